# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
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
from model_builders import (
    DSA_LAYERS,
    KDA_LAYERS,
    MTP_LAYER,
    NUM_LAYERS,
    assert_params_match,
    build,
    lm_checkpoint_name,
    load,
    plain_vllm_config,
    read_checkpoint,
)

import vllm.models.kimi_k3.nvidia.dsa as D
from kimi_k3_dsa_tools.tiny_checkpoint import (
    TINY_DSA_CONFIG,
    tiny_text_config,
    write_tiny_checkpoint,
)


@pytest.fixture
def dsa_log(record_logs):
    """The DSA layer module's log messages."""
    return record_logs(D)


@pytest.mark.overlay_only
def test_seams_registered() -> None:
    import vllm.models.kimi_k3.nvidia.model as model_module
    from vllm.plugins import kimi_k3_dsa
    from vllm.plugins.kimi_k3_dsa import dsa_layers

    for name in ("dsa_layers", "dsa_weights", "dsa_post_load"):
        assert name in kimi_k3_dsa.PATCH_MODULES
    kimi_k3_dsa.register()
    assert model_module.MultiHeadLatentAttention is (
        dsa_layers.kimi_k3_attention_factory
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

    from vllm.models.kimi_k3.common.dsa_verify import topk_indices_buffer_rows

    def cfg(dcp: int) -> Any:
        return SimpleNamespace(
            parallel_config=SimpleNamespace(decode_context_parallel_size=dcp),
            scheduler_config=SimpleNamespace(max_num_batched_tokens=8192),
        )

    assert topk_indices_buffer_rows(cfg(1)) == 8192
    assert topk_indices_buffer_rows(cfg(2)) == 8193
    assert topk_indices_buffer_rows(cfg(8)) == 8199


def test_topk_buffer_is_rows_by_index_topk(dsa_layer_env) -> None:
    from vllm.models.kimi_k3.common.dsa_verify import topk_indices_buffer_rows
    from vllm.models.kimi_k3.nvidia.dsa_model import make_topk_indices_buffer

    cfg = dsa_layer_env.vllm_config
    buf = make_topk_indices_buffer(cfg, device="cpu")
    topk = cfg.model_config.hf_text_config.dsa_config.index_topk
    assert buf.shape == (topk_indices_buffer_rows(cfg), topk)
    assert buf.dtype == torch.int32


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
    assert_params_match(model, ckpt, lm_checkpoint_name)
    # The post-load hook visits no layer.
    model.process_weights_after_loading()


# -- loading ---------------------------------------------------------------
