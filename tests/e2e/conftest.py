# SPDX-License-Identifier: Apache-2.0
"""Fixtures of the end-to-end serving tests (``-m gpu``): vLLM 0.33.0 with
this package on a CUDA GPU, serving the tiny Kimi K3.1 checkpoint.

Engine runs are cached for the session: several tests compare the same run
(the fused CUDA-graph run is the reference of most). Set
``KIMI_K3_DSA_E2E_REPORT=<file>`` to have every comparison, load time and
time to first token written there as JSON lines.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest


def _skip_reason() -> str | None:
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "needs a CUDA GPU"
    try:
        import vllm.entrypoints.llm  # noqa: F401
    except ImportError as exc:
        return f"needs vLLM 0.33.0 installed ({exc})"
    return None


@pytest.fixture(scope="session")
def e2e_ready() -> None:
    reason = _skip_reason()
    if reason is not None:
        pytest.skip(reason)


@pytest.fixture(scope="session")
def e2e_dir(tmp_path_factory: pytest.TempPathFactory, e2e_ready: None) -> Path:
    return tmp_path_factory.mktemp("kimi_k3_dsa_e2e")


@pytest.fixture(scope="session")
def log_dir(e2e_dir: Path) -> Path:
    """Where server logs go: beside the report when one is written."""
    path = os.environ.get("KIMI_K3_DSA_E2E_REPORT")
    return Path(path).parent if path else e2e_dir


@pytest.fixture(scope="session")
def tiny_dsa(e2e_dir: Path) -> Path:
    """The tiny Kimi K3.1 checkpoint with the generator's defaults."""
    from vllm.models.kimi_k3.common.dsa_tiny_checkpoint import write_tiny_checkpoint

    return write_tiny_checkpoint(e2e_dir / "tiny-k3.1")


@pytest.fixture(scope="session")
def tiny_real_attention(e2e_dir: Path) -> Path:
    """The tiny checkpoint with Kimi K3.1's real attention dimensions
    (``--real-attention``: 96 heads, 32 index heads x 128, top-k 2048)."""
    from vllm.models.kimi_k3.common.dsa_tiny_checkpoint import (
        real_attention_overrides,
        write_tiny_checkpoint,
    )

    return write_tiny_checkpoint(
        e2e_dir / "tiny-k3.1-real-attention", **real_attention_overrides()
    )


@pytest.fixture(scope="session")
def report() -> Callable[..., None]:
    """Append one JSON record to ``$KIMI_K3_DSA_E2E_REPORT`` (if set)."""
    path = os.environ.get("KIMI_K3_DSA_E2E_REPORT")

    def write(kind: str, **record: Any) -> None:
        if not path:
            return
        with open(path, "a") as f:
            f.write(json.dumps({"kind": kind, **record}, default=str) + "\n")

    return write


@pytest.fixture(scope="session")
def engine_runs(report: Callable[..., None]) -> Callable[..., Any]:
    """``engine_runs(label, model, prompts, env=..., **engine_kwargs)``: the
    cached :class:`tiny_serving.EngineRun` of that configuration."""
    from tiny_serving import run_llm

    cache: dict[str, Any] = {}

    def get(label: str, model: Path, prompt_ids: list[list[int]], **kwargs: Any):
        if label not in cache:
            run = run_llm(label, model, prompt_ids, **kwargs)
            report(
                "engine_run",
                label=run.label,
                load_s=round(run.load_s, 1),
                first_token_s=round(run.first_token_s, 3),
                forward_paths=run.forward_paths,
                tokens=[c.tokens for c in run.completions],
                engine_kwargs=run.engine_kwargs,
            )
            cache[label] = run
        return cache[label]

    return get


@pytest.fixture
def report_agreement(report: Callable[..., None]) -> Callable[..., None]:
    def write(name: str, agreement: Any) -> None:
        report("agreement", name=name, **asdict(agreement))

    return write
