# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Low-latency GEMMs for the packed projections of the Kimi K3.1 DSA layers.

The packed shapes are not in vLLM's measured Kimi K3 GEMM tables; for
1..16 tokens they run its CuTe skinny GEMM instead of cuBLAS.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

import vllm.envs as envs
from vllm.logger import init_logger
from vllm.models.kimi_k3.common.dsa_formats import (
    KERNEL_INDEX_HEAD_DIM,
    KERNEL_KV_LORA_RANK,
    KERNEL_Q_LORA_RANK,
    KERNEL_ROPE_DIM,
)

logger = init_logger(__name__)

# Kimi K3.1's dims beyond the kernels' (common/dsa_formats.py).
KIMI_K31_HIDDEN_SIZE = 7168
KIMI_K31_QK_HEAD_DIM = 128 + KERNEL_ROPE_DIM
KIMI_K31_NUM_HEADS = 96
KIMI_K31_INDEX_NUM_HEADS = 32
# TP sizes whose local head count divides 96 without padding.
PACKED_TP_SIZES = (1, 2, 4, 8)
# The CuTe skinny GEMM takes 1 <= M <= 16.
LOW_LATENCY_MAX_TOKENS = 16


def packed_input_rows(
    q_lora_rank: int = KERNEL_Q_LORA_RANK,
    kv_lora_rank: int = KERNEL_KV_LORA_RANK,
    qk_rope_head_dim: int = KERNEL_ROPE_DIM,
    index_head_dim: int = KERNEL_INDEX_HEAD_DIM,
    index_num_heads: int = KIMI_K31_INDEX_NUM_HEADS,
) -> int:
    """Rows of ``[q_a | kv_a | wk | weights_proj]`` (2272 for Kimi K3.1)."""
    return (
        q_lora_rank + kv_lora_rank + qk_rope_head_dim + index_head_dim + index_num_heads
    )


def packed_query_rows(
    num_local_heads: int,
    qk_head_dim: int = KIMI_K31_QK_HEAD_DIM,
    index_head_dim: int = KERNEL_INDEX_HEAD_DIM,
    index_num_heads: int = KIMI_K31_INDEX_NUM_HEADS,
) -> int:
    """Rows of ``[q_b | wq_index]`` for ``num_local_heads`` attention heads."""
    return num_local_heads * qk_head_dim + index_num_heads * index_head_dim


def _input_shape() -> tuple[int, int]:
    """The ``(N, K)`` of the packed input weight (replicated)."""
    return packed_input_rows(), KIMI_K31_HIDDEN_SIZE


def _query_shapes() -> list[tuple[int, int]]:
    """The local ``(N, K)`` of the packed query weight at TP 1/2/4/8."""
    return [
        (packed_query_rows(KIMI_K31_NUM_HEADS // tp_size), KERNEL_Q_LORA_RANK)
        for tp_size in PACKED_TP_SIZES
    ]


def kimi_k31_packed_shapes() -> frozenset[tuple[int, int]]:
    """The local ``(N, K)`` of both packed weights at TP 1/2/4/8."""
    return frozenset([_input_shape(), *_query_shapes()])


# SkinnyGemmConfig fields, or None where cuBLAS was faster.
MeasuredConfig = tuple[int, int, int, int, int] | None

# SM90: the fastest skinny config where it beat cuBLAS by 5 %, else None.
_SM90_QUERY_MEASURED: dict[int, MeasuredConfig] = {
    1: (1, 96, 4, 2, 4),
    2: (2, 96, 4, 1, 8),
    **dict.fromkeys(range(3, LOW_LATENCY_MAX_TOKENS + 1)),
}
_SM90_MEASURED: dict[tuple[int, int], dict[int, MeasuredConfig]] = {
    _input_shape(): {
        1: (1, 224, 2, 4, 8),
        2: (2, 64, 2, 2, 8),
        3: (3, 64, 2, 2, 8),
        4: (4, 64, 2, 2, 8),
        **dict.fromkeys(range(5, LOW_LATENCY_MAX_TOKENS + 1)),
    },
    **{shape: dict(_SM90_QUERY_MEASURED) for shape in _query_shapes()},
}

# Capability major -> (N, K) -> M -> measured config; absent keeps the heuristic.
PACKED_SHAPE_CONFIG_OVERRIDES: dict[
    int, dict[tuple[int, int], dict[int, MeasuredConfig]]
] = {9: _SM90_MEASURED}


def _skinny_gemm():
    """vLLM's shape-dynamic CuTe skinny GEMM, or None where it cannot run."""
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
    """The capability major where vLLM's Kimi K3 low-latency GEMM serves
    the device, else None."""
    if device.type != "cuda":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    major = _capability_major(index)
    return major if major in (9, 10) else None


@functools.cache
def _packed_plan(n: int, k: int, major: int) -> dict[int, object]:
    """``{M: SkinnyGemmConfig}`` for a packed shape; an M that runs cuBLAS is
    left out."""
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
        if n % config.outputs_per_block or k % (
            config.block_size * config.vector_width
        ):
            continue
        plan[num_tokens] = config
    return plan


def _runtime_ok(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """vLLM's ``low_latency_gemm._runtime_ok`` plus an aligned row-major
    ``x``."""
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
    """Whether the skinny GEMM's vectorized loads of ``x`` stay aligned."""
    from vllm.model_executor.kernels.linear.cute_dsl.skinny_gemm import (
        row_stride_ok,
    )

    return row_stride_ok(x, config)


def low_latency_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight.T`` through the fastest kernel known for its shape."""
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
    """Ask vLLM's CuTe-DSL warmup to compile the configs
    :func:`low_latency_linear` will run for ``weight``, before CUDA-graph
    capture; returns whether anything was requested."""
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
