# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""What a Kimi K3.1 DSA deployment runs with, resolved once from the
configuration the verifier accepted."""

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

    dsa: DSAConfig
    indexer_fp4: bool
    topk_buffer_rows: int

    @property
    def index_topk(self) -> int:
        """The top-k buffer's width, read from ``dsa_config``."""
        return self.dsa.index_topk


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
        dsa=dsa,
        indexer_fp4=dsa_cache.kimi_k3_indexer_uses_fp4(vllm_config),
        topk_buffer_rows=topk_indices_buffer_rows(vllm_config),
    )
