# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""What Kimi K3's full-attention layers receive from the checkpoint, checked.

vLLM's loader loads whatever arrives: a missing MLA projection stays
uninitialized, a second copy overwrites, a NaN loads. The audit refuses
non-finite values and conflicting copies as they stream past, and
incomplete layers after loading.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import torch
from torch import nn

from vllm.models.kimi_k3.nvidia.dsa_weight_router import (
    CHECKPOINT_PURPOSES,
    WeightItem,
)

# Checkpoint module of a full-attention layer -> what it is for.
MLA_CHECKPOINT_PURPOSES: dict[str, str] = {
    "q_a_proj": CHECKPOINT_PURPOSES["q_a_proj"],
    "q_a_layernorm": "the norm of the query latent",
    "q_b_proj": "the MLA query up-projection",
    "q_proj": "the MLA query projection",
    "kv_a_proj_with_mqa": CHECKPOINT_PURPOSES["kv_a_proj_with_mqa"],
    "kv_a_layernorm": "the norm of the key/value latent",
    "kv_b_proj": "the MLA key/value up-projection",
    "o_proj": "the output projection",
    "g_proj": "the output gate",
}
STATE_ATTR = "kimi_k3_attention_checkpoint"


def expected_mla_modules(attn: nn.Module) -> frozenset[str]:
    """The checkpoint modules whose ``weight`` a full-attention layer takes."""
    query = (
        ("q_proj",)
        if getattr(attn, "q_lora_rank", None) is None
        else ("q_a_proj", "q_a_layernorm", "q_b_proj")
    )
    gated = getattr(attn, "g_proj", None) is not None
    gate = ("g_proj",) if gated or getattr(attn, "use_output_gate", False) else ()
    return frozenset(
        (*query, "kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj", "o_proj", *gate)
    )


def is_full_attention(module: nn.Module | None) -> bool:
    """A Kimi K3 MLA layer, dense or DSA (KDA layers have no latent norm)."""
    return module is not None and hasattr(module, "kv_a_layernorm")


@dataclass
class AttentionCheckpointState:
    """What one full-attention layer got, across ``load_weights`` calls."""

    checkpoint_prefix: str
    label: str
    expected: frozenset[str]
    seen: dict[str, set[str]] = field(default_factory=dict)

    def missing(self) -> list[str]:
        return [
            f"'{self.checkpoint_prefix}{m}.weight' ({MLA_CHECKPOINT_PURPOSES[m]})"
            for m in sorted(self.expected)
            if f"{m}.weight" not in self.seen.get(m, set())
        ]


def _values(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's values as fp32 (quantized and packed ones as bytes)."""
    flat = tensor.detach().reshape(-1)
    if not flat.is_floating_point() or flat.dtype == torch.float8_e8m0fnu:
        flat = flat.contiguous().view(torch.uint8)
    return flat.float()


def _fingerprint(values: torch.Tensor) -> tuple[float, ...]:
    """Sums in which two differing copies differ, but for a vanishing chance."""
    half = values[: values.numel() // 2]
    return tuple(
        float(x)
        for x in (
            values.sum(dtype=torch.float64),
            (values * values).sum(dtype=torch.float64),
            half.sum(dtype=torch.float64),
        )
    ) + (float(values.numel()),)


class AttentionCheckpointAudit:
    """Checks the tensors of ``layers`` as they stream past (:meth:`watch`)."""

    def __init__(self, layers: dict[str, tuple[str, nn.Module]]) -> None:
        self.states: dict[str, AttentionCheckpointState] = {}
        for ckpt, (label, attn) in layers.items():
            state = getattr(attn, STATE_ATTR, None)
            if state is None or state.checkpoint_prefix != ckpt:
                state = AttentionCheckpointState(
                    ckpt, label, expected_mla_modules(attn)
                )
                setattr(attn, STATE_ATTR, state)
            self.states[ckpt] = state
        self.last_name: str | None = None
        # Per call: a weight refit brings new values for the same names.
        self.fingerprints: dict[str, tuple[float, ...]] = {}

    def watch(self, weights: Iterable[WeightItem]) -> Iterator[WeightItem]:
        for item in weights:
            self.last_name = item[0]
            self.observe(item[0], item[1])
            yield item

    def observe(self, name: str, tensor: torch.Tensor) -> None:
        state = next((s for p, s in self.states.items() if name.startswith(p)), None)
        if state is None:
            return
        rest = name[len(state.checkpoint_prefix) :]
        state.seen.setdefault(rest.partition(".")[0], set()).add(rest)
        values = _values(tensor)
        if not bool(torch.isfinite(values).all()):
            raise ValueError(
                f"Kimi K3 attention layer '{state.label}': checkpoint tensor "
                f"'{name}' holds non-finite values (NaN or inf): the checkpoint "
                "is damaged"
            )
        fingerprint = _fingerprint(values)
        if self.fingerprints.setdefault(name, fingerprint) != fingerprint:
            raise ValueError(
                f"Kimi K3 attention layer '{state.label}': checkpoint tensor "
                f"'{name}' is given twice with different values (two shards of "
                "the checkpoint hold it); keep one copy"
            )


def full_attention_layers(
    candidates: Iterable[tuple[str, str, nn.Module | None]],
) -> dict[str, tuple[str, nn.Module]]:
    """Checkpoint prefix -> (label, layer) of the candidates that are MLA
    layers."""
    return {
        ckpt: (param.rstrip("."), attn)
        for ckpt, param, attn in candidates
        if is_full_attention(attn)
    }


def raise_missing_attention_tensors(model: nn.Module) -> None:
    """Every full-attention layer that got checkpoint tensors got each MLA
    projection and norm."""
    for module in model.modules():
        state = getattr(module, STATE_ATTR, None)
        if state is None or not state.seen:
            continue
        missing = state.missing()
        if missing:
            raise ValueError(
                f"Kimi K3 attention layer '{state.label}': the checkpoint lacks "
                f"{', '.join(missing)}; the checkpoint is incomplete"
            )
