# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Kimi K3.1 DSA kernels: python entry points and their pure-torch references.

One module per kernel holds its entry point (``fused_prologue``,
``indexer_k_insert``, ``indexer_q_quant``, ``index_rope``) and takes its
pure-torch path (``torch_path``) off CUDA; ``reference`` holds the
references, the entry points on that path on every device, which define the
kernels' exact semantics, byte for byte. This layer imports torch (and
triton), the ``vllm._kimi_k3_C`` extension and the standard-library module of
the kernels' numbers (``common/dsa_formats.py``) only, never upstream vLLM,
so the GPU tests run on a machine where vLLM is not installed.

The public ops, by the names the DSA layers call them (``nvidia/dsa.py``),
one per key format: :func:`dsa_fused_prologue` / :func:`mxfp4_fused_prologue`,
:func:`indexer_k_norm_quant_insert` / :func:`mxfp4_k_norm_quant_insert`,
:func:`indexer_q_quant_fold_weights` / :func:`mxfp4_q_quant`. Each pair is one
kernel, whose entry point takes the format as ``fp4=``. They are loaded on
first access, so importing this package (for ``formats``) does not load the
kernels' modules.

It is ``nvidia/dsa_ops`` rather than ``nvidia/ops`` because vLLM
0.33.0 already owns ``vllm/models/kimi_k3/nvidia/ops/`` (``attn_res``): an
``__init__.py`` of ours there would replace upstream's on install, and under an
editable install upstream's package would hide our modules.
"""

import importlib
from typing import TYPE_CHECKING, Any

# Public op -> the module of its entry point.
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
