# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The per-layer KV cache specs a Kimi K3.1 worker reports, for the tests that
drive vLLM 0.33.0's planner with them."""

from __future__ import annotations

from dsa_kv_specs import dsa_layer_specs, kda_layer_spec

# 0-indexed full-attention (DSA) layers: 1-indexed 4, 8, ..., 92, 93.
FULL_ATTN = [*range(3, 92, 4), 92]


def kimi_k3_1_specs(block: int, tp: int) -> dict:
    """The per-layer specs a TP ``tp`` worker of Kimi K3.1 reports."""
    specs = {}
    for layer in range(93):
        if layer in FULL_ATTN:
            specs.update(dsa_layer_specs(f"l{layer}", block))
        else:
            specs[f"l{layer}.kda"] = kda_layer_spec(block, tp, 96, 128)
    return specs
