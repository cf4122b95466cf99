# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The indexer's top-k in one canonical form (Triton + torch): the ``k``
largest of a row's scored columns (all when ``n <= k``), ties to the lowest
columns, ascending, then -1. vLLM's top-k order and tie choice vary run to
run, and sparse MLA accumulates in index order."""

import torch

from vllm.models.kimi_k3.nvidia.dsa_ops._checks import check_one_device
from vllm.models.kimi_k3.nvidia.dsa_ops._triton import HAS_TRITON, tl, triton
from vllm.models.kimi_k3.nvidia.dsa_ops.torch_path import (
    canonical_topk_rows,
    runs_torch_path,
)

# Columns each count and write program covers: a row is written in column
# order by its segments in parallel, no sort.
_SEGMENT = 4096
# The -1 tail's store width.
_FILL_BLOCK = 1024


def _check_inputs(
    logits: torch.Tensor, row_lens: torch.Tensor, topk_indices: torch.Tensor
) -> None:
    op = "canonical_topk"
    if logits.dim() != 2 or logits.dtype != torch.float32:
        raise ValueError(
            f"{op}: logits must be fp32 [rows, columns], got {logits.dtype} "
            f"{tuple(logits.shape)}"
        )
    rows = logits.shape[0]
    if row_lens.dtype != torch.int32 or tuple(row_lens.shape) != (rows,):
        raise ValueError(
            f"{op}: row_lens must be int32 [{rows}], got {row_lens.dtype} "
            f"{tuple(row_lens.shape)}"
        )
    if (
        topk_indices.dim() != 2
        or topk_indices.dtype != torch.int32
        or topk_indices.shape[0] != rows
        or topk_indices.shape[1] == 0
    ):
        raise ValueError(
            f"{op}: topk_indices must be int32 [{rows}, k > 0], got "
            f"{topk_indices.dtype} {tuple(topk_indices.shape)}"
        )
    check_one_device(op, logits, row_lens, topk_indices)


if HAS_TRITON:

    @triton.jit
    def _canonical_topk_threshold_kernel(
        logits_ptr, l_s0, l_s1, lens_ptr, width,
        topk_ptr, t_s0, t_s1,
        thresh_ptr, need_eq_ptr,
        K: tl.constexpr, BLOCK_K: tl.constexpr,
    ):  # fmt: skip
        # The k-th value, and how many of the row's ties at it the top-k keeps.
        row = tl.program_id(0).to(tl.int64)
        n = tl.minimum(tl.load(lens_ptr + row), width)
        j = tl.arange(0, BLOCK_K)
        idx = tl.load(topk_ptr + row * t_s0 + j * t_s1, mask=j < K, other=-1)
        valid = (idx >= 0) & (idx < n)
        x = tl.load(
            logits_ptr + row * l_s0 + idx.to(tl.int64) * l_s1,
            mask=valid,
            other=float("inf"),
        )
        thresh = tl.min(tl.where(valid, x, float("inf")), axis=0)
        num_gt = tl.sum((valid & (x > thresh)).to(tl.int32), axis=0)
        tl.store(thresh_ptr + row, thresh)
        tl.store(need_eq_ptr + row, K - num_gt)

    @triton.jit
    def _canonical_topk_count_kernel(
        logits_ptr, l_s0, l_s1, lens_ptr, width,
        thresh_ptr, seg_counts_ptr,
        SEGMENT: tl.constexpr,
    ):  # fmt: skip
        # Per segment: columns above the threshold, and ties at it.
        row = tl.program_id(0).to(tl.int64)
        seg = tl.program_id(1)
        segments = tl.num_programs(1)
        n = tl.minimum(tl.load(lens_ptr + row), width)
        cols = seg * SEGMENT + tl.arange(0, SEGMENT)
        in_row = cols < n
        thresh = tl.load(thresh_ptr + row)
        x = tl.load(
            logits_ptr + row * l_s0 + cols.to(tl.int64) * l_s1,
            mask=in_row,
            other=float("-inf"),
        )
        counts = seg_counts_ptr + (row * segments + seg) * 2
        tl.store(counts, tl.sum((in_row & (x > thresh)).to(tl.int32), axis=0))
        tl.store(counts + 1, tl.sum((in_row & (x == thresh)).to(tl.int32), axis=0))

    @triton.jit
    def _canonical_topk_write_kernel(
        logits_ptr, l_s0, l_s1, lens_ptr, width,
        topk_ptr, t_s0, t_s1,
        thresh_ptr, need_eq_ptr, seg_counts_ptr,
        K: tl.constexpr, SEGMENT: tl.constexpr, SEGMENTS_BLOCK: tl.constexpr,
        FILL_BLOCK: tl.constexpr,
    ):  # fmt: skip
        # Each segment writes its kept columns after the earlier segments'.
        row = tl.program_id(0).to(tl.int64)
        seg = tl.program_id(1)
        segments = tl.num_programs(1)
        n = tl.minimum(tl.load(lens_ptr + row), width)
        out = topk_ptr + row * t_s0
        cols = seg * SEGMENT + tl.arange(0, SEGMENT)
        if n <= K:
            tl.store(out + cols * t_s1, cols, mask=cols < n)
            total = n
        else:
            need_eq = tl.load(need_eq_ptr + row)
            s = tl.arange(0, SEGMENTS_BLOCK)
            counts = seg_counts_ptr + (row * segments + s) * 2
            gt = tl.load(counts, mask=s < segments, other=0)
            eq = tl.load(counts + 1, mask=s < segments, other=0)
            eq_before = tl.sum(tl.where(s < seg, eq, 0), axis=0)
            kept_before = tl.sum(tl.where(s < seg, gt, 0), axis=0) + tl.minimum(
                eq_before, need_eq
            )
            if kept_before < K:
                thresh = tl.load(thresh_ptr + row)
                in_row = cols < n
                x = tl.load(
                    logits_ptr + row * l_s0 + cols.to(tl.int64) * l_s1,
                    mask=in_row,
                    other=float("-inf"),
                )
                tie = (in_row & (x == thresh)).to(tl.int32)
                tie_rank = eq_before + tl.cumsum(tie, axis=0) - tie
                keep = (in_row & (x > thresh)) | ((tie > 0) & (tie_rank < need_eq))
                keep_i = keep.to(tl.int32)
                slot = kept_before + tl.cumsum(keep_i, axis=0) - keep_i
                tl.store(out + slot * t_s1, cols, mask=keep & (slot < K))
            total = tl.sum(gt, axis=0) + tl.minimum(tl.sum(eq, axis=0), need_eq)
        if seg == 0:
            for start in range(0, K, FILL_BLOCK):
                j = start + tl.arange(0, FILL_BLOCK)
                tl.store(out + j * t_s1, -1, mask=(j >= total) & (j < K))


def canonical_topk(
    logits: torch.Tensor, row_lens: torch.Tensor, topk_indices: torch.Tensor
) -> None:
    """Rewrite the top-k ``topk_indices [rows, k]`` (int32, written through
    a view) of ``logits`` in canonical form. CPU tensors take the torch
    path."""
    _check_inputs(logits, row_lens, topk_indices)
    rows, k = topk_indices.shape
    if rows == 0:
        return
    if runs_torch_path(logits) or not HAS_TRITON:
        topk_indices.copy_(canonical_topk_rows(logits, row_lens, k))
        return
    _launch(logits, row_lens, topk_indices)


def _launch(
    logits: torch.Tensor, row_lens: torch.Tensor, topk_indices: torch.Tensor
) -> None:
    rows, k = topk_indices.shape
    segments = triton.cdiv(max(logits.shape[1], 1), _SEGMENT)
    device = logits.device
    thresh = torch.empty(rows, dtype=torch.float32, device=device)
    need_eq = torch.empty(rows, dtype=torch.int32, device=device)
    seg_counts = torch.empty(rows, segments, 2, dtype=torch.int32, device=device)
    row_args = (logits, *logits.stride(), row_lens, logits.shape[1])
    topk_args = (topk_indices, *topk_indices.stride())
    _canonical_topk_threshold_kernel[(rows,)](
        *row_args, *topk_args, thresh, need_eq,
        K=k, BLOCK_K=triton.next_power_of_2(k), num_warps=4,
    )  # fmt: skip
    _canonical_topk_count_kernel[(rows, segments)](
        *row_args, thresh, seg_counts, SEGMENT=_SEGMENT, num_warps=8
    )
    _canonical_topk_write_kernel[(rows, segments)](
        *row_args, *topk_args, thresh, need_eq, seg_counts,
        K=k, SEGMENT=_SEGMENT, SEGMENTS_BLOCK=triton.next_power_of_2(segments),
        FILL_BLOCK=_FILL_BLOCK, num_warps=8,
    )  # fmt: skip
