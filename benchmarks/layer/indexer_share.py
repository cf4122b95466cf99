# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""One TP rank's share of the indexer on one GPU, for the layer benchmark.

vLLM 0.33.0 shards the indexer's prefill rows across TP ranks when a step
prefills at least ``attention_config.indexer_tp_shard_min_rows`` rows
(``balanced_prefill_row_shard``: contiguous rows of equal MQA cost); each rank
scores its rows and one ``all_gatherv`` of the int32 top-k rows follows.
Decode rows stay replicated. Here rank 0's share is scored, and the gather
is stood in for by a device copy of the bytes it would deliver: every
rank's rows, filled from rank 0's (valid indices for every later row, since
rank 0 holds the first rows).
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


@contextlib.contextmanager
def stand_in_row_exchange() -> Iterator[list[int]]:
    """Replace the top-k all-gather by a device copy of its output bytes;
    yields the list the stand-in appends each exchanged row count to."""
    from vllm.model_executor.layers import sparse_attn_indexer as upstream

    shard = upstream.PrefillRowShard
    original = shard.exchange_topk
    exchanged: list[int] = []

    def exchange_topk(self: Any, topk_buffer: Any, width: int) -> None:
        local = topk_buffer[self.start : self.stop, :width]
        total = sum(self.sizes)
        repeats = -(-total // local.shape[0])
        start = self.num_decode_tokens
        topk_buffer[start : start + total, :width] = local.repeat(repeats, 1)[:total]
        exchanged.append(total)

    shard.exchange_topk = exchange_topk
    try:
        yield exchanged
    finally:
        shard.exchange_topk = original
