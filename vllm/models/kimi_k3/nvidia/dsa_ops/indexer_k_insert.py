# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Indexer key k-norm -> quantize -> paged insert (CUDA).

``reference.indexer_k_insert`` is the contract of the kernel
(``csrc/kimi_k3/indexer_k_insert.cu``). Slots of -1 are skipped and
out-of-range slots never written (``check_slots=True`` raises for them, at
the cost of a host sync).
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
    """Raise when a slot is neither -1 nor inside the paged cache (syncs; a
    no-op during CUDA-graph capture)."""
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
    """The fp8 scale word: ``None`` follows the device's DeepGEMM (UE8M0 x4
    on SM10x, fp32 elsewhere); MXFP4 keys have none."""
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
    """Indexer key insert (CUDA; torch off CUDA), fp8 or, with ``fp4``,
    MXFP4 keys."""
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
    """:func:`indexer_k_norm_quant_insert` with MXFP4 keys (SM10x readers).""",
)
