# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Where each Kimi K3.1 DSA checkpoint tensor loads, checked before it loads.

The weight loaders cast on copy, so a quantized tensor without its scale, or
one of the wrong shape, must be refused before it reaches them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from vllm.models.kimi_k3.nvidia.dsa_model import (
    CHECKPOINT_INDEXER,
    MODULE_INDEXER,
)

# Checkpoint indexer sub-module -> (module in KimiK3DSAIndexer, shard id).
INDEXER_CHECKPOINT_NAMES: dict[str, tuple[str, int | None]] = {
    "wq_b": ("wq_index", None),
    "wk": ("wkv_index", 0),
    "weights_proj": ("wkv_index", 1),
    "k_norm": ("k_index_norm", None),
}
# Checkpoint MLA input projections stacked into fused_qkv_a_proj.
FUSED_QKV_A_CHECKPOINT_NAMES: dict[str, int] = {
    "q_a_proj": 0,
    "kv_a_proj_with_mqa": 1,
}
# Indexer projections a checkpoint may store in fp8 for a bf16 parameter.
UPCAST_INDEXER_PROJECTIONS = ("wq_b", "wk")
SCALE_SUFFIXES = ("weight_scale_inv", "weight_scale")
FP8_BLOCK = 128
# Checkpoint module -> what it is for (named in the errors).
CHECKPOINT_PURPOSES: dict[str, str] = {
    "wq_b": "the indexer's query projection",
    "wk": "the indexer's key projection",
    "weights_proj": "the indexer's per-head score weights",
    "k_norm": "the indexer's key norm, applied to every key before it is cached",
    "q_a_proj": "the MLA query down-projection",
    "kv_a_proj_with_mqa": "the MLA latent down-projection",
}
_PARAMETER_ROLES: dict[str, str] = {
    "weight": "weight",
    "bias": "bias",
    "weight_scale_inv": "fp8 weight's scales",
    "weight_scale": "fp8 weight's scales",
}
_UNQUANTIZED_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
CHECKPOINT_ROW_MEANINGS: dict[str, str] = {
    "wq_b": "index_num_heads*index_head_dim",
    "wk": "index_head_dim",
    "weights_proj": "index_num_heads",
    "k_norm": "index_head_dim",
    "q_a_proj": "q_lora_rank",
    "kv_a_proj_with_mqa": "kv_lora_rank + qk_rope_head_dim",
}

WeightItem = tuple[str, torch.Tensor] | tuple[str, torch.Tensor, dict[str, Any]]


@dataclass
class DSALayerLoadState:
    """What the checkpoint gave one DSA layer's indexer so far, kept across
    ``load_weights`` calls (loaders may split a model over several)."""

    checkpoint_prefix: str
    label: str
    expected: frozenset[str]
    seen: set[str] = field(default_factory=set)
    touched: bool = False
    # Both halves of an fp8 tensor bound for a bf16 parameter, until complete.
    pending: dict[str, dict[str, tuple[str, torch.Tensor]]] = field(
        default_factory=dict
    )

    def missing(self) -> list[str]:
        return sorted(
            f"{self.checkpoint_prefix}{CHECKPOINT_INDEXER}.{t}"
            for t in self.expected - self.seen
        )

    def missing_described(self) -> list[str]:
        return [
            f"'{self.checkpoint_prefix}{CHECKPOINT_INDEXER}.{t}' ({describe(t)})"
            for t in sorted(self.expected - self.seen)
        ]


def describe(tensor: str) -> str:
    """What checkpoint tensor ``{module}.{leaf}`` is for."""
    module, _, leaf = tensor.partition(".")
    role = _PARAMETER_ROLES.get(leaf, leaf)
    purpose = CHECKPOINT_PURPOSES.get(module, module)
    return f"the {role} of {purpose}"


LOAD_STATE_ATTR = "dsa_checkpoint_state"


def expected_indexer_tensors(attn: nn.Module) -> frozenset[str]:
    """Checkpoint names, relative to ``...self_attn.indexer.``, that a DSA
    layer's indexer takes."""
    indexer = getattr(attn, MODULE_INDEXER)
    expected: set[str] = set()
    for ckpt_name, (module_name, _) in INDEXER_CHECKPOINT_NAMES.items():
        module = getattr(indexer, module_name)
        for param_name, _ in module.named_parameters():
            expected.add(f"{ckpt_name}.{param_name}")
    return frozenset(expected)


Shape = tuple[int, ...]


def _shape_of(tensor: torch.Tensor) -> Shape:
    return tuple(int(d) for d in tensor.shape)


def _checkpoint_module(attn: nn.Module, source: str) -> nn.Module:
    mapping = INDEXER_CHECKPOINT_NAMES.get(source)
    if mapping is None:
        return attn.fused_qkv_a_proj
    return getattr(getattr(attn, MODULE_INDEXER), mapping[0])


def expected_checkpoint_shape(
    attn: nn.Module,
    source: str,
    param_suffix: str,
    target: str,
    param: torch.Tensor,
    shard: int | None,
) -> tuple[Shape, str] | None:
    """The shape checkpoint tensor ``{source}.{param_suffix}`` must have to
    load into ``param``, and what its dimensions mean; None where only vLLM's
    loader can tell. Taken from the built modules, which are replicated."""
    from torch.nn.parameter import UninitializedParameter

    if isinstance(param, UninitializedParameter):
        return None
    rows = CHECKPOINT_ROW_MEANINGS[source]
    cols = "hidden_size"
    if source == "wq_b" and getattr(attn, "q_lora_rank", None) is not None:
        cols = "q_lora_rank"
    if shard is not None:
        # vLLM's merged loader narrows to the shard without checking its size.
        module = _checkpoint_module(attn, source)
        partitions = list(module.output_partition_sizes)
        if param_suffix != "weight" or _shape_of(param) != (
            sum(partitions),
            module.input_size,
        ):
            return None  # a scale or a packed layout: vLLM's loader's business
        if getattr(param, "is_sharded_weight", False):
            num_rows = partitions[shard]
        else:
            num_rows = module.output_sizes[shard]
        return (num_rows, module.input_size), f"{rows} x {cols}"
    shape = _shape_of(param)
    if param_suffix == "weight" and len(shape) == 2:
        return shape, f"{rows} x {cols}"
    if source == "k_norm" and len(shape) == 1:
        return shape, rows
    return shape, f"the shape of parameter '{target}'"


def _shape_matches(got: Shape, expected: Shape) -> bool:
    if got == expected:
        return True
    # A per-tensor scale, stored as () or (1,) for a one-element parameter.
    return {got, expected} <= {(), (1,)}


def fp8_scale_fits(weight_shape: Shape, scale_shape: Shape) -> bool:
    if len(weight_shape) != 2 or len(scale_shape) not in (1, 2):
        return False
    if len(scale_shape) == 1:
        scale_shape = (scale_shape[0], 1)
    for size, num_scales in zip(weight_shape, scale_shape, strict=True):
        if num_scales < 1:
            return False
        try:
            _fp8_block(size, num_scales)
        except ValueError:
            return False
    return True


@dataclass(frozen=True)
class _Destination:
    ckpt: str
    target: str
    shard: int | None
    source: str  # the checkpoint module: ``wk``, ``q_a_proj``, ...
    param_suffix: str
    seen: str | None  # the indexer tensor it completes (``wk.weight``)


class DSAWeightRouter:
    """Loads the tensors vLLM's Kimi K3 loaders cannot place for DSA layers.

    ``layers`` maps each DSA layer's checkpoint attention prefix to its
    parameter prefix and module.
    """

    def __init__(
        self,
        params_dict: dict[str, nn.Parameter],
        layers: dict[str, tuple[str, nn.Module]],
    ) -> None:
        self.params_dict = params_dict
        self.layers = layers
        self.states: dict[str, DSALayerLoadState] = {}
        for ckpt, (param_prefix, attn) in layers.items():
            state = getattr(attn, LOAD_STATE_ATTR, None)
            if state is None or state.checkpoint_prefix != ckpt:
                state = DSALayerLoadState(
                    checkpoint_prefix=ckpt,
                    label=param_prefix.rstrip("."),
                    expected=expected_indexer_tensors(attn),
                )
                setattr(attn, LOAD_STATE_ATTR, state)
            self.states[ckpt] = state

    def _layer_of(self, name: str) -> str | None:
        for ckpt in self.layers:
            if name.startswith(ckpt):
                return ckpt
        return None

    def _destination(self, name: str) -> _Destination | None:
        """Where ``name`` loads, or None when vLLM's loader places it."""
        ckpt = self._layer_of(name)
        if ckpt is None:
            return None
        param_prefix, attn = self.layers[ckpt]
        state = self.states[ckpt]
        state.touched = True
        rest = name[len(ckpt) :]
        head, _, suffix = rest.partition(".")
        if head == CHECKPOINT_INDEXER:
            sub, _, param_suffix = suffix.partition(".")
            mapping = INDEXER_CHECKPOINT_NAMES.get(sub)
            target = (
                None
                if mapping is None
                else f"{param_prefix}{MODULE_INDEXER}.{mapping[0]}.{param_suffix}"
            )
            if mapping is None or not param_suffix or target not in self.params_dict:
                takes = sorted(
                    f"{ckpt}{CHECKPOINT_INDEXER}.{t}" for t in state.expected
                )
                raise ValueError(
                    f"Kimi K3.1 DSA layer '{state.label}': unexpected indexer "
                    f"tensor '{name}' in the checkpoint; this layer's indexer "
                    f"takes {takes}"
                )
            return _Destination(ckpt, target, mapping[1], sub, param_suffix, suffix)
        shard = FUSED_QKV_A_CHECKPOINT_NAMES.get(head)
        if shard is not None and hasattr(attn, "fused_qkv_a_proj"):
            target = f"{param_prefix}fused_qkv_a_proj.{suffix}"
            if target in self.params_dict:
                return _Destination(ckpt, target, shard, head, suffix, None)
        return None

    def _mark_seen(self, dest: _Destination) -> None:
        if dest.seen is not None:
            self.states[dest.ckpt].seen.add(dest.seen)

    def _check_shape(
        self,
        ckpt: str,
        name: str,
        loaded_weight: torch.Tensor,
        expected: tuple[Shape, str],
    ) -> None:
        """vLLM's merged loader would truncate a misfit silently."""
        got = _shape_of(loaded_weight)
        shape, meaning = expected
        if _shape_matches(got, shape):
            return
        hint = "; it looks transposed" if len(got) == 2 and got[::-1] == shape else ""
        raise ValueError(
            f"Kimi K3.1 DSA layer '{self.states[ckpt].label}': checkpoint tensor "
            f"'{name}' has shape {got}, expected {shape} ({meaning}){hint}"
        )

    def _check_fp8_scale(
        self, ckpt: str, name: str, scale: torch.Tensor, weight_shape: Shape
    ) -> None:
        got = _shape_of(scale)
        if fp8_scale_fits(weight_shape, got):
            return
        out_rows, in_cols = weight_shape
        blocks = (-(-out_rows // FP8_BLOCK), -(-in_cols // FP8_BLOCK))
        raise ValueError(
            f"Kimi K3.1 DSA layer '{self.states[ckpt].label}': checkpoint tensor "
            f"'{name}' has shape {got}, expected {blocks} (the "
            f"{FP8_BLOCK}x{FP8_BLOCK} block scales of the {weight_shape} fp8 "
            f"weight; per-channel ({out_rows},) or ({out_rows}, 1), or another "
            "block size that divides the weight, also loads)"
        )

    def _maybe_upcast(self, name: str, loaded_weight: torch.Tensor) -> str | None:
        """Buffer an fp8 ``wq_b`` / ``wk`` half bound for a bf16 parameter and
        load it dequantized once complete; None when not this case."""
        ckpt = self._layer_of(name)
        if ckpt is None:
            return None
        rest = name[len(ckpt) :]
        if not rest.startswith(CHECKPOINT_INDEXER + "."):
            return None
        sub, _, suffix = rest[len(CHECKPOINT_INDEXER) + 1 :].partition(".")
        if sub not in UPCAST_INDEXER_PROJECTIONS:
            return None
        param_prefix, attn = self.layers[ckpt]
        module_name, shard = INDEXER_CHECKPOINT_NAMES[sub]
        target = f"{param_prefix}{MODULE_INDEXER}.{module_name}.weight"
        param = self.params_dict.get(target)
        if param is None or param.dtype in _FP8_DTYPES:
            return None  # a natively fp8 parameter takes weight and scale
        is_fp8_weight = suffix == "weight" and loaded_weight.dtype in _FP8_DTYPES
        if not (is_fp8_weight or suffix in SCALE_SUFFIXES):
            return None
        state = self.states[ckpt]
        state.touched = True
        if not is_fp8_weight and loaded_weight.dtype not in _SCALE_DTYPES:
            raise ValueError(
                f"Kimi K3.1 DSA layer '{state.label}': checkpoint tensor '{name}' "
                f"({describe(f'{sub}.{suffix}')}) is "
                f"{_dtype_name(loaded_weight.dtype)}; accepted: float32, "
                "bfloat16 or float16 scales, or UE8M0 (uint8, float8_e8m0fnu)"
            )
        expected = expected_checkpoint_shape(attn, sub, "weight", target, param, shard)
        if expected is not None:
            if is_fp8_weight:
                self._check_shape(ckpt, name, loaded_weight, expected)
            else:
                self._check_fp8_scale(ckpt, name, loaded_weight, expected[0])
        entry = state.pending.setdefault(sub, {})
        entry["weight" if is_fp8_weight else "scale"] = (name, loaded_weight)
        if "weight" in entry and "scale" in entry:
            del state.pending[sub]
            value = dequantize_fp8_block(
                entry["weight"][1], entry["scale"][1], param.dtype
            )
            self._load_into(target, value, shard)
            state.seen.add(f"{sub}.weight")
        return target

    def _load_into(
        self, target: str, loaded_weight: torch.Tensor, shard: int | None
    ) -> None:
        from vllm.model_executor.model_loader.weight_utils import (
            default_weight_loader,
        )

        param = self.params_dict[target]
        weight_loader: Callable[..., Any] = getattr(
            param, "weight_loader", default_weight_loader
        )
        if shard is None:
            weight_loader(param, loaded_weight)
        else:
            weight_loader(param, loaded_weight, shard)

    def load(self, name: str, loaded_weight: torch.Tensor) -> str | None:
        """Load ``name`` if it is ours; None leaves it to vLLM's loader."""
        upcast = self._maybe_upcast(name, loaded_weight)
        if upcast is not None:
            return upcast
        dest = self._destination(name)
        if dest is None:
            return None
        _, attn = self.layers[dest.ckpt]
        expected = expected_checkpoint_shape(
            attn,
            dest.source,
            dest.param_suffix,
            dest.target,
            self.params_dict[dest.target],
            dest.shard,
        )
        if expected is not None:
            self._check_shape(dest.ckpt, name, loaded_weight, expected)
        self._check_dtype(dest, name, loaded_weight)
        self._load_into(dest.target, loaded_weight, dest.shard)
        self._mark_seen(dest)
        return dest.target

    def _check_dtype(
        self, dest: _Destination, name: str, loaded_weight: torch.Tensor
    ) -> None:
        """The loaders copy with a cast: quantized values without their scale
        would load and serve wrong."""
        if dest.param_suffix not in ("weight", "bias"):
            return
        param = self.params_dict[dest.target]
        got, wanted = loaded_weight.dtype, param.dtype
        param_quantized = wanted not in _UNQUANTIZED_DTYPES
        if param_quantized:
            if got == wanted:
                return
            accepted = f"a {_dtype_name(wanted)} weight with its weight_scale_inv"
        else:
            if got in _UNQUANTIZED_DTYPES:
                return
            accepted = "bfloat16, float16 or float32"
            if dest.source in UPCAST_INDEXER_PROJECTIONS and got in _FP8_DTYPES:
                accepted += " (or an fp8 weight with its weight_scale_inv)"
        what = describe(f"{dest.source}.{dest.param_suffix}")
        raise ValueError(
            f"Kimi K3.1 DSA layer '{self.states[dest.ckpt].label}': checkpoint "
            f"tensor '{name}' ({what}) is {_dtype_name(got)}, which parameter "
            f"'{dest.target}' ({_dtype_name(wanted)}) cannot take without a scale "
            f"that fits it; accepted: {accepted}"
        )

    def check_complete(self) -> None:
        raise_incomplete_indexers(self.states.values())


def raise_incomplete_indexers(states: Iterable[DSALayerLoadState]) -> None:
    for state in states:
        if not state.touched:
            continue
        for sub, entry in sorted(state.pending.items()):
            have = sorted(name for name, _ in entry.values())
            raise ValueError(
                f"Kimi K3.1 DSA layer '{state.label}': the checkpoint has "
                f"{have} but not the other half of the fp8 indexer.{sub} "
                f"({CHECKPOINT_PURPOSES[sub]}): an fp8 weight needs its "
                "weight_scale_inv and a scale needs an fp8 weight"
            )
        if not state.seen:
            raise ValueError(
                f"Kimi K3.1 DSA layer '{state.label}': the checkpoint lacks "
                "indexer tensors for this layer (it has none of "
                f"{state.missing()}): these tensors belong to a plain Kimi K3 "
                "checkpoint; remove dsa_config from its config.json to serve it "
                "as Kimi K3, or load the Kimi K3.1 weights"
            )
        missing = state.missing_described()
        if missing:
            raise ValueError(
                f"Kimi K3.1 DSA layer '{state.label}': the checkpoint lacks "
                f"indexer tensor(s) {', '.join(missing)} (a Kimi K3 checkpoint "
                "without DSA weights cannot be served as Kimi K3.1)"
            )


_FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


_SCALE_DTYPES = (
    torch.float32,
    torch.bfloat16,
    torch.float16,
    torch.uint8,
    torch.float8_e8m0fnu,
)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _fp8_block(size: int, num_scales: int) -> int:
    if num_scales == -(-size // FP8_BLOCK):
        return FP8_BLOCK
    if size % num_scales == 0:
        return size // num_scales
    raise ValueError(
        f"cannot infer the fp8 block size of {size} values with {num_scales} scales"
    )


def dequantize_fp8_block(
    weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """An fp8 ``[out, in]`` weight times its block, per-channel or E8M0
    scale."""
    if scale.dtype in (torch.uint8, torch.float8_e8m0fnu):
        scale = scale.view(torch.float8_e8m0fnu).to(torch.float32)
    scale = scale.to(torch.float32)
    if scale.ndim == 1:
        scale = scale[:, None]
    out_rows, in_cols = weight.shape
    rows = _fp8_block(out_rows, scale.shape[0])
    cols = _fp8_block(in_cols, scale.shape[1])
    full = scale.repeat_interleave(rows, 0)[:out_rows].repeat_interleave(cols, 1)
    return (weight.to(torch.float32) * full[:, :in_cols]).to(dtype)
