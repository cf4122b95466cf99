# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The packed DSA block row of Kimi K3.1, applied to an engine configuration.

Kimi K3.1 is a KDA hybrid: its 69 KDA layers keep per-request recurrent and
conv states. With a block-outermost KV cache layout one block row holds every
DSA layer's MLA and indexer pages (plus a dense MLA draft's pages) and, in
the state groups, KDA states. The row's byte arithmetic and its size
(:func:`~vllm.models.kimi_k3.common.dsa_cache.packed_dsa_block_size`) are
:mod:`.dsa_cache`'s; this module measures the KDA state and the kernel
alignment of an engine configuration, and the Kimi K3 model classes'
``get_hybrid_block_size`` hook returns the resulting size
(:func:`packed_hybrid_block_size`). The platform's
``_align_hybrid_block_size``, which asks that hook, is the one place that
writes it into ``cache_config`` (the ``block_size`` seam).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch

from vllm.logger import init_logger
from vllm.models.kimi_k3.common.dsa_cache import (
    dense_mla_draft_bytes_per_token,
    dsa_layer_counts,
    is_kda_hybrid_dsa,
    mla_page_bytes_per_token,
    packed_dsa_block_size,
)
from vllm.models.kimi_k3.common.dsa_verify import (
    DENSE_MLA_DRAFT_METHODS,
    MTP_DRAFT_METHODS,
    check_dsa_pcp,
)
from vllm.utils.math_utils import cdiv
from vllm.v1.kv_cache_interface import (
    MLAAttentionSpec,
    get_kv_quant_mode,
)
from vllm.v1.worker.kernel_pages import token_cache_kernel_page_slots

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = init_logger(__name__)


def kda_state_bytes(
    num_heads: int,
    head_dim: int,
    conv_kernel_size: int,
    tp_size: int,
    num_speculative_tokens: int = 0,
    conv_dtype: torch.dtype = torch.bfloat16,
    recurrent_dtype: torch.dtype = torch.float32,
) -> int:
    """Bytes of one KDA layer's state of one request on one TP rank: the conv
    state (q, k and v channels, ``conv_kernel_size - 1 + num_spec`` taps) and
    the recurrent state (``head_dim x head_dim`` per head), as vLLM's
    ``MambaStateShapeCalculator.kda_state_shape`` shapes them."""
    from vllm.model_executor.layers.mamba.mamba_utils import MambaStateShapeCalculator

    conv_shape, recurrent_shape = MambaStateShapeCalculator.kda_state_shape(
        tp_size,
        num_heads,
        head_dim,
        conv_kernel_size=conv_kernel_size,
        num_spec=num_speculative_tokens,
    )
    return (
        math.prod(conv_shape) * conv_dtype.itemsize
        + math.prod(recurrent_shape) * recurrent_dtype.itemsize
    )


def kda_state_bytes_for(vllm_config: VllmConfig) -> int:
    """:func:`kda_state_bytes` for the target model of ``vllm_config``, with
    the state dtypes the KDA layers allocate."""
    from vllm.model_executor.layers.mamba.mamba_utils import MambaStateDtypeCalculator

    model_config = vllm_config.model_config
    cache_config = vllm_config.cache_config
    linear_attn_config = model_config.hf_text_config.linear_attn_config
    conv_dtype, recurrent_dtype = MambaStateDtypeCalculator.kda_state_dtype(
        model_config.dtype,
        cache_config.mamba_cache_dtype,
        cache_config.mamba_ssm_cache_dtype,
    )
    spec_config = vllm_config.speculative_config
    return kda_state_bytes(
        linear_attn_config["num_heads"],
        linear_attn_config["head_dim"],
        linear_attn_config["short_conv_kernel_size"],
        vllm_config.parallel_config.tensor_parallel_size,
        spec_config.num_speculative_tokens if spec_config else 0,
        conv_dtype,
        recurrent_dtype,
    )


def packed_dsa_alignment(
    kernel_block_sizes: list[int], checkpoint_alignment: int | None = None
) -> int:
    """Token alignment of the packed block: every backend's smallest kernel
    block, 128 (vLLM keeps MLA manager blocks a multiple of 128 so split
    kernel blocks stay aligned for its decode kernels), and the KDA prefill
    checkpoint alignment in ``mamba_cache_mode='align'``."""
    return math.lcm(128, *kernel_block_sizes, checkpoint_alignment or 1)


def packed_block_bytes(
    block_size: int,
    row_bytes_per_token: int,
    state_group_bytes: int,
    kernel_page_bytes: list[int],
) -> int:
    """Bytes of one packed block, as vLLM's planner lays it out
    (``_get_kv_cache_bytes_per_block``): the widest group (the DSA row or a
    state group) rounded up to whole kernel pages of every split cache
    (``block_stride_alignment``: 64 x 656 B for ``fp8_ds_mla``, 64 x 132 B for
    fp8 indexer keys), so the runner can address each cache's kernel pages."""
    widest = max(block_size * row_bytes_per_token, state_group_bytes)
    step = math.lcm(*kernel_page_bytes) if kernel_page_bytes else 1
    return cdiv(widest, step) * step


def backend_kernel_block_alignments(backends: list[Any]) -> list[int]:
    """The smallest kernel block of each attention backend (a ``MultipleOf``
    counts as its base), as vLLM's hybrid alignment reads them."""
    from vllm.v1.attention.backend import MultipleOf

    return [
        min(s.base if isinstance(s, MultipleOf) else s for s in sizes)
        for backend in backends
        if (sizes := backend.get_supported_kernel_block_sizes())
    ]


def target_mla_bytes_per_token(vllm_config: VllmConfig) -> int:
    """One DSA layer's MLA page per token (656 for ``fp8_ds_mla``)."""
    text_config = vllm_config.model_config.hf_text_config
    return mla_page_bytes_per_token(
        vllm_config.cache_config.cache_dtype,
        text_config.kv_lora_rank,
        text_config.qk_rope_head_dim or 0,
        vllm_config.model_config,
    )


def check_token_cache_splits(
    vllm_config: VllmConfig, backends: list[Any], block_size: int
) -> None:
    """Refuse, before the KV cache is allocated, a packed block that a backend
    other than ours would have to split into kernel pages.

    Caches whose backend declares ``token_cache_kernel_page_slots`` (ours:
    the indexer's slots come from the kernel block table, the DSA layers' MLA
    cache's from the runner) are written at kernel-page slots when split, so
    they may be. Any other token cache (for
    example a draft's MLA cache under another backend) is written through
    manager-block slots, so vLLM's runner would refuse the split when the
    cache is bound, with advice (a smaller ``--block-size``, a layer-compact
    layout) that cannot apply to Kimi K3.1.
    """
    from vllm.v1.attention.backend import MultipleOf

    cache_dtype = vllm_config.cache_config.cache_dtype
    text_config = vllm_config.model_config.hf_text_config
    mla_spec = MLAAttentionSpec(
        block_size=block_size,
        num_kv_heads=1,
        head_size=text_config.kv_lora_rank + (text_config.qk_rope_head_dim or 0),
        dtype=torch.uint8,
        cache_dtype_str=cache_dtype,
        kv_quant_mode=get_kv_quant_mode(cache_dtype),
        state_content_bytes=target_mla_bytes_per_token(vllm_config),
    )
    for backend in backends:
        # A backend that writes at kernel-page slots may be split.
        if token_cache_kernel_page_slots(backend) is not None or not backend.is_mla():
            continue
        sizes = backend.get_supported_kernel_block_sizes(mla_spec)
        if any(isinstance(size, MultipleOf) for size in sizes) or block_size in sizes:
            continue
        raise NotImplementedError(
            f"Kimi-K3.1 packed DSA caches: the {backend.get_name()} attention "
            f"backend reads the {cache_dtype} MLA cache in "
            f"{'/'.join(map(str, sizes))}-token kernel pages only on this GPU, "
            f"but a packed block row is {block_size} "
            "tokens (it must hold the KDA states), and that backend writes its "
            "MLA cache through manager-block slots, which cannot address split "
            "pages. Only the Kimi K3.1 DSA layers' own FlashMLA sparse cache can "
            "be split."
        )


def packed_dsa_block_size_for(
    vllm_config: VllmConfig,
    kernel_block_sizes: list[int],
    checkpoint_alignment: int | None = None,
) -> int | None:
    """The block size of a KDA-hybrid DSA model's packed row on this engine
    configuration (:func:`packed_dsa_block_size`); None for any other model.

    Computes only: the platform applies the size the model class's hook
    returns (``cache_config.block_size``, and ``mamba_block_size`` in
    ``align`` mode), and leaves the KDA states unpadded, since a packed block
    row holds ``states_per_row`` of them at their own size.
    """
    if not is_kda_hybrid_dsa(vllm_config):
        return None
    check_dsa_pcp(vllm_config.parallel_config)
    cache_config = vllm_config.cache_config
    block_size = packed_dsa_block_size(
        vllm_config,
        target_mla_bytes_per_token(vllm_config),
        kda_state_bytes_for(vllm_config),
        packed_dsa_alignment(kernel_block_sizes, checkpoint_alignment),
    )
    if block_size is None:
        return None
    if cache_config.user_specified_block_size and cache_config.block_size != (
        block_size
    ):
        logger.warning(
            "Kimi-K3.1 DSA: --block-size %d replaced by %d, the packed DSA row "
            "size (one row holds its KDA states).",
            cache_config.block_size,
            block_size,
        )
    logger.info(
        "Kimi-K3.1 DSA: packed KV cache block size %d tokens; one cache "
        "group's row holds %s.",
        block_size,
        packed_row_contents(vllm_config),
    )
    return block_size


def packed_row_contents(vllm_config: VllmConfig) -> str:
    """What a packed row's cache group holds, a speculative draft's caches
    included, so the log says where the draft's pages went."""
    text_config = vllm_config.model_config.hf_text_config
    num_dsa, _ = dsa_layer_counts(text_config)
    contents = f"the MLA and indexer pages of {num_dsa} DSA layers"
    method = getattr(vllm_config.speculative_config, "method", None)
    if method in DENSE_MLA_DRAFT_METHODS:
        draft = dense_mla_draft_bytes_per_token(vllm_config)
        contents += f" and the {method} draft's MLA pages ({draft} B a token)"
    elif method in MTP_DRAFT_METHODS:
        layers = getattr(text_config, "num_nextn_predict_layers", 0)
        # vLLM groups the MTP layers' specs with the target's after sizing.
        contents += (
            f" and the MTP draft's {layers} DSA layer(s), added after the block "
            "was sized"
        )
    return contents


def packed_hybrid_block_size(
    vllm_config: VllmConfig, backend_classes: list[Any]
) -> int | None:
    """The Kimi K3 model classes' ``get_hybrid_block_size`` hook, which the
    platform's ``_align_hybrid_block_size`` asks before its own rule: the
    packed DSA row's block size for a KDA-hybrid DSA model (the platform
    writes it into ``cache_config``), None (the platform's rule) for any
    other model.

    ``backend_classes`` are the model's attention backends; a packed block
    that one of them would have to split without writing at kernel-page
    slots is refused here (:func:`check_token_cache_splits`), before the KV
    cache is allocated.
    """
    if not is_kda_hybrid_dsa(vllm_config):
        return None
    from vllm.model_executor.layers.mamba.abstract import (
        get_mamba_prefill_checkpoint_alignment,
    )

    checkpoint = (
        get_mamba_prefill_checkpoint_alignment(vllm_config)
        if vllm_config.cache_config.mamba_cache_mode == "align"
        else None
    )
    block_size = packed_dsa_block_size_for(
        vllm_config, backend_kernel_block_alignments(backend_classes), checkpoint
    )
    if block_size is None:
        return None
    check_token_cache_splits(vllm_config, backend_classes, block_size)
    return block_size
