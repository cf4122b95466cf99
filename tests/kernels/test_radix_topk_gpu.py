# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""``radix_topk`` on the GPU at the indexer's shapes (k = 2048; decode rows
over 32K and 128K, a prefill chunk): the canonical rows of fresh random
scores, with and without ties, the same bits on every run and under
CUDA-graph replay, and the columns past the view untouched."""

from __future__ import annotations

import pytest
import torch
from dsa_gpu_utils import requires_cuda

from vllm.models.kimi_k3.nvidia.dsa_ops.radix_topk import radix_topk
from vllm.models.kimi_k3.nvidia.dsa_ops.torch_path import canonical_topk_rows

pytestmark = [pytest.mark.gpu, requires_cuda]

K = 2048
SENTINEL = 0x5A5A5A5


def scores(rows: int, cols: int, ties: bool, seed: int) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed)
    if ties:
        return torch.randint(-4, 4, (rows, cols), device="cuda", generator=g).float()
    return torch.randn(rows, cols, device="cuda", generator=g)


@pytest.mark.parametrize(
    ("rows", "cols", "ties"),
    [(1, 131072, False), (1, 131072, True), (8, 32768, False), (64, 32768, True),
     (3, 5000, False), (256, 4096, True)],
)  # fmt: skip
def test_matches_the_canonical_rows(rows: int, cols: int, ties: bool) -> None:
    logits = scores(rows, cols + 17, ties, seed=rows + cols)[:, :cols]
    g = torch.Generator(device="cuda").manual_seed(rows)
    lens = torch.randint(1, cols + 1, (rows,), device="cuda", generator=g).int()
    lens[0] = cols
    lens[-1] = min(lens[-1].item(), K - 1)  # a row no longer than k
    out = torch.full((rows, K + 3), SENTINEL, dtype=torch.int32, device="cuda")
    radix_topk(logits, lens, out[:, :K])
    assert torch.equal(out[:, :K].cpu(), canonical_topk_rows(logits, lens, K).cpu())
    assert (out[:, K:] == SENTINEL).all()
    again = torch.empty(rows, K, dtype=torch.int32, device="cuda")
    radix_topk(logits, lens, again)
    assert torch.equal(again, out[:, :K])


def test_cuda_graph_replay_equals_eager() -> None:
    logits = scores(4, 65536, True, seed=7)
    lens = torch.tensor([65536, 40000, 2048, 17], dtype=torch.int32, device="cuda")
    eager = torch.empty(4, K, dtype=torch.int32, device="cuda")
    radix_topk(logits, lens, eager)
    out = torch.empty_like(eager)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        radix_topk(logits, lens, out)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)
