# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The host CPU the CPU suite reports to vLLM (see tests/conftest.py)."""

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


def pin_cpu_isa() -> None:
    """Replace torch.cpu's ISA probes by the pinned answers, process-wide."""
    for name, answer in PINNED_CPU_ISA.items():
        setattr(torch.cpu, name, lambda answer=answer: answer)
