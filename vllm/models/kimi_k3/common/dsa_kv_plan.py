# SPDX-License-Identifier: Apache-2.0
"""Plan the KV cache of a Kimi K3.1 DSA deployment, without a GPU or weights.

From a checkpoint's ``config.json`` (default: the bundled Kimi K3.1 config), a
TP size, a KV cache budget per GPU, the indexer key dtype and an optional
dense MLA draft, print what the packed KV cache of vLLM 0.33.0 with this
series holds: the per-token bytes of each DSA cache (``fp8_ds_mla`` MLA and
indexer keys), the KDA states of one request, the block size, and how many
tokens and full-length requests fit. It uses the same arithmetic the engine
sizes the cache with (``dsa_cache``).

The config is built and checked with the engine's own config classes and
rules (``dsa_config``) before any arithmetic: a checkpoint that ``vllm serve``
refuses, or a bad flag, is refused with one line on stderr that names the file
and the field, and exit status 2.

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
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

if TYPE_CHECKING:
    from vllm.models.kimi_k3.common.dsa_config import KimiLinearDSAConfig

PROG = "kimi-k3-dsa-kv-plan"
BUNDLED_CONFIG = "kimi_k3_1_config.json"
CONFIG_FILE = "config.json"
# A config.json is a few KiB: a larger file (the weights, a log) is refused
# before it is read into memory.
MAX_CONFIG_BYTES = 16 * 2**20
# The model types whose HF config class parses dsa_config (the hf_config
# seam): text-only Kimi K3, and the multimodal one with a nested text_config.
TEXT_MODEL_TYPE = "kimi_linear"
MULTIMODAL_MODEL_TYPE = "kimi_k3"
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
# What the HF config classes raise on a field of the wrong type or value:
# they index, divide and assert on the raw JSON values.
_CONFIG_BUILD_ERRORS = (
    TypeError,
    ValueError,
    LookupError,
    AttributeError,
    AssertionError,
    ArithmeticError,
    NotImplementedError,
)
_MISSING = object()


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


def _one_line(error: BaseException) -> str:
    """The message of ``error`` on one line (an error is one stderr line)."""
    return " ".join(str(error).split()) or type(error).__name__


def _json_type(value: Any) -> str:
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    names = {dict: "object", list: "array", str: "string", type(None): "null"}
    return names.get(type(value), type(value).__name__)


def _got(value: Any) -> str:
    """How a refusal shows a bad JSON value (or its absence), as JSON."""
    if value is _MISSING:
        return "it is missing"
    shown = json.dumps(value)
    if len(shown) > 60:
        shown = shown[:57] + "..."
    return f"got {shown} ({_json_type(value)})"


def _require_int(name: str, field: str, value: Any, minimum: int | None) -> None:
    """A JSON integer (not a boolean, float or string), >= ``minimum``."""
    if (
        not isinstance(value, int)
        or isinstance(value, bool)
        or (minimum is not None and value < minimum)
    ):
        kind = {None: "an integer", 0: "an integer >= 0", 1: "a positive integer"}
        wanted = kind.get(minimum, f"an integer >= {minimum}")
        raise PlanError(f"{name}: {field} must be {wanted}; {_got(value)}")


def _config_path(path: str | Path, flag: str) -> Path:
    """A checkpoint directory stands for its ``config.json``."""
    if str(path).strip() == "":
        raise PlanError(f"{flag} is empty: give a config.json or its directory")
    path = Path(path)
    return path / CONFIG_FILE if path.is_dir() else path


def _read_json(path: Path, what: str) -> Any:
    """The JSON value in ``path``; every way reading it can fail is a
    :class:`PlanError` that names the file."""
    prefix = f"cannot read the {what} {path}"
    try:
        with path.open("rb") as f:
            data = f.read(MAX_CONFIG_BYTES + 1)
    except OSError as e:
        raise PlanError(f"{prefix}: {e.strerror or _one_line(e)}") from e
    if len(data) > MAX_CONFIG_BYTES:
        raise PlanError(
            f"{prefix}: it is over {MAX_CONFIG_BYTES // 2**20} MiB, not a "
            "config.json (the weights?)"
        )
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise PlanError(
            f"{prefix}: byte {e.start} is not UTF-8 text; is it a binary file? "
            "Give a config.json"
        ) from e
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise PlanError(
            f"{prefix}: invalid JSON: {e.msg} at line {e.lineno} column {e.colno}"
        ) from e
    except RecursionError as e:
        raise PlanError(f"{prefix}: its JSON is nested too deeply") from e


def _require_object(name: str, raw: Any) -> dict[str, Any]:
    if not isinstance(raw, dict):
        raise PlanError(
            f"{name} is not a model config: it holds a JSON {_json_type(raw)}, "
            "not an object"
        )
    return raw


def load_text_config(path: str | Path | None) -> tuple[KimiLinearDSAConfig, str]:
    """The checked text config of a checkpoint ``config.json`` (default: the
    bundled Kimi K3.1 config) and a name for it; see
    :func:`build_text_config`."""
    if path is None:
        # Beside this module (installed or editable): a namespace package's
        # resources would resolve to upstream's tree.
        data = Path(__file__).resolve().parent / "data" / BUNDLED_CONFIG
        raw, name = _read_json(data, "bundled config"), f"bundled {BUNDLED_CONFIG}"
    else:
        config_path = _config_path(path, "--config")
        raw, name = _read_json(config_path, "checkpoint config"), str(config_path)
    return build_text_config(raw, name), name


def build_text_config(raw: Any, name: str) -> KimiLinearDSAConfig:
    """Build the text config from a parsed ``config.json`` with the engine's
    HF config classes and run the engine's DSA rules on it, so that the plan
    refuses what ``vllm serve`` refuses and its arithmetic sees only a model
    the engine would serve.

    The fields the classes compute with are typed first: the classes would
    fail on them with messages that name no field.
    """
    from vllm.models.kimi_k3.common.dsa_config import (
        KimiK3DSAConfig,
        KimiLinearDSAConfig,
        check_dsa_serving,
    )

    raw = _require_object(name, raw)
    model_type = raw.get("model_type")
    if model_type is not None and model_type not in (
        TEXT_MODEL_TYPE,
        MULTIMODAL_MODEL_TYPE,
    ):
        raise PlanError(
            f"{name}: model_type {model_type!r} is not Kimi K3: vLLM reads "
            f"dsa_config for model_type {TEXT_MODEL_TYPE!r} (text) or "
            f"{MULTIMODAL_MODEL_TYPE!r} (multimodal, with a text_config)"
        )
    multimodal = model_type == MULTIMODAL_MODEL_TYPE or (
        model_type is None and "text_config" in raw
    )
    text = raw.get("text_config", _MISSING) if multimodal else raw
    if not isinstance(text, dict):
        raise PlanError(
            f"{name}: text_config must be a JSON object (the language model's "
            f"config); {_got(text)}"
        )
    # A multimodal config with dsa_config at the top level is refused by
    # KimiK3DSAConfig below, with a message that says where it belongs.
    misplaced_dsa = multimodal and raw.get("dsa_config") is not None
    if text.get("dsa_config") is None and not misplaced_dsa:
        raise PlanError(f"{name} is not a Kimi K3.1 DSA config: it has no dsa_config")
    if text.get("linear_attn_config") is None:
        raise PlanError(
            f"{name} has no linear_attn_config: the packed DSA plan is for the "
            "KDA-hybrid Kimi K3.1"
        )
    _check_field_types(text, name)
    try:
        if multimodal:
            text_config = KimiK3DSAConfig(**raw).text_config
        else:
            text_config = KimiLinearDSAConfig(**raw)
        # The classes ran check_dsa_model; the rest of what the engine's
        # verify_dsa_vllm_config checks on the built config:
        check_dsa_serving(text_config)
    except KeyError as e:
        raise PlanError(f"{name}: field {e.args[0]!r} is missing") from e
    except (ValueError, NotImplementedError) as e:
        raise PlanError(f"{name}: {_one_line(e)}") from e
    except _CONFIG_BUILD_ERRORS as e:
        raise PlanError(
            f"{name}: not a valid Kimi K3 config ({type(e).__name__}: {_one_line(e)})"
        ) from e
    return text_config


def _check_field_types(text: Mapping[str, Any], name: str) -> None:
    """Type the fields that ``KimiLinearConfig`` and the plan compute with
    (``hidden_size // num_attention_heads``, ``range(num_hidden_layers)``,
    the KDA state shapes); their values are the engine rules' business."""
    for field in (
        "num_hidden_layers",
        "num_attention_heads",
        "hidden_size",
        "max_position_embeddings",
    ):
        if field in text:
            _require_int(name, field, text[field], minimum=1)
    for field in ("kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim"):
        if text.get(field) is not None:
            _require_int(name, field, text[field], minimum=None)
    linear = text["linear_attn_config"]
    if not isinstance(linear, dict):
        raise PlanError(
            f"{name}: linear_attn_config must be a JSON object; {_got(linear)}"
        )
    for field in ("kda_layers", "full_attn_layers"):
        layers = linear.get(field, _MISSING)
        if not isinstance(layers, list) or not all(
            isinstance(layer, int) and not isinstance(layer, bool) for layer in layers
        ):
            raise PlanError(
                f"{name}: linear_attn_config.{field} must be a list of 1-indexed "
                f"layer numbers; {_got(layers)}"
            )
    for field in ("num_heads", "head_dim", "short_conv_kernel_size"):
        value = linear.get(field, _MISSING)
        _require_int(name, f"linear_attn_config.{field}", value, minimum=1)


def load_draft_config(path: str | Path) -> tuple[dict[str, Any], str]:
    """The text config (as JSON) of a dense MLA draft's ``config.json`` and a
    name for it; its fields are checked by :func:`make_plan`."""
    config_path = _config_path(path, "--draft-config")
    name = str(config_path)
    raw = _require_object(name, _read_json(config_path, "draft config"))
    text = raw.get("text_config", raw)
    if not isinstance(text, dict):
        raise PlanError(f"{name}: text_config must be a JSON object; {_got(text)}")
    return text, name


def _draft_bytes_per_token(
    draft_text: Mapping[str, Any], name: str, method: str, cache_dtype: str
) -> int:
    """What the engine's ``dense_mla_draft_bytes_per_token`` counts: the
    draft's layers x one MLA page per token in the target's cache dtype."""
    from vllm.models.kimi_k3.common import dsa_block_size

    if draft_text.get("kv_lora_rank") is None:
        raise PlanError(
            f"{name} has no kv_lora_rank: --draft-method {method} plans a dense "
            "MLA draft, whose pages share the DSA row; give its config.json"
        )
    _require_int(name, "kv_lora_rank", draft_text["kv_lora_rank"], minimum=1)
    layers = draft_text.get("num_hidden_layers", _MISSING)
    _require_int(name, "num_hidden_layers", layers, minimum=1)
    rope = draft_text.get("qk_rope_head_dim") or 0
    _require_int(name, "qk_rope_head_dim", rope, minimum=0)
    return layers * dsa_block_size.mla_page_bytes_per_token(
        cache_dtype, draft_text["kv_lora_rank"], rope
    )


def make_plan(
    text_config: KimiLinearDSAConfig,
    *,
    config_name: str = "config",
    tp: int = 8,
    kv_budget_bytes: int,
    indexer_kv_dtype: str = "auto",
    kv_cache_dtype: str = "auto",
    max_model_len: int | None = None,
    draft_method: str | None = None,
    draft_text: Mapping[str, Any] | None = None,
    draft_config_name: str = "draft config",
    num_speculative_tokens: int = 0,
) -> KVPlan:
    """The plan for a text config checked by :func:`build_text_config`."""
    from vllm.models.kimi_k3.common import dsa_block_size, dsa_cache
    from vllm.models.kimi_k3.common.dsa_config import (
        DSA_INDEXER_KV_DTYPES,
        check_mxfp4_indexer,
        resolve_dsa_cache_dtype,
    )

    # The flags, on their own.
    if tp < 1:
        raise PlanError(f"--tp must be a positive integer, got {tp}")
    if indexer_kv_dtype not in DSA_INDEXER_KV_DTYPES:
        raise PlanError(
            f"unknown indexer key dtype {indexer_kv_dtype!r}: accepted values are "
            f"{', '.join(DSA_INDEXER_KV_DTYPES)} (auto = fp8, 132 B/token at head "
            "dim 128; mxfp4 = 68 B/token, SM10x only)"
        )
    try:
        cache_dtype = resolve_dsa_cache_dtype(kv_cache_dtype)
    except ValueError as e:
        raise PlanError(str(e)) from e
    if max_model_len is not None and max_model_len <= 0:
        raise PlanError("--max-model-len must be a positive number of tokens")
    if num_speculative_tokens < 0:
        raise PlanError("--num-speculative-tokens must be >= 0")
    if draft_method is not None:
        if draft_method not in dsa_block_size.DENSE_MLA_DRAFT_METHODS:
            raise PlanError(
                f"unknown draft method {draft_method!r}: the dense MLA drafts "
                "whose pages share the DSA row are "
                f"{', '.join(dsa_block_size.DENSE_MLA_DRAFT_METHODS)}"
            )
        if draft_text is None:
            raise PlanError(
                f"--draft-method {draft_method} needs --draft-config, the "
                "config.json of a dense MLA draft (with kv_lora_rank)"
            )
    elif draft_text is not None:
        raise PlanError(
            "--draft-config needs --draft-method "
            f"({' or '.join(dsa_block_size.DENSE_MLA_DRAFT_METHODS)}): only a dense "
            "MLA draft's pages share the DSA row"
        )

    # The flags against the model.
    dsa = text_config.dsa_config
    linear = text_config.linear_attn_config
    num_dsa, num_kda = dsa_block_size.dsa_layer_counts(text_config)
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
    use_fp4 = indexer_kv_dtype == "mxfp4"
    if use_fp4:
        try:
            check_mxfp4_indexer(dsa)
        except ValueError as exc:
            raise PlanError(str(exc)) from None
    if max_model_len is None:
        max_model_len = text_config.max_position_embeddings

    # What the engine sizes the packed cache with (target_mla_bytes_per_token,
    # dense_mla_draft_bytes_per_token, packed_dsa_block_size), on numbers.
    mla = dsa_block_size.mla_page_bytes_per_token(
        cache_dtype, text_config.kv_lora_rank, text_config.qk_rope_head_dim or 0
    )
    index = dsa_cache.indexer_cache_entry_bytes(dsa.index_head_dim, use_fp4)
    draft = 0
    if draft_method is not None:
        assert draft_text is not None
        draft = _draft_bytes_per_token(
            draft_text, draft_config_name, draft_method, cache_dtype
        )
    row = dsa_block_size.packed_row_bytes_per_token(num_dsa, mla, index, draft)
    state = dsa_block_size.kda_state_bytes(
        kda_heads,
        linear["head_dim"],
        linear["short_conv_kernel_size"],
        tp,
        num_speculative_tokens,
    )
    spr = dsa_block_size.states_per_row(num_dsa, num_kda)
    alignment = dsa_block_size.packed_dsa_alignment(list(KERNEL_BLOCK_SIZES))
    block = dsa_block_size.packed_block_size_from_bytes(row, spr, state, alignment, tp)
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
        draft_bytes_per_token=draft,
        row_bytes_per_token=row,
        num_speculative_tokens=num_speculative_tokens,
        kda_state_bytes=state,
        kda_bytes_per_request=state * num_kda,
        states_per_row=spr,
        num_state_groups=num_state_groups,
        alignment=alignment,
        reference_tp=dsa_block_size._PD_REFERENCE_TP,
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


class _ArgumentParser(argparse.ArgumentParser):
    """Reports a bad flag as a :class:`PlanError`, so that :func:`main` prints
    it as its one error line (argparse would print the usage and exit)."""

    def error(self, message: str) -> NoReturn:
        raise PlanError(f"{message} (see {self.prog} --help)")


def build_parser() -> argparse.ArgumentParser:
    parser = _ArgumentParser(
        prog=PROG,
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
    parser.add_argument("--draft-config", help="the draft's config.json or directory")
    parser.add_argument("--num-speculative-tokens", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Print the plan and return 0; or refuse a bad input with one line on
    stderr (naming the flag, or the file and its field) and return 2."""
    try:
        args = build_parser().parse_args(argv)
        kv_budget_bytes = parse_bytes(args.kv_budget)
        text_config, name = load_text_config(args.config)
        draft_text, draft_name = None, "draft config"
        if args.draft_config is not None:
            draft_text, draft_name = load_draft_config(args.draft_config)
        plan = make_plan(
            text_config,
            config_name=name,
            tp=args.tp,
            kv_budget_bytes=kv_budget_bytes,
            indexer_kv_dtype=args.indexer_kv_dtype,
            kv_cache_dtype=args.kv_cache_dtype,
            max_model_len=args.max_model_len,
            draft_method=args.draft_method,
            draft_text=draft_text,
            draft_config_name=draft_name,
            num_speculative_tokens=args.num_speculative_tokens,
        )
    except (PlanError, ValueError, OSError, NotImplementedError) as e:
        print(f"{PROG}: error: {_one_line(e)}", file=sys.stderr)
        return 2
    print(json.dumps(asdict(plan), indent=2) if args.json else format_plan(plan))
    return 0


if __name__ == "__main__":
    sys.exit(main())
