# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Kimi K3.1 DSA weights in Kimi K3's model: how the checkpoint's indexer
tensors load, the completeness check after loading, and the post-load packing.

In a fork these are edits of ``KimiLinearModel.load_weights`` and
``KimiK3MTP.load_weights`` (the indexer names) and a
``process_weights_after_loading`` on the top-level classes; on the released
0.33.0 the ``dsa_weights`` and ``dsa_post_load`` seams of
``vllm.plugins.kimi_k3_dsa`` call into this module.

Checkpoint naming (per DSA layer, checkpoint prefix ``...self_attn.``):

==============================================  ===================================
checkpoint tensor                               parameter (shard)
==============================================  ===================================
``indexer.wq_b.{weight,weight_scale_inv,..}``   ``dsa_indexer.wq_index.*``
``indexer.wk.weight``                           ``dsa_indexer.wkv_index.weight`` (0)
``indexer.weights_proj.weight``                 ``dsa_indexer.wkv_index.weight`` (1)
``indexer.k_norm.{weight,bias}``                ``dsa_indexer.k_index_norm.*``
``q_a_proj.*``                                  ``fused_qkv_a_proj.*`` (0)
``kv_a_proj_with_mqa.*``                        ``fused_qkv_a_proj.*`` (1)
``g_proj.*``                                    ``g_proj.*`` (its own linear)
==============================================  ===================================

An fp8 ``wq_b`` or ``wk`` with its ``weight_scale_inv`` bound for a bf16
parameter is dequantized on load (``wk`` always shares a bf16 GEMM with
``weights_proj``), as DeepSeek V3.2's loader does for ``wk``.

Every tensor above is shape-checked against the parameter (or the shard of a
merged parameter) it loads into before any weight loader runs: vLLM's merged
loader narrows a too-large tensor without a word (``weights_proj`` with extra
rows would be silently truncated into ``wkv_index``) and the other loaders
assert with no tensor name.

0.33.0's loaders map ``q_a_proj``/``kv_a_proj_with_mqa``/``g_proj`` only into the
dense layer's ``fused_qkv_a_g_proj`` when the output gate is on, which a DSA
layer does not have, and know no indexer names at all.
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
    received its whole indexer (over all ``load_weights`` calls so far).

    Run after loading: vLLM's own every-parameter-initialized check is skipped
    for quantized models such as Kimi K3.1's, and names vLLM parameters rather
    than checkpoint tensors. A layer that received nothing (``--load-format
    dummy``) is not checked.
    """
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
    a :class:`DSAWeightRouter` on the way (none: ``original`` alone)."""
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
    """Checkpoint prefix -> (parameter prefix, layer) of the candidates
    ``(checkpoint prefix, parameter prefix, attention or None)`` that are
    DSA layers."""
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
    # AutoWeightsLoader strips ``model.``: checkpoint and parameter prefixes
    # are both ``layers.{i}.self_attn.``.
    return [
        (f"layers.{idx}.self_attn.",) * 2 + (getattr(layer, "self_attn", None),)
        for idx, layer in enumerate(getattr(model, "layers", []))
    ]


def load_kimi_linear_model_weights(
    model: nn.Module,
    weights: Iterable[WeightItem],
    original: Callable[[nn.Module, Iterable[WeightItem]], set[str]],
) -> set[str]:
    """``KimiLinearModel.load_weights`` with the DSA names: our tensors are
    loaded here, everything else goes through 0.33.0's loader unchanged; the
    full-attention layers' tensors are audited on the way
    (:class:`AttentionCheckpointAudit`), DSA or not."""
    layers = kimi_linear_model_dsa_layers(model)
    dsa_layer_ids = {int(p.split(".")[1]) for p in layers}
    num_layers = len(getattr(model, "layers", []))
    start = getattr(model, "start_layer", 0)
    end = getattr(model, "end_layer", num_layers)
    audit = AttentionCheckpointAudit(full_attention_layers(_layer_candidates(model)))

    def refuse_foreign_indexer(name: str) -> None:
        # An indexer tensor on a layer that exists here and is not DSA (a KDA
        # layer, or any layer of a model without dsa_config): 0.33.0 would
        # fail with a bare KeyError.
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
        # vLLM's loader looks every name up in the model's parameters.
        raise ValueError(
            f"Kimi K3: checkpoint tensor '{audit.last_name}' has no parameter in "
            f"this model (vLLM's loader found no {exc}); the model has decoder "
            f"layers 0 to {num_layers - 1} (MTP layers load into the draft): "
            "check the tensor's name and the config's num_hidden_layers"
        ) from exc


def kimi_k3_mtp_dsa_layers(mtp: nn.Module) -> dict[str, tuple[str, nn.Module]]:
    """DSA blocks of a ``KimiK3MTP`` draft: checkpoint prefix
    ``model.layers.{L}.self_attn.``, parameter prefix
    ``model.layers.{L}.mtp_block.self_attn.``."""
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
    # As KimiK3MTP.load_weights: the multimodal checkpoint prefixes text
    # weights with ``language_model.``.
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


# ---------------------------------------------------------------------------
# Post-load
# ---------------------------------------------------------------------------


def pack_dsa_projections(model: nn.Module) -> int:
    """Stands for the top-level ``process_weights_after_loading``: check that
    every full-attention layer that was loaded got each MLA tensor and every
    DSA layer its whole indexer (:func:`check_dsa_indexers_complete`), then
    let every DSA layer pack its projections for the fused forward. A layer
    may decline (it then keeps the wrapper forward); a rerun after a weight
    reload is a no-op per layer.
    Returns the number of DSA layers visited."""
    raise_missing_attention_tensors(model)
    check_dsa_indexers_complete(model)
    layers = dsa_attention_layers(model)
    for _, attn in layers:
        attn.pack_projections()
    return len(layers)
