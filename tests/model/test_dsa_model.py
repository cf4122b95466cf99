# SPDX-License-Identifier: Apache-2.0
"""The Kimi K3.1 model wiring on the CPU: the real vLLM 0.33.0 Kimi K3 model
classes (``KimiLinearForCausalLM``, ``KimiK3MTP``) built from the tiny
checkpoint's real engine configuration, with our general plugin's seams
applied (``dsa_layers``, ``dsa_weights``, ``dsa_post_load``).

Stubbed, and why:

* the CUDA attention-backend selection (``mla_attention.get_attn_backend``
  returns ``FlashMLASparseBackend``; the ``dsa_layer_env`` fixture of
  ``conftest.py``): on a CPU vLLM refuses sparse MLA;
* ``torch.cuda.Stream``: ``KimiLinearModel.__init__`` and
  ``KimiK3MultiTokenPredictorLayer.__init__`` create an aux stream
  unconditionally, which needs a CUDA driver. A placeholder object stands in;
  nothing here runs a forward, so it is never used.

Nothing else is stubbed: KDA layers, dense MLA (on the CPU MLA backend), the
MoE layers, the DSA layers and the loaders are 0.33.0's and ours.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

D = pytest.importorskip("vllm.models.kimi_k3.nvidia.dsa")

from vllm.models.kimi_k3.common.dsa_tiny_checkpoint import (  # noqa: E402
    CHECKPOINT_FILE,
    TINY_DSA_CONFIG,
    TINY_FULL_ATTN_LAYERS,
    TINY_KDA_LAYERS,
    tiny_text_config,
    write_tiny_checkpoint,
)

NUM_LAYERS = len(TINY_KDA_LAYERS) + len(TINY_FULL_ATTN_LAYERS)
MTP_LAYER = NUM_LAYERS  # 0-indexed id of the tiny checkpoint's MTP layer
DSA_LAYERS = [n - 1 for n in TINY_FULL_ATTN_LAYERS]  # 0-indexed
KDA_LAYERS = [n - 1 for n in TINY_KDA_LAYERS]


class _NoCudaStream:
    """Placeholder for ``torch.cuda.Stream()`` (never used without a forward)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass


@pytest.fixture
def dsa_log(record_logs):
    """The DSA layer module's log messages."""
    return record_logs(D)


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


def test_seams_registered() -> None:
    import vllm.models.kimi_k3.nvidia.model as model_module
    from vllm.models.kimi_k3.nvidia import dsa_model
    from vllm.plugins import kimi_k3_dsa

    for name in ("dsa_layers", "dsa_weights", "dsa_post_load"):
        assert name in kimi_k3_dsa.PATCH_MODULES
    kimi_k3_dsa.register()
    assert model_module.MultiHeadLatentAttention is (
        dsa_model.kimi_k3_attention_factory
    )


def test_module_tree_dsa_exactly_at_full_attention_layers(dsa_layer_env) -> None:
    from vllm.models.kimi_k3.nvidia.kda import KimiK3DeltaAttention

    model = build(dsa_layer_env)
    layers = model.model.layers
    assert len(layers) == NUM_LAYERS
    for idx in range(NUM_LAYERS):
        attn = layers[idx].self_attn
        if idx in DSA_LAYERS:
            assert isinstance(attn, D.KimiK3DSAAttention), idx
        else:
            assert idx in KDA_LAYERS
            assert isinstance(attn, KimiK3DeltaAttention), idx
    from vllm.models.kimi_k3.nvidia.dsa_model import dsa_attention_layers

    assert [n for n, _ in dsa_attention_layers(model)] == [
        f"model.layers.{i}.self_attn" for i in DSA_LAYERS
    ]


def test_one_model_level_topk_buffer_and_index_group_builder(
    dsa_layer_env, dsa_log
) -> None:
    model = build(dsa_layer_env)
    inner = model.model
    buf = inner.topk_indices_buffer
    sched = dsa_layer_env.vllm_config.scheduler_config
    assert buf.dtype == torch.int32
    assert tuple(buf.shape) == (
        sched.max_num_batched_tokens,  # DCP 1: no slack rows
        TINY_DSA_CONFIG["index_topk"],
    )
    builder = inner.dsa_index_group_builder
    assert builder.logical_topk_indices is buf
    for idx in DSA_LAYERS:
        attn = inner.layers[idx].self_attn
        assert attn.topk_indices_buffer is buf
        assert attn.dsa_indexer.topk_indices_buffer is buf
        impl = attn.mla_attn.mla_attn.impl
        assert impl.topk_indices_buffer is buf
        # The model-level builder made this layer's group (each K3.1 DSA layer
        # has its own indexer, so it leads its own group).
        assert impl.index_group is not None
        assert impl.index_group.logical_topk_indices is buf
        assert impl.index_group.has_indexer
    groups = {
        id(inner.layers[i].self_attn.mla_attn.mla_attn.impl.index_group)
        for i in DSA_LAYERS
    }
    assert len(groups) == len(DSA_LAYERS)
    # The builder's workspace rows are capped like DeepSeek V3.2's.
    from vllm.v1.attention.backends.mla.index_group import (
        get_sparse_mla_index_group_max_rows,
    )

    assert builder.max_decode_rows == get_sparse_mla_index_group_max_rows(
        dsa_layer_env.vllm_config
    )
    assert not [m for m in dsa_log.messages("warning_once") if "fallback" in m]


def test_topk_buffer_rows_dcp_slack() -> None:
    from types import SimpleNamespace

    from vllm.models.kimi_k3.common.dsa_config import topk_indices_buffer_rows
    from vllm.models.kimi_k3.nvidia.dsa_model import make_topk_indices_buffer

    def cfg(dcp: int) -> Any:
        return SimpleNamespace(
            parallel_config=SimpleNamespace(decode_context_parallel_size=dcp),
            scheduler_config=SimpleNamespace(max_num_batched_tokens=8192),
        )

    assert topk_indices_buffer_rows(cfg(1)) == 8192
    assert topk_indices_buffer_rows(cfg(2)) == 8193
    assert topk_indices_buffer_rows(cfg(8)) == 8199
    buf = make_topk_indices_buffer(cfg(4), 2048, device="cpu")
    assert buf.shape == (8195, 2048) and buf.dtype == torch.int32


def test_dsa_parameter_shapes(dsa_layer_env) -> None:
    model = build(dsa_layer_env)
    c = tiny_text_config()
    h, heads = c["hidden_size"], c["num_attention_heads"]
    q_lora, kv_lora = c["q_lora_rank"], c["kv_lora_rank"]
    nope, rope, v = c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"]
    idx_heads, idx_dim = (
        TINY_DSA_CONFIG["index_num_heads"],
        TINY_DSA_CONFIG["index_head_dim"],
    )
    for idx in DSA_LAYERS:
        params = {
            n: (tuple(p.shape), p.dtype)
            for n, p in model.model.layers[idx].self_attn.named_parameters()
        }
        bf16, fp32 = torch.bfloat16, torch.float32
        assert params == {
            "fused_qkv_a_proj.weight": ((q_lora + kv_lora + rope, h), bf16),
            "q_a_layernorm.weight": ((q_lora,), bf16),
            "q_b_proj.weight": ((heads * (nope + rope), q_lora), bf16),
            "kv_a_layernorm.weight": ((kv_lora,), bf16),
            "kv_b_proj.weight": ((heads * (nope + v), kv_lora), bf16),
            "o_proj.weight": ((h, heads * v), bf16),
            "g_proj.weight": ((heads * v, h), bf16),
            "dsa_indexer.wq_index.weight": ((idx_heads * idx_dim, q_lora), bf16),
            "dsa_indexer.wkv_index.weight": ((idx_dim + idx_heads, h), bf16),
            "dsa_indexer.k_index_norm.weight": ((idx_dim,), fp32),
            "dsa_indexer.k_index_norm.bias": ((idx_dim,), fp32),
        }, idx


def test_mtp_layer_is_dsa_with_the_drafts_model_level_buffer(
    dsa_layer_env, dsa_log
) -> None:
    mtp = build(dsa_layer_env, "mtp")
    attn = mtp.model.layers[str(MTP_LAYER)].mtp_block.self_attn
    assert isinstance(attn, D.KimiK3DSAAttention)
    # The draft's model level is KimiK3MultiTokenPredictor: vLLM's MTP
    # proposer replaces ``draft.model.topk_indices_buffer`` (and every
    # module's attribute) with the target's buffer.
    buf = mtp.model.topk_indices_buffer
    assert attn.topk_indices_buffer is buf
    assert attn.dsa_indexer.topk_indices_buffer is buf
    assert tuple(buf.shape) == (
        dsa_layer_env.vllm_config.scheduler_config.max_num_batched_tokens,
        TINY_DSA_CONFIG["index_topk"],
    )
    assert not [m for m in dsa_log.messages("warning_once") if "fallback" in m]


def test_decoder_layer_built_directly_takes_the_fallback_buffer_and_warns(
    dsa_layer_env, dsa_log
) -> None:
    """A host that builds ``KimiDecoderLayer`` outside a Kimi model gets the
    seed's per-layer fallback buffer, with its warning."""
    from vllm.config import set_current_vllm_config
    from vllm.models.kimi_k3.nvidia.model import KimiDecoderLayer
    from vllm.utils.torch_utils import set_default_torch_dtype

    env = dsa_layer_env
    config = env.vllm_config.model_config.hf_text_config
    with (
        set_current_vllm_config(env.vllm_config),
        set_default_torch_dtype(torch.bfloat16),
    ):
        layer = KimiDecoderLayer(
            config, env.vllm_config, prefix=f"model.layers.{DSA_LAYERS[0]}"
        )
    attn = layer.self_attn
    assert isinstance(attn, D.KimiK3DSAAttention)
    warnings = dsa_log.messages("warning_once")
    assert any(
        "did not receive a model-level topk_indices_buffer" in m for m in warnings
    ), warnings
    buf = attn.topk_indices_buffer
    assert buf.dtype == torch.int32
    assert tuple(buf.shape) == (
        env.vllm_config.scheduler_config.max_num_batched_tokens,
        TINY_DSA_CONFIG["index_topk"],
    )


def test_plain_kimi_k3_still_builds_dense_mla_and_loads(
    dsa_layer_env, tmp_path: Path
) -> None:
    from vllm.models.kimi_k3.nvidia.mla import MultiHeadLatentAttention

    cfg = plain_vllm_config(dsa_layer_env)
    assert cfg.model_config.hf_text_config.dsa_config is None
    model = build(dsa_layer_env, vllm_config=cfg)
    for idx in DSA_LAYERS:
        assert isinstance(model.model.layers[idx].self_attn, MultiHeadLatentAttention)
    assert not any(isinstance(m, D.KimiK3DSAAttention) for m in model.modules())
    assert not hasattr(model.model, "topk_indices_buffer")
    # The plain checkpoint loads through 0.33.0's path (fused_qkv_a_g_proj).
    ckpt = read_checkpoint(write_tiny_checkpoint(tmp_path / "k3", dsa=False))
    assert not [k for k in ckpt if ".indexer." in k]
    loaded = load(model, ckpt)
    assert loaded == {n for n, _ in model.named_parameters()}
    assert_params_match(model, ckpt, _lm_ckpt_name)
    # The post-load hook visits no layer.
    model.process_weights_after_loading()


# -- loading ---------------------------------------------------------------


def _lm_ckpt_name(param_name: str) -> str:
    return param_name


def test_load_tiny_checkpoint_every_parameter(dsa_layer_env, tmp_path: Path) -> None:
    model = build(dsa_layer_env)
    ckpt = read_checkpoint(write_tiny_checkpoint(tmp_path / "k31"))
    loaded = load(model, ckpt)
    assert loaded == {n for n, _ in model.named_parameters()}
    checked = assert_params_match(model, ckpt, _lm_ckpt_name)
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
    assert_params_match(model.model, inner, _lm_ckpt_name)


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
    assert_params_match(model, ckpt, _lm_ckpt_name)


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
    from vllm.models.kimi_k3.nvidia.dsa_weights import DSAWeightRouter

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
    from vllm.models.kimi_k3.nvidia.dsa_weights import DSAWeightRouter

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
    from vllm.models.kimi_k3.nvidia.dsa_weights import DSAWeightRouter

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
    from vllm.models.kimi_k3.nvidia.dsa_weights import DSAWeightRouter

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
    assert_params_match(model, ckpt, _lm_ckpt_name)
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
    assert_params_match(lm, ckpt, _lm_ckpt_name)


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
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(
        model=str(multimodal_checkpoint),
        enable_prefix_caching=False,
        max_model_len=dsa_vllm_config.model_config.max_model_len,
        max_num_batched_tokens=dsa_vllm_config.scheduler_config.max_num_batched_tokens,
        skip_tokenizer_init=True,
        speculative_config={"method": "kimi_k3_mtp", "num_speculative_tokens": 1},
    ).create_engine_config()


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
    assert assert_params_match(lm, text, _lm_ckpt_name) == len(
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
