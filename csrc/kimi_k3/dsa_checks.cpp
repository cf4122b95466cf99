// SPDX-License-Identifier: Apache-2.0
// SPDX-FileCopyrightText: Copyright contributors to the vLLM project
//
// Input checks of the DSA kernels: they raise instead of letting a kernel
// read or write through a wrong dtype, device, shape or alignment. Vector
// (16-byte) accesses need 16-byte aligned rows; the packed GEMM output of the
// fused forward satisfies this for every slice.
#include <cstdint>
#include <string>

#include "dsa_formats.h"
#include "dsa_ops.h"

namespace kimi_k3 {
namespace {

// Numbers go into messages as std::string: streaming integers through
// TORCH_CHECK's std::ostream crashes when built with a GCC newer than torch's.
std::string num(int64_t v) { return std::to_string(v); }

std::string shape(const at::Tensor& t) {
  std::string s = "[";
  for (int64_t i = 0; i < t.dim(); ++i) {
    s += (i ? ", " : "") + std::to_string(t.size(i));
  }
  return s + "]";
}

bool aligned16(const at::Tensor& t) {
  return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0;
}

void check_same_device(const at::Tensor& t, const char* name,
                       const at::Tensor& like) {
  TORCH_CHECK(t.is_cuda(), name, " must be a CUDA tensor");
  TORCH_CHECK(t.device() == like.device(), name, " is on ", t.device().str(),
              " but the inputs are on ", like.device().str());
}

}  // namespace

void check_bf16_rows(const at::Tensor& t, int64_t width, const char* name,
                     const at::Tensor& like) {
  check_same_device(t, name, like);
  TORCH_CHECK(t.scalar_type() == at::kBFloat16, name, " must be bfloat16, got ",
              t.scalar_type());
  TORCH_CHECK(t.dim() == 2 && t.size(1) == width, name, " must be [T, ", num(width),
              "], got ", shape(t));
  TORCH_CHECK(t.stride(1) == 1, name, " must be contiguous in its last dim");
  TORCH_CHECK(t.size(0) <= 1 || t.stride(0) % kKernelRowAlignElements == 0,
              name, ": the row stride must be a multiple of ",
              num(kKernelRowAlignElements), " elements (16 bytes)");
  TORCH_CHECK(aligned16(t), name, " must be 16-byte aligned");
}

void check_index_key(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.is_cuda(), name, " must be a CUDA tensor");
  check_bf16_rows(t, kKernelIndexHeadDim, name, t);
}

void check_norm_param(const at::Tensor& t, at::ScalarType dtype,
                      int64_t numel, const char* name,
                      const at::Tensor& like) {
  check_same_device(t, name, like);
  TORCH_CHECK(t.scalar_type() == dtype, name, " must be ", dtype, ", got ",
              t.scalar_type());
  TORCH_CHECK(t.numel() == numel && t.is_contiguous(), name,
              " must be contiguous with ", num(numel), " elements");
  TORCH_CHECK(aligned16(t), name, " must be 16-byte aligned");
}

void check_slot_mapping(const at::Tensor& t, int64_t max_tokens,
                        const char* name, const at::Tensor& like) {
  check_same_device(t, name, like);
  TORCH_CHECK(t.scalar_type() == at::kLong || t.scalar_type() == at::kInt,
              name, " must be int64 or int32, got ", t.scalar_type());
  TORCH_CHECK(t.dim() == 1 && t.is_contiguous(), name,
              " must be a contiguous 1-D tensor");
  TORCH_CHECK(t.numel() <= max_tokens, name, " has ", num(t.numel()),
              " slots for ", num(max_tokens), " tokens");
}

void check_indexer_cache(const at::Tensor& t, bool fp4,
                         const at::Tensor& like) {
  check_same_device(t, "index kv_cache", like);
  const int64_t entry = fp4 ? kIndexerFp4EntryBytes : kIndexerFp8EntryBytes;
  TORCH_CHECK(t.scalar_type() == at::kByte,
              "index kv_cache must be uint8, got ", t.scalar_type());
  TORCH_CHECK(t.dim() == 3 && t.size(2) == entry,
              "index kv_cache must be [num_blocks, block_size, ", num(entry),
              "], got ", shape(t));
  if (t.numel() == 0) return;
  TORCH_CHECK(t.stride(2) == 1 && t.stride(1) == entry,
              "index kv_cache: tokens of a block must be contiguous");
  TORCH_CHECK(t.size(0) == 1 || t.stride(0) >= t.size(1) * entry,
              "index kv_cache: blocks overlap");
  TORCH_CHECK(t.stride(0) % 16 == 0 && aligned16(t),
              "index kv_cache: blocks must be 16-byte aligned");
}

void check_mla_cache(const at::Tensor& t, const at::Tensor& like) {
  check_same_device(t, "mla kv_cache", like);
  TORCH_CHECK(t.scalar_type() == at::kByte, "mla kv_cache must be uint8, got ",
              t.scalar_type());
  TORCH_CHECK(t.dim() == 3 && t.size(2) == kDsMlaEntryBytes,
              "mla kv_cache must be [num_blocks, block_size, ",
              num(kDsMlaEntryBytes), "] (fp8_ds_mla), got ", shape(t));
  if (t.numel() == 0) return;
  TORCH_CHECK(t.stride(2) == 1, "mla kv_cache: entries must be contiguous");
  TORCH_CHECK(t.stride(1) >= kDsMlaEntryBytes && t.stride(1) % 16 == 0 &&
                  t.stride(0) % 16 == 0 && aligned16(t),
              "mla kv_cache: entries must be 16-byte aligned and disjoint");
  TORCH_CHECK(t.size(0) == 1 || t.stride(0) >= t.size(1) * t.stride(1),
              "mla kv_cache: blocks overlap");
}

void check_topk(const at::Tensor& t, int64_t rows,
                const at::Tensor& like) {
  check_same_device(t, "topk_indices_buffer", like);
  TORCH_CHECK(t.scalar_type() == at::kInt,
              "topk_indices_buffer must be int32, got ", t.scalar_type());
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1,
              "topk_indices_buffer must be 2-D, contiguous in its last dim");
  TORCH_CHECK(rows >= 0 && rows <= t.size(0), "cannot fill ", num(rows),
              " top-k rows of a buffer with ", num(t.size(0)));
}

bool topk_vectorizable(const at::Tensor& t) {
  return aligned16(t) && t.size(1) % 4 == 0 &&
         (t.size(0) <= 1 || t.stride(0) % 4 == 0);
}

}  // namespace kimi_k3
