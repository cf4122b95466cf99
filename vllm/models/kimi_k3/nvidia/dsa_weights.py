# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Kimi K3.1 DSA weights in Kimi K3's model: how the checkpoint's indexer
tensors load (``...self_attn.indexer.*`` into ``dsa_indexer``, ``q_a_proj``
and ``kv_a_proj_with_mqa`` stacked into ``fused_qkv_a_proj``), the
completeness check after loading, and the post-load packing.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

from torch import nn

from vllm.models.kimi_k3.nvidia.dsa_checkpoint_audit import (
    AttentionCheckpointAudit,
    full_attention_layers,
    raise_missing_attention_tensors,
)
from vllm.models.kimi_k3.nvidia.dsa_model import (
    CHECKPOINT_INDEXER,
    dsa_attention_layers,
    is_dsa_attention,
)
from vllm.models.kimi_k3.nvidia.dsa_weight_router import (
    LOAD_STATE_ATTR,
    DSAWeightRouter,
    WeightItem,
    raise_incomplete_indexers,
)


def check_dsa_indexers_complete(model: nn.Module) -> None:
    """Every DSA layer under ``model`` that received checkpoint tensors
    received its whole indexer. vLLM's own check is skipped for quantized
    models and names parameters, not checkpoint tensors."""
    states = [
        getattr(attn, LOAD_STATE_ATTR, None) for _, attn in dsa_attention_layers(model)
    ]
    raise_incomplete_indexers(s for s in states if s is not None)


def _weights_with_router(
    weights: Iterable[WeightItem],
    router: DSAWeightRouter,
    loaded: set[str],
    normalize: Callable[[str], str] = lambda name: name,
    refuse_foreign_indexer: Callable[[str], None] | None = None,
) -> Iterator[WeightItem]:
    for item in weights:
        name = normalize(item[0])
        target = router.load(name, item[1])
        if target is not None:
            loaded.add(target)
            continue
        if refuse_foreign_indexer is not None:
            refuse_foreign_indexer(name)
        yield item


def _checked(
    weights: Iterable[WeightItem], check: Callable[[str], None]
) -> Iterator[WeightItem]:
    for item in weights:
        check(item[0])
        yield item


def _load_with_router(
    module: nn.Module,
    weights: Iterable[WeightItem],
    original: Callable[[nn.Module, Iterable[WeightItem]], set[str]],
    layers: dict[str, tuple[str, nn.Module]],
    normalize: Callable[[str], str] = lambda name: name,
    refuse_foreign_indexer: Callable[[str], None] | None = None,
) -> set[str]:
    """``original`` over ``weights``, the DSA tensors of ``layers`` loaded by
    a :class:`DSAWeightRouter` on the way."""
    if not layers:
        if refuse_foreign_indexer is not None:
            weights = _checked(weights, refuse_foreign_indexer)
        return original(module, weights)
    router = DSAWeightRouter(dict(module.named_parameters()), layers)
    loaded: set[str] = set()
    loaded |= original(
        module,
        _weights_with_router(
            weights, router, loaded, normalize, refuse_foreign_indexer
        ),
    )
    return loaded


def _dsa_layers(
    candidates: Iterable[tuple[str, str, nn.Module | None]],
) -> dict[str, tuple[str, nn.Module]]:
    """Checkpoint prefix -> (parameter prefix, layer) of the DSA layers."""
    return {
        checkpoint: (param, attn)
        for checkpoint, param, attn in candidates
        if attn is not None and is_dsa_attention(attn)
    }


def kimi_linear_model_dsa_layers(
    model: nn.Module,
) -> dict[str, tuple[str, nn.Module]]:
    """DSA layers of a ``KimiLinearModel``."""
    return _dsa_layers(_layer_candidates(model))


def _layer_candidates(model: nn.Module) -> list[tuple[str, str, nn.Module | None]]:
    # AutoWeightsLoader strips ``model.``: both prefixes are equal.
    return [
        (f"layers.{idx}.self_attn.",) * 2 + (getattr(layer, "self_attn", None),)
        for idx, layer in enumerate(getattr(model, "layers", []))
    ]


def load_kimi_linear_model_weights(
    model: nn.Module,
    weights: Iterable[WeightItem],
    original: Callable[[nn.Module, Iterable[WeightItem]], set[str]],
) -> set[str]:
    """``KimiLinearModel.load_weights`` with the DSA names; the
    full-attention layers' tensors are audited on the way."""
    layers = kimi_linear_model_dsa_layers(model)
    dsa_layer_ids = {int(p.split(".")[1]) for p in layers}
    num_layers = len(getattr(model, "layers", []))
    start = getattr(model, "start_layer", 0)
    end = getattr(model, "end_layer", num_layers)
    audit = AttentionCheckpointAudit(full_attention_layers(_layer_candidates(model)))

    def refuse_foreign_indexer(name: str) -> None:
        # vLLM's loader would fail with a bare KeyError.
        if f".self_attn.{CHECKPOINT_INDEXER}." not in name:
            return
        parts = name.split(".")
        if len(parts) < 2 or parts[0] != "layers" or not parts[1].isdigit():
            return
        idx = int(parts[1])
        if idx in dsa_layer_ids or not start <= idx < min(end, num_layers):
            return
        if not dsa_layer_ids:
            raise ValueError(
                f"Kimi K3: checkpoint tensor '{name}' is a DSA indexer tensor "
                "(Kimi K3.1 weights), but the model config has no dsa_config: "
                "add the checkpoint's dsa_config to its (text) config.json to "
                "serve it as Kimi K3.1"
            )
        raise ValueError(
            f"Kimi K3.1: unexpected indexer tensor '{name}' in the checkpoint: "
            f"layer {idx} is not a DSA layer (DSA layers: {sorted(dsa_layer_ids)})"
        )

    try:
        return _load_with_router(
            model,
            audit.watch(weights),
            original,
            layers,
            refuse_foreign_indexer=refuse_foreign_indexer,
        )
    except KeyError as exc:
        raise ValueError(
            f"Kimi K3: checkpoint tensor '{audit.last_name}' has no parameter in "
            f"this model (vLLM's loader found no {exc}); the model has decoder "
            f"layers 0 to {num_layers - 1} (MTP layers load into the draft): "
            "check the tensor's name and the config's num_hidden_layers"
        ) from exc


def kimi_k3_mtp_dsa_layers(mtp: nn.Module) -> dict[str, tuple[str, nn.Module]]:
    """DSA blocks of a ``KimiK3MTP`` draft (parameter prefix
    ``model.layers.{L}.mtp_block.self_attn.``)."""
    predictor = getattr(mtp, "model", None)
    return _dsa_layers(
        (
            f"model.layers.{key}.self_attn.",
            f"model.layers.{key}.mtp_block.self_attn.",
            getattr(getattr(layer, "mtp_block", None), "self_attn", None),
        )
        for key, layer in getattr(predictor, "layers", {}).items()
    )


def _strip_language_model(name: str) -> str:
    # The multimodal checkpoint prefixes text weights with ``language_model.``.
    if name.startswith("language_model."):
        return name[len("language_model.") :]
    return name


def load_kimi_k3_mtp_weights(
    mtp: nn.Module,
    weights: Iterable[WeightItem],
    original: Callable[[nn.Module, Iterable[WeightItem]], set[str]],
) -> set[str]:
    """``KimiK3MTP.load_weights`` with the DSA names of the MTP block."""
    layers = kimi_k3_mtp_dsa_layers(mtp)
    return _load_with_router(
        mtp, weights, original, layers, normalize=_strip_language_model
    )


def pack_dsa_projections(model: nn.Module) -> int:
    """The top-level ``process_weights_after_loading``: check completeness,
    then let every DSA layer pack its projections; returns the number of DSA
    layers."""
    raise_missing_attention_tensors(model)
    check_dsa_indexers_complete(model)
    layers = dsa_attention_layers(model)
    for _, attn in layers:
        attn.pack_projections()
    return len(layers)
