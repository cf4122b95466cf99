# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
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
    """The tiny Kimi K3.1 checkpoint with the e2e query heads and top-k
    (``tiny_serving.E2E_QUERY_HEADS``: each prompt takes the path its test
    names)."""
    from tiny_serving import e2e_checkpoint_overrides

    from kimi_k3_dsa_tools.tiny_checkpoint import write_tiny_checkpoint

    return write_tiny_checkpoint(e2e_dir / "tiny-k3.1", **e2e_checkpoint_overrides())


@pytest.fixture(scope="session")
def tiny_real_attention(e2e_dir: Path) -> Path:
    """The tiny checkpoint with Kimi K3.1's real attention dimensions
    (``--real-attention``: 96 heads, 32 index heads x 128, top-k 2048)."""
    from kimi_k3_dsa_tools.tiny_checkpoint import (
        real_attention_overrides,
        write_tiny_checkpoint,
    )

    return write_tiny_checkpoint(
        e2e_dir / "tiny-k3.1-real-attention", **real_attention_overrides()
    )


ENGINE_SPECS = pytest.StashKey[dict[str, Any]]()


def report_run(report: Callable[..., None], run: Any) -> None:
    """One ``engine_run`` record: what a run was, how long it took, what its
    DSA layers ran and what it generated."""
    report(
        "engine_run",
        label=run.label,
        load_s=round(run.load_s, 1),
        first_token_s=round(run.first_token_s, 3),
        forward_paths=run.forward_paths,
        model_runner=run.model_runner,
        prompt_paths=run.prompt_paths,
        batched_paths=run.batched_paths,
        tokens=[c.tokens for c in run.completions],
        engine_kwargs=run.engine_kwargs,
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list) -> None:
    """Gather the engine runs the selected tests compare (their ``engines``
    markers, looked up in their module's ``ENGINES``), so that the session
    starts them all at once (``engine_pool``)."""
    wanted: dict[str, Any] = {}
    for item in items:
        for marker in item.iter_markers("engines"):
            table = getattr(item.module, "ENGINES", {})
            for label in marker.args:
                wanted.setdefault(label, table[label])
    config.stash[ENGINE_SPECS] = wanted


@pytest.fixture(scope="session")
def engine_pool(
    request: pytest.FixtureRequest,
    e2e_dir: Path,
    log_dir: Path,
    tiny_dsa: Path,
    report: Callable[..., None],
):
    """Every engine run of the selected tests, each in its own process
    (``engine_pool.EnginePool``), as many at once as the GPU's memory holds
    (``KIMI_K3_DSA_E2E_PARALLEL`` overrides that cap)."""
    import torch
    from engine_pool import EnginePool, engines_that_fit
    from tiny_serving import (
        ALL_PROMPTS,
        PREEMPT_PROMPTS,
        PREFIX_PROMPTS,
        SHORT_PROMPTS,
        dense_twin,
    )

    specs = request.config.stash.get(ENGINE_SPECS, {})
    checkpoints = {"dsa": tiny_dsa}
    names = {spec.checkpoint for spec in specs.values()} | {
        spec.draft for spec in specs.values() if spec.draft is not None
    }
    if "dense" in names:
        checkpoints["dense"] = dense_twin(tiny_dsa, e2e_dir / "tiny-k3-dense")
    if "dsa-multimodal" in names:
        from tiny_serving import e2e_checkpoint_overrides

        from kimi_k3_dsa_tools.tiny_checkpoint import (
            write_tiny_checkpoint,
        )

        checkpoints["dsa-multimodal"] = write_tiny_checkpoint(
            e2e_dir / "tiny-k3.1-mm", multimodal=True, **e2e_checkpoint_overrides()
        )
    for name in sorted(n for n in names if n.startswith("draft-")):
        from tiny_serving import e2e_checkpoint_overrides

        from kimi_k3_dsa_tools.tiny_drafts import write_tiny_draft

        method = name.removeprefix("draft-")
        checkpoints[name] = write_tiny_draft(
            e2e_dir / f"tiny-{method}-draft", method, **e2e_checkpoint_overrides()
        )
    work = e2e_dir / "engine_runs"
    work.mkdir(exist_ok=True)
    fit = engines_that_fit(torch.cuda.get_device_properties(0).total_memory)
    max_parallel = int(
        os.environ.get("KIMI_K3_DSA_E2E_PARALLEL", min(len(specs) or 1, fit))
    )
    pool = EnginePool(
        checkpoints,
        {
            "all": ALL_PROMPTS,
            "short": SHORT_PROMPTS,
            "prefix": PREFIX_PROMPTS,
            "preempt": PREEMPT_PROMPTS,
        },
        work,
        log_dir,
        max_parallel,
    )
    pool.submit(specs.items())
    yield pool
    pool.close()
    report("engine_pool", parallel=pool.max_parallel, timings=pool.timings())


@pytest.fixture(scope="session")
def one_gpu_runs(engine_pool, report: Callable[..., None]) -> Any:
    """The results of ``engine_pool``'s runs: ``.run(label)`` (an
    :class:`tiny_serving.EngineRun`, checked to come from Model Runner V2)
    and ``.serve(label)``."""
    from tiny_serving import V2_MODEL_RUNNER, EngineRun, ServeResult

    runs: dict[str, Any] = {}

    class Runs:
        def run(self, label: str) -> EngineRun:
            if label not in runs:
                run = EngineRun.from_json(engine_pool.result(label))
                report_run(report, run)
                # vLLM 0.33.0 runs V2 wherever Triton does: a V1 run here
                # would test a runner no GPU user gets.
                assert run.model_runner == V2_MODEL_RUNNER, (label, run.model_runner)
                runs[label] = run
            return runs[label]

        def serve(self, label: str) -> ServeResult:
            if label not in runs:
                runs[label] = ServeResult(**engine_pool.result(label))
            return runs[label]

    return Runs()


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
            report_run(report, run)
            cache[label] = run
        return cache[label]

    return get


@pytest.fixture
def report_agreement(report: Callable[..., None]) -> Callable[..., None]:
    def write(name: str, agreement: Any) -> None:
        report("agreement", name=name, **asdict(agreement))

    return write
