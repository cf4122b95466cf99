# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The specification's public names at its paths, with the signatures it
shows (seed 001: ``common/dsa_cache.py``; seed 000: ``nvidia/dsa.py`` and the
ops it calls as that module's names), and the exceptions its layers raise
where the code used to assert."""

from __future__ import annotations

import importlib
import inspect
from types import SimpleNamespace

import pytest
import torch
from layer_builders import (
    build,
    build_indexer,
    cpu_post_load,
    fill_random,
    roped_indexer_layer,
)

import vllm.models.kimi_k3.common.dsa_cache as dsa_cache
import vllm.models.kimi_k3.nvidia.dsa as D
from vllm.models.kimi_k3.common.dsa_config import DSAConfig
from vllm.v1.attention.backends.mla import indexer as v32_indexer

CACHE = "vllm.models.kimi_k3.common.dsa_cache"
DSA = "vllm.models.kimi_k3.nvidia.dsa"
OPS = "vllm.models.kimi_k3.nvidia.dsa_ops"

# Parameter names, in order, as the specification shows them.
CACHE_SIGNATURES = {
    "kimi_k3_indexer_uses_fp4": ["vllm_config"],
    "indexer_cache_entry_bytes": ["head_dim", "use_fp4_cache"],
    "dense_mla_draft_bytes_per_token": ["vllm_config"],
    "packed_dsa_block_size": [
        "vllm_config",
        "mla_bytes_per_token",
        "state_bytes",
        "alignment",
    ],
}
# The ops seed 000 calls as names of nvidia/dsa.py, with the number of
# positional arguments it passes: the prologue takes the four caches and slot
# mappings after its ten inputs.
OP_CALLS = {
    "dsa_fused_prologue": (10, 14),
    "mxfp4_fused_prologue": (10, 14),
    "indexer_k_norm_quant_insert": (8, 8),
    "mxfp4_k_norm_quant_insert": (8, 8),
    "indexer_q_quant_fold_weights": (4, 4),
    "mxfp4_q_quant": (4, 4),
}
ATTENTION_PARAMS = [
    "config",
    "hidden_size",
    "num_heads",
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "v_head_dim",
    "q_lora_rank",
    "kv_lora_rank",
    "cache_config",
    "quant_config",
    "prefix",
    "reduce_results",
    "topk_indices_buffer",
    "aux_stream",
]
INDEXER_PARAMS = [
    "vllm_config",
    "hidden_size",
    "index_q_input_size",
    "index_head_dim",
    "index_num_heads",
    "index_topk",
    "rms_norm_eps",
    "index_rope_dim",
    "index_k_norm_type",
    "cache_config",
    "quant_config",
    "topk_indices_buffer",
    "prefix",
]


def _names(fn) -> list[str]:
    return list(inspect.signature(fn).parameters)


@pytest.mark.parametrize("name", sorted(CACHE_SIGNATURES))
def test_cache_functions_at_their_path(name):
    fn = getattr(importlib.import_module(CACHE), name)
    assert inspect.isfunction(fn) and fn.__module__ == CACHE
    assert _names(fn) == CACHE_SIGNATURES[name]


def test_indexer_metadata_builder_at_its_path():
    cls = importlib.import_module(CACHE).KimiK3IndexerMetadataBuilder
    assert issubclass(cls, v32_indexer.DeepseekV32IndexerMetadataBuilder)
    assert _names(cls.build) == [
        "self",
        "common_prefix_len",
        "common_attn_metadata",
        "fast_build",
    ]


@pytest.mark.parametrize("name", sorted(OP_CALLS))
def test_ops_by_the_specification_names(name):
    """Each op is one public function of the ops layer, importable from
    nvidia/dsa.py by the same name, taking the arguments seed 000 passes."""
    op = getattr(importlib.import_module(OPS), name)
    assert getattr(importlib.import_module(DSA), name) is op
    assert name in importlib.import_module(OPS).__all__
    assert name in D.__all__
    required, most = OP_CALLS[name]
    signature = inspect.signature(op)
    signature.bind(*range(required))
    signature.bind(*range(most))
    with pytest.raises(TypeError):
        signature.bind(*range(most + 1))


def test_layer_classes_and_their_signatures():
    module = importlib.import_module(DSA)
    init = module.KimiK3DSAAttention.__init__
    assert _names(init)[1 : 1 + len(ATTENTION_PARAMS)] == ATTENTION_PARAMS
    assert _names(module.KimiK3DSAIndexer.__init__)[1:] == INDEXER_PARAMS
    assert _names(module.KimiK3DSAIndexerKNorm.__init__) == ["self", "dim", "eps"]
    assert _names(module.KimiK3DSAIndexer.score) == [
        "self",
        "hidden_states",
        "index_q",
        "index_weights",
        "index_k",
    ]
    assert _names(module.KimiK3DSAAttention.pack_projections) == ["self"]
    # The seed's layout: the three classes defined in nvidia/dsa.py, the
    # fused forward as the attention's own methods.
    for cls in (
        module.KimiK3DSAAttention,
        module.KimiK3DSAIndexer,
        module.KimiK3DSAIndexerKNorm,
    ):
        assert cls.__module__ == DSA, cls
    attention = module.KimiK3DSAAttention
    assert _names(attention.forward) == ["self", "positions", "hidden_states"]
    assert _names(attention._fused_attention) == ["self", "hidden_states"]
    forward = inspect.signature(module.KimiK3DSAIndexer.forward).parameters
    assert list(forward) == [
        "self",
        "hidden_states",
        "index_q_input",
        "positions",
        "rotary_emb",
    ]
    assert forward["positions"].default is None
    assert forward["rotary_emb"].default is None
    assert _names(module.KimiK3DSAIndexerKNorm.forward) == ["self", "x"]
    for name in ("KimiK3DSAIndexer", "KimiK3DSAIndexerKNorm"):
        assert name in module.__all__


def _defaults(fn) -> dict:
    return {
        name: param.default
        for name, param in inspect.signature(fn).parameters.items()
        if param.default is not inspect.Parameter.empty
    }


def test_defaults_and_the_attributes_the_specification_sets(dsa_layer_env):
    """The specification's defaults, one tensor back from each forward, and
    the attributes its constructors set, with their values."""
    module = importlib.import_module(DSA)
    seed = {
        "cache_config": None,
        "quant_config": None,
        "prefix": "",
        "reduce_results": True,
        "topk_indices_buffer": None,
        "aux_stream": None,
    }
    # The specification's, first; ours (keyword arguments of the model's
    # state) may follow.
    ours = _defaults(module.KimiK3DSAAttention.__init__)
    assert list(ours.items())[: len(seed)] == list(seed.items())
    assert _defaults(module.KimiK3DSAIndexer.__init__) == {
        "index_rope_dim": 0,
        "index_k_norm_type": "rmsnorm",
        "cache_config": None,
        "quant_config": None,
        "topk_indices_buffer": None,
        "prefix": "",
    }
    for forward in (
        module.KimiK3DSAAttention.forward,
        module.KimiK3DSAIndexer.forward,
        module.KimiK3DSAIndexerKNorm.forward,
    ):
        assert inspect.signature(forward).return_annotation in (
            torch.Tensor, "torch.Tensor",
        ), forward  # fmt: skip
    config = dsa_layer_env.text_config()
    dsa = config.dsa_config
    layer = build(dsa_layer_env, config)
    assert layer.use_nope is True and layer.rotary_emb is None
    assert (layer.index_topk, layer.index_head_dim) == (
        dsa.index_topk,
        dsa.index_head_dim,
    )
    assert (layer.index_num_heads, layer.index_rope_dim) == (
        dsa.index_num_heads,
        dsa.index_rope_dim,
    )
    assert isinstance(layer.dsa_indexer, module.KimiK3DSAIndexer)
    assert layer.topk_indices_buffer is layer.dsa_indexer.topk_indices_buffer
    assert hasattr(layer, "g_proj") == bool(config.mla_use_output_gate)
    indexer = layer.dsa_indexer
    assert indexer.topk_tokens == dsa.index_topk
    assert indexer.index_rope_dim == dsa.index_rope_dim
    assert indexer.indexer_weight_scale == dsa.index_num_heads**-0.5
    assert indexer.index_softmax_scale == dsa.index_head_dim**-0.5
    assert indexer.quant_block_size == dsa.index_head_dim
    assert indexer.scale_fmt == "ue8m0"
    assert indexer.padded_index_num_heads in (32, 64)
    assert indexer.padded_index_num_heads >= dsa.index_num_heads
    norm = (
        module.KimiK3DSAIndexerKNorm if dsa.index_k_norm_type == "layernorm" else None
    )
    if norm is not None:
        assert isinstance(indexer.k_index_norm, norm)
    for name in (
        "wq_index",
        "wkv_index",
        "k_cache",
        "max_model_len",
        "use_pcp",
        "dense_mha_metadata_layer_name",
        "topk_backend",
        "use_fused_k_insert",
        "dcp_world_size",
        "dcp_rank",
    ):
        assert hasattr(indexer, name), name  # fmt: skip


# --------------------------------------------------------------------------
# Exceptions where the specification raises (python -O keeps them)
# --------------------------------------------------------------------------


def _fp4_config(pcp: int = 1, index_k_norm_type: str = "layernorm"):
    """Stub config: what kimi_k3_indexer_uses_fp4 reads."""
    dsa = DSAConfig(
        index_topk=128,
        index_head_dim=128,
        index_num_heads=32,
        index_k_norm_type=index_k_norm_type,
    )
    return SimpleNamespace(
        model_config=SimpleNamespace(hf_text_config=SimpleNamespace(dsa_config=dsa)),
        parallel_config=SimpleNamespace(prefill_context_parallel_size=pcp),
    )


def test_mxfp4_keys_with_pcp_refused(monkeypatch):
    # Stub: answer "SM10x" for vLLM's MXFP4 capability check.
    monkeypatch.setattr(v32_indexer, "dsa_indexer_uses_fp4", lambda cfg: True)
    assert dsa_cache.kimi_k3_indexer_uses_fp4(_fp4_config()) is True
    with pytest.raises(ValueError, match="prefill context parallelism"):
        dsa_cache.kimi_k3_indexer_uses_fp4(_fp4_config(pcp=2))
    with pytest.raises(ValueError, match="fused Kimi K3 DSA key insert"):
        dsa_cache.kimi_k3_indexer_uses_fp4(_fp4_config(index_k_norm_type="rmsnorm"))


def test_indexer_builder_with_pcp_raises(monkeypatch):
    """The builder's own guard, behind the PCP refusal it runs first: a base
    class that turned PCP on (stubbed) is refused, not asserted."""

    def base_init(self, *args, **kwargs):
        self.use_pcp = True

    monkeypatch.setattr(dsa_cache, "check_dsa_pcp", lambda parallel_config: None)
    monkeypatch.setattr(
        v32_indexer.DeepseekV32IndexerMetadataBuilder, "__init__", base_init
    )
    with pytest.raises(NotImplementedError, match="packed DSA caches with PCP"):
        dsa_cache.KimiK3IndexerMetadataBuilder(None, [], None, torch.device("cpu"))


def test_indexer_rope_needs_positions(dsa_layer_env):
    indexer = roped_indexer_layer(dsa_layer_env).dsa_indexer
    with pytest.raises(ValueError, match="requires positions"):
        indexer(torch.randn(2, 256), torch.randn(2, 1536))


def test_prologue_slot_check_needs_both_slot_mappings():
    from vllm.models.kimi_k3.nvidia.dsa_ops import dsa_fused_prologue

    cache = torch.zeros(1, 64, 656, dtype=torch.uint8)
    tensors = [torch.zeros(1)] * 10
    with pytest.raises(ValueError, match="index_slot_mapping are required"):
        dsa_fused_prologue(*tensors, cache, None, cache, None, check_slots=True)


def test_reference_prologue_needs_both_slot_mappings():
    from vllm.models.kimi_k3.nvidia.dsa_ops import reference

    q_c, kv_c, k_pe, index_k = (torch.randn(2, n) for n in (1536, 512, 64, 128))
    weights = [torch.ones(n) for n in (1536, 512, 128)] + [torch.zeros(128)]
    mla = torch.zeros(1, 64, 656, dtype=torch.uint8)
    index = torch.zeros(1, 64, 132, dtype=torch.uint8)
    topk = torch.zeros(2, 128, dtype=torch.int32)
    with pytest.raises(ValueError, match="index_slot_mapping are required"):
        reference.fused_prologue(
            q_c, kv_c, k_pe, index_k, *weights, 1e-5, topk, mla, None, index, None
        )


def test_indexer_cache_views_refuse_a_cache_of_another_format():
    from vllm.models.kimi_k3.nvidia.dsa_ops.formats import indexer_block_views

    fp8_cache = torch.zeros(2, 64, 132, dtype=torch.uint8)
    values, scales = indexer_block_views(fp8_cache, 128, fp4=False)
    assert (values.shape, scales.shape) == ((2, 64, 128), (2, 64, 4))
    with pytest.raises(ValueError, match="MXFP4 keys take 64 \\+ 4"):
        indexer_block_views(fp8_cache, 128, fp4=True)
    with pytest.raises(ValueError, match="must be uint8"):
        indexer_block_views(fp8_cache.view(torch.int8), 128, fp4=False)


# --------------------------------------------------------------------------
# The layers call the ops by those names, one per key format
# --------------------------------------------------------------------------


class _Called(Exception):
    pass


def _recorder(name: str, calls: list[str]):
    def op(*args, **kwargs):
        calls.append(name)
        assert "fp4" not in kwargs  # the name carries the format
        raise _Called

    return op


@pytest.mark.parametrize("fp4", [False, True])
def test_indexer_scores_with_the_query_op_of_its_format(
    dsa_layer_env, monkeypatch, fp4
):
    calls: list[str] = []
    for name in ("indexer_q_quant_fold_weights", "mxfp4_q_quant"):
        monkeypatch.setattr(D, name, _recorder(name, calls))
    indexer = build_indexer(dsa_layer_env)
    indexer.use_fp4_cache = fp4
    with pytest.raises(_Called):
        indexer.score(torch.randn(2, 256), torch.randn(2, 32, 128), None, None)
    assert calls == ["mxfp4_q_quant" if fp4 else "indexer_q_quant_fold_weights"]


@pytest.mark.parametrize("fp4", [False, True])
def test_fused_forward_runs_the_prologue_of_its_format(
    dsa_layer_env, extension, monkeypatch, fp4
):
    from vllm.forward_context import set_forward_context

    calls: list[str] = []
    for name in ("dsa_fused_prologue", "mxfp4_fused_prologue"):
        monkeypatch.setattr(D, name, _recorder(name, calls))
    layer = build(dsa_layer_env)
    fill_random(layer)
    cpu_post_load(layer)
    layer.pack_projections()
    assert layer._packed is not None
    layer.dsa_indexer.use_fp4_cache = fp4
    with set_forward_context(None, dsa_layer_env.vllm_config), pytest.raises(_Called):
        layer._fused_attention(torch.randn(3, 256))
    assert calls == ["mxfp4_fused_prologue" if fp4 else "dsa_fused_prologue"]
