# SPDX-License-Identifier: Apache-2.0
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

The block row those caches share, and its size, are
:mod:`vllm.models.kimi_k3.common.dsa_block_size`'s.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import TYPE_CHECKING, ClassVar

import torch

from vllm.logger import init_logger
from vllm.model_executor.models.deepseek_v2 import DeepseekV32IndexerCache
from vllm.models.kimi_k3.common import dsa_settings
from vllm.models.kimi_k3.common.dsa_envs import mla_kernel_pages_forced
from vllm.models.kimi_k3.common.dsa_pages import (
    MLA_KERNEL_PAGE_TOKENS,
    SLOTS_FROM_BUILDER,
    SLOTS_FROM_RUNNER,
)
from vllm.models.kimi_k3.common.dsa_verify import check_dsa_pcp
from vllm.models.kimi_k3.nvidia.dsa_ops import formats
from vllm.utils.math_utils import round_up
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
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.attention.backend import CommonAttentionMetadata

logger = init_logger(__name__)


def indexer_cache_entry_bytes(head_dim: int, use_fp4_cache: bool) -> int:
    """Indexer key cache bytes per token: 132 (fp8) or 68 (MXFP4) at head dim
    128, as the kernels write them (``dsa_ops.formats``)."""
    return formats.indexer_entry_bytes(head_dim, use_fp4_cache)


def fp8_ds_mla_bytes_per_token(kv_lora_rank: int, qk_rope_head_dim: int) -> int:
    """Bytes of one token in the ``fp8_ds_mla`` format (656 for 512 + 64)."""
    return formats.ds_mla_entry_bytes(kv_lora_rank, qk_rope_head_dim)


class KimiK3IndexerMetadataBuilder(DeepseekV32IndexerMetadataBuilder):
    """Writes the indexer keys at slots derived from the block table, as the
    compressed indexers are written: in a packed block row the block table
    addresses 64-token kernel pages, which manager slots do not.

    With ``compress_ratio=1`` ``get_compressed_slot_mapping`` recomputes each
    token's slot as ``block_table[req, pos // bs] * bs + pos % bs`` over the
    kernel block table the runner hands a split group, and keeps -1 (do not
    write) for padded tokens and tokens another DCP rank owns.
    """

    def __init__(self, *args, **kwargs) -> None:
        vllm_config = kwargs.get("vllm_config", args[2] if len(args) > 2 else None)
        if vllm_config is not None:
            # Before the base class touches the PCP group.
            check_dsa_pcp(vllm_config.parallel_config)
        super().__init__(*args, **kwargs)
        assert not self.use_pcp, "refused by check_dsa_pcp"
        # The K3.1 key format (validated when the builder is made).
        self.indexer_uses_fp4 = dsa_settings.indexer_uses_fp4(self.vllm_config)
        self.slot_mapping_buffer = torch.zeros(
            self.vllm_config.scheduler_config.max_num_batched_tokens,
            dtype=torch.int64,
            device=self.device,
        )

    def build(
        self,
        common_prefix_len: int,
        common_attn_metadata: CommonAttentionMetadata,
        fast_build: bool = False,
    ) -> DeepseekV32IndexerMetadata:
        slot_mapping = get_compressed_slot_mapping(
            common_attn_metadata.num_actual_tokens,
            common_attn_metadata.slot_mapping,
            common_attn_metadata.query_start_loc,
            common_attn_metadata.seq_lens,
            common_attn_metadata.block_table_tensor,
            self.kv_cache_spec.block_size,
            compress_ratio=1,
            out=self.slot_mapping_buffer,
            dcp_world_size=self.dcp_world_size,
            cp_interleave=self.cp_kv_cache_interleave_size,
        )
        return super().build(
            common_prefix_len,
            replace(common_attn_metadata, slot_mapping=slot_mapping),
            fast_build,
        )


class KimiK3IndexerBackend(DeepseekV32IndexerBackend):
    """0.33.0's DSA indexer backend with the Kimi K3.1 builder.

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
    spec is 0.33.0's (a one-head ``MLAAttentionSpec`` in the indexer role, so
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

    vLLM 0.33.0 sizes that workspace from ``cache_config.block_size`` (capped
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
