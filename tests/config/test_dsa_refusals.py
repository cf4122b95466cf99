# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Inputs the kernels, the GPU memory or vLLM's own checks cannot take are
refused at configuration time, in one line that names the field, the value
and what is accepted: ``dsa_config`` values against the kernels in use, the
top-k buffer against the GPU memory budget and top-k against
``max_model_len``, DSA keys outside ``dsa_config``, our environment switches,
and an MTP draft on a checkpoint without MTP layers. Each case runs vLLM
0.33.0's real configuration path (``EngineArgs.create_engine_config``) on a
tiny checkpoint directory; where a CPU cannot be the GPU a rule is about, the
platform query alone is stubbed and the verifier called on the real config.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kimi_k3_dsa_tools.tiny_checkpoint import (
    TINY_DSA_CONFIG,
    TINY_VISION_CONFIG,
    tiny_multimodal_config,
    tiny_text_config,
)
from vllm.models.kimi_k3.common import dsa_config as dsa_config_module
from vllm.models.kimi_k3.common.dsa_verify import verify_dsa_vllm_config

GIB = 2**30


def dsa(**changes: Any) -> dict[str, Any]:
    return {**TINY_DSA_CONFIG, **changes}


def one_line(error: pytest.ExceptionInfo) -> str:
    """The refusal's message, which is one line. A rule that runs while
    vLLM's ``ModelConfig`` validates (the HF config classes, the model
    verifiers) reaches the user inside pydantic's ValidationError, whose
    text puts it on a line of its own: that line, without pydantic's
    ``Value error, `` prefix and ``[type=...]`` suffix."""
    message = str(error.value)
    lines = message.splitlines()
    if len(lines) == 1:
        return message
    (ours,) = [line for line in lines if line.strip().startswith("Value error, ")]
    return ours.strip().removeprefix("Value error, ").split(" [type=")[0]


def multimodal_checkpoint(path: Path, config: dict[str, Any]) -> Path:
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    return path


def as_gpu(monkeypatch: pytest.MonkeyPatch, sm10x: bool, total_bytes: int) -> None:
    """A CPU cannot be an SM90 or SM10x GPU: stub the platform queries the
    rules ask (CUDA, its capability family, its total memory), nothing else."""
    from vllm.platforms import current_platform

    monkeypatch.setattr(current_platform, "is_cuda", lambda: True)
    monkeypatch.setattr(
        current_platform, "is_device_capability_family", lambda family: sm10x
    )
    monkeypatch.setattr(
        current_platform, "get_device_capability", lambda: 100 if sm10x else 90
    )
    monkeypatch.setattr(
        current_platform, "get_device_total_memory", lambda device_id=0: total_bytes
    )


# -- 1. dsa_config values against the kernels in use ----------------------------


@pytest.mark.parametrize("head_dim", [96, 160, 256, 4096])
def test_index_head_dim_deepgemm_cannot_run_refused(
    tiny_checkpoint, engine_config, head_dim
):
    """DeepGEMM's fp8 MQA-logits kernels (SM90 and SM100) take indexer head
    dims 32, 64 and 128 only; a multiple of 32 is not enough."""
    with pytest.raises(ValueError) as err:
        engine_config(tiny_checkpoint(dsa_config=dsa(index_head_dim=head_dim)))
    assert (
        f"dsa_config.index_head_dim must be one of [32, 64, 128] (the head "
        f"dims DeepGEMM's fp8 MQA-logits kernels take), got {head_dim}"
    ) in one_line(err)


@pytest.mark.parametrize(
    ("head_dim", "accepted"),
    [(32, "[64, 128]"), (64, "128")],
    ids=["deepgemm-fp4", "fused-insert"],
)
def test_mxfp4_index_head_dim_refused(
    tiny_checkpoint, engine_config, head_dim, accepted
):
    """MXFP4 keys: DeepGEMM's FP4 MQA logits take 64 or 128, and only the
    fused key insert (built for 128) writes them."""
    path = tiny_checkpoint(dsa_config=dsa(index_head_dim=head_dim))
    engine_config(path)  # fp8 keys take both
    with pytest.raises(ValueError) as err:
        engine_config(path, attention_config={"indexer_kv_dtype": "mxfp4"})
    message = one_line(err)
    assert f"index_head_dim {head_dim}" in message
    assert "indexer_kv_dtype='mxfp4' needs" in message
    assert accepted in message


def test_mxfp4_with_the_wrapper_forward_refused(
    tiny_checkpoint, engine_config, monkeypatch
):
    """The wrapper forward writes keys with vLLM's insert, fp8 only."""
    monkeypatch.setenv("VLLM_KIMI_K3_DSA_FORCE_WRAPPER", "1")
    with pytest.raises(ValueError) as err:
        engine_config(tiny_checkpoint(), attention_config={"indexer_kv_dtype": "mxfp4"})
    assert (
        "indexer_kv_dtype='mxfp4' cannot be served with "
        "VLLM_KIMI_K3_DSA_FORCE_WRAPPER=1"
    ) in one_line(err)


def test_sm10x_fp8_keys_need_head_dim_128(tiny_checkpoint, engine_config, monkeypatch):
    """On SM10x DeepGEMM reads MX-scaled fp8 keys, which vLLM's key insert
    writes at head dim 128 only (and so does ours)."""
    config = engine_config(tiny_checkpoint(dsa_config=dsa(index_head_dim=64)))
    as_gpu(monkeypatch, sm10x=False, total_bytes=141 * GIB)
    verify_dsa_vllm_config(config)  # SM90 reads fp32-scaled keys at 64
    as_gpu(monkeypatch, sm10x=True, total_bytes=141 * GIB)
    with pytest.raises(ValueError) as err:
        verify_dsa_vllm_config(config)
    assert (
        "dsa_config.index_head_dim 64 cannot serve fp8 indexer keys on SM10x: "
        "accepted: 128"
    ) in one_line(err)


def test_index_topk_above_max_model_len_refused(tiny_checkpoint, engine_config):
    path = tiny_checkpoint(dsa_config=dsa(index_topk=2048))
    with pytest.raises(ValueError) as err:
        engine_config(path, max_model_len=1024)
    assert (
        "dsa_config.index_topk (2048) must not exceed max_model_len (1024)"
    ) in one_line(err)
    assert "--max-model-len of at least 2048" in one_line(err)
    engine_config(path, max_model_len=2048)


def test_topk_buffer_over_the_gpu_memory_budget_refused(
    tiny_checkpoint, engine_config, monkeypatch
):
    """max_num_batched_tokens x index_topk x 4 B, the model-level top-k buffer,
    against the memory vLLM may use on the GPU, before anything is
    allocated."""
    path = tiny_checkpoint(dsa_config=dsa(index_topk=4096))
    common = dict(max_model_len=4096, gpu_memory_utilization=0.9)
    big = engine_config(path, max_num_batched_tokens=2**20, **common)
    small = engine_config(path, max_num_batched_tokens=8192, **common)
    as_gpu(monkeypatch, sm10x=False, total_bytes=141 * GIB)
    verify_dsa_vllm_config(small)  # 128 MiB
    # A process without the GPU (Ray's driver) cannot tell: nothing to check.
    from vllm.platforms import current_platform

    def no_gpu_here(device_id: int = 0) -> int:
        raise RuntimeError("no GPU visible")

    monkeypatch.setattr(current_platform, "get_device_total_memory", no_gpu_here)
    verify_dsa_vllm_config(big)
    as_gpu(monkeypatch, sm10x=False, total_bytes=141 * GIB)
    with pytest.raises(ValueError) as err:
        verify_dsa_vllm_config(big)
    message = one_line(err)
    assert (
        "the model-level top-k buffer (max_num_batched_tokens 1048576 x "
        "dsa_config.index_topk 4096 x 4 B = 16.00 GiB) would take more than "
        "1/10 of the GPU memory vLLM may use (gpu_memory_utilization 0.9 x "
        "141.00 GiB = 126.90 GiB)"
    ) in message
    assert "--max-num-batched-tokens of at most 831" in message


@pytest.mark.parametrize("heads", [256])
def test_sparse_mla_heads_per_rank_refused(tiny_checkpoint, engine_config, heads):
    """FlashMLA sparse's fp8 decode kernel runs 64 or 128 query heads per
    rank (vLLM pads up to them)."""
    path = tiny_checkpoint(num_attention_heads=heads, num_key_value_heads=heads)
    with pytest.raises(ValueError) as err:
        engine_config(path)
    assert (
        f"num_attention_heads {heads} at tensor_parallel_size 1 gives {heads} "
        "attention heads per rank; FlashMLA sparse takes at most 128"
    ) in one_line(err)


# -- 2. DSA keys where Kimi K3.1 does not read them ---------------------------


@pytest.mark.parametrize(
    ("keys", "named"),
    [
        pytest.param(
            {"index_topk": 2048, "index_head_dim": 128, "index_n_heads": 64},
            "index_head_dim=128, index_n_heads=64, index_topk=2048",
            id="deepseek-v32-flat",
        ),
        pytest.param(
            {"indexer_n_heads": 32, "indexer_head_dim": 128},
            "indexer_head_dim=128, indexer_n_heads=32",
            id="newer-indexer",
        ),
        pytest.param(
            {"linear_attn_config": {**tiny_text_config()["linear_attn_config"],
                                    "dsa_config": TINY_DSA_CONFIG}},
            "linear_attn_config.dsa_config=",
            id="under-linear-attn-config",
        ),
    ],
)  # fmt: skip
def test_dsa_keys_outside_dsa_config_refused(
    tiny_checkpoint, engine_config, keys, named
):
    """Without dsa_config these would be served as dense Kimi K3."""
    with pytest.raises(ValueError) as err:
        engine_config(tiny_checkpoint(dsa=False, **keys))
    message = one_line(err)
    assert named in message
    assert "outside dsa_config" in message
    assert "would be served as dense Kimi K3" in message


def test_multimodal_dsa_block_under_vision_config_refused(tmp_path, engine_config):
    config = tiny_multimodal_config(dsa=False)
    config["vision_config"] = {**TINY_VISION_CONFIG, "dsa_config": TINY_DSA_CONFIG}
    with pytest.raises(ValueError) as err:
        engine_config(multimodal_checkpoint(tmp_path / "mm", config))
    assert "vision_config.dsa_config=" in one_line(err)


def test_dsa_keys_beside_dsa_config_warned_by_name(
    tiny_checkpoint, engine_config, record_logs
):
    """With dsa_config present the model is served as DSA from it (as the
    spec reads it); keys elsewhere are named in one warning, not silently
    ignored. The top-level index_topk the config class derives is not one."""
    logs = record_logs(dsa_config_module)
    config = engine_config(
        tiny_checkpoint(index_n_heads=64, index_topk=TINY_DSA_CONFIG["index_topk"])
    )
    assert config.model_config.hf_text_config.dsa_config.index_num_heads == 32
    warnings = [m for m in logs.messages("warning_once") if "outside dsa_config" in m]
    assert len(warnings) == 1
    assert "index_n_heads=64" in warnings[0]
    assert "index_topk" not in warnings[0]
    assert "ignored" in warnings[0]


def test_plain_kimi_k3_without_dsa_keys_still_accepted(tiny_checkpoint, engine_config):
    for nulls in ({}, {"index_topk": None, "indexer_n_heads": None}):
        config = engine_config(tiny_checkpoint(dsa=False, **nulls))
        assert config.model_config.hf_text_config.dsa_config is None


# -- 5. environment switches and the speculative config -----------------------


@pytest.mark.parametrize(
    "name",
    [
        "VLLM_KIMI_K3_DSA_FORCE_WRAPPER",
        "VLLM_KIMI_K3_DSA_EXPERIMENTAL_DCP",
        "VLLM_KIMI_K3_DSA_MLA_KERNEL_PAGES",
    ],
)
@pytest.mark.parametrize("value", ["yes", "2", "", "on"])
def test_bad_env_switch_refused_at_config_time(
    tiny_checkpoint, engine_config, monkeypatch, name, value
):
    """Every switch is parsed when the config is verified, not first when a
    layer, the cache or the compile cache happens to read it."""
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError) as err:
        engine_config(tiny_checkpoint())
    assert (
        f"{name}={value!r} is not understood: accepted values are "
        "['0', '1', 'false', 'true']"
    ) in one_line(err)


@pytest.mark.parametrize("value", ["0", "1", "TRUE", "false"])
def test_good_env_switch_values_accepted(
    tiny_checkpoint, engine_config, monkeypatch, value
):
    monkeypatch.setenv("VLLM_KIMI_K3_DSA_FORCE_WRAPPER", value)
    engine_config(tiny_checkpoint())


_ABSENT = object()


@pytest.mark.parametrize("dsa", [True, False], ids=["k3.1", "plain-k3"])
@pytest.mark.parametrize(
    ("layers", "shown"),
    [(0, 0), (_ABSENT, 0), (None, None)],
    ids=["zero", "absent", "null"],
)
@pytest.mark.parametrize("method", ["mtp", "kimi_k3_mtp"])
def test_mtp_draft_without_mtp_layers_refused(
    tmp_path, engine_config, layers, shown, method, dsa
):
    """vLLM 0.33.0 divides num_speculative_tokens by the draft's
    num_nextn_predict_layers (ZeroDivisionError at 0, also the default when
    the key is absent) and, at null, builds an MTP draft with no layer:
    refused before either, for Kimi K3.1 and plain Kimi K3 alike."""
    text = tiny_text_config(dsa=dsa)
    if layers is _ABSENT:
        del text["num_nextn_predict_layers"]
    else:
        text["num_nextn_predict_layers"] = layers
    config = {**tiny_multimodal_config(dsa=dsa), "text_config": text}
    path = multimodal_checkpoint(tmp_path / "mm", config)
    with pytest.raises(ValueError) as err:
        engine_config(
            path,
            speculative_config={"method": method, "num_speculative_tokens": 1},
        )
    assert (
        f"text_config.num_nextn_predict_layers is {shown!r}: an MTP draft needs "
        "a positive integer (the checkpoint's MTP layers)"
    ) in one_line(err)
    engine_config(path)  # without a draft it serves


def test_mtp_draft_with_mtp_layers_accepted(tmp_path, engine_config):
    path = multimodal_checkpoint(tmp_path / "mm", tiny_multimodal_config())
    config = engine_config(
        path, speculative_config={"method": "mtp", "num_speculative_tokens": 1}
    )
    assert config.speculative_config.num_speculative_tokens == 1


@pytest.mark.parametrize("dsa", [True, False], ids=["k3.1", "plain-k3"])
@pytest.mark.parametrize("method", ["mtp", "kimi_k3_mtp"])
def test_mtp_draft_of_a_text_only_checkpoint_refused(
    tiny_checkpoint, engine_config, method, dsa
):
    """The text-only architecture has no MTP draft in vLLM 0.33.0, which
    would stop on "Unsupported speculative method": refused by name."""
    path = tiny_checkpoint(dsa=dsa)
    with pytest.raises(ValueError) as err:
        engine_config(
            path, speculative_config={"method": method, "num_speculative_tokens": 1}
        )
    message = one_line(err)
    assert "the draft resolves to ['KimiLinearForCausalLM']" in message
    assert "needs the multimodal KimiK3ForConditionalGeneration checkpoint" in message
    engine_config(path)  # without a draft it serves


@pytest.mark.parametrize(
    ("knob", "owner"),
    [
        ("indexer_sparse_logits", "DeepSeek V4.1's two-level indexer"),
        ("minimax_m3_indexer_cp", "MiniMax M3's context-parallel indexer"),
    ],
)
def test_attention_knobs_of_other_models_refused(
    tiny_checkpoint, engine_config, knob, owner
):
    path = tiny_checkpoint()
    with pytest.raises(ValueError) as err:
        engine_config(path, attention_config={knob: True})
    assert one_line(err) == (
        f"attention_config.{knob} is set, but it is {owner} and does not apply "
        "to Kimi K3.1; the sparse-attention knobs Kimi K3.1 reads: "
        "indexer_kv_dtype, indexer_tp_shard_min_rows, sparse_mla_force_mqa, "
        "sparse_mla_prefill_workspace_factor"
    )
    # Kimi K3.1's own knobs, and the foreign ones left at their defaults, pass.
    engine_config(
        path,
        attention_config={
            "indexer_tp_shard_min_rows": 1024,
            "sparse_mla_force_mqa": True,
            knob: False,
        },
    )
