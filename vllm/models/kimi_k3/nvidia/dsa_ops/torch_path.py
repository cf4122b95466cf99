# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The entry points' pure-torch path, taken off CUDA and inside
:func:`run_on_every_device` (the kernels' contract)."""

import contextvars
import functools
from collections.abc import Callable
from typing import Any

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
    """Quantize normed keys ``k [N, D]`` into the indexer cache at their
    slots (-1 skipped)."""
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


def write_mla_entries(
    kv_normed: torch.Tensor,
    k_pe: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_cache: torch.Tensor,
) -> None:
    """Write ``fp8_ds_mla`` entries at their slots (-1 skipped)."""
    n = slot_mapping.numel()
    slots = slot_mapping.long()
    keep = slots >= 0
    entries = fp8_ds_mla_entry(kv_normed[:n], k_pe[:n])[keep]
    block_size = kv_cache.shape[1]
    kv_cache[slots[keep] // block_size, slots[keep] % block_size] = entries


def pad_heads(x: torch.Tensor, padded_heads: int) -> torch.Tensor:
    """``x [T, H, ...]`` with zero heads appended up to ``padded_heads``."""
    pad = padded_heads - x.shape[1]
    if pad == 0:
        return x
    return torch.cat([x, x.new_zeros(x.shape[0], pad, *x.shape[2:])], dim=1)


def quantize_query(
    q: torch.Tensor,
    w: torch.Tensor,
    weight_scale: float,
    *,
    fp4: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """``indexer_q_quant``'s triple of the padded fp32 query and weights."""
    # A Python scalar keeps fp32 arithmetic and CUDA-graph capturability.
    if fp4:
        packed, ue8m0 = mxfp4_quantize_rows(q)
        q_scale = ue8m0.contiguous().view(torch.int32).squeeze(-1)
        return packed, q_scale, w * float(weight_scale)
    codes, e = fp8_quantize_rows(q, q.shape[-1])
    weights = (w * exp2_int(e.squeeze(-1))) * float(weight_scale)
    return codes.view(torch.float8_e4m3fn), None, weights


def rotate_(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    rope_dim: int,
    interleave: bool,
) -> None:
    """Rotate the leading ``rope_dim`` dims of ``x`` in place, in fp32."""
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


def rope_cos_sin(
    positions: torch.Tensor, cos_sin_cache: torch.Tensor, rope_dim: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``(cos, sin)`` ``[T, rope_dim // 2]`` at ``positions``."""
    half = rope_dim // 2
    sin_start = cos_sin_cache.shape[1] // 2
    rows = cos_sin_cache[positions.long()].float()
    return rows[:, :half], rows[:, sin_start : sin_start + half]


def canonical_topk_rows(
    logits: torch.Tensor, row_lens: torch.Tensor, k: int
) -> torch.Tensor:
    """``canonical_topk``'s rows from the scores alone: the ``k`` largest
    (ties to the lowest column), ascending, then -1."""
    out = torch.full((logits.shape[0], k), -1, dtype=torch.int32)
    for r, n in enumerate(row_lens.tolist()):
        scores = logits[r, :n].float().cpu()
        order = torch.sort(scores, descending=True, stable=True).indices[:k]
        kept = torch.sort(order).values
        out[r, : kept.numel()] = kept.to(torch.int32)
    return out.to(logits.device)


_TORCH_PATH = contextvars.ContextVar("kimi_k3_dsa_torch_path", default=False)


def runs_torch_path(x: torch.Tensor) -> bool:
    """Whether an entry point given ``x`` takes its pure-torch path."""
    return not x.is_cuda or _TORCH_PATH.get()


def run_on_every_device(entry: Callable[..., Any], name: str) -> Callable[..., Any]:
    """``entry`` on its pure-torch path on every device, as ``name``."""

    @functools.wraps(entry)
    def run(*args: Any, **kwargs: Any) -> Any:
        token = _TORCH_PATH.set(True)
        try:
            return entry(*args, **kwargs)
        finally:
            _TORCH_PATH.reset(token)

    run.__name__ = run.__qualname__ = name
    run.__doc__ = f"``{entry.__name__}`` on its pure-torch path, on every device."
    return run
