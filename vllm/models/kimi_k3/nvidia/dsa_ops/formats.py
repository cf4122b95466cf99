# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Byte formats of the DSA caches, as pure-torch encoders (torch only): the
one copy the CUDA kernels and every reference share. Scales are powers of two
rounded up, with an exact ``ceil_log2``, so kernels match bit for bit."""

import torch

from vllm.models.kimi_k3.common.dsa_formats import (
    DS_MLA_TILE,
    E2M1_MAX,
    FP8_AMAX_FLOOR,
    FP8_E4M3_MAX,
    FP32_MIN_NORMAL_EXP,
    MXFP4_AMAX_FLOOR,
    MXFP4_BLOCK_SIZE,
    UE8M0_BIAS,
    UE8M0_MAX_EXP,
    UE8M0_MIN_EXP,
    indexer_scale_bytes,
    indexer_value_bytes,
)

# e2m1 magnitudes by code (bit 3 is the sign).
_E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def use_mx_scales(device: torch.device | str | int | None = None) -> bool:
    """Whether DeepGEMM's MQA logits read MX (UE8M0) scales (SM10x)."""
    if not torch.cuda.is_available():
        return False
    if isinstance(device, torch.device) and device.type != "cuda":
        return False
    return torch.cuda.get_device_capability(device)[0] == 10


def ceil_log2(x: torch.Tensor) -> torch.Tensor:
    """Exact ``ceil(log2(x))`` of positive fp32 values, as int32."""
    mantissa, exponent = torch.frexp(x.float())
    return (exponent - (mantissa == 0.5).to(exponent.dtype)).to(torch.int32)


def exp2_int(e: torch.Tensor) -> torch.Tensor:
    """Exact fp32 ``2**e`` of int32 exponents in [-126, 127]."""
    e = e.to(torch.int32).clamp(FP32_MIN_NORMAL_EXP, UE8M0_MAX_EXP)
    return ((e + UE8M0_BIAS) << 23).view(torch.float32)


def ue8m0_byte(e: torch.Tensor) -> torch.Tensor:
    """UE8M0 byte (biased exponent) of int32 exponents in [-127, 127]."""
    e = e.to(torch.int32).clamp(UE8M0_MIN_EXP, UE8M0_MAX_EXP)
    return (e + UE8M0_BIAS).to(torch.uint8)


def pack_ue8m0_x4(e: torch.Tensor) -> torch.Tensor:
    """Four equal UE8M0 bytes per exponent (SM10x's scale word)."""
    return ue8m0_byte(e).unsqueeze(-1).expand(*e.shape, 4).contiguous()


def fp32_bytes(x: torch.Tensor) -> torch.Tensor:
    """Little-endian bytes of fp32 values, shape ``[..., 4]`` uint8."""
    return x.float().contiguous().view(torch.uint8).view(*x.shape, 4)


def fp8_e4m3_encode(x: torch.Tensor) -> torch.Tensor:
    """fp8 e4m3fn codes (uint8) of fp32 values, saturating at +-448."""
    x = x.float().clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX)
    return x.to(torch.float8_e4m3fn).view(torch.uint8)


def fp8_e4m3_decode(codes: torch.Tensor) -> torch.Tensor:
    """fp32 values of fp8 e4m3fn codes (uint8)."""
    return codes.view(torch.float8_e4m3fn).float()


def fp8_pow2_scale_exponent(
    amax: torch.Tensor, clamp_after_divide: bool = False
) -> torch.Tensor:
    """Exponent ``e`` of the power-of-two scale ``2**e >= amax / 448``;
    ``clamp_after_divide`` matches vLLM's DS-MLA writer, else its indexer-key
    writer."""
    amax = amax.float()
    if clamp_after_divide:
        ratio = (amax * (1.0 / FP8_E4M3_MAX)).clamp_min(FP8_AMAX_FLOOR)
    else:
        ratio = amax.clamp_min(FP8_AMAX_FLOOR) / FP8_E4M3_MAX
    return ceil_log2(ratio)


def fp8_quantize_rows(
    x: torch.Tensor, group: int, clamp_after_divide: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp8 codes of ``x [..., n]`` and one scale exponent per ``group``
    values."""
    x = x.float()
    xg = x.unflatten(-1, (x.shape[-1] // group, group))
    e = fp8_pow2_scale_exponent(xg.abs().amax(-1), clamp_after_divide)
    codes = fp8_e4m3_encode(xg * exp2_int(-e).unsqueeze(-1))
    return codes.flatten(-2), e


def e2m1_encode(x: torch.Tensor) -> torch.Tensor:
    """e2m1 nibbles (uint8 0..15) of fp32 values, round to nearest even;
    bit 3 is the sign."""
    x = x.float()
    a = x.abs()
    mag = torch.zeros_like(a, dtype=torch.int32)
    bounds = (
        (0.25, False),
        (0.75, True),
        (1.25, False),
        (1.75, True),
        (2.5, False),
        (3.5, True),
        (5.0, False),
    )
    for bound, tie_up in bounds:
        mag += (a >= bound if tie_up else a > bound).to(torch.int32)
    sign = (torch.signbit(x)).to(torch.int32) << 3
    return (mag | sign).to(torch.uint8)


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    """fp32 values of e2m1 nibbles (uint8 0..15)."""
    table = torch.tensor(_E2M1_VALUES, dtype=torch.float32, device=codes.device)
    c = codes.to(torch.int64)
    mag = table[c & 7]
    return torch.where((c & 8) != 0, -mag, mag)


def mxfp4_quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP4 ``x [..., n]``: packed e2m1 pairs (even element low) and one
    UE8M0 byte per 32 values."""
    x = x.float()
    xg = x.unflatten(-1, (x.shape[-1] // MXFP4_BLOCK_SIZE, MXFP4_BLOCK_SIZE))
    amax = xg.abs().amax(-1).clamp_min(MXFP4_AMAX_FLOOR)
    e = ceil_log2(amax * (1.0 / E2M1_MAX)).clamp(UE8M0_MIN_EXP, UE8M0_MAX_EXP)
    nib = e2m1_encode(xg * exp2_int(-e).unsqueeze(-1))
    nib = nib.flatten(-2).to(torch.int32)
    packed = (nib[..., 0::2] | (nib[..., 1::2] << 4)).to(torch.uint8)
    return packed, ue8m0_byte(e)


def mxfp4_dequantize_rows(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """fp32 values of MXFP4 rows (inverse of ``mxfp4_quantize_rows``)."""
    p = packed.to(torch.int32)
    nib = torch.stack((p & 15, p >> 4), dim=-1).flatten(-2).to(torch.uint8)
    vals = e2m1_decode(nib).unflatten(-1, (scales.shape[-1], MXFP4_BLOCK_SIZE))
    e = scales.to(torch.int32) - UE8M0_BIAS
    return (vals * exp2_int(e).unsqueeze(-1)).flatten(-2)


def indexer_fp8_entry(
    k: torch.Tensor, mx_scales: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp8 indexer entries of keys ``k [T, D]``: values and scale bytes."""
    codes, e = fp8_quantize_rows(k, k.shape[-1])
    e = e.squeeze(-1)
    scale = pack_ue8m0_x4(e) if mx_scales else fp32_bytes(exp2_int(e))
    return codes, scale


def indexer_block_views(
    kv_cache: torch.Tensor, head_dim: int, fp4: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, scales) views of a uint8 indexer cache
    ``[blocks, block_size, entry]``, value rows first in each block."""
    if kv_cache.dtype != torch.uint8 or kv_cache.dim() != 3:
        raise ValueError(
            "indexer cache must be uint8 [blocks, block_size, entry], got "
            f"{kv_cache.dtype} {tuple(kv_cache.shape)}"
        )
    num_blocks, block_size, entry = kv_cache.shape
    vb = indexer_value_bytes(head_dim, fp4)
    sb = indexer_scale_bytes(head_dim, fp4)
    if entry != vb + sb:
        raise ValueError(
            f"indexer cache entry is {entry} bytes, but head dim {head_dim} "
            f"{'MXFP4' if fp4 else 'fp8'} keys take {vb} + {sb}"
        )
    bs = kv_cache.stride(0)
    values = kv_cache.as_strided((num_blocks, block_size, vb), (bs, vb, 1))
    scales = kv_cache.as_strided(
        (num_blocks, block_size, sb),
        (bs, sb, 1),
        kv_cache.storage_offset() + block_size * vb,
    )
    return values, scales


def fp8_ds_mla_entry(kv_normed: torch.Tensor, k_pe: torch.Tensor) -> torch.Tensor:
    """``fp8_ds_mla`` entries ``[T, 656]`` uint8 of ``kv_normed [T, 512]`` and
    ``k_pe [T, 64]``."""
    codes, e = fp8_quantize_rows(kv_normed, DS_MLA_TILE, clamp_after_divide=True)
    scales = fp32_bytes(exp2_int(e)).flatten(-2)
    rope = k_pe.to(torch.bfloat16).contiguous().view(torch.uint8)
    return torch.cat((codes, scales, rope), dim=-1)
