# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Kimi K3.1 DSA in Kimi K3's model: the model-level top-k buffer and
index-group builder every DSA layer shares, and which layers are DSA.

As ``DeepseekV32Model`` does, Kimi K3's ``KimiLinearModel`` (and the MTP
predictor) allocates one state per model (:func:`make_dsa_model_state`) and
passes its ``topk_indices_buffer`` and ``index_group_builder`` through
``KimiDecoderLayer`` to each :class:`KimiK3DSAAttention`; the state is then
kept on the model (:func:`attach_dsa_model_state`), where vLLM's MTP proposer
finds the target's buffer. In vLLM's tree those are edits of
``vllm/models/kimi_k3/nvidia/model.py`` and ``mtp.py``; on the released 0.33.0
the ``dsa_layers`` seam of ``vllm.plugins.kimi_k3_dsa`` makes them. The
checkpoint side (indexer names, shape checks, the post-load packing) is
:mod:`vllm.models.kimi_k3.nvidia.dsa_weights`.
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

# ---------------------------------------------------------------------------
# Model-level shared state: one top-k buffer, one index-group builder
# ---------------------------------------------------------------------------


@dataclass
class DSAModelState:
    """What one model (the target, or the MTP draft) shares across its DSA
    layers."""

    topk_indices_buffer: torch.Tensor
    index_group_builder: SparseMLAIndexGroupBuilder | None


# The indexer's name in the checkpoint and in the model's DSA layer.
CHECKPOINT_INDEXER = "indexer"
MODULE_INDEXER = "dsa_indexer"
# Checkpoint module paths -> the DSA layer's, for the module paths a
# quantization config names (fp8 ``ignored_layers``, compressed-tensors
# ``ignore`` / targets). Only wq_b can be quantized (wkv_index is built
# without a quant config; k_norm is a norm).
QUANT_CONFIG_INDEXER_RENAMES: dict[str, str] = {
    f".self_attn.{CHECKPOINT_INDEXER}.wq_b": f".self_attn.{MODULE_INDEXER}.wq_index",
}


def map_indexer_names_in_quant_config(vllm_config: VllmConfig) -> None:
    """Rename the checkpoint's indexer module paths in the quantization
    config's layer lists to the DSA layer's (``indexer.wq_b`` ->
    ``dsa_indexer.wq_index``), as a model's ``hf_to_vllm_mapper`` does, so an
    ignore list that names ``wq_b`` still keeps it unquantized. Regex entries
    are left alone (vLLM's mappers skip them). Idempotent."""
    quant_config = getattr(vllm_config, "quant_config", None)
    if quant_config is None:
        return
    from vllm.model_executor.models.utils import WeightsMapper

    quant_config.apply_vllm_mapper(
        WeightsMapper(orig_to_new_substr=dict(QUANT_CONFIG_INDEXER_RENAMES))
    )


def make_dsa_model_state(vllm_config: VllmConfig) -> DSAModelState | None:
    """The shared state for the model ``vllm_config`` describes, or None when
    it is not a Kimi K3.1 DSA model. Called by the model's ``__init__`` before
    it builds its layers, it also renames the checkpoint's indexer paths in
    the quantization config (:func:`map_indexer_names_in_quant_config`), which
    the layers read when they are built."""
    text_config = vllm_config.model_config.hf_text_config
    if not is_dsa_model(text_config):
        return None
    map_indexer_names_in_quant_config(vllm_config)
    from vllm.v1.attention.backends.mla.index_group import (
        SparseMLAIndexGroupBuilder,
        get_sparse_mla_index_group_max_rows,
    )

    buffer = make_topk_indices_buffer(vllm_config)
    # As DeepSeek V3.2 (models/deepseek_v32/nvidia/model.py): one builder on
    # the model; every K3.1 DSA layer has its own indexer, so each layer is
    # its own index-group leader, but the physical-topk workspace rows are
    # capped by the decode rows instead of max_num_batched_tokens + 1.
    builder = SparseMLAIndexGroupBuilder(
        buffer, get_sparse_mla_index_group_max_rows(vllm_config)
    )
    return DSAModelState(topk_indices_buffer=buffer, index_group_builder=builder)


def attach_dsa_model_state(model: nn.Module, state: DSAModelState | None) -> None:
    """Keep the shared buffer on the model, where vLLM's MTP proposer looks
    for it (``target.model.topk_indices_buffer``, shared with the draft's
    ``model.model``)."""
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
