# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Decode context parallelism (DCP2) on one GPU: both ranks in one process.

Each DCP rank's caches are built as vLLM 0.33.0 writes them at DCP2 (Model
Runner V2's slot mapping, ``cp_kv_cache_interleave_size`` 1 and 64), beside
the one-rank caches of the same tokens, from fresh random inputs into
sentinel-filled packed rows (indexer block and ``fp8_ds_mla`` block in one
row). The NCCL collectives of the DCP path are replaced by what they compute:
the top-k merge's all-gather by a concatenation in rank order, the output
reduce-scatter by a sum.

What it proves, stage by stage (the first failing test names the stage where
DCP2 stops equalling one GPU):

1. slots: every token goes to exactly one rank, ``(pos // interleave) % 2``,
   at vLLM's local lengths (``get_dcp_local_seq_lens``); the indexer slots our
   ``KimiK3IndexerMetadataBuilder`` derives from the block table
   (``get_compressed_slot_mapping``, compress ratio 1) equal the MLA slots;
2. writes: at a token's local slot each rank holds exactly the bytes one rank
   holds for it (our indexer key insert, the one DCP serves with; vLLM's
   ``concat_and_cache_mla``), nothing else in the cache is touched, and our
   insert and fused prologue write what vLLM's unfused ops write (codes within
   one step);
3. indexer: DeepGEMM's paged MQA logits over each rank's half equal the
   one-rank logits of the same tokens, all finite;
4. selection: each rank's local top-k merged by vLLM's DCP merge (its Triton
   pack and CuTe DSL selector of ``_merge_dcp_topk_global``) and by a torch
   merge equals the one-rank top-k;
5. sparse MLA: FlashMLA sparse decode on each rank at the merged top-k
   (localized by vLLM's ``triton_filter_and_convert_dcp_index``), combined by
   vLLM's DCP LSE correction (``correct_attn_out``), equals one rank's output.

Not covered here (the two-GPU run, docs/serving.md, covers it): the prefill
path under DCP (the indexer's key gather, FlashMLA sparse prefill), packed
rows of several 64-token kernel pages, the engine's metadata builders, NCCL.

Needs a CUDA GPU, the built ``vllm._kimi_k3_C``, vLLM 0.33.0 importable (its
cache ops and DCP helpers), its DeepGEMM and FlashMLA in
``$KIMI_K3_DEVICE_DIR`` (as the consumer tests), and CuTe DSL for vLLM's
merge (that test alone skips without it).
"""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest
import torch
from dsa_gpu_utils import (
    BLOCK,
    EPS,
    SENTINEL,
    PackedCaches,
    calc_diff,
    compare_caches,
    compare_index_values,
    cutedsl_dcp_merge,
    dcp_block_table,
    dcp_global_positions,
    dcp_merge_reference,
    deep_gemm_module,
    flashmla_sparse_decode_op,
    fp8_indexer_query,
    gemm_slices,
    index_entries,
    mla_entries,
    norm_weights,
    requires_consumers,
    requires_kernels,
)

from vllm.models.kimi_k3.nvidia.dsa_ops import formats as F
from vllm.models.kimi_k3.nvidia.dsa_ops import reference
from vllm.models.kimi_k3.nvidia.dsa_ops.fused_prologue import dsa_fused_prologue
from vllm.models.kimi_k3.nvidia.dsa_ops.indexer_k_insert import (
    indexer_k_norm_quant_insert,
)

pytestmark = [pytest.mark.gpu, requires_kernels, requires_consumers]

DCP = 2
D = 128  # indexer head dim
INDEX_HEADS = 32
MLA_HEADS = 64  # FlashMLA sparse's fp8 decode runs 64 or 128 query heads
KV_LORA = 512
# A width vLLM's DCP merge takes (512, 1024, 2048), as the e2e DCP checkpoint.
TOPK = 512
# One request shorter than the top-k (every token selected), three longer.
CTX_LENS = [300, 700, 1500, 2600]
INTERLEAVES = [1, BLOCK]


def _vllm() -> SimpleNamespace:
    """vLLM 0.33.0's pieces of the DCP path; skips where vLLM is absent."""
    try:
        from vllm import _custom_ops as ops
        from vllm.v1.attention.backends.mla.compressor_utils import (
            get_compressed_slot_mapping,
        )
        from vllm.v1.attention.backends.mla.sparse_utils import (
            triton_filter_and_convert_dcp_index,
        )
        from vllm.v1.attention.backends.utils import get_dcp_local_seq_lens
        from vllm.v1.attention.ops.dcp import CPTritonContext, correct_attn_out
        from vllm.v1.worker.gpu.block_table import BlockTables
    except ImportError as e:
        pytest.skip(f"vLLM 0.33.0 is not importable here ({e})")
    if not hasattr(torch.ops._C_cache_ops, "indexer_k_quant_and_cache"):
        pytest.skip("vLLM's cache ops (torch.ops._C_cache_ops) are not loaded")
    return SimpleNamespace(
        ops=ops,
        get_compressed_slot_mapping=get_compressed_slot_mapping,
        filter_and_convert=triton_filter_and_convert_dcp_index,
        get_dcp_local_seq_lens=get_dcp_local_seq_lens,
        CPTritonContext=CPTritonContext,
        correct_attn_out=correct_attn_out,
        BlockTables=BlockTables,
    )


def _rank(
    v: SimpleNamespace,
    batch: SimpleNamespace,
    world: int,
    rank: int,
    interleave: int,
    seed: int,
) -> SimpleNamespace:
    """One DCP rank (``world`` 1: the single rank): its block table over
    shuffled physical blocks, vLLM's slots for writing the whole batch, and
    its caches written three ways."""
    dev = batch.lens.device
    num_tokens = batch.num_tokens
    table, slots, num_blocks = dcp_block_table(
        v.BlockTables, CTX_LENS, BLOCK, world, rank, interleave,
        batch.query_start_loc, batch.positions, seed,
    )  # fmt: skip
    # What KimiK3IndexerMetadataBuilder.build hands the indexer.
    index_slots = v.get_compressed_slot_mapping(
        num_tokens,
        slots,
        batch.query_start_loc,
        batch.lens,
        table,
        BLOCK,
        compress_ratio=1,
        dcp_world_size=world,
        cp_interleave=interleave,
    ).clone()

    x = batch.inputs
    k_scale = torch.ones((), dtype=torch.float32, device=dev)
    # Our fused prologue (the fused forward): both caches by our kernels.
    fused = PackedCaches(num_blocks, fp4=False)
    topk_fill = torch.empty(num_tokens, 2048, dtype=torch.int32, device=dev)
    _, kv_normed = dsa_fused_prologue(
        x.q_c, x.kv_c, x.k_pe, x.index_k, x.qw, x.kvw, x.kw, x.kb, EPS,
        topk_fill, fused.mla, slots, fused.index, index_slots,
    )  # fmt: skip
    k_pe = x.k_pe.contiguous()
    # What DCP serves with: the wrapper forward (vLLM's MLA insert) and our
    # indexer key insert.
    served = PackedCaches(num_blocks, fp4=False)
    indexer_k_norm_quant_insert(
        x.index_k, x.kw, x.kb, EPS, index_slots, served.index,
        torch.empty(num_tokens, 8, dtype=torch.int32, device=dev), num_tokens,
    )  # fmt: skip
    v.ops.concat_and_cache_mla(
        kv_normed, k_pe, served.mla, slots, "fp8_ds_mla", k_scale
    )
    # vLLM's unfused path (VLLM_KIMI_K3_DSA_FORCE_WRAPPER=1).
    unfused = PackedCaches(num_blocks, fp4=False)
    v.ops.indexer_k_quant_and_cache(
        reference.k_norm(x.index_k, x.kw, x.kb, EPS),
        unfused.index,
        index_slots,
        D,
        "mxfp8" if F.use_mx_scales() else "ue8m0",
    )
    v.ops.concat_and_cache_mla(
        kv_normed, k_pe, unfused.mla, slots, "fp8_ds_mla", k_scale
    )
    local_lens = v.get_dcp_local_seq_lens(batch.lens, world, rank, interleave)
    return SimpleNamespace(
        rank=rank,
        world=world,
        table=table,
        slots=slots,
        index_slots=index_slots,
        local_lens=local_lens.to(torch.int32).view(-1),
        fused=fused,
        served=served,
        unfused=unfused,
        kv_normed=kv_normed,
    )


def _indexer_logits(dg, r: SimpleNamespace, q_in, weights) -> torch.Tensor:
    """DeepGEMM's decode logits over one rank's indexer cache, at its local
    lengths (the DCP indexer's decode ``seq_lens``)."""
    context_lens = r.local_lens.view(-1, 1).contiguous()
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    schedule = dg.get_paged_mqa_logits_metadata(context_lens, BLOCK, num_sms)
    max_len = r.table.shape[1] * BLOCK
    return dg.fp8_fp4_paged_mqa_logits(
        q_in, r.served.index.unsqueeze(-2), weights, context_lens, r.table,
        schedule, max_len,
    ).float()  # fmt: skip


def _local_topk(logits: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
    """Each row's top ``TOPK`` local positions below its length, -1 after."""
    cols = torch.arange(logits.shape[1], device=logits.device)
    masked = logits.masked_fill(cols[None, :] >= lens[:, None], float("-inf"))
    values, idx = masked.topk(min(TOPK, logits.shape[1]), dim=-1)
    out = torch.full((logits.shape[0], TOPK), -1, dtype=torch.int32, device="cuda")
    out[:, : idx.shape[1]] = idx.to(torch.int32).masked_fill(torch.isinf(values), -1)
    return out


def _assert_same_selection(
    got: torch.Tensor, want: torch.Tensor, scores: torch.Tensor, what: str
) -> None:
    """Per request: the same token positions, except where a tie at the
    boundary let either be chosen (the selected scores then agree)."""
    for b, length in enumerate(CTX_LENS):
        a, w = got[b][got[b] >= 0].long(), want[b][want[b] >= 0].long()
        assert a.numel() == a.unique().numel(), f"{what}: request {b} repeats"
        assert a.numel() == w.numel() == min(TOPK, length), (
            f"{what}: request {b} selects {a.numel()} tokens, one rank "
            f"{w.numel()} (expected {min(TOPK, length)})"
        )
        assert int(a.max()) < length, f"{what}: request {b} selects past its end"
        overlap = float(torch.isin(a, w).float().mean())
        print(f"METRIC dcp2 {what} req={b} overlap={overlap:.4f}")
        if overlap < 1.0:
            torch.testing.assert_close(
                scores[b, a].sort().values,
                scores[b, w].sort().values,
                rtol=1e-3,
                atol=1e-3,
            )
            assert overlap >= 0.99, f"{what}: request {b} overlap {overlap:.4f}"


def _sparse_decode(v, op, q, r, topk_global, interleave: int):
    """FlashMLA sparse decode on one rank, as FlashMLASparseImpl under DCP:
    global positions localized to this rank's slots (-1 elsewhere), and rows
    that own no selected token set to (0, -inf), the merge's identity."""
    num_reqs = q.shape[0]
    req_id = torch.arange(num_reqs, dtype=torch.int32, device="cuda")
    indices = v.filter_and_convert(
        req_id,
        r.table,
        topk_global,
        dcp_size=r.world,
        dcp_rank=r.rank,
        cp_kv_cache_interleave_size=interleave,
        BLOCK_SIZE=BLOCK,
        BLOCK_STRIDE_ROWS=None,
        NUM_TOPK_TOKENS=TOPK,
        compact_valid_to_front=False,
    )
    scale = (KV_LORA + 64) ** -0.5
    out, lse, _, _ = op(
        q, r.served.mla.unsqueeze(-2), indices.view(num_reqs, 1, TOPK), None,
        None, None, None, None, None, None, KV_LORA, scale, None, False,
    )  # fmt: skip
    out = out.reshape(num_reqs, MLA_HEADS, KV_LORA)
    lse = lse.reshape(num_reqs, MLA_HEADS).float()
    empty = (indices == -1).all(dim=-1)
    out = out.masked_fill(empty.view(-1, 1, 1), 0.0)
    lse = lse.masked_fill(empty.view(-1, 1), float("-inf"))
    return out, lse, indices


@pytest.fixture(scope="module", params=INTERLEAVES, ids=lambda i: f"interleave{i}")
def dcp2(request) -> SimpleNamespace:
    """One rank and the two DCP ranks of the same batch, written and read."""
    v = _vllm()
    interleave = request.param
    dev = torch.device("cuda")
    lens = torch.tensor(CTX_LENS, dtype=torch.int32, device=dev)
    query_start_loc = torch.zeros(len(CTX_LENS) + 1, dtype=torch.int32, device=dev)
    query_start_loc[1:] = lens.cumsum(0)
    positions = torch.cat([torch.arange(n, device=dev) for n in CTX_LENS])
    num_tokens = sum(CTX_LENS)
    q_c, kv_c, k_pe, index_k = gemm_slices(num_tokens, seed=41 + interleave)
    qw, kvw, kw, kb = norm_weights(seed=42 + interleave)
    batch = SimpleNamespace(
        lens=lens,
        query_start_loc=query_start_loc,
        positions=positions,
        num_tokens=num_tokens,
        inputs=SimpleNamespace(
            q_c=q_c,
            kv_c=kv_c,
            k_pe=k_pe,
            index_k=index_k,
            qw=qw,
            kvw=kvw,
            kw=kw,
            kb=kb,
        ),
    )
    one = _rank(v, batch, 1, 0, interleave, seed=50)
    ranks = [_rank(v, batch, DCP, r, interleave, seed=51 + r) for r in range(DCP)]

    # The decode step's queries: the indexer's (fp8, scale folded into the
    # head weights as vLLM does) and sparse MLA's.
    dg = deep_gemm_module()
    g = torch.Generator(device="cuda").manual_seed(43 + interleave)
    num_reqs = len(CTX_LENS)
    q_index = torch.randn(
        num_reqs, 1, INDEX_HEADS, D, device=dev, generator=g
    ).bfloat16()
    head_w = torch.randn(num_reqs, INDEX_HEADS, device=dev, generator=g)
    q_in, weights = fp8_indexer_query(q_index, head_w)
    one.logits = _indexer_logits(dg, one, q_in, weights)
    for r in ranks:
        r.logits = _indexer_logits(dg, r, q_in, weights)
    one.topk = _local_topk(one.logits, one.local_lens)
    for r in ranks:
        r.topk = _local_topk(r.logits, r.local_lens)
    merged = dcp_merge_reference(
        [r.logits for r in ranks], [r.topk for r in ranks], interleave, TOPK
    )
    q_mla = (
        torch.randn(num_reqs, 1, MLA_HEADS, KV_LORA + 64, device=dev, generator=g) * 0.5
    ).bfloat16()
    return SimpleNamespace(
        v=v,
        interleave=interleave,
        batch=batch,
        one=one,
        ranks=ranks,
        q_index=q_index,
        head_w=head_w,
        merged=merged,
        q_mla=q_mla,
    )


def test_dcp2_slots_give_each_token_to_one_rank(dcp2):
    i = dcp2.interleave
    positions = dcp2.batch.positions
    owner = (positions // i) % DCP
    assert (dcp2.one.slots >= 0).all()
    assert torch.equal(dcp2.one.index_slots, dcp2.one.slots)
    starts = dcp2.batch.query_start_loc.tolist()
    for r in dcp2.ranks:
        mine = r.slots >= 0
        assert torch.equal(mine, owner == r.rank), f"rank {r.rank} owns wrong tokens"
        assert torch.equal(r.index_slots, r.slots), (
            f"rank {r.rank}: the indexer slots (get_compressed_slot_mapping over "
            "the block table) differ from the MLA slots"
        )
        assert r.slots[mine].unique().numel() == int(mine.sum())
        owned = [int(mine[a:b].sum()) for a, b in itertools.pairwise(starts)]
        assert r.local_lens.tolist() == owned, (
            f"rank {r.rank}: get_dcp_local_seq_lens {r.local_lens.tolist()} "
            f"but the slot mapping gives it {owned} tokens"
        )


def test_dcp2_caches_hold_one_ranks_bytes(dcp2):
    """At each token's slot a rank holds the bytes the single rank holds for
    that token, in both caches, and every other slot keeps the sentinel."""
    one = dcp2.one
    for r in dcp2.ranks:
        mine = r.slots >= 0
        local, single = r.slots[mine], one.slots[mine]
        assert torch.equal(
            index_entries(r.served, local), index_entries(one.served, single)
        ), f"rank {r.rank}: indexer keys differ from one rank's"
        mla = mla_entries(r.served)
        assert torch.equal(mla[local], mla_entries(one.served)[single]), (
            f"rank {r.rank}: fp8_ds_mla entries differ from one rank's"
        )
        untouched = torch.ones(mla.shape[0], dtype=torch.bool, device="cuda")
        untouched[local] = False
        assert (mla[untouched] == SENTINEL).all(), (
            f"rank {r.rank}: MLA slots it does not own were written"
        )
        index_untouched = index_entries(r.served, torch.nonzero(untouched).squeeze(1))
        assert (index_untouched == SENTINEL).all(), (
            f"rank {r.rank}: indexer slots it does not own were written"
        )


def test_dcp2_our_writers_equal_vllms_unfused(dcp2):
    for r in [dcp2.one, *dcp2.ranks]:
        n = int((r.slots >= 0).sum())
        # Our key insert (served) and our fused prologue, each against vLLM's
        # unfused insert; the MLA entries of the prologue against vLLM's.
        compare_caches(r.served, r.unfused, n * KV_LORA)
        compare_index_values(r.served, r.unfused, n)
        compare_caches(r.fused, r.unfused, n * KV_LORA)
        compare_index_values(r.fused, r.unfused, n)


def test_dcp2_indexer_logits_equal_one_ranks(dcp2):
    one = dcp2.one
    k = reference.k_norm(
        dcp2.batch.inputs.index_k, dcp2.batch.inputs.kw, dcp2.batch.inputs.kb, EPS
    ).float()
    starts = dcp2.batch.query_start_loc.tolist()
    got, ref = [], []
    for b, length in enumerate(CTX_LENS):
        assert torch.isfinite(one.logits[b, :length]).all()
        keys = k[starts[b] : starts[b] + length]
        scores = torch.relu(dcp2.q_index[b, 0].float() @ keys.T)
        ref.append((scores * dcp2.head_w[b].unsqueeze(-1)).sum(0))
        got.append(one.logits[b, :length])
    diff = calc_diff(torch.cat(got), torch.cat(ref))
    print(f"METRIC dcp2 one-rank logits calc_diff={diff:.3e}")
    assert diff < 1e-3, f"one-rank logits calc_diff {diff:.2e}"
    for r in dcp2.ranks:
        worst = 0.0
        for b in range(len(CTX_LENS)):
            n = int(r.local_lens[b])
            local = torch.arange(n, device="cuda")
            glob = dcp_global_positions(local, r.rank, DCP, dcp2.interleave)
            mine = r.logits[b, :n]
            assert torch.isfinite(mine).all(), f"rank {r.rank}: non-finite logits"
            theirs = one.logits[b, glob]
            worst = max(worst, float((mine - theirs).abs().max()))
            torch.testing.assert_close(mine, theirs, rtol=1e-3, atol=1e-3)
        print(f"METRIC dcp2 rank={r.rank} logits max_abs_diff={worst:.3e}")


def test_dcp2_merged_topk_equals_one_ranks(dcp2):
    """The torch merge of the ranks' local top-k selects one rank's tokens."""
    _assert_same_selection(dcp2.merged, dcp2.one.topk, dcp2.one.logits, "merge")


def test_dcp2_vllms_merge_equals_one_ranks(dcp2):
    """vLLM's DCP merge (``_merge_dcp_topk_global`` without the collective:
    its pack kernel per rank, the all-gather as a concatenation in rank
    order, its CuTe DSL selector) selects one rank's tokens."""
    pack, select = cutedsl_dcp_merge()
    packed = []
    for r in dcp2.ranks:
        candidates = torch.empty((*r.topk.shape, 2), dtype=torch.float32, device="cuda")
        pack(r.logits, r.topk.clone(), candidates, r.rank, DCP, dcp2.interleave, None)
        packed.append(candidates)
    gathered = torch.cat(packed, dim=1)
    merged = torch.empty_like(dcp2.one.topk)
    select(gathered, TOPK, out=merged)
    _assert_same_selection(merged, dcp2.one.topk, dcp2.one.logits, "vllm-merge")
    _assert_same_selection(merged, dcp2.merged, dcp2.one.logits, "vllm-vs-torch")


def test_dcp2_sparse_mla_decode_equals_one_ranks(dcp2):
    """FlashMLA sparse decode per rank at the merged top-k, combined as vLLM's
    DCP does (LSE correction on each rank, then the sum its reduce-scatter
    takes), against one rank at its own top-k."""
    v, op = dcp2.v, flashmla_sparse_decode_op()
    out_one, lse_one, _ = _sparse_decode(
        v, op, dcp2.q_mla, dcp2.one, dcp2.one.topk, dcp2.interleave
    )
    parts = [
        _sparse_decode(v, op, dcp2.q_mla, r, dcp2.merged, dcp2.interleave)
        for r in dcp2.ranks
    ]
    owned = sum((indices >= 0).sum(-1) for _, _, indices in parts)
    expected = (dcp2.merged >= 0).sum(-1)
    assert torch.equal(owned, expected), (
        f"the ranks own {owned.tolist()} of the merged tokens, not {expected.tolist()}"
    )
    lses = torch.stack([lse for _, lse, _ in parts])
    total = torch.zeros_like(out_one, dtype=torch.float32)
    for rank, (out, _, _) in enumerate(parts):
        corrected, lse = v.correct_attn_out(
            out.clone(), lses, rank, v.CPTritonContext()
        )
        total += corrected.float()
    assert torch.isfinite(total).all() and torch.isfinite(lse).all()
    err = float((total - out_one.float()).abs().max())
    lse_err = float((lse - lse_one).abs().max())
    print(f"METRIC dcp2 sparse-mla max_abs_err={err:.3e} lse_err={lse_err:.3e}")
    torch.testing.assert_close(lse, lse_one, rtol=1e-4, atol=1e-3)
    torch.testing.assert_close(
        total.bfloat16().float(), out_one.float(), rtol=2e-2, atol=5e-3
    )
