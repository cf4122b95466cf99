# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Seam: Kimi K3's weight loaders load the DSA layers' checkpoint tensors.

Upstream target: ``KimiLinearModel.load_weights`` (``model.py``) and
``KimiK3MTP.load_weights`` (``mtp.py``).

Why: 0.33.0 knows no indexer names and maps ``q_a_proj`` /
``kv_a_proj_with_mqa`` only into the dense layer's ``fused_qkv_a_g_proj``.

In-tree edit: the indexer renames and the ``fused_qkv_a_proj`` stacking in
both ``load_weights``, recording what each indexer received
(:class:`DSAWeightRouter`).
"""

from __future__ import annotations

import functools
from types import ModuleType
from typing import Any

from vllm.plugins.kimi_k3_dsa._on_import import on_import

MODEL_MODULE = "vllm.models.kimi_k3.nvidia.model"
MTP_MODULE = "vllm.models.kimi_k3.nvidia.mtp"
_MARK = "_kimi_k3_dsa_weights"


def _wrap_load_weights(cls: type, loader: Any) -> None:
    original = cls.load_weights
    if getattr(original, _MARK, False):
        return

    @functools.wraps(original)
    def load_weights(self, weights):
        return loader(self, weights, original)

    setattr(load_weights, _MARK, True)
    cls.load_weights = load_weights


def _patch_model(module: ModuleType) -> None:
    from vllm.models.kimi_k3.nvidia.dsa_weights import load_kimi_linear_model_weights

    _wrap_load_weights(module.KimiLinearModel, load_kimi_linear_model_weights)


def _patch_mtp(module: ModuleType) -> None:
    from vllm.models.kimi_k3.nvidia.dsa_weights import load_kimi_k3_mtp_weights

    _wrap_load_weights(module.KimiK3MTP, load_kimi_k3_mtp_weights)


def apply() -> None:
    on_import(MODEL_MODULE, _patch_model)
    on_import(MTP_MODULE, _patch_mtp)
