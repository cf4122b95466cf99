# SPDX-License-Identifier: Apache-2.0
"""Seam: refuse at startup a Kimi K3.1 layout the packed DSA caches cannot
take.

Upstream target: ``vllm/model_executor/models/config.py``,
``HybridAttentionMambaModelConfig.verify_and_update_config`` (run by
``VllmConfig.try_verify_and_update_config`` for every hybrid model, in the
front-end, before any worker starts).

Why: with prefill context parallelism a token's indexer key and MLA latent
are written by the rank that owns it, through slots that interleave across
ranks; the block-table-derived slots of the packed DSA row do not model that.
0.33.0 would only fail when the first indexer metadata builder is made in a
worker (``KimiK3IndexerMetadataBuilder`` raises too, as a backstop); a user
should hear it before the model loads.

In-tree edit: a call to ``check_packed_dsa_layout`` in the Kimi K3 verifier,
for KDA-hybrid DSA models.
"""

from __future__ import annotations

from typing import Any

from vllm.models.kimi_k3.common.dsa_cache import (
    check_packed_dsa_layout,
    is_kda_hybrid_dsa,
)

_MARK = "_kimi_k3_dsa_layout_check"


def _verify(original: Any, cls: Any, vllm_config: Any) -> None:
    if is_kda_hybrid_dsa(vllm_config):
        check_packed_dsa_layout(vllm_config)
    return original(cls, vllm_config)


def apply() -> None:
    from vllm.model_executor.models.config import HybridAttentionMambaModelConfig

    current = HybridAttentionMambaModelConfig.__dict__["verify_and_update_config"]
    if getattr(current, _MARK, False):
        return
    original = current.__func__

    def verify_and_update_config(cls, vllm_config):
        return _verify(original, cls, vllm_config)

    verify_and_update_config.__doc__ = original.__doc__
    wrapped = classmethod(verify_and_update_config)
    setattr(wrapped, _MARK, True)
    HybridAttentionMambaModelConfig.verify_and_update_config = wrapped
