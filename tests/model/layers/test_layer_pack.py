# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""``pack_projections``: when the fused forward switches on, and that declining
leaves every weight as it was."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from layer_builders import (
    build,
    build_indexer,
    cpu_post_load,
    fill_random,
)

import vllm.models.kimi_k3.nvidia.dsa as D

# --------------------------------------------------------------------------
# pack_projections
# --------------------------------------------------------------------------


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


class _QuantizedMethod:
    """Any linear method that is not ``UnquantizedLinearMethod``."""


def _set_dcp(layer, monkeypatch) -> None:
    # DCP groups do not exist on one rank; the layer reads the indexer's size.
    layer.dsa_indexer.dcp_world_size = 2


def _set_cache_dtype_auto(layer, monkeypatch) -> None:
    layer.mla_attn.mla_attn.kv_cache_dtype = "auto"


def _set_hisparse(layer, monkeypatch) -> None:
    layer.mla_attn.mla_attn.hisparse_cache = object()


def _set_pre_processed(layer, monkeypatch) -> None:
    monkeypatch.setattr(D, "is_weights_pre_processed", lambda: True)


def _set_norm_eps(layer, monkeypatch) -> None:
    layer.q_a_layernorm.variance_epsilon = 1e-6


def _set_quantized(layer, monkeypatch) -> None:
    layer.dsa_indexer.wq_index.quant_method = _QuantizedMethod()


# A condition set on a built layer -> the one reason the fused forward gives.
DECLINED_AFTER_BUILD = [
    pytest.param(_set_dcp, "decode context parallelism", id="dcp"),
    pytest.param(
        _set_cache_dtype_auto, "kv cache dtype is not fp8_ds_mla", id="not-fp8-ds-mla"
    ),
    pytest.param(_set_hisparse, "HiSparse", id="hisparse"),
    pytest.param(_set_pre_processed, "weights pre-processed", id="pre-processed"),
    pytest.param(_set_norm_eps, "norm eps differ", id="norm-eps"),
    pytest.param(_set_quantized, "quantized projections", id="quantized"),
]


@pytest.mark.parametrize(("set_condition", "blocker"), DECLINED_AFTER_BUILD)
def test_pack_declines(dsa_layer_env, extension, monkeypatch, set_condition, blocker):
    layer = build(dsa_layer_env)
    assert layer.fused_forward_blockers() == []
    set_condition(layer, monkeypatch)
    assert layer.fused_forward_blockers() == [blocker]
    _assert_declined(layer, _snapshot(layer))


# Text-config changes -> the one reason (q-LoRA off also leaves nothing to
# pack, so no weight snapshot).
DECLINED_BY_CONFIG = [
    pytest.param({"q_lora_rank": None}, "no q-LoRA", id="no-q-lora"),
    pytest.param({"mla_use_nope": False}, "rope (not NoPE)", id="rope"),
    pytest.param({"mla_use_output_gate": False}, "no output gate", id="no-gate"),
]


@pytest.mark.parametrize(("changes", "blocker"), DECLINED_BY_CONFIG)
def test_pack_declines_for_the_config(dsa_layer_env, extension, changes, blocker):
    layer = build(dsa_layer_env, dsa_layer_env.text_config(**changes))
    assert layer.fused_forward_blockers() == [blocker]
    if "mla_use_output_gate" in changes:
        assert not hasattr(layer, "g_proj") and layer.mla_attn.g_proj is None
    snapshot = None if changes.get("q_lora_rank", 1) is None else _snapshot(layer)
    _assert_declined(layer, snapshot)


@pytest.mark.parametrize(
    ("offload", "value"),
    [("uva.cpu_offload_gb", 4), ("prefetch.offload_group_size", 2)],
    ids=["uva", "prefetch"],
)
def test_pack_declines_when_weights_offloaded(
    dsa_layer_env, extension, monkeypatch, offload, value
):
    group, name = offload.split(".")
    config = getattr(dsa_layer_env.vllm_config.offload_config, group)
    monkeypatch.setattr(config, name, value)
    layer = build(dsa_layer_env)
    assert layer.weights_offloaded
    assert layer.fused_forward_blockers() == ["weights offloaded"]
    _assert_declined(layer, _snapshot(layer))


def test_low_latency_method_counts_as_unquantized(dsa_layer_env, extension):
    from vllm.models.kimi_k3.nvidia.low_latency_gemm import (
        KimiK3LowLatencyLinearMethod,
    )

    layer = build(dsa_layer_env)
    layer.fused_qkv_a_proj.quant_method = KimiK3LowLatencyLinearMethod({}, {})
    assert layer.fused_forward_blockers() == []
