# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Hand-worked CPU cases of the cache-writer references (the contract of the
CUDA insert and prologue kernels): formats, layouts, skips and fills."""

import pytest
import torch

from vllm.models.kimi_k3.common import dsa_formats
from vllm.models.kimi_k3.nvidia.dsa_ops import formats as F
from vllm.models.kimi_k3.nvidia.dsa_ops import reference
from vllm.models.kimi_k3.nvidia.dsa_ops.fused_prologue import dsa_fused_prologue
from vllm.models.kimi_k3.nvidia.dsa_ops.indexer_k_insert import (
    check_slot_bounds,
    indexer_k_norm_quant_insert,
    resolve_mx_scales,
)

SENTINEL = 0xA5
D = 128


def _row(*head: float) -> torch.Tensor:
    x = torch.zeros(1, D)
    x[0, : len(head)] = torch.tensor(head)
    return x


def test_fp8_power_of_two_scale():
    # amax 3: 3 / 448 = 2^-7.22 -> scale 2^-7; 3 * 2^7 = 384 = 1.5 * 2^8 -> 0x7C
    codes, e = F.fp8_quantize_rows(_row(3.0, -1.5, 0.25), D)
    assert e.tolist() == [[-7]]
    assert codes[0, :3].tolist() == [0x7C, 0xF4, 0x60]  # 384, -192, 32
    assert F.fp8_e4m3_decode(codes[0, :3]).tolist() == [384.0, -192.0, 32.0]


def test_fp8_saturation_at_448():
    assert F.fp8_e4m3_encode(torch.tensor([448.0, 500.0, -1e4])).tolist() == [
        0x7E,
        0x7E,
        0xFE,
    ]
    # amax 448 * 2^3 is exactly representable: scale 2^3, code 448 (no NaN).
    codes, e = F.fp8_quantize_rows(_row(3584.0, -3584.0), D)
    assert e.item() == 3 and codes[0, :2].tolist() == [0x7E, 0xFE]


def test_both_scale_encodings():
    _, fp32 = F.indexer_fp8_entry(_row(3.0), mx_scales=False)
    _, mx = F.indexer_fp8_entry(_row(3.0), mx_scales=True)
    assert fp32[0].tolist() == [0x00, 0x00, 0x00, 0x3C]  # 2^-7 as fp32 (LE)
    assert mx[0].tolist() == [120] * 4  # -7 + 127, four times


def test_constant_row_layer_norm_is_bias():
    bias = torch.linspace(-1, 1, D)
    x = torch.full((2, D), 3.25).bfloat16()
    out = reference.k_norm(x, torch.randn(D), bias, 1e-5)
    assert torch.equal(out, bias.bfloat16().expand(2, D))


def test_all_zero_row_is_finite():
    k = reference.k_norm(
        torch.zeros(1, D).bfloat16(), torch.ones(D), torch.zeros(D), 1e-5
    )
    assert torch.isfinite(k.float()).all() and not k.float().any()
    codes, e = F.fp8_quantize_rows(k, D)
    assert e.item() == -22 and not codes.any()  # 1e-4 / 448 -> 2^-22
    packed, scales = F.mxfp4_quantize_rows(k)
    assert not packed.any() and scales.tolist() == [[1, 1, 1, 1]]  # 2^-126
    entry = F.fp8_ds_mla_entry(torch.zeros(1, 512).bfloat16(), torch.zeros(1, 64))
    scales = entry[:, 512:528].view(torch.float32)
    assert torch.isfinite(scales).all() and (scales == 2.0**-13).all()  # 1e-4


def test_e2m1_codes_round_to_nearest_even():
    x = torch.tensor([0.0, 0.25, 0.3, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0, -0.5, -6.0])
    assert F.e2m1_encode(x).tolist() == [0, 0, 1, 2, 2, 4, 4, 6, 6, 7, 9, 15]


def test_mxfp4_codes_for_chosen_values():
    block0 = [6.0, -6.0, 3.0, 0.75, 1.0, -0.5] + [0.0] * 26  # amax 6 -> 2^0
    block1 = [12.0, 2.0] + [0.0] * 30  # amax 12 -> 2^1: codes of 6 and 1
    x = torch.tensor([block0 + block1 + [0.0] * 64])
    packed, scales = F.mxfp4_quantize_rows(x)
    assert scales[0, :2].tolist() == [127, 128]
    # Low nibble = even element: (6, -6) -> 0xF7, (3, 0.75) -> 0x25, (1, -.5) -> 0x92
    assert packed[0, :3].tolist() == [0xF7, 0x25, 0x92]
    assert packed[0, 16].item() == 0x27  # (12, 2) / 2 = (6, 1)
    back = F.mxfp4_dequantize_rows(packed, scales)
    assert back[0, :6].tolist() == [6.0, -6.0, 3.0, 1.0, 1.0, -0.5]


def _cache(blocks: int, entry: int, pad: int = 0) -> torch.Tensor:
    """A sentinel-filled cache whose blocks are not contiguous (packed row)."""
    row = 64 * entry + pad
    buf = torch.full((blocks, row), SENTINEL, dtype=torch.uint8)
    return buf.as_strided((blocks, 64, entry), (row, entry, 1))


@pytest.mark.parametrize("fp4", [False, True])
def test_insert_layout_skips_and_topk_fill(fp4: bool):
    entry = dsa_formats.indexer_entry_bytes(D, fp4)
    cache = _cache(3, entry, pad=4096)
    x = torch.randn(4, D).bfloat16()
    w, b = torch.rand(D) + 0.5, torch.randn(D) * 0.1
    slots = torch.tensor([65, -1, 0, 130])
    topk = torch.full((6, 16), 7, dtype=torch.int32)
    reference.indexer_k_insert(x, w, b, 1e-5, slots, cache, topk, 5, fp4=fp4)
    k = reference.k_norm(x, w, b, 1e-5)
    if fp4:
        vals, scales = F.mxfp4_quantize_rows(k)
    else:
        vals, scales = F.indexer_fp8_entry(k, mx_scales=False)
    raw = cache.as_strided((3, 64 * entry + 4096), (cache.stride(0), 1))
    vb, sb = (
        dsa_formats.indexer_value_bytes(D, fp4),
        dsa_formats.indexer_scale_bytes(D, fp4),
    )
    expect = torch.full_like(raw, SENTINEL)
    for t, s in enumerate(slots.tolist()):
        if s < 0:
            continue
        blk, off = divmod(s, 64)
        expect[blk, off * vb : (off + 1) * vb] = vals[t]
        expect[blk, 64 * vb + off * sb : 64 * vb + (off + 1) * sb] = scales[t]
    assert torch.equal(raw, expect)
    assert (topk[:5] == -1).all() and (topk[5:] == 7).all()


def test_insert_empty_cache_touches_nothing():
    cache = torch.empty((0, 64, 132), dtype=torch.uint8)
    topk = torch.full((4, 8), 7, dtype=torch.int32)
    x = torch.randn(2, D).bfloat16()
    reference.indexer_k_insert(
        x, torch.ones(D), torch.zeros(D), 1e-5, torch.tensor([0, 1]), cache, topk, 2
    )
    assert (topk == 7).all()


def test_check_slot_bounds():
    cache = torch.zeros((2, 64, 132), dtype=torch.uint8)
    check_slot_bounds(torch.tensor([-1, 0, 127]), cache)
    for bad in ([128], [-2]):
        with pytest.raises(ValueError, match="slots"):
            check_slot_bounds(torch.tensor(bad), cache)


def test_mx_scales_choice():
    cpu = torch.device("cpu")
    assert resolve_mx_scales(False, None, cpu) is False  # CPU: fp32 words
    assert resolve_mx_scales(False, True, cpu) is True
    assert resolve_mx_scales(True, None, cpu) is False
    assert resolve_mx_scales(True, False, cpu) is False
    with pytest.raises(ValueError, match="mx_scales"):
        resolve_mx_scales(True, True, cpu)


def test_fp4_with_mx_scales_is_refused_before_launch():
    """The entry points refuse the pair before they need the extension."""
    q_c, kv_c, k_pe, index_k, (qw, kvw, kw, kb) = _prologue_inputs(2)
    topk = torch.full((2, 8), 7, dtype=torch.int32)
    cache = torch.zeros((1, 64, 68), dtype=torch.uint8)
    with pytest.raises(ValueError, match="mx_scales"):
        indexer_k_norm_quant_insert(
            index_k, kw, kb, 1e-5, torch.tensor([0, 1]), cache, topk, 2,
            fp4=True, mx_scales=True,
        )  # fmt: skip
    with pytest.raises(ValueError, match="mx_scales"):
        dsa_fused_prologue(
            q_c, kv_c, k_pe, index_k, qw, kvw, kw, kb, 1e-5, topk,
            fp4=True, mx_scales=True,
        )  # fmt: skip
    assert (topk == 7).all() and not cache.any()


def test_fp8_ds_mla_entry_layout():
    kv = torch.zeros(1, 512)
    kv[0, 0], kv[0, 128], kv[0, 300], kv[0, 511] = 3.0, -448.0, 0.5, 336.0
    k_pe = torch.randn(1, 64).bfloat16()
    entry = F.fp8_ds_mla_entry(kv.bfloat16(), k_pe)
    assert entry.shape == (1, dsa_formats.DS_MLA_ENTRY_BYTES) == (1, 656)
    scales = entry[0, 512:528].view(torch.float32).tolist()
    # 336/448 = 0.75 -> 2^0 (a non power-of-two scale would be 0.75)
    assert scales == [2.0**-7, 1.0, 2.0**-9, 1.0]
    assert entry[0, 0].item() == 0x7C and entry[0, 128].item() == 0xFE
    assert entry[0, 511].item() == F.fp8_e4m3_encode(torch.tensor(336.0)).item()
    assert torch.equal(entry[0, 528:], k_pe.view(torch.uint8)[0])


def _prologue_inputs(t: int):
    gemm = torch.randn(t, 1536 + 512 + 64 + 128 + 32).bfloat16()
    q_c, kv_c, k_pe, index_k, _ = gemm.split([1536, 512, 64, 128, 32], dim=-1)
    weights = (
        torch.rand(1536).bfloat16() + 0.5,
        torch.rand(512).bfloat16() + 0.5,
        torch.rand(D) + 0.5,
        torch.randn(D) * 0.1,
    )
    return q_c, kv_c, k_pe, index_k, weights


@pytest.mark.parametrize("fp4", [False, True])
def test_prologue_reference_writes_both_caches(fp4: bool):
    q_c, kv_c, k_pe, index_k, (qw, kvw, kw, kb) = _prologue_inputs(3)
    mla = torch.full((2, 64, 656), SENTINEL, dtype=torch.uint8)
    idx = _cache(2, dsa_formats.indexer_entry_bytes(D, fp4))
    topk = torch.full((4, 32), 7, dtype=torch.int32)
    mla_slots, idx_slots = torch.tensor([70, -1, 3]), torch.tensor([5, 64, -1])
    q_out, kv_out = reference.fused_prologue(
        q_c, kv_c, k_pe, index_k, qw, kvw, kw, kb, 1e-5, topk,
        mla, mla_slots, idx, idx_slots, fp4=fp4,
    )  # fmt: skip
    assert torch.equal(q_out, reference.rms_norm(q_c, qw, 1e-5))
    entries = F.fp8_ds_mla_entry(kv_out, k_pe)
    assert torch.equal(mla[1, 6], entries[0]) and torch.equal(mla[0, 3], entries[2])
    assert (mla[0, :3] == SENTINEL).all() and (mla[1, 7:] == SENTINEL).all()
    expect_idx = _cache(2, dsa_formats.indexer_entry_bytes(D, fp4))
    reference.indexer_k_insert(
        index_k, kw, kb, 1e-5, idx_slots, expect_idx, topk.clone(), 0, fp4=fp4
    )
    assert torch.equal(idx, expect_idx)
    assert (topk[:3] == -1).all() and (topk[3] == 7).all()


def test_prologue_reference_profiling_only_normalizes():
    q_c, kv_c, k_pe, index_k, (qw, kvw, kw, kb) = _prologue_inputs(2)
    topk = torch.full((2, 8), 7, dtype=torch.int32)
    q_out, kv_out = reference.fused_prologue(
        q_c, kv_c, k_pe, index_k, qw, kvw, kw, kb, 1e-5, topk
    )
    assert torch.equal(kv_out, reference.rms_norm(kv_c, kvw, 1e-5))
    assert (topk == 7).all()


def test_use_mx_scales_is_false_without_sm100():
    if torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 10:
        pytest.skip("an SM10x GPU is present")
    assert F.use_mx_scales() is False
    assert F.use_mx_scales(torch.device("cpu")) is False
