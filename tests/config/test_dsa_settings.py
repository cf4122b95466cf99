# SPDX-License-Identifier: Apache-2.0
"""The resolved settings of a Kimi K3.1 engine configuration: what vLLM's real
configuration path accepted, read once (``dsa_settings``)."""

import pytest

from vllm.models.kimi_k3.common.dsa_envs import FORCE_WRAPPER_ENV
from vllm.models.kimi_k3.common.dsa_settings import (
    padded_index_heads,
    resolve_dsa_settings,
)
from vllm.models.kimi_k3.common.dsa_tiny_checkpoint import (
    TINY_DSA_CONFIG,
    write_tiny_config,
)


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    return write_tiny_config(tmp_path_factory.mktemp("settings") / "ckpt", dsa=True)


def test_settings_of_the_default_deployment(
    engine_config, tiny_checkpoint, monkeypatch
):
    monkeypatch.delenv(FORCE_WRAPPER_ENV, raising=False)
    cfg = engine_config(tiny_checkpoint, max_num_batched_tokens=2048)
    settings = resolve_dsa_settings(cfg)
    assert settings.indexer_fp4 is False
    assert settings.index_topk == TINY_DSA_CONFIG["index_topk"]
    assert settings.topk_buffer_rows == 2048
    assert settings.padded_index_heads == 32
    assert settings.fused_paths_allowed is True
    assert settings.mla_kernel_pages is False  # SM90 semantics on a CPU machine


def test_force_wrapper_turns_the_fused_paths_off(
    engine_config, tiny_checkpoint, monkeypatch
):
    cfg = engine_config(tiny_checkpoint)
    monkeypatch.setenv(FORCE_WRAPPER_ENV, "1")
    assert resolve_dsa_settings(cfg).fused_paths_allowed is False


@pytest.mark.parametrize(("heads", "padded"), [(1, 32), (32, 32), (33, 64), (64, 64)])
def test_padded_index_heads(heads, padded):
    assert padded_index_heads(heads) == padded


def test_padded_index_heads_refuses_more_than_64():
    with pytest.raises(ValueError, match="at most 64 index heads, got 65"):
        padded_index_heads(65)
