# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Seam: Kimi K3's decoder builds DSA layers for a checkpoint with
``dsa_config``, each given the model-level top-k buffer and index-group
builder explicitly.

Upstream target: ``vllm/models/kimi_k3/nvidia/model.py``: the full-attention
branch of ``KimiDecoderLayer.__init__`` (the ``MultiHeadLatentAttention(...)``
call), ``KimiLinearModel.__init__`` (its ``get_layer``);
``vllm/models/kimi_k3/nvidia/mtp.py``: ``KimiK3MultiTokenPredictor.__init__``
and ``KimiK3MultiTokenPredictorLayer.__init__`` (its MTP block is a
``KimiDecoderLayer`` too).

Why: 0.33.0 builds dense MLA at every full-attention layer and has no
``topk_indices_buffer``. Kimi K3.1 needs ``KimiK3DSAAttention`` at every
full-attention layer and at the MTP layer (KDA layers untouched; plain Kimi K3
keeps dense MLA), and, as DeepSeek V3.2's model does, one int32
``[max_num_batched_tokens + DCP slack, index_topk]`` buffer and one
``SparseMLAIndexGroupBuilder`` per model
(:func:`~vllm.models.kimi_k3.nvidia.dsa_model.make_dsa_model_state`), kept on
the model where vLLM's MTP proposer finds the target's buffer.

In-tree edit: ``KimiLinearModel.__init__`` and
``KimiK3MultiTokenPredictor.__init__`` call ``make_dsa_model_state`` before
they build their layers and pass ``topk_indices_buffer=`` and
``index_group_builder=`` down through ``KimiDecoderLayer`` (and
``KimiK3MultiTokenPredictorLayer``), whose full-attention branch builds
``KimiK3DSAAttention(..., topk_indices_buffer=, index_group_builder=)`` when
``config.dsa_config`` is set; the model keeps the state
(``attach_dsa_model_state``).

Overlay only: 0.33.0's unmodified ``KimiDecoderLayer`` takes no such
arguments, so this seam reaches it with the smallest mechanism that does: the
model ``__init__`` makes the state and holds it in a context variable while
the original body runs, and the name ``MultiHeadLatentAttention``, which
``KimiDecoderLayer`` looks up in its module globals, is rebound to
:func:`kimi_k3_attention_factory`, which reads it. The in-tree form has
neither the context variable nor the factory.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
from collections.abc import Iterator
from types import ModuleType
from typing import TYPE_CHECKING, Any

from torch import nn

from vllm.plugins.kimi_k3_dsa._on_import import on_import

if TYPE_CHECKING:
    from vllm.models.kimi_k3.nvidia.dsa_model import DSAModelState

MODEL_MODULE = "vllm.models.kimi_k3.nvidia.model"
MTP_MODULE = "vllm.models.kimi_k3.nvidia.mtp"
_MARK = "_kimi_k3_dsa_scope"

# The state of the model whose __init__ is running (overlay only).
_BUILDING: contextvars.ContextVar[DSAModelState | None] = contextvars.ContextVar(
    "kimi_k3_dsa_model_state", default=None
)


@contextlib.contextmanager
def _building(state: DSAModelState | None) -> Iterator[None]:
    token = _BUILDING.set(state)
    try:
        yield
    finally:
        _BUILDING.reset(token)


def kimi_k3_attention_factory(config: Any, *args: Any, **kwargs: Any) -> nn.Module:
    """Stands for ``KimiDecoderLayer``'s full-attention branch (overlay
    only): Kimi K3's dense ``MultiHeadLatentAttention`` without
    ``dsa_config``, ``KimiK3DSAAttention`` with it, given the state of the
    model being built. Takes ``MultiHeadLatentAttention``'s arguments, bound
    by its own signature, so this stand-in does not restate them."""
    from vllm.models.kimi_k3.common.dsa_config import is_dsa_model
    from vllm.models.kimi_k3.nvidia.mla import MultiHeadLatentAttention

    if not is_dsa_model(config):
        return MultiHeadLatentAttention(config, *args, **kwargs)
    from vllm.models.kimi_k3.nvidia.dsa import KimiK3DSAAttention

    mla = inspect.signature(MultiHeadLatentAttention).bind(config, *args, **kwargs)
    layer_args = dict(mla.arguments)
    prefix = layer_args.get("prefix", "")
    use_output_gate = layer_args.pop("use_output_gate", False)
    # run_gemm_rs_ar: the DSA layer keeps the standard o_proj (the decoder
    # layer turns its reduction off under sequence parallelism and
    # reduce-scatters the full-length output itself).
    layer_args.pop("run_gemm_rs_ar", None)
    dsa_params = inspect.signature(KimiK3DSAAttention).parameters
    unsupported = set(layer_args) - set(dsa_params)
    if unsupported:
        raise TypeError(
            f"Kimi K3.1 DSA layer {prefix}: unsupported MLA arguments "
            f"{sorted(unsupported)}"
        )
    if bool(use_output_gate) != bool(config.mla_use_output_gate):
        raise ValueError(
            f"Kimi K3.1 DSA layer {prefix}: use_output_gate={use_output_gate} "
            f"disagrees with mla_use_output_gate={config.mla_use_output_gate}"
        )
    state = _BUILDING.get()
    # Outside a model __init__ (a host that builds KimiDecoderLayer directly)
    # the layer gets no buffer, allocates a per-layer fallback and warns.
    return KimiK3DSAAttention(
        **layer_args,
        topk_indices_buffer=None if state is None else state.topk_indices_buffer,
        index_group_builder=None if state is None else state.index_group_builder,
    )


def _wrap_init(cls: type) -> None:
    from vllm.models.kimi_k3.nvidia.dsa_model import (
        attach_dsa_model_state,
        make_dsa_model_state,
    )

    original = cls.__init__
    if getattr(original, _MARK, False):
        return

    @functools.wraps(original)
    def __init__(self, *args: Any, vllm_config: Any, **kwargs: Any) -> None:
        state = make_dsa_model_state(vllm_config)
        with _building(state):
            original(self, *args, vllm_config=vllm_config, **kwargs)
        attach_dsa_model_state(self, state)

    setattr(__init__, _MARK, True)
    cls.__init__ = __init__


def _patch_model(module: ModuleType) -> None:
    module.MultiHeadLatentAttention = kimi_k3_attention_factory
    _wrap_init(module.KimiLinearModel)


def _patch_mtp(module: ModuleType) -> None:
    _wrap_init(module.KimiK3MultiTokenPredictor)


def apply() -> None:
    on_import(MODEL_MODULE, _patch_model)
    on_import(MTP_MODULE, _patch_mtp)
