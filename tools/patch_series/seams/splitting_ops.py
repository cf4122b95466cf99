# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""In-tree edit of the ``splitting_ops`` seam: piecewise CUDA graphs split at
the Kimi K3.1 indexer op."""

from patch_series.edits import insert_after

SUBJECT = "[Model] Kimi K3.1: split piecewise CUDA graphs at its indexer op"

EDITS = (
    insert_after(
        "vllm/config/compilation.py",
        '        "vllm::sparse_attn_indexer",\n',
        '        "vllm::kimi_k3_sparse_attn_indexer",\n',
    ),
)
