# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The fused layer with the kernels issue 38 proposes, for the layer
benchmark only: ``sparse_mla_fp8`` in place of FlashMLA's padded fp8 sparse
kernel, and ``radix_topk`` in place of vLLM's top-k plus ``canonical_topk``.
Nothing that serves uses either yet; this measures what wiring them in would
give, on the same layer, metadata and caches."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

CANDIDATE_SUFFIX = "-cand"


def base_kind(kind: str) -> str:
    """The layer a ``-cand`` kind builds."""
    return kind.removesuffix(CANDIDATE_SUFFIX)


def _sparse_mla(
    self: Any,
    q: Any,
    kv_c_and_k_pe_cache: Any,
    topk_indices: Any,
    kernel_metadata: Any = None,
):
    """FlashMLA's ``_fp8_flash_mla_kernel`` (its names: vLLM calls it with
    keywords): q [B, S, H, 576], the cache's 64-token pages, topk [B, S, k]
    slots -> out [B, S, H, 512], lse [B, H, S]."""
    import torch

    from vllm.models.kimi_k3.nvidia.dsa_ops.sparse_mla import sparse_mla_fp8

    batch, steps, heads, dim = q.shape
    out, lse = sparse_mla_fp8(
        q.reshape(batch * steps, heads, dim),
        kv_c_and_k_pe_cache.view(torch.uint8),
        topk_indices.reshape(batch * steps, -1).to(torch.int32),
        self.softmax_scale,
    )
    out = out.view(batch, steps, heads, -1)
    return out, lse.view(batch, steps, heads).transpose(1, 2)


@contextlib.contextmanager
def candidate_kernels() -> Iterator[None]:
    """Both swaps for the duration (restored after)."""
    from vllm import _custom_ops
    from vllm.models.kimi_k3.nvidia import dsa_indexer_op
    from vllm.models.kimi_k3.nvidia.dsa_ops.radix_topk import radix_topk
    from vllm.v1.attention.backends.mla.flashmla_sparse import FlashMLASparseImpl

    def no_topk(*args: Any, **kwargs: Any) -> None:
        return None

    saved = (
        FlashMLASparseImpl._fp8_flash_mla_kernel,
        dsa_indexer_op.get_indexer_topk,
        dsa_indexer_op.canonical_topk,
        _custom_ops.top_k_per_row_prefill,
    )
    FlashMLASparseImpl._fp8_flash_mla_kernel = _sparse_mla
    dsa_indexer_op.get_indexer_topk = lambda backend: no_topk
    dsa_indexer_op.canonical_topk = radix_topk
    _custom_ops.top_k_per_row_prefill = no_topk
    try:
        yield
    finally:
        (
            FlashMLASparseImpl._fp8_flash_mla_kernel,
            dsa_indexer_op.get_indexer_topk,
            dsa_indexer_op.canonical_topk,
            _custom_ops.top_k_per_row_prefill,
        ) = saved
