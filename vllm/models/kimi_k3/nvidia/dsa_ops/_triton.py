# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Triton, where installed: the Triton ops define their kernels only with it
and otherwise take their pure-torch path on every device."""

from types import ModuleType

triton: ModuleType | None
tl: ModuleType | None
try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover - triton ships with CUDA torch
    triton = tl = None
    HAS_TRITON = False
