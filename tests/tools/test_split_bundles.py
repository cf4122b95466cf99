# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""tools/gpu/split_bundles.sh on small fake bundles: every folder within the
limit, the pieces concatenate back to each payload, the scripts and the extra
wheels where the host steps expect them, bad limits refused; and the folders
staged as the host stages them (``run.py stage``)."""

from __future__ import annotations

import io
import os
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "tools" / "gpu" / "split_bundles.sh"
RUNNER = SCRIPT.with_name("run.py")
MIB = 1024 * 1024


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """A project root with the script and fake bundles of random bytes."""
    (tmp_path / "tools" / "gpu").mkdir(parents=True)
    shutil.copy(SCRIPT, tmp_path / "tools" / "gpu" / SCRIPT.name)
    dev = tmp_path / ".device"
    bundles = {
        "cutedsl": [("1", "part.0", 11), ("2", "part.1", 6)],
        "offline-vllm": [("1", "part.0", 11), ("2", "part.1", 11), ("3", "part.2", 4)],
    }
    for name, parts in bundles.items():
        for folder, part, mib in parts:
            (dev / name / folder).mkdir(parents=True)
            (dev / name / folder / part).write_bytes(os.urandom(mib * MIB))
    (dev / "cutedsl" / "1" / "install_cutedsl.sh").write_text("# c\n")
    (dev / "offline-vllm" / "1" / "install.sh").write_text("# v\n")
    for extra in ("cute-core", "cute-extra"):
        (dev / extra).mkdir()
        (dev / extra / f"{extra}-1.0-py3-none-any.whl").write_bytes(os.urandom(MIB))
    return tmp_path


def run(tree: Path, *args: str) -> subprocess.CompletedProcess:
    script = tree / "tools" / "gpu" / SCRIPT.name
    return subprocess.run(
        ["bash", str(script), *args], capture_output=True, text=True, check=False
    )


def payload(folders: list[Path]) -> bytes:
    parts = sorted((p for f in folders for p in f.glob("part.*")), key=lambda p: p.name)
    return b"".join(p.read_bytes() for p in parts)


def test_pieces_fit_and_join_back(tree: Path) -> None:
    result = run(tree, "8")
    assert result.returncode == 0, result.stderr
    dev = tree / ".device"
    out = dev / "r3"
    for folder in out.iterdir():
        size = sum(p.stat().st_size for p in folder.iterdir())
        assert size <= 8 * MIB, folder.name
    cute = sorted(out.glob("c*"))
    vllm = sorted(out.glob("v*"))
    assert len(cute) == 3 and len(vllm) == 4
    original = (dev / "cutedsl/1/part.0").read_bytes() + (
        dev / "cutedsl/2/part.1"
    ).read_bytes()
    assert payload(cute) == original
    original = b"".join(
        (dev / f"offline-vllm/{i}/part.{i - 1}").read_bytes() for i in (1, 2, 3)
    )
    assert payload(vllm) == original
    assert (out / "c1" / "install_cutedsl.sh").exists()
    assert (out / "v1" / "install.sh").exists()
    last = cute[-1]
    assert {p.name for p in last.glob("*.whl")} == {
        "cute-core-1.0-py3-none-any.whl",
        "cute-extra-1.0-py3-none-any.whl",
    }


def git_tree(tree: Path, tracked_mib: int) -> None:
    """Make the fake root a git checkout whose tree takes tracked_mib MiB,
    the bundles ignored as in the project."""
    (tree / ".gitignore").write_text(".device/\n")
    with open(tree / "results.bin", "wb") as f:
        f.truncate(tracked_mib * MIB)
    for args in (["init", "-q"], ["add", "-A"]):
        subprocess.run(["git", "-C", str(tree), *args], check=True)


def test_default_limit_leaves_room_for_the_tree(tree: Path) -> None:
    git_tree(tree, 50)
    result = run(tree)
    assert result.returncode == 0, result.stderr
    # 64 MiB less the tree (50 MiB and the script, rounded up) less 3.
    assert "chunks of at most 10 MiB (the tree: 50 MiB" in result.stdout
    for folder in (tree / ".device" / "r3").iterdir():
        size = sum(p.stat().st_size for p in folder.iterdir())
        assert size <= 10 * MIB, folder.name


def test_default_limit_refuses_a_tree_that_leaves_no_room(tree: Path) -> None:
    git_tree(tree, 54)
    result = run(tree)
    assert result.returncode == 2
    assert "the tree takes 54 MiB of a call's 64" in result.stderr
    assert not (tree / ".device" / "r3").exists()


def test_a_run_that_stops_half_way_keeps_the_last_cut(tree: Path) -> None:
    assert run(tree, "8").returncode == 0
    out = tree / ".device" / "r3"
    before = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    # The vLLM bundle without its install.sh fails after the CuTe DSL's cut.
    (tree / ".device" / "offline-vllm" / "1" / "install.sh").unlink()
    assert run(tree, "10").returncode != 0
    after = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    assert after == before
    assert not (tree / ".device" / "r3.partial").exists()


def wheel(files: dict[str, bytes]) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        for path, data in files.items():
            archive.writestr(path, data)
    return buffer.getvalue()


def test_run_py_stages_the_folders(tree: Path, tmp_path: Path) -> None:
    """What the host does with the folders: ``run.py stage`` puts the vLLM
    parts where ``install`` reads them and, at the CuTe DSL's last folder,
    joins its parts and unzips every wheel into one site folder."""
    big = os.urandom(12 * MIB)
    payload = io.BytesIO()
    with tarfile.open(fileobj=payload, mode="w") as tar:
        data = wheel({"cutlass_dsl/big.bin": big, "cutlass_dsl/a.py": b"a"})
        info = tarfile.TarInfo("whl/dsl-1.0-py3-none-any.whl")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    cute = tree / ".device" / "cutedsl"
    shutil.rmtree(cute)
    (cute / "1").mkdir(parents=True)
    (cute / "1" / "part.0").write_bytes(payload.getvalue())
    (cute / "1" / "install_cutedsl.sh").write_text("# c\n")
    for extra in ("cute-core", "cute-extra"):
        (tree / ".device" / extra / f"{extra}-1.0-py3-none-any.whl").write_bytes(
            wheel({f"{extra}/mod.py": extra.encode()})
        )
    assert run(tree, "8").returncode == 0
    folders = sorted((tree / ".device" / "r3").iterdir())
    assert [f.name for f in folders] == ["c1", "c2", "v1", "v2", "v3", "v4"]
    host = tmp_path / "host"
    staged = subprocess.run(
        [sys.executable, str(RUNNER), "stage", *map(str, folders)],
        capture_output=True,
        text=True,
        env={**os.environ, "KIMI_K3_GPU_HOST_TMP": str(host)},
    )
    assert staged.returncode == 0, staged.stderr
    site = host / "site-cute2"
    assert (site / "cutlass_dsl" / "big.bin").read_bytes() == big
    assert (site / "cute-core" / "mod.py").read_bytes() == b"cute-core"
    assert (site / "cute-extra" / "mod.py").read_bytes() == b"cute-extra"
    vllm_parts = sorted((host / "offline-vllm").glob("part.*"))
    original = b"".join(
        (tree / f".device/offline-vllm/{i}/part.{i - 1}").read_bytes()
        for i in (1, 2, 3)
    )
    assert b"".join(p.read_bytes() for p in vllm_parts) == original
    assert (host / "offline-vllm" / "install.sh").exists()


def test_run_py_refuses_the_last_cute_folder_alone(tree: Path, tmp_path: Path) -> None:
    assert run(tree, "8").returncode == 0
    host = tmp_path / "host"
    staged = subprocess.run(
        [sys.executable, str(RUNNER), "stage", str(tree / ".device" / "r3" / "c3")],
        capture_output=True,
        text=True,
        env={**os.environ, "KIMI_K3_GPU_HOST_TMP": str(host)},
    )
    assert staged.returncode == 1
    assert "not part.00 to part.00: stage every c folder first" in staged.stderr
    assert not (host / "site-cute2").exists()


@pytest.mark.parametrize("limit", ["7", "61", "4x", "-1"])
def test_bad_limits_are_refused(tree: Path, limit: str) -> None:
    result = run(tree, limit)
    assert result.returncode == 2
    assert "MAX_MIB must be a whole number from 8 to 60" in result.stderr
    assert not (tree / ".device" / "r3").exists()


def test_missing_bundle_is_named(tree: Path) -> None:
    shutil.rmtree(tree / ".device" / "offline-vllm")
    result = run(tree)
    assert result.returncode == 1
    assert "offline-vllm/*/part.*: run its bundle script first" in result.stderr
    assert not (tree / ".device" / "r3").exists()


def test_prepare_sitting_refuses_a_missing_bundle_folder(tmp_path: Path) -> None:
    """The preparation names the folder it needs before it installs or
    writes anything."""
    prepare = SCRIPT.with_name("prepare_sitting.sh")
    (tmp_path / "tools" / "gpu").mkdir(parents=True)
    shutil.copy(prepare, tmp_path / "tools" / "gpu" / prepare.name)
    env = {**os.environ, "OFFLINE_VLLM_TOOLS": str(tmp_path / "nowhere")}
    run = subprocess.run(
        ["bash", str(tmp_path / "tools" / "gpu" / prepare.name)],
        capture_output=True,
        text=True,
        env=env,
    )
    assert run.returncode == 2
    assert "set OFFLINE_VLLM_TOOLS" in run.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tools"]
