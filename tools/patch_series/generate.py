# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Write the series as ``git format-patch`` files against vLLM's source tree.

The commits are made in a scratch repository whose base commit holds only the
upstream files the series edits, taken from the vLLM source tree given. A
patch depends only on the content of the files it touches (``--full-index``
blob ids included), so the patches are those a full clone would give. Author,
committer and dates are fixed: two runs on the same inputs write identical
files.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from patch_series.edits import apply_edits
from patch_series.series import VLLM_VERSION, Patch, SeriesError, build_series

AUTHOR = "vllm-kimi-k3-dsa"
AUTHOR_EMAIL = "vllm-kimi-k3-dsa@users.noreply.github.com"
# Fixed, so that commit ids (and the patches) do not depend on the clock.
DATE = "2026-12-01T00:00:00+00:00"


def _git_env() -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("GIT_") and k not in {"EMAIL"}
    }
    for role in ("AUTHOR", "COMMITTER"):
        env[f"GIT_{role}_NAME"] = AUTHOR
        env[f"GIT_{role}_EMAIL"] = AUTHOR_EMAIL
        env[f"GIT_{role}_DATE"] = DATE
    env.update(GIT_CONFIG_GLOBAL=os.devnull, GIT_CONFIG_NOSYSTEM="1", TZ="UTC")
    return env


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(
        ["git", *args],
        cwd=repo,
        env=_git_env(),
        check=True,
        capture_output=True,
        text=True,
    ).stdout


def upstream_reader(vllm_src: Path):
    """path -> text of vLLM's source tree (only files that exist there)."""

    class _Upstream(dict):
        def __missing__(self, path: str) -> str:
            file = vllm_src / path
            if not file.is_file():
                raise KeyError(path)
            text = file.read_text()
            self[path] = text
            return text

        def __contains__(self, path: object) -> bool:
            return isinstance(path, str) and (
                dict.__contains__(self, path) or (vllm_src / path).is_file()
            )

    return _Upstream()


def check_vllm_source(vllm_src: Path) -> None:
    """Refuse a tree that is not vLLM's v0.33.0 source."""
    pkg_info = vllm_src / "PKG-INFO"
    if not (vllm_src / "vllm" / "envs.py").is_file():
        raise SeriesError(f"{vllm_src} is not a vLLM source tree (no vllm/envs.py)")
    if pkg_info.is_file():
        for line in pkg_info.read_text().splitlines():
            if line.startswith("Version:"):
                version = line.split(":", 1)[1].strip()
                if version != VLLM_VERSION:
                    raise SeriesError(
                        f"{vllm_src} is vLLM {version}; the series targets "
                        f"{VLLM_VERSION}"
                    )
                break


def resolve(patches: list[Patch], vllm_src: Path) -> list[dict[str, bytes]]:
    """Per patch, the full content of every file it adds or changes. Fails on
    an anchor not found exactly once, or a new file that upstream has."""
    upstream = upstream_reader(vllm_src)
    state: dict[str, str] = {}
    out = []
    for patch in patches:
        changed: dict[str, bytes] = {}
        for path, (data, _mode) in patch.files.items():
            if path in upstream:
                raise SeriesError(
                    f"{patch.slug}: {path} already exists in vLLM's tree; a new "
                    "file must not replace an upstream one"
                )
            changed[path] = data
        for path in apply_edits(state, patch.edits, upstream):
            changed[path] = state[path].encode()
        out.append(changed)
    return out


def write_series(root: Path, vllm_src: Path, out_dir: Path, work: Path) -> list[Path]:
    """Generate the series from the checkout ``root`` against ``vllm_src``
    into ``out_dir`` (its old ``*.patch`` files are removed). ``work`` is a
    scratch directory for the commits."""
    check_vllm_source(vllm_src)
    patches = build_series(root)
    contents = resolve(patches, vllm_src)

    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    _git(work, "init", "-q", "-b", "main")
    base = sorted({e.path for p in patches for e in p.edits})
    for path in base:
        target = work / path
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(vllm_src / path, target)
        # The mode is part of the patch header (vllm/envs.py is executable).
        shutil.copymode(vllm_src / path, target)
    _git(work, "add", "--", *base)
    _git(
        work,
        "commit",
        "-q",
        "--no-verify",
        "-m",
        f"vLLM v{VLLM_VERSION} (the files this series edits)",
    )
    _git(work, "tag", "base")
    for patch, changed in zip(patches, contents, strict=True):
        for path, data in changed.items():
            target = work / path
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(data)
            if path in patch.files:
                executable = patch.files[path][1] == 0o100755
                target.chmod(0o755 if executable else 0o644)
        _git(work, "add", "--", *sorted(changed))
        subprocess.run(
            ["git", "commit", "-q", "--no-verify", "-F", "-"],
            cwd=work,
            env=_git_env(),
            input=patch.message,
            text=True,
            check=True,
        )

    out_dir.mkdir(parents=True, exist_ok=True)
    for old in out_dir.glob("*.patch"):
        old.unlink()
    names = _git(
        work,
        "format-patch",
        "--zero-commit",
        "--no-signature",
        "--full-index",
        "--no-renames",
        "-o",
        str(out_dir.resolve()),
        "base..HEAD",
    ).split()
    return [Path(n) for n in names]
