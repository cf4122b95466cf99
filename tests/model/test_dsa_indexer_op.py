# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The Kimi K3.1 indexer op (``dsa_indexer_op``) on the CPU: every row it
scores, prefill chunks and decode rows alike, leaves in canonical form
whatever tie choice and order the top-k kernel made, and piecewise CUDA
graphs split at it.

Real: the op's Python steps, vLLM's indexer metadata classes, its forward
context and workspace shapes, ``canonical_topk`` (its torch path). Stubbed,
because they are CUDA kernels: DeepGEMM's logits (they return a table of
scores with many ties), vLLM's top-k kernels (a correct top-k whose ties and
order are shuffled, as their atomics do), the key gather and the workspace
buffers' allocation.
"""

from __future__ import annotations

import types

import pytest
import torch

from vllm.models.kimi_k3.nvidia import dsa_indexer_op as OP
from vllm.models.kimi_k3.nvidia.dsa_ops.torch_path import canonical_topk_rows

PREFIX = "model.layers.3.self_attn.dsa_indexer.k_cache"
TOPK = 8


def shuffled_topk(logits: torch.Tensor, row_lens: torch.Tensor, out, gen) -> None:
    """A correct top-k per row with ties and order left to chance."""
    out.fill_(-1)
    for r, n in enumerate(row_lens.tolist()):
        perm = torch.randperm(n, generator=gen)
        by_score = torch.sort(logits[r, perm], descending=True, stable=True).indices
        kept = perm[by_score[:TOPK]]
        kept = kept[torch.randperm(kept.numel(), generator=gen)]
        out[r, : kept.numel()] = kept.to(torch.int32)


class Kernels:
    """The CUDA kernels the op calls, as CPU stand-ins over one score table
    per call (rows in call order)."""

    def __init__(self, tables: list[torch.Tensor], seed: int) -> None:
        self.tables = list(tables)
        self.gen = torch.Generator().manual_seed(seed)
        self.prefill_calls: list[tuple[int, list[int]]] = []

    def mqa_logits(self, q, k, weights, ks, ke, max_seqlen_k):
        table = self.tables.pop(0)
        assert table.shape[0] == q[0].shape[0]
        return table

    def paged_logits(self, q, kv_cache, weights, seq_lens, *args, **kwargs):
        return self.tables.pop(0)

    def top_k_per_row_prefill(self, logits, starts, ends, out, rows, s0, s1, k):
        assert k == TOPK and not starts.any()
        self.prefill_calls.append((rows, ends.tolist()))
        shuffled_topk(logits, ends, out, self.gen)

    def decode_topk(self, backend):
        def run(logits, seq_lens, next_n, out, k, max_seq_len):
            assert next_n == 1 and k == TOPK
            shuffled_topk(logits, seq_lens.reshape(-1), out, self.gen)

        return run


@pytest.fixture
def kernels(monkeypatch: pytest.MonkeyPatch):
    def install(tables: list[torch.Tensor], seed: int) -> Kernels:
        k = Kernels(tables, seed)
        monkeypatch.setattr(
            OP,
            "ops",
            types.SimpleNamespace(
                cp_gather_indexer_k_quant_cache=lambda *a: None,
                top_k_per_row_prefill=k.top_k_per_row_prefill,
            ),
        )
        monkeypatch.setattr(OP, "fp8_fp4_mqa_logits", k.mqa_logits)
        monkeypatch.setattr(OP, "fp8_fp4_paged_mqa_logits", k.paged_logits)
        monkeypatch.setattr(OP, "mqa_logits_mx_inputs", lambda q, s, w: (s, w))
        monkeypatch.setattr(OP, "mqa_logits_use_mx_scales", lambda: False)
        monkeypatch.setattr(OP, "get_indexer_topk", k.decode_topk)

        class Workspace:
            def get_simultaneous(self, *specs):
                return [torch.empty(shape, dtype=dtype) for shape, dtype in specs]

        monkeypatch.setattr(OP, "current_workspace_manager", Workspace)
        return k

    return install


def tie_heavy(rows: int, cols: int, seed: int) -> torch.Tensor:
    """Scores from a few values, as equal keys give."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 4, (rows, cols), generator=g).float()


def step_metadata(prefill_rows: list[int], decode_lens: list[int]):
    """Indexer metadata of a step: decodes first (one token each, context
    ``decode_lens``), then one prefill chunk whose row ``i`` scores its
    first ``prefill_rows[i]`` keys."""
    from vllm.v1.attention.backends.mla.indexer import (
        DeepSeekV32IndexerDecodeMetadata,
        DeepseekV32IndexerMetadata,
        DeepseekV32IndexerPrefillChunkMetadata,
        DeepseekV32IndexerPrefillMetadata,
    )

    num_decodes = len(decode_lens)
    num_tokens = num_decodes + len(prefill_rows)
    decode = None
    if num_decodes:
        decode = DeepSeekV32IndexerDecodeMetadata(
            block_table=torch.zeros(num_decodes, 1, dtype=torch.int32),
            seq_lens=torch.tensor(decode_lens, dtype=torch.int32).view(-1, 1),
            decode_lens=torch.ones(num_decodes, dtype=torch.int32),
            requires_padding=False,
            schedule_metadata=torch.zeros(1, dtype=torch.int32),
        )
    prefill = None
    if prefill_rows:
        ke = torch.tensor(prefill_rows, dtype=torch.int32)
        chunk = DeepseekV32IndexerPrefillChunkMetadata(
            block_table=torch.zeros(1, 1, dtype=torch.int32),
            cu_seqlen_ks=torch.zeros_like(ke),
            cu_seqlen_ke=ke,
            cu_seq_lens=torch.tensor([0, max(prefill_rows)], dtype=torch.int32),
            token_to_seq=torch.zeros(len(prefill_rows), dtype=torch.int32),
            total_seq_lens=max(prefill_rows),
            max_seqlen_k=max(prefill_rows),
            token_start=num_decodes,
            token_end=num_tokens,
            num_reqs=1,
            local_cu_seq_lens=torch.tensor([0, max(prefill_rows)], dtype=torch.int32),
            local_total_seq_lens=max(prefill_rows),
            max_local_total_seq_lens=max(prefill_rows),
        )
        prefill = DeepseekV32IndexerPrefillMetadata(chunks=[chunk])
    return DeepseekV32IndexerMetadata(
        seq_lens=torch.zeros(1, dtype=torch.int32),
        max_seq_len=max([*decode_lens, *prefill_rows]),
        slot_mapping=torch.arange(num_tokens, dtype=torch.int64),
        num_decodes=num_decodes,
        num_decode_tokens=num_decodes,
        num_prefills=1 if prefill_rows else 0,
        num_prefill_tokens=len(prefill_rows),
        decode=decode,
        prefill=prefill,
    )


def run_op(vllm_config, metadata, num_tokens: int) -> torch.Tensor:
    from vllm.forward_context import set_forward_context

    buffer = torch.full((num_tokens + 2, TOPK), 7, dtype=torch.int32)
    buffer[:num_tokens] = -1  # what the fused key insert leaves
    with set_forward_context({PREFIX: metadata}, vllm_config):
        out = OP.kimi_k3_sparse_attn_indexer(
            torch.zeros(num_tokens, 4),
            PREFIX,
            torch.zeros(4, 64, 132, dtype=torch.uint8),
            torch.zeros(num_tokens, 32, 128),
            None,
            None,
            torch.zeros(num_tokens, 32),
            128,
            "ue8m0",
            TOPK,
            128,
            1024,
            1024,
            buffer,
            True,  # skip_k_cache_insert: the fused insert ran
            "",
            False,
            0,
            1,
            1,
            "auto",
        )
    assert out is buffer
    assert (buffer[num_tokens:] == 7).all()  # rows past the step untouched
    return buffer[:num_tokens]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_every_row_leaves_in_canonical_form(dsa_layer_env, kernels, seed):
    """Two decodes and a prefill chunk of rows shorter and longer than top-k,
    over scores with many ties: the rows are the canonical selection, and a
    second run whose top-k kernel broke the ties otherwise gives the same."""
    decode_lens = [5, 40]
    prefill_rows = [3, 8, 9, 30, 64]
    decode_scores = tie_heavy(2, 64, seed)
    prefill_scores = tie_heavy(5, 64, seed + 10)
    metadata = step_metadata(prefill_rows, decode_lens)
    num_tokens = len(decode_lens) + len(prefill_rows)

    first = kernels([prefill_scores, decode_scores], seed=seed)
    rows = run_op(dsa_layer_env.vllm_config, metadata, num_tokens).clone()
    assert first.prefill_calls == [(5, prefill_rows)]
    expected = torch.cat(
        [
            canonical_topk_rows(decode_scores, torch.tensor(decode_lens), TOPK),
            canonical_topk_rows(prefill_scores, torch.tensor(prefill_rows), TOPK),
        ]
    )
    assert torch.equal(rows, expected)

    kernels([prefill_scores, decode_scores], seed=seed + 100)
    again = run_op(dsa_layer_env.vllm_config, metadata, num_tokens)
    assert torch.equal(again, rows)


def test_piecewise_graphs_split_at_the_indexer_op() -> None:
    """The op is one of vLLM's splitting ops (it loops over prefill chunks on
    the host), named as it is registered."""
    from vllm.config import CompilationConfig
    from vllm.config.compilation import CompilationMode
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    name = torch.ops.vllm.kimi_k3_sparse_attn_indexer.default._schema.name
    config = CompilationConfig(mode=CompilationMode.VLLM_COMPILE)
    config.set_splitting_ops_for_v1(all2all_backend="allgather_reducescatter")
    assert name in config.splitting_ops
    assert "vllm::sparse_attn_indexer" in config.splitting_ops


def test_decode_row_lens() -> None:
    """Per row, or per request with next_n rows seeing one more token each."""
    per_row = torch.tensor([[3, 4], [9, 10]], dtype=torch.int32)
    assert OP.decode_row_lens(per_row, 2, 4).tolist() == [3, 4, 9, 10]
    per_request = torch.tensor([[4], [10]], dtype=torch.int32)
    assert OP.decode_row_lens(per_request, 2, 4).tolist() == [3, 4, 9, 10]
    assert OP.decode_row_lens(per_request, 1, 2).tolist() == [4, 10]


@pytest.fixture
def decode_switch(monkeypatch: pytest.MonkeyPatch):
    """``decode_switch(on)``: set the decode-share switch, which the op reads
    once a process."""
    from vllm.models.kimi_k3.common.dsa_envs import INDEXER_DECODE_SHARD_ENV

    def switch(on: bool) -> None:
        monkeypatch.setenv(INDEXER_DECODE_SHARD_ENV, "1" if on else "0")
        OP.decode_share_enabled.cache_clear()

    yield switch
    OP.decode_share_enabled.cache_clear()


@pytest.mark.parametrize(("tp", "num_decodes"), [(2, 5), (4, 4), (4, 7)])
def test_shared_decode_rows_equal_the_replicated_ones(
    dsa_layer_env, kernels, monkeypatch, decode_switch, tp, num_decodes
):
    """With the indexer's decode rows shared, each TP rank scores its
    contiguous share of the requests (DeepGEMM scheduled for those alone)
    and one all-gather puts every rank's rows in place: the ranks' rows, put
    together in rank order, are the replicated op's."""
    decode_lens = [5 + 7 * i for i in range(num_decodes)]
    scores = tie_heavy(num_decodes, 64, seed=tp + num_decodes)
    metadata = step_metadata([], decode_lens)
    kernels([scores], seed=0)
    replicated = run_op(dsa_layer_env.vllm_config, metadata, num_decodes).clone()

    decode_switch(True)
    monkeypatch.setattr(OP, "get_tensor_model_parallel_world_size", lambda: tp)
    monkeypatch.setattr(OP, "num_compute_units", lambda index: 1)
    scheduled: list[list[int]] = []

    def schedule(seq_lens, block_size, num_sms, indices=None):
        scheduled.append(seq_lens.reshape(-1).tolist())
        return torch.zeros(1, dtype=torch.int32)

    monkeypatch.setattr(OP, "get_paged_mqa_logits_metadata", schedule)
    gathered: list[torch.Tensor] = []

    def gather(local, sizes):
        assert sum(sizes) == num_decodes and len(sizes) == tp
        gathered.append(local.clone())
        rows = torch.full((num_decodes, local.shape[1]), -5, dtype=local.dtype)
        start = sum(sizes[: len(gathered) - 1])
        rows[start : start + local.shape[0]] = local
        return rows

    monkeypatch.setattr(OP, "gather_decode_topk", gather)
    base, extra = divmod(num_decodes, tp)
    sizes = [base + (r < extra) for r in range(tp)]
    starts = [sum(sizes[:r]) for r in range(tp)]
    for rank in range(tp):
        monkeypatch.setattr(OP, "get_tensor_model_parallel_rank", lambda r=rank: r)
        rows = slice(starts[rank], starts[rank] + sizes[rank])
        kernels([scores[rows]], seed=rank + 1)
        run_op(dsa_layer_env.vllm_config, metadata, num_decodes)
    assert scheduled == [
        decode_lens[s : s + n] for s, n in zip(starts, sizes, strict=True)
    ]
    assert torch.equal(torch.cat(gathered), replicated)


def test_decode_rows_stay_replicated_below_the_rank_count(monkeypatch, decode_switch):
    monkeypatch.setattr(OP, "get_tensor_model_parallel_world_size", lambda: 8)
    monkeypatch.setattr(OP, "get_tensor_model_parallel_rank", lambda: 3)
    decode_switch(False)
    assert OP.decode_request_share(64) is None  # the switch is off
    decode_switch(True)
    assert OP.decode_request_share(7) is None  # fewer requests than ranks
    assert OP.decode_request_share(64) == (24, 32, [8] * 8)
    assert OP.decode_request_share(11) == (6, 7, [2, 2, 2, 1, 1, 1, 1, 1])
    monkeypatch.setattr(OP, "get_tensor_model_parallel_world_size", lambda: 1)
    assert OP.decode_request_share(64) is None
