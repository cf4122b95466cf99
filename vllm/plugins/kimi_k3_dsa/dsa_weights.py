# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Seam: Kimi K3's weight loaders load the DSA layers' checkpoint tensors.

Upstream target: ``vllm/models/kimi_k3/nvidia/model.py``
``KimiLinearModel.load_weights`` and ``vllm/models/kimi_k3/nvidia/mtp.py``
``KimiK3MTP.load_weights``.

Why: 0.33.0 knows no indexer names, and with the output gate on it maps
``q_a_proj`` / ``kv_a_proj_with_mqa`` only into the dense layer's
``fused_qkv_a_g_proj``, which a DSA layer (``fused_qkv_a_proj`` + its own
``g_proj``) does not have: the target model would die on a bare KeyError and
the MTP loader would silently drop the indexer. The wrapped loaders place
``self_attn.indexer.{wq_b, wk, weights_proj, k_norm}`` into
``self_attn.dsa_indexer.{wq_index, wkv_index (shards 0, 1), k_index_norm}``
(fp8 ``wq_b`` scales included; an fp8 ``wq_b`` / ``wk`` bound for a bf16
parameter is dequantized) and stack ``q_a_proj`` / ``kv_a_proj_with_mqa``
into ``fused_qkv_a_proj``; every other tensor goes through 0.33.0's loader
unchanged, ``g_proj`` included. An unexpected indexer tensor raises at once,
naming the layer and the tensor; what each DSA layer received is recorded on
it, and the post-load hook (``dsa_post_load``) refuses a layer whose indexer is
incomplete, naming the missing checkpoint tensors (after loading, because some
loaders split a model over several ``load_weights`` calls). Models without DSA
layers take 0.33.0's path untouched. Applied when the module is first
imported.

In-tree edit: in both ``load_weights``, rename ``.self_attn.indexer.wq_b.`` /
``.k_norm.`` to ``.self_attn.dsa_indexer.wq_index.`` / ``.k_index_norm.``,
add ``(".dsa_indexer.wkv_index.", ".indexer.wk.", 0)``,
``(".dsa_indexer.wkv_index.", ".indexer.weights_proj.", 1)`` and the
``fused_qkv_a_proj`` entries next to the ``fused_qkv_a_g_proj`` ones (the loop
already skips a mapping whose target is absent), and record what each
indexer received (:class:`DSAWeightRouter`).
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
