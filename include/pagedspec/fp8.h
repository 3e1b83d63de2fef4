// FP8 (OCP e4m3fn and e5m2) conversion shared by every CPU and CUDA kernel.
//
// Encoding follows the cache contract: stored = saturate(x / scale) rounded to nearest even,
// NaN stays NaN (0x7F with the input's sign, as torch encodes it), +-inf saturates to the largest
// finite value. The result is bit-identical to
//   (x.float() / scale).clamp(-max, max).to(torch.float8_e4m3fn / float8_e5m2).
// The code is plain integer and float arithmetic, so the same function runs on host and device
// and what the CPU tests prove holds for the CUDA kernels too.
#pragma once

#include <stdint.h>
#include <string.h>

#include "pagedspec/cache_format.h"
#include "pagedspec/macros.h"

namespace pagedspec {

PS_HOST_DEVICE uint32_t float_as_bits(float x) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(x);
#else
  uint32_t bits;
  memcpy(&bits, &x, sizeof(bits));
  return bits;
#endif
}

PS_HOST_DEVICE float bits_as_float(uint32_t bits) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(bits);
#else
  float x;
  memcpy(&x, &bits, sizeof(x));
  return x;
#endif
}

// Per-format constants. kMantBits: stored mantissa bits; kBias: exponent bias;
// kMaxFinite: largest finite magnitude; kMaxCode: its 7-bit code; kMinNormalBits: float bits of
// the smallest normal; kSubnormalScale: 2^(mantissa bits + bias - 1), so subnormal code =
// round(|x| * kSubnormalScale). Defined for the two FP8 formats only (CacheFormat::kNative has
// no traits, so instantiating an FP8 conversion with it does not compile).
template <CacheFormat F>
struct Fp8Traits;

template <>
struct Fp8Traits<CacheFormat::kE4M3> {
  static constexpr int kMantBits = 3;
  static constexpr int kBias = 7;
  static constexpr float kMaxFinite = 448.0f;
  static constexpr uint32_t kMaxFiniteBits = 0x43E00000u;  // 448.0f
  static constexpr uint8_t kMaxCode = 0x7E;
  static constexpr uint32_t kMinNormalBits = 0x3C800000u;  // 2^-6
  static constexpr float kSubnormalScale = 512.0f;         // 2^9
};

template <>
struct Fp8Traits<CacheFormat::kE5M2> {
  static constexpr int kMantBits = 2;
  static constexpr int kBias = 15;
  static constexpr float kMaxFinite = 57344.0f;
  static constexpr uint32_t kMaxFiniteBits = 0x47600000u;  // 57344.0f
  static constexpr uint8_t kMaxCode = 0x7B;
  static constexpr uint32_t kMinNormalBits = 0x38800000u;  // 2^-14
  static constexpr float kSubnormalScale = 65536.0f;       // 2^16
};

// float -> FP8 code with saturation and round-to-nearest-even.
// Written without branches (every path is computed, then selected) so the CPU loops vectorize;
// on the GPU the selects become predicated moves.
template <CacheFormat F>
PS_HOST_DEVICE uint8_t float_to_fp8(float x) {
  using T = Fp8Traits<F>;
  const uint32_t bits = float_as_bits(x);
  const uint32_t sign = (bits >> 24) & 0x80u;
  const uint32_t mag = bits & 0x7FFFFFFFu;
  // Normal range: rebias the exponent, then drop (23 - kMantBits) mantissa bits rounding to
  // nearest even; a carry out of the mantissa correctly bumps the exponent. (For magnitudes
  // below the normal range the subtraction wraps; that lane is not selected.)
  constexpr int kDrop = 23 - T::kMantBits;
  const uint32_t rebiased = mag - (static_cast<uint32_t>(127 - T::kBias) << 23);
  const uint32_t normal =
      (rebiased + ((1u << (kDrop - 1)) - 1u) + ((rebiased >> kDrop) & 1u)) >> kDrop;
  // Subnormal range (and zero): the code is the count of smallest subnormals, rounded to even.
  // Scaling by a power of two is exact; adding 2^23 then rounds to an integer (float addition
  // rounds to nearest even, and 2^23's ulp is 1), whose value is the low mantissa bits. A result
  // of 2^kMantBits is exactly the smallest normal's code. Lanes that are not selected are clamped
  // to the smallest normal so the arithmetic stays in range.
  const float tiny = bits_as_float(mag < T::kMinNormalBits ? mag : T::kMinNormalBits);
  const uint32_t subnormal = float_as_bits(tiny * T::kSubnormalScale + 8388608.0f) - 0x4B000000u;
  uint32_t code = mag < T::kMinNormalBits ? subnormal : normal;
  code = mag >= T::kMaxFiniteBits ? T::kMaxCode : code;  // saturate, inf included
  code = mag > 0x7F800000u ? 0x7Fu : code;               // NaN keeps its sign
  return static_cast<uint8_t>(sign | code);
}

// FP8 code -> float (exact). Branch-free for the same reason as float_to_fp8.
template <CacheFormat F>
PS_HOST_DEVICE float fp8_to_float(uint8_t code) {
  using T = Fp8Traits<F>;
  constexpr int kExpBits = 7 - T::kMantBits;
  constexpr uint32_t kExpMax = (1u << kExpBits) - 1u;
  const uint32_t sign = static_cast<uint32_t>(code & 0x80u) << 24;
  const uint32_t exp = (code >> T::kMantBits) & kExpMax;
  const uint32_t mant = code & ((1u << T::kMantBits) - 1u);
  const uint32_t normal = sign | ((exp + 127 - T::kBias) << 23) | (mant << (23 - T::kMantBits));
  const uint32_t subnormal =
      sign | float_as_bits(static_cast<float>(mant) * (1.0f / T::kSubnormalScale));
  uint32_t bits = exp == 0 ? subnormal : normal;
  if constexpr (F == CacheFormat::kE4M3) {
    bits = (code & 0x7Fu) == 0x7Fu ? (sign | 0x7FC00000u) : bits;  // e4m3fn: only NaN, no inf
  } else {
    bits = exp == kExpMax ? (sign | (mant == 0 ? 0x7F800000u : 0x7FC00000u)) : bits;  // inf/NaN
  }
  return bits_as_float(bits);
}

// Quantize with a scale: stored = saturate(x / scale). True division (not a reciprocal
// multiply) so the result matches the reference bit for bit.
template <CacheFormat F>
PS_HOST_DEVICE uint8_t quantize_fp8_value(float x, float scale) {
  return float_to_fp8<F>(x / scale);
}

template <CacheFormat F>
PS_HOST_DEVICE float dequantize_fp8_value(uint8_t code, float scale) {
  return fp8_to_float<F>(code) * scale;
}

}  // namespace pagedspec
