# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""``sparse_mla_fp8``'s launch shapes compiled for sm_90 on the CPU (Triton's
bundled ptxas): none spills, and the candidates that claim two programs an
SM fit in 128 registers and half an SM's shared memory. Timing them needs
the GPU (``sparse-mla-bench``)."""

from __future__ import annotations

import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")

from vllm.models.kimi_k3.nvidia.dsa_ops import sparse_mla as S  # noqa: E402

_BENCH = next(
    p / "benchmarks" / "kernels"
    for p in Path(__file__).resolve().parents
    if (p / "benchmarks" / "kernels" / "bench_sparse_mla.py").is_file()
)
sys.path.insert(0, str(_BENCH))
import bench_sparse_mla as bench  # noqa: E402

CUOBJDUMP = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
POINTERS = {
    "q_ptr": "*bf16",
    "cache_ptr": "*u8",
    "cache_f32_ptr": "*fp32",
    "cache_bf16_ptr": "*bf16",
    "idx_ptr": "*i32",
    "out_ptr": "*bf16",
    "lse_ptr": "*fp32",
}
# Shapes kept at one program an SM for comparison; never the default, since
# default_num_splits plans for two.
ONE_PROGRAM_AN_SM = {"n32w8"}
# sm_90's shared memory an SM, in bytes (228 KB, 1 KB of it per block reserved).
SM90_SHARED_PER_SM = 233472
SM90_REGISTERS_PER_SM = 65536
# Integers the launcher passes 16-divisible in the suite's shapes.
ALIGNED = {"q_token_stride", "q_head_stride", "cache_block_stride", "block_size"}


def sm90_resources(tiles: S.SparseMLATiles) -> tuple[int, int, int]:
    """Registers a thread, local (spill) bytes and shared memory bytes of the
    split kernel."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    kernel = S._sparse_mla_split_kernel
    names = kernel.arg_names
    signature = {n: POINTERS.get(n, "i32") for n in names}
    flags = {
        "SINGLE": True,
        "BLOCK_N": tiles.block_n,
        "FP16_LATENT": tiles.fp16_latent,
        "INLINE_PTX": True,
    }
    signature.update(scale_log2="fp32", **dict.fromkeys(flags, "constexpr"))
    aligned = [n for n in names if n in POINTERS or n in ALIGNED]
    source = ASTSource(
        fn=kernel,
        signature=signature,
        constexprs={(names.index(flag),): value for flag, value in flags.items()},
        attrs={(names.index(n),): [["tt.divisibility", 16]] for n in aligned},
    )
    compiled = triton.compile(
        source, target=GPUTarget("cuda", 90, 32), options=tiles.compile_options()
    )
    return *_usage(compiled.asm["cubin"]), compiled.metadata.shared


def _usage(cubin: bytes) -> tuple[int, int]:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        usage = subprocess.run(
            [str(CUOBJDUMP), "-res-usage", f.name],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    regs = re.search(r"REG:(\d+)", usage)
    local = re.search(r"LOCAL:(\d+)", usage)
    assert regs and local, usage
    return int(regs.group(1)), int(local.group(1))


@pytest.mark.slow
@pytest.mark.skipif(not CUOBJDUMP.exists(), reason="Triton's cuobjdump is missing")
@pytest.mark.parametrize("name", sorted(S.TILE_CANDIDATES))
def test_launch_shape_compiles_without_spills(name: str) -> None:
    tiles = S.TILE_CANDIDATES[name]
    regs, local, shared = sm90_resources(tiles)
    assert local == 0, f"{name} spills {local} bytes"
    if name not in ONE_PROGRAM_AN_SM:
        assert regs <= 128, f"{name} takes {regs} registers: one program an SM"
        assert 2 * (shared + 1024) <= SM90_SHARED_PER_SM, (
            f"{name} takes {shared} bytes of shared memory: one program an SM"
        )


@pytest.mark.slow
@pytest.mark.skipif(not CUOBJDUMP.exists(), reason="Triton's cuobjdump is missing")
@pytest.mark.parametrize("name", sorted(bench.PROBES))
def test_benchmark_probe_fits_its_programs_an_sm(name: str) -> None:
    """The benchmark's four-warp probes plan their splits for this many
    programs an SM: their registers and shared memory must allow it."""
    fields, per_sm = bench.PROBES[name]
    tiles = S.SparseMLATiles(*fields)
    S._check_tiles(tiles)
    regs, local, shared = sm90_resources(tiles)
    assert local == 0, f"{name} spills {local} bytes"
    assert per_sm * tiles.num_warps * 32 * regs <= SM90_REGISTERS_PER_SM, (name, regs)
    assert per_sm * (shared + 1024) <= SM90_SHARED_PER_SM, (name, shared)
