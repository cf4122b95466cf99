# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The layer benchmark's issue-38 variants on the CPU: ``fused-cand``'s swaps
(made and undone) and ``fused-unpadded``'s switch (set and restored). Their
timing needs a GPU."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

_ROOT = next(
    p for p in Path(__file__).resolve().parents if (p / "benchmarks" / "layer").is_dir()
)
sys.path.insert(0, str(_ROOT / "benchmarks" / "layer"))
import candidate_kernels as C  # noqa: E402

from vllm.models.kimi_k3.common.dsa_envs import (  # noqa: E402
    SPARSE_MLA_UNPADDED_ENV,
    sparse_mla_unpadded,
)


def test_the_swaps_are_made_and_undone() -> None:
    from vllm import _custom_ops
    from vllm.models.kimi_k3.nvidia import dsa_indexer_op
    from vllm.models.kimi_k3.nvidia.dsa_ops.radix_topk import radix_topk

    before = (
        dsa_indexer_op.get_indexer_topk,
        dsa_indexer_op.canonical_topk,
        _custom_ops.top_k_per_row_prefill,
    )
    with C.variant("fused-cand"):
        assert dsa_indexer_op.canonical_topk is radix_topk
        assert dsa_indexer_op.get_indexer_topk("any")() is None
        assert _custom_ops.top_k_per_row_prefill() is None
    after = (
        dsa_indexer_op.get_indexer_topk,
        dsa_indexer_op.canonical_topk,
        _custom_ops.top_k_per_row_prefill,
    )
    assert after == before
    assert [C.base_kind(k) for k in C.LAYERS] == ["fused", "fused"]


@pytest.mark.parametrize("before", [None, "0"])
def test_unpadded_variant_sets_and_restores_the_switch(before, monkeypatch) -> None:
    if before is None:
        monkeypatch.delenv(SPARSE_MLA_UNPADDED_ENV, raising=False)
    else:
        monkeypatch.setenv(SPARSE_MLA_UNPADDED_ENV, before)
    assert not sparse_mla_unpadded()
    with C.variant("fused-unpadded"):
        assert sparse_mla_unpadded()
    assert os.environ.get(SPARSE_MLA_UNPADDED_ENV) == before
    assert not sparse_mla_unpadded()
