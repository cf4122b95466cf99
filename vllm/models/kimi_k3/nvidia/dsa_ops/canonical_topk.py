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

# Columns each tie-count program reads, and each step of the rescan.
_SEGMENT = 4096
_SCAN_BLOCK = 1024


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
        logits_ptr, l_s0, l_s1, lens_ptr,
        topk_ptr, t_s0, t_s1,
        thresh_ptr, counts_ptr,
        K: tl.constexpr, BLOCK_K: tl.constexpr,
    ):  # fmt: skip
        # The k-th value and its tie counts (row may keep / top-k holds).
        row = tl.program_id(0).to(tl.int64)
        n = tl.load(lens_ptr + row)
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
        num_eq = tl.sum((valid & (x == thresh)).to(tl.int32), axis=0)
        tl.store(thresh_ptr + row, thresh)
        tl.store(counts_ptr + row * 3, K - num_gt)
        tl.store(counts_ptr + row * 3 + 1, num_eq)
        tl.store(counts_ptr + row * 3 + 2, 0)

    @triton.jit
    def _canonical_topk_tie_count_kernel(
        logits_ptr,
        l_s0,
        l_s1,
        lens_ptr,
        thresh_ptr,
        counts_ptr,
        SEGMENT: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        start = tl.program_id(1) * SEGMENT
        n = tl.load(lens_ptr + row)
        if start < n:
            thresh = tl.load(thresh_ptr + row)
            cols = start + tl.arange(0, SEGMENT)
            in_row = cols < n
            x = tl.load(
                logits_ptr + row * l_s0 + cols.to(tl.int64) * l_s1,
                mask=in_row,
                other=float("-inf"),
            )
            ties = tl.sum((in_row & (x == thresh)).to(tl.int32), axis=0)
            if ties > 0:
                # An integer sum: the same whatever the programs' order.
                tl.atomic_add(counts_ptr + row * 3 + 2, ties)

    @triton.jit
    def _canonical_topk_write_kernel(
        logits_ptr, l_s0, l_s1, lens_ptr,
        topk_ptr, t_s0, t_s1,
        thresh_ptr, counts_ptr,
        K: tl.constexpr, BLOCK_K: tl.constexpr, SCAN_BLOCK: tl.constexpr,
    ):  # fmt: skip
        row = tl.program_id(0).to(tl.int64)
        n = tl.load(lens_ptr + row)
        out = topk_ptr + row * t_s0
        j = tl.arange(0, BLOCK_K)
        if n <= K:
            tl.store(out + j * t_s1, tl.where(j < n, j, -1), mask=j < K)
        else:
            need_eq = tl.load(counts_ptr + row * 3)
            held_eq = tl.load(counts_ptr + row * 3 + 1)
            row_eq = tl.load(counts_ptr + row * 3 + 2)
            if row_eq == held_eq:
                # The given top-k is the canonical set: sort it.
                idx = tl.load(out + j * t_s1, mask=j < K, other=-1)
                big = 0x7FFFFFFF
                idx = tl.where((idx >= 0) & (idx < n), idx, big)
                idx = tl.sort(idx)
                tl.store(out + j * t_s1, tl.where(idx == big, -1, idx), mask=j < K)
            else:
                thresh = tl.load(thresh_ptr + row)
                kept = tl.zeros((), dtype=tl.int32)
                ties_seen = tl.zeros((), dtype=tl.int32)
                for start in range(0, n, SCAN_BLOCK):
                    cols = start + tl.arange(0, SCAN_BLOCK)
                    in_row = cols < n
                    x = tl.load(
                        logits_ptr + row * l_s0 + cols.to(tl.int64) * l_s1,
                        mask=in_row,
                        other=float("-inf"),
                    )
                    eq = (in_row & (x == thresh)).to(tl.int32)
                    tie_rank = ties_seen + tl.cumsum(eq, axis=0) - eq
                    keep = (in_row & (x > thresh)) | ((eq > 0) & (tie_rank < need_eq))
                    keep_i = keep.to(tl.int32)
                    slot = kept + tl.cumsum(keep_i, axis=0) - keep_i
                    tl.store(out + slot * t_s1, cols, mask=keep & (slot < K))
                    kept += tl.sum(keep_i, axis=0)
                    ties_seen += tl.sum(eq, axis=0)
                tl.store(
                    out + j * t_s1,
                    tl.full((BLOCK_K,), -1, tl.int32),
                    mask=(j >= kept) & (j < K),
                )


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
    thresh = torch.empty(rows, dtype=torch.float32, device=logits.device)
    counts = torch.empty(rows, 3, dtype=torch.int32, device=logits.device)
    block_k = triton.next_power_of_2(k)
    # The threshold and write kernels take the same arguments.
    row_args = (
        logits,
        *logits.stride(),
        row_lens,
        topk_indices,
        *topk_indices.stride(),
        thresh,
        counts,
    )
    _canonical_topk_threshold_kernel[(rows,)](
        *row_args, K=k, BLOCK_K=block_k, num_warps=4
    )
    segments = triton.cdiv(max(logits.shape[1], 1), _SEGMENT)
    _canonical_topk_tie_count_kernel[(rows, segments)](
        logits,
        *logits.stride(),
        row_lens,
        thresh,
        counts,
        SEGMENT=_SEGMENT,
        num_warps=8,
    )
    _canonical_topk_write_kernel[(rows,)](
        *row_args, K=k, BLOCK_K=block_k, SCAN_BLOCK=_SCAN_BLOCK, num_warps=8
    )
