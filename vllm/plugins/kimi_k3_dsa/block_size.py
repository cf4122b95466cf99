# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Seam: a hybrid model may size its KV cache block itself; Kimi K3.1's block
is the packed DSA row.

Upstream target: ``vllm/platforms/interface.py``,
``Platform._align_hybrid_block_size`` (called by
``update_block_size_for_backend`` in the worker after the model is built, on
CUDA and CPU alike), and the Kimi K3 model classes of
``vllm/models/kimi_k3/nvidia/model.py`` (``KimiLinearForCausalLM``,
``KimiK3ForConditionalGeneration``).

Why: 0.33.0 sizes a hybrid block so that ONE attention page holds one mamba
state, from one MLA page of 576 B/token (its spec lacks
``state_content_bytes``, so ``fp8_ds_mla``'s real 656 B are undercounted), and
it ignores the indexer page and a dense MLA draft's pages; then it pads every
KDA state to that page. Kimi K3.1's block row holds all 24 DSA layers' MLA and
indexer pages (plus a draft's) and, in the state groups, several KDA states at
their own size. The platform cannot know that layout, so it asks the model
class, as it asks for the state shapes (``get_mamba_state_shape_from_config``):
a model class with the optional classmethod ``get_hybrid_block_size(vllm_config,
backend_classes)`` returns the block size it needs (its states then unpadded)
or None for the platform's rule. The Kimi K3 classes implement it with
:func:`~vllm.models.kimi_k3.common.dsa_block_size.packed_hybrid_block_size`:
the packed row's size, TP-divisible, for a KDA-hybrid DSA model (None for
Kimi K3 and Kimi-Linear). It also refuses, before the KV cache is allocated,
a backend that would have to split the packed row of a token cache written
through manager slots (0.33.0 would fail later, when the cache is bound, with
advice that cannot apply to Kimi K3.1).

In-tree edit: at the top of ``_align_hybrid_block_size``, resolve the model
class and, where it has ``get_hybrid_block_size`` and that returns a size,
set ``cache_config.block_size`` (and ``mamba_block_size`` in ``align`` mode),
leave the states unpadded and return; the Kimi K3 classes get the classmethod.
The platform is the only writer of that size: the hook computes it and
changes nothing.
"""

from __future__ import annotations

from types import ModuleType
from typing import TYPE_CHECKING, Any

from vllm.plugins.kimi_k3_dsa._on_import import on_import

if TYPE_CHECKING:
    from vllm.config import VllmConfig

MODEL_MODULE = "vllm.models.kimi_k3.nvidia.model"
# The model-class hook the platform asks.
HOOK = "get_hybrid_block_size"
_MODEL_CLASSES = ("KimiLinearForCausalLM", "KimiK3ForConditionalGeneration")
_MARK = "_kimi_k3_dsa_hybrid_block_size"


def model_hybrid_block_size(
    cls: Any, vllm_config: VllmConfig, backend_cls: Any
) -> int | None:
    """What the in-tree ``_align_hybrid_block_size`` does first: ask the
    model class's hook and apply the block size it returns (None: the
    platform's own rule follows). The one place that writes the hook's size
    into ``cache_config``: the hook only computes it."""
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
