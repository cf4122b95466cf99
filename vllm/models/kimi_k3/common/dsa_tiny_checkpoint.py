# SPDX-License-Identifier: Apache-2.0
"""A tiny random Kimi K3.1 checkpoint, for tests and for smoke-testing
``vllm serve`` on one GPU.

The config keeps every dimension that a kernel or cache format fixes (the MLA
latent of 512 + 64 for ``fp8_ds_mla``, indexer head dim 128) and shrinks the
rest: a few layers with both KDA and DSA layers and one MTP layer.

    python -m vllm.models.kimi_k3.common.dsa_tiny_checkpoint OUT_DIR
"""

from __future__ import annotations

import argparse
import copy
import json
from pathlib import Path
from typing import Any

# 1-indexed, like Kimi K3's lists (the real model: full attention at 4, 8, ...,
# 92, 93).
TINY_KDA_LAYERS = [1, 2, 3]
TINY_FULL_ATTN_LAYERS = [4, 5]

TINY_DSA_CONFIG: dict[str, Any] = {
    "index_topk": 64,
    "index_head_dim": 128,
    "index_num_heads": 4,
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
    "q_lora_rank": 128,
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


def tiny_text_config(dsa: bool = True, **overrides: Any) -> dict[str, Any]:
    """The tiny text config as a dict; ``dsa=False`` gives plain Kimi K3."""
    config = copy.deepcopy(TINY_TEXT_CONFIG)
    if not dsa:
        del config["dsa_config"]
    config.update(copy.deepcopy(overrides))
    return config


def write_tiny_config(path: str | Path, dsa: bool = True, **overrides: Any) -> Path:
    """Write ``config.json`` of a tiny text-only (``KimiLinearForCausalLM``)
    Kimi K3.1 checkpoint into ``path`` and return the directory."""
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    config = tiny_text_config(dsa=dsa, **overrides)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", help="directory to write the checkpoint into")
    parser.add_argument(
        "--no-dsa", action="store_true", help="write a plain Kimi K3 config"
    )
    args = parser.parse_args(argv)
    out = write_tiny_config(args.out_dir, dsa=not args.no_dsa)
    print(f"wrote a tiny Kimi K3.1 checkpoint config to {out}")


if __name__ == "__main__":
    main()
