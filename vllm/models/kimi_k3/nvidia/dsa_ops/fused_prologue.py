# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""DSA fused prologue: norms and both cache inserts in one launch (CUDA).

The kernel (``csrc/kimi_k3/fused_prologue.cu``) writes the bytes of
``reference.fused_prologue``, its contract.

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
    """No cache to write: only the norms run."""
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
    indexer keys; returns the normed ``(q_c, kv_c)``. ``mx_scales=None`` picks
    the fp8 scale word the device's DeepGEMM reads (SM10x: UE8M0)."""
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
        # The indexer entry and the top-k fill are the insert op's.
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
    """:func:`dsa_fused_prologue` with MXFP4 indexer keys (68 bytes per token
    at head dim 128, SM10x readers).""",
)
