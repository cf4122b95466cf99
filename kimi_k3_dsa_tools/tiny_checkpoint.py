# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A tiny random Kimi K3.1 checkpoint, for tests and for smoke-testing
``vllm serve`` on one GPU.

The config keeps every dimension that a kernel or cache format fixes, so that
a smoke test on one GPU drives the fused forward and our kernels: the MLA
latent of 512 + 64 for ``fp8_ds_mla``, q-LoRA rank 1536 (the fused prologue),
32 indexer heads of dim 128 (DeepGEMM's width; 16-byte GEMM rows) and a top-k
that vLLM's FlashMLA sparse index conversion takes (a multiple of 128). It
shrinks the rest: a few layers with both KDA and DSA layers and one MTP
layer.
:func:`write_tiny_checkpoint` writes ``config.json`` plus random weights in the
real checkpoint naming (``model.safetensors``, from
:mod:`~kimi_k3_dsa_tools.tiny_weights`): the text-only
``KimiLinearForCausalLM`` layout (``model.layers.N.*``, ``lm_head``), or with
``prefix="language_model."`` the text part of the multimodal
``KimiK3ForConditionalGeneration`` naming; ``multimodal=True`` writes the
whole multimodal checkpoint (its config, the text weights under
``language_model.``, a one-block vision tower and the projector).

:func:`real_attention_overrides` gives Kimi K3.1's attention at its real size
(96 heads, 12 per rank at TP 8; the indexer's 32 heads of 128, top-k 2048)
with the rest still small, for tensor-parallel tests; see
:data:`TINY_REAL_ATTENTION`. Its ``one_rank_of_tp=N`` gives instead what one
rank of TP N holds (``96 / N`` MLA and KDA heads, the indexer whole), a model
that one GPU serves at TP 1 with a TP N deployment's per-rank shapes.

The writers here update a directory in place (tests rewrite a config beside
their own files); ``kimi-k3-dsa-tiny-checkpoint`` (:mod:`.tiny_checkpoint_cli`)
writes whole new directories with the same files.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import stat
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kimi_k3_dsa_tools.tiny_weights import (
    tiny_checkpoint_tensors,
    tiny_vision_tensors,
)

# 1-indexed, like Kimi K3's lists (the real model: full attention at 4, 8, ...,
# 92, 93).
TINY_KDA_LAYERS = [1, 2, 3]
TINY_FULL_ATTN_LAYERS = [4, 5]

TINY_DSA_CONFIG: dict[str, Any] = {
    "index_topk": 128,
    "index_head_dim": 128,
    "index_num_heads": 32,
    "index_rope_dim": 0,
    "index_k_norm_type": "layernorm",
    "index_topk_freq": 1,
}

# Kimi K3.1's MLA dimensions, which every tiny checkpoint keeps.
KIMI_K31_MLA_DIMS: dict[str, Any] = {
    "q_lora_rank": 1536,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "mla_use_nope": True,
    "mla_use_output_gate": True,
}

TINY_TEXT_CONFIG: dict[str, Any] = {
    "model_type": "kimi_linear",
    "architectures": ["KimiLinearForCausalLM"],
    "vocab_size": 1024,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": len(TINY_KDA_LAYERS) + len(TINY_FULL_ATTN_LAYERS),
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
    "dtype": "bfloat16",
    **KIMI_K31_MLA_DIMS,
    "num_experts": 8,
    "num_experts_per_token": 2,
    "num_shared_experts": 1,
    "moe_intermediate_size": 128,
    "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
    "moe_renormalize": True,
    "moe_router_activation_func": "sigmoid",
    "routed_scaling_factor": 1.0,
    "use_grouped_topk": True,
    "num_expert_group": 1,
    "topk_group": 1,
    "num_nextn_predict_layers": 1,
    "linear_attn_config": {
        "kda_layers": TINY_KDA_LAYERS,
        "full_attn_layers": TINY_FULL_ATTN_LAYERS,
        "num_heads": 4,
        "head_dim": 64,
        "short_conv_kernel_size": 4,
        "use_full_rank_gate": True,
        "gate_lower_bound": -5.0,
    },
    "dsa_config": TINY_DSA_CONFIG,
}


# Kimi K3.1's attention at its real size, everything else small: the shape of
# the TP 8 deployment on each rank (12 of the 96 MLA heads, the indexer's 32
# heads of 128 replicated, top-k 2048). Every head count divides by 8 (and by
# 16, the packed block's reference TP). The layers are the real model's first
# four (three KDA, one DSA) and there is no MTP layer: each DSA layer costs
# ~110 MB whatever the hidden size (q_b_proj alone is 18432 x 1536). The KDA
# layers keep the real head dim (128) with 80 heads, not 96: one state is then
# large enough against the one-DSA-layer row that the packed block is the real
# model's at every TP (8192, 4096 and 1024 tokens at TP 1, 2 and 8). The MoE
# and MLP widths give 64 columns per rank at TP 8.
TINY_REAL_ATTENTION_KDA_LAYERS = [1, 2, 3]
TINY_REAL_ATTENTION_FULL_ATTN_LAYERS = [4]

TINY_REAL_ATTENTION: dict[str, Any] = {
    "num_hidden_layers": 4,
    "num_attention_heads": 96,
    "num_key_value_heads": 96,
    **KIMI_K31_MLA_DIMS,
    "max_position_embeddings": 4096,
    "intermediate_size": 512,
    "moe_intermediate_size": 512,
    "num_nextn_predict_layers": 0,
    "linear_attn_config": {
        "kda_layers": TINY_REAL_ATTENTION_KDA_LAYERS,
        "full_attn_layers": TINY_REAL_ATTENTION_FULL_ATTN_LAYERS,
        "num_heads": 80,
        "head_dim": 128,
        "short_conv_kernel_size": 4,
        "use_full_rank_gate": True,
        "gate_lower_bound": -5.0,
    },
    "dsa_config": {
        "index_topk": 2048,
        "index_head_dim": 128,
        "index_num_heads": 32,
        "index_rope_dim": 0,
        "index_k_norm_type": "layernorm",
        "index_topk_freq": 1,
    },
}


# At most this many repeats of the four-layer block (each DSA layer weighs
# ~110 MB; 24 blocks are the real model's 24 DSA layers).
MAX_ATTENTION_BLOCKS = 24

# Kimi K3.1's MLA heads (num_attention_heads) and KDA heads
# (linear_attn_config.num_heads) in kimi_k3_1_config.json. One rank of TP N
# holds 1/N of each; the indexer is replicated, whole on every rank.
REAL_NUM_HEADS = 96
REAL_KDA_HEADS = 96
# The TP sizes whose one rank the real-attention variant can stand for: those
# that split both head counts evenly (vLLM refuses any other).
ONE_RANK_TP_SIZES = tuple(
    n
    for n in range(1, REAL_NUM_HEADS + 1)
    if REAL_NUM_HEADS % n == 0 and REAL_KDA_HEADS % n == 0
)


def real_attention_overrides(
    dsa: bool = True, blocks: int = 1, one_rank_of_tp: int | None = None
) -> dict[str, Any]:
    """Text-config overrides (a fresh copy of :data:`TINY_REAL_ATTENTION`) for
    :func:`write_tiny_checkpoint` and friends: Kimi K3.1's real attention
    dimensions on a small model. ``dsa=False`` leaves out ``dsa_config``, as
    the plain Kimi K3 config has none.

    ``blocks`` repeats the real model's layer pattern (three KDA layers, then
    one attention layer) that many times: with one attention layer of four, a
    decode step is the engine's fixed host cost, whatever its attention
    does; more blocks give the attention the share of the step it has in the
    real model (24 of 93 layers).

    ``one_rank_of_tp=N`` gives one rank of a TP N deployment, to serve at
    TP 1: ``96 / N`` MLA heads and ``96 / N`` KDA heads (the real model's, not
    the 80 the TP-sharded variant keeps), the indexer's 32 heads of 128 whole
    (replicated on every rank), the rest unchanged. With ``blocks=24`` it is
    one rank's attention at the real depth; ``None`` keeps the whole-model
    variant."""
    if not 1 <= blocks <= MAX_ATTENTION_BLOCKS:
        raise ValueError(
            f"blocks={blocks}: give 1 to {MAX_ATTENTION_BLOCKS} repeats of the "
            "three-KDA, one-attention layer block"
        )
    if one_rank_of_tp is not None and one_rank_of_tp not in ONE_RANK_TP_SIZES:
        raise ValueError(
            f"one_rank_of_tp={one_rank_of_tp}: give a TP size that divides Kimi "
            f"K3.1's {REAL_NUM_HEADS} MLA and {REAL_KDA_HEADS} KDA heads: "
            + ", ".join(map(str, ONE_RANK_TP_SIZES))
        )
    overrides = copy.deepcopy(TINY_REAL_ATTENTION)
    if one_rank_of_tp is not None:
        heads = REAL_NUM_HEADS // one_rank_of_tp
        overrides["num_attention_heads"] = overrides["num_key_value_heads"] = heads
        overrides["linear_attn_config"]["num_heads"] = REAL_KDA_HEADS // one_rank_of_tp
        # Without head_dim, transformers takes hidden_size // heads as the
        # RoPE dimension and refuses an odd one (256 // 12 = 21); MLA rotates
        # qk_rope_head_dim dimensions, and nothing else reads it.
        overrides["head_dim"] = overrides["qk_rope_head_dim"]
    if not dsa:
        del overrides["dsa_config"]
    if blocks > 1:
        period = len(TINY_REAL_ATTENTION_KDA_LAYERS) + len(
            TINY_REAL_ATTENTION_FULL_ATTN_LAYERS
        )
        linear = overrides["linear_attn_config"]
        linear["kda_layers"] = [
            block * period + layer
            for block in range(blocks)
            for layer in TINY_REAL_ATTENTION_KDA_LAYERS
        ]
        linear["full_attn_layers"] = [
            block * period + layer
            for block in range(blocks)
            for layer in TINY_REAL_ATTENTION_FULL_ATTN_LAYERS
        ]
        overrides["num_hidden_layers"] = blocks * period
    return overrides


# The multimodal checkpoint (KimiK3ForConditionalGeneration): a one-block
# MoonViT vision tower and the patch-merger projector, shrunk likewise.
TINY_VISION_CONFIG: dict[str, Any] = {
    "patch_size": 14,
    "init_pos_emb_height": 8,
    "init_pos_emb_width": 8,
    "init_pos_emb_time": 2,
    "vt_num_attention_heads": 2,
    "vt_num_hidden_layers": 1,
    "vt_hidden_size": 64,
    "vt_intermediate_size": 128,
    "qkv_hidden_size": 64,
    "merge_kernel_size": [2, 2],
    "mm_projector_type": "patchmergerv2",
}
TINY_MEDIA_PLACEHOLDER_TOKEN_ID = 1023


def tiny_multimodal_config(dsa: bool = True, **overrides: Any) -> dict[str, Any]:
    """The tiny ``KimiK3ForConditionalGeneration`` config as a dict (the text
    config nested as ``text_config``)."""
    return {
        "model_type": "kimi_k3",
        "architectures": ["KimiK3ForConditionalGeneration"],
        "text_config": tiny_text_config(dsa=dsa, **overrides),
        "vision_config": copy.deepcopy(TINY_VISION_CONFIG),
        "media_placeholder_token_id": TINY_MEDIA_PLACEHOLDER_TOKEN_ID,
        "dtype": "bfloat16",
    }


def tiny_text_config(dsa: bool = True, **overrides: Any) -> dict[str, Any]:
    """The tiny text config as a dict; ``dsa=False`` gives plain Kimi K3."""
    config = copy.deepcopy(TINY_TEXT_CONFIG)
    if not dsa:
        del config["dsa_config"]
    config.update(copy.deepcopy(overrides))
    return config


CONFIG_FILE = "config.json"
CHECKPOINT_FILE = "model.safetensors"


def mla_dims(text_config: Any) -> dict[str, Any]:
    """The MLA arguments Kimi K3's decoder layer passes its attention, from a
    text config (``config`` included): what the layer tests and the layer
    benchmark build it with."""
    same_names = (
        "hidden_size",
        "qk_nope_head_dim",
        "qk_rope_head_dim",
        "v_head_dim",
        "q_lora_rank",
        "kv_lora_rank",
    )
    dims = {name: getattr(text_config, name) for name in same_names}
    return dict(config=text_config, num_heads=text_config.num_attention_heads, **dims)


def checkpoint_dir_mode(existing: Path | None) -> int:
    """The mode the new directory gets: the old one's, else the default that
    ``mkdir`` gives (mkdtemp makes its directories private)."""
    if existing is not None:
        return stat.S_IMODE(existing.stat().st_mode)
    umask = os.umask(0)
    os.umask(umask)
    return 0o777 & ~umask


def save_weights(directory: Path, tensors: dict[str, Any]) -> str:
    """Write ``tensors`` as the checkpoint's safetensors file; returns its
    name."""
    from safetensors.torch import save_file

    path = directory / CHECKPOINT_FILE
    save_file(
        {name: t.contiguous() for name, t in tensors.items()},
        str(path),
        metadata={"format": "pt"},
    )
    # safetensors writes through a private temporary file: give the weights
    # the mode config.json gets, so whoever serves can read them.
    path.chmod(checkpoint_dir_mode(None) & 0o666)
    return CHECKPOINT_FILE


def write_checkpoint_files(
    directory: Path,
    *,
    dsa: bool,
    weights: bool,
    seed: int = 0,
    prefix: str = "",
    multimodal: bool = False,
    overrides: dict[str, Any] | None = None,
) -> list[str]:
    """Write the checkpoint's files into ``directory`` (a fresh staging
    directory) and return their names in the order to install them: the
    weights before ``config.json``, so that no step leaves a new config over
    old weights."""
    overrides = overrides or {}
    config = tiny_text_config(dsa=dsa, **overrides)
    if multimodal:
        config_dict = tiny_multimodal_config(dsa=dsa, **overrides)
    else:
        config_dict = config
    names = []
    if weights:
        if multimodal:
            tensors = tiny_checkpoint_tensors(
                config, seed=seed, prefix="language_model."
            )
            tensors.update(
                tiny_vision_tensors(
                    config_dict["vision_config"], config["hidden_size"], seed=seed + 1
                )
            )
        else:
            tensors = tiny_checkpoint_tensors(config, seed=seed, prefix=prefix)
        names.append(save_weights(directory, tensors))
    (directory / CONFIG_FILE).write_text(json.dumps(config_dict, indent=2) + "\n")
    names.append(CONFIG_FILE)
    return names


def _write_into(out: Path, write: Callable[[Path], list[str]]) -> Path:
    """The library writers' install step: stage the files in a hidden
    directory inside ``out`` (created with its parents if missing; same
    filesystem) and move each over its old copy, so a failed write leaves the
    old files as they were. Other files in ``out`` are kept, as tests that
    rewrite a config in place rely on; the CLI replaces whole directories."""
    out.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".tiny-checkpoint-", dir=out))
    try:
        for name in write(staging):
            os.replace(staging / name, out / name)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out


def write_tiny_config(path: str | Path, dsa: bool = True, **overrides: Any) -> Path:
    """Write ``config.json`` of a tiny text-only (``KimiLinearForCausalLM``)
    Kimi K3.1 checkpoint into ``path`` (created if missing; an old
    ``config.json`` there is replaced atomically) and return the directory."""
    return _write_into(
        Path(path),
        lambda d: write_checkpoint_files(
            d, dsa=dsa, weights=False, overrides=overrides
        ),
    )


def write_tiny_checkpoint(
    path: str | Path,
    dsa: bool = True,
    *,
    seed: int = 0,
    prefix: str = "",
    multimodal: bool = False,
    **overrides: Any,
) -> Path:
    """Write a tiny Kimi K3.1 checkpoint (``config.json`` and
    ``model.safetensors``) into ``path``; ``dsa=False`` writes plain Kimi K3.
    Keyword overrides replace top-level text-config keys. ``multimodal=True``
    writes the ``KimiK3ForConditionalGeneration`` checkpoint: the text
    weights under ``language_model.``, plus a tiny vision tower and projector
    (``prefix`` is then ignored). ``path`` is created if missing; old copies
    of the two files are replaced atomically, weights first. Returns the
    directory."""
    return _write_into(
        Path(path),
        lambda d: write_checkpoint_files(
            d,
            dsa=dsa,
            weights=True,
            seed=seed,
            prefix=prefix,
            multimodal=multimodal,
            overrides=overrides,
        ),
    )
