# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The per-layer KV cache specs a Kimi K3.1 worker reports, for the tests that
drive vLLM 0.33.0's planner with them."""

from __future__ import annotations

import torch

# 0-indexed full-attention (DSA) layers: 1-indexed 4, 8, ..., 92, 93.
FULL_ATTN = [*range(3, 92, 4), 92]


def kimi_k3_1_specs(block: int, tp: int) -> dict:
    """The per-layer specs a TP ``tp`` worker of Kimi K3.1 reports, with the
    block_stride_alignment the runner's customize_attention_spec adds for
    64-token kernel pages."""
    from vllm.model_executor.layers.mamba.mamba_utils import (
        MambaStateShapeCalculator,
    )
    from vllm.v1.attention.backend import MultipleOf
    from vllm.v1.kv_cache_interface import (
        MambaSpec,
        MLAAttentionSpec,
        SparseCacheRole,
    )

    specs = {}
    for layer in range(93):
        if layer in FULL_ATTN:
            specs[f"l{layer}.mla"] = MLAAttentionSpec(
                block_size=block,
                block_stride_alignment=MultipleOf(64),
                num_kv_heads=1,
                head_size=576,
                dtype=torch.uint8,
                cache_dtype_str="fp8_ds_mla",
                state_content_bytes=656,
            )
            specs[f"l{layer}.index"] = MLAAttentionSpec(
                block_size=block,
                block_stride_alignment=MultipleOf(64),
                num_kv_heads=1,
                max_tp_shards=1,
                head_size=132,
                dtype=torch.uint8,
                cache_role=SparseCacheRole.INDEXER,
            )
        else:
            specs[f"l{layer}.kda"] = MambaSpec(
                block_size=block,
                shapes=MambaStateShapeCalculator.kda_state_shape(tp, 96, 128),
                dtypes=(torch.bfloat16, torch.float32),
            )
    return specs
