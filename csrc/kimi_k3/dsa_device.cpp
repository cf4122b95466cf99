// SPDX-License-Identifier: Apache-2.0
// SPDX-FileCopyrightText: Copyright contributors to the vLLM project
//
// Which GPUs this build of the DSA kernels runs on. The kernels are compiled
// for architecture-specific targets (sm_90a, sm_100a, sm_103a by default),
// whose machine code runs on exactly that architecture; the model asks before
// it selects them, so a GPU the build lacks serves with upstream ops instead
// of failing its first launch.
#include <c10/cuda/CUDAGuard.h>
#include <cuda_runtime.h>

#include <string>

#include "dsa_ops.h"

namespace kimi_k3 {

bool kernel_image_runs_on(const void* kernel, int64_t device) {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  TORCH_CHECK(device >= 0 && device < count, "device must be in [0, ",
              std::to_string(count), "), got ", std::to_string(device));
  const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
  cudaFuncAttributes attributes;
  const cudaError_t status = cudaFuncGetAttributes(&attributes, kernel);
  if (status != cudaSuccess) {
    // cudaErrorInvalidDeviceFunction ("no kernel image"): not sticky, but
    // cleared so that the next launch check does not report it.
    (void)cudaGetLastError();
    return false;
  }
  return true;
}

bool kernels_run_on(int64_t device) {
  return fused_prologue_runs_on(device) && indexer_k_insert_runs_on(device);
}

}  // namespace kimi_k3
