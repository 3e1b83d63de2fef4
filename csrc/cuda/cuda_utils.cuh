// Launcher-side CUDA helpers: torch dtype -> device scalar mapping and launch bookkeeping.
#pragma once

#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>

#include <memory>
#include <mutex>

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

// A value computed once per CUDA device, thread-safe: std::call_once per device, over a table
// sized by the device count when the owning (function-local static) object is first built.
template <typename T>
class PerDeviceOnce {
 public:
  PerDeviceOnce()
      : count_(c10::cuda::device_count()),
        flags_(new std::once_flag[count_ > 0 ? count_ : 1]),
        values_(new T[count_ > 0 ? count_ : 1]) {}

  // compute(device) -> T runs at most once per device (again only if it threw).
  template <typename Fn>
  const T& get(int device, Fn&& compute) {
    TORCH_CHECK(device >= 0 && device < count_, "pagedspec: CUDA device index must be in [0, ",
                count_, "), got ", device);
    std::call_once(flags_[device], [&] { values_[device] = compute(device); });
    return values_[device];
  }

 private:
  int count_;
  std::unique_ptr<std::once_flag[]> flags_;
  std::unique_ptr<T[]> values_;
};

// Device facts the launchers size their grids and shared memory by.
struct DeviceInfo {
  int sm_count;              // cudaDevAttrMultiProcessorCount
  int max_smem_optin_bytes;  // cudaDevAttrMaxSharedMemoryPerBlockOptin: dynamic + static, per block
};

inline const DeviceInfo& device_info(int device) {
  static PerDeviceOnce<DeviceInfo> cache;
  return cache.get(device, [](int d) {
    DeviceInfo info{};
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&info.sm_count, cudaDevAttrMultiProcessorCount, d));
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&info.max_smem_optin_bytes,
                                          cudaDevAttrMaxSharedMemoryPerBlockOptin, d));
    return info;
  });
}

// Number of SMs of `device`.
inline int sm_count(int device) { return device_info(device).sm_count; }

}  // namespace pagedspec
