// SPDX-License-Identifier: Apache-2.0
// SPDX-FileCopyrightText: Copyright contributors to the vLLM project
//
// Registers the Kimi K3.1 DSA kernels as torch.ops._kimi_k3_C.*. The python
// entry points in vllm/models/kimi_k3/nvidia/dsa_ops/ are the public interface.
#include <torch/extension.h>
#include <torch/library.h>

#include "dsa_ops.h"

TORCH_LIBRARY(_kimi_k3_C, m) {
  m.def(
      "indexer_k_norm_quant_insert(Tensor index_k, Tensor weight, "
      "Tensor bias, float eps, Tensor slot_mapping, Tensor(a!) kv_cache, "
      "Tensor(b!) topk_indices_buffer, int num_tokens, bool fp4, "
      "bool mx_scales) -> ()");
  m.def(
      "dsa_fused_prologue(Tensor q_c, Tensor kv_c, Tensor k_pe, "
      "Tensor index_k, Tensor q_a_norm_weight, Tensor kv_a_norm_weight, "
      "Tensor k_norm_weight, Tensor k_norm_bias, float eps, "
      "Tensor(a!) topk_indices_buffer, Tensor(b!)? mla_kv_cache, "
      "Tensor? mla_slot_mapping, Tensor(c!)? index_kv_cache, "
      "Tensor? index_slot_mapping, Tensor(d!) q_c_out, Tensor(e!) kv_c_out, "
      "bool fp4, bool mx_scales) -> ()");
  // Takes no tensor: one implementation for every dispatch key.
  m.def("kernels_run_on(int device) -> bool", &kimi_k3::kernels_run_on);
}

TORCH_LIBRARY_IMPL(_kimi_k3_C, CUDA, m) {
  m.impl("indexer_k_norm_quant_insert", &kimi_k3::indexer_k_insert);
  m.impl("dsa_fused_prologue", &kimi_k3::dsa_fused_prologue);
}

// `import vllm._kimi_k3_C` loads the library (and the registrations above).
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {}
