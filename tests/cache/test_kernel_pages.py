# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The generic kernel-page helpers (``vllm/v1/worker/kernel_pages.py``) on
plain tensors, with no model: the capability a backend declares, the page
view of one cache of a packed block row, and the slot remapping the runners
apply. The Kimi K3.1 caches that use them: ``test_mla_kernel_pages.py``."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from vllm.v1.worker.kernel_pages import (
    SLOTS_FROM_BUILDER,
    SLOTS_FROM_RUNNER,
    KernelPageSlots,
    bind_builder_kernel_pages,
    configure_block_tables,
    kernel_page_slot_groups,
    remap_slot_mapping_rows,
    split_packed_rows_into_kernel_pages,
    token_cache_kernel_page_slots,
)

BLOCKS, TOKENS, WIDTH, PAGE = 3, 256, 8, 64


def packed_rows() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Two caches of ``TOKENS`` tokens packed in each block's row (the first
    then the second), every element its own index."""
    row = 2 * TOKENS * WIDTH
    storage = torch.arange(BLOCKS * row, dtype=torch.int64)
    first = storage.as_strided((BLOCKS, TOKENS, WIDTH), (row, WIDTH, 1))
    second = storage.as_strided(
        (BLOCKS, TOKENS, WIDTH), (row, WIDTH, 1), TOKENS * WIDTH
    )
    return storage, first, second


class Backend:
    pass


@pytest.mark.parametrize("value", [None, SLOTS_FROM_BUILDER, SLOTS_FROM_RUNNER])
def test_the_capability_a_backend_declares(value) -> None:
    backend = type("B", (Backend,), {"token_cache_kernel_page_slots": value})
    assert token_cache_kernel_page_slots(backend) == value
    assert token_cache_kernel_page_slots(Backend) is None


def test_a_bad_capability_is_refused_by_name() -> None:
    backend = type("Odd", (Backend,), {"token_cache_kernel_page_slots": "both"})
    with pytest.raises(
        ValueError, match=r"Odd.token_cache_kernel_page_slots is 'both'"
    ):
        token_cache_kernel_page_slots(backend)


@pytest.mark.parametrize("which", [0, 1])
def test_pages_of_a_packed_cache_view_its_own_tokens(which: int) -> None:
    _, *caches = packed_rows()
    cache = caches[which]
    pages, stride = split_packed_rows_into_kernel_pages(cache, PAGE)
    assert stride == 2 * TOKENS // PAGE  # pages per block row
    for block in range(BLOCKS):
        for j in range(TOKENS // PAGE):
            page = pages[block * stride + j]
            assert torch.equal(page, cache[block, j * PAGE : (j + 1) * PAGE])


def test_a_cache_that_does_not_split_is_refused() -> None:
    _, first, _ = packed_rows()
    with pytest.raises(ValueError, match="cannot be split into 96-token"):
        split_packed_rows_into_kernel_pages(first, 96)
    odd = first.as_strided((BLOCKS, TOKENS, WIDTH), (first.stride(0) - WIDTH, WIDTH, 1))
    with pytest.raises(ValueError, match="cannot be split into 64-token"):
        split_packed_rows_into_kernel_pages(odd, PAGE)


def test_remapped_slots_address_the_same_token_through_the_pages() -> None:
    _, _, cache = packed_rows()
    pages, stride = split_packed_rows_into_kernel_pages(cache, PAGE)
    flat_pages = pages.reshape(-1, WIDTH)
    slots = torch.tensor([0, 5, 63, 64, 255, 256, 300, 767, -1])
    remapped = KernelPageSlots(TOKENS, PAGE, stride).remap(
        slots, out=torch.full_like(slots, 99)
    )
    assert remapped[-1] == -1
    for slot, paged in zip(slots[:-1].tolist(), remapped[:-1].tolist(), strict=True):
        block, offset = divmod(slot, TOKENS)
        assert torch.equal(flat_pages[paged], cache[block, offset])


def _group(gid: int, capability, pages: int | None, stride: int = 8):
    backend = type("B", (Backend,), {"token_cache_kernel_page_slots": capability})
    return SimpleNamespace(
        kv_cache_group_id=gid,
        backend=backend,
        kernel_block_size=pages,
        kernel_block_stride=stride,
        kv_cache_spec=SimpleNamespace(block_size=TOKENS),
        metadata_builders=[],
    )


def test_only_groups_whose_backend_asks_the_runner_are_remapped() -> None:
    groups = [
        _group(0, SLOTS_FROM_RUNNER, PAGE),
        _group(1, SLOTS_FROM_BUILDER, PAGE),
        _group(2, None, PAGE),
        _group(3, SLOTS_FROM_RUNNER, None),  # not split
    ]
    found = kernel_page_slot_groups(groups)
    assert found == {0: KernelPageSlots(TOKENS, PAGE, 8)}
    rows = torch.tensor([[0, 256, -1], [0, 256, -1]])
    remap_slot_mapping_rows(rows, found)
    assert rows.tolist() == [[0, 512, -1], [0, 256, -1]]
    tables = SimpleNamespace(num_kv_cache_groups=2)
    configure_block_tables(tables, groups)
    assert tables.kernel_page_slot_groups == found


class _RecordingBuilder:
    def __init__(self) -> None:
        self.bound: list[KernelPageSlots] = []

    def bind_kernel_page_slots(self, pages: KernelPageSlots) -> None:
        self.bound.append(pages)


def test_builder_groups_learn_the_period_of_their_slot_mapping() -> None:
    """A ``"builder"`` group sharing a gid with a remapped runner group sees
    runner kernel-page slots; one alone sees manager-block slots."""
    shared, alone, unsplit = (
        _RecordingBuilder(),
        _RecordingBuilder(),
        _RecordingBuilder(),
    )
    groups = [
        _group(0, SLOTS_FROM_RUNNER, PAGE),
        _group(0, SLOTS_FROM_BUILDER, 32, stride=4),
        _group(1, SLOTS_FROM_BUILDER, 32, stride=4),
        _group(2, SLOTS_FROM_BUILDER, None),
    ]
    groups[1].metadata_builders = [shared, object()]
    groups[2].metadata_builders = [alone]
    groups[3].metadata_builders = [unsplit]
    bind_builder_kernel_pages(groups, kernel_page_slot_groups(groups))
    assert shared.bound == [KernelPageSlots(PAGE * 8, 32, 4)]
    assert alone.bound == [KernelPageSlots(TOKENS, 32, 4)]
    assert unsplit.bound == []
    # configure_block_tables binds them too.
    shared.bound.clear()
    configure_block_tables(SimpleNamespace(num_kv_cache_groups=3), groups)
    assert shared.bound == [KernelPageSlots(PAGE * 8, 32, 4)]


def test_one_group_split_two_ways_is_refused() -> None:
    groups = [_group(0, SLOTS_FROM_RUNNER, PAGE), _group(0, SLOTS_FROM_RUNNER, 32)]
    with pytest.raises(ValueError, match="split into kernel pages in two ways"):
        kernel_page_slot_groups(groups)
    with pytest.raises(ValueError, match="not one of the runner's 0 block tables"):
        configure_block_tables(
            SimpleNamespace(num_kv_cache_groups=0), [_group(0, SLOTS_FROM_RUNNER, PAGE)]
        )
