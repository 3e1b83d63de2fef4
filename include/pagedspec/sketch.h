// Count-min sketch math shared by the CPU and CUDA kernels: the contract's row hash, the column
// function and the saturating counter arithmetic, plus the kernel parameter structs.
// Torch-free, so a sketch built on one device hashes identically on the other.
#pragma once

#include <stdint.h>

#include "pagedspec/macros.h"

namespace pagedspec {

constexpr int kSketchMaxDepth = 16;
constexpr int32_t kSketchCounterMax = 0x7fffffff;  // 2^31 - 1: counters saturate here
constexpr uint64_t kSketchRowSeed = 0x9E3779B97F4A7C15ull;  // row r adds (r + 1) * seed

// MurmurHash3's 64-bit finalizer (a bijection on uint64, all arithmetic mod 2^64).
PS_HOST_DEVICE uint64_t fmix64(uint64_t x) {
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdull;
  x ^= x >> 33;
  x *= 0xc4ceb9fe1a85ec53ull;
  x ^= x >> 33;
  return x;
}

// The contract's pre-modulo hash of `key` for row `row`: uint64(key) is the key's two's complement
// bit pattern.
PS_HOST_DEVICE uint64_t sketch_row_hash(int64_t key, int row) {
  return fmix64(static_cast<uint64_t>(key) + static_cast<uint64_t>(row + 1) * kSketchRowSeed);
}

// High 64 bits of the 128-bit product a * b.
PS_HOST_DEVICE uint64_t mul_hi64(uint64_t a, uint64_t b) {
#if defined(__CUDA_ARCH__)
  return __umul64hi(a, b);
#else
  return static_cast<uint64_t>((static_cast<unsigned __int128>(a) * b) >> 64);
#endif
}

// x mod width without a 64-bit division (slow on GPUs, and not pipelined on CPUs). Barrett
// reduction with inv = floor((2^64 - 1) / width): q = mulhi(x, inv) is floor(x / width) or one
// less (x * (2^64/width - inv) / 2^64 < 1), so one conditional subtraction makes it exact for every
// x and every width in [1, 2^63). Power-of-two widths take a mask instead.
struct SketchGeometry {
  int depth;         // sketch.size(0): rows, 1..kSketchMaxDepth
  int64_t width;     // sketch.size(1): counters per row, >= 1
  uint64_t inv;      // floor((2^64 - 1) / width), for the Barrett reduction
  bool pow2;         // width is a power of two: reduce with a mask

  static SketchGeometry make(int depth, int64_t width) {
    const uint64_t w = static_cast<uint64_t>(width);
    return SketchGeometry{depth, width, ~0ull / w, (w & (w - 1)) == 0};
  }

  // The Barrett path alone (callers that hoisted the power-of-two test use these directly).
  PS_HOST_DEVICE int64_t reduce_barrett(uint64_t h) const {
    const uint64_t w = static_cast<uint64_t>(width);
    uint64_t r = h - mul_hi64(h, inv) * w;
    if (r >= w) r -= w;
    return static_cast<int64_t>(r);
  }
  PS_HOST_DEVICE int64_t reduce_pow2(uint64_t h) const {
    return static_cast<int64_t>(h & static_cast<uint64_t>(width - 1));
  }

  // col_r(key) = fmix64(uint64(key) + (r + 1) * 0x9E3779B97F4A7C15) mod width.
  PS_HOST_DEVICE int64_t column(int64_t key, int row) const {
    const uint64_t h = sketch_row_hash(key, row);
    return pow2 ? reduce_pow2(h) : reduce_barrett(h);
  }
};

// min(2^31 - 1, c + inc) for counters and increments in [0, 2^31 - 1]. Saturating adds of
// nonnegative increments compose to min(MAX, c + sum) whatever their order, which is why plain
// updates are order-independent.
PS_HOST_DEVICE int32_t sat_add(int32_t c, int32_t inc) {
  const int64_t s = static_cast<int64_t>(c) + inc;
  return s > kSketchCounterMax ? kSketchCounterMax : static_cast<int32_t>(s);
}

// min(2^31 - 1, e + s) for an estimate e >= 0 and an aggregated increment s >= 0 (s may exceed
// 2^31 when many duplicates of one key arrive in one call).
PS_HOST_DEVICE int32_t sat_add_wide(int32_t e, int64_t s) {
  const int64_t t = static_cast<int64_t>(e) + s;
  return t > kSketchCounterMax ? kSketchCounterMax : static_cast<int32_t>(t);
}

// Hash-table slot of a key when aggregating duplicate keys of one conservative update (any good
// mix works; fmix64 of the raw key is independent enough of the row hashes' low bits).
PS_HOST_DEVICE uint64_t sketch_dedup_hash(int64_t key) {
  return fmix64(static_cast<uint64_t>(key) ^ 0x5851F42D4C957F2Dull);
}

// cms_update / cms_query over n keys.
struct SketchUpdateParams {
  int32_t* sketch;            // [depth, width], row-major contiguous
  const int64_t* keys;        // [n]
  const int32_t* increments;  // [n], each >= 0; nullptr means every increment is 1
  int64_t n;                  // keys.size(0)
  SketchGeometry geo;

  PS_HOST_DEVICE int32_t increment(int64_t i) const {
    if (increments == nullptr) return 1;
    const int32_t v = increments[i];
    return v > 0 ? v : 0;  // negative increments are rejected on the host; never corrupt counters
  }
};

struct SketchQueryParams {
  const int32_t* sketch;  // [depth, width], row-major contiguous
  const int64_t* keys;    // [n]
  int32_t* out;           // [n]: min over rows
  int64_t n;              // keys.size(0)
  SketchGeometry geo;
};

// Scratch of a conservative update on CUDA (the CPU kernel runs the same phases with a
// sequentially built table). It runs in phases so that its result does not depend on
// the order of keys: (1) every key's estimate before the call, (2) the sum of each distinct key's
// increments, aggregated through an open-addressing table keyed by the index of the key's first
// inserted occurrence, (3) every hit counter raised to max(counter, sat(estimate + sum)).
struct SketchConservativeScratch {
  int32_t* estimate;      // [n]: query estimate before the call
  int32_t* slot;          // [n]: the key's entry in the table
  int32_t* table_key;     // [capacity]: index into keys of the entry's key, -1 = empty
  uint64_t* table_sum;    // [capacity]: sum of the increments of the entry's key
  int64_t capacity;       // power of two >= 2 n (load factor <= 1/2)
};

// Capacity of the dedup table for n keys: the next power of two >= 2n (at least 16).
PS_HOST_DEVICE int64_t sketch_table_capacity(int64_t n) {
  int64_t c = 16;
  while (c < 2 * n) c <<= 1;
  return c;
}

}  // namespace pagedspec
