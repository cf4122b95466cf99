# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Kimi K3.1 DSA caches: the per-token formats' sizes, the indexer cache layer
and its metadata builder, and the DSA layers' FlashMLA sparse backend and its
metadata builder.

Every DSA layer of Kimi K3.1 owns two token caches:

* the MLA cache in ``fp8_ds_mla`` format, 656 B/token (512 fp8 latent values,
  4 fp32 power-of-two scales, 64 bf16 rope values), written by the attention
  layer and read by FlashMLA sparse;
* the indexer key cache, :func:`indexer_cache_entry_bytes` per token (132 B
  for fp8 keys of head dim 128, 68 B for MXFP4), owned by
  :class:`KimiK3IndexerCache` and read by DeepGEMM's MQA logits.

In Kimi K3.1 (a KDA hybrid) one block row holds every DSA layer's pages of
both caches, plus a dense MLA draft's pages; :func:`packed_dsa_block_size`
sizes it so that the row fits the KDA states it must hold.
:mod:`vllm.models.kimi_k3.common.dsa_block_size` applies that size to an
engine configuration.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from vllm.logger import init_logger
from vllm.model_executor.models.deepseek_v2 import DeepseekV32IndexerCache
from vllm.models.kimi_k3.common import dsa_formats
from vllm.models.kimi_k3.common.dsa_config import check_mxfp4_indexer
from vllm.models.kimi_k3.common.dsa_envs import mla_kernel_pages_forced
from vllm.models.kimi_k3.common.dsa_formats import MLA_KERNEL_PAGE_TOKENS
from vllm.models.kimi_k3.common.dsa_verify import (
    DENSE_MLA_DRAFT_METHODS,
    check_dsa_pcp,
)
from vllm.utils.math_utils import cdiv, round_up
from vllm.utils.torch_utils import kv_cache_dtype_str_to_dtype
from vllm.v1.attention.backends.mla import indexer as v32_indexer
from vllm.v1.attention.backends.mla.compressor_utils import (
    get_compressed_slot_mapping,
)
from vllm.v1.attention.backends.mla.flashmla_sparse import (
    FlashMLASparseBackend,
    FlashMLASparseMetadataBuilder,
)
from vllm.v1.attention.backends.mla.indexer import (
    DeepseekV32IndexerBackend,
    DeepseekV32IndexerMetadata,
    DeepseekV32IndexerMetadataBuilder,
)
from vllm.v1.kv_cache_interface import (
    KVCacheLayout,
    MLAAttentionSpec,
    get_kv_quant_mode,
)
from vllm.v1.worker.kernel_pages import (
    SLOTS_FROM_BUILDER,
    SLOTS_FROM_RUNNER,
    KernelPageSlots,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.attention.backend import CommonAttentionMetadata

logger = init_logger(__name__)


def indexer_cache_entry_bytes(head_dim: int, use_fp4_cache: bool) -> int:
    """Indexer key cache bytes per token: 132 (fp8) or 68 (MXFP4) at head dim
    128, as the kernels write them (``dsa_formats``)."""
    return dsa_formats.indexer_entry_bytes(head_dim, use_fp4_cache)


def fp8_ds_mla_bytes_per_token(kv_lora_rank: int, qk_rope_head_dim: int) -> int:
    """Bytes of one token in the ``fp8_ds_mla`` format (656 for 512 + 64)."""
    return dsa_formats.ds_mla_entry_bytes(kv_lora_rank, qk_rope_head_dim)


def kimi_k3_indexer_uses_fp4(vllm_config: VllmConfig) -> bool:
    """fp8 indexer keys (132 B/token) by default (``indexer_kv_dtype='auto'``);
    MXFP4 keys (68 B/token) only on ``--attention-config
    '{"indexer_kv_dtype": "mxfp4"}'``.

    vLLM's own ``dsa_indexer_uses_fp4`` decides (it also checks for SM10x), so
    the layers, this cache's builder and the block size agree with vLLM's
    indexer code on the format. MXFP4 keys need the fused key insert
    (``index_k_norm_type='layernorm'``, ``index_rope_dim=0``, the shapes its
    kernel takes: :func:`~.dsa_config.check_mxfp4_indexer`) and no prefill
    context parallelism; anything else raises instead of writing another
    format.
    """
    if not v32_indexer.dsa_indexer_uses_fp4(vllm_config):
        return False
    model_config = getattr(vllm_config, "model_config", None)
    text_config = getattr(model_config, "hf_text_config", None)
    dsa = getattr(text_config, "dsa_config", None)
    if dsa is not None:
        check_mxfp4_indexer(dsa)
    parallel_config = getattr(vllm_config, "parallel_config", None)
    pcp_size = getattr(parallel_config, "prefill_context_parallel_size", 1)
    if pcp_size > 1:
        raise ValueError(
            "indexer_kv_dtype='mxfp4' is not supported with prefill context "
            f"parallelism for Kimi K3 DSA (prefill_context_parallel_size="
            f"{pcp_size}); use indexer_kv_dtype='fp8' or "
            "--prefill-context-parallel-size 1"
        )
    return True


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


def mla_page_bytes_per_token(
    cache_dtype: str,
    kv_lora_rank: int,
    qk_rope_head_dim: int,
    model_config: Any = None,
) -> int:
    """Per-token bytes of one MLA layer's cache page, as the runner allocates
    it.

    vLLM's ``MLAAttentionSpec`` counts ``fp8_ds_mla`` as 576 B unless
    ``state_content_bytes`` is passed; the layer passes 656 and so do we, so
    the sizing never undercounts the real page.
    """
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

    The draft's cache dtype is ``speculative_config.kv_cache_dtype``
    (``dsa_verify.configure_dense_draft`` sets it), else the target's; an
    ``fp8_ds_mla`` page counts 656 B/token, as a layer allocates it.
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
        text_config.dsa_config.index_head_dim, kimi_k3_indexer_uses_fp4(vllm_config)
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


class KimiK3IndexerMetadataBuilder(DeepseekV32IndexerMetadataBuilder):
    """Writes the indexer keys at slots derived from the block table, as the
    compressed indexers are written: in a packed block row the block table
    addresses 64-token kernel pages, which manager slots do not.

    Once Model Runner V2 binds the split cache
    (:meth:`bind_kernel_page_slots`), each slot follows from the group's slot
    by arithmetic on the persistent buffer. Unbound (V1), it is recomputed as
    ``block_table[req, pos // bs] * bs + pos % bs`` over the kernel block
    table by ``get_compressed_slot_mapping`` (``compress_ratio=1``). Either
    way -1 (do not write) stays -1 for padded tokens and tokens another DCP
    rank owns.
    """

    def __init__(self, *args, **kwargs) -> None:
        vllm_config = kwargs.get("vllm_config", args[2] if len(args) > 2 else None)
        if vllm_config is not None:
            # Before the base class touches the PCP group.
            check_dsa_pcp(vllm_config.parallel_config)
        super().__init__(*args, **kwargs)
        if self.use_pcp:
            raise NotImplementedError(
                "Kimi-K3.1 packed DSA caches with PCP: the packed rows' slots do "
                "not model prefill context parallelism; use "
                "--prefill-context-parallel-size 1"
            )
        # The K3.1 key format (validated when the builder is made).
        self.indexer_uses_fp4 = kimi_k3_indexer_uses_fp4(self.vllm_config)
        self.slot_mapping_buffer = torch.full(
            (self.vllm_config.scheduler_config.max_num_batched_tokens,),
            -1,
            dtype=torch.int64,
            device=self.device,
        )
        self.kernel_page_slots: KernelPageSlots | None = None
        # The buffer holds -1 (do not write) from here on.
        self._written_tokens = 0

    def bind_kernel_page_slots(self, pages: KernelPageSlots) -> None:
        self.kernel_page_slots = pages

    def _slot_mapping(self, common: CommonAttentionMetadata) -> torch.Tensor:
        if self.kernel_page_slots is not None:
            # All of the (padded) step's slots: a replayed graph reads them.
            slots = common.slot_mapping
            num_tokens = slots.shape[0]
            if num_tokens < self._written_tokens:
                self.slot_mapping_buffer[num_tokens : self._written_tokens].fill_(-1)
            self._written_tokens = num_tokens
            paged = self.kernel_page_slots.remap(
                slots, out=self.slot_mapping_buffer[:num_tokens]
            )
            return paged[: common.num_actual_tokens]
        return get_compressed_slot_mapping(
            common.num_actual_tokens,
            common.slot_mapping,
            common.query_start_loc,
            common.seq_lens,
            common.block_table_tensor,
            self.kv_cache_spec.block_size,
            compress_ratio=1,
            out=self.slot_mapping_buffer,
            dcp_world_size=self.dcp_world_size,
            cp_interleave=self.cp_kv_cache_interleave_size,
        )

    def build(
        self,
        common_prefix_len: int,
        common_attn_metadata: CommonAttentionMetadata,
        fast_build: bool = False,
    ) -> DeepseekV32IndexerMetadata:
        slot_mapping = self._slot_mapping(common_attn_metadata)
        # Without compression the base build only passes the common slot
        # mapping through: set ours on its result rather than pay a dataclass
        # ``replace`` of the common metadata every step.
        metadata = super().build(common_prefix_len, common_attn_metadata, fast_build)
        metadata.slot_mapping = slot_mapping
        return metadata


class KimiK3IndexerBackend(DeepseekV32IndexerBackend):
    """vLLM's DSA indexer backend with the Kimi K3.1 builder.

    It asks for a block-outermost layout, as DeepSeek-V4's indexer does: the
    indexer pages sit beside the MLA latent pages inside each block row (and
    the KDA states beside them in their groups), which is the row
    :func:`packed_dsa_block_size` sizes.

    Its builder writes the keys at slots derived from the kernel block table,
    so the runner may split the packed row into kernel pages
    (``token_cache_kernel_page_slots``).
    """

    token_cache_kernel_page_slots: ClassVar[str | None] = SLOTS_FROM_BUILDER

    @classmethod
    def supported_kv_cache_layouts(cls) -> tuple[KVCacheLayout, ...]:
        return (KVCacheLayout.BLHNC, KVCacheLayout.BLNHC)

    @staticmethod
    def get_builder_cls() -> type[KimiK3IndexerMetadataBuilder]:  # type: ignore[override]
        return KimiK3IndexerMetadataBuilder


class KimiK3IndexerCache(DeepseekV32IndexerCache):
    """The indexer key cache of one Kimi K3.1 DSA layer.

    ``head_dim`` is the per-token entry in bytes
    (:func:`indexer_cache_entry_bytes`) and ``dtype`` is ``torch.uint8``. Its
    spec is vLLM's (a one-head ``MLAAttentionSpec`` in the indexer role, so
    it shares the block table of the layer's MLA cache); its backend builds
    :class:`KimiK3IndexerMetadataBuilder`.
    """

    def get_attn_backend(self) -> type[KimiK3IndexerBackend]:  # type: ignore[override]
        return KimiK3IndexerBackend


def chunked_context_workspace_rows(
    upstream_rows: int, block_size: int, dcp_virtual_block_size: int = 1
) -> int:
    """Rows of FlashMLA sparse's chunked-context workspace for an MLA group
    of ``block_size``-token blocks: at least upstream's size, and a whole
    number of the chunk alignment that vLLM's chunk planner
    (``build_mla_chunked_context_metadata``) uses for that group, so that at
    least one chunk fits."""
    alignment = math.lcm(block_size, dcp_virtual_block_size)
    return round_up(max(upstream_rows, alignment), alignment)


class KimiK3FlashMLASparseMetadataBuilder(FlashMLASparseMetadataBuilder):
    """FlashMLA sparse's metadata builder, with a chunked-context workspace
    that holds at least one block of the group it serves.

    vLLM sizes that workspace from ``cache_config.block_size`` (capped
    at ``max_num_seqs * index_topk``) but aligns the context chunks to the
    group's own block. For Kimi K3.1 the two differ: the DSA group's block is
    the packed row, and before a worker in the engine's process (TP 1) builds
    its metadata builders, the engine core lowers ``cache_config.block_size``
    to the smallest block of the prefix-cacheable groups. The first prefill
    with cached context (a chunked prompt, a prefix-cache hit, an MTP draft
    step) then failed vLLM's assert that the "chunked prefill workspace ... is
    smaller than the context chunk alignment".
    """

    def determine_chunked_prefill_workspace_size(  # type: ignore[override]
        self, vllm_config: VllmConfig
    ) -> int:
        # Called from the base __init__ once kv_cache_spec and the DCP sizes
        # are set.
        upstream = (
            FlashMLASparseMetadataBuilder.determine_chunked_prefill_workspace_size(
                vllm_config
            )
        )
        rows = chunked_context_workspace_rows(
            upstream,
            self.kv_cache_spec.block_size,
            self.dcp_virtual_block_size if self.dcp_world_size > 1 else 1,
        )
        if rows != upstream:
            logger.debug(
                "Kimi-K3.1 DSA: chunked-context workspace %d rows (upstream %d) "
                "for %d-token blocks.",
                rows,
                upstream,
                self.kv_cache_spec.block_size,
            )
        return rows


class KimiK3FlashMLASparseBackend(FlashMLASparseBackend):
    """FlashMLA sparse for the MLA cache of the Kimi K3.1 DSA layers: the same
    kernels and metadata, and the packed row's MLA pages split into 64-token
    kernel pages wherever FlashMLA sparse reads them so (SM10x), or where
    :data:`MLA_KERNEL_PAGES_ENV` forces it (SM90, which reads such pages too).

    A split MLA cache is written at kernel-page slots: the ``mla_page_slots``
    seam remaps the group's manager-block slots (:func:`kernel_page_slots`)
    for the upstream insert and our fused prologue alike, and the runner hands
    the builder the kernel block table, so the insert and the reads address the
    same pages.
    """

    # The runner hands this backend's group kernel-page slots when it split
    # the MLA cache, so the packed row may be split.
    token_cache_kernel_page_slots: ClassVar[str | None] = SLOTS_FROM_RUNNER

    @staticmethod
    def get_builder_cls() -> type[KimiK3FlashMLASparseMetadataBuilder]:
        return KimiK3FlashMLASparseMetadataBuilder

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list:
        if mla_kernel_pages_forced():
            return [MLA_KERNEL_PAGE_TOKENS]
        return FlashMLASparseBackend.get_supported_kernel_block_sizes(kv_cache_spec)
