# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Lazy access to the ``vllm._kimi_k3_C`` extension (torch only).

The extension is optional: a package installed without a CUDA toolkit has no
``_kimi_k3_C``, and the model then keeps the wrapper path. Importing it
lazily keeps this package importable everywhere (CPU CI, config tests).
"""

import contextlib
import functools
import importlib

import torch


@functools.cache
def extension_available() -> bool:
    """Whether ``torch.ops._kimi_k3_C`` holds our kernels."""
    try:
        importlib.import_module("vllm._kimi_k3_C")
    except ImportError:
        return False
    return hasattr(torch.ops._kimi_k3_C, "dsa_fused_prologue")


def kimi_k3_ops():
    """``torch.ops._kimi_k3_C``; raises when the extension is not built."""
    if not extension_available():
        raise RuntimeError(
            "vllm._kimi_k3_C is not available: build the package with torch "
            "and a CUDA toolkit (nvcc) present"
        )
    return torch.ops._kimi_k3_C


def _register_fakes() -> None:
    """Shape-only implementations, so torch.compile can trace through the
    ops (they mutate their arguments and return nothing)."""
    for name in ("indexer_k_norm_quant_insert", "dsa_fused_prologue"):
        qualname = f"_kimi_k3_C::{name}"
        # Already registered when the module is reloaded.
        with contextlib.suppress(RuntimeError):
            torch.library.register_fake(qualname)(lambda *args, **kwargs: None)


if extension_available():
    _register_fakes()
