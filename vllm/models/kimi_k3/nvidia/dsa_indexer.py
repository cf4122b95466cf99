# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The Kimi K3.1 DSA lightning indexer: its projections, key norm and key cache.

Upstream pieces newer than 0.33.0 (the specialized DCP top-k merge, ShardQ)
are feature-detected, never assumed.
"""

from __future__ import annotations

import importlib
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from vllm.config import CacheConfig, CUDAGraphMode, VllmConfig
from vllm.distributed import get_dcp_group
from vllm.forward_context import get_forward_context
from vllm.logger import init_logger
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import (
    MergedColumnParallelLinear,
    ReplicatedLinear,
)
from vllm.model_executor.layers.quantization import QuantizationConfig
from vllm.models.kimi_k3.common import dsa_cache, dsa_settings
from vllm.models.kimi_k3.common.dsa_envs import (
    FORCE_WRAPPER_ENV,
    force_wrapper_forward,
)
from vllm.models.kimi_k3.common.dsa_formats import k_insert_unsupported
from vllm.models.kimi_k3.nvidia import dsa_indexer_op  # noqa: F401 (its op)
from vllm.models.kimi_k3.nvidia.dsa_ops import _extension as dsa_extension
from vllm.models.kimi_k3.nvidia.dsa_ops import (
    index_rope,
    indexer_k_norm_quant_insert,
    indexer_q_quant_fold_weights,
    mxfp4_k_norm_quant_insert,
    mxfp4_q_quant,
)
from vllm.utils.torch_utils import _encode_layer_name
from vllm.v1.attention.backends.mla import indexer as v32_indexer

logger = init_logger(__name__)


def _extension_loaded() -> bool:
    """Whether ``vllm._kimi_k3_C`` loads and runs on this GPU."""
    return dsa_extension.unavailable_reason() is None


def fused_k_insert_blockers(
    use_pcp: bool,
    index_k_norm_type: str,
    index_rope_dim: int,
    index_head_dim: int,
    index_num_heads: int,
) -> list[str]:
    """Why the indexer cannot use our fused key insert (empty: it can)."""
    blockers = []
    if force_wrapper_forward():
        blockers.append(f"{FORCE_WRAPPER_ENV}=1")
    if use_pcp:
        blockers.append("prefill context parallelism")
    if index_k_norm_type != "layernorm":
        blockers.append(f"index_k_norm_type {index_k_norm_type!r}")
    if index_rope_dim != 0:
        blockers.append(f"index_rope_dim {index_rope_dim}")
    blockers += k_insert_unsupported(index_head_dim, index_num_heads)
    if not blockers and not _extension_loaded():
        blockers.append(
            dsa_extension.unavailable_reason() or "vllm._kimi_k3_C not available"
        )
    return blockers


def _upstream_init_dcp_topk_merge() -> Any:
    """Upstream's ``init_dcp_topk_merge`` where the installed vLLM has it."""
    module = importlib.import_module("vllm.model_executor.layers.sparse_attn_indexer")
    return getattr(module, "init_dcp_topk_merge", None)


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
        # Without the fused insert 0.33.0's op inserts the key (fp8 only).
        self.k_insert_blockers = fused_k_insert_blockers(
            self.use_pcp,
            index_k_norm_type,
            index_rope_dim,
            index_head_dim,
            index_num_heads,
        )
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
        # 0 keeps the op's generic merge (always on 0.33.0).
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
