# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Lazy access to the optional ``vllm._kimi_k3_C`` extension (torch only)."""

import contextlib
import functools
import importlib
import importlib.machinery
import importlib.util
import sys
from pathlib import Path

import torch

_MODULE = "vllm._kimi_k3_C"


def _load_checkout_build() -> bool:
    """Load ``vllm/_kimi_k3_C*.so`` built in place, which upstream's regular
    ``vllm`` package would hide from an editable install."""
    vllm_dir = Path(__file__).resolve().parents[4]
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = vllm_dir / f"_kimi_k3_C{suffix}"
        if not path.is_file():
            continue
        spec = importlib.util.spec_from_file_location(_MODULE, path)
        if spec is None or spec.loader is None:
            return False
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        sys.modules[_MODULE] = module
        return True
    return False


@functools.cache
def extension_available() -> bool:
    """Whether ``torch.ops._kimi_k3_C`` holds our kernels."""
    try:
        importlib.import_module(_MODULE)
    except ImportError:
        try:
            if not _load_checkout_build():
                return False
        except (ImportError, OSError):
            return False
    ops = torch.ops._kimi_k3_C
    return hasattr(ops, "dsa_fused_prologue") and hasattr(ops, "kernels_run_on")


@functools.cache
def _kernels_run_on(device_index: int) -> bool:
    return bool(torch.ops._kimi_k3_C.kernels_run_on(device_index))


def unavailable_reason() -> str | None:
    """Why our kernels cannot run in this process (None: they can)."""
    if not extension_available():
        return "vllm._kimi_k3_C not available"
    if not torch.cuda.is_available():
        return "no CUDA device"
    index = torch.cuda.current_device()
    if not _kernels_run_on(index):
        major, minor = torch.cuda.get_device_capability(index)
        return (
            f"vllm._kimi_k3_C holds no kernels for this GPU (SM{major}{minor}): "
            f"rebuild it with TORCH_CUDA_ARCH_LIST including {major}.{minor}a"
        )
    return None


def kimi_k3_ops():
    """``torch.ops._kimi_k3_C``; raises when the extension is not built."""
    if not extension_available():
        raise RuntimeError(
            "vllm._kimi_k3_C is not available: build the package with torch "
            "and a CUDA toolkit (nvcc) present"
        )
    return torch.ops._kimi_k3_C


def _register_fakes() -> None:
    """Shape-only implementations, so torch.compile can trace the ops."""
    for name in ("indexer_k_norm_quant_insert", "dsa_fused_prologue"):
        qualname = f"_kimi_k3_C::{name}"
        with contextlib.suppress(RuntimeError):
            torch.library.register_fake(qualname)(lambda *args, **kwargs: None)


if extension_available():
    _register_fakes()
