# SPDX-License-Identifier: Apache-2.0
"""``dsa_config`` parsing, its rules and the Kimi K3 verifier, through vLLM
0.33.0's real configuration path (``EngineArgs.create_engine_config``) on tiny
checkpoint directories."""

import json
import pickle
from typing import Any

import pytest

from vllm.models.kimi_k3.common.dsa_config import (
    DSAConfig,
    KimiK3DSAConfig,
    KimiLinearDSAConfig,
    verify_dsa_vllm_config,
)
from vllm.models.kimi_k3.common.dsa_tiny_checkpoint import (
    TINY_DSA_CONFIG,
    tiny_text_config,
)

ROPE_MODEL = {"mla_use_nope": False}


def dsa(**changes: Any) -> dict[str, Any]:
    """The tiny dsa_config with fields replaced (None deletes a field)."""
    out = dict(TINY_DSA_CONFIG)
    for key, value in changes.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = value
    return out


# (id, text-config overrides, exception type, message pattern). Each entry is a
# distinct bad configuration with its own message.
BAD_CHECKPOINTS = [
    (
        "rope-odd",
        {"dsa_config": dsa(index_rope_dim=3)},
        ValueError,
        r"index_rope_dim must be even and >= 0, got 3",
    ),
    (
        "rope-negative",
        {"dsa_config": dsa(index_rope_dim=-2)},
        ValueError,
        r"index_rope_dim must be even and >= 0, got -2",
    ),
    (
        "rope-over-head-dim",
        {"dsa_config": dsa(index_head_dim=32, index_rope_dim=64)},
        ValueError,
        r"index_rope_dim \(64\) must not exceed index_head_dim \(32\)",
    ),
    (
        "rope-over-qk-rope",
        {**ROPE_MODEL, "dsa_config": dsa(index_rope_dim=96)},
        ValueError,
        r"index_rope_dim \(96\) must not exceed qk_rope_head_dim \(64\)",
    ),
    (
        "rope-under-nope",
        {"dsa_config": dsa(index_rope_dim=32)},
        ValueError,
        r"index_rope_dim \(32\) must be 0 when mla_use_nope",
    ),
    (
        "k-norm-type",
        {"dsa_config": dsa(index_k_norm_type="layer")},
        ValueError,
        r"index_k_norm_type must be 'rmsnorm' or 'layernorm', got 'layer'",
    ),
    (
        "heads-zero",
        {"dsa_config": dsa(index_num_heads=0)},
        ValueError,
        r"index_num_heads must be in 1\.\.64 .* got 0",
    ),
    (
        "heads-65",
        {"dsa_config": dsa(index_num_heads=65)},
        ValueError,
        r"index_num_heads must be in 1\.\.64 .* got 65",
    ),
    (
        "head-dim-100",
        {"dsa_config": dsa(index_head_dim=100)},
        ValueError,
        r"index_head_dim must be a positive multiple of 32 .* got 100",
    ),
    (
        "head-dim-negative",
        {"dsa_config": dsa(index_head_dim=-128)},
        ValueError,
        r"index_head_dim must be a positive multiple of 32 .* got -128",
    ),
    (
        "topk-zero",
        {"dsa_config": dsa(index_topk=0)},
        ValueError,
        r"index_topk must be a positive integer, got 0",
    ),
    (
        "topk-string",
        {"dsa_config": dsa(index_topk="2048")},
        ValueError,
        r"index_topk must be an integer, got '2048' \(str\)",
    ),
    (
        "topk-bool",
        {"dsa_config": dsa(index_topk=True)},
        ValueError,
        r"index_topk must be an integer, got True \(bool\)",
    ),
    (
        "topk-freq-4",
        {"dsa_config": dsa(index_topk_freq=4)},
        NotImplementedError,
        r"index_topk_freq != 1 \(index share\).* got 4",
    ),
    (
        "layers-mismatch",
        {"dsa_config": dsa(index_layers=[4])},
        ValueError,
        r"index_layers \(\[4\]\) must equal the full-attention layers \[4, 5\]",
    ),
    (
        "layers-zero-indexed",
        {"dsa_config": dsa(index_layers=[0, 4])},
        ValueError,
        r"1-indexed layer numbers \(>= 1\), got 0",
    ),
    (
        "layers-duplicate",
        {"dsa_config": dsa(index_layers=[4, 4, 5])},
        ValueError,
        r"index_layers lists a layer twice",
    ),
    (
        "layers-not-a-list",
        {"dsa_config": dsa(index_layers="4,5")},
        ValueError,
        r"index_layers must be a list of 1-indexed layer numbers",
    ),
    (
        "full-attn-not-dsa",
        {
            "linear_attn_config": {
                **tiny_text_config()["linear_attn_config"],
                "full_attn_layers": [5],
            }
        },
        ValueError,
        r"every full-attention layer must be a DSA layer",
    ),
    (
        "missing-topk",
        {"dsa_config": dsa(index_topk=None)},
        ValueError,
        r"dsa_config\.index_topk is required and missing",
    ),
    (
        "missing-head-dim",
        {"dsa_config": dsa(index_head_dim=None)},
        ValueError,
        r"dsa_config\.index_head_dim is required and missing",
    ),
    (
        "missing-heads",
        {"dsa_config": dsa(index_num_heads=None)},
        ValueError,
        r"dsa_config\.index_num_heads is required and missing",
    ),
    (
        "unknown-field",
        {"dsa_config": dsa(index_n_heads=32)},
        ValueError,
        r"unknown field\(s\) \['index_n_heads'\]",
    ),
    (
        "not-an-object",
        {"dsa_config": [2048, 128, 32]},
        ValueError,
        r"dsa_config must be a JSON object or null, got list",
    ),
]


@pytest.mark.parametrize(
    "overrides,exc,match",
    [pytest.param(o, e, m, id=i) for i, o, e, m in BAD_CHECKPOINTS],
)
def test_bad_checkpoint_refused_at_config_loading(
    tiny_checkpoint, engine_config, overrides, exc, match
):
    path = tiny_checkpoint(**overrides)
    with pytest.raises(exc, match=match):
        engine_config(path)


def test_bad_checkpoint_messages_are_distinct():
    patterns = [m for _, _, _, m in BAD_CHECKPOINTS]
    assert len(patterns) >= 20
    assert len(set(patterns)) == len(patterns)


# Serving flags refused for a valid checkpoint: (id, engine kwargs, text-config
# overrides, message pattern).
BAD_FLAGS = [
    (
        "kv-bfloat16",
        {"kv_cache_dtype": "bfloat16"},
        {},
        r"--kv-cache-dtype 'bfloat16' is not supported for Kimi-K3.1 DSA models: "
        r"accepted values are \['auto', 'fp8', 'fp8_ds_mla', 'fp8_e4m3'\]",
    ),
    (
        "kv-fp8-e5m2",
        {"kv_cache_dtype": "fp8_e5m2"},
        {},
        r"--kv-cache-dtype 'fp8_e5m2' is not supported",
    ),
    (
        "indexer-nvfp4",
        {"attention_config": {"indexer_kv_dtype": "nvfp4"}},
        {},
        r"indexer_kv_dtype 'nvfp4' is not supported for Kimi-K3.1 DSA: accepted "
        r"values are \['auto', 'fp8', 'mxfp4'\]",
    ),
    (
        "mxfp4-rmsnorm",
        {"attention_config": {"indexer_kv_dtype": "mxfp4"}},
        {"dsa_config": dsa(index_k_norm_type="rmsnorm")},
        r"indexer_kv_dtype='mxfp4' needs the fused Kimi K3 DSA key insert .*"
        r"index_k_norm_type='rmsnorm'",
    ),
    (
        "mxfp4-rope",
        {"attention_config": {"indexer_kv_dtype": "mxfp4"}},
        {**ROPE_MODEL, "dsa_config": dsa(index_rope_dim=32)},
        r"needs the fused Kimi K3 DSA key insert .* index_rope_dim=32",
    ),
]


@pytest.mark.parametrize(
    "kwargs,overrides,match",
    [pytest.param(k, o, m, id=i) for i, k, o, m in BAD_FLAGS],
)
def test_bad_serving_flags_refused(
    tiny_checkpoint, engine_config, kwargs, overrides, match
):
    with pytest.raises(ValueError, match=match):
        engine_config(tiny_checkpoint(**overrides), **kwargs)


def test_mxfp4_refused_with_prefill_context_parallelism(tiny_checkpoint, engine_config):
    config = engine_config(
        tiny_checkpoint(), attention_config={"indexer_kv_dtype": "mxfp4"}
    )
    # PCP > 1 needs several ranks to configure; the rule reads only this field.
    config.parallel_config.prefill_context_parallel_size = 2
    with pytest.raises(ValueError, match=r"not supported with prefill context"):
        verify_dsa_vllm_config(config)


def test_mxfp4_refused_off_sm10x(tiny_checkpoint, engine_config, monkeypatch):
    config = engine_config(tiny_checkpoint())
    config.attention_config.indexer_kv_dtype = "mxfp4"
    # A CPU cannot be an SM90 GPU: stub the platform query only.
    from vllm.platforms import current_platform

    monkeypatch.setattr(current_platform, "is_cuda", lambda: True)
    monkeypatch.setattr(
        current_platform, "is_device_capability_family", lambda f: False
    )
    monkeypatch.setattr(current_platform, "get_device_capability", lambda: 90)
    with pytest.raises(ValueError, match=r"needs an SM10x GPU .* this GPU is SM90"):
        verify_dsa_vllm_config(config)
    monkeypatch.setattr(current_platform, "is_device_capability_family", lambda f: True)
    verify_dsa_vllm_config(config)


def test_rocm_refused_with_the_seed_reason(tiny_checkpoint, engine_config, monkeypatch):
    config = engine_config(tiny_checkpoint())
    from vllm.platforms import current_platform

    monkeypatch.setattr(current_platform, "is_rocm", lambda: True)
    with pytest.raises(NotImplementedError, match=r"ROCm is not supported"):
        verify_dsa_vllm_config(config)


def test_xpu_refused(tiny_checkpoint, engine_config, monkeypatch):
    config = engine_config(tiny_checkpoint())
    from vllm.platforms import current_platform

    monkeypatch.setattr(current_platform, "is_xpu", lambda: True)
    with pytest.raises(NotImplementedError, match=r"not supported on XPU"):
        verify_dsa_vllm_config(config)


def test_specialized_decode_refused(tiny_checkpoint, engine_config):
    with pytest.raises(
        NotImplementedError,
        match=r"decode_backend='latency_specialized' is not supported for Kimi-K3.1",
    ):
        engine_config(
            tiny_checkpoint(),
            additional_config={"decode_backend": "latency_specialized"},
        )


@pytest.mark.parametrize(
    "requested,expected",
    [
        ("auto", "fp8_ds_mla"),
        ("fp8", "fp8_ds_mla"),
        ("fp8_e4m3", "fp8_ds_mla"),
        ("fp8_ds_mla", "fp8_ds_mla"),
    ],
)
def test_cache_dtype_table(tiny_checkpoint, engine_config, requested, expected):
    config = engine_config(tiny_checkpoint(), kv_cache_dtype=requested)
    assert config.cache_config.cache_dtype == expected


@pytest.mark.parametrize("indexer_kv_dtype", ["auto", "fp8", "mxfp4"])
def test_indexer_kv_dtype_accepted(tiny_checkpoint, engine_config, indexer_kv_dtype):
    config = engine_config(
        tiny_checkpoint(), attention_config={"indexer_kv_dtype": indexer_kv_dtype}
    )
    assert config.attention_config.indexer_kv_dtype == indexer_kv_dtype


def test_dsa_config_parsed(tiny_checkpoint, engine_config):
    config = engine_config(tiny_checkpoint(dsa_config=dsa(index_layers=[5, 4])))
    text_config = config.model_config.hf_text_config
    assert isinstance(text_config, KimiLinearDSAConfig)
    parsed = text_config.dsa_config
    assert isinstance(parsed, DSAConfig)
    assert (parsed.index_topk, parsed.index_head_dim, parsed.index_num_heads) == (
        64,
        128,
        4,
    )
    assert parsed.index_layers == (5, 4)
    # 0.33.0's FlashMLA sparse metadata builder reads the top-level field.
    assert text_config.index_topk == 64
    with pytest.raises(AttributeError):
        parsed.index_topk = 1  # type: ignore[misc]


def test_defaults_of_optional_fields():
    parsed = DSAConfig.from_dict(
        {"index_topk": 2048, "index_head_dim": 128, "index_num_heads": 32}
    )
    assert parsed.index_rope_dim == 0
    assert parsed.index_k_norm_type == "rmsnorm"
    assert parsed.index_topk_freq == 1
    assert parsed.index_layers is None
    assert DSAConfig.from_dict({**parsed.to_dict(), "index_topk_freq": None})


def test_pickle_and_json_round_trip(tiny_checkpoint, engine_config):
    config = engine_config(tiny_checkpoint(dsa_config=dsa(index_layers=[4, 5])))
    text_config = config.model_config.hf_text_config
    # vLLM pickles the whole engine config to its engine core and workers.
    clone = pickle.loads(pickle.dumps(config)).model_config.hf_text_config
    assert clone.dsa_config == text_config.dsa_config
    assert clone.index_topk == 64
    for use_diff in (True, False):
        as_json = json.loads(text_config.to_json_string(use_diff=use_diff))
        assert as_json["dsa_config"] == {**TINY_DSA_CONFIG, "index_layers": [4, 5]}
        assert "index_topk" not in as_json
        as_json.pop("transformers_version", None)
        rebuilt = KimiLinearDSAConfig(**as_json)
        assert rebuilt.dsa_config == text_config.dsa_config
    assert text_config.to_dict()["dsa_config"]["index_layers"] == [4, 5]


def test_plain_kimi_k3_unchanged(tiny_checkpoint, engine_config):
    config = engine_config(tiny_checkpoint(dsa=False))
    text_config = config.model_config.hf_text_config
    assert text_config.dsa_config is None
    assert not hasattr(text_config, "index_topk")
    assert "dsa_config" not in text_config.to_dict()
    # No forcing: the user's cache dtype stays.
    assert config.cache_config.cache_dtype == "auto"
    assert engine_config(tiny_checkpoint(dsa=False), kv_cache_dtype="bfloat16")


def test_multimodal_kimi_k3_config_path(tmp_path):
    from vllm.transformers_utils.config import get_config
    from vllm.transformers_utils.configs.kimi_k3 import KimiK3Config

    (tmp_path / "config.json").write_text(
        json.dumps(
            {
                "model_type": "kimi_k3",
                "architectures": ["KimiK3ForConditionalGeneration"],
                "text_config": tiny_text_config(),
                "vision_config": {},
            }
        )
    )
    config = get_config(str(tmp_path), trust_remote_code=False)
    # The multimodal processor checks isinstance(..., KimiK3Config).
    assert isinstance(config, KimiK3Config)
    assert isinstance(config, KimiK3DSAConfig)
    assert config.text_config.dsa_config == DSAConfig.from_dict(TINY_DSA_CONFIG)
    assert config.get_text_config().index_topk == 64
    reloaded = pickle.loads(pickle.dumps(config))
    assert reloaded.text_config.dsa_config == config.text_config.dsa_config
    assert (
        json.loads(config.to_json_string())["text_config"]["dsa_config"][
            "index_num_heads"
        ]
        == 4
    )
