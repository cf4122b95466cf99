# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The packed DSA projections' GEMMs on one GPU: cuBLAS against vLLM 0.33.0's
shape-dynamic CuTe-DSL skinny GEMM, with its heuristic config and with a
small set of candidate configs, to fill ``PACKED_SHAPE_CONFIG_OVERRIDES`` in
``vllm/models/kimi_k3/nvidia/dsa_low_latency.py`` from measurements.

Per packed ``(N, K)`` of ``kimi_k31_packed_shapes()`` and token count ``M``
(1..16 by default) it times

- ``cublas``: ``F.linear`` in bf16, what the module falls back to;
- ``heuristic``: the skinny GEMM with ``ShapeDynamicSkinnyGemm._config``,
  what it runs without a config (the module's plan on devices not measured);
- ``candidate``: other ``SkinnyGemmConfig`` values valid for the shape.

Candidates. The kernel's constraints: ``num_rows == M``, ``block_size`` a
multiple of the warp size, ``N % outputs_per_block == 0``, ``K %
(block_size * vector_width) == 0`` (``static_k``, when set, equal to ``K``
and at least two such tiles); it is compiled with at most 64 registers a
thread, so ``M * outputs_per_block`` accumulators are kept at or below
:data:`MAX_ACCUMULATORS`. Within that space the candidates of an ``M`` are,
in this order: the configs vLLM 0.33.0 measured as winners at that ``M`` for
the other Kimi K3 shapes on this device (``KIMI_K3_PROJECTIONS_SM90`` on
SM90), then the one-step neighbours of the heuristic configs (block size,
outputs per block, unroll, vector width), configs valid for more packed
shapes first; ``--max-candidates`` of them per ``M``, for ``M`` up to
``--candidate-tokens``. The kernel is shape-dynamic in ``N`` and ``K``, so a
config is compiled once and timed on every packed shape it is valid for
(the heuristic config of one shape is a candidate for the others). Each
compile is a CuTe JIT of one to several seconds that grows with ``M``
(every row is unrolled); ``--dry-run`` prints the plan and a time estimate
without a GPU.

Timing as ``benchmark_kimi_k3_dsa.py``: one CUDA graph holds calls that
rotate through weight/input sets whose bytes exceed twice the L2
(``--l2-mb``), its median replay time over ``--reps`` (CUDA events) divided
by the number of calls. Fraction of copy: bytes moved (weight + input +
output; the weight is over 99 %) per time over the device-to-device copy
bandwidth (read + written) measured at the start. Before timing, every
variant's output on the first set is compared with ``x.float() @ w.float().T``:
``max|out - ref| <= CHECK_RTOL * max|ref|`` (2^-7: one to two bf16 ulps of
the largest output, at least twice its rounding; a lost K tile or a wrong
row is far above it); failing variants are not
timed and never suggested. Consecutive skinny-GEMM calls in the graph launch
with programmatic dependent launch, as in vLLM, so a call's prologue may
overlap the previous call's tail; cuBLAS calls do not.

Suggested overrides: per ``(N, K, M)`` the fastest checked skinny config if
it beats cuBLAS by ``--min-gain`` (5 %, vLLM's threshold for its tables),
else cuBLAS, in the form of ``PACKED_SHAPE_CONFIG_OVERRIDES``'s table for
the device's capability major (``None`` runs cuBLAS for that M; winners
differ between parts, as vLLM keeps ``KIMI_K3_PROJECTIONS{,_SM100,_SM90}``
apart). The printed block uses ``None`` for cuBLAS in that sense.

    python benchmarks/kernels/bench_packed_gemm.py --dry-run
    python benchmarks/kernels/bench_packed_gemm.py --json packed_gemm.json

Needs a CUDA GPU, vLLM 0.33.0 with this package, and the CuTe DSL
(``cutlass``) plus what vLLM's skinny GEMM compiles with (``quack``,
``cuda.bindings``); it exits with a message naming what is missing. Any
exception of one point (compile, check, capture) is recorded in the JSON,
which is rewritten after every point, and the run goes on; a lost CUDA
context ends the run with what was measured. ``--time-budget-s`` skips what
is left once spent.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import importlib.util
import json
import math
import sys
import time
import traceback
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from gpu_timing import copy_bandwidth, time_graph

from vllm.model_executor.kernels.linear.cute_dsl.skinny_gemm import (
    ShapeDynamicSkinnyGemm,
    SkinnyGemmConfig,
)
from vllm.models.kimi_k3.nvidia.dsa_low_latency import (
    LOW_LATENCY_MAX_TOKENS,
    kimi_k31_packed_shapes,
)

Shape = tuple[int, int]
# Overridable for a CPU test of the runner.
DEVICE = "cuda"

WARP_SIZE = 32
# Threads a block; vLLM's measured tables stay at or below 256.
MAX_BLOCK_SIZE = 256
OUTPUTS_PER_BLOCK = (1, 2, 3, 4, 6, 8)
K_UNROLLS = (1, 2, 4)
VECTOR_WIDTHS = (8, 4)
# -maxrregcount=64: beyond this many fp32 accumulators a thread spills.
MAX_ACCUMULATORS = 32
# Candidates where a skinny GEMM has a chance against cuBLAS: vLLM's H200
# table has CuTe winners at M <= 4 but for one shape (M <= 6).
DEFAULT_CANDIDATE_TOKENS = 4
DEFAULT_MAX_CANDIDATES = 3
MIN_GAIN = 0.05
CHECK_RTOL = 2.0**-7
# CuTe JIT compile of one config, seconds: BASE + PER_ROW * M (every row of
# A is unrolled; unroll and outputs per block matter far less). Fitted to
# compiles of the default plan's configs for sm_90a on a CPU without a GPU
# (CUTE_DSL_ARCH=sm_90a; all compiled): 1.6 to 1.8 s at M=1, 3.3 to 6.3 s at
# M=10..16 while that 2-core box was lightly loaded, up to 5x that loaded.
COMPILE_S_BASE = 1.2
COMPILE_S_PER_ROW = 0.3
# Per timed (config, shape, M) point: check, capture, replays.
POINT_S = 0.15
# Imports, copy bandwidth, weight sets.
FIXED_S = 30.0


def skinny_valid(config: SkinnyGemmConfig, m: int, n: int, k: int) -> bool:
    """The kernel's own constraints (``ShapeDynamicSkinnyGemm.__call__`` and
    ``CuteSkinnyGemm.__init__``) for ``x[M, K] @ w[N, K].T``."""
    tile = config.block_size * config.vector_width
    return (
        1 <= m <= LOW_LATENCY_MAX_TOKENS
        and config.num_rows == m
        and config.block_size % WARP_SIZE == 0
        and WARP_SIZE <= config.block_size <= 1024
        and config.outputs_per_block >= 1
        and config.k_unroll >= 1
        and config.vector_width in VECTOR_WIDTHS
        and n % config.outputs_per_block == 0
        and k % tile == 0
        and (config.static_k is None or (config.static_k == k and k >= 2 * tile))
    )


def heuristic_config(m: int, n: int, k: int) -> SkinnyGemmConfig:
    """What the skinny GEMM runs without a config (and the module where its
    device has no measured table)."""
    return ShapeDynamicSkinnyGemm._config(m, n, k)


def config_key(config: SkinnyGemmConfig) -> str:
    """``M/block/outputs/unroll/vw`` (``/sK`` when K is static)."""
    key = (
        f"{config.num_rows}/{config.block_size}/{config.outputs_per_block}/"
        f"{config.k_unroll}/{config.vector_width}"
    )
    return key if config.static_k is None else f"{key}/s{config.static_k}"


def unrolled_fmas(config: SkinnyGemmConfig) -> int:
    """Multiply-adds of the kernel's unrolled K-tile body."""
    return (
        config.num_rows
        * config.outputs_per_block
        * config.vector_width
        * config.k_unroll
    )


def compile_estimate_s(config: SkinnyGemmConfig) -> float:
    return COMPILE_S_BASE + COMPILE_S_PER_ROW * config.num_rows


def _acceptable(config: SkinnyGemmConfig, shapes: Iterable[Shape]) -> bool:
    m = config.num_rows
    return m * config.outputs_per_block <= MAX_ACCUMULATORS and any(
        skinny_valid(config, m, n, k) for n, k in shapes
    )


def candidate_space(m: int, shapes: list[Shape]) -> list[SkinnyGemmConfig]:
    """Every dynamic-K config at M that the kernel takes for at least one of
    ``shapes`` within the register bound (what the candidates are drawn
    from; far too many to compile)."""
    return [
        SkinnyGemmConfig(m, block, opb, unroll, vw)
        for vw in VECTOR_WIDTHS
        for block in range(WARP_SIZE, MAX_BLOCK_SIZE + 1, WARP_SIZE)
        for opb in OUTPUTS_PER_BLOCK
        for unroll in K_UNROLLS
        if _acceptable(SkinnyGemmConfig(m, block, opb, unroll, vw), shapes)
    ]


def neighbours(config: SkinnyGemmConfig) -> list[SkinnyGemmConfig]:
    """Configs one step away: block size +-32 and x2 / /2, outputs per block,
    unroll and vector width to their adjacent values. Validity is checked by
    the caller."""
    out = []
    b = config.block_size
    for block in (b - WARP_SIZE, b + WARP_SIZE, b // 2, b * 2):
        if WARP_SIZE <= block <= MAX_BLOCK_SIZE:
            out.append(_replace(config, block_size=block))
    for values, name in (
        (OUTPUTS_PER_BLOCK, "outputs_per_block"),
        (K_UNROLLS, "k_unroll"),
    ):
        here = getattr(config, name)
        if here in values:
            i = values.index(here)
            for j in (i - 1, i + 1):
                if 0 <= j < len(values):
                    out.append(_replace(config, **{name: values[j]}))
    for vw in VECTOR_WIDTHS:
        if vw != config.vector_width:
            # Same K tile with the other vector width.
            block = config.block_size * config.vector_width // vw
            if WARP_SIZE <= block <= MAX_BLOCK_SIZE:
                out.append(_replace(config, block_size=block, vector_width=vw))
            out.append(_replace(config, vector_width=vw))
    return out


def _replace(config: SkinnyGemmConfig, **changes: int) -> SkinnyGemmConfig:
    fields = {
        "num_rows": config.num_rows,
        "block_size": config.block_size,
        "outputs_per_block": config.outputs_per_block,
        "k_unroll": config.k_unroll,
        "vector_width": config.vector_width,
        "static_k": config.static_k,
    }
    fields.update(changes)
    return SkinnyGemmConfig(**fields)


def measured_seeds(table: dict | None) -> dict[int, list[SkinnyGemmConfig]]:
    """``{M: configs}`` that vLLM measured as winners at M on this device
    (a ``ProjectionSpec`` table), most frequent first."""
    counts: dict[int, dict[SkinnyGemmConfig, int]] = {}
    for spec in (table or {}).values():
        for m, config in getattr(spec, "cute_configs", ()):
            per_m = counts.setdefault(m, {})
            per_m[config] = per_m.get(config, 0) + 1
    return {
        m: sorted(per_m, key=lambda c: (-per_m[c], config_key(c)))
        for m, per_m in counts.items()
    }


def candidates_for(
    m: int,
    shapes: list[Shape],
    seeds: list[SkinnyGemmConfig],
    max_candidates: int,
) -> list[SkinnyGemmConfig]:
    """Up to ``max_candidates`` configs for ``M`` besides the heuristic ones:
    measured seeds, then heuristic neighbours (by packed shapes covered)."""
    heuristics = {heuristic_config(m, n, k) for n, k in shapes}

    def coverage(c: SkinnyGemmConfig) -> int:
        return sum(skinny_valid(c, m, n, k) for n, k in shapes)

    picked: list[SkinnyGemmConfig] = []
    for config in seeds:
        if (
            config.num_rows == m
            and config not in heuristics
            and config not in picked
            and _acceptable(config, shapes)
        ):
            picked.append(config)
    near: list[SkinnyGemmConfig] = []
    for h in sorted(heuristics, key=config_key):
        for config in neighbours(h):
            if config in heuristics or config in picked or config in near:
                continue
            if _acceptable(config, shapes):
                near.append(config)
    near.sort(key=lambda c: (-coverage(c), unrolled_fmas(c), config_key(c)))
    return (picked + near)[:max_candidates]


@dataclass(frozen=True)
class Work:
    """One compile unit (or cuBLAS, ``config=None``) at one M and the packed
    shapes it is timed on."""

    m: int
    config: SkinnyGemmConfig | None
    shapes: tuple[Shape, ...]
    stage: str  # "baseline": cuBLAS + heuristics, "candidate"

    def estimate_s(self) -> float:
        compile_s = 0.0 if self.config is None else compile_estimate_s(self.config)
        return compile_s + POINT_S * len(self.shapes)


def build_plan(
    shapes: list[Shape],
    tokens: list[int],
    candidate_tokens: int,
    max_candidates: int,
    seeds: dict[int, list[SkinnyGemmConfig]],
) -> list[Work]:
    """cuBLAS and the heuristic configs at every M first (the unmeasured plan),
    then the candidates, smallest M first; each config once, on every shape
    it is valid for."""
    baseline: list[Work] = []
    later: list[Work] = []
    for m in tokens:
        baseline.append(Work(m, None, tuple(shapes), "baseline"))
        heuristics = sorted(
            {heuristic_config(m, n, k) for n, k in shapes}, key=config_key
        )
        configs = [(c, "baseline") for c in heuristics]
        if m <= candidate_tokens and max_candidates > 0:
            for c in candidates_for(m, shapes, seeds.get(m, []), max_candidates):
                configs.append((c, "candidate"))
        for config, stage in configs:
            valid = tuple(s for s in shapes if skinny_valid(config, m, *s))
            if valid:
                (baseline if stage == "baseline" else later).append(
                    Work(m, config, valid, stage)
                )
    return baseline + later


def plan_estimate_s(plan: list[Work]) -> float:
    return FIXED_S + sum(w.estimate_s() for w in plan)


def config_dict(config: SkinnyGemmConfig | None) -> dict | None:
    return None if config is None else asdict(config)


# ---------------------------------------------------------------------------
# Summary (pure: rows in, suggestions out).
# ---------------------------------------------------------------------------


def summarize(rows: list[dict], min_gain: float = MIN_GAIN) -> list[dict]:
    """Per (N, K, M): cuBLAS, the heuristic, the fastest checked skinny
    config, and the suggestion: that config where it is ``min_gain`` ahead
    of cuBLAS, else cuBLAS (``config: None``)."""
    points: dict[tuple[int, int, int], dict[str, Any]] = {}
    for r in rows:
        if r.get("us") is None or not r.get("check_ok", False):
            continue
        key = (r["n"], r["k"], r["m"])
        p = points.setdefault(key, {"skinny": []})
        if r["variant"] == "cublas":
            p["cublas"] = r
        else:
            p["skinny"].append(r)
            if r["role"] == "heuristic":
                p["heuristic"] = r
    out = []
    for (n, k, m), p in sorted(points.items()):
        cublas = p.get("cublas")
        best = min(p["skinny"], key=lambda r: r["us"], default=None)
        s: dict[str, Any] = {"n": n, "k": k, "m": m}
        s["cublas_us"] = cublas["us"] if cublas else None
        s["heuristic_us"] = p["heuristic"]["us"] if "heuristic" in p else None
        s["best_us"] = best["us"] if best else None
        s["best_config"] = best["config"] if best else None
        s["best_role"] = best["role"] if best else None
        beats = (
            best is not None
            and cublas is not None
            and best["us"] * (1 + min_gain) <= cublas["us"]
        )
        s["skinny_beats_cublas"] = beats
        if cublas is not None and best is not None:
            s["x_cublas"] = cublas["us"] / best["us"]
        if cublas is not None and "heuristic" in p:
            s["heuristic_x_cublas"] = cublas["us"] / p["heuristic"]["us"]
        if beats:
            s["suggest"] = best["config"]
        elif cublas is not None:
            s["suggest"] = None  # cuBLAS
        else:
            s["suggest"] = "unmeasured"
        out.append(s)
    return out


def suggested_overrides(
    summary: list[dict],
) -> dict[Shape, dict[int, dict | None]]:
    """``{(N, K): {M: config dict, or None for cuBLAS}}``."""
    out: dict[Shape, dict[int, dict | None]] = {}
    for s in summary:
        if s["suggest"] == "unmeasured":
            continue
        out.setdefault((s["n"], s["k"]), {})[s["m"]] = s["suggest"]
    return out


def overrides_source(overrides: dict[Shape, dict[int, dict | None]]) -> str:
    """The overrides as Python for ``dsa_low_latency.py`` (``None``: cuBLAS,
    which the module cannot express yet; see the docstring)."""
    lines = ["PACKED_SHAPE_CONFIG_OVERRIDES = {"]
    for (n, k), per_m in sorted(overrides.items()):
        lines.append(f"    ({n}, {k}): {{")
        for m, c in sorted(per_m.items()):
            if c is None:
                lines.append(f"        {m}: None,  # cuBLAS")
                continue
            args = (
                f"{c['num_rows']}, {c['block_size']}, {c['outputs_per_block']}, "
                f"{c['k_unroll']}, {c['vector_width']}"
            )
            if c.get("static_k") is not None:
                args += f", static_k={c['static_k']}"
            lines.append(f"        {m}: SkinnyGemmConfig({args}),")
        lines.append("    },")
    lines.append("}")
    return "\n".join(lines)


def fmt(v: Any, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def print_summary(summary: list[dict], rows: list[dict]) -> None:
    frac = {
        (r["n"], r["k"], r["m"], r["variant"], r.get("config_key")): r.get("frac_copy")
        for r in rows
        if r.get("us") is not None
    }
    head = (
        f"{'N':>6} {'K':>5} {'M':>3} {'cublas':>8} {'copy%':>6} {'heur':>8} "
        f"{'xC':>5} {'best':>8} {'copy%':>6} {'xC':>5}  best config (M/block/"
        "outputs/unroll/vw)  suggest"
    )
    print(head)
    print("-" * len(head))
    for s in summary:
        c = s["best_config"]
        key = config_key(SkinnyGemmConfig(**c)) if c else None
        cf = frac.get((s["n"], s["k"], s["m"], "cublas", None))
        bf = frac.get((s["n"], s["k"], s["m"], "skinny", key))
        suggest = "skinny" if s["skinny_beats_cublas"] else "cuBLAS"
        if s["suggest"] == "unmeasured":
            suggest = "unmeasured"
        print(
            f"{s['n']:>6} {s['k']:>5} {s['m']:>3} {fmt(s['cublas_us'], '8.2f')} "
            f"{fmt(cf and 100 * cf, '5.1f')}% {fmt(s['heuristic_us'], '8.2f')} "
            f"{fmt(s.get('heuristic_x_cublas'), '5.2f')} "
            f"{fmt(s['best_us'], '8.2f')} {fmt(bf and 100 * bf, '5.1f')}% "
            f"{fmt(s.get('x_cublas'), '5.2f')}  {key or '-':22} "
            f"{s['best_role'] or '':10} {suggest}"
        )


# ---------------------------------------------------------------------------
# GPU side.
# ---------------------------------------------------------------------------


def missing_requirements() -> list[str]:
    """What the skinny GEMM needs that cannot be imported here."""
    missing = []
    for module, what in (
        ("cutlass", "CuTe DSL (nvidia-cutlass-dsl)"),
        ("cutlass.cute", "CuTe DSL (nvidia-cutlass-dsl)"),
        ("quack.compile_utils", "quack (quack-kernels), vLLM's skinny GEMM compile"),
        ("cuda.bindings.driver", "cuda.bindings (cuda-python)"),
    ):
        try:
            importlib.import_module(module)
        except Exception as e:  # ImportError, or a broken install
            missing.append(f"{what}: import {module}: {type(e).__name__}: {e}")
    if missing and importlib.util.find_spec("nvidia_cutlass_dsl") is not None:
        missing.append(
            "nvidia_cutlass_dsl is importable but not cutlass: a pip --target "
            "install's .pth is not read from PYTHONPATH; add its "
            "nvidia_cutlass_dsl/dsl_packages folder to PYTHONPATH"
        )
    return missing


def device_table() -> dict | None:
    """vLLM 0.33.0's measured Kimi K3 table for this device (SM90 without
    CUDA: the H200 this is for); None where it cannot be imported."""
    try:
        import vllm.models.kimi_k3.nvidia.low_latency_gemm as llg
    except Exception:
        return None
    cap = torch.cuda.get_device_capability() if torch.cuda.is_available() else (9, 0)
    names = {
        (9, 0): "KIMI_K3_PROJECTIONS_SM90",
        (10, 0): "KIMI_K3_PROJECTIONS_SM100",
        (10, 3): "KIMI_K3_PROJECTIONS",
        (10, 7): "KIMI_K3_PROJECTIONS",
    }
    return getattr(llg, names.get(cap, "KIMI_K3_PROJECTIONS_SM90"), None)


class ContextLost(RuntimeError):
    """The CUDA context no longer works: nothing more can run."""


def sync() -> None:
    torch.cuda.synchronize()


def ensure_context() -> None:
    try:
        sync()
    except Exception as e:
        raise ContextLost(f"{type(e).__name__}: {e}") from e


def num_sets(weight_bytes: int, l2_bytes: int, max_sets: int) -> int:
    """Weight sets whose bytes exceed twice the L2 (at least two)."""
    return int(min(max_sets, max(2, math.ceil(2 * l2_bytes / weight_bytes))))


def graph_calls(sets: int, min_calls: int) -> int:
    """Whole rotations of the sets, at least ``min_calls`` calls."""
    return sets * math.ceil(min_calls / sets)


@dataclass
class ShapeState:
    n: int
    k: int
    sets: int
    weights: list[torch.Tensor]
    inputs: dict[int, list[torch.Tensor]] = field(default_factory=dict)
    refs: dict[int, torch.Tensor] = field(default_factory=dict)

    def x(self, m: int) -> list[torch.Tensor]:
        if m not in self.inputs:
            self.inputs[m] = [
                torch.randn(m, self.k, device=DEVICE, dtype=torch.bfloat16)
                for _ in range(self.sets)
            ]
        return self.inputs[m]

    def ref(self, m: int) -> torch.Tensor:
        if m not in self.refs:
            self.refs[m] = self.x(m)[0].float() @ self.weights[0].float().T
        return self.refs[m]


def make_shape(n: int, k: int, l2_bytes: int, max_sets: int) -> ShapeState:
    sets = num_sets(n * k * 2, l2_bytes, max_sets)
    scale = k**-0.5  # outputs ~ N(0, 1)
    weights = [
        (torch.randn(n, k, device=DEVICE) * scale).bfloat16() for _ in range(sets)
    ]
    return ShapeState(n, k, sets, weights)


def check_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """max|out - ref| / max|ref| (inf on a non-finite output)."""
    if not torch.isfinite(out).all():
        return math.inf
    return float((out.float() - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


class Runner:
    """Runs a plan, one point at a time, writing the JSON after each."""

    def __init__(self, args: argparse.Namespace, meta: dict, plan: list[Work]):
        self.args = args
        self.meta = meta
        self.plan = plan
        self.rows: list[dict] = []
        self.compiles: list[dict] = []
        self.states: dict[Shape, ShapeState] = {}
        self.deadline = time.monotonic() + args.time_budget_s
        self.bw = meta["copy_bandwidth_gbps"] * 1e9
        from vllm.model_executor.kernels.linear.cute_dsl.skinny_gemm import (
            shape_dynamic_skinny_gemm,
        )

        self.gemm = shape_dynamic_skinny_gemm

    def state(self, shape: Shape) -> ShapeState:
        if shape not in self.states:
            self.states[shape] = make_shape(
                *shape, self.args.l2_mb << 20, self.args.max_sets
            )
        return self.states[shape]

    def write(self) -> None:
        if self.args.json is None:
            return
        summary = summarize(self.rows, self.args.min_gain)
        doc = dict(
            meta=self.meta,
            plan=[
                dict(
                    m=w.m,
                    variant="cublas" if w.config is None else "skinny",
                    config=config_dict(w.config),
                    shapes=[list(s) for s in w.shapes],
                    stage=w.stage,
                )
                for w in self.plan
            ],
            compiles=self.compiles,
            rows=self.rows,
            summary=summary,
            overrides={
                f"{n}x{k}": {str(m): c for m, c in per_m.items()}
                for (n, k), per_m in suggested_overrides(summary).items()
            },
        )
        tmp = self.args.json.with_suffix(self.args.json.suffix + ".tmp")
        tmp.write_text(json.dumps(doc, indent=1))
        tmp.replace(self.args.json)

    def run(self) -> None:
        lost = None
        for work in self.plan:
            if lost is not None:
                self._skip(work, f"not run: CUDA context lost ({lost})")
                continue
            if time.monotonic() > self.deadline:
                self._skip(work, "not run: --time-budget-s spent")
                continue
            try:
                self._run_work(work)
            except ContextLost as e:
                lost = str(e)[:200]
                self.meta["notes"].append(f"CUDA context lost: {lost}")
                print(f"CUDA context lost: {lost}", file=sys.stderr)
            self.write()

    def _skip(self, work: Work, why: str) -> None:
        for n, k in work.shapes:
            self.rows.append(self._row(work, n, k) | {"error": why})

    def _row(self, work: Work, n: int, k: int) -> dict:
        config = work.config
        if config is None:
            role = "cublas"
        elif config == heuristic_config(work.m, n, k):
            role = "heuristic"
        else:
            role = "candidate"
        return dict(
            n=n,
            k=k,
            m=work.m,
            variant="cublas" if config is None else "skinny",
            role=role,
            stage=work.stage,
            config=config_dict(config),
            config_key=None if config is None else config_key(config),
        )

    def _fn(self, work: Work, st: ShapeState) -> Callable[[int], torch.Tensor]:
        xs, ws, sets, config = st.x(work.m), st.weights, st.sets, work.config
        if config is None:
            return lambda i: F.linear(xs[i % sets], ws[i % sets])
        gemm = self.gemm
        return lambda i: gemm(xs[i % sets], ws[i % sets], config, None)

    def _run_work(self, work: Work) -> None:
        first = work.config is not None  # its first call compiles
        for i, (n, k) in enumerate(work.shapes):
            row = self._row(work, n, k)
            self.rows.append(row)
            try:
                self._run_point(work, row, first)
            except ContextLost:
                raise
            except Exception as e:
                row["error"] = f"{type(e).__name__}: {e}"[:300]
                traceback.print_exc()
                ensure_context()
                if first and "compile_s" not in row:
                    # A config whose first call fails (compile) fails on
                    # every shape.
                    for n2, k2 in work.shapes[i + 1 :]:
                        self.rows.append(
                            self._row(work, n2, k2)
                            | {"error": f"not run: first call failed on {n}x{k}"}
                        )
                    return
            finally:
                self.write()
                label = row.get("config_key") or "cublas"
                print(
                    f"N={n} K={k} M={work.m} {label:18} {row['role']:9} "
                    f"{fmt(row.get('us'), '.2f')} us {row.get('error', '')}",
                    flush=True,
                )
            first = False

    def _run_point(self, work: Work, row: dict, first: bool) -> None:
        """Check, then time, one (config, shape, M); fills ``row``."""
        n, k, m = row["n"], row["k"], row["m"]
        st = self.state((n, k))
        fn = self._fn(work, st)
        t0 = time.perf_counter()
        # Outside any capture: a skinny config's first call compiles it.
        out = fn(0)
        sync()
        if first:
            row["compile_s"] = time.perf_counter() - t0
            self.compiles.append(
                dict(config=config_dict(work.config), seconds=row["compile_s"])
            )
        err = check_error(out, st.ref(m))
        row["check_err"] = err
        row["check_ok"] = err <= CHECK_RTOL
        if not row["check_ok"]:
            row["error"] = f"check failed: {err:.3g} > {CHECK_RTOL:.3g}"
            return
        calls = graph_calls(st.sets, self.args.min_calls)
        us = time_graph(fn, calls, self.args.reps)
        nbytes = 2 * (n * k + m * k + m * n)
        row.update(
            us=us,
            sets=st.sets,
            calls=calls,
            bytes=nbytes,
            frac_copy=nbytes / (us * 1e-6) / self.bw,
        )


# ---------------------------------------------------------------------------
# Entry point.
# ---------------------------------------------------------------------------


def parse_shapes(specs: list[str] | None) -> list[Shape]:
    packed = sorted(kimi_k31_packed_shapes())
    if not specs:
        return packed
    shapes = []
    for spec in specs:
        n, sep, k = spec.lower().partition("x")
        if not sep or not n.isdigit() or not k.isdigit():
            raise SystemExit(f"--shapes takes NxK, got {spec!r}")
        shapes.append((int(n), int(k)))
    return shapes


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--tokens",
        type=int,
        nargs="+",
        default=list(range(1, LOW_LATENCY_MAX_TOKENS + 1)),
        help="token counts M (1..16)",
    )
    p.add_argument(
        "--shapes",
        nargs="+",
        default=None,
        help="NxK (default: every packed Kimi K3.1 shape)",
    )
    p.add_argument(
        "--max-candidates",
        type=int,
        default=DEFAULT_MAX_CANDIDATES,
        help="candidate configs per M besides the heuristic ones (0: none)",
    )
    p.add_argument(
        "--candidate-tokens",
        type=int,
        default=DEFAULT_CANDIDATE_TOKENS,
        help="candidates only up to this M (cuBLAS + heuristic at every M)",
    )
    p.add_argument("--json", type=Path, default=None, help="write results here")
    p.add_argument("--dry-run", action="store_true", help="plan and estimate only")
    p.add_argument("--reps", type=int, default=30, help="graph replays per point")
    p.add_argument("--min-calls", type=int, default=32, help="calls per graph")
    p.add_argument("--max-sets", type=int, default=16, help="weight sets, at most")
    p.add_argument(
        "--l2-mb", type=int, default=60, help="L2 to defeat with rotation (H200: 60)"
    )
    p.add_argument(
        "--min-gain",
        type=float,
        default=MIN_GAIN,
        help="a skinny config must be this much faster than cuBLAS",
    )
    p.add_argument(
        "--time-budget-s",
        type=float,
        default=330.0,
        help="skip what is left after this many seconds",
    )
    args = p.parse_args(argv)
    bad = [m for m in args.tokens if not 1 <= m <= LOW_LATENCY_MAX_TOKENS]
    if bad:
        p.error(f"--tokens must be in 1..{LOW_LATENCY_MAX_TOKENS}, got {bad}")
    args.tokens = sorted(set(args.tokens))
    args.shapes = parse_shapes(args.shapes)
    return args


def make_plan(args: argparse.Namespace, table: dict | None) -> list[Work]:
    return build_plan(
        args.shapes,
        args.tokens,
        args.candidate_tokens,
        args.max_candidates,
        measured_seeds(table),
    )


def print_plan(plan: list[Work], shapes: list[Shape]) -> None:
    compiles = [w for w in plan if w.config is not None]
    ms = sorted({w.m for w in plan})
    space = sum(len(candidate_space(m, shapes)) for m in ms)
    points = sum(len(w.shapes) for w in plan)
    compile_s = sum(compile_estimate_s(w.config) for w in compiles)  # type: ignore[arg-type]
    for w in plan:
        label = "cublas" if w.config is None else config_key(w.config)
        shapes = " ".join(f"{n}x{k}" for n, k in w.shapes)
        print(f"  M={w.m:<2} {w.stage:9} {label:18} on {shapes}")
    print(
        f"valid config space at these M: {space} configs; "
        f"plan: {len(compiles)} compiled configs (~{compile_s:.0f} s of CuTe JIT), "
        f"{points} timed points (~{POINT_S * points:.0f} s), "
        f"~{plan_estimate_s(plan):.0f} s in all with ~{FIXED_S:.0f} s of setup"
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    table = device_table()
    plan = make_plan(args, table)
    if args.dry_run:
        print_plan(plan, args.shapes)
        return 0
    if not torch.cuda.is_available():
        sys.exit("bench_packed_gemm.py needs a CUDA GPU (torch sees none)")
    missing = missing_requirements()
    if missing:
        sys.exit(
            "bench_packed_gemm.py needs vLLM's CuTe-DSL skinny GEMM, which "
            "cannot run here:\n  " + "\n  ".join(missing)
        )
    print_plan(plan, args.shapes)
    # The fp32 reference of the checks in full fp32.
    torch.backends.cuda.matmul.allow_tf32 = False
    bw = copy_bandwidth()
    import vllm

    meta: dict[str, Any] = dict(
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        gpu=torch.cuda.get_device_name(),
        capability=".".join(map(str, torch.cuda.get_device_capability())),
        torch=torch.__version__,
        vllm=getattr(vllm, "__version__", "?"),
        copy_bandwidth_gbps=bw / 1e9,
        measured_table="found" if table is not None else "not importable",
        check_rtol=CHECK_RTOL,
        min_gain=args.min_gain,
        estimate_s=plan_estimate_s(plan),
        command=" ".join(sys.argv),
        notes=[],
    )
    try:
        import cutlass

        meta["cutlass"] = getattr(cutlass, "__version__", "?")
    except ImportError:
        pass
    print(
        f"# {meta['gpu']} (sm_{meta['capability']}), torch {meta['torch']}, "
        f"copy bandwidth {bw / 1e9:.0f} GB/s (read + write)",
        flush=True,
    )
    runner = Runner(args, meta, plan)
    runner.write()
    t0 = time.monotonic()
    runner.run()
    meta["wall_s"] = time.monotonic() - t0
    runner.write()
    summary = summarize(runner.rows, args.min_gain)
    print_summary(summary, runner.rows)
    errors = [r for r in runner.rows if "error" in r]
    for r in errors:
        print(f"N={r['n']} K={r['k']} M={r['m']} {r.get('config_key')}: {r['error']}")
    print(overrides_source(suggested_overrides(summary)))
    for note in meta["notes"]:
        print(f"note: {note}")
    lost = any("context lost" in n for n in meta["notes"])
    timed = any(
        r.get("us") is not None for r in runner.rows if r["variant"] == "skinny"
    )
    if not timed:
        print("no skinny-GEMM point was timed", file=sys.stderr)
    return 1 if lost or not timed else 0


if __name__ == "__main__":
    sys.exit(main())
