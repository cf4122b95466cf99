# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""``dsa_config`` parsing, its rules and the Kimi K3 verifier, through vLLM
0.33.0's real configuration path (``EngineArgs.create_engine_config``) on tiny
checkpoint directories."""

import json
import pickle
from typing import Any

import pytest

from kimi_k3_dsa_tools.tiny_checkpoint import (
    TINY_DSA_CONFIG,
    tiny_multimodal_config,
    tiny_text_config,
    write_tiny_config,
)
from vllm.models.kimi_k3.common.dsa_config import (
    DSAConfig,
    KimiK3DSAConfig,
    KimiLinearDSAConfig,
)
from vllm.models.kimi_k3.common.dsa_verify import verify_dsa_vllm_config

ROPE_MODEL = {"mla_use_nope": False}
TINY_LINEAR = tiny_text_config()["linear_attn_config"]


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
        r"index_head_dim must be one of \[32, 64, 128\] .* got 100",
    ),
    (
        "head-dim-negative",
        {"dsa_config": dsa(index_head_dim=-128)},
        ValueError,
        r"index_head_dim must be one of \[32, 64, 128\] .* got -128",
    ),
    (
        "topk-zero",
        {"dsa_config": dsa(index_topk=0)},
        ValueError,
        r"index_topk must be a positive multiple of 128 \(vLLM's FlashMLA sparse "
        r"backend .*\), got 0",
    ),
    (
        "topk-64",
        {"dsa_config": dsa(index_topk=64)},
        ValueError,
        r"index_topk must be a positive multiple of 128 .* got 64",
    ),
    (
        "topk-above-positions",
        {"dsa_config": dsa(index_topk=10_000_000)},
        ValueError,
        r"index_topk \(10000000\) must not exceed max_position_embeddings \(4096\)",
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
        "kda-layer-outside-the-model",
        {"linear_attn_config": {**TINY_LINEAR, "kda_layers": [1, 2, 3, 9]}},
        ValueError,
        r"linear_attn_config.kda_layers holds \[9\], which are not layers of this "
        r"model: layers are numbered 1..5 \(1-indexed\)",
    ),
    (
        "kda-layer-twice",
        {"linear_attn_config": {**TINY_LINEAR, "kda_layers": [1, 2, 3, 3]}},
        ValueError,
        r"linear_attn_config.kda_layers lists layer\(s\) \[3\] twice",
    ),
    (
        "kv-lora-256",
        {"kv_lora_rank": 256},
        ValueError,
        r"kv_lora_rank must be 512 for Kimi-K3.1 DSA, got 256: FlashMLA sparse "
        r"reads the fp8_ds_mla cache as 512 latent \+ 64 rope values",
    ),
    (
        "kv-lora-missing",
        {"kv_lora_rank": None},
        ValueError,
        r"kv_lora_rank must be 512 for Kimi-K3.1 DSA, got None",
    ),
    (
        "rope-dim-0",
        {"qk_rope_head_dim": 0},
        ValueError,
        r"qk_rope_head_dim must be 64 for Kimi-K3.1 DSA, got 0",
    ),
    (
        "v-head-dim-missing",
        {"v_head_dim": None},
        ValueError,
        r"v_head_dim must be a positive integer for Kimi-K3.1 DSA \(MLA\), got None",
    ),
    (
        "mla-rope",
        {"mla_use_nope": False},
        ValueError,
        r"mla_use_nope must be true for Kimi-K3.1 DSA: vLLM's Kimi K3 "
        r"decoder layer builds NoPE MLA layers only",
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
MXFP4 = {"attention_config": {"indexer_kv_dtype": "mxfp4"}}
BAD_FLAGS = {
    "kv-bfloat16": (
        {"kv_cache_dtype": "bfloat16"},
        {},
        r"--kv-cache-dtype 'bfloat16' is not supported for Kimi-K3.1 DSA models: "
        r"accepted values are \['auto', 'fp8', 'fp8_ds_mla', 'fp8_e4m3'\]",
    ),
    "kv-fp8-e5m2": (
        {"kv_cache_dtype": "fp8_e5m2"},
        {},
        r"--kv-cache-dtype 'fp8_e5m2' is not supported",
    ),
    "indexer-nvfp4": (
        {"attention_config": {"indexer_kv_dtype": "nvfp4"}},
        {},
        r"indexer_kv_dtype 'nvfp4' is not supported for Kimi-K3.1 DSA: accepted "
        r"values are \['auto', 'fp8', 'mxfp4'\]",
    ),
    "mxfp4-rmsnorm": (
        MXFP4,
        {"dsa_config": dsa(index_k_norm_type="rmsnorm")},
        r"indexer_kv_dtype='mxfp4' needs the fused Kimi K3 DSA key insert .*"
        r"index_k_norm_type='rmsnorm'",
    ),
    # Indexer rope needs a rope MLA, which vLLM 0.33.0 cannot build: the NoPE
    # rule refuses first.
    "mxfp4-rope": (
        MXFP4,
        {**ROPE_MODEL, "dsa_config": dsa(index_rope_dim=32)},
        r"mla_use_nope must be true for Kimi-K3.1 DSA",
    ),
}


@pytest.mark.parametrize(
    "kwargs,overrides,match", list(BAD_FLAGS.values()), ids=list(BAD_FLAGS)
)
def test_bad_serving_flags_refused(
    tiny_checkpoint, engine_config, kwargs, overrides, match
):
    with pytest.raises(ValueError, match=match):
        engine_config(tiny_checkpoint(**overrides), **kwargs)


@pytest.mark.parametrize("indexer_kv_dtype", ["auto", "mxfp4"])
def test_prefill_context_parallelism_refused_first(
    tiny_checkpoint, engine_config, indexer_kv_dtype
):
    """PCP is refused for every DSA model, before the indexer dtype (MXFP4
    off SM10x would be refused too) is looked at."""
    config = engine_config(tiny_checkpoint())
    config.attention_config.indexer_kv_dtype = indexer_kv_dtype
    # PCP > 1 needs several ranks to configure; the rule reads only this field.
    config.parallel_config.prefill_context_parallel_size = 2
    with pytest.raises(
        NotImplementedError,
        match=r"Kimi-K3.1 packed DSA caches with PCP: prefill context parallelism "
        r"\(prefill_context_parallel_size=2\) is not supported",
    ):
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
        128,
        128,
        32,
    )
    assert parsed.index_layers == (5, 4)
    # 0.33.0's FlashMLA sparse metadata builder reads the top-level field.
    assert text_config.index_topk == 128
    with pytest.raises(AttributeError):
        parsed.index_topk = 1  # type: ignore[misc]


def test_unknown_dsa_config_fields_warned_and_served(
    tiny_checkpoint, engine_config, record_logs
):
    """A dsa_config field Kimi K3.1 does not read is named in one warning and
    ignored, and the model serves from the fields it reads (as the
    specification reads dsa_config); a value the kernels cannot run is still
    refused beside it."""
    from vllm.models.kimi_k3.common import dsa_config as dsa_config_module

    logs = record_logs(dsa_config_module)
    config = engine_config(
        tiny_checkpoint(dsa_config=dsa(index_share=True, index_n_heads=64))
    )
    parsed = config.model_config.hf_text_config.dsa_config
    assert parsed == DSAConfig.from_dict(dsa())
    warnings = [m for m in logs.messages("warning_once") if "unknown field" in m]
    assert len(warnings) == 1
    assert "index_n_heads, index_share" in warnings[0]
    assert "ignored" in warnings[0]
    with pytest.raises(ValueError, match="index_topk must be a positive multiple"):
        engine_config(tiny_checkpoint(dsa_config=dsa(index_share=1, index_topk=100)))


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
    assert clone.index_topk == 128
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
    assert config.get_text_config().index_topk == 128
    reloaded = pickle.loads(pickle.dumps(config))
    assert reloaded.text_config.dsa_config == config.text_config.dsa_config
    assert (
        json.loads(config.to_json_string())["text_config"]["dsa_config"][
            "index_num_heads"
        ]
        == 32
    )


def test_dcp_refused_unless_experimental(tiny_checkpoint, engine_config, monkeypatch):
    from vllm.models.kimi_k3.common.dsa_envs import EXPERIMENTAL_DCP_ENV

    config = engine_config(tiny_checkpoint(dsa_config=dsa(index_topk=512)))
    config.parallel_config.decode_context_parallel_size = 2
    monkeypatch.delenv(EXPERIMENTAL_DCP_ENV, raising=False)
    with pytest.raises(ValueError, match=r"is not supported for Kimi K3.1 DSA"):
        verify_dsa_vllm_config(config)
    monkeypatch.setenv(EXPERIMENTAL_DCP_ENV, "maybe")
    with pytest.raises(
        ValueError,
        match=r"VLLM_KIMI_K3_DSA_EXPERIMENTAL_DCP='maybe' is not understood",
    ):
        verify_dsa_vllm_config(config)
    monkeypatch.setenv(EXPERIMENTAL_DCP_ENV, "1")
    verify_dsa_vllm_config(config)


def test_dcp_needs_a_topk_the_merge_takes(tiny_checkpoint, engine_config, monkeypatch):
    from vllm.models.kimi_k3.common.dsa_envs import EXPERIMENTAL_DCP_ENV

    monkeypatch.setenv(EXPERIMENTAL_DCP_ENV, "1")
    config = engine_config(tiny_checkpoint())
    # DCP > 1 needs several ranks to configure; the rule reads only this field.
    config.parallel_config.decode_context_parallel_size = 2
    with pytest.raises(
        ValueError,
        match=r"--decode-context-parallel-size 2 needs dsa_config.index_topk in "
        r"\[512, 1024, 2048\] \(vLLM's DCP top-k merge, _merge_dcp_topk_global\), "
        r"got 128",
    ):
        verify_dsa_vllm_config(config)
    config = engine_config(
        tiny_checkpoint(dsa_config=dsa(index_topk=2048)), max_model_len=2048
    )
    config.parallel_config.decode_context_parallel_size = 2
    verify_dsa_vllm_config(config)


def test_dcp_needs_cute_dsl_on_cuda(tiny_checkpoint, engine_config, monkeypatch):
    """vLLM 0.33.0's DCP top-k merge has no PyTorch fallback: without CuTe DSL
    it raises at the first forward, so the config refuses it first. The CPU
    platform stands in for CUDA here (``is_cuda`` stubbed: no GPU in CI)."""
    import vllm.utils.import_utils
    from vllm.models.kimi_k3.common.dsa_envs import EXPERIMENTAL_DCP_ENV
    from vllm.platforms import current_platform

    monkeypatch.setenv(EXPERIMENTAL_DCP_ENV, "1")
    config = engine_config(tiny_checkpoint(dsa_config=dsa(index_topk=512)))
    config.parallel_config.decode_context_parallel_size = 2
    monkeypatch.setattr(current_platform, "is_cuda", lambda: True)
    monkeypatch.setattr(vllm.utils.import_utils, "has_cutedsl", lambda: True)
    verify_dsa_vllm_config(config)
    monkeypatch.setattr(vllm.utils.import_utils, "has_cutedsl", lambda: False)
    with pytest.raises(
        ValueError,
        match=r"--decode-context-parallel-size 2 needs CuTe DSL \(the "
        r"'nvidia-cutlass-dsl' package, importable as 'cutlass'\)",
    ):
        verify_dsa_vllm_config(config)
    config.parallel_config.decode_context_parallel_size = 1
    verify_dsa_vllm_config(config)


def _multimodal_checkpoint(path, **top_level):
    path.mkdir()
    config = {**tiny_multimodal_config(dsa=False), **top_level}
    (path / "config.json").write_text(json.dumps(config))
    return path


def test_multimodal_top_level_dsa_config_refused(tmp_path, engine_config):
    path = _multimodal_checkpoint(tmp_path / "mm", dsa_config=dict(TINY_DSA_CONFIG))
    with pytest.raises(
        ValueError,
        match=r"dsa_config is at the top level of a KimiK3ForConditionalGeneration "
        r"config.json; it belongs in text_config",
    ):
        engine_config(path)


@pytest.mark.parametrize("multimodal", [False, True], ids=["text", "multimodal"])
def test_null_dsa_config_keeps_the_config_hash(tmp_path, engine_config, multimodal):
    """``"dsa_config": null`` is plain Kimi K3: the same config and hash."""
    hashes = []
    for null in (False, True):
        path = tmp_path / "ckpt"  # one path: the model path enters the hash
        if multimodal:
            extra = {"dsa_config": None} if null else {}
            config = {**tiny_multimodal_config(dsa=False), **extra}
            config["text_config"].update(extra)
            path.mkdir(exist_ok=True)
            (path / "config.json").write_text(json.dumps(config))
        else:
            write_tiny_config(path, dsa=False, **({"dsa_config": None} if null else {}))
        vllm_config = engine_config(path)
        hashes.append(
            (
                vllm_config.compute_hash(),
                vllm_config.model_config.hf_config.to_json_string(),
            )
        )
    assert hashes[0] == hashes[1]


@pytest.mark.parametrize(
    ("raw", "expected"),
    [("0", False), ("1", True), ("true", True), ("False", False), (" 1 ", True)],
)
def test_force_wrapper_env_values(monkeypatch, raw, expected):
    from vllm.models.kimi_k3.common.dsa_envs import (
        FORCE_WRAPPER_ENV,
        force_wrapper_forward,
    )

    monkeypatch.setenv(FORCE_WRAPPER_ENV, raw)
    assert force_wrapper_forward() is expected


def test_force_wrapper_env_bad_value_refused(monkeypatch):
    from vllm.models.kimi_k3.common.dsa_envs import (
        FORCE_WRAPPER_ENV,
        force_wrapper_forward,
    )

    monkeypatch.setenv(FORCE_WRAPPER_ENV, "yes")
    with pytest.raises(
        ValueError,
        match=r"VLLM_KIMI_K3_DSA_FORCE_WRAPPER='yes' is not understood: accepted "
        r"values are \['0', '1', 'false', 'true'\]",
    ):
        force_wrapper_forward()
