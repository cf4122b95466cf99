# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The CPU suite answers vLLM's host probes as one pinned host (tests/conftest.py),
so that a config test takes the same branches on every machine CI lands on."""

import os

import pytest
import torch
from cpu_host import PINNED_CPU_ISA, REAL_CPU_ISA_PROBES

pytestmark = pytest.mark.skipif(
    os.environ.get("VLLM_TARGET_DEVICE") != "cpu", reason="CPU platform only"
)


def test_isa_probes_answer_the_pinned_host() -> None:
    assert {name: getattr(torch.cpu, name)() for name in PINNED_CPU_ISA} == (
        PINNED_CPU_ISA
    )


def test_inductor_compiles_for_the_real_host() -> None:
    """Inductor's CPU kernels target the ISA the host has, not the pinned one:
    AVX-512 code dies of SIGILL on an AVX2-only host."""
    from torch._inductor import cpu_vec_isa

    real = {name: probe() for name, probe in REAL_CPU_ISA_PROBES.items()}
    assert real.keys() == PINNED_CPU_ISA.keys()
    isa_flags = {
        "avx2": real["_is_avx2_supported"],
        "avx512": real["_is_avx512_supported"],
        "avx512_vnni": real["_is_avx512_supported"] and real["_is_vnni_supported"],
        "amx_tile": real["_is_amx_tile_supported"],
    }
    for isa in cpu_vec_isa.valid_vec_isa_list():
        assert all(isa_flags.get(flag, True) for flag in str(isa).split()), isa
    # The pin still holds outside the ISA pick.
    assert torch.cpu._is_avx512_supported() is True


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
