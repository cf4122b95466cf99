# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Seam: piecewise CUDA graphs split at the Kimi K3.1 indexer op.

Upstream target: ``vllm/config/compilation.py``
``CompilationConfig._attention_ops``.

Why: the Kimi K3.1 indexer scores through its own op,
``kimi_k3_sparse_attn_indexer`` (vLLM's ``sparse_attn_indexer`` steps with a
deterministic top-k, ``models/kimi_k3/nvidia/dsa_indexer_op.py``). Like
vLLM's op beside it in that list, it loops on the host over a step's prefill
chunks, so it must run between piecewise CUDA graphs, never inside one; full
decode graphs capture it as they capture vLLM's.

In-tree edit: ``"vllm::kimi_k3_sparse_attn_indexer"`` in ``_attention_ops``,
after ``"vllm::sparse_attn_indexer"``.
"""

INDEXER_OP = "vllm::kimi_k3_sparse_attn_indexer"
_UPSTREAM_INDEXER_OP = "vllm::sparse_attn_indexer"


def apply() -> None:
    from vllm.config.compilation import CompilationConfig

    ops = CompilationConfig._attention_ops
    if INDEXER_OP not in ops:
        ops.insert(ops.index(_UPSTREAM_INDEXER_OP) + 1, INDEXER_OP)
