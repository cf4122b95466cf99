# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The ``num_stages`` probe of ``sparse_mla_fp8`` on the CPU: it forces its
stage count on every launch and puts the shipped kernel back. A development
probe, kept out of the upstream series; the timing needs a GPU
(``tools/gpu/run.py``, suite ``sparse-mla-stages``)."""

from __future__ import annotations

import sys
from pathlib import Path

_ROOT = next(
    p
    for p in Path(__file__).resolve().parents
    if (p / "benchmarks" / "kernels").is_dir()
)
sys.path.insert(0, str(_ROOT / "benchmarks" / "kernels"))
import probe_sparse_mla_stages as P  # noqa: E402


def test_the_stage_probe_forces_num_stages_and_restores_the_kernel() -> None:
    """The probe's launches carry its ``num_stages``, and the split kernel
    is the shipped one again after the probe."""
    from vllm.models.kimi_k3.nvidia.dsa_ops import sparse_mla

    shipped = sparse_mla._sparse_mla_split_kernel
    launches = []

    class Kernel:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: launches.append((grid, args, kwargs))

    sparse_mla._sparse_mla_split_kernel = Kernel()
    try:
        with P.forced_stages(5):
            sparse_mla._sparse_mla_split_kernel[(2, 1)](7, num_warps=8)
        assert launches == [((2, 1), (7,), {"num_stages": 5, "num_warps": 8})]
        assert isinstance(sparse_mla._sparse_mla_split_kernel, Kernel)
    finally:
        sparse_mla._sparse_mla_split_kernel = shipped
    assert set(P.SHAPES) <= set(sparse_mla.TILE_CANDIDATES)
