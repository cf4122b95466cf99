# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The KV plan command: on the bundled Kimi K3.1 config, its numbers checked
by an independent computation here, and its errors on bad inputs."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kimi_k3_dsa_tools import kv_plan_inputs as plan_inputs
from kimi_k3_dsa_tools.kv_plan_cli import main

GIB = 2**30
BUNDLED = Path(plan_inputs.__file__).parent / plan_inputs.BUNDLED_CONFIG


def independent_plan(
    tp, budget, index_bytes=132, draft_bytes=0, num_spec=0, max_len=1_048_576
):
    """Kimi K3.1 by hand: 24 DSA + 69 KDA layers, KDA 96 heads x 128 with a
    4-tap conv (bf16) and fp32 recurrent state, fp8_ds_mla 656 B/token."""
    row = 24 * (656 + index_bytes) + draft_bytes
    conv = 3 * 96 * 128 // tp * (3 + num_spec) * 2
    recurrent = 96 // tp * 128 * 128 * 4
    state = conv + recurrent
    states_per_row = 23  # 69 states in 3 rows of 23
    units = math.ceil(states_per_row * state * tp / (128 * 16 * row))
    block = 128 * units * 16 // tp
    # Whole 64-token kernel pages of the MLA (656 B) and indexer caches.
    page_step = math.lcm(64 * 656, 64 * index_bytes)
    block_bytes = math.ceil(block * row / page_step) * page_step
    blocks = budget // block_bytes
    per_request = math.ceil(max_len / block) + 3
    return dict(
        row_bytes_per_token=row,
        kda_state_bytes=state,
        kda_bytes_per_request=69 * state,
        block_size=block,
        block_bytes=block_bytes,
        num_blocks=blocks,
        max_tokens=(blocks - 3) * block,
        blocks_per_full_request=per_request,
        full_length_requests=blocks // per_request,
    )


def run_json(capsys, *args):
    capsys.readouterr()  # drop vLLM's logs of earlier steps
    assert main([*args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_bundled_config_has_the_kimi_k3_1_facts():
    config = json.loads(BUNDLED.read_text())
    linear = config["linear_attn_config"]
    assert config["num_hidden_layers"] == 93
    assert linear["full_attn_layers"] == [*range(4, 93, 4), 93]
    assert sorted(linear["kda_layers"] + linear["full_attn_layers"]) == list(
        range(1, 94)
    )
    assert (linear["num_heads"], linear["head_dim"]) == (96, 128)
    assert linear["short_conv_kernel_size"] == 4
    assert config["dsa_config"]["index_topk"] == 2048
    assert config["dsa_config"]["index_num_heads"] == 32
    assert config["dsa_config"]["index_head_dim"] == 128
    assert config["max_position_embeddings"] == 1_048_576


@pytest.mark.parametrize("tp", [1, 2, 4, 8, 16])
def test_plan_numbers(capsys, tp):
    budget = 60 * GIB
    plan = run_json(capsys, "--tp", str(tp), "--kv-budget", "60GiB")
    assert plan["mla_bytes_per_token"] == 656
    assert plan["indexer_bytes_per_token"] == 132
    assert (plan["num_dsa_layers"], plan["num_kda_layers"]) == (24, 69)
    assert plan["kv_budget_bytes"] == budget
    expected = independent_plan(tp, budget)
    assert {k: plan[k] for k in expected} == expected


def test_plan_tp8_text(capsys):
    assert main(["--tp", "8", "--kv-budget", "60GiB"]) == 0
    out = capsys.readouterr().out
    expected = independent_plan(8, 60 * GIB)
    assert expected["block_size"] == 1024
    assert "656 B x 24 layers =  15,744 B" in out
    assert "132 B x 24 layers =   3,168 B" in out
    assert "packed row                           =  18,912 B" in out
    assert "814,080 B x 69 layers = 56,171,520 B" in out
    assert "block size 1,024 tokens" in out
    assert f"blocks {expected['num_blocks']:,}" in out
    assert f"KV tokens {expected['max_tokens']:,}" in out
    assert out.rstrip().endswith(f": {expected['full_length_requests']:,}")


def test_plan_mxfp4_keys(capsys):
    plan = run_json(capsys, "--indexer-kv-dtype", "mxfp4", "--kv-budget", "60GiB")
    assert plan["indexer_bytes_per_token"] == 68
    expected = independent_plan(8, 60 * GIB, index_bytes=68)
    assert {k: plan[k] for k in expected} == expected


def test_plan_with_dense_draft_and_spec_tokens(capsys, tmp_path):
    draft = tmp_path / "draft.json"
    draft.write_text(
        json.dumps(
            {"num_hidden_layers": 1, "kv_lora_rank": 512, "qk_rope_head_dim": 64}
        )
    )
    plan = run_json(
        capsys,
        "--draft-method", "eagle3", "--draft-config", str(draft),
        "--num-speculative-tokens", "3", "--kv-budget", "80GiB",
        "--max-model-len", "262144",
    )  # fmt: skip
    # The draft's own cache dtype, auto: 512 + 64 bf16 values (its dense MLA
    # backends read no fp8_ds_mla).
    assert plan["draft_bytes_per_token"] == 1152
    expected = independent_plan(
        8, 80 * GIB, draft_bytes=1152, num_spec=3, max_len=262_144
    )
    assert {k: plan[k] for k in expected} == expected
    fp8 = run_json(
        capsys,
        "--draft-method", "eagle3", "--draft-config", str(draft),
        "--draft-kv-cache-dtype", "fp8", "--kv-budget", "80GiB",
    )  # fmt: skip
    assert fp8["draft_bytes_per_token"] == 576


def test_plan_refuses_a_draft_cache_dtype_no_dense_backend_reads(capsys, tmp_path):
    from kimi_k3_dsa_tools.kv_plan_cli import main

    draft = tmp_path / "draft.json"
    draft.write_text(json.dumps({"num_hidden_layers": 1, "kv_lora_rank": 512}))
    assert main(
        ["--draft-method", "dspark", "--draft-config", str(draft),
         "--draft-kv-cache-dtype", "fp8_ds_mla", "--kv-budget", "80GiB"]
    ) == 2  # fmt: skip
    assert "--draft-kv-cache-dtype 'fp8_ds_mla'" in capsys.readouterr().err


def test_plan_matches_the_engine_block_size(capsys, vllm_config_for, tmp_path):
    """On the tiny checkpoint the plan's block is the block the engine's
    sizing (packed_dsa_block_size on the real VllmConfig) gives."""
    from kimi_k3_dsa_tools.tiny_checkpoint import write_tiny_config
    from vllm.models.kimi_k3.common.dsa_block_size import (
        kda_state_bytes_for,
        target_mla_bytes_per_token,
    )
    from vllm.models.kimi_k3.common.dsa_cache import packed_dsa_block_size

    cfg = vllm_config_for()
    engine_block = packed_dsa_block_size(
        cfg, target_mla_bytes_per_token(cfg), kda_state_bytes_for(cfg), 128
    )
    ckpt = write_tiny_config(tmp_path / "tiny")
    plan = run_json(
        capsys, "--config", str(ckpt), "--tp", "1", "--kv-budget", "1GiB",
        "--max-model-len", "1024",
    )  # fmt: skip
    assert plan["block_size"] == engine_block == 2048


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--indexer-kv-dtype", "int4"], "--indexer-kv-dtype 'int4' is not supported"),
        (["--kv-cache-dtype", "bfloat16"], "--kv-cache-dtype 'bfloat16' is not"),
        (["--tp", "5"], "--tp 5 does not divide the 96 KDA heads"),
        (["--tp", "64"], "--tp 64 does not divide the 96 KDA heads"),
        (["--kv-budget", "1GiB"], "too small for one request of 1,048,576 tokens"),
        (["--kv-budget", "lots"], "cannot read the KV budget 'lots'"),
        (["--draft-method", "eagle3"], "needs --draft-config"),
        (["--draft-method", "medusa"], "unknown draft method 'medusa'"),
        (["--max-model-len", "0"], "--max-model-len must be a positive"),
        (["--config", "/nonexistent/config.json"], "cannot read the checkpoint"),
    ],
)
def test_bad_inputs(capsys, args, message):
    assert main(args) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert message in captured.err


def test_non_dsa_and_rmsnorm_mxfp4_configs(capsys, tmp_path):
    from kimi_k3_dsa_tools.tiny_checkpoint import write_tiny_config

    plain = write_tiny_config(tmp_path / "plain", dsa=False)
    assert main(["--config", str(plain)]) == 2
    assert "not a Kimi K3.1 DSA config" in capsys.readouterr().err
    rms = json.loads(BUNDLED.read_text())
    rms["dsa_config"]["index_k_norm_type"] = "rmsnorm"
    path = tmp_path / "rms.json"
    path.write_text(json.dumps(rms))
    assert main(["--config", str(path), "--indexer-kv-dtype", "mxfp4"]) == 2
    assert "fused Kimi K3 DSA key insert" in capsys.readouterr().err
    # fp8 keys stay fine with an rmsnorm k-norm.
    assert main(["--config", str(path), "--kv-budget", "60GiB"]) == 0


def test_module_command_and_console_script():
    from importlib.metadata import entry_points

    scripts = entry_points(group="console_scripts", name="kimi-k3-dsa-kv-plan")
    assert [ep.value for ep in scripts] == ["kimi_k3_dsa_tools.kv_plan_cli:main"]
    result = subprocess.run(
        [sys.executable, "-m", "kimi_k3_dsa_tools.kv_plan_cli",
         "--tp", "8", "--kv-budget", "60GiB"],
        capture_output=True, text=True, timeout=300,
        env={**os.environ, "VLLM_TARGET_DEVICE": "cpu"},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "block size 1,024 tokens" in result.stdout
