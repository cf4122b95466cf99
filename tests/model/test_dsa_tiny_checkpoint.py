# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The tiny Kimi K3.1 checkpoint generator (config + safetensors, CLI).

That the tensors load into the real model, each into the parameter it
belongs to, is checked in ``test_dsa_model.py``; here: the file set, the
naming, determinism and the command line.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

safetensors_torch = pytest.importorskip("safetensors.torch")

from kimi_k3_dsa_tools import tiny_checkpoint as T  # noqa: E402
from kimi_k3_dsa_tools import tiny_checkpoint_cli as cli  # noqa: E402
from kimi_k3_dsa_tools import tiny_weights as W  # noqa: E402


def _layers_with(names: set[str], part: str) -> set[int]:
    return {int(n.split(".")[2]) for n in names if part in n}


def test_shapes_follow_the_layer_kinds() -> None:
    config = T.tiny_text_config()
    names = set(W.tiny_checkpoint_shapes(config))
    num_layers = config["num_hidden_layers"]
    mtp = num_layers  # one MTP layer
    full = {n - 1 for n in T.TINY_FULL_ATTN_LAYERS}
    kda = {n - 1 for n in T.TINY_KDA_LAYERS}
    assert _layers_with(names, ".self_attn.indexer.wq_b.weight") == full | {mtp}
    for leaf in ("wk.weight", "weights_proj.weight", "k_norm.weight", "k_norm.bias"):
        assert _layers_with(names, f".self_attn.indexer.{leaf}") == full | {mtp}
    assert _layers_with(names, ".self_attn.q_a_proj.weight") == full | {mtp}
    assert _layers_with(names, ".self_attn.g_proj.weight") == full | kda | {mtp}
    assert _layers_with(names, ".self_attn.q_conv1d.weight") == kda
    assert _layers_with(names, ".eh_proj.weight") == {mtp}
    assert f"model.layers.{mtp}.embed_tokens.weight" in names
    assert {"model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"} <= names
    shapes = W.tiny_checkpoint_shapes(config)
    dsa = T.TINY_DSA_CONFIG
    p = f"model.layers.{min(full)}.self_attn.indexer."
    assert shapes[p + "wq_b.weight"] == (
        dsa["index_num_heads"] * dsa["index_head_dim"],
        config["q_lora_rank"],
    )
    assert shapes[p + "wk.weight"] == (dsa["index_head_dim"], config["hidden_size"])
    assert shapes[p + "weights_proj.weight"] == (
        dsa["index_num_heads"],
        config["hidden_size"],
    )


def test_plain_k3_and_rmsnorm_variants() -> None:
    names = set(W.tiny_checkpoint_shapes(T.tiny_text_config(dsa=False)))
    assert not [n for n in names if ".indexer." in n]
    rms = T.tiny_text_config(
        dsa_config={**T.TINY_DSA_CONFIG, "index_k_norm_type": "rmsnorm"}
    )
    names = set(W.tiny_checkpoint_shapes(rms))
    assert [n for n in names if n.endswith("indexer.k_norm.weight")]
    assert not [n for n in names if n.endswith("indexer.k_norm.bias")]


def test_write_tiny_checkpoint_files_and_determinism(tmp_path: Path) -> None:
    a = T.write_tiny_checkpoint(tmp_path / "a", seed=1)
    b = T.write_tiny_checkpoint(tmp_path / "b", seed=1)
    c = T.write_tiny_checkpoint(tmp_path / "c", seed=2)
    assert sorted(p.name for p in a.iterdir()) == ["config.json", T.CHECKPOINT_FILE]
    config = json.loads((a / "config.json").read_text())
    assert config == T.tiny_text_config()
    ta = safetensors_torch.load_file(str(a / T.CHECKPOINT_FILE))
    tb = safetensors_torch.load_file(str(b / T.CHECKPOINT_FILE))
    tc = safetensors_torch.load_file(str(c / T.CHECKPOINT_FILE))
    assert set(ta) == set(W.tiny_checkpoint_shapes(config))
    name = "model.layers.3.self_attn.indexer.wk.weight"
    assert ta[name].equal(tb[name]) and not ta[name].equal(tc[name])
    assert all(
        tuple(t.shape) == W.tiny_checkpoint_shapes(config)[n] for n, t in ta.items()
    )


def test_multimodal_prefix() -> None:
    tensors = W.tiny_checkpoint_tensors(T.tiny_text_config(), prefix="language_model.")
    assert all(n.startswith("language_model.") for n in tensors)
    assert "language_model.model.layers.3.self_attn.indexer.wq_b.weight" in tensors


def test_cli_writes_config_and_weights(tmp_path: Path) -> None:
    cli.main([str(tmp_path / "full")])
    full = json.loads((tmp_path / "full" / "config.json").read_text())
    assert full["dsa_config"] == T.TINY_DSA_CONFIG
    weights = safetensors_torch.load_file(str(tmp_path / "full" / T.CHECKPOINT_FILE))
    expected = W.tiny_checkpoint_shapes(full)
    assert {n: tuple(t.shape) for n, t in weights.items()} == expected
    assert any(".indexer.wq_b." in n for n in weights)
    cli.main([str(tmp_path / "plain"), "--no-dsa"])
    plain = json.loads((tmp_path / "plain" / "config.json").read_text())
    assert "dsa_config" not in plain
    weights = safetensors_torch.load_file(str(tmp_path / "plain" / T.CHECKPOINT_FILE))
    assert not [n for n in weights if ".indexer." in n]
    cli.main([str(tmp_path / "cfg"), "--config-only"])
    assert sorted(p.name for p in (tmp_path / "cfg").iterdir()) == ["config.json"]


def test_write_tiny_config_unchanged(tmp_path: Path) -> None:
    out = T.write_tiny_config(tmp_path / "x", dsa=True, max_position_embeddings=2048)
    config = json.loads((out / "config.json").read_text())
    assert config["dsa_config"] == T.TINY_DSA_CONFIG
    assert config["max_position_embeddings"] == 2048
    assert not (out / T.CHECKPOINT_FILE).exists()


def test_multimodal_checkpoint(tmp_path: Path) -> None:
    cli.main([str(tmp_path / "mm"), "--multimodal"])
    config = json.loads((tmp_path / "mm" / "config.json").read_text())
    assert config["model_type"] == "kimi_k3"
    assert config["architectures"] == ["KimiK3ForConditionalGeneration"]
    assert config["text_config"] == T.tiny_text_config()
    assert config["media_placeholder_token_id"] < config["text_config"]["vocab_size"]
    tensors = safetensors_torch.load_file(str(tmp_path / "mm" / T.CHECKPOINT_FILE))
    text = {n for n in tensors if n.startswith("language_model.")}
    assert {n.removeprefix("language_model.") for n in text} == set(
        W.tiny_checkpoint_shapes(T.tiny_text_config())
    )
    assert set(tensors) - text == set(
        W.tiny_vision_shapes(T.TINY_VISION_CONFIG, config["text_config"]["hidden_size"])
    )
    with pytest.raises(SystemExit):
        cli.main([str(tmp_path / "bad"), "--multimodal", "--config-only"])
