# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""``canonical_topk`` on the GPU, and why the indexer needs it.

* The Triton kernels against the reference (which selects from the scores
  alone) on fresh random scores, many ties and none, rows shorter and longer
  than top-k, rows of several tie-count segments, strided rows of a wider
  buffer whose other columns keep a sentinel.
* vLLM 0.33.0's top-k kernels (vLLM installed: the ``topk-determinism``
  suite) on scores with ties: what their raw rows do from run to run
  (printed as METRIC lines), and that every one of them, made canonical,
  is the reference, the same every run.
* FlashMLA's sparse decode (vLLM's consumer kernels) gives different bits for
  the same indices in another order, and the same bits for the same order.
"""

from __future__ import annotations

import pytest
import torch
from dsa_gpu_utils import DEVICE_DIR, requires_consumers, requires_cuda

from vllm.models.kimi_k3.nvidia.dsa_ops import reference
from vllm.models.kimi_k3.nvidia.dsa_ops.canonical_topk import canonical_topk

pytestmark = [pytest.mark.gpu, requires_cuda]
SENTINEL = -7


def scores(rows: int, cols: int, ties: bool, seed: int) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed)
    if ties:  # a few values, as equal keys (or all-zero ReLU sums) give
        return torch.randint(-2, 3, (rows, cols), device="cuda", generator=g).float()
    return torch.randn(rows, cols, device="cuda", generator=g)


def any_topk(logits: torch.Tensor, lens: torch.Tensor, k: int, seed: int):
    """A correct top-k with random tie choice and order (what vLLM's kernels
    may return), in a wider buffer filled with the sentinel."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    buf = torch.full((logits.shape[0], k + 5), SENTINEL, dtype=torch.int32)
    buf = buf.cuda()
    for r, n in enumerate(lens.tolist()):
        perm = torch.randperm(n, device="cuda", generator=g)
        top = torch.sort(logits[r, perm], descending=True, stable=True).indices
        kept = perm[top[:k]]
        kept = kept[torch.randperm(kept.numel(), device="cuda", generator=g)]
        buf[r, :k] = -1
        buf[r, : kept.numel()] = kept.int()
    return buf


@pytest.mark.parametrize("ties", [True, False], ids=["ties", "distinct"])
@pytest.mark.parametrize("k", [128, 2048])
def test_matches_reference(k: int, ties: bool):
    cols = 20_003  # several tie-count segments, an odd width
    lens = [0, 1, k - 1, k, k + 1, 5 * k + 3, cols, 3 * k]
    logits = scores(len(lens), cols, ties, seed=k)
    row_lens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    buf = any_topk(logits, row_lens, k, seed=1)
    expected = buf.clone()
    reference.canonical_topk(logits, row_lens, expected[:, :k])
    canonical_topk(logits, row_lens, buf[:, :k])
    assert torch.equal(buf, expected)
    assert (buf[:, k:] == SENTINEL).all()


def test_strided_logits_and_rows():
    """A column-strided score view (every other column) and top-k rows of a
    buffer whose rows are wider than k."""
    k = 128
    base = scores(4, 2 * 3000, ties=True, seed=3)
    logits = base[:, ::2]
    row_lens = torch.tensor([3000, 129, 77, 2000], dtype=torch.int32, device="cuda")
    buf = any_topk(logits, row_lens, k, seed=4)
    expected = buf.clone()
    reference.canonical_topk(logits, row_lens, expected[:, :k])
    canonical_topk(logits, row_lens, buf[:, :k])
    assert torch.equal(buf, expected)
    assert (buf[:, k:] == SENTINEL).all()


def test_under_cuda_graph_replay():
    """Captured once, replayed on new scores of the same shape."""
    k, cols = 128, 4096
    row_lens = torch.tensor([4096, 1000, 100], dtype=torch.int32, device="cuda")
    logits = scores(3, cols, ties=True, seed=5)
    buf = any_topk(logits, row_lens, k, seed=6)
    canonical_topk(logits, row_lens, buf[:, :k])  # compile outside capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        canonical_topk(logits, row_lens, buf[:, :k])
    for seed in (7, 8):
        logits.copy_(scores(3, cols, ties=True, seed=seed))
        buf.copy_(any_topk(logits, row_lens, k, seed=seed))
        expected = buf.clone()
        reference.canonical_topk(logits, row_lens, expected[:, :k])
        graph.replay()
        assert torch.equal(buf, expected)


def test_bad_inputs():
    logits = torch.zeros(2, 10, device="cuda")
    lens = torch.tensor([10, 10], dtype=torch.int32, device="cuda")
    out = torch.zeros(2, 4, dtype=torch.int32, device="cuda")
    with pytest.raises(ValueError, match="logits must be fp32"):
        canonical_topk(logits.bfloat16(), lens, out)
    with pytest.raises(ValueError, match="row_lens must be int32"):
        canonical_topk(logits, lens.long(), out)
    with pytest.raises(ValueError, match="topk_indices must be int32"):
        canonical_topk(logits, lens, out[:1])
    with pytest.raises(ValueError, match="different devices"):
        canonical_topk(logits, lens.cpu(), out)


def _vllm_topk_kernels():
    """vLLM 0.33.0's decode and prefill top-k ops, or a skip."""
    try:
        import vllm._custom_ops  # noqa: F401  (loads torch.ops._C)
    except Exception as exc:  # vLLM absent on the kernels suite's host
        pytest.skip(f"needs vLLM 0.33.0 importable: {exc}")
    return torch.ops._C


@pytest.mark.parametrize("kernel", ["prefill", "per_row", "cooperative", "persistent"])
def test_vllm_topk_made_canonical_is_deterministic(kernel: str):
    """vLLM's own top-k on scores with ties, ten times: the raw rows' order
    and tie choice (METRIC lines) and the canonical rows, identical to the
    reference every time."""
    ops = _vllm_topk_kernels()
    k = 2048
    lens = [4096, 2049, 9000, 131072, 2000]
    rows, cols = len(lens), max(lens)
    logits = scores(rows, cols, ties=True, seed=11)
    row_lens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    expected = torch.empty(rows, k, dtype=torch.int32, device="cuda")
    reference.canonical_topk(logits, row_lens, expected)
    workspace = torch.empty(1024 * 1024, dtype=torch.uint8, device="cuda")
    raw_runs, sets = [], set()
    for _ in range(10):
        out = torch.full((rows, k), -1, dtype=torch.int32, device="cuda")
        if kernel == "prefill":
            starts = torch.zeros_like(row_lens)
            ops.top_k_per_row_prefill(
                logits, starts, row_lens, out, rows, logits.stride(0), 1, k
            )
        elif kernel == "per_row":
            ops.top_k_per_row_decode(
                logits, 1, row_lens, out, rows, logits.stride(0), 1, k
            )
        else:
            op = getattr(ops, f"{kernel}_topk")
            op(logits, row_lens.view(-1, 1), out, workspace, k, max(lens))
        raw_runs.append(out.clone())
        sets.add(tuple(tuple(sorted(r.tolist())) for r in out.cpu()))
        canonical_topk(logits, row_lens, out)
        assert torch.equal(out, expected)
    orders = sum(not torch.equal(raw_runs[0], r) for r in raw_runs[1:])
    print(
        f"METRIC vllm_topk kernel={kernel} runs=10 raw_rows_differing_from_first="
        f"{orders} distinct_tie_choices={len(sets)}"
    )


@requires_consumers
def test_flashmla_sparse_decode_depends_on_index_order():
    """The same selected entries in another order change the output bits:
    the reason a row's order must be fixed."""
    if not hasattr(torch.ops._flashmla_C, "sparse_decode_fwd"):
        torch.ops.load_library(str(DEVICE_DIR / "_flashmla_C.abi3.so"))
    g = torch.Generator(device="cuda").manual_seed(31)
    blocks, block, topk, heads = 64, 64, 2048, 64
    cache = torch.randint(0, 256, (blocks, block, 1, 656), dtype=torch.uint8)
    cache = cache.cuda()
    # Finite fp8 values and power-of-two scales of one.
    cache[..., :512] = torch.randint(0, 0x40, (blocks, block, 1, 512)).to(cache)
    cache[..., 512:528] = torch.tensor([0, 0, 0x80, 0x3F] * 4, dtype=torch.uint8).cuda()
    cache[..., 528:] = 0
    q = (torch.randn(1, 1, heads, 576, device="cuda", generator=g) * 0.5).bfloat16()
    chosen = torch.randperm(blocks * block, device="cuda", generator=g)[:topk].int()
    ascending = torch.sort(chosen).values.view(1, 1, topk)
    shuffled = chosen.view(1, 1, topk)

    def decode(indices: torch.Tensor) -> torch.Tensor:
        out, *_ = torch.ops._flashmla_C.sparse_decode_fwd(
            q, cache, indices, None, None, None, None, None, None, None,
            512, 576**-0.5, None, False,
        )  # fmt: skip
        return out

    first = decode(ascending)
    assert torch.equal(decode(ascending), first)
    other = decode(shuffled)
    differing = int((other != first).sum())
    print(f"METRIC flashmla_sparse_decode order_changes_bits={differing}")
    torch.testing.assert_close(other, first, rtol=0.02, atol=0.02)
