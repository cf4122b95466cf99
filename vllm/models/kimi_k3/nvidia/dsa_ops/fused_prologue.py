# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""DSA fused prologue: norms and both cache inserts in one launch.

The CUDA kernel (``csrc/kimi_k3/fused_prologue.cu``) and the pure-torch
reference below write the same bytes; the reference is the contract.

Inputs are column slices of the packed ``[q_a | kv_a | k_pe | wk | weights]``
GEMM output ``[T, 1536 + 512 + 64 + 128 + 32]`` bf16 (row stride != width).
Per token ``t``:

- ``q_c_out[t] = rms_norm(q_c[t]) * q_a_norm_weight`` and
  ``kv_c_out[t] = rms_norm(kv_c[t]) * kv_a_norm_weight``, computed in fp32 and
  rounded once to bf16 (returned, contiguous).
- ``fp8_ds_mla`` entry at ``mla_slot_mapping[t]`` (flat ``block * block_size +
  offset``; cache ``[num_blocks, block_size, 656]`` uint8 as vLLM binds it):
  bytes [0, 512) fp8 e4m3 codes of ``kv_c_out[t]`` in 4 tiles of 128, each
  with scale ``2**ceil(log2(max(amax * (1/448), 1e-4)))``; bytes [512, 528)
  the 4 scales as fp32; bytes [528, 656) ``k_pe[t]`` as raw bf16.
- the indexer entry at ``index_slot_mapping[t]``: exactly the insert kernel's
  (``indexer_k_insert``), fp8 or MXFP4.
- top-k row ``t`` set to -1 for every ``t < T``.

Slots of -1 (and, as a guard, slots beyond a cache) are not written. With
the caches ``None`` or empty (profiling run) it only normalizes. One ``eps``
serves the three norms (the model checks they are equal).
"""

import torch

from vllm.models.kimi_k3.nvidia.dsa_ops._extension import kimi_k3_ops
from vllm.models.kimi_k3.nvidia.dsa_ops.formats import fp8_ds_mla_entry, use_mx_scales
from vllm.models.kimi_k3.nvidia.dsa_ops.indexer_k_insert import (
    check_slot_bounds,
    k_norm_reference,
    write_indexer_entries,
)


def _prologue(
    fp4: bool,
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
    mla_kv_cache: torch.Tensor | None,
    mla_slot_mapping: torch.Tensor | None,
    index_kv_cache: torch.Tensor | None,
    index_slot_mapping: torch.Tensor | None,
    mx_scales: bool | None,
    check_slots: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    if mx_scales is None:
        mx_scales = not fp4 and use_mx_scales(q_c.device)
    if check_slots and mla_kv_cache is not None and index_kv_cache is not None:
        assert mla_slot_mapping is not None and index_slot_mapping is not None
        check_slot_bounds(mla_slot_mapping, mla_kv_cache)
        check_slot_bounds(index_slot_mapping, index_kv_cache)
    num_tokens = q_c.shape[0]
    q_c_out = torch.empty(
        (num_tokens, q_c.shape[1]), dtype=q_c.dtype, device=q_c.device
    )
    kv_c_out = torch.empty(
        (num_tokens, kv_c.shape[1]), dtype=kv_c.dtype, device=kv_c.device
    )
    kimi_k3_ops().dsa_fused_prologue(
        q_c,
        kv_c,
        k_pe,
        index_k,
        q_a_norm_weight,
        kv_a_norm_weight,
        k_norm_weight,
        k_norm_bias,
        eps,
        topk_indices_buffer,
        mla_kv_cache,
        mla_slot_mapping,
        index_kv_cache,
        index_slot_mapping,
        q_c_out,
        kv_c_out,
        fp4,
        mx_scales,
    )
    return q_c_out, kv_c_out


def dsa_fused_prologue(
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
    mx_scales: bool | None = None,
    check_slots: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused prologue with fp8 indexer keys (CUDA); returns the normed
    ``(q_c, kv_c)``. ``mx_scales=None`` follows the device (SM10x: UE8M0)."""
    return _prologue(
        False,
        q_c,
        kv_c,
        k_pe,
        index_k,
        q_a_norm_weight,
        kv_a_norm_weight,
        k_norm_weight,
        k_norm_bias,
        eps,
        topk_indices_buffer,
        mla_kv_cache,
        mla_slot_mapping,
        index_kv_cache,
        index_slot_mapping,
        mx_scales,
        check_slots,
    )


def mxfp4_fused_prologue(
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
    check_slots: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused prologue with MXFP4 indexer keys (CUDA)."""
    return _prologue(
        True,
        q_c,
        kv_c,
        k_pe,
        index_k,
        q_a_norm_weight,
        kv_a_norm_weight,
        k_norm_weight,
        k_norm_bias,
        eps,
        topk_indices_buffer,
        mla_kv_cache,
        mla_slot_mapping,
        index_kv_cache,
        index_slot_mapping,
        False,
        check_slots,
    )


def rms_norm_reference(
    x: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """fp32 RMSNorm times the weight, rounded once to bf16."""
    xf = x.float()
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * rstd * weight.float()).to(torch.bfloat16)


def fused_prologue_reference(
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
    fp4: bool = False,
    mx_scales: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pure-torch twin of both prologue kernels (mutates the caches and the
    top-k buffer)."""
    q_out = rms_norm_reference(q_c, q_a_norm_weight, eps)
    kv_out = rms_norm_reference(kv_c, kv_a_norm_weight, eps)
    if (
        mla_kv_cache is None
        or index_kv_cache is None
        or mla_kv_cache.numel() == 0
        or index_kv_cache.numel() == 0
    ):
        return q_out, kv_out
    assert mla_slot_mapping is not None and index_slot_mapping is not None
    n = mla_slot_mapping.numel()
    slots = mla_slot_mapping.long()
    keep = slots >= 0
    entries = fp8_ds_mla_entry(kv_out[:n], k_pe[:n])[keep]
    block_size = mla_kv_cache.shape[1]
    mla_kv_cache[slots[keep] // block_size, slots[keep] % block_size] = entries
    m = index_slot_mapping.numel()
    k = k_norm_reference(index_k[:m], k_norm_weight, k_norm_bias, eps)
    write_indexer_entries(k, index_slot_mapping, index_kv_cache, fp4, mx_scales)
    topk_indices_buffer[: q_c.shape[0]] = -1
    return q_out, kv_out
