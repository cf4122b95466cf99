# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Download vLLM v0.33.0's sdist from PyPI (pinned URL, sha256-checked) and
extract it: the tree the series applies to."""

from __future__ import annotations

import hashlib
import subprocess
import tarfile
from pathlib import Path

from patch_series.series import SDIST_SHA256, SDIST_URL, VLLM_VERSION

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_DIR = ROOT / "build" / "patch_series"


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def fetch_sdist(dest: Path, tarball: Path | None = None) -> Path:
    """The extracted ``vllm-0.33.0/`` under ``dest``, downloading the sdist
    with curl unless ``tarball`` (or an earlier download) is there. A
    checksum mismatch is an error, never a silent re-download."""
    tree = dest / f"vllm-{VLLM_VERSION}"
    if (tree / "PKG-INFO").is_file():
        return tree
    dest.mkdir(parents=True, exist_ok=True)
    if tarball is None:
        tarball = dest / f"vllm-{VLLM_VERSION}.tar.gz"
        if not tarball.is_file():
            partial = tarball.with_suffix(".part")
            subprocess.run(
                ["curl", "-fsSL", "--retry", "3", "-o", str(partial), SDIST_URL],
                check=True,
            )
            partial.rename(tarball)
    got = sha256_of(tarball)
    if got != SDIST_SHA256:
        raise RuntimeError(
            f"{tarball}: sha256 {got}, expected {SDIST_SHA256} (vLLM "
            f"{VLLM_VERSION}'s sdist on PyPI)"
        )
    with tarfile.open(tarball) as tar:
        tar.extractall(dest, filter="data")
    if not (tree / "PKG-INFO").is_file():
        raise RuntimeError(f"{tarball} did not extract to {tree}")
    return tree
