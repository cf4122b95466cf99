# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Decode context parallelism (DCP2) on one GPU, the prefill path: both ranks
in one process.

What vLLM 0.33.0 does with a prefill chunk under DCP (no PCP), read from its
source:

- Every DCP rank computes every prefill query row: the queries are not split
  across the ranks (the "prefill rows padded to ceil(P / W) per rank" of the
  newer upstream's allgather-k mode does not exist in 0.33.0). Only the KV is
  sharded: token ``p`` of a request lives on rank ``(p // interleave) % W``.
- Indexer (``sparse_attn_indexer``, ``model_executor/layers/
  sparse_attn_indexer.py``): per prefill chunk of
  ``build_prefill_chunk_metadata`` (``v1/attention/backends/mla/
  indexer.py``), ``cp_gather_indexer_k_quant_cache`` gathers this rank's own
  keys of the chunk's requests (``local_cu_seq_lens``, the per-rank lengths
  of ``get_dcp_local_seq_lens``) through the indexer's kernel block table;
  DeepGEMM's ``fp8_fp4_mqa_logits`` scores every query row over its local
  causal bound (``cu_seqlen_ks``: the request's local start; ``cu_seqlen_ke``:
  plus the rank's tokens at positions <= the row's); ``top_k_per_row_prefill``
  keeps the local top-k; ``_merge_dcp_topk_global`` packs (score, global
  position) candidates, all-gathers them over the DCP group and selects the
  global top-k (CuTe DSL only).
- Sparse MLA (``FlashMLASparseMetadataBuilder``/``FlashMLASparseImpl``,
  ``v1/attention/backends/mla/flashmla_sparse.py``): under DCP only the
  mixed-batch fp8 path is allowed, so prefill rows go through FlashMLA's
  sparse *decode* kernel as one batch of ``T`` queries (the bf16 sparse
  prefill kernel, ``flash_mla_sparse_fwd``, runs only under PCP+DCP); the
  query heads are all-gathered over the DCP group (``MLADCPManager``),
  ``triton_filter_and_convert_dcp_index`` keeps this rank's share of the
  global top-k as local slots, rows owning none become (0, -inf), and
  ``cp_lse_ag_out_rs`` (``v1/attention/ops/dcp.py``) all-gathers the LSEs,
  corrects each rank's output (``correct_attn_out``) and reduce-scatters the
  heads. A batch whose longest prefill is no longer than the top-k takes the
  dense-MHA prefill instead (not covered here: every batch below has longer
  prompts, so its shorter prompt goes the sparse way too).

Here each rank's caches are written as at DCP2 (Model Runner V2's slot
mapping, ``cp_kv_cache_interleave_size`` 1 and 64) into sentinel-filled
packed rows, beside one rank's caches of the same tokens, with fresh random
inputs; manager blocks of one 64-token kernel page and of four (the SM90
layout: the indexer run split into kernel pages by the runner, the MLA run
read in manager blocks). The requests are prompts of 300 (shorter than the
top-k), 700 and 1500 tokens and the last 400-token chunk of a 2600-token
prompt. The collectives are replaced by what they compute: all-gathers by
concatenation in rank order, the reduce-scatter by a sum. Stage by stage
(the first failing test names the stage where DCP2 stops equalling one GPU):

1. slots: each token goes to one rank; the indexer slots derived from the
   kernel block table equal the manager slots remapped to kernel pages;
2. writes: at a token's local slot each rank holds one rank's bytes (our
   indexer key insert, vLLM's ``concat_and_cache_mla``), nothing else moved;
3. chunk bounds: vLLM's ``build_prefill_chunk_metadata`` per rank gives the
   local lengths and the causal local bounds the slot mapping implies;
4. key gather: ``cp_gather_indexer_k_quant_cache`` per rank returns one
   rank's keys of the positions it owns, in order;
5. logits: one rank's prefill logits equal a torch reference, each rank's
   equal one rank's at the same positions, all finite;
6. local top-k: ``top_k_per_row_prefill`` selects what torch selects;
7. merge: the ranks' local top-k merged in torch, and by vLLM's DCP merge
   (CuTe DSL; skips without it), equal one rank's top-k row by row;
8. sparse MLA: FlashMLA sparse (the mixed-batch kernel) per rank at one
   rank's top-k, localized by vLLM's converter and combined by its LSE
   correction, equals one rank's output; then the same end to end, at the
   merged top-k.

Not covered (needs more than one process): the NCCL collectives themselves,
the engine's metadata builders as a whole (its chunking, ``CommonAttention
Metadata``; the chunk planner and ``build_prefill_chunk_metadata`` are
called here), the query head all-gather, the dense-MHA prefill.

Needs a CUDA GPU, the built ``vllm._kimi_k3_C``, vLLM 0.33.0 importable (its
cache ops, metadata and DCP helpers), its DeepGEMM and FlashMLA in
``$KIMI_K3_DEVICE_DIR`` (as the consumer tests), and CuTe DSL for vLLM's
merge (that test alone skips without it). Not yet run on a GPU.
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
from vllm.models.kimi_k3.nvidia.dsa_ops.indexer_k_insert import (
    indexer_k_norm_quant_insert,
)
from vllm.v1.worker.kernel_pages import kernel_page_slots

pytestmark = [pytest.mark.gpu, requires_kernels, requires_consumers]

DCP = 2
D = 128  # indexer head dim
INDEX_HEADS = 32
# The DCP-gathered query heads; FlashMLA sparse's fp8 kernel runs 64 or 128.
MLA_HEADS = 64
KV_LORA = 512
# A width vLLM's DCP merge takes (512, 1024, 2048), as the e2e DCP checkpoint.
TOPK = 512
# Context of each request after this step, and the rows this step prefills:
# three whole prompts (one shorter than the top-k) and the last chunk of a
# longer one, whose earlier tokens are already cached.
CTX_LENS = [300, 700, 1500, 2600]
QUERY_LENS = [300, 700, 1500, 400]
INTERLEAVES = [1, BLOCK]
# Manager blocks of one 64-token kernel page, and packed rows of four.
BLOCK_TOKENS = [BLOCK, 4 * BLOCK]
SCALE = (KV_LORA + 64) ** -0.5


def _vllm() -> SimpleNamespace:
    """vLLM 0.33.0's pieces of the DCP prefill path; skips where vLLM is
    absent (as in the kernels suite, which runs without it)."""
    try:
        import vllm.envs as envs
        from vllm import _custom_ops as ops
        from vllm.v1.attention.backends.mla.compressor_utils import (
            get_compressed_slot_mapping,
        )
        from vllm.v1.attention.backends.mla.indexer import (
            DeepseekV32IndexerMetadataBuilder,
            build_prefill_chunk_metadata,
        )
        from vllm.v1.attention.backends.mla.sparse_utils import (
            flat_kv_row_view,
            triton_convert_req_index_to_global_index,
            triton_filter_and_convert_dcp_index,
        )
        from vllm.v1.attention.ops.dcp import (
            CPTritonContext,
            correct_attn_out,
            mask_dcp_empty_shards_,
        )
        from vllm.v1.worker.gpu.block_table import BlockTables
    except ImportError as e:
        pytest.skip(f"vLLM 0.33.0 is not importable here ({e})")
    for op in ("cp_gather_indexer_k_quant_cache", "concat_and_cache_mla"):
        if not hasattr(torch.ops._C_cache_ops, op):
            pytest.skip(
                f"vLLM's cache ops (torch.ops._C_cache_ops.{op}) are not loaded"
            )
    if not hasattr(torch.ops._C, "top_k_per_row_prefill"):
        pytest.skip("vLLM's top_k_per_row_prefill (torch.ops._C) is not loaded")
    return SimpleNamespace(
        ops=ops,
        max_logits_bytes=envs.VLLM_SPARSE_INDEXER_MAX_LOGITS_MB * 1024 * 1024,
        get_compressed_slot_mapping=get_compressed_slot_mapping,
        split_chunks=DeepseekV32IndexerMetadataBuilder._split_indexer_prefill_chunks,
        build_chunk=build_prefill_chunk_metadata,
        flat_kv_row_view=flat_kv_row_view,
        convert_to_global=triton_convert_req_index_to_global_index,
        filter_and_convert=triton_filter_and_convert_dcp_index,
        CPTritonContext=CPTritonContext,
        correct_attn_out=correct_attn_out,
        mask_empty_shards=mask_dcp_empty_shards_,
        BlockTables=BlockTables,
    )


def _kernel_block_table(table: torch.Tensor, stride: int, pages: int) -> torch.Tensor:
    """The manager block table in 64-token kernel pages, as the runner hands
    a split group (``AttentionGroup.map_to_kernel_block_table``: page j of
    block b is ``b * kernel_block_stride + j``)."""
    offsets = torch.arange(pages, dtype=table.dtype, device=table.device)
    return (table.unsqueeze(-1) * stride + offsets).flatten(1).contiguous()


def _fp8_kv_pages(v, mla: torch.Tensor, block_tokens: int):
    """The MLA cache as FlashMLA sparse's fp8 kernel reads it, and the block
    stride in rows when a block spans several pages (``_fp8_kv_pages`` of
    ``flashmla_sparse.py``)."""
    if block_tokens == BLOCK:
        return mla, None
    rows, block_stride_rows = v.flat_kv_row_view(mla, block_tokens)
    return rows.view(-1, BLOCK, rows.shape[-1]), block_stride_rows


def _rank(
    v: SimpleNamespace,
    batch: SimpleNamespace,
    world: int,
    rank: int,
    interleave: int,
    block_tokens: int,
    seed: int,
) -> SimpleNamespace:
    """One DCP rank (``world`` 1: the single rank): its block table over
    shuffled physical blocks, vLLM's slots for writing every token of the
    batch (the cached context as earlier steps wrote it, and this step's
    rows), and its caches as DCP serves them (our indexer key insert, vLLM's
    MLA insert)."""
    dev = batch.lens.device
    num_tokens = batch.num_tokens
    table, slots, num_blocks = dcp_block_table(
        v.BlockTables, CTX_LENS, block_tokens, world, rank, interleave,
        batch.token_start_loc, batch.positions, seed,
    )  # fmt: skip
    caches = PackedCaches(num_blocks, fp4=False, block_tokens=block_tokens)
    index_pages, page_stride = caches.index_pages()
    kernel_table = _kernel_block_table(table, page_stride, block_tokens // BLOCK)
    # What KimiK3IndexerMetadataBuilder.build hands the indexer: slots from
    # the kernel block table (its spec's block is the 64-token page).
    index_slots = v.get_compressed_slot_mapping(
        num_tokens,
        slots,
        batch.token_start_loc,
        batch.lens,
        kernel_table,
        BLOCK,
        compress_ratio=1,
        dcp_world_size=world,
        cp_interleave=interleave,
    ).clone()
    x = batch.inputs
    indexer_k_norm_quant_insert(
        x.index_k, x.kw, x.kb, EPS, index_slots, index_pages,
        torch.empty(num_tokens, 8, dtype=torch.int32, device=dev), num_tokens,
        check_slots=True,
    )  # fmt: skip
    k_scale = torch.ones((), dtype=torch.float32, device=dev)
    v.ops.concat_and_cache_mla(
        batch.kv_normed, batch.k_pe, caches.mla, slots, "fp8_ds_mla", k_scale
    )
    return SimpleNamespace(
        rank=rank,
        world=world,
        interleave=interleave,
        block_tokens=block_tokens,
        table=table,
        kernel_table=kernel_table,
        page_stride=page_stride,
        slots=slots,
        index_slots=index_slots,
        caches=caches,
        index_pages=index_pages,
    )


def _prefill_indexer(
    v: SimpleNamespace, dg, batch: SimpleNamespace, r: SimpleNamespace
) -> None:
    """This step's prefill rows through the indexer on one rank, as
    ``sparse_attn_indexer`` runs them (no decode rows, no PCP, no TP row
    sharding): vLLM's chunk planner and chunk metadata, the key gather into
    one workspace, DeepGEMM's logits, the per-row top-k. Keeps each chunk,
    its gathered keys, the local top-k, and the logits by local position
    (-inf past each row's bound)."""
    dev = batch.lens.device
    seq_lens_cpu = batch.lens.cpu()
    total = int(seq_lens_cpu.sum())
    specs = v.split_chunks(
        seq_lens_cpu, batch.query_lens_cpu, total, v.max_logits_bytes
    )
    # The shared workspace of the op (sized for every context token).
    k_quant_full = torch.full((total, D), SENTINEL, dtype=torch.uint8, device=dev)
    k_quant_full = k_quant_full.view(torch.float8_e4m3fn)
    k_scale_full = torch.full((total, 4), SENTINEL, dtype=torch.uint8, device=dev)
    num_rows = batch.num_rows
    r.topk = torch.full((num_rows, TOPK), -1, dtype=torch.int32, device=dev)
    r.dense = torch.full(
        (num_rows, max(CTX_LENS)), float("-inf"), dtype=torch.float32, device=dev
    )
    r.row_ks = torch.full((num_rows,), -1, dtype=torch.int32, device=dev)
    r.row_len = torch.full((num_rows,), -1, dtype=torch.int32, device=dev)
    r.chunks, r.gathered = [], []
    q_values, q_sf = batch.q_in
    for req_slice, query_slice in specs:
        chunk = v.build_chunk(
            req_slice.start,
            req_slice.stop,
            batch.query_start_loc,
            batch.query_start_loc_cpu,
            batch.lens,
            batch.lens,
            seq_lens_cpu,
            r.kernel_table,
            1,
            query_slice=query_slice,
            skip_kv_gather=query_slice.start > 0,
            dcp_rank=r.rank,
            dcp_world_size=r.world,
            cp_kv_cache_interleave_size=r.interleave,
        )
        if chunk is None:
            continue
        k_quant = k_quant_full[: chunk.max_local_total_seq_lens]
        k_scale = k_scale_full[: chunk.max_local_total_seq_lens]
        if not chunk.skip_kv_gather and chunk.local_total_seq_lens > 0:
            v.ops.cp_gather_indexer_k_quant_cache(
                r.index_pages, k_quant, k_scale, chunk.block_table,
                chunk.local_cu_seq_lens,
            )  # fmt: skip
            n = chunk.local_total_seq_lens
            r.gathered.append(
                torch.cat((k_quant[:n].view(torch.uint8), k_scale[:n]), dim=1)
            )
        lo, hi = chunk.token_start, chunk.token_end
        ks, ke = chunk.cu_seqlen_ks, chunk.cu_seqlen_ke
        r.row_ks[lo:hi] = ks
        r.row_len[lo:hi] = ke - ks
        out = r.topk[lo:hi]
        logits = None
        if chunk.local_total_seq_lens == 0 or hi == lo:
            out.fill_(-1)
        else:
            scale_dtype = torch.int32 if F.use_mx_scales() else torch.float32
            kv = (k_quant, k_scale.view(scale_dtype).squeeze(-1))
            q_rows = (q_values[lo:hi], None if q_sf is None else q_sf[lo:hi])
            logits = dg.fp8_fp4_mqa_logits(
                q_rows, kv, batch.weights[lo:hi], ks, ke, chunk.max_seqlen_k
            )
            # as_fp32_logits (SM10x logits are bf16) on the columns read.
            logits = logits if logits.dtype == torch.float32 else logits.float()
            row_ends = ke - ks
            v.ops.top_k_per_row_prefill(
                logits, torch.zeros_like(row_ends), row_ends, out, hi - lo,
                logits.stride(0), logits.stride(1), TOPK,
            )  # fmt: skip
            cols = min(logits.shape[1], r.dense.shape[1])
            valid = torch.arange(cols, device=dev)[None, :] < row_ends[:, None]
            r.dense[lo:hi, :cols] = torch.where(
                valid, logits[:, :cols].float(), float("-inf")
            )
        r.chunks.append(
            SimpleNamespace(meta=chunk, req=req_slice, logits=logits, lo=lo, hi=hi)
        )


def _sparse_mla(v, op, q_mla, r, topk: torch.Tensor, batch):
    """FlashMLA sparse on one rank as ``FlashMLASparseImpl``'s mixed-batch
    fp8 path runs prefill rows: every row one query of a single batch, the
    request positions converted to this rank's slots (under DCP: its share
    only, -1 elsewhere), and rows that own no selected token set to
    (0, -inf), the merge's identity. Returns (out [T, H, 512], lse [T, H],
    indices)."""
    pages, block_stride_rows = _fp8_kv_pages(v, r.caches.mla, r.block_tokens)
    if r.world == 1:
        indices = v.convert_to_global(
            batch.row_req,
            r.table,
            topk,
            BLOCK_SIZE=r.block_tokens,
            BLOCK_STRIDE_ROWS=block_stride_rows,
            NUM_TOPK_TOKENS=TOPK,
        )
    else:
        indices = v.filter_and_convert(
            batch.row_req,
            r.table,
            topk,
            dcp_size=r.world,
            dcp_rank=r.rank,
            cp_kv_cache_interleave_size=r.interleave,
            BLOCK_SIZE=r.block_tokens,
            BLOCK_STRIDE_ROWS=block_stride_rows,
            NUM_TOPK_TOKENS=TOPK,
            compact_valid_to_front=False,
        )
    out, lse, _, _ = op(
        q_mla.unsqueeze(0), pages.unsqueeze(-2), indices.unsqueeze(0), None, None,
        None, None, None, None, None, KV_LORA, SCALE, None, False,
    )  # fmt: skip
    out = out.squeeze(0)
    lse = lse.squeeze(0).transpose(0, 1).float()
    empty = (indices == -1).all(dim=-1)
    out = out.masked_fill(empty.view(-1, 1, 1), 0.0).contiguous()
    lse = lse.masked_fill(empty.view(-1, 1), float("-inf")).contiguous()
    return out, lse, indices


def _dcp_combine(v, parts, batch):
    """vLLM's ``cp_lse_ag_out_rs`` without the collectives: each rank's LSE
    masked for empty shards, the LSEs all-gathered (stacked in rank order),
    each rank's output corrected, the reduce-scatter's sum over ranks.
    Returns (output, LSE, the sum of the corrected outputs' magnitudes)."""
    lses = []
    for _, lse, _ in parts:
        lse = lse.clone()
        v.mask_empty_shards(lse, batch.lens, batch.query_start_loc)
        lses.append(lse)
    lses = torch.stack(lses)
    total = magnitude = None
    for rank, (out, _, _) in enumerate(parts):
        corrected, lse = v.correct_attn_out(
            out.clone(), lses, rank, v.CPTritonContext()
        )
        corrected = corrected.float()
        total = corrected if total is None else total + corrected
        magnitude = (
            corrected.abs() if magnitude is None else magnitude + corrected.abs()
        )
    return total, lse, magnitude


def _assert_output_close(total, magnitude, want, what: str) -> None:
    """The combined output against one rank's, elementwise within the
    decode test's tolerance plus the bf16 roundings of DCP itself: each
    rank's partial output and its corrected value are bf16, so where the
    ranks' contributions cancel the error scales with their magnitudes,
    not with the result (four unit roundoffs of their sum)."""
    want = want.float()
    err = (total.bfloat16().float() - want).abs()
    bound = 5e-3 + 2e-2 * want.abs() + 2.0**-7 * magnitude
    diff = calc_diff(total, want)
    print(
        f"METRIC dcp2-prefill {what} max_abs_err={float(err.max()):.3e} "
        f"calc_diff={diff:.3e}"
    )
    bad = err > bound
    assert not bad.any(), (
        f"{what}: {int(bad.sum())} of {err.numel()} output values differ from "
        f"one rank's beyond the bf16 bound, worst {float((err - bound).max()):.3e} "
        f"over it (row {int(torch.nonzero(bad)[0, 0])})"
    )
    assert diff < 1e-4, f"{what}: calc_diff {diff:.2e}"


def _assert_same_rows(
    got: torch.Tensor,
    want: torch.Tensor,
    scores: torch.Tensor,
    lengths: torch.Tensor,
    what: str,
) -> None:
    """Per row: ``min(TOPK, length)`` distinct positions below the row's
    length, the same as ``want`` except where a tie at the boundary let
    either be chosen (the selected scores then agree)."""
    expect = lengths.clamp(max=TOPK)
    count = (got >= 0).sum(1)
    bad = torch.nonzero(count != expect).flatten()
    assert bad.numel() == 0, (
        f"{what}: {bad.numel()} rows select the wrong number of tokens, e.g. "
        f"row {int(bad[0])}: {int(count[bad[0]])} of {int(expect[bad[0]])}"
    )
    past = torch.nonzero(got.max(1).values >= lengths).flatten()
    assert past.numel() == 0, (
        f"{what}: {past.numel()} rows select positions past their causal "
        f"bound, e.g. row {int(past[0])} (length {int(lengths[past[0]])})"
    )
    big = torch.iinfo(torch.int32).max
    gs = torch.where(got >= 0, got, big).sort(1).values
    ws = torch.where(want >= 0, want, big).sort(1).values
    repeats = ((gs[:, 1:] == gs[:, :-1]) & (gs[:, 1:] != big)).any(1)
    assert not repeats.any(), f"{what}: {int(repeats.sum())} rows repeat a position"
    differ = torch.nonzero((gs != ws).any(1)).flatten().tolist()
    print(f"METRIC dcp2-prefill {what} rows_differing={len(differ)} of={got.shape[0]}")
    assert len(differ) <= max(1, got.shape[0] // 100), (
        f"{what}: {len(differ)} of {got.shape[0]} rows select other tokens "
        f"than the reference, e.g. row {differ[0]}"
    )
    for row in differ:
        a = got[row][got[row] >= 0].long()
        w = want[row][want[row] >= 0].long()
        overlap = float(torch.isin(a, w).float().mean())
        torch.testing.assert_close(
            scores[row, a].sort().values,
            scores[row, w].sort().values,
            rtol=1e-3,
            atol=1e-3,
            msg=lambda m, row=row: f"{what}: row {row} selects other scores: {m}",
        )
        assert overlap >= 0.99, f"{what}: row {row} overlap {overlap:.4f}"


def _same_selection(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Rows whose two top-k lists hold the same positions."""
    big = torch.iinfo(torch.int32).max
    sa = torch.where(a >= 0, a, big).sort(1).values
    sb = torch.where(b >= 0, b, big).sort(1).values
    return (sa == sb).all(1)


@pytest.fixture(
    scope="module",
    params=[(i, b) for i in INTERLEAVES for b in BLOCK_TOKENS],
    ids=lambda p: f"interleave{p[0]}-block{p[1]}",
)
def dcp2(request) -> SimpleNamespace:
    """One rank and the two DCP ranks of the same batch, written, and this
    step's prefill rows through each one's indexer."""
    v = _vllm()
    interleave, block_tokens = request.param
    seed = 7 * interleave + block_tokens
    dev = torch.device("cuda")
    num_reqs = len(CTX_LENS)
    lens = torch.tensor(CTX_LENS, dtype=torch.int32, device=dev)
    token_start_loc = torch.zeros(num_reqs + 1, dtype=torch.int32, device=dev)
    token_start_loc[1:] = lens.cumsum(0)
    positions = torch.cat([torch.arange(n, device=dev) for n in CTX_LENS])
    num_tokens = sum(CTX_LENS)
    query_lens = torch.tensor(QUERY_LENS, dtype=torch.int32)
    query_start_loc_cpu = torch.zeros(num_reqs + 1, dtype=torch.int32)
    query_start_loc_cpu[1:] = query_lens.cumsum(0)
    # This step's rows: the last QUERY_LENS tokens of each request.
    row_token = torch.cat(
        [
            torch.arange(c - q, c, device=dev) + int(token_start_loc[b])
            for b, (c, q) in enumerate(zip(CTX_LENS, QUERY_LENS, strict=True))
        ]
    )
    num_rows = row_token.numel()
    q_c, kv_c, k_pe, index_k = gemm_slices(num_tokens, seed=seed)
    qw, kvw, kw, kb = norm_weights(seed=seed + 1)
    g = torch.Generator(device="cuda").manual_seed(seed + 2)
    q_index = torch.randn(num_rows, INDEX_HEADS, D, device=dev, generator=g).bfloat16()
    head_w = torch.randn(num_rows, INDEX_HEADS, device=dev, generator=g)
    q_in, weights = fp8_indexer_query(q_index, head_w)
    q_mla = (
        torch.randn(num_rows, MLA_HEADS, KV_LORA + 64, device=dev, generator=g) * 0.5
    ).bfloat16()
    batch = SimpleNamespace(
        lens=lens,
        token_start_loc=token_start_loc,
        positions=positions,
        num_tokens=num_tokens,
        query_lens_cpu=query_lens,
        query_start_loc_cpu=query_start_loc_cpu,
        query_start_loc=query_start_loc_cpu.to(dev),
        row_token=row_token,
        row_pos=positions[row_token],
        row_req=torch.repeat_interleave(
            torch.arange(num_reqs, dtype=torch.int32, device=dev),
            query_lens.to(dev),
        ),
        num_rows=num_rows,
        inputs=SimpleNamespace(index_k=index_k, kw=kw, kb=kb),
        kv_normed=reference.rms_norm(kv_c, kvw, EPS),
        k_pe=k_pe.contiguous(),
        q_index=q_index,
        head_w=head_w,
        q_in=q_in,
        weights=weights,
        q_mla=q_mla,
    )
    one = _rank(v, batch, 1, 0, interleave, block_tokens, seed=seed + 3)
    ranks = [
        _rank(v, batch, DCP, r, interleave, block_tokens, seed=seed + 4 + r)
        for r in range(DCP)
    ]
    dg = deep_gemm_module()
    for r in [one, *ranks]:
        _prefill_indexer(v, dg, batch, r)
    merged = dcp_merge_reference(
        [r.dense for r in ranks], [r.topk for r in ranks], interleave, TOPK
    )
    return SimpleNamespace(
        v=v,
        interleave=interleave,
        block_tokens=block_tokens,
        batch=batch,
        one=one,
        ranks=ranks,
        merged=merged,
    )


def _owned(dcp2, rank: int) -> torch.Tensor:
    """Which tokens of the batch DCP's interleave gives ``rank``."""
    return (dcp2.batch.positions // dcp2.interleave) % DCP == rank


def test_dcp2_prefill_slots_give_each_token_to_one_rank(dcp2):
    b = dcp2.block_tokens
    for r in [dcp2.one, *dcp2.ranks]:
        mine = r.slots >= 0
        if r.world == 1:
            assert mine.all()
        else:
            assert torch.equal(mine, _owned(dcp2, r.rank)), (
                f"rank {r.rank} owns wrong tokens"
            )
        assert r.slots[mine].unique().numel() == int(mine.sum())
        assert torch.equal(
            r.index_slots, kernel_page_slots(r.slots, b, BLOCK, r.page_stride)
        ), (
            f"rank {r.rank}/{r.world}: the indexer slots (get_compressed_slot_mapping "
            "over the kernel block table) differ from the MLA slots remapped to "
            "kernel pages"
        )


def test_dcp2_prefill_caches_hold_one_ranks_bytes(dcp2):
    """At each token's slot a rank holds the bytes the single rank holds for
    that token, in both caches; every other indexer page slot, MLA slot and
    padding byte keeps the sentinel."""
    one = dcp2.one
    for r in [one, *dcp2.ranks]:
        mine = r.slots >= 0
        local, single = r.slots[mine], one.slots[mine]
        local_idx, single_idx = r.index_slots[mine], one.index_slots[mine]
        assert torch.equal(
            index_entries(r.caches, local_idx), index_entries(one.caches, single_idx)
        ), f"rank {r.rank}/{r.world}: indexer keys differ from one rank's"
        mla = mla_entries(r.caches)
        assert torch.equal(mla[local], mla_entries(one.caches)[single]), (
            f"rank {r.rank}/{r.world}: fp8_ds_mla entries differ from one rank's"
        )
        untouched = torch.ones(mla.shape[0], dtype=torch.bool, device="cuda")
        untouched[local] = False
        assert (mla[untouched] == SENTINEL).all(), (
            f"rank {r.rank}/{r.world}: MLA slots it does not own were written"
        )
        page_slots = r.caches.index_page_slots()
        others = page_slots[~torch.isin(page_slots, local_idx)]
        assert (index_entries(r.caches, others) == SENTINEL).all(), (
            f"rank {r.rank}/{r.world}: indexer slots it does not own were written"
        )
        assert (r.caches.buf[:, r.caches.used :] == SENTINEL).all(), (
            f"rank {r.rank}/{r.world}: the row padding was written"
        )


def test_dcp2_prefill_chunk_bounds(dcp2):
    """vLLM's ``build_prefill_chunk_metadata`` per rank: the local lengths of
    each chunk's requests, each row's local start (``cu_seqlen_ks``) and its
    causal local bound (``cu_seqlen_ke``) are what the slot mapping gives
    that rank."""
    batch = dcp2.batch
    starts = batch.token_start_loc.tolist()
    for r in [dcp2.one, *dcp2.ranks]:
        who = f"rank {r.rank}/{r.world}"
        own = (r.slots >= 0).to(torch.int64)
        per_req = [int(own[a:b].sum()) for a, b in itertools.pairwise(starts)]
        # Tokens of its request the rank holds at positions <= each token's.
        cum = own.cumsum(0)
        before = torch.tensor(
            [0, *(int(cum[a - 1]) for a in starts[1:-1])], device="cuda"
        )
        upto = cum - torch.repeat_interleave(before, batch.lens.long())
        assert r.chunks, f"{who}: no prefill chunk"
        assert (r.row_len >= 0).all(), f"{who}: a prefill row has no chunk"
        for c in r.chunks:
            lens = per_req[c.req.start : c.req.stop]
            got = c.meta.local_cu_seq_lens.diff().tolist()
            assert got == lens, (
                f"{who}: local lengths {got}, the slot mapping gives {lens}"
            )
            local_start = torch.tensor([0, *itertools.accumulate(lens)], device="cuda")
            req = batch.row_req[c.lo : c.hi].long() - c.req.start
            assert torch.equal(r.row_ks[c.lo : c.hi].long(), local_start[req]), (
                f"{who}: cu_seqlen_ks are not the requests' local starts"
            )
        want = upto[batch.row_token]
        bad = torch.nonzero(r.row_len.long() != want).flatten()
        assert bad.numel() == 0, (
            f"{who}: {bad.numel()} rows have a wrong causal bound, e.g. row "
            f"{int(bad[0])} at position {int(batch.row_pos[bad[0]])}: "
            f"{int(r.row_len[bad[0]])} local tokens, the slot mapping gives "
            f"{int(want[bad[0]])}"
        )


def test_dcp2_prefill_gathered_keys_are_one_ranks(dcp2):
    """``cp_gather_indexer_k_quant_cache`` per rank: the keys of the tokens it
    owns, request by request in position order, as one rank holds them."""
    one = dcp2.one
    for r in [one, *dcp2.ranks]:
        assert r.gathered, f"rank {r.rank}/{r.world}: nothing gathered"
        got = torch.cat(r.gathered)
        want = index_entries(one.caches, one.index_slots[r.slots >= 0])
        assert got.shape == want.shape, (
            f"rank {r.rank}/{r.world}: gathered {tuple(got.shape)}, expected "
            f"{tuple(want.shape)}"
        )
        assert torch.equal(got, want), (
            f"rank {r.rank}/{r.world}: gathered keys differ from one rank's at "
            f"{int((got != want).any(1).sum())} of {got.shape[0]} tokens"
        )


def test_dcp2_prefill_logits_equal_one_ranks(dcp2):
    batch, one = dcp2.batch, dcp2.one
    inputs = batch.inputs
    keys = reference.k_norm(inputs.index_k, inputs.kw, inputs.kb, EPS).float()
    starts = batch.token_start_loc.tolist()
    assert torch.equal(one.row_len.long(), batch.row_pos + 1)
    got, ref = [], []
    # Every fifth row against a torch reference of the unquantized inputs.
    sample = torch.arange(0, batch.num_rows, 5, device="cuda")
    for b, length in enumerate(CTX_LENS):
        rows = sample[batch.row_req[sample] == b]
        k = keys[starts[b] : starts[b] + length]
        scores = torch.relu(torch.einsum("rhd,kd->rhk", batch.q_index[rows].float(), k))
        want = (scores * batch.head_w[rows].unsqueeze(-1)).sum(1)
        valid = (
            torch.arange(length, device="cuda")[None, :] <= batch.row_pos[rows, None]
        )
        assert torch.isfinite(one.dense[rows, :length][valid]).all()
        got.append(one.dense[rows, :length][valid])
        ref.append(want[valid])
    diff = calc_diff(torch.cat(got), torch.cat(ref))
    print(f"METRIC dcp2-prefill one-rank logits calc_diff={diff:.3e}")
    assert diff < 1e-3, f"one-rank prefill logits calc_diff {diff:.2e}"
    for r in dcp2.ranks:
        width = int(r.row_len.max())
        local = torch.arange(width, device="cuda")
        glob = dcp_global_positions(local, r.rank, DCP, dcp2.interleave)
        valid = local[None, :] < r.row_len[:, None].long()
        mine = r.dense[:, :width]
        theirs = one.dense.gather(
            1, glob.clamp(max=one.dense.shape[1] - 1).expand(batch.num_rows, -1)
        )
        assert torch.isfinite(mine[valid]).all(), f"rank {r.rank}: non-finite logits"
        assert torch.isfinite(theirs[valid]).all(), (
            f"rank {r.rank}: its positions lie past one rank's causal bound"
        )
        worst = float((mine[valid] - theirs[valid]).abs().max())
        print(f"METRIC dcp2-prefill rank={r.rank} logits max_abs_diff={worst:.3e}")
        torch.testing.assert_close(mine[valid], theirs[valid], rtol=1e-3, atol=1e-3)


def test_dcp2_prefill_local_topk_equals_torch(dcp2):
    """vLLM's ``top_k_per_row_prefill`` on each rank's logits selects what
    torch's top-k of the same logits selects."""
    for r in [dcp2.one, *dcp2.ranks]:
        values, idx = r.dense.topk(TOPK, dim=1)
        want = idx.to(torch.int32).masked_fill(torch.isinf(values), -1)
        _assert_same_rows(
            r.topk, want, r.dense, r.row_len.long(), f"local-topk-{r.rank}/{r.world}"
        )


def test_dcp2_prefill_merged_topk_equals_one_ranks(dcp2):
    """The torch merge of the ranks' local top-k selects one rank's tokens."""
    lengths = dcp2.batch.row_pos + 1
    _assert_same_rows(dcp2.merged, dcp2.one.topk, dcp2.one.dense, lengths, "merge")


def test_dcp2_prefill_vllms_merge_equals_one_ranks(dcp2):
    """vLLM's DCP merge per prefill chunk (``_merge_dcp_topk_global`` without
    the collective: its pack kernel per rank with ``row_starts`` None as on
    CUDA, the all-gather as a concatenation in rank order, its CuTe DSL
    selector) selects one rank's tokens."""
    pack, select = cutedsl_dcp_merge()
    merged = torch.full_like(dcp2.one.topk, -1)
    for chunks in zip(*(r.chunks for r in dcp2.ranks), strict=True):
        lo, hi = chunks[0].lo, chunks[0].hi
        packed = []
        for r, c in zip(dcp2.ranks, chunks, strict=True):
            assert (c.lo, c.hi) == (lo, hi), "the ranks chunk the rows differently"
            assert c.logits is not None, f"rank {r.rank}: a chunk without logits"
            topk = r.topk[lo:hi].clone()
            candidates = torch.empty(
                (*topk.shape, 2), dtype=torch.float32, device="cuda"
            )
            pack(c.logits, topk, candidates, r.rank, DCP, dcp2.interleave, None)
            packed.append(candidates)
        out = merged[lo:hi]
        select(torch.cat(packed, dim=1), TOPK, out=out)
    lengths = dcp2.batch.row_pos + 1
    _assert_same_rows(merged, dcp2.one.topk, dcp2.one.dense, lengths, "vllm-merge")
    _assert_same_rows(merged, dcp2.merged, dcp2.one.dense, lengths, "vllm-vs-torch")


def test_dcp2_prefill_sparse_mla_equals_one_ranks(dcp2):
    """FlashMLA sparse per rank at one rank's top-k (the selection taken out
    of the comparison), localized by vLLM's converter and combined as its DCP
    does, against one rank."""
    v, op, batch = dcp2.v, flashmla_sparse_decode_op(), dcp2.batch
    topk = dcp2.one.topk
    out_one, lse_one, _ = _sparse_mla(v, op, batch.q_mla, dcp2.one, topk, batch)
    parts = [_sparse_mla(v, op, batch.q_mla, r, topk, batch) for r in dcp2.ranks]
    owned = sum((indices >= 0).sum(-1) for _, _, indices in parts)
    expected = (topk >= 0).sum(-1)
    bad = torch.nonzero(owned != expected).flatten()
    assert bad.numel() == 0, (
        f"the ranks own {int(owned[bad[0]])} of row {int(bad[0])}'s "
        f"{int(expected[bad[0]])} selected tokens ({bad.numel()} rows wrong)"
    )
    assert torch.isfinite(out_one).all() and torch.isfinite(lse_one).all()
    total, lse, magnitude = _dcp_combine(v, parts, batch)
    assert torch.isfinite(total).all() and torch.isfinite(lse).all()
    lse_err = float((lse - lse_one).abs().max())
    print(f"METRIC dcp2-prefill sparse-mla lse_err={lse_err:.3e}")
    torch.testing.assert_close(lse, lse_one, rtol=1e-4, atol=1e-3)
    _assert_output_close(total, magnitude, out_one, "sparse-mla")


def test_dcp2_prefill_end_to_end_equals_one_rank(dcp2):
    """The whole prefill path: each rank's sparse MLA at the merged top-k,
    combined, against one rank at its own top-k, on the rows whose merged
    selection is one rank's (the merge test bounds the others, ties)."""
    v, op, batch = dcp2.v, flashmla_sparse_decode_op(), dcp2.batch
    out_one, lse_one, _ = _sparse_mla(
        v, op, batch.q_mla, dcp2.one, dcp2.one.topk, batch
    )
    parts = [_sparse_mla(v, op, batch.q_mla, r, dcp2.merged, batch) for r in dcp2.ranks]
    total, lse, magnitude = _dcp_combine(v, parts, batch)
    same = _same_selection(dcp2.merged, dcp2.one.topk)
    print(f"METRIC dcp2-prefill end-to-end rows={int(same.sum())} of={same.numel()}")
    assert int(same.sum()) >= same.numel() * 0.99
    assert torch.isfinite(total[same]).all() and torch.isfinite(lse[same]).all()
    torch.testing.assert_close(lse[same], lse_one[same], rtol=1e-4, atol=1e-3)
    _assert_output_close(total[same], magnitude[same], out_one[same], "end-to-end")
