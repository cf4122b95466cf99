# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The numbers the Kimi K3.1 DSA kernels fix, each defined once.

``csrc/kimi_k3/dsa_formats.h`` holds the same numbers (``kFooBar`` is
``FOO_BAR``); a CPU test checks they agree. Standard library only: the ops
layer runs without vLLM.
"""

# Scalar encodings (fp8 e4m3, e2m1, UE8M0).

FP8_E4M3_MAX = 448.0
# All-zero rows get a finite scale instead of NaN.
FP8_AMAX_FLOOR = 1e-4
E2M1_MAX = 6.0
MXFP4_BLOCK_SIZE = 32
UE8M0_BIAS = 127
# Exponents a UE8M0 byte holds; the least one of a normal fp32.
UE8M0_MAX_EXP = UE8M0_BIAS
UE8M0_MIN_EXP = -UE8M0_BIAS
FP32_MIN_NORMAL_EXP = 1 - UE8M0_BIAS
# Keeps the MXFP4 scale exponent normal.
MXFP4_AMAX_FLOOR = E2M1_MAX * 2.0**FP32_MIN_NORMAL_EXP

# Indexer key cache: per token, values then scale bytes, segregated per block.

# fp32 power of two (SM90) or four equal UE8M0 bytes (SM10x).
INDEXER_SCALE_BYTES = 4

# fp8_ds_mla entry: 512 fp8 latents, an fp32 scale per 128, 64 bf16 rope (656 B).

DS_MLA_NOPE_DIM = 512
DS_MLA_TILE = 128
DS_MLA_NUM_TILES = DS_MLA_NOPE_DIM // DS_MLA_TILE
DS_MLA_ROPE_DIM = 64
DS_MLA_SCALE_BYTES = 4
DS_MLA_ROPE_DTYPE_BYTES = 2
DS_MLA_SCALE_OFFSET = DS_MLA_NOPE_DIM
DS_MLA_ROPE_OFFSET = DS_MLA_SCALE_OFFSET + DS_MLA_SCALE_BYTES * DS_MLA_NUM_TILES
DS_MLA_ENTRY_BYTES = DS_MLA_ROPE_OFFSET + DS_MLA_ROPE_DTYPE_BYTES * DS_MLA_ROPE_DIM


def indexer_value_bytes(head_dim: int, fp4: bool) -> int:
    """Value bytes of one indexer key."""
    return head_dim // 2 if fp4 else head_dim


def indexer_scale_bytes(head_dim: int, fp4: bool) -> int:
    """Scale bytes of one indexer key."""
    return head_dim // MXFP4_BLOCK_SIZE if fp4 else INDEXER_SCALE_BYTES


def indexer_entry_bytes(head_dim: int, fp4: bool) -> int:
    """Bytes per token of the indexer cache: 132 (fp8) or 68 (MXFP4) at 128."""
    if fp4 and head_dim % MXFP4_BLOCK_SIZE:
        raise ValueError(
            f"MXFP4 indexer keys need a head dim that is a multiple of "
            f"{MXFP4_BLOCK_SIZE}, got {head_dim}"
        )
    return indexer_value_bytes(head_dim, fp4) + indexer_scale_bytes(head_dim, fp4)


def ds_mla_entry_bytes(kv_lora_rank: int, rope_dim: int) -> int:
    """Bytes per token of an ``fp8_ds_mla`` entry for other latent and rope
    sizes."""
    num_tiles = -(-kv_lora_rank // DS_MLA_TILE)
    return (
        kv_lora_rank
        + num_tiles * DS_MLA_SCALE_BYTES
        + rope_dim * DS_MLA_ROPE_DTYPE_BYTES
    )


# The dims our kernels are compiled for.

KERNEL_Q_LORA_RANK = 1536
KERNEL_KV_LORA_RANK = DS_MLA_NOPE_DIM
KERNEL_ROPE_DIM = DS_MLA_ROPE_DIM
KERNEL_INDEX_HEAD_DIM = 128
# 16-byte vector loads of bf16 rows: row strides in multiples of 8 elements.
KERNEL_ROW_ALIGN_ELEMENTS = 8
INDEXER_FP8_ENTRY_BYTES = indexer_entry_bytes(KERNEL_INDEX_HEAD_DIM, fp4=False)
INDEXER_FP4_ENTRY_BYTES = indexer_entry_bytes(KERNEL_INDEX_HEAD_DIM, fp4=True)

# What vLLM's kernels accept.

# Kernel page tokens of the MLA and indexer caches (SM90 and SM10x alike).
MLA_KERNEL_PAGE_TOKENS = 64
INDEXER_KERNEL_PAGE_TOKENS = 64
KERNEL_BLOCK_SIZES = (MLA_KERNEL_PAGE_TOKENS, INDEXER_KERNEL_PAGE_TOKENS)
# DeepGEMM's indexer MQA-logits head counts; our heads are zero-padded to one.
DEEPGEMM_INDEX_HEADS = (32, 64)
# Indexer head dims DeepGEMM's MQA-logits kernels take, per key format.
DEEPGEMM_INDEX_HEAD_DIMS_FP8 = (32, 64, 128)
DEEPGEMM_INDEX_HEAD_DIMS_FP4 = (64, 128)
# FlashMLA sparse's fp8 decode kernel runs 64 or 128 query heads.
SPARSE_MLA_MAX_HEADS_PER_RANK = 128
# FlashMLA sparse converts top-k rows to slots 128 columns per tile.
INDEX_TOPK_MULTIPLE = 128
TOPK_INDEX_BYTES = 4
# What vLLM's DCP top-k merge (_merge_dcp_topk_global) takes.
DCP_INDEX_TOPK_VALUES = (512, 1024, 2048)


# Whether a model's dims reach our kernels.


def k_insert_unsupported(index_head_dim: int, index_num_heads: int) -> list[str]:
    """Why the fused key insert cannot take this indexer (empty: it can)."""
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
    """Why the fused prologue cannot take this layer (empty: it can)."""
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
