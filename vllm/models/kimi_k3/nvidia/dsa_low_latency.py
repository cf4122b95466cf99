# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Low-latency GEMMs for the packed projections of the Kimi K3.1 DSA layers.

``KimiK3DSAAttention.pack_projections`` replaces six GEMMs by two over packed
weights (``vllm/models/kimi_k3/nvidia/dsa.py``):

* ``[q_a | kv_a | wk | weights_proj]``: ``N = 1536 + 512 + 64 + 128 + 32 =
  2272`` rows, ``K = 7168`` (replicated; the same at every TP size);
* ``[q_b | wq_index]``: ``N = local_heads * 192 + 32 * 128`` rows, ``K =
  1536``: 22528 (TP1), 13312 (TP2), 8704 (TP4), 6400 (TP8) for 96 heads.

vLLM 0.33.0's Kimi K3 low-latency GEMM (``low_latency_gemm.py``) dispatches by
the local ``(N, K)`` of a weight through per-device tables of *measured*
winners (``KIMI_K3_PROJECTIONS{,_SM100,_SM90}``) and warms the CuTe-DSL
skinny-GEMM configs they name through
``shape_dynamic_skinny_gemm.request_warmup_configs``. None of the packed
shapes above is a key of those tables, so ``try_low_latency_gemm`` returns
None for them. What this module adds, and what is still missing:

* :func:`low_latency_linear` first asks ``try_low_latency_gemm`` (any shape
  0.33.0 has measured keeps its measured kernel), then, for the packed Kimi
  K3.1 shapes only, runs 0.33.0's shape-dynamic CuTe skinny GEMM for 1..16
  tokens, and falls back to ``F.linear`` (cuBLAS) for everything else: other
  shapes, more tokens, non-bf16, non-CUDA tensors, batch-invariant mode, a
  missing CuTe DSL.
* The skinny-GEMM configs of the packed shapes: on SM90 the measured winners
  of :data:`PACKED_SHAPE_CONFIG_OVERRIDES` (cuBLAS where the skinny GEMM
  lost); elsewhere, until measured, the kernel's own shape heuristic
  (``ShapeDynamicSkinnyGemm._config``, what it runs when called without a
  config). The ``dsv3_fused_a`` kernel is compiled for fixed shapes and cannot
  take them.
* :func:`request_low_latency_warmup` registers exactly the configs a packed
  weight will run with 0.33.0's CuTe-DSL warmup (compiled before CUDA-graph
  capture, never during it).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

import vllm.envs as envs
from vllm.logger import init_logger

logger = init_logger(__name__)

# Kimi K3.1 (public config): the packed projections' dimensions.
KIMI_K31_HIDDEN_SIZE = 7168
KIMI_K31_Q_LORA_RANK = 1536
KIMI_K31_KV_LORA_RANK = 512
KIMI_K31_QK_ROPE_HEAD_DIM = 64
KIMI_K31_QK_HEAD_DIM = 128 + 64
KIMI_K31_NUM_HEADS = 96
KIMI_K31_INDEX_HEAD_DIM = 128
KIMI_K31_INDEX_NUM_HEADS = 32
# TP sizes whose local head count divides 96 without padding.
PACKED_TP_SIZES = (1, 2, 4, 8)
# The CuTe skinny GEMM takes 1 <= M <= 16.
LOW_LATENCY_MAX_TOKENS = 16


def packed_input_rows(
    q_lora_rank: int = KIMI_K31_Q_LORA_RANK,
    kv_lora_rank: int = KIMI_K31_KV_LORA_RANK,
    qk_rope_head_dim: int = KIMI_K31_QK_ROPE_HEAD_DIM,
    index_head_dim: int = KIMI_K31_INDEX_HEAD_DIM,
    index_num_heads: int = KIMI_K31_INDEX_NUM_HEADS,
) -> int:
    """Rows of ``[q_a | kv_a | wk | weights_proj]`` (2272 for Kimi K3.1)."""
    return (
        q_lora_rank
        + kv_lora_rank
        + qk_rope_head_dim
        + index_head_dim
        + (index_num_heads)
    )


def packed_query_rows(
    num_local_heads: int,
    qk_head_dim: int = KIMI_K31_QK_HEAD_DIM,
    index_head_dim: int = KIMI_K31_INDEX_HEAD_DIM,
    index_num_heads: int = KIMI_K31_INDEX_NUM_HEADS,
) -> int:
    """Rows of ``[q_b | wq_index]`` for ``num_local_heads`` attention heads."""
    return num_local_heads * qk_head_dim + index_num_heads * index_head_dim


def kimi_k31_packed_shapes() -> frozenset[tuple[int, int]]:
    """The local ``(N, K)`` of both packed weights at TP 1/2/4/8."""
    shapes = {(packed_input_rows(), KIMI_K31_HIDDEN_SIZE)}
    for tp_size in PACKED_TP_SIZES:
        rows = packed_query_rows(KIMI_K31_NUM_HEADS // tp_size)
        shapes.add((rows, KIMI_K31_Q_LORA_RANK))
    return frozenset(shapes)


# SkinnyGemmConfig fields (num_rows, block_size, outputs_per_block, k_unroll,
# vector_width) of a measured config, or None where cuBLAS was faster.
MeasuredConfig = tuple[int, int, int, int, int] | None

# The H200 (SM90), ``benchmarks/kernels/bench_packed_gemm.py``
# (docs/benchmarks.md): the fastest skinny config where it beats cuBLAS by
# 5 %, else None. The skinny GEMM wins at 1-4 tokens for the input projection
# and 1-2 for the query projection; beyond, its heuristic is up to 4x slower
# than cuBLAS.
_SM90_MEASURED: dict[tuple[int, int], dict[int, MeasuredConfig]] = {
    (2272, 7168): {
        1: (1, 224, 2, 4, 8),
        2: (2, 64, 2, 2, 8),
        3: (3, 64, 2, 2, 8),
        4: (4, 64, 2, 2, 8),
        **dict.fromkeys(range(5, LOW_LATENCY_MAX_TOKENS + 1)),
    },
    (6400, 1536): {
        1: (1, 96, 4, 2, 4),
        2: (2, 96, 4, 1, 8),
        **dict.fromkeys(range(3, LOW_LATENCY_MAX_TOKENS + 1)),
    },
    (8704, 1536): {
        1: (1, 96, 4, 2, 4),
        2: (2, 96, 4, 1, 8),
        **dict.fromkeys(range(3, LOW_LATENCY_MAX_TOKENS + 1)),
    },
    (13312, 1536): {
        1: (1, 96, 4, 2, 4),
        2: (2, 96, 4, 1, 8),
        **dict.fromkeys(range(3, LOW_LATENCY_MAX_TOKENS + 1)),
    },
    (22528, 1536): {
        1: (1, 96, 4, 2, 4),
        2: (2, 96, 4, 1, 8),
        **dict.fromkeys(range(3, LOW_LATENCY_MAX_TOKENS + 1)),
    },
}

# ``{capability major: {(N, K): {M: fields or None}}}``: measured winners that
# replace the skinny GEMM's heuristic for a packed shape; None runs cuBLAS.
# A device or M without an entry keeps the heuristic.
PACKED_SHAPE_CONFIG_OVERRIDES: dict[
    int, dict[tuple[int, int], dict[int, MeasuredConfig]]
] = {9: _SM90_MEASURED}


def _skinny_gemm():
    """0.33.0's shape-dynamic CuTe skinny GEMM, or None where it cannot run."""
    try:
        from vllm.model_executor.kernels.linear.cute_dsl.skinny_gemm import (
            shape_dynamic_skinny_gemm,
        )
    except ImportError:
        return None
    if not shape_dynamic_skinny_gemm.is_available():
        return None
    return shape_dynamic_skinny_gemm


@functools.cache
def _capability_major(device_index: int) -> int:
    return torch.cuda.get_device_capability(device_index)[0]


def _device_major(device: torch.device) -> int | None:
    """The device's capability major where 0.33.0's Kimi K3 low-latency GEMM
    serves it (SM90, SM100, SM103, SM107), else None."""
    if device.type != "cuda":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    major = _capability_major(index)
    return major if major in (9, 10) else None


@functools.cache
def _packed_plan(n: int, k: int, major: int) -> dict[int, object]:
    """``{M: SkinnyGemmConfig}`` for a packed shape on a device of capability
    ``major``; an M measured slower than cuBLAS, or without a valid config,
    is left out (it runs cuBLAS)."""
    if (n, k) not in kimi_k31_packed_shapes():
        return {}
    try:
        from vllm.model_executor.kernels.linear.cute_dsl.skinny_gemm import (
            ShapeDynamicSkinnyGemm,
            SkinnyGemmConfig,
        )
    except ImportError:
        return {}
    heuristic = getattr(ShapeDynamicSkinnyGemm, "_config", None)
    overrides = PACKED_SHAPE_CONFIG_OVERRIDES.get(major, {}).get((n, k), {})
    plan: dict[int, object] = {}
    for num_tokens in range(1, LOW_LATENCY_MAX_TOKENS + 1):
        if num_tokens in overrides:
            fields = overrides[num_tokens]
            config = None if fields is None else SkinnyGemmConfig(*fields)
        elif heuristic is not None:
            config = heuristic(num_tokens, n, k)
        else:
            config = None
        if config is None:
            continue
        # The kernel's own shape constraints (skinny_gemm.py, __call__).
        if n % config.outputs_per_block or k % (
            config.block_size * config.vector_width
        ):
            continue
        plan[num_tokens] = config
    return plan


def _runtime_ok(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Same conditions as 0.33.0's ``low_latency_gemm._runtime_ok`` plus the
    skinny GEMM's aligned row-major ``x``."""
    return (
        x.dim() == 2
        and weight.dim() == 2
        and x.is_cuda
        and weight.is_cuda
        and x.device == weight.device
        and x.dtype == torch.bfloat16
        and weight.dtype == torch.bfloat16
        and x.shape[1] == weight.shape[1]
        and x.stride(1) == 1
        and (x.shape[0] == 1 or x.stride(0) % 8 == 0)
        and weight.is_contiguous()
    )


def _aligned_rows(x: torch.Tensor, config: object) -> bool:
    """The skinny GEMM's vectorized loads of ``x`` stay aligned (it raises
    otherwise; a column slice at an odd offset falls back instead)."""
    from vllm.model_executor.kernels.linear.cute_dsl.skinny_gemm import (
        row_stride_ok,
    )

    return row_stride_ok(x, config)


def low_latency_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight.T`` through the fastest kernel known for its shape.

    0.33.0's measured Kimi K3 tables first (``try_low_latency_gemm``), then
    the packed Kimi K3.1 DSA shapes on the CuTe skinny GEMM (1..16 tokens),
    else ``F.linear``.
    """
    if x.is_cuda and not envs.VLLM_BATCH_INVARIANT:
        from vllm.models.kimi_k3.nvidia.low_latency_gemm import try_low_latency_gemm

        out = try_low_latency_gemm(x, weight)
        if out is not None:
            return out
        if 1 <= x.shape[0] <= LOW_LATENCY_MAX_TOKENS and _runtime_ok(x, weight):
            major = _device_major(x.device)
            if major is not None:
                plan = _packed_plan(weight.shape[0], weight.shape[1], major)
                config = plan.get(x.shape[0])
                gemm = _skinny_gemm() if config is not None else None
                if gemm is not None and _aligned_rows(x, config):
                    return gemm(x, weight, config, None)
    return F.linear(x, weight)


def request_low_latency_warmup(weight: torch.Tensor) -> bool:
    """Ask 0.33.0's CuTe-DSL warmup to compile the skinny-GEMM configs that
    :func:`low_latency_linear` will run for ``weight``, before CUDA-graph
    capture. Returns whether anything was requested (False on the CPU, for
    non-bf16 weights, shapes that are not packed Kimi K3.1 shapes, or without
    the CuTe DSL)."""
    if weight.dim() != 2 or weight.dtype != torch.bfloat16 or envs.VLLM_BATCH_INVARIANT:
        return False
    major = _device_major(weight.device)
    if major is None:
        return False
    plan = _packed_plan(weight.shape[0], weight.shape[1], major)
    gemm = _skinny_gemm() if plan else None
    if gemm is None:
        return False
    gemm.request_warmup_configs(weight.dtype, set(plan.values()))
    logger.debug(
        "Kimi K3.1 DSA: skinny-GEMM warmup requested for packed weight %s.",
        tuple(weight.shape),
    )
    return True
