# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Seam: Kimi K3's decoder builds DSA layers for a checkpoint with
``dsa_config``, sharing the model-level top-k buffer and index-group builder.

Upstream target: ``KimiDecoderLayer`` and ``KimiLinearModel.__init__``
(``model.py``); ``KimiK3MultiTokenPredictor`` (``mtp.py``).

Why: 0.33.0 builds dense MLA everywhere and has no ``topk_indices_buffer``.

In-tree edit: the model ``__init__`` passes ``make_dsa_model_state``'s buffer
and builder down to ``KimiK3DSAAttention``; the overlay rebinds
``MultiHeadLatentAttention`` to :func:`kimi_k3_attention_factory` instead.
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
    """``MultiHeadLatentAttention`` without ``dsa_config``, else
    ``KimiK3DSAAttention`` with the state of the model being built."""
    from vllm.models.kimi_k3.common.dsa_config import is_dsa_model
    from vllm.models.kimi_k3.nvidia.mla import MultiHeadLatentAttention

    if not is_dsa_model(config):
        return MultiHeadLatentAttention(config, *args, **kwargs)
    from vllm.models.kimi_k3.nvidia.dsa import KimiK3DSAAttention

    mla = inspect.signature(MultiHeadLatentAttention).bind(config, *args, **kwargs)
    layer_args = dict(mla.arguments)
    prefix = layer_args.get("prefix", "")
    use_output_gate = layer_args.pop("use_output_gate", False)
    # The DSA layer keeps the standard o_proj.
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
