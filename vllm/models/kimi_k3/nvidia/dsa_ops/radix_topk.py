# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The indexer's top-k written in canonical form directly (Triton + torch):
a radix select of the k-th largest score (four 8-bit digits of an
order-preserving key, each a histogram pass over the row's segments), then
one ordered write of the kept columns. Integer counts only, so the result is
the same on every run, without a second top-k and a rewrite."""

import torch

from vllm.models.kimi_k3.nvidia.dsa_ops._triton import HAS_TRITON, tl, triton
from vllm.models.kimi_k3.nvidia.dsa_ops.torch_path import (
    canonical_topk_rows,
    runs_torch_path,
)

_SEGMENT = 4096
_BLOCK = 1024
_BINS = 256
# Per row: key prefix found so far, columns still to take at it, whether the
# row keeps every column (n <= k).
_STATE = 3


def radix_topk(
    logits: torch.Tensor, row_lens: torch.Tensor, topk_indices: torch.Tensor
) -> None:
    """Write the canonical top-k of ``logits [rows, columns]`` (fp32, the
    first ``row_lens[r]`` columns of row r scored) into ``topk_indices
    [rows, k]`` (int32, written through a view): the ``k`` largest, ties to
    the lowest columns, ascending, then -1. CPU tensors take the torch path."""
    _check(logits, row_lens, topk_indices)
    if topk_indices.shape[0] == 0:
        return
    on_gpu = HAS_TRITON and not runs_torch_path(logits)
    if on_gpu:
        _launch(logits, row_lens, topk_indices)
    else:
        rows = canonical_topk_rows(logits, row_lens, topk_indices.shape[1])
        topk_indices.copy_(rows)


def _check(
    logits: torch.Tensor, row_lens: torch.Tensor, topk_indices: torch.Tensor
) -> None:
    rows = logits.shape[0] if logits.dim() == 2 else -1
    problems = []
    if logits.dim() != 2 or logits.dtype != torch.float32:
        problems.append(f"logits fp32 [rows, columns], got {logits.dtype} "
                        f"{tuple(logits.shape)}")  # fmt: skip
    if row_lens.dtype != torch.int32 or tuple(row_lens.shape) != (rows,):
        problems.append(f"row_lens int32 [{rows}], got {row_lens.dtype} "
                        f"{tuple(row_lens.shape)}")  # fmt: skip
    if (
        topk_indices.dtype != torch.int32
        or topk_indices.dim() != 2
        or topk_indices.shape[0] != rows
        or topk_indices.shape[1] == 0
    ):
        got = f"{topk_indices.dtype} {tuple(topk_indices.shape)}"
        problems.append(f"topk_indices int32 [{rows}, k > 0], got {got}")
    if not logits.device == row_lens.device == topk_indices.device:
        problems.append("logits, row_lens and topk_indices on one device")
    if problems:
        raise ValueError("radix_topk needs " + "; ".join(problems))


def _launch(
    logits: torch.Tensor, row_lens: torch.Tensor, topk_indices: torch.Tensor
) -> None:
    rows, k = topk_indices.shape
    segments = max(1, triton.cdiv(logits.shape[1], _SEGMENT))
    device = logits.device
    state = torch.zeros(rows, _STATE, dtype=torch.int32, device=device)
    hist = torch.empty(rows, segments, _BINS, dtype=torch.int32, device=device)
    counts = torch.empty(rows, segments, 2, dtype=torch.int32, device=device)
    seg_p2 = triton.next_power_of_2(segments)
    for digit in range(4):
        _hist_kernel[(rows, segments)](
            logits, *logits.stride(), row_lens, logits.shape[1], state, hist,
            DIGIT=digit, SEGMENT=_SEGMENT, BLOCK=_BLOCK, num_warps=4,
        )  # fmt: skip
        _select_kernel[(rows,)](
            hist, state, row_lens, logits.shape[1], k, segments,
            DIGIT=digit, SEGMENTS=seg_p2, num_warps=4,
        )  # fmt: skip
    _count_kernel[(rows, segments)](
        logits, *logits.stride(), row_lens, logits.shape[1], state, counts,
        SEGMENT=_SEGMENT, BLOCK=_BLOCK, num_warps=4,
    )  # fmt: skip
    _write_kernel[(rows, segments)](
        logits, *logits.stride(), row_lens, logits.shape[1], state, counts,
        topk_indices, *topk_indices.stride(), k, segments,
        SEGMENT=_SEGMENT, BLOCK=_BLOCK, SEGMENTS=seg_p2,
        K_P2=triton.next_power_of_2(k), num_warps=4,
    )  # fmt: skip


if HAS_TRITON:

    @triton.jit
    def _keys(logits_ptr, l_s0, l_s1, row, cols, n):
        """Order-preserving uint32 keys of a row's scores (-0.0 as 0.0)."""
        x = tl.load(logits_ptr + row * l_s0 + cols.to(tl.int64) * l_s1, mask=cols < n)
        bits = tl.where(x == 0.0, 0.0, x).to(tl.uint32, bitcast=True)
        negative = (bits >> 31) != 0
        return tl.where(negative, bits ^ 0xFFFFFFFF, bits | 0x80000000)

    @triton.jit
    def _hist_kernel(
        logits_ptr, l_s0, l_s1, lens_ptr, columns, state_ptr, hist_ptr,
        DIGIT: tl.constexpr, SEGMENT: tl.constexpr, BLOCK: tl.constexpr,
    ):  # fmt: skip
        row = tl.program_id(0).to(tl.int64)
        seg = tl.program_id(1)
        n = tl.minimum(tl.load(lens_ptr + row), columns)
        prefix = tl.load(state_ptr + row * 3).to(tl.uint32)
        total = tl.zeros([2 * 256], tl.int32)
        for start in range(seg * SEGMENT, (seg + 1) * SEGMENT, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            key = _keys(logits_ptr, l_s0, l_s1, row, cols, n)
            digit = ((key >> (24 - 8 * DIGIT)) & 0xFF).to(tl.int32)
            keep = cols < n
            if DIGIT > 0:
                keep = keep & ((key >> (32 - 8 * DIGIT)) == prefix)
            # Columns not counted go to the upper half, which is dropped.
            total += tl.histogram(tl.where(keep, digit, 256), 2 * 256)
        bins = tl.arange(0, 2 * 256)
        out = hist_ptr + (row * tl.num_programs(1) + seg) * 256
        tl.store(out + bins, total, mask=bins < 256)

    @triton.jit
    def _select_kernel(
        hist_ptr, state_ptr, lens_ptr, columns, k, segments,
        DIGIT: tl.constexpr, SEGMENTS: tl.constexpr,
    ):  # fmt: skip
        row = tl.program_id(0).to(tl.int64)
        n = tl.minimum(tl.load(lens_ptr + row), columns)
        keeps_all = tl.load(state_ptr + row * 3 + 2)
        if DIGIT == 0:
            keeps_all = (n <= k).to(tl.int32)
            tl.store(state_ptr + row * 3 + 2, keeps_all)
            tl.store(state_ptr + row * 3 + 1, tl.minimum(n, k))
        if keeps_all == 0:
            need = tl.load(state_ptr + row * 3 + 1)
            prefix = tl.load(state_ptr + row * 3)
            s = tl.arange(0, SEGMENTS)
            top = tl.arange(0, 256)
            # Bins from the highest digit down: a cumulative sum from the top.
            parts = tl.load(
                hist_ptr + (row * segments + s[:, None]) * 256 + (255 - top)[None, :],
                mask=s[:, None] < segments,
                other=0,
            )
            count = tl.sum(parts, axis=0)
            through = tl.cumsum(count, axis=0)
            above = through - count
            found = (above < need) & (through >= need)
            pick = tl.max(tl.where(found, top, -1), axis=0)
            taken_above = tl.sum(tl.where(top == pick, above, 0), axis=0)
            tl.store(state_ptr + row * 3, (prefix << 8) | (255 - pick))
            tl.store(state_ptr + row * 3 + 1, need - taken_above)

    @triton.jit
    def _count_kernel(
        logits_ptr, l_s0, l_s1, lens_ptr, columns, state_ptr, counts_ptr,
        SEGMENT: tl.constexpr, BLOCK: tl.constexpr,
    ):  # fmt: skip
        row = tl.program_id(0).to(tl.int64)
        seg = tl.program_id(1)
        n = tl.minimum(tl.load(lens_ptr + row), columns)
        threshold = tl.load(state_ptr + row * 3).to(tl.uint32)
        keeps_all = tl.load(state_ptr + row * 3 + 2) != 0
        above = 0
        ties = 0
        for start in range(seg * SEGMENT, (seg + 1) * SEGMENT, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            key = _keys(logits_ptr, l_s0, l_s1, row, cols, n)
            valid = cols < n
            above += tl.sum((valid & (keeps_all | (key > threshold))).to(tl.int32))
            ties += tl.sum((valid & ~keeps_all & (key == threshold)).to(tl.int32))
        out = counts_ptr + (row * tl.num_programs(1) + seg) * 2
        tl.store(out, above)
        tl.store(out + 1, ties)

    @triton.jit
    def _write_kernel(
        logits_ptr, l_s0, l_s1, lens_ptr, columns, state_ptr, counts_ptr,
        out_ptr, o_s0, o_s1, k, segments,
        SEGMENT: tl.constexpr, BLOCK: tl.constexpr, SEGMENTS: tl.constexpr,
        K_P2: tl.constexpr,
    ):  # fmt: skip
        # Segments in column order: each writes its kept columns after the
        # earlier segments' (their counts), ties taken lowest column first.
        row = tl.program_id(0).to(tl.int64)
        seg = tl.program_id(1)
        n = tl.minimum(tl.load(lens_ptr + row), columns)
        threshold = tl.load(state_ptr + row * 3).to(tl.uint32)
        tie_quota = tl.load(state_ptr + row * 3 + 1)
        keeps_all = tl.load(state_ptr + row * 3 + 2) != 0
        s = tl.arange(0, SEGMENTS)
        earlier = s < seg
        counts = counts_ptr + (row * segments + s) * 2
        above_before = tl.sum(tl.load(counts, mask=earlier, other=0), axis=0)
        ties_before = tl.sum(tl.load(counts + 1, mask=earlier, other=0), axis=0)
        taken_before = above_before + tl.minimum(ties_before, tie_quota)
        out = out_ptr + row * o_s0
        for start in range(seg * SEGMENT, (seg + 1) * SEGMENT, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            key = _keys(logits_ptr, l_s0, l_s1, row, cols, n)
            valid = cols < n
            above = valid & (keeps_all | (key > threshold))
            tie = valid & ~keeps_all & (key == threshold)
            tie_rank = ties_before + tl.cumsum(tie.to(tl.int32), axis=0) - 1
            keep = above | (tie & (tie_rank < tie_quota))
            at = taken_before + tl.cumsum(keep.to(tl.int32), axis=0) - 1
            tl.store(out + at.to(tl.int64) * o_s1, cols, mask=keep)
            taken_before += tl.sum(keep.to(tl.int32), axis=0)
            ties_before += tl.sum(tie.to(tl.int32), axis=0)
        if seg == 0:
            # What the row does not fill is -1.
            kept = tl.minimum(n, k)
            j = tl.arange(0, K_P2)
            tl.store(out + j * o_s1, -1, mask=(j >= kept) & (j < k))
