# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The engine-side rules of Kimi K3.1 DSA, run at config verification.

:func:`verify_dsa_vllm_config` refuses what an engine configuration cannot
serve with a DSA model and forces the ``fp8_ds_mla`` cache;
:func:`check_dsa_deployment` is the part the KV plan command shares.
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
    FORCE_WRAPPER_ENV,
    INDEXER_DECODE_SHARD_ENV,
    MLA_KERNEL_PAGES_ENV,
    check_env_switches,
    experimental_dcp,
    force_wrapper_forward,
    indexer_decode_shard,
    mla_kernel_pages_in_use,
)
from vllm.models.kimi_k3.common.dsa_formats import (
    DCP_INDEX_TOPK_VALUES,
    KERNEL_INDEX_HEAD_DIM,
    SPARSE_MLA_MAX_HEADS_PER_RANK,
    TOPK_INDEX_BYTES,
)

if TYPE_CHECKING:
    from vllm.config import ModelConfig, VllmConfig

logger = init_logger(__name__)

# The FlashMLA sparse kernels read only fp8_ds_mla.
DSA_CACHE_DTYPES: dict[str, str] = {
    "auto": "fp8_ds_mla",
    "fp8": "fp8_ds_mla",
    "fp8_e4m3": "fp8_ds_mla",
    "fp8_ds_mla": "fp8_ds_mla",
}
DSA_INDEXER_KV_DTYPES = ("auto", "fp8", "mxfp4")
# The top-k buffer may take at most 1/N of the usable GPU memory.
TOPK_BUFFER_MAX_BUDGET_SHARE = 10
GIB = 2**30
ROCM_REASON = (
    "Kimi-K3.1 DSA requires the CUDA FlashMLA sparse / DeepGEMM indexer "
    "kernels; ROCm is not supported."
)
XPU_REASON = (
    "Kimi-K3.1 DSA is not supported on XPU: vLLM serves Kimi K3 there "
    "with its AMD text model, which has no DSA layers."
)


# Dense MLA drafts whose pages share the target's packed DSA row.
DENSE_MLA_DRAFT_METHODS = ("eagle3", "dspark")
MTP_DRAFT_METHODS = ("mtp", "kimi_k3_mtp")
DSA_SPECULATIVE_METHODS = (
    *MTP_DRAFT_METHODS,
    *DENSE_MLA_DRAFT_METHODS,
    "ngram",
    "ngram_gpu",
    "suffix",
)


def check_speculative_draft(vllm_config: VllmConfig) -> None:
    """Refuse a draft whose KV cache the packed DSA row does not size."""
    spec = vllm_config.speculative_config
    if spec is None:
        return
    if spec.method not in DSA_SPECULATIVE_METHODS:
        raise ValueError(
            f"speculative_config.method {spec.method!r} is not supported for "
            "Kimi-K3.1 DSA: its draft's KV cache has no place in the packed DSA "
            f"row. Accepted methods: {list(DSA_SPECULATIVE_METHODS)}"
        )
    if spec.method not in DENSE_MLA_DRAFT_METHODS:
        return
    draft = spec.draft_model_config
    text = getattr(draft, "hf_text_config", None)
    kv_lora_rank = getattr(text, "kv_lora_rank", None)
    rope = getattr(text, "qk_rope_head_dim", None)
    if type(kv_lora_rank) is not int or kv_lora_rank < 1 or type(rope) is not int:
        raise ValueError(
            f"speculative_config.model {getattr(draft, 'model', None)!r}: a "
            f"{spec.method} draft of Kimi-K3.1 DSA must be a dense MLA draft, "
            f"its config's kv_lora_rank a positive integer and qk_rope_head_dim "
            f"an integer (got {kv_lora_rank!r} and {rope!r}): the packed DSA row "
            "holds the draft's MLA latent pages"
        )


# What vLLM's dense MLA backends read; none reads fp8_ds_mla.
DENSE_DRAFT_CACHE_DTYPES = ("auto", "bfloat16", "float16", "fp8", "fp8_e4m3")


def configure_dense_draft(vllm_config: VllmConfig) -> None:
    """Give a dense MLA draft a cache dtype its backends read."""
    spec = vllm_config.speculative_config
    if spec is None or spec.method not in DENSE_MLA_DRAFT_METHODS:
        return
    if spec.kv_cache_dtype is None:
        spec.kv_cache_dtype = "auto"
        logger.info_once(
            "Kimi-K3.1 DSA: the %s draft's MLA cache uses kv_cache_dtype 'auto' "
            "(dense MLA backends do not read fp8_ds_mla); set "
            "speculative_config.kv_cache_dtype for another.",
            spec.method,
        )
    elif spec.kv_cache_dtype not in DENSE_DRAFT_CACHE_DTYPES:
        raise ValueError(
            f"speculative_config.kv_cache_dtype {spec.kv_cache_dtype!r} is not "
            f"supported for the {spec.method} draft of Kimi-K3.1 DSA: its dense "
            "MLA attention reads none but "
            f"{list(DENSE_DRAFT_CACHE_DTYPES)} (fp8_ds_mla is the sparse "
            "layers' format)"
        )


def check_mla_kernel_pages(vllm_config: VllmConfig) -> None:
    """Model Runner V1's later draft steps compute their slots in manager
    blocks (``eagle_step_update_slot_mapping_and_metadata``), which kernel
    pages do not take; V2's speculators compute theirs through the remapped
    ``BlockTables.compute_slot_mappings``."""
    spec = vllm_config.speculative_config
    num_tokens = (spec.num_speculative_tokens or 0) if spec is not None else 0
    if (
        num_tokens > 1
        and mla_kernel_pages_in_use()
        and not vllm_config.use_v2_model_runner
    ):
        raise NotImplementedError(
            f"num_speculative_tokens={num_tokens} is not supported for Kimi K3.1 DSA "
            "with the MLA cache in 64-token kernel pages (SM10x, or "
            f"{MLA_KERNEL_PAGES_ENV}=1) under Model Runner V1: its draft steps "
            "after the first write their KV at manager-block slots. Use Model "
            "Runner V2 (VLLM_USE_V2_MODEL_RUNNER=1) or num_speculative_tokens=1"
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
    """PCP's interleaved slots are not modeled by the packed row's slots."""
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
    """Whether ``indexer_kv_dtype`` asks for MXFP4 keys."""
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
    """Validate ``--attention-config '{"indexer_kv_dtype": ...}'``; MXFP4
    keys need DeepGEMM's FP4 MQA logits (SM10x only)."""
    from vllm.platforms import current_platform

    requested = getattr(vllm_config.attention_config, "indexer_kv_dtype", "auto")
    if not indexer_kv_dtype_is_fp4(requested, dsa):
        check_sm10x_fp8_index_head_dim(dsa)
        return
    if force_wrapper_forward():
        raise ValueError(
            f"indexer_kv_dtype='mxfp4' cannot be served with {FORCE_WRAPPER_ENV}=1: "
            "the wrapper forward writes keys with vLLM's insert, which writes fp8 "
            "only. Use indexer_kv_dtype='fp8', or unset the switch"
        )
    if current_platform.is_cuda() and not current_platform.is_device_capability_family(
        100
    ):
        raise ValueError(
            "indexer_kv_dtype='mxfp4' needs an SM10x GPU (DeepGEMM's FP4 MQA "
            f"logits); this GPU is SM{current_platform.get_device_capability()}. "
            "Use indexer_kv_dtype='fp8' (or 'auto')."
        )


def check_sm10x_fp8_index_head_dim(dsa: DSAConfig) -> None:
    """vLLM's key insert writes SM10x's MX-scaled fp8 keys at dim 128 only."""
    from vllm.platforms import current_platform

    if not (
        current_platform.is_cuda() and current_platform.is_device_capability_family(100)
    ):
        return
    if dsa.index_head_dim != KERNEL_INDEX_HEAD_DIM:
        raise ValueError(
            f"dsa_config.index_head_dim {dsa.index_head_dim} cannot serve fp8 "
            f"indexer keys on SM10x: accepted: {KERNEL_INDEX_HEAD_DIM}, the one "
            "head dim of the MX-scaled keys that DeepGEMM reads there"
        )


def check_topk_within_max_model_len(dsa: DSAConfig, max_model_len: int) -> None:
    """A top-k wider than ``max_model_len`` selects past every row."""
    if dsa.index_topk > max_model_len:
        raise ValueError(
            f"dsa_config.index_topk ({dsa.index_topk}) must not exceed "
            f"max_model_len ({max_model_len}): no request holds more tokens to "
            "select from, and the indexer's decode logits are max_model_len "
            f"columns wide. Serve with --max-model-len of at least {dsa.index_topk}"
        )


def check_sparse_mla_heads(num_heads: int, tensor_parallel_size: int) -> None:
    """FlashMLA sparse's fp8 decode kernel caps the query heads per rank."""
    per_rank = -(-num_heads // tensor_parallel_size)
    if per_rank > SPARSE_MLA_MAX_HEADS_PER_RANK:
        min_tp = -(-num_heads // SPARSE_MLA_MAX_HEADS_PER_RANK)
        raise ValueError(
            f"num_attention_heads {num_heads} at tensor_parallel_size "
            f"{tensor_parallel_size} gives {per_rank} attention heads per rank; "
            f"FlashMLA sparse takes at most {SPARSE_MLA_MAX_HEADS_PER_RANK} (its "
            "fp8 decode kernel runs 64 or 128 query heads). Use a "
            f"tensor_parallel_size of at least {min_tp}"
        )


def check_dsa_deployment(
    text_config: Any, *, max_model_len: int, tensor_parallel_size: int
) -> None:
    """The rules shared with ``kimi-k3-dsa-kv-plan``, which needs no engine."""
    dsa: DSAConfig = text_config.dsa_config
    check_dsa_model(dsa, text_config)
    check_dsa_serving(text_config)
    check_topk_within_max_model_len(dsa, max_model_len)
    check_sparse_mla_heads(text_config.num_attention_heads, tensor_parallel_size)


def topk_indices_buffer_rows(vllm_config: VllmConfig) -> int:
    """Rows of the model-level top-k buffer, with DCP allgather slack."""
    dcp_world_size = vllm_config.parallel_config.decode_context_parallel_size
    slack = dcp_world_size - 1 if dcp_world_size > 1 else 0
    return vllm_config.scheduler_config.max_num_batched_tokens + slack


def check_topk_buffer_budget(vllm_config: VllmConfig, dsa: DSAConfig) -> None:
    """Refuse a top-k buffer too large for the GPU before it is allocated."""
    from vllm.platforms import current_platform

    if not current_platform.is_cuda():
        return
    try:
        total = current_platform.get_device_total_memory()
    except Exception:
        # The verifying process need not sit on a serving GPU (Ray).
        return
    utilization = vllm_config.cache_config.gpu_memory_utilization
    budget = int(total * utilization)
    rows = topk_indices_buffer_rows(vllm_config)
    row_bytes = dsa.index_topk * TOPK_INDEX_BYTES
    size = rows * row_bytes
    if size * TOPK_BUFFER_MAX_BUDGET_SHARE <= budget:
        return
    tokens = vllm_config.scheduler_config.max_num_batched_tokens
    slack = rows - tokens
    shown_rows = f"max_num_batched_tokens {tokens}" + (
        f" + {slack} DCP slack rows" if slack else ""
    )
    max_tokens = budget // TOPK_BUFFER_MAX_BUDGET_SHARE // row_bytes - slack
    raise ValueError(
        f"the model-level top-k buffer ({shown_rows} x dsa_config.index_topk "
        f"{dsa.index_topk} x {TOPK_INDEX_BYTES} B = {size / GIB:.2f} GiB) would "
        f"take more than 1/{TOPK_BUFFER_MAX_BUDGET_SHARE} of the GPU memory vLLM "
        f"may use (gpu_memory_utilization {utilization} x {total / GIB:.2f} GiB "
        f"= {budget / GIB:.2f} GiB), leaving the weights and the KV cache short. "
        f"Use --max-num-batched-tokens of at most {max(max_tokens, 0)}"
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
    """Decode context parallelism is refused unless explicitly opted in."""
    tp = vllm_config.parallel_config.tensor_parallel_size
    if tp > 1 and not indexer_decode_shard():
        logger.info_once(
            "Kimi K3.1 DSA: every one of the %d TP ranks scores all of the "
            "indexer's decode rows; %s=1 shares them by request.",
            tp,
            INDEXER_DECODE_SHARD_ENV,
        )
    dcp = vllm_config.parallel_config.decode_context_parallel_size
    if dcp <= 1:
        return
    if not experimental_dcp():
        raise ValueError(
            f"--decode-context-parallel-size {dcp} is not supported for Kimi K3.1 "
            "DSA: it produces wrong tokens (NaN logits for prompts longer than "
            "index_topk); serve with "
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

    # The merge has no PyTorch fallback.
    if current_platform.is_cuda() and not has_cutedsl():
        raise ValueError(
            f"--decode-context-parallel-size {dcp} needs CuTe DSL (the "
            "'nvidia-cutlass-dsl' package, importable as 'cutlass'): vLLM's "
            "DCP top-k merge (_merge_dcp_topk_global) runs only on it; "
            "install it or serve without decode context parallelism"
        )


# Other sparse models' attention_config knobs, refused when set -> owner.
FOREIGN_ATTENTION_KNOBS: dict[str, str] = {
    "indexer_sparse_logits": "DeepSeek V4.1's two-level indexer",
    "minimax_m3_indexer_cp": "MiniMax M3's context-parallel indexer",
}
DSA_ATTENTION_KNOBS = (
    "indexer_kv_dtype",
    "indexer_tp_shard_min_rows",
    "sparse_mla_force_mqa",
    "sparse_mla_prefill_workspace_factor",
)


def check_attention_knobs(attention_config: Any) -> None:
    """Refuse a knob of another sparse model, which Kimi K3.1 would ignore."""
    for knob, owner in FOREIGN_ATTENTION_KNOBS.items():
        if getattr(attention_config, knob, False):
            raise ValueError(
                f"attention_config.{knob} is set, but it is {owner} and does not "
                "apply to Kimi K3.1; the sparse-attention knobs Kimi K3.1 reads: "
                f"{', '.join(DSA_ATTENTION_KNOBS)}"
            )


def verify_dsa_vllm_config(vllm_config: VllmConfig) -> None:
    """Refuse what cannot be served and force the cache format, for a Kimi
    K3.1 model; a no-op for any other model. Runs before the model exists,
    because the runner resolves the KV cache dtype before the layers."""
    from vllm.platforms import current_platform

    model_config = vllm_config.model_config
    text_config = getattr(model_config, "hf_text_config", None)
    if not is_dsa_model(text_config):
        return
    if current_platform.is_rocm():
        raise NotImplementedError(ROCM_REASON)
    if current_platform.is_xpu():
        raise NotImplementedError(XPU_REASON)
    check_env_switches()
    dsa: DSAConfig = text_config.dsa_config
    check_dsa_pcp(vllm_config.parallel_config)
    check_decode_backend(vllm_config)
    check_dsa_deployment(
        text_config,
        max_model_len=model_config.max_model_len,
        tensor_parallel_size=vllm_config.parallel_config.tensor_parallel_size,
    )
    check_attention_knobs(vllm_config.attention_config)
    check_indexer_kv_dtype(vllm_config, dsa)
    check_dsa_parallelism(vllm_config, dsa)
    check_speculative_draft(vllm_config)
    configure_dense_draft(vllm_config)
    check_mla_kernel_pages(vllm_config)
    check_topk_buffer_budget(vllm_config, dsa)
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


def verify_mtp_draft(model_config: ModelConfig) -> None:
    """Refuse an MTP draft of a checkpoint without MTP layers."""
    text_config = getattr(model_config, "hf_text_config", None)
    layers = getattr(text_config, "num_nextn_predict_layers", None)
    if type(layers) is not int or layers < 1:
        raise ValueError(
            f"text_config.num_nextn_predict_layers is {layers!r}: an MTP draft "
            "needs a positive integer (the checkpoint's MTP layers), and this "
            "checkpoint has no MTP layer to draft with. Serve it without "
            "--speculative-config, or use a checkpoint with MTP layers"
        )


def refuse_text_only_draft(model_config: ModelConfig) -> None:
    """vLLM drafts Kimi K3 only with the multimodal checkpoint."""
    if getattr(model_config, "spec_target_max_model_len", None) is None:
        return  # the target model, not a draft
    raise ValueError(
        f"speculative_config: the draft resolves to {model_config.architectures} "
        "(a text-only Kimi K3 checkpoint), which has no speculative draft in "
        "vLLM. Method 'kimi_k3_mtp' (or 'mtp') needs the multimodal "
        "KimiK3ForConditionalGeneration checkpoint, whose MTP layers it loads; "
        "serve this checkpoint without --speculative-config"
    )
