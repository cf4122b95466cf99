# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""FlashMLA sparse for the Kimi K3.1 DSA layers, with an opt-in
``fp8_ds_mla`` kernel at the layer's own head count below 64 heads.

FlashMLA's fp8 sparse kernel takes 64 or 128 query heads, so vLLM pads a
TP 8 rank's 12 heads to 64, and below 32 heads sends prefill rows through
that kernel too (its mixed batch). :func:`sparse_mla_fp8` reads the same
pages and top-k slots at the real head count, but is still slower than the
padded kernel, so it runs only with ``VLLM_KIMI_K3_DSA_SPARSE_MLA_UNPADDED=1``.
DCP (which merges the kernel's LSE across ranks), 64 or more heads and the
wrapper forward (upstream ops only) always keep FlashMLA.
"""

from __future__ import annotations

import torch

from vllm.logger import init_logger
from vllm.models.kimi_k3.common.dsa_envs import (
    force_wrapper_forward,
    sparse_mla_unpadded,
)
from vllm.models.kimi_k3.nvidia.dsa_ops.sparse_mla import sparse_mla_fp8
from vllm.v1.attention.backends.mla.flashmla_sparse import (
    FlashMLASparseImpl,
    FlashMLASparseMetadata,
)

logger = init_logger(__name__)


class KimiK3FlashMLASparseImpl(FlashMLASparseImpl):
    """FlashMLA sparse, whose fp8 kernel may run unpadded below 64 heads."""

    # Decided once, when the layer adopts the impl (the switches are read
    # when a layer is built, as the fused forward's are).
    runs_unpadded: bool = False

    @classmethod
    def adopt(cls, impl: FlashMLASparseImpl) -> FlashMLASparseImpl:
        """``impl`` as this class, with its kernel chosen: vLLM's MLA wrapper
        builds the layer's impl from the backend it selects, before the layer
        can hand it ours."""
        if not isinstance(impl, FlashMLASparseImpl):
            return impl
        impl.__class__ = cls
        impl.runs_unpadded = (
            impl.num_heads < impl.fp8_decode_padded_heads
            and impl.kv_cache_dtype == "fp8_ds_mla"
            and not impl.need_to_return_lse_for_decode
            and sparse_mla_unpadded()
            and not force_wrapper_forward()
        )
        if impl.runs_unpadded:
            logger.info_once(
                "Kimi-K3.1 DSA: sparse MLA at %d heads a rank without padding "
                "(sparse_mla_fp8).",
                impl.num_heads,
            )
        return impl

    def _fp8_flash_mla_kernel(
        self,
        q: torch.Tensor,
        kv_c_and_k_pe_cache: torch.Tensor,
        topk_indices: torch.Tensor,
        kernel_metadata: FlashMLASparseMetadata.FP8KernelMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # q [B, S, H, 576], the cache's 64-token pages, topk [B, S, k] slots;
        # returns out [B, S, H, 512] and lse [B, H, S], as FlashMLA does.
        if not self.runs_unpadded:
            return super()._fp8_flash_mla_kernel(
                q, kv_c_and_k_pe_cache, topk_indices, kernel_metadata
            )
        batch, steps, heads, dim = q.shape
        out, lse = sparse_mla_fp8(
            q.reshape(batch * steps, heads, dim),
            kv_c_and_k_pe_cache.view(torch.uint8),
            topk_indices.reshape(batch * steps, -1).to(torch.int32),
            self.softmax_scale,
        )
        out = out.view(batch, steps, heads, -1)
        return out, lse.view(batch, steps, heads).transpose(1, 2)
