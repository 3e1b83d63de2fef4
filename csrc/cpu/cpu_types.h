// CPU specializations of the shared conversion traits for torch's scalar types.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include "pagedspec/codec.h"

namespace pagedspec {

template <>
struct ScalarConvert<c10::Half> {
  static inline float to_float(c10::Half x) { return static_cast<float>(x); }
  static inline c10::Half from_float(float x) { return c10::Half(x); }
};

template <>
struct ScalarConvert<c10::BFloat16> {
  static inline float to_float(c10::BFloat16 x) { return static_cast<float>(x); }
  static inline c10::BFloat16 from_float(float x) { return c10::BFloat16(x); }
};

}  // namespace pagedspec
