# SPDX-License-Identifier: Apache-2.0
"""Seam: the runner splits the packed DSA row into 64-token kernel pages for
the Kimi K3.1 indexer cache, and for its MLA cache where FlashMLA sparse reads
64-token pages.

Upstream target: ``vllm/v1/worker/utils.py``,
``AttentionGroup.map_kv_cache_to_kernel_blocks``.

Why: in a block-outermost (packed) layout a block row of Kimi K3.1 is hundreds
of tokens long (see ``packed_dsa_block_size``), and DeepGEMM reads the indexer
cache in 64-token pages. 0.33.0 raises ValueError when a token cache
(``tokens_per_state == 1``) must be split, because token caches are written
through manager-block slot mappings, which do not address kernel pages. The
Kimi K3.1 caches are not: ``KimiK3IndexerMetadataBuilder`` derives the
indexer's slots from the kernel block table (``get_compressed_slot_mapping``
with ``compress_ratio=1``), as the compressed caches are written, and the
``mla_page_slots`` seam remaps the MLA cache's slots to its kernel pages
(``KimiK3FlashMLASparseBackend``: SM10x, or SM90 with
``VLLM_KIMI_K3_DSA_MLA_KERNEL_PAGES=1``), so the split is correct for them.
Every other backend keeps the ValueError.

In-tree edit: in the ``if`` that raises, accept ``tokens_per_state == 1`` when
the group's backend is ``KimiK3IndexerBackend`` or
``KimiK3FlashMLASparseBackend``.
"""

from __future__ import annotations

from typing import Any

from vllm.models.kimi_k3.common.dsa_cache import is_kimi_k3_dsa_backend
from vllm.models.kimi_k3.common.dsa_pages import split_packed_rows_into_kernel_pages

_MARK = "_kimi_k3_dsa_split"


def _map_kv_cache_to_kernel_blocks(original: Any, group: Any, kv_cache: Any) -> Any:
    spec = group.kv_cache_spec
    if not (is_kimi_k3_dsa_backend(group.backend) and spec.tokens_per_state == 1):
        return original(group, kv_cache)
    assert group.kernel_block_size is not None
    kernel_rows = spec.get_num_kernel_states(group.kernel_block_size)
    if kv_cache.shape[-2] == kernel_rows:
        return kv_cache
    view, stride = split_packed_rows_into_kernel_pages(kv_cache, kernel_rows)
    group.kernel_block_stride = stride
    return view


def apply() -> None:
    from vllm.v1.worker.utils import AttentionGroup

    current = AttentionGroup.map_kv_cache_to_kernel_blocks
    if getattr(current, _MARK, False):
        return

    def map_kv_cache_to_kernel_blocks(self, kv_cache):
        return _map_kv_cache_to_kernel_blocks(current, self, kv_cache)

    map_kv_cache_to_kernel_blocks.__doc__ = current.__doc__
    setattr(map_kv_cache_to_kernel_blocks, _MARK, True)
    AttentionGroup.map_kv_cache_to_kernel_blocks = map_kv_cache_to_kernel_blocks
