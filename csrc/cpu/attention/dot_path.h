// The AVX512-BF16 dot-product path's blocks (cpu_bf16_dot; AVX-512 level only, all under
// PAGEDSPEC_CPU_LEVEL == 2): scores on bf16 rows, on FP8 codes converted in registers
// (fp8_images_in_lanes) and on a packed K tile for many rows. Its tile loops are kernel members
// (dot_tiles.h). Its P.V is the FMA path's, on float32 probabilities.
// A part of cpu/attention_impl.h, included only there, inside its namespaces.
#ifndef PAGEDSPEC_CPU_ATTENTION_PARTS
#error "a part of cpu/attention_impl.h, included only there: include that instead"
#endif

#if PAGEDSPEC_CPU_LEVEL == 2
// The bf16 dot-product path (cpu_bf16_dot: AVX512-BF16, bf16 queries on a bf16 cache or on
// the bf16 images of an FP8 cache's codes, D a multiple of 32). A register holds 32 bf16, and
// each vdpbf16ps adds two exact products per float32 lane, so a score takes half the
// instructions of the FMA path and bf16 K rows are read as stored, not widened; the products
// are exact and summed in float32, as on the FMA path. With D a multiple of 64, FP8 codes are
// converted in registers as they are read (score_block_fp8_dot); otherwise through images in
// the workspace (fp8_images_as_bf16).
// P.V stays on the FMA path, with float32 probabilities: dot products there need the weights in
// bf16, 2^-9 relative each, which broke the contract's bound (up to 2^-11 max|V| on bf16
// verification); split exactly into three bf16 parts they cost 1.5-1.6x the FMA path's P.V
// time on 5-token verification (Zen 4, bench/log/2026-12-07-cpu-attention-exact-dot-zen4.md),
// and the dot scores with the FMA path's P.V beat both.

// out[r * out_stride + t] = scale * sum over lanes of acc[r][t].
template <int NR, int NT>
[[gnu::always_inline]] inline void store_dot_scores(__m512 (&acc)[NR][NT], float scale,
                                                    float* out, int out_stride) {
  if constexpr (NR == 4 && NT == 4) {
    store_rows4x4(_mm512_mul_ps(sum16(&acc[0][0]), _mm512_set1_ps(scale)), out, out_stride);
  } else {
    for (int r = 0; r < NR; ++r) {
      for (int t = 0; t < NT; ++t) out[r * out_stride + t] = vsum(acc[r][t]) * scale;
    }
  }
}

// The dot path's scores for tasks of up to kLanesMaxRows rows (decode). A 256-bit
// product holds one query row per 128-bit block (rows 2p and 2p + 1: lane_pair_queries) against
// 8 dimensions of one K row broadcast to both blocks, so each lane sums pairs of one row and one
// position, and four positions' scores for two rows take 9 instructions (sum4_in_blocks). The
// 4 x 4 blocks of 512-bit products this replaced (as score_block_fp8_dot still runs) spent
// sum16's 45 shuffles and adds on every 16 scores, as many instructions as a third of their dot
// products. Zen 4 issues two 256-bit dot products a cycle, as many pairs as one 512-bit.

// Query rows for score_block_lanes: rows 2p and 2p + 1 side by side 8 dimensions at a time,
// out[(p * D / 8 + g) * 16 + 8 h + i] = q[2p + h][8 g + i] (bf16 bits; `row(r)` gives row r, and
// a last row of an odd count is paired with zeros).
template <typename Row>
inline void lane_pair_queries(int R, int D, Row&& row, uint16_t* __restrict out) {
  const int groups = D / 8;
  for (int r = 0; r < R + R % 2; ++r) {
    const uint16_t* src = r < R ? row(r) : nullptr;
    uint16_t* dst = out + size_t(r / 2) * groups * 16 + 8 * (r % 2);
    for (int g = 0; g < groups; ++g) {
      if (src != nullptr) {
        std::memcpy(dst + 16 * g, src + 8 * g, 8 * sizeof(uint16_t));
      } else {
        std::memset(dst + 16 * g, 0, 8 * sizeof(uint16_t));
      }
    }
  }
}

// out[r * out_stride + t] = scale * q[r] . k[t] for the 2 NP rows of q (lane_pair_queries, NP
// pairs) and NT positions (a multiple of 4), k the raw bf16 rows; D a multiple of 32 (as on all
// of the dot path), so the K rows are read a 64-byte line at a time. `steps` calls of step(),
// spread over the lines.
template <int NP, int NT, typename Step>
[[gnu::always_inline]] inline void score_block_lanes(const uint16_t* __restrict q,
                                                     const uint16_t* const* k, int D, float scale,
                                                     float* out, int out_stride, int steps,
                                                     Step&& step) {
  static_assert(NT % 4 == 0, "scores are summed four positions at a time");
  if (D <= 0) __builtin_unreachable();  // as in score_block
  const int groups = D / 8;
  __m256 acc[NT][NP];
  for (int t = 0; t < NT; ++t) {
    for (int p = 0; p < NP; ++p) acc[t][p] = _mm256_setzero_ps();
  }
  int stepped = 0;
  for (int g0 = 0; g0 < groups; g0 += 4) {
    for (const int due = steps * (g0 + 4) / groups; stepped < due; ++stepped) step();
    __m256i qv[4][NP];
    for (int i = 0; i < 4; ++i) {
      for (int p = 0; p < NP; ++p) {
        qv[i][p] =
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + (p * groups + g0 + i) * 16));
      }
    }
    for (int i = 0; i < 4; ++i) {
      for (int t = 0; t < NT; ++t) {
        const __m256i kb = _mm256_broadcastsi128_si256(
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(k[t] + 8 * (g0 + i))));
        for (int p = 0; p < NP; ++p) acc[t][p] = vdot_bf16(acc[t][p], qv[i][p], kb);
      }
    }
  }
  const __m256 s = _mm256_set1_ps(scale);
  for (int t = 0; t < NT; t += 4) {
    for (int p = 0; p < NP; ++p) {
      const __m256 x = _mm256_mul_ps(
          sum4_in_blocks(acc[t][p], acc[t + 1][p], acc[t + 2][p], acc[t + 3][p]), s);
      _mm_storeu_ps(out + 2 * p * out_stride + t, _mm256_castps256_ps128(x));
      _mm_storeu_ps(out + (2 * p + 1) * out_stride + t, _mm256_extractf128_ps(x, 1));
    }
  }
}

// The bf16 bits of the 128 FP8 magnitudes' images (table[c]: code c's float32 image, as
// CacheReader holds it), split into their high and low bytes. The narrowing is exact: an image
// has at most 4 significant bits and lies inside bf16's normal range, so its float32 bits end in
// 16 zeros (NaN stays NaN).
struct Fp8ImageBytes {
  alignas(64) uint8_t high[128];
  alignas(64) uint8_t low[128];
};
inline Fp8ImageBytes fp8_image_bytes(const float* table) {
  Fp8ImageBytes b;
  for (int c = 0; c < 128; c += 16) {
    const __m512i bits = _mm512_castps_si512(_mm512_loadu_ps(table + c));
    _mm_store_si128(reinterpret_cast<__m128i*>(b.high + c),
                    _mm512_cvtepi32_epi8(_mm512_srli_epi32(bits, 24)));
    _mm_store_si128(reinterpret_cast<__m128i*>(b.low + c),
                    _mm512_cvtepi32_epi8(_mm512_srli_epi32(bits, 16)));
  }
  return b;
}

// The same tables in registers, for lookup128_bytes (VBMI: callers check
// CpuConfig::avx512_vbmi).
struct Fp8ImageLookup {
  __m512i high0, high1, low0, low1;
  explicit Fp8ImageLookup(const Fp8ImageBytes& b)
      : high0(_mm512_load_si512(b.high)), high1(_mm512_load_si512(b.high + 64)),
        low0(_mm512_load_si512(b.low)), low1(_mm512_load_si512(b.low + 64)) {}
};

// The bf16 images of 64 FP8 codes in two registers: each image's high and low byte looked up by
// the code's 7 magnitude bits, the sign ORed into the high byte, the bytes interleaved into
// 16-bit lanes within each 128-bit lane L. So `first` holds the images of codes 16 L + j and
// `second` those of 16 L + 8 + j (j < 8), words 8 L + j of each: 5 operations per 64 codes.
[[gnu::always_inline]] inline void fp8_images_in_lanes(__m512i codes, const Fp8ImageLookup& t,
                                                       __m512i& first, __m512i& second) {
  const __m512i sign_bit = _mm512_set1_epi8(char(0x80));
  // high | (codes & 0x80)
  const __m512i hi =
      _mm512_ternarylogic_epi32(lookup128_bytes(codes, t.high0, t.high1), codes, sign_bit, 0xF8);
  const __m512i lo = lookup128_bytes(codes, t.low0, t.low1);
  first = _mm512_unpacklo_epi8(lo, hi);
  second = _mm512_unpackhi_epi8(lo, hi);
}

// Byte 16 L + p of the codes fp8_images_in_lanes converts lands at word 8 L + p of `first`
// (p < 8) and word 8 L + p - 8 of `second` (p >= 8): this order puts the codes where they come
// back in the natural order.
struct Fp8InterleaveOrder {
  alignas(64) uint8_t index[64];
};
constexpr Fp8InterleaveOrder make_fp8_interleave_order() {
  Fp8InterleaveOrder o{};
  for (int lane = 0; lane < 4; ++lane) {
    for (int p = 0; p < 8; ++p) {
      o.index[16 * lane + p] = uint8_t(8 * lane + p);
      o.index[16 * lane + 8 + p] = uint8_t(32 + 8 * lane + p);
    }
  }
  return o;
}

// n rows of D FP8 codes (D a multiple of 32) as the bf16 bits of their images in the natural
// order, into dst (row i at dst + i * D; out[i] points there): for the AMX path, and the dot path
// where D is not a multiple of 64.
inline void fp8_images_as_bf16(const uint8_t* const* rows, int n, int D, const Fp8ImageBytes& bytes,
                               uint16_t* dst, const uint16_t** out) {
  static constexpr Fp8InterleaveOrder kOrder = make_fp8_interleave_order();
  const Fp8ImageLookup lookup(bytes);
  const __m512i order_v = _mm512_load_si512(kOrder.index);
  for (int i = 0; i < n; ++i) {
    uint16_t* row = dst + size_t(i) * D;
    for (int d = 0; d < D; d += 64) {
      const bool half = d + 64 > D;  // a last 32 codes (D = 96, 160, ...)
      const __m512i raw = half ? _mm512_castsi256_si512(_mm256_loadu_si256(
                                     reinterpret_cast<const __m256i*>(rows[i] + d)))
                               : _mm512_loadu_si512(rows[i] + d);
      __m512i first, second;
      fp8_images_in_lanes(permute_bytes(order_v, raw), lookup, first, second);
      _mm512_storeu_si512(row + d, first);
      if (!half) _mm512_storeu_si512(row + d + 32, second);
    }
    out[i] = row;
  }
}

// The queries of score_block_fp8_dot: each 64 dimensions of q in fp8_images_in_lanes' order, so
// that q . k is the same sum with K converted as read (words 8 L + j of the first 32 hold
// dimension 16 L + j, those of the second 16 L + 8 + j).
inline void fp8_lane_order_query(const uint16_t* q, int D, uint16_t* out) {
  for (int d = 0; d < D; d += 64) {
    for (int lane = 0; lane < 4; ++lane) {
      for (int j = 0; j < 8; ++j) {
        out[d + 8 * lane + j] = q[d + 16 * lane + j];
        out[d + 32 + 8 * lane + j] = q[d + 16 * lane + 8 + j];
      }
    }
  }
}

// out[r * out_stride + t] = scale * q[r] . k[t] for NR query rows (stride D, from
// fp8_lane_order_query) and NT FP8 K rows (D a multiple of 64), each 64 codes converted in
// registers once for all NR rows; a 4 x 4 block's sums by sum16.
template <int NR, int NT>
[[gnu::always_inline]] inline void score_block_fp8_dot(const uint16_t* __restrict q,
                                                       const uint8_t* const* k, int D, float scale,
                                                       const Fp8ImageLookup& lookup, float* out,
                                                       int out_stride) {
  if (D <= 0) __builtin_unreachable();  // as in score_block
  __m512 acc[NR][NT];
  for (int r = 0; r < NR; ++r) {
    for (int t = 0; t < NT; ++t) acc[r][t] = _mm512_setzero_ps();
  }
  for (int d = 0; d < D; d += 64) {
    __m512i k0[NT], k1[NT];
    for (int t = 0; t < NT; ++t) fp8_images_in_lanes(_mm512_loadu_si512(k[t] + d), lookup, k0[t], k1[t]);
    for (int r = 0; r < NR; ++r) {
      const __m512i q0 = _mm512_loadu_si512(q + r * D + d);
      const __m512i q1 = _mm512_loadu_si512(q + r * D + d + 32);
      for (int t = 0; t < NT; ++t) {
        acc[r][t] = vdot_bf16(acc[r][t], q0, k0[t]);
        acc[r][t] = vdot_bf16(acc[r][t], q1, k1[t]);
      }
    }
  }
  store_dot_scores(acc, scale, out, out_stride);
}

// The dot path's scores for tasks of many rows (score_tile_packed): the tile's K rows packed
// pair-major, one register per (group of 16 positions, bf16 pair j of the head), so that a
// query's pair j broadcast against it adds that pair's products for 16 positions at once and
// the scores come out in lanes, position by position. The packing spends 64 shuffles per 16
// positions and 32 dimensions, once for all of a task's rows.

// Packs n <= 16 K rows of one group (rows past n as zeros), D a multiple of 32: dword c of 16-
// dword block b of every row (bf16 dimensions 32 b + 2 c, + 1 in the queries' order) at dst +
// (16 b + c) * 16, position by position. load(t, k, lo, hi, pair) gives row t's dwords [32 k,
// 32 k + 32) as two registers (only `lo` if !pair, the last 16 of D = 96, 160, ...); `hi` waits
// in L1 while `lo`'s block is transposed.
template <typename LoadChunk>
[[gnu::always_inline]] inline void pack_key_group(int n, int D, uint32_t* __restrict dst,
                                                  LoadChunk&& load) {
  alignas(64) uint32_t spill[kPackedGroup][16];
  const int blocks = D / 32;
  for (int b = 0; b < blocks; b += 2) {
    const bool pair = b + 1 < blocks;
    __m512i r[kPackedGroup];
#pragma GCC unroll 16
    for (int t = 0; t < kPackedGroup; ++t) {
      __m512i lo = _mm512_setzero_si512(), hi = _mm512_setzero_si512();
      if (t < n) load(t, b / 2, lo, hi, pair);
      r[t] = lo;
      if (pair) _mm512_store_si512(spill[t], hi);
    }
    transpose16_epi32(r);
    for (int c = 0; c < 16; ++c) _mm512_store_si512(dst + (16 * b + c) * kPackedGroup, r[c]);
    if (!pair) break;
    for (int t = 0; t < kPackedGroup; ++t) r[t] = _mm512_load_si512(spill[t]);
    transpose16_epi32(r);
    for (int c = 0; c < 16; ++c) {
      _mm512_store_si512(dst + (16 * (b + 1) + c) * kPackedGroup, r[c]);
    }
  }
}

// w[r * w_stride + 16 g + i] = scale * q[r] . k[16 g + i] for NR query rows (bf16, stride D, in
// the packed tile's order) and G groups of the packed tile (D / 2 * 16 dwords apart).
template <int NR, int G, typename Step>
[[gnu::always_inline]] inline void score_rows_packed(const uint16_t* __restrict q,
                                                     const uint32_t* __restrict packed, int D,
                                                     float scale, float* __restrict w,
                                                     int w_stride, Step&& step) {
  if (D <= 0) __builtin_unreachable();  // as in score_block
  const int pairs = D / 2;
  __m512 acc[NR][G];
  for (int r = 0; r < NR; ++r) {
    for (int g = 0; g < G; ++g) acc[r][g] = _mm512_setzero_ps();
  }
  for (int j = 0; j < pairs; ++j) {
    if (j % kPackedStepPairs == 0) step();
    __m512i k[G];
    for (int g = 0; g < G; ++g) k[g] = _mm512_load_si512(packed + (g * pairs + j) * kPackedGroup);
    for (int r = 0; r < NR; ++r) {
      for (int g = 0; g < G; ++g) acc[r][g] = vdot_bf16_bcast(acc[r][g], k[g], q + r * D + 2 * j);
    }
  }
  const __m512 s = _mm512_set1_ps(scale);
  for (int r = 0; r < NR; ++r) {
    for (int g = 0; g < G; ++g) {
      _mm512_storeu_ps(w + r * w_stride + kPackedGroup * g, _mm512_mul_ps(acc[r][g], s));
    }
  }
}

#endif
