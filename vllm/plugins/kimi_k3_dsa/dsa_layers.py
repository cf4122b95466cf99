# SPDX-License-Identifier: Apache-2.0
"""Seam: Kimi K3's decoder builds DSA layers for a checkpoint with
``dsa_config``, all sharing one model-level top-k buffer and index-group
builder.

Upstream target: ``vllm/models/kimi_k3/nvidia/model.py``: the full-attention
branch of ``KimiDecoderLayer.__init__`` (the ``MultiHeadLatentAttention(...)``
call) and ``KimiLinearModel.__init__``; ``vllm/models/kimi_k3/nvidia/mtp.py``
``KimiK3MultiTokenPredictor.__init__`` (its MTP block is a
``KimiDecoderLayer`` too).

Why: 0.33.0 builds dense MLA at every full-attention layer and has no
``topk_indices_buffer``. Kimi K3.1 needs ``KimiK3DSAAttention`` at every
full-attention layer and at the MTP layer (KDA layers untouched; plain Kimi K3
keeps dense MLA), and, as DeepSeek V3.2's model does, one int32
``[max_num_batched_tokens + DCP slack, index_topk]`` buffer and one
``SparseMLAIndexGroupBuilder`` per model, kept on the model where vLLM's MTP
proposer finds the target's buffer and shares it with the draft.

How: ``KimiDecoderLayer`` looks ``MultiHeadLatentAttention`` up in its module
globals when it builds a layer, so that name is rebound to
:func:`~vllm.models.kimi_k3.nvidia.dsa_model.kimi_k3_attention_factory` (dense
MLA unless ``dsa_config``); the model ``__init__``s run inside
:func:`~vllm.models.kimi_k3.nvidia.dsa_model.dsa_model_scope`, which hands the
model's shared buffer and builder to the factory and leaves them on the model
(and renames the checkpoint's ``indexer.wq_b`` paths in the quantization
config's layer lists to ``dsa_indexer.wq_index``). Applied when the module is
first imported.

In-tree edit: in ``KimiLinearModel.__init__`` allocate the buffer and builder
(:func:`make_dsa_model_state`) and pass them through ``get_layer`` to
``KimiDecoderLayer``, whose full-attention branch builds
``KimiK3DSAAttention(..., topk_indices_buffer=, aux_stream=,
index_group_builder=)`` when ``config.dsa_config`` is set; the same in
``KimiK3MultiTokenPredictor.__init__`` for the MTP block.
"""

from __future__ import annotations

import functools
from types import ModuleType
from typing import Any

from vllm.plugins.kimi_k3_dsa._on_import import on_import

MODEL_MODULE = "vllm.models.kimi_k3.nvidia.model"
MTP_MODULE = "vllm.models.kimi_k3.nvidia.mtp"
_MARK = "_kimi_k3_dsa_scope"


def _wrap_init(cls: type) -> None:
    from vllm.models.kimi_k3.nvidia.dsa_model import (
        attach_dsa_model_state,
        dsa_model_scope,
    )

    original = cls.__init__
    if getattr(original, _MARK, False):
        return

    @functools.wraps(original)
    def __init__(self, *args: Any, vllm_config: Any, **kwargs: Any) -> None:
        with dsa_model_scope(vllm_config) as state:
            original(self, *args, vllm_config=vllm_config, **kwargs)
        attach_dsa_model_state(self, state)

    setattr(__init__, _MARK, True)
    cls.__init__ = __init__


def _patch_model(module: ModuleType) -> None:
    from vllm.models.kimi_k3.nvidia.dsa_model import kimi_k3_attention_factory

    module.MultiHeadLatentAttention = kimi_k3_attention_factory
    _wrap_init(module.KimiLinearModel)


def _patch_mtp(module: ModuleType) -> None:
    _wrap_init(module.KimiK3MultiTokenPredictor)


def apply() -> None:
    on_import(MODEL_MODULE, _patch_model)
    on_import(MTP_MODULE, _patch_mtp)
