# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Seam: the runner may split the packed row of a token cache into kernel
pages when the cache's attention backend writes it at kernel-page slots.

Upstream target: ``vllm/v1/attention/backend.py``, ``AttentionBackend`` (a
new class attribute) and ``vllm/v1/worker/utils.py``,
``AttentionGroup.map_kv_cache_to_kernel_blocks``.

Why: in a block-outermost (packed) layout a block row of Kimi K3.1 is hundreds
of tokens long (see ``packed_dsa_block_size``), and DeepGEMM reads the indexer
cache in 64-token pages (FlashMLA sparse the MLA cache too, on SM10x). 0.33.0
raises ValueError when a token cache (``tokens_per_state == 1``) must be
split, because token caches are written through manager-block slot mappings,
which do not address kernel pages. That holds for most backends, not all: a
backend whose builder derives its write slots from the kernel block table (as
the compressed caches are written), or whose group the runner hands
kernel-page slots (the ``mla_page_slots`` seam), writes a split cache
correctly. So the backend declares it, with the class attribute
``token_cache_kernel_page_slots`` (None by default: the split stays refused;
``"builder"`` or ``"runner"``: who puts the writes at kernel-page slots), and
the runner asks the backend, never a model's type. Kimi K3.1's
``KimiK3IndexerBackend`` says ``"builder"`` (its builder calls
``get_compressed_slot_mapping`` with ``compress_ratio=1``) and
``KimiK3FlashMLASparseBackend`` says ``"runner"``.

In-tree edit: ``AttentionBackend.token_cache_kernel_page_slots: ClassVar[str |
None] = None``; in ``map_kv_cache_to_kernel_blocks``, before the ``if`` that
raises, a token cache whose backend declares it is split
(``split_packed_rows_into_kernel_pages``, from the engine's generic module
:mod:`vllm.v1.worker.kernel_pages`, which the series adds at that path) and
its kernel block stride kept.
"""

from __future__ import annotations

from typing import Any

from vllm.v1.worker.kernel_pages import (
    TOKEN_CACHE_KERNEL_PAGE_SLOTS,
    split_packed_rows_into_kernel_pages,
    token_cache_kernel_page_slots,
)

_MARK = "_kimi_k3_dsa_split"


def _map_kv_cache_to_kernel_blocks(original: Any, group: Any, kv_cache: Any) -> Any:
    spec = group.kv_cache_spec
    if (
        spec.tokens_per_state != 1
        or token_cache_kernel_page_slots(group.backend) is None
    ):
        return original(group, kv_cache)
    if group.kernel_block_size is None:
        # 0.33.0's own method asserts this too: the runner sets the kernel
        # block size of every group before it binds the caches.
        raise RuntimeError(
            f"{group.backend.get_name()}: the KV cache of KV cache group "
            f"{group.kv_cache_group_id} is bound before its kernel block size "
            "was chosen"
        )
    kernel_rows = spec.get_num_kernel_states(group.kernel_block_size)
    if kv_cache.shape[-2] == kernel_rows:
        return kv_cache
    view, stride = split_packed_rows_into_kernel_pages(kv_cache, kernel_rows)
    group.kernel_block_stride = stride
    return view


def apply() -> None:
    from vllm.v1.attention.backend import AttentionBackend
    from vllm.v1.worker.utils import AttentionGroup

    # The capability's default, as the in-tree attribute declares it.
    if not hasattr(AttentionBackend, TOKEN_CACHE_KERNEL_PAGE_SLOTS):
        setattr(AttentionBackend, TOKEN_CACHE_KERNEL_PAGE_SLOTS, None)
    current = AttentionGroup.map_kv_cache_to_kernel_blocks
    if getattr(current, _MARK, False):
        return

    def map_kv_cache_to_kernel_blocks(self, kv_cache):
        return _map_kv_cache_to_kernel_blocks(current, self, kv_cache)

    map_kv_cache_to_kernel_blocks.__doc__ = current.__doc__
    setattr(map_kv_cache_to_kernel_blocks, _MARK, True)
    AttentionGroup.map_kv_cache_to_kernel_blocks = map_kv_cache_to_kernel_blocks
