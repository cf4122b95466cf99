# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Bad invocations of ``kimi-k3-dsa-tiny-checkpoint``: each is refused early
with one clear line and leaves the disk exactly as it was; failed writes
leave nothing half-written behind.

``main`` runs in-process (fast); one run of the installed console script
shows that a refusal carries no traceback.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

safetensors_torch = pytest.importorskip("safetensors.torch")

from kimi_k3_dsa_tools import tiny_checkpoint as T  # noqa: E402
from kimi_k3_dsa_tools import tiny_checkpoint_cli as cli  # noqa: E402

PROG = "kimi-k3-dsa-tiny-checkpoint"
EXTRAS = ("model.safetensors.index.json", "tokenizer.json")


def snapshot(root: Path, dir_mtimes: bool = True) -> dict[str, tuple]:
    """Every entry under ``root`` (``root`` included, symlinks not followed)
    with its kind, mode, mtime and, for files, a hash of the bytes.
    ``dir_mtimes=False`` ignores directory mtimes, which a staging directory
    created and removed again changes."""
    entries: dict[str, tuple] = {}

    def record(path: Path) -> None:
        rel = str(path.relative_to(root))
        st = path.lstat()
        if path.is_symlink():
            entries[rel] = ("link", os.readlink(path))
        elif path.is_dir():
            entries[rel] = ("dir", st.st_mode, st.st_mtime_ns if dir_mtimes else 0)
        else:
            digest = hashlib.sha256(path.read_bytes()).hexdigest()
            entries[rel] = ("file", st.st_mode, st.st_mtime_ns, digest)

    record(root)
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            record(Path(dirpath) / name)
    return entries


def run_main(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> tuple[int, str, str]:
    """``main(argv)``'s exit status, stdout and stderr; it must print nothing
    on stdout when it fails."""
    try:
        cli.main(argv)
        code = 0
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else 1
    captured = capsys.readouterr()
    if code:
        assert captured.out == ""
    return code, captured.out, captured.err


@pytest.fixture(scope="module")
def k31_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return T.write_tiny_checkpoint(tmp_path_factory.mktemp("cli_src") / "k31")


@pytest.fixture
def workdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh directory, the current one, holding ``ckpt``: an existing
    Kimi K3.1 checkpoint with an index file and a tokenizer beside it."""
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.fixture
def existing(workdir: Path, k31_checkpoint: Path) -> Path:
    ckpt = workdir / "ckpt"
    shutil.copytree(k31_checkpoint, ckpt)
    for name in EXTRAS:
        (ckpt / name).write_text("{}\n")
    return ckpt


def _file(root: Path) -> None:
    (root / "weights.bin").write_bytes(b"not a directory")


def _link(root: Path) -> None:
    (root / "link").symlink_to("ckpt", target_is_directory=True)


def _dangling(root: Path) -> None:
    (root / "dangling").symlink_to("missing")


def _nothing(root: Path) -> None:
    pass


# (id, extra setup, argv, exit status, words of the one stderr line)
BAD = [
    ("non-empty", _nothing, ["ckpt"], 2, ["ckpt is not empty", "use --force"]),
    (
        "config-only-no-dsa-over-k31",
        _nothing,
        ["ckpt", "--config-only", "--no-dsa"],
        2,
        ["ckpt is not empty", "config.json", "use --force"],
    ),
    ("empty-path", _nothing, [""], 2, ["output path is empty"]),
    ("blank-path", _nothing, ["  "], 2, ["output path is empty"]),
    (
        "regular-file",
        _file,
        ["weights.bin"],
        2,
        ["weights.bin exists and is not a directory"],
    ),
    (
        "regular-file-force",
        _file,
        ["weights.bin", "--force"],
        2,
        ["weights.bin exists and is not a directory"],
    ),
    (
        "symlink-to-dir",
        _link,
        ["link"],
        2,
        ["link is a symbolic link (to ckpt)", "not followed"],
    ),
    (
        "symlink-to-dir-force",
        _link,
        ["link/", "--force"],
        2,
        ["link/ is a symbolic link (to ckpt)", "not followed"],
    ),
    ("dangling-symlink", _dangling, ["dangling"], 2, ["dangling is a symbolic link"]),
    (
        "parent-is-a-file",
        _file,
        ["weights.bin/sub/out"],
        2,
        ["cannot create weights.bin/sub/out", "weights.bin is not a directory"],
    ),
    ("root", _nothing, ["/", "--force"], 2, ["/ is the filesystem root"]),
    (
        "force-on-current-dir",
        _nothing,
        [".", "--force"],
        2,
        ["--force would replace .", "holds the current directory"],
    ),
    (
        "multimodal-config-only",
        _nothing,
        ["new", "--multimodal", "--config-only"],
        2,
        ["--config-only writes the text-only config"],
    ),
    (
        "seed-config-only",
        _nothing,
        ["new", "--config-only", "--seed", "3"],
        2,
        ["--seed has no effect with --config-only"],
    ),
    ("negative-seed", _nothing, ["new", "--seed", "-1"], 2, ["--seed -1 is out"]),
    (
        "small-vocab",
        _nothing,
        ["new", "--vocab-size", "1000"],
        2,
        ["--vocab-size 1000 is out of range", "give 1024 to 131072"],
    ),
    (
        "large-vocab",
        _nothing,
        ["new", "--vocab-size", "131073"],
        2,
        ["--vocab-size 131073 is out of range", "give 1024 to 131072"],
    ),
    (
        "blocks-without-real-attention",
        _nothing,
        ["new", "--attention-blocks", "4"],
        2,
        ["--attention-blocks needs --real-attention"],
    ),
    (
        "zero-blocks",
        _nothing,
        ["new", "--real-attention", "--attention-blocks", "0"],
        2,
        ["--attention-blocks 0 is out of range", "give 1 to 24"],
    ),
    (
        "too-many-blocks",
        _nothing,
        ["new", "--real-attention", "--attention-blocks", "25"],
        2,
        ["--attention-blocks 25 is out of range", "give 1 to 24"],
    ),
    ("misspelt-option", _nothing, ["new", "--forse"], 2, ["unrecognized arguments"]),
]


@pytest.mark.parametrize(
    ("setup", "argv", "code", "words"),
    [case[1:] for case in BAD],
    ids=[case[0] for case in BAD],
)
def test_bad_invocation_is_refused_and_changes_nothing(
    existing: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    setup: Callable[[Path], None],
    argv: list[str],
    code: int,
    words: list[str],
) -> None:
    root = existing.parent
    setup(root)
    if argv[0] == ".":
        monkeypatch.chdir(existing)
    before = snapshot(root)
    status, _, err = run_main(argv, capsys)
    assert status == code
    line = err.strip().splitlines()[-1]
    assert line.startswith(f"{PROG}: error: ")
    for word in words:
        assert word in line
    if "unrecognized" not in line:  # argparse's own errors add the usage
        assert err.count("\n") == 1
    assert snapshot(root) == before


def test_force_replaces_the_whole_directory(
    existing: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    mode = existing.stat().st_mode
    status, _, _ = run_main(["ckpt", "--force", "--no-dsa", "--seed", "5"], capsys)
    assert status == 0
    assert sorted(p.name for p in existing.iterdir()) == [
        "config.json",
        T.CHECKPOINT_FILE,
    ]
    assert "dsa_config" not in json.loads((existing / "config.json").read_text())
    weights = safetensors_torch.load_file(str(existing / T.CHECKPOINT_FILE))
    assert not [n for n in weights if ".indexer." in n]
    assert existing.stat().st_mode == mode
    # no staging or moved-aside directory left beside it
    assert sorted(p.name for p in existing.parent.iterdir()) == ["ckpt"]


def test_force_config_only_leaves_no_old_weights(
    existing: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    status, out, _ = run_main(["ckpt", "--config-only", "--no-dsa", "--force"], capsys)
    assert status == 0 and "plain Kimi K3" in out
    assert [p.name for p in existing.iterdir()] == ["config.json"]
    assert json.loads((existing / "config.json").read_text()) == T.tiny_text_config(
        dsa=False
    )


def test_new_directory_and_missing_parents(
    workdir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert run_main(["a/b/c", "--config-only"], capsys)[0] == 0
    out = workdir / "a" / "b" / "c"
    assert [p.name for p in out.iterdir()] == ["config.json"]
    umask = os.umask(0)
    os.umask(umask)
    assert out.stat().st_mode & 0o777 == 0o777 & ~umask  # not mkdtemp's 0700
    assert sorted(p.name for p in out.parent.iterdir()) == ["c"]


def test_empty_directory_is_filled_in_place(
    workdir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    empty = workdir / "empty"
    empty.mkdir(mode=0o750)
    inode = empty.stat().st_ino
    assert run_main(["empty", "--config-only"], capsys)[0] == 0
    assert empty.stat().st_ino == inode
    assert [p.name for p in empty.iterdir()] == ["config.json"]
    assert sorted(p.name for p in workdir.iterdir()) == ["empty"]


def _disk_full(*args: object, **kwargs: object) -> None:
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


@pytest.mark.parametrize(
    "argv",
    [["ckpt", "--force"], ["new/deeper/out"], ["empty"]],
    ids=["existing-force", "new-with-parents", "empty-dir"],
)
def test_failed_weight_write_changes_nothing(
    existing: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    argv: list[str],
) -> None:
    root = existing.parent
    (root / "empty").mkdir()
    monkeypatch.setattr(safetensors_torch, "save_file", _disk_full)
    before = snapshot(root, dir_mtimes=False)
    status, _, err = run_main(argv, capsys)
    assert status == 1
    assert err.count("\n") == 1
    assert f"cannot write the checkpoint to {root / argv[0]}" in err
    assert "No space left on device" in err and "nothing was changed" in err
    assert snapshot(root, dir_mtimes=False) == before


def test_failed_swap_puts_the_old_directory_back(
    existing: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The new directory cannot be moved in after the old one was moved
    aside: the old one comes back."""
    rename = os.rename

    def fail_staging(src: str | Path, dst: str | Path) -> None:
        if cli._STAGING_INFIX in Path(src).name:
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        rename(src, dst)

    before = snapshot(existing.parent, dir_mtimes=False)
    monkeypatch.setattr(os, "rename", fail_staging)
    status, _, err = run_main(["ckpt", "--config-only", "--force"], capsys)
    monkeypatch.undo()
    assert status == 1
    assert "Input/output error" in err and "nothing was changed" in err
    assert snapshot(existing.parent, dir_mtimes=False) == before


def test_permission_denied_is_one_line(
    existing: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    def denied(*args: object, **kwargs: object) -> str:
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES))

    before = snapshot(existing.parent, dir_mtimes=False)
    monkeypatch.setattr(cli.tempfile, "mkdtemp", denied)
    status, _, err = run_main(["new/out", "--config-only"], capsys)
    monkeypatch.undo()
    assert status == 1 and err.count("\n") == 1
    assert "cannot write the checkpoint to" in err and "Permission denied" in err
    # the parent "new" it created is removed again
    assert snapshot(existing.parent, dir_mtimes=False) == before


def test_library_writer_keeps_old_files_on_failure(
    existing: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``write_tiny_checkpoint`` replaces its two files in place (tests
    rewrite configs so), but a failed write leaves them as they were."""
    before = snapshot(existing, dir_mtimes=False)
    monkeypatch.setattr(safetensors_torch, "save_file", _disk_full)
    with pytest.raises(OSError):
        T.write_tiny_checkpoint(existing, dsa=False)
    assert snapshot(existing, dir_mtimes=False) == before
    monkeypatch.undo()
    T.write_tiny_config(existing, dsa=False)
    assert sorted(p.name for p in existing.iterdir()) == sorted(
        ["config.json", T.CHECKPOINT_FILE, *EXTRAS]
    )


def test_console_script_refuses_without_traceback(existing: Path) -> None:
    script = Path(sys.executable).parent / PROG
    if not script.exists():
        pytest.skip(f"{PROG} is not installed next to {sys.executable}")
    before = snapshot(existing.parent)
    result = subprocess.run(
        [str(script), "ckpt"],
        cwd=existing.parent,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert f"{PROG}: error: ckpt is not empty" in result.stderr
    assert result.stdout == ""
    assert snapshot(existing.parent) == before
