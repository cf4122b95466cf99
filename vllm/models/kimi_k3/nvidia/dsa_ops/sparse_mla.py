# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Sparse MLA over an ``fp8_ds_mla`` cache for few query heads (Triton +
torch). FlashMLA's sparse kernels take 64 or 128 heads, so a TP rank of
Kimi K3.1 (12 heads at TP 8) pays for 64; this kernel runs heads in blocks
of 16 and splits each row's top-k across programs, so that one decode token
still fills the GPU. Absorbed form: the value is the 512-dim latent."""

import functools
import math
from typing import NamedTuple

import torch

from vllm.models.kimi_k3.common.dsa_formats import (
    DS_MLA_ENTRY_BYTES,
    DS_MLA_NOPE_DIM,
    DS_MLA_ROPE_DIM,
    DS_MLA_ROPE_OFFSET,
    DS_MLA_SCALE_OFFSET,
    DS_MLA_TILE,
)
from vllm.models.kimi_k3.nvidia.dsa_ops._triton import HAS_TRITON, tl, triton
from vllm.models.kimi_k3.nvidia.dsa_ops.formats import fp8_e4m3_decode
from vllm.models.kimi_k3.nvidia.dsa_ops.torch_path import runs_torch_path

QK_DIM = DS_MLA_NOPE_DIM + DS_MLA_ROPE_DIM
_BLOCK_H = 16
# Programs per SM a launch aims at, and the fewest keys a split takes (its
# partial output costs as much to write as 128 keys to read).
_PROGRAMS_PER_SM = 2
_MIN_SPLIT_KEYS = 128


class SparseMLATiles(NamedTuple):
    """The split kernel's launch shape: keys per loop step, warps, a register
    cap (``None``: the compiler's choice), the latent's dtype and the depth
    of Triton's software pipeline (``None``: its default). Two
    programs share an SM only at 128 registers or fewer. The bf16 latent
    takes each fp8 code through three quarter-rate ``cvt``; ``fp16_latent``
    widens codes with integer ops (exact: an e4m3 code's bits moved into an
    f16 are the code times 2**-8) and brings ``q`` into fp16's range by a
    power of two."""

    block_n: int = 64
    num_warps: int = 8
    maxnreg: int | None = 128
    fp16_latent: bool = False
    num_stages: int | None = None

    def compile_options(self) -> dict[str, int]:
        """Triton's launch options for this shape (unset ones left out)."""
        options = {"num_warps": self.num_warps}
        if self.maxnreg is not None:
            options["maxnreg"] = self.maxnreg
        if self.num_stages is not None:
            options["num_stages"] = self.num_stages
        return options


DEFAULT_TILES = SparseMLATiles()
# The launch shapes the benchmark compares: at sm_90 all but n32w8 run two
# programs an SM (tests/kernels/test_sparse_mla_sm90_resources.py).
TILE_CANDIDATES: dict[str, SparseMLATiles] = {
    "n64w8r128": DEFAULT_TILES,
    "n32w8": SparseMLATiles(32, 8, None),
    "n32w8r128": SparseMLATiles(32, 8, 128),
    "n16w8": SparseMLATiles(16, 8, None),
    "n32w8h": SparseMLATiles(32, 8, None, True),
    "n64w8hr128": SparseMLATiles(64, 8, 128, True),
    "n16w8h": SparseMLATiles(16, 8, None, True),
    # Five stages keep the next steps' gathers in flight.
    "n32w8s5": SparseMLATiles(32, 8, None, num_stages=5),
    "n64w8r128s5": SparseMLATiles(64, 8, 128, num_stages=5),
}


def _check_tiles(tiles: SparseMLATiles) -> None:
    if (
        tiles.block_n not in (16, 32, 64)
        or tiles.num_warps not in (4, 8, 16)
        or not (tiles.maxnreg is None or 64 <= tiles.maxnreg <= 255)
        or not (tiles.num_stages is None or 1 <= tiles.num_stages <= 6)
    ):
        raise ValueError(
            f"sparse_mla_fp8: tiles {tiles} out of range: block_n takes 16, 32 "
            "or 64, num_warps 4, 8 or 16, maxnreg None or 64 to 255, "
            "num_stages None or 1 to 6"
        )


def _check(q: torch.Tensor, kv_cache: torch.Tensor, indices: torch.Tensor) -> None:
    op = "sparse_mla_fp8"
    if q.dim() != 3 or q.dtype != torch.bfloat16 or q.shape[2] != QK_DIM:
        raise ValueError(
            f"{op}: q must be bf16 [tokens, heads, {QK_DIM}], got {q.dtype} "
            f"{tuple(q.shape)}"
        )
    if q.stride(2) != 1:
        raise ValueError(f"{op}: q's last dimension must be contiguous")
    if (
        kv_cache.dim() != 3
        or kv_cache.dtype != torch.uint8
        or kv_cache.shape[2] != DS_MLA_ENTRY_BYTES
    ):
        raise ValueError(
            f"{op}: kv_cache must be uint8 [blocks, block_size, "
            f"{DS_MLA_ENTRY_BYTES}] (fp8_ds_mla), got {kv_cache.dtype} "
            f"{tuple(kv_cache.shape)}"
        )
    if (
        kv_cache.stride(2) != 1
        or kv_cache.stride(1) != DS_MLA_ENTRY_BYTES
        or kv_cache.stride(0) % 4
        or kv_cache.storage_offset() % 4
    ):
        raise ValueError(
            f"{op}: kv_cache entries must be contiguous {DS_MLA_ENTRY_BYTES}-byte "
            "rows and its blocks 4-byte aligned (a block may be strided), got "
            f"strides {kv_cache.stride()}, offset {kv_cache.storage_offset()}"
        )
    tokens = q.shape[0]
    if (
        indices.dim() != 2
        or indices.dtype != torch.int32
        or indices.shape[0] != tokens
        or indices.shape[1] == 0
        or indices.stride(1) != 1
    ):
        raise ValueError(
            f"{op}: indices must be int32 [{tokens}, k > 0] with contiguous "
            f"rows, got {indices.dtype} {tuple(indices.shape)}"
        )
    if not q.device == kv_cache.device == indices.device:
        raise ValueError(
            f"{op}: q, kv_cache and indices must share a device, got {q.device}, "
            f"{kv_cache.device} and {indices.device}"
        )


def dequantize_entries(entries: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The fp32 latent ``[..., 512]`` and rope ``[..., 64]`` of ``fp8_ds_mla``
    entries ``[..., 656]`` uint8."""
    codes = entries[..., :DS_MLA_NOPE_DIM]
    scale_bytes = entries[..., DS_MLA_SCALE_OFFSET:DS_MLA_ROPE_OFFSET].contiguous()
    scales = scale_bytes.view(torch.float32)
    tiles = fp8_e4m3_decode(codes).unflatten(-1, (-1, DS_MLA_TILE))
    latent = (tiles * scales.unsqueeze(-1)).flatten(-2)
    rope = entries[..., DS_MLA_ROPE_OFFSET:].contiguous().view(torch.bfloat16)
    return latent, rope.float()


def sparse_mla_fp8_reference(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    indices: torch.Tensor,
    softmax_scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """What :func:`sparse_mla_fp8` computes, in fp32 with the dequantized
    latent rounded to bf16 as the default tiles round it (``fp16_latent``
    rounds finer): ``out [T, H, 512]`` bf16 and the
    natural-log ``lse [T, H]`` (-inf, and a zero row, where a row selects
    nothing)."""
    _check(q, kv_cache, indices)
    flat = kv_cache.reshape(-1, DS_MLA_ENTRY_BYTES)
    valid = (indices >= 0) & (indices < flat.shape[0])
    latent, rope = dequantize_entries(flat[torch.where(valid, indices, 0).long()])
    latent = latent.bfloat16().float()
    qf = q.float()
    scores = torch.einsum("thd,tkd->thk", qf[..., :DS_MLA_NOPE_DIM], latent)
    scores += torch.einsum("thd,tkd->thk", qf[..., DS_MLA_NOPE_DIM:], rope)
    scores = (scores * softmax_scale).masked_fill(~valid[:, None, :], -math.inf)
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse.unsqueeze(-1)).nan_to_num(0.0)
    out = torch.einsum("thk,tkd->thd", probs, latent)
    return out.bfloat16(), lse


def sparse_mla_fp8(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    indices: torch.Tensor,
    softmax_scale: float,
    num_splits: int | None = None,
    tiles: SparseMLATiles = DEFAULT_TILES,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of each token's heads over its selected cache slots.

    ``q [T, H, 576]`` bf16 (latent, then rope), ``kv_cache [blocks,
    block_size, 656]`` ``fp8_ds_mla`` (blocks may be strided, as in a packed
    row), ``indices [T, k]`` int32 slots (``block * block_size + offset``;
    -1 and slots past the cache are skipped). Returns ``out [T, H, 512]``
    bf16 and ``lse [T, H]`` fp32 (natural log). CPU tensors take the torch
    path."""
    _check(q, kv_cache, indices)
    _check_tiles(tiles)
    if runs_torch_path(q) or not HAS_TRITON:
        return sparse_mla_fp8_reference(q, kv_cache, indices, softmax_scale)
    tokens, heads, _ = q.shape
    out = q.new_empty(tokens, heads, DS_MLA_NOPE_DIM)
    lse = torch.empty(tokens, heads, dtype=torch.float32, device=q.device)
    if tokens == 0 or heads == 0:
        return out, lse
    if num_splits is None:
        programs = _PROGRAMS_PER_SM * _sm_count(q.device.index or 0)
        num_splits = default_num_splits(tokens, heads, indices.shape[1], programs)
    _launch(q, kv_cache, indices, softmax_scale, num_splits, out, lse, tiles)
    return out, lse


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def default_num_splits(tokens: int, heads: int, topk: int, programs: int) -> int:
    """Splits of each row's top-k: about ``programs`` programs in all, at
    least ``_MIN_SPLIT_KEYS`` keys each."""
    rows = tokens * -(-heads // _BLOCK_H)
    most = max(1, -(-topk // _MIN_SPLIT_KEYS))
    return max(1, min(most, -(-programs // rows)))


def _launch(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    indices: torch.Tensor,
    softmax_scale: float,
    num_splits: int,
    out: torch.Tensor,
    lse: torch.Tensor,
    tiles: SparseMLATiles = DEFAULT_TILES,
) -> None:
    tokens, heads, _ = q.shape
    topk = indices.shape[1]
    # Whole key blocks per split, so that splits never share a block.
    block_n = tiles.block_n
    split_len = triton.cdiv(triton.cdiv(topk, num_splits), block_n) * block_n
    num_splits = -(-topk // split_len)
    single = num_splits == 1
    if single:
        part_out, part_lse = out, lse
    else:
        part_out = torch.empty(
            tokens, num_splits, heads, DS_MLA_NOPE_DIM,
            dtype=torch.float32, device=q.device,
        )  # fmt: skip
        part_lse = torch.empty(
            tokens, num_splits, heads, dtype=torch.float32, device=q.device
        )
    grid = (tokens, num_splits, triton.cdiv(heads, _BLOCK_H))
    _sparse_mla_split_kernel[grid](
        q,
        q.stride(0),
        q.stride(1),
        kv_cache,
        kv_cache.view(torch.float32),
        kv_cache.view(torch.bfloat16),
        kv_cache.stride(0),
        kv_cache.shape[1],
        kv_cache.shape[0] * kv_cache.shape[1],
        indices,
        indices.stride(0),
        part_out,
        part_lse,
        heads,
        topk,
        split_len,
        softmax_scale * 1.4426950408889634,  # log2(e): the kernel uses exp2
        SINGLE=single,
        BLOCK_N=block_n,
        FP16_LATENT=tiles.fp16_latent,
        INLINE_PTX=q.is_cuda,
        **tiles.compile_options(),
    )
    if not single:
        _sparse_mla_combine_kernel[(tokens, heads)](
            part_out,
            part_lse,
            out,
            lse,
            num_splits,
            heads,
            SPLITS=triton.next_power_of_2(num_splits),
            num_warps=4,
        )


if HAS_TRITON:
    # The fp8_ds_mla entry and the tiling, as the kernels see them.
    NOPE = tl.constexpr(DS_MLA_NOPE_DIM)
    ROPE = tl.constexpr(DS_MLA_ROPE_DIM)
    TILE = tl.constexpr(DS_MLA_TILE)
    SCALE_OFFSET = tl.constexpr(DS_MLA_SCALE_OFFSET)
    ROPE_OFFSET = tl.constexpr(DS_MLA_ROPE_OFFSET)
    BLOCK_H = tl.constexpr(_BLOCK_H)
    # Codes b0..b3 of $2 to f16 pairs (b0, b1) in $0 and (b2, b3) in $1, each
    # times its scale in $3 and $4: every byte to the high half of a 16-bit lane,
    # then sign kept and the rest shifted right by one.
    E4M3X4_TIMES_F16X2X2 = tl.constexpr(
        """
{
.reg .b32 lo, hi, lo_mag, hi_mag;
prmt.b32 lo, $2, 0, 0x1404;
prmt.b32 hi, $2, 0, 0x3424;
and.b32 lo_mag, lo, 0x7F007F00;
and.b32 hi_mag, hi, 0x7F007F00;
shr.u32 lo_mag, lo_mag, 1;
shr.u32 hi_mag, hi_mag, 1;
and.b32 lo, lo, 0x80008000;
and.b32 hi, hi, 0x80008000;
or.b32 lo, lo, lo_mag;
or.b32 hi, hi, hi_mag;
mul.rn.f16x2 $0, lo, $3;
mul.rn.f16x2 $1, hi, $4;
}
"""
    )

    @triton.jit
    def _sparse_mla_split_kernel(
        q_ptr, q_token_stride, q_head_stride,
        cache_ptr, cache_f32_ptr, cache_bf16_ptr, cache_block_stride, block_size,
        num_slots,
        idx_ptr, idx_token_stride,
        out_ptr, lse_ptr,
        num_heads, topk, split_len, scale_log2,
        SINGLE: tl.constexpr, BLOCK_N: tl.constexpr, FP16_LATENT: tl.constexpr,
        INLINE_PTX: tl.constexpr,
    ):  # fmt: skip
        token = tl.program_id(0).to(tl.int64)
        heads = tl.program_id(2) * BLOCK_H + tl.arange(0, BLOCK_H)
        split = tl.program_id(1)
        num_splits = tl.num_programs(1)
        head_ok = heads < num_heads
        d = tl.arange(0, NOPE)
        r = tl.arange(0, ROPE)
        tiles = tl.arange(0, NOPE // TILE)
        tile_cols = tiles[:, None] * TILE + tl.arange(0, TILE)[None, :]
        q_row = q_ptr + token * q_token_stride + heads[:, None] * q_head_stride
        q_nope = tl.load(q_row + d[None, :], mask=head_ok[:, None], other=0.0)
        q_rope = tl.load(q_row + NOPE + r[None, :], mask=head_ok[:, None], other=0.0)
        if FP16_LATENT:
            q_nope, q_nope_scale = _to_fp16_range(q_nope)

        m = tl.full([BLOCK_H], float("-inf"), tl.float32)
        denom = tl.zeros([BLOCK_H], tl.float32)
        acc = tl.zeros([BLOCK_H, NOPE], tl.float32)
        start = split * split_len
        end = tl.minimum(start + split_len, topk)
        for n0 in range(start, end, BLOCK_N):
            n = n0 + tl.arange(0, BLOCK_N)
            slot = tl.load(
                idx_ptr + token * idx_token_stride + n, mask=n < end, other=-1
            )
            valid = (slot >= 0) & (slot < num_slots)
            valid3 = valid[:, None, None]
            slot = tl.where(valid, slot, 0).to(tl.int64)
            entry_byte = (slot // block_size) * cache_block_stride + (
                slot % block_size
            ) * (ROPE_OFFSET + 2 * ROPE)
            # [keys, tiles, 128] codes times each tile's fp32 scale (the same
            # bytes read as fp32; element units).
            e3 = entry_byte[:, None, None]
            codes = tl.load(
                cache_ptr + e3 + tile_cols[None, :, :], mask=valid3, other=0
            )
            scales = tl.load(
                cache_f32_ptr + (e3 + SCALE_OFFSET) // 4 + tiles[None, :, None],
                mask=valid3,
                other=0.0,
            )
            if FP16_LATENT:
                scales = tl.broadcast_to((scales * 256.0).to(tl.float16), codes.shape)
                latent = _dequantize_fp16(codes, scales, INLINE_PTX)
            else:
                latent = codes.to(tl.float8e4nv, bitcast=True).to(tl.float32)
                latent = (latent * scales).to(tl.bfloat16)
            latent = tl.reshape(latent, (BLOCK_N, NOPE))
            rope_at = (entry_byte + ROPE_OFFSET) // 2
            rope = tl.load(
                cache_bf16_ptr + rope_at[:, None] + r[None, :],
                mask=valid[:, None],
                other=0.0,
            )
            if FP16_LATENT:
                s = tl.dot(q_nope, tl.trans(latent)) * q_nope_scale
                s = tl.dot(q_rope, tl.trans(rope), s)
            else:
                s = tl.dot(q_nope, tl.trans(latent)) + tl.dot(q_rope, tl.trans(rope))
            s = tl.where(valid[None, :], s * scale_log2, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, axis=1))
            # Rows with nothing selected yet keep m = -inf: shift by 0 there.
            shift = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp2(s - shift[:, None])
            alpha = tl.exp2(m - shift)
            denom = denom * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.dot(p.to(latent.dtype), latent)
            m = m_new

        empty = denom == 0.0
        acc = acc / tl.where(empty, 1.0, denom)[:, None]
        lse2 = tl.where(empty, float("-inf"), m + tl.log2(tl.where(empty, 1.0, denom)))
        if SINGLE:
            o_row = out_ptr + token * num_heads * NOPE + heads[:, None] * NOPE
            tl.store(o_row + d[None, :], acc.to(tl.bfloat16), mask=head_ok[:, None])
            tl.store(lse_ptr + token * num_heads + heads, lse2 * 0.6931471805599453,
                     mask=head_ok)  # fmt: skip
        else:
            part = token * num_splits + split
            o_row = out_ptr + (part * num_heads + heads[:, None]) * NOPE
            tl.store(o_row + d[None, :], acc, mask=head_ok[:, None])
            tl.store(lse_ptr + part * num_heads + heads, lse2, mask=head_ok)

    @triton.jit
    def _dequantize_fp16(codes, scales, INLINE_PTX: tl.constexpr):
        # An e4m3 code's sign moved to bit 15 and its other bits to 7-13 is an
        # f16 of the code times 2**-8, subnormals included; ``scales`` carry
        # the 2**8. In PTX four codes take six integer ops and two f16x2
        # multiplies (the interpreter, which runs no PTX, takes the same
        # arithmetic element by element).
        if INLINE_PTX:
            return tl.inline_asm_elementwise(
                asm=E4M3X4_TIMES_F16X2X2,
                constraints="=r,=r,r,r,r",
                args=[codes, scales],
                dtype=tl.float16,
                is_pure=True,
                pack=4,
            )
        bits = codes.to(tl.uint16)
        bits = ((bits & 0x80) << 8) | ((bits & 0x7F) << 7)
        return bits.to(tl.float16, bitcast=True) * scales

    @triton.jit
    def _to_fp16_range(x):
        # x / 2**k in fp16, k >= 0 the least that keeps |x| below 2**15, and
        # 2**k: powers of two built from their exponent bits, so exact.
        amax = tl.max(tl.max(tl.abs(x.to(tl.float32)), axis=1), axis=0)
        exponent = ((amax.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
        k = tl.maximum(exponent - 14, 0)
        down = ((127 - k) << 23).to(tl.float32, bitcast=True)
        up = ((127 + k) << 23).to(tl.float32, bitcast=True)
        return (x.to(tl.float32) * down).to(tl.float16), up

    @triton.jit
    def _sparse_mla_combine_kernel(
        part_out_ptr,
        part_lse_ptr,
        out_ptr,
        lse_ptr,
        num_splits,
        num_heads,
        SPLITS: tl.constexpr,
    ):
        # The splits in index order: the same sum whatever ran first.
        token = tl.program_id(0).to(tl.int64)
        head = tl.program_id(1)
        s = tl.arange(0, SPLITS)
        s_ok = s < num_splits
        lse2 = tl.load(
            part_lse_ptr + (token * num_splits + s) * num_heads + head,
            mask=s_ok,
            other=float("-inf"),
        )
        top = tl.max(lse2, axis=0)
        shift = tl.where(top == float("-inf"), 0.0, top)
        w = tl.exp2(lse2 - shift)
        total = tl.sum(w, axis=0)
        d = tl.arange(0, NOPE)
        parts = tl.load(
            part_out_ptr
            + ((token * num_splits + s[:, None]) * num_heads + head) * NOPE
            + d[None, :],
            mask=s_ok[:, None],
            other=0.0,
        )
        o = tl.sum(parts * w[:, None], axis=0) / tl.where(total == 0.0, 1.0, total)
        tl.store(out_ptr + (token * num_heads + head) * NOPE + d, o.to(tl.bfloat16))
        lse = tl.where(total == 0.0, float("-inf"), shift + tl.log2(total))
        tl.store(lse_ptr + token * num_heads + head, lse * 0.6931471805599453)
