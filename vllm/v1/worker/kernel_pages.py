# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Kernel pages of packed token caches: the page view of one cache and the
runners' slot mappings in those pages (torch only at import).

A backend's ``token_cache_kernel_page_slots`` says who writes a split cache at
kernel-page slots: None (never split), ``"builder"`` or ``"runner"``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch

if TYPE_CHECKING:
    from vllm.v1.worker.gpu.block_table import BlockTables
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    from vllm.v1.worker.ubatch_utils import UBatchSlices
    from vllm.v1.worker.utils import AttentionGroup

# The attention-backend capability the runner asks before it splits.
TOKEN_CACHE_KERNEL_PAGE_SLOTS = "token_cache_kernel_page_slots"
SLOTS_FROM_BUILDER = "builder"
SLOTS_FROM_RUNNER = "runner"

# Our attributes on vLLM's objects (the runner's buffers, the block tables'
# split groups).
_BUFFERS = "_kernel_page_slot_buffers"
BLOCK_TABLES_ATTR = "kernel_page_slot_groups"
# A V1 runner's slot mappings by layer: one dict, or one per micro-batch.
SlotMappingsByLayer = dict[str, torch.Tensor] | list[dict[str, torch.Tensor]]


def token_cache_kernel_page_slots(backend: object) -> str | None:
    """A backend class's :data:`TOKEN_CACHE_KERNEL_PAGE_SLOTS` capability."""
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
    """View one cache of a packed block-outermost KV cache as
    ``kernel_rows``-token kernel pages; returns the view and the kernel block
    stride (page ``j`` of block ``b`` is page ``b * stride + j``)."""
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
    """Manager-block slots as slots of a cache split into kernel pages; -1
    stays -1, and ``out`` makes the result a persistent buffer (CUDA graphs).
    """
    if block_size % page_tokens or kernel_block_stride * page_tokens < block_size:
        raise ValueError(
            f"kernel pages of {page_tokens} tokens at a stride of "
            f"{kernel_block_stride} pages cannot hold {block_size}-token blocks"
        )
    # Three launches (this runs every step): block 0 for -1 keeps it -1.
    blocks = torch.div(manager_slots, block_size, rounding_mode="floor").clamp_(min=0)
    shift = kernel_block_stride * page_tokens - block_size
    return torch.add(manager_slots, blocks, alpha=shift, out=out)


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


@runtime_checkable
class BindsKernelPageSlots(Protocol):
    """A metadata builder of a ``"builder"`` backend that derives its
    kernel-page slots from its group's slot mapping once told how."""

    def bind_kernel_page_slots(self, pages: KernelPageSlots) -> None: ...


def bind_builder_kernel_pages(
    attn_groups: Iterable[AttentionGroup],
    runner_groups: dict[int, KernelPageSlots],
) -> None:
    """Tell the builders of split ``"builder"`` caches how their group's slots
    map to their kernel pages: from the runner's kernel-page slots where it
    remaps the group (``runner_groups``), else from manager-block slots."""
    for group in attn_groups:
        if group.kernel_block_size is None or not group.kernel_block_stride:
            continue
        if token_cache_kernel_page_slots(group.backend) != SLOTS_FROM_BUILDER:
            continue
        runner = runner_groups.get(group.kv_cache_group_id)
        # Slots one manager block spans in the group's slot mapping.
        period = (
            runner.page_tokens * runner.kernel_block_stride
            if runner is not None
            else group.kv_cache_spec.block_size
        )
        pages = KernelPageSlots(
            period, group.kernel_block_size, group.kernel_block_stride
        )
        for builder in group.metadata_builders:
            if isinstance(builder, BindsKernelPageSlots):
                builder.bind_kernel_page_slots(pages)


def kernel_page_slot_groups(
    attn_groups: Iterable[AttentionGroup],
) -> dict[int, KernelPageSlots]:
    """KV cache group id -> kernel-page addressing of the split groups whose
    backend takes its slots from the runner."""
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
    """Model Runner V2: remap the split groups' rows of ``slot_mappings`` in
    place (persistent buffers that CUDA graphs read)."""
    for gid, pages in groups.items():
        row = slot_mappings[gid]
        pages.remap(row, out=row)
    return slot_mappings


def configure_block_tables(
    block_tables: BlockTables, attn_groups: Iterable[AttentionGroup]
) -> None:
    """Model Runner V2: record which groups' slots address kernel pages, and
    bind the builders that derive their own, once the KV caches are bound."""
    attn_groups = list(attn_groups)
    groups = kernel_page_slot_groups(attn_groups)
    for gid in groups:
        if gid >= block_tables.num_kv_cache_groups:
            raise ValueError(
                f"KV cache group {gid} of a cache split into kernel pages is not "
                f"one of the runner's {block_tables.num_kv_cache_groups} block "
                "tables."
            )
    setattr(block_tables, BLOCK_TABLES_ATTR, groups)
    bind_builder_kernel_pages(attn_groups, groups)


def runner_kernel_page_groups(runner: GPUModelRunner) -> dict[int, KernelPageSlots]:
    """V1 runner: the groups whose slots it remaps."""
    return kernel_page_slot_groups(
        group for groups in runner.attn_groups for group in groups
    )


def remap_slot_mappings(
    runner: GPUModelRunner,
    by_gid: dict[int, torch.Tensor] | None,
    by_layer: SlotMappingsByLayer | None = None,
    ubatch_slices: UBatchSlices | None = None,
) -> tuple[dict[int, torch.Tensor] | None, SlotMappingsByLayer | None]:
    """V1 runner: remap the split groups' slots into a persistent buffer and
    update ``by_gid`` and ``by_layer`` with it, in place."""
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
