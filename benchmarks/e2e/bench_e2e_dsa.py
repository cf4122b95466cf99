# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""End-to-end latency of the DSA layer against dense MLA, through ``vllm.LLM``.

Three engines on the same real-attention tiny checkpoint (Kimi K3.1's 96 MLA
heads and its 32 x 128 indexer, the rest small): ``fused`` (our fused forward),
``wrapper`` (``VLLM_KIMI_K3_DSA_FORCE_WRAPPER=1``: upstream ops only) and
``dense`` (the same checkpoint written without ``dsa_config``: plain Kimi K3
MLA). Each row is ``batch`` random-token prompts of ``input_len`` tokens and
``output_len`` sampled tokens with ``ignore_eos``: the loop of
``vllm bench latency`` (its ``SamplingParams``, prefix caching off), but one
engine serves every row: an engine start costs 30-200 s, and a GPU sitting
holds a machine for 30 minutes. Spread comes from ``--starts`` engine starts
per mode, run interleaved (start 1 of every mode, then start 2, ...), and
``--iters`` repeats of each row inside a start, interleaved too (a warm-up
pass over every row, then each repeat over every row in turn); the spread is
over the repeats.

Times are vLLM's own stats (``disable_log_stats=False``), engine-core
timestamps. TTFT is each request's ``first_token_latency`` (for a batch, the
later prompts queue behind the earlier ones' prefill). The decode step is the
median inter-token latency over the steps in which every request of the row
decodes and none prefills (``IterationStats``: ``batch`` new tokens, no first
token, ``batch`` requests running), read through the engine's stat-logger
manager; a row's decode rate is ``batch / step`` tokens/s. Chunked prefill
overlaps decode otherwise, so ``--max-num-batched-tokens`` (the same for every
mode) sets how many steps the prefill takes and thus how many pure-decode
steps remain. ``vllm bench latency`` itself reports only the whole batch's
wall time; ``--vllm-bench-latency`` runs it on the same checkpoints (whose
vocabulary holds its prompt ids, drawn below 10000) as a cross-check.

    python benchmarks/e2e/bench_e2e_dsa.py --out build/e2e_bench \\
        --input-lens 8192 32768 131072 --batch-sizes 1 16 64 --output-len 256

The checkpoint has one attention layer and three KDA layers, so its decode
step is mostly the engine's fixed host cost (about 2.5 ms on an H200), the
same for every mode. ``--attention-blocks N`` repeats that four-layer block N
times (the real model: 24 attention layers of 93), so that the attention has
the share of the step it has there; give the KV cache room for N layers.

``--one-rank-of-tp N`` writes instead what one rank of TP N holds (96 / N MLA
and KDA heads, the 32 x 128 indexer whole, as it is replicated on every
rank), served at TP 1: with ``--attention-blocks 24``, one TP 8 rank's
attention at the real model's depth on one GPU, where the attention's share
of the step is a deployed rank's.

``--modes mtp`` adds the fused engine with the checkpoint's MTP layer as a
draft (``kimi_k3_mtp``, ``--mtp-tokens`` tokens) on the multimodal variant
of the checkpoint (the same text weights plus an MTP layer). Its weights are
random, so acceptance means nothing: its rows give the decode step's cost
with verification (``step x fused``) and the tokens a step emitted.

``--dry-run`` prints the plan (engines, rows, tokens to prefill) and exits.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

MODES = ("fused", "wrapper", "dense", "mtp")
DEFAULT_MODES = ("fused", "wrapper", "dense")
FORCE_WRAPPER_ENV = "VLLM_KIMI_K3_DSA_FORCE_WRAPPER"
TINY_CHECKPOINT_COMMAND = "kimi-k3-dsa-tiny-checkpoint"
TINY_CHECKPOINT_MODULE = "kimi_k3_dsa_tools.tiny_checkpoint_cli"
MAX_NUM_SEQS = 256
# vllm bench latency draws prompt ids below 10000: the checkpoints' vocabulary
# holds them, so that its own loop (--vllm-bench-latency) runs them too.
VOCAB_SIZE = 10240
LATENCY_WARMUP_ITERS = 1


@dataclass(frozen=True)
class Row:
    input_len: int
    batch: int

    @property
    def prefill_tokens(self) -> int:
        return self.input_len * self.batch


def plan_rows(
    input_lens: list[int], batch_sizes: list[int], max_prefill_tokens: int
) -> tuple[list[Row], list[Row]]:
    """The grid's rows, and those left out because one iteration would prefill
    more than ``max_prefill_tokens`` (dense MHA prefill is quadratic: 64 x 128K
    would take minutes a repeat)."""
    rows, skipped = [], []
    for input_len in input_lens:
        for batch in batch_sizes:
            row = Row(input_len, batch)
            (rows if row.prefill_tokens <= max_prefill_tokens else skipped).append(row)
    return rows, skipped


def engine_order(modes: list[str], starts: int) -> list[tuple[int, str]]:
    """Interleaved engine starts: every mode's first start, then the second;
    the mode order rotates so no mode always runs on the warmest caches."""
    order = []
    for start in range(starts):
        shift = start % len(modes)
        for mode in modes[shift:] + modes[:shift]:
            order.append((start, mode))
    return order


def schedule(rows: list[Row], iters: int) -> list[tuple[int, Row]]:
    """``(iteration, row)`` in run order: iteration -1 (the warm-up) of every
    row, then each repeat over every row in turn."""
    return [(it, row) for it in range(-1, iters) for row in rows]


def request_times(metrics: Any, output_len: int) -> dict[str, float]:
    """TTFT and TPOT of one finished request from vLLM's ``RequestStateStats``."""
    if metrics is None:
        raise RuntimeError(
            "RequestOutput.metrics is None: the engine must run with "
            "disable_log_stats=False"
        )
    generated = metrics.num_generation_tokens
    if generated != output_len:
        raise RuntimeError(f"a request generated {generated} tokens, not {output_len}")
    tpot = (metrics.last_token_ts - metrics.first_token_ts) / max(generated - 1, 1)
    return {"ttft_s": metrics.first_token_latency, "tpot_s": tpot}


@dataclass
class StepLog:
    """Every engine step's decode counts and inter-token latencies."""

    steps: list[tuple[int, int, int, list[float]]] = field(default_factory=list)

    def add(self, scheduler_stats: Any, iteration_stats: Any) -> None:
        if iteration_stats is None or scheduler_stats is None:
            return
        self.steps.append(
            (
                iteration_stats.num_generation_tokens,
                len(iteration_stats.time_to_first_tokens_iter),
                scheduler_stats.num_running_reqs,
                list(iteration_stats.inter_token_latencies_iter),
            )
        )

    def _pure_decode(self, batch: int) -> list[tuple[int, list[float]]]:
        # A speculative step emits 1 to k + 1 tokens a request, one ITL each.
        return [
            (new_tokens, itls)
            for new_tokens, first_tokens, running, itls in self.steps
            if len(itls) == running == batch
            and new_tokens >= batch
            and first_tokens == 0
        ]

    def pure_decode_itls(self, batch: int) -> list[float]:
        """ITLs of the steps where all ``batch`` requests decode, none prefills."""
        return [itl for _, itls in self._pure_decode(batch) for itl in itls]

    def tokens_per_step(self, batch: int) -> float | None:
        """Mean tokens a request got from one of those steps (1 without a draft)."""
        steps = self._pure_decode(batch)
        if not steps:
            return None
        return sum(n for n, _ in steps) / (batch * len(steps))


def attach_step_log(llm: Any) -> StepLog:
    """Record each step's stats as vLLM's ``StatLoggerManager`` receives them."""
    manager = llm.llm_engine.logger_manager
    if manager is None:
        raise RuntimeError("the engine has no stat loggers: disable_log_stats=False")
    log = StepLog()
    record = manager.record

    def recording(scheduler_stats: Any, iteration_stats: Any, *a: Any, **k: Any):
        log.add(scheduler_stats, iteration_stats)
        return record(scheduler_stats, iteration_stats, *a, **k)

    manager.record = recording
    return log


def summarize(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (input, batch, mode): medians over every repeat and start, the spread
    of the decode rates of the repeats (each start's each iteration), and the
    ratios to dense."""
    groups: dict[tuple[int, int, str], list[dict[str, Any]]] = {}
    for r in records:
        groups.setdefault((r["input_len"], r["batch"], r["mode"]), []).append(r)
    out = []
    for (input_len, batch, mode), recs in sorted(groups.items()):
        starts = {r["start"] for r in recs}
        step_repeats = [r["decode_itl_s"] for r in recs if r["decode_itl_s"]]
        steps = [t for v in step_repeats for t in v]
        summary = {
            "input_len": input_len,
            "batch": batch,
            "mode": mode,
            "ttft_ms": 1e3 * statistics.median(t for r in recs for t in r["ttft_s"]),
            "tpot_ms": 1e3 * statistics.median(t for r in recs for t in r["tpot_s"]),
            "decode_steps": len(steps),
            "starts": len(starts),
            "repeats": len(recs),
        }
        per_step = [r["tokens_per_step"] for r in recs if r.get("tokens_per_step")]
        if per_step:
            summary["tokens_per_step"] = statistics.fmean(per_step)
        if steps:
            rates = [batch / statistics.median(v) for v in step_repeats]
            summary |= {
                "step_ms": 1e3 * statistics.median(steps),
                "decode_tok_s": batch / statistics.median(steps),
                "decode_tok_s_min": min(rates),
                "decode_tok_s_max": max(rates),
            }
        out.append(summary)
    by_mode = {(s["mode"], s["input_len"], s["batch"]): s for s in out}
    for s in out:
        row = (s["input_len"], s["batch"])
        dense = by_mode.get(("dense", *row)) if s["mode"] != "dense" else None
        wrapper = by_mode.get(("wrapper", *row)) if s["mode"] == "fused" else None
        if dense is not None:
            s["ttft_x_dense"] = s["ttft_ms"] / dense["ttft_ms"]
        fused = by_mode.get(("fused", *row)) if s["mode"] == "mtp" else None
        if fused is not None and "step_ms" in s and "step_ms" in fused:
            s["step_x_fused"] = s["step_ms"] / fused["step_ms"]
        for name, ref in (("decode_x_dense", dense), ("decode_x_wrapper", wrapper)):
            if ref is not None and "decode_tok_s" in s and "decode_tok_s" in ref:
                s[name] = s["decode_tok_s"] / ref["decode_tok_s"]
    return out


def _ratio(value: float | None) -> str:
    return "" if value is None else f"{value:.2f}"


def print_summary(summary: list[dict[str, Any]]) -> None:
    print(
        f"{'input':>7} {'B':>3} {'mode':>8} {'TTFT ms':>9} {'step ms':>8} "
        f"{'steps':>6} {'decode tok/s':>13} {'(min-max)':>13} {'x dense':>8} "
        f"{'TTFT/dense':>10} {'step/fused':>10} {'tok/step':>8}"
    )
    for s in summary:
        if "decode_tok_s" in s:
            step = f"{s['step_ms']:.3f}"
            rate = f"{s['decode_tok_s']:.0f}"
            spread = f"{s['decode_tok_s_min']:.0f}-{s['decode_tok_s_max']:.0f}"
        else:
            step = rate = spread = "-"
        x = _ratio(s.get("decode_x_dense"))
        t = _ratio(s.get("ttft_x_dense"))
        v = _ratio(s.get("step_x_fused"))
        k = _ratio(s.get("tokens_per_step"))
        print(
            f"{s['input_len']:>7} {s['batch']:>3} {s['mode']:>8} {s['ttft_ms']:>9.1f} "
            f"{step:>8} {s['decode_steps']:>6} {rate:>13} {spread:>13} {x:>8} {t:>10} "
            f"{v:>10} {k:>8}"
        )


def markdown_summary(summary: list[dict[str, Any]]) -> str:
    """The summary as a Markdown table, for docs/benchmarks.md."""
    lines = [
        "| input x B | mode | TTFT ms | step ms | decode tok/s (min-max) "
        "| decode x dense | TTFT x dense | fused x wrapper | step x fused "
        "| tokens a step |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for s in summary:
        if "decode_tok_s" in s:
            step = f"{s['step_ms']:.2f}"
            rate = (
                f"{s['decode_tok_s']:.0f} "
                f"({s['decode_tok_s_min']:.0f}-{s['decode_tok_s_max']:.0f})"
            )
        else:
            step = rate = "-"
        size = f"{s['input_len'] // 1024}K x {s['batch']}"
        lines.append(
            f"| {size} | {s['mode']} | {s['ttft_ms']:.1f} | {step} | {rate} "
            f"| {_ratio(s.get('decode_x_dense'))} | {_ratio(s.get('ttft_x_dense'))} "
            f"| {_ratio(s.get('decode_x_wrapper'))} "
            f"| {_ratio(s.get('step_x_fused'))} | {_ratio(s.get('tokens_per_step'))} |"
        )
    return "\n".join(lines)


def summarize_files(args: argparse.Namespace) -> int:
    """Summarize committed ``records.jsonl`` files (several runs together)."""
    records = [
        json.loads(line)
        for path in args.records
        for line in Path(path).read_text().splitlines()
        if line.strip()
    ]
    if not records:
        raise SystemExit(f"no records in {' '.join(args.records)}")
    summary = summarize(records)
    if args.markdown:
        print(markdown_summary(summary))
    else:
        print_summary(summary)
    return 0


# -- the engine process -------------------------------------------------------


def engine_kwargs(model: str, max_len: int, args: argparse.Namespace) -> dict:
    """``vllm.LLM``'s arguments, the same for every mode: only the checkpoint,
    the wrapper switch and the MTP draft differ."""
    draft = {}
    length = {"max_position_embeddings": max_len}
    if getattr(args, "mode", None) == "mtp":
        # The multimodal checkpoint keeps the length in its text config.
        length = {"text_config": length}
        draft = {
            "speculative_config": {
                "method": "kimi_k3_mtp",
                "num_speculative_tokens": args.mtp_tokens,
            },
            "limit_mm_per_prompt": {"image": 0},
        }
    return draft | {
        "model": model,
        "skip_tokenizer_init": True,
        "enable_prefix_caching": False,
        "max_model_len": max_len,
        "hf_overrides": length,
        "kv_cache_memory_bytes": int(args.kv_cache_gib * 2**30),
        # vLLM 0.33.0's packed KDA decode kernel launches (V / 32, batch x KDA
        # heads) programs, and a grid's y is at most 65535: with this
        # checkpoint's 80 KDA heads on one GPU, the engine's warm-up decode at
        # max_num_seqs 1024 fails ("Triton Error [CUDA]: invalid argument").
        "max_num_seqs": MAX_NUM_SEQS,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "disable_log_stats": False,
        "seed": args.start,
        **parallel_kwargs(args),
    }


def parallel_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The engine's parallel layout: TP N, each rank 96 / N MLA heads and the
    indexer whole. DP attention needs one engine process a rank, which
    ``vllm.LLM`` refuses: serve it (``vllm serve``) and drive it with
    ``vllm bench serve``."""
    return {
        "tensor_parallel_size": args.tensor_parallel_size,
        "enable_expert_parallel": args.enable_expert_parallel,
    }


def run_engine(args: argparse.Namespace) -> int:
    """One engine start: every row, ``--iters`` repeats after one warm-up,
    one JSON line per repeat appended to ``--records``."""
    import numpy as np

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    rows = [Row(*map(int, r.split("x"))) for r in args.rows]
    max_len = max(r.input_len for r in rows) + args.output_len
    llm = LLM(**engine_kwargs(args.model, max_len, args))
    step_log = attach_step_log(llm)
    text_config = llm.llm_engine.model_config.hf_text_config
    attention_layers = len(text_config.linear_attn_config["full_attn_layers"])
    mla_heads = text_config.num_attention_heads
    # vllm bench latency's prompt ids: below 10000 (or the vocabulary).
    vocab = min(10000, llm.llm_engine.model_config.get_vocab_size())
    params = SamplingParams(
        temperature=1.0,
        top_p=1.0,
        ignore_eos=True,
        max_tokens=args.output_len,
        detokenize=False,
    )
    rng = np.random.default_rng(1000 + args.start)
    with open(args.records, "a") as f:
        # Every row once to warm up, then the repeats interleaved (each pass
        # over every row), so drift within a start spreads over all rows.
        for it, row in schedule(rows, args.iters):
            ids = rng.integers(vocab, size=(row.batch, row.input_len)).tolist()
            prompts = [TokensPrompt(prompt_token_ids=p) for p in ids]
            step_log.steps.clear()
            t0 = time.perf_counter()
            outputs = llm.generate(prompts, params, use_tqdm=False)
            wall = time.perf_counter() - t0
            if it < 0:
                continue
            times = [request_times(o.metrics, args.output_len) for o in outputs]
            record = {
                "mode": args.mode,
                "attention_layers": attention_layers,
                "mla_heads": mla_heads,
                "start": args.start,
                "iter": it,
                **asdict(row),
                "output_len": args.output_len,
                "wall_s": wall,
                "ttft_s": [t["ttft_s"] for t in times],
                "tpot_s": [t["tpot_s"] for t in times],
                "decode_itl_s": step_log.pure_decode_itls(row.batch),
                "tokens_per_step": step_log.tokens_per_step(row.batch),
            }
            f.write(json.dumps(record) + "\n")
            f.flush()
            print(
                f"[{args.mode} start {args.start}] {row.input_len}x{row.batch} "
                f"iter {it}: wall {wall:.2f} s, "
                f"{len(record['decode_itl_s'])} pure-decode ITLs",
                flush=True,
            )
    return 0


# -- the driver ---------------------------------------------------------------


def write_checkpoints(
    out: Path,
    seed: int,
    config_only: bool = False,
    blocks: int = 1,
    vocab_size: int = VOCAB_SIZE,
    multimodal: bool = False,
    one_rank_of_tp: int | None = None,
) -> dict[str, Path]:
    """The DSA and the dense real-attention checkpoints (same seed, ``blocks``
    repeats of the three-KDA, one-attention layer block, with
    ``one_rank_of_tp`` one rank of that TP size's heads), once; with
    ``multimodal``, the DSA one's multimodal variant too (its MTP layer).
    The directory names carry every shape option, so that runs of other
    shapes under the same ``out`` never reuse them."""
    suffix = "" if blocks == 1 else f"-b{blocks}"
    if one_rank_of_tp is not None:
        suffix += f"-rank-of-tp{one_rank_of_tp}"
    suffix += f"-v{vocab_size}"
    paths = {"dsa": out / f"ckpt-dsa{suffix}", "dense": out / f"ckpt-dense{suffix}"}
    if multimodal:
        paths["mtp"] = out / f"ckpt-dsa-mm{suffix}"
    # The console script, or its module where pip put no script on PATH (an
    # install with --target, as on the GPU test host).
    script = shutil.which(TINY_CHECKPOINT_COMMAND)
    command = [script] if script else [sys.executable, "-m", TINY_CHECKPOINT_MODULE]
    for kind, path in paths.items():
        if (path / "config.json").exists():
            continue
        extra = {"dense": ["--no-dsa"], "mtp": ["--multimodal", "--mtp-layers", "1"]}
        extra = extra.get(kind, [])
        extra += ["--config-only"] if config_only else ["--seed", str(seed)]
        extra += ["--attention-blocks", str(blocks), "--vocab-size", str(vocab_size)]
        if one_rank_of_tp is not None:
            extra += ["--one-rank-of-tp", str(one_rank_of_tp)]
        subprocess.run([*command, str(path), "--real-attention", *extra], check=True)
    return paths


def checkpoint_shape(blocks: int, one_rank_of_tp: int | None) -> str:
    """The plan's line on the checkpoints' attention, from the writer's own
    config (what the engines will serve)."""
    from kimi_k3_dsa_tools.tiny_checkpoint import real_attention_overrides

    config = real_attention_overrides(True, blocks, one_rank_of_tp)
    dsa = config["dsa_config"]
    rank = "" if one_rank_of_tp is None else f"one rank of TP {one_rank_of_tp}: "
    return (
        f"{blocks} attention layer(s) of {config['num_hidden_layers']}, {rank}"
        f"{config['num_attention_heads']} MLA heads, "
        f"{config['linear_attn_config']['num_heads']} KDA heads, indexer "
        f"{dsa['index_num_heads']} x {dsa['index_head_dim']} (whole)"
    )


def engine_command(
    args: argparse.Namespace, mode: str, start: int, model: Path, records: Path
) -> list[str]:
    rows = [f"{r.input_len}x{r.batch}" for r in args.planned_rows]
    return [
        sys.executable,
        __file__,
        "engine",
        "--mode", mode,
        "--start", str(start),
        "--model", str(model),
        "--records", str(records),
        "--output-len", str(args.output_len),
        "--iters", str(args.iters),
        "--kv-cache-gib", str(args.kv_cache_gib),
        "--max-num-batched-tokens", str(args.max_num_batched_tokens),
        "--mtp-tokens", str(args.mtp_tokens),
        "--tensor-parallel-size", str(args.tensor_parallel_size),
        *(["--enable-expert-parallel"] if args.enable_expert_parallel else []),
        "--rows", *rows,
    ]  # fmt: skip


def checkpoint_of(mode: str) -> str:
    return {"dense": "dense", "mtp": "mtp"}.get(mode, "dsa")


def mode_env(mode: str) -> dict[str, str]:
    env = dict(os.environ)
    env.pop(FORCE_WRAPPER_ENV, None)
    if mode == "wrapper":
        env[FORCE_WRAPPER_ENV] = "1"
    return env


def drive(args: argparse.Namespace) -> int:
    if max(args.batch_sizes) > MAX_NUM_SEQS:
        raise SystemExit(f"--batch-sizes: at most {MAX_NUM_SEQS} (max_num_seqs)")
    rows, skipped = plan_rows(
        args.input_lens, args.batch_sizes, args.max_prefill_tokens
    )
    if not rows:
        raise SystemExit("no row fits --max-prefill-tokens")
    args.planned_rows = rows
    order = engine_order(args.modes, args.starts)
    print(f"engines: {len(order)} ({', '.join(f'{m}#{s}' for s, m in order)})")
    if args.vllm_bench_latency:
        print(
            f"vllm bench latency: {len(order) * len(rows)} runs, one engine each "
            f"({1 + args.iters} batches a run: {LATENCY_WARMUP_ITERS} warm-up)"
        )
    print(f"rows: {', '.join(f'{r.input_len}x{r.batch}' for r in rows)}")
    if skipped:
        print(
            "left out (over --max-prefill-tokens "
            f"{args.max_prefill_tokens}): "
            + ", ".join(f"{r.input_len}x{r.batch}" for r in skipped)
        )
    shape = checkpoint_shape(args.attention_blocks, args.one_rank_of_tp)
    print(f"checkpoint: {shape}")
    print(
        f"parallel: TP {args.tensor_parallel_size}"
        + (", EP" if args.enable_expert_parallel else "")
    )
    print(
        "tokens prefilled per engine: "
        f"{sum(r.prefill_tokens for r in rows) * (args.iters + 1):,}"
    )
    if args.dry_run:
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    ckpts = write_checkpoints(
        out,
        args.seed,
        blocks=args.attention_blocks,
        vocab_size=args.vocab_size,
        multimodal="mtp" in args.modes,
        one_rank_of_tp=args.one_rank_of_tp,
    )
    if args.vllm_bench_latency:
        return drive_vllm_bench_latency(args, out, ckpts, order)
    records = out / "records.jsonl"
    status = 0
    for start, mode in order:
        model = ckpts[checkpoint_of(mode)]
        with open(out / f"engine_{mode}_{start}.log", "w") as log:
            proc = subprocess.run(
                engine_command(args, mode, start, model, records),
                env=mode_env(mode),
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        print(f"{mode} start {start}: rc={proc.returncode}", flush=True)
        status = status or proc.returncode
    if records.exists():
        recs = [json.loads(line) for line in records.read_text().splitlines() if line]
        summary = summarize(recs)
        (out / "summary.json").write_text(json.dumps(summary, indent=1))
        print_summary(summary)
    return status


def vllm_bench_latency_command(
    args: argparse.Namespace, model: Path, row: Row, start: int, out_json: Path
) -> list[str]:
    """``vllm bench latency`` for one row, with the engine arguments of
    :func:`engine_kwargs` (the driver's own loop) as its command line."""
    max_len = max(r.input_len for r in args.planned_rows) + args.output_len
    per_start = argparse.Namespace(**{**vars(args), "start": start})
    kwargs = engine_kwargs(str(model), max_len, per_start)
    return [
        sys.executable, "-m", "vllm.entrypoints.cli.main", "bench", "latency",
        "--model", kwargs["model"],
        "--skip-tokenizer-init",
        "--disable-detokenize",
        "--no-enable-prefix-caching",
        "--max-model-len", str(kwargs["max_model_len"]),
        "--hf-overrides", json.dumps(kwargs["hf_overrides"]),
        "--kv-cache-memory-bytes", str(kwargs["kv_cache_memory_bytes"]),
        "--max-num-seqs", str(kwargs["max_num_seqs"]),
        "--max-num-batched-tokens", str(kwargs["max_num_batched_tokens"]),
        "--seed", str(kwargs["seed"]),
        "--input-len", str(row.input_len),
        "--output-len", str(args.output_len),
        "--batch-size", str(row.batch),
        "--num-iters-warmup", str(LATENCY_WARMUP_ITERS),
        "--num-iters", str(args.iters),
        "--output-json", str(out_json),
        "--tensor-parallel-size", str(kwargs["tensor_parallel_size"]),
        *(["--enable-expert-parallel"] if kwargs["enable_expert_parallel"] else []),
    ]  # fmt: skip


def drive_vllm_bench_latency(
    args: argparse.Namespace,
    out: Path,
    ckpts: dict[str, Path],
    order: list[tuple[int, str]],
) -> int:
    """vLLM's own ``vllm bench latency`` per engine start, mode and row (one
    engine each): the batch's whole latency, prefill and decode together; a
    cross-check of the driver's loop on the same checkpoints and arguments."""
    status = 0
    results = []
    for start, mode in order:
        model = ckpts[checkpoint_of(mode)]
        for row in args.planned_rows:
            name = f"latency_{mode}_{start}_{row.input_len}x{row.batch}"
            command = vllm_bench_latency_command(
                args, model, row, start, out / f"{name}.json"
            )
            with open(out / f"{name}.log", "w") as log:
                proc = subprocess.run(
                    command, env=mode_env(mode), stdout=log, stderr=subprocess.STDOUT
                )
            print(f"{name}: rc={proc.returncode}", flush=True)
            status = status or proc.returncode
            if proc.returncode == 0:
                result = json.loads((out / f"{name}.json").read_text())
                results.append({"mode": mode, "start": start, **asdict(row)} | result)
    (out / "latency_summary.json").write_text(json.dumps(results, indent=1))
    print_latency_summary(results)
    return status


def print_latency_summary(results: list[dict[str, Any]]) -> None:
    """Median latency per row and mode over every start's iterations, with
    the spread and the ratio to dense."""
    groups: dict[tuple[int, int, str], list[float]] = {}
    for r in results:
        key = (r["input_len"], r["batch"], r["mode"])
        groups.setdefault(key, []).extend(r["latencies"])
    dense = {
        (i, b): statistics.median(v) for (i, b, m), v in groups.items() if m == "dense"
    }
    print(f"{'input':>7} {'B':>3} {'mode':>8} {'latency s':>10} {'(min-max)':>15} "
          f"{'x dense':>8}")  # fmt: skip
    for (input_len, batch, mode), values in sorted(groups.items()):
        median = statistics.median(values)
        ref = dense.get((input_len, batch))
        ratio = "" if ref is None or mode == "dense" else f"{ref / median:.2f}"
        spread = f"{min(values):.3f}-{max(values):.3f}"
        print(
            f"{input_len:>7} {batch:>3} {mode:>8} {median:>10.3f} {spread:>15} "
            f"{ratio:>8}"
        )


def add_parallel_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        help="vLLM's tensor_parallel_size for every engine (TP 8: 12 MLA heads a rank)",
    )
    p.add_argument(
        "--enable-expert-parallel",
        action="store_true",
        help="vLLM's enable_expert_parallel (the MoE across the TP ranks)",
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command")
    e = sub.add_parser("engine", help="internal: one engine start")
    e.add_argument("--mode", choices=MODES, required=True)
    e.add_argument("--start", type=int, required=True)
    e.add_argument("--model", required=True)
    e.add_argument("--records", required=True)
    e.add_argument("--output-len", type=int, required=True)
    e.add_argument("--iters", type=int, required=True)
    e.add_argument("--kv-cache-gib", type=float, required=True)
    e.add_argument("--max-num-batched-tokens", type=int, required=True)
    e.add_argument("--mtp-tokens", type=int, required=True)
    e.add_argument("--rows", nargs="+", required=True)
    add_parallel_args(e)
    m = sub.add_parser("summarize", help="summarize records.jsonl files")
    m.add_argument("records", nargs="+")
    m.add_argument("--markdown", action="store_true")
    p.add_argument("--out", default="build/e2e_bench")
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(DEFAULT_MODES))
    p.add_argument(
        "--mtp-tokens",
        type=int,
        default=1,
        help="num_speculative_tokens of the mtp mode's draft",
    )
    p.add_argument("--input-lens", type=int, nargs="+", default=[8192, 32768, 131072])
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--starts", type=int, default=3)
    p.add_argument("--iters", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--attention-blocks",
        type=int,
        default=1,
        help="repeats of the checkpoint's layer block (three KDA layers, one "
        "attention layer): with one, the step is the engine's host cost; the "
        "real model has 24 attention layers of 93",
    )
    p.add_argument(
        "--one-rank-of-tp",
        type=int,
        default=None,
        metavar="N",
        help="checkpoints of one rank of TP N, served at TP 1 (96 / N MLA and "
        "KDA heads, the indexer whole); default: all 96 MLA heads",
    )
    p.add_argument(
        "--kv-cache-gib",
        type=float,
        default=6.0,
        help="the engines' KV cache, the same for every mode (vLLM's "
        "kv_cache_memory_bytes)",
    )
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=32768,
        help="the engines' prefill chunk (the same for every mode)",
    )
    p.add_argument(
        "--max-prefill-tokens",
        type=int,
        default=2_200_000,
        help="leave out rows whose batch prefills more tokens than this",
    )
    p.add_argument(
        "--vocab-size",
        type=int,
        default=VOCAB_SIZE,
        help="the checkpoints' vocabulary; vllm bench latency needs 10000 or more",
    )
    p.add_argument(
        "--vllm-bench-latency",
        action="store_true",
        help="run vLLM's own `vllm bench latency` per engine start, mode and row "
        "(one engine each; --iters its iterations after one warm-up) instead of "
        "the driver's loop",
    )
    add_parallel_args(p)
    p.add_argument("--dry-run", action="store_true")
    args = p.parse_args(argv)
    for name in (
        "output_len",
        "starts",
        "iters",
        "max_prefill_tokens",
        "max_num_batched_tokens",
        "attention_blocks",
        "mtp_tokens",
        "tensor_parallel_size",
    ):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.command is None:
        # The checkpoint writer's own limits, refused before any engine runs.
        from kimi_k3_dsa_tools.tiny_checkpoint import (
            MAX_ATTENTION_BLOCKS,
            ONE_RANK_TP_SIZES,
        )

        if args.attention_blocks > MAX_ATTENTION_BLOCKS:
            p.error(f"--attention-blocks: at most {MAX_ATTENTION_BLOCKS}")
        rank = args.one_rank_of_tp
        if rank is not None and rank not in ONE_RANK_TP_SIZES:
            sizes = ", ".join(map(str, ONE_RANK_TP_SIZES))
            p.error(
                f"--one-rank-of-tp {rank}: give a TP size that divides Kimi "
                f"K3.1's 96 MLA and KDA heads: {sizes}"
            )
        tp = args.tensor_parallel_size
        if tp > 1 and tp not in ONE_RANK_TP_SIZES:
            sizes = ", ".join(map(str, ONE_RANK_TP_SIZES))
            p.error(
                f"--tensor-parallel-size {tp}: give a size that divides Kimi "
                f"K3.1's 96 MLA and KDA heads: {sizes}"
            )
        if tp > 1 and rank is not None:
            p.error(
                "--one-rank-of-tp serves one rank's checkpoint at TP 1: give it "
                "or --tensor-parallel-size, not both"
            )
    if args.command != "engine" and args.vllm_bench_latency and "mtp" in args.modes:
        p.error("--vllm-bench-latency runs the fused, wrapper and dense modes only")
    if args.command != "engine" and args.vllm_bench_latency and args.vocab_size < 10000:
        p.error(
            f"--vllm-bench-latency draws prompt ids below 10000: give --vocab-size "
            f"10000 or more, not {args.vocab_size}"
        )
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.command == "engine":
        return run_engine(args)
    if args.command == "summarize":
        return summarize_files(args)
    return drive(args)


if __name__ == "__main__":
    sys.exit(main())
