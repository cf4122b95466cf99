// SPDX-License-Identifier: Apache-2.0
// SPDX-FileCopyrightText: Copyright contributors to the vLLM project
//
// Indexer k-norm-quant-insert: LayerNorm (fp32) -> bf16 -> fp8 e4m3 with one
// power-of-two scale per token, or MXFP4 (e2m1 + UE8M0 per 32 values) -> the
// paged indexer cache, plus the -1 fill of the top-k rows. One launch, one
// pass: a 16-lane group per token (16-byte loads), 16 tokens per block, and
// the block's 256 threads fill its top-k rows with 16-byte stores.
#include <algorithm>

#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

#include "dsa_common.cuh"
#include "dsa_formats.h"
#include "dsa_ops.h"

namespace kimi_k3 {
namespace {

constexpr int kInsertThreads = 256;
constexpr int kTokensPerBlock = kInsertThreads / 16;
// The top-k rows of a block's tokens (8 KiB each) are split over gridDim.y
// blocks, so that small batches still spread the fill over the SMs: enough
// splits for about kFillTargetBlocks blocks, between kMinFillSplit and
// kMaxFillSplit.
constexpr int kMinFillSplit = 4;
constexpr int kMaxFillSplit = 16;
constexpr int64_t kFillTargetBlocks = 256;

template <bool kFp4, typename SlotT>
__global__ void __launch_bounds__(kInsertThreads)
    indexer_k_insert_kernel(const __nv_bfloat16* __restrict__ index_k,
                            int64_t k_stride, int64_t num_rows,
                            const float* __restrict__ weight,
                            const float* __restrict__ bias, float eps,
                            const SlotT* __restrict__ slots, int64_t n_slots,
                            uint8_t* __restrict__ cache, int64_t block_stride,
                            int block_size, int64_t cache_slots,
                            bool mx_scales, int32_t* __restrict__ topk,
                            int64_t topk_stride, int topk_width,
                            int64_t n_fill, bool topk_vec) {
  const int tid = threadIdx.x;
  const int l16 = tid & 15;
  const int64_t tok0 = static_cast<int64_t>(blockIdx.x) * kTokensPerBlock;
  const int64_t tok = tok0 + (tid >> 4);
  const int64_t slot = checked_slot(slots, n_slots, tok, cache_slots);
  // Whole warps leave together (no shuffle partner is lost).
  const int64_t warp_tok0 = tok0 + 2 * (tid >> 5);
  if (blockIdx.y == 0 && warp_tok0 < n_slots) {
    index_key_insert<kFp4>(index_k + tok * k_stride, tok < num_rows, weight,
                           bias, eps, slot, true, cache, block_stride,
                           block_size, mx_scales, l16);
  }
  if (tok0 < n_fill) {
    const int64_t row1 = min(tok0 + kTokensPerBlock, n_fill);
    // Column range of this split, in multiples of 4 (16-byte stores).
    const int quads = (topk_width + 3) / 4;
    const int part = static_cast<int>(blockIdx.y);
    const int splits = static_cast<int>(gridDim.y);
    const int begin = min(topk_width, 4 * (quads * part / splits));
    const int end = min(topk_width, 4 * (quads * (part + 1) / splits));
    fill_topk(topk, topk_stride, tok0, row1, begin, end, topk_vec, tid,
              kInsertThreads);
  }
}

}  // namespace

void indexer_k_insert(const at::Tensor& index_k,
                      const at::Tensor& weight, const at::Tensor& bias,
                      double eps, const at::Tensor& slot_mapping,
                      at::Tensor& kv_cache, at::Tensor& topk,
                      int64_t num_tokens, bool fp4, bool mx_scales) {
  check_index_key(index_k, "index_k");
  check_norm_param(weight, at::kFloat, kKernelIndexHeadDim, "k_norm weight",
                   index_k);
  check_norm_param(bias, at::kFloat, kKernelIndexHeadDim, "k_norm bias",
                   index_k);
  check_slot_mapping(slot_mapping, index_k.size(0), "slot_mapping", index_k);
  check_indexer_cache(kv_cache, fp4, index_k);
  check_topk(topk, num_tokens, index_k);
  // Profiling run: the cache is not allocated yet; touch nothing.
  if (kv_cache.numel() == 0) return;
  const int64_t n_slots = slot_mapping.numel();
  const int64_t n_work = std::max(n_slots, num_tokens);
  if (n_work == 0) return;

  const c10::cuda::CUDAGuard guard(index_k.device());
  const auto stream = c10::cuda::getCurrentCUDAStream();
  const int64_t token_blocks = (n_work + kTokensPerBlock - 1) / kTokensPerBlock;
  const int64_t fill_split =
      std::clamp<int64_t>((kFillTargetBlocks + token_blocks - 1) / token_blocks,
                          kMinFillSplit, kMaxFillSplit);
  const dim3 grid(static_cast<unsigned>(token_blocks),
                  static_cast<unsigned>(fill_split));
  const int block_size = static_cast<int>(kv_cache.size(1));
  const int64_t cache_slots = kv_cache.size(0) * kv_cache.size(1);
  const bool topk_vec = topk_vectorizable(topk);

#define KIMI_K3_LAUNCH_INSERT(FP4, SLOT_T)                                    \
  indexer_k_insert_kernel<FP4, SLOT_T><<<grid, kInsertThreads, 0, stream>>>( \
      reinterpret_cast<const __nv_bfloat16*>(index_k.data_ptr()),            \
      index_k.stride(0), index_k.size(0), weight.data_ptr<float>(),          \
      bias.data_ptr<float>(), static_cast<float>(eps),                       \
      slot_mapping.data_ptr<SLOT_T>(), n_slots, kv_cache.data_ptr<uint8_t>(), \
      kv_cache.stride(0), block_size, cache_slots, mx_scales,                \
      topk.data_ptr<int32_t>(), topk.stride(0),                              \
      static_cast<int>(topk.size(1)), num_tokens, topk_vec)

  const bool i64 = slot_mapping.scalar_type() == at::kLong;
  if (fp4) {
    if (i64) KIMI_K3_LAUNCH_INSERT(true, int64_t);
    else KIMI_K3_LAUNCH_INSERT(true, int32_t);
  } else {
    if (i64) KIMI_K3_LAUNCH_INSERT(false, int64_t);
    else KIMI_K3_LAUNCH_INSERT(false, int32_t);
  }
#undef KIMI_K3_LAUNCH_INSERT
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

bool indexer_k_insert_runs_on(int64_t device) {
  return kernel_image_runs_on(
      reinterpret_cast<const void*>(&indexer_k_insert_kernel<false, int64_t>),
      device);
}

}  // namespace kimi_k3
