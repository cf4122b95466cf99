# SPDX-License-Identifier: Apache-2.0
"""Seam: the slots of a split Kimi K3.1 MLA cache address its kernel pages.

Upstream target: ``vllm/v1/worker/gpu_model_runner.py``,
``GPUModelRunner._get_slot_mappings``.

Why: where FlashMLA sparse reads the ``fp8_ds_mla`` cache in 64-token kernel
pages (SM10x, or SM90 with ``VLLM_KIMI_K3_DSA_MLA_KERNEL_PAGES=1``), the
runner splits the packed row's MLA pages (``kernel_block_split``) and hands
the builders the kernel block table, whose page ``j`` of block ``b`` is
``b * kernel_block_stride + j``. The KV insert (upstream's, and our fused
prologue's) writes at the group's slot mapping, which 0.33.0 computes in
manager blocks: ``b * block_size + o``. In a packed row the two disagree
(other layers' pages sit between a layer's blocks), so this seam turns the
group's slots into kernel-page slots (``kernel_page_slots``) in a persistent
buffer, once per step, before the metadata and the forward context read them:
the attention metadata (``common_attn_metadata.slot_mapping``), the per-layer
slots of the forward context (the insert and the fused prologue), prefill,
decode, dummy and CUDA-graph capture runs alike. The indexer of the same group
derives its own slots from the kernel block table and reads these only for
their -1s, which stay -1.

In-tree edit: in ``_get_slot_mapping``, for a KV cache group whose MLA
attention group has ``kernel_block_stride`` set, return
``kernel_page_slots(...)`` of the block table's slots in a persistent buffer.
"""

from __future__ import annotations

from typing import Any

import torch

from vllm.models.kimi_k3.common.dsa_cache import KimiK3FlashMLASparseBackend
from vllm.models.kimi_k3.common.dsa_pages import kernel_page_slots

_MARK = "_kimi_k3_dsa_page_slots"
_BUFFERS = "_kimi_k3_dsa_page_slot_buffers"


def split_mla_groups(runner: Any) -> dict[int, Any]:
    """KV cache group id -> the attention group of our MLA backend whose
    cache the runner split into kernel pages."""
    found = {}
    for gid, groups in enumerate(getattr(runner, "attn_groups", None) or []):
        for group in groups:
            if (
                isinstance(group.backend, type)
                and issubclass(group.backend, KimiK3FlashMLASparseBackend)
                and group.kernel_block_size is not None
                and group.kernel_block_stride
            ):
                found[gid] = group
    return found


def remap_slot_mappings(
    runner: Any,
    by_gid: dict[int, torch.Tensor] | None,
    by_layer: dict[str, torch.Tensor] | list[dict[str, torch.Tensor]] | None,
    ubatch_slices: Any,
) -> tuple[Any, Any]:
    """``_get_slot_mappings``' result with every split MLA group's slots in
    kernel pages (the same tensor in both returned structures)."""
    if by_gid is None or by_layer is None:
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


def apply() -> None:
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    current = GPUModelRunner._get_slot_mappings
    if getattr(current, _MARK, False):
        return

    def _get_slot_mappings(
        self,
        num_tokens_padded: int,
        num_reqs_padded: int,
        num_tokens_unpadded: int,
        ubatch_slices: Any = None,
    ):
        by_gid, by_layer = current(
            self, num_tokens_padded, num_reqs_padded, num_tokens_unpadded, ubatch_slices
        )
        return remap_slot_mappings(self, by_gid, by_layer, ubatch_slices)

    _get_slot_mappings.__doc__ = current.__doc__
    setattr(_get_slot_mappings, _MARK, True)
    GPUModelRunner._get_slot_mappings = _get_slot_mappings
