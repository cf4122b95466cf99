# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Kimi K3.1 DSA (DeepSeek Sparse Attention) for the kimi_k3 stack.

Kimi K3's MLA plus a lightning indexer whose top-k selects the tokens sparse
MLA attends to, through ``MLAModules(is_sparse=True)``. Upstream APIs newer
than 0.33.0 (ShardQ) are feature-detected.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn

from vllm.config import CacheConfig, VllmConfig, get_current_vllm_config
from vllm.distributed import get_tensor_model_parallel_world_size
from vllm.logger import init_logger
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from vllm.model_executor.layers.mla import MLAModules, MultiHeadLatentAttentionWrapper
from vllm.model_executor.layers.quantization import QuantizationConfig
from vllm.model_executor.layers.rotary_embedding import get_rope
from vllm.model_executor.layers.rotary_embedding.common import yarn_get_mscale
from vllm.models.kimi_k3.common.dsa_cache import KimiK3FlashMLASparseBackend
from vllm.models.kimi_k3.common.dsa_settings import resolve_dsa_settings
from vllm.models.kimi_k3.nvidia import dsa_fused, dsa_ops
from vllm.models.kimi_k3.nvidia.dsa_indexer import (
    KimiK3DSAIndexer,
    KimiK3DSAIndexerKNorm,
)
from vllm.models.kimi_k3.nvidia.dsa_ops import (  # noqa: F401 (re-exported)
    dsa_fused_prologue,
    indexer_k_norm_quant_insert,
    indexer_q_quant_fold_weights,
    mxfp4_fused_prologue,
    mxfp4_k_norm_quant_insert,
    mxfp4_q_quant,
)
from vllm.models.kimi_k3.nvidia.mla import (
    _GATE_MULTI_STREAM_TOKEN_THRESHOLD,
    _gate_sigmoid_mul,
)
from vllm.platforms import current_platform
from vllm.transformers_utils.configs.kimi_linear import KimiLinearConfig
from vllm.utils.multi_stream_utils import maybe_execute_in_parallel
from vllm.v1.attention.backends.mla.flashmla_sparse import FlashMLASparseBackend

__all__ = [
    "KimiK3DSAAttention",
    "KimiK3DSAIndexer",
    "KimiK3DSAIndexerKNorm",
    "make_topk_indices_buffer",
    "padded_num_heads",
    "use_kimi_k3_mla_backend",
]
__all__ += dsa_ops.__all__

logger = init_logger(__name__)


def padded_num_heads(num_heads: int, tp_size: int) -> int:
    """``num_heads`` rounded up to a multiple of ``tp_size``."""
    return (num_heads + tp_size - 1) // tp_size * tp_size


def make_topk_indices_buffer(
    vllm_config: VllmConfig, device: torch.device | str | None = None
) -> torch.Tensor:
    """The int32 ``[rows, index_topk]`` buffer a model's DSA layers share."""
    settings = resolve_dsa_settings(vllm_config)
    if device is None:
        device = current_platform.device_type or "cpu"
    return torch.empty(
        (settings.topk_buffer_rows, settings.index_topk),
        dtype=torch.int32,
        device=device,
    )


def _accepts_kwarg(fn: Any, name: str) -> bool:
    """Whether ``fn`` names the parameter ``name`` (a bare ``**kwargs`` may
    forward it somewhere that refuses it)."""
    try:
        parameters = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return name in parameters


class KimiK3DSAAttention(nn.Module):
    """Kimi K3.1 DSA attention: Kimi K3's MLA projections plus the indexer."""

    def __init__(
        self,
        config: KimiLinearConfig,
        hidden_size: int,
        num_heads: int,
        qk_nope_head_dim: int,
        qk_rope_head_dim: int,
        v_head_dim: int,
        q_lora_rank: int | None,
        kv_lora_rank: int,
        cache_config: CacheConfig | None = None,
        quant_config: QuantizationConfig | None = None,
        prefix: str = "",
        reduce_results: bool = True,
        topk_indices_buffer: torch.Tensor | None = None,
        aux_stream: torch.cuda.Stream | None = None,
        index_group_builder: Any | None = None,
    ) -> None:
        super().__init__()
        dsa_config = getattr(config, "dsa_config", None)
        if dsa_config is None:
            raise ValueError("dsa_config is required for KimiK3DSAAttention")
        if current_platform.is_rocm():
            raise NotImplementedError(
                "Kimi-K3.1 DSA requires the CUDA FlashMLA sparse / DeepGEMM "
                "indexer kernels; ROCm is not supported."
            )
        self.hidden_size = hidden_size
        self.qk_nope_head_dim = qk_nope_head_dim
        self.qk_rope_head_dim = qk_rope_head_dim
        self.qk_head_dim = qk_nope_head_dim + qk_rope_head_dim
        self.v_head_dim = v_head_dim
        self.q_lora_rank = q_lora_rank
        self.kv_lora_rank = kv_lora_rank

        self.num_heads = num_heads
        tp_size = get_tensor_model_parallel_world_size()
        if num_heads % tp_size > 0:
            num_padded_heads = padded_num_heads(num_heads, tp_size)
            logger.warning_once(
                f"DSA num_heads {num_heads} is not divisible by tp_size "
                f"{tp_size}, will pad to {num_padded_heads} heads"
            )
            self.num_heads = num_padded_heads
        self.num_local_heads = self.num_heads // tp_size

        self.scaling = self.qk_head_dim**-0.5
        self.max_position_embeddings = config.max_position_embeddings

        self._init_projections(config, quant_config, reduce_results, prefix)
        self._init_rope_and_gate(config, quant_config, prefix)

        self.index_topk = dsa_config.index_topk
        self.index_head_dim = dsa_config.index_head_dim
        self.index_num_heads = dsa_config.index_num_heads
        self.index_rope_dim = dsa_config.index_rope_dim
        if self.index_rope_dim > 0 and self.use_nope:
            raise ValueError(
                "dsa_config.index_rope_dim > 0 is incompatible with "
                "mla_use_nope (there is no rotary cache to share), got "
                f"index_rope_dim={self.index_rope_dim}"
            )
        if self.index_rope_dim > min(self.qk_rope_head_dim, self.index_head_dim):
            raise ValueError(
                f"dsa_config.index_rope_dim ({self.index_rope_dim}) must "
                f"not exceed min(qk_rope_head_dim={self.qk_rope_head_dim}, "
                f"index_head_dim={self.index_head_dim})"
            )
        index_topk_freq = getattr(dsa_config, "index_topk_freq", 1)
        if index_topk_freq not in (None, 1):
            raise NotImplementedError(
                "Kimi-K3.1 DSA does not support index_topk_freq != 1 "
                f"(index share); dsa_config.index_topk_freq accepts 1 or null, "
                f"got {index_topk_freq!r}."
            )

        vllm_config = get_current_vllm_config()
        self.topk_indices_buffer = self._model_topk_buffer(
            vllm_config, topk_indices_buffer
        )

        index_q_input_size = (
            self.q_lora_rank if self.q_lora_rank is not None else self.hidden_size
        )
        self.dsa_indexer = KimiK3DSAIndexer(
            vllm_config=vllm_config,
            hidden_size=self.hidden_size,
            index_q_input_size=index_q_input_size,
            index_head_dim=self.index_head_dim,
            index_num_heads=self.index_num_heads,
            index_topk=self.index_topk,
            rms_norm_eps=config.rms_norm_eps,
            index_rope_dim=self.index_rope_dim,
            index_k_norm_type=dsa_config.index_k_norm_type,
            cache_config=cache_config,
            quant_config=quant_config,
            topk_indices_buffer=self.topk_indices_buffer,
            prefix=f"{prefix}.dsa_indexer",
        )

        self._init_mla_wrapper(cache_config, quant_config, prefix, index_group_builder)

        use_kimi_k3_mla_backend(self.mla_attn.mla_attn)

        indexer = self.dsa_indexer
        # Dense-MHA prefills never read the top-k indices (PCP excluded).
        if not indexer.use_pcp:
            indexer.dense_mha_metadata_layer_name = self.mla_attn.mla_attn.layer_name
        if getattr(self.mla_attn.mla_attn, "use_shardq", False):
            indexer.k_cache.use_shardq = True

        offload = vllm_config.offload_config
        self.weights_offloaded = (
            offload.uva.cpu_offload_gb > 0 or offload.prefetch.offload_group_size > 0
        )
        self.aux_stream = aux_stream
        self._gate_events: tuple[torch.cuda.Event, torch.cuda.Event] | None = None
        self._packed: list[torch.Tensor] | None = None

    def _init_projections(
        self,
        config: KimiLinearConfig,
        quant_config: QuantizationConfig | None,
        reduce_results: bool,
        prefix: str,
    ) -> None:
        """The MLA projections; the output gate is its own linear."""

        def linear(
            cls: type[nn.Module],
            in_features: int,
            out_features: int | list[int],
            name: str,
            **kwargs: Any,
        ) -> Any:
            return cls(
                in_features,
                out_features,
                bias=False,
                quant_config=quant_config,
                prefix=f"{prefix}.{name}",
                **kwargs,
            )

        if self.q_lora_rank is not None:
            self.fused_qkv_a_proj = linear(
                MergedColumnParallelLinear,
                self.hidden_size,
                [self.q_lora_rank, self.kv_lora_rank + self.qk_rope_head_dim],
                "fused_qkv_a_proj",
                disable_tp=True,
            )
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, eps=config.rms_norm_eps)
            self.q_b_proj = linear(
                ColumnParallelLinear,
                self.q_lora_rank,
                self.num_heads * self.qk_head_dim,
                "q_b_proj",
            )
        else:
            self.kv_a_proj_with_mqa = linear(
                ReplicatedLinear,
                self.hidden_size,
                self.kv_lora_rank + self.qk_rope_head_dim,
                "kv_a_proj_with_mqa",
            )
            self.q_proj = linear(
                ColumnParallelLinear,
                self.hidden_size,
                self.num_heads * self.qk_head_dim,
                "q_proj",
            )
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, eps=config.rms_norm_eps)
        self.kv_b_proj = linear(
            ColumnParallelLinear,
            self.kv_lora_rank,
            self.num_heads * (self.qk_nope_head_dim + self.v_head_dim),
            "kv_b_proj",
        )
        self.o_proj = linear(
            RowParallelLinear,
            self.num_heads * self.v_head_dim,
            self.hidden_size,
            "o_proj",
            reduce_results=reduce_results,
        )

    def _init_rope_and_gate(
        self,
        config: KimiLinearConfig,
        quant_config: QuantizationConfig | None,
        prefix: str,
    ) -> None:
        """The rotary embedding (NoPE: none) and the output gate."""
        # Kimi K3 is NoPE; a scaled rope becomes deepseek_yarn.
        rope_parameters: dict[str, Any] = dict(
            getattr(config, "rope_parameters", None) or {}
        )
        rope_parameters.setdefault("rope_theta", 10000.0)
        rope_scaling = (
            rope_parameters
            if rope_parameters.get("rope_type") not in (None, "default")
            else None
        )
        self.use_nope = bool(config.mla_use_nope)
        self.rotary_emb: nn.Module | None
        if self.use_nope:
            self.rotary_emb = None
        else:
            if rope_scaling:
                rope_parameters["rope_type"] = "deepseek_yarn"
            self.rotary_emb = get_rope(
                self.qk_rope_head_dim,
                max_position=self.max_position_embeddings,
                is_neox_style=False,
                rope_parameters=rope_parameters,
            )
        if rope_scaling:
            mscale_all_dim = rope_scaling.get("mscale_all_dim", False)
            scaling_factor = rope_parameters["factor"]
            mscale = yarn_get_mscale(scaling_factor, float(mscale_all_dim))
            self.scaling = self.scaling * mscale * mscale

        if config.mla_use_output_gate:
            self.g_proj = ColumnParallelLinear(
                self.hidden_size,
                self.v_head_dim * self.num_heads,
                bias=False,
                quant_config=quant_config,
                prefix=f"{prefix}.g_proj",
            )

    def _model_topk_buffer(
        self, vllm_config: VllmConfig, topk_indices_buffer: torch.Tensor | None
    ) -> torch.Tensor:
        """The model-level top-k buffer, or a per-layer fallback."""
        if topk_indices_buffer is None:
            logger.warning_once(
                "KimiK3DSAAttention did not receive a model-level "
                "topk_indices_buffer; allocating a per-layer fallback."
            )
            topk_indices_buffer = make_topk_indices_buffer(vllm_config)
        return topk_indices_buffer

    def _init_mla_wrapper(
        self,
        cache_config: CacheConfig | None,
        quant_config: QuantizationConfig | None,
        prefix: str,
        index_group_builder: Any | None,
    ) -> None:
        """vLLM's MLA wrapper in sparse mode."""
        has_q_lora = self.q_lora_rank is not None
        mla_modules = MLAModules(
            kv_a_layernorm=self.kv_a_layernorm,
            kv_b_proj=self.kv_b_proj,
            rotary_emb=self.rotary_emb,
            o_proj=self.o_proj,
            fused_qkv_a_proj=self.fused_qkv_a_proj if has_q_lora else None,
            kv_a_proj_with_mqa=None if has_q_lora else self.kv_a_proj_with_mqa,
            q_a_layernorm=self.q_a_layernorm if has_q_lora else None,
            q_b_proj=self.q_b_proj if has_q_lora else None,
            q_proj=None if has_q_lora else self.q_proj,
            g_proj=getattr(self, "g_proj", None),
            indexer=self.dsa_indexer,
            indexer_rotary_emb=self.rotary_emb,
            is_sparse=True,
            topk_indices_buffer=self.topk_indices_buffer,
            index_group_builder=index_group_builder,
        )
        wrapper_kwargs: dict[str, Any] = {}
        if _accepts_kwarg(MultiHeadLatentAttentionWrapper.__init__, "shardq_eligible"):
            wrapper_kwargs["shardq_eligible"] = True
        self.mla_attn = MultiHeadLatentAttentionWrapper(
            self.hidden_size,
            self.num_local_heads,
            self.scaling,
            self.qk_nope_head_dim,
            self.qk_rope_head_dim,
            self.v_head_dim,
            self.q_lora_rank,
            self.kv_lora_rank,
            mla_modules,
            cache_config,
            quant_config,
            prefix,
            **wrapper_kwargs,
        )

    def fused_forward_blockers(self) -> list[str]:
        """Why :meth:`pack_projections` would decline (empty: it will not)."""
        return dsa_fused.fused_forward_blockers(self)

    def pack_projections(self) -> None:
        """Enable the fused forward (as DeepseekV32Attention): pack
        ``[q_a | kv_a | wk | weights_proj]`` and ``[q_b | wq_index]`` into one
        weight each, the linears becoming views. Idempotent."""
        if self._packed is not None:
            return
        blockers = self.fused_forward_blockers()
        if blockers:
            logger.info_once(
                "Kimi K3.1 DSA layers use the wrapper forward (upstream ops): %s.",
                "; ".join(blockers),
            )
            return
        self._packed = dsa_fused.pack_projections(self)
        if self.aux_stream is not None:
            self._gate_events = (torch.cuda.Event(), torch.cuda.Event())
        logger.info_once("Kimi K3.1 DSA layers use the fused forward.")

    def forward(
        self,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
    ) -> torch.Tensor:
        if self._packed is None:
            return self.mla_attn(positions, hidden_states)
        # Small batches overlap the output-gate GEMM on the aux stream.
        if (
            self._gate_events is not None
            and hidden_states.shape[0] < _GATE_MULTI_STREAM_TOKEN_THRESHOLD
        ):
            attn_out, gate = maybe_execute_in_parallel(
                lambda: self._fused_attention(hidden_states),
                lambda: self.g_proj(hidden_states)[0],
                *self._gate_events,
                self.aux_stream,
            )
        else:
            attn_out = self._fused_attention(hidden_states)
            gate = self.g_proj(hidden_states)[0]
        return self.o_proj(_gate_sigmoid_mul(attn_out, gate))[0]

    def _fused_attention(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return dsa_fused.fused_attention(self, hidden_states)


def use_kimi_k3_mla_backend(attn: Any) -> None:
    """Give a DSA layer's MLA attention our FlashMLA sparse subclass, whose
    MLA pages the runner may split into kernel pages."""
    if getattr(attn, "attn_backend", None) is FlashMLASparseBackend:
        attn.attn_backend = KimiK3FlashMLASparseBackend
