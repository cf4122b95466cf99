# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Kimi K3's KDA layers are not a reason to refuse decode context parallelism.

vLLM 0.33.0 sets ``MambaBase.supports_dcp = False``, but nothing in 0.33.0
reads a layer's ``supports_dcp``: DCP support is checked per attention
backend (``AttentionBackend.supports_dcp`` in ``validate_configuration``),
and Mamba-like backends are selected without that check. A KDA layer keeps
one recurrent state per request, not per token: its KV cache spec is a
``MambaSpec``, which is not DCP-sharded (``KVCacheSpec.dcp_sharded`` is False),
so every DCP rank holds its TP shard of the whole state, exactly as without
DCP, and the hybrid KV cache coordinator accepts Mamba groups beside
full-attention groups under DCP. These tests pin that on the real 0.33.0
classes and configuration path; the DCP refusal of Kimi K3.1 DSA names its
own reason (wrong tokens on two H200s), not KDA.
"""

from __future__ import annotations

import pytest
import torch

DCP = 2
# DCP reuses the TP ranks; vLLM refuses a DCP size that TP does not divide.
TP = 2
MAX_MODEL_LEN = 2048


def test_plain_kimi_k3_accepts_dcp2_through_vllms_config_path(
    tiny_checkpoint, engine_config
):
    """Plain Kimi K3 (KDA + dense MLA, no ``dsa_config``): vLLM's own
    configuration path, our plugin and verifier included, accepts DCP2 over
    TP2, so the plugin adds no DCP rule for KDA."""
    config = engine_config(
        tiny_checkpoint(dsa=False),
        tensor_parallel_size=TP,
        decode_context_parallel_size=DCP,
        max_model_len=MAX_MODEL_LEN,
    )
    assert config.model_config.is_hybrid
    assert config.parallel_config.decode_context_parallel_size == DCP
    assert getattr(config.model_config.hf_text_config, "dsa_config", None) is None


def test_dsa_dcp_refusal_names_its_own_reason(
    tiny_checkpoint, engine_config, monkeypatch
):
    """The same flags on Kimi K3.1 DSA are refused for the wrong tokens seen
    on two GPUs, and the message does not blame the KDA layers."""
    from kimi_k3_dsa_tools.tiny_checkpoint import TINY_DSA_CONFIG
    from vllm.models.kimi_k3.common.dsa_envs import EXPERIMENTAL_DCP_ENV

    monkeypatch.delenv(EXPERIMENTAL_DCP_ENV, raising=False)
    ckpt = tiny_checkpoint(dsa_config={**TINY_DSA_CONFIG, "index_topk": 512})
    with pytest.raises(ValueError) as refused:
        engine_config(
            ckpt,
            tensor_parallel_size=TP,
            decode_context_parallel_size=DCP,
            max_model_len=MAX_MODEL_LEN,
        )
    message = str(refused.value)
    assert f"--decode-context-parallel-size {DCP} is not supported" in message
    assert "wrong tokens" in message
    assert "KDA" not in message and "supports_dcp" not in message


def test_mamba_layers_flag_is_not_what_vllm_checks():
    """``MambaBase.supports_dcp`` is False in 0.33.0, while the DCP check
    vLLM runs is the attention backend's, which the KDA backend never goes
    through (``get_mamba_attn_backend`` takes only the Mamba type)."""
    import inspect

    from vllm.model_executor.layers.mamba.abstract import MambaBase
    from vllm.models.kimi_k3.nvidia.kda import KimiK3DeltaAttention
    from vllm.v1.attention.selector import get_mamba_attn_backend

    assert MambaBase.supports_dcp is False
    assert issubclass(KimiK3DeltaAttention, MambaBase)
    assert list(inspect.signature(get_mamba_attn_backend).parameters) == ["mamba_type"]


def test_kda_state_is_replicated_across_dcp_ranks():
    """A ``MambaSpec`` is not DCP-sharded: its block is not scaled by the DCP
    size and its slots are not interleaved across ranks, while the MLA
    cache's block is (``resolve_dcp_kv_block_size``)."""
    from vllm.v1.core.kv_cache_utils import resolve_dcp_kv_block_size
    from vllm.v1.kv_cache_interface import MambaSpec, MLAAttentionSpec

    kda = MambaSpec(
        block_size=MAX_MODEL_LEN,
        shapes=((4, 96), (2, 128, 128)),
        dtypes=(torch.bfloat16, torch.float32),
    )
    mla = MLAAttentionSpec(
        block_size=64, num_kv_heads=1, head_size=576, dtype=torch.bfloat16
    )
    assert kda.dcp_sharded is False
    assert mla.dcp_sharded is True
    assert resolve_dcp_kv_block_size(kda, DCP) == MAX_MODEL_LEN
    assert resolve_dcp_kv_block_size(mla, DCP) == 64 * DCP
