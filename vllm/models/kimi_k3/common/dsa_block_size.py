# SPDX-License-Identifier: Apache-2.0
"""The packed DSA block row of Kimi K3.1 and its size.

Kimi K3.1 is a KDA hybrid: its 69 KDA layers keep per-request recurrent and
conv states. With a block-outermost KV cache layout one block row holds every
DSA layer's MLA and indexer pages (plus a dense MLA draft's pages) and, in
the state groups, KDA states; :func:`packed_dsa_block_size` sizes the block so
that one row fits the states it must hold, the same at every TP size that
divides the reference TP. The ``block_size`` seam applies it in the worker
(:func:`apply_packed_dsa_block_size`), and the plan command reads the same
functions.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch

from vllm.logger import init_logger
from vllm.models.kimi_k3.common.dsa_cache import (
    fp8_ds_mla_bytes_per_token,
    indexer_cache_entry_bytes,
)
from vllm.models.kimi_k3.common.dsa_pages import token_cache_kernel_page_slots
from vllm.models.kimi_k3.common.dsa_settings import indexer_uses_fp4
from vllm.models.kimi_k3.common.dsa_verify import check_dsa_pcp
from vllm.utils.math_utils import cdiv
from vllm.v1.kv_cache_interface import (
    MLAAttentionSpec,
    get_kv_quant_mode,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = init_logger(__name__)


# Reference TP of the packed block size (see ``packed_dsa_block_size``).
#
# A KDA state shards with TP (its heads are split), a DSA row does not (the
# MLA latent and the indexer keys are replicated per rank). Sizing the block
# at each TP on its own would give block sizes of different TP sizes that do
# not divide one another; prefill/decode ("PD") disaggregation moves KV blocks
# between instances of different TP and needs that they do. So the block is
# rounded once at this reference TP, where the unsharded state is split 16
# ways, and scaled by ``_PD_REFERENCE_TP / tp``: the block of TP t is then
# ``units * alignment * 16 / t`` with ``units`` the same for every t dividing
# 16, so block sizes of TP 1, 2, 4, 8 and 16 (one or two 8-GPU nodes; 16
# divides Kimi K3.1's 96 attention and KDA heads) divide one another. A TP
# that does not divide 16 is rounded at ``lcm(_PD_REFERENCE_TP, tp)``.
_PD_REFERENCE_TP = 16


# Dense MLA drafts whose full-attention MLA specs group with the target's
# DSA row (their pages sit in the same block row).
DENSE_MLA_DRAFT_METHODS = ("eagle3", "dspark")


def mla_page_bytes_per_token(
    cache_dtype: str,
    kv_lora_rank: int,
    qk_rope_head_dim: int,
    model_config: Any = None,
) -> int:
    """Per-token bytes of one MLA layer's cache page, as the runner allocates
    it.

    0.33.0's ``MLAAttentionSpec`` counts ``fp8_ds_mla`` as 576 B unless
    ``state_content_bytes`` is passed; the layer passes 656 and so do we, so
    the sizing never undercounts the real page.
    """
    from vllm.utils.torch_utils import kv_cache_dtype_str_to_dtype

    state_content_bytes = None
    if cache_dtype == "fp8_ds_mla":
        state_content_bytes = fp8_ds_mla_bytes_per_token(kv_lora_rank, qk_rope_head_dim)
    return MLAAttentionSpec(
        block_size=1,
        num_kv_heads=1,
        head_size=kv_lora_rank + qk_rope_head_dim,
        dtype=kv_cache_dtype_str_to_dtype(cache_dtype, model_config),
        cache_dtype_str=cache_dtype,
        kv_quant_mode=get_kv_quant_mode(cache_dtype),
        state_content_bytes=state_content_bytes,
    ).page_size_bytes


def is_kda_hybrid_dsa(vllm_config: VllmConfig) -> bool:
    """Whether the target model is a KDA-hybrid DSA model (Kimi K3.1)."""
    model_config = getattr(vllm_config, "model_config", None)
    text_config = getattr(model_config, "hf_text_config", None)
    return (
        getattr(text_config, "dsa_config", None) is not None
        and getattr(text_config, "linear_attn_config", None) is not None
    )


def dense_mla_draft_bytes_per_token(vllm_config: VllmConfig) -> int:
    """Per-token bytes of a dense MLA draft's caches, which share the DSA row:
    the full-attention MLA specs of an eagle3 / dspark draft with an MLA
    latent group with the target's. 0 without such a draft.

    The draft's ``fp8_ds_mla`` page is counted at 656 B/token, as the layer
    allocates it (0.33.0's spec would say 576 without ``state_content_bytes``).
    """
    spec_config = vllm_config.speculative_config
    if spec_config is None or spec_config.method not in DENSE_MLA_DRAFT_METHODS:
        return 0
    draft_model_config = spec_config.draft_model_config
    if draft_model_config is None:
        return 0
    draft_config = draft_model_config.hf_text_config
    kv_lora_rank = getattr(draft_config, "kv_lora_rank", None)
    if kv_lora_rank is None:
        return 0
    cache_dtype = spec_config.kv_cache_dtype or vllm_config.cache_config.cache_dtype
    page = mla_page_bytes_per_token(
        cache_dtype,
        kv_lora_rank,
        getattr(draft_config, "qk_rope_head_dim", 0) or 0,
        draft_model_config,
    )
    return draft_config.num_hidden_layers * page


def dsa_layer_counts(text_config: Any) -> tuple[int, int]:
    """(DSA layers, KDA layers) of a Kimi K3.1 text config."""
    linear_attn_config = text_config.linear_attn_config
    return (
        len(linear_attn_config["full_attn_layers"]),
        len(linear_attn_config["kda_layers"]),
    )


def states_per_row(num_dsa: int, num_states: int) -> int:
    """KDA states one packed row must hold: the states are spread over as few
    rows per block as the DSA pages allow, evenly."""
    return cdiv(num_states, cdiv(num_states, num_dsa))


def packed_row_bytes_per_token(
    num_dsa: int,
    mla_bytes_per_token: int,
    index_bytes_per_token: int,
    draft_bytes_per_token: int = 0,
) -> int:
    """Bytes one token adds to a packed DSA row."""
    return num_dsa * (mla_bytes_per_token + index_bytes_per_token) + (
        draft_bytes_per_token
    )


def packed_block_size_from_bytes(
    row_bytes_per_token: int,
    num_states_in_row: int,
    state_bytes: int,
    alignment: int,
    tp_size: int,
) -> int:
    """The rule of :func:`packed_dsa_block_size`, on plain numbers.

    ``state_bytes`` is one KDA state on one rank (sharded by ``tp_size``).
    """
    if min(row_bytes_per_token, num_states_in_row, alignment, tp_size) <= 0:
        raise ValueError(
            "packed DSA block size needs positive row bytes, states, alignment "
            f"and TP; got row_bytes_per_token={row_bytes_per_token}, "
            f"states={num_states_in_row}, alignment={alignment}, tp={tp_size}"
        )
    reference_tp = math.lcm(_PD_REFERENCE_TP, tp_size)
    # TP-invariant: the unsharded state bytes, in reference-TP block units.
    reference_units = cdiv(
        num_states_in_row * state_bytes * tp_size,
        alignment * reference_tp * row_bytes_per_token,
    )
    return alignment * reference_units * (reference_tp // tp_size)


def packed_dsa_block_size(
    vllm_config: VllmConfig,
    mla_bytes_per_token: int,
    state_bytes: int,
    alignment: int,
) -> int | None:
    """Block size of the packed cache of a KDA-hybrid DSA model, else None.

    A block row holds every DSA layer's MLA and indexer pages, plus a dense
    MLA draft's pages; size it to fit as many KDA states as the row must hold
    (:func:`states_per_row`). The KDA state shards with TP and the row does
    not, so the block is rounded at ``_PD_REFERENCE_TP`` and scaled by
    ``_PD_REFERENCE_TP / tp``: block sizes of TP 1, 2, 4, 8 and 16 divide one
    another, and the rounding stays fine (a power of two would leave up to half
    the row empty once spec decoding grows the conv state).

    ``mla_bytes_per_token`` is one DSA layer's MLA page per token (656 for
    ``fp8_ds_mla``), ``state_bytes`` one KDA state on one rank, ``alignment``
    the kernel block alignment the result must be a multiple of.
    """
    if not is_kda_hybrid_dsa(vllm_config):
        return None
    text_config = vllm_config.model_config.hf_text_config
    num_dsa, num_states = dsa_layer_counts(text_config)
    index_bytes = indexer_cache_entry_bytes(
        text_config.dsa_config.index_head_dim, indexer_uses_fp4(vllm_config)
    )
    row_bytes_per_token = packed_row_bytes_per_token(
        num_dsa,
        mla_bytes_per_token,
        index_bytes,
        dense_mla_draft_bytes_per_token(vllm_config),
    )
    return packed_block_size_from_bytes(
        row_bytes_per_token,
        states_per_row(num_dsa, num_states),
        state_bytes,
        alignment,
        vllm_config.parallel_config.tensor_parallel_size,
    )


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
    the recurrent state (``head_dim x head_dim`` per head), as 0.33.0's
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
    block, 128 (0.33.0 keeps MLA manager blocks a multiple of 128 so split
    kernel blocks stay aligned for its decode kernels), and the KDA prefill
    checkpoint alignment in ``mamba_cache_mode='align'``."""
    return math.lcm(128, *kernel_block_sizes, checkpoint_alignment or 1)


def packed_block_bytes(
    block_size: int,
    row_bytes_per_token: int,
    state_group_bytes: int,
    kernel_page_bytes: list[int],
) -> int:
    """Bytes of one packed block, as 0.33.0's planner lays it out
    (``_get_kv_cache_bytes_per_block``): the widest group (the DSA row or a
    state group) rounded up to whole kernel pages of every split cache
    (``block_stride_alignment``: 64 x 656 B for ``fp8_ds_mla``, 64 x 132 B for
    fp8 indexer keys), so the runner can address each cache's kernel pages."""
    widest = max(block_size * row_bytes_per_token, state_group_bytes)
    step = math.lcm(*kernel_page_bytes) if kernel_page_bytes else 1
    return cdiv(widest, step) * step


def backend_kernel_block_alignments(backends: list[Any]) -> list[int]:
    """The smallest kernel block of each attention backend (a ``MultipleOf``
    counts as its base), as 0.33.0's hybrid alignment reads them."""
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
    manager-block slots, so 0.33.0's runner would refuse the split when the
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


def apply_packed_dsa_block_size(
    vllm_config: VllmConfig,
    kernel_block_sizes: list[int],
    checkpoint_alignment: int | None = None,
) -> int | None:
    """Set ``cache_config.block_size`` of a KDA-hybrid DSA model from
    :func:`packed_dsa_block_size`; None (and nothing changed) for any other
    model.

    The KDA states are not padded to a block: in the packed layout a block
    row holds :func:`states_per_row` of them at their own size, so
    ``mamba_page_size_padded`` stays unset.
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
    assert block_size is not None
    if cache_config.user_specified_block_size and cache_config.block_size != (
        block_size
    ):
        logger.warning(
            "Kimi-K3.1 DSA: --block-size %d replaced by %d, the packed DSA row "
            "size (one row holds its KDA states).",
            cache_config.block_size,
            block_size,
        )
    cache_config.block_size = block_size
    cache_config.mamba_page_size_padded = None
    if cache_config.mamba_cache_mode == "align":
        cache_config.mamba_block_size = block_size
    logger.info("Kimi-K3.1 DSA: packed KV cache block size %d tokens.", block_size)
    return block_size


def packed_hybrid_block_size(
    vllm_config: VllmConfig, backend_classes: list[Any]
) -> int | None:
    """The Kimi K3 model classes' ``get_hybrid_block_size`` hook, which the
    platform's ``_align_hybrid_block_size`` asks before its own rule: the
    packed DSA row's block size for a KDA-hybrid DSA model (applied to
    ``cache_config`` by :func:`apply_packed_dsa_block_size`), None (the
    platform's rule) for any other model.

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
    block_size = apply_packed_dsa_block_size(
        vllm_config, backend_kernel_block_alignments(backend_classes), checkpoint
    )
    assert block_size is not None
    check_token_cache_splits(vllm_config, backend_classes, block_size)
    return block_size
