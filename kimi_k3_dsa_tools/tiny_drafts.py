# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Tiny random dense-MLA speculative drafts for a tiny Kimi K3.1 target.

Two architectures vLLM 0.33.0 loads as drafts of a Kimi K3 target, in its own
checkpoint naming, with the target's MLA latent (512 + 64, so the draft's
page in the packed DSA row is the target's) and hidden size:

- ``dspark``: ``K3DSparkModel`` (``model_type`` ``k3_dspark``), dense MLA
  layers over the target's hidden states; no ``model.`` prefix in its names.
- ``eagle3``: ``Eagle3DeepseekV2ForCausalLM`` (``model_type`` ``deepseek_v2``:
  vLLM rewrites a ``deepseek_v3`` draft config into its MTP model), one MLA
  layer whose first projection reads the embedding and the fused hidden.

Both take the embedding and ``lm_head`` from the target, so neither writes
them. The weights are random: acceptance means nothing, but the target's
tokens must not change with them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kimi_k3_dsa_tools.tiny_checkpoint import (
    CONFIG_FILE,
    TINY_FULL_ATTN_LAYERS,
    _write_into,
    save_weights,
    tiny_text_config,
)
from kimi_k3_dsa_tools.tiny_weights import _random_tensors

DRAFT_METHODS = ("dspark", "eagle3")
# The target's layers whose hidden states the draft reads (0-indexed: the
# first KDA layer and the first attention layer of the tiny target).
TINY_DRAFT_TARGET_LAYERS = [0, TINY_FULL_ATTN_LAYERS[0] - 1]
# Tokens a DSpark draft proposes per step (its default num_speculative_tokens).
TINY_DSPARK_BLOCK = 2
# Query heads of the draft's MLA: a divisor of the tiny hidden size (the HF
# config classes check it) that TP 8 splits.
TINY_DRAFT_HEADS = 16


def _draft_base(target: dict[str, Any]) -> dict[str, Any]:
    """What both drafts take from ``target``: its MLA latent, hidden size and
    vocabulary; one layer of :data:`TINY_DRAFT_HEADS` heads."""
    keys = (
        "hidden_size",
        "q_lora_rank",
        "kv_lora_rank",
        "qk_nope_head_dim",
        "qk_rope_head_dim",
        "v_head_dim",
        "intermediate_size",
        "hidden_act",
        "rms_norm_eps",
        "max_position_embeddings",
        "vocab_size",
    )
    return {
        **{key: target[key] for key in keys},
        "num_attention_heads": TINY_DRAFT_HEADS,
        "num_key_value_heads": TINY_DRAFT_HEADS,
        "num_hidden_layers": 1,
        "target_hidden_size": target["hidden_size"],
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    }


def tiny_draft_config(method: str, target: dict[str, Any]) -> dict[str, Any]:
    """``config.json`` of a one-layer ``method`` draft for ``target`` (a
    tiny text config)."""
    base = _draft_base(target)
    layers = TINY_DRAFT_TARGET_LAYERS
    if method == "dspark":
        return {
            "model_type": "k3_dspark",
            "architectures": ["K3DSparkModel"],
            **base,
            "target_layer_ids": layers,
            "num_target_layers": len(layers),
            "draft_vocab_size": base["vocab_size"],
            "markov_rank": 32,
            "dspark_block_size": TINY_DSPARK_BLOCK,
            "dspark_noise_token_id": base["vocab_size"] - 1,
        }
    if method == "eagle3":
        return {
            "model_type": "deepseek_v2",
            "architectures": ["Eagle3DeepseekV2ForCausalLM"],
            **base,
            "eagle_aux_hidden_state_layer_ids": [i + 1 for i in layers],
            "num_aux_hidden_states": len(layers),
        }
    raise ValueError(f"draft method {method!r}: accepted values are {DRAFT_METHODS}")


def _attention_shapes(
    config: dict[str, Any], prefix: str, input_size: int
) -> dict[str, tuple[int, ...]]:
    heads = config["num_attention_heads"]
    q_lora, kv_lora = config["q_lora_rank"], config["kv_lora_rank"]
    nope, rope = config["qk_nope_head_dim"], config["qk_rope_head_dim"]
    v = config["v_head_dim"]
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    return {
        f"{prefix}self_attn.q_a_proj.weight": (q_lora, input_size),
        f"{prefix}self_attn.q_a_layernorm.weight": (q_lora,),
        f"{prefix}self_attn.q_b_proj.weight": (heads * (nope + rope), q_lora),
        f"{prefix}self_attn.kv_a_proj_with_mqa.weight": (kv_lora + rope, input_size),
        f"{prefix}self_attn.kv_a_layernorm.weight": (kv_lora,),
        f"{prefix}self_attn.kv_b_proj.weight": (heads * (nope + v), kv_lora),
        f"{prefix}self_attn.o_proj.weight": (hidden, heads * v),
        f"{prefix}mlp.gate_proj.weight": (inter, hidden),
        f"{prefix}mlp.up_proj.weight": (inter, hidden),
        f"{prefix}mlp.down_proj.weight": (hidden, inter),
        f"{prefix}input_layernorm.weight": (hidden,),
        f"{prefix}post_attention_layernorm.weight": (hidden,),
    }


def tiny_draft_shapes(
    method: str, config: dict[str, Any]
) -> dict[str, tuple[int, ...]]:
    """Checkpoint tensor names and shapes of a ``method`` draft, as vLLM
    0.33.0's draft loader reads them."""
    hidden = config["hidden_size"]
    if method == "dspark":
        shapes: dict[str, tuple[int, ...]] = {}
        for layer in range(config["num_hidden_layers"]):
            shapes.update(_attention_shapes(config, f"layers.{layer}.", hidden))
        context = config["target_hidden_size"] * config["num_target_layers"]
        rank = config["markov_rank"]
        shapes.update(
            {
                "context_proj.weight": (hidden, context),
                "context_norm.weight": (hidden,),
                "final_norm.weight": (hidden,),
                "markov_head.markov_w1.weight": (config["vocab_size"], rank),
                "markov_head.markov_w2.weight": (config["draft_vocab_size"], rank),
            }
        )
        return shapes
    if method == "eagle3":
        shapes = _attention_shapes(config, "midlayer.", 2 * hidden)
        aux = config["target_hidden_size"] * config["num_aux_hidden_states"]
        shapes.update(
            {
                "midlayer.hidden_norm.weight": (hidden,),
                "fc.weight": (hidden, aux),
                "norm.weight": (hidden,),
            }
        )
        return shapes
    raise ValueError(f"draft method {method!r}: accepted values are {DRAFT_METHODS}")


def write_draft_files(
    directory: Path, method: str, target: dict[str, Any], seed: int = 0
) -> list[str]:
    """Write the draft's weights, then its ``config.json``, into
    ``directory``; returns their names in that order."""
    config = tiny_draft_config(method, target)
    tensors = _random_tensors(tiny_draft_shapes(method, config), seed, None)
    weights = save_weights(directory, tensors)
    (directory / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    return [weights, CONFIG_FILE]


def write_tiny_draft(
    path: str | Path, method: str, *, seed: int = 0, **target_overrides: Any
) -> Path:
    """Write a tiny ``method`` draft (``config.json``, ``model.safetensors``)
    for the tiny Kimi K3.1 target with ``target_overrides`` into ``path``."""
    target = tiny_text_config(dsa=True, **target_overrides)
    return _write_into(Path(path), lambda d: write_draft_files(d, method, target, seed))
