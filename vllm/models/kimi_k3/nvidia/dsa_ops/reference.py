# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Pure-torch references of the DSA kernels: the entry points on their
pure-torch path on every device, which the GPU tests compare the kernels with,
byte for byte. Pass ``mx_scales`` explicitly to compare one format.
"""

from vllm.models.kimi_k3.nvidia.dsa_ops.canonical_topk import (
    canonical_topk as _canonical_topk,
)
from vllm.models.kimi_k3.nvidia.dsa_ops.fused_prologue import dsa_fused_prologue
from vllm.models.kimi_k3.nvidia.dsa_ops.index_rope import index_rope as _index_rope
from vllm.models.kimi_k3.nvidia.dsa_ops.indexer_k_insert import (
    indexer_k_norm_quant_insert,
)
from vllm.models.kimi_k3.nvidia.dsa_ops.indexer_q_quant import (
    indexer_q_quant as _indexer_q_quant,
)
from vllm.models.kimi_k3.nvidia.dsa_ops.torch_path import (
    k_norm,
    pad_heads,
    quantize_query,
    rms_norm,
    rope_cos_sin,
    rotate_,
    run_on_every_device,
    write_indexer_entries,
    write_mla_entries,
)

__all__ = [
    "canonical_topk",
    "fused_prologue",
    "index_rope",
    "indexer_k_insert",
    "indexer_q_quant",
    "k_norm",
    "pad_heads",
    "quantize_query",
    "rms_norm",
    "rope_cos_sin",
    "rotate_",
    "write_indexer_entries",
    "write_mla_entries",
]

fused_prologue = run_on_every_device(dsa_fused_prologue, "fused_prologue")
indexer_k_insert = run_on_every_device(indexer_k_norm_quant_insert, "indexer_k_insert")
indexer_q_quant = run_on_every_device(_indexer_q_quant, "indexer_q_quant")
index_rope = run_on_every_device(_index_rope, "index_rope")
canonical_topk = run_on_every_device(_canonical_topk, "canonical_topk")
