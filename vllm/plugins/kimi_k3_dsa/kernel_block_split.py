# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Seam: the runner may split the packed row of a token cache into kernel
pages when the cache's attention backend writes it at kernel-page slots.

Upstream target: ``vllm/v1/attention/backend.py`` ``AttentionBackend`` and
``vllm/v1/worker/utils.py`` ``AttentionGroup.map_kv_cache_to_kernel_blocks``.

Why: 0.33.0 refuses to split a token cache, as manager-block slots do not
address kernel pages; a backend writing at kernel-page slots is safe to split.

In-tree edit: ``AttentionBackend.token_cache_kernel_page_slots = None`` and a
split in ``map_kv_cache_to_kernel_blocks`` for backends that declare it.
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
