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

vLLM's CPU code then branches on the host's CPU (the CPU platform's MLA
backend, block size, prefix caching and SSM state dtype; the unquantized GEMM
dispatch, whose AMX branch needs ops that only vLLM's CPU build has). The CPU
suite answers every such probe as one x86-64 host with AMX and AVX-512 BF16,
where vLLM's CPU MLA keeps prefix caching and chunked prefill on as a GPU
does, so that the suite takes the same branches on every machine.
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

if os.environ.get("VLLM_TARGET_DEVICE") == "cpu":
    # Before vLLM imports: its platform import reads the probes.
    from cpu_host import pin_cpu_isa

    pin_cpu_isa()

from collections.abc import Callable, Iterator  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import pytest  # noqa: E402


def _has_vllm() -> bool:
    try:
        import vllm.config  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.fixture(autouse=True, scope="session")
def _pin_cpu_architecture() -> Iterator[None]:
    """vLLM's CPU platform reads the architecture from ``platform.machine``;
    the CPU suite answers x86-64 with the ISA pinned above."""
    if os.environ.get("VLLM_TARGET_DEVICE") != "cpu" or not _has_vllm():
        yield
        return
    from vllm.platforms.interface import CpuArchEnum, Platform

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(
            Platform, "get_cpu_architecture", classmethod(lambda cls: CpuArchEnum.X86)
        )
        yield


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
