# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""FlashMLA sparse's chunked-context workspace for the DSA layers' MLA group.

vLLM 0.33.0 sizes the workspace from ``cache_config.block_size``, capped at
``max_num_seqs * index_topk``, and aligns the context chunks to the group's
own block. In a worker in the engine core's process (TP 1), the engine core
has already lowered ``cache_config.block_size`` to the smallest prefix-cacheable
group's block before the builders are made. With the packed DSA row as the MLA
group's block and ``max_num_seqs * index_topk`` below it, the first prefill
with cached context hit vLLM's assert. On the H200 (2026-11-30) this was the
tiny checkpoint with an MTP draft and ``max_num_seqs`` 8.

Real: the engine config, the DSA layer and its ``MLAAttention``, the builder
classes and vLLM's chunk planner (``build_mla_chunked_context_metadata``).
Stubbed, because a CPU cannot answer it: ``num_compute_units`` (the GPU's SM
count, which the FlashMLA sparse builder reads for its decode buffers).
"""

from __future__ import annotations

import pytest
import torch
from layer_builders import build

from vllm.models.kimi_k3.common.dsa_cache import (
    KimiK3FlashMLASparseBackend,
    KimiK3FlashMLASparseMetadataBuilder,
    chunked_context_workspace_rows,
)

# The tiny checkpoint's packed DSA row (tests/e2e's KV report on the H200), and
# the smallest group block the engine core may leave in cache_config.
PACKED_BLOCK = 2048
SMALL_BLOCK = 64
MAX_NUM_SEQS = 8  # 8 x index_topk 128 = 1024 rows < PACKED_BLOCK


def test_workspace_rows_hold_one_aligned_chunk() -> None:
    assert chunked_context_workspace_rows(1024, 2048) == 2048
    assert chunked_context_workspace_rows(8192, 2048) == 8192
    assert chunked_context_workspace_rows(9000, 2048) == 10240
    # Under DCP the chunks align to lcm(block, interleave x DCP size).
    assert chunked_context_workspace_rows(1024, 2048, 3 * 64) == 6144
    assert chunked_context_workspace_rows(4096, 64, 2 * 64) == 4096


@pytest.fixture
def mla_builder_inputs(dsa_layer_env, monkeypatch):
    """(the DSA layer's MLA attention name, its spec with the packed block),
    with the engine core's lowered ``cache_config.block_size`` and a small
    ``max_num_seqs`` in the session's real config."""
    from vllm.v1.attention.backends.mla import flashmla_sparse

    cfg = dsa_layer_env.vllm_config
    monkeypatch.setattr(cfg.scheduler_config, "max_num_seqs", MAX_NUM_SEQS)
    monkeypatch.setattr(cfg.cache_config, "block_size", SMALL_BLOCK)
    monkeypatch.setattr(flashmla_sparse, "num_compute_units", lambda index=None: 132)
    build(dsa_layer_env)
    context = cfg.compilation_config.static_forward_context
    (name,) = [
        n
        for n, layer in context.items()
        if getattr(layer, "attn_backend", None) is KimiK3FlashMLASparseBackend
    ]
    spec = context[name].get_kv_cache_spec(cfg).copy_with_new_block_size(PACKED_BLOCK)
    return cfg, name, spec


def _plan_one_long_context(builder) -> object:
    """vLLM's chunk planner on the builder's workspace, for one prefill whose
    cached context spans several packed blocks."""
    from vllm.model_executor.layers.attention.mla_attention import (
        build_mla_chunked_context_metadata,
    )

    return build_mla_chunked_context_metadata(
        context_lens_cpu=torch.tensor([3 * PACKED_BLOCK + 5], dtype=torch.int32),
        prefill_query_start_loc_cpu=torch.tensor([0, 7], dtype=torch.int32),
        chunked_prefill_workspace=builder.chunked_prefill_workspace,
        chunked_prefill_workspace_size=builder.chunked_prefill_workspace_size,
        block_size=builder.kv_cache_spec.block_size,
        align_chunk_to_block=True,  # as on CUDA
        device=torch.device("cpu"),
        dcp_world_size=1,
        dcp_local_block_size=1,
        dcp_virtual_block_size=1,
    )


def test_upstream_builder_cannot_chunk_a_packed_block(mla_builder_inputs) -> None:
    """The failure this module guards against, on vLLM 0.33.0's own builder."""
    from vllm.v1.attention.backends.mla.flashmla_sparse import (
        FlashMLASparseMetadataBuilder,
    )

    cfg, name, spec = mla_builder_inputs
    upstream = FlashMLASparseMetadataBuilder(spec, [name], cfg, torch.device("cpu"))
    assert upstream.chunked_prefill_workspace_size == MAX_NUM_SEQS * 128
    with pytest.raises(AssertionError, match="smaller than the context chunk"):
        _plan_one_long_context(upstream)


def test_dsa_builder_chunks_a_packed_block(mla_builder_inputs) -> None:
    cfg, name, spec = mla_builder_inputs
    builder_cls = KimiK3FlashMLASparseBackend.get_builder_cls()
    assert builder_cls is KimiK3FlashMLASparseMetadataBuilder
    builder = builder_cls(spec, [name], cfg, torch.device("cpu"))
    assert builder.chunked_prefill_workspace_size == PACKED_BLOCK
    assert builder.chunked_prefill_workspace.shape[0] >= PACKED_BLOCK

    chunks = _plan_one_long_context(builder).chunks
    # One packed block per chunk, each starting on a block, the whole context.
    assert [(int(c.starts.min()), c.num_context_tokens) for c in chunks] == [
        (0, PACKED_BLOCK),
        (PACKED_BLOCK, PACKED_BLOCK),
        (2 * PACKED_BLOCK, PACKED_BLOCK),
        (3 * PACKED_BLOCK, 5),
    ]
