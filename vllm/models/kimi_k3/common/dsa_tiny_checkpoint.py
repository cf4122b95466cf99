# SPDX-License-Identifier: Apache-2.0
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
real checkpoint naming (``model.safetensors``): the text-only
``KimiLinearForCausalLM`` layout (``model.layers.N.*``, ``lm_head``), or with
``prefix="language_model."`` the text part of the multimodal
``KimiK3ForConditionalGeneration`` naming; ``multimodal=True`` (``--multimodal``)
writes the whole multimodal checkpoint (its config, the text weights under
``language_model.``, a one-block vision tower and the projector). DSA layers
carry the indexer as the
checkpoint names it, ``self_attn.indexer.{wq_b, wk, weights_proj, k_norm}``,
and the MLA projections unfused (``q_a_proj``, ``kv_a_proj_with_mqa``,
``g_proj``).

``--real-attention`` (:func:`real_attention_overrides`) gives Kimi K3.1's
attention at its real size (96 heads, 12 per rank at TP 8; the indexer's 32
heads of 128, top-k 2048) with the rest still small, for tensor-parallel
tests; see :data:`TINY_REAL_ATTENTION`.

    python -m vllm.models.kimi_k3.common.dsa_tiny_checkpoint OUT_DIR
    vllm serve OUT_DIR --skip-tokenizer-init --max-model-len 1024

    # multimodal (KimiK3ForConditionalGeneration): the MTP draft needs it
    python -m vllm.models.kimi_k3.common.dsa_tiny_checkpoint OUT_DIR --multimodal
    vllm serve OUT_DIR --skip-tokenizer-init --max-model-len 1024 \
        --speculative-config '{"method": "kimi_k3_mtp", "num_speculative_tokens": 1}'

(no tokenizer is written: send token ids, e.g. ``"prompt": [1, 2, 3]`` to
``/v1/completions``).

The command line never merges into, or follows, anything: ``OUT_DIR`` must be
new (its missing parents are created) or an empty directory; ``--force``
replaces a non-empty one's whole contents, so that no old index, tokenizer or
weights of another kind are left beside the new files. The checkpoint is
staged in a hidden directory beside ``OUT_DIR`` and moved into place (the old
directory moved aside first, deleted only once the new one is in), so a
failure leaves the disk as it was. A bad argument exits 2, a failed write 1,
each with one line on stderr.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import shutil
import stat
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

if TYPE_CHECKING:
    import torch

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
    "q_lora_rank": 1536,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "mla_use_nope": True,
    "mla_use_output_gate": True,
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
    "q_lora_rank": 1536,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "mla_use_nope": True,
    "mla_use_output_gate": True,
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


def real_attention_overrides(dsa: bool = True) -> dict[str, Any]:
    """Text-config overrides (a fresh copy of :data:`TINY_REAL_ATTENTION`) for
    :func:`write_tiny_checkpoint` and friends: Kimi K3.1's real attention
    dimensions on a small model. ``dsa=False`` leaves out ``dsa_config``, as
    the plain Kimi K3 config has none."""
    overrides = copy.deepcopy(TINY_REAL_ATTENTION)
    if not dsa:
        del overrides["dsa_config"]
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


def _write_files(
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
        from safetensors.torch import save_file

        if multimodal:
            tensors = tiny_checkpoint_tensors(
                config, seed=seed, prefix="language_model."
            )
            vision = tiny_vision_shapes(
                config_dict["vision_config"], config["hidden_size"]
            )
            tensors.update(_random_tensors(vision, seed + 1, None))
        else:
            tensors = tiny_checkpoint_tensors(config, seed=seed, prefix=prefix)
        weights_path = directory / CHECKPOINT_FILE
        save_file(
            {name: t.contiguous() for name, t in tensors.items()},
            str(weights_path),
            metadata={"format": "pt"},
        )
        # safetensors writes through a private temporary file: give the
        # weights the mode config.json gets, so whoever serves can read them.
        weights_path.chmod(_dir_mode(None) & 0o666)
        names.append(CHECKPOINT_FILE)
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
        lambda d: _write_files(d, dsa=dsa, weights=False, overrides=overrides),
    )


def _is_kda_layer(config: dict[str, Any], layer_idx: int) -> bool:
    return (layer_idx + 1) in config["linear_attn_config"]["kda_layers"]


def _is_moe_layer(config: dict[str, Any], layer_idx: int) -> bool:
    return (
        config.get("num_experts") is not None
        and layer_idx >= config.get("first_k_dense_replace", 0)
        and layer_idx % config.get("moe_layer_freq", 1) == 0
    )


def tiny_checkpoint_shapes(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Every tensor of a Kimi K3(.1) text checkpoint for ``config`` (a text
    config dict), in the real naming, with its shape.

    Layers ``num_hidden_layers .. + num_nextn_predict_layers - 1`` are the MTP
    layers (``enorm``, ``hnorm``, ``eh_proj``, ``shared_head``, the embedding
    copy, and a full-attention decoder block).
    """
    h = config["hidden_size"]
    vocab = config["vocab_size"]
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (vocab, h),
        "model.norm.weight": (h,),
        "lm_head.weight": (vocab, h),
    }
    num_layers = config["num_hidden_layers"]
    num_mtp = config.get("num_nextn_predict_layers", 0) or 0
    for idx in range(num_layers + num_mtp):
        p = f"model.layers.{idx}."
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        if idx < num_layers and _is_kda_layer(config, idx):
            shapes.update(_kda_shapes(config, p + "self_attn."))
        else:
            shapes.update(_mla_shapes(config, p + "self_attn."))
        shapes.update(_mlp_shapes(config, idx, p))
        if idx >= num_layers:
            shapes[p + "enorm.weight"] = (h,)
            shapes[p + "hnorm.weight"] = (h,)
            shapes[p + "eh_proj.weight"] = (h, 2 * h)
            shapes[p + "shared_head.norm.weight"] = (h,)
            shapes[p + "shared_head.head.weight"] = (vocab, h)
            if idx == num_layers:
                shapes[p + "embed_tokens.weight"] = (vocab, h)
    return shapes


def _kda_shapes(config: dict[str, Any], p: str) -> dict[str, tuple[int, ...]]:
    h = config["hidden_size"]
    kda = config["linear_attn_config"]
    heads, dim = kda["num_heads"], kda["head_dim"]
    proj = heads * dim
    kernel = kda["short_conv_kernel_size"]
    shapes = {
        p + "q_proj.weight": (proj, h),
        p + "k_proj.weight": (proj, h),
        p + "v_proj.weight": (proj, h),
        p + "f_a_proj.weight": (dim, h),
        p + "f_b_proj.weight": (proj, dim),
        p + "b_proj.weight": (heads, h),
        p + "q_conv1d.weight": (proj, 1, kernel),
        p + "k_conv1d.weight": (proj, 1, kernel),
        p + "v_conv1d.weight": (proj, 1, kernel),
        p + "dt_bias": (proj,),
        p + "A_log": (heads,),
        p + "o_norm.weight": (dim,),
        p + "o_proj.weight": (h, proj),
    }
    if kda.get("use_full_rank_gate", False):
        shapes[p + "g_proj.weight"] = (proj, h)
    else:
        shapes[p + "g_a_proj.weight"] = (dim, h)
        shapes[p + "g_b_proj.weight"] = (proj, dim)
    return shapes


def _mla_shapes(config: dict[str, Any], p: str) -> dict[str, tuple[int, ...]]:
    h = config["hidden_size"]
    heads = config["num_attention_heads"]
    nope, rope = config["qk_nope_head_dim"], config["qk_rope_head_dim"]
    v_dim, kv_lora = config["v_head_dim"], config["kv_lora_rank"]
    q_lora = config.get("q_lora_rank")
    shapes: dict[str, tuple[int, ...]] = {
        p + "kv_a_proj_with_mqa.weight": (kv_lora + rope, h),
        p + "kv_a_layernorm.weight": (kv_lora,),
        p + "kv_b_proj.weight": (heads * (nope + v_dim), kv_lora),
        p + "o_proj.weight": (h, heads * v_dim),
    }
    if q_lora is not None:
        shapes[p + "q_a_proj.weight"] = (q_lora, h)
        shapes[p + "q_a_layernorm.weight"] = (q_lora,)
        shapes[p + "q_b_proj.weight"] = (heads * (nope + rope), q_lora)
    else:
        shapes[p + "q_proj.weight"] = (heads * (nope + rope), h)
    if config.get("mla_use_output_gate"):
        shapes[p + "g_proj.weight"] = (heads * v_dim, h)
    dsa = config.get("dsa_config")
    if dsa is not None:
        idx_heads, idx_dim = dsa["index_num_heads"], dsa["index_head_dim"]
        q_in = q_lora if q_lora is not None else h
        shapes[p + "indexer.wq_b.weight"] = (idx_heads * idx_dim, q_in)
        shapes[p + "indexer.wk.weight"] = (idx_dim, h)
        shapes[p + "indexer.weights_proj.weight"] = (idx_heads, h)
        shapes[p + "indexer.k_norm.weight"] = (idx_dim,)
        if dsa.get("index_k_norm_type", "rmsnorm") == "layernorm":
            shapes[p + "indexer.k_norm.bias"] = (idx_dim,)
    return shapes


def _mlp_shapes(config: dict[str, Any], idx: int, p: str) -> dict[str, tuple[int, ...]]:
    h = config["hidden_size"]
    if not _is_moe_layer(config, idx):
        inter = config["intermediate_size"]
        return {
            p + "mlp.gate_proj.weight": (inter, h),
            p + "mlp.up_proj.weight": (inter, h),
            p + "mlp.down_proj.weight": (h, inter),
        }
    experts = config["num_experts"]
    inter = config["moe_intermediate_size"]
    m = p + "block_sparse_moe."
    shapes: dict[str, tuple[int, ...]] = {
        m + "gate.weight": (experts, h),
        m + "gate.e_score_correction_bias": (experts,),
    }
    shared = config.get("num_shared_experts") or 0
    if shared:
        shapes[m + "shared_experts.gate_proj.weight"] = (inter * shared, h)
        shapes[m + "shared_experts.up_proj.weight"] = (inter * shared, h)
        shapes[m + "shared_experts.down_proj.weight"] = (h, inter * shared)
    for e in range(experts):
        shapes[m + f"experts.{e}.w1.weight"] = (inter, h)
        shapes[m + f"experts.{e}.w3.weight"] = (inter, h)
        shapes[m + f"experts.{e}.w2.weight"] = (h, inter)
    return shapes


def tiny_vision_shapes(
    vision: dict[str, Any], text_hidden_size: int
) -> dict[str, tuple[int, ...]]:
    """The vision tower and projector tensors of the multimodal checkpoint, in
    its naming (``mm_projector.proj.{0,2}``, which vLLM maps to
    ``linear_{1,2}``)."""
    vt = vision["vt_hidden_size"]
    qkv = vision["qkv_hidden_size"]
    inter = vision["vt_intermediate_size"]
    patch = vision["patch_size"]
    merge_h, merge_w = vision["merge_kernel_size"]
    shapes: dict[str, tuple[int, ...]] = {
        "vision_tower.patch_embed.proj.weight": (vt, 3, patch, patch),
        "vision_tower.patch_embed.pos_emb.weight": (
            vision["init_pos_emb_height"],
            vision["init_pos_emb_width"],
            vt,
        ),
        "vision_tower.encoder.final_layernorm.weight": (vt,),
        "mm_projector.proj.0.weight": (vt * merge_h * merge_w, vt * merge_h * merge_w),
        "mm_projector.proj.2.weight": (text_hidden_size, vt * merge_h * merge_w),
        "mm_projector.post_norm.weight": (text_hidden_size,),
    }
    for block in range(vision["vt_num_hidden_layers"]):
        b = f"vision_tower.encoder.blocks.{block}."
        shapes[b + "norm0.weight"] = (vt,)
        shapes[b + "norm1.weight"] = (vt,)
        shapes[b + "wqkv.weight"] = (3 * qkv, vt)
        shapes[b + "wo.weight"] = (vt, qkv)
        shapes[b + "mlp.fc0.weight"] = (inter, vt)
        shapes[b + "mlp.fc1.weight"] = (vt, inter)
    return shapes


# Output heads at 0.02 would give a near-uniform next-token distribution, whose
# logprobs tell two serving paths apart by nothing; 0.1 spreads the logits
# (std ~1.6 at hidden 256) without changing which paths agree.
OUTPUT_HEAD_STD = 0.1
OUTPUT_HEADS = ("lm_head.weight", "shared_head.head.weight")


def _is_norm(name: str) -> bool:
    return name.endswith(("norm.weight", "layernorm.weight")) or name in {
        "model.norm.weight"
    }


def tiny_checkpoint_tensors(
    config: dict[str, Any],
    *,
    seed: int = 0,
    dtype: torch.dtype | None = None,
    prefix: str = "",
) -> dict[str, torch.Tensor]:
    """Random tensors for :func:`tiny_checkpoint_shapes`, reproducible from
    ``seed``; ``prefix="language_model."`` gives the multimodal naming."""

    return _random_tensors(tiny_checkpoint_shapes(config), seed, dtype, prefix)


def _random_tensors(
    shapes: dict[str, tuple[int, ...]],
    seed: int,
    dtype: torch.dtype | None,
    prefix: str = "",
) -> dict[str, torch.Tensor]:
    import torch

    dtype = torch.bfloat16 if dtype is None else dtype
    generator = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for name, shape in shapes.items():
        value = torch.randn(shape, generator=generator, dtype=torch.float32)
        if _is_norm(name):
            value = 1.0 + 0.1 * value
        elif name.endswith((".bias", "dt_bias", "A_log")):
            value = 0.1 * value
        elif name.endswith(OUTPUT_HEADS):
            value = OUTPUT_HEAD_STD * value
        else:
            value = 0.02 * value
        tensors[prefix + name] = value.to(dtype)
    return tensors


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
        lambda d: _write_files(
            d,
            dsa=dsa,
            weights=True,
            seed=seed,
            prefix=prefix,
            multimodal=multimodal,
            overrides=overrides,
        ),
    )


# -- the command line ---------------------------------------------------------
#
# The CLI never merges into or follows anything: it writes the whole checkpoint
# into a staging directory beside the target (same filesystem) and moves it
# into place, so that an error or a refusal leaves the disk as it was.

PROG = "kimi-k3-dsa-tiny-checkpoint"
_STAGING_INFIX = ".tiny-checkpoint-"


class _Refused(Exception):
    """A bad output path: the message names it, the problem and the fix."""


class _WriteFailed(Exception):
    """Writing failed after the checks; the message says what is on disk."""


def _reason(error: BaseException) -> str:
    if isinstance(error, OSError) and error.strerror:
        return error.strerror
    return str(error) or type(error).__name__


def _listing(names: list[str], limit: int = 3) -> str:
    shown = ", ".join(names[:limit])
    more = len(names) - limit
    return f"{shown} and {more} more" if more > 0 else shown


def _check_output_dir(raw: str, force: bool) -> Path:
    """The absolute target for the path argument ``raw``; raises
    :class:`_Refused` for an empty path, a symlink (never followed), a
    non-directory, the filesystem root, an ancestor that is not a directory,
    a non-empty directory without ``--force``, or (with it) the directory
    that holds the current one. Missing parents are fine: they are created."""
    if not raw.strip():
        raise _Refused(
            "the output path is empty; give the directory to write the checkpoint into"
        )
    path = Path(raw)
    if path.is_symlink():
        raise _Refused(
            f"{raw} is a symbolic link (to {os.readlink(path)}); it is not "
            "followed: give the real directory, or remove the link"
        )
    if path.exists() and not path.is_dir():
        raise _Refused(
            f"{raw} exists and is not a directory; give a new or empty directory"
        )
    target = Path(os.path.realpath(path))
    if target.parent == target:
        raise _Refused(f"{raw} is the filesystem root; give a directory below it")
    if not path.exists():
        ancestor = target.parent
        while not ancestor.exists() and ancestor.parent != ancestor:
            ancestor = ancestor.parent
        if not ancestor.is_dir():
            raise _Refused(
                f"cannot create {raw}: {ancestor} is not a directory; give a "
                "path under a directory"
            )
        return target
    entries = sorted(p.name for p in target.iterdir())
    if entries and not force:
        raise _Refused(
            f"{raw} is not empty (it holds {_listing(entries)}); use --force to "
            "replace its contents, or give a new or empty directory"
        )
    cwd = Path.cwd().resolve()
    if entries and (target == cwd or target in cwd.parents):
        raise _Refused(
            f"--force would replace {raw}, which holds the current directory; "
            "run from outside it"
        )
    return target


def _dir_mode(existing: Path | None) -> int:
    """The mode the new directory gets: the old one's, else the default that
    ``mkdir`` gives (mkdtemp makes its directories private)."""
    if existing is not None:
        return stat.S_IMODE(existing.stat().st_mode)
    umask = os.umask(0)
    os.umask(umask)
    return 0o777 & ~umask


def _install(staging: Path, names: list[str], target: Path) -> Path | None:
    """Move the staged checkpoint to ``target`` and return where the old
    contents were moved aside (for the caller to delete), if anywhere."""
    if not target.exists():
        os.chmod(staging, _dir_mode(None))
        os.rename(staging, target)
        return None
    if not any(target.iterdir()):
        # Keep an existing empty directory (its owner, mode, and any shell
        # sitting in it): move the files in, config.json last.
        moved: list[Path] = []
        try:
            for name in names:
                os.rename(staging / name, target / name)
                moved.append(target / name)
        except BaseException:
            for file in moved:
                file.unlink(missing_ok=True)
            raise
        return None
    os.chmod(staging, _dir_mode(target))
    aside = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=target.parent))
    try:
        os.rename(target, aside / target.name)
    except BaseException:
        aside.rmdir()
        raise
    try:
        os.rename(staging, target)
    except BaseException as error:
        try:
            os.rename(aside / target.name, target)
            aside.rmdir()
        except OSError:
            raise _WriteFailed(
                f"cannot write {target}: {_reason(error)}; its old contents are "
                f"in {aside / target.name}"
            ) from error
        raise
    return aside


def _write_checkpoint_dir(
    target: Path, write: Callable[[Path], list[str]]
) -> Path | None:
    """Stage the files beside ``target`` and install them, creating missing
    parents; on any failure remove the staging directory and the parents
    created, so that nothing is left behind. Returns the old contents' place
    aside (see :func:`_install`)."""
    created: list[Path] = []
    parent = target.parent
    while not parent.exists():
        created.append(parent)
        parent = parent.parent
    staging: Path | None = None
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(
            tempfile.mkdtemp(
                prefix=f".{target.name}{_STAGING_INFIX}", dir=target.parent
            )
        )
        return _install(staging, write(staging), target)
    except BaseException:
        if staging is not None:
            shutil.rmtree(staging, ignore_errors=True)
        for directory in created:  # deepest first
            with contextlib.suppress(OSError):
                directory.rmdir()
        raise
    finally:
        # Gone once renamed into place; left empty after moving files in.
        if staging is not None and staging.exists():
            shutil.rmtree(staging, ignore_errors=True)


def _exit(message: str, code: int) -> NoReturn:
    print(f"{PROG}: error: {message}", file=sys.stderr)
    raise SystemExit(code)


def _write_errors() -> tuple[type[BaseException], ...]:
    """Errors that mean the disk refused a write (permission, space, ...):
    ``OSError``, and safetensors' own error, which carries its I/O errors."""
    try:
        from safetensors import SafetensorError
    except ImportError:
        return (OSError,)
    return (OSError, SafetensorError)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description=__doc__.split("\n\n")[0],
        epilog=(
            "OUT_DIR must be new or empty (missing parents are created); "
            "--force replaces a non-empty directory's whole contents. The "
            "checkpoint is staged beside OUT_DIR and moved into place, so a "
            "failure changes nothing. Exit status: 0 written, 1 the write "
            "failed, 2 bad arguments."
        ),
    )
    parser.add_argument("out_dir", help="directory to write the checkpoint into")
    parser.add_argument(
        "--no-dsa", action="store_true", help="write a plain Kimi K3 checkpoint"
    )
    parser.add_argument(
        "--config-only", action="store_true", help="write config.json only"
    )
    parser.add_argument(
        "--multimodal",
        action="store_true",
        help="write the multimodal KimiK3ForConditionalGeneration checkpoint",
    )
    parser.add_argument(
        "--real-attention",
        action="store_true",
        help="Kimi K3.1's real attention dimensions (96 heads, 12 per rank at "
        "TP 8; 32 x 128 indexer heads, top-k 2048), the rest small (~220 MB)",
    )
    parser.add_argument("--seed", type=int, default=None, help="random seed (0)")
    parser.add_argument(
        "--force",
        action="store_true",
        help="replace a non-empty OUT_DIR: its old files are all removed",
    )
    return parser


def main(argv: list[str] | None = None) -> None:
    """The console script: refusals exit 2 and write nothing, failed writes
    exit 1 and leave the disk as it was; each prints one line on stderr."""
    args = _parser().parse_args(argv)
    if args.config_only and args.multimodal:
        _exit("--config-only writes the text-only config; drop --multimodal", 2)
    if args.config_only and args.seed is not None:
        _exit("--seed has no effect with --config-only (no weights)", 2)
    seed = 0 if args.seed is None else args.seed
    if not 0 <= seed < 2**64:
        _exit(f"--seed {seed} is out of range; give 0 to 2**64 - 1", 2)
    try:
        target = _check_output_dir(args.out_dir, args.force)
    except _Refused as refusal:
        _exit(str(refusal), 2)
    except OSError as error:
        _exit(f"cannot inspect {args.out_dir}: {_reason(error)}", 1)

    dsa = not args.no_dsa
    overrides = real_attention_overrides(dsa) if args.real_attention else None
    try:
        aside = _write_checkpoint_dir(
            target,
            lambda d: _write_files(
                d,
                dsa=dsa,
                weights=not args.config_only,
                seed=seed,
                multimodal=args.multimodal,
                overrides=overrides,
            ),
        )
    except _WriteFailed as failure:
        _exit(str(failure), 1)
    except _write_errors() as error:
        _exit(
            f"cannot write the checkpoint to {target}: {_reason(error)}; "
            "nothing was changed",
            1,
        )
    if aside is not None:
        try:
            shutil.rmtree(aside)
        except OSError as error:
            print(
                f"{PROG}: warning: wrote {target}, but could not delete its old "
                f"contents in {aside}: {_reason(error)}",
                file=sys.stderr,
            )
    kind = "Kimi K3.1" if dsa else "plain Kimi K3"
    if args.real_attention:
        kind += " (real attention dimensions)"
    files = "config.json" if args.config_only else f"config.json, {CHECKPOINT_FILE}"
    replaced = " (replacing its old contents)" if aside is not None else ""
    print(f"wrote a tiny {kind} checkpoint ({files}) to {target}{replaced}")


if __name__ == "__main__":
    main()
