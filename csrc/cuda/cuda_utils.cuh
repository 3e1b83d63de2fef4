// Launcher-side CUDA helpers: torch dtype -> device scalar mapping and launch bookkeeping.
#pragma once

#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>

#include "pagedspec/cuda_types.cuh"

namespace pagedspec {

// at::Half -> __half, at::BFloat16 -> __nv_bfloat16, anything else unchanged.
template <typename T>
struct DeviceScalar {
  using type = T;
};
template <>
struct DeviceScalar<at::Half> {
  using type = __half;
};
template <>
struct DeviceScalar<at::BFloat16> {
  using type = __nv_bfloat16;
};
template <typename T>
using device_t = typename DeviceScalar<T>::type;

// Whether a pointer allows `bytes`-wide vector accesses (tensors with a storage offset may not).
inline bool is_aligned(const void* ptr, int64_t bytes) {
  return reinterpret_cast<uintptr_t>(ptr) % bytes == 0;
}

inline int ceil_div(int64_t a, int64_t b) { return static_cast<int>((a + b - 1) / b); }

// Number of SMs of the current device (cached per device; no synchronization).
inline int sm_count(int device) {
  static int counts[64] = {0};
  if (device < 64 && counts[device] > 0) return counts[device];
  int n = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device));
  if (device < 64) counts[device] = n;
  return n;
}

}  // namespace pagedspec
