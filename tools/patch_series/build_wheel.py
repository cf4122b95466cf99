# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Build vLLM from source with the series applied, as vLLM documents a
Python-only build: its ``setup.py`` with ``VLLM_USE_PRECOMPILED=1`` takes the
compiled files from a vLLM 0.33.0 wheel (``VLLM_PRECOMPILED_WHEEL_LOCATION``,
a local file: no network), plus ``_kimi_k3_C`` from the series' own CMake
target, which the series' ``setup.py`` edit ships when it is in the tree.

    python tools/patch_series/build_wheel.py --vllm-wheel PATH [--check]

runs after ``in_tree.py run`` (or ``gpu-kit``) has applied the series to
``build/patch_series/applied``, and writes ``build/patch_series/dist/``.
``--check`` then installs the wheel into a scratch folder and checks that it
holds the series' files and the extension and imports without the plugin.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from patch_series import cmake_target
from patch_series.fetch import DEFAULT_DIR
from patch_series.in_tree import _series_paths


def _log(msg: str) -> None:
    print(f"[build-wheel] {msg}", flush=True)


def prepare_source(applied: Path, work: Path, extension: Path) -> Path:
    """A copy of the patched tree (the build writes into its tree) with the
    CMake target's ``_kimi_k3_C`` in ``vllm/``."""
    source = work / "src"
    if source.exists():
        shutil.rmtree(source)
    source.parent.mkdir(parents=True, exist_ok=True)
    shutil.copytree(applied, source, symlinks=True)
    shutil.copy2(extension, source / "vllm" / extension.name)
    return source


def build(source: Path, vllm_wheel: Path, dist: Path) -> Path:
    """``pip wheel`` of the tree on vLLM's precompiled route."""
    if dist.exists():
        shutil.rmtree(dist)
    env = dict(
        os.environ,
        VLLM_USE_PRECOMPILED="1",
        VLLM_PRECOMPILED_WHEEL_LOCATION=str(vllm_wheel.resolve()),
        SETUPTOOLS_SCM_PRETEND_VERSION="0.33.0",
    )
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-build-isolation",
            "--no-deps",
            "-w",
            str(dist),
            str(source),
        ],
        env=env,
        check=True,
    )
    built = sorted(dist.glob("vllm-*.whl"))
    if len(built) != 1:
        raise SystemExit(f"expected one vllm wheel in {dist}, found {built}")
    return built[0]


def check_wheel(wheel: Path, series_files: list[str], scratch: Path) -> None:
    """The wheel holds the series' files and the extension, no plugin, and,
    installed by itself, imports with the series active."""
    scratch = scratch.resolve()
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        entry_points = "".join(
            archive.read(n).decode() for n in names if n.endswith("entry_points.txt")
        )
    missing = [f for f in series_files if f not in names]
    if missing:
        raise SystemExit(f"{wheel.name} lacks the series' {missing[:5]}")
    if not any(n.startswith("vllm/_kimi_k3_C") and n.endswith(".so") for n in names):
        raise SystemExit(f"{wheel.name} holds no vllm/_kimi_k3_C*.so")
    if "kimi_k3_dsa" in entry_points or any("plugins/kimi_k3_dsa" in n for n in names):
        raise SystemExit(f"{wheel.name} carries the overlay's plugin")
    if scratch.exists():
        shutil.rmtree(scratch)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--no-compile",
            "--target",
            str(scratch),
            str(wheel),
        ],
        check=True,
    )
    subprocess.run(
        [
            sys.executable,
            str(Path(__file__).with_name("check_in_tree.py")),
            str(scratch),
        ],
        env=dict(os.environ, PYTHONPATH=str(scratch)),
        cwd=scratch,
        check=True,
    )
    _log(f"{wheel.name}: {len(series_files)} series files, _kimi_k3_C, no plugin")


def series_files(patches: Path) -> list[str]:
    """The files under ``vllm/`` that the series' patches add or change."""
    found = sorted(
        {
            path
            for patch in patches.glob("*.patch")
            for path in _series_paths(patch)
            if path.startswith("vllm/")
        }
    )
    if not found:
        raise SystemExit(f"no series in {patches}: run `in_tree.py run` first")
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vllm-wheel", type=Path, required=True)
    parser.add_argument("--applied", type=Path, default=DEFAULT_DIR / "applied")
    parser.add_argument("--work", type=Path, default=DEFAULT_DIR / "wheel_build")
    parser.add_argument("--dist", type=Path, default=DEFAULT_DIR / "dist")
    parser.add_argument("--patches", type=Path, default=DEFAULT_DIR / "patches")
    parser.add_argument("--archs", default=cmake_target.DEFAULT_ARCHS)
    parser.add_argument("--jobs", type=int, default=int(os.environ.get("MAX_JOBS", 2)))
    parser.add_argument(
        "--extension",
        type=Path,
        help="a _kimi_k3_C the CMake target already built (cmake_target.py)",
    )
    parser.add_argument("--check", action="store_true")
    args = parser.parse_args(argv)
    if not args.vllm_wheel.is_file():
        raise SystemExit(f"no vLLM 0.33.0 wheel at {args.vllm_wheel}")
    start = time.monotonic()
    so = args.extension
    if so is None:
        cut = cmake_target.stage_source(args.applied, args.work / "cmake")
        so, _ = cmake_target.build(cut, args.work / "cmake", args.archs, args.jobs)
        _log(f"_kimi_k3_C built in {time.monotonic() - start:.0f} s")
    elif not so.is_file():
        raise SystemExit(f"no {so}")
    source = prepare_source(args.applied, args.work, so)
    wheel = build(source, args.vllm_wheel, args.dist)
    _log(f"built {wheel} in {time.monotonic() - start:.0f} s")
    if args.check:
        check_wheel(wheel, series_files(args.patches), args.work / "installed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
