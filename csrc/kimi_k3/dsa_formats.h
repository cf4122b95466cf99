// SPDX-License-Identifier: Apache-2.0
// SPDX-FileCopyrightText: Copyright contributors to the vLLM project
//
// The numbers the Kimi K3.1 DSA kernels fix: cache byte formats and the dims
// the kernels are compiled for. Every C++/CUDA file of the extension takes
// them from here. Their Python home is
// vllm/models/kimi_k3/common/dsa_formats.py: kFooBar here is FOO_BAR there,
// and a CPU test (tests/cache/test_dsa_formats.py) parses this header and
// checks that both sides hold the same values. Derived numbers are computed
// from the ones they depend on, never restated. Plain C++ (no CUDA headers),
// so host-only sources can include it too.
#pragma once

#include <cstdint>

namespace kimi_k3 {

// Scalar encodings (fp8 e4m3, e2m1, UE8M0).
constexpr float kFp8E4m3Max = 448.f;
// Floor of the absmax before an fp8 scale is derived.
constexpr float kFp8AmaxFloor = 1e-4f;
constexpr float kE2m1Max = 6.f;
// Values per UE8M0 scale of an MXFP4 key.
constexpr int kMxfp4BlockSize = 32;
// Exponent bias of a UE8M0 byte (the fp32 exponent field's).
constexpr int kUe8m0Bias = 127;
// E2M1 max times the smallest normal fp32 (2^-126): keeps an MXFP4 scale
// exponent normal for an all-zero block.
constexpr float kMxfp4AmaxFloor = kE2m1Max * 1.17549435082228750797e-38f;

// Indexer key cache: the fp8 key's scale word (an fp32, or four UE8M0 bytes).
constexpr int kIndexerScaleBytes = 4;

// fp8_ds_mla entry: fp8 latent codes, one fp32 scale per tile, bf16 rope.
constexpr int kDsMlaNopeDim = 512;
constexpr int kDsMlaTile = 128;
constexpr int kDsMlaNumTiles = kDsMlaNopeDim / kDsMlaTile;
constexpr int kDsMlaRopeDim = 64;
constexpr int kDsMlaScaleBytes = 4;
constexpr int kDsMlaRopeDtypeBytes = 2;
constexpr int kDsMlaScaleOffset = kDsMlaNopeDim;
constexpr int kDsMlaRopeOffset =
    kDsMlaScaleOffset + kDsMlaScaleBytes * kDsMlaNumTiles;
constexpr int kDsMlaEntryBytes =
    kDsMlaRopeOffset + kDsMlaRopeDtypeBytes * kDsMlaRopeDim;

// The dims the kernels are compiled for.
constexpr int kKernelQLoraRank = 1536;
constexpr int kKernelKvLoraRank = kDsMlaNopeDim;
constexpr int kKernelRopeDim = kDsMlaRopeDim;
constexpr int kKernelIndexHeadDim = 128;
// 16-byte vector loads of bf16 rows: row strides in multiples of 8 elements.
constexpr int kKernelRowAlignElements = 8;
// Indexer cache bytes per token at the kernels' head dim.
constexpr int kIndexerFp8EntryBytes = kKernelIndexHeadDim + kIndexerScaleBytes;
constexpr int kIndexerFp4EntryBytes =
    kKernelIndexHeadDim / 2 + kKernelIndexHeadDim / kMxfp4BlockSize;

}  // namespace kimi_k3
