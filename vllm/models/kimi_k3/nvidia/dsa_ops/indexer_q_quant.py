# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Indexer query quantization for the DSA lightning indexer (Triton + torch).

One launch turns the bf16 GEMM outputs into what DeepGEMM's MQA logits read
(32 or 64 heads, zero-padded), so no ``cat``/``pad``/scale chain runs between
the query GEMM and the indexer op. ``(q_quant, q_scale, weights)`` for ``T``
tokens, ``Hp`` padded heads, head dim ``D``:

- fp8: ``q_quant`` float8_e4m3fn ``[T, Hp, D]`` with a power-of-two scale per
  (token, head) folded into the fp32 ``weights [T, Hp]``; ``q_scale`` None.
- MXFP4 (``D == 128``): ``q_quant`` uint8 ``[T, Hp, D / 2]`` e2m1 nibbles
  (even element low), ``q_scale`` int32 ``[T, Hp]`` of four UE8M0 bytes, and
  unscaled ``weights``.

Padded heads get zero codes and zero weights. ``reference.indexer_q_quant`` is
the contract the kernels are tested against.
"""

from typing import Any

import torch

from vllm.models.kimi_k3.common import dsa_formats
from vllm.models.kimi_k3.common.dsa_formats import (
    DEEPGEMM_INDEX_HEADS,
    E2M1_MAX,
    FP8_AMAX_FLOOR,
    FP8_E4M3_MAX,
    MXFP4_AMAX_FLOOR,
    MXFP4_BLOCK_SIZE,
)
from vllm.models.kimi_k3.nvidia.dsa_ops._triton import HAS_TRITON, tl, triton
from vllm.models.kimi_k3.nvidia.dsa_ops._variants import mxfp4_variant
from vllm.models.kimi_k3.nvidia.dsa_ops.torch_path import (
    pad_heads,
    quantize_query,
    runs_torch_path,
)

SUPPORTED_PADDED_HEADS = DEEPGEMM_INDEX_HEADS
MXFP4_HEAD_DIM = 4 * MXFP4_BLOCK_SIZE


def _check_inputs(
    index_q: torch.Tensor,
    index_weights: torch.Tensor,
    padded_heads: int,
    fp4: bool,
) -> None:
    op = "indexer_q_quant"
    if index_q.dim() != 3:
        raise ValueError(f"{op}: index_q must be [T, H, D], got {index_q.shape}")
    num_tokens, num_heads, head_dim = index_q.shape
    if index_q.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise TypeError(f"{op}: index_q must be bf16/fp16/fp32, got {index_q.dtype}")
    if index_weights.dim() != 2 or tuple(index_weights.shape) != (
        num_tokens,
        num_heads,
    ):
        raise ValueError(
            f"{op}: index_weights must be [T, H] = [{num_tokens}, {num_heads}], "
            f"got {tuple(index_weights.shape)}"
        )
    if not index_weights.is_floating_point():
        raise TypeError(f"{op}: index_weights must be floating point")
    if index_weights.device != index_q.device:
        raise ValueError(f"{op}: index_q and index_weights are on different devices")
    if padded_heads not in SUPPORTED_PADDED_HEADS:
        raise ValueError(
            f"{op}: padded_heads must be one of {SUPPORTED_PADDED_HEADS} "
            f"(DeepGEMM MQA logits), got {padded_heads}"
        )
    if num_heads > padded_heads:
        raise ValueError(f"{op}: {num_heads} heads do not fit in {padded_heads}")
    if head_dim == 0 or head_dim % MXFP4_BLOCK_SIZE != 0:
        raise ValueError(
            f"{op}: head dim must be a multiple of {MXFP4_BLOCK_SIZE}, got {head_dim}"
        )
    if fp4 and head_dim != MXFP4_HEAD_DIM:
        raise ValueError(
            f"{op}: with fp4=True the head dim must be {MXFP4_HEAD_DIM}, got {head_dim}"
        )


# Triton kernels.

if HAS_TRITON:
    # The fp32 exponent field and the UE8M0 byte, as the kernels see them.
    BIAS = tl.constexpr(dsa_formats.UE8M0_BIAS)
    MAX_EXP = tl.constexpr(dsa_formats.UE8M0_MAX_EXP)
    MIN_EXP = tl.constexpr(dsa_formats.UE8M0_MIN_EXP)
    MIN_NORMAL_EXP = tl.constexpr(dsa_formats.FP32_MIN_NORMAL_EXP)

    @triton.jit
    def _ceil_log2_fp32(x):
        """Exact ceil(log2(x)) of positive normal fp32 values (int32), from
        the exponent bits: lg2.approx can miss a power-of-two boundary."""
        bits = x.to(tl.int32, bitcast=True)
        exp_field = (bits >> 23) & 0xFF
        frac = bits & 0x7FFFFF
        return exp_field - BIAS + (frac != 0).to(tl.int32)

    @triton.jit
    def _exp2_int(e):
        """Exact fp32 2**e of int32 exponents in [-126, 127]."""
        e = tl.minimum(tl.maximum(e, MIN_NORMAL_EXP), MAX_EXP)
        return ((e + BIAS) << 23).to(tl.float32, bitcast=True)

    @triton.jit
    def _q_fp8_fold_weights_kernel(
        q_ptr, q_s0, q_s1, q_s2,
        w_ptr, w_s0, w_s1,
        q_out_ptr, w_out_ptr,
        weight_scale, num_heads,
        PADDED_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
        BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
        AMAX_FLOOR: tl.constexpr, FP8_MAX: tl.constexpr,
    ):  # fmt: skip
        tok = tl.program_id(0).to(tl.int64)
        heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        dims = tl.arange(0, BLOCK_D)
        h_in = heads < num_heads
        d_in = dims < HEAD_DIM
        x = tl.load(
            q_ptr + tok * q_s0 + heads[:, None] * q_s1 + dims[None, :] * q_s2,
            mask=h_in[:, None] & d_in[None, :],
            other=0.0,
        ).to(tl.float32)
        w = tl.load(w_ptr + tok * w_s0 + heads * w_s1, mask=h_in, other=0.0)

        amax = tl.maximum(tl.max(tl.abs(x), axis=1), AMAX_FLOOR)
        e = _ceil_log2_fp32(tl.math.div_rn(amax, FP8_MAX))
        codes = tl.clamp(x * _exp2_int(-e)[:, None], -FP8_MAX, FP8_MAX)

        h_out = heads < PADDED_HEADS
        out_off = tok * (PADDED_HEADS * HEAD_DIM) + heads[:, None] * HEAD_DIM
        tl.store(
            q_out_ptr + out_off + dims[None, :],
            codes.to(q_out_ptr.dtype.element_ty),
            mask=h_out[:, None] & d_in[None, :],
        )
        w_out = (w.to(tl.float32) * _exp2_int(e)) * weight_scale
        tl.store(w_out_ptr + tok * PADDED_HEADS + heads, w_out, mask=h_out)

    @triton.jit
    def _e2m1_nibble(y):
        """e2m1 code of fp32 ``y`` (round to nearest even, saturating at 6;
        bit 3 = sign bit of ``y``), as ``formats.e2m1_encode``."""
        a = tl.abs(y)
        mag = (
            (a > 0.25).to(tl.int32)
            + (a >= 0.75).to(tl.int32)
            + (a > 1.25).to(tl.int32)
            + (a >= 1.75).to(tl.int32)
            + (a > 2.5).to(tl.int32)
            + (a >= 3.5).to(tl.int32)
            + (a > 5.0).to(tl.int32)
        )
        sign = ((y.to(tl.int32, bitcast=True) >> 31) & 1) << 3
        return mag | sign

    @triton.jit
    def _q_mxfp4_kernel(
        q_ptr, q_s0, q_s1, q_s2,
        w_ptr, w_s0, w_s1,
        q_out_ptr, scale_out_ptr, w_out_ptr,
        weight_scale, num_heads,
        PADDED_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
        BLOCK_H: tl.constexpr, MX_BLOCK: tl.constexpr,
        AMAX_FLOOR: tl.constexpr, INV_E2M1_MAX: tl.constexpr,
        BF16_PAIRS: tl.constexpr,
    ):  # fmt: skip
        """``BF16_PAIRS``: ``q_ptr`` is the bf16 query viewed as int32 (strides
        in int32 units), each word one (even, odd) element pair, so the pair
        split is two bit operations instead of a register shuffle."""
        NUM_BLOCKS: tl.constexpr = HEAD_DIM // MX_BLOCK
        HALF: tl.constexpr = MX_BLOCK // 2
        tok = tl.program_id(0).to(tl.int64)
        heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        h_in = heads < num_heads
        blocks = tl.arange(0, NUM_BLOCKS)
        pairs = tl.arange(0, HALF)
        w = tl.load(w_ptr + tok * w_s0 + heads * w_s1, mask=h_in, other=0.0)

        # lo / hi: [BLOCK_H, NUM_BLOCKS, HALF] even / odd elements.
        if BF16_PAIRS:
            word = tl.load(
                q_ptr
                + tok * q_s0
                + heads[:, None, None] * q_s1
                + (blocks[None, :, None] * HALF + pairs[None, None, :]) * q_s2,
                mask=h_in[:, None, None],
                other=0,
            )
            lo = (word << 16).to(tl.float32, bitcast=True)
            hi = (word & -65536).to(tl.float32, bitcast=True)
        else:
            even = q_ptr + tok * q_s0 + heads[:, None, None] * q_s1
            even += (blocks[None, :, None] * MX_BLOCK + 2 * pairs[None, None, :]) * q_s2
            lo = tl.load(even, mask=h_in[:, None, None], other=0.0).to(tl.float32)
            hi = tl.load(even + q_s2, mask=h_in[:, None, None], other=0.0)
            hi = hi.to(tl.float32)

        amax = tl.maximum(tl.max(tl.abs(lo), axis=2), tl.max(tl.abs(hi), axis=2))
        amax = tl.maximum(amax, AMAX_FLOOR)
        e = _ceil_log2_fp32(amax * INV_E2M1_MAX)
        e = tl.minimum(tl.maximum(e, MIN_EXP), MAX_EXP)
        inv = _exp2_int(-e)[:, :, None]
        packed = _e2m1_nibble(lo * inv) | (_e2m1_nibble(hi * inv) << 4)

        h_out = heads < PADDED_HEADS
        q_off = (
            tok * (PADDED_HEADS * HEAD_DIM // 2)
            + heads[:, None, None] * (HEAD_DIM // 2)
            + blocks[None, :, None] * HALF
            + pairs[None, None, :]
        )
        tl.store(q_out_ptr + q_off, packed.to(tl.uint8), mask=h_out[:, None, None])
        s_off = (
            tok * (PADDED_HEADS * NUM_BLOCKS)
            + heads[:, None] * NUM_BLOCKS
            + blocks[None, :]
        )
        tl.store(scale_out_ptr + s_off, (e + BIAS).to(tl.uint8), mask=h_out[:, None])
        tl.store(
            w_out_ptr + tok * PADDED_HEADS + heads,
            w.to(tl.float32) * weight_scale,
            mask=h_out,
        )


# Heads per program; None picks by token count. An int overrides (tuning).
_BLOCK_H: int | None = None
_NUM_WARPS = 4


def _block_h(num_tokens: int, padded_heads: int) -> int:
    if _BLOCK_H is not None:
        return min(_BLOCK_H, padded_heads)
    if num_tokens <= 1024:
        return 8
    if num_tokens <= 4096:
        return 16
    return 32


def _as_bf16_pairs(index_q: torch.Tensor) -> torch.Tensor | None:
    """``index_q`` as int32 words of (even, odd) bf16 pairs, or None when its
    layout does not allow that view."""
    if index_q.dtype != torch.bfloat16 or index_q.stride(2) != 1:
        return None
    try:
        return index_q.view(torch.int32)
    except RuntimeError:
        return None


def indexer_q_quant(
    index_q: torch.Tensor,
    index_weights: torch.Tensor,
    weight_scale: float,
    padded_heads: int,
    *,
    fp4: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """The indexer query as DeepGEMM's MQA logits read it, heads padded to
    ``padded_heads`` (layouts in the module docstring). CPU tensors take the
    torch reference path."""
    _check_inputs(index_q, index_weights, padded_heads, fp4)
    if runs_torch_path(index_q) or not HAS_TRITON:
        q = pad_heads(index_q.float(), padded_heads)
        w = pad_heads(index_weights.float(), padded_heads)
        return quantize_query(q, w, weight_scale, fp4=fp4)
    if fp4:
        return _mxfp4_q_quant_triton(index_q, index_weights, weight_scale, padded_heads)
    q_fp8, weights = _fp8_q_quant_triton(
        index_q, index_weights, weight_scale, padded_heads
    )
    return q_fp8, None, weights


def indexer_q_quant_fold_weights(
    index_q: torch.Tensor,
    index_weights: torch.Tensor,
    weight_scale: float,
    padded_heads: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`indexer_q_quant` for fp8, which has no ``q_scale``."""
    q_fp8, _, weights = indexer_q_quant(
        index_q, index_weights, weight_scale, padded_heads
    )
    return q_fp8, weights


mxfp4_q_quant = mxfp4_variant(
    indexer_q_quant,
    "mxfp4_q_quant",
    """:func:`indexer_q_quant` with ``fp4`` (SM10x readers).""",
    return_annotation=tuple[torch.Tensor, torch.Tensor, torch.Tensor],
)


def _launch(
    kernel: Any,
    q_arg: torch.Tensor,
    index_q: torch.Tensor,
    index_weights: torch.Tensor,
    outputs: tuple[torch.Tensor, ...],
    weight_scale: float,
    padded_heads: int,
    **meta: Any,
) -> None:
    """One program per (token, block of heads); ``q_arg`` is ``index_q`` or a
    view of it that the kernel reads."""
    num_tokens, num_heads, head_dim = index_q.shape
    if num_tokens == 0:
        return
    block_h = _block_h(num_tokens, padded_heads)
    kernel[(num_tokens, padded_heads // block_h)](
        q_arg,
        *q_arg.stride(),
        index_weights,
        *index_weights.stride(),
        *outputs,
        float(weight_scale),
        num_heads,
        PADDED_HEADS=padded_heads,
        HEAD_DIM=head_dim,
        BLOCK_H=block_h,
        num_warps=_NUM_WARPS,
        **meta,
    )


def _fp8_q_quant_triton(
    index_q: torch.Tensor,
    index_weights: torch.Tensor,
    weight_scale: float,
    padded_heads: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    num_tokens, _, head_dim = index_q.shape
    device = index_q.device
    q_fp8 = torch.empty(
        (num_tokens, padded_heads, head_dim), dtype=torch.float8_e4m3fn, device=device
    )
    weights = torch.empty(
        (num_tokens, padded_heads), dtype=torch.float32, device=device
    )
    _launch(
        _q_fp8_fold_weights_kernel,
        index_q,
        index_q,
        index_weights,
        (q_fp8, weights),
        weight_scale,
        padded_heads,
        BLOCK_D=triton.next_power_of_2(head_dim),
        AMAX_FLOOR=FP8_AMAX_FLOOR,
        FP8_MAX=FP8_E4M3_MAX,
    )
    return q_fp8, weights


def _mxfp4_q_quant_triton(
    index_q: torch.Tensor,
    index_weights: torch.Tensor,
    weight_scale: float,
    padded_heads: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    num_tokens, _, head_dim = index_q.shape
    device = index_q.device
    q_packed = torch.empty(
        (num_tokens, padded_heads, head_dim // 2), dtype=torch.uint8, device=device
    )
    q_scale = torch.empty((num_tokens, padded_heads), dtype=torch.int32, device=device)
    weights = torch.empty(
        (num_tokens, padded_heads), dtype=torch.float32, device=device
    )
    pairs = _as_bf16_pairs(index_q)
    _launch(
        _q_mxfp4_kernel,
        index_q if pairs is None else pairs,
        index_q,
        index_weights,
        (q_packed, q_scale.view(torch.uint8), weights),
        weight_scale,
        padded_heads,
        MX_BLOCK=MXFP4_BLOCK_SIZE,
        AMAX_FLOOR=MXFP4_AMAX_FLOOR,
        INV_E2M1_MAX=1.0 / E2M1_MAX,
        BF16_PAIRS=pairs is not None,
    )
    return q_packed, q_scale, weights
