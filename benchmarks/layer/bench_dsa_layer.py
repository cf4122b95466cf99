# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""One Kimi K3.1 DSA layer under vLLM on one GPU: the fused forward, the
wrapper forward (upstream ops only) and vLLM 0.33.0's DeepSeek V3.2 sparse MLA
layer at the same dims, against plain Kimi K3's dense MLA layer (vLLM 0.33.0's
own; ``dense-bf16`` and ``dense-fp8`` caches), in decode steps and prefill
chunks.

Decode steps are captured in a CUDA graph with the forward context's runtime
mode FULL (vLLM's mode for uniform decode batches; FlashMLA sparse, FlashMLA
and FlashAttention MLA declare UNIFORM_BATCH, and breakable capture runs
attention inside the graph in FULL mode) and replayed; prefill chunks run
eagerly, as vLLM runs them outside full graphs. ``--profile`` adds a
per-stage breakdown of one eager step and the host time of building the
layer's attention metadata (``metadata_build_us``, and per cache
``metadata_build_us_by_cache`` and its cProfile hotspots,
``metadata_hotspots_by_cache``).

Every point is measured on its own: one that fails is recorded with its error
(and a decode step that cannot be captured is timed eagerly, saying so), the
others still run, the records are written after each point, and the exit
status is 1 when any point failed. A point vLLM itself cannot run on the
device (dense fp8 prefill below SM100) is recorded as skipped, with why.

    python benchmarks/layer/bench_dsa_layer.py --layers fused wrapper v32 \\
        --tp-heads 96 12 --json out.json --profile
    python benchmarks/layer/bench_dsa_layer.py \\
        --layers fused dense-bf16 dense-fp8 --tp-heads 12 --json out.json

``fused-shared`` and ``wrapper-shared`` time one rank of TP ``--indexer-tp``
(give ``--tp-heads`` its heads, 12 for TP 8): its share of the indexer's
prefill rows and, at batch >= TP, of the decode requests (as
``VLLM_KIMI_K3_DSA_INDEXER_DECODE_SHARD=1`` shares them), the top-k
all-gathers stood in for by device copies (:mod:`indexer_share`).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import re
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import candidate_kernels as C  # noqa: E402
import dsa_layer_setup as S  # noqa: E402
import indexer_share as I  # noqa: E402

SHARED_LAYERS = tuple(f"{k}{I.SHARED_SUFFIX}" for k in ("fused", "wrapper"))
CANDIDATE_LAYERS = C.LAYERS

HIDDEN = 7168
# Kernel name -> stage, first match wins (case-insensitive). Names from the
# sources: our csrc/kimi_k3 kernels and dsa_ops Triton kernels, vLLM 0.33.0's
# csrc (concat_and_cache_ds_mla, indexer_k_quant_and_cache, topKPerRow*) and
# deepseek_v32/common/kernels.py (_fused_norm_rope_kernel, _fused_q_kernel),
# DeepGEMM's fp8_mqa_logits / fp8_paged_mqa_logits, FlashMLA's sparse kernels.
STAGE_PATTERNS: list[tuple[str, str]] = [
    ("prologue", r"dsa_prologue|fused_norm_rope|indexer_k_insert|rms_?norm"
     r"|layer_?norm|concat_and_cache|indexer_k_quant_and_cache|FillFunctor"),
    ("q_quant", r"q_fp8_fold_weights|q_mxfp4|_fused_q_kernel|group_quant"),
    ("indexer_logits", r"mqa_logits|clean_logits"),
    # canonical_topk's kernels (Triton names them by function), before vLLM's.
    ("canonical_topk", r"canonical_topk"),
    ("topk", r"topk|top_k|radix|sort"),
    ("sparse_attn", r"flash|sparse|mla|convert_req_index|combine"),
    ("gate_o_proj", r"sigmoid|gate"),
    ("gemm", r"gemm|gemv|cutlass|xmma|nvjet|cublas|skinny|matmul|bmm|splitk"),
]  # fmt: skip


def classify(names: list[str]) -> list[str]:
    """The stage of each kernel of one step, in launch order. GEMMs after the
    first sparse-attention kernel (MLA's W_UV bmm, o_proj) count as
    ``gate_o_proj``; names no pattern matches are ``other``."""
    stages, seen_attn = [], False
    for name in names:
        stage = next(
            (s for s, pat in STAGE_PATTERNS if re.search(pat, name, re.I)), "other"
        )
        seen_attn |= stage == "sparse_attn"
        stages.append("gate_o_proj" if stage == "gemm" and seen_attn else stage)
    return stages


def forward(bench: S.LayerBench, graph: bool) -> torch.Tensor:
    """One step inside vLLM's forward context (FULL mode when captured), in
    inference mode as vLLM's runner steps (grad mode would refuse the
    ``out=`` GEMMs of MLA, whose inputs then require grad through the norms'
    weights)."""
    from vllm.config import CUDAGraphMode, set_current_vllm_config
    from vllm.forward_context import BatchDescriptor, set_forward_context

    num_tokens = bench.spec.num_tokens
    mode = CUDAGraphMode.FULL if graph else CUDAGraphMode.NONE
    desc = BatchDescriptor(num_tokens, bench.spec.batch, uniform=graph)
    with (
        torch.inference_mode(),
        set_current_vllm_config(bench.vllm_config),
        set_forward_context(
            bench.attn_metadata,
            bench.vllm_config,
            num_tokens=num_tokens,
            cudagraph_runtime_mode=mode,
            batch_descriptor=desc if graph else None,
            slot_mapping=bench.slot_mapping,
        ),
    ):
        return bench.layer(bench.positions, bench.hidden)


def require_cuda() -> None:
    if not torch.cuda.is_available():
        raise RuntimeError(
            "bench_dsa_layer times on a CUDA GPU (FlashMLA sparse, DeepGEMM); "
            "no CUDA device is visible. The setup path alone runs on the CPU "
            "(tests/benchmarks/test_bench_dsa_layer.py)."
        )


def _median_us(run: Any, reps: int) -> float:
    """Median microseconds of ``run()`` between two events on the stream."""
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(True), torch.cuda.Event(True)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def time_step(
    bench: S.LayerBench, reps: int, warmup: int = 3
) -> tuple[float, str | None]:
    """Median microseconds of one step (graph replays for decode, eager calls
    for prefill), and why a decode step ran eagerly (None: it replayed).

    Warm-up runs the step in the mode it will be captured in, so every kernel
    is compiled and every workspace allocated before the capture."""
    require_cuda()
    graph = bench.spec.mode == "decode"
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            forward(bench, graph=graph)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    if not graph:
        return _median_us(lambda: forward(bench, graph=False), reps), None
    g = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(g):
            forward(bench, graph=True)
        torch.cuda.synchronize()
        for _ in range(warmup):
            g.replay()
        return _median_us(g.replay, reps), None
    except Exception as e:
        # Not capturable: an eager time is still a number, and says so.
        reason = f"{type(e).__name__}: {e}".splitlines()[0][:500]
        del g
        torch.cuda.synchronize()
        return _median_us(lambda: forward(bench, graph=False), reps), reason


def step_breakdown(
    names: list[str], durations_us: list[float]
) -> tuple[dict[str, float], list[str], dict[str, float]]:
    """One step's kernels (in launch order) summed per stage, the names no
    pattern matched (to fix :data:`STAGE_PATTERNS`), and each kernel name's
    total (names cut to 120 characters)."""
    stages: dict[str, float] = {}
    kernels: dict[str, float] = {}
    for name, us, stage in zip(names, durations_us, classify(names), strict=True):
        stages[stage] = stages.get(stage, 0.0) + us
        kernels[name[:120]] = kernels.get(name[:120], 0.0) + us
    unclassified = sorted({n for n in names if classify([n]) == ["other"]})
    return stages, unclassified, kernels


def profile_step(
    bench: S.LayerBench,
) -> tuple[dict[str, float], list[str], dict[str, float]]:
    """:func:`step_breakdown` of one eager step."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    require_cuda()
    forward(bench, graph=False)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        forward(bench, graph=False)
        torch.cuda.synchronize()
    kernels = sorted(
        (e for e in prof.events() if e.device_type == DeviceType.CUDA),
        key=lambda e: e.time_range.start,
    )
    return step_breakdown(
        [e.name for e in kernels], [e.time_range.elapsed_us() for e in kernels]
    )


def _warm_builders(bench: S.LayerBench, warm_s: float) -> None:
    """Builds every cache group's metadata once, then again until ``warm_s``
    seconds have passed: a host fresh from GPU work runs its first builds
    slower, which would charge the first point measured."""
    start = time.perf_counter()
    while True:
        for group in bench.groups.values():
            group.build_metadata(bench.common)
        if time.perf_counter() - start >= warm_s:
            return


def metadata_build_us(
    bench: S.LayerBench, reps: int, warm_s: float = 0.25
) -> tuple[float, dict[str, float]]:
    """Median host microseconds to build this layer's attention metadata, as
    the runner does once a step per KV cache group (here: every cache of the
    layer, from the same common metadata), and each cache's own median (which
    builder the time goes to). The GPU is idle when each build starts; a
    build that waits on the GPU is charged for it."""
    cuda = bench.hidden is not None and bench.hidden.is_cuda
    groups = bench.groups
    if not groups:
        raise RuntimeError("the layer bench holds no metadata builders")
    _warm_builders(bench, warm_s)
    totals: list[float] = []
    by_cache: dict[str, list[float]] = {name: [] for name in groups}
    for _ in range(reps):
        if cuda:
            torch.cuda.synchronize()
        total = 0.0
        for name, group in groups.items():
            start = time.perf_counter()
            group.build_metadata(bench.common)
            elapsed = (time.perf_counter() - start) * 1e6
            by_cache[name].append(elapsed)
            total += elapsed
        totals.append(total)
    if cuda:
        torch.cuda.synchronize()
    return statistics.median(totals), {
        name: statistics.median(times) for name, times in by_cache.items()
    }


def metadata_hotspots(
    bench: S.LayerBench, reps: int, top: int = 15, warm_s: float = 0.25
) -> dict[str, list[dict[str, Any]]]:
    """Where each cache's metadata build spends its host time: the ``top``
    functions by own time under cProfile, per build. cProfile slows Python
    calls, so the shares matter, not the sums; torch ops and kernel launches
    show as built-in calls."""
    import cProfile
    import pstats

    out: dict[str, list[dict[str, Any]]] = {}
    _warm_builders(bench, warm_s)
    for name, group in bench.groups.items():
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(reps):
            group.build_metadata(bench.common)
        profiler.disable()
        stats = pstats.Stats(profiler).stats  # type: ignore[attr-defined]
        rows = sorted(stats.items(), key=lambda kv: kv[1][2], reverse=True)[:top]
        out[name] = [
            dict(
                function=f"{Path(file).name}:{line}({func})",
                own_us=own * 1e6 / reps,
                cumulative_us=cum * 1e6 / reps,
                calls=calls / reps,
            )
            for (file, line, func), (_, calls, own, cum, _) in rows
        ]
    return out


def specs(args: argparse.Namespace) -> list[S.Spec]:
    out = [
        S.Spec("decode", b, c, 1) for c in args.contexts for b in args.decode_batches
    ]
    out += [
        S.Spec("prefill", 1, c, n) for c in args.contexts for n in args.prefill_chunks
    ]
    return out


def config_sizes(args: argparse.Namespace) -> tuple[int, int, int]:
    """``max_model_len``, ``max_num_batched_tokens`` and ``max_num_seqs`` that
    hold every point of ``args``."""
    points = specs(args)
    max_len = max(p.seq_len for p in points)
    seqs = max(args.decode_batches, default=1)
    max_batched = max(max(p.num_tokens for p in points), seqs)
    return max_len, max_batched, seqs


def init_runtime(cfg: Any, device: torch.device) -> None:
    """Single-rank distributed groups and vLLM's workspace manager, once."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed.parallel_state import (
        ensure_model_parallel_initialized,
        init_distributed_environment,
        model_parallel_is_initialized,
    )
    from vllm.utils.network_utils import get_distributed_init_method, get_open_port
    from vllm.v1.worker.workspace import (
        init_workspace_manager,
        is_workspace_manager_initialized,
    )

    with set_current_vllm_config(cfg):
        if not model_parallel_is_initialized():
            backend = "nccl" if device.type == "cuda" else "gloo"
            init_method = get_distributed_init_method("127.0.0.1", get_open_port())
            init_distributed_environment(1, 0, init_method, 0, backend)
            ensure_model_parallel_initialized(1, 1)
        if not is_workspace_manager_initialized():
            init_workspace_manager(device)


def shutdown_runtime() -> None:
    """Tear the process groups down (a live NCCL group can stall the exit)."""
    from vllm.distributed.parallel_state import (
        destroy_distributed_environment,
        destroy_model_parallel,
    )

    destroy_model_parallel()
    destroy_distributed_environment()


def bench_device() -> torch.device:
    """The timing GPU, with its index (vLLM's builders read ``device.index``)."""
    require_cuda()
    index = torch.cuda.current_device()
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def measure(
    kind: str,
    spec: S.Spec,
    cfg: Any,
    device: torch.device,
    args: argparse.Namespace,
) -> dict[str, Any]:
    """Build one point, time it (and profile it), and free it, under its
    variant's switches (a layer reads them when built)."""
    with C.variant(kind):
        shared = kind in SHARED_LAYERS
        kind = C.base_kind(I.base_kind(kind))
        bench = S.setup(kind, spec, cfg, device)
        try:
            if kind == "fused" and bench.layer._packed is None:
                raise RuntimeError("the fused layer did not pack (see the log)")
            reason = S.unsupported_reason(bench)
            if reason is not None:
                raise S.Unsupported(reason)
            out: dict[str, Any] = {}
            exchange: Any = contextlib.nullcontext([])
            if shared:
                out["indexer_tp"] = args.indexer_tp
                out["indexer_rows_by_rank"] = I.share_prefill_rows(
                    bench, args.indexer_tp
                )
                exchange = I.stand_in_row_exchange(args.indexer_tp)
            with exchange as exchanged:
                median, eager_reason = S.under_env(kind, time_step, bench, args.reps)
                if args.profile:
                    stages = S.under_env(kind, profile_step, bench)
            expect_exchange = out.get("indexer_rows_by_rank") is not None or (
                spec.mode == "decode" and spec.batch >= args.indexer_tp
            )
            if shared and expect_exchange and not exchanged:
                raise RuntimeError("the indexer scored every row: no row exchange ran")
            out["median_us"] = median
            if spec.mode == "decode":
                out["graph"] = eager_reason is None
                if eager_reason is not None:
                    out["graph_error"] = eager_reason
            if args.profile:
                out["stages_us"], out["unclassified"], out["kernels_us"] = stages
                (
                    out["metadata_build_us"],
                    out["metadata_build_us_by_cache"],
                ) = S.under_env(kind, metadata_build_us, bench, args.reps)
                out["metadata_hotspots_by_cache"] = S.under_env(
                    kind, metadata_hotspots, bench, args.reps
                )
            out["backends"] = dict(bench.backends)
            if kind in S.DENSE_LAYERS:
                out.update(dense_fields(bench))
            if bench.notes:
                out["notes"] = list(bench.notes)
            return out
        finally:
            del bench
            S.release(cfg)
            gc.collect()
            if device.type == "cuda":
                # After a CUDA error this raises too; the record keeps the first.
                with contextlib.suppress(Exception):
                    torch.cuda.empty_cache()


def dense_fields(bench: S.LayerBench) -> dict[str, Any]:
    """What a dense point reads, beside its time: the latent cache's bytes
    per token (bf16 1152, fp8 576), for decode the bytes of every cached
    token of the batch (dense MLA reads them all), and the prefill backend."""
    (per_token,) = S.cache_bytes_per_token(bench).values()
    out: dict[str, Any] = dict(kv_bytes_per_token=per_token)
    if bench.spec.mode == "decode":
        out["kv_bytes_read"] = bench.spec.batch * bench.spec.seq_len * per_token
    out["prefill_backend"] = bench.layer.prefill_backend.get_name()
    return out


def _failure(e: BaseException) -> dict[str, Any]:
    """A failed point's record fields."""
    return dict(
        error=f"{type(e).__name__}: {e}".splitlines()[0][:1000],
        traceback=traceback.format_exc()[-8000:],
    )


def run(args: argparse.Namespace, on_record: Any = None) -> list[dict[str, Any]]:
    """Every point of ``args``; ``on_record(records)`` after each one."""
    device = bench_device()
    points = specs(args)
    sizes = config_sizes(args)
    records: list[dict[str, Any]] = []
    for heads in args.tp_heads:
        for kind in args.layers:
            cfg, cfg_error = None, None
            extra: dict[str, str] = {}
            if kind in S.DENSE_LAYERS and args.dense_backend is not None:
                extra["attention_backend"] = args.dense_backend
            try:
                cfg = S.make_vllm_config(
                    C.base_kind(I.base_kind(kind)), heads, HIDDEN, *sizes, **extra
                )
                init_runtime(cfg, device)
            except Exception as e:
                cfg_error = _failure(e)
            for spec in points:
                rec: dict[str, Any] = dict(
                    layer=kind, heads=heads, mode=spec.mode, batch=spec.batch,
                    context=spec.context, tokens=spec.num_tokens,
                )  # fmt: skip
                if cfg_error is not None:
                    rec.update(cfg_error)
                else:
                    try:
                        rec.update(measure(kind, spec, cfg, device, args))
                    except S.Unsupported as e:
                        rec["skipped"] = str(e)
                    except Exception as e:
                        rec.update(_failure(e))
                        print(rec["traceback"], file=sys.stderr, flush=True)
                print(
                    json.dumps({k: v for k, v in rec.items() if k != "traceback"}),
                    flush=True,
                )
                records.append(rec)
                if on_record is not None:
                    on_record(records)
    return records


def print_table(records: list[dict[str, Any]]) -> None:
    """Step times per point, with the fused forward's speedup over each other
    layer (its time over the fused time): the wrapper, V3.2 and, when dense
    points were run, each dense MLA layer."""
    by = {
        (r["layer"], r["heads"], r["mode"], r["batch"], r["context"], r["tokens"]): r[
            "median_us"
        ]
        for r in records
        if "median_us" in r
    }
    ran = {r["layer"] for r in records}
    layers = [
        *S.DSA_LAYERS,
        *(k for k in (*SHARED_LAYERS, *CANDIDATE_LAYERS, *S.DENSE_LAYERS) if k in ran),
    ]
    short = {
        "wrapper": "wrap",
        "dense-bf16": "d-bf16",
        "dense-fp8": "d-fp8",
        "fused-shared": "f-shr",
        "wrapper-shared": "w-shr",
        "fused-cand": "f-cand",
        "fused-unpadded": "f-unpad",
    }
    ratio_cols = [f"x {short.get(k, k)}" for k in layers[1:]]
    cols = ("heads", "mode", "B", "ctx", "T", *layers, *ratio_cols)
    width = max(9, *(len(c) for c in cols))
    print(" ".join(f"{c:>{width}}" for c in cols))
    for key in sorted({k[1:] for k in by}):
        t = [by.get((layer, *key)) for layer in layers]
        ratios = [f"{o / t[0]:.2f}" if o and t[0] else "-" for o in t[1:]]
        cells = [*key, *(f"{x:.1f}" if x else "-" for x in t), *ratios]
        print(" ".join(f"{c:>{width}}" for c in cells))


def plot(records: list[dict[str, Any]], path: str) -> None:
    """Decode step time against context, one line per layer and batch."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed; no plot written")
        return
    heads = sorted({r["heads"] for r in records})
    fig, axes = plt.subplots(1, len(heads), figsize=(6 * len(heads), 4), squeeze=False)
    # One colour per layer, one marker per batch: a dozen lines stay apart.
    layers = sorted({r["layer"] for r in records})
    colours = {layer: f"C{i}" for i, layer in enumerate(layers)}
    batches = sorted({r["batch"] for r in records if r["mode"] == "decode"})
    markers = {b: "osD^vP*X"[i % 8] for i, b in enumerate(batches)}
    for ax, h in zip(axes[0], heads, strict=True):
        rows = [
            r
            for r in records
            if r["heads"] == h and r["mode"] == "decode" and "median_us" in r
        ]
        for layer, batch in sorted({(r["layer"], r["batch"]) for r in rows}):
            pts = sorted(
                (r["context"], r["median_us"])
                for r in rows
                if (r["layer"], r["batch"]) == (layer, batch)
            )
            ax.plot(
                [p[0] for p in pts],
                [p[1] for p in pts],
                color=colours[layer],
                marker=markers[batch],
                linestyle="--" if layer in S.DENSE_LAYERS else "-",
                label=f"{layer} B={batch}",
            )
        ax.set(
            xscale="log",
            yscale="log",
            xlabel="context (tokens)",
            ylabel="decode step (us)",
        )
        ax.set_title(f"{h} heads")
        ax.legend(fontsize=7)
    fig.savefig(path, bbox_inches="tight")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--layers",
        nargs="+",
        choices=(*S.LAYERS, *SHARED_LAYERS, *CANDIDATE_LAYERS),
        default=list(S.DSA_LAYERS),
    )
    p.add_argument(
        "--indexer-tp",
        type=int,
        default=8,
        help="TP size whose rank 0 the -shared layers time (its share of the "
        "indexer's prefill rows)",
    )
    p.add_argument("--tp-heads", nargs="+", type=int, default=[96, 12])
    # Either list may be given empty (a decode-only or prefill-only grid).
    p.add_argument("--decode-batches", nargs="*", type=int, default=[1, 8, 64, 256])
    p.add_argument("--contexts", nargs="+", type=int, default=[4096, 32768, 131072])
    p.add_argument("--prefill-chunks", nargs="*", type=int, default=[1024, 4096, 8192])
    p.add_argument(
        "--dense-backend",
        help="attention backend of the dense kinds (vLLM's --attention-backend, "
        "e.g. FLASHMLA); default: the one vLLM selects, as when serving",
    )
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--profile", action="store_true")
    p.add_argument("--json", help="write the records here")
    p.add_argument("--plot", help="write a decode plot here (needs matplotlib)")
    p.add_argument(
        "--from-json",
        nargs="+",
        metavar="JSON",
        help="time nothing: print the table (and --plot) of earlier runs' records",
    )
    args = p.parse_args(argv)
    if args.from_json:
        return args
    if not args.decode_batches and not args.prefill_chunks:
        p.error("no points: give --decode-batches or --prefill-chunks")
    if args.indexer_tp < 2:
        p.error(f"--indexer-tp must be at least 2, not {args.indexer_tp}")
    return args


def write_json(path: str, records: list[dict[str, Any]]) -> None:
    """The records so far, replaced atomically (a crash keeps the last)."""
    out = Path(path)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps(records, indent=1))
    tmp.replace(out)


def main(argv: list[str] | None = None) -> int:
    """Exit status: 0 when every point ran or was skipped (vLLM cannot run it
    on this device), 1 when any failed."""
    args = parse_args(argv)
    if args.from_json:
        records = [
            r for path in args.from_json for r in json.loads(Path(path).read_text())
        ]
        print_table(records)
        if args.plot:
            plot(records, args.plot)
        return 0
    if args.json:
        # Before the run: a missing folder must not cost its results.
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    on_record = (lambda recs: write_json(args.json, recs)) if args.json else None
    try:
        records = run(args, on_record)
    finally:
        if torch.cuda.is_available():
            try:
                shutdown_runtime()
            except Exception as e:  # teardown must not mask the results
                print(f"teardown: {type(e).__name__}: {e}", file=sys.stderr)
    print_table(records)
    if args.plot:
        plot(records, args.plot)
    for r in records:
        if "skipped" in r:
            print(
                f"SKIPPED {r['layer']} heads={r['heads']} {r['mode']} "
                f"B={r['batch']} ctx={r['context']}: {r['skipped']}",
                file=sys.stderr,
            )
    failed = [r for r in records if "error" in r]
    for r in failed:
        print(
            f"FAILED {r['layer']} heads={r['heads']} {r['mode']} B={r['batch']} "
            f"ctx={r['context']}: {r['error']}",
            file=sys.stderr,
        )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
