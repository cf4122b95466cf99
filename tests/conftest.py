# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Shared fixtures of the CPU suite, run against the real vLLM 0.33.0 install.

On a machine without a GPU, vLLM's ``current_platform`` is
``UnspecifiedPlatform``, which cannot build a ``DeviceConfig``. With
``VLLM_TARGET_DEVICE=cpu`` it is ``CpuPlatform``, and
``EngineArgs(...).create_engine_config()`` runs the whole configuration path a
user's ``vllm serve`` takes (HF config parsing, the model verifiers, the
general plugins). Set before anything imports vLLM, and only where no CUDA
device is visible.
"""

import os


def _cuda_device_present() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


# The GPU suites (tests/kernels, tests/e2e) run on the CUDA platform.
if "VLLM_TARGET_DEVICE" not in os.environ and not _cuda_device_present():
    os.environ["VLLM_TARGET_DEVICE"] = "cpu"

from collections.abc import Callable  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import pytest  # noqa: E402


def _has_vllm() -> bool:
    try:
        import vllm.config  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.fixture
def tiny_checkpoint(tmp_path: Path) -> Callable[..., Path]:
    """Write a tiny Kimi K3.1 config.json; keyword overrides replace top-level
    text-config keys (``dsa=False`` writes plain Kimi K3)."""
    from kimi_k3_dsa_tools.tiny_checkpoint import write_tiny_config

    counter = iter(range(1_000_000))

    def make(dsa: bool = True, **overrides: Any) -> Path:
        return write_tiny_config(
            tmp_path / f"ckpt{next(counter)}", dsa=dsa, **overrides
        )

    return make


@pytest.fixture
def engine_config() -> Callable[..., Any]:
    """Run vLLM's real configuration path on a checkpoint directory:
    ``engine_config(path, kv_cache_dtype="fp8", attention_config={...})``."""
    if not _has_vllm():
        pytest.skip("vLLM 0.33.0 is not installed")
    from engine_configs import create_engine_config

    return create_engine_config


class LogRecorder:
    """Stands in for a module's ``logger``: records every message by level."""

    def __init__(self) -> None:
        self.records: list[tuple[str, str]] = []

    def __getattr__(self, level: str):
        def log(msg: str, *args: Any, **kwargs: Any) -> None:
            self.records.append((level, msg % args if args else msg))

        return log

    def messages(self, level: str) -> list[str]:
        return [msg for lvl, msg in self.records if lvl == level]


@pytest.fixture
def record_logs(monkeypatch: pytest.MonkeyPatch) -> Callable[[Any], LogRecorder]:
    """``record_logs(*modules)``: replace each module's ``logger`` with one
    recorder for the test and return it."""

    def attach(*modules: Any) -> LogRecorder:
        recorder = LogRecorder()
        for module in modules:
            monkeypatch.setattr(module, "logger", recorder)
        return recorder

    return attach
