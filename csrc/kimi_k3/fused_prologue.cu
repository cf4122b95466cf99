// SPDX-License-Identifier: Apache-2.0
// SPDX-FileCopyrightText: Copyright contributors to the vLLM project
//
// DSA fused prologue: from the four column slices of the packed
// [q_a | kv_a | k_pe | wk | weights] GEMM output, in one launch and one pass:
//   warp 0: q_c RMSNorm -> bf16 q_c_out;
//   warp 1: kv_c RMSNorm -> bf16 kv_c_out and the fp8_ds_mla entry (normed
//           kv_c as 4 tiles of 128 fp8 with power-of-two fp32 scales, then
//           k_pe as 64 bf16);
//   warp 2: index_k LayerNorm -> fp8 (or MXFP4) indexer entry;
//   warps 1-3: the -1 fill of the token's top-k row (16-byte stores).
// One 128-thread block per token; no block-wide synchronization.
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

#include "dsa_common.cuh"
#include "dsa_formats.h"
#include "dsa_ops.h"

namespace kimi_k3 {
namespace {

constexpr int kPrologueThreads = 128;

struct PrologueArgs {
  const __nv_bfloat16* q_c;
  int64_t q_stride;
  const __nv_bfloat16* kv_c;
  int64_t kv_stride;
  const __nv_bfloat16* k_pe;
  int64_t pe_stride;
  const __nv_bfloat16* index_k;
  int64_t ik_stride;
  const __nv_bfloat16* q_w;
  const __nv_bfloat16* kv_w;
  const float* k_w;
  const float* k_b;
  float eps;
  __nv_bfloat16* q_out;
  __nv_bfloat16* kv_out;
  // fp8_ds_mla cache (nullptr: profiling run).
  uint8_t* mla_cache;
  int64_t mla_block_stride;
  int64_t mla_entry_stride;
  int mla_block_size;
  int64_t mla_cache_slots;
  const void* mla_slots;
  int64_t n_mla_slots;
  // Indexer cache (nullptr: profiling run).
  uint8_t* idx_cache;
  int64_t idx_block_stride;
  int idx_block_size;
  int64_t idx_cache_slots;
  const void* idx_slots;
  int64_t n_idx_slots;
  bool mx_scales;
  int32_t* topk;  // nullptr: no fill
  int64_t topk_stride;
  int topk_width;
  bool topk_vec;
};

// Weights are loaded raw before the reduction so that their latency overlaps
// the inputs' (after the reduction they would be a second dependent load).
__device__ __forceinline__ void rms_chunk_out(float* v, const uint4& w_raw,
                                              float r, __nv_bfloat16* out) {
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&w_raw);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 wf = __bfloat1622float2(h[i]);
    v[2 * i] = v[2 * i] * r * wf.x;
    v[2 * i + 1] = v[2 * i + 1] * r * wf.y;
  }
  *reinterpret_cast<uint4*>(out) = round_bf16x8(v);
}

__device__ __forceinline__ uint4 load_raw16(const __nv_bfloat16* p) {
  return *reinterpret_cast<const uint4*>(p);
}

__device__ __forceinline__ void q_norm(const PrologueArgs& a, int64_t t,
                                       int lane) {
  constexpr int kChunks = kKernelQLoraRank / 8 / 32;  // 6 per lane
  float v[kChunks][8];
  uint4 w[kChunks];
#pragma unroll
  for (int i = 0; i < kChunks; ++i) {
    load_bf16x8(a.q_c + t * a.q_stride + 8 * (lane + 32 * i), v[i]);
    w[i] = load_raw16(a.q_w + 8 * (lane + 32 * i));
  }
  float ss = 0.f;
#pragma unroll
  for (int i = 0; i < kChunks; ++i) {
#pragma unroll
    for (int j = 0; j < 8; ++j) ss += v[i][j] * v[i][j];
  }
  const float r = 1.f / sqrtf(group_sum<32>(ss) / kKernelQLoraRank + a.eps);
#pragma unroll
  for (int i = 0; i < kChunks; ++i) {
    const int c = lane + 32 * i;
    rms_chunk_out(v[i], w[i], r, a.q_out + t * kKernelQLoraRank + 8 * c);
  }
}

template <typename SlotT>
__device__ __forceinline__ void kv_norm_mla_insert(const PrologueArgs& a,
                                                   int64_t t, int lane) {
  float v0[8], v1[8];
  const int c0 = lane, c1 = lane + 32;  // chunk c holds values 8c..8c+7
  load_bf16x8(a.kv_c + t * a.kv_stride + 8 * c0, v0);
  load_bf16x8(a.kv_c + t * a.kv_stride + 8 * c1, v1);
  const uint4 w0 = load_raw16(a.kv_w + 8 * c0);
  const uint4 w1 = load_raw16(a.kv_w + 8 * c1);
  // The slot and k_pe too: read after the norm they would delay the stores.
  const int64_t slot =
      a.mla_cache == nullptr
          ? -1
          : checked_slot(static_cast<const SlotT*>(a.mla_slots), a.n_mla_slots,
                         t, a.mla_cache_slots);
  const bool pe_lane = lane < kKernelRopeDim / 8;
  const uint4 pe = a.mla_cache != nullptr && pe_lane
                       ? load_raw16(a.k_pe + t * a.pe_stride + 8 * lane)
                       : make_uint4(0, 0, 0, 0);
  float ss = 0.f;
#pragma unroll
  for (int j = 0; j < 8; ++j) ss += v0[j] * v0[j] + v1[j] * v1[j];
  const float r = 1.f / sqrtf(group_sum<32>(ss) / kKernelKvLoraRank + a.eps);
  rms_chunk_out(v0, w0, r, a.kv_out + t * kKernelKvLoraRank + 8 * c0);
  rms_chunk_out(v1, w1, r, a.kv_out + t * kKernelKvLoraRank + 8 * c1);
  if (slot < 0) return;  // uniform over the warp (also: no cache)

  // Tiles of 128 values = 16 chunks: lanes 0-15 own tiles 0 and 2, lanes
  // 16-31 tiles 1 and 3.
  float m0 = 0.f, m1 = 0.f;
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    m0 = fmaxf(m0, fabsf(v0[j]));
    m1 = fmaxf(m1, fabsf(v1[j]));
  }
  m0 = group_max<16>(m0);
  m1 = group_max<16>(m1);
  const int e0 = ceil_log2(fmaxf(m0 * (1.f / kFp8E4m3Max), kFp8AmaxFloor));
  const int e1 = ceil_log2(fmaxf(m1 * (1.f / kFp8E4m3Max), kFp8AmaxFloor));
  uint8_t* entry = a.mla_cache + (slot / a.mla_block_size) * a.mla_block_stride +
                   (slot % a.mla_block_size) * a.mla_entry_stride;
  *reinterpret_cast<uint2*>(entry + 8 * c0) = fp8x8(v0, exp2i(-e0));
  *reinterpret_cast<uint2*>(entry + 8 * c1) = fp8x8(v1, exp2i(-e1));
  const float s1 = __shfl_sync(0xFFFFFFFFu, exp2i(e0), 16);
  const float s3 = __shfl_sync(0xFFFFFFFFu, exp2i(e1), 16);
  static_assert(kDsMlaNumTiles == 4, "the tile scales go out as one float4");
  if (lane == 0) {
    *reinterpret_cast<float4*>(entry + kDsMlaScaleOffset) =
        make_float4(exp2i(e0), s1, exp2i(e1), s3);
  }
  if (pe_lane) {
    *reinterpret_cast<uint4*>(entry + kDsMlaRopeOffset + 16 * lane) = pe;
  }
}

template <bool kFp4, typename SlotT>
__global__ void __launch_bounds__(kPrologueThreads)
    dsa_prologue_kernel(const PrologueArgs a) {
  const int64_t t = blockIdx.x;
  const int warp = threadIdx.x >> 5;
  const int lane = threadIdx.x & 31;
  if (warp == 0) {
    q_norm(a, t, lane);
    return;
  }
  if (warp == 1) {
    kv_norm_mla_insert<SlotT>(a, t, lane);
  } else if (warp == 2 && a.idx_cache != nullptr) {
    // Both 16-lane halves compute the token; only the first one writes.
    const int64_t slot =
        checked_slot(static_cast<const SlotT*>(a.idx_slots), a.n_idx_slots, t,
                     a.idx_cache_slots);
    index_key_insert<kFp4>(a.index_k + t * a.ik_stride, true, a.k_w, a.k_b,
                           a.eps, slot, lane < 16, a.idx_cache,
                           a.idx_block_stride, a.idx_block_size, a.mx_scales,
                           lane & 15);
  }
  if (a.topk == nullptr) return;
  // Warp 3 fills the first half of the row, warps 1 and 2 a quarter each.
  const int w = a.topk_width;
  const int half = (w / 8) * 4, three_q = (3 * w / 16) * 4;
  const int begin = warp == 3 ? 0 : (warp == 1 ? half : three_q);
  const int end = warp == 3 ? half : (warp == 1 ? three_q : w);
  fill_topk(a.topk, a.topk_stride, t, t + 1, begin, end, a.topk_vec, lane, 32);
}

}  // namespace

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
    at::Tensor& q_c_out, at::Tensor& kv_c_out, bool fp4,
    bool mx_scales) {
  check_bf16_rows(q_c, kKernelQLoraRank, "q_c", q_c);
  const int64_t T = q_c.size(0);
  check_bf16_rows(kv_c, kKernelKvLoraRank, "kv_c", q_c);
  check_bf16_rows(k_pe, kKernelRopeDim, "k_pe", q_c);
  check_bf16_rows(index_k, kKernelIndexHeadDim, "index_k", q_c);
  TORCH_CHECK(kv_c.size(0) == T && k_pe.size(0) == T && index_k.size(0) == T,
              "q_c, kv_c, k_pe and index_k must have the same number of rows");
  check_norm_param(q_norm_weight, at::kBFloat16, kKernelQLoraRank,
                   "q_a_norm weight", q_c);
  check_norm_param(kv_norm_weight, at::kBFloat16, kKernelKvLoraRank,
                   "kv_a_norm weight", q_c);
  check_norm_param(k_norm_weight, at::kFloat, kKernelIndexHeadDim,
                   "k_norm weight", q_c);
  check_norm_param(k_norm_bias, at::kFloat, kKernelIndexHeadDim, "k_norm bias",
                   q_c);
  check_bf16_rows(q_c_out, kKernelQLoraRank, "q_c_out", q_c);
  check_bf16_rows(kv_c_out, kKernelKvLoraRank, "kv_c_out", q_c);
  TORCH_CHECK(q_c_out.is_contiguous() && kv_c_out.is_contiguous() &&
                  q_c_out.size(0) == T && kv_c_out.size(0) == T,
              "q_c_out and kv_c_out must be contiguous [T, dim]");
  const int given = mla_cache.has_value() + mla_slot_mapping.has_value() +
                    index_cache.has_value() + index_slot_mapping.has_value();
  TORCH_CHECK(given == 0 || given == 4,
              "pass all four of mla_kv_cache, mla_slot_mapping, "
              "index_kv_cache, index_slot_mapping, or none of them");
  bool write = given == 4;
  if (write) {
    check_mla_cache(*mla_cache, q_c);
    check_slot_mapping(*mla_slot_mapping, T, "mla_slot_mapping", q_c);
    check_indexer_cache(*index_cache, fp4, q_c);
    check_slot_mapping(*index_slot_mapping, T, "index_slot_mapping", q_c);
    TORCH_CHECK(mla_slot_mapping->scalar_type() ==
                    index_slot_mapping->scalar_type(),
                "the two slot mappings must have the same dtype");
    check_topk(topk, T, q_c);
    // A cache not yet allocated (profiling run) leaves everything alone.
    write = mla_cache->numel() > 0 && index_cache->numel() > 0;
  }
  if (T == 0) return;

  PrologueArgs a{};
  a.q_c = reinterpret_cast<const __nv_bfloat16*>(q_c.data_ptr());
  a.q_stride = q_c.stride(0);
  a.kv_c = reinterpret_cast<const __nv_bfloat16*>(kv_c.data_ptr());
  a.kv_stride = kv_c.stride(0);
  a.k_pe = reinterpret_cast<const __nv_bfloat16*>(k_pe.data_ptr());
  a.pe_stride = k_pe.stride(0);
  a.index_k = reinterpret_cast<const __nv_bfloat16*>(index_k.data_ptr());
  a.ik_stride = index_k.stride(0);
  a.q_w = reinterpret_cast<const __nv_bfloat16*>(q_norm_weight.data_ptr());
  a.kv_w = reinterpret_cast<const __nv_bfloat16*>(kv_norm_weight.data_ptr());
  a.k_w = k_norm_weight.data_ptr<float>();
  a.k_b = k_norm_bias.data_ptr<float>();
  a.eps = static_cast<float>(eps);
  a.q_out = reinterpret_cast<__nv_bfloat16*>(q_c_out.data_ptr());
  a.kv_out = reinterpret_cast<__nv_bfloat16*>(kv_c_out.data_ptr());
  a.mx_scales = mx_scales;
  bool slots_i64 = true;
  if (write) {
    const auto& mc = *mla_cache;
    a.mla_cache = mc.data_ptr<uint8_t>();
    a.mla_block_stride = mc.stride(0);
    a.mla_entry_stride = mc.stride(1);
    a.mla_block_size = static_cast<int>(mc.size(1));
    a.mla_cache_slots = mc.size(0) * mc.size(1);
    a.mla_slots = mla_slot_mapping->data_ptr();
    a.n_mla_slots = mla_slot_mapping->numel();
    const auto& ic = *index_cache;
    a.idx_cache = ic.data_ptr<uint8_t>();
    a.idx_block_stride = ic.stride(0);
    a.idx_block_size = static_cast<int>(ic.size(1));
    a.idx_cache_slots = ic.size(0) * ic.size(1);
    a.idx_slots = index_slot_mapping->data_ptr();
    a.n_idx_slots = index_slot_mapping->numel();
    a.topk = topk.data_ptr<int32_t>();
    a.topk_stride = topk.stride(0);
    a.topk_width = static_cast<int>(topk.size(1));
    a.topk_vec = topk_vectorizable(topk);
    slots_i64 = mla_slot_mapping->scalar_type() == at::kLong;
  }

  const c10::cuda::CUDAGuard guard(q_c.device());
  const auto stream = c10::cuda::getCurrentCUDAStream();
  const dim3 grid(static_cast<unsigned>(T));
  if (fp4) {
    if (slots_i64)
      dsa_prologue_kernel<true, int64_t><<<grid, kPrologueThreads, 0, stream>>>(a);
    else
      dsa_prologue_kernel<true, int32_t><<<grid, kPrologueThreads, 0, stream>>>(a);
  } else {
    if (slots_i64)
      dsa_prologue_kernel<false, int64_t><<<grid, kPrologueThreads, 0, stream>>>(a);
    else
      dsa_prologue_kernel<false, int32_t><<<grid, kPrologueThreads, 0, stream>>>(a);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

bool fused_prologue_runs_on(int64_t device) {
  return kernel_image_runs_on(
      reinterpret_cast<const void*>(&dsa_prologue_kernel<false, int64_t>),
      device);
}

}  // namespace kimi_k3
