# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Kimi K3.1 DSA (DeepSeek Sparse Attention) for the kimi_k3 stack.

Kimi K3's MLA plus a lightning indexer whose top-k selects the tokens sparse
MLA attends to, through ``MLAModules(is_sparse=True)``. Upstream APIs newer
than 0.33.0 (ShardQ) are feature-detected.
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from vllm.config import CacheConfig, CUDAGraphMode, VllmConfig, get_current_vllm_config
from vllm.distributed import get_dcp_group, get_tensor_model_parallel_world_size
from vllm.forward_context import get_forward_context
from vllm.logger import init_logger
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
    UnquantizedLinearMethod,
)
from vllm.model_executor.layers.mla import MLAModules, MultiHeadLatentAttentionWrapper
from vllm.model_executor.layers.quantization import QuantizationConfig
from vllm.model_executor.layers.rotary_embedding import get_rope
from vllm.model_executor.layers.rotary_embedding.common import yarn_get_mscale
from vllm.model_executor.utils import is_weights_pre_processed
from vllm.models.kimi_k3.common import dsa_cache, dsa_settings
from vllm.models.kimi_k3.common.dsa_cache import KimiK3FlashMLASparseBackend
from vllm.models.kimi_k3.common.dsa_config import DSAConfig, check_index_topk_freq
from vllm.models.kimi_k3.common.dsa_envs import FORCE_WRAPPER_ENV, force_wrapper_forward
from vllm.models.kimi_k3.common.dsa_formats import (
    fused_prologue_unsupported,
    k_insert_unsupported,
)
from vllm.models.kimi_k3.common.dsa_settings import resolve_dsa_settings
from vllm.models.kimi_k3.nvidia import (
    dsa_indexer_op,  # noqa: F401 (its op)
    dsa_ops,
)
from vllm.models.kimi_k3.nvidia.dsa_low_latency import (
    low_latency_linear,
    request_low_latency_warmup,
)
from vllm.models.kimi_k3.nvidia.dsa_ops import _extension as dsa_extension
from vllm.models.kimi_k3.nvidia.dsa_ops import (  # noqa: F401 (re-exported)
    dsa_fused_prologue,
    index_rope,
    indexer_k_norm_quant_insert,
    indexer_q_quant_fold_weights,
    mxfp4_fused_prologue,
    mxfp4_k_norm_quant_insert,
    mxfp4_q_quant,
)
from vllm.models.kimi_k3.nvidia.dsa_sparse_mla import KimiK3FlashMLASparseImpl
from vllm.models.kimi_k3.nvidia.mla import (
    _GATE_MULTI_STREAM_TOKEN_THRESHOLD,
    _gate_sigmoid_mul,
)
from vllm.platforms import current_platform
from vllm.transformers_utils.configs.kimi_linear import KimiLinearConfig
from vllm.utils.deep_gemm import mqa_logits_use_mx_scales
from vllm.utils.multi_stream_utils import maybe_execute_in_parallel
from vllm.utils.torch_utils import _encode_layer_name
from vllm.v1.attention.backends.mla import indexer as v32_indexer
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
    elif not kimi_k3_extension_available():
        blockers.append(
            dsa_extension.unavailable_reason() or "vllm._kimi_k3_C not available"
        )
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
    return blockers


def fused_k_insert_blockers(indexer: KimiK3DSAIndexer) -> list[str]:
    """Why the indexer cannot use our fused key insert (empty: it can)."""
    blockers = []
    if force_wrapper_forward():
        blockers.append(f"{FORCE_WRAPPER_ENV}=1")
    if indexer.use_pcp:
        blockers.append("prefill context parallelism")
    if not isinstance(indexer.k_index_norm, KimiK3DSAIndexerKNorm):
        blockers.append("index_k_norm_type 'rmsnorm'")
    if indexer.index_rope_dim != 0:
        blockers.append(f"index_rope_dim {indexer.index_rope_dim}")
    blockers += k_insert_unsupported(indexer.index_head_dim, indexer.index_num_heads)
    if not blockers and not kimi_k3_extension_available():
        blockers.append(
            dsa_extension.unavailable_reason() or "vllm._kimi_k3_C not available"
        )
    return blockers


def key_format_kwargs(fp4: bool) -> dict[str, bool]:
    """The key writers' format arguments: fp8 scales in the word vLLM's
    DeepGEMM reads (MXFP4 keys have one scale format)."""
    return {} if fp4 else {"mx_scales": mqa_logits_use_mx_scales()}


def _upstream_init_dcp_topk_merge() -> Any:
    """Upstream's ``init_dcp_topk_merge`` where the installed vLLM has it."""
    module = importlib.import_module("vllm.model_executor.layers.sparse_attn_indexer")
    return getattr(module, "init_dcp_topk_merge", None)


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

        self.dsa_config: DSAConfig = dsa_config
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
        check_index_topk_freq(getattr(dsa_config, "index_topk_freq", 1))

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

    @property
    def index_topk(self) -> int:
        """Top-k width, read from ``dsa_config`` (its one home)."""
        return self.dsa_config.index_topk

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
        return fused_forward_blockers(self)

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
        indexer = self.dsa_indexer
        groups = (
            (self.fused_qkv_a_proj, indexer.wkv_index),
            (self.q_b_proj, indexer.wq_index),
        )
        packed_weights = []
        for linears in groups:
            packed = torch.cat([linear.weight.data for linear in linears])
            rows = [linear.weight.shape[0] for linear in linears]
            for linear, view in zip(linears, packed.split(rows), strict=True):
                linear.weight.data = view
            request_low_latency_warmup(packed)
            packed_weights.append(packed)
        self._packed = packed_weights
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
        """Packed input GEMM, fused prologue, packed query GEMM, indexer
        scoring and sparse MLA."""
        if self.q_lora_rank is None or self._packed is None:
            raise RuntimeError(
                "Kimi-K3.1 DSA fused forward of a layer without q-LoRA or packed "
                "projections"
            )
        indexer = self.dsa_indexer
        attn = cast(Any, self.mla_attn.mla_attn)
        input_weight, query_weight = self._packed
        q_c, kv_c, k_pe, index_k, index_weights = low_latency_linear(
            hidden_states, input_weight
        ).split(
            [
                self.q_lora_rank,
                self.kv_lora_rank,
                self.qk_rope_head_dim,
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
            self.q_a_layernorm.weight,
            self.kv_a_layernorm.weight,
            k_norm.weight,
            k_norm.bias,
            k_norm.eps,
            topk_indices_buffer,
            *caches,
            **key_format_kwargs(indexer.use_fp4_cache),
        )

        q, index_q = low_latency_linear(q_c, query_weight).split(
            [
                self.num_local_heads * self.qk_head_dim,
                indexer.index_num_heads * indexer.index_head_dim,
            ],
            dim=-1,
        )
        q = q.view(-1, self.num_local_heads, self.qk_head_dim)
        if has_prefills:
            # q is a column slice; some MHA prefill backends need it contiguous.
            q = q.contiguous()
        index_q = index_q.view(-1, indexer.index_num_heads, indexer.index_head_dim)
        indexer.score(hidden_states, index_q, index_weights, None)
        attn.impl.record_logical_topk_ready()

        output = torch.empty(
            (hidden_states.shape[0], self.num_local_heads * self.v_head_dim),
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


class KimiK3DSAIndexer(nn.Module):
    """Indexer projections, key cache, and the drive of
    ``kimi_k3_sparse_attn_indexer`` (the ``deepseek_v2.Indexer`` pattern)."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        hidden_size: int,
        index_q_input_size: int,
        index_head_dim: int,
        index_num_heads: int,
        index_topk: int,
        rms_norm_eps: float,
        index_rope_dim: int = 0,
        index_k_norm_type: str = "rmsnorm",
        cache_config: CacheConfig | None = None,
        quant_config: QuantizationConfig | None = None,
        topk_indices_buffer: torch.Tensor | None = None,
        prefix: str = "",
    ) -> None:
        super().__init__()
        self.index_head_dim = index_head_dim
        self.index_num_heads = index_num_heads
        self.indexer_weight_scale = self.index_num_heads**-0.5
        # vLLM's MultiHeadLatentAttentionWrapper reads the indexer's topk_tokens.
        self.topk_tokens = index_topk
        # 0 = no indexer rope; the checkpoint is pair-permuted for neox.
        if index_rope_dim < 0 or index_rope_dim % 2 != 0:
            raise ValueError(
                f"dsa_config.index_rope_dim must be even and >= 0, got {index_rope_dim}"
            )
        if index_rope_dim > index_head_dim:
            raise ValueError(
                f"dsa_config.index_rope_dim ({index_rope_dim}) must not "
                f"exceed index_head_dim ({index_head_dim})"
            )
        self.index_rope_dim = index_rope_dim
        self.wq_index = ReplicatedLinear(
            index_q_input_size,
            self.index_num_heads * self.index_head_dim,
            bias=False,
            quant_config=quant_config,
            prefix=f"{prefix}.wq_index",
        )
        self.wkv_index = MergedColumnParallelLinear(
            hidden_size,
            [self.index_head_dim, self.index_num_heads],
            bias=False,
            quant_config=None,
            disable_tp=True,
            prefix=f"{prefix}.wkv_index",
        )
        self.k_index_norm: nn.Module
        if index_k_norm_type == "layernorm":
            self.k_index_norm = KimiK3DSAIndexerKNorm(
                self.index_head_dim, eps=rms_norm_eps
            )
        elif index_k_norm_type == "rmsnorm":
            self.k_index_norm = RMSNorm(self.index_head_dim, eps=rms_norm_eps)
        else:
            raise ValueError(
                "dsa_config.index_k_norm_type must be 'rmsnorm' or "
                f"'layernorm', got {index_k_norm_type!r}"
            )

        # Power-of-two (ue8m0) key scales, as DeepSeek V3.2.
        self.scale_fmt = "ue8m0"
        self.quant_block_size = self.index_head_dim
        self.index_softmax_scale = self.index_head_dim**-0.5
        # DeepGEMM's indexer kernels take 32 or 64 heads.
        self.padded_index_num_heads = dsa_settings.padded_index_heads(
            self.index_num_heads
        )
        self.use_fp4_cache = dsa_settings.resolve_dsa_settings(vllm_config).indexer_fp4
        self.k_cache = dsa_cache.KimiK3IndexerCache(
            head_dim=dsa_cache.indexer_cache_entry_bytes(
                self.index_head_dim, self.use_fp4_cache
            ),
            dtype=torch.uint8,
            prefix=f"{prefix}.k_cache",
            cache_config=cast(CacheConfig, cache_config),
        )
        self.max_model_len = vllm_config.model_config.max_model_len
        self.max_total_seq_len = v32_indexer.get_max_prefill_buffer_size(vllm_config)
        self.topk_indices_buffer = topk_indices_buffer
        self.use_pcp = vllm_config.parallel_config.prefill_context_parallel_size > 1
        # Set by KimiK3DSAAttention to skip scoring dense-MHA prefills.
        self.dense_mha_metadata_layer_name = ""
        self.topk_backend = vllm_config.kernel_config.sparse_indexer_topk_backend
        # Without the fused insert vLLM's op inserts the key (fp8 only).
        self.k_insert_blockers = fused_k_insert_blockers(self)
        self.use_fused_k_insert = not self.k_insert_blockers
        if self.k_insert_blockers:
            logger.info_once(
                "Kimi K3.1 DSA indexer keys use vLLM's unfused insert: %s.",
                "; ".join(self.k_insert_blockers),
            )
        if self.use_fp4_cache and not self.use_fused_k_insert:
            raise NotImplementedError(
                "MXFP4 indexer keys need the fused key insert "
                "(index_k_norm_type='layernorm', index_rope_dim=0, no prefill "
                "context parallelism, the vllm._kimi_k3_C extension built, and "
                "the shapes it takes), which this layer cannot use: "
                f"{'; '.join(self.k_insert_blockers)}. Use indexer_kv_dtype='fp8'."
            )
        self._parallel_config = vllm_config.parallel_config
        self.dcp_world_size = self._parallel_config.decode_context_parallel_size
        self.dcp_rank = get_dcp_group().rank_in_group if self.dcp_world_size > 1 else 0
        self._cp_kv_cache_interleave_size: int | None = None
        # 0 keeps the op's generic merge (no upstream DCP top-k merge).
        init_dcp_topk_merge = _upstream_init_dcp_topk_merge()
        self.dcp_local_topk = (
            init_dcp_topk_merge(vllm_config, index_topk)
            if init_dcp_topk_merge is not None
            else 0
        )

    def required_topk_indices_buffer(self) -> torch.Tensor:
        """The model's top-k buffer; required to write the cache."""
        if self.topk_indices_buffer is None:
            raise RuntimeError(
                f"{self.k_cache.prefix}: the indexer was built without the "
                "model's top-k buffer (topk_indices_buffer)"
            )
        return self.topk_indices_buffer

    @property
    def cp_kv_cache_interleave_size(self) -> int:
        """The parallel config's value, cached once a real batch runs."""
        if self._cp_kv_cache_interleave_size is None:
            value = self._parallel_config.cp_kv_cache_interleave_size
            if isinstance(get_forward_context().attn_metadata, dict):
                self._cp_kv_cache_interleave_size = value
            return value
        return self._cp_kv_cache_interleave_size

    def _apply_index_rope(
        self,
        index_q: torch.Tensor,
        index_k: torch.Tensor,
        positions: torch.Tensor,
        rotary_emb: nn.Module,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """In-place neox RoPE on the leading ``index_rope_dim`` dims."""
        index_rope.index_rope(
            index_q,
            index_k,
            positions.view(-1),
            rotary_emb.cos_sin_cache,
            self.index_rope_dim,
            False,  # interleave: neox / half-split
        )
        return index_q, index_k

    def _shardq_indexer_rows(self) -> torch.Tensor | None:
        """The rows a ShardQ step scores on this rank, or None (also under CUDA
        graphs, which would bake in the capture batch's rows)."""
        if not getattr(self.k_cache, "use_shardq", False):
            return None
        forward_context = get_forward_context()
        if (
            forward_context.cudagraph_runtime_mode != CUDAGraphMode.NONE
            or torch.cuda.is_current_stream_capturing()
        ):
            return None
        attn_metadata = forward_context.attn_metadata
        if not isinstance(attn_metadata, dict):
            return None
        prefill = getattr(attn_metadata.get(self.k_cache.prefix), "prefill", None)
        if prefill is None:
            return None
        return getattr(prefill, "shardq_gather_indices", None)

    def _fused_k_insert(self, index_k: torch.Tensor, num_tokens: int) -> None:
        """LayerNorm, quantize and insert the keys in one kernel."""
        attn_metadata = get_forward_context().attn_metadata
        kv_cache = self.k_cache.kv_cache
        if not isinstance(attn_metadata, dict) or kv_cache.numel() == 0:
            return
        metadata = attn_metadata[self.k_cache.prefix]
        if not isinstance(metadata, v32_indexer.DeepseekV32IndexerMetadata):
            raise RuntimeError(
                f"{self.k_cache.prefix}: the indexer cache's metadata is a "
                f"{type(metadata).__name__}, not DeepseekV32IndexerMetadata"
            )
        topk_indices_buffer = self.required_topk_indices_buffer()
        norm = cast(KimiK3DSAIndexerKNorm, self.k_index_norm)
        insert = indexer_k_norm_quant_insert
        if self.use_fp4_cache:
            insert = mxfp4_k_norm_quant_insert
        insert(
            index_k,
            norm.weight,
            norm.bias,
            norm.eps,
            metadata.slot_mapping,
            kv_cache,
            topk_indices_buffer,
            num_tokens,
            **key_format_kwargs(self.use_fp4_cache),
        )

    def forward(
        self,
        hidden_states: torch.Tensor,
        index_q_input: torch.Tensor | None,
        positions: torch.Tensor | None = None,
        rotary_emb: nn.Module | None = None,
    ) -> torch.Tensor:
        if index_q_input is None:
            # No q-LoRA: the query reads hidden_states.
            index_q_input = hidden_states
        rows = self._shardq_indexer_rows() if self.use_fused_k_insert else None
        if rows is not None:
            index_q_input = index_q_input[rows]
        index_q = self.wq_index(index_q_input)[0].view(
            -1, self.index_num_heads, self.index_head_dim
        )
        index_k, index_weights = self.wkv_index(hidden_states)[0].split(
            [self.index_head_dim, self.index_num_heads], dim=-1
        )
        if rows is not None:
            index_weights = index_weights[rows]
        if self.use_fused_k_insert:
            self._fused_k_insert(index_k, hidden_states.shape[0])
            index_k = None
        else:
            index_k = self.k_index_norm(index_k)
            if self.index_rope_dim > 0:
                if positions is None or rotary_emb is None:
                    raise ValueError(
                        "index_rope_dim > 0 requires positions and the main "
                        "attention rotary_emb (mla_use_nope models cannot "
                        "enable indexer rope)"
                    )
                index_q, index_k = self._apply_index_rope(
                    index_q, index_k, positions, rotary_emb
                )
        return self.score(hidden_states, index_q, index_weights, index_k)

    def score(
        self,
        hidden_states: torch.Tensor,
        index_q: torch.Tensor,
        index_weights: torch.Tensor,
        index_k: torch.Tensor | None,
    ) -> torch.Tensor:
        """Top-k of the current rows into ``topk_indices_buffer``."""
        weight_scale = self.index_softmax_scale * self.indexer_weight_scale
        q_scale: torch.Tensor | None = None
        if self.use_fp4_cache:
            q_quant, q_scale, weights = mxfp4_q_quant(
                index_q, index_weights, weight_scale, self.padded_index_num_heads
            )
        else:
            q_quant, weights = indexer_q_quant_fold_weights(
                index_q, index_weights, weight_scale, self.padded_index_num_heads
            )
        # In a dummy run the op only reserves its workspace.
        return torch.ops.vllm.kimi_k3_sparse_attn_indexer(
            hidden_states,
            _encode_layer_name(self.k_cache.prefix),
            self.k_cache.kv_cache,
            q_quant,
            q_scale,  # None for fp8: its scale is folded into the weights
            index_k,
            weights,
            self.quant_block_size,
            self.scale_fmt,
            self.topk_tokens,
            self.index_head_dim,
            self.max_model_len,
            self.max_total_seq_len,
            self.topk_indices_buffer,
            self.use_fused_k_insert,  # skip_k_cache_insert
            _encode_layer_name(self.dense_mha_metadata_layer_name),
            self.use_fp4_cache,
            self.dcp_rank,
            self.dcp_world_size,
            self.cp_kv_cache_interleave_size,
            self.topk_backend,
        )


class KimiK3DSAIndexerKNorm(nn.Module):
    """fp32 LayerNorm with bias for the indexer key."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.normalized_shape = (dim,)
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=torch.float32))
        self.bias = nn.Parameter(torch.zeros(dim, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(
            x.float(), self.normalized_shape, self.weight, self.bias, self.eps
        ).type_as(x)


def use_kimi_k3_mla_backend(attn: Any) -> None:
    """Give a DSA layer's MLA attention our FlashMLA sparse subclass, whose
    MLA pages the runner may split into kernel pages, and its impl, whose
    fp8 kernel runs unpadded below 64 heads."""
    if getattr(attn, "attn_backend", None) is FlashMLASparseBackend:
        attn.attn_backend = KimiK3FlashMLASparseBackend
        attn.impl = KimiK3FlashMLASparseImpl.adopt(attn.impl)
