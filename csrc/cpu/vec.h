// The CPU kernels' vector abstraction: 16-float vectors (vfloat) and their operations, the
// vectorized exp2 of a softmax tile, cache elements decoded 16 at a time (CacheReader), FP8
// encoding of a row (quantize_fp8_row), a 16-way horizontal sum and (AVX-512) the bf16 dot
// product, for one ISA level:
// PAGEDSPEC_CPU_LEVEL 2 (AVX-512 F/BW/VL/DQ), 1 (AVX2 + FMA + F16C) or 0 (baseline x86-64). A
// kernel source includes it once, after `#pragma GCC target` has enabled the level's
// instructions (see cpu/isa.h): one source, built once per level, each in its own namespace
// (PAGEDSPEC_CPU_NAMESPACE) with internal linkage.
//
// It includes nothing: every header it needs (<immintrin.h>, <type_traits>, cpu/cpu_types.h,
// pagedspec/attention.h) is included before the pragma (cpu/kernel_levels.h does), so that no
// library code is compiled for the level's instructions (its inline functions are shared with the
// other levels' objects and must run on every CPU).
#pragma once

#ifndef PAGEDSPEC_CPU_LEVEL
#error "define PAGEDSPEC_CPU_LEVEL (0, 1 or 2) and PAGEDSPEC_CPU_NAMESPACE before cpu/vec.h"
#endif

namespace pagedspec {
namespace PAGEDSPEC_CPU_NAMESPACE {
namespace {

// 16-float vectors: one AVX-512 register, two AVX2 registers, or (baseline) an array the compiler
// vectorizes for SSE2. Every supported head size is a multiple of 16.
constexpr int kLanes = 16;
#if PAGEDSPEC_CPU_LEVEL == 2
using vfloat = __m512;
inline vfloat vload(const float* p) { return _mm512_loadu_ps(p); }
inline void vstore(float* p, vfloat v) { _mm512_storeu_ps(p, v); }
inline vfloat vzero() { return _mm512_setzero_ps(); }
inline vfloat vset1(float x) { return _mm512_set1_ps(x); }
inline vfloat vfma(vfloat a, vfloat b, vfloat c) { return _mm512_fmadd_ps(a, b, c); }
inline vfloat vadd(vfloat a, vfloat b) { return _mm512_add_ps(a, b); }
inline vfloat vmul(vfloat a, vfloat b) { return _mm512_mul_ps(a, b); }
inline vfloat vsub(vfloat a, vfloat b) { return _mm512_sub_ps(a, b); }
// max(a, 0) lane by lane, NaN as 0 (max_ps returns its second operand when either is NaN).
inline vfloat vrelu(vfloat a) { return _mm512_max_ps(a, _mm512_setzero_ps()); }
// Lane i: x[2i] + x[2i + 1] over the 32 values of (a, b), in order: one level of a pairwise tree.
inline vfloat vpair_sums(vfloat a, vfloat b) {
  const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i odd = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
  return _mm512_add_ps(_mm512_permutex2var_ps(a, even, b), _mm512_permutex2var_ps(a, odd, b));
}
inline float vsum(vfloat v) {
  // Halves, quarters, pairs, lanes (GCC 12's _mm512_reduce_add_ps warns under -Wall).
  v = _mm512_add_ps(v, _mm512_shuffle_f32x4(v, v, 0x4E));
  v = _mm512_add_ps(v, _mm512_shuffle_f32x4(v, v, 0xB1));
  v = _mm512_add_ps(v, _mm512_permute_ps(v, 0x4E));
  v = _mm512_add_ps(v, _mm512_permute_ps(v, 0xB1));
  return _mm512_cvtss_f32(v);
}
#elif PAGEDSPEC_CPU_LEVEL == 1
// Two 8-float AVX2 registers.
struct vfloat {
  __m256 lo, hi;
};
inline vfloat vload(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline void vstore(float* p, vfloat v) {
  _mm256_storeu_ps(p, v.lo);
  _mm256_storeu_ps(p + 8, v.hi);
}
inline vfloat vzero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline vfloat vset1(float x) { return {_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
inline vfloat vfma(vfloat a, vfloat b, vfloat c) {
  return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
}
inline vfloat vadd(vfloat a, vfloat b) {
  return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)};
}
inline vfloat vsub(vfloat a, vfloat b) {
  return {_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)};
}
inline vfloat vmul(vfloat a, vfloat b) {
  return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)};
}
inline vfloat vrelu(vfloat a) {
  return {_mm256_max_ps(a.lo, _mm256_setzero_ps()), _mm256_max_ps(a.hi, _mm256_setzero_ps())};
}
// Lane i: x[2i] + x[2i + 1] over the 16 values of (a, b): hadd pairs neighbours within each
// 128-bit lane (P0 P1 P4 P5 | P2 P3 P6 P7), and the 64-bit permute puts them in order.
inline __m256 swap_middle_blocks(__m256 x) {  // 64-bit blocks in the order 0, 2, 1, 3
  return _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(x), 0xD8));
}
inline __m256 pair_sums8(__m256 a, __m256 b) { return swap_middle_blocks(_mm256_hadd_ps(a, b)); }
inline vfloat vpair_sums(vfloat a, vfloat b) {
  return {pair_sums8(a.lo, a.hi), pair_sums8(b.lo, b.hi)};
}
inline float vsum8(__m256 v) {
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  x = _mm_add_ss(x, _mm_movehdup_ps(x));
  return _mm_cvtss_f32(x);
}
inline float vsum(vfloat v) { return vsum8(_mm256_add_ps(v.lo, v.hi)); }
#else
struct vfloat {
  float v[kLanes];
};
inline vfloat vload(const float* p) {
  vfloat r;
  for (int i = 0; i < kLanes; ++i) r.v[i] = p[i];
  return r;
}
inline void vstore(float* p, vfloat x) {
  for (int i = 0; i < kLanes; ++i) p[i] = x.v[i];
}
inline vfloat vset1(float x) {
  vfloat r;
  for (int i = 0; i < kLanes; ++i) r.v[i] = x;
  return r;
}
inline vfloat vzero() { return vset1(0.0f); }
inline vfloat vfma(vfloat a, vfloat b, vfloat c) {
  for (int i = 0; i < kLanes; ++i) c.v[i] += a.v[i] * b.v[i];
  return c;
}
inline vfloat vadd(vfloat a, vfloat b) {
  for (int i = 0; i < kLanes; ++i) a.v[i] += b.v[i];
  return a;
}
inline vfloat vmul(vfloat a, vfloat b) {
  for (int i = 0; i < kLanes; ++i) a.v[i] *= b.v[i];
  return a;
}
inline float vsum(vfloat x) {
  for (int w = kLanes / 2; w > 0; w /= 2) {
    for (int i = 0; i < w; ++i) x.v[i] += x.v[i + w];
  }
  return x.v[0];
}
#endif

// The largest of w[0..n) (-inf for n = 0): one vector max per 16 (8) scores instead of a scalar
// chain, whose latency per score was a tenth of a decode task's time.
inline float max_weights(const float* w, int n) {
#if PAGEDSPEC_CPU_LEVEL == 2
  __m512 m = _mm512_set1_ps(neg_inf());
  for (int i = 0; i < n; i += kLanes) {
    const __mmask16 live = n - i >= kLanes ? __mmask16(0xFFFF) : __mmask16((1u << (n - i)) - 1);
    m = _mm512_mask_max_ps(m, live, m, _mm512_maskz_loadu_ps(live, w + i));
  }
  return _mm512_reduce_max_ps(m);
#elif PAGEDSPEC_CPU_LEVEL == 1
  __m256 m = _mm256_set1_ps(neg_inf());
  int i = 0;
  for (; i + 8 <= n; i += 8) m = _mm256_max_ps(m, _mm256_loadu_ps(w + i));
  const __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  const __m128 q = _mm_max_ps(h, _mm_movehl_ps(h, h));
  float best = _mm_cvtss_f32(_mm_max_ss(q, _mm_shuffle_ps(q, q, 1)));
  for (; i < n; ++i) best = std::max(best, w[i]);
  return best;
#else
  float best = neg_inf();
  for (int i = 0; i < n; ++i) best = std::max(best, w[i]);
  return best;
#endif
}

// w[i] = exp2(w[i] - max) for i < n (the softmax weights of a tile); returns their sum. Lanes
// from n up to the next multiple of 16 are set to 0. The AVX-512 and AVX2 paths evaluate 2^x as
// 2^round(x) * p(x - round(x)) with p the degree-7 Taylor polynomial of e^(f ln 2) on |f| <= 1/2
// (truncation error < 6e-9, below float rounding); elsewhere it is the scalar softmax_exp2.
inline float exp2_weights(float* w, int n, float max) {
#if PAGEDSPEC_CPU_LEVEL == 2
  constexpr float c[8] = {1.0f,          0.69314718f,   0.24022651f,  0.055504109f,
                          0.0096181291f, 0.0013333558f, 1.5403530e-4f, 1.5252734e-5f};
  __m512 total = _mm512_setzero_ps();
  const __m512 vmax = _mm512_set1_ps(max);
  for (int i = 0; i < n; i += kLanes) {
    __m512 x = _mm512_sub_ps(_mm512_loadu_ps(w + i), vmax);
    x = _mm512_max_ps(x, _mm512_set1_ps(-150.0f));
    const __m512 k = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(x, k);
    __m512 p = _mm512_set1_ps(c[7]);
    for (int j = 6; j >= 0; --j) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(c[j]));
    const __mmask16 live = n - i >= kLanes ? __mmask16(0xFFFF) : __mmask16((1u << (n - i)) - 1);
    const __m512 e = _mm512_maskz_mov_ps(live, _mm512_scalef_ps(p, k));
    _mm512_storeu_ps(w + i, e);
    total = _mm512_add_ps(total, e);
  }
  return vsum(total);
#elif PAGEDSPEC_CPU_LEVEL == 1
  // The same polynomial; 2^k from the exponent bits (k >= -126 after the clamp: weights below
  // 2^-126 of the running max count as 2^-126, a difference far below float rounding of the sum).
  constexpr float c[8] = {1.0f,          0.69314718f,   0.24022651f,  0.055504109f,
                          0.0096181291f, 0.0013333558f, 1.5403530e-4f, 1.5252734e-5f};
  __m256 total = _mm256_setzero_ps();
  const __m256 vmax = _mm256_set1_ps(max);
  const __m256i iota = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  for (int i = 0; i < n; i += 8) {
    __m256 x = _mm256_sub_ps(_mm256_loadu_ps(w + i), vmax);
    x = _mm256_max_ps(x, _mm256_set1_ps(-126.0f));
    const __m256 k = _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256 f = _mm256_sub_ps(x, k);
    __m256 p = _mm256_set1_ps(c[7]);
    for (int j = 6; j >= 0; --j) p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(c[j]));
    const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(k),
                                                            _mm256_set1_epi32(127)), 23);
    const __m256 live = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(n - i), iota));
    const __m256 e = _mm256_and_ps(live, _mm256_mul_ps(p, _mm256_castsi256_ps(bits)));
    _mm256_storeu_ps(w + i, e);
    total = _mm256_add_ps(total, e);
  }
  for (int i = (n + 7) / 8 * 8; i % kLanes != 0; ++i) w[i] = 0.0f;
  return vsum8(total);
#else
  float sum = 0.0f;
  for (int i = 0; i < n; ++i) {
    w[i] = softmax_exp2(w[i] - max);
    sum += w[i];
  }
  for (int i = n; i % kLanes != 0; ++i) w[i] = 0.0f;
  return sum;
#endif
}

#if PAGEDSPEC_CPU_LEVEL == 1
// Horizontal sums of 8 vectors at once: lane i of the result is the sum of v[i]'s lanes (two
// levels of hadd pair up the inputs, one cross-lane add finishes): 9 operations for 8 sums.
inline __m256 sum8(const __m256* v) {
  const __m256 s0123 = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 s4567 = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(s0123, s4567, 0x20),
                       _mm256_permute2f128_ps(s0123, s4567, 0x31));
}

// Lanes [2 r, 2 r + 2) of v to out + r * stride, r < 4: a 4 x 2 block of sums into its rows (as
// store_rows4x4 at AVX-512).
[[gnu::always_inline]] inline void store_rows4x2(__m256 v, float* out, int stride) {
  const __m128 rows01 = _mm256_castps256_ps128(v), rows23 = _mm256_extractf128_ps(v, 1);
  _mm_storel_pi(reinterpret_cast<__m64*>(out), rows01);
  _mm_storeh_pi(reinterpret_cast<__m64*>(out + stride), rows01);
  _mm_storel_pi(reinterpret_cast<__m64*>(out + 2 * stride), rows23);
  _mm_storeh_pi(reinterpret_cast<__m64*>(out + 3 * stride), rows23);
}

inline __m256 bf16x8_to_float(__m128i bits) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}
#endif

#if PAGEDSPEC_CPU_LEVEL >= 1
// The fp16 images S.EEEE.MMM.0000000 of e4m3 codes given sign-extended to 16-bit lanes: shifted
// left by 7, a lane's copies of the sign land on bits 15 (kept) and 14 (cleared); the NaN codes
// S.1111.111 become fp16 NaN, so the conversion that follows needs no fix-up (8 operations per
// 16 codes with it, where separate magnitude and sign and a NaN fix-up on the floats took 12).
inline __m256i e4m3_fp16_images(__m256i sign_extended) {
  const __m256i image = _mm256_and_si256(_mm256_slli_epi16(sign_extended, 7),
                                         _mm256_set1_epi16(int16_t(0xBFFF)));
  const __m256i is_nan = _mm256_cmpeq_epi16(
      _mm256_or_si256(sign_extended, _mm256_set1_epi16(int16_t(0xFF80))), _mm256_set1_epi16(-1));
  return _mm256_blendv_epi8(image, _mm256_set1_epi16(0x7E00), is_nan);
}
#endif

// Reads 16 cache elements as floats: native elements as ScalarConvert would, FP8 codes as their
// unscaled "images" CacheCodec::decode(code, 1) / kImage, with no multiply in the loop: the
// kernel folds scale * kImage into the query (K) and into the output (V), and image x
// (scale * kImage) rounds exactly as decode(code, scale) does (both factors are exact powers
// of two apart). Baseline: FP8 images are looked up in a table. AVX-512 and AVX2 (F16C): bf16 is
// a 16-bit shift and fp16 the hardware conversion; an e5m2 code is the top byte of the fp16 with
// the same value (kImage 1); an e4m3 code's 7 magnitude bits shifted left by 7 (sign to bit 15)
// form the fp16 of value * 2^-8, subnormals included (kImage 256). The one e4m3 code with no
// image there, NaN (S.1111.111), is patched in.
template <typename CacheT, CacheFormat F>
struct CacheReader {
  static constexpr float kImage = F == CacheFormat::kE4M3 ? 256.0f : 1.0f;
  // load_pair (AVX2, AVX-512) returns bf16 elements in even/odd order, not the natural one.
  static constexpr bool kEvenOddPairs =
      PAGEDSPEC_CPU_LEVEL >= 1 && std::is_same_v<CacheT, c10::BFloat16>;
  const float* table = nullptr;  // FP8: the 256 codes' images, after init()

  // Built once per format and shared (read-only): a task's reader used to fill its own, 256
  // scalar decodes per task, 5% of FP8 decode at batch 1.
  void init() {
    if constexpr (F != CacheFormat::kNative) {
      struct Images {
        float values[256];
        Images() {
          for (int c = 0; c < 256; ++c) {
            values[c] = CacheCodec<uint8_t, F>::decode(uint8_t(c), 1.0f) / kImage;
          }
        }
      };
      static const Images kImages;
      table = kImages.values;
    }
  }

  vfloat load16(const CacheT* __restrict p) const {
#if PAGEDSPEC_CPU_LEVEL == 2
    if constexpr (std::is_same_v<CacheT, float>) {
      return _mm512_loadu_ps(p);
    } else if constexpr (std::is_same_v<CacheT, c10::BFloat16>) {
      const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
      return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
    } else if constexpr (std::is_same_v<CacheT, c10::Half>) {
      return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    }
    if constexpr (F == CacheFormat::kE5M2) {
      const __m256i codes = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
      return _mm512_cvtph_ps(_mm256_slli_epi16(codes, 8));
    } else if constexpr (F == CacheFormat::kE4M3) {
      const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
      return _mm512_cvtph_ps(e4m3_fp16_images(_mm256_cvtepi8_epi16(raw)));
    }
#elif PAGEDSPEC_CPU_LEVEL == 1
    if constexpr (std::is_same_v<CacheT, float>) {
      return vload(p);
    } else if constexpr (std::is_same_v<CacheT, c10::BFloat16>) {
      const __m128i* q = reinterpret_cast<const __m128i*>(p);
      return {bf16x8_to_float(_mm_loadu_si128(q)), bf16x8_to_float(_mm_loadu_si128(q + 1))};
    } else if constexpr (std::is_same_v<CacheT, c10::Half>) {
      const __m128i* q = reinterpret_cast<const __m128i*>(p);
      return {_mm256_cvtph_ps(_mm_loadu_si128(q)), _mm256_cvtph_ps(_mm_loadu_si128(q + 1))};
    } else {
      // FP8 through the same fp16 images as AVX-512 (F16C converts them); e4m3's NaN codes
      // become fp16 NaN before the conversion.
      const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
      __m256i halves;
      if constexpr (F == CacheFormat::kE5M2) {
        halves = _mm256_slli_epi16(_mm256_cvtepu8_epi16(raw), 8);
      } else {
        halves = e4m3_fp16_images(_mm256_cvtepi8_epi16(raw));
      }
      return {_mm256_cvtph_ps(_mm256_castsi256_si128(halves)),
              _mm256_cvtph_ps(_mm256_extracti128_si256(halves, 1))};
    }
#endif
    return load_fallback(p);
  }

#if PAGEDSPEC_CPU_LEVEL == 1
  // 8 elements as one AVX2 register (the kernels' register-blocked loops run on these).
  __m256 load8(const CacheT* __restrict p) const {
    if constexpr (std::is_same_v<CacheT, float>) {
      return _mm256_loadu_ps(p);
    } else if constexpr (std::is_same_v<CacheT, c10::BFloat16>) {
      return bf16x8_to_float(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    } else if constexpr (std::is_same_v<CacheT, c10::Half>) {
      return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    } else {
      const __m128i raw = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
      if constexpr (F == CacheFormat::kE5M2) {
        return _mm256_cvtph_ps(_mm_slli_epi16(_mm_cvtepu8_epi16(raw), 8));
      } else {
        const __m256i codes = _mm256_zextsi128_si256(_mm_cvtepi8_epi16(raw));
        return _mm256_cvtph_ps(_mm256_castsi256_si128(e4m3_fp16_images(codes)));
      }
    }
  }

  // 16 elements as two AVX2 registers, for the loops that walk a row 16 elements at a time:
  // `first` elements 0..7 and `second` 8..15, except bf16 (kEvenOddPairs): one 256-bit load,
  // the even elements by a 16-bit shift, the odd ones by masking off their low neighbours, so
  // 2 operations per 16 where two widening loads took 2 loads and 4 (the shuffles compete with
  // the FMAs for ports). The caller keeps the other operand in that order (even_odd_order).
  void load_pair(const CacheT* __restrict p, __m256& first, __m256& second) const {
    if constexpr (kEvenOddPairs) {
      const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
      first = _mm256_castsi256_ps(_mm256_slli_epi32(bits, 16));
      second = _mm256_castsi256_ps(_mm256_and_si256(bits, _mm256_set1_epi32(int(0xFFFF0000u))));
    } else if constexpr (F != CacheFormat::kNative) {
      // The 16 codes' fp16 images in one register (load16), not two half-empty ones.
      const vfloat v = load16(p);
      first = v.lo;
      second = v.hi;
    } else {
      first = load8(p);
      second = load8(p + 8);
    }
  }
#endif

#if PAGEDSPEC_CPU_LEVEL == 2
  // 32 bf16 elements as two registers in even/odd order, as at AVX2, for the FMA path's loops
  // over 32 dimensions at a time: one 512-bit load, a shift and a mask, where two widening loads
  // and two shifts took 4 operations besides the loads.
  void load_pair(const CacheT* __restrict p, __m512& first, __m512& second) const {
    static_assert(kEvenOddPairs, "AVX-512 reads pairs of bf16 rows only");
    const __m512i bits = _mm512_loadu_si512(p);
    first = _mm512_castsi512_ps(_mm512_slli_epi32(bits, 16));
    second = _mm512_castsi512_ps(_mm512_and_si512(bits, _mm512_set1_epi32(int(0xFFFF0000u))));
  }
#endif

  vfloat load_fallback(const CacheT* __restrict p) const {
    alignas(64) float tmp[kLanes];
    if constexpr (F == CacheFormat::kNative) {
      for (int i = 0; i < kLanes; ++i) tmp[i] = ScalarConvert<CacheT>::to_float(p[i]);
    } else {
      for (int i = 0; i < kLanes; ++i) tmp[i] = table[p[i]];
    }
    return vload(tmp);
  }
};

#if PAGEDSPEC_CPU_LEVEL == 1
// float_to_fp8 (pagedspec/fp8.h) on 8 lanes, operation for operation, so the codes are the same
// bits: GCC does not vectorize the scalar form for this level ("control flow in loop"), where the
// AVX-512 build does. The 8 codes come back in the low 8 bytes.
template <CacheFormat F>
inline __m128i fp8_codes8(__m256 x) {
  using T = Fp8Traits<F>;
  constexpr int kDrop = 23 - T::kMantBits;
  const __m256i bits = _mm256_castps_si256(x);
  const __m256i sign = _mm256_and_si256(_mm256_srli_epi32(bits, 24), _mm256_set1_epi32(0x80));
  const __m256i mag = _mm256_and_si256(bits, _mm256_set1_epi32(0x7FFFFFFF));
  const __m256i rebiased = _mm256_sub_epi32(mag, _mm256_set1_epi32((127 - T::kBias) << 23));
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(rebiased, kDrop), _mm256_set1_epi32(1));
  const __m256i normal = _mm256_srli_epi32(
      _mm256_add_epi32(_mm256_add_epi32(rebiased, _mm256_set1_epi32((1 << (kDrop - 1)) - 1)), odd),
      kDrop);
  // mag has no sign bit, so the signed compares order it as the scalar's unsigned ones do.
  const __m256i min_normal = _mm256_set1_epi32(int(T::kMinNormalBits));
  const __m256i is_subnormal = _mm256_cmpgt_epi32(min_normal, mag);
  const __m256 tiny = _mm256_castsi256_ps(_mm256_blendv_epi8(min_normal, mag, is_subnormal));
  const __m256 rounded = _mm256_add_ps(_mm256_mul_ps(tiny, _mm256_set1_ps(T::kSubnormalScale)),
                                       _mm256_set1_ps(8388608.0f));
  const __m256i subnormal =
      _mm256_sub_epi32(_mm256_castps_si256(rounded), _mm256_set1_epi32(0x4B000000));
  __m256i code = _mm256_blendv_epi8(normal, subnormal, is_subnormal);
  code = _mm256_blendv_epi8(code, _mm256_set1_epi32(T::kMaxCode),
                            _mm256_cmpgt_epi32(mag, _mm256_set1_epi32(int(T::kMaxFiniteBits) - 1)));
  code = _mm256_blendv_epi8(code, _mm256_set1_epi32(0x7F),
                            _mm256_cmpgt_epi32(mag, _mm256_set1_epi32(0x7F800000)));
  code = _mm256_or_si256(code, sign);
  const __m128i words =
      _mm_packus_epi32(_mm256_castsi256_si128(code), _mm256_extracti128_si256(code, 1));
  return _mm_packus_epi16(words, words);
}
#endif

// out[i] = quantize_fp8_value<F>(in[i], scale) for n values (quantize_fp8, reshape_and_cache
// into an FP8 cache): AVX2 through fp8_codes8, the other levels as a loop the compiler
// vectorizes (AVX-512) or leaves scalar (baseline).
template <CacheFormat F, typename InT>
inline void quantize_fp8_row(const InT* __restrict in, uint8_t* __restrict out, int64_t n,
                             float scale) {
#if PAGEDSPEC_CPU_LEVEL == 1
  // Native loads only: no FP8 table.
  CacheReader<InT, CacheFormat::kNative> reader;
  const __m256 divisor = _mm256_set1_ps(scale);
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    const vfloat x = reader.load16(in + i);
    const __m128i lo = fp8_codes8<F>(_mm256_div_ps(x.lo, divisor));
    const __m128i hi = fp8_codes8<F>(_mm256_div_ps(x.hi, divisor));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), _mm_unpacklo_epi64(lo, hi));
  }
  for (; i < n; ++i) out[i] = quantize_fp8_value<F>(ScalarConvert<InT>::to_float(in[i]), scale);
#else
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    out[i] = quantize_fp8_value<F>(ScalarConvert<InT>::to_float(in[i]), scale);
  }
#endif
}

#if PAGEDSPEC_CPU_LEVEL == 2
// Horizontal sums of 16 vectors at once: lane i of the result is the sum of x[i]'s lanes. Four
// levels each add the two halves of every input's live lanes while packing two inputs into one
// vector (16 -> 8 -> 4 -> 2 -> 1 live lanes per input): 128-bit blocks across the register
// (vshuff32x4), then lanes within each block (vshufps), 30 shuffles and 15 adds for 16 sums. The
// shuffles take immediates and leave their sources intact, so no index registers and no copies.
// Inputs are visited in the order that leaves lane i holding x[i]: the tree puts input k at lane
// 4 (k % 4) + k / 4.
[[gnu::always_inline]] inline __m512 sum16(const __m512* x) {
  __m512 v[16];
  for (int k = 0; k < 16; ++k) v[k] = x[4 * (k % 4) + k / 4];
  for (int i = 0; i < 8; ++i) {  // blocks (0, 1) + (2, 3) of each input
    v[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                         _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
  }
  for (int i = 0; i < 4; ++i) {  // block 0 + block 1: one block per input
    v[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xDD));
  }
  for (int i = 0; i < 2; ++i) {  // lanes (0, 1) + (2, 3) within each block
    v[i] = _mm512_add_ps(_mm512_shuffle_ps(v[2 * i], v[2 * i + 1], 0x44),
                         _mm512_shuffle_ps(v[2 * i], v[2 * i + 1], 0xEE));
  }
  return _mm512_add_ps(_mm512_shuffle_ps(v[0], v[1], 0x88), _mm512_shuffle_ps(v[0], v[1], 0xDD));
}

// Lanes [4 r, 4 r + 4) of v to out + r * stride, r < 4: a 4 x 4 block of sums into its rows, one
// 128-bit store each (not through a 64-byte buffer re-read by 16-byte loads, which the stores
// cannot forward).
[[gnu::always_inline]] inline void store_rows4x4(__m512 v, float* out, int stride) {
  _mm_storeu_ps(out, _mm512_castps512_ps128(v));
  _mm_storeu_ps(out + stride, _mm512_extractf32x4_ps(v, 1));
  _mm_storeu_ps(out + 2 * stride, _mm512_extractf32x4_ps(v, 2));
  _mm_storeu_ps(out + 3 * stride, _mm512_extractf32x4_ps(v, 3));
}

// acc lane i += a[2i] * b[2i] + a[2i + 1] * b[2i + 1] over the 32 bf16 of a and b: AVX512-BF16's
// vdpbf16ps (the products are exact; denormal inputs and results are flushed to zero). Written in
// asm so that the avx512 level's object is built without the avx512bf16 target, which would let
// GCC use the extension anywhere in code that must run on AVX-512 CPUs without it: only code
// behind CpuConfig::bf16_dot executes this.
inline __m512 vdot_bf16(__m512 acc, __m512i a, __m512i b) {
  asm("vdpbf16ps %2, %1, %0" : "+v"(acc) : "v"(a), "vm"(b));
  return acc;
}
// vdot_bf16 against the two bf16 at `pair` in every lane: an embedded broadcast, so the pair
// costs no instruction of its own. `pair` points into bf16 data written as 16-bit elements, so
// it is read through a type that may alias them.
typedef uint32_t __attribute__((may_alias)) Bf16PairBits;
inline __m512 vdot_bf16_bcast(__m512 acc, __m512i a, const uint16_t* pair) {
  asm("vdpbf16ps %2%{1to16%}, %1, %0"
      : "+v"(acc)
      : "v"(a), "m"(*reinterpret_cast<const Bf16PairBits*>(pair)));
  return acc;
}

// vdot_bf16 on 256-bit vectors (8 lanes, 16 bf16 each side), also AVX512-BF16 (with VL).
inline __m256 vdot_bf16(__m256 acc, __m256i a, __m256i b) {
  asm("vdpbf16ps %2, %1, %0" : "+v"(acc) : "v"(a), "vm"(b));
  return acc;
}

// Sums of four vectors' lanes within each 128-bit block: lane i of block b of the result is the
// sum of x[i]'s four lanes in block b. 6 shuffles and 3 adds: unpacks pair up x0 with x1 and x2
// with x3 (adding lanes 0 + 2 and 1 + 3), then 64-bit shuffles add what is left.
[[gnu::always_inline]] inline __m256 sum4_in_blocks(__m256 x0, __m256 x1, __m256 x2, __m256 x3) {
  const __m256 s01 = _mm256_add_ps(_mm256_unpacklo_ps(x0, x1), _mm256_unpackhi_ps(x0, x1));
  const __m256 s23 = _mm256_add_ps(_mm256_unpacklo_ps(x2, x3), _mm256_unpackhi_ps(x2, x3));
  return _mm256_add_ps(_mm256_shuffle_ps(s01, s23, 0x44), _mm256_shuffle_ps(s01, s23, 0xEE));
}

// A 16 x 16 matrix of 32-bit elements transposed in registers: lane c of r[i] becomes lane i of
// r[c]. 64 shuffles: 32- and 64-bit unpacks leave, in each 128-bit lane L of vector 4 i + k,
// column 4 L + k of rows 4 i .. 4 i + 3; two rounds of 128-bit block shuffles then transpose the
// 4 x 4 blocks of each k.
[[gnu::always_inline]] inline void transpose16_epi32(__m512i (&r)[16]) {
  __m512i t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {
    r[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int k = 0; k < 4; ++k) {
    const __m512i x0 = _mm512_shuffle_i32x4(r[k], r[4 + k], 0x44);
    const __m512i x1 = _mm512_shuffle_i32x4(r[k], r[4 + k], 0xEE);
    const __m512i x2 = _mm512_shuffle_i32x4(r[8 + k], r[12 + k], 0x44);
    const __m512i x3 = _mm512_shuffle_i32x4(r[8 + k], r[12 + k], 0xEE);
    t[k] = _mm512_shuffle_i32x4(x0, x2, 0x88);      // column k
    t[4 + k] = _mm512_shuffle_i32x4(x0, x2, 0xDD);  // column 4 + k
    t[8 + k] = _mm512_shuffle_i32x4(x1, x3, 0x88);
    t[12 + k] = _mm512_shuffle_i32x4(x1, x3, 0xDD);
  }
  for (int i = 0; i < 16; ++i) r[i] = t[i];
}

// AVX512-VBMI byte permutes, in asm for the same reason (the avx512 level does not assume VBMI;
// only code behind CpuConfig::avx512_vbmi executes them). permute_bytes: byte i of the result is
// x[index[i] & 63] (vpermb). lookup128_bytes: byte i is entry index[i] & 127 of the 128-byte table
// held in (table_lo, table_hi) (vpermi2b; bit 7 of the index is ignored).
inline __m512i permute_bytes(__m512i index, __m512i x) {
  __m512i out;
  asm("vpermb %2, %1, %0" : "=v"(out) : "v"(index), "vm"(x));
  return out;
}
inline __m512i lookup128_bytes(__m512i index, __m512i table_lo, __m512i table_hi) {
  asm("vpermi2b %2, %1, %0" : "+v"(index) : "v"(table_lo), "vm"(table_hi));
  return index;
}

// 16 float32 rounded to bf16 (to nearest even), as 16 bit patterns: exact rounding for finite
// values; a NaN or inf lane gives unspecified bits.
inline __m256i round_to_bf16(__m512 x) {
  const __m512i bits = _mm512_castps_si512(x);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16));
}
#endif

// The register vector the blocked score and accumulate loops run on (as many lanes as one
// register holds, so a 4 x 4 or 4 x 2 block of accumulators fits the register file): kRegLanes
// floats, rload/rfma/... as the vfloat operations, CacheReader::load_reg.
#if PAGEDSPEC_CPU_LEVEL == 1
constexpr int kRegLanes = 8;
using rvec = __m256;
inline rvec rload(const float* p) { return _mm256_loadu_ps(p); }
inline void rstore(float* p, rvec v) { _mm256_storeu_ps(p, v); }
inline rvec rzero() { return _mm256_setzero_ps(); }
inline rvec rset1(float x) { return _mm256_set1_ps(x); }
inline rvec rfma(rvec a, rvec b, rvec c) { return _mm256_fmadd_ps(a, b, c); }
inline rvec radd(rvec a, rvec b) { return _mm256_add_ps(a, b); }
inline float rsum(rvec v) { return vsum8(v); }
template <typename Reader, typename CacheT>
inline rvec load_reg(const Reader& reader, const CacheT* p) { return reader.load8(p); }

// Each 16 floats of a row (n a multiple of 16) into load_pair's even/odd order (dimensions 0, 2,
// .., 14 then 1, 3, .., 15), and back.
inline void even_odd_order(float* __restrict row, int n) {
  for (int i = 0; i < n; i += 16) {
    const __m256 a = _mm256_loadu_ps(row + i), b = _mm256_loadu_ps(row + i + 8);
    _mm256_storeu_ps(row + i, swap_middle_blocks(_mm256_shuffle_ps(a, b, 0x88)));
    _mm256_storeu_ps(row + i + 8, swap_middle_blocks(_mm256_shuffle_ps(a, b, 0xDD)));
  }
}
inline void even_odd_to_natural(float* __restrict row, int n) {
  for (int i = 0; i < n; i += 16) {
    const __m256 even = _mm256_loadu_ps(row + i), odd = _mm256_loadu_ps(row + i + 8);
    const __m256 lo = _mm256_unpacklo_ps(even, odd), hi = _mm256_unpackhi_ps(even, odd);
    _mm256_storeu_ps(row + i, _mm256_permute2f128_ps(lo, hi, 0x20));
    _mm256_storeu_ps(row + i + 8, _mm256_permute2f128_ps(lo, hi, 0x31));
  }
}
#else
#if PAGEDSPEC_CPU_LEVEL == 2
// Each whole 32 floats of a row, as two registers x = (lo, hi), replaced by x[first] and
// x[second] (32-lane indices, vpermt2ps); a last 16 stays as it is.
inline void permute_whole_32s(float* __restrict row, int n, __m512i first, __m512i second) {
  for (int i = 0; i + 32 <= n; i += 32) {
    const __m512 lo = _mm512_loadu_ps(row + i), hi = _mm512_loadu_ps(row + i + 16);
    _mm512_storeu_ps(row + i, _mm512_permutex2var_ps(lo, first, hi));
    _mm512_storeu_ps(row + i + 16, _mm512_permutex2var_ps(lo, second, hi));
  }
}
// Each whole 32 floats of a row into load_pair's even/odd order (dimensions 0, 2, .., 30 then
// 1, 3, .., 31), and back; a last 16 (n = 80, 112, ...) stays as it is, which the loops read as
// one vector in dimension order.
inline void even_odd_order(float* __restrict row, int n) {
  alignas(64) static constexpr int kEven[16] = {0,  2,  4,  6,  8,  10, 12, 14,
                                                16, 18, 20, 22, 24, 26, 28, 30};
  const __m512i even = _mm512_load_si512(kEven);
  permute_whole_32s(row, n, even, _mm512_add_epi32(even, _mm512_set1_epi32(1)));
}
inline void even_odd_to_natural(float* __restrict row, int n) {
  alignas(64) static constexpr int kLow[16] = {0, 16, 1, 17, 2, 18, 3, 19,
                                               4, 20, 5, 21, 6, 22, 7, 23};
  const __m512i low = _mm512_load_si512(kLow);
  permute_whole_32s(row, n, low, _mm512_add_epi32(low, _mm512_set1_epi32(8)));
}
#endif
constexpr int kRegLanes = kLanes;
using rvec = vfloat;
inline rvec rload(const float* p) { return vload(p); }
inline void rstore(float* p, rvec v) { vstore(p, v); }
inline rvec rzero() { return vzero(); }
inline rvec rset1(float x) { return vset1(x); }
inline rvec rfma(rvec a, rvec b, rvec c) { return vfma(a, b, c); }
inline rvec radd(rvec a, rvec b) { return vadd(a, b); }
inline float rsum(rvec v) { return vsum(v); }
template <typename Reader, typename CacheT>
inline rvec load_reg(const Reader& reader, const CacheT* p) { return reader.load16(p); }
#endif

// v, held in a register: GCC otherwise folds the load of a value used by several FMAs into
// each of them, and at AVX2 a 4 x 2 score block then issued 20 loads per 16 FMAs (the load
// ports, not the FMAs, set its pace).
// Used for bf16 rows only, where it was measured faster.
[[gnu::always_inline]] inline rvec in_register(rvec v) {
#if PAGEDSPEC_CPU_LEVEL == 1
  asm("" : "+x"(v));
#endif
  return v;
}

// S register vectors of cache elements from p: load_pair's two per pair at the AVX2 level (S =
// 2) and for bf16 at the AVX-512 level (S even: spans of 32 elements in even/odd order), else
// one load_reg per vector.
template <int S, typename Reader, typename CacheT>
[[gnu::always_inline]] inline void load_regs(const Reader& reader, const CacheT* p,
                                             rvec (&out)[S]) {
#if PAGEDSPEC_CPU_LEVEL == 1
  if constexpr (S == 2) {
    reader.load_pair(p, out[0], out[1]);
    return;
  }
#elif PAGEDSPEC_CPU_LEVEL == 2
  if constexpr (S % 2 == 0 && Reader::kEvenOddPairs) {
    for (int s = 0; s < S; s += 2) reader.load_pair(p + s * kRegLanes, out[s], out[s + 1]);
    return;
  }
#endif
  for (int s = 0; s < S; ++s) out[s] = load_reg(reader, p + s * kRegLanes);
}

}  // namespace
}  // namespace PAGEDSPEC_CPU_NAMESPACE
}  // namespace pagedspec
