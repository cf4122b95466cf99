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

from vllm.models.kimi_k3.common.dsa_tiny_checkpoint import (
    TINY_DSA_CONFIG,
)
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
