# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The inputs of a KV cache plan, read and checked before any arithmetic.

A plan is only as good as the model it is made for, so a checkpoint's
``config.json`` is built with the engine's own HF config classes and run
through the engine's DSA rules (``dsa_config``): a config that ``vllm serve``
refuses is refused here too. Every way an input can be wrong (an unreadable
or oversized file, invalid JSON, a field of the wrong type or value, a
malformed byte size) is a :class:`PlanError` whose one-line message names the
file and the field, or the flag.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllm.models.kimi_k3.common.dsa_config import KimiLinearDSAConfig

BUNDLED_CONFIG = "kimi_k3_1_config.json"
CONFIG_FILE = "config.json"
# A config.json is a few KiB: a larger file (the weights, a log) is refused
# before it is read into memory.
MAX_CONFIG_BYTES = 16 * 2**20
# The model types whose HF config class parses dsa_config (the hf_config
# seam): text-only Kimi K3, and the multimodal one with a nested text_config.
TEXT_MODEL_TYPE = "kimi_linear"
MULTIMODAL_MODEL_TYPE = "kimi_k3"
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


def one_line(error: BaseException) -> str:
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
        raise PlanError(f"{prefix}: {e.strerror or one_line(e)}") from e
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
        # Package data, beside this module (installed or editable).
        data = Path(__file__).resolve().parent / BUNDLED_CONFIG
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
        MULTIMODAL_TOP_LEVEL,
        KimiK3DSAConfig,
        KimiLinearDSAConfig,
        check_dsa_key_placement,
        check_dsa_serving,
        find_dsa_keys,
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
        # DSA keys elsewhere are refused as vllm serve refuses them, saying
        # where they are; without any, the model is plain Kimi K3.
        try:
            check_dsa_key_placement(find_dsa_keys(text), "the text config", None)
            if multimodal:
                outside = {k: v for k, v in raw.items() if k != "text_config"}
                check_dsa_key_placement(
                    find_dsa_keys(outside), MULTIMODAL_TOP_LEVEL, None
                )
        except ValueError as e:
            raise PlanError(f"{name}: {one_line(e)}") from e
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
        raise PlanError(f"{name}: {one_line(e)}") from e
    except _CONFIG_BUILD_ERRORS as e:
        raise PlanError(
            f"{name}: not a valid Kimi K3 config ({type(e).__name__}: {one_line(e)})"
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


def verify_max_model_len(text_config: Any, max_model_len: int | None) -> int:
    """The ``max_model_len`` vLLM 0.33.0 serves ``text_config`` with, by its
    own check (``ModelConfig.get_and_verify_max_len``: the model's
    ``max_position_embeddings`` and rope scaling, ``VLLM_ALLOW_LONG_MAX_MODEL_LEN``),
    for a caller without a ``ModelConfig``: the plan must refuse the
    ``--max-model-len`` that ``vllm serve`` refuses."""
    from vllm.config.model import _get_and_verify_max_len
    from vllm.transformers_utils.model_arch_config_convertor import (
        MODEL_ARCH_CONFIG_CONVERTORS,
        ModelArchConfigConvertorBase,
    )

    convertor_cls = MODEL_ARCH_CONFIG_CONVERTORS.get(
        text_config.model_type, ModelArchConfigConvertorBase
    )
    return _get_and_verify_max_len(
        hf_config=text_config,
        model_arch_config=convertor_cls(text_config, text_config).convert(),
        tokenizer_config=None,
        max_model_len=max_model_len,
        disable_sliding_window=False,
        sliding_window=None,
    )


def load_draft_config(path: str | Path) -> tuple[dict[str, Any], str]:
    """The text config (as JSON) of a dense MLA draft's ``config.json`` and a
    name for it; its fields are checked when the plan is made
    (:func:`draft_mla_dims`)."""
    config_path = _config_path(path, "--draft-config")
    name = str(config_path)
    raw = _require_object(name, _read_json(config_path, "draft config"))
    text = raw.get("text_config", raw)
    if not isinstance(text, dict):
        raise PlanError(f"{name}: text_config must be a JSON object; {_got(text)}")
    return text, name


def draft_mla_dims(
    draft_text: Mapping[str, Any], name: str, method: str
) -> tuple[int, int, int]:
    """The layer count, ``kv_lora_rank`` and ``qk_rope_head_dim`` (0 if
    unset) of a dense MLA draft's text config, each checked: they are what
    its pages in the DSA row are sized by."""
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
    return layers, draft_text["kv_lora_rank"], rope
