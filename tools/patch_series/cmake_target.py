# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Build the series' ``_kimi_k3_C`` CMake target by itself in the patched
tree, against the installed vLLM 0.33.0 wheel's torch.

    python tools/patch_series/cmake_target.py [--archs "9.0;10.0"]

runs after ``in_tree.py run`` has applied the series to
``build/patch_series/applied`` (or, with ``--source``, on the GPU host from
``in_tree.py gpu-kit``'s cut source). vLLM's full configure step cannot run here:
it fetches CUTLASS, FlashMLA and its other third-party sources from GitHub.
So the target is configured with vLLM's own CMake prelude, read from the
patched ``CMakeLists.txt`` up to where those downloads begin (the project,
torch, the CUDA architectures and compiler flags), followed by the series'
``include(cmake/kimi_k3_dsa.cmake)``. The build checks the result two ways.
The ``.so`` must hold SASS, in each kernel source, for every architecture the
target's configure step chose, and those must run on SM90, SM100 and SM103.
It must also register the same ``torch.ops._kimi_k3_C`` operators as the
overlay's ``setup.py`` build.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from patch_series.build_edits import CMAKE_MODULE
from patch_series.fetch import DEFAULT_DIR

# TORCH_CUDA_ARCH_LIST as vLLM's CUDA wheels name the Hopper and Blackwell
# datacenter architectures; the target's configure step narrows it to its own.
DEFAULT_ARCHS = "9.0;10.0"
# The configure step's report of the architectures the target builds for.
BUILDING_FOR = re.compile(r"Building _kimi_k3_C for archs: (\S+)")
# SASS that runs on each GPU the kernels must serve: an architecture-specific
# target, or the SM10x family-specific one.
MUST_RUN_ON = {
    "SM90": ({"sm_90a"},),
    "SM100": ({"sm_100a"}, {"sm_100f"}),
    "SM103": ({"sm_103a"}, {"sm_100f"}),
}

EXTENSION = "_kimi_k3_C"
# vLLM's CMakeLists.txt: the first line after the prelude (its third-party
# FetchContent dependencies begin here).
PRELUDE_END = re.compile(r"^#\n# Use FetchContent for C\+\+ dependencies", re.M)
# Lists the operators an extension registers, in a fresh interpreter.
LIST_OPS = (
    "import sys, torch; torch.ops.load_library(sys.argv[1]); "
    "print('\\n'.join(sorted(n for n in torch._C._dispatch_get_all_op_names() "
    f"if n.startswith('{EXTENSION}::'))))"
)


def _log(msg: str) -> None:
    print(f"[cmake-target] {msg}", flush=True)


# A CUDA toolkit without the driver's link stub (lib64/stubs/libcuda.so), as
# on the CPU machines here, leaves torch's CUDA::cuda_driver undefined, and
# vLLM's define_extension_target links every CUDA target to it. The kernels
# call no driver API, so an empty stand-in changes nothing in what they link.
DRIVER_STAND_IN = """\
if(NOT TARGET CUDA::cuda_driver)
  message(WARNING "no libcuda link stub in this CUDA toolkit: CUDA::cuda_driver "
                  "is an empty stand-in (the DSA kernels use no driver API)")
  add_library(CUDA::cuda_driver INTERFACE IMPORTED)
endif()
"""


def target_cmakelists(upstream: str) -> str:
    """vLLM's prelude and the series' kernel module, nothing else."""
    match = PRELUDE_END.search(upstream)
    if match is None:
        raise SystemExit(
            "CMakeLists.txt: the FetchContent section that ends vLLM's "
            "prelude was not found; this is not vLLM 0.33.0's build"
        )
    return (
        upstream[: match.start()]
        + "# The Kimi K3.1 DSA target alone (tools/patch_series/cmake_target.py).\n"
        + DRIVER_STAND_IN
        + f"include(${{CMAKE_CURRENT_LIST_DIR}}/{CMAKE_MODULE})\n"
    )


def stage_source(applied: Path, work: Path) -> Path:
    """A hard-link copy of the patched tree whose CMakeLists.txt configures
    only the prelude and the series' target."""
    if not (applied / CMAKE_MODULE).is_file():
        raise SystemExit(
            f"{applied / CMAKE_MODULE} missing: run `in_tree.py run` first "
            "(it applies the series there)"
        )
    source = work / "src"
    if source.exists():
        shutil.rmtree(source)
    source.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run(["cp", "-al", str(applied), str(source)], check=True)
    cmakelists = source / "CMakeLists.txt"
    text = target_cmakelists(cmakelists.read_text())
    cmakelists.unlink()  # never write through the hard link
    cmakelists.write_text(text)
    return source


def cuda_home() -> Path:
    """The CUDA toolkit, as vLLM's setup.py finds it (``CUDA_HOME`` first)."""
    from torch.utils.cpp_extension import CUDA_HOME

    home = os.environ.get("CUDA_HOME") or CUDA_HOME
    if not home or not (Path(home) / "bin" / "nvcc").is_file():
        raise SystemExit(f"no CUDA toolkit with bin/nvcc (CUDA_HOME={home!r})")
    return Path(home)


def nvrtc_args(toolkit: Path) -> list[str]:
    """Torch's CMake config links NVRTC. A toolkit without it (as on the CPU
    machines here) gets the one the torch wheel itself loads."""
    if any(
        found
        for lib in ("lib64", "lib")
        for found in (toolkit / lib).glob("libnvrtc.so*")
    ):
        return []
    import torch

    site = Path(torch.__file__).parents[1]
    wheel_nvrtc = sorted(site.glob("nvidia/*/lib/libnvrtc.so.*[0-9]"))
    if not wheel_nvrtc:
        raise SystemExit(f"no libnvrtc in {toolkit} nor in the nvidia wheels")
    _log(f"{toolkit} has no libnvrtc: using {wheel_nvrtc[0]}")
    return [f"-DCUDA_nvrtc_LIBRARY={wheel_nvrtc[0]}"]


def build(source: Path, work: Path, archs: str, jobs: int) -> tuple[Path, str]:
    """Configure and build the target; returns the ``.so`` and the
    architectures the configure step chose for it."""
    binary = work / "build"
    toolkit = cuda_home()
    if binary.exists():
        shutil.rmtree(binary)
    env = dict(os.environ, TORCH_CUDA_ARCH_LIST=archs)
    configure = subprocess.run(
        [
            "cmake",
            "-G",
            "Ninja",
            "-S",
            str(source),
            "-B",
            str(binary),
            "-DCMAKE_BUILD_TYPE=Release",
            f"-DVLLM_PYTHON_EXECUTABLE={sys.executable}",
            # As vLLM's setup.py passes it (a wrapper script on PATH would
            # hide the toolkit from torch's FindCUDA).
            f"-DCMAKE_CUDA_COMPILER={toolkit / 'bin' / 'nvcc'}",
            f"-DCUDA_TOOLKIT_ROOT_DIR={toolkit}",
            *nvrtc_args(toolkit),
        ],
        env=env,
        capture_output=True,
        text=True,
    )
    print(configure.stdout + configure.stderr, flush=True)
    if configure.returncode:
        raise SystemExit(f"cmake configure failed ({configure.returncode})")
    chosen = BUILDING_FOR.search(configure.stdout)
    if chosen is None:
        raise SystemExit(f"the configure step built no {EXTENSION} for {archs}")
    subprocess.run(
        ["cmake", "--build", str(binary), "--target", EXTENSION, "-j", str(jobs)],
        env=env,
        check=True,
    )
    built = sorted(binary.glob(f"{EXTENSION}*.so"))
    if len(built) != 1:
        raise SystemExit(f"expected one {EXTENSION}*.so in {binary}, found {built}")
    return built[0], chosen.group(1)


def cuobjdump() -> str:
    """The toolkit's cuobjdump, else the one triton resolves (its bundled
    copy, or ``TRITON_CUOBJDUMP_PATH``): the CPU machines' toolkit has none."""
    toolkit_tool = cuda_home() / "bin" / "cuobjdump"
    if toolkit_tool.is_file():
        return str(toolkit_tool)
    from triton import knobs

    return knobs.nvidia.cuobjdump.path


def sass_by_source(so: Path) -> dict[str, set[str]]:
    """``{kernel source stem: {sm_XX[a|f], ...}}`` from the ELF cubins in
    ``so``: each cubin's header names its architecture and its source
    (``--list-elf`` names a family cubin ``sm_100``, without its ``f``)."""
    listing = subprocess.run(
        [cuobjdump(), "--dump-elf-symbols", str(so)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    found: dict[str, set[str]] = {}
    pairs = re.findall(
        r"^arch = (sm_\d+[af]?)\s*\n(?:.*\n)*?identifier = (\S+)", listing, re.M
    )
    for arch, source in pairs:
        found.setdefault(Path(source).stem, set()).add(arch)
    return found


def registered_ops(so: Path) -> list[str]:
    out = subprocess.run(
        [sys.executable, "-c", LIST_OPS, str(so)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return out.split()


# The ops layer, whose entry points call the extension's ops.
OPS_LAYER = Path(__file__).resolve().parents[2] / "vllm/models/kimi_k3/nvidia/dsa_ops"
CALLED_OP = re.compile(
    r"(?:kimi_k3_ops\(\)|torch\.ops\._kimi_k3_C)\.(\w+)|"
    r"hasattr\(ops,\s*\"(\w+)\"\)"
)


def called_ops(ops_layer: Path = OPS_LAYER) -> list[str]:
    """``_kimi_k3_C::name`` of every op the ops layer's entry points call
    (``kimi_k3_ops().name``, ``torch.ops._kimi_k3_C.name``) or probe."""
    names = {
        a or b
        for path in sorted(ops_layer.glob("*.py"))
        for a, b in CALLED_OP.findall(path.read_text())
    }
    return sorted(f"{EXTENSION}::{name}" for name in names)


def check_called_ops(registered: list[str], called: list[str]) -> None:
    missing = sorted(set(called) - set(registered))
    if missing:
        raise SystemExit(
            f"the ops layer calls {missing}, which the extension does not "
            f"register (it registers {registered})"
        )


def overlay_extension() -> Path:
    """The ``_kimi_k3_C`` that the overlay's ``setup.py`` installed."""
    import importlib.util

    spec = importlib.util.find_spec(f"vllm.{EXTENSION}")
    if spec is None or spec.origin is None:
        raise SystemExit(f"vllm.{EXTENSION} is not installed: `pip install .` first")
    return Path(spec.origin)


def check(so: Path, chosen: str, kernel_sources: list[str]) -> None:
    wanted = {"sm_" + a.replace(".", "") for a in chosen.split(";")}
    unserved = [
        gpu
        for gpu, options in MUST_RUN_ON.items()
        if not any(option <= wanted for option in options)
    ]
    if unserved:
        raise SystemExit(
            f"the target is built for {chosen}, which does not run on {unserved}"
        )
    found = sass_by_source(so)
    for source in kernel_sources:
        got = found.get(Path(source).stem, set())
        if not wanted <= got:
            raise SystemExit(
                f"{so.name}: {source} has SASS for {sorted(got)}, expected "
                f"{sorted(wanted)}"
            )
    _log(
        f"{so.name}: SASS for {', '.join(sorted(wanted))} (runs on "
        f"{', '.join(MUST_RUN_ON)}) in each of {kernel_sources}"
    )
    ops = registered_ops(so)
    overlay_ops = registered_ops(overlay_extension())
    if not ops or ops != overlay_ops:
        raise SystemExit(
            f"the CMake target registers {ops}, the overlay's build {overlay_ops}"
        )
    called = called_ops()
    check_called_ops(ops, called)
    _log(
        f"registers the overlay build's {len(ops)} ops, every one the ops "
        f"layer calls among them: {', '.join(ops)}"
    )


def kernel_sources(source: Path) -> list[str]:
    """The ``.cu`` files the series' CMake module compiles."""
    module = (source / CMAKE_MODULE).read_text()
    return sorted(set(re.findall(r'"(csrc/\S+\.cu)"', module)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--applied", type=Path, default=DEFAULT_DIR / "applied")
    parser.add_argument("--work", type=Path, default=DEFAULT_DIR / "cmake_target")
    parser.add_argument(
        "--archs",
        default=DEFAULT_ARCHS,
        help="TORCH_CUDA_ARCH_LIST for vLLM's prelude (default: %(default)s)",
    )
    parser.add_argument(
        "--source",
        type=Path,
        help="a source already cut to the target (in_tree.py gpu-kit's "
        "cmake_source.tar.gz, extracted) instead of --applied",
    )
    parser.add_argument("--jobs", type=int, default=int(os.environ.get("MAX_JOBS", 2)))
    args = parser.parse_args(argv)
    start = time.monotonic()
    if args.source is not None:
        source = args.source
        if not (source / CMAKE_MODULE).is_file():
            raise SystemExit(f"{source / CMAKE_MODULE} missing: not a cut source")
    else:
        source = stage_source(args.applied, args.work)
    so, chosen = build(source, args.work, args.archs, args.jobs)
    _log(f"built {so} for {chosen} in {time.monotonic() - start:.0f} s")
    check(so, chosen, kernel_sources(source))
    return 0


if __name__ == "__main__":
    sys.exit(main())
