# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Kimi K3.1 DSA kernels against what a user would run instead.

Kernels: the fp8 and MXFP4 indexer-key insert, the fp8 and MXFP4 fused
prologue (``vllm._kimi_k3_C``), and the fp8 and MXFP4 indexer-query
quantization (Triton). Baselines, timed in the same run:

- ``eager``: the torch composition of the references (formats helpers,
  k-norm, cache writes, top-k fill), written without host syncs so it can be
  graph-captured like the kernels (slots are all valid here);
- ``compile``: ``torch.compile`` of that same composition;
- ``vllm``: vLLM 0.33.0's Triton ``fused_norm_rope`` (DeepSeek V3.2 prologue,
  identity rope table) for the fp8 prologue, when vLLM can be imported.

Every variant is timed under CUDA-graph replay: one graph holds one call per
rotated input set (enough sets that their bytes exceed twice the L2, capped
by ``--max-sets``), and the median replay time is divided by the number of
calls. Bytes moved count each input read once and each output written once,
the top-k fill (``topk * 4`` bytes a token) included; the fraction is of the
device-to-device copy bandwidth measured at the start of the run.

    python benchmarks/kernels/benchmark_kimi_k3_dsa.py --json out.json

Runs on any CUDA GPU with torch and triton; kernels that cannot run there
(no extension, no MXFP4 writer on the device, ...) are reported as skipped.
"""

import argparse
import datetime
import json
import math
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gpu_timing
import torch
import torch.nn.functional as F
from gpu_timing import copy_bandwidth

REPO_ROOT = Path(__file__).resolve().parents[2]
if str(REPO_ROOT) not in sys.path:
    # Run from a checkout without installing (the GPU machine has no vLLM).
    sys.path.insert(0, str(REPO_ROOT))

from vllm.models.kimi_k3.common import dsa_formats  # noqa: E402
from vllm.models.kimi_k3.nvidia.dsa_ops import formats, reference  # noqa: E402
from vllm.models.kimi_k3.nvidia.dsa_ops import indexer_q_quant as qq  # noqa: E402

# Overridable for a CPU dry run of the input builders and compositions.
DEVICE = "cuda"
DEFAULT_TOKENS = (1, 16, 64, 256, 1024, 4096, 16384, 65536)


@dataclass(frozen=True)
class Dims:
    """Kimi K3.1 shapes (flags override them)."""

    q_lora: int = 1536
    kv_lora: int = 512
    rope: int = 64
    index_head_dim: int = 128
    index_heads: int = 32
    padded_heads: int = 32
    topk: int = 2048
    block: int = 64
    # The second packed GEMM holds q_b (96 heads x 192) before wq_index.
    q_b: int = 96 * 192
    eps: float = 1e-5

    @property
    def gemm1(self) -> int:
        """Width of the packed [q_a | kv_a | k_pe | wk | weights_proj] row."""
        return (
            self.q_lora
            + self.kv_lora
            + self.rope
            + self.index_head_dim
            + (self.index_heads)
        )

    @property
    def weight_scale(self) -> float:
        return self.index_head_dim**-0.5 * self.index_heads**-0.5


# The Dims fields the command line sets.
DIM_FLAGS = (
    "q_lora",
    "kv_lora",
    "rope",
    "index_head_dim",
    "index_heads",
    "padded_heads",
    "topk",
    "block",
)


@dataclass
class Case:
    """One kernel: builds input sets, runs variants, counts bytes."""

    name: str
    make: Callable[[int, int], dict]  # (num_tokens, num_sets) -> shared state
    fast: Callable[[dict, int], Any]  # (state, set index)
    # (state, set index, impl): calls impl, the torch composition (or its
    # torch.compile), on the set's tensors.
    composition: Callable[[dict, int, Callable], Any]
    impl: Callable
    bytes_moved: Callable[[int], int]
    vllm: Callable[[dict, int], Any] | None = None
    check: Callable[[dict], str] | None = None
    baselines: bool = True
    notes: list[str] = field(default_factory=list)


# ---------------------------------------------------------------------------
# Inputs.
# ---------------------------------------------------------------------------


def gemm1_sets(dims: Dims, num_tokens: int, num_sets: int) -> list[dict]:
    """Column slices of the packed first GEMM output, one buffer per set."""
    sets = []
    for _ in range(num_sets):
        row = torch.randn(num_tokens, dims.gemm1, device=DEVICE).bfloat16()
        cols = [dims.q_lora, dims.kv_lora, dims.rope, dims.index_head_dim]
        q_c, kv_c, k_pe, index_k, weights = row.split(cols + [dims.index_heads], -1)
        sets.append(
            dict(q_c=q_c, kv_c=kv_c, k_pe=k_pe, index_k=index_k, weights=weights)
        )
    return sets


def slot_sets(dims: Dims, num_tokens: int, num_sets: int) -> tuple[list, int]:
    """Prefill-like slots: consecutive tokens fill randomly placed blocks;
    every set writes its own blocks. Returns (int64 slot tensors, blocks)."""
    per_set = math.ceil(num_tokens / dims.block)
    num_blocks = per_set * num_sets + 1
    perm = torch.randperm(num_blocks, device=DEVICE)
    tok = torch.arange(num_tokens, device=DEVICE)
    out = []
    for s in range(num_sets):
        blocks = perm[s * per_set : (s + 1) * per_set]
        out.append(blocks[tok // dims.block] * dims.block + tok % dims.block)
    return out, num_blocks


def writer_sets(dims: Dims, num_tokens: int, num_sets: int) -> tuple[dict, int]:
    """What every cache writer case reads and writes (the GEMM slices, the
    slots, the top-k rows it fills) and the number of cache blocks."""
    slots, num_blocks = slot_sets(dims, num_tokens, num_sets)
    topk = [
        torch.empty(num_tokens, dims.topk, dtype=torch.int32, device=DEVICE)
        for _ in range(num_sets)
    ]
    shared = dict(sets=gemm1_sets(dims, num_tokens, num_sets), slots=slots, topk=topk)
    return shared, num_blocks


def zero_cache(num_blocks: int, dims: Dims, entry_bytes: int) -> torch.Tensor:
    return torch.zeros(
        num_blocks, dims.block, entry_bytes, dtype=torch.uint8, device=DEVICE
    )


# ---------------------------------------------------------------------------
# Graph-capturable torch compositions of the references.
# ---------------------------------------------------------------------------


def _layer_norm_bf16(x, w, b, eps):
    return F.layer_norm(x.float(), (x.shape[-1],), w, b, eps).bfloat16()


def _rms_norm_bf16(x, w, eps):
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * w.float()).bfloat16()


def _write_indexer(cache, slots, k, fp4: bool, mx: bool, head_dim: int) -> None:
    if fp4:
        values, scales = formats.mxfp4_quantize_rows(k)
    else:
        values, scales = formats.indexer_fp8_entry(k, mx)
    vview, sview = formats.indexer_block_views(cache, head_dim, fp4)
    blk, off = slots // cache.shape[1], slots % cache.shape[1]
    vview[blk, off] = values
    sview[blk, off] = scales


def insert_composition(index_k, w, b, eps, slots, cache, topk, fp4, mx, head_dim):
    k = _layer_norm_bf16(index_k, w, b, eps)
    _write_indexer(cache, slots, k, fp4, mx, head_dim)
    topk[: index_k.shape[0]] = -1


def prologue_composition(
    q_c, kv_c, k_pe, index_k, q_w, kv_w, k_w, k_b, eps, topk, mla, idx, slots, fp4, mx
):
    q_out = _rms_norm_bf16(q_c, q_w, eps)
    kv_out = _rms_norm_bf16(kv_c, kv_w, eps)
    entry = formats.fp8_ds_mla_entry(kv_out, k_pe)
    mla.view(-1, mla.shape[-1])[slots] = entry
    k = _layer_norm_bf16(index_k, k_w, k_b, eps)
    _write_indexer(idx, slots, k, fp4, mx, index_k.shape[-1])
    topk[: q_c.shape[0]] = -1
    return q_out, kv_out


# ---------------------------------------------------------------------------
# Cases.
# ---------------------------------------------------------------------------


def _ops_or_none():
    try:
        from vllm.models.kimi_k3.nvidia.dsa_ops._extension import extension_available
    except ImportError:
        return None
    return extension_available()


def insert_case(dims: Dims, fp4: bool) -> Case:
    from vllm.models.kimi_k3.nvidia.dsa_ops import indexer_k_insert as ins

    # UE8M0 scale words where the device reads them (fp8 keys only).
    mx = not fp4 and formats.use_mx_scales(torch.device(DEVICE))
    entry = dsa_formats.indexer_entry_bytes(dims.index_head_dim, fp4)

    def make(t: int, n: int) -> dict:
        shared, num_blocks = writer_sets(dims, t, n)
        return dict(
            shared,
            cache=zero_cache(num_blocks, dims, entry),
            w=torch.randn(dims.index_head_dim, device=DEVICE),
            b=torch.randn(dims.index_head_dim, device=DEVICE),
        )

    def inputs(st: dict, i: int) -> tuple:
        """The arguments the op and its composition share, in order."""
        index_k = st["sets"][i]["index_k"]
        return (index_k, st["w"], st["b"], dims.eps, st["slots"][i], st["cache"])

    def fast(st: dict, i: int) -> None:
        ins.indexer_k_norm_quant_insert(
            *inputs(st, i),
            st["topk"][i],
            st["sets"][i]["index_k"].shape[0],
            fp4=fp4,
            mx_scales=mx,
        )

    def comp(st: dict, i: int, impl: Callable) -> None:
        impl(
            *inputs(st, i),
            st["topk"][i],
            fp4,
            mx,
            dims.index_head_dim,
        )

    def check(st: dict) -> str:
        ref_cache, ref_topk = st["cache"].clone(), st["topk"][0].clone()
        comp({**st, "cache": ref_cache, "topk": [ref_topk]}, 0, insert_composition)
        fast(st, 0)
        same = torch.equal(ref_cache, st["cache"]) and torch.equal(
            ref_topk, st["topk"][0]
        )
        return "bytes match the composition" if same else "MISMATCH vs composition"

    def nbytes(t: int) -> int:
        d = dims.index_head_dim
        return t * (2 * d + 8) + 2 * 4 * d + t * (entry + 4 * dims.topk)

    name = "mxfp4_k_norm_quant_insert" if fp4 else "indexer_k_norm_quant_insert"
    return Case(name, make, fast, comp, insert_composition, nbytes, check=check)


def prologue_case(dims: Dims, fp4: bool) -> Case:
    from vllm.models.kimi_k3.nvidia.dsa_ops import fused_prologue as fp

    mx = not fp4 and formats.use_mx_scales(torch.device(DEVICE))
    entry = dsa_formats.indexer_entry_bytes(dims.index_head_dim, fp4)
    mla_entry = dsa_formats.DS_MLA_ENTRY_BYTES

    def make(t: int, n: int) -> dict:
        shared, num_blocks = writer_sets(dims, t, n)
        dev = DEVICE
        return dict(
            shared,
            mla=zero_cache(num_blocks, dims, mla_entry),
            idx=zero_cache(num_blocks, dims, entry),
            q_w=torch.randn(dims.q_lora, device=dev).bfloat16(),
            kv_w=torch.randn(dims.kv_lora, device=dev).bfloat16(),
            k_w=torch.randn(dims.index_head_dim, device=dev),
            k_b=torch.randn(dims.index_head_dim, device=dev),
        )

    def inputs(st: dict, i: int) -> tuple:
        """The arguments the op and its composition share, in order."""
        s = st["sets"][i]
        return (
            *(s[name] for name in ("q_c", "kv_c", "k_pe", "index_k")),
            *(st[name] for name in ("q_w", "kv_w", "k_w", "k_b")),
            dims.eps,
            st["topk"][i],
        )

    def fast(st: dict, i: int) -> Any:
        return fp.dsa_fused_prologue(
            *inputs(st, i),
            mla_kv_cache=st["mla"],
            mla_slot_mapping=st["slots"][i],
            index_kv_cache=st["idx"],
            index_slot_mapping=st["slots"][i],
            fp4=fp4,
            mx_scales=mx,
        )

    def comp(st: dict, i: int, impl: Callable) -> Any:
        return impl(
            *inputs(st, i),
            st["mla"],
            st["idx"],
            st["slots"][i],
            fp4,
            mx,
        )

    def check(st: dict) -> str:
        mla, idx, topk = st["mla"].clone(), st["idx"].clone(), st["topk"][0].clone()
        q_ref, kv_ref = comp(
            {**st, "mla": mla, "idx": idx, "topk": [topk]}, 0, prologue_composition
        )
        q_out, kv_out = fast(st, 0)
        pairs = {
            "q_c_out": (q_ref, q_out),
            "kv_c_out": (kv_ref, kv_out),
            "mla": (mla, st["mla"]),
            "idx": (idx, st["idx"]),
            "topk": (topk, st["topk"][0]),
        }
        diffs = [
            f"{k}: {int((a.view(torch.uint8) != b.view(torch.uint8)).sum())} bytes"
            for k, (a, b) in pairs.items()
            if not torch.equal(a.view(torch.uint8), b.view(torch.uint8))
        ]
        if diffs:
            return "differs from composition (" + "; ".join(diffs) + ")"
        return "bytes match the composition"

    def nbytes(t: int) -> int:
        d = dims
        reads = t * 2 * (d.q_lora + d.kv_lora + d.rope + d.index_head_dim)
        reads += 2 * (d.q_lora + d.kv_lora) + 2 * 4 * d.index_head_dim + 2 * 8 * t
        writes = t * (2 * (d.q_lora + d.kv_lora) + mla_entry + entry + 4 * d.topk)
        return reads + writes

    vllm_fn = None if fp4 else _vllm_fused_norm_rope(dims)
    name = "mxfp4_fused_prologue" if fp4 else "dsa_fused_prologue"
    return Case(
        name,
        make,
        fast,
        comp,
        prologue_composition,
        nbytes,
        vllm=vllm_fn,
        check=check,
    )


def _vllm_fused_norm_rope(dims: Dims):
    """vLLM 0.33.0's Triton DeepSeek V3.2 prologue with an identity rope
    table, writing fp8_ds_mla + fp8 indexer keys + the top-k fill; None when
    vLLM is not importable."""
    try:
        from vllm.models.deepseek_v32.common.kernels import fused_norm_rope
    except Exception:
        return None
    cache = torch.cat(
        (torch.ones(1, dims.rope // 2), torch.zeros(1, dims.rope // 2)), -1
    ).to(DEVICE)

    def run(st: dict, i: int) -> Any:
        s = st["sets"][i]
        t = s["q_c"].shape[0]
        positions = st.setdefault(
            "zeros", torch.zeros(t, dtype=torch.int64, device=DEVICE)
        )
        return fused_norm_rope(
            positions,
            s["q_c"],
            st["q_w"],
            dims.eps,
            s["kv_c"],
            st["kv_w"],
            dims.eps,
            s["k_pe"],
            cache,
            s["index_k"],
            st["k_w"],
            st["k_b"],
            dims.eps,
            cache,
            st["topk"][i],
            slot_mapping=st["slots"][i],
            indexer_slot_mapping=st["slots"][i],
            indexer_k_cache=st["idx"],
            mla_kv_cache=st["mla"],
            mla_kv_cache_dtype="fp8_ds_mla",
            mla_k_scale=st.setdefault("one", torch.ones(1, device=DEVICE)),
        )

    return run


def query_case(dims: Dims, fp4: bool, block_h: int | None = None) -> Case:
    """The query quantization; ``block_h`` times a non-default heads-per-
    program tiling of the Triton kernel (tuning rows, fast path only)."""

    def fast_fn(q: torch.Tensor, w: torch.Tensor, scale: float, heads: int) -> Any:
        return qq.indexer_q_quant(q, w, scale, heads, fp4=fp4)

    def ref_fn(q: torch.Tensor, w: torch.Tensor, scale: float, heads: int) -> Any:
        return reference.indexer_q_quant(q, w, scale, heads, fp4=fp4)

    hd, h, hp = dims.index_head_dim, dims.index_heads, dims.padded_heads

    def make(t: int, n: int) -> dict:
        g1 = gemm1_sets(dims, t, n)
        qs = []
        for _ in range(n):
            # [q_b | wq_index] GEMM output; only the wq_index part is read.
            row = torch.empty(t, dims.q_b + h * hd, dtype=torch.bfloat16, device=DEVICE)
            row[:, dims.q_b :].normal_()
            qs.append(row[:, dims.q_b :].view(t, h, hd))
        return dict(q=qs, w=[s["weights"] for s in g1])

    def fast(st: dict, i: int) -> Any:
        if block_h is None:
            return fast_fn(st["q"][i], st["w"][i], dims.weight_scale, hp)
        default = qq._BLOCK_H
        qq._BLOCK_H = block_h
        try:
            return fast_fn(st["q"][i], st["w"][i], dims.weight_scale, hp)
        finally:
            qq._BLOCK_H = default

    def comp(st: dict, i: int, impl: Callable) -> Any:
        return impl(st["q"][i], st["w"][i], dims.weight_scale, hp)

    def same(x: torch.Tensor | None, y: torch.Tensor | None) -> bool:
        if x is None or y is None:
            return x is y  # fp8: no q_scale
        if x.dtype == torch.float8_e4m3fn:
            x, y = x.view(torch.uint8), y.view(torch.uint8)
        return torch.equal(x, y)

    def check(st: dict) -> str:
        a, b = fast(st, 0), comp(st, 0, ref_fn)
        ok = all(same(x, y) for x, y in zip(a, b, strict=True))
        return "bytes match the reference" if ok else "MISMATCH vs reference"

    def nbytes(t: int) -> int:
        reads = t * h * (hd * 2 + 2)
        if fp4:
            return reads + t * hp * (hd // 2 + 4 + 4)
        return reads + t * hp * (hd + 4)

    name = "mxfp4_q_quant" if fp4 else "indexer_q_quant_fold_weights"
    if block_h is not None:
        return Case(
            f"{name}[block_h={block_h}]",
            make,
            fast,
            comp,
            ref_fn,
            nbytes,
            baselines=False,
        )
    return Case(name, make, fast, comp, ref_fn, nbytes, check=check)


# ---------------------------------------------------------------------------
# Timing.
# ---------------------------------------------------------------------------


def time_graph(
    fn: Callable[[dict, int], Any], st: dict, num_sets: int, reps: int
) -> float:
    """Median microseconds per call under graph replay of one call per set."""
    return gpu_timing.time_graph(lambda i: fn(st, i), num_sets, reps)


def num_sets_for(case: Case, t: int, l2_bytes: int, max_sets: int) -> int:
    return int(min(max_sets, max(2, math.ceil(2 * l2_bytes / case.bytes_moved(t)))))


def run_case(case: Case, t: int, args, bw: float, compiled: dict) -> dict:
    n = num_sets_for(case, t, args.l2_mb << 20, args.max_sets)
    torch.manual_seed(t)
    st = case.make(t, n)
    nbytes = case.bytes_moved(t)
    row: dict[str, Any] = dict(
        kernel=case.name,
        tokens=t,
        sets=n,
        bytes=nbytes,
        footprint_mb=round(n * nbytes / 2**20, 1),
    )
    if case.check is not None and t == args.check_tokens:
        row["check"] = case.check(st)
    us = time_graph(case.fast, st, n, args.reps)
    row.update(us=us, gbps=nbytes / us / 1e3, frac_copy=nbytes / (us * 1e-6) / bw)
    variants: list[tuple[str, Callable | None]] = [
        ("eager", lambda st, i: case.composition(st, i, case.impl))
    ]
    if not case.baselines:
        variants = []
    elif not args.no_compile:
        if case.name not in compiled:
            compiled[case.name] = torch.compile(case.impl, dynamic=True)
        impl = compiled[case.name]
        variants.append(("compile", lambda st, i: case.composition(st, i, impl)))
    if case.vllm is not None:
        variants.append(("vllm", case.vllm))
    for label, fn in variants:
        if fn is None:
            continue
        try:
            base = time_graph(fn, st, n, args.reps)
            row[f"{label}_us"] = base
            row[f"x_{label}"] = base / us
        except Exception as e:  # a baseline that cannot run here is reported
            row[f"{label}_error"] = f"{type(e).__name__}: {e}"[:200]
    del st
    torch.cuda.empty_cache()
    return row


def targets(row: dict) -> str:
    """The issue's targets for the insert and prologue kernels."""
    if "insert" not in row["kernel"] and "prologue" not in row["kernel"]:
        return ""
    miss = []
    if row["tokens"] >= 16384 and row["frac_copy"] < 0.80:
        miss.append("bw<0.80")
    if "x_compile" in row and row["x_compile"] < 1.5:
        miss.append("compile<1.5x")
    if row["tokens"] <= 64 and row["us"] > 4.0:
        miss.append(">4us")
    if "x_vllm" in row and row["x_vllm"] < 1.0:
        miss.append("slower than vllm")
    return "MISS " + ",".join(miss) if miss else "ok"


def fmt(v: Any, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def print_table(rows: list[dict]) -> None:
    head = (
        f"{'kernel':30} {'T':>6} {'us':>9} {'MB':>8} {'GB/s':>7} {'copy%':>6} "
        f"{'eager':>9} {'xE':>6} {'compile':>9} {'xC':>6} {'vllm':>8} "
        f"{'xV':>5}  target"
    )
    print(head)
    print("-" * len(head))
    for r in rows:
        if "skipped" in r:
            print(f"{r['kernel']:30} {r.get('tokens', ''):>6} skipped: {r['skipped']}")
            continue
        print(
            f"{r['kernel']:30} {r['tokens']:>6} {r['us']:9.2f} "
            f"{r['bytes'] / 1e6:8.2f} {r['gbps']:7.0f} {100 * r['frac_copy']:5.1f}% "
            f"{fmt(r.get('eager_us'), '9.2f')} {fmt(r.get('x_eager'), '6.1f')} "
            f"{fmt(r.get('compile_us'), '9.2f')} {fmt(r.get('x_compile'), '6.1f')} "
            f"{fmt(r.get('vllm_us'), '8.2f')} {fmt(r.get('x_vllm'), '5.2f')}  "
            f"{targets(r)}"
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, nargs="+", default=list(DEFAULT_TOKENS))
    p.add_argument(
        "--kernels",
        nargs="+",
        default=None,
        help="subset of kernel names (default: all)",
    )
    p.add_argument("--json", type=Path, default=None, help="write results here")
    p.add_argument("--reps", type=int, default=30, help="graph replays per case")
    p.add_argument(
        "--max-sets",
        type=int,
        default=256,
        help="most rotated input sets (calls) per graph",
    )
    p.add_argument(
        "--l2-mb",
        type=int,
        default=60,
        help="L2 size to defeat with rotation (H200: 60 MB)",
    )
    p.add_argument(
        "--check-tokens",
        type=int,
        default=256,
        help="at this T, check the kernel's bytes against the baseline",
    )
    p.add_argument(
        "--no-compile", action="store_true", help="skip the torch.compile column"
    )
    p.add_argument(
        "--q-block-h",
        type=int,
        nargs="*",
        default=[],
        help="extra rows: the query kernels with these heads per program",
    )
    for f in DIM_FLAGS:
        p.add_argument(f"--{f.replace('_', '-')}", type=int, default=getattr(Dims, f))
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmark_kimi_k3_dsa.py needs a CUDA GPU")

    dims = Dims(**{f: getattr(args, f) for f in DIM_FLAGS})
    bw = copy_bandwidth()
    meta = dict(
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        gpu=torch.cuda.get_device_name(),
        capability=".".join(map(str, torch.cuda.get_device_capability())),
        torch=torch.__version__,
        copy_bandwidth_gbps=bw / 1e9,
        dims=dims.__dict__,
        command=" ".join(sys.argv),
        notes=[],
    )
    try:
        import triton

        meta["triton"] = triton.__version__
    except ImportError:
        pass
    print(
        f"# {meta['gpu']} (sm_{meta['capability']}), torch {meta['torch']}, "
        f"copy bandwidth {bw / 1e9:.0f} GB/s (read + write)"
    )

    # Case names, one per kernel and format, are those of the recorded
    # results (benchmarks/results): the MXFP4 cases run the same entry points with
    # fp4=True.
    builders = [
        ("indexer_k_norm_quant_insert", lambda: insert_case(dims, False)),
        ("mxfp4_k_norm_quant_insert", lambda: insert_case(dims, True)),
        ("dsa_fused_prologue", lambda: prologue_case(dims, False)),
        ("mxfp4_fused_prologue", lambda: prologue_case(dims, True)),
        ("indexer_q_quant_fold_weights", lambda: query_case(dims, False)),
        ("mxfp4_q_quant", lambda: query_case(dims, True)),
    ]
    for bh in args.q_block_h:
        builders += [
            (
                f"indexer_q_quant_fold_weights[block_h={bh}]",
                lambda bh=bh: query_case(dims, False, bh),
            ),
            (f"mxfp4_q_quant[block_h={bh}]", lambda bh=bh: query_case(dims, True, bh)),
        ]
    if _ops_or_none() is False:
        meta["notes"].append("vllm._kimi_k3_C not built: insert/prologue skipped")
    rows: list[dict] = []
    compiled: dict = {}
    for name, build in builders:
        if args.kernels and name not in args.kernels:
            continue
        try:
            case = build()
        except Exception as e:
            rows.append(dict(kernel=name, skipped=f"{type(e).__name__}: {e}"[:160]))
            continue
        if name == "dsa_fused_prologue" and case.vllm is None:
            meta["notes"].append(
                "vLLM 0.33.0 not importable here: no fused_norm_rope column"
            )
        for t in args.tokens:
            try:
                rows.append(run_case(case, t, args, bw, compiled))
            except Exception as e:
                traceback.print_exc()
                rows.append(
                    dict(
                        kernel=name, tokens=t, skipped=f"{type(e).__name__}: {e}"[:160]
                    )
                )
                torch.cuda.empty_cache()
    print_table(rows)
    for r in rows:
        if "check" in r:
            print(f"check {r['kernel']} T={r['tokens']}: {r['check']}")
        for k, v in r.items():
            if k.endswith("_error"):
                print(f"{r['kernel']} T={r['tokens']} {k}: {v}")
    for n in meta["notes"]:
        print(f"note: {n}")
    if args.json is not None:
        args.json.write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))


if __name__ == "__main__":
    main()
