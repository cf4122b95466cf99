# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The end-to-end DSA benchmark's driver on the CPU: its plan (rows left out
by the prefill budget, interleaved engine starts), the engine command it
hands each start (parsed back by its own parser), the per-request times it
reads from vLLM's ``RequestStateStats`` and its summary and ratios. The
engines themselves need a GPU (``tools/gpu/run.py``)."""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from kimi_k3_dsa_tools.tiny_checkpoint import tiny_multimodal_config

_ROOT = next(
    p for p in Path(__file__).resolve().parents if (p / "benchmarks" / "e2e").is_dir()
)
sys.path.insert(0, str(_ROOT / "benchmarks" / "e2e"))
import bench_e2e_dsa as E  # noqa: E402


def test_rows_over_the_prefill_budget_are_left_out() -> None:
    rows, skipped = E.plan_rows([8192, 131072], [1, 16, 64], 2_200_000)
    assert [(r.input_len, r.batch) for r in skipped] == [(131072, 64)]
    assert len(rows) == 5
    assert all(r.prefill_tokens <= 2_200_000 for r in rows)


def test_engine_starts_interleave_and_rotate() -> None:
    order = E.engine_order(["fused", "wrapper", "dense"], 3)
    assert order[:3] == [(0, "fused"), (0, "wrapper"), (0, "dense")]
    assert [m for s, m in order if s == 1] == ["wrapper", "dense", "fused"]
    assert len(order) == 9
    assert {m for _, m in order[:3]} == {m for _, m in order[3:6]}


def test_engine_command_parses_back(tmp_path: Path) -> None:
    args = E.parse_args(["--input-lens", "8192", "--batch-sizes", "1", "16"])
    args.planned_rows = E.plan_rows(args.input_lens, args.batch_sizes, 10**9)[0]
    cmd = E.engine_command(args, "wrapper", 2, tmp_path / "m", tmp_path / "r.jsonl")
    parsed = E.parse_args(cmd[2:])
    assert parsed.command == "engine"
    assert (parsed.mode, parsed.start, parsed.iters) == ("wrapper", 2, args.iters)
    assert parsed.rows == ["8192x1", "8192x16"]
    assert E.mode_env("wrapper")[E.FORCE_WRAPPER_ENV] == "1"
    assert E.FORCE_WRAPPER_ENV not in E.mode_env("fused")


class _Stats:
    def __init__(self, n: int, ttft: float, first: float, last: float) -> None:
        self.num_generation_tokens = n
        self.first_token_latency = ttft
        self.first_token_ts = first
        self.last_token_ts = last


def test_request_times_and_their_refusals() -> None:
    times = E.request_times(_Stats(256, 0.5, 10.0, 12.55), 256)
    assert times["ttft_s"] == 0.5
    assert times["tpot_s"] == pytest.approx(2.55 / 255)
    with pytest.raises(RuntimeError, match="disable_log_stats=False"):
        E.request_times(None, 256)
    with pytest.raises(RuntimeError, match="generated 10 tokens, not 256"):
        E.request_times(_Stats(10, 0.5, 10.0, 11.0), 256)


def _record(mode: str, start: int, step: float, ttft: float) -> dict:
    return {
        "mode": mode, "start": start, "input_len": 32768, "batch": 4,
        "ttft_s": [ttft] * 4, "tpot_s": [2 * step] * 4, "decode_itl_s": [step] * 8,
    }  # fmt: skip


def test_summary_medians_spread_and_ratios() -> None:
    records = [
        _record("dense", 0, 0.004, 0.2),
        _record("dense", 1, 0.006, 0.2),
        _record("fused", 0, 0.002, 0.1),
        _record("fused", 1, 0.002, 0.3),
        _record("fused", 1, 0.003, 0.3),
        _record("wrapper", 0, 0.002, 0.1) | {"decode_itl_s": []},
    ]
    summary = {s["mode"]: s for s in E.summarize(records)}
    dense, fused, wrapper = summary["dense"], summary["fused"], summary["wrapper"]
    assert dense["step_ms"] == pytest.approx(5.0)
    assert dense["tpot_ms"] == pytest.approx(10.0)
    assert dense["decode_tok_s"] == pytest.approx(4 / 0.005)
    assert (dense["decode_tok_s_min"], dense["decode_tok_s_max"]) == pytest.approx(
        (4 / 0.006, 4 / 0.004)
    )
    assert (fused["starts"], fused["repeats"], fused["decode_steps"]) == (2, 3, 24)
    # The spread is over repeats: start 1's two repeats count apart.
    assert (fused["decode_tok_s_min"], fused["decode_tok_s_max"]) == pytest.approx(
        (4 / 0.003, 4 / 0.002)
    )
    assert fused["decode_x_dense"] == pytest.approx((4 / 0.002) / (4 / 0.005))
    assert fused["ttft_x_dense"] == pytest.approx(300 / 200)
    assert "decode_x_dense" not in dense
    # No pure-decode step: no decode rate and no ratio, the TTFT ratio stays.
    assert "decode_tok_s" not in wrapper and "decode_x_dense" not in wrapper
    assert wrapper["ttft_x_dense"] == pytest.approx(0.5)
    E.print_summary(list(summary.values()))


class _Sched:
    def __init__(self, running: int) -> None:
        self.num_running_reqs = running


class _Iter:
    def __init__(self, new: int, first: int, itls: list[float]) -> None:
        self.num_generation_tokens = new
        self.time_to_first_tokens_iter = [0.1] * first
        self.inter_token_latencies_iter = itls


def test_only_steps_where_the_whole_batch_decodes_count() -> None:
    log = E.StepLog()
    log.add(_Sched(3), _Iter(1, 1, []))  # a prefill finished
    log.add(_Sched(3), _Iter(2, 0, [0.5, 0.5]))  # one request still prefills
    log.add(_Sched(3), _Iter(3, 0, [0.01, 0.01, 0.01]))  # pure decode
    log.add(_Sched(3), _Iter(3, 1, [0.2, 0.2]))  # a first token in the step
    log.add(_Sched(2), _Iter(2, 0, [0.02, 0.02]))  # one request finished
    log.add(None, _Iter(3, 0, [9.0] * 3))
    log.add(_Sched(3), None)
    assert log.pure_decode_itls(3) == [0.01, 0.01, 0.01]


def test_speculative_steps_count_with_their_tokens() -> None:
    log = E.StepLog()
    log.add(_Sched(2), _Iter(3, 0, [0.01, 0.01]))  # one request got 2 tokens
    log.add(_Sched(2), _Iter(4, 0, [0.02, 0.02]))
    log.add(_Sched(2), _Iter(2, 0, [0.5]))  # one request still prefills
    log.add(_Sched(2), _Iter(3, 1, [0.2]))  # a first token in the step
    assert log.pure_decode_itls(2) == [0.01, 0.01, 0.02, 0.02]
    assert log.tokens_per_step(2) == pytest.approx(7 / 4)
    assert log.tokens_per_step(3) is None


def test_mtp_rows_report_the_step_against_fused() -> None:
    records = [
        _record("fused", 0, 0.002, 0.1),
        _record("mtp", 0, 0.003, 0.1) | {"tokens_per_step": 1.5},
    ]
    summary = {s["mode"]: s for s in E.summarize(records)}
    assert summary["mtp"]["step_x_fused"] == pytest.approx(1.5)
    assert summary["mtp"]["tokens_per_step"] == pytest.approx(1.5)
    assert "step_x_fused" not in summary["fused"]


def test_mtp_mode_drafts_with_the_multimodal_checkpoint() -> None:
    import argparse

    args = argparse.Namespace(
        mode="mtp", mtp_tokens=3, kv_cache_gib=1.0, max_num_batched_tokens=8192,
        start=0, tensor_parallel_size=1, enable_expert_parallel=False,
    )  # fmt: skip
    kwargs = E.engine_kwargs("ckpt", 4096, args)
    assert kwargs["speculative_config"] == {
        "method": "kimi_k3_mtp",
        "num_speculative_tokens": 3,
    }
    assert E.checkpoint_of("mtp") == "mtp" and E.checkpoint_of("wrapper") == "dsa"
    assert "speculative_config" not in E.engine_kwargs(
        "ckpt", 4096, args.__class__(**{**vars(args), "mode": "fused"})
    )
    with pytest.raises(SystemExit):
        E.parse_args(["--modes", "mtp", "--vllm-bench-latency"])


def test_step_log_wraps_the_engines_stat_logger_manager() -> None:
    seen = []

    class Manager:
        def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None):
            seen.append(mm_cache_stats)

    llm = type("LLM", (), {})()
    llm.llm_engine = type("Engine", (), {})()
    llm.llm_engine.logger_manager = Manager()
    log = E.attach_step_log(llm)
    llm.llm_engine.logger_manager.record(
        scheduler_stats=_Sched(1), iteration_stats=_Iter(1, 0, [0.5]), mm_cache_stats=7
    )
    assert seen == [7] and log.pure_decode_itls(1) == [0.5]
    llm.llm_engine.logger_manager = None
    with pytest.raises(RuntimeError, match="disable_log_stats=False"):
        E.attach_step_log(llm)


def test_repeats_are_interleaved_after_one_warm_up_pass() -> None:
    rows = [E.Row(8192, 1), E.Row(32768, 16)]
    order = [(it, (r.input_len, r.batch)) for it, r in E.schedule(rows, 2)]
    assert order == [
        (-1, (8192, 1)),
        (-1, (32768, 16)),
        (0, (8192, 1)),
        (0, (32768, 16)),
        (1, (8192, 1)),
        (1, (32768, 16)),
    ]


def test_dry_run_prints_the_plan(capsys: pytest.CaptureFixture[str]) -> None:
    assert E.main(["--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "engines: 9" in out
    assert "left out" in out and "131072x64" in out


@pytest.mark.parametrize("option", ["--starts", "--attention-blocks"])
def test_bad_counts_are_refused(
    capsys: pytest.CaptureFixture[str], option: str
) -> None:
    with pytest.raises(SystemExit):
        E.parse_args([option, "0"])
    assert f"{option} must be at least 1" in capsys.readouterr().err


# One TP 8 rank of Kimi K3.1 at its real depth (24 attention layers).
ONE_RANK_AT_DEPTH = ["--attention-blocks", "24", "--one-rank-of-tp", "8"]


@pytest.mark.parametrize(
    ("argv", "kv_gib"),
    [
        ([], 6),
        (["--attention-blocks", "4", "--kv-cache-gib", "24"], 24),
        ([*ONE_RANK_AT_DEPTH, "--kv-cache-gib", "24"], 24),
        (["--tensor-parallel-size", "8"], 6),
        (["--tensor-parallel-size", "8", "--enable-expert-parallel"], 6),
    ],
    ids=["one-block", "four-blocks", "one-rank-of-tp8", "tp8", "tp8-ep"],
)
def test_engine_arguments_pass_vllms_configuration(
    tmp_path: Path, engine_config, argv: list[str], kv_gib: int
) -> None:
    """Both checkpoints, at the longest row's length, through vLLM's real
    configuration path with the engines' arguments (the DSA verifier
    included): the sitting must not find a refused config."""
    args = E.parse_args(["--dry-run", *argv])
    args.start = 0
    ckpts = E.write_checkpoints(
        tmp_path,
        seed=0,
        config_only=True,
        blocks=args.attention_blocks,
        one_rank_of_tp=args.one_rank_of_tp,
    )
    max_len = 131072 + args.output_len
    for kind, path in ckpts.items():
        kwargs = E.engine_kwargs(str(path), max_len, args)
        model = kwargs.pop("model")
        cfg = engine_config(Path(model), **kwargs)
        assert cfg.model_config.max_model_len == max_len
        assert cfg.scheduler_config.max_num_batched_tokens == 32768
        assert cfg.scheduler_config.max_num_seqs == E.MAX_NUM_SEQS
        assert cfg.cache_config.kv_cache_memory_bytes == kv_gib * 2**30
        text = cfg.model_config.hf_text_config
        has_dsa = getattr(text, "dsa_config", None)
        assert (has_dsa is not None) == (kind == "dsa")
        blocks = args.attention_blocks
        assert text.num_hidden_layers == 4 * blocks
        assert text.linear_attn_config["full_attn_layers"] == [
            4 * (b + 1) for b in range(blocks)
        ]
        tp = args.tensor_parallel_size
        heads = 96 // (args.one_rank_of_tp or tp)
        parallel = cfg.parallel_config
        assert cfg.model_config.get_num_attention_heads(parallel) == heads
        assert parallel.tensor_parallel_size == tp
        assert parallel.enable_expert_parallel == args.enable_expert_parallel


def test_mtp_engine_arguments_pass_vllms_configuration(
    tmp_path: Path, engine_config
) -> None:
    """The MTP mode's multimodal checkpoint takes the longest row's length
    too: its text config holds ``max_position_embeddings``."""
    args = E.parse_args(["--dry-run", "--modes", "fused", "mtp", "--mtp-tokens", "3"])
    args.start, args.mode = 0, "mtp"
    # The writer's config-only mode is text-only: nest the DSA checkpoint's
    # text config the way the multimodal checkpoint does, with its MTP layer.
    text = E.write_checkpoints(tmp_path, seed=0, config_only=True)["dsa"]
    text_config = json.loads((text / "config.json").read_text())
    text_config["num_nextn_predict_layers"] = 1
    mtp = tmp_path / "ckpt-dsa-mm"
    mtp.mkdir()
    (mtp / "config.json").write_text(json.dumps(tiny_multimodal_config(**text_config)))
    max_len = 32768 + args.output_len
    kwargs = E.engine_kwargs(str(mtp), max_len, args)
    model = kwargs.pop("model")
    cfg = engine_config(Path(model), **kwargs)
    assert cfg.model_config.max_model_len == max_len
    assert cfg.speculative_config.num_speculative_tokens == 3
    assert cfg.speculative_config.method == "mtp"  # vLLM folds kimi_k3_mtp into mtp


def test_vllm_bench_latency_gets_the_drivers_engine(
    tmp_path: Path, engine_config
) -> None:
    """The ``vllm bench latency`` command line, parsed by vLLM's own bench
    latency parser, gives the engine arguments the driver's loop uses, and
    they pass vLLM's configuration path; its rows and iterations are ours."""
    from vllm.benchmarks.latency import add_cli_args
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    args = E.parse_args(["--vllm-bench-latency", "--iters", "3"])
    args.planned_rows, _ = E.plan_rows(args.input_lens, args.batch_sizes, 2_200_000)
    ckpts = E.write_checkpoints(tmp_path, seed=0, config_only=True)
    assert all(path.name.endswith("-v10240") for path in ckpts.values())
    row = E.Row(131072, 16)
    command = E.vllm_bench_latency_command(
        args, ckpts["dsa"], row, start=2, out_json=tmp_path / "l.json"
    )
    assert command[1:5] == ["-m", "vllm.entrypoints.cli.main", "bench", "latency"]
    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    parsed = parser.parse_args(command[5:])
    assert (parsed.input_len, parsed.batch_size) == (131072, 16)
    assert (parsed.output_len, parsed.num_iters) == (args.output_len, 3)
    assert parsed.num_iters_warmup == E.LATENCY_WARMUP_ITERS
    assert parsed.disable_detokenize and parsed.output_json == str(tmp_path / "l.json")
    engine_args = EngineArgs.from_cli_args(parsed)
    max_len = 131072 + args.output_len
    args.start = 2
    expected = E.engine_kwargs(str(ckpts["dsa"]), max_len, args)
    for key, value in expected.items():
        if key == "disable_log_stats":  # the driver's loop reads vLLM's stats
            continue
        assert getattr(engine_args, key) == value, key
    cfg = engine_config(
        ckpts["dsa"], **{k: v for k, v in expected.items() if k != "model"}
    )
    assert cfg.model_config.hf_text_config.vocab_size == 10240
    assert cfg.model_config.max_model_len == max_len


@pytest.mark.parametrize(
    "parallel",
    [
        ["--tensor-parallel-size", "8"],
        ["--tensor-parallel-size", "8", "--enable-expert-parallel"],
    ],
    ids=["tp8", "tp8-ep"],
)
def test_the_parallel_layout_reaches_every_engine(
    tmp_path: Path, parallel: list[str]
) -> None:
    """The driver's loop and ``vllm bench latency`` get the same layout."""
    from vllm.benchmarks.latency import add_cli_args
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    args = E.parse_args(["--input-lens", "8192", "--batch-sizes", "1", *parallel])
    args.planned_rows = E.plan_rows(args.input_lens, args.batch_sizes, 10**9)[0]
    cmd = E.engine_command(args, "fused", 0, tmp_path / "m", tmp_path / "r.jsonl")
    engine = E.parse_args(cmd[2:])
    expected = E.parallel_kwargs(args)
    assert E.parallel_kwargs(engine) == expected
    command = E.vllm_bench_latency_command(
        args, tmp_path / "m", E.Row(8192, 1), start=0, out_json=tmp_path / "l.json"
    )
    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    engine_args = EngineArgs.from_cli_args(parser.parse_args(command[5:]))
    for key, value in expected.items():
        assert getattr(engine_args, key) == value, key


def test_vllm_bench_latency_needs_its_prompt_ids_in_the_vocabulary(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit):
        E.parse_args(["--vllm-bench-latency", "--vocab-size", "4096"])
    assert "give --vocab-size 10000 or more, not 4096" in capsys.readouterr().err


def test_latency_summary_medians_and_ratios(capsys: pytest.CaptureFixture[str]) -> None:
    row = {"input_len": 8, "batch": 1}
    results = [
        {"mode": "dense", "start": 0, **row, "latencies": [2.0, 4.0]},
        {"mode": "fused", "start": 0, **row, "latencies": [1.0]},
        {"mode": "fused", "start": 1, **row, "latencies": [2.0, 3.0]},
    ]
    E.print_latency_summary(results)
    lines = capsys.readouterr().out.splitlines()
    dense = next(line for line in lines if " dense " in line).split()
    fused = next(line for line in lines if " fused " in line).split()
    assert dense[3] == "3.000" and dense[4] == "2.000-4.000"
    assert fused[3] == "2.000" and fused[4] == "1.000-3.000" and fused[5] == "1.50"


def test_dry_run_counts_the_vllm_bench_latency_runs(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = [
        "--dry-run",
        "--vllm-bench-latency",
        "--modes",
        "fused",
        "dense",
        "--starts",
        "1",
    ]
    assert E.main([*argv, "--input-lens", "8192", "32768", "--batch-sizes", "1"]) == 0
    assert "vllm bench latency: 4 runs, one engine each" in capsys.readouterr().out


def test_summarize_committed_records_as_markdown(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import json

    records = [
        _record("dense", 0, 0.004, 0.2),
        _record("fused", 0, 0.002, 0.1),
        _record("wrapper", 0, 0.003, 0.1),
    ]
    path = tmp_path / "records.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    assert E.main(["summarize", str(path), "--markdown"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if "32K x 4" in line]
    fused = next(r for r in rows if "| fused |" in r).split("|")
    # decode x dense 2.00, TTFT x dense 0.50, fused x wrapper 1.50
    assert [c.strip() for c in fused[-6:-3]] == ["2.00", "0.50", "1.50"]
    dense = next(r for r in rows if "| dense |" in r).split("|")
    assert [c.strip() for c in dense[-6:-1]] == ["", "", "", "", ""]
    assert E.main(["summarize", str(path)]) == 0
    assert "decode tok/s" in capsys.readouterr().out
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(SystemExit, match="no records in"):
        E.main(["summarize", str(empty)])


RANK_FLAGS = ["--one-rank-of-tp", "8"]


def _written(monkeypatch: pytest.MonkeyPatch) -> list[list[str]]:
    """The checkpoint writer's command lines, run by nothing."""
    commands: list[list[str]] = []

    def run(command: list[str], **kwargs: object) -> subprocess.CompletedProcess:
        commands.append(command)
        return subprocess.CompletedProcess(command, 0)

    monkeypatch.setattr(E.subprocess, "run", run)
    return commands


def test_one_rank_of_tp_reaches_the_checkpoint_writer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    commands = _written(monkeypatch)
    rank = E.write_checkpoints(tmp_path, seed=3, blocks=24, one_rank_of_tp=8)
    assert len(commands) == 2
    for kind, command in zip(("dsa", "dense"), commands, strict=True):
        assert command[-len(RANK_FLAGS) :] == RANK_FLAGS
        assert command[command.index("--attention-blocks") + 1] == "24"
        assert str(rank[kind]) in command
        assert ("--no-dsa" in command) == (kind == "dense")
    # Another shape under the same --out gets directories of its own.
    assert {p.name for p in rank.values()} == {
        "ckpt-dsa-b24-rank-of-tp8-v10240",
        "ckpt-dense-b24-rank-of-tp8-v10240",
    }
    whole = E.write_checkpoints(tmp_path, seed=3, blocks=24)
    assert not set(whole.values()) & set(rank.values())
    assert all("--one-rank-of-tp" not in c for c in commands[2:])


@pytest.mark.parametrize("latency", [False, True], ids=["loop", "vllm-bench-latency"])
def test_the_driver_serves_the_one_rank_checkpoints(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, latency: bool
) -> None:
    """Both the driver's loop and --vllm-bench-latency write the checkpoints
    with the flag and hand exactly those to the engines."""
    commands = _written(monkeypatch)
    served: dict[str, Path] = {}

    def fake_latency(args, out, ckpts, order) -> int:
        served.update(ckpts)
        return 0

    monkeypatch.setattr(E, "drive_vllm_bench_latency", fake_latency)
    argv = ["--out", str(tmp_path), "--modes", "fused", "dense", "--starts", "1"]
    argv += ["--input-lens", "32768", "--batch-sizes", "1"]
    argv += ONE_RANK_AT_DEPTH
    assert E.main(argv + (["--vllm-bench-latency"] if latency else [])) == 0
    writes = [c for c in commands if "--real-attention" in c]
    assert len(writes) == 2 and all(c[-2:] == RANK_FLAGS for c in writes)
    written = {Path(c[c.index("--real-attention") - 1]) for c in writes}
    if latency:
        assert set(served.values()) == written
    else:
        engines = [c for c in commands if "engine" in c]
        models = {Path(c[c.index("--model") + 1]) for c in engines}
        assert len(engines) == 2 and models == written


def test_dry_run_names_the_one_rank_shape(capsys: pytest.CaptureFixture[str]) -> None:
    assert E.main(["--dry-run", *ONE_RANK_AT_DEPTH]) == 0
    out = capsys.readouterr().out
    assert (
        "checkpoint: 24 attention layer(s) of 96, one rank of TP 8: 12 MLA heads, "
        "12 KDA heads, indexer 32 x 128 (whole)"
    ) in out
    assert E.main(["--dry-run"]) == 0
    assert "1 attention layer(s) of 4, 96 MLA heads, 80 KDA heads" in (
        capsys.readouterr().out
    )


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--one-rank-of-tp", "5"], "--one-rank-of-tp 5: give a TP size that divides"),
        (["--one-rank-of-tp", "0"], "32, 48, 96"),
        (["--attention-blocks", "25"], "--attention-blocks: at most 24"),
        (["--tensor-parallel-size", "5"], "--tensor-parallel-size 5: give a size"),
        (["--tensor-parallel-size", "0"], "--tensor-parallel-size must be at least 1"),
        (
            ["--tensor-parallel-size", "8", "--one-rank-of-tp", "8"],
            "give it or --tensor-parallel-size, not both",
        ),
    ],
)
def test_bad_shapes_and_layouts_are_refused_before_any_engine(
    capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    with pytest.raises(SystemExit):
        E.parse_args(["--dry-run", *argv])
    assert message in capsys.readouterr().err


def _suite_args(command: str, logs: Path) -> argparse.Namespace:
    """A runner suite's bench_e2e_dsa.py command line, parsed by the driver."""
    argv = shlex.split(command.replace("$LOGS", str(logs)))
    assert argv[:2] == ["python3", "benchmarks/e2e/bench_e2e_dsa.py"]
    return E.parse_args(argv[2:])


@pytest.mark.parametrize(
    "suite",
    ["e2e-bench-one-rank", "e2e-bench-one-rank-b64", "vllm-bench-latency-one-rank"],
)
def test_one_rank_suites_plan_their_rows_in_their_kv_cache(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], suite: str
) -> None:
    """The runner's one-rank suites parse, serve one TP 8 rank at the real
    depth, fused against dense, and give every row's batch room in the KV
    cache: the DSA engine's blocks by the plan command, dense MLA's bf16
    cache and KDA states by their bytes (a floor of what it allocates)."""
    from kimi_k3_dsa_tools import kv_plan_cli

    run = _runner_module()
    args = _suite_args(run.SUITES[suite].command, tmp_path)
    assert (args.one_rank_of_tp, args.attention_blocks) == (8, 24)
    assert args.modes == ["fused", "dense"] and args.starts == 1
    assert args.vllm_bench_latency == suite.startswith("vllm-bench-latency")
    assert run.SUITES[suite].timeout_s <= 1200
    rows, _ = E.plan_rows(args.input_lens, args.batch_sizes, args.max_prefill_tokens)
    assert rows
    ckpt = E.write_checkpoints(
        tmp_path, seed=0, config_only=True, blocks=24, one_rank_of_tp=8
    )["dsa"]
    capsys.readouterr()
    argv = ["--config", str(ckpt), "--tp", "1", "--max-model-len", "4096"]
    argv += ["--kv-budget", f"{args.kv_cache_gib}GiB", "--json"]
    assert kv_plan_cli.main(argv) == 0
    plan = json.loads(capsys.readouterr().out)
    budget = args.kv_cache_gib * 2**30
    for row in rows:
        tokens = row.input_len + args.output_len
        per_request = -(-tokens // plan["block_size"]) + plan["num_state_groups"]
        assert row.batch * per_request <= plan["num_blocks"], row
        dense = 24 * 2 * (512 + 64) * tokens + 72 * plan["kda_state_bytes"]
        assert row.batch * dense <= budget, row


def _runner_module():
    runner = _ROOT / "tools" / "gpu"
    sys.path.insert(0, str(runner))
    try:
        import run
    finally:
        sys.path.remove(str(runner))
    return run
