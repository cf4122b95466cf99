# SPDX-License-Identifier: Apache-2.0
"""The Kimi K3.1 DSA layer classes and ``pack_projections`` on the CPU.

Real vLLM 0.33.0 layers (linears, norms, ``MultiHeadLatentAttentionWrapper``,
``MLAAttention``, ``FlashMLASparseImpl``, the indexer cache) under the real
engine configuration of the tiny Kimi K3.1 checkpoint. The only stub is the
CUDA attention-backend selection (``mla_attention.get_attn_backend`` returns
``FlashMLASparseBackend``; see ``conftest.py``).

Tensor parallelism: one CPU rank cannot build TP > 1 layers. The head padding
is tested through its arithmetic (``padded_num_heads``) and through the layer
built with the TP size the layer reads patched to 3: the warning and the
padded head counts are the layer's; the linears still see vLLM's real TP size
of 1 (their shapes are those of TP 1 with the padded head count).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

import vllm.models.kimi_k3.nvidia.dsa as D
import vllm.models.kimi_k3.nvidia.dsa_low_latency as LL

TOPK = 128  # the tiny dsa_config's index_topk


@pytest.fixture(autouse=True)
def extension_built(monkeypatch: pytest.MonkeyPatch) -> None:
    """Most tests describe a deployment with vllm._kimi_k3_C built (a CPU CI
    machine may or may not load it); the tests of its absence undo this."""
    monkeypatch.setattr(D, "_extension_loaded", lambda: True)


@pytest.fixture
def log(record_logs):
    """The DSA layer module's log messages."""
    return record_logs(D)


def topk_buffer(rows: int = 256) -> torch.Tensor:
    return torch.full((rows, TOPK), -1, dtype=torch.int32)


def build(env, text_config=None, prefix: str | None = None, **kwargs: Any):
    """A KimiK3DSAAttention with the model's constructor arguments."""
    config = text_config if text_config is not None else env.text_config()
    kwargs.setdefault("topk_indices_buffer", topk_buffer())
    return D.KimiK3DSAAttention(
        config=config,
        hidden_size=config.hidden_size,
        num_heads=config.num_attention_heads,
        qk_nope_head_dim=config.qk_nope_head_dim,
        qk_rope_head_dim=config.qk_rope_head_dim,
        v_head_dim=config.v_head_dim,
        q_lora_rank=config.q_lora_rank,
        kv_lora_rank=config.kv_lora_rank,
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


def test_index_rope_with_nope_refused(dsa_layer_env):
    config = with_dsa(dsa_layer_env.text_config(), index_rope_dim=32)
    with pytest.raises(ValueError, match="incompatible with mla_use_nope"):
        build(dsa_layer_env, config)


def test_index_rope_above_qk_rope_refused(dsa_layer_env):
    config = with_dsa(dsa_layer_env.text_config(mla_use_nope=False), index_rope_dim=96)
    with pytest.raises(ValueError, match=r"must not exceed min\(qk_rope_head_dim=64"):
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
    with pytest.raises(ValueError, match="must be even and >= 0"):
        build_indexer(dsa_layer_env, index_rope_dim=rope_dim)


def test_indexer_rope_dim_above_head_dim(dsa_layer_env):
    with pytest.raises(ValueError, match=r"must not exceed index_head_dim \(64\)"):
        build_indexer(dsa_layer_env, index_head_dim=64, index_rope_dim=128)


def test_indexer_k_norm_type_refused(dsa_layer_env):
    with pytest.raises(ValueError, match="'rmsnorm' or 'layernorm', got 'batchnorm'"):
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


# --------------------------------------------------------------------------
# pack_projections
# --------------------------------------------------------------------------


@pytest.fixture
def extension(monkeypatch):
    """Pretend ``vllm._kimi_k3_C`` and the fused entry points are usable
    (whether this machine built the extension or not)."""
    monkeypatch.setattr(D, "kimi_k3_extension_available", lambda: True)


@pytest.fixture
def no_extension(monkeypatch):
    """A machine without ``vllm._kimi_k3_C`` (CI builds it; a user's install
    without nvcc has none)."""
    monkeypatch.setattr(D, "kimi_k3_extension_available", lambda: False)


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


def weights(layer) -> dict[str, torch.Tensor]:
    indexer = layer.dsa_indexer
    return {
        "fused_qkv_a_proj": layer.fused_qkv_a_proj.weight,
        "wkv_index": indexer.wkv_index.weight,
        "q_b_proj": layer.q_b_proj.weight,
        "wq_index": indexer.wq_index.weight,
    }


def test_pack_projections_makes_views(dsa_layer_env, extension):
    layer = build(dsa_layer_env)
    fill_random(layer)
    before = {name: w.detach().clone() for name, w in weights(layer).items()}
    assert layer.fused_forward_blockers() == []
    layer.pack_projections()
    assert layer._packed is not None
    packed_in, packed_q = layer._packed
    assert packed_in.shape == (1536 + 512 + 64 + 128 + 32, 256)
    assert packed_q.shape == (4 * 192 + 32 * 128, 1536)
    after = weights(layer)
    # Values kept; each linear a view of its packed weight, in order.
    for name, w in after.items():
        torch.testing.assert_close(w, before[name], rtol=0, atol=0)
    assert after["fused_qkv_a_proj"].data_ptr() == packed_in.data_ptr()
    assert after["wkv_index"].data_ptr() == packed_in[1536 + 576 :].data_ptr()
    assert after["q_b_proj"].data_ptr() == packed_q.data_ptr()
    assert after["wq_index"].data_ptr() == packed_q[4 * 192 :].data_ptr()
    for name in ("fused_qkv_a_proj", "wkv_index"):
        assert after[name].untyped_storage().data_ptr() == (
            packed_in.untyped_storage().data_ptr()
        )
    for name in ("q_b_proj", "wq_index"):
        assert after[name].untyped_storage().data_ptr() == (
            packed_q.untyped_storage().data_ptr()
        )
    torch.testing.assert_close(
        packed_in, torch.cat([before["fused_qkv_a_proj"], before["wkv_index"]])
    )
    torch.testing.assert_close(
        packed_q, torch.cat([before["q_b_proj"], before["wq_index"]])
    )
    # The linears still compute through their (view) weights.
    cpu_post_load(layer)
    x = torch.randn(3, 256)
    torch.testing.assert_close(
        layer.fused_qkv_a_proj(x)[0], x @ before["fused_qkv_a_proj"].T
    )
    # No aux stream: no gate events.
    assert layer._gate_events is None


def test_pack_projections_rerun_is_noop_and_reload_refills_views(
    dsa_layer_env, extension, monkeypatch
):
    layer = build(dsa_layer_env)
    fill_random(layer)
    layer.pack_projections()
    packed = list(layer._packed)
    calls: list[Any] = []
    monkeypatch.setattr(D, "request_low_latency_warmup", calls.append)
    layer.pack_projections()
    assert layer._packed[0] is packed[0] and layer._packed[1] is packed[1]
    assert calls == []
    # A reload: the weight loaders write into the views in place.
    new = torch.randn_like(layer.dsa_indexer.wkv_index.weight)
    layer.dsa_indexer.wkv_index.weight_loader(
        layer.dsa_indexer.wkv_index.weight, new[:128], 0
    )
    layer.dsa_indexer.wkv_index.weight_loader(
        layer.dsa_indexer.wkv_index.weight, new[128:], 1
    )
    layer.pack_projections()
    torch.testing.assert_close(layer._packed[0][1536 + 576 :], new, rtol=0, atol=0)
    assert layer.dsa_indexer.wkv_index.weight.data_ptr() == (
        layer._packed[0][1536 + 576 :].data_ptr()
    )


def test_pack_projections_requests_warmup(dsa_layer_env, extension, monkeypatch):
    calls: list[tuple[int, ...]] = []
    monkeypatch.setattr(
        D, "request_low_latency_warmup", lambda w: calls.append(tuple(w.shape))
    )
    layer = build(dsa_layer_env)
    layer.pack_projections()
    assert calls == [(1536 + 512 + 64 + 128 + 32, 256), (4 * 192 + 32 * 128, 1536)]


def _assert_declined(layer, snapshot) -> None:
    layer.pack_projections()
    assert layer._packed is None
    if snapshot is not None:
        for name, (ptr, value) in snapshot.items():
            assert weights(layer)[name].data_ptr() == ptr, name
            torch.testing.assert_close(weights(layer)[name], value, rtol=0, atol=0)


def _snapshot(layer):
    fill_random(layer)
    return {n: (w.data_ptr(), w.detach().clone()) for n, w in weights(layer).items()}


def test_pack_declines_without_extension(dsa_layer_env, no_extension):
    layer = build(dsa_layer_env)
    assert layer.fused_forward_blockers() == ["vllm._kimi_k3_C not available"]
    _assert_declined(layer, _snapshot(layer))


def test_pack_declines_without_fused_insert(dsa_layer_env, extension):
    config = dsa_layer_env.text_config(
        dsa_config=dsa_layer_env.dsa_config(index_k_norm_type="rmsnorm")
    )
    layer = build(dsa_layer_env, config)
    assert layer.fused_forward_blockers() == ["no fused key insert"]
    _assert_declined(layer, _snapshot(layer))


# Shapes the compiled kernels do not take (the smoke-test crashes of the
# first serving run): the layer keeps the wrapper forward and says why.
UNSUPPORTED_SHAPES = [
    (
        "q-lora-128",
        {"q_lora_rank": 128},
        {},
        ["q_lora_rank 128 (the prologue is built for 1536)"],
    ),
    (
        "index-heads-4",
        {},
        {"index_num_heads": 4},
        [
            "no fused key insert",
            "the packed input row of 2244 bf16 values is not a multiple of 8 "
            "(16 bytes); index_num_heads must be a multiple of 8",
        ],
    ),
]


@pytest.mark.parametrize(
    ("text", "dsa", "blockers"),
    [pytest.param(t, d, b, id=i) for i, t, d, b in UNSUPPORTED_SHAPES],
)
def test_pack_declines_shapes_the_kernels_do_not_take(
    dsa_layer_env, extension, log, text, dsa, blockers
):
    config = dsa_layer_env.text_config(
        **text, dsa_config=dsa_layer_env.dsa_config(**dsa)
    )
    layer = build(dsa_layer_env, config)
    assert layer.fused_forward_blockers() == blockers
    _assert_declined(layer, _snapshot(layer))
    assert log.messages("info_once")[-1] == (
        "Kimi K3.1 DSA layers use the wrapper forward (upstream ops): "
        + "; ".join(blockers)
        + "."
    )


def test_fused_insert_declined_for_unaligned_key_rows(dsa_layer_env, log):
    """4 index heads: the key is a slice of a 132-wide [wk | weights_proj]
    row, which the insert kernel cannot read in 16-byte vectors."""
    indexer = build_indexer(dsa_layer_env, index_num_heads=4)
    assert not indexer.use_fused_k_insert
    assert indexer.k_insert_blockers == [
        "the [wk | weights_proj] row of 132 bf16 values is not a multiple of 8 "
        "(16 bytes); index_num_heads must be a multiple of 8"
    ]
    assert "vLLM's unfused insert" in log.messages("info_once")[-1]
    indexer = build_indexer(dsa_layer_env, index_num_heads=8)
    assert indexer.use_fused_k_insert


def test_force_wrapper_env_keeps_upstream_ops(dsa_layer_env, extension, monkeypatch):
    monkeypatch.setenv("VLLM_KIMI_K3_DSA_FORCE_WRAPPER", "1")
    layer = build(dsa_layer_env)
    assert not layer.dsa_indexer.use_fused_k_insert
    assert layer.dsa_indexer.k_insert_blockers == ["VLLM_KIMI_K3_DSA_FORCE_WRAPPER=1"]
    assert layer.fused_forward_blockers() == ["VLLM_KIMI_K3_DSA_FORCE_WRAPPER=1"]
    _assert_declined(layer, _snapshot(layer))


def test_pack_declines_under_dcp(dsa_layer_env, extension):
    layer = build(dsa_layer_env)
    # DCP groups do not exist on one rank; the layer reads the indexer's size.
    layer.dsa_indexer.dcp_world_size = 2
    assert layer.fused_forward_blockers() == ["decode context parallelism"]
    _assert_declined(layer, _snapshot(layer))


def test_pack_declines_without_q_lora(dsa_layer_env, extension):
    layer = build(dsa_layer_env, dsa_layer_env.text_config(q_lora_rank=None))
    assert layer.fused_forward_blockers() == ["no q-LoRA"]
    _assert_declined(layer, None)


def test_pack_declines_with_rope(dsa_layer_env, extension):
    layer = build(dsa_layer_env, dsa_layer_env.text_config(mla_use_nope=False))
    assert layer.fused_forward_blockers() == ["rope (not NoPE)"]
    _assert_declined(layer, _snapshot(layer))


def test_pack_declines_without_output_gate(dsa_layer_env, extension):
    layer = build(dsa_layer_env, dsa_layer_env.text_config(mla_use_output_gate=False))
    assert not hasattr(layer, "g_proj") and layer.mla_attn.g_proj is None
    assert layer.fused_forward_blockers() == ["no output gate"]
    _assert_declined(layer, _snapshot(layer))


def test_pack_declines_without_fp8_ds_mla(dsa_layer_env, extension):
    layer = build(dsa_layer_env)
    layer.mla_attn.mla_attn.kv_cache_dtype = "auto"
    assert layer.fused_forward_blockers() == ["kv cache dtype is not fp8_ds_mla"]
    _assert_declined(layer, _snapshot(layer))


def test_pack_declines_with_hisparse(dsa_layer_env, extension):
    layer = build(dsa_layer_env)
    layer.mla_attn.mla_attn.hisparse_cache = object()
    assert layer.fused_forward_blockers() == ["HiSparse"]
    _assert_declined(layer, _snapshot(layer))


def test_pack_declines_when_weights_pre_processed(
    dsa_layer_env, extension, monkeypatch
):
    layer = build(dsa_layer_env)
    monkeypatch.setattr(D, "is_weights_pre_processed", lambda: True)
    assert layer.fused_forward_blockers() == ["weights pre-processed"]
    _assert_declined(layer, _snapshot(layer))


def test_pack_declines_when_weights_offloaded(dsa_layer_env, extension, monkeypatch):
    offload = dsa_layer_env.vllm_config.offload_config
    monkeypatch.setattr(offload.uva, "cpu_offload_gb", 4)
    layer = build(dsa_layer_env)
    assert layer.weights_offloaded
    assert layer.fused_forward_blockers() == ["weights offloaded"]
    _assert_declined(layer, _snapshot(layer))


def test_pack_declines_when_prefetch_offloaded(dsa_layer_env, extension, monkeypatch):
    offload = dsa_layer_env.vllm_config.offload_config
    monkeypatch.setattr(offload.prefetch, "offload_group_size", 2)
    layer = build(dsa_layer_env)
    assert layer.weights_offloaded
    _assert_declined(layer, _snapshot(layer))


def test_pack_declines_when_norm_eps_differ(dsa_layer_env, extension):
    layer = build(dsa_layer_env)
    layer.q_a_layernorm.variance_epsilon = 1e-6
    assert layer.fused_forward_blockers() == ["norm eps differ"]
    _assert_declined(layer, _snapshot(layer))


def test_pack_declines_with_quantized_linear(dsa_layer_env, extension):
    layer = build(dsa_layer_env)

    class QuantizedMethod:  # not an UnquantizedLinearMethod
        pass

    layer.dsa_indexer.wq_index.quant_method = QuantizedMethod()
    assert layer.fused_forward_blockers() == ["quantized projections"]
    _assert_declined(layer, _snapshot(layer))


def test_low_latency_method_counts_as_unquantized(dsa_layer_env, extension):
    from vllm.models.kimi_k3.nvidia.low_latency_gemm import (
        KimiK3LowLatencyLinearMethod,
    )

    layer = build(dsa_layer_env)
    layer.fused_qkv_a_proj.quant_method = KimiK3LowLatencyLinearMethod({}, {})
    assert layer.fused_forward_blockers() == []


# --------------------------------------------------------------------------
# forward: the wrapper path when not packed
# --------------------------------------------------------------------------


def test_forward_uses_wrapper_when_declined(dsa_layer_env, no_extension, monkeypatch):
    layer = build(dsa_layer_env)
    layer.pack_projections()  # declines: no extension
    calls: list[tuple[torch.Tensor, torch.Tensor]] = []
    sentinel = torch.zeros(2, 256)

    def wrapper_forward(positions, hidden_states):
        calls.append((positions, hidden_states))
        return sentinel

    monkeypatch.setattr(layer.mla_attn, "forward", wrapper_forward)

    def fail(*args, **kwargs):
        raise AssertionError("fused path taken")

    monkeypatch.setattr(layer, "_fused_attention", fail)
    positions, hidden = torch.arange(2), torch.randn(2, 256)
    assert layer(positions, hidden) is sentinel
    assert len(calls) == 1 and calls[0][1] is hidden


def test_forward_uses_fused_path_when_packed(dsa_layer_env, extension, monkeypatch):
    layer = build(dsa_layer_env)
    fill_random(layer)
    layer.pack_projections()
    hidden = torch.randn(3, 256)
    attn_out = torch.randn(3, 4 * 128)

    def wrapper_forward(*args, **kwargs):
        raise AssertionError("wrapper path taken")

    monkeypatch.setattr(layer.mla_attn, "forward", wrapper_forward)
    monkeypatch.setattr(layer, "_fused_attention", lambda h: attn_out)
    cpu_post_load(layer)
    out = layer(torch.arange(3), hidden)
    gate = hidden @ layer.g_proj.weight.T
    expected = (attn_out * gate.sigmoid()) @ layer.o_proj.weight.T
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)


# --------------------------------------------------------------------------
# low_latency_linear / request_low_latency_warmup
# --------------------------------------------------------------------------


def test_packed_shapes_of_kimi_k31():
    shapes = LL.kimi_k31_packed_shapes()
    assert (2272, 7168) in shapes
    for tp, rows in {1: 22528, 2: 13312, 4: 8704, 8: 6400}.items():
        assert LL.packed_query_rows(96 // tp) == rows
        assert (rows, 1536) in shapes
    assert len(shapes) == 5
    assert LL.packed_input_rows() == 2272


@pytest.mark.parametrize(
    ("m", "n", "k"), [(1, 2272, 7168), (4, 6400, 1536), (3, 40, 24), (20, 2272, 64)]
)
def test_low_latency_linear_falls_back_on_cpu(m, n, k):
    x = torch.randn(m, k, dtype=torch.bfloat16)
    w = torch.randn(n, k, dtype=torch.bfloat16)
    torch.testing.assert_close(
        LL.low_latency_linear(x, w), torch.nn.functional.linear(x, w)
    )


def test_low_latency_linear_fp32_and_strided_input():
    base = torch.randn(5, 32)
    x = base[:, :16]  # a column slice, like q_c out of the packed GEMM
    w = torch.randn(8, 16)
    torch.testing.assert_close(LL.low_latency_linear(x, w), x @ w.T)


def test_request_low_latency_warmup_is_noop_on_cpu():
    packed = torch.empty(2272, 7168, dtype=torch.bfloat16)
    assert LL.request_low_latency_warmup(packed) is False
    assert LL.request_low_latency_warmup(torch.empty(16, 8)) is False


def test_packed_plan_configs_satisfy_kernel_constraints():
    pytest.importorskip("vllm.model_executor.kernels.linear.cute_dsl.skinny_gemm")
    for n, k in LL.kimi_k31_packed_shapes():
        plan = LL._packed_plan(n, k)
        assert set(plan) == set(range(1, LL.LOW_LATENCY_MAX_TOKENS + 1)), (n, k)
        for m, config in plan.items():
            assert config.num_rows == m
            assert n % config.outputs_per_block == 0
            assert k % (config.block_size * config.vector_width) == 0
    # Shapes that are not packed Kimi K3.1 shapes get no plan.
    assert LL._packed_plan(2112, 7168) == {}


# --------------------------------------------------------------------------
# The indexer forward against the real sparse_attn_indexer op (dummy run)
# --------------------------------------------------------------------------


@pytest.mark.parametrize("k_norm", ["layernorm", "rmsnorm"])
def test_indexer_forward_dummy_run_calls_op(dsa_layer_env, monkeypatch, k_norm):
    """A profile (dummy) run through the real op schema: upstream's argument
    list binds, the fp8 query scale is folded (q_scale None), the heads are
    zero-padded to 32, and the fused insert skips the key."""
    import vllm.model_executor.layers.sparse_attn_indexer as sai
    from vllm.forward_context import set_forward_context

    seen: dict[str, Any] = {}
    real_fake = sai.sparse_attn_indexer_fake

    def record(*args, **kwargs):
        seen["args"], seen["kwargs"] = args, kwargs
        return real_fake(*args, **kwargs)

    monkeypatch.setattr(sai, "sparse_attn_indexer_fake", record)
    layer = build(
        dsa_layer_env,
        dsa_layer_env.text_config(
            dsa_config=dsa_layer_env.dsa_config(
                index_k_norm_type=k_norm, index_num_heads=24
            )
        ),
    )
    cpu_post_load(layer)
    indexer = layer.dsa_indexer
    hidden = torch.randn(5, 256)
    q_c = torch.randn(5, 1536)
    with set_forward_context(None, dsa_layer_env.vllm_config):
        out = indexer(hidden, q_c)
    assert out is indexer.topk_indices_buffer
    args = seen["args"]
    q_quant, q_scale, k, weights = args[3], args[4], args[5], args[6]
    assert q_quant.shape == (5, 32, 128) and q_quant.dtype == torch.float8_e4m3fn
    assert q_scale is None
    assert weights.shape == (5, 32) and weights.dtype == torch.float32
    assert torch.all(weights[:, 24:] == 0)
    fused = k_norm == "layernorm"
    assert indexer.use_fused_k_insert is fused
    assert (k is None) is fused
    if not fused:
        assert k.shape == (5, 128)
    assert args[14] is fused  # skip_k_cache_insert
    assert args[9] == TOPK and args[10] == 128  # topk_tokens, head_dim
    assert args[7] == 128 and args[8] == "ue8m0"
    assert args[18] is False  # use_fp4_cache


# --------------------------------------------------------------------------
# The fused path's composition on the CPU (kernels recorded, not run)
# --------------------------------------------------------------------------


def test_fused_attention_composition(dsa_layer_env, extension, monkeypatch):
    """``_fused_attention`` in a dummy run, with the prologue, the indexer
    scoring and the sparse MLA op recorded: the packed GEMMs give exactly
    what the six unpacked linears give, in the order the kernels take."""
    import sys
    import types

    from vllm.forward_context import set_forward_context

    layer = build(dsa_layer_env)
    fill_random(layer)
    cpu_post_load(layer)
    indexer = layer.dsa_indexer
    hidden = torch.randn(3, 256)
    expected_qkv_a = layer.fused_qkv_a_proj(hidden)[0]
    expected_wkv = indexer.wkv_index(hidden)[0]
    layer.pack_projections()
    assert layer._packed is not None

    calls: dict[str, Any] = {}
    q_c_normed = torch.randn(3, 1536)
    kv_c_normed = torch.randn(3, 512)

    def prologue(*args):
        calls["prologue"] = args
        return q_c_normed, kv_c_normed

    fused_prologue = types.ModuleType("fused_prologue")
    fused_prologue.dsa_fused_prologue = prologue
    fused_prologue.mxfp4_fused_prologue = None
    monkeypatch.setitem(sys.modules, f"{D.OPS_PACKAGE}.fused_prologue", fused_prologue)
    monkeypatch.setattr(indexer, "score", lambda *args: calls.setdefault("score", args))
    impl = layer.mla_attn.mla_attn.impl
    monkeypatch.setattr(
        impl, "record_logical_topk_ready", lambda: calls.setdefault("ready", True)
    )

    def mla_op(q, kv_c, k_pe, output, layer_name):
        calls["mla"] = (q, kv_c, k_pe, output, layer_name)
        output.fill_(1.0)

    monkeypatch.setattr(torch.ops.vllm, "unified_mla_attention_with_output", mla_op)

    with set_forward_context(None, dsa_layer_env.vllm_config):
        out = layer._fused_attention(hidden)

    args = calls["prologue"]
    q_c, kv_c, k_pe, index_k = args[:4]
    torch.testing.assert_close(q_c, expected_qkv_a[:, :1536])
    torch.testing.assert_close(kv_c, expected_qkv_a[:, 1536:2048])
    torch.testing.assert_close(k_pe, expected_qkv_a[:, 2048:])
    torch.testing.assert_close(index_k, expected_wkv[:, :128])
    assert args[4] is layer.q_a_layernorm.weight
    assert args[5] is layer.kv_a_layernorm.weight
    assert args[6] is indexer.k_index_norm.weight
    assert args[7] is indexer.k_index_norm.bias
    assert args[8] == indexer.k_index_norm.eps
    assert args[9] is indexer.topk_indices_buffer
    assert args[10:] == (None, None, None, None)  # dummy run: no caches

    score_hidden, index_q, index_weights, score_k = calls["score"]
    assert score_hidden is hidden and score_k is None
    torch.testing.assert_close(index_weights, expected_wkv[:, 128:])
    expected_index_q = q_c_normed @ indexer.wq_index.weight.T
    torch.testing.assert_close(index_q, expected_index_q.view(3, 32, 128))
    assert calls["ready"] is True

    q, kv, k_pe_arg, output, layer_name = calls["mla"]
    expected_q = (q_c_normed @ layer.q_b_proj.weight.T).view(3, 4, 192)
    torch.testing.assert_close(q, expected_q)
    assert kv is kv_c_normed
    assert k_pe_arg.shape == (3, 1, 64)
    torch.testing.assert_close(k_pe_arg[:, 0], expected_qkv_a[:, 2048:])
    from vllm.utils.torch_utils import _resolve_layer_name

    assert _resolve_layer_name(layer_name) == layer.mla_attn.mla_attn.layer_name
    assert out is output and out.shape == (3, 4 * 128)


@pytest.mark.parametrize(
    ("num_tokens", "parallel"), [(1, True), (511, True), (512, False), (600, False)]
)
def test_gate_on_aux_stream_below_threshold(
    dsa_layer_env, extension, monkeypatch, num_tokens, parallel
):
    from vllm.models.kimi_k3.nvidia.mla import _GATE_MULTI_STREAM_TOKEN_THRESHOLD

    assert _GATE_MULTI_STREAM_TOKEN_THRESHOLD == 512
    aux_stream = object()  # only handed through on this CPU machine
    layer = build(dsa_layer_env, aux_stream=aux_stream)
    fill_random(layer)
    cpu_post_load(layer)
    layer.pack_projections()
    assert layer._gate_events is not None  # created with the aux stream
    seen: list[Any] = []

    def in_parallel(fn0, fn1, event0, event1, stream):
        seen.append((event0, event1, stream))
        return fn0(), fn1()

    monkeypatch.setattr(D, "maybe_execute_in_parallel", in_parallel)
    attn_out = torch.randn(num_tokens, 4 * 128)
    monkeypatch.setattr(layer, "_fused_attention", lambda h: attn_out)
    hidden = torch.randn(num_tokens, 256)
    out = layer(torch.arange(num_tokens), hidden)
    if parallel:
        assert seen == [(*layer._gate_events, aux_stream)]
    else:
        assert seen == []
    gate = hidden @ layer.g_proj.weight.T
    expected = (attn_out * gate.sigmoid()) @ layer.o_proj.weight.T
    torch.testing.assert_close(out, expected, rtol=1e-3, atol=1e-3)


def test_no_gate_events_when_declined(dsa_layer_env, no_extension):
    layer = build(dsa_layer_env, aux_stream=object())
    layer.pack_projections()  # declines: no extension
    assert layer._packed is None and layer._gate_events is None


def test_request_warmup_registers_the_plan(monkeypatch):
    """On a supported GPU the warmup asks 0.33.0's CuTe-DSL warmup for exactly
    the configs the packed shape runs (device and kernel faked here)."""
    pytest.importorskip("vllm.model_executor.kernels.linear.cute_dsl.skinny_gemm")
    requested: list[tuple[torch.dtype, set]] = []

    class FakeGemm:
        def request_warmup_configs(self, dtype, configs, **kwargs):
            requested.append((dtype, set(configs)))

    monkeypatch.setattr(LL, "_device_supported", lambda device: True)
    monkeypatch.setattr(LL, "_skinny_gemm", lambda: FakeGemm())
    packed = torch.empty(2272, 7168, dtype=torch.bfloat16)
    assert LL.request_low_latency_warmup(packed) is True
    assert requested == [(torch.bfloat16, set(LL._packed_plan(2272, 7168).values()))]
    # Not a packed Kimi K3.1 shape, or not bf16: nothing requested.
    assert LL.request_low_latency_warmup(torch.empty(2112, 7168)) is False
    assert (
        LL.request_low_latency_warmup(torch.empty(2112, 7168, dtype=torch.bfloat16))
        is False
    )
    assert len(requested) == 1


def test_packed_shape_overrides_replace_heuristic(monkeypatch):
    skinny = pytest.importorskip(
        "vllm.model_executor.kernels.linear.cute_dsl.skinny_gemm"
    )
    measured = skinny.SkinnyGemmConfig(1, 64, 2, 2)
    monkeypatch.setitem(LL.PACKED_SHAPE_CONFIG_OVERRIDES, (6400, 1536), {1: measured})
    LL._packed_plan.cache_clear()
    try:
        assert LL._packed_plan(6400, 1536)[1] is measured
    finally:
        LL._packed_plan.cache_clear()


def test_indexer_forward_dummy_run_with_index_rope(dsa_layer_env, monkeypatch):
    """A rope checkpoint with indexer rope: the key is normed and rotated in
    the layer (no fused insert), then inserted by the op."""
    import vllm.model_executor.layers.sparse_attn_indexer as sai
    from vllm.forward_context import set_forward_context

    seen: dict[str, Any] = {}
    real_fake = sai.sparse_attn_indexer_fake

    def record(*args, **kwargs):
        seen["args"] = args
        return real_fake(*args, **kwargs)

    monkeypatch.setattr(sai, "sparse_attn_indexer_fake", record)
    rotations: list[int] = []
    real_rope = D.KimiK3DSAIndexer._apply_index_rope

    def apply_rope(self, index_q, index_k, positions, rotary_emb):
        rotations.append(self.index_rope_dim)
        return real_rope(self, index_q, index_k, positions, rotary_emb)

    monkeypatch.setattr(D.KimiK3DSAIndexer, "_apply_index_rope", apply_rope)
    config = dsa_layer_env.text_config(
        mla_use_nope=False,
        dsa_config=dsa_layer_env.dsa_config(
            index_k_norm_type="rmsnorm", index_rope_dim=32
        ),
    )
    layer = build(dsa_layer_env, config)
    cpu_post_load(layer)
    indexer = layer.dsa_indexer
    assert not indexer.use_fused_k_insert
    positions = torch.arange(4)
    with set_forward_context(None, dsa_layer_env.vllm_config):
        indexer(torch.randn(4, 256), torch.randn(4, 1536), positions, layer.rotary_emb)
    assert rotations == [32]
    assert seen["args"][5].shape == (4, 128)  # the normed, rotated key
    assert seen["args"][14] is False  # the op inserts it


def test_fused_insert_needs_the_extension(dsa_layer_env, monkeypatch):
    # Without vllm._kimi_k3_C the key is normed in torch and 0.33.0's op
    # inserts it: the wrapper path with upstream ops only.
    monkeypatch.setattr(D, "_extension_loaded", lambda: False)
    indexer = build_indexer(dsa_layer_env)
    assert not indexer.use_fused_k_insert
    import vllm.models.kimi_k3.common.dsa_cache as dsa_cache

    monkeypatch.setattr(dsa_cache, "kimi_k3_indexer_uses_fp4", lambda cfg: True)
    with pytest.raises(NotImplementedError, match="vllm._kimi_k3_C extension built"):
        build_indexer(dsa_layer_env)
