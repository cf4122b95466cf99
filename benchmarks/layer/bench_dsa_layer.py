# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""One Kimi K3.1 DSA layer under vLLM on one GPU: the fused forward, the
wrapper forward (upstream ops only) and vLLM 0.33.0's DeepSeek V3.2 sparse MLA
layer at the same dims, in decode steps and prefill chunks.

Decode steps are captured in a CUDA graph with the forward context's runtime
mode FULL (vLLM's mode for uniform decode batches; FlashMLA sparse declares
UNIFORM_BATCH, and breakable capture runs attention inside the graph in FULL
mode) and replayed; prefill chunks run eagerly, as vLLM runs them outside
full graphs. ``--profile`` adds a per-stage breakdown of one eager step.

    python benchmarks/layer/bench_dsa_layer.py --layers fused wrapper v32 \\
        --tp-heads 96 12 --json out.json --profile
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import dsa_layer_setup as S  # noqa: E402

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
    """One step inside vLLM's forward context (FULL mode when captured)."""
    from vllm.config import CUDAGraphMode, set_current_vllm_config
    from vllm.forward_context import BatchDescriptor, set_forward_context

    num_tokens = bench.spec.num_tokens
    mode = CUDAGraphMode.FULL if graph else CUDAGraphMode.NONE
    desc = BatchDescriptor(num_tokens, bench.spec.batch, uniform=graph)
    with (
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


def time_step(bench: S.LayerBench, reps: int, warmup: int = 3) -> float:
    """Median microseconds of one step: graph replays for decode, eager
    calls for prefill."""
    require_cuda()
    graph = bench.spec.mode == "decode"
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            forward(bench, graph=False)
    torch.cuda.current_stream().wait_stream(side)
    run = lambda: forward(bench, graph=False)  # noqa: E731
    if graph:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            forward(bench, graph=True)
        run = g.replay
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(True), torch.cuda.Event(True)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def profile_step(bench: S.LayerBench) -> tuple[dict[str, float], list[str]]:
    """Per-stage kernel microseconds of one eager step, and the names of the
    kernels no pattern matched (to fix :data:`STAGE_PATTERNS`)."""
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
    stages: dict[str, float] = {}
    names = [e.name for e in kernels]
    for e, stage in zip(kernels, classify(names), strict=True):
        stages[stage] = stages.get(stage, 0.0) + e.time_range.elapsed_us()
    return stages, sorted({n for n in names if classify([n]) == ["other"]})


def specs(args: argparse.Namespace) -> list[S.Spec]:
    out = [
        S.Spec("decode", b, c, 1) for c in args.contexts for b in args.decode_batches
    ]
    out += [
        S.Spec("prefill", 1, c, n) for c in args.contexts for n in args.prefill_chunks
    ]
    return out


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    require_cuda()
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

    device = torch.device("cuda")
    points = specs(args)
    max_len = max(p.seq_len for p in points)
    max_batched = max(max(p.num_tokens for p in points), max(args.decode_batches))
    records = []
    for heads in args.tp_heads:
        for kind in args.layers:
            cfg = S.make_vllm_config(
                kind, heads, HIDDEN, max_len, max_batched, max(args.decode_batches)
            )
            with set_current_vllm_config(cfg):
                if not model_parallel_is_initialized():
                    init_method = get_distributed_init_method(
                        "127.0.0.1", get_open_port()
                    )
                    init_distributed_environment(1, 0, init_method, 0, "nccl")
                    ensure_model_parallel_initialized(1, 1)
                if not is_workspace_manager_initialized():
                    init_workspace_manager(device)
            for spec in points:
                bench = S.setup(kind, spec, cfg, device)
                if kind == "fused" and bench.layer._packed is None:
                    raise RuntimeError("the fused layer did not pack (see log)")
                rec: dict[str, Any] = dict(
                    layer=kind, heads=heads, mode=spec.mode, batch=spec.batch,
                    context=spec.context, tokens=spec.num_tokens,
                    median_us=S.under_env(kind, time_step, bench, args.reps),
                )  # fmt: skip
                if args.profile:
                    stages = S.under_env(kind, profile_step, bench)
                    rec["stages_us"], rec["unclassified"] = stages
                print(json.dumps(rec), flush=True)
                records.append(rec)
                del bench
                torch.cuda.empty_cache()
    return records


def print_table(records: list[dict[str, Any]]) -> None:
    """Step times per point, with fused/wrapper and fused/v32 speedups."""
    by = {
        (r["layer"], r["heads"], r["mode"], r["batch"], r["context"], r["tokens"]): r[
            "median_us"
        ]
        for r in records
    }
    cols = ("heads", "mode", "B", "ctx", "T", *S.LAYERS, "x wrap", "x v32")
    print(" ".join(f"{c:>9}" for c in cols))
    for key in sorted({k[1:] for k in by}):
        t = [by.get((layer, *key)) for layer in S.LAYERS]
        ratios = [f"{o / t[0]:.2f}" if o and t[0] else "-" for o in t[1:]]
        cells = [*key, *(f"{x:.1f}" if x else "-" for x in t), *ratios]
        print(" ".join(f"{c:>9}" for c in cells))


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
    for ax, h in zip(axes[0], heads, strict=True):
        rows = [r for r in records if r["heads"] == h and r["mode"] == "decode"]
        for layer, batch in sorted({(r["layer"], r["batch"]) for r in rows}):
            pts = sorted(
                (r["context"], r["median_us"])
                for r in rows
                if (r["layer"], r["batch"]) == (layer, batch)
            )
            ax.plot(
                [p[0] for p in pts],
                [p[1] for p in pts],
                marker="o",
                label=f"{layer} B={batch}",
            )
        ax.set(xscale="log", xlabel="context (tokens)", ylabel="decode step (us)")
        ax.set_title(f"{h} heads")
        ax.legend(fontsize=7)
    fig.savefig(path, bbox_inches="tight")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", nargs="+", choices=S.LAYERS, default=list(S.LAYERS))
    p.add_argument("--tp-heads", nargs="+", type=int, default=[96, 12])
    p.add_argument("--decode-batches", nargs="+", type=int, default=[1, 8, 64, 256])
    p.add_argument("--contexts", nargs="+", type=int, default=[4096, 32768, 131072])
    p.add_argument("--prefill-chunks", nargs="+", type=int, default=[1024, 4096, 8192])
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--profile", action="store_true")
    p.add_argument("--json", help="write the records here")
    p.add_argument("--plot", help="write a decode plot here (needs matplotlib)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    records = run(args)
    print_table(records)
    if args.json:
        Path(args.json).write_text(json.dumps(records, indent=1))
    if args.plot:
        plot(records, args.plot)


if __name__ == "__main__":
    main()
