# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Seam: a model-level post-load hook packs the DSA layers' projections.

Upstream target: ``KimiLinearForCausalLM``, ``KimiK3ForConditionalGeneration``
(``model.py``), ``KimiK3MTP`` (``mtp.py``) and
``DefaultModelLoader.track_weights_loading``.

Why: packing needs the loaded weights and the resolved cache dtype, and an
incomplete indexer should be named by its checkpoint tensors.

In-tree edit: ``process_weights_after_loading`` calling
``pack_dsa_projections`` on the three classes, and
``check_dsa_indexers_complete`` before the loader's generic refusal.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

from vllm.plugins.kimi_k3_dsa._on_import import on_import

MODEL_MODULE = "vllm.models.kimi_k3.nvidia.model"
MTP_MODULE = "vllm.models.kimi_k3.nvidia.mtp"
LOADER_MODULE = "vllm.model_executor.model_loader.default_loader"
_MARK = "_kimi_k3_dsa_post_load"


def _add_hook(cls: type) -> None:
    from vllm.models.kimi_k3.nvidia.dsa_weights import pack_dsa_projections

    previous = cls.__dict__.get("process_weights_after_loading")
    if getattr(previous, _MARK, False):
        return

    def process_weights_after_loading(self, *args: Any, **kwargs: Any) -> None:
        """Pack every Kimi K3.1 DSA layer's projections."""
        if previous is not None:
            previous(self, *args, **kwargs)
        pack_dsa_projections(self)

    setattr(process_weights_after_loading, _MARK, True)
    cls.process_weights_after_loading = process_weights_after_loading


def _patch_model(module: ModuleType) -> None:
    _add_hook(module.KimiLinearForCausalLM)
    _add_hook(module.KimiK3ForConditionalGeneration)


def _patch_mtp(module: ModuleType) -> None:
    _add_hook(module.KimiK3MTP)


def _patch_default_loader(module: ModuleType) -> None:
    from vllm.models.kimi_k3.nvidia.dsa_weights import check_dsa_indexers_complete

    loader_class = module.DefaultModelLoader
    original = loader_class.track_weights_loading
    if getattr(original, _MARK, False):
        return

    def track_weights_loading(self: Any, model: Any, *args: Any, **kwargs: Any) -> None:
        """Name a missing DSA tensor before 0.33.0's generic refusal."""
        try:
            original(self, model, *args, **kwargs)
        except ValueError as generic:
            try:
                check_dsa_indexers_complete(model)
            except ValueError as named:
                raise named from generic
            raise

    setattr(track_weights_loading, _MARK, True)
    loader_class.track_weights_loading = track_weights_loading


def apply() -> None:
    on_import(MODEL_MODULE, _patch_model)
    on_import(MTP_MODULE, _patch_mtp)
    on_import(LOADER_MODULE, _patch_default_loader)
