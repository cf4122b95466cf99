# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The dense MLA drafts (DSpark, EAGLE3) of a Kimi K3.1 target through vLLM
0.33.0's real configuration path: the tiny drafts resolve to vLLM's draft
architectures, the packed DSA row grows by the draft's pages at TP 1 and 8,
``kimi-k3-dsa-kv-plan`` counts the same row and block, vLLM's packer puts the
draft's layers in the row's group, and drafts the row cannot hold are
refused by name."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from engine_configs import create_engine_config, sm90_block_size

from kimi_k3_dsa_tools import kv_plan_cli
from kimi_k3_dsa_tools import tiny_checkpoint as T
from kimi_k3_dsa_tools.tiny_checkpoint_cli import main as write_target
from kimi_k3_dsa_tools.tiny_drafts import (
    DRAFT_METHODS,
    tiny_draft_config,
    tiny_draft_shapes,
    write_tiny_draft,
)

TP_SIZES = (1, 8)
MAX_MODEL_LEN = 4096
ROW_WITHOUT_DRAFT = 788  # one DSA layer: 656 B MLA + 132 B indexer keys
# The draft's bf16 latent (512 + 64 values): its dense MLA backends read no
# fp8_ds_mla, so configure_dense_draft gives it kv_cache_dtype "auto".
DRAFT_PAGE = 1152
ARCHITECTURES = {"dspark": "K3DSparkModel", "eagle3": "Eagle3DeepseekV2ForCausalLM"}


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("dense_drafts") / "target"
    write_target([str(out), "--real-attention"])
    return out


@pytest.fixture(scope="module")
def drafts(target: Path) -> dict[str, Path]:
    overrides = T.real_attention_overrides()
    return {
        method: write_tiny_draft(target.parent / method, method, **overrides)
        for method in DRAFT_METHODS
    }


def draft_engine_config(
    target: Path, draft: Path, method: str, tp: int, monkeypatch: Any
) -> Any:
    # vLLM's CPU platform picks Model Runner V1 (no Triton there), which has
    # no DSpark speculator; every GPU host runs Model Runner V2.
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    return create_engine_config(
        target,
        tensor_parallel_size=tp,
        max_model_len=MAX_MODEL_LEN,
        speculative_config={
            "method": method,
            "model": str(draft),
            "num_speculative_tokens": 1,
        },
    )


def test_tiny_drafts_have_the_targets_latent_and_vllms_names():
    target = T.tiny_text_config(dsa=True)
    for method in DRAFT_METHODS:
        config = tiny_draft_config(method, target)
        assert config["architectures"] == [ARCHITECTURES[method]]
        assert (config["kv_lora_rank"], config["qk_rope_head_dim"]) == (512, 64)
        assert config["hidden_size"] == target["hidden_size"]
        names = set(tiny_draft_shapes(method, config))
        # The embedding and lm_head are the target's.
        assert not {n for n in names if "embed_tokens" in n or "lm_head" in n}
    dspark = tiny_draft_shapes("dspark", tiny_draft_config("dspark", target))
    assert dspark["context_proj.weight"] == (256, 2 * 256)
    eagle3 = tiny_draft_shapes("eagle3", tiny_draft_config("eagle3", target))
    # The EAGLE3 layer reads the embedding and the fused hidden state.
    assert eagle3["midlayer.self_attn.q_a_proj.weight"] == (1536, 2 * 256)
    with pytest.raises(ValueError, match="accepted values are"):
        tiny_draft_config("eagle", target)


def test_dspark_config_loads_with_vllms_class(drafts: dict[str, Path]):
    from vllm.transformers_utils.configs.k3_dspark import K3DSparkConfig

    raw = json.loads((drafts["dspark"] / "config.json").read_text())
    config = K3DSparkConfig(**{k: v for k, v in raw.items() if k != "model_type"})
    assert config.num_target_layers == len(config.target_layer_ids)


@pytest.mark.parametrize("tp", TP_SIZES)
@pytest.mark.parametrize("method", DRAFT_METHODS)
def test_the_row_holds_the_draft_as_the_plan_counts_it(
    target: Path,
    drafts: dict[str, Path],
    method: str,
    tp: int,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
):
    from vllm.models.kimi_k3.common.dsa_block_size import packed_row_contents
    from vllm.models.kimi_k3.common.dsa_cache import dense_mla_draft_bytes_per_token

    cfg = draft_engine_config(target, drafts[method], method, tp, monkeypatch)
    spec = cfg.speculative_config
    assert spec.method == method
    assert spec.draft_model_config.architectures == [ARCHITECTURES[method]]
    assert dense_mla_draft_bytes_per_token(cfg) == DRAFT_PAGE
    block = sm90_block_size(cfg, monkeypatch)
    capsys.readouterr()
    assert kv_plan_cli.main(
        ["--config", str(target), "--tp", str(tp), "--kv-budget", str(2**30),
         "--max-model-len", str(MAX_MODEL_LEN), "--draft-method", method,
         "--draft-config", str(drafts[method] / "config.json"), "--json"]
    ) == 0  # fmt: skip
    plan = json.loads(capsys.readouterr().out)
    assert plan["draft_bytes_per_token"] == DRAFT_PAGE
    assert plan["row_bytes_per_token"] == ROW_WITHOUT_DRAFT + DRAFT_PAGE
    assert plan["block_size"] == block
    # The engine's block-size log line names the draft's pages in the row.
    assert packed_row_contents(cfg).endswith(
        f"and the {method} draft's MLA pages ({DRAFT_PAGE} B a token)"
    )


def test_vllms_packer_puts_the_draft_layers_in_the_dsa_row():
    """vLLM's packer (block-outermost layout) groups the draft's MLA layer
    with the target's DSA layers: one row per block holds all of them."""
    from types import SimpleNamespace

    from vllm.v1.attention.backend import MultipleOf
    from vllm.v1.core.kv_cache_planning import _get_packed_kv_cache_groups
    from vllm.v1.kv_cache_interface import (
        MambaSpec,
        MLAAttentionSpec,
        SparseCacheRole,
    )

    block = 1024

    def mla(**kwargs: Any) -> Any:
        return MLAAttentionSpec(
            block_size=block, block_stride_alignment=MultipleOf(64),
            num_kv_heads=1, dtype=torch.uint8, **kwargs,
        )  # fmt: skip

    specs = {
        "l3.mla": mla(head_size=576, cache_dtype_str="fp8_ds_mla",
                      state_content_bytes=656),
        "l3.index": mla(head_size=132, max_tp_shards=1,
                        cache_role=SparseCacheRole.INDEXER),
        "draft.mla": mla(head_size=576, cache_dtype_str="fp8_ds_mla",
                         state_content_bytes=656),
    }  # fmt: skip
    for layer in range(3):
        specs[f"l{layer}.kda"] = MambaSpec(
            block_size=block, shapes=((4, 128), (4, 64, 64)),
            dtypes=(torch.bfloat16, torch.float32),
        )  # fmt: skip
    layout = SimpleNamespace(is_block_outermost=True)
    cfg = SimpleNamespace(
        cache_config=SimpleNamespace(get_resolved_kv_cache_layout=lambda: layout)
    )
    groups = _get_packed_kv_cache_groups(cfg, specs)
    row = next(g for g in groups if "l3.mla" in g.layer_names)
    assert set(row.layer_names) == {"l3.mla", "l3.index", "draft.mla"}


def _refused(target: Path, draft: Path, method: str, monkeypatch: Any) -> str:
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    with pytest.raises(ValueError) as err:
        create_engine_config(
            target,
            max_model_len=MAX_MODEL_LEN,
            speculative_config={
                "method": method,
                "model": str(draft),
                "num_speculative_tokens": 1,
            },
        )
    return str(err.value)


def test_a_draft_without_an_mla_latent_is_refused(
    target: Path, monkeypatch: pytest.MonkeyPatch
):
    """An EAGLE3 draft of the Llama architecture has no MLA latent: the row
    has no page for it."""
    draft = target.parent / "llama_eagle3"
    draft.mkdir(exist_ok=True)
    (draft / "config.json").write_text(
        json.dumps(
            {
                "model_type": "llama",
                "architectures": ["LlamaForCausalLMEagle3"],
                "hidden_size": 256,
                "intermediate_size": 512,
                "num_attention_heads": 4,
                "num_key_value_heads": 4,
                "num_hidden_layers": 1,
                "vocab_size": T.TINY_TEXT_CONFIG["vocab_size"],
                "max_position_embeddings": MAX_MODEL_LEN,
                "rms_norm_eps": 1e-5,
            }
        )
    )
    message = _refused(target, draft, "eagle3", monkeypatch)
    assert "kv_lora_rank" in message and "dense MLA draft" in message


def test_a_method_the_row_does_not_size_is_refused(
    target: Path, drafts: dict[str, Path], monkeypatch: pytest.MonkeyPatch
):
    """EAGLE (1) drafts keep a KV cache of their own that the row does not
    size (vLLM itself turns a ``draft_model`` of an EAGLE3 architecture into
    ``eagle3``)."""
    message = _refused(target, drafts["eagle3"], "eagle", monkeypatch)
    assert "speculative_config.method 'eagle'" in message
    assert "'eagle3', 'dspark'" in message


def test_the_command_line_writes_the_drafts(tmp_path: Path, capsys):
    for method in DRAFT_METHODS:
        out = tmp_path / method
        write_target([str(out), "--draft", method, "--real-attention"])
        config = json.loads((out / "config.json").read_text())
        assert config["architectures"] == [ARCHITECTURES[method]]
        assert (out / "model.safetensors").is_file()
    with pytest.raises(SystemExit) as exit_info:
        write_target([str(tmp_path / "mm"), "--draft", "eagle3", "--multimodal"])
    assert exit_info.value.code == 2
    assert "--draft" in capsys.readouterr().err
    assert not (tmp_path / "mm").exists()
