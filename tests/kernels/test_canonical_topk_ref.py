# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""``canonical_topk`` on the CPU: the reference's semantics on rows written
out by hand, its input checks, and the Triton kernels run by Triton's
interpreter (``TRITON_INTERPRET=1``, a subprocess: Triton reads it when the
kernels are defined) against the reference on random rows with ties."""

from __future__ import annotations

import textwrap

import pytest
import torch
from triton_interpreter import run_interpreted

from vllm.models.kimi_k3.nvidia.dsa_ops import reference
from vllm.models.kimi_k3.nvidia.dsa_ops.canonical_topk import canonical_topk


def canonical(scores: list[list[float]], lens: list[int], k: int) -> list[list[int]]:
    width = max(len(r) for r in scores)
    logits = torch.tensor([r + [0] * (width - len(r)) for r in scores]).float()
    out = torch.full((len(scores), k), 99, dtype=torch.int32)
    reference.canonical_topk(logits, torch.tensor(lens, dtype=torch.int32), out)
    return out.tolist()


def test_reference_semantics() -> None:
    # The k largest, ties at the k-th value to the lowest columns, ascending.
    assert canonical([[1, 5, 3, 5, 3, 3, 0]], [7], 3) == [[1, 2, 3]]
    assert canonical([[1, 5, 3, 5, 3, 3, 0]], [7], 4) == [[1, 2, 3, 4]]
    # Columns past the row's length are not scored.
    assert canonical([[0, 0, 9, 9]], [2], 2) == [[0, 1]]
    # A row no longer than k keeps every column, then -1.
    assert canonical([[4, 2, 8]], [3], 5) == [[0, 1, 2, -1, -1]]
    assert canonical([[4, 2, 8]], [0], 2) == [[-1, -1]]
    # Negative and equal scores.
    assert canonical([[-1, -3, -1, -2]], [4], 2) == [[0, 2]]


def test_bad_inputs() -> None:
    logits = torch.zeros(2, 10)
    lens = torch.tensor([10, 10], dtype=torch.int32)
    out = torch.zeros(2, 4, dtype=torch.int32)
    with pytest.raises(ValueError, match="logits must be fp32"):
        canonical_topk(logits.half(), lens, out)
    with pytest.raises(ValueError, match=r"row_lens must be int32 \[2\]"):
        canonical_topk(logits, lens[:1], out)
    with pytest.raises(ValueError, match=r"topk_indices must be int32 \[2, k > 0\]"):
        canonical_topk(logits, lens, out[:, :0])
    with pytest.raises(ValueError, match="topk_indices must be int32"):
        canonical_topk(logits, lens, out.long())


INTERPRETED = textwrap.dedent(
    """
    import torch
    from vllm.models.kimi_k3.nvidia.dsa_ops import canonical_topk as C
    from vllm.models.kimi_k3.nvidia.dsa_ops import reference

    C._SEGMENT, C._FILL_BLOCK = 256, 16  # several segments and fill steps
    g = torch.Generator().manual_seed(0)
    for trial in range(12):
        # 150: more than the top value's ties, so the threshold is the next
        # value and earlier segments hold more ties than the top-k keeps.
        k = [5, 37, 64, 150][trial % 4]
        # 760: a row length past the scored columns (only 700 are scored).
        lens = [700, k, k + 1, 3, 0, 513, 760]
        if trial % 3 == 2:
            scores = torch.randn(len(lens), 700, generator=g)
        else:
            scores = torch.randint(0, 6, (len(lens), 700), generator=g).float()
        # A strided view whose hidden columns would win if they were read.
        padded = torch.full((len(lens), 800), 1e9)
        padded[:, :700] = scores
        logits = padded[:, :700]
        row_lens = torch.tensor(lens, dtype=torch.int32)
        buf = torch.full((len(lens), k + 3), -7, dtype=torch.int32)
        for r, n in enumerate(lens):  # any correct top-k, any order
            perm = torch.randperm(min(n, 700), generator=g)
            top = torch.sort(logits[r, perm], descending=True, stable=True)
            kept = perm[top.indices[:k]]
            kept = kept[torch.randperm(kept.numel(), generator=g)]
            buf[r, :k] = -1
            buf[r, : kept.numel()] = kept.int()
        expected = buf.clone()
        reference.canonical_topk(logits, row_lens, expected[:, :k])
        C._launch(logits, row_lens, buf[:, :k])
        assert torch.equal(buf, expected), (trial, buf, expected)
    # A row length past fewer scored columns than k: only those 40 count.
    padded = torch.full((1, 64), 1e9)
    padded[:, :40] = torch.randn(1, 40, generator=g)
    out = torch.cat([torch.randperm(40, generator=g), torch.full((8,), -1)])
    out = out.int().unsqueeze(0)
    C._launch(padded[:, :40], torch.tensor([60], dtype=torch.int32), out)
    assert out.tolist() == [list(range(40)) + [-1] * 8], out
    print("interpreted kernels match")
    """
)


def test_triton_kernels_under_the_interpreter() -> None:
    assert "interpreted kernels match" in run_interpreted(INTERPRETED, timeout=600)
