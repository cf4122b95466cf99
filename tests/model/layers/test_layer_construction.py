# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The DSA layers as built: parameters and shapes, head padding under TP, the
indexer key norm."""

from __future__ import annotations

import pytest
import torch
from layer_builders import (
    TOPK,
    build,
    topk_buffer,
)

import vllm.models.kimi_k3.nvidia.dsa as D

# --------------------------------------------------------------------------
# Construction and parameter shapes
# --------------------------------------------------------------------------


def test_q_lora_layer_shapes(dsa_layer_env):
    config = dsa_layer_env.text_config()
    layer = build(dsa_layer_env, config, prefix="model.layers.3.self_attn")
    heads, hidden = config.num_attention_heads, config.hidden_size
    q_lora, kv_lora = config.q_lora_rank, config.kv_lora_rank
    assert layer.num_heads == heads and layer.num_local_heads == heads
    assert layer.fused_qkv_a_proj.weight.shape == (q_lora + kv_lora + 64, hidden)
    assert layer.q_a_layernorm.weight.shape == (q_lora,)
    assert layer.q_b_proj.weight.shape == (heads * 192, q_lora)
    assert layer.kv_a_layernorm.weight.shape == (kv_lora,)
    assert layer.kv_b_proj.weight.shape == (heads * (128 + 128), kv_lora)
    assert layer.o_proj.weight.shape == (hidden, heads * 128)
    assert layer.g_proj.weight.shape == (heads * 128, hidden)
    assert not hasattr(layer, "q_proj") and not hasattr(layer, "kv_a_proj_with_mqa")
    indexer = layer.dsa_indexer
    index_heads = config.dsa_config.index_num_heads
    assert indexer.wq_index.weight.shape == (index_heads * 128, q_lora)
    assert indexer.wkv_index.weight.shape == (128 + index_heads, hidden)
    assert isinstance(indexer.k_index_norm, D.KimiK3DSAIndexerKNorm)
    assert indexer.k_index_norm.weight.dtype == torch.float32
    assert indexer.k_index_norm.bias.shape == (128,)
    assert indexer.k_index_norm.eps == config.rms_norm_eps
    # NoPE: no rotary embedding, plain softmax scale.
    assert layer.rotary_emb is None
    assert layer.scaling == pytest.approx(192**-0.5)
    # The wrapper got the sparse modules.
    wrapper = layer.mla_attn
    assert wrapper.is_sparse and wrapper.indexer is indexer
    assert wrapper.g_proj is layer.g_proj
    assert wrapper.fused_qkv_a_proj is layer.fused_qkv_a_proj
    assert wrapper.topk_indices_buffer is layer.topk_indices_buffer
    attn = wrapper.mla_attn
    assert attn.layer_name == "model.layers.3.self_attn.attn"
    assert attn.kv_cache_dtype == "fp8_ds_mla"
    assert attn.impl.topk_indices_buffer is layer.topk_indices_buffer
    # fp8 indexer keys: 128 values + one 4-byte scale per token.
    assert indexer.k_cache.head_dim == 132
    assert indexer.k_cache.prefix == "model.layers.3.self_attn.dsa_indexer.k_cache"
    assert indexer.topk_tokens == TOPK
    assert indexer.padded_index_num_heads == 32
    assert indexer.dense_mha_metadata_layer_name == attn.layer_name
    assert indexer.dcp_local_topk == 0
    assert layer._packed is None


def test_no_q_lora_layer_shapes(dsa_layer_env):
    config = dsa_layer_env.text_config(q_lora_rank=None)
    layer = build(dsa_layer_env, config)
    hidden, heads = config.hidden_size, config.num_attention_heads
    index_heads = config.dsa_config.index_num_heads
    assert layer.kv_a_proj_with_mqa.weight.shape == (512 + 64, hidden)
    assert layer.q_proj.weight.shape == (heads * 192, hidden)
    assert not hasattr(layer, "fused_qkv_a_proj")
    assert not hasattr(layer, "q_a_layernorm")
    # The indexer query reads hidden_states.
    assert layer.dsa_indexer.wq_index.weight.shape == (index_heads * 128, hidden)
    assert layer.mla_attn.q_proj is layer.q_proj
    assert layer.mla_attn.fused_qkv_a_proj is None


def test_rmsnorm_key_norm(dsa_layer_env):
    from vllm.model_executor.layers.layernorm import RMSNorm

    config = dsa_layer_env.text_config(
        dsa_config=dsa_layer_env.dsa_config(index_k_norm_type="rmsnorm")
    )
    layer = build(dsa_layer_env, config)
    assert isinstance(layer.dsa_indexer.k_index_norm, RMSNorm)


def test_rope_deepseek_yarn_mscale(dsa_layer_env):
    from vllm.model_executor.layers.rotary_embedding.common import yarn_get_mscale

    config = dsa_layer_env.text_config(
        mla_use_nope=False,
        rope_parameters={
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 1024,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
            "beta_fast": 32,
            "beta_slow": 1,
            "rope_theta": 10000.0,
        },
    )
    layer = build(dsa_layer_env, config)
    mscale = yarn_get_mscale(4.0, 1.0)
    assert mscale > 1.0
    assert layer.scaling == pytest.approx(192**-0.5 * mscale * mscale)
    assert type(layer.rotary_emb).__name__ == "DeepseekScalingRotaryEmbedding"
    assert layer.mla_attn.rotary_emb is layer.rotary_emb
    assert layer.mla_attn.indexer_rope_emb is layer.rotary_emb


def test_rope_default_unscaled(dsa_layer_env):
    layer = build(dsa_layer_env, dsa_layer_env.text_config(mla_use_nope=False))
    assert layer.rotary_emb is not None
    assert not layer.rotary_emb.is_neox_style
    assert layer.scaling == pytest.approx(192**-0.5)


def test_model_level_builder_is_passed(dsa_layer_env):
    from vllm.v1.attention.backends.mla.index_group import SparseMLAIndexGroupBuilder

    buffer = topk_buffer()
    # A model-level builder caps the physical workspace (DeepSeek V3.2 uses
    # get_sparse_mla_index_group_max_rows); a per-layer one would not.
    builder = SparseMLAIndexGroupBuilder(buffer, max_decode_rows=7)
    layers = [
        build(dsa_layer_env, topk_indices_buffer=buffer, index_group_builder=builder)
        for _ in range(2)
    ]
    groups = [layer.mla_attn.mla_attn.impl.index_group for layer in layers]
    # Every DSA layer has an indexer, so each leads its own group.
    assert groups[0] is not groups[1] and builder.current_group is groups[1]
    for layer, group in zip(layers, groups, strict=True):
        assert group.logical_topk_indices is buffer
        assert group.physical_topk_indices.shape == (8, TOPK)
        assert layer.topk_indices_buffer is buffer
        assert layer.dsa_indexer.topk_indices_buffer is buffer
    default = build(dsa_layer_env, topk_indices_buffer=buffer)
    default_group = default.mla_attn.mla_attn.impl.index_group
    assert default_group.physical_topk_indices.shape == (buffer.shape[0] + 1, TOPK)


# --------------------------------------------------------------------------
# Head padding (TP)
# --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("heads", "tp", "padded"),
    [(96, 8, 96), (96, 5, 100), (4, 3, 6), (7, 2, 8), (64, 1, 64)],
)
def test_padded_num_heads_arithmetic(heads, tp, padded):
    assert D.padded_num_heads(heads, tp) == padded
    assert padded % tp == 0 and padded - heads < tp


def test_head_padding_warning(dsa_layer_env, log, monkeypatch):
    # One CPU rank: the layer reads a TP size of 3, its linears the real 1.
    monkeypatch.setattr(D, "get_tensor_model_parallel_world_size", lambda: 3)
    layer = build(dsa_layer_env)
    assert log.messages("warning_once") == [
        "DSA num_heads 4 is not divisible by tp_size 3, will pad to 6 heads"
    ]
    assert layer.num_heads == 6 and layer.num_local_heads == 2
    assert layer.mla_attn.num_heads == 2
    assert layer.q_b_proj.weight.shape[0] == 6 * 192
    assert layer.o_proj.input_size == 6 * 128


def test_no_padding_warning_when_divisible(dsa_layer_env, log):
    layer = build(dsa_layer_env)
    assert not log.messages("warning_once")
    assert layer.num_heads == 4


# --------------------------------------------------------------------------
# KimiK3DSAIndexerKNorm
# --------------------------------------------------------------------------


def test_k_norm_matches_fp32_layer_norm():
    norm = D.KimiK3DSAIndexerKNorm(128, eps=1e-5)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
        norm.bias.uniform_(-0.1, 0.1)
    x = torch.randn(5, 128, dtype=torch.bfloat16)
    out = norm(x)
    ref = torch.nn.functional.layer_norm(
        x.float(), (128,), norm.weight, norm.bias, 1e-5
    ).to(torch.bfloat16)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, ref)
