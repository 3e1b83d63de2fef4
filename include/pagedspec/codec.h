// Element conversion between activation dtypes and the cache's storage format.
//
// ScalarConvert<T> turns a storage scalar to and from float. It is specialized for float here,
// for CUDA's __half / __nv_bfloat16 in cuda_types.cuh, and for c10::Half / c10::BFloat16 in the
// CPU kernels (those are torch types, so they stay out of this torch-free header).
// CacheCodec<CacheT, F> is how a kernel reads or writes one cache element: natively, or as FP8 with
// a scale. Attention, reshape_and_cache and quantize/dequantize all go through it.
#pragma once

#include <stdint.h>

#include "pagedspec/cache_format.h"
#include "pagedspec/fp8.h"
#include "pagedspec/macros.h"

namespace pagedspec {

template <typename T>
struct ScalarConvert;

template <>
struct ScalarConvert<float> {
  static PS_HOST_DEVICE float to_float(float x) { return x; }
  static PS_HOST_DEVICE float from_float(float x) { return x; }
};

template <typename CacheT, CacheFormat F>
struct CacheCodec {
  // Native: scale is ignored, as the contract says for non-FP8 caches.
  static PS_HOST_DEVICE CacheT encode(float x, float /*scale*/) {
    return ScalarConvert<CacheT>::from_float(x);
  }
  static PS_HOST_DEVICE float decode(CacheT c, float /*scale*/) {
    return ScalarConvert<CacheT>::to_float(c);
  }
};

template <>
struct CacheCodec<uint8_t, CacheFormat::kE4M3> {
  static PS_HOST_DEVICE uint8_t encode(float x, float scale) {
    return quantize_fp8_value<CacheFormat::kE4M3>(x, scale);
  }
  static PS_HOST_DEVICE float decode(uint8_t c, float scale) {
    return dequantize_fp8_value<CacheFormat::kE4M3>(c, scale);
  }
};

template <>
struct CacheCodec<uint8_t, CacheFormat::kE5M2> {
  static PS_HOST_DEVICE uint8_t encode(float x, float scale) {
    return quantize_fp8_value<CacheFormat::kE5M2>(x, scale);
  }
  static PS_HOST_DEVICE float decode(uint8_t c, float scale) {
    return dequantize_fp8_value<CacheFormat::kE5M2>(c, scale);
  }
};

// A scale that is either one float for the whole tensor or one per head.
// data: [] or [num_heads] float32, device-resident; per_head: whether it has num_heads entries.
// A null data pointer means "no scale" (1.0), used for non-FP8 caches.
struct ScaleRef {
  const float* data;  // [] or [num_heads]
  bool per_head;

  PS_HOST_DEVICE float at(int head) const {
    if (data == nullptr) return 1.0f;
    return per_head ? data[head] : data[0];
  }
};

}  // namespace pagedspec
