# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Kimi K3.1's ``dsa_config``: its parsed form and the rules of the model.

Without ``dsa_config`` (plain Kimi K3, Kimi-Linear) the config classes behave
exactly as vLLM's.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from vllm.logger import init_logger
from vllm.models.kimi_k3.common.dsa_formats import (
    DEEPGEMM_INDEX_HEAD_DIMS_FP4,
    DEEPGEMM_INDEX_HEAD_DIMS_FP8,
    DEEPGEMM_INDEX_HEADS,
    DS_MLA_NOPE_DIM,
    DS_MLA_ROPE_DIM,
    INDEX_TOPK_MULTIPLE,
    k_insert_unsupported,
)
from vllm.transformers_utils.configs.kimi_k3 import KimiK3Config
from vllm.transformers_utils.configs.kimi_linear import KimiLinearConfig

logger = init_logger(__name__)

INDEX_K_NORM_TYPES = ("rmsnorm", "layernorm")
MAX_INDEX_NUM_HEADS = max(DEEPGEMM_INDEX_HEADS)
# Keys of other DSA configs' layouts; Kimi K3.1 reads only dsa_config.
DSA_KEY_PREFIXES = ("index_", "indexer_", "dsa_")
DSA_BLOCK_KEYS = ("indexer", "dsa")
MULTIMODAL_TOP_LEVEL = "the KimiK3ForConditionalGeneration config (outside text_config)"


@dataclass(frozen=True)
class DSAConfig:
    """The ``dsa_config`` block of a Kimi K3.1 text config; ``index_layers``
    (1-indexed) must name exactly the full-attention layers."""

    index_topk: int
    index_head_dim: int
    index_num_heads: int
    index_rope_dim: int = 0
    index_k_norm_type: str = "rmsnorm"
    index_topk_freq: int | None = 1
    index_layers: tuple[int, ...] | None = None

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> DSAConfig:
        """Parse and check each field on its own."""
        if not isinstance(raw, Mapping):
            raise ValueError(
                f"dsa_config must be a JSON object, got {type(raw).__name__}"
            )
        known = {field.name for field in dataclasses.fields(cls)}
        unknown = sorted(str(key) for key in raw if key not in known)
        if unknown:
            # Extra keys are ignored, so a newer checkpoint still serves.
            logger.warning_once(
                "Kimi K3.1: dsa_config has unknown field(s) %s, which are "
                "ignored; the fields read are %s",
                ", ".join(unknown),
                ", ".join(sorted(known)),
            )
        for name in ("index_topk", "index_head_dim", "index_num_heads"):
            if raw.get(name) is None:
                raise ValueError(f"dsa_config.{name} is required and missing")
        values = {key: value for key, value in raw.items() if key in known}
        layers = values.get("index_layers")
        if layers is not None:
            values["index_layers"] = _parse_layer_list(layers)
        config = cls(**values)
        config._check_fields()
        return config

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        if self.index_layers is None:
            del out["index_layers"]
        else:
            out["index_layers"] = list(self.index_layers)
        return out

    def _check_fields(self) -> None:
        for name in ("index_topk", "index_head_dim", "index_num_heads"):
            _require_int(name, getattr(self, name))
        _require_int("index_rope_dim", self.index_rope_dim)
        if self.index_topk <= 0 or self.index_topk % INDEX_TOPK_MULTIPLE:
            raise ValueError(
                "dsa_config.index_topk must be a positive multiple of "
                f"{INDEX_TOPK_MULTIPLE} (vLLM's FlashMLA sparse backend converts "
                f"top-k rows to cache slots {INDEX_TOPK_MULTIPLE} columns at a "
                f"time), got {self.index_topk}"
            )
        if self.index_head_dim not in DEEPGEMM_INDEX_HEAD_DIMS_FP8:
            raise ValueError(
                "dsa_config.index_head_dim must be one of "
                f"{list(DEEPGEMM_INDEX_HEAD_DIMS_FP8)} (the head dims DeepGEMM's "
                f"fp8 MQA-logits kernels take), got {self.index_head_dim}"
            )
        if not 1 <= self.index_num_heads <= MAX_INDEX_NUM_HEADS:
            raise ValueError(
                f"dsa_config.index_num_heads must be in 1..{MAX_INDEX_NUM_HEADS} "
                "(DeepGEMM's indexer kernels pad to 32 or 64 heads and support no "
                f"more), got {self.index_num_heads}"
            )
        if self.index_rope_dim < 0 or self.index_rope_dim % 2 != 0:
            raise ValueError(
                "dsa_config.index_rope_dim must be even and >= 0, got "
                f"{self.index_rope_dim}"
            )
        if self.index_rope_dim > self.index_head_dim:
            raise ValueError(
                f"dsa_config.index_rope_dim ({self.index_rope_dim}) must not "
                f"exceed index_head_dim ({self.index_head_dim})"
            )
        if self.index_k_norm_type not in INDEX_K_NORM_TYPES:
            raise ValueError(
                "dsa_config.index_k_norm_type must be 'rmsnorm' or 'layernorm', "
                f"got {self.index_k_norm_type!r}"
            )
        check_index_topk_freq(self.index_topk_freq)


def check_index_topk_freq(index_topk_freq: Any) -> None:
    """Kimi K3.1 has no index share: every DSA layer selects its own top-k."""
    if index_topk_freq not in (None, 1) or isinstance(index_topk_freq, bool):
        raise NotImplementedError(
            "Kimi-K3.1 DSA does not support index_topk_freq != 1 (index "
            f"share); dsa_config.index_topk_freq accepts 1 or null, got "
            f"{index_topk_freq!r}"
        )


def _require_int(name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(
            f"dsa_config.{name} must be an integer, got {value!r} "
            f"({type(value).__name__})"
        )


def _parse_layer_list(layers: Any) -> tuple[int, ...]:
    if isinstance(layers, (str, bytes)) or not isinstance(layers, Sequence):
        raise ValueError(
            "dsa_config.index_layers must be a list of 1-indexed layer numbers, "
            f"got {layers!r}"
        )
    for layer in layers:
        if not isinstance(layer, int) or isinstance(layer, bool) or layer < 1:
            raise ValueError(
                "dsa_config.index_layers must hold 1-indexed layer numbers (>= 1), "
                f"got {layer!r} in {list(layers)}"
            )
    if len(set(layers)) != len(layers):
        raise ValueError(f"dsa_config.index_layers lists a layer twice: {list(layers)}")
    return tuple(layers)


def _is_dsa_key(key: Any) -> bool:
    return isinstance(key, str) and (
        key in DSA_BLOCK_KEYS or key.startswith(DSA_KEY_PREFIXES)
    )


def find_dsa_keys(values: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """The DSA-shaped keys in a raw config, nested ones included, by dotted
    path; null values set nothing and are skipped."""
    found: dict[str, Any] = {}
    pending: list[tuple[str, Mapping[str, Any]]] = [(prefix, values)]
    while pending:
        path, mapping = pending.pop()
        for key, value in mapping.items():
            name = f"{path}{key}"
            if _is_dsa_key(key):
                if value is not None:
                    found[name] = value
            elif isinstance(value, Mapping):
                pending.append((f"{name}.", value))
    return dict(sorted(found.items()))


def _shown(value: Any) -> str:
    try:
        text = json.dumps(value, sort_keys=True)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def check_dsa_key_placement(
    found: Mapping[str, Any], where: str, dsa: DSAConfig | None
) -> None:
    """Refuse stray DSA keys without ``dsa_config`` (they would silently
    serve dense Kimi K3); beside one, warn that they are ignored."""
    keys = dict(found)
    if dsa is not None and keys.get("index_topk") == dsa.index_topk:
        del keys["index_topk"]
    if not keys:
        return
    listed = ", ".join(f"{name}={_shown(value)}" for name, value in keys.items())
    if dsa is None:
        raise ValueError(
            f"{where} carries DSA keys outside dsa_config: {listed}. Kimi K3.1 "
            "reads its DSA settings only from text_config.dsa_config (fields "
            f"{', '.join(f.name for f in dataclasses.fields(DSAConfig))}), so "
            "this checkpoint would be served as dense Kimi K3. Move them into "
            "text_config.dsa_config, or remove them to serve plain Kimi K3"
        )
    logger.warning_once(
        "Kimi K3.1: %s carries DSA keys outside dsa_config, which are ignored "
        "(the model is served from dsa_config): %s",
        where,
        listed,
    )


def full_attention_layers(text_config: KimiLinearConfig) -> tuple[int, ...]:
    """1-indexed layers that Kimi K3's decoder builds as full attention (every
    layer that is not a KDA layer)."""
    return tuple(
        layer_idx + 1
        for layer_idx in range(text_config.num_hidden_layers)
        if not text_config.is_kda_layer(layer_idx)
    )


def check_layer_lists(linear_attn_config: Mapping[str, Any], num_layers: int) -> None:
    """Each layer list names real layers once: the packed cache counts KDA
    states by ``len(kda_layers)``."""
    for field in ("kda_layers", "full_attn_layers"):
        layers = list(linear_attn_config.get(field) or ())
        outside = [layer for layer in layers if not 1 <= layer <= num_layers]
        if outside:
            raise ValueError(
                f"linear_attn_config.{field} holds {outside}, which are not layers "
                f"of this model: layers are numbered 1..{num_layers} (1-indexed)"
            )
        twice = sorted({layer for layer in layers if layers.count(layer) > 1})
        if twice:
            raise ValueError(f"linear_attn_config.{field} lists layer(s) {twice} twice")


def check_dsa_model(dsa: DSAConfig, text_config: KimiLinearConfig) -> None:
    """The rules that tie ``dsa_config`` to the rest of the text config."""
    qk_rope_head_dim = text_config.qk_rope_head_dim or 0
    if dsa.index_rope_dim > qk_rope_head_dim:
        raise ValueError(
            f"dsa_config.index_rope_dim ({dsa.index_rope_dim}) must not exceed "
            f"qk_rope_head_dim ({qk_rope_head_dim}): the indexer reuses the "
            "leading frequencies of the main attention's rotary cache"
        )
    if dsa.index_rope_dim > 0 and text_config.mla_use_nope:
        raise ValueError(
            f"dsa_config.index_rope_dim ({dsa.index_rope_dim}) must be 0 when "
            "mla_use_nope is true (there is no rotary cache to share)"
        )
    max_positions = getattr(text_config, "max_position_embeddings", None)
    if isinstance(max_positions, int) and dsa.index_topk > max_positions:
        raise ValueError(
            f"dsa_config.index_topk ({dsa.index_topk}) must not exceed "
            f"max_position_embeddings ({max_positions}): no context holds more "
            "tokens to select, and the top-k buffer grows with index_topk"
        )
    linear_attn_config = text_config.linear_attn_config
    if linear_attn_config is not None:
        check_layer_lists(linear_attn_config, text_config.num_hidden_layers)
    full_attn = full_attention_layers(text_config)
    declared = (
        None
        if linear_attn_config is None
        else tuple(linear_attn_config["full_attn_layers"])
    )
    if declared is not None and sorted(declared) != list(full_attn):
        raise ValueError(
            "every full-attention layer must be a DSA layer: "
            f"linear_attn_config['full_attn_layers'] is {list(declared)}, but the "
            f"layers that are not KDA layers are {list(full_attn)} (1-indexed)"
        )
    if dsa.index_layers is not None and sorted(dsa.index_layers) != list(full_attn):
        raise ValueError(
            f"dsa_config.index_layers ({list(dsa.index_layers)}) must equal the "
            f"full-attention layers {list(full_attn)} "
            "(linear_attn_config['full_attn_layers'], 1-indexed)"
        )


def check_dsa_serving(text_config: KimiLinearConfig) -> None:
    """The rules vLLM's kernels and Kimi K3 decoder impose on a DSA
    model's attention, checked when serving and planning."""
    for name in ("qk_nope_head_dim", "v_head_dim"):
        value = getattr(text_config, name, None)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(
                f"{name} must be a positive integer for Kimi-K3.1 DSA (MLA), got "
                f"{value!r}"
            )
    for name, needed in (
        ("kv_lora_rank", DS_MLA_NOPE_DIM),
        ("qk_rope_head_dim", DS_MLA_ROPE_DIM),
    ):
        value = getattr(text_config, name, None)
        if type(value) is not int or value != needed:
            raise ValueError(
                f"{name} must be {needed} for Kimi-K3.1 DSA, got {value!r}: "
                "FlashMLA sparse reads the fp8_ds_mla cache as "
                f"{DS_MLA_NOPE_DIM} latent + {DS_MLA_ROPE_DIM} rope "
                "values per token"
            )
    if getattr(text_config, "mla_use_nope", None) is not True:
        raise ValueError(
            "mla_use_nope must be true for Kimi-K3.1 DSA: vLLM's Kimi K3 "
            "decoder layer builds NoPE MLA layers only (it asserts this before "
            f"any DSA layer exists), got {text_config.mla_use_nope!r}"
        )


class KimiLinearDSAConfig(KimiLinearConfig):
    """``KimiLinearConfig`` that parses ``dsa_config``. ``index_topk`` lives in
    ``dsa_config``; the top-level attribute is a mirror that vLLM's sparse
    MLA code reads (``hf_text_config.index_topk``), never set otherwise."""

    def __init__(self, dsa_config: Mapping[str, Any] | DSAConfig | None = None, **kw):
        misplaced = find_dsa_keys(kw)
        super().__init__(**kw)
        if isinstance(dsa_config, Mapping):
            dsa_config = DSAConfig.from_dict(dsa_config)
        elif dsa_config is not None and not isinstance(dsa_config, DSAConfig):
            raise ValueError(
                "dsa_config must be a JSON object or null, got "
                f"{type(dsa_config).__name__}"
            )
        self.dsa_config: DSAConfig | None = dsa_config
        check_dsa_key_placement(misplaced, "the text config", dsa_config)
        if dsa_config is not None:
            check_dsa_model(dsa_config, self)
            self.index_topk = dsa_config.index_topk

    def to_dict(self) -> dict[str, Any]:
        out = super().to_dict()
        if self.dsa_config is None:
            out.pop("dsa_config", None)
        else:
            out["dsa_config"] = self.dsa_config.to_dict()
            out.pop("index_topk", None)
        return out


class KimiK3DSAConfig(KimiK3Config):
    """``KimiK3Config`` whose text config is a :class:`KimiLinearDSAConfig`."""

    def __init__(
        self, text_config: Mapping[str, Any] | KimiLinearConfig | None = None, **kw
    ):
        if kw.pop("dsa_config", None) is not None:
            raise ValueError(
                "dsa_config is at the top level of a KimiK3ForConditionalGeneration "
                "config.json; it belongs in text_config (text_config.dsa_config), "
                "where the language model reads it"
            )
        if isinstance(text_config, Mapping):
            text_config = KimiLinearDSAConfig(**text_config)
        check_dsa_key_placement(
            find_dsa_keys(kw),
            MULTIMODAL_TOP_LEVEL,
            getattr(text_config, "dsa_config", None),
        )
        super().__init__(text_config=text_config, **kw)


def is_dsa_model(text_config: Any) -> bool:
    """Whether a (text) config is a Kimi K3.1 DSA model."""
    return getattr(text_config, "dsa_config", None) is not None


def check_mxfp4_indexer(dsa: DSAConfig) -> None:
    """The model-side rules of MXFP4 indexer keys: DeepGEMM's FP4 MQA logits
    and the fused key insert, their only reader and writer."""
    if not (dsa.index_k_norm_type == "layernorm" and dsa.index_rope_dim == 0):
        raise ValueError(
            "indexer_kv_dtype='mxfp4' needs the fused Kimi K3 DSA key insert "
            "(index_k_norm_type='layernorm', index_rope_dim=0), got "
            f"index_k_norm_type={dsa.index_k_norm_type!r}, "
            f"index_rope_dim={dsa.index_rope_dim}"
        )
    if dsa.index_head_dim not in DEEPGEMM_INDEX_HEAD_DIMS_FP4:
        raise ValueError(
            "indexer_kv_dtype='mxfp4' needs dsa_config.index_head_dim in "
            f"{list(DEEPGEMM_INDEX_HEAD_DIMS_FP4)} (the head dims DeepGEMM's FP4 "
            f"MQA-logits kernels take), got index_head_dim {dsa.index_head_dim}"
        )
    unsupported = k_insert_unsupported(dsa.index_head_dim, dsa.index_num_heads)
    if unsupported:
        raise ValueError(
            "indexer_kv_dtype='mxfp4' needs the fused Kimi K3 DSA key insert, "
            "the only writer of MXFP4 keys, which cannot take "
            f"{'; '.join(unsupported)}. Use indexer_kv_dtype='fp8'"
        )
