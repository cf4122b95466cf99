// SPDX-License-Identifier: Apache-2.0
// SPDX-FileCopyrightText: Copyright contributors to the vLLM project
//
// Device helpers shared by the Kimi K3.1 DSA cache writers. Every encoding
// here has a pure-torch twin in vllm/models/kimi_k3/nvidia/dsa_ops/formats.py;
// the two must stay bit-identical (the python one is the contract). Their
// numbers come from dsa_formats.h.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include <cstdint>

#include "dsa_formats.h"

namespace kimi_k3 {

// Exact ceil(log2(x)) of a positive normal float (the callers floor their
// inputs, so no subnormal reaches here). log2f on the GPU is approximate and
// would round some near-power-of-two ratios the wrong way.
__device__ __forceinline__ int ceil_log2(float x) {
  const uint32_t bits = __float_as_uint(x);
  const int e = static_cast<int>((bits >> 23) & 0xFF) - kUe8m0Bias;
  return e + ((bits & 0x7FFFFF) != 0 ? 1 : 0);
}

// Exact 2^e for e in [-126, 127], from the exponent bits.
__device__ __forceinline__ float exp2i(int e) {
  e = max(-126, min(127, e));
  return __uint_as_float(static_cast<uint32_t>(e + kUe8m0Bias) << 23);
}

// Two fp8 e4m3fn codes (round to nearest even, saturating at +-448); a in the
// low byte.
__device__ __forceinline__ uint32_t fp8x2(float a, float b) {
  return static_cast<uint32_t>(
      __nv_cvt_float2_to_fp8x2(make_float2(a, b), __NV_SATFINITE, __NV_E4M3));
}

// Eight fp8 codes of v[0..7] * inv, little-endian in a uint2.
__device__ __forceinline__ uint2 fp8x8(const float* v, float inv) {
  uint2 r;
  r.x = fp8x2(v[0] * inv, v[1] * inv) | (fp8x2(v[2] * inv, v[3] * inv) << 16);
  r.y = fp8x2(v[4] * inv, v[5] * inv) | (fp8x2(v[6] * inv, v[7] * inv) << 16);
  return r;
}

// e2m1 nibble: round to nearest even, saturating at +-6, sign in bit 3 (kept
// on a zero result). Written out so that SM90 and SM100 builds agree.
__device__ __forceinline__ uint32_t e2m1(float x) {
  const float a = fabsf(x);
  uint32_t m = (a > 0.25f) + (a >= 0.75f) + (a > 1.25f) + (a >= 1.75f) +
               (a > 2.5f) + (a >= 3.5f) + (a > 5.f);
  return m | (signbit(x) ? 8u : 0u);
}

// Four e2m1 pairs of v[0..7] * inv: even element in the low nibble.
__device__ __forceinline__ uint32_t e2m1x8(const float* v, float inv) {
  uint32_t r = 0;
#pragma unroll
  for (int i = 0; i < 8; ++i) r |= e2m1(v[i] * inv) << (4 * i);
  return r;
}

template <int kWidth>
__device__ __forceinline__ float group_sum(float v) {
#pragma unroll
  for (int o = kWidth / 2; o > 0; o >>= 1)
    v += __shfl_xor_sync(0xFFFFFFFFu, v, o);
  return v;
}

template <int kWidth>
__device__ __forceinline__ float group_max(float v) {
#pragma unroll
  for (int o = kWidth / 2; o > 0; o >>= 1)
    v = fmaxf(v, __shfl_xor_sync(0xFFFFFFFFu, v, o));
  return v;
}

// 8 bf16 (one 16-byte load) to fp32.
__device__ __forceinline__ void load_bf16x8(const __nv_bfloat16* p, float* v) {
  const uint4 raw = *reinterpret_cast<const uint4*>(p);
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = __bfloat1622float2(h[i]);
    v[2 * i] = f.x;
    v[2 * i + 1] = f.y;
  }
}

// Round v[0..7] to bf16 in place and return them packed for a 16-byte store.
__device__ __forceinline__ uint4 round_bf16x8(float* v) {
  uint4 raw;
  __nv_bfloat162* h = reinterpret_cast<__nv_bfloat162*>(&raw);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    h[i] = __floats2bfloat162_rn(v[2 * i], v[2 * i + 1]);
    const float2 f = __bfloat1622float2(h[i]);
    v[2 * i] = f.x;
    v[2 * i + 1] = f.y;
  }
  return raw;
}

__device__ __forceinline__ void load_f32x8(const float* p, float* v) {
  const float4 a = *reinterpret_cast<const float4*>(p);
  const float4 b = *reinterpret_cast<const float4*>(p + 4);
  v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w;
  v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
}

// Slot of a token, or -1 when it must not be written: padding (-1), past the
// slot mapping, or beyond the cache (the host checks the latter on request;
// the device never writes out of bounds).
template <typename SlotT>
__device__ __forceinline__ int64_t checked_slot(const SlotT* slots,
                                                int64_t n_slots, int64_t tok,
                                                int64_t cache_slots) {
  if (slots == nullptr || tok >= n_slots) return -1;
  const int64_t s = static_cast<int64_t>(slots[tok]);
  return (s >= 0 && s < cache_slots) ? s : -1;
}

// LayerNorm (fp32, weight and bias fp32) of one 128-wide indexer key held by
// a 16-lane group, 8 values a lane; the result is rounded to bf16 (the k-norm
// module's output dtype) and quantized into the indexer cache at `slot`.
// All 32 lanes must call this together (shuffles); `write` gates the stores.
template <bool kFp4>
__device__ __forceinline__ void index_key_insert(
    const __nv_bfloat16* krow, bool valid, const float* weight,
    const float* bias, float eps, int64_t slot, bool write, uint8_t* cache,
    int64_t block_stride, int block_size, bool mx_scales, int l16) {
  float v[8], w[8], b[8];
  if (valid) {
    load_bf16x8(krow + 8 * l16, v);
  } else {
#pragma unroll
    for (int i = 0; i < 8; ++i) v[i] = 0.f;
  }
  load_f32x8(weight + 8 * l16, w);
  load_f32x8(bias + 8 * l16, b);

  float s = 0.f;
#pragma unroll
  for (int i = 0; i < 8; ++i) s += v[i];
  const float mean = group_sum<16>(s) * (1.f / kKernelIndexHeadDim);
  float q = 0.f;
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    v[i] -= mean;
    q += v[i] * v[i];
  }
  const float var = group_sum<16>(q) * (1.f / kKernelIndexHeadDim);
  const float rstd = 1.f / sqrtf(var + eps);
#pragma unroll
  for (int i = 0; i < 8; ++i) v[i] = v[i] * rstd * w[i] + b[i];
  round_bf16x8(v);

  float amax = 0.f;
#pragma unroll
  for (int i = 0; i < 8; ++i) amax = fmaxf(amax, fabsf(v[i]));

  write = write && slot >= 0;
  const int64_t blk = write ? slot / block_size : 0;
  const int off = write ? static_cast<int>(slot % block_size) : 0;
  uint8_t* base = cache + blk * block_stride;

  if constexpr (!kFp4) {
    amax = group_max<16>(amax);
    const int e = ceil_log2(fmaxf(amax, kFp8AmaxFloor) / kFp8E4m3Max);
    const uint2 codes = fp8x8(v, exp2i(-e));
    if (write) {
      *reinterpret_cast<uint2*>(base + off * kKernelIndexHeadDim + 8 * l16) =
          codes;
      if (l16 == 0) {
        // SM10x readers: the UE8M0 byte in each of the word's 4 bytes.
        const uint32_t word =
            mx_scales ? static_cast<uint32_t>(e + kUe8m0Bias) * 0x01010101u
                      : __float_as_uint(exp2i(e));
        *reinterpret_cast<uint32_t*>(base + block_size * kKernelIndexHeadDim +
                                     off * kIndexerScaleBytes) = word;
      }
    }
  } else {
    amax = group_max<4>(amax);
    int e = ceil_log2(fmaxf(amax, kMxfp4AmaxFloor) * (1.f / kE2m1Max));
    e = max(-127, min(127, e));
    const uint32_t codes = e2m1x8(v, exp2i(-e));
    // Gather the four group scales (lanes 0, 4, 8, 12 of the 16) into one
    // word for a single 4-byte store.
    const uint32_t sbyte = static_cast<uint32_t>(e + kUe8m0Bias) & 0xFFu;
    uint32_t word = 0;
    constexpr int kScales = kKernelIndexHeadDim / kMxfp4BlockSize;
    static_assert(kScales == 4, "the UE8M0 bytes go out in one 4-byte store");
#pragma unroll
    for (int g = 0; g < kScales; ++g)
      word |= __shfl_sync(0xFFFFFFFFu, sbyte, 4 * g, 16) << (8 * g);
    if (write) {
      constexpr int kVals = kKernelIndexHeadDim / 2;
      *reinterpret_cast<uint32_t*>(base + off * kVals + 4 * l16) = codes;
      if (l16 == 0)
        *reinterpret_cast<uint32_t*>(base + block_size * kVals +
                                     off * kScales) = word;
    }
  }
}

// Fill elements [begin, end) of the int32 rows [row0, row1) of the top-k
// buffer with -1, `nthreads` threads from `tid`; 16-byte stores when allowed.
__device__ __forceinline__ void fill_topk(int32_t* topk, int64_t stride,
                                          int64_t row0, int64_t row1,
                                          int begin, int end, bool vec,
                                          int tid, int nthreads) {
  // A block fills a few rows: 32-bit index math (64-bit division is a long
  // emulated sequence on the GPU), 64-bit only for the row offset.
  const int rows = static_cast<int>(row1 - row0);
  if (vec) {
    const int cb = begin / 4, per_row = end / 4 - cb;
    const int total = rows * per_row;
    const int4 neg = make_int4(-1, -1, -1, -1);
    for (int i = tid; i < total; i += nthreads) {
      const int r = i / per_row;
      const int c = cb + (i - r * per_row);
      *reinterpret_cast<int4*>(topk + (row0 + r) * stride + 4 * c) = neg;
    }
  } else {
    const int per_row = end - begin;
    const int total = rows * per_row;
    for (int i = tid; i < total; i += nthreads) {
      const int r = i / per_row;
      topk[(row0 + r) * stride + begin + (i - r * per_row)] = -1;
    }
  }
}

}  // namespace kimi_k3
