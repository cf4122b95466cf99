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

In-tree edit: in ``_get_slot_mappings``, right after the per-group slot
mappings are built and when an attention group has a kernel block stride,
``remap_slot_mappings(self, slot_mappings_by_gid)``
(:mod:`vllm.models.kimi_k3.common.dsa_slot_mappings`) puts a split MLA
group's slots in kernel pages, so the per-layer mappings built from them
follow.
"""

from __future__ import annotations

from typing import Any

# The logic lives in the cache layer (vLLM's tree calls it from the runner);
# re-exported for callers of this seam.
from vllm.models.kimi_k3.common.dsa_slot_mappings import (
    remap_slot_mappings,
    split_mla_groups,
)

__all__ = ["apply", "remap_slot_mappings", "split_mla_groups"]

_MARK = "_kimi_k3_dsa_page_slots"


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
