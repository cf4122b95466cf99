# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The sparse MLA benchmark on the CPU: its points cover decode and prefill,
and a head count FlashMLA cannot be padded from is refused before any GPU
work. The timing needs a GPU (``tools/gpu/run.py``, suite
``sparse-mla-bench``)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

_ROOT = next(
    p
    for p in Path(__file__).resolve().parents
    if (p / "benchmarks" / "kernels").is_dir()
)
sys.path.insert(0, str(_ROOT / "benchmarks" / "kernels"))
import bench_sparse_mla as B  # noqa: E402


def test_points_cover_decode_and_prefill() -> None:
    modes = {mode for mode, _ in B.POINTS}
    assert modes == {"decode", "prefill"}
    assert B.CONTEXT % B.BLOCK == 0 and B.TOPK <= B.CONTEXT


@pytest.mark.parametrize("heads", ["0", "65"])
def test_heads_past_the_padding_are_refused(
    capsys: pytest.CaptureFixture[str], heads: str
) -> None:
    with pytest.raises(SystemExit):
        B.main(["--heads", "12", heads])
    assert f"--heads [{heads}]" in capsys.readouterr().err
