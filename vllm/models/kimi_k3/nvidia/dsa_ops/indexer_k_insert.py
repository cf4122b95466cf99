# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Indexer key k-norm -> quantize -> paged insert (CUDA).

The kernel (``csrc/kimi_k3/indexer_k_insert.cu``) writes the bytes of
``reference.indexer_k_insert``, its contract.

Semantics, per token ``t < slot_mapping.numel()`` with ``slot >= 0``:

1. ``k = layer_norm(index_k[t].float(), weight, bias, eps).bfloat16()``: the
   bias-full fp32 LayerNorm of ``KimiK3DSAIndexerKNorm``, rounded to bf16 as
   that module returns it, so the fused path stores what the unfused one
   would quantize.
2. fp8: ``e = ceil(log2(max(amax(k), 1e-4) / 448))``; codes
   ``e4m3(k * 2**-e)`` (round to nearest even, saturating); scale word
   ``2**e`` as fp32 (SM90 readers) or four equal UE8M0 bytes ``e + 127``
   (SM100 readers, ``mx_scales``).
   MXFP4: per 32 values ``e = ceil(log2(max(amax, 6 * 2^-126) * (1/6)))``;
   e2m1 codes of ``k * 2**-e`` (even element in the low nibble), UE8M0 byte
   ``e + 127`` per 32 values.
3. Indexer cache ``[num_blocks, block_size, entry]`` uint8, entry 132 (fp8) or
   68 (MXFP4) bytes at head dim 128. Per block (block stride taken from the
   tensor: blocks of the packed DSA row are not contiguous):
   ``[block_size x values][block_size x scales]``; slot ``s`` lives in block
   ``s // block_size`` at row ``s % block_size`` of each region.

Slots of -1 are skipped. Rows ``[0, num_tokens)`` of the top-k buffer are
set to -1. An empty cache (profiling run) touches nothing, the top-k buffer
included. Slots beyond the cache are never written (a device-side guard);
``check_slots=True`` raises for them instead (one host sync, so it is off by
default and always skipped while a CUDA graph is being captured).
"""

import torch

from vllm.models.kimi_k3.nvidia.dsa_ops._extension import kimi_k3_ops
from vllm.models.kimi_k3.nvidia.dsa_ops._variants import mxfp4_variant
from vllm.models.kimi_k3.nvidia.dsa_ops.formats import use_mx_scales
from vllm.models.kimi_k3.nvidia.dsa_ops.torch_path import (
    k_norm,
    runs_torch_path,
    write_indexer_entries,
)


def check_slot_bounds(slot_mapping: torch.Tensor, kv_cache: torch.Tensor) -> None:
    """Raise when a slot is neither -1 nor inside the paged cache.

    Syncs with the device; a no-op during CUDA-graph capture."""
    if slot_mapping.numel() == 0 or kv_cache.numel() == 0:
        return
    if slot_mapping.is_cuda and torch.cuda.is_current_stream_capturing():
        return
    num_slots = kv_cache.shape[0] * kv_cache.shape[1]
    lo, hi = (int(v) for v in torch.aminmax(slot_mapping))
    if lo < -1 or hi >= num_slots:
        raise ValueError(
            f"slot_mapping holds slots in [{lo}, {hi}] but the cache has "
            f"{num_slots} slots (-1 means skip)"
        )


def resolve_mx_scales(fp4: bool, mx_scales: bool | None, device: torch.device) -> bool:
    """The scale word of fp8 keys: ``None`` follows the device's DeepGEMM
    (UE8M0 x4 on SM10x, fp32 elsewhere). MXFP4 keys have UE8M0 block bytes
    and no scale word, so ``mx_scales=True`` is refused with ``fp4``."""
    if fp4:
        if mx_scales:
            raise ValueError(
                "mx_scales=True is an fp8 scale word; MXFP4 keys (fp4=True) "
                "carry UE8M0 block scales already"
            )
        return False
    if mx_scales is None:
        return use_mx_scales(device)
    return mx_scales


def indexer_k_norm_quant_insert(
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
    mx_scales: bool | None = None,
    check_slots: bool = False,
) -> None:
    """Indexer key insert (CUDA; torch off CUDA): fp8 keys (132 bytes per
    token at head dim 128) or, with ``fp4``, MXFP4 keys (68 bytes).
    ``mx_scales=None`` picks the fp8 scale word the device's DeepGEMM reads."""
    mx_scales = resolve_mx_scales(fp4, mx_scales, kv_cache.device)
    if check_slots:
        check_slot_bounds(slot_mapping, kv_cache)
    if runs_torch_path(kv_cache):
        if kv_cache.numel() == 0:
            return
        k = k_norm(index_k[: slot_mapping.numel()], weight, bias, eps)
        write_indexer_entries(k, slot_mapping, kv_cache, fp4=fp4, mx_scales=mx_scales)
        topk_indices_buffer[:num_tokens] = -1
        return
    kimi_k3_ops().indexer_k_norm_quant_insert(
        index_k,
        weight,
        bias,
        eps,
        slot_mapping,
        kv_cache,
        topk_indices_buffer,
        num_tokens,
        fp4,
        mx_scales,
    )


mxfp4_k_norm_quant_insert = mxfp4_variant(
    indexer_k_norm_quant_insert,
    "mxfp4_k_norm_quant_insert",
    """:func:`indexer_k_norm_quant_insert` with MXFP4 keys (68 bytes per token
    at head dim 128, SM10x readers).""",
)
