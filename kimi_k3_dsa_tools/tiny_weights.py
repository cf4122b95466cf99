# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The tensors of the tiny Kimi K3.1 checkpoint: every weight of a Kimi K3(.1)
checkpoint in the real naming, with its shape, and reproducible random values
for them.

The shapes follow the checkpoint, not vLLM's modules: KDA layers carry their
unfused projections and short convolutions, MLA layers ``q_a_proj``,
``kv_a_proj_with_mqa`` and ``g_proj`` unfused, DSA layers the indexer as the
checkpoint names it (``self_attn.indexer.{wq_b, wk, weights_proj, k_norm}``),
MoE layers one tensor per expert, and MTP layers their own embedding copy and
head. A loader test that reads these tensors therefore exercises the same
name mapping and fusing a real checkpoint goes through.
:mod:`~kimi_k3_dsa_tools.tiny_checkpoint` writes them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


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


def tiny_vision_tensors(
    vision: dict[str, Any],
    text_hidden_size: int,
    *,
    seed: int = 0,
    dtype: torch.dtype | None = None,
) -> dict[str, torch.Tensor]:
    """Random tensors for :func:`tiny_vision_shapes`, reproducible from
    ``seed``."""
    return _random_tensors(tiny_vision_shapes(vision, text_hidden_size), seed, dtype)
