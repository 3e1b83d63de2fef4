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

#include <math.h>

#include "pagedspec/macros.h"

namespace pagedspec {

enum class Fp8Format : int { kE4M3 = 0, kE5M2 = 1 };

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
// round(|x| * kSubnormalScale).
template <Fp8Format F>
struct Fp8Traits;

template <>
struct Fp8Traits<Fp8Format::kE4M3> {
  static constexpr int kMantBits = 3;
  static constexpr int kBias = 7;
  static constexpr float kMaxFinite = 448.0f;
  static constexpr uint32_t kMaxFiniteBits = 0x43E00000u;  // 448.0f
  static constexpr uint8_t kMaxCode = 0x7E;
  static constexpr uint32_t kMinNormalBits = 0x3C800000u;  // 2^-6
  static constexpr float kSubnormalScale = 512.0f;         // 2^9
};

template <>
struct Fp8Traits<Fp8Format::kE5M2> {
  static constexpr int kMantBits = 2;
  static constexpr int kBias = 15;
  static constexpr float kMaxFinite = 57344.0f;
  static constexpr uint32_t kMaxFiniteBits = 0x47600000u;  // 57344.0f
  static constexpr uint8_t kMaxCode = 0x7B;
  static constexpr uint32_t kMinNormalBits = 0x38800000u;  // 2^-14
  static constexpr float kSubnormalScale = 65536.0f;       // 2^16
};

// float -> FP8 code with saturation and round-to-nearest-even.
template <Fp8Format F>
PS_HOST_DEVICE uint8_t float_to_fp8(float x) {
  using T = Fp8Traits<F>;
  const uint32_t bits = float_as_bits(x);
  const uint8_t sign = static_cast<uint8_t>((bits >> 24) & 0x80u);
  const uint32_t mag = bits & 0x7FFFFFFFu;
  if (mag > 0x7F800000u) return sign | 0x7F;               // NaN keeps its sign
  if (mag >= T::kMaxFiniteBits) return sign | T::kMaxCode;  // saturate, inf included
  if (mag < T::kMinNormalBits) {
    // Subnormal (or zero): the code is the multiple of the smallest subnormal, rounded to even.
    // Scaling by a power of two is exact and rintf rounds to nearest even; a result equal to
    // 2^kMantBits is exactly the smallest normal's code, so no special case is needed.
    const float scaled = bits_as_float(mag) * T::kSubnormalScale;
    return sign | static_cast<uint8_t>(rintf(scaled));
  }
  // Normal: rebias the exponent, then drop (23 - kMantBits) mantissa bits, rounding to nearest
  // even. A carry out of the mantissa correctly bumps the exponent.
  constexpr int kDrop = 23 - T::kMantBits;
  const uint32_t rebiased = mag - (static_cast<uint32_t>(127 - T::kBias) << 23);
  const uint32_t odd = (rebiased >> kDrop) & 1u;
  const uint32_t rounded = (rebiased + ((1u << (kDrop - 1)) - 1u) + odd) >> kDrop;
  return sign | static_cast<uint8_t>(rounded);
}

// FP8 code -> float (exact).
template <Fp8Format F>
PS_HOST_DEVICE float fp8_to_float(uint8_t code) {
  using T = Fp8Traits<F>;
  constexpr int kExpBits = 7 - T::kMantBits;
  const uint32_t sign = static_cast<uint32_t>(code & 0x80u) << 24;
  const uint32_t exp = (code >> T::kMantBits) & ((1u << kExpBits) - 1u);
  const uint32_t mant = code & ((1u << T::kMantBits) - 1u);
  if (exp == 0) {
    const float mag = static_cast<float>(mant) / T::kSubnormalScale;
    return sign ? -mag : mag;
  }
  if (F == Fp8Format::kE4M3) {
    if (exp == 15 && mant == 7) return bits_as_float(sign | 0x7FC00000u);  // e4m3fn: only NaN
  } else if (exp == 31) {
    return bits_as_float(sign | (mant == 0 ? 0x7F800000u : 0x7FC00000u));  // e5m2: inf / NaN
  }
  return bits_as_float(sign | ((exp + 127 - T::kBias) << 23) | (mant << (23 - T::kMantBits)));
}

// Quantize with a scale: stored = saturate(x / scale). True division (not a reciprocal
// multiply) so the result matches the reference bit for bit.
template <Fp8Format F>
PS_HOST_DEVICE uint8_t quantize_fp8_value(float x, float scale) {
  return float_to_fp8<F>(x / scale);
}

template <Fp8Format F>
PS_HOST_DEVICE float dequantize_fp8_value(uint8_t code, float scale) {
  return fp8_to_float<F>(code) * scale;
}

}  // namespace pagedspec
