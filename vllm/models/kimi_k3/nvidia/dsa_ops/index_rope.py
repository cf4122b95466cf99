# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""RoPE on the leading dims of the DSA indexer query and key (Triton + torch).

With ``index_rope_dim > 0`` only the leading ``rope_dim`` dims of each head
rotate, with the leading ``rope_dim // 2`` frequencies of the main rotary
table, which no vLLM rotary op does. fp32 with separately rounded products,
in place; ``reference.index_rope`` is the contract.
"""

import torch

from vllm.models.kimi_k3.nvidia.dsa_ops._checks import check_one_device
from vllm.models.kimi_k3.nvidia.dsa_ops._triton import HAS_TRITON, tl, triton
from vllm.models.kimi_k3.nvidia.dsa_ops.torch_path import (
    rope_cos_sin,
    rotate_,
    runs_torch_path,
)


def _check_inputs(
    index_q: torch.Tensor,
    index_k: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    rope_dim: int,
) -> None:
    if index_q.dim() != 3:
        raise ValueError(f"index_rope: index_q must be [T, H, D], got {index_q.shape}")
    num_tokens, _, head_dim = index_q.shape
    if index_k.dim() != 2 or tuple(index_k.shape) != (num_tokens, head_dim):
        raise ValueError(
            f"index_rope: index_k must be [T, D] = [{num_tokens}, {head_dim}], "
            f"got {tuple(index_k.shape)}"
        )
    if positions.dim() != 1 or positions.shape[0] != num_tokens:
        raise ValueError(
            f"index_rope: positions must be [T] = [{num_tokens}], "
            f"got {tuple(positions.shape)}"
        )
    if positions.dtype not in (torch.int32, torch.int64):
        raise TypeError(
            f"index_rope: positions must be int32/int64, got {positions.dtype}"
        )
    for name, t in (("index_q", index_q), ("index_k", index_k)):
        if not t.is_floating_point():
            raise TypeError(f"index_rope: {name} must be floating point")
    if cos_sin_cache.dim() != 2 or cos_sin_cache.shape[1] % 2 != 0:
        raise ValueError(
            "index_rope: cos_sin_cache must be [max_pos, rot_dim] with even "
            f"rot_dim, got {tuple(cos_sin_cache.shape)}"
        )
    if rope_dim < 0 or rope_dim % 2 != 0:
        raise ValueError(f"index_rope: rope_dim must be even and >= 0, got {rope_dim}")
    if rope_dim > head_dim:
        raise ValueError(
            f"index_rope: rope_dim ({rope_dim}) exceeds the head dim ({head_dim})"
        )
    if rope_dim > cos_sin_cache.shape[1]:
        raise ValueError(
            f"index_rope: rope_dim ({rope_dim}) needs {rope_dim // 2} frequencies; "
            f"the cache has {cos_sin_cache.shape[1] // 2}"
        )
    check_one_device("index_rope", index_q, index_k, positions, cos_sin_cache)


if HAS_TRITON:

    @triton.jit
    def _index_rope_kernel(
        q_ptr,
        q_s0,
        q_s1,
        q_s2,
        k_ptr,
        k_s0,
        k_s1,
        pos_ptr,
        cache_ptr,
        cache_s0,
        cache_s1,
        num_heads,
        sin_start,
        HALF: tl.constexpr,
        BLOCK_HALF: tl.constexpr,
        BLOCK_H: tl.constexpr,
        INTERLEAVE: tl.constexpr,
    ):
        tok = tl.program_id(0).to(tl.int64)
        hb = tl.program_id(1)
        pos = tl.load(pos_ptr + tok).to(tl.int64)
        i = tl.arange(0, BLOCK_HALF)
        i_in = i < HALF
        row = cache_ptr + pos * cache_s0
        cos = tl.load(row + i * cache_s1, mask=i_in, other=0.0).to(tl.float32)
        sin = tl.load(row + (sin_start + i) * cache_s1, mask=i_in, other=0.0).to(
            tl.float32
        )
        if INTERLEAVE:
            d1 = 2 * i
            d2 = 2 * i + 1
        else:
            d1 = i
            d2 = i + HALF

        heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)
        m = (heads < num_heads)[:, None] & i_in[None, :]
        base = q_ptr + tok * q_s0 + heads[:, None] * q_s1
        p1 = base + d1[None, :] * q_s2
        p2 = base + d2[None, :] * q_s2
        x1 = tl.load(p1, mask=m, other=0.0).to(tl.float32)
        x2 = tl.load(p2, mask=m, other=0.0).to(tl.float32)
        o1 = x1 * cos[None, :] - x2 * sin[None, :]
        o2 = x2 * cos[None, :] + x1 * sin[None, :]
        tl.store(p1, o1.to(q_ptr.dtype.element_ty), mask=m)
        tl.store(p2, o2.to(q_ptr.dtype.element_ty), mask=m)

        if hb == 0:
            kp1 = k_ptr + tok * k_s0 + d1 * k_s1
            kp2 = k_ptr + tok * k_s0 + d2 * k_s1
            k1 = tl.load(kp1, mask=i_in, other=0.0).to(tl.float32)
            k2 = tl.load(kp2, mask=i_in, other=0.0).to(tl.float32)
            tl.store(kp1, (k1 * cos - k2 * sin).to(k_ptr.dtype.element_ty), mask=i_in)
            tl.store(kp2, (k2 * cos + k1 * sin).to(k_ptr.dtype.element_ty), mask=i_in)


_MAX_BLOCK_H = 16


def index_rope(
    index_q: torch.Tensor,
    index_k: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    rope_dim: int,
    interleave: bool,
) -> None:
    """RoPE on the leading ``rope_dim`` dims of ``index_q [T, H, D]`` and
    ``index_k [T, D]``, in place. CPU tensors take the torch path."""
    _check_inputs(index_q, index_k, positions, cos_sin_cache, rope_dim)
    num_tokens, num_heads, _ = index_q.shape
    if rope_dim == 0 or num_tokens == 0:
        return
    if runs_torch_path(index_q) or not HAS_TRITON:
        cos, sin = rope_cos_sin(positions, cos_sin_cache, rope_dim)
        rotate_(index_q, cos[:, None], sin[:, None], rope_dim, interleave)
        rotate_(index_k, cos, sin, rope_dim, interleave)
        return
    half = rope_dim // 2
    block_h = min(_MAX_BLOCK_H, triton.next_power_of_2(max(num_heads, 1)))
    grid = (num_tokens, max(triton.cdiv(num_heads, block_h), 1))
    _index_rope_kernel[grid](
        index_q,
        *index_q.stride(),
        index_k,
        *index_k.stride(),
        positions,
        cos_sin_cache,
        *cos_sin_cache.stride(),
        num_heads,
        cos_sin_cache.shape[1] // 2,
        HALF=half,
        BLOCK_HALF=triton.next_power_of_2(half),
        BLOCK_H=block_h,
        INTERLEAVE=interleave,
        num_warps=4,
        # Separate roundings of the two products, as the reference.
        enable_fp_fusion=False,
    )
