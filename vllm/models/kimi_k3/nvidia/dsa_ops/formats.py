# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Byte formats of the DSA caches, as pure-torch encoders (torch only).

These helpers are the contract that our CUDA kernels and every reference in
this package share; keeping one copy means a kernel and its reference cannot
drift apart on an encoding. All of them run on CPU and CUDA tensors. Their
numbers (dims, offsets, scale floors, bytes per token) live in
:mod:`vllm.models.kimi_k3.common.dsa_formats`, which the kernels mirror in
``csrc/kimi_k3/dsa_formats.h``.

Scales are powers of two chosen by rounding *up* (UE8M0 style): the quantized
magnitude then never exceeds the format's maximum, and the scale survives as
one exponent byte. ``ceil_log2`` is exact (``frexp``), unlike ``log2`` on a
GPU, so the kernels reproduce it bit for bit.

Formats (see docs/kernels.md for the full byte layouts):

- fp8 indexer key, per token: ``D`` fp8 e4m3 codes and 4 scale bytes (an fp32
  power of two for SM90 readers, or four equal UE8M0 bytes for SM100 readers,
  as vLLM 0.33.0's ``mqa_logits_use_mx_scales``). A 64-token cache block holds
  all value rows first, then all scale words.
- MXFP4 indexer key, per token: ``D / 2`` bytes of e2m1 pairs (low nibble =
  even element) and ``D / 32`` UE8M0 bytes, one per 32 values, segregated per
  block the same way.
- ``fp8_ds_mla`` entry (656 B): 512 fp8 e4m3 codes, 4 fp32 power-of-two scales
  (one per 128 values), 64 bf16 rope values.
"""

import torch

from vllm.models.kimi_k3.common.dsa_formats import (
    DS_MLA_TILE,
    E2M1_MAX,
    FP8_AMAX_FLOOR,
    FP8_E4M3_MAX,
    MXFP4_AMAX_FLOOR,
    MXFP4_BLOCK_SIZE,
    UE8M0_BIAS,
    indexer_scale_bytes,
    indexer_value_bytes,
)

# e2m1 magnitudes by code (bit 3 is the sign).
_E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def use_mx_scales(device: torch.device | str | int | None = None) -> bool:
    """True where DeepGEMM's MQA logits read MX (UE8M0) scales: the SM10x
    family, as vLLM 0.33.0's ``mqa_logits_use_mx_scales`` (without vLLM)."""
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
    """Exact fp32 ``2**e`` of int32 exponents in [-126, 127] (built from the
    exponent bits, so no ``pow`` rounding can enter)."""
    e = e.to(torch.int32).clamp(-126, 127)
    return ((e + UE8M0_BIAS) << 23).view(torch.float32)


def ue8m0_byte(e: torch.Tensor) -> torch.Tensor:
    """UE8M0 byte (biased exponent) of int32 exponents in [-127, 127]."""
    return (e.to(torch.int32) + UE8M0_BIAS).clamp(0, 254).to(torch.uint8)


def pack_ue8m0_x4(e: torch.Tensor) -> torch.Tensor:
    """Four equal UE8M0 bytes per exponent, shape ``[..., 4]`` uint8: the SM100
    form of a 128-wide row's scale word."""
    return ue8m0_byte(e).unsqueeze(-1).expand(*e.shape, 4).contiguous()


def fp32_bytes(x: torch.Tensor) -> torch.Tensor:
    """Little-endian bytes of fp32 values, shape ``[..., 4]`` uint8."""
    return x.float().contiguous().view(torch.uint8).view(*x.shape, 4)


def fp8_e4m3_encode(x: torch.Tensor) -> torch.Tensor:
    """fp8 e4m3fn codes (uint8) of fp32 values: round to nearest even, with
    saturation at +-448 (as ``cvt.rn.satfinite``)."""
    x = x.float().clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX)
    return x.to(torch.float8_e4m3fn).view(torch.uint8)


def fp8_e4m3_decode(codes: torch.Tensor) -> torch.Tensor:
    """fp32 values of fp8 e4m3fn codes (uint8)."""
    return codes.view(torch.float8_e4m3fn).float()


def fp8_pow2_scale_exponent(
    amax: torch.Tensor, clamp_after_divide: bool = False
) -> torch.Tensor:
    """Exponent ``e`` of the power-of-two scale ``2**e >= amax / 448``.

    Indexer keys (vLLM's ``_fp8_ue8m0_quantize``): ``max(amax, 1e-4) / 448``.
    ``fp8_ds_mla`` tiles (``clamp_after_divide``, vLLM's DS-MLA writer):
    ``max(amax * (1 / 448), 1e-4)``. Both round the ratio up to 2**e."""
    amax = amax.float()
    if clamp_after_divide:
        ratio = (amax * (1.0 / FP8_E4M3_MAX)).clamp_min(FP8_AMAX_FLOOR)
    else:
        ratio = amax.clamp_min(FP8_AMAX_FLOOR) / FP8_E4M3_MAX
    return ceil_log2(ratio)


def fp8_quantize_rows(
    x: torch.Tensor, group: int, clamp_after_divide: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x [..., n]`` to fp8 codes with one power-of-two scale per
    ``group`` consecutive values. Returns (codes uint8 [..., n], exponents
    int32 [..., n // group])."""
    x = x.float()
    xg = x.unflatten(-1, (x.shape[-1] // group, group))
    e = fp8_pow2_scale_exponent(xg.abs().amax(-1), clamp_after_divide)
    codes = fp8_e4m3_encode(xg * exp2_int(-e).unsqueeze(-1))
    return codes.flatten(-2), e


def e2m1_encode(x: torch.Tensor) -> torch.Tensor:
    """e2m1 nibbles (uint8 0..15) of fp32 values: round to nearest even,
    saturation at +-6; bit 3 is the sign (kept on a zero result)."""
    x = x.float()
    a = x.abs()
    # Interval midpoints; a tie goes to the even code (codes 0, 2, 4, 6).
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
    """MXFP4-quantize ``x [..., n]``: per 32 values a scale ``2**e`` with
    ``e = ceil(log2(max(amax, 6 * 2^-126) * (1 / 6)))``. Returns (packed
    uint8 [..., n // 2] with the even element in the low nibble, UE8M0 bytes
    uint8 [..., n // 32])."""
    x = x.float()
    xg = x.unflatten(-1, (x.shape[-1] // MXFP4_BLOCK_SIZE, MXFP4_BLOCK_SIZE))
    amax = xg.abs().amax(-1).clamp_min(MXFP4_AMAX_FLOOR)
    e = ceil_log2(amax * (1.0 / E2M1_MAX)).clamp(-127, 127)
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
    """fp8 indexer entries of keys ``k [T, D]`` (fp32 or bf16 values, used as
    given). Returns (values uint8 [T, D], scale word bytes uint8 [T, 4])."""
    codes, e = fp8_quantize_rows(k, k.shape[-1])
    e = e.squeeze(-1)
    scale = pack_ue8m0_x4(e) if mx_scales else fp32_bytes(exp2_int(e))
    return codes, scale


def indexer_block_views(
    kv_cache: torch.Tensor, head_dim: int, fp4: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, scales) views of an indexer cache ``[blocks, block_size,
    entry]`` uint8: per block ``block_size`` value rows, then ``block_size``
    scale rows. The block stride comes from the tensor (packed DSA rows)."""
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
    ``k_pe [T, 64]`` (bf16): 4 tiles of 128 fp8 codes with fp32 power-of-two
    scales, then the rope values as raw bf16."""
    codes, e = fp8_quantize_rows(kv_normed, DS_MLA_TILE, clamp_after_divide=True)
    scales = fp32_bytes(exp2_int(e)).flatten(-2)
    rope = k_pe.to(torch.bfloat16).contiguous().view(torch.uint8)
    return torch.cat((codes, scales, rope), dim=-1)
