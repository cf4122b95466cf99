# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The CPU suite answers vLLM's host probes as one pinned host (tests/conftest.py),
so that a config test takes the same branches on every machine CI lands on."""

import os

import pytest
import torch
from cpu_host import PINNED_CPU_ISA

pytestmark = pytest.mark.skipif(
    os.environ.get("VLLM_TARGET_DEVICE") != "cpu", reason="CPU platform only"
)


def test_isa_probes_answer_the_pinned_host() -> None:
    assert {name: getattr(torch.cpu, name)() for name in PINNED_CPU_ISA} == (
        PINNED_CPU_ISA
    )


def test_cpu_platform_sees_an_x86_host() -> None:
    from vllm.platforms.interface import CpuArchEnum, Platform

    assert Platform.get_cpu_architecture() == CpuArchEnum.X86


def test_mla_config_keeps_vllm_defaults(tiny_checkpoint, engine_config) -> None:
    """On the pinned host vLLM's CPU platform keeps an MLA model's chunked
    prefill and prefix caching, as the CUDA platform does; on a host without
    AMX it would turn both off."""
    cfg = engine_config(
        tiny_checkpoint(), enable_prefix_caching=True, max_num_batched_tokens=512
    )
    assert cfg.cache_config.enable_prefix_caching
    assert cfg.scheduler_config.enable_chunked_prefill
    assert cfg.scheduler_config.max_num_batched_tokens == 512
