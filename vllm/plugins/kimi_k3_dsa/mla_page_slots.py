# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Seam: the slots of a split token cache whose backend takes them from the
runner address its kernel pages, under both of vLLM 0.33.0's model runners.

Upstream targets:

* Model Runner V2 (the default wherever Triton runs, every GPU host):
  ``vllm/v1/worker/gpu/block_table.py``, ``BlockTables.compute_slot_mappings``,
  and ``vllm/v1/worker/gpu/model_runner.py``,
  ``GPUModelRunner.initialize_kv_cache``;
* the V1 runner: ``vllm/v1/worker/gpu_model_runner.py``,
  ``GPUModelRunner._get_slot_mappings``.

Why: a backend that declares ``token_cache_kernel_page_slots = "runner"``
(``kernel_block_split``) writes at its group's slot mapping; Kimi K3.1's
``KimiK3FlashMLASparseBackend`` does, where FlashMLA sparse reads the
``fp8_ds_mla`` cache in 64-token kernel pages (SM10x, or SM90 with
``VLLM_KIMI_K3_DSA_MLA_KERNEL_PAGES=1``). There the runner splits the packed
row's MLA pages (``kernel_block_split``) and hands
the builders the kernel block table, whose page ``j`` of block ``b`` is
``b * kernel_block_stride + j``. The KV insert (upstream's, and our fused
prologue's) writes at the group's slot mapping, which 0.33.0 computes in
manager blocks: ``b * block_size + o``. In a packed row the two disagree
(other layers' pages sit between a layer's blocks): unremapped, every write
past a request's first block lands in another layer's pages. So the group's
slots become kernel-page slots (``kernel_page_slots``) wherever the runner
computes them, before the metadata and the forward context read them:
prefill, decode, dummy and CUDA-graph capture runs, micro-batches, and, under
V2, the speculators' draft steps, which compute their slots through the same
``BlockTables``. The indexer of the same group derives its own slots from the
kernel block table and reads these only for their -1s, which stay -1.

The runner finds those groups by asking each attention group's backend for
the capability, never by a model's type.

In-tree edits: V2's ``initialize_kv_cache``, once the caches are bound,
records on its ``BlockTables`` which groups' slots address kernel pages
(``configure_block_tables``: the split groups whose backend says
``"runner"``), and ``compute_slot_mappings`` remaps those rows of the
mappings it computed (``remap_slot_mapping_rows``); in V1's
``_get_slot_mappings``, right after the per-group slot mappings are built,
``remap_slot_mappings(self, slot_mappings_by_gid)``. These helpers know no
model: they live in the engine's generic module
:mod:`vllm.v1.worker.kernel_pages`, which the series adds at that path.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

# The logic lives in the engine's generic module (vLLM's tree calls it from
# the runners); re-exported for callers of this seam.
from vllm.v1.worker.kernel_pages import (
    BLOCK_TABLES_ATTR,
    configure_block_tables,
    remap_slot_mapping_rows,
    remap_slot_mappings,
    runner_kernel_page_groups,
)

__all__ = [
    "apply",
    "configure_block_tables",
    "remap_slot_mapping_rows",
    "remap_slot_mappings",
    "runner_kernel_page_groups",
]

_MARK = "_kimi_k3_dsa_page_slots"


def _wrap(owner: type, name: str, make: Callable[[Any], Any]) -> None:
    """Replace ``owner.name`` by ``make(original)`` once per process."""
    current = getattr(owner, name)
    if getattr(current, _MARK, False):
        return
    wrapper = make(current)
    wrapper.__doc__ = current.__doc__
    setattr(wrapper, _MARK, True)
    setattr(owner, name, wrapper)


def _v2_attn_groups(runner: Any) -> list[Any]:
    """Every attention group a V2 runner binds caches for: the target's and
    a draft model's (which builds its own metadata)."""
    lists = list(runner.attn_groups) + list(
        getattr(getattr(runner, "speculator", None), "attn_groups", None) or []
    )
    return [group for groups in lists for group in groups]


def _apply_v2() -> None:
    from vllm.v1.worker.gpu.block_table import BlockTables
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner

    def make_initialize(original: Any) -> Any:
        def initialize_kv_cache(self, *args, **kwargs):
            original(self, *args, **kwargs)
            configure_block_tables(self.block_tables, _v2_attn_groups(self))

        return initialize_kv_cache

    def make_compute(original: Any) -> Any:
        def compute_slot_mappings(self, *args, **kwargs):
            slot_mappings = original(self, *args, **kwargs)
            groups = getattr(self, BLOCK_TABLES_ATTR, None)
            if groups:
                remap_slot_mapping_rows(slot_mappings, groups)
            return slot_mappings

        return compute_slot_mappings

    _wrap(GPUModelRunner, "initialize_kv_cache", make_initialize)
    _wrap(BlockTables, "compute_slot_mappings", make_compute)


def _apply_v1() -> None:
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    def make_get_slot_mappings(original: Any) -> Any:
        def _get_slot_mappings(
            self,
            num_tokens_padded: int,
            num_reqs_padded: int,
            num_tokens_unpadded: int,
            ubatch_slices: Any = None,
        ):
            by_gid, by_layer = original(
                self,
                num_tokens_padded,
                num_reqs_padded,
                num_tokens_unpadded,
                ubatch_slices,
            )
            return remap_slot_mappings(self, by_gid, by_layer, ubatch_slices)

        return _get_slot_mappings

    _wrap(GPUModelRunner, "_get_slot_mappings", make_get_slot_mappings)


def apply() -> None:
    _apply_v2()
    _apply_v1()
