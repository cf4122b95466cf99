# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""``sparse_mla_fp8`` on the GPU: against its reference on fresh random
caches (packed-row strides, -1 and out-of-cache slots, a row that selects
nothing, odd top-k, 12 to 64 heads, every split count), under CUDA-graph
replay, and against vLLM 0.33.0's FlashMLA sparse decode with the heads
padded to 64."""

from __future__ import annotations

import math

import pytest
import test_sparse_mla as cpu_tests
import torch
from dsa_gpu_utils import flashmla_sparse_decode_op, requires_consumers, requires_cuda

from vllm.models.kimi_k3.nvidia.dsa_ops.sparse_mla import (
    QK_DIM,
    TILE_CANDIDATES,
    sparse_mla_fp8,
    sparse_mla_fp8_reference,
)

pytestmark = [pytest.mark.gpu, requires_cuda]

SCALE = 1 / math.sqrt(192)
BLOCK = 64


def packed_cache(blocks: int, gap: int, seed: int) -> torch.Tensor:
    """Blocks ``gap`` bytes apart in a larger row (the packed DSA row)."""
    return cpu_tests.packed_cache(blocks, BLOCK, gap, seed, device="cuda")[0]


def random_indices(tokens: int, k: int, slots: int, seed: int) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed)
    idx = torch.randint(0, slots, (tokens, k), device="cuda", generator=g)
    idx = idx.int()
    idx[:, ::7] = -1
    idx[0, 1] = slots + 3
    if tokens > 2:
        idx[1] = -1
    return idx


@pytest.mark.parametrize(
    ("tokens", "heads", "k", "splits"),
    [(1, 12, 2048, None), (5, 12, 2048, 1), (3, 16, 1000, 7), (64, 20, 2048, None),
     (17, 64, 333, None), (300, 12, 2048, None)],
)  # fmt: skip
def test_matches_the_reference(tokens: int, heads: int, k: int, splits) -> None:
    cache = packed_cache(blocks=40, gap=200, seed=tokens)
    slots = cache.shape[0] * BLOCK
    g = torch.Generator(device="cuda").manual_seed(heads)
    q = torch.randn(tokens, heads + 2, QK_DIM, device="cuda", generator=g)
    q = q.bfloat16()[:, 1 : heads + 1]
    idx = random_indices(tokens, k, slots, seed=k)
    out, lse = sparse_mla_fp8(q, cache, idx, SCALE, num_splits=splits)
    ref_out, ref_lse = sparse_mla_fp8_reference(q, cache, idx, SCALE)
    torch.testing.assert_close(out.float(), ref_out.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse, ref_lse, atol=1e-3, rtol=1e-3)
    # The same inputs, the same bits.
    again, _ = sparse_mla_fp8(q, cache, idx, SCALE, num_splits=splits)
    assert torch.equal(again, out)


@pytest.mark.parametrize("name", sorted(TILE_CANDIDATES))
def test_every_tile_candidate_matches_the_reference(name: str) -> None:
    cache = packed_cache(blocks=40, gap=200, seed=5)
    q = torch.randn(9, 12, QK_DIM, device="cuda").bfloat16()
    idx = random_indices(9, 2048, cache.shape[0] * BLOCK, seed=6)
    tiles = TILE_CANDIDATES[name]
    out, lse = sparse_mla_fp8(q, cache, idx, SCALE, tiles=tiles)
    ref_out, ref_lse = sparse_mla_fp8_reference(q, cache, idx, SCALE)
    torch.testing.assert_close(out.float(), ref_out.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse, ref_lse, atol=1e-3, rtol=1e-3)
    if tiles.fp16_latent:
        # q past fp16's range, scaled back in by a power of two: the same bits.
        big = sparse_mla_fp8(q * 2**18, cache, idx, SCALE / 2**18, tiles=tiles)
        assert torch.equal(big[0], out) and torch.equal(big[1], lse)


@pytest.mark.parametrize("inline_ptx", [True, False])
def test_fp16_widening_of_every_code(inline_ptx: bool) -> None:
    codes, scales, out = cpu_tests.widened_codes("cuda", inline_ptx)
    real = torch.ones(256, dtype=torch.bool, device="cuda")
    real[list(cpu_tests.NAN_CODES)] = False
    expected = cpu_tests.expected_widening(codes, scales)
    assert torch.equal(out[real], expected[real])
    assert out[~real].isfinite().all()


def test_cuda_graph_replay_equals_eager() -> None:
    cache = packed_cache(blocks=40, gap=0, seed=1)
    q = torch.randn(4, 12, QK_DIM, device="cuda").bfloat16()
    idx = random_indices(4, 2048, cache.shape[0] * BLOCK, seed=2)
    eager, eager_lse = sparse_mla_fp8(q, cache, idx, SCALE)
    graph = torch.cuda.CUDAGraph()
    sparse_mla_fp8(q, cache, idx, SCALE)  # warm-up: compile outside capture
    with torch.cuda.graph(graph):
        out, lse = sparse_mla_fp8(q, cache, idx, SCALE)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager) and torch.equal(lse, eager_lse)


@requires_consumers
@pytest.mark.parametrize("heads", [12, 16, 32])
def test_matches_flashmla_padded_to_64_heads(heads: int) -> None:
    cache = packed_cache(blocks=40, gap=0, seed=heads)
    tokens = 8
    q = torch.randn(tokens, heads, QK_DIM, device="cuda").bfloat16()
    idx = random_indices(tokens, 2048, cache.shape[0] * BLOCK, seed=heads)
    idx[1] = torch.arange(2048, device="cuda", dtype=torch.int32)  # no -1
    padded = q.new_zeros(tokens, 1, 64, QK_DIM)
    padded[:, 0, :heads] = q
    flash_idx = idx.clone()
    flash_idx[flash_idx >= cache.shape[0] * BLOCK] = -1
    want, *_ = flashmla_sparse_decode_op()(
        padded, cache.unsqueeze(-2), flash_idx.unsqueeze(1), None, None, None, None,
        None, None, None, 512, SCALE, None, False,
    )  # fmt: skip
    out, _ = sparse_mla_fp8(q, cache, idx, SCALE)
    # FlashMLA's rows that select something (its empty rows are undefined).
    rows = (flash_idx >= 0).any(dim=-1)
    torch.testing.assert_close(
        out[rows].float(), want[:, 0, :heads][rows].float(), atol=2e-2, rtol=2e-2
    )


def test_bad_inputs_on_the_gpu() -> None:
    cache = packed_cache(blocks=2, gap=0, seed=0)
    q = torch.zeros(2, 12, QK_DIM, dtype=torch.bfloat16, device="cuda")
    idx = torch.zeros(2, 64, dtype=torch.int32, device="cuda")
    with pytest.raises(ValueError, match="must share a device"):
        sparse_mla_fp8(q, cache, idx.cpu(), SCALE)
    misaligned = cache.view(-1)[2:].as_strided((1, 64, 656), (64 * 656, 656, 1))
    with pytest.raises(ValueError, match="4-byte aligned"):
        sparse_mla_fp8(q, misaligned, idx, SCALE)
    with pytest.raises(ValueError, match=r"indices must be int32"):
        sparse_mla_fp8(q, cache, idx[:, ::2], SCALE)
