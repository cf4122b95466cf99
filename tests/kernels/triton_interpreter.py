# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Triton kernels on the CPU: a script run by Triton's interpreter in a
subprocess (Triton reads ``TRITON_INTERPRET`` when the kernels are defined),
with this folder importable."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

# Triton 3.8's interpreter multiplies bf16 dot operands as their raw uint16
# bits; widen them to fp32 first (what the GPU's MMA computes).
_BF16_DOT = """
import numpy as _np
import triton.language as _tl
from triton.runtime import interpreter as _interpreter

_create_dot = _interpreter.InterpreterBuilder.create_dot


def _as_fp32(h):
    if h.dtype.scalar != _tl.bfloat16:
        return h
    return _interpreter.TensorHandle(
        (h.data.astype(_np.uint32) << 16).view(_np.float32), _tl.float32
    )


def _dot(self, a, b, d, *args):
    return _create_dot(self, _as_fp32(a), _as_fp32(b), d, *args)


_interpreter.InterpreterBuilder.create_dot = _dot
"""


def run_interpreted(script: str, timeout: int = 900) -> str:
    """Run ``script`` under the interpreter; its stdout (a failure raises)."""
    pytest.importorskip("triton")
    path = [str(Path(__file__).resolve().parent)]
    if os.environ.get("PYTHONPATH"):
        path.append(os.environ["PYTHONPATH"])
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join(path)}
    result = subprocess.run(
        [sys.executable, "-c", _BF16_DOT + textwrap.dedent(script)],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return result.stdout
