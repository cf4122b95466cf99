# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The KV cache plan of a Kimi K3.1 DSA deployment, without a GPU or weights.

For a checked text config (:mod:`.kv_plan_inputs`), a TP size, a KV cache
budget per GPU, the indexer key dtype and an optional draft (dense MLA or MTP),
:func:`make_plan` computes what the packed KV cache of vLLM 0.33.0 with this
series holds: the per-token bytes of each DSA cache (``fp8_ds_mla`` MLA and
indexer keys), the KDA states of one request, the block size, and how many
tokens and full-length requests fit. It uses the same arithmetic the engine
sizes the cache with (``dsa_block_size``, ``dsa_cache``), so the numbers are
the engine's. ``kimi-k3-dsa-kv-plan`` (:mod:`.kv_plan_cli`) prints them.

Model of the cache (block-outermost packed layout, ``mamba_cache_mode``
``none``): every block row holds all DSA layers' MLA and indexer pages for
``block_size`` tokens (plus a dense draft's MLA pages, or the MTP layers' MLA
and indexer pages); the KDA states sit in state groups of ``states_per_row``
states, each group's page fitting one row. The engine sizes the block without
the MTP layers (they join the row when vLLM groups the draft's caches).
A request of L tokens takes ``ceil(L / block_size)`` rows plus one row per
state group. The budget is what vLLM gives the KV cache on each GPU (after
weights and activations, e.g. ``--gpu-memory-utilization`` minus the rest).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kimi_k3_dsa_tools.kv_plan_inputs import (
    PlanError,
    draft_mla_dims,
    one_line,
    verify_max_model_len,
)
from vllm.models.kimi_k3.common.dsa_formats import KERNEL_BLOCK_SIZES

if TYPE_CHECKING:
    from vllm.models.kimi_k3.common.dsa_config import KimiLinearDSAConfig


@dataclass(frozen=True)
class KVPlan:
    """What :func:`make_plan` computes, in bytes, tokens and blocks; the
    command prints it with :func:`format_plan`, or as JSON."""

    config: str
    tp: int
    dp: int
    kv_budget_bytes: int
    max_model_len: int
    num_layers: int
    num_dsa_layers: int
    num_kda_layers: int
    kv_cache_dtype: str
    indexer_kv_dtype: str
    mla_bytes_per_token: int
    indexer_bytes_per_token: int
    draft_method: str | None
    mtp_layers: int
    draft_bytes_per_token: int
    block_size_row_bytes_per_token: int
    row_bytes_per_token: int
    row_bytes: int
    num_speculative_tokens: int
    kda_state_bytes: int
    kda_bytes_per_request: int
    states_per_row: int
    num_state_groups: int
    alignment: int
    reference_tp: int
    block_size: int
    block_bytes: int
    num_blocks: int
    max_tokens: int
    blocks_per_full_request: int
    full_length_requests: int


def _draft_bytes_per_token(
    draft_text: Mapping[str, Any], name: str, method: str, cache_dtype: str
) -> int:
    """What the engine's ``dense_mla_draft_bytes_per_token`` counts: the
    draft's layers x one MLA page per token in the draft's cache dtype."""
    from vllm.models.kimi_k3.common import dsa_cache

    layers, kv_lora_rank, rope = draft_mla_dims(draft_text, name, method)
    return layers * dsa_cache.mla_page_bytes_per_token(cache_dtype, kv_lora_rank, rope)


def make_plan(
    text_config: KimiLinearDSAConfig,
    *,
    config_name: str = "config",
    tp: int = 8,
    dp: int = 1,
    kv_budget_bytes: int,
    indexer_kv_dtype: str = "auto",
    kv_cache_dtype: str = "auto",
    max_model_len: int | None = None,
    draft_method: str | None = None,
    draft_text: Mapping[str, Any] | None = None,
    draft_config_name: str = "draft config",
    draft_kv_cache_dtype: str = "auto",
    num_speculative_tokens: int = 0,
) -> KVPlan:
    """The plan for a text config checked by :func:`build_text_config`."""
    from vllm.models.kimi_k3.common import dsa_block_size, dsa_cache, dsa_verify
    from vllm.models.kimi_k3.common.dsa_verify import (
        check_dsa_deployment,
        indexer_kv_dtype_is_fp4,
        resolve_dsa_cache_dtype,
    )

    # The flags, on their own.
    if tp < 1:
        raise PlanError(f"--tp must be a positive integer, got {tp}")
    if dp < 1:
        raise PlanError(f"--dp must be a positive integer, got {dp}")
    try:
        cache_dtype = resolve_dsa_cache_dtype(kv_cache_dtype)
    except ValueError as e:
        raise PlanError(str(e)) from e
    if max_model_len is not None and max_model_len <= 0:
        raise PlanError("--max-model-len must be a positive number of tokens")
    if num_speculative_tokens < 0:
        raise PlanError("--num-speculative-tokens must be >= 0")
    is_mtp = draft_method in dsa_verify.MTP_DRAFT_METHODS
    if is_mtp:
        if draft_text is not None:
            raise PlanError(
                f"--draft-config is for a dense MLA draft "
                f"({' or '.join(dsa_verify.DENSE_MLA_DRAFT_METHODS)}); "
                f"--draft-method {draft_method} drafts with the checkpoint's own "
                "MTP layers"
            )
        if num_speculative_tokens < 1:
            raise PlanError(
                f"--draft-method {draft_method} needs --num-speculative-tokens "
                ">= 1, as vLLM's speculative_config does"
            )
    elif draft_method is not None:
        if draft_method not in dsa_verify.DENSE_MLA_DRAFT_METHODS:
            methods = (
                *dsa_verify.DENSE_MLA_DRAFT_METHODS,
                *dsa_verify.MTP_DRAFT_METHODS,
            )
            raise PlanError(
                f"unknown draft method {draft_method!r}: the drafts whose pages "
                f"share the DSA row are {', '.join(methods)}"
            )
        if draft_kv_cache_dtype not in dsa_verify.DENSE_DRAFT_CACHE_DTYPES:
            raise PlanError(
                f"--draft-kv-cache-dtype {draft_kv_cache_dtype!r}: the dense MLA "
                "draft's backends read "
                f"{', '.join(dsa_verify.DENSE_DRAFT_CACHE_DTYPES)}"
            )
        if draft_text is None:
            raise PlanError(
                f"--draft-method {draft_method} needs --draft-config, the "
                "config.json of a dense MLA draft (with kv_lora_rank)"
            )
    elif draft_text is not None:
        raise PlanError(
            "--draft-config needs --draft-method "
            f"({' or '.join(dsa_verify.DENSE_MLA_DRAFT_METHODS)}): only a dense "
            "MLA draft's pages share the DSA row"
        )

    # The flags against the model.
    mtp_layers = 0
    if is_mtp:
        mtp_layers = getattr(text_config, "num_nextn_predict_layers", None)
        if type(mtp_layers) is not int or mtp_layers < 1:
            raise PlanError(
                f"{config_name}: --draft-method {draft_method} needs the "
                "checkpoint's MTP layers, and text_config.num_nextn_predict_layers "
                f"is {mtp_layers!r}; plan with the config of a checkpoint that has "
                "them, or without a draft"
            )
    dsa = text_config.dsa_config
    linear = text_config.linear_attn_config
    num_dsa, num_kda = dsa_cache.dsa_layer_counts(text_config)
    kda_heads = linear["num_heads"]
    if kda_heads % tp:
        raise PlanError(
            f"--tp {tp} does not divide the {kda_heads} KDA heads "
            "(linear_attn_config.num_heads): vLLM shards the KDA states by head. "
            f"Use a TP size that divides {kda_heads}."
        )
    attn_heads = text_config.num_attention_heads
    if attn_heads % tp:
        raise PlanError(
            f"--tp {tp} does not divide the {attn_heads} attention heads "
            "(num_attention_heads)."
        )
    try:
        use_fp4 = indexer_kv_dtype_is_fp4(indexer_kv_dtype, dsa, "--indexer-kv-dtype")
    except ValueError as exc:
        raise PlanError(str(exc)) from None
    # What vllm serve refuses for these flags, by the same functions: vLLM's
    # own max_model_len check, then the DSA rules the config verifier runs.
    try:
        max_model_len = verify_max_model_len(text_config, max_model_len)
    except ValueError as exc:
        raise PlanError(f"--max-model-len: {one_line(exc)}") from None
    try:
        check_dsa_deployment(
            text_config, max_model_len=max_model_len, tensor_parallel_size=tp
        )
    except (ValueError, NotImplementedError) as exc:
        raise PlanError(f"{config_name}: {one_line(exc)}") from None

    # What the engine sizes the packed cache with (target_mla_bytes_per_token,
    # dense_mla_draft_bytes_per_token, packed_dsa_block_size), on numbers.
    mla = dsa_cache.mla_page_bytes_per_token(
        cache_dtype, text_config.kv_lora_rank, text_config.qk_rope_head_dim or 0
    )
    index = dsa_cache.indexer_cache_entry_bytes(dsa.index_head_dim, use_fp4)
    draft = 0
    if draft_method is not None and not is_mtp:
        assert draft_text is not None
        # "auto" is the draft's weight dtype: bf16 for the Kimi K3 drafts.
        draft_dtype = (
            "bfloat16" if draft_kv_cache_dtype == "auto" else draft_kv_cache_dtype
        )
        draft = _draft_bytes_per_token(
            draft_text, draft_config_name, draft_method, draft_dtype
        )
    sizing_row = dsa_cache.packed_row_bytes_per_token(num_dsa, mla, index, draft)
    # The MTP layers are DSA layers: vLLM packs their pages into the row the
    # engine sized the block without.
    row = sizing_row + dsa_cache.packed_row_bytes_per_token(mtp_layers, mla, index)
    if is_mtp:
        draft = row - sizing_row
    state = dsa_block_size.kda_state_bytes(
        kda_heads,
        linear["head_dim"],
        linear["short_conv_kernel_size"],
        tp,
        num_speculative_tokens,
    )
    alignment = dsa_block_size.packed_dsa_alignment(list(KERNEL_BLOCK_SIZES))
    block = dsa_cache.packed_block_size_from_bytes(
        sizing_row,
        dsa_cache.states_per_row(num_dsa, num_kda),
        state,
        alignment,
        tp,
    )
    spr = dsa_cache.states_per_row(num_dsa + mtp_layers, num_kda)
    # FlashMLA sparse and the indexer read 64-token pages; the planner keeps
    # the block stride a whole number of both.
    block_bytes = dsa_block_size.packed_block_bytes(
        block,
        row,
        spr * state,
        [KERNEL_BLOCK_SIZES[0] * mla, KERNEL_BLOCK_SIZES[1] * index],
    )
    num_state_groups = -(-num_kda // spr)
    num_blocks = kv_budget_bytes // block_bytes
    blocks_per_request = -(-max_model_len // block) + num_state_groups
    full_requests = num_blocks // blocks_per_request
    if full_requests < 1:
        need = blocks_per_request * block_bytes
        raise PlanError(
            f"a KV budget of {_human(kv_budget_bytes)} per GPU is too small for one "
            f"request of {max_model_len:,} tokens at TP {tp}: it needs "
            f"{blocks_per_request:,} blocks of {_human(block_bytes)} = "
            f"{_human(need)} ({need:,} B). Raise the budget, lower "
            "--max-model-len, or use a larger TP."
        )
    return KVPlan(
        config=config_name,
        tp=tp,
        dp=dp,
        kv_budget_bytes=kv_budget_bytes,
        max_model_len=max_model_len,
        num_layers=text_config.num_hidden_layers,
        num_dsa_layers=num_dsa,
        num_kda_layers=num_kda,
        kv_cache_dtype=cache_dtype,
        indexer_kv_dtype="mxfp4" if use_fp4 else "fp8",
        mla_bytes_per_token=mla,
        indexer_bytes_per_token=index,
        draft_method=draft_method,
        mtp_layers=mtp_layers,
        draft_bytes_per_token=draft,
        block_size_row_bytes_per_token=sizing_row,
        row_bytes_per_token=row,
        num_speculative_tokens=num_speculative_tokens,
        kda_state_bytes=state,
        kda_bytes_per_request=state * num_kda,
        states_per_row=spr,
        num_state_groups=num_state_groups,
        alignment=alignment,
        reference_tp=dsa_cache._PD_REFERENCE_TP,
        block_size=block,
        row_bytes=block * row,
        block_bytes=block_bytes,
        num_blocks=num_blocks,
        max_tokens=(num_blocks - num_state_groups) * block,
        blocks_per_full_request=blocks_per_request,
        full_length_requests=full_requests,
    )


def _human(n: int) -> str:
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def format_plan(p: KVPlan) -> str:
    """The plan as the command's human-readable report."""
    if p.mtp_layers:
        draft_name = f"{p.draft_method}: {p.mtp_layers} MTP layer(s), MLA + indexer"
    else:
        draft_name = p.draft_method or "no draft"
    draft = f"{p.draft_bytes_per_token:>7,} B ({draft_name})"
    lines = [
        f"Kimi K3.1 DSA KV cache plan ({p.config})",
        f"  layers {p.num_layers}: {p.num_dsa_layers} DSA + {p.num_kda_layers} KDA"
        + (f" | DP {p.dp} x" if p.dp > 1 else " |")
        + f" TP {p.tp} | KV budget {_human(p.kv_budget_bytes)} per GPU"
        f" | max_model_len {p.max_model_len:,}",
        "Per token, per GPU (DSA caches are replicated across TP ranks):",
        f"  MLA {p.kv_cache_dtype:<12} {p.mla_bytes_per_token:>5} B x "
        f"{p.num_dsa_layers} layers = {p.mla_bytes_per_token * p.num_dsa_layers:>7,} B",
        f"  indexer {p.indexer_kv_dtype:<8} {p.indexer_bytes_per_token:>5} B x "
        f"{p.num_dsa_layers} layers = "
        f"{p.indexer_bytes_per_token * p.num_dsa_layers:>7,} B",
        f"  draft pages                          = {draft}",
        f"  packed row                           = {p.row_bytes_per_token:>7,} B",
        "KDA states per request, per GPU:",
        f"  {p.kda_state_bytes:,} B x {p.num_kda_layers} layers = "
        f"{p.kda_bytes_per_request:,} B ({_human(p.kda_bytes_per_request)})"
        + (
            f", {p.num_speculative_tokens} speculative tokens"
            if p.num_speculative_tokens
            else ""
        ),
        "Block:",
        f"  block size {p.block_size:,} tokens (multiple of {p.alignment}, rounded at "
        f"reference TP {p.reference_tp})"
        + (
            f", sized from the row without the MTP layers "
            f"({p.block_size_row_bytes_per_token:,} B a token), as the engine does"
            if p.mtp_layers
            else ""
        ),
        f"  block bytes {p.block_bytes:,} ({_human(p.block_bytes)}): the row's "
        f"{p.row_bytes:,} B in whole 64-token kernel pages",
        f"  {p.states_per_row} KDA states per row, {p.num_state_groups} state groups",
        "Capacity:",
        f"  blocks {p.num_blocks:,}",
        f"  KV tokens {p.max_tokens:,} (one request)",
        f"  full-length requests ({p.max_model_len:,} tokens, "
        f"{p.blocks_per_full_request:,} blocks each): {p.full_length_requests:,}",
    ]
    if p.dp > 1:
        lines.append(
            f"Data parallel: {p.dp} engines (TP {p.tp} attention each, all "
            "DSA heads on each of its ranks), each planned as above for its own "
            f"requests: {p.dp * p.full_length_requests:,} full-length requests"
        )
    return "\n".join(lines)
