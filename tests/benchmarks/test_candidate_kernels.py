# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The layer benchmark's ``fused-cand`` kind on the CPU: the swaps it makes
(and undoes), and the sparse MLA stand-in's shapes against FlashMLA's
``_fp8_flash_mla_kernel`` contract. Its timing needs a GPU."""

from __future__ import annotations

import inspect
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

_ROOT = next(
    p for p in Path(__file__).resolve().parents if (p / "benchmarks" / "layer").is_dir()
)
sys.path.insert(0, str(_ROOT / "benchmarks" / "layer"))
import candidate_kernels as C  # noqa: E402

from vllm.models.kimi_k3.nvidia.dsa_ops.formats import fp8_ds_mla_entry  # noqa: E402
from vllm.models.kimi_k3.nvidia.dsa_ops.sparse_mla import (  # noqa: E402
    sparse_mla_fp8_reference,
)


def test_the_swaps_are_made_and_undone() -> None:
    from vllm import _custom_ops
    from vllm.models.kimi_k3.nvidia import dsa_indexer_op
    from vllm.models.kimi_k3.nvidia.dsa_ops.radix_topk import radix_topk
    from vllm.v1.attention.backends.mla.flashmla_sparse import FlashMLASparseImpl

    before = (
        FlashMLASparseImpl._fp8_flash_mla_kernel,
        dsa_indexer_op.get_indexer_topk,
        dsa_indexer_op.canonical_topk,
        _custom_ops.top_k_per_row_prefill,
    )
    # The stand-in takes the names vLLM passes (it calls with keywords).
    names = list(inspect.signature(FlashMLASparseImpl._fp8_flash_mla_kernel).parameters)
    assert list(inspect.signature(C._sparse_mla).parameters) == names
    with C.candidate_kernels():
        assert FlashMLASparseImpl._fp8_flash_mla_kernel is C._sparse_mla
        assert dsa_indexer_op.canonical_topk is radix_topk
        assert dsa_indexer_op.get_indexer_topk("any")() is None
        assert _custom_ops.top_k_per_row_prefill() is None
    after = (
        FlashMLASparseImpl._fp8_flash_mla_kernel,
        dsa_indexer_op.get_indexer_topk,
        dsa_indexer_op.canonical_topk,
        _custom_ops.top_k_per_row_prefill,
    )
    assert after == before
    assert C.base_kind("fused-cand") == "fused"


def test_sparse_mla_stand_in_keeps_flashmlas_shapes() -> None:
    g = torch.Generator().manual_seed(0)
    entries = fp8_ds_mla_entry(
        torch.randn(256, 512, generator=g), torch.randn(256, 64, generator=g)
    )
    pages = entries.view(4, 64, 656)
    q = torch.randn(2, 3, 12, 576, generator=g).bfloat16()  # [B, S, H, D]
    topk = torch.randint(-1, 256, (2, 3, 40), generator=g, dtype=torch.int32)
    impl = SimpleNamespace(softmax_scale=0.07)
    # vLLM calls it with keywords.
    out, lse = C._sparse_mla(
        impl, q=q, kv_c_and_k_pe_cache=pages, topk_indices=topk, kernel_metadata=None
    )
    assert out.shape == (2, 3, 12, 512) and lse.shape == (2, 12, 3)
    ref_out, ref_lse = sparse_mla_fp8_reference(
        q.reshape(6, 12, 576), pages, topk.reshape(6, 40), 0.07
    )
    assert torch.equal(out.reshape(6, 12, 512), ref_out)
    assert torch.equal(lse.transpose(1, 2).reshape(6, 12), ref_lse)
