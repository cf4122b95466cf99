# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The fused forward of a Kimi K3.1 DSA layer: packed input GEMM, fused
prologue, packed query GEMM, indexer scoring and sparse MLA. Every other
configuration serves the wrapper forward (upstream ops only)."""

from __future__ import annotations

from typing import Any, cast

import torch
from torch import nn

from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.linear import UnquantizedLinearMethod
from vllm.model_executor.utils import is_weights_pre_processed
from vllm.models.kimi_k3.common.dsa_envs import (
    FORCE_WRAPPER_ENV,
    force_wrapper_forward,
)
from vllm.models.kimi_k3.common.dsa_formats import fused_prologue_unsupported
from vllm.models.kimi_k3.nvidia.dsa_indexer import KimiK3DSAIndexerKNorm
from vllm.models.kimi_k3.nvidia.dsa_low_latency import (
    low_latency_linear,
    request_low_latency_warmup,
)
from vllm.models.kimi_k3.nvidia.dsa_ops import _extension as dsa_extension
from vllm.models.kimi_k3.nvidia.dsa_ops import (
    dsa_fused_prologue,
    mxfp4_fused_prologue,
)
from vllm.utils.torch_utils import _encode_layer_name
from vllm.v1.attention.backends.mla import indexer as v32_indexer

# ``layer`` is typed nn.Module: the layer module imports this one.


def kimi_k3_extension_available() -> bool:
    """Whether ``vllm._kimi_k3_C`` loads and runs on this GPU."""
    return dsa_extension.unavailable_reason() is None


def _norm_eps(norm: nn.Module) -> float | None:
    """The epsilon of an RMSNorm (``variance_epsilon``) or a LayerNorm."""
    eps = getattr(norm, "eps", None)
    if eps is None:
        eps = getattr(norm, "variance_epsilon", None)
    return eps


def fused_forward_blockers(layer: nn.Module) -> list[str]:
    """Why ``layer`` cannot run the fused forward (empty: it can)."""
    attn = cast(Any, layer.mla_attn.mla_attn)
    indexer = layer.dsa_indexer
    blockers = []
    if force_wrapper_forward():
        blockers.append(f"{FORCE_WRAPPER_ENV}=1")
    elif not indexer.use_fused_k_insert:
        blockers.append("no fused key insert")
    if indexer.dcp_world_size != 1:
        blockers.append("decode context parallelism")
    if layer.q_lora_rank is None:
        blockers.append("no q-LoRA")
    else:
        blockers += fused_prologue_unsupported(
            layer.q_lora_rank,
            layer.kv_lora_rank,
            layer.qk_rope_head_dim,
            indexer.index_head_dim,
            indexer.index_num_heads,
        )
    if not layer.use_nope:
        blockers.append("rope (not NoPE)")
    if not hasattr(layer, "g_proj"):
        blockers.append("no output gate")
    if getattr(attn, "kv_cache_dtype", None) != "fp8_ds_mla":
        blockers.append("kv cache dtype is not fp8_ds_mla")
    if getattr(attn, "hisparse_cache", None) is not None:
        blockers.append("HiSparse")
    if is_weights_pre_processed():
        blockers.append("weights pre-processed")
    if layer.weights_offloaded:
        blockers.append("weights offloaded")
    if layer.q_lora_rank is not None:
        # The fused prologue takes one eps for all three norms.
        eps = {
            _norm_eps(layer.q_a_layernorm),
            _norm_eps(layer.kv_a_layernorm),
            _norm_eps(indexer.k_index_norm),
        }
        if len(eps) != 1:
            blockers.append("norm eps differ")
        linears = (
            layer.fused_qkv_a_proj,
            indexer.wkv_index,
            layer.q_b_proj,
            indexer.wq_index,
        )
        if not all(
            isinstance(linear.quant_method, UnquantizedLinearMethod)
            for linear in linears
        ):
            blockers.append("quantized projections")
    if not kimi_k3_extension_available():
        blockers.append(
            dsa_extension.unavailable_reason() or "vllm._kimi_k3_C not available"
        )
    return blockers


def pack_projections(layer: nn.Module) -> list[torch.Tensor]:
    """Pack the input and query projections of ``layer`` into one weight
    each, the linears becoming views into them; returns the packed weights."""
    indexer = layer.dsa_indexer
    groups = (
        (layer.fused_qkv_a_proj, indexer.wkv_index),
        (layer.q_b_proj, indexer.wq_index),
    )
    packed_weights = []
    for linears in groups:
        packed = torch.cat([linear.weight.data for linear in linears])
        rows = [linear.weight.shape[0] for linear in linears]
        for linear, view in zip(linears, packed.split(rows), strict=True):
            linear.weight.data = view
        request_low_latency_warmup(packed)
        packed_weights.append(packed)
    return packed_weights


def fused_attention(layer: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    """The fused forward of ``layer`` (packed by :func:`pack_projections`)."""
    if layer.q_lora_rank is None or layer._packed is None:
        raise RuntimeError(
            "Kimi-K3.1 DSA fused forward of a layer without q-LoRA or packed "
            "projections"
        )
    indexer = layer.dsa_indexer
    attn = cast(Any, layer.mla_attn.mla_attn)
    input_weight, query_weight = layer._packed
    q_c, kv_c, k_pe, index_k, index_weights = low_latency_linear(
        hidden_states, input_weight
    ).split(
        [
            layer.q_lora_rank,
            layer.kv_lora_rank,
            layer.qk_rope_head_dim,
            indexer.index_head_dim,
            indexer.index_num_heads,
        ],
        dim=-1,
    )

    # Profile / dummy runs have no metadata and leave both caches alone.
    caches: tuple = (None, None, None, None)
    has_prefills = False
    forward_context = get_forward_context()
    attn_metadata = forward_context.attn_metadata
    if isinstance(attn_metadata, dict) and attn.kv_cache.numel() > 0:
        slot_mapping = forward_context.slot_mapping
        index_metadata = attn_metadata[indexer.k_cache.prefix]
        if not isinstance(slot_mapping, dict) or not isinstance(
            index_metadata, v32_indexer.DeepseekV32IndexerMetadata
        ):
            raise RuntimeError(
                f"{attn.layer_name}: the fused forward needs per-layer slot "
                "mappings and DeepseekV32IndexerMetadata, got "
                f"{type(slot_mapping).__name__} and "
                f"{type(index_metadata).__name__}"
            )
        has_prefills = cast(Any, attn_metadata[attn.layer_name]).num_prefills > 0
        caches = (
            attn.kv_cache,
            slot_mapping[attn.layer_name],
            indexer.k_cache.kv_cache,
            index_metadata.slot_mapping,
        )
    topk_indices_buffer = indexer.required_topk_indices_buffer()
    k_norm = cast(KimiK3DSAIndexerKNorm, indexer.k_index_norm)
    # One eps for the three norms (checked in pack_projections).
    prologue = dsa_fused_prologue
    if indexer.use_fp4_cache:
        prologue = mxfp4_fused_prologue
    q_c, kv_c_normed = prologue(
        q_c,
        kv_c,
        k_pe,
        index_k,
        layer.q_a_layernorm.weight,
        layer.kv_a_layernorm.weight,
        k_norm.weight,
        k_norm.bias,
        k_norm.eps,
        topk_indices_buffer,
        *caches,
    )

    q, index_q = low_latency_linear(q_c, query_weight).split(
        [
            layer.num_local_heads * layer.qk_head_dim,
            indexer.index_num_heads * indexer.index_head_dim,
        ],
        dim=-1,
    )
    q = q.view(-1, layer.num_local_heads, layer.qk_head_dim)
    if has_prefills:
        # q is a column slice; some MHA prefill backends need it contiguous.
        q = q.contiguous()
    index_q = index_q.view(-1, indexer.index_num_heads, indexer.index_head_dim)
    indexer.score(hidden_states, index_q, index_weights, None)
    attn.impl.record_logical_topk_ready()

    output = torch.empty(
        (hidden_states.shape[0], layer.num_local_heads * layer.v_head_dim),
        dtype=hidden_states.dtype,
        device=hidden_states.device,
    )
    torch.ops.vllm.unified_mla_attention_with_output(
        q,
        kv_c_normed,
        k_pe.unsqueeze(1),
        output,
        _encode_layer_name(attn.layer_name),
    )
    return output
