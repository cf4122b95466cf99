# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""One TP rank's share of the indexer on one GPU, for the layer benchmark.

vLLM 0.33.0 shards the indexer's prefill rows across TP ranks when a step
prefills at least ``attention_config.indexer_tp_shard_min_rows`` rows
(``balanced_prefill_row_shard``: contiguous rows of equal MQA cost); each rank
scores its rows and one ``all_gatherv`` of the int32 top-k rows follows.
Decode rows are shared the same way by request with
``VLLM_KIMI_K3_DSA_INDEXER_DECODE_SHARD=1`` (``dsa_indexer_op``). Here rank
0's share is scored, and the gather is stood in for by a device copy of the
bytes it would deliver: every rank's rows, filled from rank 0's (valid
indices for every later row, since rank 0 holds the first rows).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

SHARED_SUFFIX = "-shared"


def base_kind(kind: str) -> str:
    """The layer a ``-shared`` kind builds."""
    return kind.removesuffix(SHARED_SUFFIX)


def share_prefill_rows(bench: Any, tp: int) -> list[int] | None:
    """Give every indexer prefill metadata of ``bench`` the row shard the
    builder makes at TP ``tp`` once sharding is on; returns the row counts
    (None for a step with no prefill rows)."""
    import torch

    from vllm.v1.attention.backends.mla.indexer import (
        DeepseekV32IndexerPrefillMetadata,
        balanced_prefill_row_shard,
    )

    common = bench.common
    query_lens = torch.diff(common.query_start_loc_cpu)
    prefills = [
        m
        for m in bench.attn_metadata.values()
        if isinstance(getattr(m, "prefill", None), DeepseekV32IndexerPrefillMetadata)
    ]
    if bench.spec.mode == "prefill" and not prefills:
        raise RuntimeError("no indexer prefill metadata to share the rows of")
    sizes = None
    for metadata in prefills:
        first = metadata.num_decodes
        sizes = balanced_prefill_row_shard(
            common.seq_lens_cpu_upper_bound[first:],
            query_lens[first:],
            1,
            tp,
            min_rows=tp,
        )
        metadata.prefill.row_shard_sizes = sizes
    return sizes


def _tiled(local: Any, total: int) -> Any:
    """``total`` rows cut from copies of ``local``: the gather's bytes."""
    return local.repeat(-(-total // local.shape[0]), 1)[:total]


@contextlib.contextmanager
def stand_in_row_exchange(tp: int = 8) -> Iterator[list[int]]:
    """Replace the prefill and decode top-k all-gathers by device copies of
    their output bytes, rank 0 of ``tp`` scoring its share of the decode
    requests; yields the list each exchanged row count is appended to."""
    from vllm.model_executor.layers import sparse_attn_indexer as upstream
    from vllm.models.kimi_k3.nvidia import dsa_indexer_op

    shard = upstream.PrefillRowShard
    original = shard.exchange_topk
    originals = (
        dsa_indexer_op.decode_request_share,
        dsa_indexer_op.gather_decode_topk,
    )
    exchanged: list[int] = []

    def decode_request_share(num_requests: int) -> Any:
        if num_requests < tp:
            return None
        sizes = dsa_indexer_op.decode_request_sizes(num_requests, tp)
        return 0, sizes[0], sizes

    def gather_decode_topk(local: Any, sizes: list[int]) -> Any:
        exchanged.append(sum(sizes))
        return _tiled(local, sum(sizes))

    def exchange_topk(self: Any, topk_buffer: Any, width: int) -> None:
        local = topk_buffer[self.start : self.stop, :width]
        total = sum(self.sizes)
        start = self.num_decode_tokens
        topk_buffer[start : start + total, :width] = _tiled(local, total)
        exchanged.append(total)

    shard.exchange_topk = exchange_topk
    dsa_indexer_op.decode_request_share = decode_request_share
    dsa_indexer_op.gather_decode_topk = gather_decode_topk
    try:
        yield exchanged
    finally:
        shard.exchange_topk = original
        (
            dsa_indexer_op.decode_request_share,
            dsa_indexer_op.gather_decode_topk,
        ) = originals
