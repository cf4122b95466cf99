# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Kimi K3.1 DSA weight loading on the CPU: the tiny checkpoint (and its
multimodal and MTP namings) through the real Kimi K3 model classes and vLLM
0.33.0's loaders with our ``dsa_weights`` and ``dsa_post_load`` seams: every
parameter holds its checkpoint tensor, fp8 indexer tensors load or are
dequantized, and incomplete or unexpected indexer tensors are refused.

Stubbed as in ``test_dsa_model.py`` (``model_builders``): the CUDA
attention-backend selection and ``torch.cuda.Stream``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from model_builders import (
    DSA_LAYERS,
    KDA_LAYERS,
    MTP_LAYER,
    _NoCudaStream,
    assert_params_match,
    build,
    lm_checkpoint_name,
    load,
    read_checkpoint,
)

import vllm.models.kimi_k3.nvidia.dsa as D
from kimi_k3_dsa_tools.tiny_checkpoint import (
    TINY_DSA_CONFIG,
    tiny_text_config,
    write_tiny_checkpoint,
)


def test_load_tiny_checkpoint_every_parameter(dsa_layer_env, tmp_path: Path) -> None:
    model = build(dsa_layer_env)
    ckpt = read_checkpoint(write_tiny_checkpoint(tmp_path / "k31"))
    loaded = load(model, ckpt)
    assert loaded == {n for n, _ in model.named_parameters()}
    checked = assert_params_match(model, ckpt, lm_checkpoint_name)
    assert checked == len(loaded)
    # Stacking order, spelled out for one DSA layer.
    p = f"model.layers.{DSA_LAYERS[0]}.self_attn."
    attn = model.model.layers[DSA_LAYERS[0]].self_attn
    idx_dim = TINY_DSA_CONFIG["index_head_dim"]
    wkv = attn.dsa_indexer.wkv_index.weight
    assert torch.equal(wkv[:idx_dim], ckpt[p + "indexer.wk.weight"])
    assert torch.equal(wkv[idx_dim:], ckpt[p + "indexer.weights_proj.weight"])
    q_lora = tiny_text_config()["q_lora_rank"]
    fused = attn.fused_qkv_a_proj.weight
    assert torch.equal(fused[:q_lora], ckpt[p + "q_a_proj.weight"])
    assert torch.equal(fused[q_lora:], ckpt[p + "kv_a_proj_with_mqa.weight"])
    assert torch.equal(attn.g_proj.weight, ckpt[p + "g_proj.weight"])


def test_load_through_auto_weights_loader_prefixes(
    dsa_layer_env, tmp_path: Path
) -> None:
    """The same tensors reach ``KimiLinearModel.load_weights`` without the
    ``model.`` prefix (what ``AutoWeightsLoader`` hands it)."""
    model = build(dsa_layer_env)
    ckpt = read_checkpoint(write_tiny_checkpoint(tmp_path / "k31", seed=3))
    inner = {
        k.removeprefix("model."): v for k, v in ckpt.items() if k.startswith("model.")
    }
    loaded = load(model.model, inner)
    assert loaded == {n for n, _ in model.model.named_parameters()}
    assert_params_match(model.model, inner, lm_checkpoint_name)


def _mtp_ckpt_name(param_name: str) -> str:
    if param_name == "model.embed_tokens.weight":
        return f"model.layers.{MTP_LAYER}.embed_tokens.weight"
    return param_name.replace(
        f"model.layers.{MTP_LAYER}.mtp_block.", f"model.layers.{MTP_LAYER}."
    )


@pytest.mark.parametrize("prefix", ["", "language_model."])
def test_load_mtp_layer_every_parameter(
    dsa_layer_env, tmp_path: Path, prefix: str
) -> None:
    mtp = build(dsa_layer_env, "mtp")
    path = write_tiny_checkpoint(tmp_path / "k31", prefix=prefix)
    ckpt = read_checkpoint(path)
    loaded = load(mtp, ckpt)
    assert loaded == {n for n, _ in mtp.named_parameters()}
    plain = {k.removeprefix(prefix): v for k, v in ckpt.items()}
    checked = assert_params_match(mtp, plain, _mtp_ckpt_name)
    assert checked == len(loaded)


def _drop(ckpt: dict[str, torch.Tensor], name: str) -> dict[str, torch.Tensor]:
    assert name in ckpt
    return {k: v for k, v in ckpt.items() if k != name}


@pytest.mark.parametrize(
    "missing",
    ["indexer.weights_proj.weight", "indexer.wq_b.weight", "indexer.k_norm.bias"],
)
def test_missing_indexer_tensor_refused(
    dsa_layer_env, tmp_path: Path, missing: str
) -> None:
    model = build(dsa_layer_env)
    ckpt = read_checkpoint(write_tiny_checkpoint(tmp_path / "k31"))
    layer = DSA_LAYERS[-1]
    name = f"model.layers.{layer}.self_attn.{missing}"
    load(model, _drop(ckpt, name))
    # Refused once loading is over (a loader may split the tensors over
    # several load_weights calls): by the model-level post-load hook.
    with pytest.raises(ValueError) as err:
        model.process_weights_after_loading()
    assert f"layers.{layer}.self_attn" in str(err.value)
    assert name.removeprefix("model.") in str(err.value)


def test_plain_k3_checkpoint_on_a_dsa_config_refused(
    dsa_layer_env, tmp_path: Path
) -> None:
    model = build(dsa_layer_env)
    ckpt = read_checkpoint(write_tiny_checkpoint(tmp_path / "k31"))
    no_indexer = {k: v for k, v in ckpt.items() if ".indexer." not in k}
    load(model, no_indexer)
    with pytest.raises(ValueError, match="lacks indexer tensor"):
        model.process_weights_after_loading()


def test_indexer_split_over_load_calls_accepted(dsa_layer_env, tmp_path: Path) -> None:
    """Loaders that split a model over several ``load_weights`` calls, and a
    model that was never loaded (``--load-format dummy``), pass the check."""
    model = build(dsa_layer_env)
    model.process_weights_after_loading()  # nothing loaded: nothing checked
    ckpt = read_checkpoint(write_tiny_checkpoint(tmp_path / "k31"))
    names = sorted(ckpt)
    first = {n: ckpt[n] for n in names if "weights_proj" not in n}
    second = {n: ckpt[n] for n in names if "weights_proj" in n}
    assert second
    load(model, first)
    load(model, second)
    model.process_weights_after_loading()
    assert_params_match(model, ckpt, lm_checkpoint_name)


@pytest.mark.parametrize(
    "extra",
    [
        f"model.layers.{DSA_LAYERS[0]}.self_attn.indexer.wq_a.weight",
        f"model.layers.{DSA_LAYERS[0]}.self_attn.indexer.k_norm.running_mean",
        f"model.layers.{KDA_LAYERS[1]}.self_attn.indexer.wk.weight",
    ],
)
def test_unexpected_indexer_tensor_refused(
    dsa_layer_env, tmp_path: Path, extra: str
) -> None:
    model = build(dsa_layer_env)
    ckpt = read_checkpoint(write_tiny_checkpoint(tmp_path / "k31"))
    ckpt[extra] = torch.zeros(4, 4, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="unexpected indexer tensor") as err:
        load(model, ckpt)
    assert extra.removeprefix("model.") in str(err.value)


def test_mtp_missing_and_unexpected_indexer_tensor_refused(
    dsa_layer_env, tmp_path: Path
) -> None:
    mtp = build(dsa_layer_env, "mtp")
    ckpt = read_checkpoint(write_tiny_checkpoint(tmp_path / "k31"))
    p = f"model.layers.{MTP_LAYER}.self_attn."
    load(mtp, _drop(ckpt, p + "indexer.wk.weight"))
    with pytest.raises(ValueError, match="lacks indexer tensor") as err:
        mtp.process_weights_after_loading()
    assert f"model.layers.{MTP_LAYER}.mtp_block.self_attn" in str(err.value)
    assert p + "indexer.wk.weight" in str(err.value)
    extra = dict(ckpt)
    extra[p + "indexer.bogus.weight"] = torch.zeros(2)
    with pytest.raises(ValueError, match="unexpected indexer tensor"):
        load(mtp, extra)


# -- post-load hook ------------------------------------------------------------


def test_post_load_hook_packs_every_dsa_layer_idempotently(
    dsa_layer_env, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from vllm.models.kimi_k3.nvidia.model import (
        KimiK3ForConditionalGeneration,
        KimiLinearForCausalLM,
    )
    from vllm.models.kimi_k3.nvidia.mtp import KimiK3MTP

    for cls in (KimiLinearForCausalLM, KimiK3ForConditionalGeneration, KimiK3MTP):
        assert callable(getattr(cls, "process_weights_after_loading", None)), cls

    model = build(dsa_layer_env)
    ckpt = read_checkpoint(write_tiny_checkpoint(tmp_path / "k31"))
    load(model, ckpt)
    calls: list[str] = []
    real = D.KimiK3DSAAttention.pack_projections

    def spy(self):
        calls.append(self)
        return real(self)

    monkeypatch.setattr(D.KimiK3DSAAttention, "pack_projections", spy)
    model.process_weights_after_loading()
    dsa_layers = [model.model.layers[i].self_attn for i in DSA_LAYERS]
    assert calls == dsa_layers
    before = {n: p.data.clone() for n, p in model.named_parameters()}
    # A reload followed by the hook again: same weights, no error.
    load(model, ckpt)
    model.process_weights_after_loading()
    assert len(calls) == 2 * len(DSA_LAYERS)
    for n, p in model.named_parameters():
        assert torch.equal(p.data, before[n]), n

    # The multimodal class's hook visits the layers of its language model.
    calls.clear()
    holder = torch.nn.Module()
    holder.language_model = model
    KimiK3ForConditionalGeneration.process_weights_after_loading(holder)
    assert calls == dsa_layers


def test_mtp_post_load_hook(dsa_layer_env, monkeypatch: pytest.MonkeyPatch) -> None:
    mtp = build(dsa_layer_env, "mtp")
    calls: list[Any] = []
    monkeypatch.setattr(
        D.KimiK3DSAAttention, "pack_projections", lambda self: calls.append(self)
    )
    mtp.process_weights_after_loading()
    assert calls == [mtp.model.layers[str(MTP_LAYER)].mtp_block.self_attn]


# -- fp8 wq_b -----------------------------------------------------------------


class _FakeDSAAttention(torch.nn.Module):
    """The parameter tree of a DSA layer's indexer. With ``fp8=True``,
    ``wq_index`` carries the parameters vLLM's block-quantized fp8 linear
    registers (``weight`` in float8_e4m3fn, ``weight_scale_inv`` one fp32 per
    128x128 block): on this CPU vLLM finds no fp8 block-scaled GEMM kernel, so
    ``Fp8LinearMethod`` cannot be built and its parameters are made here."""

    def __init__(self, fp8: bool) -> None:
        from vllm.model_executor.layers.layernorm import RMSNorm
        from vllm.model_executor.layers.linear import (
            MergedColumnParallelLinear,
            ReplicatedLinear,
        )
        from vllm.model_executor.model_loader.weight_utils import (
            default_weight_loader,
        )

        super().__init__()
        self.dsa_indexer = torch.nn.Module()
        wq = ReplicatedLinear(256, 512, bias=False, prefix="wq_index")
        if fp8:
            wq.weight = torch.nn.Parameter(
                torch.empty(512, 256, dtype=torch.float8_e4m3fn), requires_grad=False
            )
            wq.weight_scale_inv = torch.nn.Parameter(
                torch.empty(4, 2, dtype=torch.float32), requires_grad=False
            )
            for param in (wq.weight, wq.weight_scale_inv):
                param.weight_loader = default_weight_loader
        self.dsa_indexer.wq_index = wq
        self.dsa_indexer.wkv_index = MergedColumnParallelLinear(
            256,
            [128, 4],
            bias=False,
            quant_config=None,
            disable_tp=True,
            prefix="wkv_index",
        )
        self.dsa_indexer.k_index_norm = RMSNorm(128)


def _fake_root(fp8: bool) -> tuple[torch.nn.Module, _FakeDSAAttention]:
    from vllm.utils.torch_utils import set_default_torch_dtype

    with set_default_torch_dtype(torch.bfloat16):
        attn = _FakeDSAAttention(fp8)
    root = torch.nn.Module()
    root.layers = torch.nn.ModuleList([torch.nn.Module()])
    root.layers[0].self_attn = attn
    return root, attn


def test_fp8_block_quantized_wq_b_loads_with_its_scale(dsa_layer_env) -> None:
    from vllm.models.kimi_k3.nvidia.dsa_weight_router import DSAWeightRouter

    root, attn = _fake_root(fp8=True)
    params = dict(root.named_parameters())
    wq = attn.dsa_indexer.wq_index
    p = "layers.0.self_attn."
    router = DSAWeightRouter(params, {p: (p, attn)})
    weight = (torch.randn(512, 256) * 0.1).to(torch.float8_e4m3fn)
    scale = torch.rand(4, 2) + 0.5
    wk, wproj = torch.randn(128, 256), torch.randn(4, 256)
    norm = torch.rand(128)
    for name, tensor in [
        (p + "indexer.wq_b.weight", weight),
        (p + "indexer.wq_b.weight_scale_inv", scale),
        (p + "indexer.wk.weight", wk),
        (p + "indexer.weights_proj.weight", wproj),
        (p + "indexer.k_norm.weight", norm),
    ]:
        assert router.load(name, tensor) is not None, name
    router.check_complete()
    assert torch.equal(wq.weight.data.view(torch.uint8), weight.view(torch.uint8))
    assert torch.equal(wq.weight_scale_inv.data, scale)
    wkv = attn.dsa_indexer.wkv_index.weight.data
    assert torch.equal(wkv[:128], wk.to(wkv.dtype))
    assert torch.equal(wkv[128:], wproj.to(wkv.dtype))

    # Without its scale the fp8 wq_b is incomplete.
    root, attn = _fake_root(fp8=True)
    params = dict(root.named_parameters())
    router = DSAWeightRouter(params, {p: (p, attn)})
    router.load(p + "indexer.wq_b.weight", weight)
    router.load(p + "indexer.wk.weight", wk)
    router.load(p + "indexer.weights_proj.weight", wproj)
    router.load(p + "indexer.k_norm.weight", norm)
    with pytest.raises(ValueError, match=r"indexer\.wq_b\.weight_scale_inv"):
        router.check_complete()


@pytest.mark.parametrize("scale_first", [False, True])
def test_fp8_wq_b_and_wk_into_bf16_parameters_are_dequantized(
    dsa_layer_env, scale_first: bool
) -> None:
    """A checkpoint with fp8 ``wq_b`` / ``wk`` (and their block scales) served
    by a model that keeps them in bf16 (``wk`` always shares a bf16 GEMM with
    ``weights_proj``): dequantized on load, in either arrival order."""
    from vllm.models.kimi_k3.nvidia.dsa_weight_router import DSAWeightRouter

    root, attn = _fake_root(fp8=False)
    p = "layers.0.self_attn."
    router = DSAWeightRouter(dict(root.named_parameters()), {p: (p, attn)})
    wq = (torch.randn(512, 256) * 0.3).to(torch.float8_e4m3fn)
    wq_scale = torch.rand(4, 2) + 0.5
    # wk: 128 x 256 with a [1, 2] block scale; weights_proj stays bf16.
    wk = (torch.randn(128, 256) * 0.3).to(torch.float8_e4m3fn)
    wk_scale = torch.rand(1, 2) + 0.5
    pairs = [
        [
            (p + "indexer.wq_b.weight", wq),
            (p + "indexer.wq_b.weight_scale_inv", wq_scale),
        ],
        [(p + "indexer.wk.weight", wk), (p + "indexer.wk.weight_scale_inv", wk_scale)],
    ]
    for pair in pairs:
        for name, tensor in reversed(pair) if scale_first else pair:
            assert router.load(name, tensor) is not None
    wproj = torch.randn(4, 256)
    router.load(p + "indexer.weights_proj.weight", wproj)
    router.load(p + "indexer.k_norm.weight", torch.rand(128))
    router.check_complete()

    def reference(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        full = scale.repeat_interleave(128, 0).repeat_interleave(128, 1)
        return (w.float() * full[: w.shape[0], : w.shape[1]]).to(torch.bfloat16)

    assert torch.equal(attn.dsa_indexer.wq_index.weight.data, reference(wq, wq_scale))
    wkv = attn.dsa_indexer.wkv_index.weight.data
    assert torch.equal(wkv[:128], reference(wk, wk_scale))
    assert torch.equal(wkv[128:], wproj.to(wkv.dtype))


@pytest.mark.parametrize("half", ["weight", "weight_scale_inv"])
def test_half_an_fp8_indexer_tensor_refused(dsa_layer_env, half: str) -> None:
    """An fp8 weight without its scale, or a scale beside a bf16 weight."""
    from vllm.models.kimi_k3.nvidia.dsa_weight_router import DSAWeightRouter

    root, attn = _fake_root(fp8=False)
    p = "layers.0.self_attn."
    router = DSAWeightRouter(dict(root.named_parameters()), {p: (p, attn)})
    if half == "weight":
        router.load(
            p + "indexer.wk.weight", torch.zeros(128, 256).to(torch.float8_e4m3fn)
        )
    else:
        router.load(p + "indexer.wk.weight", torch.zeros(128, 256))
        router.load(p + "indexer.wk.weight_scale_inv", torch.ones(1, 2))
    with pytest.raises(ValueError, match=rf"indexer\.wk\.{half}'.*other half"):
        router.check_complete()


def test_partial_reload_of_other_layers_is_not_refused(dsa_layer_env) -> None:
    """Only layers that received tensors in a call must be complete (a
    weight refit may send a subset of layers)."""
    from vllm.models.kimi_k3.nvidia.dsa_weight_router import DSAWeightRouter

    p = "layers.0.self_attn."
    root, attn = _fake_root(fp8=False)
    router = DSAWeightRouter(dict(root.named_parameters()), {p: (p, attn)})
    assert router.load("layers.1.mlp.down_proj.weight", torch.zeros(1)) is None
    router.check_complete()


# -- vLLM's own loader ---------------------------------------------------------


def test_default_model_loader_end_to_end(dsa_layer_env, tmp_path: Path) -> None:
    """vLLM's ``DefaultModelLoader`` reads the tiny checkpoint's safetensors
    (its every-parameter-initialized check included); then the attention
    layers' post-load pass and our model-level hook run in the loader's
    order."""
    import copy

    from vllm.model_executor.model_loader import get_model_loader

    env = dsa_layer_env
    path = write_tiny_checkpoint(tmp_path / "k31", seed=7)
    model = build(env)
    model_config = copy.copy(env.vllm_config.model_config)
    model_config.model = str(path)
    loader = get_model_loader(env.vllm_config.load_config)
    with torch.no_grad():
        loader.load_weights(model, model_config)
    ckpt = read_checkpoint(path)
    assert_params_match(model, ckpt, lm_checkpoint_name)
    calls: list[Any] = []
    real = D.KimiK3DSAAttention.pack_projections
    env.monkeypatch.setattr(
        D.KimiK3DSAAttention,
        "pack_projections",
        lambda self: (calls.append(self), real(self))[1],
    )
    # The loader's post-load sequence (model_loader/utils.py
    # process_weights_after_loading) minus its first pass, the quant methods'
    # CPU repacking, which needs vLLM's CPU kernels (vllm._C) that the CUDA
    # wheel lacks: then every attention layer's own pass, then the model-level
    # hook, on the top-level model.
    from vllm.model_executor.layers.attention import is_deferred_attention_layer

    for _, module in model.named_modules():
        if is_deferred_attention_layer(module):
            module.process_weights_after_loading(model_config.dtype)
    assert hasattr(model, "process_weights_after_loading")
    model.process_weights_after_loading()
    assert calls == [model.model.layers[i].self_attn for i in DSA_LAYERS]


@pytest.mark.parametrize(
    "mm_prefix", ["language_model.model.layers.", "language_model.layers."]
)
def test_multimodal_naming_through_the_kimi_k3_mapper(
    dsa_layer_env, tmp_path: Path, mm_prefix: str
) -> None:
    """``KimiK3ForConditionalGeneration.load_weights`` is an
    ``AutoWeightsLoader`` with its ``hf_to_vllm_mapper`` over a
    ``language_model`` (the registered ``KimiLinearForCausalLM``); the text
    weights of the multimodal checkpoint reach our loader the same way."""
    from vllm.model_executor.models.utils import AutoWeightsLoader
    from vllm.models.kimi_k3.nvidia.model import KimiK3ForConditionalGeneration

    lm = build(dsa_layer_env)
    holder = torch.nn.Module()
    holder.language_model = lm
    ckpt = read_checkpoint(write_tiny_checkpoint(tmp_path / "k31"))
    mm = {}
    for name, tensor in ckpt.items():
        if name.startswith("model.layers."):
            name = mm_prefix + name[len("model.layers.") :]
        else:
            name = "language_model." + name
        mm[name] = tensor
    with torch.no_grad():
        loaded = AutoWeightsLoader(holder).load_weights(
            iter(list(mm.items())),
            mapper=KimiK3ForConditionalGeneration.hf_to_vllm_mapper,
        )
    assert loaded == {"language_model." + n for n, _ in lm.named_parameters()}
    assert_params_match(lm, ckpt, lm_checkpoint_name)


def test_vllm_initialize_model_resolves_the_wired_architecture(dsa_layer_env) -> None:
    """vLLM's own ``initialize_model`` (registry resolution of
    ``KimiLinearForCausalLM``, signature inspection, config context) builds the
    DSA model: the seams patch the registered classes in place."""
    from vllm.model_executor.model_loader.utils import initialize_model
    from vllm.utils.torch_utils import set_default_torch_dtype

    env = dsa_layer_env
    env.monkeypatch.setattr(torch.cuda, "Stream", _NoCudaStream)
    with set_default_torch_dtype(torch.bfloat16):
        model = initialize_model(vllm_config=env.vllm_config)
    assert type(model).__name__ == "KimiLinearForCausalLM"
    attns = [model.model.layers[i].self_attn for i in DSA_LAYERS]
    assert all(isinstance(a, D.KimiK3DSAAttention) for a in attns)
    assert all(a.topk_indices_buffer is model.model.topk_indices_buffer for a in attns)


# -- the multimodal architecture and its MTP draft, end to end ---------------


@pytest.fixture(scope="module")
def multimodal_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_checkpoint(
        tmp_path_factory.mktemp("tiny_k31_mm"), multimodal=True, seed=11
    )


@pytest.fixture(scope="module")
def multimodal_vllm_config(multimodal_checkpoint: Path, dsa_vllm_config: Any) -> Any:
    """The real engine configuration of the multimodal tiny checkpoint with
    the Kimi K3 MTP draft (``--speculative-config kimi_k3_mtp``), sized like
    the session's text-only one."""
    from engine_configs import create_engine_config

    return create_engine_config(
        multimodal_checkpoint,
        max_model_len=dsa_vllm_config.model_config.max_model_len,
        max_num_batched_tokens=dsa_vllm_config.scheduler_config.max_num_batched_tokens,
        speculative_config={"method": "kimi_k3_mtp", "num_speculative_tokens": 1},
    )


def test_the_row_log_names_the_mtp_layers(multimodal_vllm_config: Any) -> None:
    from vllm.models.kimi_k3.common.dsa_block_size import packed_row_contents

    text = multimodal_vllm_config.model_config.hf_text_config
    assert text.num_nextn_predict_layers >= 1
    assert packed_row_contents(multimodal_vllm_config) == (
        f"the MLA and indexer pages of {len(DSA_LAYERS)} DSA layers and the MTP "
        f"draft's {text.num_nextn_predict_layers} DSA layer(s), added after the "
        "block was sized"
    )


def test_multimodal_target_and_mtp_draft_load_end_to_end(
    dsa_layer_env, multimodal_checkpoint: Path, multimodal_vllm_config: Any
) -> None:
    """``KimiK3ForConditionalGeneration`` and its ``KimiK3MTP`` draft, built by
    vLLM's ``initialize_model`` from the real engine configuration (the
    draft's model config comes from the speculative config) and loaded by
    vLLM's ``DefaultModelLoader`` from the multimodal tiny checkpoint."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.model_executor.model_loader.utils import initialize_model
    from vllm.utils.torch_utils import set_default_torch_dtype

    cfg = multimodal_vllm_config
    env = dsa_layer_env
    env.monkeypatch.setattr(cfg.compilation_config, "static_forward_context", {})
    env.monkeypatch.setattr(torch.cuda, "Stream", _NoCudaStream)
    assert cfg.cache_config.cache_dtype == "fp8_ds_mla"
    draft_config = cfg.speculative_config.draft_model_config
    assert draft_config.architecture == "KimiK3MTPModel"
    loader = get_model_loader(cfg.load_config)
    ckpt = read_checkpoint(multimodal_checkpoint)
    with set_current_vllm_config(cfg), set_default_torch_dtype(torch.bfloat16):
        target = initialize_model(vllm_config=cfg)
        draft = initialize_model(vllm_config=cfg, model_config=draft_config)
    assert type(target).__name__ == "KimiK3ForConditionalGeneration"
    assert type(draft).__name__ == "KimiK3MTP"
    lm = target.language_model
    for idx in DSA_LAYERS:
        assert isinstance(lm.model.layers[idx].self_attn, D.KimiK3DSAAttention)
    mtp_attn = draft.model.layers[str(MTP_LAYER)].mtp_block.self_attn
    assert isinstance(mtp_attn, D.KimiK3DSAAttention)
    assert mtp_attn.topk_indices_buffer is draft.model.topk_indices_buffer

    with torch.no_grad():
        loader.load_weights(target, cfg.model_config)
        loader.load_weights(draft, draft_config)
    text = {
        k.removeprefix("language_model."): v
        for k, v in ckpt.items()
        if k.startswith("language_model.")
    }
    assert assert_params_match(lm, text, lm_checkpoint_name) == len(
        list(lm.named_parameters())
    )
    assert assert_params_match(draft, text, _mtp_ckpt_name) == len(
        list(draft.named_parameters())
    )
    calls: list[Any] = []
    env.monkeypatch.setattr(
        D.KimiK3DSAAttention, "pack_projections", lambda self: calls.append(self)
    )
    target.process_weights_after_loading()
    draft.process_weights_after_loading()
    assert calls == [lm.model.layers[i].self_attn for i in DSA_LAYERS] + [mtp_attn]


def test_quant_config_ignore_list_follows_the_indexer_rename() -> None:
    """An fp8 ``ignored_layers`` entry naming the checkpoint's ``wq_b`` keeps
    the DSA layer's ``wq_index`` unquantized."""
    from types import SimpleNamespace

    from vllm.model_executor.layers.quantization.fp8 import Fp8Config
    from vllm.models.kimi_k3.nvidia.dsa_model import map_indexer_names_in_quant_config

    quant_config = Fp8Config(
        is_checkpoint_fp8_serialized=True,
        activation_scheme="dynamic",
        ignored_layers=[
            "model.layers.3.self_attn.indexer.wq_b",
            "model.layers.3.self_attn.kv_b_proj",
            "re:.*indexer.wq_b",
        ],
        weight_block_size=[128, 128],
    )
    cfg = SimpleNamespace(quant_config=quant_config)
    for _ in range(2):  # idempotent
        map_indexer_names_in_quant_config(cfg)
        assert quant_config.ignored_layers == [
            "model.layers.3.self_attn.dsa_indexer.wq_index",
            "model.layers.3.self_attn.kv_b_proj",
            "re:.*indexer.wq_b",
        ]
    map_indexer_names_in_quant_config(SimpleNamespace(quant_config=None))


# -- dtypes and scales; missing tensors named through vLLM's own loader --------


@pytest.mark.parametrize(
    ("tensor", "dtype"),
    [
        ("indexer.weights_proj.weight", torch.float8_e4m3fn),
        ("indexer.k_norm.weight", torch.float8_e4m3fn),
        ("indexer.k_norm.bias", torch.int8),
        ("indexer.wk.weight", torch.int8),
        ("q_a_proj.weight", torch.float8_e4m3fn),
    ],
)
def test_quantized_tensor_into_an_unquantized_parameter_refused(
    dsa_layer_env, tmp_path: Path, tensor: str, dtype: torch.dtype
) -> None:
    """The weight loaders copy with a cast: quantized values without their
    scale would load as if they were the weights. Refused on arrival, naming
    the tensor, its dtype and what the parameter takes."""
    model = build(dsa_layer_env)
    ckpt = read_checkpoint(write_tiny_checkpoint(tmp_path / "k31"))
    name = f"model.layers.{DSA_LAYERS[0]}.self_attn.{tensor}"
    ckpt[name] = ckpt[name].to(dtype)
    with pytest.raises(ValueError) as err:
        load(model, ckpt)
    message = str(err.value)
    assert "\n" not in message
    dtype_name = str(dtype).removeprefix("torch.")
    assert f"checkpoint tensor '{name.removeprefix('model.')}'" in message
    assert f"is {dtype_name}, which parameter" in message
    assert "accepted: bfloat16, float16 or float32" in message


def test_unquantized_weight_into_an_fp8_parameter_refused(dsa_layer_env) -> None:
    """A bf16 wq_b for a block-quantized fp8 wq_index would be cast to fp8
    without a scale."""
    from vllm.models.kimi_k3.nvidia.dsa_weight_router import DSAWeightRouter

    root, attn = _fake_root(fp8=True)
    p = "layers.0.self_attn."
    router = DSAWeightRouter(dict(root.named_parameters()), {p: (p, attn)})
    with pytest.raises(ValueError) as err:
        router.load(p + "indexer.wq_b.weight", torch.randn(512, 256))
    assert (
        f"checkpoint tensor '{p}indexer.wq_b.weight' (the weight of the indexer's "
        "query projection) is float32, which parameter"
    ) in str(err.value)
    assert "accepted: a float8_e4m3fn weight with its weight_scale_inv" in str(
        err.value
    )


def test_fp8_scale_of_a_dtype_it_cannot_be_refused(dsa_layer_env) -> None:
    from vllm.models.kimi_k3.nvidia.dsa_weight_router import DSAWeightRouter

    root, attn = _fake_root(fp8=False)
    p = "layers.0.self_attn."
    router = DSAWeightRouter(dict(root.named_parameters()), {p: (p, attn)})
    router.load(p + "indexer.wk.weight", torch.zeros(128, 256).to(torch.float8_e4m3fn))
    with pytest.raises(ValueError) as err:
        router.load(
            p + "indexer.wk.weight_scale_inv", torch.ones(1, 2, dtype=torch.int32)
        )
    assert "'layers.0.self_attn.indexer.wk.weight_scale_inv'" in str(err.value)
    assert "is int32; accepted: float32, bfloat16 or float16 scales" in str(err.value)


@pytest.mark.parametrize(
    ("missing", "purpose"),
    [
        (
            "indexer.k_norm.weight",
            "the weight of the indexer's key norm, applied to every key before "
            "it is cached",
        ),
        ("indexer.wq_b.weight", "the weight of the indexer's query projection"),
    ],
)
def test_missing_dsa_tensor_named_through_vllms_loader(
    dsa_layer_env, tmp_path: Path, missing: str, purpose: str
) -> None:
    """vLLM's DefaultModelLoader would refuse a missing norm with its generic
    "Following weights were not initialized" naming a vLLM parameter; the
    DSA layer, the checkpoint tensor and what it is for are named instead. A
    linear's weight is exempt from that check (UnquantizedLinearMethod
    post-processes it), so the model-level post-load hook, which runs right
    after, refuses it, in the same words."""
    import copy

    from safetensors.torch import save_file

    from kimi_k3_dsa_tools.tiny_checkpoint import CHECKPOINT_FILE
    from vllm.model_executor.model_loader import get_model_loader

    env = dsa_layer_env
    path = write_tiny_checkpoint(tmp_path / "k31")
    layer = DSA_LAYERS[-1]
    name = f"model.layers.{layer}.self_attn.{missing}"
    save_file(_drop(read_checkpoint(path), name), str(path / CHECKPOINT_FILE))
    model = build(env)
    model_config = copy.copy(env.vllm_config.model_config)
    model_config.model = str(path)
    loader = get_model_loader(env.vllm_config.load_config)
    with pytest.raises(ValueError) as err, torch.no_grad():
        loader.load_weights(model, model_config)
        model.process_weights_after_loading()
    message = str(err.value)
    assert "\n" not in message
    assert "not initialized" not in message
    assert f"Kimi K3.1 DSA layer 'layers.{layer}.self_attn'" in message
    assert f"'layers.{layer}.self_attn.{missing}' ({purpose})" in message
