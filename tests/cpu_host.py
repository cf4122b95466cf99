# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The host CPU the CPU suite reports to vLLM (see tests/conftest.py)."""

import functools
from collections.abc import Callable

import torch

# torch.cpu's ISA probes as an x86-64 host with AMX and AVX-512 BF16 answers.
PINNED_CPU_ISA = {
    "_is_amx_tile_supported": True,
    "_is_amx_fp16_supported": False,
    "_is_avx512_supported": True,
    "_is_avx512_bf16_supported": True,
    "_is_avx2_supported": True,
    "_is_vnni_supported": True,
}

# The host's own probes, for code that must not run pinned.
REAL_CPU_ISA_PROBES: dict[str, Callable[[], bool]] = {}


def _with_real_probes(fn: Callable) -> Callable:
    """``fn`` run against the host's own probes: Inductor compiles its CPU
    kernels for the ISA they report, and code built for a pinned AVX-512 or
    AMX dies of SIGILL on a host without it."""

    @functools.wraps(fn)
    def call(*args, **kwargs):
        pinned = {name: getattr(torch.cpu, name) for name in REAL_CPU_ISA_PROBES}
        for name, probe in REAL_CPU_ISA_PROBES.items():
            setattr(torch.cpu, name, probe)
        try:
            return fn(*args, **kwargs)
        finally:
            for name, probe in pinned.items():
                setattr(torch.cpu, name, probe)

    return call


def pin_cpu_isa() -> None:
    """Replace torch.cpu's ISA probes by the pinned answers, process-wide,
    except where Inductor picks the ISA its kernels are compiled for."""
    from torch._inductor import cpu_vec_isa

    if not REAL_CPU_ISA_PROBES:
        REAL_CPU_ISA_PROBES.update(
            (name, getattr(torch.cpu, name)) for name in PINNED_CPU_ISA
        )
        cpu_vec_isa.valid_vec_isa_list = _with_real_probes(
            cpu_vec_isa.valid_vec_isa_list
        )
    for name, answer in PINNED_CPU_ISA.items():
        setattr(torch.cpu, name, lambda answer=answer: answer)
