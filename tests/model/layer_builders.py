# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Builders of the Kimi K3.1 DSA layer tests (``tests/model`` and its
``layers/`` folder): a ``KimiK3DSAAttention`` or a ``KimiK3DSAIndexer`` with the
model's constructor arguments, on the session's real engine configuration
(``dsa_layer_env``, ``tests/model/conftest.py``, whose folder pytest puts on
the import path)."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

import vllm.models.kimi_k3.nvidia.dsa as D
from kimi_k3_dsa_tools.tiny_checkpoint import mla_dims

TOPK = 128  # the tiny dsa_config's index_topk


def topk_buffer(rows: int = 256) -> torch.Tensor:
    return torch.full((rows, TOPK), -1, dtype=torch.int32)


def build(env, text_config=None, prefix: str | None = None, **kwargs: Any):
    """A KimiK3DSAAttention with the model's constructor arguments."""
    config = text_config if text_config is not None else env.text_config()
    kwargs.setdefault("topk_indices_buffer", topk_buffer())
    return D.KimiK3DSAAttention(
        **mla_dims(config),
        cache_config=env.vllm_config.cache_config,
        quant_config=None,
        prefix=prefix or env.prefix(),
        **kwargs,
    )


def with_dsa(config, **changes: Any):
    """``config`` whose dsa_config has ``changes``, past the config-time rules
    (so the layer's own validations are what is tested)."""
    config.dsa_config = dataclasses.replace(config.dsa_config, **changes)
    return config


def build_indexer(env, **overrides: Any):
    kwargs: dict[str, Any] = dict(
        vllm_config=env.vllm_config,
        hidden_size=256,
        index_q_input_size=1536,
        index_head_dim=128,
        index_num_heads=32,
        index_topk=TOPK,
        rms_norm_eps=1e-5,
        index_rope_dim=0,
        index_k_norm_type="layernorm",
        cache_config=env.vllm_config.cache_config,
        topk_indices_buffer=topk_buffer(),
        prefix=env.prefix() + ".dsa_indexer",
    )
    kwargs.update(overrides)
    return D.KimiK3DSAIndexer(**kwargs)


def fill_random(layer) -> None:
    with torch.no_grad():
        for param in layer.parameters():
            param.uniform_(-1, 1)


def cpu_post_load(layer) -> None:
    """vLLM's post-load step of the unquantized linears on a CPU platform,
    with the weight repacking off (``_cpu_skip_gemm_dispatch``, as vLLM does
    for MLA's kv_b_proj): the linears then run F.linear on their weights. On
    CUDA this step leaves unquantized weights alone."""
    from vllm.model_executor.layers.linear import LinearBase

    for module in layer.modules():
        if isinstance(module, LinearBase):
            module._cpu_skip_gemm_dispatch = True
            module.quant_method.process_weights_after_loading(module)


def roped_indexer_layer(env):
    """A post-loaded layer whose indexer ropes its leading 32 dims (RMSNorm
    key norm; the MLA without nope, so that it has a rotary cache)."""
    config = env.text_config(
        mla_use_nope=False,
        dsa_config=env.dsa_config(index_k_norm_type="rmsnorm", index_rope_dim=32),
    )
    layer = build(env, config)
    cpu_post_load(layer)
    return layer
