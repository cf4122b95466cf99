# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Kimi K3.1 DSA in Kimi K3's model: the model-level top-k buffer and
index-group builder every DSA layer shares, and which layers are DSA.

As ``DeepseekV32Model``, the model allocates one state and keeps it where
vLLM's MTP proposer finds the target's buffer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from vllm.models.kimi_k3.common.dsa_config import is_dsa_model
from vllm.models.kimi_k3.nvidia.dsa import (
    KimiK3DSAAttention,
    make_topk_indices_buffer,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.attention.backends.mla.index_group import (
        SparseMLAIndexGroupBuilder,
    )

__all__ = [
    "DSAModelState",
    "attach_dsa_model_state",
    "dsa_attention_layers",
    "is_dsa_attention",
    "make_dsa_model_state",
    "make_topk_indices_buffer",
    "map_indexer_names_in_quant_config",
]


@dataclass
class DSAModelState:
    """What one model (target or MTP draft) shares across its DSA layers."""

    topk_indices_buffer: torch.Tensor
    index_group_builder: SparseMLAIndexGroupBuilder | None


CHECKPOINT_INDEXER = "indexer"
MODULE_INDEXER = "dsa_indexer"
# Checkpoint -> model indexer paths in quantization configs (only wq_b can be
# quantized).
QUANT_CONFIG_INDEXER_RENAMES: dict[str, str] = {
    f".self_attn.{CHECKPOINT_INDEXER}.wq_b": f".self_attn.{MODULE_INDEXER}.wq_index",
}


def map_indexer_names_in_quant_config(vllm_config: VllmConfig) -> None:
    """Rename the checkpoint's indexer paths in the quantization config's
    layer lists, as a ``hf_to_vllm_mapper`` does, so ignore lists still
    apply. Idempotent."""
    quant_config = getattr(vllm_config, "quant_config", None)
    if quant_config is None:
        return
    from vllm.model_executor.models.utils import WeightsMapper

    quant_config.apply_vllm_mapper(
        WeightsMapper(orig_to_new_substr=dict(QUANT_CONFIG_INDEXER_RENAMES))
    )


def make_dsa_model_state(vllm_config: VllmConfig) -> DSAModelState | None:
    """The shared state for a Kimi K3.1 DSA model, else None; also renames
    the indexer paths in the quantization config, which the layers read."""
    text_config = vllm_config.model_config.hf_text_config
    if not is_dsa_model(text_config):
        return None
    map_indexer_names_in_quant_config(vllm_config)
    from vllm.v1.attention.backends.mla.index_group import (
        SparseMLAIndexGroupBuilder,
        get_sparse_mla_index_group_max_rows,
    )

    buffer = make_topk_indices_buffer(vllm_config)
    # Each DSA layer leads its own index group (it has its own indexer).
    builder = SparseMLAIndexGroupBuilder(
        buffer, get_sparse_mla_index_group_max_rows(vllm_config)
    )
    return DSAModelState(topk_indices_buffer=buffer, index_group_builder=builder)


def attach_dsa_model_state(model: nn.Module, state: DSAModelState | None) -> None:
    """Keep the shared buffer where vLLM's MTP proposer looks for it."""
    if state is None:
        return
    model.topk_indices_buffer = state.topk_indices_buffer
    model.dsa_index_group_builder = state.index_group_builder


def is_dsa_attention(module: nn.Module) -> bool:
    """Whether ``module`` is a Kimi K3.1 DSA attention layer."""
    return isinstance(module, KimiK3DSAAttention)


def dsa_attention_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Every DSA attention layer under ``model``, with its qualified name."""
    return [(n, m) for n, m in model.named_modules() if is_dsa_attention(m)]
