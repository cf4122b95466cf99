# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Data-parallel attention with expert parallelism for Kimi K3.1 DSA
(``--data-parallel-size N --enable-expert-parallel``): vLLM 0.33.0's real
configuration path accepts it on the real-attention checkpoint, every rank
keeps the attention heads of its attention TP, and ``kimi-k3-dsa-kv-plan
--dp N`` plans each engine as the engine sizes its packed block."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from engine_configs import create_engine_config, sm90_block_size

from kimi_k3_dsa_tools import kv_plan_cli
from kimi_k3_dsa_tools.tiny_checkpoint_cli import main as write_checkpoint

MAX_MODEL_LEN = 4096
HEADS = 96


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("dp_attention") / "ckpt"
    write_checkpoint([str(out), "--real-attention"])
    return out


def plan(capsys: pytest.CaptureFixture[str], *args: str) -> dict[str, Any]:
    capsys.readouterr()
    assert kv_plan_cli.main([*args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("dp,tp", [(8, 1), (2, 4)])
def test_dp_attention_with_expert_parallelism_is_planned_per_engine(
    checkpoint: Path,
    dp: int,
    tp: int,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
):
    cfg = create_engine_config(
        checkpoint,
        max_model_len=MAX_MODEL_LEN,
        data_parallel_size=dp,
        tensor_parallel_size=tp,
        enable_expert_parallel=True,
    )
    parallel = cfg.parallel_config
    assert (parallel.data_parallel_size, parallel.tensor_parallel_size) == (dp, tp)
    assert parallel.enable_expert_parallel
    assert cfg.model_config.get_num_attention_heads(parallel) == HEADS // tp
    assert cfg.cache_config.cache_dtype == "fp8_ds_mla"
    block = sm90_block_size(cfg, monkeypatch)
    args = ["--config", str(checkpoint), "--tp", str(tp), "--kv-budget", "1GiB",
            "--max-model-len", str(MAX_MODEL_LEN)]  # fmt: skip
    per_engine = plan(capsys, *args, "--dp", str(dp))
    assert per_engine["dp"] == dp
    assert per_engine["block_size"] == block
    # DP changes how many engines there are, not an engine's plan.
    alone = plan(capsys, *args)
    assert {**per_engine, "dp": 1} == alone


def test_the_plan_refuses_a_dp_size_below_one(capsys: pytest.CaptureFixture[str]):
    assert kv_plan_cli.main(["--dp", "0"]) == 2
    assert "--dp must be a positive integer, got 0" in capsys.readouterr().err


@pytest.mark.parametrize("shared", [False, True])
def test_tp_says_once_how_the_indexer_decode_rows_run(
    checkpoint: Path, monkeypatch: pytest.MonkeyPatch, record_logs, shared: bool
):
    """At TP > 1 the config check says that every rank scores every decode
    row and names the switch that shares them; with it on, the op says so."""
    from vllm.models.kimi_k3.common import dsa_verify
    from vllm.models.kimi_k3.common.dsa_envs import INDEXER_DECODE_SHARD_ENV

    monkeypatch.setenv(INDEXER_DECODE_SHARD_ENV, "1" if shared else "0")
    logs = record_logs(dsa_verify)
    create_engine_config(
        checkpoint, max_model_len=MAX_MODEL_LEN, tensor_parallel_size=4
    )
    said = [m for m in logs.messages("info_once") if "decode rows" in m]
    if shared:
        assert said == []
    else:
        assert said == [
            "Kimi K3.1 DSA: every one of the 4 TP ranks scores all of the "
            f"indexer's decode rows; {INDEXER_DECODE_SHARD_ENV}=1 shares them by "
            "request."
        ]
