# SPDX-License-Identifier: Apache-2.0
"""The runner's slot mappings of a split Kimi K3.1 MLA cache, in kernel pages.

Where FlashMLA sparse reads the ``fp8_ds_mla`` cache in 64-token kernel pages
(SM10x, or SM90 with ``VLLM_KIMI_K3_DSA_MLA_KERNEL_PAGES=1``), the runner
splits the packed row's MLA pages and hands the builders the kernel block
table, whose page ``j`` of block ``b`` is ``b * kernel_block_stride + j``. The
KV insert writes at the group's slot mapping, which vLLM computes in manager
blocks (``b * block_size + o``); in a packed row the two disagree, so the
group's slots are turned into kernel-page slots (:func:`kernel_page_slots`)
in a persistent buffer, once per step, before the metadata and the forward
context read them. The runner calls :func:`remap_slot_mappings` from
``GPUModelRunner._get_slot_mappings`` (in vLLM's tree, or through the
``mla_page_slots`` seam of the overlay).
"""

from __future__ import annotations

from typing import Any

import torch

from vllm.models.kimi_k3.common.dsa_pages import kernel_page_slots

_BUFFERS = "_kimi_k3_dsa_page_slot_buffers"


def split_mla_groups(runner: Any) -> dict[int, Any]:
    """KV cache group id -> the attention group of the Kimi K3.1 MLA backend
    whose cache the runner split into kernel pages. Runs every step: a model
    with no split group (any other model) returns before the cache module is
    imported."""
    split = [
        (gid, group)
        for gid, groups in enumerate(getattr(runner, "attn_groups", None) or [])
        for group in groups
        if group.kernel_block_size is not None and group.kernel_block_stride
    ]
    if not split:
        return {}
    from vllm.models.kimi_k3.common.dsa_cache import KimiK3FlashMLASparseBackend

    return {
        gid: group
        for gid, group in split
        if isinstance(group.backend, type)
        and issubclass(group.backend, KimiK3FlashMLASparseBackend)
    }


def remap_slot_mappings(
    runner: Any,
    by_gid: dict[int, torch.Tensor] | None,
    by_layer: dict[str, torch.Tensor] | list[dict[str, torch.Tensor]] | None = None,
    ubatch_slices: Any = None,
) -> tuple[Any, Any]:
    """Put every split MLA group's slots in kernel pages: ``by_gid`` (the
    attention metadata's) and, when given, ``by_layer`` (the forward
    context's, per micro-batch when a list) are updated in place with the
    same tensor and returned."""
    if by_gid is None:
        return by_gid, by_layer
    split = split_mla_groups(runner)
    if not split:
        return by_gid, by_layer
    buffers: dict[int, torch.Tensor] = runner.__dict__.setdefault(_BUFFERS, {})
    for gid, group in split.items():
        manager = by_gid[gid]
        block_size = runner.kv_cache_config.kv_cache_groups[
            gid
        ].kv_cache_spec.block_size
        full = runner.input_batch.block_table[gid].slot_mapping.gpu
        buffer = buffers.get(gid)
        if buffer is None or buffer.shape != full.shape:
            buffer = buffers[gid] = torch.empty_like(full)
        paged = buffer[: manager.shape[0]]
        kernel_page_slots(
            manager,
            block_size,
            group.kernel_block_size,
            group.kernel_block_stride,
            out=paged,
        )
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
