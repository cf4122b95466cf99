# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The numbers the Kimi K3.1 DSA kernels fix, each defined once.

The byte formats of the two DSA caches, the dims our CUDA kernels are compiled
for, and the shapes vLLM 0.33.0's DeepGEMM indexer and FlashMLA sparse kernels
accept. Every other module imports them from here: the ``dsa_config`` rules,
the cache sizing, the ops layer and its references. The ops layer runs on GPU
hosts without vLLM, so this module imports the standard library only.

The CUDA side reads the same numbers from ``csrc/kimi_k3/dsa_formats.h``: a
constant ``kFooBar`` there is ``FOO_BAR`` here, and a CPU test checks that the
two agree. Derived numbers are computed from the ones they depend on, never
restated.
"""

# ---------------------------------------------------------------------------
# Scalar encodings (fp8 e4m3, e2m1, UE8M0).
# ---------------------------------------------------------------------------

FP8_E4M3_MAX = 448.0
# Floor of the absmax before an fp8 scale is derived (all-zero rows get a
# finite scale and zero codes instead of NaN).
FP8_AMAX_FLOOR = 1e-4
E2M1_MAX = 6.0
# Values per UE8M0 scale of an MXFP4 key.
MXFP4_BLOCK_SIZE = 32
# Exponent bias of a UE8M0 byte (the fp32 exponent field's).
UE8M0_BIAS = 127
# Floor of an MXFP4 block absmax: E2M1_MAX times the smallest normal fp32
# (2^-126) keeps the scale exponent normal.
MXFP4_AMAX_FLOOR = E2M1_MAX * 2.0**-126

# ---------------------------------------------------------------------------
# Indexer key cache (per token: values, then scale bytes, segregated per block).
# ---------------------------------------------------------------------------

# The fp8 key's scale word: an fp32 power of two (SM90 readers) or four equal
# UE8M0 bytes (SM10x readers).
INDEXER_SCALE_BYTES = 4

# ---------------------------------------------------------------------------
# fp8_ds_mla MLA cache entry: 512 fp8 latent values, one fp32 power-of-two
# scale per 128 of them, 64 bf16 rope values (656 B).
# ---------------------------------------------------------------------------

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
    """Value bytes of one indexer key (fp8: one byte a value; MXFP4: two
    values a byte)."""
    return head_dim // 2 if fp4 else head_dim


def indexer_scale_bytes(head_dim: int, fp4: bool) -> int:
    """Scale bytes of one indexer key (fp8: one 4-byte word; MXFP4: one UE8M0
    byte per 32 values)."""
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
    sizes (656 at 512 + 64): fp8 codes, one fp32 scale per started tile,
    bf16 rope values."""
    num_tiles = -(-kv_lora_rank // DS_MLA_TILE)
    return (
        kv_lora_rank
        + num_tiles * DS_MLA_SCALE_BYTES
        + rope_dim * DS_MLA_ROPE_DTYPE_BYTES
    )


# ---------------------------------------------------------------------------
# The dims our kernels are compiled for (csrc/kimi_k3): Kimi K3.1's latent
# dims for the fused prologue, a 128-wide indexer key for both writers.
# ---------------------------------------------------------------------------

KERNEL_Q_LORA_RANK = 1536
# The prologue writes the normed latent as an fp8_ds_mla entry.
KERNEL_KV_LORA_RANK = DS_MLA_NOPE_DIM
KERNEL_ROPE_DIM = DS_MLA_ROPE_DIM
KERNEL_INDEX_HEAD_DIM = 128
# 16-byte vector loads of bf16 rows: row strides in multiples of 8 elements.
KERNEL_ROW_ALIGN_ELEMENTS = 8
# Indexer cache bytes per token at the kernels' head dim: 132 and 68.
INDEXER_FP8_ENTRY_BYTES = indexer_entry_bytes(KERNEL_INDEX_HEAD_DIM, fp4=False)
INDEXER_FP4_ENTRY_BYTES = indexer_entry_bytes(KERNEL_INDEX_HEAD_DIM, fp4=True)

# ---------------------------------------------------------------------------
# What vLLM 0.33.0's kernels accept.
# ---------------------------------------------------------------------------

# Kernel pages of the two DSA caches on CUDA, in tokens: FlashMLA sparse reads
# the fp8_ds_mla cache, DeepGEMM's paged MQA logits the indexer keys, in pages
# of 64 tokens (SM90 and SM10x alike).
MLA_KERNEL_PAGE_TOKENS = 64
INDEXER_KERNEL_PAGE_TOKENS = 64
# (MLA, indexer), as the KV plan lays out the packed row.
KERNEL_BLOCK_SIZES = (MLA_KERNEL_PAGE_TOKENS, INDEXER_KERNEL_PAGE_TOKENS)
# The head counts DeepGEMM's indexer MQA-logits kernels run at (the indexer's
# heads are zero-padded up to the first that holds them).
DEEPGEMM_INDEX_HEADS = (32, 64)
# The indexer head dims DeepGEMM's MQA-logits kernels (the fp8_fp4 ones vLLM
# 0.33.0 ships, SM90 and SM100) take, per key format.
DEEPGEMM_INDEX_HEAD_DIMS_FP8 = (32, 64, 128)
DEEPGEMM_INDEX_HEAD_DIMS_FP4 = (64, 128)
# FlashMLA sparse's fp8 decode kernel runs 64 or 128 query heads; vLLM 0.33.0
# pads a rank's heads up to one of them (FlashMLASparseImpl).
SPARSE_MLA_MAX_HEADS_PER_RANK = 128
# vLLM 0.33.0's FlashMLA sparse backend turns each top-k row into cache slots
# with triton_convert_req_index_to_global_index, 128 columns per tile.
INDEX_TOPK_MULTIPLE = 128
# Bytes of one top-k index (the buffer is int32).
TOPK_INDEX_BYTES = 4
# vLLM 0.33.0's DCP top-k merge (_merge_dcp_topk_global: CuteDSL stable
# top-k selector) takes only these.
DCP_INDEX_TOPK_VALUES = (512, 1024, 2048)


# ---------------------------------------------------------------------------
# Whether a model's dims reach our kernels.
# ---------------------------------------------------------------------------


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
