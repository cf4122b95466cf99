# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Seam: the runners address a split token cache's kernel pages for backends
that take their slots from the runner.

Upstream target: V2's ``BlockTables`` and ``GPUModelRunner.initialize_kv_cache``;
V1's ``GPUModelRunner._get_slot_mappings``.

Why: in a packed row, manager-block slots and kernel pages disagree, so
unremapped writes land in other layers' pages.

In-tree edit: the runners remap those groups' slot mappings with the helpers
of :mod:`vllm.v1.worker.kernel_pages`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

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

if TYPE_CHECKING:
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner
    from vllm.v1.worker.utils import AttentionGroup

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


def _v2_attn_groups(runner: GPUModelRunner) -> list[AttentionGroup]:
    """The target's and a draft model's attention groups."""
    from vllm.v1.worker.gpu.spec_decode.speculator import DraftModelSpeculator

    lists = list(runner.attn_groups)
    if isinstance(runner.speculator, DraftModelSpeculator):
        lists += runner.speculator.attn_groups
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
