# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""What a DSA layer refuses or chooses at construction: its own validations,
the fused key insert's selection, the top-k buffer fallback and the ShardQ /
DCP guards."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from layer_builders import (
    TOPK,
    build,
    build_indexer,
    topk_buffer,
    with_dsa,
)

import vllm.models.kimi_k3.nvidia.dsa as D

# --------------------------------------------------------------------------
# Validations
# --------------------------------------------------------------------------


def test_requires_dsa_config(dsa_layer_env):
    config = dsa_layer_env.text_config(dsa=False)
    with pytest.raises(ValueError, match="dsa_config is required"):
        build(dsa_layer_env, config)


def test_refuses_rocm(dsa_layer_env, monkeypatch):
    monkeypatch.setattr(D.current_platform, "is_rocm", lambda: True)
    with pytest.raises(NotImplementedError, match="ROCm is not supported"):
        build(dsa_layer_env)


# The dsa_config rules are decided at config time (tests/config); a layer
# built past them (a config made with dataclasses.replace) raises the
# specification's exception, which python -O keeps (an assert would vanish).


def test_index_rope_with_nope_refused(dsa_layer_env):
    config = with_dsa(dsa_layer_env.text_config(), index_rope_dim=32)
    with pytest.raises(ValueError, match="index_rope_dim > 0 is incompatible with"):
        build(dsa_layer_env, config)


def test_index_rope_above_qk_rope_refused(dsa_layer_env):
    config = with_dsa(dsa_layer_env.text_config(mla_use_nope=False), index_rope_dim=96)
    with pytest.raises(
        ValueError,
        match=r"index_rope_dim \(96\) must not exceed min\(qk_rope_head_dim=64",
    ):
        build(dsa_layer_env, config)


def test_index_topk_freq_refused(dsa_layer_env):
    config = with_dsa(dsa_layer_env.text_config(), index_topk_freq=2)
    with pytest.raises(NotImplementedError, match="index_topk_freq != 1"):
        build(dsa_layer_env, config)


@pytest.mark.parametrize("freq", [1, None])
def test_index_topk_freq_accepted(dsa_layer_env, freq):
    """Every layer selects its own top-k (1, or unset meaning 1)."""
    layer = build(
        dsa_layer_env, with_dsa(dsa_layer_env.text_config(), index_topk_freq=freq)
    )
    assert isinstance(layer.dsa_indexer, D.KimiK3DSAIndexer)
    assert layer.dsa_indexer.topk_tokens == TOPK


@pytest.mark.parametrize("rope_dim", [-2, 3])
def test_indexer_rope_dim_odd_or_negative(dsa_layer_env, rope_dim):
    with pytest.raises(ValueError, match="index_rope_dim must be even and >= 0"):
        build_indexer(dsa_layer_env, index_rope_dim=rope_dim)


def test_indexer_rope_dim_above_head_dim(dsa_layer_env):
    with pytest.raises(
        ValueError, match=r"index_rope_dim \(128\) must not exceed index_head_dim"
    ):
        build_indexer(dsa_layer_env, index_head_dim=64, index_rope_dim=128)


def test_indexer_k_norm_type_refused(dsa_layer_env):
    with pytest.raises(ValueError, match="got 'batchnorm'"):
        build_indexer(dsa_layer_env, index_k_norm_type="batchnorm")


@pytest.mark.parametrize(("heads", "padded"), [(1, 32), (32, 32), (33, 64), (64, 64)])
def test_indexer_heads_padded(dsa_layer_env, heads, padded):
    indexer = build_indexer(dsa_layer_env, index_num_heads=heads)
    assert indexer.padded_index_num_heads == padded
    assert indexer.indexer_weight_scale == pytest.approx(heads**-0.5)
    assert indexer.index_softmax_scale == pytest.approx(128**-0.5)


def test_indexer_more_than_64_heads_refused(dsa_layer_env):
    with pytest.raises(ValueError, match="at most 64 index heads, got 65"):
        build_indexer(dsa_layer_env, index_num_heads=65)


def test_mxfp4_without_fused_insert_refused(dsa_layer_env, monkeypatch):
    import vllm.models.kimi_k3.common.dsa_cache as dsa_cache

    monkeypatch.setattr(dsa_cache, "kimi_k3_indexer_uses_fp4", lambda cfg: True)
    with pytest.raises(NotImplementedError, match="MXFP4 indexer keys need the fused"):
        build_indexer(dsa_layer_env, index_k_norm_type="rmsnorm")


def test_mxfp4_with_fused_insert_cache_bytes(dsa_layer_env, monkeypatch):
    import vllm.models.kimi_k3.common.dsa_cache as dsa_cache

    monkeypatch.setattr(dsa_cache, "kimi_k3_indexer_uses_fp4", lambda cfg: True)
    indexer = build_indexer(dsa_layer_env)
    assert indexer.use_fp4_cache and indexer.use_fused_k_insert
    assert indexer.k_cache.head_dim == 68


# --------------------------------------------------------------------------
# Fused key insert selection
# --------------------------------------------------------------------------


def test_fused_insert_selected_for_layernorm_without_rope(dsa_layer_env):
    indexer = build_indexer(dsa_layer_env)
    assert indexer.use_fused_k_insert
    assert not indexer.use_pcp


def test_fused_insert_not_selected_for_rmsnorm(dsa_layer_env):
    assert not build_indexer(
        dsa_layer_env, index_k_norm_type="rmsnorm"
    ).use_fused_k_insert


def test_fused_insert_not_selected_with_index_rope(dsa_layer_env):
    assert not build_indexer(dsa_layer_env, index_rope_dim=32).use_fused_k_insert


def test_fused_insert_not_selected_under_pcp(dsa_layer_env, monkeypatch):
    parallel_config = dsa_layer_env.vllm_config.parallel_config
    monkeypatch.setattr(parallel_config, "prefill_context_parallel_size", 2)
    indexer = build_indexer(dsa_layer_env)
    assert indexer.use_pcp and not indexer.use_fused_k_insert


def test_dense_mha_layer_name_not_set_under_pcp(dsa_layer_env, monkeypatch):
    layer = build(dsa_layer_env)
    assert layer.dsa_indexer.dense_mha_metadata_layer_name == (
        layer.mla_attn.mla_attn.layer_name
    )
    parallel_config = dsa_layer_env.vllm_config.parallel_config
    # PCP groups do not exist on one rank: only the indexer's reading of the
    # size matters here, so MLAAttention's own PCP handling is kept at 1.
    real_init = D.KimiK3DSAIndexer.__init__

    def init_with_pcp(self, *args, **kwargs):
        monkeypatch.setattr(parallel_config, "prefill_context_parallel_size", 2)
        try:
            real_init(self, *args, **kwargs)
        finally:
            monkeypatch.setattr(parallel_config, "prefill_context_parallel_size", 1)

    monkeypatch.setattr(D.KimiK3DSAIndexer, "__init__", init_with_pcp)
    layer = build(dsa_layer_env)
    assert layer.dsa_indexer.use_pcp
    assert layer.dsa_indexer.dense_mha_metadata_layer_name == ""


# --------------------------------------------------------------------------
# Top-k buffer fallback, ShardQ / DCP guards
# --------------------------------------------------------------------------


def test_fallback_topk_buffer_warns(dsa_layer_env, log):
    layer = build(dsa_layer_env, topk_indices_buffer=None)
    assert log.messages("warning_once") == [
        "KimiK3DSAAttention did not receive a model-level topk_indices_buffer; "
        "allocating a per-layer fallback."
    ]
    max_tokens = dsa_layer_env.vllm_config.scheduler_config.max_num_batched_tokens
    buffer = layer.topk_indices_buffer
    assert buffer.shape == (max_tokens, TOPK) and buffer.dtype == torch.int32
    assert layer.dsa_indexer.topk_indices_buffer is buffer
    assert layer.mla_attn.mla_attn.impl.topk_indices_buffer is buffer


def test_model_buffer_no_warning(dsa_layer_env, log):
    buffer = topk_buffer()
    layer = build(dsa_layer_env, topk_indices_buffer=buffer)
    assert not log.messages("warning_once")
    assert layer.topk_indices_buffer is buffer


def test_shardq_guarded_on_033(dsa_layer_env):
    """0.33.0 has no shardq_eligible / use_shardq: nothing is passed, nothing
    raises, the cache is not marked, the indexer scores full rows."""
    from vllm.model_executor.layers.mla import MultiHeadLatentAttentionWrapper

    assert not D._accepts_kwarg(
        MultiHeadLatentAttentionWrapper.__init__, "shardq_eligible"
    )
    layer = build(dsa_layer_env)
    assert not hasattr(layer.mla_attn.mla_attn, "use_shardq")
    assert not getattr(layer.dsa_indexer.k_cache, "use_shardq", False)
    assert layer.dsa_indexer._shardq_indexer_rows() is None


def test_shardq_passed_when_wrapper_takes_it(dsa_layer_env, monkeypatch):
    from vllm.model_executor.layers.mla import MultiHeadLatentAttentionWrapper

    seen: dict[str, Any] = {}
    real_init = MultiHeadLatentAttentionWrapper.__init__

    def init(self, *args, shardq_eligible: bool = False, **kwargs):
        seen["shardq_eligible"] = shardq_eligible
        real_init(self, *args, **kwargs)
        self.mla_attn.use_shardq = True

    monkeypatch.setattr(MultiHeadLatentAttentionWrapper, "__init__", init)
    layer = build(dsa_layer_env)
    assert seen == {"shardq_eligible": True}
    assert layer.dsa_indexer.k_cache.use_shardq is True


def test_dcp_topk_merge_guarded(dsa_layer_env, monkeypatch):
    import vllm.model_executor.layers.sparse_attn_indexer as sai

    assert not hasattr(sai, "init_dcp_topk_merge")
    assert build_indexer(dsa_layer_env).dcp_local_topk == 0
    monkeypatch.setattr(
        sai, "init_dcp_topk_merge", lambda cfg, topk: topk // 4, raising=False
    )
    assert build_indexer(dsa_layer_env).dcp_local_topk == TOPK // 4
