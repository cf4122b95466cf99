# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Shape checks of a Kimi K3.1 DSA layer's checkpoint tensors on load.

vLLM's merged-linear loader narrows a tensor to its shard without checking
its size, so a ``weights_proj`` with extra rows or a ``wk`` with 130 rows
would load silently truncated into ``wkv_index`` (likewise ``q_a_proj`` /
``kv_a_proj_with_mqa`` into ``fused_qkv_a_proj``), and the other loaders
assert without naming the tensor. Every such tensor is now checked against
the parameter (shard) it loads into before any weight loader runs, and a
mismatch is a ``ValueError`` naming the layer, the checkpoint tensor, its
shape and the expected one.

Built as ``test_dsa_model.py`` builds it: the real ``KimiLinearForCausalLM``
/ ``KimiK3MTP`` from the tiny checkpoint's engine configuration (fixtures of
``conftest.py``), loaded through ``load_weights``; ``torch.cuda.Stream`` is a
placeholder (no forward runs). The natively fp8 ``wq_index`` case uses a
stand-in indexer module, as ``test_dsa_model.py`` does: on a CPU vLLM cannot
build its fp8 block-scaled linear.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
import torch
from model_builders import MTP_LAYER, build, load

from kimi_k3_dsa_tools.tiny_checkpoint import (
    CHECKPOINT_FILE,
    TINY_DSA_CONFIG,
    TINY_FULL_ATTN_LAYERS,
    tiny_text_config,
    write_tiny_checkpoint,
)

Shape = tuple[int, ...]

DSA_LAYER = TINY_FULL_ATTN_LAYERS[-1] - 1  # 0-indexed

_TEXT = tiny_text_config()
HIDDEN: int = _TEXT["hidden_size"]
Q_LORA: int = _TEXT["q_lora_rank"]
KV_A: int = _TEXT["kv_lora_rank"] + _TEXT["qk_rope_head_dim"]
IDX_DIM: int = TINY_DSA_CONFIG["index_head_dim"]
IDX_HEADS: int = TINY_DSA_CONFIG["index_num_heads"]
WQ_B: Shape = (IDX_HEADS * IDX_DIM, Q_LORA)
BLOCK = 128


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    """The tiny checkpoint's tensors, written and read back once."""
    from safetensors.torch import load_file

    path = write_tiny_checkpoint(tmp_path_factory.mktemp("tiny_k31_shapes"))
    return load_file(str(path / CHECKPOINT_FILE))


def snapshot(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter's bytes (bitwise, so that NaN garbage compares)."""
    return {
        n: p.data.detach().contiguous().view(torch.uint8).clone()
        for n, p in module.named_parameters()
    }


def assert_unchanged(module: torch.nn.Module, before: dict[str, torch.Tensor]) -> None:
    after = snapshot(module)
    assert after.keys() == before.keys()
    for name, value in before.items():
        assert torch.equal(after[name], value), name


def fp8(*shape: int) -> torch.Tensor:
    return (torch.randn(*shape) * 0.3).to(torch.float8_e4m3fn)


def blocks(rows: int, cols: int) -> Shape:
    return (-(-rows // BLOCK), -(-cols // BLOCK))


# -- the table -------------------------------------------------------------


WQ_B_BLOCKS = blocks(*WQ_B)

# What the loader expects of each leaf (relative to ``...self_attn.``) and
# how its error names that shape.
EXPECTED: dict[str, tuple[Shape, str]] = {
    "indexer.weights_proj.weight": (
        (IDX_HEADS, HIDDEN), "index_num_heads x hidden_size"),
    "indexer.wk.weight": ((IDX_DIM, HIDDEN), "index_head_dim x hidden_size"),
    "indexer.wq_b.weight": (WQ_B, "index_num_heads*index_head_dim x q_lora_rank"),
    "indexer.wq_b.weight_scale_inv": (
        WQ_B_BLOCKS, f"block scales of the {WQ_B} fp8 weight"),
    "indexer.k_norm.bias": ((IDX_DIM,), "(index_head_dim)"),
    "indexer.k_norm.weight": ((IDX_DIM,), "(index_head_dim)"),
    "q_a_proj.weight": ((Q_LORA, HIDDEN), "q_lora_rank x hidden_size"),
    "kv_a_proj_with_mqa.weight": (
        (KV_A, HIDDEN), "kv_lora_rank + qk_rope_head_dim x hidden_size"),
}  # fmt: skip


@dataclass(frozen=True)
class BadTensor:
    """One wrong checkpoint tensor of a DSA layer. ``kind``: ``bf16``, an
    ``fp8`` weight bound for a bf16 parameter, or a ``scale`` sent after its
    (well-shaped) fp8 weight; ``note``: what the error adds."""

    leaf: str
    shape: Shape
    kind: str = "bf16"
    note: str = ""

    @property
    def expected(self) -> Shape:
        return EXPECTED[self.leaf][0]

    @property
    def meaning(self) -> str:
        meaning = EXPECTED[self.leaf][1]
        return f"{meaning}); {self.note}" if self.note else meaning

    def tensors(self, prefix: str) -> dict[str, torch.Tensor]:
        if self.kind == "scale":
            weight = self.leaf.replace("weight_scale_inv", "weight")
            return {
                prefix + weight: fp8(*EXPECTED[weight][0]),
                prefix + self.leaf: torch.rand(self.shape) + 0.5,
            }
        if self.kind == "fp8":
            return {prefix + self.leaf: fp8(*self.shape)}
        dtype = torch.float32 if ".k_norm." in self.leaf else torch.bfloat16
        return {prefix + self.leaf: torch.randn(self.shape, dtype=dtype)}


def bad(case: str, leaf: str, *shape: int, **kwargs: str) -> Any:
    return pytest.param(BadTensor(leaf, shape, **kwargs), id=case)


BAD_TENSORS = [
    bad("weights_proj-rows", "indexer.weights_proj.weight", IDX_HEADS + 4, HIDDEN),
    bad("wk-130-rows", "indexer.wk.weight", IDX_DIM + 2, HIDDEN),
    bad("wk-transposed", "indexer.wk.weight", HIDDEN, IDX_DIM,
        note="it looks transposed"),
    bad("fp8-wk-transposed", "indexer.wk.weight", HIDDEN, IDX_DIM, kind="fp8"),
    bad("wq_b-without-q-lora", "indexer.wq_b.weight", IDX_HEADS * IDX_DIM, HIDDEN),
    bad("k_norm-bias-length", "indexer.k_norm.bias", IDX_DIM - 1),
    bad("k_norm-weight-2d", "indexer.k_norm.weight", IDX_DIM, 1),
    bad("q_a_proj-extra-rows", "q_a_proj.weight", Q_LORA + 64, HIDDEN),
    bad("kv_a_proj-no-rope-rows", "kv_a_proj_with_mqa.weight", KV_A - 64, HIDDEN),
    bad("fp8-wq_b-scale", "indexer.wq_b.weight_scale_inv",
        WQ_B_BLOCKS[0] + 1, WQ_B_BLOCKS[1], kind="scale"),
]  # fmt: skip


@pytest.mark.parametrize("bad", BAD_TENSORS)
def test_wrong_shape_refused_before_loading(
    dsa_layer_env, checkpoint: dict[str, torch.Tensor], bad: BadTensor
) -> None:
    """A reload (a weight refit) that carries one wrong tensor is refused
    with its name and both shapes, and leaves the layer as it was: nothing is
    truncated into it."""
    model = build(dsa_layer_env)
    load(model, checkpoint)
    attn = model.model.layers[DSA_LAYER].self_attn
    before = snapshot(attn)
    tensors = bad.tensors(f"model.layers.{DSA_LAYER}.self_attn.")
    with pytest.raises(ValueError) as err:
        load(model, tensors)
    msg = str(err.value)
    assert f"DSA layer 'layers.{DSA_LAYER}.self_attn'" in msg
    # As the name reaches KimiLinearModel.load_weights (``model.`` stripped).
    assert f"'layers.{DSA_LAYER}.self_attn.{bad.leaf}' has shape {bad.shape}" in msg
    assert f"expected {bad.expected}" in msg
    assert bad.meaning in msg
    assert_unchanged(attn, before)


def test_mtp_block_wrong_shape_names_the_mtp_layer(
    dsa_layer_env, checkpoint: dict[str, torch.Tensor]
) -> None:
    """The MTP draft's DSA block goes through the same check."""
    mtp = build(dsa_layer_env, "mtp")
    attn = mtp.model.layers[str(MTP_LAYER)].mtp_block.self_attn
    before = snapshot(attn)
    name = f"model.layers.{MTP_LAYER}.self_attn.indexer.wk.weight"
    with pytest.raises(ValueError) as err:
        load(mtp, {name: torch.randn(IDX_DIM + 2, HIDDEN, dtype=torch.bfloat16)})
    msg = str(err.value)
    assert f"'model.layers.{MTP_LAYER}.mtp_block.self_attn'" in msg
    assert f"'{name}' has shape {(IDX_DIM + 2, HIDDEN)}" in msg
    assert f"expected {(IDX_DIM, HIDDEN)} (index_head_dim x hidden_size)" in msg
    assert_unchanged(attn, before)


# -- good loads --------------------------------------------------------------


def test_good_tensors_land_where_expected(
    dsa_layer_env, checkpoint: dict[str, torch.Tensor]
) -> None:
    """The checks pass a well-shaped checkpoint, every value where it
    belongs, and an fp8 ``wq_b`` / ``wk`` with a block or per-channel scale
    still dequantizes into its bf16 parameter."""
    from vllm.models.kimi_k3.nvidia.dsa_weight_router import dequantize_fp8_block
    from vllm.models.kimi_k3.nvidia.dsa_weights import check_dsa_indexers_complete

    model = build(dsa_layer_env)
    loaded = load(model, checkpoint)
    assert loaded == {n for n, _ in model.named_parameters()}
    check_dsa_indexers_complete(model)
    p = f"model.layers.{DSA_LAYER}.self_attn."
    attn = model.model.layers[DSA_LAYER].self_attn
    indexer = attn.dsa_indexer
    wkv = indexer.wkv_index.weight
    assert torch.equal(wkv[:IDX_DIM], checkpoint[p + "indexer.wk.weight"])
    assert torch.equal(wkv[IDX_DIM:], checkpoint[p + "indexer.weights_proj.weight"])
    assert torch.equal(indexer.wq_index.weight, checkpoint[p + "indexer.wq_b.weight"])
    norm = indexer.k_index_norm
    for leaf in ("weight", "bias"):
        expected = checkpoint[p + f"indexer.k_norm.{leaf}"].to(norm.weight.dtype)
        assert torch.equal(getattr(norm, leaf).data, expected), leaf
    fused = attn.fused_qkv_a_proj.weight
    assert torch.equal(fused[:Q_LORA], checkpoint[p + "q_a_proj.weight"])
    assert torch.equal(fused[Q_LORA:], checkpoint[p + "kv_a_proj_with_mqa.weight"])

    # fp8 halves bound for bf16 parameters: block scale for wq_b, per-channel
    # [rows, 1] for wk.
    wq_b, wq_scale = fp8(*WQ_B), torch.rand(*blocks(*WQ_B)) + 0.5
    wk, wk_scale = fp8(IDX_DIM, HIDDEN), torch.rand(IDX_DIM, 1) + 0.5
    before_proj = wkv[IDX_DIM:].clone()
    load(
        model,
        {
            p + "indexer.wq_b.weight_scale_inv": wq_scale,
            p + "indexer.wq_b.weight": wq_b,
            p + "indexer.wk.weight": wk,
            p + "indexer.wk.weight_scale_inv": wk_scale,
        },
    )
    check_dsa_indexers_complete(model)
    assert torch.equal(
        indexer.wq_index.weight, dequantize_fp8_block(wq_b, wq_scale, torch.bfloat16)
    )
    assert torch.equal(
        wkv[:IDX_DIM], dequantize_fp8_block(wk, wk_scale, torch.bfloat16)
    )
    assert torch.equal(wkv[IDX_DIM:], before_proj)


# -- a natively fp8 wq_index ---------------------------------------------------


class _FakeFp8Attention(torch.nn.Module):
    """The parameter tree of a DSA layer whose ``wq_index`` is fp8
    block-quantized (``weight`` in float8_e4m3fn, ``weight_scale_inv`` one
    fp32 per 128x128 block), made by hand as in ``test_dsa_model.py``: on a
    CPU vLLM's ``Fp8LinearMethod`` finds no block-scaled GEMM kernel."""

    def __init__(self) -> None:
        from vllm.model_executor.layers.layernorm import RMSNorm
        from vllm.model_executor.layers.linear import (
            MergedColumnParallelLinear,
            ReplicatedLinear,
        )

        super().__init__()
        self.q_lora_rank = Q_LORA
        self.dsa_indexer = torch.nn.Module()
        wq = ReplicatedLinear(Q_LORA, IDX_HEADS * IDX_DIM, bias=False)
        weight_loader = wq.weight_loader
        wq.weight = torch.nn.Parameter(
            torch.zeros(WQ_B, dtype=torch.float8_e4m3fn), requires_grad=False
        )
        wq.weight_scale_inv = torch.nn.Parameter(
            torch.ones(blocks(*WQ_B), dtype=torch.float32), requires_grad=False
        )
        for param in (wq.weight, wq.weight_scale_inv):
            param.weight_loader = weight_loader
        self.dsa_indexer.wq_index = wq
        self.dsa_indexer.wkv_index = MergedColumnParallelLinear(
            HIDDEN, [IDX_DIM, IDX_HEADS], bias=False, disable_tp=True
        )
        self.dsa_indexer.k_index_norm = RMSNorm(IDX_DIM)


@pytest.mark.parametrize(
    "leaf, shape, expected, meaning",
    [
        (
            "weight",
            (IDX_HEADS * IDX_DIM, HIDDEN),
            (IDX_HEADS * IDX_DIM, Q_LORA),
            "index_num_heads*index_head_dim x q_lora_rank",
        ),
        (
            "weight_scale_inv",
            blocks(IDX_HEADS * IDX_DIM, HIDDEN),
            blocks(IDX_HEADS * IDX_DIM, Q_LORA),
            "the shape of parameter 'layers.0.self_attn.dsa_indexer.wq_index."
            "weight_scale_inv'",
        ),
        (None, None, None, None),
    ],
    ids=["weight", "scale", "good"],
)
def test_natively_fp8_wq_index_checked_against_its_parameters(
    dsa_layer_env,
    leaf: str | None,
    shape: Shape | None,
    expected: Shape | None,
    meaning: str | None,
) -> None:
    """An fp8 ``wq_b`` and its scale bound for an fp8 ``wq_index`` load as
    they are (no dequantization); each is checked against its own
    parameter."""
    from vllm.models.kimi_k3.nvidia.dsa_weight_router import DSAWeightRouter
    from vllm.utils.torch_utils import set_default_torch_dtype

    with set_default_torch_dtype(torch.bfloat16):
        attn = _FakeFp8Attention()
    root = torch.nn.Module()
    root.layers = torch.nn.ModuleList([torch.nn.Module()])
    root.layers[0].self_attn = attn
    p = "layers.0.self_attn."
    router = DSAWeightRouter(dict(root.named_parameters()), {p: (p, attn)})
    wq = attn.dsa_indexer.wq_index
    weight = fp8(*WQ_B)
    scale = torch.rand(*blocks(*WQ_B)) + 0.5
    if leaf is None:
        assert router.load(p + "indexer.wq_b.weight", weight) is not None
        assert router.load(p + "indexer.wq_b.weight_scale_inv", scale) is not None
        assert torch.equal(wq.weight.view(torch.uint8), weight.view(torch.uint8))
        assert torch.equal(wq.weight_scale_inv.data, scale)
        return
    assert shape is not None and meaning is not None
    bad = fp8(*shape) if leaf == "weight" else torch.rand(*shape)
    before = snapshot(attn)
    with pytest.raises(ValueError) as err:
        router.load(p + f"indexer.wq_b.{leaf}", bad)
    msg = str(err.value)
    assert f"'{p}indexer.wq_b.{leaf}' has shape {shape}" in msg
    assert f"expected {expected} ({meaning})" in msg
    assert_unchanged(attn, before)
