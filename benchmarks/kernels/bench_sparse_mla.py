# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Sparse MLA at few heads a rank: FlashMLA's sparse decode with the heads
padded to 64 (what vLLM 0.33.0 runs below 64) against ``sparse_mla_fp8``
at the real head count, under graph replay.

Per point: ``tokens`` query rows (a decode batch, or a prefill chunk run as
the mixed batch runs it: one query a row), top-k 2048 random slots of a
128K-token ``fp8_ds_mla`` cache in 64-token blocks, some -1. Reports each
kernel's time (ours at every launch shape of ``TILE_CANDIDATES`` and of
``PROBES``), ours as a
fraction of the padded one's, and the bytes the selected entries take as a
fraction of the copy bandwidth. Needs vLLM installed (its FlashMLA).

    python3 benchmarks/kernels/bench_sparse_mla.py --json out.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_timing import copy_bandwidth, time_graph  # noqa: E402

TOPK = 2048
CONTEXT = 131072
BLOCK = 64
PADDED_HEADS = 64
SCALE = 1 / math.sqrt(192)
# Four-warp launch shapes timed beside the kernel's candidates (not among
# them yet): ``(block_n, num_warps, maxnreg, num_stages)`` and the programs an
# SM that their sm_90 registers and shared memory allow, which the split count
# here plans for (tests/kernels/test_sparse_mla_sm90_resources.py checks both).
PROBES: dict[str, tuple[tuple[int, int, int | None, int | None], int]] = {
    "n64w4r128": ((64, 4, 128, None), 3),
    "n64w4r168": ((64, 4, 168, None), 3),
    "n32w4r128": ((32, 4, 128, None), 4),
    "n32w4r128s5": ((32, 4, 128, 5), 3),
}
POINTS = [
    ("decode", 1),
    ("decode", 8),
    ("decode", 64),
    ("decode", 256),
    ("prefill", 1024),
    ("prefill", 4096),
]


def inputs(tokens: int, heads: int, seed: int):
    from vllm.models.kimi_k3.nvidia.dsa_ops.formats import fp8_ds_mla_entry

    g = torch.Generator(device="cuda").manual_seed(seed)
    entries = fp8_ds_mla_entry(
        torch.randn(CONTEXT, 512, device="cuda", generator=g),
        torch.randn(CONTEXT, 64, device="cuda", generator=g),
    )
    cache = entries.view(CONTEXT // BLOCK, BLOCK, -1)
    q = torch.randn(tokens, heads, 576, device="cuda", generator=g).bfloat16()
    indices = torch.randint(
        0, CONTEXT, (tokens, TOPK), device="cuda", generator=g, dtype=torch.int32
    )
    indices[:, ::97] = -1
    return q, cache, indices


def flashmla_padded(q: torch.Tensor, cache: torch.Tensor, indices: torch.Tensor):
    """FlashMLA sparse decode as vLLM runs it below 64 heads: the query padded
    with zero heads, its tile-scheduler metadata computed once."""
    import vllm._flashmla_C  # noqa: F401  (torch.ops._flashmla_C)

    op = torch.ops._flashmla_C.sparse_decode_fwd
    tokens, heads, _ = q.shape
    padded = q.new_zeros(tokens, 1, PADDED_HEADS, q.shape[-1])
    padded[:, 0, :heads] = q
    pages, idx = cache.unsqueeze(-2), indices.unsqueeze(1)

    def call(meta=None, splits=None):
        return op(
            padded, pages, idx, None, None, meta, splits, None, None, None, 512,
            SCALE, None, False,
        )  # fmt: skip

    _, _, meta, splits = call()
    return lambda _: call(meta, splits)


def measure(mode: str, tokens: int, heads: int, reps: int, bandwidth: float) -> dict:
    from vllm.models.kimi_k3.nvidia.dsa_ops.sparse_mla import (
        DEFAULT_TILES,
        TILE_CANDIDATES,
        SparseMLATiles,
        default_num_splits,
        sparse_mla_fp8,
    )

    q, cache, indices = inputs(tokens, heads, seed=tokens * 131 + heads)
    if mode == "prefill":
        # The mixed batch: every row one query of one batch.
        calls = 1
    else:
        calls = 20

    def time_ours(tiles: SparseMLATiles, num_splits: int | None = None) -> float:
        return time_graph(
            lambda _: sparse_mla_fp8(
                q, cache, indices, SCALE, num_splits=num_splits, tiles=tiles
            ),
            calls,
            reps,
        )

    tiles_us = {name: time_ours(tiles) for name, tiles in TILE_CANDIDATES.items()}
    sms = torch.cuda.get_device_properties(q.device).multi_processor_count
    probe_us = {
        name: time_ours(
            SparseMLATiles(*fields),
            default_num_splits(tokens, heads, TOPK, per_sm * sms),
        )
        for name, (fields, per_sm) in PROBES.items()
    }
    default = next(n for n, t in TILE_CANDIDATES.items() if t == DEFAULT_TILES)
    ours_us = tiles_us[default]
    padded_us = time_graph(flashmla_padded(q, cache, indices), calls, reps)
    nbytes = tokens * TOPK * cache.shape[-1] + q.numel() * 2 + tokens * heads * 1024
    return {
        "mode": mode,
        "tokens": tokens,
        "heads": heads,
        "topk": TOPK,
        "ours_us": ours_us,
        "flashmla_padded_us": padded_us,
        "ours_over_padded": ours_us / padded_us,
        "ours_copy_fraction": nbytes / (ours_us * 1e-6) / bandwidth,
        "tiles_us": tiles_us,
        "probe_us": probe_us,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--heads", type=int, nargs="+", default=[12, 16, 32])
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    bad = [h for h in args.heads if not 1 <= h <= PADDED_HEADS]
    if bad:
        parser.error(f"--heads {bad}: FlashMLA pads to {PADDED_HEADS}; give 1 to 64")
    bandwidth = copy_bandwidth()
    print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s")
    rows = []
    print(f"{'mode':>8} {'tokens':>6} {'heads':>5} {'ours us':>9} {'padded us':>9} "
          f"{'ratio':>6} {'of copy':>7}  launch shapes / padded")  # fmt: skip
    for heads in args.heads:
        for mode, tokens in POINTS:
            row = measure(mode, tokens, heads, args.reps, bandwidth)
            rows.append(row)
            print(f"{mode:>8} {tokens:>6} {heads:>5} {row['ours_us']:>9.1f} "
                  f"{row['flashmla_padded_us']:>9.1f} {row['ours_over_padded']:>6.2f} "
                  f"{row['ours_copy_fraction']:>7.2f}  " + " ".join(
                      f"{name} {us / row['flashmla_padded_us']:.2f}"
                      for name, us in {**row["tiles_us"], **row["probe_us"]}.items()),
                  flush=True)  # fmt: skip
    if args.json is not None:
        args.json.write_text(
            json.dumps({"copy_bandwidth": bandwidth, "points": rows}, indent=1)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
