# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Layer variants of issue 38, for the layer benchmark only.

``fused-unpadded`` is the fused layer with ``sparse_mla_fp8`` at the layer's
own head count below 64 heads (the fused layer runs FlashMLA's fp8 kernel
padded to 64 heads, as vLLM 0.33.0 does); ``fused-cand`` swaps
``radix_topk`` in for vLLM's top-k plus ``canonical_topk``, which nothing that
serves uses."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

from vllm.models.kimi_k3.common.dsa_envs import SPARSE_MLA_UNPADDED_ENV

CANDIDATE_SUFFIX = "-cand"
UNPADDED_SUFFIX = "-unpadded"
LAYERS = (f"fused{UNPADDED_SUFFIX}", f"fused{CANDIDATE_SUFFIX}")


def base_kind(kind: str) -> str:
    """The layer a variant builds."""
    return kind.removesuffix(CANDIDATE_SUFFIX).removesuffix(UNPADDED_SUFFIX)


@contextlib.contextmanager
def unpadded_sparse_mla() -> Iterator[None]:
    """``sparse_mla_fp8`` below 64 heads for the duration (the switch
    restored)."""
    saved = os.environ.get(SPARSE_MLA_UNPADDED_ENV)
    os.environ[SPARSE_MLA_UNPADDED_ENV] = "1"
    try:
        yield
    finally:
        if saved is None:
            del os.environ[SPARSE_MLA_UNPADDED_ENV]
        else:
            os.environ[SPARSE_MLA_UNPADDED_ENV] = saved


@contextlib.contextmanager
def candidate_kernels() -> Iterator[None]:
    """``radix_topk`` for the duration (restored after)."""
    from vllm import _custom_ops
    from vllm.models.kimi_k3.nvidia import dsa_indexer_op
    from vllm.models.kimi_k3.nvidia.dsa_ops.radix_topk import radix_topk

    def no_topk(*args: Any, **kwargs: Any) -> None:
        return None

    saved = (
        dsa_indexer_op.get_indexer_topk,
        dsa_indexer_op.canonical_topk,
        _custom_ops.top_k_per_row_prefill,
    )
    dsa_indexer_op.get_indexer_topk = lambda backend: no_topk
    dsa_indexer_op.canonical_topk = radix_topk
    _custom_ops.top_k_per_row_prefill = no_topk
    try:
        yield
    finally:
        (
            dsa_indexer_op.get_indexer_topk,
            dsa_indexer_op.canonical_topk,
            _custom_ops.top_k_per_row_prefill,
        ) = saved


def variant(kind: str) -> contextlib.AbstractContextManager[Any]:
    """What ``kind`` changes while it is timed."""
    if kind.endswith(UNPADDED_SUFFIX):
        return unpadded_sparse_mla()
    if kind.endswith(CANDIDATE_SUFFIX):
        return candidate_kernels()
    return contextlib.nullcontext()
