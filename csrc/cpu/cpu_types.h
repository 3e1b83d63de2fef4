// CPU specializations of the shared conversion traits for torch's scalar types.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include "pagedspec/codec.h"
#include "pagedspec/fp8.h"

namespace pagedspec {

template <>
struct ScalarConvert<c10::Half> {
  static inline float to_float(c10::Half x) { return static_cast<float>(x); }
  static inline c10::Half from_float(float x) { return c10::Half(x); }
};

template <>
struct ScalarConvert<c10::BFloat16> {
  static inline float to_float(c10::BFloat16 x) { return static_cast<float>(x); }
  // Round to nearest even like c10::BFloat16(float), without its NaN branch so loops vectorize.
  static inline c10::BFloat16 from_float(float x) {
    const uint32_t bits = float_as_bits(x);
    const uint32_t rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
    const uint16_t out = (bits & 0x7FFFFFFFu) > 0x7F800000u ? uint16_t(0x7FC0) : uint16_t(rounded);
    return c10::BFloat16(out, c10::BFloat16::from_bits());
  }
};

}  // namespace pagedspec
