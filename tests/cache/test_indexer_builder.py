# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""KimiK3IndexerMetadataBuilder's slot mapping through the runner's own
kernel-block mapping, the kernel-page split seam, and the PCP refusals.

Real: the engine config, KimiK3IndexerCache and its spec, the runner's
``AttentionGroup`` (builder creation, kernel block table, cache mapping),
``get_compressed_slot_mapping`` and the body of its Triton kernel.
Stubbed, because a CPU cannot do it:

* the Triton *launch*: vLLM launches the kernel through a CUDA launcher; here
  the same kernel body runs under Triton's CPU interpreter
  (``TRITON_INTERPRET=1``);
* the base ``DeepseekV32IndexerMetadataBuilder.build``, which plans DeepGEMM
  decode scheduling on the GPU: it is replaced by a recorder of the metadata
  our builder hands it (``recorded_base_build`` in conftest.py).
"""

from __future__ import annotations

import types
from types import SimpleNamespace

import pytest
import torch

from vllm.models.kimi_k3.common import dsa_cache
from vllm.models.kimi_k3.common.dsa_cache import (
    KimiK3IndexerBackend,
    KimiK3IndexerCache,
    KimiK3IndexerMetadataBuilder,
)

MANAGER_BLOCK = 256
KERNEL_BLOCK = 64
ENTRY = 132
MLA_PAGE = 656 * MANAGER_BLOCK
INDEX_PAGE = ENTRY * MANAGER_BLOCK
# The planner pads the block stride to whole 64-token indexer pages
# (block_stride_alignment=MultipleOf(64)).
KERNEL_PAGE_BYTES = KERNEL_BLOCK * ENTRY
ROW = -(-(MLA_PAGE + INDEX_PAGE) // KERNEL_PAGE_BYTES) * KERNEL_PAGE_BYTES
NUM_BLOCKS = 6


@pytest.fixture
def interpreted_slot_kernel(monkeypatch):
    import triton
    import triton.language as tl

    from vllm.v1.attention.backends.mla import compressor_utils

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    body = compressor_utils.CompressedSlotMappingKernel.__dict__["kernel"]
    body = getattr(body, "__func__", body)
    body = getattr(body, "fn", body)
    globals_ = dict(body.__globals__, tl=tl, triton=triton)
    fn = types.FunctionType(
        body.__code__, globals_, body.__name__, body.__defaults__, body.__closure__
    )
    kernel = triton.jit(do_not_specialize=["block_table_stride"])(fn)
    calls = []

    def launch(
        out, slot_mapping, query_start_loc, seq_lens, block_table, block_size,
        compress_ratio, dcp_world_size, cp_interleave,
    ):  # fmt: skip
        calls.append((block_size, compress_ratio))
        kernel[(block_table.shape[0],)](
            out, slot_mapping, query_start_loc, seq_lens, block_table,
            block_table.stride(0), block_size, dcp_world_size, cp_interleave,
            COMPRESS_RATIO=compress_ratio, PAD_ID=-1, TRITON_BLOCK_SIZE=1024,
        )  # fmt: skip
        return out

    monkeypatch.setattr(compressor_utils, "_COMPRESSED_SLOT_MAPPING_KERNEL", launch)
    return calls


@pytest.fixture
def indexer_group(vllm_config_for):
    """A runner AttentionGroup of one KimiK3IndexerCache over a packed
    block-outermost row: [MLA page | indexer page | padding] per block."""
    from dsa_series_mode import apply_seam

    from vllm.config import set_current_vllm_config
    from vllm.v1.worker.utils import AttentionGroup

    apply_seam("kernel_block_split")
    cfg = vllm_config_for()
    prefix = "builder.layers.3.self_attn.indexer.k_cache"
    with set_current_vllm_config(cfg):
        cache = KimiK3IndexerCache(
            head_dim=ENTRY,
            dtype=torch.uint8,
            prefix=prefix,
            cache_config=cfg.cache_config,
        )
        spec = cache.get_kv_cache_spec(cfg).copy_with_new_block_size(MANAGER_BLOCK)
        group = AttentionGroup(
            backend=cache.get_attn_backend(),
            layer_names=[prefix],
            kv_cache_spec=spec,
            kv_cache_group_id=0,
        )
        group.create_metadata_builders(
            cfg, torch.device("cpu"), kernel_block_size=KERNEL_BLOCK
        )
    raw = torch.zeros(NUM_BLOCKS, ROW, dtype=torch.uint8)
    kv_cache = raw[:, MLA_PAGE : MLA_PAGE + INDEX_PAGE].view(
        NUM_BLOCKS, 1, MANAGER_BLOCK, ENTRY
    )
    yield SimpleNamespace(cfg=cfg, group=group, kv_cache=kv_cache, raw=raw)
    cfg.compilation_config.static_forward_context.pop(prefix, None)


def test_runner_splits_our_packed_row_into_kernel_pages(indexer_group):
    group, kv_cache = indexer_group.group, indexer_group.kv_cache
    assert group.kernel_block_size == KERNEL_BLOCK
    view = group.map_kv_cache_to_kernel_blocks(kv_cache)
    stride = ROW // KERNEL_PAGE_BYTES
    assert group.kernel_block_stride == stride
    assert view.shape[1:] == (1, KERNEL_BLOCK, ENTRY)
    # Kernel page b * stride + j is rows [64 j, 64 j + 64) of manager block b.
    for b in range(NUM_BLOCKS):
        for j in range(MANAGER_BLOCK // KERNEL_BLOCK):
            for r in (0, 17, 63):
                assert (
                    view[b * stride + j, 0, r].data_ptr()
                    == kv_cache[b, 0, j * KERNEL_BLOCK + r].data_ptr()
                )


def test_runner_keeps_refusing_other_token_caches(indexer_group):
    from vllm.v1.attention.backends.mla.indexer import DeepseekV32IndexerBackend
    from vllm.v1.worker.utils import AttentionGroup

    other = AttentionGroup(
        backend=DeepseekV32IndexerBackend,
        layer_names=["other"],
        kv_cache_spec=indexer_group.group.kv_cache_spec,
        kv_cache_group_id=0,
        kernel_block_size=KERNEL_BLOCK,
    )
    with pytest.raises(ValueError, match="cannot be split"):
        other.map_kv_cache_to_kernel_blocks(indexer_group.kv_cache)


def test_unsplittable_row_is_refused(indexer_group):
    # A block stride that is not whole kernel pages cannot be addressed.
    raw = torch.zeros(NUM_BLOCKS, ROW + 4, dtype=torch.uint8)
    bad = raw[:, :INDEX_PAGE].view(NUM_BLOCKS, 1, MANAGER_BLOCK, ENTRY)
    with pytest.raises(ValueError, match="cannot be split into 64-token"):
        indexer_group.group.map_kv_cache_to_kernel_blocks(bad)


def test_builder_slots_follow_the_kernel_block_table(
    indexer_group, interpreted_slot_kernel, recorded_base_build
):
    from vllm.v1.attention.backend import CommonAttentionMetadata

    group = indexer_group.group
    view = group.map_kv_cache_to_kernel_blocks(indexer_group.kv_cache)
    stride = group.kernel_block_stride
    builder = group.get_metadata_builder()
    assert isinstance(builder, KimiK3IndexerMetadataBuilder)

    manager_table = torch.tensor([[4, 1, 5], [2, 0, 3]], dtype=torch.int32)
    # Request 0 decodes 4 tokens across a kernel-page boundary (318..321),
    # request 1 prefills 70 tokens (0..69) whose last is padding.
    positions = [list(range(318, 322)), list(range(0, 70))]
    seq_lens = torch.tensor([322, 70], dtype=torch.int32)
    query_start_loc = torch.tensor([0, 4, 74], dtype=torch.int32)
    manager_slots = []
    for req, pos_list in enumerate(positions):
        for p in pos_list:
            block = int(manager_table[req, p // MANAGER_BLOCK])
            manager_slots.append(block * MANAGER_BLOCK + p % MANAGER_BLOCK)
    manager_slots[-1] = -1  # a padded token: must never be written
    num_tokens = len(manager_slots)
    common = CommonAttentionMetadata(
        query_start_loc=query_start_loc,
        query_start_loc_cpu=query_start_loc.clone(),
        seq_lens=seq_lens,
        num_reqs=2,
        num_actual_tokens=num_tokens,
        max_query_len=70,
        max_seq_len=322,
        block_table_tensor=manager_table,
        slot_mapping=torch.tensor(manager_slots, dtype=torch.int64),
    )
    built = group.build_metadata(common)

    # Hand-computed: kernel page = manager block * stride + (p % 256) // 64.
    expected = []
    for req, pos_list in enumerate(positions):
        for p in pos_list:
            block = int(manager_table[req, p // MANAGER_BLOCK])
            page = block * stride + (p % MANAGER_BLOCK) // KERNEL_BLOCK
            expected.append(page * KERNEL_BLOCK + p % KERNEL_BLOCK)
    expected[-1] = -1
    # The base build saw the runner's slot mapping, untouched; the indexer's
    # metadata carries the kernel-page slots.
    (passed,) = recorded_base_build
    assert passed.slot_mapping is common.slot_mapping
    assert common.slot_mapping.tolist() == manager_slots
    slots = built.slot_mapping
    assert slots.tolist() == expected
    # The manager slots would have written other layers' pages.
    assert slots.tolist() != manager_slots
    # The kernel got the kernel block size and no compression.
    assert interpreted_slot_kernel == [(KERNEL_BLOCK, 1)]
    # Written into the preallocated buffer, whose tail stays "do not write".
    assert slots.data_ptr() == builder.slot_mapping_buffer.data_ptr()
    assert (builder.slot_mapping_buffer[num_tokens:] == -1).all()
    # Each slot addresses the token's row of its manager block.
    for req, pos_list in enumerate(positions):
        for i, p in enumerate(pos_list):
            slot = expected[int(query_start_loc[req]) + i]
            if slot < 0:
                continue
            block = int(manager_table[req, p // MANAGER_BLOCK])
            assert (
                view[slot // KERNEL_BLOCK, 0, slot % KERNEL_BLOCK].data_ptr()
                == indexer_group.kv_cache[block, 0, p % MANAGER_BLOCK].data_ptr()
            )


def test_builder_validates_the_key_format(indexer_group, monkeypatch):
    # Stub: answer "SM10x" for 0.33.0's MXFP4 capability check; the tiny
    # model's layernorm k-norm and no rope make MXFP4 valid.
    from vllm.v1.attention.backends.mla import indexer

    monkeypatch.setattr(indexer, "dsa_indexer_uses_fp4", lambda cfg: True)
    group = indexer_group.group
    spec = group.kv_cache_spec.copy_with_new_block_size(KERNEL_BLOCK)
    builder = KimiK3IndexerMetadataBuilder(
        spec, group.layer_names, indexer_group.cfg, torch.device("cpu"),
        block_table_width=16,
    )  # fmt: skip
    assert builder.indexer_uses_fp4 is True

    def refuse(cfg):
        raise ValueError("indexer_kv_dtype='mxfp4' needs the fused key insert")

    monkeypatch.setattr(dsa_cache, "kimi_k3_indexer_uses_fp4", refuse)
    with pytest.raises(ValueError, match="fused key insert"):
        KimiK3IndexerMetadataBuilder(
            spec, group.layer_names, indexer_group.cfg, torch.device("cpu"),
            block_table_width=16,
        )  # fmt: skip


def test_builder_refuses_pcp():
    from vllm.models.kimi_k3.common.dsa_verify import check_dsa_pcp

    # Stub config: only the parallel layout is read before the refusal.
    cfg = SimpleNamespace(
        parallel_config=SimpleNamespace(prefill_context_parallel_size=2)
    )
    with pytest.raises(NotImplementedError, match="packed DSA caches with PCP"):
        KimiK3IndexerMetadataBuilder(None, [], cfg, torch.device("cpu"))
    with pytest.raises(NotImplementedError, match="packed DSA caches with PCP"):
        check_dsa_pcp(cfg.parallel_config)
    check_dsa_pcp(SimpleNamespace(prefill_context_parallel_size=1))


def test_pcp_refused_at_startup(tiny_checkpoint, engine_config):
    """The real configuration path refuses PCP for Kimi K3.1 before any
    worker starts."""
    with pytest.raises(NotImplementedError, match="packed DSA caches with PCP"):
        engine_config(tiny_checkpoint(), prefill_context_parallel_size=2)


def test_backend_declares_kernel_page_slots():
    from vllm.v1.attention.backends.mla.indexer import DeepseekV32IndexerBackend
    from vllm.v1.worker.kernel_pages import (
        SLOTS_FROM_BUILDER,
        token_cache_kernel_page_slots,
    )

    # Its builder writes at kernel-page slots, so the runner may split it.
    assert token_cache_kernel_page_slots(KimiK3IndexerBackend) == SLOTS_FROM_BUILDER
    assert token_cache_kernel_page_slots(DeepseekV32IndexerBackend) is None
    assert token_cache_kernel_page_slots(None) is None
