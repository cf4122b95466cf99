# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The decode batch that vLLM's Triton KDA decode can launch.

Its grid puts decode tokens x KDA heads per rank on CUDA's y dimension
(at most 65535); a larger batch fails only at warm-up, after the weights and
caches are in place, so ``max_num_seqs`` is checked at config verification.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllm.config import VllmConfig

CUDA_MAX_GRID_Y = 65535


def triton_kda_decode_max_num_seqs(heads_per_rank: int) -> int:
    """The largest decode batch whose Triton KDA decode grid fits."""
    return CUDA_MAX_GRID_Y // heads_per_rank


def kda_decode_backend(vllm_config: VllmConfig, kda_config: dict[str, Any]) -> str:
    """The KDA decode backend the layer will resolve to, from vLLM's own
    ``resolve_kda_decode_backend`` with the layer's arguments."""
    from vllm.model_executor.layers.mamba.mamba_utils import (
        MambaStateDtypeCalculator,
    )
    from vllm.models.kimi_k3.nvidia.kda import resolve_kda_decode_backend

    model_config = vllm_config.model_config
    cache_config = vllm_config.cache_config
    tp_size = vllm_config.parallel_config.tensor_parallel_size
    additional_config = vllm_config.additional_config
    requested = (
        additional_config.get("kda_decode_backend", "auto")
        if isinstance(additional_config, dict)
        else "auto"
    )
    spec = vllm_config.speculative_config
    num_spec = spec.num_speculative_tokens if spec is not None else 0
    conv_state_dtype, recurrent_state_dtype = MambaStateDtypeCalculator.kda_state_dtype(
        model_config.dtype,
        cache_config.mamba_cache_dtype,
        cache_config.mamba_ssm_cache_dtype,
    )[:2]
    return resolve_kda_decode_backend(
        requested,
        kda_config["num_heads"] // tp_size,
        kda_config["head_dim"],
        kda_config["short_conv_kernel_size"],
        num_spec,
        model_config.dtype,
        conv_state_dtype,
        recurrent_state_dtype,
    )


def check_kda_decode_grid(vllm_config: VllmConfig) -> None:
    """Refuse a ``max_num_seqs`` the Triton KDA decode cannot launch, when a
    Kimi K3 model's KDA layers would decode with it (the fused decodes have no
    such limit)."""
    from vllm.platforms import current_platform

    if not current_platform.is_cuda():
        return
    text_config = getattr(vllm_config.model_config, "hf_text_config", None)
    kda_config = getattr(text_config, "linear_attn_config", None)
    if not isinstance(kda_config, dict) or not kda_config.get("kda_layers"):
        return
    # KimiK3DeltaAttention serves only the full-rank gate.
    if not kda_config.get("use_full_rank_gate", False):
        return
    tp_size = vllm_config.parallel_config.tensor_parallel_size
    num_heads = kda_config["num_heads"]
    if num_heads % tp_size:
        return
    heads_per_rank = num_heads // tp_size
    max_num_seqs = vllm_config.scheduler_config.max_num_seqs
    bound = triton_kda_decode_max_num_seqs(heads_per_rank)
    if max_num_seqs <= bound:
        return
    if kda_decode_backend(vllm_config, kda_config) != "triton":
        return
    raise ValueError(
        f"max_num_seqs {max_num_seqs} is too large for this model at "
        f"tensor_parallel_size {tp_size}: accepted: at most {bound}. Its "
        f"{heads_per_rank} KDA heads per rank decode with vLLM's Triton "
        "KDA decode (fused_recurrent_kda_packed_decode; the native fused decode "
        "does not take this configuration), whose launch grid puts decode "
        f"requests x KDA heads per rank on CUDA's grid y, at most {CUDA_MAX_GRID_Y}: "
        f"{max_num_seqs} x {heads_per_rank} = {max_num_seqs * heads_per_rank} "
        "fails the launch (at warm-up, or when that many requests decode). Use "
        f"--max-num-seqs {bound} or less"
    )
