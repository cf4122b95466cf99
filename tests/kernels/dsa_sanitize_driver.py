# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Runs each DSA cache-writer kernel once at a representative size, for
``compute-sanitizer --tool memcheck|racecheck python dsa_sanitize_driver.py``.

Packed (non-contiguous) cache blocks, -1 holes, strided inputs and a top-k
buffer wider than the fill are used, so every address path is exercised."""

import torch
from dsa_gpu_utils import EPS, PackedCaches, gemm_slices, norm_weights, random_slots

from vllm.models.kimi_k3.nvidia.dsa_ops.fused_prologue import dsa_fused_prologue
from vllm.models.kimi_k3.nvidia.dsa_ops.indexer_k_insert import (
    indexer_k_norm_quant_insert,
)


def main() -> None:
    t, nb = 257, 6
    q_c, kv_c, k_pe, index_k = gemm_slices(t)
    qw, kvw, kw, kb = norm_weights()
    slots = random_slots(t, nb, seed=1)
    topk = torch.zeros(t + 3, 2048, dtype=torch.int32, device="cuda")
    for fp4 in (False, True):
        caches = PackedCaches(nb, fp4)
        indexer_k_norm_quant_insert(
            index_k, kw, kb, EPS, slots, caches.index, topk, t, fp4=fp4
        )
        dsa_fused_prologue(
            q_c, kv_c, k_pe, index_k, qw, kvw, kw, kb, EPS, topk,
            caches.mla, slots, caches.index, slots, fp4=fp4,
        )  # fmt: skip
    torch.cuda.synchronize()
    print("dsa_sanitize_driver: 4 kernels ran")


if __name__ == "__main__":
    main()
