# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""tools/gpu/split_bundles.sh on small fake bundles: every folder within the
limit, the pieces concatenate back to each payload, the scripts and the extra
wheels where the host steps expect them, bad limits refused."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "tools" / "gpu" / "split_bundles.sh"
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
