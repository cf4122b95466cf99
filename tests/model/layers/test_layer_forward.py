# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The DSA layer forward on the CPU: the wrapper path, the low-latency GEMM's
plan, the indexer against the real op schema (dummy run), and the fused
path's composition (kernels recorded, not run)."""

from __future__ import annotations

from dataclasses import astuple
from typing import Any

import pytest
import torch
from layer_builders import (
    TOPK,
    build,
    build_indexer,
    cpu_post_load,
    fill_random,
    roped_indexer_layer,
)

import vllm.models.kimi_k3.nvidia.dsa as D
import vllm.models.kimi_k3.nvidia.dsa_low_latency as LL

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


@pytest.mark.parametrize("major", [9, 10])
def test_packed_plan_configs_satisfy_kernel_constraints(major):
    """SM90 runs the measured winners (cuBLAS where the skinny GEMM lost);
    SM10x, not measured, the kernel's heuristic at every M."""
    pytest.importorskip("vllm.model_executor.kernels.linear.cute_dsl.skinny_gemm")
    measured = LL.PACKED_SHAPE_CONFIG_OVERRIDES.get(major, {})
    for n, k in LL.kimi_k31_packed_shapes():
        plan = LL._packed_plan(n, k, major)
        expected = set(range(1, LL.LOW_LATENCY_MAX_TOKENS + 1))
        if (n, k) in measured:
            assert set(measured[n, k]) == expected, (n, k)
            expected = {m for m, fields in measured[n, k].items() if fields}
            for m in expected:
                assert astuple(plan[m])[:5] == measured[n, k][m]
        assert set(plan) == expected, (n, k)
        for m, config in plan.items():
            assert config.num_rows == m
            assert n % config.outputs_per_block == 0
            assert k % (config.block_size * config.vector_width) == 0
    # Shapes that are not packed Kimi K3.1 shapes get no plan.
    assert LL._packed_plan(2112, 7168, major) == {}


def test_sm90_runs_the_skinny_gemm_only_where_it_was_measured_faster():
    """The H200 measurements: 1-4 tokens for the input projection, 1-2 for
    the query projection at every TP size; cuBLAS beyond."""
    pytest.importorskip("vllm.model_executor.kernels.linear.cute_dsl.skinny_gemm")
    assert set(LL._packed_plan(2272, 7168, 9)) == {1, 2, 3, 4}
    for tp_size in LL.PACKED_TP_SIZES:
        rows = LL.packed_query_rows(LL.KIMI_K31_NUM_HEADS // tp_size)
        assert set(LL._packed_plan(rows, 1536, 9)) == {1, 2}


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

    def prologue(*args, **kwargs):
        calls["prologue"] = args
        calls["prologue_kwargs"] = kwargs
        return q_c_normed, kv_c_normed

    monkeypatch.setattr(D, "dsa_fused_prologue", prologue)
    monkeypatch.setattr(D, "mxfp4_fused_prologue", None)  # fp8 keys here
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
    assert indexer.use_fp4_cache is False
    # The fp8 scale word is vLLM's choice for this platform (fp32 off SM10x).
    assert calls["prologue_kwargs"] == {"mx_scales": False}

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

    monkeypatch.setattr(LL, "_device_major", lambda device: 9)
    monkeypatch.setattr(LL, "_skinny_gemm", lambda: FakeGemm())
    packed = torch.empty(2272, 7168, dtype=torch.bfloat16)
    assert LL.request_low_latency_warmup(packed) is True
    plan = LL._packed_plan(2272, 7168, 9)
    assert requested == [(torch.bfloat16, set(plan.values()))]
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
    monkeypatch.setitem(
        LL.PACKED_SHAPE_CONFIG_OVERRIDES,
        10,
        {(6400, 1536): {1: (1, 64, 2, 2, 8), 2: None}},
    )
    LL._packed_plan.cache_clear()
    try:
        plan = LL._packed_plan(6400, 1536, 10)
        assert plan[1] == skinny.SkinnyGemmConfig(1, 64, 2, 2, 8)
        assert 2 not in plan  # None: cuBLAS
        assert set(plan) == set(range(1, LL.LOW_LATENCY_MAX_TOKENS + 1)) - {2}
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
    layer = roped_indexer_layer(dsa_layer_env)
    indexer = layer.dsa_indexer
    assert not indexer.use_fused_k_insert
    positions = torch.arange(4)
    with set_forward_context(None, dsa_layer_env.vllm_config):
        indexer(torch.randn(4, 256), torch.randn(4, 1536), positions, layer.rotary_emb)
    assert rotations == [32]
    assert seen["args"][5].shape == (4, 128)  # the normed, rotated key
    assert seen["args"][14] is False  # the op inserts it


def test_a_gpu_the_build_lacks_serves_with_upstream_ops(dsa_layer_env, monkeypatch):
    """A GPU whose architecture the extension was not built for (SM103 with a
    sm_90a/sm_100a build): neither the fused key insert nor the fused forward
    is selected, and the reason names the GPU. Stubbed: the extension's
    probe of the GPU, which a CPU cannot run."""
    from vllm.models.kimi_k3.nvidia.dsa import fused_forward_blockers
    from vllm.models.kimi_k3.nvidia.dsa_ops import _extension

    reason = (
        "vllm._kimi_k3_C holds no kernels for this GPU (SM103): rebuild it "
        "with TORCH_CUDA_ARCH_LIST including 10.3a"
    )
    monkeypatch.setattr(_extension, "unavailable_reason", lambda: reason)
    # What the probe makes _extension_loaded say (the autouse fixture of this
    # folder pretends the extension runs).
    monkeypatch.setattr(D, "kimi_k3_extension_available", lambda: False)
    indexer = build_indexer(dsa_layer_env)
    assert not indexer.use_fused_k_insert
    assert indexer.k_insert_blockers == [reason]
    layer = build(dsa_layer_env)
    assert reason in fused_forward_blockers(layer)


def test_fused_insert_needs_the_extension(dsa_layer_env, monkeypatch):
    # Without vllm._kimi_k3_C the key is normed in torch and 0.33.0's op
    # inserts it: the wrapper path with upstream ops only.
    monkeypatch.setattr(D, "kimi_k3_extension_available", lambda: False)
    indexer = build_indexer(dsa_layer_env)
    assert not indexer.use_fused_k_insert
    import vllm.models.kimi_k3.common.dsa_cache as dsa_cache

    monkeypatch.setattr(dsa_cache, "kimi_k3_indexer_uses_fp4", lambda cfg: True)
    with pytest.raises(NotImplementedError, match="vllm._kimi_k3_C extension built"):
        build_indexer(dsa_layer_env)


@pytest.mark.parametrize("sm10x", [False, True])
def test_key_writers_take_vllms_scale_word(monkeypatch, sm10x):
    """fp8 keys carry the scale word vLLM's DeepGEMM reads on this platform
    (``mqa_logits_use_mx_scales``); MXFP4 keys take no scale choice."""
    monkeypatch.setattr(D, "mqa_logits_use_mx_scales", lambda: sm10x)
    assert D.key_format_kwargs(False) == {"mx_scales": sm10x}
    assert D.key_format_kwargs(True) == {}
