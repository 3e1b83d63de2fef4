// CUDA specializations of the shared conversion traits, and 16-byte vector helpers.
// Torch-free: kernels see __half / __nv_bfloat16, launchers map at::Half / at::BFloat16 to them
// with DeviceScalar<T>.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#include "pagedspec/codec.h"

namespace pagedspec {

template <>
struct ScalarConvert<__half> {
  static __host__ __device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
  static __host__ __device__ __forceinline__ __half from_float(float x) {
    return __float2half_rn(x);
  }
};

template <>
struct ScalarConvert<__nv_bfloat16> {
  static __host__ __device__ __forceinline__ float to_float(__nv_bfloat16 x) {
    return __bfloat162float(x);
  }
  static __host__ __device__ __forceinline__ __nv_bfloat16 from_float(float x) {
    return __float2bfloat16_rn(x);
  }
};

// N elements of T, aligned so that a 16-byte (or smaller) vector moves them in one instruction.
template <typename T, int N>
struct alignas(sizeof(T) * N) Vec {
  T v[N];
};

// Elements of T in one 16-byte access.
template <typename T>
constexpr int kVec16 = 16 / sizeof(T);

}  // namespace pagedspec
