# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The GPU sitting's runner: starts the named suites detached on the GPU test
host and reports on them, so that a host lost mid-run still leaves results.

The test host is released about 30 s after a command returns and after
30 minutes held, and one command may run for at most 10 minutes; suites take
longer. So, on the host, from the project root (``docs/gpu_runbook.md`` has
the whole sitting, staging included):

    python3 tools/gpu/run.py stage .device/r3/c1
        copies a carried staging folder (``tools/gpu/split_bundles.sh``) to
        the host's scratch; the CuTe DSL's last folder unpacks it.
    python3 tools/gpu/run.py install
        vLLM 0.33.0 from the staged offline bundle (``/tmp/offline-vllm``) and
        this package into ``/tmp/site``; vLLM's own DeepGEMM and FlashMLA
        linked for the kernel tests; the extension copied into the checkout.
    python3 tools/gpu/run.py install-in-tree
        the series' in-tree form beside it (``/tmp/site-intree``, from
        ``build/patch_series/gpu_kit``); the ``in-tree-build`` suite runs it.
    python3 tools/gpu/run.py start e2e,kernels,fidelity --then timing,layer-small
        starts a supervisor in its own session (it outlives the command):
        the suites of a group run at the same time, the groups one after the
        other. Progress and logs go to ``build/gpu/`` (git-ignored, kept by
        the host between commands).
    python3 tools/gpu/run.py start proof --then sparse-mla-bench
        ``proof`` stands for the correctness suites' groups (``PROOF_GROUPS``).
    python3 tools/gpu/run.py poll --wait 540
        waits up to that long (or until every suite has ended), prints the
        progress, and packs everything so far into ``$OUT/gpu-results.tar.gz``.

Only the standard library: it runs under the host's python before anything
is installed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# Git-ignored, so the host keeps it between commands; --state overrides.
DEFAULT_STATE = ROOT / "build" / "gpu"
# The host's scratch folder, which the offline bundle's install.sh also uses
# (its /tmp/site); KIMI_K3_GPU_HOST_TMP overrides it on another host.
HOST_TMP = Path(os.environ.get("KIMI_K3_GPU_HOST_TMP", tempfile.gettempdir()))
STAGE = HOST_TMP / "offline-vllm"
SITE = HOST_TMP / "site"
# The CuTe DSL's wheels unzipped into one folder (docs/gpu_runbook.md, "The
# CuTe DSL on the host": a pip --target install of them is not importable).
SITE_CUTE = HOST_TMP / "site-cute2"
# The CuTe DSL bundle's parts and what its payload unpacks to.
CUTE_STAGE = HOST_TMP / "cutedsl"
CONSUMERS = HOST_TMP / "kimi-k3-consumers"
# What a vLLM process needs on the host (tools/offline-vllm's README): no
# FlashInfer, no CuTe DSL.
VLLM_ENV = {
    "PYTHONPATH": str(SITE),
    "VLLM_USE_FLASHINFER_SAMPLER": "0",
    "VLLM_KIMI_K3_GEMM_AR": "0",
    "VLLM_ENABLE_GEMM_RS": "0",
}
KERNEL_ENV = {"KIMI_K3_DEVICE_DIR": str(CONSUMERS)}
# vLLM's environment with the CuTe DSL. ``cutlass`` itself sits in
# nvidia_cutlass_dsl/dsl_packages, which the wheel adds through a .pth file;
# Python reads .pth files in site-packages only, not in a PYTHONPATH folder,
# so it is named here, first: vLLM's folder holds another ``cutlass``.
CUTE_ENV = {
    **VLLM_ENV,
    "PYTHONPATH": ":".join(
        map(str, (SITE_CUTE / "nvidia_cutlass_dsl" / "dsl_packages", SITE, SITE_CUTE))
    ),
}

# The series' in-tree form on the host (docs/gpu_runbook.md, "Both forms"):
# the staged vLLM 0.33.0 without the overlay, the series' files laid over it,
# its _kimi_k3_C built by the series' CMake target.
IN_TREE_KIT = ROOT / "build" / "patch_series" / "gpu_kit"
SITE_IN_TREE = HOST_TMP / "site-intree"
CMAKE_WORK = HOST_TMP / "kimi-k3-cmake"
OVERLAY_DIST = "vllm_kimi_k3_dsa"
IN_TREE_ENV = {
    **CUTE_ENV,
    "PYTHONPATH": ":".join(
        [
            str(SITE_CUTE / "nvidia_cutlass_dsl" / "dsl_packages"),
            str(SITE_IN_TREE),
            str(SITE_CUTE),
            str(ROOT / "tools"),
        ]
    ),
    # tools/patch_series/in_tree_pytest.py refuses a run that is not in-tree.
    "PYTEST_ADDOPTS": "-p patch_series.in_tree_pytest",
    "KIMI_K3_DSA_IN_TREE": str(SITE_IN_TREE / "vllm"),
}


@dataclass(frozen=True)
class Suite:
    """One suite: a shell command run from the project root with ``$LOGS``
    (its log folder) and ``env`` set; passes when it exits 0."""

    command: str
    env: dict[str, str]
    timeout_s: int
    what: str


SUITES: dict[str, Suite] = {
    "e2e": Suite(
        "OUT=$LOGS bash tests/e2e/e2e_gpu_run.sh",
        CUTE_ENV,
        1200,
        "the one-GPU serving suite (vllm.LLM and vllm serve), the CuTe DSL "
        "staged as a vLLM install has it",
    ),
    "in-tree-build": Suite(
        "python3 tools/gpu/run.py install-in-tree >$LOGS/install.log 2>&1; "
        "rc=$?; tail -n 40 $LOGS/install.log; exit $rc",
        VLLM_ENV,
        900,
        "the series' in-tree form: the staged vLLM 0.33.0 less the overlay, "
        "the series' files laid over it, _kimi_k3_C from the series' CMake "
        "target (sm_90a, SM10x), checked to load without the plugin",
    ),
    "e2e-in-tree": Suite(
        "OUT=$LOGS bash tests/e2e/e2e_gpu_run.sh",
        IN_TREE_ENV,
        1200,
        "the e2e suite against the in-tree form (after in-tree-build)",
    ),
    "kernels-in-tree": Suite(
        'OUT=$LOGS KIMI_K3_DSA_KERNEL_STEPS="tests bad sanitizer" '
        "bash tests/kernels/dsa_gpu_run.sh",
        {
            **IN_TREE_ENV,
            **KERNEL_ENV,
            "KIMI_K3_DSA_PYTHONPATH": f"{IN_TREE_ENV['PYTHONPATH']}:{ROOT}",
        },
        900,
        "the kernel suite against the in-tree form: its ops modules and the "
        "CMake target's _kimi_k3_C (after in-tree-build)",
    ),
    "smoke": Suite(
        "OUT=$LOGS SMOKE_PORT=8011 bash tools/gpu/readme_smoke.sh",
        CUTE_ENV,
        600,
        "the README's smoke test: tiny checkpoint, vllm serve, one completion",
    ),
    "smoke-in-tree": Suite(
        "OUT=$LOGS SMOKE_PORT=8012 bash tools/gpu/readme_smoke.sh",
        {**IN_TREE_ENV, "PYTEST_ADDOPTS": ""},
        600,
        "the README's smoke test against the in-tree form",
    ),
    "kernels": Suite(
        'OUT=$LOGS KIMI_K3_DSA_KERNEL_STEPS="tests bad sanitizer" '
        "bash tests/kernels/dsa_gpu_run.sh",
        KERNEL_ENV,
        900,
        "kernels vs references and vLLM's consumers, bad inputs, "
        "compute-sanitizer memcheck and racecheck",
    ),
    "timing": Suite(
        "OUT=$LOGS KIMI_K3_DSA_KERNEL_STEPS=timing bash tests/kernels/dsa_gpu_run.sh",
        KERNEL_ENV,
        300,
        "the cache writers' graph-replay timings (alone on the GPU)",
    ),
    "fidelity": Suite(
        "python3 benchmarks/fidelity/bench_fidelity.py --contexts 4K 32K 128K "
        "--topk 2048 --num-queries 64 --recipes structured "
        "structured-no-outliers gaussian --tiny-checkpoint-activations "
        "--device cuda --seed 0 --json $LOGS/fidelity.json",
        VLLM_ENV,
        900,
        "top-k recall and layer-output error of the quantized caches",
    ),
    "topk-determinism": Suite(
        "python3 -m pytest -m gpu -v -s -p no:cacheprovider "
        "tests/kernels/test_canonical_topk_gpu.py >$LOGS/pytest.log 2>&1",
        {**VLLM_ENV, **KERNEL_ENV},
        300,
        "canonical_topk against its reference, and vLLM's own top-k kernels on "
        "scores with ties: raw run-to-run changes, canonical rows fixed "
        "(vLLM installed)",
    ),
    "candidate-kernels": Suite(
        "python3 -m pytest -m gpu -v -p no:cacheprovider "
        "tests/kernels/test_sparse_mla_gpu.py tests/kernels/test_radix_topk_gpu.py "
        ">$LOGS/pytest.log 2>&1; rc=$?; tail -n 20 $LOGS/pytest.log; exit $rc",
        {**VLLM_ENV, **KERNEL_ENV},
        300,
        "issue 38's candidate kernels alone: sparse_mla_fp8 against its reference "
        "and FlashMLA padded to 64 heads, radix_topk against the canonical rows "
        "(graph replay, bad inputs; vLLM installed)",
    ),
    "sparse-mla-bench": Suite(
        "python3 benchmarks/kernels/bench_sparse_mla.py --json $LOGS/sparse_mla.json",
        VLLM_ENV,
        300,
        "sparse MLA at 12, 16 and 32 heads: sparse_mla_fp8 against FlashMLA's "
        "sparse decode padded to 64 heads (graph replay, decode batches and "
        "prefill chunks, top-k 2048 over 128K)",
    ),
    "topk-bench": Suite(
        "python3 benchmarks/kernels/bench_canonical_topk.py "
        "--json $LOGS/canonical_topk.json",
        VLLM_ENV,
        300,
        "what canonical_topk adds to vLLM's top-k kernels (graph replay, "
        "decode and prefill shapes, scores with and without ties)",
    ),
    "dcp1gpu": Suite(
        "python3 -m pytest -m gpu -v -p no:cacheprovider "
        "tests/kernels/test_dsa_dcp2_one_gpu.py >$LOGS/pytest.log 2>&1",
        {**CUTE_ENV, **KERNEL_ENV},
        600,
        "DCP2's two ranks in one process against one rank (vLLM installed; "
        "its top-k merge test also needs the CuTe DSL, staged or skipped)",
    ),
    "dcp1gpu-prefill": Suite(
        "python3 -m pytest -m gpu -v -p no:cacheprovider "
        "tests/kernels/test_dsa_dcp2_prefill_one_gpu.py >$LOGS/pytest.log 2>&1",
        {**CUTE_ENV, **KERNEL_ENV},
        600,
        "DCP2's prefill path, both ranks in one process, against one rank "
        "(vLLM installed; its top-k merge test also needs CuTe DSL)",
    ),
    "e2e-bench-quick": Suite(
        "python3 benchmarks/e2e/bench_e2e_dsa.py "
        "--out $LOGS --modes fused dense --starts 1 --iters 1 "
        "--input-lens 32768 131072 --batch-sizes 1 16",
        VLLM_ENV,
        900,
        "DSA fused against dense MLA end to end, one engine start each "
        "(the full grid, the wrapper included, is benchmarks/e2e's default)",
    ),
    "e2e-bench-mtp": Suite(
        "for k in 1 3; do python3 benchmarks/e2e/bench_e2e_dsa.py "
        "--out $LOGS/mtp$k --modes fused mtp --mtp-tokens $k --starts 1 --iters 3 "
        "--input-lens 32768 --batch-sizes 1 16 --attention-blocks 4 "
        "--kv-cache-gib 24 || exit 1; done",
        CUTE_ENV,
        900,
        "decode at 32K with and without the MTP draft (1 and 3 tokens) on the "
        "real-attention checkpoint with four attention layers: the step's cost "
        "of verification (random weights: acceptance means nothing)",
    ),
    "packed-gemm": Suite(
        "python3 benchmarks/kernels/bench_packed_gemm.py --json $LOGS/packed_gemm.json",
        CUTE_ENV,
        420,
        "the packed DSA GEMMs: cuBLAS against the CuTe skinny GEMM's heuristic "
        "and candidate configs (alone on the GPU; needs the CuTe DSL)",
    ),
    "e2e-bench-blocks": Suite(
        "python3 benchmarks/e2e/bench_e2e_dsa.py "
        "--out $LOGS --modes fused dense --starts 1 --iters 1 "
        "--input-lens 32768 131072 --batch-sizes 1 4 16 "
        "--max-prefill-tokens 600000 --attention-blocks 4 --kv-cache-gib 24",
        CUTE_ENV,
        900,
        "DSA fused against dense MLA end to end on the checkpoint with four "
        "attention layers of 16 (the real model's share), the CuTe DSL "
        "staged as on a real install (the packed GEMMs' skinny path)",
    ),
    "e2e-bench-grid": Suite(
        "python3 benchmarks/e2e/bench_e2e_dsa.py --out $LOGS --starts 1 --iters 3",
        CUTE_ENV,
        1500,
        "issue 24's end-to-end grid: fused, wrapper and dense MLA at 8K/32K/128K "
        "x batch 1/16/64 (128K x 64 left out), three repeats interleaved over "
        "the rows, the CuTe DSL staged",
    ),
    "vllm-bench-latency": Suite(
        "python3 benchmarks/e2e/bench_e2e_dsa.py --out $LOGS --vllm-bench-latency "
        "--modes fused dense --starts 1 --iters 3 --input-lens 32768 131072 "
        "--batch-sizes 1",
        CUTE_ENV,
        900,
        "vLLM's own `vllm bench latency`, fused and dense, on the driver's "
        "checkpoints and engine arguments (a cross-check of e2e-bench-grid)",
    ),
    "e2e-bench-one-rank": Suite(
        "python3 benchmarks/e2e/bench_e2e_dsa.py "
        "--out $LOGS --modes fused dense --starts 1 --iters 3 "
        "--input-lens 32768 131072 --batch-sizes 1 16 64 "
        "--max-prefill-tokens 600000 --one-rank-of-tp 8 --attention-blocks 24 "
        "--kv-cache-gib 24",
        CUTE_ENV,
        900,
        "DSA fused against dense MLA end to end on one TP 8 rank of Kimi K3.1 "
        "at TP 1 (12 MLA and 12 KDA heads, the 32 x 128 indexer, 24 attention "
        "layers of 96): 32K x 1 and x 16, 128K x 1. The 2.1M-token rows take "
        "minutes of prefill a repeat at 24 layers: 32K x 64 is "
        "e2e-bench-one-rank-b64, 128K x 16 is left out",
    ),
    "e2e-bench-one-rank-b64": Suite(
        "python3 benchmarks/e2e/bench_e2e_dsa.py "
        "--out $LOGS --modes fused dense --starts 1 --iters 2 "
        "--input-lens 32768 --batch-sizes 64 --one-rank-of-tp 8 "
        "--attention-blocks 24 --kv-cache-gib 60",
        CUTE_ENV,
        900,
        "e2e-bench-one-rank's 32K x 64 row alone (2.1M prefill tokens a repeat; "
        "60 GiB of KV cache holds dense MLA's 64 x 32K at 24 layers, 58.2 "
        "GiB, and leaves an H100 room for the fused engine's prefill)",
    ),
    "vllm-bench-latency-one-rank": Suite(
        "python3 benchmarks/e2e/bench_e2e_dsa.py --out $LOGS --vllm-bench-latency "
        "--modes fused dense --starts 1 --iters 3 --input-lens 32768 131072 "
        "--batch-sizes 1 --one-rank-of-tp 8 --attention-blocks 24 --kv-cache-gib 24",
        CUTE_ENV,
        # Four starts of a 96-layer engine (compile and graph capture each).
        1200,
        "vLLM's own `vllm bench latency`, fused and dense, on the checkpoints "
        "and engine arguments of e2e-bench-one-rank (one TP 8 rank, 24 "
        "attention layers)",
    ),
    "e2e-profile-decode": Suite(
        "C=kimi_k3_dsa_tools.tiny_checkpoint_cli; "
        "python3 -m $C $LOGS/ckpt-dsa-b4 --real-attention --attention-blocks 4 && "
        "python3 -m $C $LOGS/ckpt-dense-b4 --real-attention --attention-blocks 4 "
        "--no-dsa && for m in dense dsa; do python3 "
        "benchmarks/e2e/profile_e2e_step.py --model $LOGS/ckpt-$m-b4 "
        "--out $LOGS/$m.txt --rows 32768x16 131072x1 131072x4 || exit 1; done",
        CUTE_ENV,
        900,
        "decode steps alone, host (cProfile) against GPU busy time "
        "(torch.profiler), dense and DSA on the four-attention-layer checkpoint",
    ),
    "layer-grid": Suite(
        "python3 benchmarks/layer/bench_dsa_layer.py --layers fused wrapper v32 "
        "dense-bf16 dense-fp8 --tp-heads 96 12 --reps 30 --profile "
        "--json $LOGS/layer.json",
        VLLM_ENV,
        900,
        "issue 24's whole layer grid: decode batch 1/8/64/256 x 4K/32K/128K and "
        "prefill chunks 1K/4K/8K, 96 and 12 heads, DSA against V3.2 and dense MLA; "
        "every decode point's per-stage kernel times and host metadata build",
    ),
    "layer-one-rank": Suite(
        "python3 benchmarks/layer/bench_dsa_layer.py --layers fused fused-shared "
        "dense-bf16 dense-fp8 --tp-heads 12 --indexer-tp 8 --reps 30 --profile "
        "--json $LOGS/layer.json",
        VLLM_ENV,
        900,
        "one TP-8 rank's layer (12 heads): the fused forward with the indexer's "
        "prefill rows replicated and shared across the 8 ranks (the all-gather "
        "stood in for by a device copy), against dense MLA bf16 and fp8",
    ),
    "layer-candidates": Suite(
        "python3 benchmarks/layer/bench_dsa_layer.py --layers fused fused-unpadded "
        "fused-cand dense-fp8 --tp-heads 12 --decode-batches 1 8 64 --contexts "
        "32768 131072 --prefill-chunks 4096 --reps 30 --profile "
        "--json $LOGS/layer.json",
        VLLM_ENV,
        600,
        "the 12-head fused layer (FlashMLA padded to 64 heads) against itself "
        "with sparse_mla_fp8 at 12 heads and with radix_topk for vLLM's "
        "top-k and canonical_topk, and against dense MLA fp8",
    ),
    "indexer-share": Suite(
        "python3 -m pytest -m gpu -v -p no:cacheprovider "
        "tests/benchmarks/test_indexer_share_gpu.py >$LOGS/pytest.log 2>&1; "
        "rc=$?; tail -n 20 $LOGS/pytest.log; exit $rc",
        VLLM_ENV,
        600,
        "vLLM's prefill row shard of the indexer through our op: each rank's "
        "rows of TP 2 and 8 select the replicated top-k (one GPU)",
    ),
    "layer-grid-flashmla": Suite(
        "python3 benchmarks/layer/bench_dsa_layer.py --layers dense-bf16 "
        "--dense-backend FLASHMLA --tp-heads 96 12 --prefill-chunks --reps 30 "
        "--json $LOGS/layer.json",
        VLLM_ENV,
        600,
        "dense MLA with a bf16 cache on FlashMLA (the backend issue 24 names; "
        "vLLM picks FlashAttention's MLA by default), the decode grid",
    ),
    "low-latency-gemm": Suite(
        "python3 -m pytest -m gpu -v -p no:cacheprovider "
        "tests/kernels/test_low_latency_linear_gpu.py >$LOGS/pytest.log 2>&1",
        CUTE_ENV,
        600,
        "the packed DSA GEMMs on the CuTe skinny GEMM (measured configs) and "
        "cuBLAS against fp32 (needs the CuTe DSL)",
    ),
    "layer-profile": Suite(
        "python3 benchmarks/layer/bench_dsa_layer.py --layers fused wrapper "
        "v32 dense-bf16 dense-fp8 --tp-heads 12 --decode-batches 1 8 64 "
        "--contexts 131072 --prefill-chunks --reps 30 --profile "
        "--json $LOGS/layer.json",
        VLLM_ENV,
        600,
        "the decode step at 128K, one TP 8 rank's heads: DSA against vLLM's "
        "V3.2 layer and dense MLA, per-stage kernel times and the host's "
        "metadata build with its hotspots",
    ),
    "layer-small": Suite(
        "python3 benchmarks/layer/bench_dsa_layer.py --layers fused wrapper v32 "
        "--tp-heads 12 --decode-batches 1 --contexts 4096 --prefill-chunks 1024 "
        "--json $LOGS/layer.json",
        VLLM_ENV,
        600,
        "the layer benchmark's smallest case",
    ),
}

# Every suite that checks correctness, in the order that fits one sitting:
# ``start proof`` runs them, and they all pass after the last edit of the
# shipped code before an issue that needs the GPU is closed.
PROOF = "proof"
PROOF_GROUPS: list[list[str]] = [
    ["e2e", "kernels", "in-tree-build"],
    ["smoke"],
    ["e2e-in-tree"],
    ["smoke-in-tree"],
    ["kernels-in-tree"],
    ["indexer-share"],
    ["fidelity"],
]


def _now() -> float:
    return round(time.time(), 1)


def _read_progress(state: Path) -> dict:
    path = state / "progress.json"
    if not path.exists():
        return {}
    return json.loads(path.read_text())


def _write_progress(state: Path, progress: dict) -> None:
    tmp = state / "progress.json.tmp"
    tmp.write_text(json.dumps(progress, indent=1))
    tmp.replace(state / "progress.json")


def _commit() -> str:
    head = ROOT / ".git" / "HEAD"
    try:
        out = subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
        )
        return out.stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return head.read_text().strip() if head.exists() else "unknown"


def stage(args: argparse.Namespace) -> int:
    """Copies carried staging folders (``.device/r3/cN`` and ``vN``) to where
    ``install`` and the CuTe DSL suites read them. The CuTe DSL's last folder,
    the one with its extra wheels, also unpacks the payload into SITE_CUTE."""
    for folder in args.folders:
        kind = folder.name[:1]
        if kind not in ("c", "v") or not folder.is_dir():
            print(
                f"stage: {folder} is not a folder of split_bundles.sh "
                "(.device/r3/cN or .device/r3/vN)",
                file=sys.stderr,
            )
            return 2
        dest = CUTE_STAGE if kind == "c" else STAGE
        dest.mkdir(parents=True, exist_ok=True)
        wheels = sorted(folder.glob("*.whl"))
        for path in sorted(folder.iterdir()):
            if path not in wheels:
                shutil.copy2(path, dest / path.name)
        print(f"staged {folder} in {dest}")
        if kind == "c" and wheels:
            status = _unpack_cute_dsl(wheels)
            if status:
                return status
    return 0


def _unpack_cute_dsl(extra_wheels: list[Path]) -> int:
    """Joins the CuTe DSL's parts, unpacks the payload, and unzips its wheels
    and the extra ones into one folder (docs/gpu_runbook.md, "The CuTe DSL on
    the host": a pip --target install of them is not importable)."""
    parts = sorted(CUTE_STAGE.glob("part.*"), key=lambda p: p.name)
    expected = [f"part.{i:02d}" for i in range(len(parts))]
    if [p.name for p in parts] != expected:
        print(
            f"stage: {CUTE_STAGE} holds {[p.name for p in parts]}, not "
            f"part.00 to part.{len(parts) - 1:02d}: stage every c folder first",
            file=sys.stderr,
        )
        return 1
    payload = CUTE_STAGE / "payload.tar"
    with open(payload, "wb") as joined:
        for part in parts:
            with open(part, "rb") as piece:
                shutil.copyfileobj(piece, joined)
    with tarfile.open(payload) as tar:
        tar.extractall(CUTE_STAGE, filter="tar")
    SITE_CUTE.mkdir(parents=True, exist_ok=True)
    for wheel in [*sorted((CUTE_STAGE / "whl").glob("*.whl")), *extra_wheels]:
        with zipfile.ZipFile(wheel) as archive:
            archive.extractall(SITE_CUTE)
    print(f"the CuTe DSL unzipped into {SITE_CUTE}")
    return 0


def install(args: argparse.Namespace) -> int:
    """vLLM and this package into /tmp/site; consumers; the extension."""
    script = STAGE / "install.sh"
    if not script.exists():
        print(f"no {script}: stage the offline-vllm chunks first", file=sys.stderr)
        return 1
    status = subprocess.run(["bash", str(script)], cwd=ROOT).returncode
    if status:
        return status
    CONSUMERS.mkdir(parents=True, exist_ok=True)
    links = {
        "deep_gemm": SITE / "vllm" / "third_party" / "deep_gemm",
        "_flashmla_C.abi3.so": SITE / "vllm" / "_flashmla_C.abi3.so",
    }
    for name, target in links.items():
        link = CONSUMERS / name
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(target)
    built = sorted((SITE / "vllm").glob("_kimi_k3_C*.so"))
    if not built:
        print("install.sh built no vllm/_kimi_k3_C*.so", file=sys.stderr)
        return 1
    for old in (ROOT / "vllm").glob("_kimi_k3_C*.so"):
        old.unlink()
    shutil.copy2(built[0], ROOT / "vllm" / built[0].name)
    print(f"consumers in {CONSUMERS}; {built[0].name} copied into the checkout")
    return 0


def _record_paths(dist_info: Path) -> list[str]:
    """The paths a wheel installed (its RECORD's first column)."""
    lines = (dist_info / "RECORD").read_text().splitlines()
    return [line.rsplit(",", 2)[0] for line in lines if line.strip()]


def lay_out_in_tree_site(site: Path, dest: Path, kit: Path) -> list[str]:
    """``dest``: a hard-link copy of ``site`` without the overlay's files
    (its wheel's RECORD), with the kit's series files written over it.
    Returns those files."""
    manifest = kit / "manifest.json"
    if not manifest.is_file():
        raise SystemExit(
            f"no {manifest}: run `python tools/patch_series/in_tree.py gpu-kit` "
            "on the CPU machine and carry build/patch_series/gpu_kit"
        )
    files = json.loads(manifest.read_text())["files"]
    overlay = sorted(site.glob(f"{OVERLAY_DIST}-*.dist-info"))
    vllm_dist = sorted(site.glob("vllm-*.dist-info"))
    if len(overlay) != 1 or len(vllm_dist) != 1:
        raise SystemExit(f"expected one overlay and one vLLM dist-info in {site}")
    overlay_owned = _record_paths(overlay[0])
    clash = sorted(set(overlay_owned) & set(_record_paths(vllm_dist[0])))
    if clash:
        raise SystemExit(f"the overlay replaced vLLM's own files: {clash[:5]}")
    if dest.exists():
        shutil.rmtree(dest)
    subprocess.run(["cp", "-al", str(site), str(dest)], check=True)
    for cache in list(dest.rglob("__pycache__")):
        shutil.rmtree(cache, ignore_errors=True)
    for rel in overlay_owned:
        path = dest / rel
        if path.is_file() or path.is_symlink():
            path.unlink()
    shutil.rmtree(dest / overlay[0].name, ignore_errors=True)
    # An emptied package folder would still import (a namespace package).
    for folder in sorted(dest.rglob("*"), key=lambda p: len(p.parts), reverse=True):
        if folder.is_dir() and not any(folder.iterdir()):
            folder.rmdir()
    for rel in files:
        target = dest / rel
        if target.exists():
            target.unlink()  # never write through the hard link
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(kit / rel, target)
    return files


def _with_build_tools(path: str) -> str:
    """``path`` with the folders of the cmake and ninja Python packages, where
    those are installed but not on it."""
    folders = []
    for module, attr in (("cmake", "CMAKE_BIN_DIR"), ("ninja", "BIN_DIR")):
        if shutil.which(module, path=path):
            continue
        with contextlib.suppress(ImportError, AttributeError):
            folders.append(str(getattr(__import__(module), attr)))
    return os.pathsep.join([*folders, path])


def install_in_tree(args: argparse.Namespace) -> int:
    """The in-tree site: the staged install without the overlay, the series'
    Python files laid over it, and the series' CMake target built against
    the host's torch."""
    if not (SITE / ".installed").exists():
        print(f"{SITE} is not installed: run `install` first", file=sys.stderr)
        return 1
    files = lay_out_in_tree_site(SITE, SITE_IN_TREE, args.kit)
    # `install` builds the overlay's wheel in the checkout, which leaves its
    # egg-info there: on the path of anything run from the checkout, its
    # entry point would make vLLM load the (absent) plugin.
    for egg_info in ROOT.glob("*.egg-info"):
        shutil.rmtree(egg_info)
    print(f"{SITE_IN_TREE}: vLLM 0.33.0, overlay removed, {len(files)} series files")
    source = CMAKE_WORK / "src"
    if CMAKE_WORK.exists():
        shutil.rmtree(CMAKE_WORK)
    source.mkdir(parents=True)
    with tarfile.open(args.kit / "cmake_source.tar.gz") as tar:
        tar.extractall(source, filter="data")
    env = {**os.environ, **VLLM_ENV, "PATH": _with_build_tools(os.environ["PATH"])}
    status = subprocess.run(
        [
            sys.executable,
            str(ROOT / "tools" / "patch_series" / "cmake_target.py"),
            "--source",
            str(source),
            "--work",
            str(CMAKE_WORK),
            "--archs",
            args.archs,
            "--jobs",
            str(os.cpu_count() or 8),
        ],  # fmt: skip
        cwd=ROOT,
        env=env,
    ).returncode
    if status:
        return status
    built = sorted((CMAKE_WORK / "build").glob("_kimi_k3_C*.so"))
    shutil.copy2(built[0], SITE_IN_TREE / "vllm" / built[0].name)
    check = subprocess.run(
        [
            sys.executable,
            "-m",
            "patch_series.check_in_tree",
            str(SITE_IN_TREE),
            "--no-entry-point",
        ],
        # From the checkout, on the path as for the suites (-m puts it there).
        cwd=ROOT,
        env={**os.environ, **IN_TREE_ENV, "PYTEST_ADDOPTS": ""},
    )
    return check.returncode


def _parse_extra(specs: list[str]) -> dict[str, Suite]:
    """``NAME=COMMAND`` suites given on the command line (run with vLLM's
    environment, e.g. a larger benchmark grid)."""
    extra = {}
    for spec in specs:
        name, sep, command = spec.partition("=")
        if not sep or not name or not command:
            raise SystemExit(f"--command takes NAME=COMMAND, got {spec!r}")
        extra[name] = Suite(command, VLLM_ENV, 540, f"command: {command}")
    return extra


def expand_groups(specs: list[str]) -> list[list[str]]:
    """Comma-separated groups, ``proof`` standing for ``PROOF_GROUPS``."""
    groups: list[list[str]] = []
    for spec in specs:
        groups += (
            [list(g) for g in PROOF_GROUPS] if spec == PROOF else [spec.split(",")]
        )
    return groups


def start(args: argparse.Namespace) -> int:
    suites = {**SUITES, **_parse_extra(args.command)}
    groups = expand_groups([args.suites, *args.then])
    unknown = [s for g in groups for s in g if s not in suites]
    if unknown:
        print(f"unknown suites {unknown}; known: {sorted(suites)}", file=sys.stderr)
        return 2
    state = args.state
    running = [
        name
        for name, entry in _read_progress(state).get("suites", {}).items()
        if entry.get("state") in ("pending", "running")
    ]
    if running and not args.force:
        print(f"suites {running} are still pending or running", file=sys.stderr)
        return 2
    if running:
        # Two supervisors would share the GPU and the progress file.
        stop(args)
        print(f"stopped {running}")
    state.mkdir(parents=True, exist_ok=True)
    _write_progress(
        state,
        {
            "commit": args.commit or _commit(),
            "started": _now(),
            "groups": groups,
            "suites": {
                name: {
                    "state": "pending",
                    "what": suites[name].what,
                    "command": suites[name].command,
                    "env": suites[name].env,
                    "timeout_s": suites[name].timeout_s,
                }
                for group in groups
                for name in group
            },
        },
    )
    with open(state / "supervisor.log", "a") as log:
        subprocess.Popen(
            [
                sys.executable,
                str(Path(__file__).resolve()),
                "--state",
                str(state),
                "_supervise",
            ],  # fmt: skip
            cwd=ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    print(f"started {groups}; progress in {state / 'progress.json'}")
    return 0


def _supervise(args: argparse.Namespace) -> int:
    state = args.state
    progress = _read_progress(state)
    progress["supervisor_pid"] = os.getpid()
    for group in progress["groups"]:
        procs: dict[str, tuple[subprocess.Popen, float]] = {}
        for name in group:
            entry = progress["suites"][name]
            logs = state / name
            logs.mkdir(parents=True, exist_ok=True)
            env = {**os.environ, **entry["env"], "LOGS": str(logs)}
            out = open(logs / "console.log", "w")  # noqa: SIM115 (closed by exit)
            proc = subprocess.Popen(
                [
                    "timeout",
                    "-s",
                    "KILL",
                    str(entry["timeout_s"]),
                    "bash",
                    "-c",
                    entry["command"],
                ],  # fmt: skip
                cwd=ROOT,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
            procs[name] = (proc, time.time())
            entry.update(state="running", started=_now(), pid=proc.pid)
        _write_progress(state, progress)
        while procs:
            time.sleep(1)
            for name, (proc, began) in list(procs.items()):
                rc = proc.poll()
                if rc is None:
                    continue
                progress["suites"][name].update(
                    state="passed" if rc == 0 else "failed",
                    rc=rc,
                    ended=_now(),
                    wall_s=round(time.time() - began, 1),
                )
                del procs[name]
                _write_progress(state, progress)
    progress["ended"] = _now()
    _write_progress(state, progress)
    return 0


ENDED = ("passed", "failed", "killed")


def poll(args: argparse.Namespace) -> int:
    """Wait up to ``--wait`` seconds (less once every suite has ended), print
    the progress, and pack the state folder into ``$OUT``."""
    state = args.state
    deadline = time.monotonic() + args.wait
    while time.monotonic() < deadline:
        states = [e["state"] for e in _read_progress(state).get("suites", {}).values()]
        if states and all(s in ENDED for s in states):
            break
        time.sleep(min(5.0, max(0.0, deadline - time.monotonic())))
    progress = _read_progress(state)
    print(f"commit {progress.get('commit', '?')}")
    for name, entry in progress.get("suites", {}).items():
        wall = entry.get("wall_s")
        if wall is None and entry.get("started"):
            wall = round(time.time() - entry["started"], 1)
        print(f"{name:12s} {entry['state']:8s} rc={entry.get('rc', '-')} wall={wall}s")
        console = state / name / "console.log"
        if console.exists() and args.tail:
            lines = console.read_text(errors="replace").splitlines()[-args.tail :]
            print("\n".join(f"    {line}" for line in lines))
    out = os.environ.get("OUT")
    if out and state.exists():
        archive = Path(out) / "gpu-results.tar.gz"
        left_out = pack_results(
            state, archive, args.max_file_bytes, args.max_archive_bytes
        )
        for path, size in left_out:
            print(f"left out {path.relative_to(state.parent)} ({size} B)")
        print(f"packed {archive} ({archive.stat().st_size} B)")
    return 0


def pack_results(
    state: Path, archive: Path, max_file_bytes: int, max_archive_bytes: int
) -> list[tuple[Path, int]]:
    """Pack every file of ``state`` up to ``max_file_bytes`` into ``archive``;
    while the archive is over ``max_archive_bytes`` (the device tool returns
    files up to 16 MiB), pack again without the file that compresses worst
    (most bytes once compressed). Returns the files left out, with sizes."""
    files = sorted(p for p in state.rglob("*") if p.is_file())
    sizes = {path: path.stat().st_size for path in files}
    left_out = [path for path in files if sizes[path] > max_file_bytes]
    compressed: dict[Path, int] = {}
    while True:
        packed = [path for path in files if path not in left_out]
        with tarfile.open(archive, "w:gz") as tar:
            for path in packed:
                tar.add(path, arcname=str(path.relative_to(state.parent)))
        if archive.stat().st_size <= max_archive_bytes or not packed:
            return [(path, sizes[path]) for path in left_out]
        if not compressed:
            compressed = {
                path: len(zlib.compress(path.read_bytes(), 1)) for path in packed
            }
        left_out.append(max(packed, key=lambda path: compressed[path]))


def stop(args: argparse.Namespace) -> int:
    """Kill the supervisor and every suite still going (each runs in its own
    process group); those suites are marked ``killed``."""
    state = args.state
    progress = _read_progress(state)
    pids = [progress.get("supervisor_pid")]
    for entry in progress.get("suites", {}).values():
        if entry.get("state") in ("pending", "running"):
            pids.append(entry.get("pid"))
            entry["state"] = "killed"
    for pid in pids:
        if pid:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
    if progress:
        _write_progress(state, progress)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--state", type=Path, default=DEFAULT_STATE)
    sub = parser.add_subparsers(dest="action", required=True)
    p = sub.add_parser("stage")
    p.add_argument("folders", type=Path, nargs="+", help="carried staging folders")
    p.set_defaults(fn=stage)
    sub.add_parser("install").set_defaults(fn=install)
    p = sub.add_parser("install-in-tree")
    p.add_argument("--kit", type=Path, default=IN_TREE_KIT)
    p.add_argument(
        "--archs",
        default="9.0;10.0",
        help="TORCH_CUDA_ARCH_LIST for the CMake target (default: %(default)s, "
        "as CI builds it)",
    )
    p.set_defaults(fn=install_in_tree)
    p = sub.add_parser("start")
    p.add_argument(
        "suites",
        help=f"comma-separated, of {sorted(SUITES)}; {PROOF!r} for "
        f"{PROOF_GROUPS}, as groups",
    )
    p.add_argument("--then", action="append", default=[], help="a later group")
    p.add_argument(
        "--command",
        action="append",
        default=[],
        metavar="NAME=COMMAND",
        help="an extra suite (vLLM's environment) that the groups may name",
    )
    p.add_argument(
        "--commit",
        help="the commit the tree is (the host's copy of the tree has no .git)",
    )
    p.add_argument("--force", action="store_true")
    p.set_defaults(fn=start)
    p = sub.add_parser("poll")
    p.add_argument("--wait", type=float, default=0.0, help="seconds, at most")
    p.add_argument("--tail", type=int, default=6, help="console lines per suite")
    p.add_argument(
        "--max-file-bytes",
        type=int,
        default=64 << 20,
        help="leave out files larger than this (before compression)",
    )
    p.add_argument(
        "--max-archive-bytes",
        type=int,
        default=15 << 20,
        help="leave out the largest files until the archive is this small "
        "(the device tool returns files up to 16 MiB)",
    )
    p.set_defaults(fn=poll)
    sub.add_parser("stop").set_defaults(fn=stop)
    sub.add_parser("_supervise").set_defaults(fn=_supervise)
    args = parser.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
