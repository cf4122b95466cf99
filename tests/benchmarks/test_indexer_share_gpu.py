# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The indexer's rows shared across TP ranks select the replicated indexer's
top-k, through our scoring op: vLLM 0.33.0's prefill row shard (on once a
step prefills ``attention_config.indexer_tp_shard_min_rows`` rows) and our
decode request share (``VLLM_KIMI_K3_DSA_INDEXER_DECODE_SHARD=1``). One fused
DSA layer on one GPU (the layer benchmark's setup: vLLM's builders, caches
and the layer): the step scored once with every row, then once per rank of
TP 2 and TP 8 with that rank's rows, the all-gather replaced by what it
computes (each rank's rows put in place). The canonical top-k makes the rows
comparable bit for bit."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest
import torch

_ROOT = next(
    p for p in Path(__file__).resolve().parents if (p / "benchmarks" / "layer").is_dir()
)
sys.path.insert(0, str(_ROOT / "benchmarks" / "layer"))
import bench_dsa_layer as B  # noqa: E402
import dsa_layer_setup as S  # noqa: E402
import indexer_share as I  # noqa: E402

pytestmark = pytest.mark.gpu

HEADS = 12
# A chunk longer than the top-k after a cached context: rows of every length.
SPEC = S.Spec("prefill", 1, 3000, 2048)
# Decode requests whose contexts are longer than the top-k.
DECODE = S.Spec("decode", 19, 5000, 1)


@pytest.fixture(scope="module")
def layer_config():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (DeepGEMM logits, FlashMLA sparse)")
    from vllm.models.kimi_k3.nvidia.dsa_ops import _extension

    reason = _extension.unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    args = argparse.Namespace(
        contexts=[SPEC.context, DECODE.context],
        decode_batches=[DECODE.batch],
        prefill_chunks=[SPEC.tokens],
    )
    cfg = S.make_vllm_config("fused", HEADS, B.HIDDEN, *B.config_sizes(args))
    B.init_runtime(cfg, torch.device("cuda"))
    yield cfg
    S.release(cfg)


def _step_topk(bench: S.LayerBench) -> torch.Tensor:
    S.under_env("fused", B.forward, bench, False)
    torch.cuda.synchronize()
    buffer = bench.layer.topk_indices_buffer
    return buffer[: bench.spec.num_tokens].clone()


@pytest.mark.parametrize("tp", [2, 8])
def test_rank_shares_select_the_replicated_topk(layer_config, monkeypatch, tp):
    from vllm.model_executor.layers import sparse_attn_indexer as upstream

    bench = S.setup("fused", SPEC, layer_config, torch.device("cuda"))
    assert bench.layer._packed is not None, "the fused layer did not pack"
    want = _step_topk(bench)
    assert (want[:, 0] >= 0).all(), "a row selected nothing"
    sizes = I.share_prefill_rows(bench, tp)
    assert sizes is not None and len(sizes) == tp
    gathered = torch.full_like(want, -2)
    scored: list[tuple[int, int]] = []

    def exchange_topk(self, topk_buffer, width):
        rows = slice(self.start, self.stop)
        gathered[rows, :width] = topk_buffer[rows, :width]
        scored.append((self.start, self.stop))

    monkeypatch.setattr(upstream.PrefillRowShard, "exchange_topk", exchange_topk)
    for rank in range(tp):
        monkeypatch.setattr(
            upstream, "get_tensor_model_parallel_rank", lambda r=rank: r
        )
        bench.layer.topk_indices_buffer.fill_(-3)
        _step_topk(bench)
    torch.cuda.synchronize()
    starts = [sum(sizes[:r]) for r in range(tp)]
    assert scored == [(s, s + n) for s, n in zip(starts, sizes, strict=True)]
    assert torch.equal(gathered, want)


@pytest.mark.parametrize("tp", [2, 8])
def test_rank_shares_of_the_decode_requests_select_the_replicated_topk(
    layer_config, monkeypatch, tp
):
    from vllm.models.kimi_k3.common.dsa_envs import INDEXER_DECODE_SHARD_ENV
    from vllm.models.kimi_k3.nvidia import dsa_indexer_op as OP

    bench = S.setup("fused", DECODE, layer_config, torch.device("cuda"))
    assert bench.layer._packed is not None, "the fused layer did not pack"
    want = _step_topk(bench)
    assert (want[:, 0] >= 0).all(), "a row selected nothing"
    monkeypatch.setenv(INDEXER_DECODE_SHARD_ENV, "1")
    OP.decode_share_enabled.cache_clear()  # read once a process
    monkeypatch.setattr(OP, "get_tensor_model_parallel_world_size", lambda: tp)
    gathered = torch.full_like(want, -2)
    shares: list[tuple[int, int]] = []

    def gather_decode_topk(local, sizes):
        rank = len(shares)
        start = sum(sizes[:rank])
        shares.append((start, start + sizes[rank]))
        gathered[start : start + sizes[rank], : local.shape[1]] = local
        return gathered[: sum(sizes), : local.shape[1]]

    monkeypatch.setattr(OP, "gather_decode_topk", gather_decode_topk)
    for rank in range(tp):
        monkeypatch.setattr(OP, "get_tensor_model_parallel_rank", lambda r=rank: r)
        bench.layer.topk_indices_buffer.fill_(-3)
        _step_topk(bench)
    torch.cuda.synchronize()
    OP.decode_share_enabled.cache_clear()
    assert len(shares) == tp and shares[-1][1] == DECODE.batch
    assert torch.equal(gathered, want)
