# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Does software pipelining pay for ``sparse_mla_fp8`` at 12 heads?

A probe, not a shipped path: ``SparseMLATiles`` has no ``num_stages`` yet, so
this launches the split kernel with Triton's ``num_stages`` forced (the
kernel object wrapped for the probe's duration) and times each launch shape
at each stage count against the shape at Triton's default (3), and against
FlashMLA padded to 64 heads. Its answer decides whether ``num_stages`` joins
the launch shape. Needs vLLM installed (its FlashMLA).

    python3 benchmarks/kernels/probe_sparse_mla_stages.py --json out.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_sparse_mla import SCALE, flashmla_padded, inputs  # noqa: E402
from gpu_timing import time_graph  # noqa: E402

SHAPES = ["n32w8", "n32w8r128", "n64w8r128", "n64w8hr128"]
STAGES = [1, 2, 3, 5]
POINTS = [("decode", 64), ("decode", 256), ("prefill", 1024)]


class _StagedKernel:
    """The split kernel with ``num_stages`` added to every launch."""

    def __init__(self, kernel, num_stages: int) -> None:
        self.kernel, self.num_stages = kernel, num_stages

    def __getitem__(self, grid):
        launch = self.kernel[grid]
        return lambda *args, **kwargs: launch(
            *args, num_stages=self.num_stages, **kwargs
        )


@contextlib.contextmanager
def forced_stages(num_stages: int):
    from vllm.models.kimi_k3.nvidia.dsa_ops import sparse_mla

    kernel = sparse_mla._sparse_mla_split_kernel
    sparse_mla._sparse_mla_split_kernel = _StagedKernel(kernel, num_stages)
    try:
        yield
    finally:
        sparse_mla._sparse_mla_split_kernel = kernel


def measure(mode: str, tokens: int, heads: int, reps: int) -> dict:
    from vllm.models.kimi_k3.nvidia.dsa_ops.sparse_mla import (
        TILE_CANDIDATES,
        sparse_mla_fp8,
        sparse_mla_fp8_reference,
    )

    q, cache, indices = inputs(tokens, heads, seed=tokens * 131 + heads)
    calls = 1 if mode == "prefill" else 20
    ref, _ = sparse_mla_fp8_reference(q, cache, indices, SCALE)
    us: dict[str, float] = {}
    for name in SHAPES:
        tiles = TILE_CANDIDATES[name]
        for stages in STAGES:
            with forced_stages(stages):
                out, _ = sparse_mla_fp8(q, cache, indices, SCALE, tiles=tiles)
                torch.testing.assert_close(
                    out.float(), ref.float(), atol=2e-2, rtol=2e-2
                )
                call = lambda _, t=tiles: sparse_mla_fp8(  # noqa: E731
                    q, cache, indices, SCALE, tiles=t
                )
                us[f"{name}s{stages}"] = time_graph(call, calls, reps)
    padded_us = time_graph(flashmla_padded(q, cache, indices), calls, reps)
    return {"mode": mode, "tokens": tokens, "heads": heads,
            "flashmla_padded_us": padded_us, "us": us}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    rows = []
    for mode, tokens in POINTS:
        row = measure(mode, tokens, args.heads, args.reps)
        rows.append(row)
        padded = row["flashmla_padded_us"]
        print(f"{mode} {tokens} heads {args.heads}: padded {padded:.1f} us; "
              + " ".join(f"{k} {v / padded:.2f}" for k, v in row["us"].items()),
              flush=True)  # fmt: skip
    if args.json is not None:
        args.json.write_text(json.dumps({"points": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
