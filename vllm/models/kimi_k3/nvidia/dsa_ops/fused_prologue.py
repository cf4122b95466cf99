# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""DSA fused prologue: norms and both cache inserts in one launch (CUDA).

``reference.fused_prologue`` is the contract of the kernel
(``csrc/kimi_k3/fused_prologue.cu``); with the caches ``None`` or empty
(profiling run) it only normalizes.
"""

import torch

from vllm.models.kimi_k3.nvidia.dsa_ops._extension import kimi_k3_ops
from vllm.models.kimi_k3.nvidia.dsa_ops._variants import mxfp4_variant
from vllm.models.kimi_k3.nvidia.dsa_ops.indexer_k_insert import (
    check_slot_bounds,
    indexer_k_norm_quant_insert,
    resolve_mx_scales,
)
from vllm.models.kimi_k3.nvidia.dsa_ops.torch_path import (
    rms_norm,
    runs_torch_path,
    write_mla_entries,
)

_SLOT_MAPPINGS_REQUIRED = (
    "dsa_fused_prologue: mla_slot_mapping and index_slot_mapping are required "
    "with the caches (pass all four, or none for a profiling run)"
)


def _profiling_run(
    mla_kv_cache: torch.Tensor | None, index_kv_cache: torch.Tensor | None
) -> bool:
    return (
        mla_kv_cache is None
        or index_kv_cache is None
        or mla_kv_cache.numel() == 0
        or index_kv_cache.numel() == 0
    )


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
    *,
    fp4: bool = False,
    mx_scales: bool | None = None,
    check_slots: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused prologue (CUDA; torch off CUDA) with fp8 or, with ``fp4``, MXFP4
    indexer keys; returns the normed ``(q_c, kv_c)``."""
    mx_scales = resolve_mx_scales(fp4, mx_scales, q_c.device)
    if check_slots and mla_kv_cache is not None and index_kv_cache is not None:
        if mla_slot_mapping is None or index_slot_mapping is None:
            raise ValueError(_SLOT_MAPPINGS_REQUIRED)
        check_slot_bounds(mla_slot_mapping, mla_kv_cache)
        check_slot_bounds(index_slot_mapping, index_kv_cache)
    num_tokens = q_c.shape[0]
    if runs_torch_path(q_c):
        q_c_out = rms_norm(q_c, q_a_norm_weight, eps)
        kv_c_out = rms_norm(kv_c, kv_a_norm_weight, eps)
        if _profiling_run(mla_kv_cache, index_kv_cache):
            return q_c_out, kv_c_out
        if mla_slot_mapping is None or index_slot_mapping is None:
            raise ValueError(_SLOT_MAPPINGS_REQUIRED)
        write_mla_entries(kv_c_out, k_pe, mla_slot_mapping, mla_kv_cache)
        indexer_k_norm_quant_insert(
            index_k,
            k_norm_weight,
            k_norm_bias,
            eps,
            index_slot_mapping,
            index_kv_cache,
            topk_indices_buffer,
            num_tokens,
            fp4=fp4,
            mx_scales=mx_scales,
        )
        return q_c_out, kv_c_out
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


mxfp4_fused_prologue = mxfp4_variant(
    dsa_fused_prologue,
    "mxfp4_fused_prologue",
    """:func:`dsa_fused_prologue` with MXFP4 indexer keys (SM10x readers).""",
)
