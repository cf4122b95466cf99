# SPDX-License-Identifier: Apache-2.0
"""Seam: the block size of a KDA-hybrid DSA model is the packed DSA row size.

Upstream target: ``vllm/platforms/interface.py``,
``Platform._align_hybrid_block_size`` (called by
``update_block_size_for_backend`` in the worker after the model is built, on
CUDA and CPU alike).

Why: 0.33.0 sizes a hybrid block so that ONE attention page holds one mamba
state, from one MLA page of 576 B/token (its spec lacks
``state_content_bytes``, so ``fp8_ds_mla``'s real 656 B are undercounted), and
it ignores the indexer page and a dense MLA draft's pages; then it pads every
KDA state to that page. Kimi K3.1's block row holds all 24 DSA layers' MLA and
indexer pages (plus a draft's) and, in the state groups, several KDA states at
their own size. :func:`~vllm.models.kimi_k3.common.dsa_block_size.packed_dsa_block_size`
sizes that row, TP-divisibly.

It also refuses, before the KV cache is allocated, a backend that would have
to split the packed row of a token cache written through manager slots
(FlashMLA sparse on SM10x reads ``fp8_ds_mla`` in 64-token pages only):
0.33.0 would fail later, when the cache is bound, with advice that cannot
apply to Kimi K3.1.

In-tree edit: at the top of ``_align_hybrid_block_size``, ``if
apply_packed_dsa_block_size(vllm_config, kernel_alignments, checkpoint) is not
None: check_token_cache_splits(...); return`` (every other model keeps
0.33.0's rule).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm.models.kimi_k3.common.dsa_block_size import (
    apply_packed_dsa_block_size,
    backend_kernel_block_alignments,
    check_token_cache_splits,
    is_kda_hybrid_dsa,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig

_MARK = "_kimi_k3_dsa_packed"


def _packed_align_hybrid_block_size(
    original: Any, cls: Any, vllm_config: VllmConfig, backend_cls: Any
) -> None:
    if not is_kda_hybrid_dsa(vllm_config):
        return original(cls, vllm_config, backend_cls)
    from vllm.config.vllm import set_current_vllm_config
    from vllm.model_executor.layers.mamba.abstract import (
        get_mamba_prefill_checkpoint_alignment,
    )

    with set_current_vllm_config(vllm_config):
        backends = cls._find_non_ssm_backends(vllm_config) or [backend_cls]
        alignments = backend_kernel_block_alignments(backends)
        checkpoint = (
            get_mamba_prefill_checkpoint_alignment(vllm_config)
            if vllm_config.cache_config.mamba_cache_mode == "align"
            else None
        )
        block_size = apply_packed_dsa_block_size(vllm_config, alignments, checkpoint)
        check_token_cache_splits(vllm_config, backends, block_size)
    return None


def apply() -> None:
    from vllm.platforms.interface import Platform

    current = Platform.__dict__["_align_hybrid_block_size"]
    if getattr(current, _MARK, False):
        return
    original = current.__func__

    def _align_hybrid_block_size(cls, vllm_config, backend_cls):
        return _packed_align_hybrid_block_size(original, cls, vllm_config, backend_cls)

    _align_hybrid_block_size.__doc__ = original.__doc__
    wrapped = classmethod(_align_hybrid_block_size)
    setattr(wrapped, _MARK, True)
    Platform._align_hybrid_block_size = wrapped
