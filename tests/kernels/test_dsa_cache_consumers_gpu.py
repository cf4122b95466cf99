# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""vLLM 0.33.0's own consumer kernels read the caches our kernels write.

DeepGEMM ``fp8_fp4_paged_mqa_logits`` reads an indexer cache written by our
insert kernel; FlashMLA ``sparse_decode_fwd`` reads an ``fp8_ds_mla`` cache
written by our prologue. Both come from the vllm==0.33.0 wheel, extracted by
``tools/extract_vllm_consumers.sh`` into ``.device/`` (or
``$KIMI_K3_DEVICE_DIR``), so the tests run where vLLM is not installed.
"""

import math
import sys

import pytest
import torch
from dsa_gpu_utils import (
    BLOCK,
    DEVICE_DIR,
    EPS,
    SENTINEL,
    PackedCaches,
    gemm_slices,
    norm_weights,
    requires_consumers,
    requires_kernels,
)

from vllm.models.kimi_k3.common import dsa_formats
from vllm.models.kimi_k3.nvidia.dsa_ops import formats as F
from vllm.models.kimi_k3.nvidia.dsa_ops import reference
from vllm.models.kimi_k3.nvidia.dsa_ops.fused_prologue import dsa_fused_prologue
from vllm.models.kimi_k3.nvidia.dsa_ops.indexer_k_insert import (
    indexer_k_norm_quant_insert,
)

pytestmark = [pytest.mark.gpu, requires_kernels, requires_consumers]

H = 32  # indexer heads
D = 128


def _calc_diff(x: torch.Tensor, y: torch.Tensor) -> float:
    """DeepGEMM's similarity error: 1 - 2<x, y> / (|x|^2 + |y|^2)."""
    x, y = x.double(), y.double()
    return float(1 - 2 * (x * y).sum() / (x * x + y * y).sum())


def _deep_gemm():
    if str(DEVICE_DIR) not in sys.path:
        sys.path.insert(0, str(DEVICE_DIR))
    import deep_gemm

    return deep_gemm


def _paged_context(ctx_lens: list[int], num_blocks: int, seed: int):
    """Block tables over shuffled physical blocks and the slot of every
    (request, position)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    perm = torch.randperm(num_blocks, device="cuda", generator=g)
    max_blocks = max((c + BLOCK - 1) // BLOCK for c in ctx_lens)
    table = torch.zeros(len(ctx_lens), max_blocks, dtype=torch.int32, device="cuda")
    slots, start = [], 0
    for b, c in enumerate(ctx_lens):
        n = (c + BLOCK - 1) // BLOCK
        table[b, :n] = perm[start : start + n].int()
        start += n
        pos = torch.arange(c, device="cuda")
        slots.append(table[b, pos // BLOCK].long() * BLOCK + pos % BLOCK)
    return table, torch.cat(slots), max_blocks * BLOCK


@pytest.mark.parametrize("packed", [False, True], ids=["contiguous", "packed"])
@pytest.mark.parametrize("fp4", [False, True], ids=["fp8", "mxfp4"])
def test_deepgemm_paged_mqa_logits_reads_our_indexer_cache(fp4: bool, packed: bool):
    sm100 = F.use_mx_scales()
    if fp4 and not sm100:
        pytest.skip("MXFP4 paged MQA logits run on SM10x only (DeepGEMM)")
    dg = _deep_gemm()
    ctx_lens = [1, 200, 1031, 2048]
    num_blocks = sum((c + BLOCK - 1) // BLOCK for c in ctx_lens) + 3
    table, slots, max_len = _paged_context(ctx_lens, num_blocks, seed=3)
    n = slots.numel()
    _, _, kw, kb = norm_weights()
    _, _, _, index_k = gemm_slices(n, seed=11)
    entry = dsa_formats.indexer_entry_bytes(D, fp4)
    if packed:
        cache = PackedCaches(num_blocks, fp4).index
    else:
        cache = torch.zeros(num_blocks, BLOCK, entry, dtype=torch.uint8, device="cuda")
    topk = torch.empty(n, 8, dtype=torch.int32, device="cuda")
    indexer_k_norm_quant_insert(index_k, kw, kb, EPS, slots, cache, topk, n, fp4=fp4)
    if fp4:
        # kv_cache_as_quant_view (sparse_attn_indexer.py) for MXFP4.
        kv_view = cache.as_strided(
            (num_blocks, BLOCK, 1, entry), (cache.stride(0), entry, entry, 1)
        )
    else:
        kv_view = cache.unsqueeze(-2)

    b = len(ctx_lens)
    g = torch.Generator(device="cuda").manual_seed(4)
    q = torch.randn(b, 1, H, D, device="cuda", generator=g).bfloat16()
    w = torch.randn(b, H, device="cuda", generator=g)
    if fp4:
        q_vals, q_sf = F.mxfp4_quantize_rows(q)
        q_in = (q_vals.view(torch.int8), q_sf.view(torch.int32).squeeze(-1))
        weights = w.bfloat16()
    else:
        codes, e = F.fp8_quantize_rows(q, D)
        # vLLM folds the per-(token, head) q scale into the head weights.
        weights = w * F.exp2_int(e.squeeze(-1)).view(b, H)
        q_sf = None
        if sm100:  # mqa_logits_mx_inputs: unit MX scales, bf16 weights
            q_sf = torch.full((b, 1, H), 0x7F7F7F7F, dtype=torch.int32, device="cuda")
            weights = weights.bfloat16()
        q_in = (codes.view(torch.float8_e4m3fn), q_sf)
    context_lens = torch.tensor(ctx_lens, dtype=torch.int32, device="cuda").view(b, 1)
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    schedule = dg.get_paged_mqa_logits_metadata(context_lens, BLOCK, num_sms)
    logits = dg.fp8_fp4_paged_mqa_logits(
        q_in, kv_view, weights, context_lens, table, schedule, max_len
    ).float()

    k = reference.k_norm(index_k, kw, kb, EPS).float()
    got, ref, start = [], [], 0
    for i, c in enumerate(ctx_lens):
        scores = torch.relu(q[i, 0].float() @ k[start : start + c].T)  # [H, c]
        ref.append((scores * w[i].unsqueeze(-1)).sum(0))
        got.append(logits[i, :c])
        start += c
    got_all, ref_all = torch.cat(got), torch.cat(ref)
    assert torch.isfinite(got_all).all()
    # DeepGEMM's own criterion, over every valid logit of the batch (a single
    # logit is dominated by the fp8 rounding of q and k).
    diff = _calc_diff(got_all, ref_all)
    per_request = [f"{_calc_diff(a, b):.1e}" for a, b in zip(got, ref, strict=True)]
    print(f"METRIC deepgemm fp4={fp4} packed={packed} calc_diff={diff:.3e}")
    assert diff < 1e-3, f"calc_diff {diff:.2e} (per request: {per_request})"


@pytest.mark.parametrize("packed", [False, True], ids=["contiguous", "packed"])
def test_flashmla_sparse_decode_reads_our_ds_mla_cache(packed: bool):
    torch.ops.load_library(str(DEVICE_DIR / "_flashmla_C.abi3.so"))
    n_tok, nb, batch, h_q, topk_w = 700, 16, 3, 64, 256
    q_c, kv_c, k_pe, index_k = gemm_slices(n_tok, seed=21)
    qw, kvw, kw, kb = norm_weights()
    caches = PackedCaches(nb, False)
    g = torch.Generator(device="cuda").manual_seed(22)
    slots = torch.randperm(nb * BLOCK, device="cuda", generator=g)[:n_tok]
    topk_buf = torch.empty(n_tok, 2048, dtype=torch.int32, device="cuda")
    _, kv_out = dsa_fused_prologue(
        q_c, kv_c, k_pe, index_k, qw, kvw, kw, kb, EPS, topk_buf,
        caches.mla, slots, caches.index, slots,
    )  # fmt: skip
    # The packed view itself (block stride from the tensor) or a contiguous
    # [num_blocks, block, 656] copy of it.
    mla = caches.mla if packed else caches.mla.contiguous()
    q = (torch.randn(batch, 1, h_q, 576, device="cuda", generator=g) * 0.5).bfloat16()
    valid = [topk_w // 2, topk_w, 37]
    indices = torch.full((batch, 1, topk_w), -1, dtype=torch.int32, device="cuda")
    chosen = []
    for i, nv in enumerate(valid):
        tok = torch.randperm(n_tok, device="cuda", generator=g)[:nv]
        chosen.append(tok)
        indices[i, 0, :nv] = slots[tok].int()
    scale = 576**-0.5
    out, lse, _, _ = torch.ops._flashmla_C.sparse_decode_fwd(
        q, mla.unsqueeze(-2), indices, None, None, None, None, None, None, None,
        512, scale, None, False,
    )  # fmt: skip
    k_full = torch.cat((kv_out, k_pe), dim=-1).float()
    for i, tok in enumerate(chosen):
        kk = k_full[tok]
        p = torch.softmax((q[i, 0].float() @ kk.T) * scale, dim=-1)
        ref = (p @ kv_out[tok].float()).bfloat16()
        err = (out[i, 0].float() - ref.float()).abs().max().item()
        print(f"METRIC flashmla packed={packed} req={i} max_abs_err={err:.4f}")
        torch.testing.assert_close(out[i, 0], ref, rtol=0.065, atol=0.05)


def test_flashmla_sparse_decode_reads_split_mla_pages():
    """The Blackwell layout (forced on SM90 by VLLM_KIMI_K3_DSA_MLA_KERNEL_PAGES):
    a packed row of 256-token manager blocks holds an indexer run, an MLA run
    and padding to whole kernel pages of both; each cache is viewed as
    64-token pages (``split_packed_rows_into_kernel_pages``) and written at the
    remapped slots (``kernel_page_slots``). The bytes equal those written at
    manager slots through the unsplit MLA view, untouched bytes keep the
    sentinel, and FlashMLA sparse decode reads the page view at the remapped
    slots."""
    # Torch only, like the ops layer: importable where vLLM is not installed.
    from vllm.v1.worker.kernel_pages import (
        kernel_page_slots,
        split_packed_rows_into_kernel_pages,
    )

    torch.ops.load_library(str(DEVICE_DIR / "_flashmla_C.abi3.so"))
    block, nb, n_tok, batch, h_q, topk_w = 256, 8, 700, 3, 64, 256
    idx_entry = dsa_formats.indexer_entry_bytes(D, False)
    mla_page, idx_page = 64 * dsa_formats.DS_MLA_ENTRY_BYTES, 64 * idx_entry
    step = math.lcm(mla_page, idx_page)
    row = -(-block * (idx_entry + dsa_formats.DS_MLA_ENTRY_BYTES) // step) * step

    def row_views(buf: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        index = buf.as_strided((nb, block, idx_entry), (row, idx_entry, 1))
        mla = buf.as_strided(
            (nb, block, dsa_formats.DS_MLA_ENTRY_BYTES),
            (row, dsa_formats.DS_MLA_ENTRY_BYTES, 1),
            buf.storage_offset() + block * idx_entry,
        )
        return index, mla

    paged_buf = torch.full((nb, row), SENTINEL, dtype=torch.uint8, device="cuda")
    whole_buf = paged_buf.clone()
    index, mla = row_views(paged_buf)
    index_pages, index_stride = split_packed_rows_into_kernel_pages(index, 64)
    mla_pages, mla_stride = split_packed_rows_into_kernel_pages(mla, 64)
    assert (mla_stride, index_stride) == (row // mla_page, row // idx_page)

    g = torch.Generator(device="cuda").manual_seed(31)
    slots = torch.randperm(nb * block, device="cuda", generator=g)[:n_tok]
    slots[::37] = -1  # padded tokens write nothing
    idx_slots = kernel_page_slots(slots, block, 64, index_stride)
    mla_slots = kernel_page_slots(slots, block, 64, mla_stride)
    q_c, kv_c, k_pe, index_k = gemm_slices(n_tok, seed=32)
    qw, kvw, kw, kb = norm_weights()
    topk_buf = torch.empty(n_tok, 2048, dtype=torch.int32, device="cuda")
    _, kv_out = dsa_fused_prologue(
        q_c, kv_c, k_pe, index_k, qw, kvw, kw, kb, EPS, topk_buf,
        mla_pages, mla_slots, index_pages, idx_slots,
    )  # fmt: skip
    # The reference: the same keys at manager slots through the unsplit MLA
    # view (the indexer cache is split in production either way).
    whole_index, whole_mla = row_views(whole_buf)
    whole_index_pages, _ = split_packed_rows_into_kernel_pages(whole_index, 64)
    dsa_fused_prologue(
        q_c, kv_c, k_pe, index_k, qw, kvw, kw, kb, EPS, topk_buf,
        whole_mla, slots, whole_index_pages, idx_slots,
    )  # fmt: skip
    assert torch.equal(paged_buf, whole_buf)
    assert int((paged_buf != SENTINEL).sum()) > 0
    assert (
        paged_buf[:, block * (idx_entry + dsa_formats.DS_MLA_ENTRY_BYTES) :] == SENTINEL
    ).all()

    q = (torch.randn(batch, 1, h_q, 576, device="cuda", generator=g) * 0.5).bfloat16()
    written = torch.nonzero(slots >= 0).squeeze(1)
    valid = [topk_w // 2, topk_w, 37]
    indices = torch.full((batch, 1, topk_w), -1, dtype=torch.int32, device="cuda")
    chosen = []
    for i, nv in enumerate(valid):
        tok = written[torch.randperm(written.numel(), device="cuda", generator=g)[:nv]]
        chosen.append(tok)
        indices[i, 0, :nv] = mla_slots[tok].int()
    scale = 576**-0.5
    out, _, _, _ = torch.ops._flashmla_C.sparse_decode_fwd(
        q, mla_pages.unsqueeze(-2), indices, None, None, None, None, None, None,
        None, 512, scale, None, False,
    )  # fmt: skip
    k_full = torch.cat((kv_out, k_pe), dim=-1).float()
    for i, tok in enumerate(chosen):
        p = torch.softmax((q[i, 0].float() @ k_full[tok].T) * scale, dim=-1)
        ref = (p @ kv_out[tok].float()).bfloat16()
        err = (out[i, 0].float() - ref.float()).abs().max().item()
        print(f"METRIC flashmla kernel-pages req={i} max_abs_err={err:.4f}")
        torch.testing.assert_close(out[i, 0], ref, rtol=0.065, atol=0.05)
