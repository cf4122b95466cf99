# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Pure-torch references of the DSA kernels: the contract they are tested
against, byte for byte.

One function per entry point, with its name and arguments
(``fused_prologue``, ``indexer_k_insert``, ``indexer_q_quant``,
``index_rope``), plus the pieces they are built from (``rms_norm``,
``k_norm``, ``write_indexer_entries``). The semantics are documented beside
each entry point; the byte encodings are ``formats.py``'s. Everything runs on
CPU and CUDA tensors, which is what the GPU tests compare the kernels with
and what the entry points run on CPU tensors.

The references take the inputs as given: the entry points check them
(dtypes, shapes, head counts, slot bounds) before dispatching. ``mx_scales``
here is explicit (default fp32 scale words), never read from the device.
"""

import torch

from vllm.models.kimi_k3.nvidia.dsa_ops.formats import (
    exp2_int,
    fp8_ds_mla_entry,
    fp8_quantize_rows,
    indexer_block_views,
    indexer_fp8_entry,
    mxfp4_quantize_rows,
)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """fp32 RMSNorm times the weight, rounded once to bf16."""
    xf = x.float()
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * rstd * weight.float()).to(torch.bfloat16)


def k_norm(
    index_k: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float
) -> torch.Tensor:
    """Bias-full fp32 LayerNorm, returned in bf16 (the k-norm module)."""
    k = torch.nn.functional.layer_norm(
        index_k.float(), (index_k.shape[-1],), weight.float(), bias.float(), eps
    )
    return k.to(torch.bfloat16)


def write_indexer_entries(
    k: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_cache: torch.Tensor,
    *,
    fp4: bool = False,
    mx_scales: bool = False,
) -> None:
    """Quantize normed keys ``k [N, D]`` (used as given) into the indexer
    cache at their slots (-1 skipped), in ``indexer_k_insert``'s layout."""
    n = slot_mapping.numel()
    if n == 0 or kv_cache.numel() == 0:
        return
    head_dim = k.shape[-1]
    if fp4:
        values, scales = mxfp4_quantize_rows(k[:n])
    else:
        values, scales = indexer_fp8_entry(k[:n], mx_scales)
    vview, sview = indexer_block_views(kv_cache, head_dim, fp4)
    slots = slot_mapping.long()
    keep = slots >= 0
    slots = slots[keep]
    block_size = kv_cache.shape[1]
    blk, off = slots // block_size, slots % block_size
    vview[blk, off] = values[keep]
    sview[blk, off] = scales[keep]


def indexer_k_insert(
    index_k: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    eps: float,
    slot_mapping: torch.Tensor,
    kv_cache: torch.Tensor,
    topk_indices_buffer: torch.Tensor,
    num_tokens: int,
    *,
    fp4: bool = False,
    mx_scales: bool = False,
) -> None:
    """``indexer_k_norm_quant_insert`` (mutates the cache and the top-k
    buffer; an empty cache leaves both alone)."""
    if kv_cache.numel() == 0:
        return
    n = slot_mapping.numel()
    k = k_norm(index_k[:n], weight, bias, eps)
    write_indexer_entries(k, slot_mapping, kv_cache, fp4=fp4, mx_scales=mx_scales)
    topk_indices_buffer[:num_tokens] = -1


def fused_prologue(
    q_c: torch.Tensor,
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    index_k: torch.Tensor,
    q_a_norm_weight: torch.Tensor,
    kv_a_norm_weight: torch.Tensor,
    k_norm_weight: torch.Tensor,
    k_norm_bias: torch.Tensor,
    eps: float,
    topk_indices_buffer: torch.Tensor,
    mla_kv_cache: torch.Tensor | None = None,
    mla_slot_mapping: torch.Tensor | None = None,
    index_kv_cache: torch.Tensor | None = None,
    index_slot_mapping: torch.Tensor | None = None,
    *,
    fp4: bool = False,
    mx_scales: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``dsa_fused_prologue``: returns the normed ``(q_c, kv_c)`` and, with
    both caches present and non-empty, writes them and the top-k fill."""
    q_out = rms_norm(q_c, q_a_norm_weight, eps)
    kv_out = rms_norm(kv_c, kv_a_norm_weight, eps)
    if (
        mla_kv_cache is None
        or index_kv_cache is None
        or mla_kv_cache.numel() == 0
        or index_kv_cache.numel() == 0
    ):
        return q_out, kv_out
    if mla_slot_mapping is None or index_slot_mapping is None:
        raise ValueError(
            "fused_prologue: mla_slot_mapping and index_slot_mapping are required "
            "with the caches"
        )
    n = mla_slot_mapping.numel()
    slots = mla_slot_mapping.long()
    keep = slots >= 0
    entries = fp8_ds_mla_entry(kv_out[:n], k_pe[:n])[keep]
    block_size = mla_kv_cache.shape[1]
    mla_kv_cache[slots[keep] // block_size, slots[keep] % block_size] = entries
    m = index_slot_mapping.numel()
    k = k_norm(index_k[:m], k_norm_weight, k_norm_bias, eps)
    write_indexer_entries(
        k, index_slot_mapping, index_kv_cache, fp4=fp4, mx_scales=mx_scales
    )
    topk_indices_buffer[: q_c.shape[0]] = -1
    return q_out, kv_out


def _pad_heads(x: torch.Tensor, padded_heads: int) -> torch.Tensor:
    pad = padded_heads - x.shape[1]
    if pad == 0:
        return x
    return torch.cat([x, x.new_zeros(x.shape[0], pad, *x.shape[2:])], dim=1)


def indexer_q_quant(
    index_q: torch.Tensor,
    index_weights: torch.Tensor,
    weight_scale: float,
    padded_heads: int,
    *,
    fp4: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """``indexer_q_quant``: ``(q_quant, q_scale, weights)``, ``q_scale``
    None for fp8 (the power-of-two query scale is folded into the weights)."""
    q = _pad_heads(index_q.float(), padded_heads)
    w = _pad_heads(index_weights.float(), padded_heads)
    # A Python scalar multiplies an fp32 tensor as an fp32 value (as the
    # kernels' fp32 argument), and keeps the reference CUDA-graph capturable.
    if fp4:
        packed, ue8m0 = mxfp4_quantize_rows(q)
        q_scale = ue8m0.contiguous().view(torch.int32).squeeze(-1)
        return packed, q_scale, w * float(weight_scale)
    codes, e = fp8_quantize_rows(q, q.shape[-1])
    weights = (w * exp2_int(e.squeeze(-1))) * float(weight_scale)
    return codes.view(torch.float8_e4m3fn), None, weights


def _rotate_(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    rope_dim: int,
    interleave: bool,
) -> None:
    half = rope_dim // 2
    xr = x[..., :rope_dim].float()
    if interleave:
        x1, x2 = xr[..., 0::2], xr[..., 1::2]
    else:
        x1, x2 = xr[..., :half], xr[..., half:]
    o1 = x1 * cos - x2 * sin
    o2 = x2 * cos + x1 * sin
    if interleave:
        out = torch.stack((o1, o2), dim=-1).flatten(-2)
    else:
        out = torch.cat((o1, o2), dim=-1)
    x[..., :rope_dim] = out.to(x.dtype)


def index_rope(
    index_q: torch.Tensor,
    index_k: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    rope_dim: int,
    interleave: bool,
) -> None:
    """``index_rope`` (in place)."""
    if rope_dim == 0 or index_q.shape[0] == 0:
        return
    half = rope_dim // 2
    sin_start = cos_sin_cache.shape[1] // 2
    rows = cos_sin_cache[positions.long()].float()
    cos = rows[:, :half]
    sin = rows[:, sin_start : sin_start + half]
    _rotate_(index_q, cos[:, None, :], sin[:, None, :], rope_dim, interleave)
    _rotate_(index_k, cos, sin, rope_dim, interleave)
