# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""What a Kimi K3.1 DSA deployment runs with, decided once.

The config verifier (:func:`~vllm.models.kimi_k3.common.dsa_verify.
verify_dsa_vllm_config`) refuses what cannot be served; what it accepts
resolves here: the indexer key format (decided by
:func:`~.dsa_cache.kimi_k3_indexer_uses_fp4`, which the cache builder and the
block size ask too), the top-k buffer rows
(:func:`~.dsa_verify.topk_indices_buffer_rows`, which the verifier checks
against the GPU memory budget) and the head count DeepGEMM's indexer runs at
(:func:`padded_index_heads`).
:class:`DSASettings` gathers what a DSA layer reads of them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from vllm.models.kimi_k3.common import dsa_cache
from vllm.models.kimi_k3.common.dsa_config import DSAConfig
from vllm.models.kimi_k3.common.dsa_formats import DEEPGEMM_INDEX_HEADS
from vllm.models.kimi_k3.common.dsa_verify import topk_indices_buffer_rows

if TYPE_CHECKING:
    from vllm.config import VllmConfig


@dataclass(frozen=True)
class DSASettings:
    """The resolved settings of one engine configuration."""

    # MXFP4 indexer keys (68 B/token at head dim 128) instead of fp8 (132 B).
    indexer_fp4: bool
    # Tokens each query keeps, and rows of the model-level top-k buffer.
    index_topk: int
    topk_buffer_rows: int


def padded_index_heads(index_num_heads: int) -> int:
    """The head count DeepGEMM's indexer kernels run ``index_num_heads`` at."""
    for width in DEEPGEMM_INDEX_HEADS:
        if index_num_heads <= width:
            return width
    raise ValueError(
        "Official DeepGEMM DSA indexer supports at most "
        f"{max(DEEPGEMM_INDEX_HEADS)} index heads, got {index_num_heads}."
    )


def resolve_dsa_settings(vllm_config: VllmConfig) -> DSASettings:
    """The settings of a Kimi K3.1 engine configuration (a DSA model)."""
    dsa: DSAConfig = vllm_config.model_config.hf_text_config.dsa_config
    return DSASettings(
        indexer_fp4=dsa_cache.kimi_k3_indexer_uses_fp4(vllm_config),
        index_topk=dsa.index_topk,
        topk_buffer_rows=topk_indices_buffer_rows(vllm_config),
    )
