# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Generate the upstream form of this repository: a ``git format-patch``
series against vLLM v0.33.0's source tree (see docs/upstream_series.md).

    python tools/make_patch_series.py --fetch
    python tools/make_patch_series.py --vllm-src path/to/vllm-0.33.0

writes ``build/patch_series/patches/*.patch`` (git-ignored). ``--fetch``
downloads the v0.33.0 sdist from PyPI (sha256-checked) into
``build/patch_series/`` first.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

from patch_series.fetch import DEFAULT_DIR, fetch_sdist  # noqa: E402
from patch_series.generate import write_series  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--vllm-src",
        type=Path,
        help="vLLM v0.33.0 source tree (the extracted sdist); default: the one "
        f"--fetch extracts under {DEFAULT_DIR.relative_to(ROOT)}",
    )
    parser.add_argument(
        "--fetch",
        action="store_true",
        help="download and extract the v0.33.0 sdist if it is not there yet",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=DEFAULT_DIR / "patches",
        help="output directory (its *.patch files are replaced)",
    )
    args = parser.parse_args(argv)
    vllm_src = args.vllm_src
    if vllm_src is None:
        vllm_src = (
            fetch_sdist(DEFAULT_DIR) if args.fetch else DEFAULT_DIR / "vllm-0.33.0"
        )
    if not vllm_src.is_dir():
        parser.error(f"{vllm_src} does not exist: pass --vllm-src or --fetch")
    written = write_series(ROOT, vllm_src, args.out, DEFAULT_DIR / "git")
    for path in written:
        print(path)
    print(f"{len(written)} patches against {vllm_src}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
