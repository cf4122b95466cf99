# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Seam: a hybrid model may size its KV cache block itself; Kimi K3.1's block
is the packed DSA row.

Upstream target: ``vllm/platforms/interface.py``
``Platform._align_hybrid_block_size`` and the Kimi K3 model classes.

Why: Kimi K3.1's packed row (every DSA layer's MLA and indexer pages, KDA
states unpadded) is a layout only the model knows.

In-tree edit: ``_align_hybrid_block_size`` first asks the model class's
optional ``get_hybrid_block_size`` classmethod.
"""

from __future__ import annotations

from types import ModuleType
from typing import TYPE_CHECKING, Any

from vllm.plugins.kimi_k3_dsa._on_import import on_import

if TYPE_CHECKING:
    from vllm.config import VllmConfig

MODEL_MODULE = "vllm.models.kimi_k3.nvidia.model"
HOOK = "get_hybrid_block_size"
_MODEL_CLASSES = ("KimiLinearForCausalLM", "KimiK3ForConditionalGeneration")
_MARK = "_kimi_k3_dsa_hybrid_block_size"


def model_hybrid_block_size(
    cls: Any, vllm_config: VllmConfig, backend_cls: Any
) -> int | None:
    """Apply the model hook's block size, or return None for the platform's
    own rule; the hook only computes, this writes ``cache_config``."""
    from vllm.config.vllm import set_current_vllm_config
    from vllm.model_executor.models import ModelRegistry

    model_config = vllm_config.model_config
    model_cls, _ = ModelRegistry.resolve_model_cls(
        model_config.architecture, model_config=model_config
    )
    hook = getattr(model_cls, HOOK, None)
    if hook is None:
        return None
    with set_current_vllm_config(vllm_config):
        backends = cls._find_non_ssm_backends(vllm_config) or [backend_cls]
        block_size = hook(vllm_config, backends)
    if block_size is None:
        return None
    cache_config = vllm_config.cache_config
    cache_config.block_size = block_size
    # The model's block row holds its states at their own size.
    cache_config.mamba_page_size_padded = None
    if cache_config.mamba_cache_mode == "align":
        cache_config.mamba_block_size = block_size
    return block_size


def _get_hybrid_block_size(
    cls: type, vllm_config: VllmConfig, backend_classes: list[Any]
) -> int | None:
    from vllm.models.kimi_k3.common.dsa_block_size import packed_hybrid_block_size

    return packed_hybrid_block_size(vllm_config, backend_classes)


def _patch_model(module: ModuleType) -> None:
    for name in _MODEL_CLASSES:
        model_cls = getattr(module, name)
        if HOOK not in model_cls.__dict__:
            setattr(model_cls, HOOK, classmethod(_get_hybrid_block_size))


def apply() -> None:
    from vllm.platforms.interface import Platform

    on_import(MODEL_MODULE, _patch_model)
    current = Platform.__dict__["_align_hybrid_block_size"]
    if getattr(current, _MARK, False):
        return
    original = current.__func__

    def _align_hybrid_block_size(cls, vllm_config, backend_cls):
        if model_hybrid_block_size(cls, vllm_config, backend_cls) is None:
            original(cls, vllm_config, backend_cls)

    _align_hybrid_block_size.__doc__ = original.__doc__
    wrapped = classmethod(_align_hybrid_block_size)
    setattr(wrapped, _MARK, True)
    Platform._align_hybrid_block_size = wrapped
