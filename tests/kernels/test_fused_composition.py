# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The fused forward's composition equals the unpacked one.

Fused: one GEMM over ``[q_a | kv_a | wk | weights_proj]``, the DSA prologue
(norms + both cache inserts + top-k fill), one GEMM over ``[q_b | wq_index]``,
the query quantization. Unpacked: six GEMMs, torch norms, the fp8_ds_mla
reference writer, the separate indexer key insert kernel. Both must leave the
same caches and the same outputs, at Kimi K3.1 dimensions on one TP-8 rank.
"""

import pytest
import torch
from dsa_gpu_utils import requires_kernels

from vllm.models.kimi_k3.nvidia.dsa_ops.formats import fp8_ds_mla_entry

Q_LORA, KV_LORA, ROPE, INDEX_DIM, INDEX_HEADS = 1536, 512, 64, 128, 32
LOCAL_HEADS, QK_HEAD = 12, 192  # 96 heads at TP 8, nope 128 + rope 64
HIDDEN, BLOCK, EPS, TOPK = 2048, 64, 1e-5, 2048
SENTINEL = 0xA5

pytestmark = [pytest.mark.gpu, requires_kernels]


def _slots(num_tokens: int, num_blocks: int, gen: torch.Generator) -> torch.Tensor:
    slots = torch.randperm(num_blocks * BLOCK, generator=gen)[:num_tokens]
    slots[torch.rand(num_tokens, generator=gen) < 0.1] = -1  # padded tokens
    return slots.cuda()


def _code_mismatch_fraction(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a != b).float().mean().item()


@pytest.mark.parametrize("num_tokens", [1, 37, 512])
def test_packed_composition_matches_unpacked(num_tokens: int):
    from vllm.models.kimi_k3.nvidia.dsa_ops.fused_prologue import dsa_fused_prologue
    from vllm.models.kimi_k3.nvidia.dsa_ops.indexer_k_insert import (
        indexer_k_norm_quant_insert,
    )
    from vllm.models.kimi_k3.nvidia.dsa_ops.indexer_q_quant import indexer_q_quant
    from vllm.models.kimi_k3.nvidia.dsa_ops.reference import rms_norm

    gen = torch.Generator().manual_seed(num_tokens)
    dev, bf16 = "cuda", torch.bfloat16

    def weight(rows: int, cols: int) -> torch.Tensor:
        return (torch.randn(rows, cols, generator=gen) * cols**-0.5).to(dev, bf16)

    x = torch.randn(num_tokens, HIDDEN, generator=gen).to(dev, bf16)
    w_qa, w_kva = weight(Q_LORA, HIDDEN), weight(KV_LORA + ROPE, HIDDEN)
    w_wk, w_wp = weight(INDEX_DIM, HIDDEN), weight(INDEX_HEADS, HIDDEN)
    w_qb, w_qi = (
        weight(LOCAL_HEADS * QK_HEAD, Q_LORA),
        weight(INDEX_HEADS * INDEX_DIM, Q_LORA),
    )
    q_norm_w = (1 + 0.1 * torch.randn(Q_LORA, generator=gen)).to(dev, bf16)
    kv_norm_w = (1 + 0.1 * torch.randn(KV_LORA, generator=gen)).to(dev, bf16)
    k_norm_w = (1 + 0.1 * torch.randn(INDEX_DIM, generator=gen)).to(dev)
    k_norm_b = (0.1 * torch.randn(INDEX_DIM, generator=gen)).to(dev)
    num_blocks = num_tokens // BLOCK + 3
    mla_slots = _slots(num_tokens, num_blocks, gen)
    index_slots = mla_slots.clone()
    weight_scale = INDEX_DIM**-0.5 * INDEX_HEADS**-0.5

    def caches() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        mla = torch.full((num_blocks, BLOCK, 656), SENTINEL, dtype=torch.uint8)
        index = torch.full((num_blocks, BLOCK, 132), SENTINEL, dtype=torch.uint8)
        topk = torch.full((num_tokens + 8, TOPK), 7, dtype=torch.int32)
        return mla.to(dev), index.to(dev), topk.to(dev)

    # Fused: packed weights, one prologue launch.
    mla_f, index_f, topk_f = caches()
    packed_in = torch.cat([w_qa, w_kva, w_wk, w_wp])
    packed_q = torch.cat([w_qb, w_qi])
    y = torch.nn.functional.linear(x, packed_in)
    q_c, kv_c, k_pe, index_k, index_w = y.split(
        [Q_LORA, KV_LORA, ROPE, INDEX_DIM, INDEX_HEADS], dim=-1
    )
    q_c_f, kv_c_f = dsa_fused_prologue(
        q_c,
        kv_c,
        k_pe,
        index_k,
        q_norm_w,
        kv_norm_w,
        k_norm_w,
        k_norm_b,
        EPS,
        topk_f,
        mla_f,
        mla_slots,
        index_f,
        index_slots,
    )
    z = torch.nn.functional.linear(q_c_f, packed_q)
    q_f, index_q_f = z.split([LOCAL_HEADS * QK_HEAD, INDEX_HEADS * INDEX_DIM], -1)
    q8_f, scale_f, qw_f = indexer_q_quant(
        index_q_f.view(-1, INDEX_HEADS, INDEX_DIM), index_w, weight_scale, 32
    )

    # Unpacked: six GEMMs, torch norms, reference MLA writer, separate insert.
    mla_u, index_u, topk_u = caches()
    q_c_u = rms_norm(torch.nn.functional.linear(x, w_qa), q_norm_w, EPS)
    kv = torch.nn.functional.linear(x, w_kva)
    kv_c_u = rms_norm(kv[:, :KV_LORA], kv_norm_w, EPS)
    keep = mla_slots >= 0
    entries = fp8_ds_mla_entry(kv_c_u, kv[:, KV_LORA:].contiguous())[keep]
    mla_u.view(-1, 656)[mla_slots[keep]] = entries
    indexer_k_norm_quant_insert(
        torch.nn.functional.linear(x, w_wk),
        k_norm_w,
        k_norm_b,
        EPS,
        index_slots,
        index_u,
        topk_u,
        num_tokens,
    )
    q_u = torch.nn.functional.linear(q_c_u, w_qb)
    q8_u, scale_u, qw_u = indexer_q_quant(
        torch.nn.functional.linear(q_c_u, w_qi).view(-1, INDEX_HEADS, INDEX_DIM),
        torch.nn.functional.linear(x, w_wp),
        weight_scale,
        32,
    )

    # Packed and separate GEMMs may round differently in the last bit (other
    # tilings): outputs within bf16 rounding, cache codes at most rarely apart.
    torch.testing.assert_close(q_c_f, q_c_u, atol=0, rtol=2**-7)
    torch.testing.assert_close(kv_c_f, kv_c_u, atol=0, rtol=2**-7)
    torch.testing.assert_close(q_f, q_u, atol=1e-2, rtol=2**-7)
    assert torch.equal(topk_f, topk_u)
    assert torch.all(topk_f[:num_tokens] == -1)
    assert torch.all(topk_f[num_tokens:] == 7)
    # Untouched slots keep the sentinel in both.
    assert torch.equal(
        mla_f.view(-1, 656)[~_written(mla_slots, num_blocks)],
        mla_u.view(-1, 656)[~_written(mla_slots, num_blocks)],
    )
    assert torch.all(mla_f.view(-1, 656)[~_written(mla_slots, num_blocks)] == SENTINEL)
    assert _code_mismatch_fraction(mla_f, mla_u) < 1e-3
    assert _code_mismatch_fraction(index_f, index_u) < 1e-3
    assert (
        _code_mismatch_fraction(q8_f.view(torch.uint8), q8_u.view(torch.uint8)) < 1e-3
    )
    torch.testing.assert_close(qw_f, qw_u, atol=0, rtol=2**-6)
    assert scale_f is None and scale_u is None  # fp8: folded into the weights


def _written(slots: torch.Tensor, num_blocks: int) -> torch.Tensor:
    mask = torch.zeros(num_blocks * BLOCK, dtype=torch.bool, device=slots.device)
    mask[slots[slots >= 0]] = True
    return mask
