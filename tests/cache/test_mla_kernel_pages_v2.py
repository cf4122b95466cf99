# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Kernel-page slots under Model Runner V2, the runner every GPU host uses.

vLLM 0.33.0's V2 runner (``vllm/v1/worker/gpu/``) computes the slot mappings
of the target, the speculators and the micro-batches in
``BlockTables.compute_slot_mappings``, never in V1's ``_get_slot_mappings``.
These tests build V2's own ``BlockTables`` on the CPU, add requests through
its staged writes, gather the forward-pass block tables and compute the slot
mappings with V2's own Triton kernels, and check, token by token, that the
slot the MLA writer (the KV insert, our fused prologue) uses is the slot
FlashMLA sparse reads through the kernel block table the attention group
hands its builder.

Stubbed, because a CPU cannot do it: V2's Triton kernels run in Triton's
interpreter (a CPU has no Triton GPU driver, so vLLM replaces ``triton.jit``
by a no-op there), and V2's buffers skip unified virtual addressing.
"""

from __future__ import annotations

import types

import pytest
import torch
from dsa_series_mode import apply_seam
from k3_1_specs import FULL_ATTN

from vllm.models.kimi_k3.common.dsa_cache import (
    KimiK3FlashMLASparseBackend,
    KimiK3IndexerBackend,
)
from vllm.models.kimi_k3.common.dsa_formats import MLA_KERNEL_PAGE_TOKENS
from vllm.v1.worker.kernel_pages import (
    BLOCK_TABLES_ATTR,
    configure_block_tables,
)

PAGE = MLA_KERNEL_PAGE_TOKENS
NUM_BLOCKS = 4
# V2's kernels, by module: interpreted on the CPU.
_V2_KERNELS = {
    "vllm.v1.worker.gpu.buffer_utils": ("_load_ptr", "_apply_write_kernel"),
    "vllm.v1.worker.gpu.block_table": (
        "_load_ptr",
        "_gather_block_tables_kernel",
        "_compute_slot_mappings_kernel",
    ),
}


@pytest.fixture
def v2_kernels_on_cpu(monkeypatch):
    """Run V2's block-table kernels in Triton's interpreter on CPU tensors."""
    import importlib

    triton = pytest.importorskip("triton")
    import triton.language as tl

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(
        "vllm.v1.worker.gpu.buffer_utils.is_uva_available", lambda: False
    )
    interpreted: dict[str, object] = {}
    for module_name, names in _V2_KERNELS.items():
        module = importlib.import_module(module_name)
        for name in names:
            if name not in interpreted:
                fn = getattr(module, name)
                fn = getattr(fn, "fn", fn)  # a JITFunction where Triton is real
                scope = {**fn.__globals__, "tl": tl, "triton": triton, **interpreted}
                code = types.FunctionType(fn.__code__, scope, fn.__name__)
                interpreted[name] = triton.jit(code)
            monkeypatch.setattr(module, name, interpreted[name])


@pytest.fixture
def packed(packed_kimi_k3_1):
    """Kimi K3.1's TP 8 caches through vLLM's real planner and allocator, and
    the attention groups of one DSA layer, split into 64-token kernel pages
    (the Blackwell layout) by the runner's ``kernel_block_split`` seam."""
    from vllm.v1.kv_cache_interface import KVCacheLayout
    from vllm.v1.worker.utils import AttentionGroup, allocate_kv_cache

    apply_seam("kernel_block_split")
    apply_seam("mla_page_slots")
    block, _, kv_cache_config = packed_kimi_k3_1(NUM_BLOCKS)
    caches = allocate_kv_cache(
        kv_cache_config, torch.device("cpu"), KVCacheLayout.BLHNC
    )
    layer = FULL_ATTN[0]
    gid = next(
        i
        for i, g in enumerate(kv_cache_config.kv_cache_groups)
        if f"l{layer}.mla" in g.layer_names
    )
    specs = kv_cache_config.kv_cache_groups[gid].kv_cache_spec.kv_cache_specs
    groups, views = [], {}
    for suffix, backend in (("mla", KimiK3FlashMLASparseBackend),
                            ("index", KimiK3IndexerBackend)):  # fmt: skip
        name = f"l{layer}.{suffix}"
        group = AttentionGroup(
            backend=backend,
            layer_names=[name],
            kv_cache_spec=specs[name],
            kv_cache_group_id=gid,
            kernel_block_size=PAGE,
        )
        views[suffix] = group.map_kv_cache_to_kernel_blocks(caches[name])
        # What create_metadata_builders sets up for a split group.
        width = NUM_BLOCKS * (block // PAGE)
        group.kernel_block_table = torch.zeros(1, 4, width, dtype=torch.int32)
        group.kernel_block_offsets = torch.arange(block // PAGE, dtype=torch.int32)
        groups.append(group)
    return block, gid, kv_cache_config, groups, views


def _block_tables(kv_cache_config, max_tokens: int):
    from vllm.v1.worker.gpu.block_table import BlockTables

    sizes = [g.kv_cache_spec.block_size for g in kv_cache_config.kv_cache_groups]
    return BlockTables(
        block_sizes=sizes,
        max_num_reqs=4,
        max_num_batched_tokens=max_tokens,
        max_num_blocks_per_group=[NUM_BLOCKS] * len(sizes),
        device=torch.device("cpu"),
    )


# Two requests: a prefill that crosses into its second block and a decode
# deep in its second block (manager block ids out of order on purpose).
BLOCK_IDS = ([3, 1], [0, 2])


def _step(block, block_tables, num_groups):
    """Add the two requests, gather the block tables and the step's inputs
    as V2's ``prepare_attn`` does."""
    for req, ids in enumerate(BLOCK_IDS):
        block_tables.append_block_ids(req, tuple(ids for _ in range(num_groups)), True)
    block_tables.apply_staged_writes()
    prefill = torch.arange(block - 40, block + 60)
    decode = torch.tensor([block + 700])
    positions = torch.cat([prefill, decode])
    query_start_loc = torch.tensor(
        [0, prefill.numel(), positions.numel()], dtype=torch.int32
    )
    req_of_token = torch.cat(
        [
            torch.zeros(prefill.numel(), dtype=torch.long),
            torch.ones(1, dtype=torch.long),
        ]
    )
    idx_mapping = torch.tensor([0, 1], dtype=torch.int32)
    tables = block_tables.gather_block_tables(idx_mapping, num_reqs_padded=2)
    return idx_mapping, query_start_loc, positions, req_of_token, tables


def _reader_slots(mla_group, table, positions, req_of_token):
    """The slot FlashMLA sparse reads each token at: its kernel page from the
    kernel block table the group hands the builder, and its row there."""
    kernel_table = mla_group.map_to_kernel_block_table(table)
    pages = kernel_table[req_of_token, positions // PAGE].long()
    return pages * PAGE + positions % PAGE


def test_v2_writer_slots_are_the_flashmla_reader_slots(v2_kernels_on_cpu, packed):
    block, gid, kv_cache_config, groups, views = packed
    mla_group = groups[0]
    assert mla_group.kernel_block_stride > block // PAGE  # a packed row
    block_tables = _block_tables(kv_cache_config, 128)
    # What V2's initialize_kv_cache does once the caches are bound.
    configure_block_tables(block_tables, groups)
    idx, qsl, positions, req_of_token, tables = _step(
        block, block_tables, len(kv_cache_config.kv_cache_groups)
    )
    n = positions.numel()
    written = block_tables.compute_slot_mappings(idx, qsl, positions, 128)[gid, :n]
    read = _reader_slots(mla_group, tables[gid], positions, req_of_token)
    assert torch.equal(written, read), (written - read).nonzero()
    # Padding tokens still write nowhere.
    assert (block_tables.slot_mappings[gid, n:] == -1).all()
    # Every written slot lies inside the layer's own kernel pages, in the
    # manager block the block table gave the token.
    manager = block_tables.slot_mappings.new_tensor(
        [
            BLOCK_IDS[r][p // block]
            for r, p in zip(req_of_token.tolist(), positions.tolist(), strict=True)
        ]
    )
    assert torch.equal(written // (mla_group.kernel_block_stride * PAGE), manager)
    assert int(written.max()) < views["mla"].shape[0] * PAGE


def test_v2_speculator_slots_are_remapped_too(v2_kernels_on_cpu, packed):
    """V2's speculators compute their draft slots through the same
    ``BlockTables`` into their own buffers (``out=``)."""
    block, gid, kv_cache_config, groups, _ = packed
    block_tables = _block_tables(kv_cache_config, 128)
    configure_block_tables(block_tables, groups)
    idx, qsl, positions, req_of_token, tables = _step(
        block, block_tables, len(kv_cache_config.kv_cache_groups)
    )
    out = torch.full_like(block_tables.slot_mappings, 7)
    n = positions.numel()
    written = block_tables.compute_slot_mappings(idx, qsl, positions, n, out=out)
    read = _reader_slots(groups[0], tables[gid], positions, req_of_token)
    assert torch.equal(written[gid], read)
    assert written.data_ptr() == out.data_ptr()


def test_v2_whole_blocks_keep_manager_slots(v2_kernels_on_cpu, packed):
    """Unsplit (SM90's default layout): nothing is remapped, and the slots
    are the manager slots FlashMLA reads through whole blocks."""
    block, gid, kv_cache_config, groups, _ = packed
    block_tables = _block_tables(kv_cache_config, 128)
    configure_block_tables(block_tables, [])
    assert getattr(block_tables, BLOCK_TABLES_ATTR) == {}
    idx, qsl, positions, req_of_token, _ = _step(
        block, block_tables, len(kv_cache_config.kv_cache_groups)
    )
    n = positions.numel()
    written = block_tables.compute_slot_mappings(idx, qsl, positions, n)[gid]
    manager = torch.tensor(
        [
            BLOCK_IDS[r][p // block]
            for r, p in zip(req_of_token.tolist(), positions.tolist(), strict=True)
        ]
    )
    assert torch.equal(written, manager * block + positions % block)


@pytest.fixture
def bound_indexer_builder(packed, vllm_config_for, monkeypatch):
    """A real ``KimiK3IndexerMetadataBuilder`` on the packed fixture's
    indexer group. Its unbound path (``get_compressed_slot_mapping``) fails
    the test if taken."""
    from vllm.models.kimi_k3.common import dsa_cache
    from vllm.models.kimi_k3.common.dsa_cache import KimiK3IndexerMetadataBuilder

    index_group = packed[3][1]
    spec = index_group.kv_cache_spec.copy_with_new_block_size(PAGE)
    builder = KimiK3IndexerMetadataBuilder(
        spec, index_group.layer_names, vllm_config_for(), torch.device("cpu"),
        block_table_width=16,
    )  # fmt: skip
    index_group.metadata_builders = [builder]

    def unbound(*args, **kwargs):
        raise AssertionError("a bound builder launched get_compressed_slot_mapping")

    monkeypatch.setattr(dsa_cache, "get_compressed_slot_mapping", unbound)
    return builder


@pytest.mark.parametrize("mla_split", [True, False], ids=["sm10x", "sm90"])
def test_v2_indexer_slots_are_the_indexer_reader_slots(
    v2_kernels_on_cpu, packed, bound_indexer_builder, recorded_base_build, mla_split
):
    """Once V2 binds the caches, the indexer builder derives its key slots
    from the group's slot row by arithmetic: the row holds the MLA cache's
    kernel-page slots where the runner remaps it (SM10x), manager slots
    where it does not (SM90). Either way each key lands where the indexer's
    readers find it through its kernel block table."""
    from vllm.v1.attention.backend import CommonAttentionMetadata

    block, gid, kv_cache_config, groups, views = packed
    mla_group, index_group = groups
    builder = bound_indexer_builder
    block_tables = _block_tables(kv_cache_config, 128)
    configure_block_tables(block_tables, groups if mla_split else [index_group])
    pages = builder.kernel_page_slots
    assert pages is not None
    period = PAGE * mla_group.kernel_block_stride if mla_split else block
    assert (pages.block_size, pages.page_tokens) == (period, PAGE)
    assert pages.kernel_block_stride == index_group.kernel_block_stride
    # The indexer's pages are smaller than the MLA cache's in the same row.
    assert index_group.kernel_block_stride > mla_group.kernel_block_stride

    idx, qsl, positions, req_of_token, tables = _step(
        block, block_tables, len(kv_cache_config.kv_cache_groups)
    )
    n = positions.numel()
    padded = n + 7  # a CUDA graph's padding: the runner writes -1 there
    row = block_tables.compute_slot_mappings(idx, qsl, positions, padded)[gid]
    common = CommonAttentionMetadata(
        query_start_loc=qsl,
        query_start_loc_cpu=qsl.clone(),
        seq_lens=torch.tensor([block + 60, block + 701], dtype=torch.int32),
        num_reqs=2,
        num_actual_tokens=n,
        max_query_len=100,
        max_seq_len=block + 701,
        block_table_tensor=tables[gid],
        slot_mapping=row,
    )
    slots = bound_indexer_builder.build(0, common).slot_mapping
    read = _reader_slots(index_group, tables[gid], positions, req_of_token)
    assert torch.equal(slots, read), (slots - read).nonzero()
    (passed,) = recorded_base_build
    assert passed.slot_mapping is row
    # Written in place in the persistent buffer; the padding writes nowhere.
    buffer = builder.slot_mapping_buffer
    assert slots.data_ptr() == buffer.data_ptr()
    assert (buffer[n:] == -1).all()
    assert int(slots.max()) < views["index"].shape[0] * PAGE

    # A smaller step leaves no stale slot behind its padding.
    short = CommonAttentionMetadata(
        query_start_loc=qsl[:2],
        query_start_loc_cpu=qsl[:2].clone(),
        seq_lens=common.seq_lens[:1],
        num_reqs=1,
        num_actual_tokens=3,
        max_query_len=3,
        max_seq_len=block + 60,
        block_table_tensor=tables[gid][:1],
        slot_mapping=torch.cat([row[:3], row.new_full((1,), -1)]),
    )
    assert torch.equal(builder.build(0, short).slot_mapping, read[:3])
    assert (buffer[3:] == -1).all()


def test_configure_refuses_two_layouts_in_one_group(packed):
    block, gid, kv_cache_config, groups, _ = packed
    mla_group = groups[0]
    other = types.SimpleNamespace(
        backend=KimiK3FlashMLASparseBackend,
        kv_cache_group_id=gid,
        kernel_block_size=PAGE,
        kernel_block_stride=mla_group.kernel_block_stride + 1,
        kv_cache_spec=mla_group.kv_cache_spec,
    )
    with pytest.raises(
        ValueError,
        match=f"KV cache group {gid} has caches split into kernel pages in two",
    ):
        configure_block_tables(
            types.SimpleNamespace(num_kv_cache_groups=gid + 1), [mla_group, other]
        )


def test_the_v2_runner_configures_its_block_tables():
    """V2's ``initialize_kv_cache`` configures the block tables it builds and
    ``compute_slot_mappings`` remaps: through the seam in the overlay, in the
    runner's own code in-tree."""
    import inspect

    from dsa_series_mode import overlay_mode

    from vllm.v1.worker.gpu.block_table import BlockTables
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner

    apply_seam("mla_page_slots")
    hooks = (
        (GPUModelRunner.initialize_kv_cache, "configure_block_tables"),
        (BlockTables.compute_slot_mappings, "remap_slot_mapping_rows"),
    )
    for fn, call in hooks:
        if overlay_mode():
            assert getattr(fn, "_kimi_k3_dsa_page_slots", False), fn
        else:
            assert call in inspect.getsource(fn), fn


@pytest.mark.overlay_only
def test_v2_groups_include_a_draft_models_groups():
    """The seam configures the draft model's attention groups too (DSpark,
    EAGLE3 and MTP share the packed row), and nothing for a speculator
    without a model (n-gram). Real V2 classes, built without their
    ``__init__`` (which needs a GPU)."""
    from vllm.plugins.kimi_k3_dsa.mla_page_slots import _v2_attn_groups
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner
    from vllm.v1.worker.gpu.spec_decode.dspark.speculator import DSparkSpeculator
    from vllm.v1.worker.gpu.spec_decode.ngram.speculator import NgramGPUSpeculator

    runner = object.__new__(GPUModelRunner)
    runner.attn_groups = [["target-0"], ["target-1"]]
    for no_model in (None, object.__new__(NgramGPUSpeculator)):
        runner.speculator = no_model
        assert _v2_attn_groups(runner) == ["target-0", "target-1"]
    runner.speculator = object.__new__(DSparkSpeculator)
    runner.speculator.attn_groups = [["draft-0"]]
    assert _v2_attn_groups(runner) == ["target-0", "target-1", "draft-0"]
