# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The tiny checkpoint with Kimi K3.1's real attention dimensions
(``kimi-k3-dsa-tiny-checkpoint --real-attention``) at TP 1, 2 and 8, on the
CPU: the shape each rank of the TP 8 deployment runs (12 of the 96 MLA heads,
the indexer's 32 heads replicated, a 1024-token packed KV block), without 8
GPUs.

What runs for real, and what stands in:

* vLLM 0.33.0's configuration path, ``EngineArgs(model=...,
  tensor_parallel_size=tp).create_engine_config()`` under
  ``VLLM_TARGET_DEVICE=cpu``, at TP 1, 2 and 8: the HF config parsing,
  ``ModelConfig.verify_with_parallel_config`` (the 96 heads divide by TP),
  the ``ParallelConfig`` (world size 8: the config path counts no devices;
  only starting the workers would need them), our general plugin and the
  Kimi K3.1 DSA verifier.
* The block-size seam, ``update_block_size_for_backend`` (what the worker
  runs once the model is built), on that config; the worker's attention
  backends are given directly (FlashMLA sparse and our indexer backend, what
  an SM90 worker's layers report): the CPU cannot build the CUDA layers.
* The plan command (``kimi-k3-dsa-kv-plan``'s ``main``, in-process) on the
  written ``config.json``, and on the bundled Kimi K3.1 config.
* vLLM's packer and planner on the KV specs a worker of the variant reports
  (built here, as ``tests/cache`` builds Kimi K3.1's).
* The DSA layer (``KimiK3DSAAttention``) at TP 2 and 8 with the TP size that
  it and vLLM's linears read patched (one CPU process cannot form a TP
  group): the per-rank shapes are the layer code's own. The whole model is
  built and loaded at TP 1 only.
* The one-rank variant (``--one-rank-of-tp 8``: one TP 8 rank's 12 MLA and
  12 KDA heads, the indexer whole) through the same configuration path and
  plan at TP 1, and its DSA layer against rank 0 of TP 8's.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import torch
from engine_configs import create_engine_config, sm90_block_size
from layer_builders import build

safetensors = pytest.importorskip("safetensors")

from kimi_k3_dsa_tools import kv_plan_cli  # noqa: E402
from kimi_k3_dsa_tools import kv_plan_inputs as plan_inputs  # noqa: E402
from kimi_k3_dsa_tools import tiny_checkpoint as T  # noqa: E402
from kimi_k3_dsa_tools import tiny_checkpoint_cli as cli  # noqa: E402
from kimi_k3_dsa_tools import tiny_weights as W  # noqa: E402

TP_SIZES = (1, 2, 8)
HEADS = 96
INDEX_HEADS, INDEX_DIM = 32, 128
HIDDEN = T.TINY_TEXT_CONFIG["hidden_size"]
Q_LORA, KV_LORA = 1536, 512
QK_NOPE, QK_ROPE, V_DIM = 128, 64, 128
KDA_HEADS, KDA_DIM = 80, 128
# Kimi K3.1's packed block at these TP sizes (tests/cache/test_kv_plan.py).
REAL_BLOCK = {1: 8192, 2: 4096, 8: 1024}
MAX_MODEL_LEN = 4096
KV_BUDGET = 2**30
BUNDLED = Path(plan_inputs.__file__).parent / plan_inputs.BUNDLED_CONFIG
DSA_LAYER = T.TINY_REAL_ATTENTION_FULL_ATTN_LAYERS[0] - 1  # 0-indexed
# The fields of Kimi K3.1's attention, as the bundled config spells them.
ATTENTION_FIELDS = (
    "num_attention_heads",
    "num_key_value_heads",
    "q_lora_rank",
    "kv_lora_rank",
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "v_head_dim",
    "mla_use_nope",
    "mla_use_output_gate",
    "dsa_config",
)


def variant_config() -> dict[str, Any]:
    return T.tiny_text_config(**T.real_attention_overrides())


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The variant, written by the command line."""
    out = tmp_path_factory.mktemp("real_attention") / "ckpt"
    cli.main([str(out), "--real-attention"])
    return out


@pytest.fixture(scope="module")
def engine_configs(checkpoint: Path) -> dict[int, Any]:
    """vLLM's engine config of the variant at each TP size."""
    return {
        tp: create_engine_config(
            checkpoint, tensor_parallel_size=tp, max_model_len=MAX_MODEL_LEN
        )
        for tp in TP_SIZES
    }


def plan(capsys: pytest.CaptureFixture[str], *args: str) -> dict[str, Any]:
    """``kimi-k3-dsa-kv-plan ARGS --json``, in-process."""
    capsys.readouterr()  # drop vLLM's logs of earlier steps
    assert kv_plan_cli.main([*args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def variant_plan(capsys, checkpoint: Path, tp: int) -> dict[str, Any]:
    return plan(
        capsys, "--config", str(checkpoint), "--tp", str(tp),
        "--kv-budget", str(KV_BUDGET), "--max-model-len", str(MAX_MODEL_LEN),
    )  # fmt: skip


class RankCase(NamedTuple):
    """One TP size of the variant: its engine config and its plan."""

    tp: int
    cfg: Any
    plan: dict[str, Any]


@pytest.fixture(params=TP_SIZES, ids=lambda tp: f"tp{tp}")
def rank(
    request: pytest.FixtureRequest,
    engine_configs: dict[int, Any],
    checkpoint: Path,
    capsys: pytest.CaptureFixture[str],
) -> RankCase:
    tp = request.param
    return RankCase(tp, engine_configs[tp], variant_plan(capsys, checkpoint, tp))


def assert_dsa_layer_shapes(shapes: dict[str, tuple[int, ...]], heads: int) -> None:
    """The DSA layer's MLA projections hold ``heads``; its indexer all 32."""
    p = f"model.layers.{DSA_LAYER}.self_attn."
    assert shapes[p + "q_b_proj.weight"] == (heads * (QK_NOPE + QK_ROPE), Q_LORA)
    assert shapes[p + "kv_b_proj.weight"] == (heads * (QK_NOPE + V_DIM), KV_LORA)
    assert shapes[p + "o_proj.weight"] == (HIDDEN, heads * V_DIM)
    assert shapes[p + "g_proj.weight"] == (heads * V_DIM, HIDDEN)
    assert shapes[p + "indexer.wq_b.weight"] == (INDEX_HEADS * INDEX_DIM, Q_LORA)
    assert shapes[p + "indexer.weights_proj.weight"] == (INDEX_HEADS, HIDDEN)
    assert shapes[p + "indexer.k_norm.bias"] == (INDEX_DIM,)  # LayerNorm k-norm


# -- the variant ---------------------------------------------------------------


def test_attention_fields_are_kimi_k3_1s() -> None:
    real = json.loads(BUNDLED.read_text())
    config = variant_config()
    for field in ATTENTION_FIELDS:
        assert config[field] == real[field], field
    real_kda, kda = real["linear_attn_config"], config["linear_attn_config"]
    assert kda["head_dim"] == real_kda["head_dim"] == KDA_DIM
    assert kda["short_conv_kernel_size"] == real_kda["short_conv_kernel_size"]
    assert kda["num_heads"] == KDA_HEADS
    # Every head count shards at TP 8 and at the block's reference TP 16.
    for heads in (config["num_attention_heads"], config["num_key_value_heads"]):
        assert heads % 16 == 0
    assert KDA_HEADS % 16 == 0
    assert config["max_position_embeddings"] >= config["dsa_config"]["index_topk"]
    # Small elsewhere: the real model's first four layers, no MTP layer.
    assert config["num_hidden_layers"] == 4
    assert (kda["kda_layers"], kda["full_attn_layers"]) == ([1, 2, 3], [4])
    assert config["num_nextn_predict_layers"] == 0
    assert config["hidden_size"] == HIDDEN == 256
    assert config["vocab_size"] == 1024
    # 64 MLP and MoE columns per rank at TP 8.
    assert config["intermediate_size"] // 8 == 64
    assert config["moe_intermediate_size"] * config["num_shared_experts"] // 8 == 64
    assert config["moe_intermediate_size"] // 8 == 64


def test_overrides_are_a_copy_and_the_defaults_stand() -> None:
    overrides = T.real_attention_overrides()
    overrides["dsa_config"]["index_topk"] = 1
    overrides["linear_attn_config"]["kda_layers"].append(9)
    assert T.TINY_REAL_ATTENTION["dsa_config"]["index_topk"] == 2048
    assert T.TINY_REAL_ATTENTION_KDA_LAYERS == [1, 2, 3]
    tiny = T.tiny_text_config()
    assert tiny["num_attention_heads"] == 4
    assert tiny["dsa_config"]["index_topk"] == 128
    assert tiny["linear_attn_config"]["kda_layers"] == [1, 2, 3]
    assert "dsa_config" not in T.real_attention_overrides(dsa=False)


def test_cli_writes_the_variant(checkpoint: Path) -> None:
    from safetensors import safe_open

    config = json.loads((checkpoint / T.CONFIG_FILE).read_text())
    assert config == variant_config()
    weights = checkpoint / T.CHECKPOINT_FILE
    expected = W.tiny_checkpoint_shapes(config)
    with safe_open(str(weights), framework="pt") as f:
        names = f.keys()  # a safe_open handle is not iterable
        shapes = {name: tuple(f.get_slice(name).get_shape()) for name in names}
    assert shapes == expected
    assert_dsa_layer_shapes(shapes, HEADS)
    # bf16 values plus the safetensors header: ~209 MiB.
    size = weights.stat().st_size
    numel = sum(torch.Size(s).numel() for s in expected.values())
    assert 2 * numel < size < 2 * numel + 2**20
    assert size < 224 * 2**20


def test_cli_flag_with_config_only_and_no_dsa(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cli.main([str(tmp_path / "k31"), "--real-attention", "--config-only"])
    assert "(real attention dimensions)" in capsys.readouterr().out
    assert sorted(p.name for p in (tmp_path / "k31").iterdir()) == [T.CONFIG_FILE]
    config = json.loads((tmp_path / "k31" / T.CONFIG_FILE).read_text())
    assert config == variant_config()
    cli.main([str(tmp_path / "k3"), "--real-attention", "--no-dsa", "--config-only"])
    plain = json.loads((tmp_path / "k3" / T.CONFIG_FILE).read_text())
    assert "dsa_config" not in plain
    assert plain["num_attention_heads"] == HEADS
    assert plain == T.tiny_text_config(dsa=False, **T.real_attention_overrides(False))


@pytest.mark.parametrize("dsa", [True, False])
def test_attention_blocks_repeat_the_layer_pattern(dsa: bool) -> None:
    one = T.real_attention_overrides(dsa)
    four = T.real_attention_overrides(dsa, blocks=4)
    linear = four["linear_attn_config"]
    assert four["num_hidden_layers"] == 16
    assert linear["kda_layers"] == [1, 2, 3, 5, 6, 7, 9, 10, 11, 13, 14, 15]
    assert linear["full_attn_layers"] == [4, 8, 12, 16]
    # Everything else is the one-block variant's.
    for key in ("num_hidden_layers", "linear_attn_config"):
        del one[key], four[key]
    assert four == one
    assert T.real_attention_overrides(dsa, blocks=1) == T.real_attention_overrides(dsa)


@pytest.mark.parametrize("blocks", [0, -1, T.MAX_ATTENTION_BLOCKS + 1])
def test_attention_blocks_out_of_range_are_refused(blocks: int) -> None:
    with pytest.raises(ValueError, match=f"blocks={blocks}: give 1 to 24"):
        T.real_attention_overrides(blocks=blocks)


def test_cli_writes_attention_blocks(tmp_path: Path) -> None:
    out = tmp_path / "b3"
    cli.main([str(out), "--real-attention", "--attention-blocks", "3", "--config-only"])
    config = json.loads((out / T.CONFIG_FILE).read_text())
    assert config == T.tiny_text_config(**T.real_attention_overrides(blocks=3))
    assert config["linear_attn_config"]["full_attn_layers"] == [4, 8, 12]


def test_cli_mtp_layers_reach_the_config(tmp_path: Path) -> None:
    out = tmp_path / "mtp"
    cli.main([str(out), "--real-attention", "--mtp-layers", "1", "--config-only"])
    config = json.loads((out / T.CONFIG_FILE).read_text())
    overrides = T.real_attention_overrides()
    assert overrides["num_nextn_predict_layers"] == 0
    assert config == T.tiny_text_config(**(overrides | {"num_nextn_predict_layers": 1}))
    with pytest.raises(SystemExit) as refused:
        cli.main([str(tmp_path / "bad"), "--mtp-layers", "5", "--config-only"])
    assert refused.value.code == 2
    assert not (tmp_path / "bad").exists()


def test_cli_vocab_size_reaches_config_and_weights(tmp_path: Path) -> None:
    """vllm bench latency draws prompt ids below 10000: --vocab-size 10240
    gives an embedding and LM head that take them; nothing else changes."""
    from safetensors import safe_open

    out = tmp_path / "v"
    cli.main([str(out), "--real-attention", "--vocab-size", "10240", "--seed", "1"])
    config = json.loads((out / T.CONFIG_FILE).read_text())
    assert config == T.tiny_text_config(
        **T.real_attention_overrides(), vocab_size=10240
    )
    with safe_open(str(out / T.CHECKPOINT_FILE), framework="pt") as f:
        assert f.get_slice("model.embed_tokens.weight").get_shape()[0] == 10240
        assert f.get_slice("lm_head.weight").get_shape()[0] == 10240


# -- one rank of TP N (--one-rank-of-tp) ---------------------------------------

RANK_TP = 8
RANK_HEADS = HEADS // RANK_TP  # 12: one TP 8 rank's MLA and KDA heads


def one_rank_config(blocks: int = 1) -> dict[str, Any]:
    return T.tiny_text_config(
        **T.real_attention_overrides(blocks=blocks, one_rank_of_tp=RANK_TP)
    )


@pytest.fixture(scope="module")
def one_rank_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One TP 8 rank, one layer block, with weights, by the command line."""
    out = tmp_path_factory.mktemp("one_rank") / "ckpt"
    cli.main([str(out), "--real-attention", "--one-rank-of-tp", str(RANK_TP)])
    return out


def test_one_rank_accepted_sizes_divide_both_head_counts() -> None:
    real = json.loads(BUNDLED.read_text())
    assert T.REAL_NUM_HEADS == real["num_attention_heads"] == HEADS
    assert T.REAL_KDA_HEADS == real["linear_attn_config"]["num_heads"] == HEADS
    assert T.ONE_RANK_TP_SIZES == (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 96)


@pytest.mark.parametrize("tp", T.ONE_RANK_TP_SIZES)
def test_one_rank_holds_its_share_of_the_heads(tp: int) -> None:
    """MLA and KDA heads divided by the TP size; the indexer, replicated on
    every rank, whole; every other field the whole-model variant's."""
    whole = T.real_attention_overrides(blocks=24)
    rank = T.real_attention_overrides(blocks=24, one_rank_of_tp=tp)
    assert rank["num_attention_heads"] == rank["num_key_value_heads"] == HEADS // tp
    assert rank["linear_attn_config"]["num_heads"] == HEADS // tp
    assert rank["dsa_config"] == whole["dsa_config"]
    assert rank["dsa_config"]["index_num_heads"] == INDEX_HEADS
    assert rank["dsa_config"]["index_head_dim"] == INDEX_DIM
    # An even RoPE dimension whatever hidden_size // heads is (256 // 12 = 21).
    assert rank["head_dim"] == rank["qk_rope_head_dim"] == QK_ROPE
    for config in (rank, whole):
        for key in ("num_attention_heads", "num_key_value_heads", "head_dim"):
            config.pop(key, None)
        del config["linear_attn_config"]["num_heads"]
    assert rank == whole
    # The default (None) is the whole-model variant, 80 KDA heads.
    default = T.real_attention_overrides()
    assert T.real_attention_overrides(one_rank_of_tp=None) == default
    assert default["linear_attn_config"]["num_heads"] == KDA_HEADS


@pytest.mark.parametrize("tp", [0, -8, 5, 7, 64, 192])
def test_one_rank_of_a_tp_that_splits_no_head_count_is_refused(tp: int) -> None:
    with pytest.raises(ValueError) as refused:
        T.real_attention_overrides(one_rank_of_tp=tp)
    message = str(refused.value)
    assert message.startswith(f"one_rank_of_tp={tp}: ")
    assert message.endswith("1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 96")


def test_cli_one_rank_reaches_the_config(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "rank"
    cli.main([
        str(out), "--real-attention", "--one-rank-of-tp", "8",
        "--attention-blocks", "24", "--config-only",
    ])  # fmt: skip
    assert "one rank of TP 8: 12 MLA and 12 KDA heads" in capsys.readouterr().out
    config = json.loads((out / T.CONFIG_FILE).read_text())
    assert config == one_rank_config(blocks=24)
    assert config["num_attention_heads"] == config["num_key_value_heads"] == 12
    assert config["linear_attn_config"]["num_heads"] == 12
    dsa = config["dsa_config"]
    assert (dsa["index_num_heads"], dsa["index_head_dim"]) == (32, 128)
    assert dsa["index_topk"] == 2048
    # The real depth: 24 attention layers, as in Kimi K3.1.
    assert len(config["linear_attn_config"]["full_attn_layers"]) == 24
    assert config["num_hidden_layers"] == 96
    cli.main([
        str(tmp_path / "dense"), "--real-attention", "--no-dsa",
        "--one-rank-of-tp", "8", "--config-only",
    ])  # fmt: skip
    dense = json.loads((tmp_path / "dense" / T.CONFIG_FILE).read_text())
    assert "dsa_config" not in dense and dense["num_attention_heads"] == 12


@pytest.mark.parametrize(
    "argv",
    [
        ["--real-attention", "--one-rank-of-tp", "5"],
        ["--real-attention", "--one-rank-of-tp", "0"],
        ["--real-attention", "--one-rank-of-tp", "192"],
        ["--one-rank-of-tp", "8"],
    ],
    ids=["5", "0", "192", "no-real-attention"],
)
def test_cli_bad_one_rank_is_refused_and_writes_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str]
) -> None:
    out = tmp_path / "bad"
    with pytest.raises(SystemExit) as refused:
        cli.main([str(out), *argv])
    assert refused.value.code == 2
    assert not out.exists() and list(tmp_path.iterdir()) == []
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--one-rank-of-tp" in err
    if "--real-attention" in argv:
        assert err.endswith("1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 96")
    else:
        assert err.endswith("--one-rank-of-tp needs --real-attention")


def test_cli_one_rank_weights_have_one_ranks_shapes(one_rank_checkpoint: Path) -> None:
    """The written tensors: the MLA and KDA projections hold 12 heads' rows
    (what rank 0 of TP 8 loads of the whole model), the indexer all 32."""
    from safetensors import safe_open

    config = json.loads((one_rank_checkpoint / T.CONFIG_FILE).read_text())
    assert config == one_rank_config()
    with safe_open(str(one_rank_checkpoint / T.CHECKPOINT_FILE), framework="pt") as f:
        names = f.keys()
        shapes = {name: tuple(f.get_slice(name).get_shape()) for name in names}
    assert shapes == W.tiny_checkpoint_shapes(config)
    assert_dsa_layer_shapes(shapes, RANK_HEADS)
    local = RANK_HEADS  # KDA heads, as MLA's
    kda = "model.layers.0.self_attn."
    for proj in ("q_proj", "k_proj", "v_proj"):
        assert shapes[kda + proj + ".weight"] == (local * KDA_DIM, HIDDEN)
    assert shapes[kda + "o_proj.weight"] == (HIDDEN, local * KDA_DIM)
    assert shapes[kda + "b_proj.weight"] == (local, HIDDEN)
    assert shapes[kda + "A_log"] == (local,)


def test_one_rank_dsa_layer_is_rank_0_of_tp8s(
    dsa_layer_env, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The one-rank variant's DSA layer at TP 1 has the parameters, by name
    and shape, that rank 0 of TP 8 builds of the whole-model variant."""
    import vllm.models.kimi_k3.nvidia.dsa as D
    from vllm.model_executor.layers import linear

    def shapes(config: Any, tp: int) -> dict[str, tuple[int, ...]]:
        for module in (D, linear):
            monkeypatch.setattr(
                module, "get_tensor_model_parallel_world_size", lambda: tp
            )
        topk = config.dsa_config.index_topk
        layer = build(
            dsa_layer_env,
            config,
            topk_indices_buffer=torch.full((16, topk), -1, dtype=torch.int32),
        )
        assert layer.num_local_heads == RANK_HEADS
        return {n: tuple(p.shape) for n, p in layer.named_parameters()}

    rank = dsa_layer_env.text_config(
        **T.real_attention_overrides(one_rank_of_tp=RANK_TP)
    )
    whole = dsa_layer_env.text_config(**T.real_attention_overrides())
    assert shapes(rank, 1) == shapes(whole, RANK_TP)


def test_engine_config_of_one_rank_at_tp1(
    one_rank_checkpoint: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """vLLM's configuration path takes the one-rank checkpoint at TP 1 (the
    even head_dim gets it past transformers' RoPE check) with one TP 8 rank's
    heads. Its packed block is 2048 tokens where TP 8's is 1024: the KDA
    state is the same bytes, but the block is rounded at the reference TP 16
    and scaled by 16 / TP (``packed_block_size_from_bytes``)."""
    cfg = create_engine_config(
        one_rank_checkpoint, tensor_parallel_size=1, max_model_len=MAX_MODEL_LEN
    )
    parallel, model = cfg.parallel_config, cfg.model_config
    assert parallel.tensor_parallel_size == parallel.world_size == 1
    assert model.get_num_attention_heads(parallel) == RANK_HEADS
    assert model.use_mla and model.is_hybrid
    text = model.hf_text_config
    assert text.linear_attn_config["num_heads"] == RANK_HEADS
    assert (text.dsa_config.index_num_heads, text.dsa_config.index_head_dim) == (
        INDEX_HEADS,
        INDEX_DIM,
    )
    assert cfg.cache_config.cache_dtype == "fp8_ds_mla"
    block = sm90_block_size(cfg, monkeypatch)
    ours = plan(
        capsys, "--config", str(one_rank_checkpoint), "--tp", "1",
        "--kv-budget", str(KV_BUDGET), "--max-model-len", str(MAX_MODEL_LEN),
    )  # fmt: skip
    real = plan(
        capsys, "--tp", str(RANK_TP), "--kv-budget", "60GiB",
        "--max-model-len", str(MAX_MODEL_LEN),
    )  # fmt: skip
    # One TP 8 rank's KDA state, to the byte.
    assert ours["kda_state_bytes"] == real["kda_state_bytes"]
    assert (block, ours["block_size"]) == (2048, 2048)
    assert real["block_size"] == REAL_BLOCK[RANK_TP] == 1024


# -- the engine configuration at TP 1, 2 and 8 --------------------------------


@pytest.mark.parametrize("tp", TP_SIZES)
def test_engine_config_per_rank_heads(engine_configs: dict[int, Any], tp: int) -> None:
    cfg = engine_configs[tp]
    parallel, model = cfg.parallel_config, cfg.model_config
    assert parallel.tensor_parallel_size == parallel.world_size == tp
    assert model.get_num_attention_heads(parallel) == HEADS // tp  # 96, 48, 12
    assert model.use_mla and model.is_hybrid
    text = model.hf_text_config
    # The indexer is not sharded: its heads are whole on every rank.
    assert text.dsa_config.index_num_heads == INDEX_HEADS
    assert text.dsa_config.index_head_dim == INDEX_DIM
    assert text.dsa_config.index_topk == 2048
    assert text.linear_attn_config["num_heads"] % tp == 0
    assert cfg.cache_config.cache_dtype == "fp8_ds_mla"


@pytest.mark.parametrize("tp", TP_SIZES)
def test_dsa_layer_shapes_per_rank(
    dsa_layer_env, monkeypatch: pytest.MonkeyPatch, tp: int
) -> None:
    """The DSA layer as rank 0 of TP ``tp`` builds it: the MLA projections
    hold ``96 / tp`` heads, the indexer all 32 (``ReplicatedLinear`` and a
    TP-disabled ``[wk | weights_proj]``)."""
    import vllm.models.kimi_k3.nvidia.dsa as D
    from vllm.model_executor.layers import linear

    for module in (D, linear):
        monkeypatch.setattr(module, "get_tensor_model_parallel_world_size", lambda: tp)
    config = dsa_layer_env.text_config(**T.real_attention_overrides())
    topk = config.dsa_config.index_topk
    layer = build(
        dsa_layer_env,
        config,
        topk_indices_buffer=torch.full((16, topk), -1, dtype=torch.int32),
    )
    local = HEADS // tp
    assert layer.num_heads == HEADS and layer.num_local_heads == local
    assert layer.mla_attn.num_heads == local
    assert layer.q_b_proj.weight.shape == (local * (QK_NOPE + QK_ROPE), Q_LORA)
    assert layer.kv_b_proj.weight.shape == (local * (QK_NOPE + V_DIM), KV_LORA)
    assert layer.o_proj.weight.shape == (HIDDEN, local * V_DIM)
    assert layer.g_proj.weight.shape == (local * V_DIM, HIDDEN)
    # Replicated: the MLA latent and the whole indexer.
    assert layer.fused_qkv_a_proj.weight.shape == (Q_LORA + KV_LORA + QK_ROPE, HIDDEN)
    indexer = layer.dsa_indexer
    assert indexer.index_num_heads == indexer.padded_index_num_heads == INDEX_HEADS
    assert indexer.wq_index.weight.shape == (INDEX_HEADS * INDEX_DIM, Q_LORA)
    assert indexer.wkv_index.weight.shape == (INDEX_DIM + INDEX_HEADS, HIDDEN)
    assert indexer.topk_tokens == 2048
    assert indexer.k_cache.head_dim == INDEX_DIM + 4  # fp8 keys + one fp32 scale


def test_model_builds_and_loads_at_tp1(dsa_layer_env, checkpoint: Path) -> None:
    """The real ``KimiLinearForCausalLM`` of the variant takes every tensor
    of the written checkpoint (a TP 1 rank; no forward)."""
    from safetensors.torch import load_file

    from vllm.config import set_current_vllm_config
    from vllm.models.kimi_k3.nvidia.model import KimiLinearForCausalLM
    from vllm.utils.torch_utils import set_default_torch_dtype

    text_config = dsa_layer_env.text_config(**T.real_attention_overrides())
    cfg = dsa_layer_env.vllm_config.with_hf_config(text_config)
    cfg.model_config.hf_text_config = text_config

    class NoCudaStream:  # KimiLinearModel makes an aux stream; never used here
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            pass

    dsa_layer_env.monkeypatch.setattr(torch.cuda, "Stream", NoCudaStream)
    with set_current_vllm_config(cfg), set_default_torch_dtype(torch.bfloat16):
        model = KimiLinearForCausalLM(vllm_config=cfg, prefix="")
    tensors = load_file(str(checkpoint / T.CHECKPOINT_FILE))
    with torch.no_grad():
        loaded = model.load_weights(iter(list(tensors.items())))
    assert loaded == {name for name, _ in model.named_parameters()}
    attn = model.model.layers[DSA_LAYER].self_attn
    assert attn.num_local_heads == HEADS
    p = f"model.layers.{DSA_LAYER}.self_attn."
    assert torch.equal(attn.q_b_proj.weight, tensors[p + "q_b_proj.weight"])
    assert torch.equal(
        attn.dsa_indexer.wq_index.weight, tensors[p + "indexer.wq_b.weight"]
    )


# -- the packed KV block: the engine's sizing and the plan command ------------


def test_plan_equals_the_engine_sizing(
    rank: RankCase, monkeypatch: pytest.MonkeyPatch
) -> None:
    from vllm.models.kimi_k3.common.dsa_block_size import (
        kda_state_bytes_for,
        target_mla_bytes_per_token,
    )
    from vllm.models.kimi_k3.common.dsa_cache import (
        dense_mla_draft_bytes_per_token,
        indexer_cache_entry_bytes,
        kimi_k3_indexer_uses_fp4,
        packed_dsa_block_size,
        packed_row_bytes_per_token,
    )

    tp, cfg, p = rank
    block = sm90_block_size(cfg, monkeypatch)
    mla = target_mla_bytes_per_token(cfg)
    index = indexer_cache_entry_bytes(INDEX_DIM, kimi_k3_indexer_uses_fp4(cfg))
    state = kda_state_bytes_for(cfg)
    assert packed_dsa_block_size(cfg, mla, state, 128) == block
    assert p["block_size"] == block == REAL_BLOCK[tp]
    assert (p["mla_bytes_per_token"], p["indexer_bytes_per_token"]) == (mla, index)
    assert (mla, index) == (656, 132)
    row = packed_row_bytes_per_token(
        1, mla, index, dense_mla_draft_bytes_per_token(cfg)
    )
    assert p["row_bytes_per_token"] == row == 788
    assert p["kda_state_bytes"] == state
    # Independent: conv (q, k, v channels, 3 taps, bf16) + fp32 recurrent.
    local_kda = KDA_HEADS // tp
    assert state == 3 * local_kda * KDA_DIM * 3 * 2 + local_kda * KDA_DIM**2 * 4
    assert (p["num_dsa_layers"], p["num_kda_layers"]) == (1, 3)
    assert (p["states_per_row"], p["num_state_groups"]) == (1, 3)


def _worker_specs(block: int, tp: int) -> dict[str, Any]:
    """The KV specs a TP ``tp`` worker of the variant reports."""
    from dsa_kv_specs import dsa_layer_specs, kda_layer_spec

    specs: dict[str, Any] = {}
    for layer in range(4):
        if layer == DSA_LAYER:
            specs.update(
                dsa_layer_specs(f"l{layer}", block, KV_LORA + QK_ROPE, INDEX_DIM + 4)
            )
        else:
            specs[f"l{layer}.kda"] = kda_layer_spec(block, tp, KDA_HEADS, KDA_DIM)
    return specs


def test_planner_allocates_the_plans_blocks(
    rank: RankCase, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What the engine core does with its ``tp`` workers' KV specs and a KV
    budget (``kv_cache_memory_bytes``) on each: vLLM's grouping, per-worker
    planning and scheduler config give the blocks the plan command counts,
    of the stride it counts; ``num_blocks`` is what the engine reports as
    ``cache_config.num_gpu_blocks``, the figure the 8-GPU test checks."""
    from vllm.v1.core.kv_cache_planning import (
        get_global_kv_cache_groups,
        get_kv_cache_configs,
    )
    from vllm.v1.core.kv_cache_utils import generate_scheduler_kv_cache_config

    tp, cfg, p = rank
    # The layout the engine core resolves for our block-outermost backends.
    monkeypatch.setattr(cfg.cache_config, "kv_cache_layout", "BLHNC")
    specs = [_worker_specs(p["block_size"], tp) for _ in range(tp)]
    groups = get_global_kv_cache_groups(cfg, specs)
    kv_cache_configs = get_kv_cache_configs(cfg, specs, [KV_BUDGET] * tp, groups)
    assert (
        generate_scheduler_kv_cache_config(kv_cache_configs).num_blocks
        == (p["num_blocks"])
    )
    for kv_cache_config in kv_cache_configs:
        strides = {t.block_stride for t in kv_cache_config.kv_cache_tensors}
        assert strides == {p["block_bytes"]}


# -- tied to the real model -----------------------------------------------------


def test_real_model_plan_at_tp8_and_the_variants_rows(
    checkpoint: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The bundled Kimi K3.1 config plans a 1024-token block at TP 8; the
    variant's DSA caches take the same bytes per token and DSA layer, and (by
    the choice of its KDA heads) the same block at TP 1, 2 and 8."""
    for tp in TP_SIZES:
        real = plan(
            capsys, "--tp", str(tp), "--kv-budget", "60GiB",
            "--max-model-len", str(MAX_MODEL_LEN),
        )  # fmt: skip
        ours = variant_plan(capsys, checkpoint, tp)
        assert real["block_size"] == ours["block_size"] == REAL_BLOCK[tp]
        for key in ("mla_bytes_per_token", "indexer_bytes_per_token"):
            assert ours[key] == real[key]
        assert (
            ours["row_bytes_per_token"] // ours["num_dsa_layers"]
            == real["row_bytes_per_token"] // real["num_dsa_layers"]
            == 656 + 132
        )
        assert ours["num_state_groups"] == real["num_state_groups"] == 3
        if tp == 8:
            assert real["block_size"] == 1024
