# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Seam: a model-level post-load hook packs the DSA layers' projections.

Upstream target: ``vllm/models/kimi_k3/nvidia/model.py``
``KimiLinearForCausalLM`` and ``KimiK3ForConditionalGeneration``, and
``vllm/models/kimi_k3/nvidia/mtp.py`` ``KimiK3MTP`` (none has a
``process_weights_after_loading`` in 0.33.0).

Why: a DSA layer that received checkpoint tensors but not its whole indexer
must be refused once all tensors are in (vLLM's own every-parameter check is
skipped for quantized models, and names vLLM parameters, not checkpoint
tensors); and ``KimiK3DSAAttention.pack_projections()`` must run once the weights are
loaded and each ``MLAAttention`` has post-processed its own (it reads the
resolved cache dtype). 0.33.0's loader
(``model_executor/model_loader/utils.py`` ``process_weights_after_loading``)
calls a model-level ``process_weights_after_loading()`` after the per-layer
passes, on the top-level model only, so each class that can be top-level (the
text-only and multimodal targets, the MTP draft) gets one, which visits every
DSA layer under it. A layer may decline (it keeps the wrapper forward);
packing is idempotent, so a weight reload repeats it harmlessly. An existing
hook, if a later vLLM adds one, runs first. Applied when the module is first
imported.

The same completeness check runs where vLLM's ``DefaultModelLoader`` would
refuse an unquantized model with "Following weights were not initialized"
(``track_weights_loading``, before any post-load pass): a missing DSA tensor
is then named by its layer, its checkpoint name and what it is for, rather
than by the vLLM parameter it fills.

In-tree edit: ``def process_weights_after_loading(self): pack_dsa_projections(
self)`` on the three classes (it checks indexer completeness first), and a
``check_dsa_indexers_complete(model)`` call before the generic refusal in
``DefaultModelLoader.track_weights_loading``.
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
        """Model-level post-load hook: pack every Kimi K3.1 DSA layer's
        projections (see ``vllm.plugins.kimi_k3_dsa.dsa_post_load``)."""
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
        """0.33.0's check, whose refusal is preceded by the DSA one (a no-op
        for a model without DSA layers)."""
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
