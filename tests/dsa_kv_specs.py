# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The KV cache specs a Kimi K3.1 worker reports per layer (the runner's
64-token kernel-page alignment included), for the tests that drive vLLM
0.33.0's planner with them."""

from __future__ import annotations

from typing import Any

import torch


def dsa_layer_specs(
    name: str, block: int, latent: int = 576, index_entry: int = 132
) -> dict[str, Any]:
    """A DSA layer's two token caches: ``fp8_ds_mla`` MLA pages (656 B a token
    for the 576-value latent) and fp8 indexer keys (``index_entry`` bytes)."""
    from vllm.v1.attention.backend import MultipleOf
    from vllm.v1.kv_cache_interface import MLAAttentionSpec, SparseCacheRole

    return {
        f"{name}.mla": MLAAttentionSpec(
            block_size=block,
            block_stride_alignment=MultipleOf(64),
            num_kv_heads=1,
            head_size=latent,
            dtype=torch.uint8,
            cache_dtype_str="fp8_ds_mla",
            state_content_bytes=656,
        ),
        f"{name}.index": MLAAttentionSpec(
            block_size=block,
            block_stride_alignment=MultipleOf(64),
            num_kv_heads=1,
            max_tp_shards=1,
            head_size=index_entry,
            dtype=torch.uint8,
            cache_role=SparseCacheRole.INDEXER,
        ),
    }


def kda_layer_spec(
    block: int, tp: int, heads: int, head_dim: int, conv: int = 4, num_spec: int = 0
) -> Any:
    """A KDA layer's state (bf16 conv state, fp32 recurrent state)."""
    from vllm.model_executor.layers.mamba.mamba_utils import MambaStateShapeCalculator
    from vllm.v1.kv_cache_interface import MambaSpec

    return MambaSpec(
        block_size=block,
        shapes=MambaStateShapeCalculator.kda_state_shape(
            tp, heads, head_dim, conv_kernel_size=conv, num_spec=num_spec
        ),
        dtypes=(torch.bfloat16, torch.float32),
    )
