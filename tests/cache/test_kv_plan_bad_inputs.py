# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The KV plan command on bad inputs: every wrong flag or config file is
refused before any arithmetic, with the engine's own rules (a config ``vllm
serve`` refuses is never planned), as one line on stderr that names the file
and the field, exit status 2 and no traceback."""

from __future__ import annotations

import copy
import json
import logging
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

# Imported here, not first inside a test: vLLM's import-time warnings would
# land in that test's captured stderr.
import vllm.models.kimi_k3.common.dsa_cache  # noqa: F401
import vllm.models.kimi_k3.common.dsa_config  # noqa: F401
from kimi_k3_dsa_tools import kv_plan_inputs as plan_inputs
from kimi_k3_dsa_tools.kv_plan_cli import PROG, main
from kimi_k3_dsa_tools.tiny_checkpoint import TINY_DSA_CONFIG

BUNDLED = Path(plan_inputs.__file__).parent / plan_inputs.BUNDLED_CONFIG
ERROR = f"{PROG}: error: "
PLAN_TITLE = "Kimi K3.1 DSA KV cache plan"
GOOD_DRAFT = {"num_hidden_layers": 1, "kv_lora_rank": 512, "qk_rope_head_dim": 64}


def bundled() -> dict[str, Any]:
    return json.loads(BUNDLED.read_text())


def edited(edit: Callable[[dict[str, Any]], Any]) -> dict[str, Any]:
    """The bundled Kimi K3.1 config with one edit."""
    config = bundled()
    edit(config)
    return config


def multimodal(text: dict[str, Any], **top: Any) -> dict[str, Any]:
    """``text`` as the text_config of a KimiK3ForConditionalGeneration
    config."""
    return {"model_type": "kimi_k3", "text_config": text, **top}


def write(path: Path, content: Any) -> Path:
    """``content`` as raw bytes, raw text, or (anything else) JSON."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif isinstance(content, str):
        path.write_text(content)
    else:
        path.write_text(json.dumps(content))
    return path


def linear(config: dict[str, Any]) -> dict[str, Any]:
    return config["linear_attn_config"]


def full_attn(config: dict[str, Any]) -> list[int]:
    return linear(config)["full_attn_layers"]


def shifted(layers: list[int]) -> list[int]:
    """A 1-indexed layer list written 0-indexed."""
    return [layer - 1 for layer in layers]


def set_field(path: str, value: Any) -> Callable[[dict[str, Any]], None]:
    """An edit that sets ``a.b`` (or deletes it when ``value`` is DELETE)."""

    def edit(config: dict[str, Any]) -> None:
        *parents, key = path.split(".")
        for parent in parents:
            config = config[parent]
        if value is DELETE:
            del config[key]
        else:
            config[key] = copy.deepcopy(value)

    return edit


DELETE = object()

# Bad checkpoint configs: (id, content of --config FILE, words of the error).
BAD_CONFIGS: list[tuple[str, Any, list[str]]] = [
    # The file itself.
    ("binary-file", bytes(range(256)) * 4, ["not UTF-8", "binary file"]),
    ("invalid-json", '{"num_hidden_layers": 93,', ["invalid JSON", "line 1"]),
    ("empty-file", "", ["invalid JSON"]),
    ("json-nested-too-deeply", "[" * 100_000, ["nested too deeply"]),
    ("json-array", [bundled()], ["not a model config", "JSON array"]),
    ("json-string", json.dumps("kimi_k3_1"), ["not a model config", "JSON string"]),
    ("json-number", 93, ["not a model config", "JSON number"]),
    ("json-null", None, ["not a model config", "JSON null"]),
    # Not a Kimi K3.1 DSA model.
    (
        "other-model-type",
        edited(set_field("model_type", "deepseek_v32")),
        ["model_type 'deepseek_v32'", "not Kimi K3"],
    ),
    (
        "plain-kimi-k3",
        edited(set_field("dsa_config", DELETE)),
        ["not a Kimi K3.1 DSA config", "no dsa_config"],
    ),
    (
        "no-linear-attn-config",
        edited(set_field("linear_attn_config", DELETE)),
        ["no linear_attn_config", "KDA-hybrid"],
    ),
    # Fields the HF config class would fail on without naming them.
    (
        "missing-kda-layers",
        edited(set_field("linear_attn_config.kda_layers", DELETE)),
        ["linear_attn_config.kda_layers", "missing"],
    ),
    (
        "kda-layers-string",
        edited(set_field("linear_attn_config.kda_layers", "1,2,3")),
        ["linear_attn_config.kda_layers", "list of 1-indexed layer numbers"],
    ),
    (
        "full-attn-layers-null",
        edited(set_field("linear_attn_config.full_attn_layers", None)),
        ["linear_attn_config.full_attn_layers", "got null"],
    ),
    (
        "linear-attn-config-array",
        edited(set_field("linear_attn_config", [1, 2])),
        ["linear_attn_config must be a JSON object", "array"],
    ),
    (
        "kda-num-heads-string",
        edited(set_field("linear_attn_config.num_heads", "96")),
        ["linear_attn_config.num_heads", "positive integer", '"96"'],
    ),
    (
        "kda-head-dim-missing",
        edited(set_field("linear_attn_config.head_dim", DELETE)),
        ["linear_attn_config.head_dim", "missing"],
    ),
    (
        "kda-conv-kernel-zero",
        edited(set_field("linear_attn_config.short_conv_kernel_size", 0)),
        ["linear_attn_config.short_conv_kernel_size", "positive integer"],
    ),
    (
        "attention-heads-string",
        edited(set_field("num_attention_heads", "96")),
        ["num_attention_heads", "positive integer", '"96"'],
    ),
    (
        "attention-heads-zero",
        edited(set_field("num_attention_heads", 0)),
        ["num_attention_heads", "positive integer"],
    ),
    (
        "num-hidden-layers-string",
        edited(set_field("num_hidden_layers", "93")),
        ["num_hidden_layers", "positive integer"],
    ),
    (
        "max-position-embeddings-float",
        edited(set_field("max_position_embeddings", 1048576.0)),
        ["max_position_embeddings", "positive integer"],
    ),
    # The engine's dsa_config rules (DSAConfig.from_dict, check_dsa_model).
    (
        "index-topk-freq-2",
        edited(set_field("dsa_config.index_topk_freq", 2)),
        ["dsa_config.index_topk_freq", "got 2"],
    ),
    (
        "index-topk-not-multiple-of-128",
        edited(set_field("dsa_config.index_topk", 2000)),
        ["dsa_config.index_topk", "multiple of 128"],
    ),
    (
        "index-topk-over-max-positions",
        edited(set_field("max_position_embeddings", 1024)),
        ["dsa_config.index_topk", "max_position_embeddings"],
    ),
    (
        "dsa-config-array",
        edited(set_field("dsa_config", [2048])),
        ["dsa_config must be a JSON object"],
    ),
    (
        "23-dsa-layers",
        edited(lambda c: full_attn(c).pop()),
        ["full_attn_layers", "every full-attention layer must be a DSA layer"],
    ),
    (
        "0-indexed-index-layers",
        edited(lambda c: c["dsa_config"].update(index_layers=shifted(full_attn(c)))),
        ["dsa_config.index_layers", "1-indexed"],
    ),
    (
        "index-layers-with-layer-0",
        edited(lambda c: c["dsa_config"].update(index_layers=[0, *full_attn(c)])),
        ["dsa_config.index_layers", "1-indexed", "got 0"],
    ),
    (
        "0-indexed-linear-attn-lists",
        edited(
            lambda c: linear(c).update(
                kda_layers=shifted(linear(c)["kda_layers"]),
                full_attn_layers=shifted(full_attn(c)),
            )
        ),
        ["linear_attn_config.kda_layers holds [0]", "(1-indexed)"],
    ),
    # The plan counts a KDA state per kda_layers entry, as the engine does.
    (
        "kda-layer-outside-the-model",
        edited(lambda c: linear(c)["kda_layers"].append(94)),
        ["linear_attn_config.kda_layers holds [94]", "1..93"],
    ),
    (
        "kda-layer-twice",
        edited(lambda c: linear(c)["kda_layers"].append(1)),
        ["linear_attn_config.kda_layers", "[1] twice"],
    ),
    # The engine's serving rules (check_dsa_serving).
    (
        "missing-kv-lora-rank",
        edited(set_field("kv_lora_rank", DELETE)),
        ["kv_lora_rank must be 512", "got None"],
    ),
    (
        "kv-lora-rank-256",
        edited(set_field("kv_lora_rank", 256)),
        ["kv_lora_rank must be 512", "got 256", "FlashMLA sparse"],
    ),
    (
        "kv-lora-rank-float",
        edited(set_field("kv_lora_rank", 512.0)),
        ["kv_lora_rank must be an integer", "512.0"],
    ),
    (
        "qk-rope-head-dim-0",
        edited(set_field("qk_rope_head_dim", 0)),
        ["qk_rope_head_dim must be 64", "got 0"],
    ),
    (
        "qk-nope-head-dim-0",
        edited(set_field("qk_nope_head_dim", 0)),
        ["qk_nope_head_dim must be a positive integer"],
    ),
    (
        "mla-use-nope-false",
        edited(set_field("mla_use_nope", False)),
        ["mla_use_nope must be true"],
    ),
    # A multimodal (kimi_k3) config: the same rules on its text_config.
    (
        "multimodal-text-config-array",
        multimodal([]),
        ["text_config must be a JSON object", "array"],
    ),
    (
        "multimodal-without-text-config",
        {"model_type": "kimi_k3"},
        ["text_config must be a JSON object", "missing"],
    ),
    (
        "multimodal-dsa-config-at-top-level",
        multimodal(
            edited(set_field("dsa_config", DELETE)), dsa_config=bundled()["dsa_config"]
        ),
        ["dsa_config", "belongs in text_config"],
    ),
    (
        "multimodal-kv-lora-rank-256",
        multimodal(edited(set_field("kv_lora_rank", 256))),
        ["kv_lora_rank must be 512", "got 256"],
    ),
]

# Bad draft configs: (id, content of --draft-config FILE, words of the error).
BAD_DRAFTS: list[tuple[str, Any, list[str]]] = [
    ("draft-array", [GOOD_DRAFT], ["not a model config", "JSON array"]),
    ("draft-binary", b"\x89PNG\r\n\x1a\n\x00\xff", ["draft config", "not UTF-8"]),
    ("draft-invalid-json", "{num_hidden_layers: 1}", ["draft config", "invalid JSON"]),
    (
        "draft-missing-num-hidden-layers",
        {k: v for k, v in GOOD_DRAFT.items() if k != "num_hidden_layers"},
        ["num_hidden_layers", "missing"],
    ),
    (
        "draft-num-hidden-layers-string",
        {**GOOD_DRAFT, "num_hidden_layers": "1"},
        ["num_hidden_layers", "positive integer", '"1"'],
    ),
    (
        "draft-without-kv-lora-rank",
        {"num_hidden_layers": 1},
        ["has no kv_lora_rank", "dense MLA draft"],
    ),
    (
        "draft-negative-rope",
        {**GOOD_DRAFT, "qk_rope_head_dim": -64},
        ["qk_rope_head_dim", "integer >= 0"],
    ),
    (
        "draft-text-config-string",
        {"text_config": "draft"},
        ["text_config must be a JSON object", "string"],
    ),
]

# Bad flags: (id, argv, words of the error).
BAD_FLAGS: list[tuple[str, list[str], list[str]]] = [
    ("tp-not-a-number", ["--tp", "eight"], ["argument --tp", "'eight'"]),
    ("tp-without-value", ["--tp"], ["argument --tp", "expected one argument"]),
    ("tp-zero", ["--tp", "0"], ["--tp must be a positive integer", "got 0"]),
    ("tp-negative", ["--tp", "-8"], ["--tp must be a positive integer", "got -8"]),
    ("tp-not-dividing-kda-heads", ["--tp", "5"], ["--tp 5", "96 KDA heads"]),
    ("unknown-flag", ["--block-size", "64"], ["unrecognized arguments: --block-size"]),
    ("kv-budget-unit", ["--kv-budget", "60 GiBs"], ["KV budget '60 GiBs'"]),
    ("kv-budget-negative", ["--kv-budget=-1GiB"], ["KV budget '-1GiB'"]),
    ("kv-budget-zero", ["--kv-budget", "0"], ["KV budget of 0 B", "too small"]),
    ("kv-cache-dtype", ["--kv-cache-dtype", "fp16"], ["--kv-cache-dtype 'fp16'"]),
    (
        "indexer-kv-dtype",
        ["--indexer-kv-dtype", "bf16"],
        ["--indexer-kv-dtype 'bf16' is not supported"],
    ),
    ("max-model-len-float", ["--max-model-len", "1.5"], ["argument --max-model-len"]),
    ("max-model-len-negative", ["--max-model-len", "-1"], ["--max-model-len must be"]),
    (
        "num-speculative-tokens-negative",
        ["--num-speculative-tokens", "-1"],
        ["--num-speculative-tokens must be >= 0"],
    ),
    ("draft-method-unknown", ["--draft-method", "medusa"], ["draft method 'medusa'"]),
    ("draft-method-without-config", ["--draft-method", "eagle3"], ["--draft-config"]),
    ("config-empty", ["--config", ""], ["--config is empty"]),
    ("draft-config-empty", ["--draft-config", ""], ["--draft-config is empty"]),
]


@pytest.fixture(autouse=True)
def no_logging_error_reports(monkeypatch: pytest.MonkeyPatch) -> None:
    """A vLLM log handler set up under an earlier test's capsys writes to that
    test's closed stream; logging would report that on stderr, as a
    traceback of its own."""
    monkeypatch.setattr(logging, "raiseExceptions", False)


def assert_refused(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    """Run the command; return its one error line (without the prefix)."""
    capsys.readouterr()
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err
    assert PLAN_TITLE not in captured.out
    lines = captured.err.splitlines()
    assert len(lines) == 1, captured.err
    assert lines[0].startswith(ERROR)
    return lines[0].removeprefix(ERROR)


def assert_words(message: str, words: list[str]) -> None:
    for word in words:
        assert word in message, f"{word!r} not in {message!r}"


@pytest.mark.parametrize(
    ("content", "words"),
    [pytest.param(c, w, id=i) for i, c, w in BAD_CONFIGS],
)
def test_bad_config(capsys, tmp_path, content, words):
    path = write(tmp_path / "ckpt" / "config.json", content)
    message = assert_refused(capsys, ["--config", str(path)])
    assert str(path) in message
    assert_words(message, words)


@pytest.mark.parametrize(
    ("content", "words"),
    [pytest.param(c, w, id=i) for i, c, w in BAD_DRAFTS],
)
def test_bad_draft_config(capsys, tmp_path, content, words):
    path = write(tmp_path / "draft" / "config.json", content)
    argv = ["--draft-method", "eagle3", "--draft-config", str(path)]
    message = assert_refused(capsys, argv)
    assert str(path) in message
    assert_words(message, words)


@pytest.mark.parametrize(
    ("argv", "words"),
    [pytest.param(a, w, id=i) for i, a, w in BAD_FLAGS],
)
def test_bad_flag(capsys, argv, words):
    assert_words(assert_refused(capsys, argv), words)


@pytest.mark.parametrize("flag", ["--config", "--draft-config"])
def test_missing_files_and_directories(capsys, tmp_path, flag):
    """A missing file, a checkpoint directory without config.json and a
    config.json that is a directory are each named in the refusal."""
    draft = ["--draft-method", "eagle3"] if flag == "--draft-config" else []
    missing = tmp_path / "nowhere" / "config.json"
    message = assert_refused(capsys, [*draft, flag, str(missing)])
    assert_words(message, ["cannot read", str(missing), "No such file"])
    empty = tmp_path / "empty"
    empty.mkdir()
    message = assert_refused(capsys, [*draft, flag, str(empty)])
    assert_words(message, ["cannot read", str(empty / "config.json"), "No such file"])
    nested = tmp_path / "nested"
    (nested / "config.json").mkdir(parents=True)
    message = assert_refused(capsys, [*draft, flag, str(nested / "config.json")])
    assert_words(message, ["cannot read", str(nested / "config.json"), "directory"])


def test_draft_config_needs_a_draft_method(capsys, tmp_path):
    path = write(tmp_path / "draft.json", GOOD_DRAFT)
    message = assert_refused(capsys, ["--draft-config", str(path)])
    assert_words(message, ["--draft-config needs --draft-method", "eagle3"])


def test_oversized_file_is_not_read(capsys, tmp_path, monkeypatch):
    """A weights file passed as --config is refused by its size."""
    monkeypatch.setattr(plan_inputs, "MAX_CONFIG_BYTES", 1024)
    path = write(tmp_path / "model.safetensors", b"\0" * 2048)
    message = assert_refused(capsys, ["--config", str(path)])
    assert_words(message, [str(path), "not a config.json"])


def run_json(capsys, *args: str) -> dict[str, Any]:
    capsys.readouterr()
    assert main([*args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_unknown_dsa_config_field_plans_as_serve_serves(capsys, tmp_path):
    """An unknown dsa_config field is ignored with a warning when serving, so
    the plan ignores it too and plans the same."""
    expected = run_json(capsys, "--kv-budget", "60GiB")
    path = write(
        tmp_path / "extra" / "config.json",
        edited(set_field("dsa_config.index_share", True)),
    )
    plan = run_json(capsys, "--config", str(path), "--kv-budget", "60GiB")
    assert {**plan, "config": None} == {**expected, "config": None}


def test_good_inputs_in_every_form_plan_the_same(capsys, tmp_path):
    """The bundled config, a checkpoint directory, its multimodal form and a
    draft directory plan alike; the MLA page is the engine's 656 B."""
    expected = run_json(capsys, "--kv-budget", "60GiB")
    assert expected["mla_bytes_per_token"] == 656
    text = write(tmp_path / "text" / "config.json", bundled())
    mm = write(tmp_path / "mm" / "config.json", multimodal(bundled()))
    for ckpt, name in ((text.parent, text), (mm, mm)):
        plan = run_json(capsys, "--config", str(ckpt), "--kv-budget", "60GiB")
        assert plan["config"] == str(name)
        assert {**plan, "config": None} == {**expected, "config": None}
    draft = write(tmp_path / "draft" / "config.json", multimodal(GOOD_DRAFT))
    plan = run_json(
        capsys, "--draft-method", "dspark", "--draft-config", str(draft.parent),
        "--kv-budget", "60GiB",
    )  # fmt: skip
    assert plan["draft_bytes_per_token"] == 1152  # the draft's own bf16 pages


def test_console_script_refuses_without_traceback(tmp_path):
    """The installed console script, in a real process: one error line (after
    whatever vLLM's import logs), exit status 2, no traceback."""
    script = Path(sys.executable).parent / PROG
    if not script.exists():
        pytest.skip(f"{PROG} is not installed beside {sys.executable}")
    path = write(tmp_path / "config.json", edited(set_field("kv_lora_rank", 256)))
    result = subprocess.run(
        [str(script), "--config", str(path)],
        capture_output=True, text=True, timeout=300,
        env={**os.environ, "VLLM_TARGET_DEVICE": "cpu"},
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    assert PLAN_TITLE not in result.stdout
    errors = [line for line in result.stderr.splitlines() if line.startswith(PROG)]
    assert len(errors) == 1, result.stderr
    assert result.stderr.rstrip().endswith(errors[0])
    assert_words(errors[0], [str(path), "kv_lora_rank must be 512", "got 256"])


# What `vllm serve` refuses for a checkpoint and flags, the plan refuses for the
# same checkpoint and flags, by the same functions, with the same reason:
# (id, text-config overrides, engine arguments, plan flags, the shared reason).
SERVE_AND_PLAN: list[tuple[str, dict[str, Any], dict[str, Any], list[str], str]] = [
    (
        "max-model-len-beyond-the-model",
        {},
        {"max_model_len": 8192},
        ["--max-model-len", "8192"],
        "User-specified max_model_len (8192) is greater than the derived "
        "max_model_len (max_position_embeddings=4096",
    ),
    (
        "index-topk-above-max-model-len",
        {},
        {"max_model_len": 64},
        ["--max-model-len", "64"],
        "dsa_config.index_topk (128) must not exceed max_model_len (64)",
    ),
    (
        "index-head-dim-deepgemm-cannot-run",
        {"dsa_config": {**TINY_DSA_CONFIG, "index_head_dim": 96}},
        {},
        [],
        "dsa_config.index_head_dim must be one of [32, 64, 128]",
    ),
    (
        "mxfp4-index-head-dim",
        {"dsa_config": {**TINY_DSA_CONFIG, "index_head_dim": 64}},
        {"attention_config": {"indexer_kv_dtype": "mxfp4"}},
        ["--indexer-kv-dtype", "mxfp4"],
        "the fused Kimi K3 DSA key insert, the only writer of MXFP4 keys, which "
        "cannot take index_head_dim 64",
    ),
    (
        "sparse-mla-heads-per-rank",
        {"num_attention_heads": 256, "num_key_value_heads": 256},
        {},
        [],
        "num_attention_heads 256 at tensor_parallel_size 1 gives 256 attention "
        "heads per rank; FlashMLA sparse takes at most 128",
    ),
    (
        "deepseek-v32-flat-keys",
        {"dsa": False, "index_topk": 2048, "index_head_dim": 128, "index_n_heads": 64},
        {},
        [],
        "carries DSA keys outside dsa_config: index_head_dim=128, "
        "index_n_heads=64, index_topk=2048",
    ),
]


@pytest.mark.parametrize(
    ("overrides", "engine_args", "flags", "reason"),
    [pytest.param(o, e, f, r, id=i) for i, o, e, f, r in SERVE_AND_PLAN],
)
def test_plan_refuses_what_serve_refuses(
    capsys, tiny_checkpoint, engine_config, overrides, engine_args, flags, reason
):
    path = tiny_checkpoint(**overrides)
    with pytest.raises(ValueError) as err:
        engine_config(path, **{"max_model_len": 1024, **engine_args})
    assert reason in str(err.value)
    if "--max-model-len" not in flags:
        flags = [*flags, "--max-model-len", "1024"]
    argv = ["--config", str(path), "--tp", "1", "--kv-budget", "1GiB", *flags]
    assert reason in assert_refused(capsys, argv)
