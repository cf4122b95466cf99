// SPDX-License-Identifier: Apache-2.0
// SPDX-FileCopyrightText: Copyright contributors to the vLLM project
//
// Host entry points of the Kimi K3.1 DSA kernels and their input checks.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <optional>

namespace kimi_k3 {

void indexer_k_insert(const at::Tensor& index_k,
                      const at::Tensor& weight, const at::Tensor& bias,
                      double eps, const at::Tensor& slot_mapping,
                      at::Tensor& kv_cache, at::Tensor& topk,
                      int64_t num_tokens, bool fp4, bool mx_scales);

void dsa_fused_prologue(
    const at::Tensor& q_c, const at::Tensor& kv_c,
    const at::Tensor& k_pe, const at::Tensor& index_k,
    const at::Tensor& q_norm_weight, const at::Tensor& kv_norm_weight,
    const at::Tensor& k_norm_weight, const at::Tensor& k_norm_bias,
    double eps, at::Tensor& topk,
    const std::optional<at::Tensor>& mla_cache,
    const std::optional<at::Tensor>& mla_slot_mapping,
    const std::optional<at::Tensor>& index_cache,
    const std::optional<at::Tensor>& index_slot_mapping,
    at::Tensor& q_c_out, at::Tensor& kv_c_out, bool fp4, bool mx_scales);

// Whether this build holds machine code that `device` can run: a build whose
// TORCH_CUDA_ARCH_LIST lacks the GPU's architecture fails every launch there
// ("no kernel image"), so the model must not select these kernels.
bool kernel_image_runs_on(const void* kernel, int64_t device);
bool fused_prologue_runs_on(int64_t device);
bool indexer_k_insert_runs_on(int64_t device);
bool kernels_run_on(int64_t device);

// Input checks (dsa_checks.cpp). Each raises with the argument's name.
void check_bf16_rows(const at::Tensor& t, int64_t width, const char* name,
                     const at::Tensor& like);
void check_index_key(const at::Tensor& t, const char* name);
void check_norm_param(const at::Tensor& t, at::ScalarType dtype,
                      int64_t numel, const char* name,
                      const at::Tensor& like);
void check_slot_mapping(const at::Tensor& t, int64_t max_tokens,
                        const char* name, const at::Tensor& like);
void check_indexer_cache(const at::Tensor& t, bool fp4,
                         const at::Tensor& like);
void check_mla_cache(const at::Tensor& t, const at::Tensor& like);
void check_topk(const at::Tensor& t, int64_t rows,
                const at::Tensor& like);
bool topk_vectorizable(const at::Tensor& t);

}  // namespace kimi_k3
