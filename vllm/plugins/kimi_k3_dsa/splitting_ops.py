# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Seam: piecewise CUDA graphs split at the Kimi K3.1 indexer op.

Upstream target: ``vllm/config/compilation.py``
``CompilationConfig._attention_ops``.

Why: like ``sparse_attn_indexer``, the op loops over prefill chunks on the
host, so it must run between piecewise graphs.

In-tree edit: ``"vllm::kimi_k3_sparse_attn_indexer"`` in ``_attention_ops``.
"""

INDEXER_OP = "vllm::kimi_k3_sparse_attn_indexer"
_UPSTREAM_INDEXER_OP = "vllm::sparse_attn_indexer"


def apply() -> None:
    from vllm.config.compilation import CompilationConfig

    ops = CompilationConfig._attention_ops
    if INDEXER_OP not in ops:
        ops.insert(ops.index(_UPSTREAM_INDEXER_OP) + 1, INDEXER_OP)
