# SPDX-License-Identifier: Apache-2.0
"""The engine-side rules of Kimi K3.1 DSA, and the config verifier.

:func:`verify_dsa_vllm_config` runs at config verification (the Kimi K3
verifier; see the ``vllm.plugins.kimi_k3_dsa`` seams), before the model or any
cache exists: it refuses what an engine configuration cannot serve correctly
with a DSA model (the platform, prefill and decode context parallelism, the
decode backend, the indexer key dtype, drafts with kernel pages) and forces the
``fp8_ds_mla`` cache. The model's own rules are :mod:`.dsa_config`'s; what the
accepted configuration resolves to is :mod:`.dsa_settings`'.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm.logger import init_logger
from vllm.models.kimi_k3.common.dsa_config import (
    DSAConfig,
    check_dsa_model,
    check_dsa_serving,
    check_mxfp4_indexer,
    is_dsa_model,
)
from vllm.models.kimi_k3.common.dsa_envs import (
    EXPERIMENTAL_DCP_ENV,
    MLA_KERNEL_PAGES_ENV,
    experimental_dcp,
    mla_kernel_pages_in_use,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = init_logger(__name__)

# vLLM 0.33.0's DCP top-k merge (_merge_dcp_topk_global: CuteDSL stable
# top-k selector) takes only these.
DCP_INDEX_TOPK_VALUES = (512, 1024, 2048)
# Cache dtypes a user may ask for, and what each becomes for a DSA model: the
# FlashMLA sparse kernels read only the fp8_ds_mla format.
DSA_CACHE_DTYPES: dict[str, str] = {
    "auto": "fp8_ds_mla",
    "fp8": "fp8_ds_mla",
    "fp8_e4m3": "fp8_ds_mla",
    "fp8_ds_mla": "fp8_ds_mla",
}
# Indexer key dtypes (--attention-config '{"indexer_kv_dtype": ...}').
DSA_INDEXER_KV_DTYPES = ("auto", "fp8", "mxfp4")
ROCM_REASON = (
    "Kimi-K3.1 DSA requires the CUDA FlashMLA sparse / DeepGEMM indexer "
    "kernels; ROCm is not supported."
)
XPU_REASON = (
    "Kimi-K3.1 DSA is not supported on XPU: vLLM 0.33.0 serves Kimi K3 there "
    "with its AMD text model, which has no DSA layers."
)


def check_mla_kernel_pages(vllm_config: VllmConfig) -> None:
    """Multi-step drafts recompute their slots in manager blocks (0.33.0's
    ``eagle_step_update_slot_mapping_and_metadata``), which kernel pages do
    not remap yet; one speculative token reuses the target's remapped slots."""
    spec = vllm_config.speculative_config
    num_tokens = (spec.num_speculative_tokens or 0) if spec is not None else 0
    if num_tokens > 1 and mla_kernel_pages_in_use():
        raise NotImplementedError(
            f"num_speculative_tokens={num_tokens} is not supported for Kimi K3.1 DSA "
            "with the MLA cache in 64-token kernel pages (SM10x, or "
            f"{MLA_KERNEL_PAGES_ENV}=1): draft steps after the first would write "
            "their KV at manager-block slots. Use num_speculative_tokens=1"
        )


def resolve_dsa_cache_dtype(cache_dtype: str) -> str:
    """The KV cache dtype a DSA model runs with, for the one the user asked."""
    resolved = DSA_CACHE_DTYPES.get(cache_dtype)
    if resolved is None:
        raise ValueError(
            f"--kv-cache-dtype {cache_dtype!r} is not supported for Kimi-K3.1 DSA "
            f"models: accepted values are {sorted(DSA_CACHE_DTYPES)} (each becomes "
            "'fp8_ds_mla', the only format the FlashMLA sparse kernels read)"
        )
    return resolved


def check_dsa_pcp(parallel_config: Any) -> None:
    """Refuse prefill context parallelism: a token's indexer key and MLA
    latent would be written by the rank that owns it, through slots that
    interleave across ranks, which the packed DSA row's block-table-derived
    slots (``KimiK3IndexerMetadataBuilder``) do not model."""
    pcp = getattr(parallel_config, "prefill_context_parallel_size", 1)
    if pcp > 1:
        raise NotImplementedError(
            "Kimi-K3.1 packed DSA caches with PCP: prefill context parallelism "
            f"(prefill_context_parallel_size={pcp}) is not supported for Kimi "
            "K3.1 DSA models; use tensor parallelism instead."
        )


def indexer_kv_dtype_is_fp4(
    requested: str,
    dsa: DSAConfig,
    field: str = "attention_config.indexer_kv_dtype",
) -> bool:
    """Whether ``indexer_kv_dtype`` asks for MXFP4 keys, after the checks that
    hold on any GPU (the accepted values, :func:`check_mxfp4_indexer`); the
    config verifier and the KV plan command (``field`` names its flag) both
    decide through this."""
    if requested not in DSA_INDEXER_KV_DTYPES:
        raise ValueError(
            f"{field} {requested!r} is not supported for Kimi-K3.1 DSA: accepted "
            f"values are {list(DSA_INDEXER_KV_DTYPES)} (auto = fp8, 132 B/token at "
            "head dim 128; mxfp4 = 68 B/token, SM10x only)"
        )
    if requested != "mxfp4":
        return False
    check_mxfp4_indexer(dsa)
    return True


def check_indexer_kv_dtype(vllm_config: VllmConfig, dsa: DSAConfig) -> None:
    """Validate ``--attention-config '{"indexer_kv_dtype": ...}'``.

    MXFP4 keys are written only by the fused key insert (layernorm k-norm, no
    indexer rope) and read by DeepGEMM's FP4 MQA logits, which exist on SM10x
    only.
    """
    from vllm.platforms import current_platform

    requested = getattr(vllm_config.attention_config, "indexer_kv_dtype", "auto")
    if not indexer_kv_dtype_is_fp4(requested, dsa):
        return
    if current_platform.is_cuda() and not current_platform.is_device_capability_family(
        100
    ):
        raise ValueError(
            "indexer_kv_dtype='mxfp4' needs an SM10x GPU (DeepGEMM's FP4 MQA "
            f"logits); this GPU is SM{current_platform.get_device_capability()}. "
            "Use indexer_kv_dtype='fp8' (or 'auto')."
        )


def check_decode_backend(vllm_config: VllmConfig) -> None:
    """Kimi K3's specialized decode loop knows only the dense MLA layers."""
    extra = vllm_config.additional_config
    backend = extra.get("decode_backend", "auto") if isinstance(extra, dict) else "auto"
    if backend != "auto":
        raise NotImplementedError(
            f"additional_config decode_backend={backend!r} is not supported for "
            "Kimi-K3.1 DSA models (the specialized decode runs dense MLA only); "
            "accepted: 'auto'"
        )


def check_dsa_parallelism(vllm_config: VllmConfig, dsa: DSAConfig) -> None:
    """Decode context parallelism is refused (wrong tokens on the H200) unless
    :data:`EXPERIMENTAL_DCP_ENV` opts in; then each rank's top-k is merged by
    vLLM's DCP merge, which takes only a few top-k widths and needs CuTe DSL."""
    dcp = vllm_config.parallel_config.decode_context_parallel_size
    if dcp <= 1:
        return
    if not experimental_dcp():
        raise ValueError(
            f"--decode-context-parallel-size {dcp} is not supported for Kimi K3.1 "
            "DSA: on an H200 pair (vLLM 0.33.0, 2026-11-30) it produced wrong "
            "tokens (NaN logits for prompts longer than index_topk); serve with "
            "decode_context_parallel_size 1. Developers reproducing it can set "
            f"{EXPERIMENTAL_DCP_ENV}=1"
        )
    if dsa.index_topk not in DCP_INDEX_TOPK_VALUES:
        raise ValueError(
            f"--decode-context-parallel-size {dcp} needs dsa_config.index_topk in "
            f"{list(DCP_INDEX_TOPK_VALUES)} (vLLM's DCP top-k merge, "
            f"_merge_dcp_topk_global), got {dsa.index_topk}"
        )
    from vllm.platforms import current_platform
    from vllm.utils.import_utils import has_cutedsl

    # The merge has no PyTorch fallback: without CuTe DSL vLLM raises on the
    # first forward, after the weights and the cache are in place.
    if current_platform.is_cuda() and not has_cutedsl():
        raise ValueError(
            f"--decode-context-parallel-size {dcp} needs CuTe DSL (the "
            "'nvidia-cutlass-dsl' package, importable as 'cutlass'): vLLM's "
            "DCP top-k merge (_merge_dcp_topk_global) runs only on it; "
            "install it or serve without decode context parallelism"
        )


def verify_dsa_vllm_config(vllm_config: VllmConfig) -> None:
    """Refuse what cannot be served and force the cache format, for a Kimi
    K3.1 model; a no-op for any other model.

    Runs at config verification, before the model exists: the runner resolves
    the KV cache dtype from ``cache_config.cache_dtype`` before the layers are
    built, so switching it inside the model would size the cache wrongly.
    """
    from vllm.platforms import current_platform

    model_config = vllm_config.model_config
    text_config = getattr(model_config, "hf_text_config", None)
    if not is_dsa_model(text_config):
        return
    if current_platform.is_rocm():
        raise NotImplementedError(ROCM_REASON)
    if current_platform.is_xpu():
        raise NotImplementedError(XPU_REASON)
    dsa: DSAConfig = text_config.dsa_config
    check_dsa_pcp(vllm_config.parallel_config)
    check_decode_backend(vllm_config)
    check_dsa_model(dsa, text_config)
    check_dsa_serving(text_config)
    check_indexer_kv_dtype(vllm_config, dsa)
    check_dsa_parallelism(vllm_config, dsa)
    check_mla_kernel_pages(vllm_config)
    cache_config = vllm_config.cache_config
    requested = cache_config.cache_dtype
    resolved = resolve_dsa_cache_dtype(requested)
    if resolved != requested:
        logger.info_once(
            "Kimi-K3.1 DSA: using kv_cache_dtype 'fp8_ds_mla' (requested %r), the "
            "format the FlashMLA sparse kernels read.",
            requested,
        )
        cache_config.cache_dtype = resolved
