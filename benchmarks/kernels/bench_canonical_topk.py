# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""What the canonical top-k adds to the indexer's top-k, under graph replay.

Per point: vLLM 0.33.0's top-k kernel alone (the decode chain's pick for the
row count, or the prefill per-row kernel), then ``canonical_topk`` on its
output, and ``radix_topk`` (the same rows from the scores alone), on fp32
scores of the indexer's shape (k = 2048). Scores are random (no ties: the
given top-k is sorted) or drawn from a few values (ties at the k-th value:
the rows are rescanned). Needs vLLM installed (its top-k ops).

    python3 benchmarks/kernels/bench_canonical_topk.py --json out.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_timing import copy_bandwidth, time_graph  # noqa: E402

K = 2048
# (mode, rows, row length): decode batches at 32K and 128K context, prefill
# chunks of 1K and 4K query rows over 32K.
POINTS = [
    ("decode", 1, 32768),
    ("decode", 1, 131072),
    ("decode", 8, 131072),
    ("decode", 64, 131072),
    ("prefill", 1024, 32768),
    ("prefill", 4096, 32768),
]


def vllm_topk(mode: str, logits, lens, out, workspace):
    import vllm._custom_ops  # noqa: F401  (torch.ops._C)

    rows = logits.shape[0]
    if mode == "prefill":
        starts = torch.zeros_like(lens)
        return lambda: torch.ops._C.top_k_per_row_prefill(
            logits, starts, lens, out, rows, logits.stride(0), 1, K
        )
    op = torch.ops._C.cooperative_topk if rows <= 64 else torch.ops._C.persistent_topk
    seq_lens, max_len = lens.view(-1, 1), int(lens.max())
    return lambda: op(logits, seq_lens, out, workspace, K, max_len)


def measure(
    mode: str, rows: int, length: int, scores: str, reps: int, bandwidth: float
) -> dict:
    from vllm.models.kimi_k3.nvidia.dsa_ops.canonical_topk import canonical_topk
    from vllm.models.kimi_k3.nvidia.dsa_ops.radix_topk import radix_topk

    g = torch.Generator(device="cuda").manual_seed(rows)
    if scores == "random":
        logits = torch.randn(rows, length, device="cuda", generator=g)
    else:
        logits = torch.randint(0, 8, (rows, length), device="cuda", generator=g)
        logits = logits.float()
    lens = torch.full((rows,), length, dtype=torch.int32, device="cuda")
    out = torch.empty(rows, K, dtype=torch.int32, device="cuda")
    workspace = torch.empty(1 << 20, dtype=torch.uint8, device="cuda")
    topk = vllm_topk(mode, logits, lens, out, workspace)
    base = time_graph(lambda i: topk(), 1, reps)

    def both(i: int) -> None:
        topk()
        canonical_topk(logits, lens, out)

    total = time_graph(both, 1, reps)
    added = total - base
    # The canonical rows in one radix select and write, without vLLM's top-k.
    radix = time_graph(lambda i: radix_topk(logits, lens, out), 1, reps)
    return dict(
        mode=mode,
        rows=rows,
        length=length,
        scores=scores,
        vllm_topk_us=round(base, 2),
        with_canonical_us=round(total, 2),
        canonical_us=round(added, 2),
        radix_topk_us=round(radix, 2),
        radix_over_with_canonical=round(radix / total, 3),
        # The scores read once (the tie count's pass) over the added time.
        canonical_fraction_of_copy=round(
            rows * length * 4 / max(added * 1e-6, 1e-9) / bandwidth, 3
        ),
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--reps", type=int, default=20)
    args = parser.parse_args(argv)
    bandwidth = copy_bandwidth()
    print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s")
    results = []
    for mode, rows, length in POINTS:
        for scores in ("random", "ties"):
            row = measure(mode, rows, length, scores, args.reps, bandwidth)
            results.append(row)
            print(json.dumps(row))
    if args.json:
        args.json.write_text(
            json.dumps({"copy_bandwidth": bandwidth, "points": results}, indent=1)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
