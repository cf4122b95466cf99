# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Kimi K3.1 DSA kernels: python entry points and their pure-torch references.

This layer imports torch, triton, ``vllm._kimi_k3_C`` and
``common/dsa_formats.py`` only, so the GPU tests run without vLLM installed.
Ops load on first access. Named ``dsa_ops`` because Kimi K3 already owns
``nvidia/ops/``.
"""

import importlib
from typing import TYPE_CHECKING, Any

_OPS = {
    "dsa_fused_prologue": "fused_prologue",
    "mxfp4_fused_prologue": "fused_prologue",
    "indexer_k_norm_quant_insert": "indexer_k_insert",
    "mxfp4_k_norm_quant_insert": "indexer_k_insert",
    "indexer_q_quant_fold_weights": "indexer_q_quant",
    "mxfp4_q_quant": "indexer_q_quant",
}

__all__ = [
    "dsa_fused_prologue",
    "indexer_k_norm_quant_insert",
    "indexer_q_quant_fold_weights",
    "mxfp4_fused_prologue",
    "mxfp4_k_norm_quant_insert",
    "mxfp4_q_quant",
]

if TYPE_CHECKING:
    from vllm.models.kimi_k3.nvidia.dsa_ops.fused_prologue import (
        dsa_fused_prologue,
        mxfp4_fused_prologue,
    )
    from vllm.models.kimi_k3.nvidia.dsa_ops.indexer_k_insert import (
        indexer_k_norm_quant_insert,
        mxfp4_k_norm_quant_insert,
    )
    from vllm.models.kimi_k3.nvidia.dsa_ops.indexer_q_quant import (
        indexer_q_quant_fold_weights,
        mxfp4_q_quant,
    )


def __getattr__(name: str) -> Any:
    module = _OPS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
