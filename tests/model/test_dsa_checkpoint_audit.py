# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Damaged or mislabelled checkpoints, refused by name while loading: a
missing MLA projection, a tensor given twice with other values, a NaN in an
attention tensor, a tensor the model has no parameter for, Kimi K3.1 weights
under a config without ``dsa_config`` and plain Kimi K3 weights under one
with it. Kimi K3.1 and plain Kimi K3 through the real model classes and
vLLM 0.33.0's loaders with our seams (stubs as in ``model_builders``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from model_builders import (
    DSA_LAYERS,
    build,
    plain_vllm_config,
    read_checkpoint,
)

from kimi_k3_dsa_tools.tiny_checkpoint import write_tiny_checkpoint

LAYER = DSA_LAYERS[-1]
ATTN = f"model.layers.{LAYER}.self_attn."


def setup(env, tmp_path: Path, dsa: bool):
    """A model and its tiny checkpoint: Kimi K3.1 (DSA layers) or plain Kimi
    K3 (dense MLA layers), the same attention tensors but the indexer."""
    cfg = None if dsa else plain_vllm_config(env)
    model = build(env, vllm_config=cfg)
    ckpt = read_checkpoint(write_tiny_checkpoint(tmp_path / "ckpt", dsa=dsa))
    return model, ckpt


def load_all(model, items) -> None:
    with torch.no_grad():
        model.load_weights(iter(items))
    model.process_weights_after_loading()


@pytest.mark.parametrize("dsa", [True, False], ids=["k3.1", "plain-k3"])
@pytest.mark.parametrize(
    ("module", "purpose"),
    [
        ("kv_a_proj_with_mqa", "the MLA latent down-projection"),
        ("g_proj", "the output gate"),
        ("kv_b_proj", "the MLA key/value up-projection"),
        ("q_a_layernorm", "the norm of the query latent"),
    ],
)
def test_missing_mla_tensor_refused(dsa_layer_env, tmp_path, dsa, module, purpose):
    """vLLM would leave the parameter uninitialized (its every-parameter
    check is skipped for quantized models and exempts linear weights)."""
    model, ckpt = setup(dsa_layer_env, tmp_path, dsa)
    name = f"{ATTN}{module}.weight"
    items = [(k, v) for k, v in ckpt.items() if k != name]
    with pytest.raises(ValueError) as err:
        load_all(model, items)
    message = str(err.value)
    assert f"Kimi K3 attention layer 'layers.{LAYER}.self_attn'" in message
    assert f"'layers.{LAYER}.self_attn.{module}.weight' ({purpose})" in message
    assert "\n" not in message


@pytest.mark.parametrize("dsa", [True, False], ids=["k3.1", "plain-k3"])
def test_complete_checkpoint_loads(dsa_layer_env, tmp_path, dsa):
    model, ckpt = setup(dsa_layer_env, tmp_path, dsa)
    # Each tensor twice with the same values (two shards overlapping): fine.
    load_all(model, [*ckpt.items(), *ckpt.items()])


def test_refit_with_new_values_accepted(dsa_layer_env, tmp_path):
    """A weight refit sends the same names with new values in a later call."""
    model, ckpt = setup(dsa_layer_env, tmp_path, dsa=True)
    load_all(model, ckpt.items())
    name = ATTN + "indexer.wk.weight"
    with torch.no_grad():
        model.load_weights(iter([(name, ckpt[name] * 2)]))
    wkv = model.model.layers[LAYER].self_attn.dsa_indexer.wkv_index.weight
    assert torch.equal(wkv[: ckpt[name].shape[0]], ckpt[name] * 2)


@pytest.mark.parametrize(
    "tensor",
    ["indexer.wk.weight", "indexer.k_norm.bias", "kv_a_proj_with_mqa.weight"],
)
def test_tensor_given_twice_with_other_values_refused(dsa_layer_env, tmp_path, tensor):
    model, ckpt = setup(dsa_layer_env, tmp_path, dsa=True)
    name = ATTN + tensor
    other = ckpt[name].clone()
    other.view(-1)[0] += 1
    with pytest.raises(ValueError) as err:
        load_all(model, [*ckpt.items(), (name, other)])
    assert (
        f"checkpoint tensor '{name.removeprefix('model.')}' is given twice with "
        "different values"
    ) in str(err.value)


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
@pytest.mark.parametrize(
    "tensor", ["indexer.weights_proj.weight", "indexer.k_norm.weight", "o_proj.weight"]
)
def test_non_finite_attention_tensor_refused(dsa_layer_env, tmp_path, tensor, value):
    model, ckpt = setup(dsa_layer_env, tmp_path, dsa=True)
    name = ATTN + tensor
    ckpt[name] = ckpt[name].clone()
    ckpt[name].view(-1)[-1] = value
    with pytest.raises(ValueError) as err:
        load_all(model, ckpt.items())
    assert (
        f"checkpoint tensor '{name.removeprefix('model.')}' holds non-finite "
        "values (NaN or inf)"
    ) in str(err.value)


@pytest.mark.parametrize("dsa", [True, False], ids=["k3.1", "plain-k3"])
@pytest.mark.parametrize(
    "stray",
    [
        f"{ATTN}extra_proj.weight",  # a projection the layer does not have
        "model.layers.9.mlp.down_proj.weight",  # a layer past the last one
    ],
)
def test_tensor_without_a_parameter_refused(dsa_layer_env, tmp_path, dsa, stray):
    """vLLM 0.33.0's loader ends in a bare KeyError naming a parameter."""
    model, ckpt = setup(dsa_layer_env, tmp_path, dsa)
    with pytest.raises(ValueError) as err:
        load_all(model, [*ckpt.items(), (stray, torch.ones(4, 4))])
    message = str(err.value)
    assert f"checkpoint tensor '{stray.removeprefix('model.')}' has no parameter" in (
        message
    )
    assert "check the tensor's name and the config's num_hidden_layers" in message


def test_dsa_weights_under_a_config_without_dsa_config_refused(dsa_layer_env, tmp_path):
    """Kimi K3.1 weights, plain Kimi K3 config: was a bare KeyError on the
    first indexer tensor."""
    model = build(dsa_layer_env, vllm_config=plain_vllm_config(dsa_layer_env))
    ckpt = read_checkpoint(write_tiny_checkpoint(tmp_path / "k31"))
    with pytest.raises(ValueError) as err:
        load_all(model, ckpt.items())
    message = str(err.value)
    assert "is a DSA indexer tensor (Kimi K3.1 weights)" in message
    assert "add the checkpoint's dsa_config" in message


def test_plain_weights_under_a_dsa_config_refused_with_the_fix(dsa_layer_env, tmp_path):
    model = build(dsa_layer_env)
    ckpt = read_checkpoint(write_tiny_checkpoint(tmp_path / "k3", dsa=False))
    with pytest.raises(ValueError) as err:
        load_all(model, ckpt.items())
    message = str(err.value)
    assert "these tensors belong to a plain Kimi K3 checkpoint" in message
    assert "remove dsa_config from its config.json" in message
