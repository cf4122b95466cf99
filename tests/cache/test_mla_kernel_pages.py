# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The MLA cache of Kimi K3.1's packed DSA row in 64-token kernel pages (the
Blackwell layout, forced on SM90 by ``VLLM_KIMI_K3_DSA_MLA_KERNEL_PAGES=1``),
checked on the CPU against vLLM 0.33.0's planner and allocator: the runner's
split (``kernel_block_split``) and the remapped slots (``mla_page_slots``)
address exactly the bytes the manager block holds for that layer, and no two
layers' pages overlap."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from k3_1_specs import FULL_ATTN

from vllm.models.kimi_k3.common.dsa_cache import (
    KimiK3FlashMLASparseBackend,
    KimiK3IndexerBackend,
)
from vllm.models.kimi_k3.common.dsa_envs import MLA_KERNEL_PAGES_ENV
from vllm.models.kimi_k3.common.dsa_formats import MLA_KERNEL_PAGE_TOKENS
from vllm.v1.worker.kernel_pages import (
    SLOTS_FROM_RUNNER,
    kernel_page_slots,
    token_cache_kernel_page_slots,
)

TP = 8
NUM_BLOCKS = 4
PAGE = MLA_KERNEL_PAGE_TOKENS


@pytest.fixture
def allocated(packed_kimi_k3_1):
    """Kimi K3.1's TP 8 caches through the real planner and allocator."""
    from vllm.v1.kv_cache_interface import KVCacheLayout
    from vllm.v1.worker.utils import allocate_kv_cache

    block, _, kv_cache_config = packed_kimi_k3_1(NUM_BLOCKS)
    caches = allocate_kv_cache(
        kv_cache_config, torch.device("cpu"), KVCacheLayout.BLHNC
    )
    return block, kv_cache_config, caches


def _split(name: str, kv_cache_config, cache: torch.Tensor):
    """The runner's view of one layer's cache, split by our seam, and its
    attention group (kernel_block_stride set by the split)."""
    from dsa_series_mode import apply_seam

    from vllm.v1.worker.utils import AttentionGroup

    apply_seam("kernel_block_split")
    gid, group = next(
        (i, g)
        for i, g in enumerate(kv_cache_config.kv_cache_groups)
        if name in g.layer_names
    )
    backend = (
        KimiK3FlashMLASparseBackend if name.endswith(".mla") else (KimiK3IndexerBackend)
    )
    attn_group = AttentionGroup(
        backend=backend,
        layer_names=[name],
        kv_cache_spec=group.kv_cache_spec.kv_cache_specs[name],
        kv_cache_group_id=gid,
        kernel_block_size=PAGE,
    )
    return attn_group.map_kv_cache_to_kernel_blocks(cache), attn_group


def test_mla_backend_is_ours_and_splits_only_when_forced(monkeypatch):
    from vllm.v1.attention.backend import MultipleOf
    from vllm.v1.attention.backends.mla.flashmla_sparse import FlashMLASparseBackend

    # The runner may split its cache because it hands it kernel-page slots;
    # upstream's FlashMLA sparse keeps the default (not split).
    assert token_cache_kernel_page_slots(KimiK3FlashMLASparseBackend) == (
        SLOTS_FROM_RUNNER
    )
    assert token_cache_kernel_page_slots(FlashMLASparseBackend) is None
    assert KimiK3FlashMLASparseBackend.get_name() == "FLASHMLA_SPARSE"
    monkeypatch.delenv(MLA_KERNEL_PAGES_ENV, raising=False)
    assert KimiK3FlashMLASparseBackend.get_supported_kernel_block_sizes() == [
        MultipleOf(64)
    ]
    monkeypatch.setenv(MLA_KERNEL_PAGES_ENV, "1")
    assert KimiK3FlashMLASparseBackend.get_supported_kernel_block_sizes() == [64]
    monkeypatch.setenv(MLA_KERNEL_PAGES_ENV, "2")
    with pytest.raises(ValueError, match="VLLM_KIMI_K3_DSA_MLA_KERNEL_PAGES='2'"):
        KimiK3FlashMLASparseBackend.get_supported_kernel_block_sizes()


def test_dsa_layers_get_our_mla_backend():
    from vllm.models.kimi_k3.nvidia.dsa import use_kimi_k3_mla_backend
    from vllm.v1.attention.backends.mla.flashmla_sparse import FlashMLASparseBackend

    attn = SimpleNamespace(attn_backend=FlashMLASparseBackend, impl=object())
    use_kimi_k3_mla_backend(attn)
    assert attn.attn_backend is KimiK3FlashMLASparseBackend
    other = SimpleNamespace(attn_backend=KimiK3IndexerBackend, impl=object())
    use_kimi_k3_mla_backend(other)
    assert other.attn_backend is KimiK3IndexerBackend


def test_kernel_page_slots_formula():
    slots = torch.tensor([-1, 0, 63, 64, 1023, 1024, 3 * 1024 + 700, -1])
    paged = kernel_page_slots(slots, 1024, 64, 40)
    # Block b starts at page b * 40; the offset inside the block is kept.
    assert paged.tolist() == [-1, 0, 63, 64, 1023, 2560, 3 * 2560 + 700, -1]
    out = torch.full_like(slots, 7)
    assert kernel_page_slots(slots, 1024, 64, 40, out=out) is out
    assert torch.equal(out, paged)
    # In place, as Model Runner V2 remaps its persistent slot-mapping rows.
    in_place = slots.clone()
    assert kernel_page_slots(in_place, 1024, 64, 40, out=in_place) is in_place
    assert torch.equal(in_place, paged)
    assert kernel_page_slots(slots, 1024, 64, 16).tolist() == slots.tolist()
    with pytest.raises(ValueError, match="cannot hold 1024-token blocks"):
        kernel_page_slots(slots, 1024, 64, 15)
    with pytest.raises(ValueError):
        kernel_page_slots(slots, 1000, 64, 40)


def test_split_mla_pages_address_their_own_layers_bytes(allocated):
    """Every token of every block, written through the split view at its
    remapped slot, lands at that token of that block in the manager view;
    written for all 24 MLA and 24 indexer caches with a per-layer marker,
    every layer reads back only its own marker (no two layers' pages
    overlap), and the KDA state groups' bytes stay untouched."""
    block, kv_cache_config, caches = allocated
    assert block == 1024
    mla_names = [f"l{i}.mla" for i in FULL_ATTN]
    index_names = [f"l{i}.index" for i in FULL_ATTN]
    manager_slots = torch.arange(NUM_BLOCKS * block)
    for marker, name in enumerate(mla_names + index_names, start=1):
        pages, group = _split(name, kv_cache_config, caches[name])
        cache = caches[name]
        stride = group.kernel_block_stride
        assert stride * PAGE * cache.shape[-1] == cache.stride(0)
        paged = kernel_page_slots(manager_slots, block, PAGE, stride)
        rows = pages.reshape(pages.shape[0], PAGE, pages.shape[-1])
        token = manager_slots % block
        # Byte 0: the layer; byte 1: the block; byte 2: the token's low byte.
        rows[paged // PAGE, paged % PAGE, 0] = marker
        rows[paged // PAGE, paged % PAGE, 1] = (manager_slots // block).byte()
        rows[paged // PAGE, paged % PAGE, 2] = token.byte()
    for marker, name in enumerate(mla_names + index_names, start=1):
        view = caches[name].reshape(NUM_BLOCKS, block, -1)
        assert (view[..., 0] == marker).all(), name
        assert torch.equal(
            view[..., 1], torch.arange(NUM_BLOCKS).byte()[:, None].expand(-1, block)
        ), name
        assert torch.equal(
            view[..., 2], torch.arange(block).byte()[None, :].expand(NUM_BLOCKS, -1)
        ), name


def _fake_runner(kv_cache_config, groups_by_gid, num_slots):
    block_tables = [
        SimpleNamespace(slot_mapping=SimpleNamespace(gpu=torch.full((num_slots,), -1)))
        for _ in kv_cache_config.kv_cache_groups
    ]
    return SimpleNamespace(
        attn_groups=groups_by_gid,
        kv_cache_config=kv_cache_config,
        input_batch=SimpleNamespace(block_table=block_tables),
    )


def test_runner_slots_are_remapped_for_split_mla_groups(allocated):
    """The seam replaces the slot mapping of the KV cache group whose MLA
    attention group is split, for the metadata (by group) and the forward
    context (by layer, and per micro-batch), in one persistent buffer; other
    groups keep theirs."""
    from vllm.v1.worker.kernel_pages import remap_slot_mappings

    block, kv_cache_config, caches = allocated
    gid = next(
        i for i, g in enumerate(kv_cache_config.kv_cache_groups)
        if "l3.mla" in g.layer_names
    )  # fmt: skip
    _, mla_group = _split("l3.mla", kv_cache_config, caches["l3.mla"])
    groups = [[] for _ in kv_cache_config.kv_cache_groups]
    groups[gid] = [mla_group]
    runner = _fake_runner(kv_cache_config, groups, 64)
    manager = runner.input_batch.block_table[gid].slot_mapping.gpu[:6]
    manager.copy_(torch.tensor([0, 5, block, 2 * block + 3, -1, -1]))
    other_gid = next(i for i in range(len(groups)) if i != gid)
    other = runner.input_batch.block_table[other_gid].slot_mapping.gpu[:6]
    by_gid = {gid: manager, other_gid: other}
    names = kv_cache_config.kv_cache_groups[gid].layer_names
    by_layer = {name: manager for name in names}
    by_gid, by_layer = remap_slot_mappings(runner, by_gid, by_layer, None)
    span = mla_group.kernel_block_stride * PAGE
    expected = [0, 5, span, 2 * span + 3, -1, -1]
    assert by_gid[gid].tolist() == expected
    assert by_gid[other_gid] is other
    assert all(by_layer[name] is by_gid[gid] for name in names)
    # The manager slots themselves are left as the block table wrote them.
    assert manager.tolist() == [0, 5, block, 2 * block + 3, -1, -1]
    # Twice in a step (execute and a dummy run) gives the same slots.
    again, _ = remap_slot_mappings(runner, {gid: manager}, {}, None)
    assert again[gid].tolist() == expected
    assert again[gid].data_ptr() == by_gid[gid].data_ptr()
    # Micro-batches slice the remapped buffer.
    ubatches = [SimpleNamespace(token_slice=slice(0, 2)),
                SimpleNamespace(token_slice=slice(2, 6))]  # fmt: skip
    sliced = [{names[0]: manager[:2]}, {names[0]: manager[2:]}]
    _, sliced = remap_slot_mappings(runner, {gid: manager}, sliced, ubatches)
    assert sliced[0][names[0]].tolist() == expected[:2]
    assert sliced[1][names[0]].tolist() == expected[2:]


def test_the_runner_asks_the_backend_capability_not_its_type(allocated):
    """Which split groups get kernel-page slots is the backend's
    ``token_cache_kernel_page_slots``: any backend that declares ``"runner"``
    does, ours with the attribute cleared and a builder-slot backend do not,
    and an undeclared value is refused naming the accepted ones."""
    from vllm.v1.attention.backends.mla.flashmla_sparse import FlashMLASparseBackend
    from vllm.v1.worker.kernel_pages import kernel_page_slot_groups

    _, kv_cache_config, caches = allocated
    _, mla_group = _split("l3.mla", kv_cache_config, caches["l3.mla"])
    gid = mla_group.kv_cache_group_id

    def with_backend(backend: type) -> SimpleNamespace:
        return SimpleNamespace(**{**vars(mla_group), "backend": backend})

    class OtherRunnerSlots(FlashMLASparseBackend):
        token_cache_kernel_page_slots = SLOTS_FROM_RUNNER

    class NotDeclared(KimiK3FlashMLASparseBackend):
        token_cache_kernel_page_slots = None

    class Misdeclared(FlashMLASparseBackend):
        token_cache_kernel_page_slots = "yes"

    assert set(kernel_page_slot_groups([with_backend(OtherRunnerSlots)])) == {gid}
    assert kernel_page_slot_groups([with_backend(NotDeclared)]) == {}
    assert kernel_page_slot_groups([with_backend(KimiK3IndexerBackend)]) == {}
    with pytest.raises(ValueError, match="'yes'; accepted: None, 'builder'"):
        kernel_page_slot_groups([with_backend(Misdeclared)])


def test_runner_slots_untouched_without_a_split(allocated):
    from vllm.v1.worker.kernel_pages import remap_slot_mappings
    from vllm.v1.worker.utils import AttentionGroup

    _, kv_cache_config, _ = allocated
    group = AttentionGroup(
        backend=KimiK3FlashMLASparseBackend,
        layer_names=["l3.mla"],
        kv_cache_spec=kv_cache_config.kv_cache_groups[0].kv_cache_spec,
        kv_cache_group_id=0,
    )
    runner = _fake_runner(kv_cache_config, [[group]], 8)
    slots = torch.arange(8)
    by_gid, by_layer = remap_slot_mappings(runner, {0: slots}, {"l3.mla": slots}, None)
    assert by_gid[0] is slots and by_layer["l3.mla"] is slots


def test_multi_step_drafts_with_kernel_pages_need_model_runner_v2(
    monkeypatch, vllm_config_for
):
    from vllm.models.kimi_k3.common.dsa_verify import check_mla_kernel_pages

    cfg = vllm_config_for()
    monkeypatch.setenv(MLA_KERNEL_PAGES_ENV, "1")
    check_mla_kernel_pages(cfg)  # no draft
    monkeypatch.setattr(
        cfg, "speculative_config", SimpleNamespace(num_speculative_tokens=1)
    )
    check_mla_kernel_pages(cfg)
    monkeypatch.setattr(
        cfg, "speculative_config", SimpleNamespace(num_speculative_tokens=2)
    )
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")
    with pytest.raises(
        NotImplementedError,
        match=r"num_speculative_tokens=2 is not supported .* 64-token kernel pages"
        r" .* under Model Runner V1",
    ):
        check_mla_kernel_pages(cfg)
    # Model Runner V2 (every GPU host's) remaps the drafts' slot mappings.
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    check_mla_kernel_pages(cfg)
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")
    monkeypatch.setenv(MLA_KERNEL_PAGES_ENV, "0")
    check_mla_kernel_pages(cfg)  # SM90 pages of whole blocks: no remap needed


def test_runner_splits_the_mla_group_only_when_forced(allocated, monkeypatch):
    """In a packed KV cache group each attention group picks its kernel block
    from the manager block (``create_metadata_builders`` calls
    ``select_common_block_size``): whole blocks for FlashMLA sparse on SM90,
    64-token pages with the forced layout (and always for the indexer)."""
    from vllm.v1.worker.utils import select_common_block_size

    block, kv_cache_config, _ = allocated
    group = next(
        g for g in kv_cache_config.kv_cache_groups if "l3.mla" in g.layer_names
    )
    mla_spec = group.kv_cache_spec.kv_cache_specs["l3.mla"]
    index_spec = group.kv_cache_spec.kv_cache_specs["l3.index"]
    monkeypatch.delenv(MLA_KERNEL_PAGES_ENV, raising=False)
    assert (
        select_common_block_size(block, [KimiK3FlashMLASparseBackend], [mla_spec])
        == block
    )
    assert select_common_block_size(block, [KimiK3IndexerBackend], [index_spec]) == PAGE
    monkeypatch.setenv(MLA_KERNEL_PAGES_ENV, "1")
    assert (
        select_common_block_size(block, [KimiK3FlashMLASparseBackend], [mla_spec])
        == PAGE
    )
