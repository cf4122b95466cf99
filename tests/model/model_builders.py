# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Builders of the Kimi K3.1 model tests: the real vLLM 0.33.0 Kimi K3 model
classes built from the tiny checkpoint's engine configuration, the checkpoint
read back, and what each parameter must hold after loading.

Stubbed: ``torch.cuda.Stream`` (see :class:`_NoCudaStream`), besides the
attention-backend selection of ``conftest.py``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from kimi_k3_dsa_tools.tiny_checkpoint import (
    CHECKPOINT_FILE,
    TINY_FULL_ATTN_LAYERS,
    TINY_KDA_LAYERS,
    tiny_text_config,
)

NUM_LAYERS = len(TINY_KDA_LAYERS) + len(TINY_FULL_ATTN_LAYERS)
MTP_LAYER = NUM_LAYERS  # 0-indexed id of the tiny checkpoint's MTP layer
DSA_LAYERS = [n - 1 for n in TINY_FULL_ATTN_LAYERS]  # 0-indexed
KDA_LAYERS = [n - 1 for n in TINY_KDA_LAYERS]


class _NoCudaStream:
    """Placeholder for ``torch.cuda.Stream()`` (never used without a forward)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass


def plain_vllm_config(env) -> Any:
    """The session's engine configuration with a plain Kimi K3 text config."""
    from vllm.models.kimi_k3.common.dsa_config import KimiLinearDSAConfig

    text_config = KimiLinearDSAConfig(**tiny_text_config(dsa=False))
    cfg = env.vllm_config.with_hf_config(text_config)
    # with_hf_config swaps hf_config only; a text-only model's text config is
    # the same object.
    cfg.model_config.hf_text_config = text_config
    # The session config went through the DSA verifier (fp8_ds_mla); plain
    # Kimi K3 serves with the default cache dtype.
    env.monkeypatch.setattr(cfg.cache_config, "cache_dtype", "auto")
    return cfg


def build(env, kind: str = "lm", vllm_config: Any = None) -> torch.nn.Module:
    """Build the real top-level class (``lm``: KimiLinearForCausalLM, ``mtp``:
    KimiK3MTP) as vLLM's loader does: current config set, bf16 default."""
    from vllm.config import set_current_vllm_config
    from vllm.utils.torch_utils import set_default_torch_dtype

    cfg = vllm_config if vllm_config is not None else env.vllm_config
    env.monkeypatch.setattr(torch.cuda, "Stream", _NoCudaStream)
    with set_current_vllm_config(cfg), set_default_torch_dtype(torch.bfloat16):
        if kind == "lm":
            from vllm.models.kimi_k3.nvidia.model import KimiLinearForCausalLM

            return KimiLinearForCausalLM(vllm_config=cfg, prefix="")
        from vllm.models.kimi_k3.nvidia.mtp import KimiK3MTP

        return KimiK3MTP(vllm_config=cfg, prefix="")


def read_checkpoint(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path / CHECKPOINT_FILE))


def load(model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> set[str]:
    with torch.no_grad():
        return model.load_weights(iter(list(tensors.items())))


# -- what each parameter must hold, from the checkpoint tensors -------------

# parameter leaf -> checkpoint leaves, concatenated along dim 0 in this order.
STACKED: dict[str, list[str]] = {
    "self_attn.in_proj_qkvgfab.weight": [
        "self_attn.q_proj.weight",
        "self_attn.k_proj.weight",
        "self_attn.v_proj.weight",
        "self_attn.g_proj.weight",
        "self_attn.f_a_proj.weight",
        "self_attn.b_proj.weight",
    ],
    "self_attn.conv1d.weight": [
        "self_attn.q_conv1d.weight",
        "self_attn.k_conv1d.weight",
        "self_attn.v_conv1d.weight",
    ],
    "mlp.gate_up_proj.weight": ["mlp.gate_proj.weight", "mlp.up_proj.weight"],
    "shared_experts.gate_up_proj.weight": [
        "shared_experts.gate_proj.weight",
        "shared_experts.up_proj.weight",
    ],
    # The dense Kimi K3 layer fuses the output gate in; the DSA layer does not.
    "self_attn.fused_qkv_a_g_proj.weight": [
        "self_attn.q_a_proj.weight",
        "self_attn.kv_a_proj_with_mqa.weight",
        "self_attn.g_proj.weight",
    ],
    "self_attn.fused_qkv_a_proj.weight": [
        "self_attn.q_a_proj.weight",
        "self_attn.kv_a_proj_with_mqa.weight",
    ],
    "self_attn.dsa_indexer.wkv_index.weight": [
        "self_attn.indexer.wk.weight",
        "self_attn.indexer.weights_proj.weight",
    ],
}
RENAMED: dict[str, str] = {
    "self_attn.dsa_indexer.wq_index.weight": "self_attn.indexer.wq_b.weight",
    "self_attn.dsa_indexer.k_index_norm.weight": "self_attn.indexer.k_norm.weight",
    "self_attn.dsa_indexer.k_index_norm.bias": "self_attn.indexer.k_norm.bias",
}


def expected_tensor(
    ckpt: dict[str, torch.Tensor], ckpt_name: str, num_rows: int
) -> torch.Tensor:
    """The checkpoint value of the parameter whose checkpoint-side name is
    ``ckpt_name`` (layer prefix + parameter leaf)."""
    for leaf, parts in STACKED.items():
        if ckpt_name.endswith("." + leaf):
            base = ckpt_name[: -len(leaf)]
            value = torch.cat([ckpt[base + part] for part in parts])
            # KDA's in_proj pads its rows to a multiple of 16 with zeros.
            pad = num_rows - value.shape[0]
            if pad:
                value = torch.cat([value, value.new_zeros(pad, *value.shape[1:])])
            return value
    for leaf, source in RENAMED.items():
        if ckpt_name.endswith("." + leaf):
            return ckpt[ckpt_name[: -len(leaf)] + source]
    for leaf, parts in (
        ("experts.routed_experts.w13_weight", ("w1", "w3")),
        ("experts.routed_experts.w2_weight", ("w2",)),
    ):
        if ckpt_name.endswith("." + leaf):
            base = ckpt_name[: -len(leaf)] + "experts."
            experts = sorted(
                {
                    int(k[len(base) :].split(".")[0])
                    for k in ckpt
                    if k.startswith(base) and k[len(base)].isdigit()
                }
            )
            return torch.stack(
                [
                    torch.cat([ckpt[f"{base}{e}.{w}.weight"] for w in parts])
                    for e in experts
                ]
            )
    return ckpt[ckpt_name]


def assert_params_match(
    model: torch.nn.Module,
    ckpt: dict[str, torch.Tensor],
    to_ckpt_name,
    skip: set[str] = frozenset(),
) -> int:
    """Every parameter equals the checkpoint tensor(s) it came from."""
    checked = 0
    for name, param in model.named_parameters():
        if name in skip:
            continue
        expected = expected_tensor(ckpt, to_ckpt_name(name), param.shape[0])
        expected = expected.to(param.dtype).reshape(param.shape)
        assert torch.equal(param.data, expected), name
        checked += 1
    return checked


# -- module tree, buffers, shapes --------------------------------------------


def lm_checkpoint_name(param_name: str) -> str:
    """The checkpoint name of a ``KimiLinearForCausalLM`` parameter (the same:
    the tiny checkpoint is written in the model's own naming)."""
    return param_name
