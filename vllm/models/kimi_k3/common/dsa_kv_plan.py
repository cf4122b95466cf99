# SPDX-License-Identifier: Apache-2.0
"""Plan the KV cache of a Kimi K3.1 DSA deployment, without a GPU or weights.

From a checkpoint's ``config.json`` (default: the bundled Kimi K3.1 config), a
TP size, a KV cache budget per GPU, the indexer key dtype and an optional
dense MLA draft, print what the packed KV cache of vLLM 0.33.0 with this
series holds: the per-token bytes of each DSA cache (``fp8_ds_mla`` MLA and
indexer keys), the KDA states of one request, the block size, and how many
tokens and full-length requests fit. It uses the same arithmetic the engine
sizes the cache with (``dsa_cache``).

    kimi-k3-dsa-kv-plan --tp 8 --kv-budget 60GiB
    python -m vllm.models.kimi_k3.common.dsa_kv_plan --config ckpt/config.json

Model of the cache (block-outermost packed layout, ``mamba_cache_mode``
``none``): every block row holds all DSA layers' MLA and indexer pages for
``block_size`` tokens (plus a dense draft's MLA pages); the KDA states sit in
state groups of ``states_per_row`` states, each group's page fitting one row.
A request of L tokens takes ``ceil(L / block_size)`` rows plus one row per
state group. The budget is what vLLM gives the KV cache on each GPU (after
weights and activations, e.g. ``--gpu-memory-utilization`` minus the rest).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

BUNDLED_CONFIG = "kimi_k3_1_config.json"
INDEXER_KV_DTYPES = ("auto", "fp8", "mxfp4")
# Dense MLA drafts whose pages share the DSA row (see dsa_cache).
DRAFT_METHODS = ("eagle3", "dspark")
# Kernel pages of the two DSA caches on CUDA: DeepGEMM's indexer reads 64-token
# pages, FlashMLA sparse multiples of 64.
KERNEL_BLOCK_SIZES = (64, 64)
_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}


class PlanError(ValueError):
    """An input the plan cannot be made for; the message says why."""


@dataclass(frozen=True)
class KVPlan:
    config: str
    tp: int
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
    draft_bytes_per_token: int
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


def parse_bytes(text: str) -> int:
    """``"60GiB"``, ``"1.5TB"``, ``"123456"`` -> bytes."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", text)
    unit = match.group(2).upper() if match else None
    if match is None or unit not in _UNITS:
        raise PlanError(
            f"cannot read the KV budget {text!r}: give a number with an optional "
            "unit, e.g. 60GiB, 64GB, 500MiB or a byte count"
        )
    return int(float(match.group(1)) * _UNITS[unit])


def load_text_config(path: str | Path | None) -> tuple[dict[str, Any], str]:
    """The text config of a checkpoint ``config.json`` (a multimodal Kimi K3
    config nests it under ``text_config``) and a name for it."""
    if path is None:
        # Beside this module (installed or editable): a namespace package's
        # resources would resolve to upstream's tree.
        data = Path(__file__).resolve().parent / "data" / BUNDLED_CONFIG
        raw, name = json.loads(data.read_text()), f"bundled {BUNDLED_CONFIG}"
    else:
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        try:
            raw = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise PlanError(f"cannot read the checkpoint config {path}: {e}") from e
        name = str(path)
    text = raw.get("text_config", raw)
    if not isinstance(text, dict) or text.get("dsa_config") is None:
        raise PlanError(f"{name} is not a Kimi K3.1 DSA config: it has no dsa_config")
    if text.get("linear_attn_config") is None:
        raise PlanError(
            f"{name} has no linear_attn_config: the packed DSA plan is for the "
            "KDA-hybrid Kimi K3.1"
        )
    return text, name


def make_plan(
    text: dict[str, Any],
    *,
    config_name: str = "config",
    tp: int = 8,
    kv_budget_bytes: int,
    indexer_kv_dtype: str = "auto",
    kv_cache_dtype: str = "auto",
    max_model_len: int | None = None,
    draft_method: str | None = None,
    draft_text: dict[str, Any] | None = None,
    num_speculative_tokens: int = 0,
) -> KVPlan:
    from vllm.models.kimi_k3.common import dsa_cache
    from vllm.models.kimi_k3.common.dsa_config import (
        DSAConfig,
        resolve_dsa_cache_dtype,
    )

    dsa = DSAConfig.from_dict(text["dsa_config"])
    linear = text["linear_attn_config"]
    num_dsa = len(linear["full_attn_layers"])
    num_kda = len(linear["kda_layers"])
    kda_heads = linear["num_heads"]
    if tp < 1:
        raise PlanError(f"--tp must be a positive integer, got {tp}")
    if kda_heads % tp:
        raise PlanError(
            f"--tp {tp} does not divide the {kda_heads} KDA heads "
            "(linear_attn_config.num_heads): vLLM shards the KDA states by head. "
            f"Use a TP size that divides {kda_heads}."
        )
    attn_heads = text.get("num_attention_heads", kda_heads)
    if attn_heads % tp:
        raise PlanError(
            f"--tp {tp} does not divide the {attn_heads} attention heads "
            "(num_attention_heads)."
        )
    if indexer_kv_dtype not in INDEXER_KV_DTYPES:
        raise PlanError(
            f"unknown indexer key dtype {indexer_kv_dtype!r}: accepted values are "
            f"{', '.join(INDEXER_KV_DTYPES)} (auto = fp8, 132 B/token at head dim "
            "128; mxfp4 = 68 B/token, SM10x only)"
        )
    use_fp4 = indexer_kv_dtype == "mxfp4"
    if use_fp4 and not (
        dsa.index_k_norm_type == "layernorm" and dsa.index_rope_dim == 0
    ):
        raise PlanError(
            "indexer_kv_dtype='mxfp4' needs the fused Kimi K3 DSA key insert "
            "(index_k_norm_type='layernorm', index_rope_dim=0)."
        )
    try:
        cache_dtype = resolve_dsa_cache_dtype(kv_cache_dtype)
    except ValueError as e:
        raise PlanError(str(e)) from e
    if max_model_len is None:
        max_model_len = int(text.get("max_position_embeddings", 0))
    if max_model_len <= 0:
        raise PlanError("--max-model-len must be a positive number of tokens")
    if num_speculative_tokens < 0:
        raise PlanError("--num-speculative-tokens must be >= 0")

    kv_lora_rank = text["kv_lora_rank"]
    rope = text.get("qk_rope_head_dim") or 0
    mla = dsa_cache.fp8_ds_mla_bytes_per_token(kv_lora_rank, rope)
    assert cache_dtype == "fp8_ds_mla"
    index = dsa_cache.indexer_cache_entry_bytes(dsa.index_head_dim, use_fp4)
    draft = 0
    if draft_method is not None:
        if draft_method not in DRAFT_METHODS:
            raise PlanError(
                f"unknown draft method {draft_method!r}: the dense MLA drafts "
                f"whose pages share the DSA row are {', '.join(DRAFT_METHODS)}"
            )
        if draft_text is None or draft_text.get("kv_lora_rank") is None:
            raise PlanError(
                f"--draft-method {draft_method} needs --draft-config, the "
                "config.json of a dense MLA draft (with kv_lora_rank)"
            )
        draft = draft_text["num_hidden_layers"] * dsa_cache.fp8_ds_mla_bytes_per_token(
            draft_text["kv_lora_rank"], draft_text.get("qk_rope_head_dim") or 0
        )
    row = dsa_cache.packed_row_bytes_per_token(num_dsa, mla, index, draft)
    state = dsa_cache.kda_state_bytes(
        kda_heads,
        linear["head_dim"],
        linear["short_conv_kernel_size"],
        tp,
        num_speculative_tokens,
    )
    spr = dsa_cache.states_per_row(num_dsa, num_kda)
    alignment = dsa_cache.packed_dsa_alignment(list(KERNEL_BLOCK_SIZES))
    block = dsa_cache.packed_block_size_from_bytes(row, spr, state, alignment, tp)
    # FlashMLA sparse and the indexer read 64-token pages; the planner keeps
    # the block stride a whole number of both.
    block_bytes = dsa_cache.packed_block_bytes(
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
        kv_budget_bytes=kv_budget_bytes,
        max_model_len=max_model_len,
        num_layers=int(text.get("num_hidden_layers", num_dsa + num_kda)),
        num_dsa_layers=num_dsa,
        num_kda_layers=num_kda,
        kv_cache_dtype=cache_dtype,
        indexer_kv_dtype="mxfp4" if use_fp4 else "fp8",
        mla_bytes_per_token=mla,
        indexer_bytes_per_token=index,
        draft_method=draft_method,
        draft_bytes_per_token=draft,
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
    draft = (
        f"{p.draft_bytes_per_token:>7,} B ({p.draft_method})"
        if p.draft_method
        else f"{0:>7,} B (no dense MLA draft)"
    )
    lines = [
        f"Kimi K3.1 DSA KV cache plan ({p.config})",
        f"  layers {p.num_layers}: {p.num_dsa_layers} DSA + {p.num_kda_layers} KDA"
        f" | TP {p.tp} | KV budget {_human(p.kv_budget_bytes)} per GPU"
        f" | max_model_len {p.max_model_len:,}",
        "Per token, per GPU (DSA caches are replicated across TP ranks):",
        f"  MLA {p.kv_cache_dtype:<12} {p.mla_bytes_per_token:>5} B x "
        f"{p.num_dsa_layers} layers = {p.mla_bytes_per_token * p.num_dsa_layers:>7,} B",
        f"  indexer {p.indexer_kv_dtype:<8} {p.indexer_bytes_per_token:>5} B x "
        f"{p.num_dsa_layers} layers = "
        f"{p.indexer_bytes_per_token * p.num_dsa_layers:>7,} B",
        f"  dense MLA draft                      = {draft}",
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
        f"reference TP {p.reference_tp})",
        f"  block bytes {p.block_bytes:,} ({_human(p.block_bytes)}): the row's "
        f"{p.row_bytes:,} B in whole 64-token kernel pages",
        f"  {p.states_per_row} KDA states per row, {p.num_state_groups} state groups",
        "Capacity:",
        f"  blocks {p.num_blocks:,}",
        f"  KV tokens {p.max_tokens:,} (one request)",
        f"  full-length requests ({p.max_model_len:,} tokens, "
        f"{p.blocks_per_full_request:,} blocks each): {p.full_length_requests:,}",
    ]
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kimi-k3-dsa-kv-plan",
        description=__doc__.split("\n\n")[0],
    )
    parser.add_argument(
        "--config",
        help="checkpoint config.json or directory (default: the bundled Kimi K3.1 "
        "config)",
    )
    parser.add_argument("--tp", type=int, default=8, help="tensor parallel size")
    parser.add_argument(
        "--kv-budget",
        default="40GiB",
        help="KV cache memory per GPU, e.g. 40GiB, 64GB (default: 40GiB)",
    )
    parser.add_argument(
        "--indexer-kv-dtype",
        default="auto",
        help="indexer key dtype: auto (= fp8), fp8 or mxfp4",
    )
    parser.add_argument(
        "--kv-cache-dtype",
        default="auto",
        help="--kv-cache-dtype of vllm serve (a DSA model runs fp8_ds_mla)",
    )
    parser.add_argument(
        "--max-model-len",
        type=int,
        help="tokens of a full-length request (default: max_position_embeddings)",
    )
    parser.add_argument("--draft-method", help="dense MLA draft: eagle3 or dspark")
    parser.add_argument("--draft-config", help="the draft's config.json")
    parser.add_argument("--num-speculative-tokens", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        text, name = load_text_config(args.config)
        draft_text = None
        if args.draft_config is not None:
            draft_raw = json.loads(Path(args.draft_config).read_text())
            draft_text = draft_raw.get("text_config", draft_raw)
        plan = make_plan(
            text,
            config_name=name,
            tp=args.tp,
            kv_budget_bytes=parse_bytes(args.kv_budget),
            indexer_kv_dtype=args.indexer_kv_dtype,
            kv_cache_dtype=args.kv_cache_dtype,
            max_model_len=args.max_model_len,
            draft_method=args.draft_method,
            draft_text=draft_text,
            num_speculative_tokens=args.num_speculative_tokens,
        )
    except (PlanError, ValueError, OSError) as e:
        print(f"kimi-k3-dsa-kv-plan: error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(asdict(plan), indent=2) if args.json else format_plan(plan))
    return 0


if __name__ == "__main__":
    sys.exit(main())
