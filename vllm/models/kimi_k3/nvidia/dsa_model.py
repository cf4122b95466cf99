# SPDX-License-Identifier: Apache-2.0
"""Kimi K3.1 DSA in Kimi K3's model: which layers are DSA, and the model-level
top-k buffer and index-group builder they share.

In a fork this is a handful of edits of ``vllm/models/kimi_k3/nvidia/model.py``
and ``mtp.py`` (``KimiDecoderLayer`` builds :class:`KimiK3DSAAttention` when the
text config has ``dsa_config``; ``KimiLinearModel`` allocates one
``topk_indices_buffer`` and one ``SparseMLAIndexGroupBuilder``). On the
released 0.33.0 the ``dsa_layers`` seam of ``vllm.plugins.kimi_k3_dsa`` calls
into this module. The checkpoint side (indexer names, shape checks, the
post-load packing) is :mod:`vllm.models.kimi_k3.nvidia.dsa_weights`.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from vllm.logger import init_logger
from vllm.models.kimi_k3.common.dsa_config import is_dsa_model
from vllm.models.kimi_k3.common.dsa_settings import resolve_dsa_settings

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.attention.backends.mla.index_group import (
        SparseMLAIndexGroupBuilder,
    )

logger = init_logger(__name__)

# ---------------------------------------------------------------------------
# Model-level shared state: one top-k buffer, one index-group builder
# ---------------------------------------------------------------------------


def make_topk_indices_buffer(
    vllm_config: VllmConfig, device: torch.device | str | None = None
) -> torch.Tensor:
    """The model-level int32 ``[rows, index_topk]`` top-k buffer every DSA
    layer's indexer writes and its sparse MLA reads."""
    settings = resolve_dsa_settings(vllm_config)
    if device is None:
        from vllm.platforms import current_platform

        device = current_platform.device_type or "cpu"
    return torch.empty(
        (settings.topk_buffer_rows, settings.index_topk),
        dtype=torch.int32,
        device=device,
    )


@dataclass
class DSAModelState:
    """What one model (the target, or the MTP draft) shares across its DSA
    layers."""

    topk_indices_buffer: torch.Tensor
    index_group_builder: SparseMLAIndexGroupBuilder | None
    layers: list[str] = field(default_factory=list)


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
    it is not a Kimi K3.1 DSA model."""
    text_config = vllm_config.model_config.hf_text_config
    if not is_dsa_model(text_config):
        return None
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


_CURRENT_STATE: contextvars.ContextVar[DSAModelState | None] = contextvars.ContextVar(
    "kimi_k3_dsa_model_state", default=None
)


def current_dsa_model_state() -> DSAModelState | None:
    """The shared state of the model being built, if any."""
    return _CURRENT_STATE.get()


@contextlib.contextmanager
def dsa_model_scope(vllm_config: VllmConfig) -> Iterator[DSAModelState | None]:
    """While a model's ``__init__`` builds its layers, make its shared DSA
    state visible to :func:`kimi_k3_attention_factory` (the model-level
    buffer threaded to each layer, as ``DeepseekV32Model`` does through its
    ``make_layers`` closure)."""
    state = make_dsa_model_state(vllm_config)
    if state is not None:
        map_indexer_names_in_quant_config(vllm_config)
    token = _CURRENT_STATE.set(state)
    try:
        yield state
    finally:
        _CURRENT_STATE.reset(token)


def attach_dsa_model_state(model: nn.Module, state: DSAModelState | None) -> None:
    """Keep the shared buffer on the model, where vLLM's MTP proposer looks
    for it (``target.model.topk_indices_buffer``, shared with the draft's
    ``model.model``)."""
    if state is None:
        return
    model.topk_indices_buffer = state.topk_indices_buffer
    model.dsa_index_group_builder = state.index_group_builder


# ---------------------------------------------------------------------------
# Layer construction
# ---------------------------------------------------------------------------


def kimi_k3_attention_factory(
    config: Any,
    hidden_size: int,
    num_heads: int,
    qk_nope_head_dim: int,
    qk_rope_head_dim: int,
    v_head_dim: int,
    q_lora_rank: int | None,
    kv_lora_rank: int,
    use_output_gate: bool = False,
    cache_config: Any = None,
    quant_config: Any = None,
    prefix: str = "",
    aux_stream: Any = None,
    run_gemm_rs_ar: bool = False,
    **kwargs: Any,
) -> nn.Module:
    """Stands for ``KimiDecoderLayer``'s full-attention branch: Kimi K3's dense
    ``MultiHeadLatentAttention`` without ``dsa_config``, ``KimiK3DSAAttention``
    with it (main model and MTP block alike, both build through
    ``KimiDecoderLayer``)."""
    from vllm.models.kimi_k3.nvidia.mla import MultiHeadLatentAttention

    if not is_dsa_model(config):
        return MultiHeadLatentAttention(
            config=config,
            hidden_size=hidden_size,
            num_heads=num_heads,
            qk_nope_head_dim=qk_nope_head_dim,
            qk_rope_head_dim=qk_rope_head_dim,
            v_head_dim=v_head_dim,
            q_lora_rank=q_lora_rank,
            kv_lora_rank=kv_lora_rank,
            use_output_gate=use_output_gate,
            cache_config=cache_config,
            quant_config=quant_config,
            prefix=prefix,
            aux_stream=aux_stream,
            run_gemm_rs_ar=run_gemm_rs_ar,
            **kwargs,
        )
    from vllm.models.kimi_k3.nvidia.dsa import KimiK3DSAAttention

    if kwargs:
        raise TypeError(
            f"Kimi K3.1 DSA layer {prefix}: unsupported MLA arguments {sorted(kwargs)}"
        )
    if bool(use_output_gate) != bool(config.mla_use_output_gate):
        raise ValueError(
            f"Kimi K3.1 DSA layer {prefix}: use_output_gate={use_output_gate} "
            f"disagrees with mla_use_output_gate={config.mla_use_output_gate}"
        )
    # run_gemm_rs_ar: the DSA layer keeps the standard o_proj (the decoder
    # layer turns its reduction off under sequence parallelism and
    # reduce-scatters the full-length output itself).
    state = current_dsa_model_state()
    extra: dict[str, Any] = {}
    if state is not None:
        extra["topk_indices_buffer"] = state.topk_indices_buffer
        extra["index_group_builder"] = state.index_group_builder
        state.layers.append(prefix)
    # Without a model scope (a host that builds KimiDecoderLayer directly) the
    # layer allocates a per-layer fallback buffer and warns.
    return KimiK3DSAAttention(
        config,
        hidden_size,
        num_heads,
        qk_nope_head_dim,
        qk_rope_head_dim,
        v_head_dim,
        q_lora_rank,
        kv_lora_rank,
        cache_config=cache_config,
        quant_config=quant_config,
        prefix=prefix,
        aux_stream=aux_stream,
        **extra,
    )


def is_dsa_attention(module: nn.Module) -> bool:
    """Whether ``module`` is a Kimi K3.1 DSA attention layer."""
    try:
        from vllm.models.kimi_k3.nvidia.dsa import KimiK3DSAAttention
    except ImportError:  # pragma: no cover - the layer module is part of us
        return False
    return isinstance(module, KimiK3DSAAttention)


def dsa_attention_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Every DSA attention layer under ``model``, with its qualified name."""
    return [(n, m) for n, m in model.named_modules() if is_dsa_attention(m)]
