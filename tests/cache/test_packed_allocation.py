# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Kimi K3.1's caches through vLLM 0.33.0's real planner and allocator (on the
CPU), at the packed DSA block size: the plan command counts the planner's
blocks, and the runner's kernel-page split of our indexer cache addresses
exactly that cache's rows inside the shared allocation."""

from __future__ import annotations

import pytest
import torch

from kimi_k3_dsa_tools.kv_plan_cli import main
from vllm.models.kimi_k3.common.dsa_cache import KimiK3IndexerBackend

TP = 8


@pytest.fixture
def planned(packed_kimi_k3_1):
    return packed_kimi_k3_1(8)


def test_plan_counts_the_planners_blocks(planned, capsys):
    import json

    block, budget, kv_cache_config = planned
    capsys.readouterr()
    assert main(
        ["--tp", str(TP), "--kv-budget", str(budget), "--max-model-len", "4096",
         "--json"]
    ) == 0  # fmt: skip
    plan = json.loads(capsys.readouterr().out)
    assert plan["block_size"] == block == 1024
    assert plan["num_blocks"] == kv_cache_config.num_blocks == 8
    # One backing allocation of num_blocks x the planner's block stride.
    strides = {t.block_stride for t in kv_cache_config.kv_cache_tensors}
    assert strides == {plan["block_bytes"]}


def test_kernel_pages_of_the_allocated_indexer_cache(planned):
    from dsa_series_mode import apply_seam

    from vllm.v1.kv_cache_interface import KVCacheLayout
    from vllm.v1.worker.utils import AttentionGroup, allocate_kv_cache

    apply_seam("kernel_block_split")
    block, _, kv_cache_config = planned
    caches = allocate_kv_cache(
        kv_cache_config, torch.device("cpu"), KVCacheLayout.BLHNC
    )
    index, mla = caches["l3.index"], caches["l3.mla"]
    assert index.shape == (8, 1, block, 132) and mla.shape == (8, 1, block, 656)
    group = next(
        g for g in kv_cache_config.kv_cache_groups if "l3.index" in g.layer_names
    )
    spec = group.kv_cache_spec.kv_cache_specs["l3.index"]
    attn_group = AttentionGroup(
        backend=KimiK3IndexerBackend,
        layer_names=["l3.index"],
        kv_cache_spec=spec,
        kv_cache_group_id=0,
        kernel_block_size=64,
    )
    pages = attn_group.map_kv_cache_to_kernel_blocks(index)
    stride = attn_group.kernel_block_stride
    assert stride * 64 * 132 == index.stride(0)
    # Write every token of every block through the kernel pages, as the
    # indexer's slots (page * 64 + row) address them.
    for b in range(8):
        for j in range(block // 64):
            pages[b * stride + j, 0, :, 0] = torch.arange(64, dtype=torch.uint8) + j
            pages[b * stride + j, 0, :, 1] = b + 1
    # The manager-block view of the same cache sees each token in its row ...
    positions = torch.arange(block)
    for b in range(8):
        assert torch.equal(index[b, 0, :, 0], (positions % 64 + positions // 64).byte())
        assert (index[b, 0, :, 1] == b + 1).all()
    # ... and no other cache of the DSA row was touched (the KDA state groups
    # overlay the same blocks by design: a block belongs to one group at a
    # time).
    others = [name for name in group.layer_names if name != "l3.index"]
    assert len(others) == 47 and "l3.mla" in others
    for name in others:
        assert int(caches[name].count_nonzero()) == 0, name
