# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""``radix_topk`` on the CPU: its input checks, its torch path (the
canonical rows), and its Triton kernels under Triton's interpreter against
those rows: ties at the k-th value, -0.0 beside 0.0, rows shorter than the
logits, rows no longer than k, an empty row, strided logits, several
segments a row."""

from __future__ import annotations

import pytest
import torch
from triton_interpreter import run_interpreted

from vllm.models.kimi_k3.nvidia.dsa_ops.radix_topk import radix_topk


def test_torch_path_writes_the_canonical_rows() -> None:
    logits = torch.tensor([[1.0, 5.0, 3.0, 5.0, 3.0, 3.0, 0.0]])
    out = torch.full((1, 4), 99, dtype=torch.int32)
    radix_topk(logits, torch.tensor([7], dtype=torch.int32), out)
    assert out.tolist() == [[1, 2, 3, 4]]
    radix_topk(logits, torch.tensor([2], dtype=torch.int32), out)
    assert out.tolist() == [[0, 1, -1, -1]]


def test_bad_inputs() -> None:
    logits = torch.zeros(2, 10)
    lens = torch.tensor([10, 10], dtype=torch.int32)
    out = torch.zeros(2, 4, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"logits fp32 \[rows, columns\]"):
        radix_topk(logits.half(), lens, out)
    with pytest.raises(ValueError, match=r"row_lens int32 \[2\]"):
        radix_topk(logits, lens.long(), out)
    with pytest.raises(ValueError, match=r"topk_indices int32 \[2, k > 0\]"):
        radix_topk(logits, lens, out[:, :0])
    with pytest.raises(ValueError, match=r"topk_indices int32 \[2, k > 0\]"):
        radix_topk(logits, lens, out[:1])


INTERPRETED = """
import torch
from vllm.models.kimi_k3.nvidia.dsa_ops import radix_topk as R
from vllm.models.kimi_k3.nvidia.dsa_ops.torch_path import canonical_topk_rows

R._SEGMENT, R._BLOCK = 512, 128  # several segments a row, quickly
g = torch.Generator().manual_seed(0)
for trial, (rows, cols, k, values) in enumerate(
    [(3, 1500, 37, None), (4, 1300, 64, 5), (2, 700, 700, 3), (3, 2100, 100, 40)]
):
    wide = torch.randn(rows, cols + 9, generator=g)
    if values is not None:  # few distinct scores: ties at the k-th value
        wide = torch.randint(-values, values, (rows, cols + 9), generator=g).float()
    wide[wide == 0] = -0.0  # -0.0 beside the 0.0 it equals
    wide[:, :3] = 0.0
    logits = wide[:, :cols]  # strided rows
    lens = torch.randint(cols // 2, cols + 1, (rows,), generator=g, dtype=torch.int32)
    lens[0] = cols
    lens[-1] = min(k, cols) - 1 if trial else 0  # no longer than k; empty
    out = torch.full((rows, k + 5), 77, dtype=torch.int32)
    R._launch(logits, lens, out[:, :k])
    want = canonical_topk_rows(logits, lens, k)
    assert torch.equal(out[:, :k], want), (trial, out[:, :k], want)
    assert (out[:, k:] == 77).all(), trial  # nothing past the view
print("interpreted kernels match")
"""


def test_triton_kernels_under_the_interpreter() -> None:
    assert "interpreted kernels match" in run_interpreted(INTERPRETED)
