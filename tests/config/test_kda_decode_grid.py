# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A ``max_num_seqs`` that vLLM 0.33.0's Triton KDA decode cannot launch is
refused at config verification, for Kimi K3 and Kimi K3.1 alike.

``fused_recurrent_kda_packed_decode`` launches decode requests x KDA heads per
rank on CUDA's grid y (at most 65535); the KDA layer uses it when vLLM's
``resolve_kda_decode_backend`` does not pick a fused decode. The configs are
built by vLLM's real configuration path on tiny checkpoints (a CPU platform);
the verifier registered for the architecture is then called on them as on an
H200. Stubbed, because a CPU cannot be that GPU: the CUDA platform and its
capability (SM90), and the presence of vLLM's native op
``torch.ops._C.fused_kda_decode`` (a CPU build of vLLM has none). Nothing
else: the backend is resolved by vLLM's own function.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from kimi_k3_dsa_tools.tiny_checkpoint import (
    real_attention_overrides,
    tiny_multimodal_config,
)
from vllm.models.kimi_k3.nvidia.kda_decode_grid import (
    CUDA_MAX_GRID_Y,
    check_kda_decode_grid,
    triton_kda_decode_max_num_seqs,
)

# 80 KDA heads (the real-attention test checkpoint): not a head count of the
# native fused decode, so a CUDA GPU decodes them with the Triton kernel.
TRITON_HEADS = 80
TRITON_BOUND = CUDA_MAX_GRID_Y // TRITON_HEADS  # 819
# Kimi K3's 96 KDA heads: the native fused decode at TP 1 on SM90.
NATIVE_HEADS = 96


def kda_overrides(num_heads: int, dsa: bool = True) -> dict[str, Any]:
    overrides = real_attention_overrides(dsa=dsa)
    overrides["linear_attn_config"]["num_heads"] = num_heads
    return overrides


def build(
    tiny_checkpoint, engine_config, num_heads: int, max_num_seqs: int, **kwargs: Any
) -> Any:
    dsa = kwargs.pop("dsa", True)
    path = tiny_checkpoint(dsa=dsa, **kda_overrides(num_heads, dsa=dsa))
    return engine_config(
        path,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=8192,
        max_model_len=4096,
        **kwargs,
    )


def verify(config: Any) -> None:
    """What ``VllmConfig`` runs at verification: the verifier registered for
    the model's architecture (the plugin's, or in-tree vLLM's own)."""
    from vllm.model_executor.models.config import MODELS_CONFIG_MAP

    MODELS_CONFIG_MAP[config.model_config.architecture].verify_and_update_config(config)


def as_h200(monkeypatch: pytest.MonkeyPatch, native_op: bool = True) -> None:
    """Stub a CUDA SM90 platform and, with ``native_op``, vLLM's native
    fused KDA decode op (what a CUDA build of vLLM registers)."""
    from vllm.platforms import current_platform
    from vllm.platforms.interface import DeviceCapability

    monkeypatch.setattr(current_platform, "is_cuda", lambda: True)
    capability = DeviceCapability(9, 0)
    monkeypatch.setattr(
        current_platform, "get_device_capability", lambda device_id=0: capability
    )
    monkeypatch.setattr(
        current_platform,
        "is_device_capability",
        lambda wanted, device_id=0: wanted in (capability, capability.to_int()),
    )
    monkeypatch.setattr(
        current_platform,
        "is_device_capability_family",
        lambda family, device_id=0: capability.to_int() // 10 == family // 10,
    )
    if native_op:
        monkeypatch.setattr(
            torch.ops._C, "fused_kda_decode", lambda *a, **k: None, raising=False
        )
    else:
        monkeypatch.delattr(torch.ops._C, "fused_kda_decode", raising=False)


def refusal(config: Any) -> str:
    with pytest.raises(ValueError) as err:
        verify(config)
    return str(err.value)


def test_bound_is_the_grid_limit_over_heads_per_rank() -> None:
    assert CUDA_MAX_GRID_Y == 65535
    assert triton_kda_decode_max_num_seqs(80) == 819
    assert triton_kda_decode_max_num_seqs(40) == 1638
    assert triton_kda_decode_max_num_seqs(12) == 5461
    for heads in (1, 7, 80, 96):
        bound = triton_kda_decode_max_num_seqs(heads)
        assert bound * heads <= CUDA_MAX_GRID_Y < (bound + 1) * heads


def test_triton_path_refused_just_above_the_bound(
    tiny_checkpoint, engine_config, monkeypatch
):
    config = build(tiny_checkpoint, engine_config, TRITON_HEADS, TRITON_BOUND + 1)
    as_h200(monkeypatch)
    message = refusal(config)
    assert (
        f"max_num_seqs {TRITON_BOUND + 1} is too large for this model at "
        f"tensor_parallel_size 1: accepted: at most {TRITON_BOUND}"
    ) in message
    assert f"{TRITON_HEADS} KDA heads per rank" in message
    assert "vLLM's Triton KDA decode" in message
    assert "fused_recurrent_kda_packed_decode" in message
    assert f"{TRITON_BOUND + 1} x 80 = {(TRITON_BOUND + 1) * 80}" in message
    assert "at most 65535" in message
    assert f"--max-num-seqs {TRITON_BOUND} or less" in message


def test_triton_path_accepted_at_the_bound(tiny_checkpoint, engine_config, monkeypatch):
    config = build(tiny_checkpoint, engine_config, TRITON_HEADS, TRITON_BOUND)
    as_h200(monkeypatch)
    verify(config)


def test_heads_per_rank_follow_tensor_parallelism(
    tiny_checkpoint, engine_config, monkeypatch
):
    """At TP 2 a rank holds 40 of the 80 heads: twice the requests fit."""
    bound = CUDA_MAX_GRID_Y // (TRITON_HEADS // 2)
    accepted = build(
        tiny_checkpoint, engine_config, TRITON_HEADS, bound, tensor_parallel_size=2
    )
    refused = build(
        tiny_checkpoint, engine_config, TRITON_HEADS, bound + 1, tensor_parallel_size=2
    )
    as_h200(monkeypatch)
    verify(accepted)
    message = refusal(refused)
    assert f"tensor_parallel_size 2: accepted: at most {bound}" in message
    assert "40 KDA heads per rank" in message


@pytest.mark.parametrize("dsa", [True, False], ids=["kimi_k3_1", "kimi_k3"])
def test_refused_for_kimi_k3_and_k3_1_text_models(
    tiny_checkpoint, engine_config, monkeypatch, dsa
):
    config = build(
        tiny_checkpoint, engine_config, TRITON_HEADS, TRITON_BOUND + 1, dsa=dsa
    )
    assert config.model_config.architecture == "KimiLinearForCausalLM"
    as_h200(monkeypatch)
    assert f"accepted: at most {TRITON_BOUND}" in refusal(config)


def test_refused_for_the_multimodal_model(tmp_path, engine_config, monkeypatch):
    import json

    path = tmp_path / "multimodal"
    path.mkdir()
    config_dict = tiny_multimodal_config(dsa=False, **kda_overrides(80, dsa=False))
    (path / "config.json").write_text(json.dumps(config_dict))
    config = engine_config(
        path,
        max_num_seqs=TRITON_BOUND + 1,
        max_num_batched_tokens=8192,
        max_model_len=4096,
    )
    assert config.model_config.architecture == "KimiK3ForConditionalGeneration"
    as_h200(monkeypatch)
    assert f"accepted: at most {TRITON_BOUND}" in refusal(config)


def test_native_path_accepted_above_the_triton_bound(
    tiny_checkpoint, engine_config, monkeypatch
):
    """96 heads on SM90 with vLLM's op: the native fused decode, no grid
    limit. Without the op the same config falls back to Triton: refused."""
    config = build(tiny_checkpoint, engine_config, NATIVE_HEADS, 1024)
    as_h200(monkeypatch, native_op=True)
    verify(config)
    as_h200(monkeypatch, native_op=False)
    message = refusal(config)
    assert "max_num_seqs 1024" in message
    assert f"accepted: at most {CUDA_MAX_GRID_Y // NATIVE_HEADS}" in message
    assert f"{NATIVE_HEADS} KDA heads per rank" in message


def test_forced_triton_backend_refused(tiny_checkpoint, engine_config, monkeypatch):
    """additional_config kda_decode_backend="triton" takes the Triton path
    even where the native decode could run."""
    config = build(
        tiny_checkpoint,
        engine_config,
        NATIVE_HEADS,
        1024,
        additional_config={"kda_decode_backend": "triton"},
    )
    as_h200(monkeypatch)
    assert f"accepted: at most {CUDA_MAX_GRID_Y // NATIVE_HEADS}" in refusal(config)


def test_speculative_tokens_take_the_triton_path(
    tiny_checkpoint, engine_config, monkeypatch
):
    """The native fused decode takes no speculative tokens. vLLM's CPU
    platform refuses an MTP speculative config, so only its token count,
    what the layer reads, is stubbed onto the real config."""
    config = build(tiny_checkpoint, engine_config, NATIVE_HEADS, 1024)
    as_h200(monkeypatch)
    verify(config)
    monkeypatch.setattr(
        config,
        "speculative_config",
        SimpleNamespace(method="mtp", num_speculative_tokens=1),
    )
    assert f"accepted: at most {CUDA_MAX_GRID_Y // NATIVE_HEADS}" in refusal(config)


def test_no_op_off_cuda(tiny_checkpoint, engine_config):
    """On the CPU platform (not CUDA) nothing is checked: the real
    configuration path, verifiers included, accepts the config that an H200
    refuses above."""
    from vllm.platforms import current_platform

    assert not current_platform.is_cuda()
    config = build(tiny_checkpoint, engine_config, TRITON_HEADS, TRITON_BOUND + 1)
    verify(config)
    check_kda_decode_grid(config)


def test_native_path_resolved_from_heads_per_rank(
    tiny_checkpoint, engine_config, monkeypatch
):
    """192 KDA heads at TP 2 are 96 a rank, which the native decode takes:
    the resolution sees the heads per rank, as the layer passes them."""
    config = build(
        tiny_checkpoint, engine_config, 2 * NATIVE_HEADS, 1024, tensor_parallel_size=2
    )
    as_h200(monkeypatch, native_op=True)
    verify(config)
    as_h200(monkeypatch, native_op=False)
    message = refusal(config)
    assert f"{NATIVE_HEADS} KDA heads per rank" in message
    assert f"accepted: at most {CUDA_MAX_GRID_Y // NATIVE_HEADS}" in message
