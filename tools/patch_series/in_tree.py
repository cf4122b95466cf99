# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""In-tree mode: the series applied to vLLM v0.33.0's source, its Python
files laid over a pristine installed vLLM 0.33.0, the plugin absent, and this
repository's CPU suite run against that.

    python tools/patch_series/in_tree.py snapshot   # before `pip install .`
    python tools/patch_series/in_tree.py run [--fetch | --vllm-src DIR]
    python tools/patch_series/in_tree.py each-patch [--fetch | --vllm-src DIR]
    python tools/patch_series/in_tree.py gpu-kit [--fetch | --vllm-src DIR]

``snapshot`` hard-links the files of the installed vLLM wheel (its
``RECORD``; CI takes it before the overlay goes in) to
``build/patch_series/pristine/vllm``. ``run`` generates the
series, applies it patch by patch to a copy of the sdist tree (GNU patch
with no fuzz and no offset allowed, then ``git apply``), lays every file the
series adds or changes under ``vllm/`` over a copy of the snapshot, and runs
``pytest -m "not gpu and not overlay_only" tests`` with that copy first on
the path and ``VLLM_PLUGINS`` listing every installed general plugin but
ours.

``gpu-kit`` writes what the GPU host needs to stand up the same form
(``tools/gpu/run.py install-in-tree``): the series' files under ``vllm/``
and, as ``cmake_source.tar.gz``, the patched tree's ``CMakeLists.txt`` cut to
the series' ``_kimi_k3_C`` target (``cmake_target.py``), ``cmake/`` and
``csrc/``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from patch_series.cmake_target import target_cmakelists
from patch_series.fetch import DEFAULT_DIR, ROOT, fetch_sdist
from patch_series.generate import write_series
from patch_series.series import (
    OVERLAY_ONLY_MARKER,
    build_series,
    overlay_only_modules,
    repository_files,
)

PRISTINE = DEFAULT_DIR / "pristine"
GPU_KIT = DEFAULT_DIR / "gpu_kit"
# The general plugin this repository registers; it must not load in-tree.
PLUGIN_ENTRY_POINT = "kimi_k3_dsa"


def in_tree_vllm_plugins() -> str:
    """``VLLM_PLUGINS`` for the in-tree run: every general plugin installed
    (vLLM's own included, as in the overlay run) except ours."""
    from importlib.metadata import entry_points

    names = sorted(
        {ep.name for ep in entry_points(group="vllm.general_plugins")}
        - {PLUGIN_ENTRY_POINT}
    )
    return ",".join(names) or "none"


def _log(msg: str) -> None:
    print(f"[in-tree] {msg}", flush=True)


def _fresh_copy(src: Path, dst: Path) -> None:
    """``dst`` becomes a hard-link copy of ``src`` (files are never written
    through: every file changed later is unlinked and replaced). A symlinked
    ``src`` (an sdist shared between checkouts) is copied as the folder it
    names: ``cp -a`` of the link itself would make ``dst`` that link, and the
    series would be applied to the shared folder."""
    if dst.is_symlink():
        dst.unlink()
    elif dst.exists():
        shutil.rmtree(dst)
    dst.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run(["cp", "-al", str(src.resolve()), str(dst)], check=True)


def _replace(src: Path, dst: Path) -> None:
    """Write ``src`` to ``dst`` as a new file (breaking any hard link)."""
    if dst.exists() or dst.is_symlink():
        dst.unlink()
    dst.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(src, dst)
    shutil.copymode(src, dst)


def installed_vllm() -> Path:
    return Path(sysconfig.get_paths()["purelib"]) / "vllm"


def snapshot(dest: Path = PRISTINE) -> Path:
    """Hard-link copy of the installed vLLM wheel's own files (those its
    ``RECORD`` lists), without anything installed into the package since."""
    from importlib.metadata import distribution

    dist = distribution("vllm")
    site = Path(str(dist.locate_file("")))
    package = dest / "vllm"
    if package.exists():
        shutil.rmtree(package)
    count = 0
    for entry in dist.files or []:
        if entry.parts[0] != "vllm" or "__pycache__" in entry.parts:
            continue
        src = site / entry
        if not src.is_file():
            continue
        target = dest / entry
        target.parent.mkdir(parents=True, exist_ok=True)
        os.link(src, target)
        count += 1
    if (package / "plugins" / "kimi_k3_dsa").exists() or count == 0:
        raise SystemExit(f"{site / 'vllm'} is not a vLLM wheel install")
    _log(f"snapshot of vLLM {dist.version} ({count} files) in {package}")
    return package


def _series_paths(patch: Path) -> list[str]:
    """Files a patch adds or changes (``b/`` side of its diffs)."""
    return re.findall(r"^\+\+\+ b/(\S+)$", patch.read_text(), flags=re.M)


def apply_series(patches: list[Path], vllm_src: Path, tree: Path) -> set[str]:
    """Apply the series to a copy of ``vllm_src`` at ``tree``, refusing any
    fuzz or offset. Returns the paths it added or changed."""
    _fresh_copy(vllm_src, tree)
    env = dict(os.environ, GIT_CEILING_DIRECTORIES=str(tree.parent))
    changed: set[str] = set()
    for patch in patches:
        paths = _series_paths(patch)
        for path in paths:  # never patch through a hard link
            file = tree / path
            if file.is_file():
                data = file.read_bytes()
                file.unlink()
                file.write_bytes(data)
        dry = subprocess.run(
            ["patch", "-p1", "-F0", "-N", "--dry-run", "-i", str(patch)],
            cwd=tree,
            capture_output=True,
            text=True,
        )
        if dry.returncode or re.search(r"offset|fuzz", dry.stdout, flags=re.I):
            raise SystemExit(
                f"{patch.name} does not apply cleanly to vLLM's tree:\n"
                f"{dry.stdout}{dry.stderr}"
            )
        subprocess.run(
            ["git", "apply", "--whitespace=error-all", str(patch)],
            cwd=tree,
            env=env,
            check=True,
        )
        changed.update(paths)
        _log(f"applied {patch.name} (no fuzz, no offset): {len(paths)} files")
    return changed


def python_side(pristine: Path, changed: set[str], vllm_src: Path) -> list[str]:
    """The series' paths under ``vllm/``, each checked to edit the wheel's
    file as it is (the sdist's copy equals the installed one)."""
    paths = sorted(p for p in changed if p.startswith("vllm/"))
    for path in paths:
        original = vllm_src / path
        installed = pristine / path.removeprefix("vllm/")
        if original.is_file() and installed.read_bytes() != original.read_bytes():
            raise SystemExit(
                f"the installed wheel's {path} differs from the sdist's: the "
                "patched file would not stand for an edit of this wheel"
            )
    return paths


def write_gpu_kit(
    pristine: Path,
    tree: Path,
    changed: set[str],
    vllm_src: Path,
    patches: list[Path],
    kit: Path,
) -> Path:
    """The series' Python files and its CMake target's sources, for the GPU
    host (``tools/gpu/run.py install-in-tree``)."""
    if kit.exists():
        shutil.rmtree(kit)
    files = python_side(pristine, changed, vllm_src)
    for path in files:
        _replace(tree / path, kit / path)
    cmakelists = target_cmakelists((tree / "CMakeLists.txt").read_text())
    staged = kit / "CMakeLists.txt"
    staged.write_text(cmakelists)
    with tarfile.open(kit / "cmake_source.tar.gz", "w:gz") as tar:
        tar.add(staged, arcname="CMakeLists.txt")
        for folder in ("cmake", "csrc"):
            tar.add(tree / folder, arcname=folder)
    staged.unlink()
    manifest = {
        "patches": [p.name for p in patches],
        "files": files,
        "cmake_source": "cmake_source.tar.gz",
    }
    (kit / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    _log(f"{kit}: {len(files)} files of the series + the CMake target's sources")
    return kit


def lay_over(
    pristine: Path,
    tree: Path,
    changed: set[str],
    vllm_src: Path,
    dest: Path,
    with_extension: bool = True,
) -> Path:
    """``dest/vllm``: the pristine package with the series' Python-side files
    (under ``vllm/``) from the patched tree."""
    package = dest / "vllm"
    _fresh_copy(pristine, package)
    for path in python_side(pristine, changed, vllm_src):
        _replace(tree / path, dest / path)
    extension = (
        sorted(installed_vllm().glob("_kimi_k3_C*.so")) if with_extension else []
    )
    for so in extension:
        # The kernels the overlay built from csrc/ stand for the target the
        # series adds to vLLM's CMake build (same sources).
        _replace(so, package / so.name)
    _log(
        f"{package}: pristine vLLM + {sum(p.startswith('vllm/') for p in changed)} "
        f"files of the series" + (f" + {extension[0].name}" if extension else "")
    )
    return package


def run_tests(
    dest: Path, pytest_args: list[str], targets: list[str] | None = None
) -> int:
    """pytest in-tree on ``targets`` (default: the whole suite; a part of
    the series when given)."""
    ignored = overlay_only_modules(ROOT, repository_files(ROOT))
    env = dict(os.environ)
    if targets is not None:
        env["KIMI_K3_DSA_IN_TREE_PREFIX"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(
        [str(dest), str(ROOT / "tools"), env.get("PYTHONPATH", "")]
    ).rstrip(os.pathsep)
    env["VLLM_PLUGINS"] = in_tree_vllm_plugins()
    env["KIMI_K3_DSA_IN_TREE"] = str(dest / "vllm")
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-p",
        "patch_series.in_tree_pytest",
        "-m",
        f"not gpu and not {OVERLAY_ONLY_MARKER}",
        *[f"--ignore={m}" for m in ignored],
        *pytest_args,
        *(targets if targets is not None else ["tests"]),
    ]
    _log("not collected (overlay-only modules): " + (", ".join(ignored) or "none"))
    _log(f"VLLM_PLUGINS={env['VLLM_PLUGINS']}")
    _log(" ".join(cmd))
    return subprocess.run(cmd, cwd=ROOT, env=env).returncode


def run_each_patch(
    pristine: Path, vllm_src: Path, files: list[Path], pytest_args: list[str]
) -> int:
    """Each prefix of the series applied and laid over, and the tests its
    patches add run against it. A prefix after which no patch changes code
    (only tests and benchmarks follow) is the whole series' run."""
    patches = build_series(ROOT)
    if len(patches) != len(files):
        raise SystemExit(f"{len(files)} patch files for {len(patches)} patches")
    code = [
        any(not f.startswith(("tests/", "benchmarks/")) for f in p.files) or p.edits
        for p in patches
    ]
    status = 0
    for k in range(1, len(patches)):
        if not any(code[k:]):
            break
        start = time.monotonic()
        tree, dest = DEFAULT_DIR / "prefix_applied", DEFAULT_DIR / "prefix_in_tree"
        changed = apply_series(files[:k], vllm_src, tree)
        with_kernels = any(p.slug == "kernels" for p in patches[:k])
        lay_over(pristine, tree, changed, vllm_src, dest, with_extension=with_kernels)
        tests = [
            t for p in patches[:k] for t in p.tests if Path(t).name.startswith("test_")
        ]
        result = run_tests(dest, pytest_args, targets=tests)
        _log(
            f"patches 1-{k} ({patches[k - 1].slug}): {len(tests)} test files, "
            f"pytest exit {result}, {time.monotonic() - start:.0f} s"
        )
        status = status or result
    return status


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("snapshot", help="hard-link the installed vLLM wheel's files")
    run = sub.add_parser("run", help="generate, apply and test in-tree")
    run.add_argument("--vllm-src", type=Path, help="extracted vLLM 0.33.0 sdist")
    run.add_argument("--fetch", action="store_true", help="download the sdist")
    run.add_argument("--pristine", type=Path, default=PRISTINE / "vllm")
    run.add_argument("pytest_args", nargs="*", help="extra pytest arguments")
    each = sub.add_parser(
        "each-patch",
        help="apply each prefix of the series and run the tests it has added",
    )
    each.add_argument("--vllm-src", type=Path, help="extracted vLLM 0.33.0 sdist")
    each.add_argument("--fetch", action="store_true", help="download the sdist")
    each.add_argument("--pristine", type=Path, default=PRISTINE / "vllm")
    each.add_argument("pytest_args", nargs="*", help="extra pytest arguments")
    kit = sub.add_parser("gpu-kit", help="generate, apply, write the GPU kit")
    kit.add_argument("--vllm-src", type=Path, help="extracted vLLM 0.33.0 sdist")
    kit.add_argument("--fetch", action="store_true", help="download the sdist")
    kit.add_argument("--pristine", type=Path, default=PRISTINE / "vllm")
    kit.add_argument("--out", type=Path, default=GPU_KIT)
    args = parser.parse_args(argv)
    if args.command == "snapshot":
        snapshot()
        return 0

    start = time.monotonic()
    vllm_src = args.vllm_src or (
        fetch_sdist(DEFAULT_DIR) if args.fetch else DEFAULT_DIR / "vllm-0.33.0"
    )
    if not args.pristine.is_dir():
        raise SystemExit(f"{args.pristine} missing: run `snapshot` first")
    patches = write_series(ROOT, vllm_src, DEFAULT_DIR / "patches", DEFAULT_DIR / "git")
    _log(f"{len(patches)} patches generated in {DEFAULT_DIR / 'patches'}")
    if args.command == "each-patch":
        return run_each_patch(args.pristine, vllm_src, patches, args.pytest_args)
    changed = apply_series(patches, vllm_src, DEFAULT_DIR / "applied")
    if args.command == "gpu-kit":
        write_gpu_kit(
            args.pristine,
            DEFAULT_DIR / "applied",
            changed,
            vllm_src,
            patches,
            args.out,
        )
        return 0
    lay_over(
        args.pristine,
        DEFAULT_DIR / "applied",
        changed,
        vllm_src,
        DEFAULT_DIR / "in_tree",
    )
    _log(f"series applied and laid over in {time.monotonic() - start:.0f} s")
    status = run_tests(DEFAULT_DIR / "in_tree", args.pytest_args)
    _log(f"in-tree stage: {time.monotonic() - start:.0f} s, pytest exit {status}")
    return status


if __name__ == "__main__":
    sys.exit(main())
