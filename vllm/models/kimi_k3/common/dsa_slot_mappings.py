# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The runner's slot mappings of a split token cache, in kernel pages.

A backend whose token cache the runner may split into kernel pages because
the runner hands it kernel-page slots declares so
(``token_cache_kernel_page_slots = "runner"``, :mod:`.dsa_pages`): Kimi
K3.1's FlashMLA sparse subclass, where FlashMLA sparse reads the
``fp8_ds_mla`` cache in 64-token kernel pages (SM10x, or SM90 with
``VLLM_KIMI_K3_DSA_MLA_KERNEL_PAGES=1``). Once the runner split such a cache,
it hands the builders the kernel block table, whose page ``j`` of block ``b``
is ``b * kernel_block_stride + j``, while the KV insert writes at the group's
slot mapping, which vLLM computes in manager blocks (``b * block_size + o``);
in a packed row the two disagree, so the group's slots are turned into
kernel-page slots (:func:`kernel_page_slots`) once per step, before the
metadata and the forward context read them. The runner asks the backend,
never a model's type.

Both of vLLM 0.33.0's model runners need it, at different places:

* Model Runner V2 (``vllm/v1/worker/gpu/``, the default wherever Triton
  runs) computes every slot mapping, the target's, the speculators' and the
  micro-batches' alike, in ``BlockTables.compute_slot_mappings``: the runner
  records the split groups on its block tables after it bound the caches
  (:func:`configure_block_tables`) and each computed mapping is remapped in
  place (:func:`remap_slot_mapping_rows`).
* The V1 runner (``gpu_model_runner.py``) calls :func:`remap_slot_mappings`
  from ``GPUModelRunner._get_slot_mappings``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from vllm.models.kimi_k3.common.dsa_pages import (
    SLOTS_FROM_RUNNER,
    kernel_page_slots,
    token_cache_kernel_page_slots,
)

# The V1 runner's persistent buffers of remapped slots, per group.
_BUFFERS = "_kernel_page_slot_buffers"
# Where Model Runner V2's BlockTables keep the groups whose slots they remap.
BLOCK_TABLES_ATTR = "kernel_page_slot_groups"


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
