# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A head count that tensor parallelism does not divide cannot be served by
vLLM 0.33.0, so the DSA layer's head padding (``padded_num_heads`` in
``vllm/models/kimi_k3/nvidia/dsa.py``) is unreachable through the engine.

``ModelConfig.verify_with_parallel_config`` refuses ``num_attention_heads %
tensor_parallel_size != 0`` while the config is built, before any layer
exists; this pins that refusal, so that a vLLM which lifts it is noticed (the
padding path then needs a GPU test at TP2 with 3 heads).

The tiny checkpoint with 3 heads sets ``head_dim``: ``KimiLinearConfig``
derives it as ``hidden_size // num_attention_heads`` (85 here), which
transformers' RoPE validation refuses as odd before vLLM's check is reached.
MLA does not use it (its head dims are ``qk_nope/rope_head_dim`` and
``v_head_dim``), and MLA skips the KV-head checks, so the heads rule is the
only one left. The KDA heads (4) divide by 2.
"""

import pytest

HEADS_3 = {"num_attention_heads": 3, "head_dim": 128}


def test_three_heads_refused_at_tp2(tiny_checkpoint, engine_config):
    with pytest.raises(
        ValueError,
        match=r"Total number of attention heads \(3\) must be divisible by "
        r"tensor parallel size \(2\)",
    ):
        engine_config(tiny_checkpoint(**HEADS_3), tensor_parallel_size=2)


def test_three_heads_served_at_tp1(tiny_checkpoint, engine_config):
    """The checkpoint itself is valid: only the TP rule refuses it."""
    config = engine_config(tiny_checkpoint(**HEADS_3))
    assert config.model_config.model_arch_config.total_num_attention_heads == 3
    assert config.cache_config.cache_dtype == "fp8_ds_mla"
