# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""An MTP draft's layers are DSA layers: vLLM 0.33.0's real planner packs
their MLA and indexer pages into the target's row, whose block size the
engine sized without them. ``kimi-k3-dsa-kv-plan --draft-method mtp`` must
count the planner's blocks and stride for the tiny Kimi K3.1 checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from dsa_kv_specs import dsa_layer_specs, kda_layer_spec

from kimi_k3_dsa_tools.kv_plan_cli import main

BUDGET = 1 << 30
MAX_LEN = 4096


@pytest.fixture(scope="module")
def tiny_config(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from kimi_k3_dsa_tools.tiny_checkpoint import write_tiny_config

    return write_tiny_config(tmp_path_factory.mktemp("mtp") / "tiny", dsa=True)


def _text(config: Path) -> dict:
    raw = json.loads((config / "config.json").read_text())
    return raw.get("text_config", raw)


def _worker_specs(text: dict, block: int, num_spec: int, dsa_layers: int) -> dict:
    """What a TP 1 worker reports: ``dsa_layers`` DSA layers (the target's
    and the MTP draft's) and the target's KDA layers with ``num_spec`` draft
    tokens in their conv state."""
    linear = text["linear_attn_config"]
    latent = text["kv_lora_rank"] + text["qk_rope_head_dim"]
    index_entry = text["dsa_config"]["index_head_dim"] + 4
    specs: dict = {}
    for i in range(dsa_layers):
        specs.update(dsa_layer_specs(f"d{i}", block, latent, index_entry))
    for i in range(len(linear["kda_layers"])):
        specs[f"k{i}.kda"] = kda_layer_spec(
            block,
            1,
            linear["num_heads"],
            linear["head_dim"],
            conv=linear["short_conv_kernel_size"],
            num_spec=num_spec,
        )
    return specs


def _plan(capsys, config: Path, *args: str) -> dict:
    capsys.readouterr()
    assert main(
        ["--config", str(config), "--tp", "1", "--kv-budget", str(BUDGET),
         "--max-model-len", str(MAX_LEN), "--json", *args]
    ) == 0  # fmt: skip
    return json.loads(capsys.readouterr().out)


def _planner(vllm_config_for, specs: dict):
    from vllm.v1.core.kv_cache_planning import (
        _get_packed_kv_cache_groups,
        get_kv_cache_config_from_groups,
    )

    cfg = vllm_config_for()
    saved = cfg.cache_config.kv_cache_layout
    cfg.cache_config.kv_cache_layout = "BLHNC"
    try:
        groups = _get_packed_kv_cache_groups(cfg, specs)
        return get_kv_cache_config_from_groups(cfg, groups, BUDGET)
    finally:
        cfg.cache_config.kv_cache_layout = saved


@pytest.mark.parametrize("num_spec", [1, 3])
def test_plan_counts_the_mtp_layers_pages(
    capsys, vllm_config_for, tiny_config: Path, num_spec: int
) -> None:
    text = _text(tiny_config)
    mtp = text["num_nextn_predict_layers"]
    num_dsa = len(text["linear_attn_config"]["full_attn_layers"])
    assert mtp >= 1
    plan = _plan(
        capsys, tiny_config, "--draft-method", "mtp",
        "--num-speculative-tokens", str(num_spec),
    )  # fmt: skip
    without = _plan(capsys, tiny_config, "--num-speculative-tokens", str(num_spec))
    # The engine sizes the block from the target's row alone.
    assert plan["block_size"] == without["block_size"]
    assert plan["mtp_layers"] == mtp
    assert plan["draft_bytes_per_token"] == mtp * (656 + 132)
    assert plan["row_bytes_per_token"] == without["row_bytes_per_token"] + mtp * 788
    specs = _worker_specs(text, plan["block_size"], num_spec, num_dsa + mtp)
    config = _planner(vllm_config_for, specs)
    assert config.num_blocks == plan["num_blocks"]
    assert {t.block_stride for t in config.kv_cache_tensors} == {plan["block_bytes"]}
    # Without the MTP layers the plan misses the planner's blocks.
    assert without["num_blocks"] != config.num_blocks


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--num-speculative-tokens", "0"], "needs --num-speculative-tokens >= 1"),
        (
            ["--num-speculative-tokens", "1", "--draft-config", "{config}"],
            "--draft-config is for a dense MLA draft",
        ),
    ],
)
def test_mtp_plan_refusals(capsys, tiny_config: Path, args, message) -> None:
    capsys.readouterr()
    args = [a.format(config=tiny_config) for a in args]
    status = main(
        ["--config", str(tiny_config), "--kv-budget", "1GiB", "--tp", "1",
         "--draft-method", "mtp", *args]
    )  # fmt: skip
    assert status != 0
    assert message in capsys.readouterr().err


def test_mtp_plan_needs_the_checkpoints_mtp_layers(capsys) -> None:
    # The bundled Kimi K3.1 config has no MTP layer.
    capsys.readouterr()
    status = main(
        ["--kv-budget", "60GiB", "--draft-method", "kimi_k3_mtp",
         "--num-speculative-tokens", "1"]
    )  # fmt: skip
    assert status != 0
    err = capsys.readouterr().err
    assert "text_config.num_nextn_predict_layers is 0" in err
