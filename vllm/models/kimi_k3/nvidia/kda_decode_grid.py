# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The decode batch that vLLM 0.33.0's Triton KDA decode can launch.

Kimi K3's KDA layer (``KimiK3DeltaAttention``) decodes with a native fused
kernel where it can and otherwise falls back to the Triton kernel
``fused_recurrent_kda_packed_decode``, whose launch grid is
``(cdiv(V, BV), B * H)``: B decode tokens times H KDA heads per rank on the
grid's y dimension, which CUDA caps at 65535. A larger product fails the
launch ("Triton Error [CUDA]: invalid argument") in the engine's warm-up, after
the weights and the caches are in place.

The model runner decodes at most ``max_num_seqs`` requests of one token each
in a step: the warm-up decodes ``min(max_num_seqs, ...)`` requests at once,
the CUDA graphs are captured for at most ``max_num_seqs`` requests, and vLLM
requires ``max_num_batched_tokens >= max_num_seqs``, so the scheduler can
batch that many. :func:`check_kda_decode_grid` refuses a larger
``max_num_seqs`` at config verification, when the layer would take the Triton
path, which is decided by vLLM's own ``resolve_kda_decode_backend`` with the
arguments the layer passes it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllm.config import VllmConfig

# CUDA's limit on a launch grid's y (and z) dimension.
CUDA_MAX_GRID_Y = 65535


def triton_kda_decode_max_num_seqs(heads_per_rank: int) -> int:
    """The largest decode batch (one token per request) whose Triton KDA
    decode grid fits: ``batch x heads_per_rank <= 65535``."""
    return CUDA_MAX_GRID_Y // heads_per_rank


def kda_decode_backend(vllm_config: VllmConfig, kda_config: dict[str, Any]) -> str:
    """The KDA decode backend the layer will resolve to: vLLM's own
    ``resolve_kda_decode_backend``, called with what ``KimiK3DeltaAttention``
    passes it (the requested ``additional_config["kda_decode_backend"]``, KDA
    heads per rank, head dim, convolution width, speculative tokens, the
    model dtype and the KDA state dtypes). Raises what it raises for a backend
    that cannot be served, as the layer would.

    Importing vLLM's KDA module also loads vLLM's CUDA ops, whose presence
    (``torch.ops._C.fused_kda_decode``) the resolution reads.
    """
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
    """Refuse a ``max_num_seqs`` whose decode batch the Triton KDA decode
    cannot launch (``max_num_seqs x KDA heads per rank > 65535``), when the
    KDA layers of a Kimi K3 / K3.1 model would decode with it.

    A no-op off CUDA, for a model without Kimi K3's KDA layers (no
    ``linear_attn_config``, or Kimi-Linear's gate, which another layer
    serves), for heads that do not divide by the tensor parallel size (the
    layer refuses those), and whenever the native or FlashInfer fused decode
    is resolved (those have no such limit).
    """
    from vllm.platforms import current_platform

    if not current_platform.is_cuda():
        return
    text_config = getattr(vllm_config.model_config, "hf_text_config", None)
    kda_config = getattr(text_config, "linear_attn_config", None)
    if not isinstance(kda_config, dict) or not kda_config.get("kda_layers"):
        return
    # KimiK3DeltaAttention serves only the full-rank gate (model.py's decoder
    # layer builds Kimi-Linear's own layer otherwise).
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
        f"{heads_per_rank} KDA heads per rank decode with vLLM 0.33.0's Triton "
        "KDA decode (fused_recurrent_kda_packed_decode; the native fused decode "
        "does not take this configuration), whose launch grid puts decode "
        f"requests x KDA heads per rank on CUDA's grid y, at most {CUDA_MAX_GRID_Y}: "
        f"{max_num_seqs} x {heads_per_rank} = {max_num_seqs * heads_per_rank} "
        "fails the launch (at warm-up, or when that many requests decode). Use "
        f"--max-num-seqs {bound} or less"
    )
