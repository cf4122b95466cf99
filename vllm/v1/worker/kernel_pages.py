# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Kernel pages of packed token caches: the page view of one cache, the slots
that address it, and the runners' slot mappings in those pages.

In a packed (block-outermost) KV cache one manager block row holds every
layer's pages of a KV cache group, so a block row can be far longer than the
pages an attention kernel reads. The runner may then view each cache through
a strided page view, kernel page ``j`` of block ``b`` being page ``b * stride
+ j`` (:func:`split_packed_rows_into_kernel_pages`). A token cache (one state
per token) is written through slot mappings, which vLLM computes in manager
blocks (``b * block_size + o``); in a split cache those slots must address
the kernel pages instead (:func:`kernel_page_slots`). Whether a backend's
token cache may be split, and who puts its writes at kernel-page slots, is the
backend's capability ``token_cache_kernel_page_slots``:

* None (the default): the cache is written through manager-block slots and is
  never split;
* ``"builder"``: the backend's metadata builder derives its write slots from
  the kernel block table it is handed (as compressed caches are written);
* ``"runner"``: the runner hands the backend's KV cache group its slot
  mapping in kernel pages (this module's remapping).

Both runners remap the slots of the ``"runner"`` groups once per step, before
the metadata and the forward context read them: Model Runner V2 in
``BlockTables.compute_slot_mappings`` (configured by
:func:`configure_block_tables` once the caches are bound, remapped by
:func:`remap_slot_mapping_rows`), the V1 runner in ``_get_slot_mappings``
(:func:`remap_slot_mappings`). The runners ask the backend, never a model's
type. Torch only at import, so kernel tests can lay out caches exactly as the
runner does without the rest of vLLM.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

# The attention-backend capability the runner asks before it splits a packed
# row of a token cache into kernel pages (a class attribute; see above).
TOKEN_CACHE_KERNEL_PAGE_SLOTS = "token_cache_kernel_page_slots"
# The backend's metadata builder derives its write slots from the kernel block
# table it is handed.
SLOTS_FROM_BUILDER = "builder"
# The runner hands the backend's KV cache group its slot mapping in kernel
# pages (:func:`kernel_page_slots`), for an insert that writes at the group's
# slots.
SLOTS_FROM_RUNNER = "runner"

# The V1 runner's persistent buffers of remapped slots, per group.
_BUFFERS = "_kernel_page_slot_buffers"
# Where Model Runner V2's BlockTables keep the groups whose slots they remap.
BLOCK_TABLES_ATTR = "kernel_page_slot_groups"


def token_cache_kernel_page_slots(backend: object) -> str | None:
    """A backend class's :data:`TOKEN_CACHE_KERNEL_PAGE_SLOTS` capability
    (None for a backend that does not declare it, or for no backend)."""
    value = getattr(backend, TOKEN_CACHE_KERNEL_PAGE_SLOTS, None)
    if value not in (None, SLOTS_FROM_BUILDER, SLOTS_FROM_RUNNER):
        raise ValueError(
            f"{getattr(backend, '__name__', backend)}.{TOKEN_CACHE_KERNEL_PAGE_SLOTS}"
            f" is {value!r}; accepted: None, {SLOTS_FROM_BUILDER!r}, "
            f"{SLOTS_FROM_RUNNER!r}"
        )
    return value


def split_packed_rows_into_kernel_pages(
    kv_cache: torch.Tensor, kernel_rows: int
) -> tuple[torch.Tensor, int]:
    """View one cache of a packed block-outermost KV cache, in manager blocks
    ``[num_blocks, 1, block_size, C]`` or ``[num_blocks, block_size, C]``, as
    ``kernel_rows``-token kernel pages.

    Returns the view and the kernel block stride: kernel page j of manager
    block b is page ``b * stride + j`` (the view spans the other layers' pages
    between two blocks and never addresses them, which ``view`` cannot
    express). Raises ValueError when the cache cannot be split (more than one
    head slot, or a block stride that is not a whole number of kernel pages).
    """
    page_stride = kernel_rows * kv_cache.stride(-2)
    if (
        kv_cache.dim() < 3
        or any(size != 1 for size in kv_cache.shape[1:-2])
        or kv_cache.shape[-2] % kernel_rows
        or kv_cache.stride(0) % page_stride
    ):
        raise ValueError(
            f"KV cache of shape {tuple(kv_cache.shape)} and strides "
            f"{kv_cache.stride()} cannot be split into {kernel_rows}-token "
            "kernel pages."
        )
    stride = kv_cache.stride(0) // page_stride
    num_pages = (kv_cache.shape[0] - 1) * stride + kv_cache.shape[-2] // kernel_rows
    view = kv_cache.as_strided(
        (num_pages, *kv_cache.shape[1:-2], kernel_rows, kv_cache.shape[-1]),
        (page_stride, *kv_cache.stride()[1:]),
    )
    return view, stride


def kernel_page_slots(
    manager_slots: torch.Tensor,
    block_size: int,
    page_tokens: int,
    kernel_block_stride: int,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Manager-block slots as slots of a cache split into kernel pages.

    Token ``o`` of manager block ``b`` (slot ``b * block_size + o``) sits in
    kernel page ``b * kernel_block_stride + o // page_tokens`` at row
    ``o % page_tokens`` (:func:`split_packed_rows_into_kernel_pages`), that is
    at slot ``b * kernel_block_stride * page_tokens + o``. Slot -1 (no write)
    stays -1. ``out`` (same shape, int64) makes the result a persistent
    buffer, as CUDA graphs need.
    """
    if block_size % page_tokens or kernel_block_stride * page_tokens < block_size:
        raise ValueError(
            f"kernel pages of {page_tokens} tokens at a stride of "
            f"{kernel_block_stride} pages cannot hold {block_size}-token blocks"
        )
    blocks = torch.div(manager_slots, block_size, rounding_mode="floor")
    paged = blocks * (kernel_block_stride * page_tokens) + (
        manager_slots - blocks * block_size
    )
    paged = torch.where(manager_slots < 0, manager_slots, paged)
    if out is None:
        return paged
    return out.copy_(paged)


@dataclass(frozen=True)
class KernelPageSlots:
    """How one KV cache group's slots address its kernel pages."""

    block_size: int
    page_tokens: int
    kernel_block_stride: int

    def remap(self, slots: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        return kernel_page_slots(
            slots, self.block_size, self.page_tokens, self.kernel_block_stride, out=out
        )


def kernel_page_slot_groups(attn_groups: Iterable[Any]) -> dict[int, KernelPageSlots]:
    """KV cache group id -> its kernel-page addressing, for every attention
    group whose cache the runner split into kernel pages and whose backend
    takes its slots from the runner (``token_cache_kernel_page_slots ==
    "runner"``)."""
    found: dict[int, KernelPageSlots] = {}
    for group in attn_groups:
        if group.kernel_block_size is None or not group.kernel_block_stride:
            continue
        if token_cache_kernel_page_slots(group.backend) != SLOTS_FROM_RUNNER:
            continue
        pages = KernelPageSlots(
            group.kv_cache_spec.block_size,
            group.kernel_block_size,
            group.kernel_block_stride,
        )
        if found.setdefault(group.kv_cache_group_id, pages) != pages:
            raise ValueError(
                f"KV cache group {group.kv_cache_group_id} has caches split "
                f"into kernel pages in two ways ({pages} and "
                f"{found[group.kv_cache_group_id]}): one slot mapping cannot "
                "address both."
            )
    return found


def remap_slot_mapping_rows(
    slot_mappings: torch.Tensor, groups: dict[int, KernelPageSlots]
) -> torch.Tensor:
    """Model Runner V2: put the rows of ``slot_mappings`` (``[num_groups,
    num_tokens]``, as ``BlockTables.compute_slot_mappings`` returns it) of
    the split groups in kernel pages, in place (the rows are persistent
    buffers that CUDA graphs and the speculators read)."""
    for gid, pages in groups.items():
        row = slot_mappings[gid]
        pages.remap(row, out=row)
    return slot_mappings


def configure_block_tables(block_tables: Any, attn_groups: Iterable[Any]) -> None:
    """Model Runner V2: record on ``block_tables`` which of its groups' slots
    address kernel pages (after the runner bound the KV caches, which sets
    the kernel block strides). Cleared when none does."""
    groups = kernel_page_slot_groups(attn_groups)
    for gid in groups:
        if gid >= block_tables.num_kv_cache_groups:
            raise ValueError(
                f"KV cache group {gid} of a cache split into kernel pages is not "
                f"one of the runner's {block_tables.num_kv_cache_groups} block "
                "tables."
            )
    setattr(block_tables, BLOCK_TABLES_ATTR, groups)


def runner_kernel_page_groups(runner: Any) -> dict[int, KernelPageSlots]:
    """V1 runner: KV cache group id -> the kernel-page addressing of the
    groups whose slots it remaps (:func:`kernel_page_slot_groups`). Runs
    every step."""
    return kernel_page_slot_groups(
        group
        for groups in getattr(runner, "attn_groups", None) or []
        for group in groups
    )


def remap_slot_mappings(
    runner: Any,
    by_gid: dict[int, torch.Tensor] | None,
    by_layer: dict[str, torch.Tensor] | list[dict[str, torch.Tensor]] | None = None,
    ubatch_slices: Any = None,
) -> tuple[Any, Any]:
    """V1 runner: put the slots of every group it remaps in kernel pages:
    ``by_gid`` (the attention metadata's) and, when given, ``by_layer`` (the
    forward context's, per micro-batch when a list) are updated in place with
    the same tensor, a persistent buffer of the runner, and returned."""
    if by_gid is None:
        return by_gid, by_layer
    split = runner_kernel_page_groups(runner)
    if not split:
        return by_gid, by_layer
    buffers: dict[int, torch.Tensor] = runner.__dict__.setdefault(_BUFFERS, {})
    for gid, pages in split.items():
        manager = by_gid[gid]
        full = runner.input_batch.block_table[gid].slot_mapping.gpu
        buffer = buffers.get(gid)
        if buffer is None or buffer.shape != full.shape:
            buffer = buffers[gid] = torch.empty_like(full)
        paged = buffer[: manager.shape[0]]
        pages.remap(manager, out=paged)
        by_gid[gid] = paged
        names = runner.kv_cache_config.kv_cache_groups[gid].layer_names
        if by_layer is None:
            continue
        if isinstance(by_layer, dict):
            by_layer.update((name, paged) for name in names if name in by_layer)
        else:
            for ubatch, mappings in zip(ubatch_slices, by_layer, strict=True):
                mappings.update(
                    (name, paged[ubatch.token_slice])
                    for name in names
                    if name in mappings
                )
    return by_gid, by_layer
