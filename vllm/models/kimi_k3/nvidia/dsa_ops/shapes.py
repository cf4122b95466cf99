# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The shapes the compiled DSA kernels take (no torch, no vLLM).

``csrc/kimi_k3/dsa_common.cuh`` fixes the fused prologue to Kimi K3.1's
latent dims and both writers to a 128-wide indexer key; every bf16 input row
is read in 16-byte vectors. A model whose dims differ must not reach the
kernels: the layers ask these functions and keep the wrapper forward (and the
upstream key insert) instead, saying why.
"""

# Mirrors of the constants the kernels are compiled with.
KERNEL_Q_LORA_RANK = 1536
KERNEL_KV_LORA_RANK = 512
KERNEL_ROPE_DIM = 64
KERNEL_INDEX_HEAD_DIM = 128
# 16-byte vector loads of bf16 rows: row strides in multiples of 8 elements.
KERNEL_ROW_ALIGN_ELEMENTS = 8
# The head counts DeepGEMM's indexer MQA-logits kernels run at (the indexer's
# heads are zero-padded up to the first that holds them).
DEEPGEMM_INDEX_HEADS = (32, 64)
# The indexer head dims DeepGEMM's MQA-logits kernels (the fp8_fp4 ones vLLM
# 0.33.0 ships, SM90 and SM100) take, per key format: fp8 keys 32, 64 or 128;
# MXFP4 keys 64 or 128.
DEEPGEMM_INDEX_HEAD_DIMS_FP8 = (32, 64, 128)
DEEPGEMM_INDEX_HEAD_DIMS_FP4 = (64, 128)


def k_insert_unsupported(index_head_dim: int, index_num_heads: int) -> list[str]:
    """Why the fused key insert cannot take this indexer (empty: it can).

    Its key is the first slice of the ``[wk | weights_proj]`` GEMM output, so
    the row stride is ``index_head_dim + index_num_heads``.
    """
    reasons = []
    if index_head_dim != KERNEL_INDEX_HEAD_DIM:
        reasons.append(
            f"index_head_dim {index_head_dim} (the kernels are built for "
            f"{KERNEL_INDEX_HEAD_DIM})"
        )
    row = index_head_dim + index_num_heads
    if row % KERNEL_ROW_ALIGN_ELEMENTS:
        reasons.append(
            f"the [wk | weights_proj] row of {row} bf16 values is not a multiple "
            f"of {KERNEL_ROW_ALIGN_ELEMENTS} (16 bytes); index_num_heads must be "
            f"a multiple of {KERNEL_ROW_ALIGN_ELEMENTS}"
        )
    return reasons


def fused_prologue_unsupported(
    q_lora_rank: int,
    kv_lora_rank: int,
    qk_rope_head_dim: int,
    index_head_dim: int,
    index_num_heads: int,
) -> list[str]:
    """Why the fused prologue cannot take this layer (empty: it can).

    Its inputs are column slices of the packed ``[q_a | kv_a | k_pe | wk |
    weights_proj]`` GEMM output, whose row must be 16-byte aligned.
    """
    reasons = []
    for name, value, built in (
        ("q_lora_rank", q_lora_rank, KERNEL_Q_LORA_RANK),
        ("kv_lora_rank", kv_lora_rank, KERNEL_KV_LORA_RANK),
        ("qk_rope_head_dim", qk_rope_head_dim, KERNEL_ROPE_DIM),
        ("index_head_dim", index_head_dim, KERNEL_INDEX_HEAD_DIM),
    ):
        if value != built:
            reasons.append(f"{name} {value} (the prologue is built for {built})")
    row = q_lora_rank + kv_lora_rank + qk_rope_head_dim + index_head_dim
    row += index_num_heads
    if row % KERNEL_ROW_ALIGN_ELEMENTS:
        reasons.append(
            f"the packed input row of {row} bf16 values is not a multiple of "
            f"{KERNEL_ROW_ALIGN_ELEMENTS} (16 bytes); index_num_heads must be a "
            f"multiple of {KERNEL_ROW_ALIGN_ELEMENTS}"
        )
    return reasons
