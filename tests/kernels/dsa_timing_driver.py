# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Times the DSA cache writers under CUDA-graph replay (the benchmark issue
owns the full study; this is the smoke figure recorded with the GPU tests).

Prints, per token count, microseconds per call and the achieved bandwidth
(bytes each kernel must move: inputs read once, outputs written once, the
top-k fill of 2048 int32 per token included)."""

from functools import partial

import torch
from dsa_gpu_utils import EPS, PackedCaches, gemm_slices, norm_weights, random_slots

from vllm.models.kimi_k3.nvidia.dsa_ops.fused_prologue import dsa_fused_prologue
from vllm.models.kimi_k3.nvidia.dsa_ops.indexer_k_insert import (
    indexer_k_norm_quant_insert,
)

REPS = 50


def _time(fn) -> float:
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(REPS):
            fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(True)
    start.record()
    for _ in range(5):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (5 * REPS)


def main() -> None:
    qw, kvw, kw, kb = norm_weights()
    print("tokens  prologue_us  prologue_TB/s  insert_us  insert_TB/s")
    for t in (1, 64, 1024, 16384, 65536):
        q_c, kv_c, k_pe, index_k = gemm_slices(t)
        nb = t // 64 + 2
        caches = PackedCaches(nb, False)
        slots = random_slots(t, nb, seed=1, holes=0.0)
        topk = torch.empty(t, 2048, dtype=torch.int32, device="cuda")
        p_us = _time(partial(
            dsa_fused_prologue, q_c, kv_c, k_pe, index_k, qw, kvw, kw, kb, EPS,
            topk, caches.mla, slots, caches.index, slots, mx_scales=False))  # fmt: skip
        i_us = _time(partial(
            indexer_k_norm_quant_insert, index_k, kw, kb, EPS, slots,
            caches.index, topk, t, mx_scales=False))  # fmt: skip
        p_bytes = t * (2 * (1536 + 512 + 64 + 128) + 8 + 2 * (1536 + 512))
        p_bytes += t * (656 + 132 + 4 * 2048)
        i_bytes = t * (2 * 128 + 8 + 132 + 4 * 2048)
        print(f"{t:6d}  {p_us:11.2f}  {p_bytes / p_us / 1e6:13.3f}  "
              f"{i_us:9.2f}  {i_bytes / i_us / 1e6:11.3f}")  # fmt: skip


if __name__ == "__main__":
    main()
