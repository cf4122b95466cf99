# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The resolved settings of a Kimi K3.1 engine configuration: what vLLM's real
configuration path accepted, read once (``dsa_settings``)."""

import pytest

from kimi_k3_dsa_tools.tiny_checkpoint import (
    TINY_DSA_CONFIG,
    write_tiny_config,
)
from vllm.models.kimi_k3.common.dsa_settings import (
    padded_index_heads,
    resolve_dsa_settings,
)


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    return write_tiny_config(tmp_path_factory.mktemp("settings") / "ckpt", dsa=True)


def test_settings_of_the_default_deployment(engine_config, tiny_checkpoint):
    cfg = engine_config(tiny_checkpoint, max_num_batched_tokens=2048)
    settings = resolve_dsa_settings(cfg)
    assert settings.indexer_fp4 is False
    assert settings.index_topk == TINY_DSA_CONFIG["index_topk"]
    assert settings.topk_buffer_rows == 2048


@pytest.mark.parametrize(("heads", "padded"), [(1, 32), (32, 32), (33, 64), (64, 64)])
def test_padded_index_heads(heads, padded):
    assert padded_index_heads(heads) == padded


def test_padded_index_heads_refuses_more_than_64():
    with pytest.raises(ValueError, match="at most 64 index heads, got 65"):
        padded_index_heads(65)
