# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Exact byte figures of the Kimi K3.1 DSA caches, against vLLM 0.33.0's own
spec classes."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from vllm.models.kimi_k3.common.dsa_cache import (
    dense_mla_draft_bytes_per_token,
    fp8_ds_mla_bytes_per_token,
    indexer_cache_entry_bytes,
    mla_page_bytes_per_token,
)
from vllm.v1.kv_cache_interface import MLAAttentionSpec, get_kv_quant_mode


def test_indexer_entry_bytes_head_dim_128():
    # fp8: 128 e4m3 values + one 4 B scale.
    assert indexer_cache_entry_bytes(128, use_fp4_cache=False) == 132
    # MXFP4: 64 B of e2m1 pairs + one UE8M0 byte per 32 values.
    assert indexer_cache_entry_bytes(128, use_fp4_cache=True) == 68


@pytest.mark.parametrize("head_dim", [32, 64, 96, 128, 256])
def test_indexer_entry_bytes_other_head_dims(head_dim):
    assert indexer_cache_entry_bytes(head_dim, False) == head_dim + 4
    assert indexer_cache_entry_bytes(head_dim, True) == head_dim // 2 + head_dim // 32


def test_mxfp4_entry_needs_whole_scale_blocks():
    with pytest.raises(ValueError, match="multiple of 32"):
        indexer_cache_entry_bytes(48, use_fp4_cache=True)


def test_fp8_ds_mla_is_656_bytes():
    # 512 fp8 latent values, 4 fp32 scales (one per 128), 64 bf16 rope values.
    assert fp8_ds_mla_bytes_per_token(512, 64) == 512 + 4 * 4 + 64 * 2 == 656
    assert mla_page_bytes_per_token("fp8_ds_mla", 512, 64) == 656


def test_fp8_ds_mla_matches_the_layer_spec_not_the_hybrid_estimate():
    # What 0.33.0's MLAAttention.get_kv_cache_spec allocates (it passes
    # state_content_bytes=656) ...
    fp8_ds_mla = dict(
        num_kv_heads=1,
        head_size=576,
        dtype=torch.uint8,
        cache_dtype_str="fp8_ds_mla",
        kv_quant_mode=get_kv_quant_mode("fp8_ds_mla"),
    )
    layer_spec = MLAAttentionSpec(block_size=64, state_content_bytes=656, **fp8_ds_mla)
    # ... and what its _align_hybrid_block_size estimates (no
    # state_content_bytes): the 80 B/token undercount our sizing must avoid.
    estimate = MLAAttentionSpec(block_size=1, **fp8_ds_mla)
    assert layer_spec.page_size_bytes == 64 * 656
    assert estimate.page_size_bytes == 576
    assert mla_page_bytes_per_token("fp8_ds_mla", 512, 64) * 64 == (
        layer_spec.page_size_bytes
    )


def test_other_mla_dtypes():
    model_config = SimpleNamespace(dtype=torch.bfloat16)
    # bf16 latent + rope: 576 values x 2 B; fp8: 576 x 1 B.
    assert mla_page_bytes_per_token("auto", 512, 64, model_config) == 1152
    assert mla_page_bytes_per_token("fp8", 512, 64, model_config) == 576


def _spec_vllm_config(method, layers=2, kv_lora_rank=512, rope=64, kv_dtype=None):
    # Stub: a real SpeculativeConfig needs a draft checkpoint and a draft
    # architecture; dense_mla_draft_bytes_per_token reads only these fields.
    draft_text = SimpleNamespace(
        kv_lora_rank=kv_lora_rank, qk_rope_head_dim=rope, num_hidden_layers=layers
    )
    draft_model_config = SimpleNamespace(
        hf_text_config=draft_text, dtype=torch.bfloat16
    )
    spec = SimpleNamespace(
        method=method, draft_model_config=draft_model_config, kv_cache_dtype=kv_dtype
    )
    return SimpleNamespace(
        speculative_config=spec,
        cache_config=SimpleNamespace(cache_dtype="fp8_ds_mla"),
    )


@pytest.mark.parametrize("method", ["eagle3", "dspark"])
def test_dense_draft_pages_inherit_fp8_ds_mla(method):
    # Two draft layers, each a 656 B fp8_ds_mla page per token.
    assert dense_mla_draft_bytes_per_token(_spec_vllm_config(method)) == 2 * 656


def test_dense_draft_pages_own_dtype():
    cfg = _spec_vllm_config("eagle3", layers=1, kv_dtype="auto")
    assert dense_mla_draft_bytes_per_token(cfg) == 1152  # bf16 576 values
    cfg = _spec_vllm_config("dspark", layers=3, kv_dtype="fp8")
    assert dense_mla_draft_bytes_per_token(cfg) == 3 * 576


@pytest.mark.parametrize("method", ["ngram", "mtp", "kimi_k3_mtp", "draft_model"])
def test_no_dense_draft_pages(method):
    assert dense_mla_draft_bytes_per_token(_spec_vllm_config(method)) == 0


def test_no_draft_pages_without_mla_draft_or_spec():
    no_spec = SimpleNamespace(speculative_config=None)
    assert dense_mla_draft_bytes_per_token(no_spec) == 0
    cfg = _spec_vllm_config("eagle3", kv_lora_rank=None)
    assert dense_mla_draft_bytes_per_token(cfg) == 0


def test_indexer_cache_spec_page_is_the_entry_bytes(vllm_config_for):
    """The real KimiK3IndexerCache spec allocates indexer_cache_entry_bytes per
    token (head_dim is the entry in bytes, dtype uint8)."""
    from vllm.config import set_current_vllm_config
    from vllm.models.kimi_k3.common.dsa_cache import (
        KimiK3IndexerBackend,
        KimiK3IndexerCache,
        KimiK3IndexerMetadataBuilder,
    )
    from vllm.v1.kv_cache_interface import KVCacheLayout, SparseCacheRole

    cfg = vllm_config_for()
    with set_current_vllm_config(cfg):
        cache = KimiK3IndexerCache(
            head_dim=indexer_cache_entry_bytes(128, False),
            dtype=torch.uint8,
            prefix="test_bytes.layers.3.self_attn.indexer.k_cache",
            cache_config=cfg.cache_config,
        )
    try:
        spec = cache.get_kv_cache_spec(cfg).copy_with_new_block_size(64)
        assert spec.page_size_bytes == 64 * 132
        assert spec.cache_role == SparseCacheRole.INDEXER
        backend = cache.get_attn_backend()
        assert backend is KimiK3IndexerBackend
        assert backend.get_builder_cls() is KimiK3IndexerMetadataBuilder
        assert backend.supported_kv_cache_layouts()[0].is_block_outermost
        assert KVCacheLayout.LBNHC not in backend.supported_kv_cache_layouts()
    finally:
        cfg.compilation_config.static_forward_context.pop(cache.prefix, None)
