// The CPU paged-attention kernel, one source built once per ISA level (cpu/isa.h): included only
// by cpu/kernels_<level>.cpp, after cpu/kernel_levels.h (every header) and the level's
// `#pragma GCC target`, with PAGEDSPEC_CPU_LEVEL and PAGEDSPEC_CPU_NAMESPACE defined.
//
// A task is (sequence, KV heads, chunk of query rows, range of positions). A head's query rows are
// all query tokens x all query heads of its group, so each K/V row is read from memory once per
// task and used by every row. Positions are walked in tiles of kTile, and within a tile head after
// head (so a tile's cache tokens are read whole, see TilePrefetch): K rows are read
// straight from the cache and decoded in registers (CacheReader: bf16/fp16 conversions, FP8 as
// exactly CacheCodec::decode), scored against the rows in 4-row x 4-position blocks (5 x 2 at
// AVX2), folded into each row's online-softmax state (include/pagedspec/attention.h, the same
// helpers as the CUDA kernels), then the V rows are decoded and accumulated with the weights.
// What a row may not see (past its causal limit, or past seq_len) never enters its softmax or its
// accumulator, not even with a zero weight, so inf or NaN in unused slots or in a later draft
// token cannot reach it.
// The next tile's cache tokens are prefetched, in address order, while this tile is scored.
// On the AVX-512 level, bf16 tasks may instead score and accumulate with AMX tile multiplies
// (cpu/amx.h, AMX machines: the decode path, accumulators kept in tile layout, for decode and
// verification rows at head sizes up to 128; the many-row path above that) or with AVX512-BF16
// dot products (cpu_bf16_dot): row pairs in the lanes of 256-bit products for up to
// kLanesMaxRows rows (score_tile_lanes; 4 x 4 blocks on FP8 codes converted in registers), and
// for more rows (verification, wide GQA groups) a K tile packed pair-major once for all the rows
// (score_tile_packed, scores in lanes position by position) and V pairs built once per tile
// (accumulate_tile_packed). Tasks of several blocks of rows on the FMA path read an FP8 tile
// as the bf16 images of its codes converted once per tile (with VBMI at AVX-512, through F16C at
// AVX2; Workspace::fp8_images), instead of converting the codes as each block of rows reads them.
//
// The work comes from a split-KV plan (attention_plan.h): one task per (item, KV head); items of
// split sequences write a partial (acc, max, sum), merged afterwards with merge_softmax.
// attn_mass: a separate pass after the final LSE is known (see mass_pass), so the fast path pays
//     nothing for it.
#include "cpu/vec.h"

namespace pagedspec {
namespace PAGEDSPEC_CPU_NAMESPACE {
namespace {

// A std::vector allocator on cache-line boundaries, for buffers that 64-byte stores and tile
// loads go through row by row: a row across two lines costs two accesses.
template <typename T>
struct LineAligned {
  using value_type = T;
  LineAligned() = default;
  template <typename U>
  LineAligned(const LineAligned<U>&) {}
  T* allocate(size_t n) {
    return static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t(64)));
  }
  void deallocate(T* p, size_t) { ::operator delete(p, std::align_val_t(64)); }
  friend bool operator==(const LineAligned&, const LineAligned&) { return true; }
  friend bool operator!=(const LineAligned&, const LineAligned&) { return false; }
};

constexpr int kDefaultTile = 32;  // positions per tile (CpuPagedAttention::kTile)
constexpr int kMaxRows = kCpuAttentionRows;  // query rows (tokens x heads of a group) per task
constexpr int kMassTile = 256; // positions per attn_mass task
// Rows from which the AVX-512 level scores bf16 tiles with AMX tile multiplies (cpu/amx.h): a
// tile multiply computes 16 rows whatever the count, so below this the FMA path is as fast.
constexpr int kAmxMinRows = 8;
static_assert(kDefaultTile == kAmxTilePositions, "amx_accumulate takes one whole tile of values");
static_assert(kDefaultTile == kAmxDecodePositions, "the AMX decode calls take one tile");
// Rows from which the dot path scores FP8 codes through a packed K tile (score_tile_packed): its
// transposition costs a position as much as the sums of 4 x 4 blocks of 512-bit products for
// about 6 rows (D = 128), and 4-row decode tasks measured 5-10% slower through it than through
// those blocks (EPYC-VM, bf16), which score_tile_lanes has since replaced.
constexpr int kPackedMinRows = 8;
// Rows up to which the dot path scores bf16 rows through score_tile_lanes instead, which reads
// a task's K rows once per 4 rows (EPYC-VM, 1 thread): at 8 rows (decode at group 8, B=1
// ctx=4096) it beat the packed tile, 1.12-1.21 against 1.26-1.28 ms; at 12 rows (3 tokens at
// group 4, B=8 ctx=2048) it lost, 8.5 against 7.7-8.2.
constexpr int kLanesMaxRows = 8;
constexpr int kPackedGroup = 16;     // positions per group of the packed tile (a score register)
constexpr int kPackedStepPairs = 4;  // a head's bf16 pairs per prefetch step of score_rows_packed
// The AMX decode path raises a row's running max only when a tile's scores exceed it by more
// than this (log2 domain): weights up to 2^8 are exact enough in bf16 and float32 sums, and the
// accumulators, which live in tile layout, are rescaled about once per task instead of per tile.
constexpr float kAmxDecodeMaxSlack = 8.0f;
// The AMX decode path's tile states per task: enough for a task's kMaxRows rows.
constexpr int kAmxDecodeChunks = (kMaxRows + kAmxDecodeMaxRows - 1) / kAmxDecodeMaxRows;
// Query rows per score and value block. Each accumulator is one FMA latency chain, and two FMA
// pipes of 5-cycle latency (Zen 2) need 10 chains to stay busy: AVX2 takes 5 rows (5 x 2 score
// accumulators beside 4 key vectors and a query vector, 5 x 2 value accumulators), so a
// verification step's FMAs are no longer latency-bound at 80% of peak there; AVX-512 keeps 4
// (16 score accumulators).
constexpr int kRowBlock = PAGEDSPEC_CPU_LEVEL == 1 ? 5 : 4;
// Key rows per score block: with kRowBlock query rows, 16 (AVX-512, baseline: 4 x 4) or 10
// (AVX2: 5 x 2 in 16 registers) accumulators.
constexpr int kScoreTokens = PAGEDSPEC_CPU_LEVEL == 1 ? 2 : 4;
// Register vectors of a key row read per step (load_regs): AVX2 reads 16 elements at a time, so
// that a bf16 row takes one load per 16 (CacheReader::load_pair); every head size is a multiple
// of 16.
constexpr int kScoreStep = PAGEDSPEC_CPU_LEVEL == 1 ? 2 : 1;
// ... and per cache element type: bf16 rows at AVX-512 in steps of one load_pair too (32
// elements in even/odd order, a row's last 16 at D = 80, 112 as one natural vector); the other
// types there one vector a step.
template <typename Reader>
constexpr int kRowStep = Reader::kEvenOddPairs ? 2 : kScoreStep;

// out[r * out_stride + t] = q[r] . k[t] for NR query rows (stride D) and NT key rows read
// straight from the cache: each key vector is decoded once for all NR rows, each query vector
// loaded once for all NT keys. Always inlined: GCC's own choice flips with the size of the task
// loop around it, and decode ran 4% slower as a call.
template <int NR, int NT, typename CacheT, CacheFormat F>
[[gnu::always_inline]] inline void score_block(const float* __restrict q, const CacheT* const* k,
                                               const CacheReader<CacheT, F>& reader, int D,
                                               float* out, int out_stride) {
  // D > 0: told so that no path skips the loop with zeroed accumulators, which made GCC keep
  // all 16 in stack slots around the reduction (30 spill stores per block).
  if (D <= 0) __builtin_unreachable();
  rvec acc[NR][NT];
  for (int r = 0; r < NR; ++r) {
    for (int t = 0; t < NT; ++t) acc[r][t] = rzero();
  }
  constexpr int S = kRowStep<CacheReader<CacheT, F>>;
  // The whole steps' end as a bound, not a `d + step <= D` test: with that form GCC's FP8 score
  // loop, which takes no last vector, came out 5% slower.
  constexpr bool kLastVector = S * kRegLanes > kLanes;  // a step may overrun D by 16
  const int whole = kLastVector ? D - D % (S * kRegLanes) : D;
  int d = 0;
  for (; d < whole; d += S * kRegLanes) {
    rvec kv[NT][S];
    for (int t = 0; t < NT; ++t) load_regs<S>(reader, k[t] + d, kv[t]);
    for (int r = 0; r < NR; ++r) {
      for (int s = 0; s < S; ++s) {
        rvec qv = rload(q + r * D + d + s * kRegLanes);
        if constexpr (CacheReader<CacheT, F>::kEvenOddPairs) qv = in_register(qv);
        for (int t = 0; t < NT; ++t) acc[r][t] = rfma(qv, kv[t][s], acc[r][t]);
      }
    }
  }
  if constexpr (kLastVector) {  // AVX-512 bf16: a last 16 (D = 80, 112), natural order
    if (d < D) {
      rvec kv[NT];
      for (int t = 0; t < NT; ++t) kv[t] = load_reg(reader, k[t] + d);
      for (int r = 0; r < NR; ++r) {
        const rvec qv = rload(q + r * D + d);
        for (int t = 0; t < NT; ++t) acc[r][t] = rfma(qv, kv[t], acc[r][t]);
      }
    }
  }
#if PAGEDSPEC_CPU_LEVEL == 2
  if constexpr (NR == 4 && NT == 4) {
    store_rows4x4(sum16(&acc[0][0]), out, out_stride);
    return;
  }
#elif PAGEDSPEC_CPU_LEVEL == 1
  if constexpr (NT == 2 && NR >= 4) {  // the first 4 rows' sums at once (acc is row-major)
    store_rows4x2(sum8(&acc[0][0]), out, out_stride);
    for (int r = 4; r < NR; ++r) {
      for (int t = 0; t < NT; ++t) out[r * out_stride + t] = rsum(acc[r][t]);
    }
    return;
  }
#endif
  for (int r = 0; r < NR; ++r) {
    for (int t = 0; t < NT; ++t) out[r * out_stride + t] = rsum(acc[r][t]);
  }
}

// acc[r][d0 .. d0 + C * kRegLanes) += sum_t w[r][t] * v[t][same] for NR rows: NR x C
// accumulators stay in registers across the n value rows, so each weight is broadcast once per
// C vectors and each V vector is decoded once for all NR rows. With few accumulators a second set
// (odd positions) keeps the FMA latency chains from limiting the loop. step() once per position
// (PrefetchSteps).
template <int NR, int C, typename CacheT, CacheFormat F, typename Step>
[[gnu::always_inline]] inline void accumulate_span(float* __restrict acc,
                                                   const float* __restrict w,
                                                   const CacheT* const* v,
                                                   const CacheReader<CacheT, F>& reader, int n,
                                                   int D, int w_stride, int d0, Step&& step) {
  constexpr bool kTwoSets = NR * C < 8;
  rvec a[NR][C], b[NR][C];
  for (int r = 0; r < NR; ++r) {
    for (int c = 0; c < C; ++c) {
      a[r][c] = rload(acc + r * D + d0 + c * kRegLanes);
      b[r][c] = rzero();
    }
  }
  int t = 0;
  if constexpr (kTwoSets) {
    for (; t + 2 <= n; t += 2) {
      step();
      step();
      rvec v0[C], v1[C];
      load_regs<C>(reader, v[t] + d0, v0);
      load_regs<C>(reader, v[t + 1] + d0, v1);
      for (int r = 0; r < NR; ++r) {
        const rvec w0 = rset1(w[r * w_stride + t]);
        const rvec w1 = rset1(w[r * w_stride + t + 1]);
        for (int c = 0; c < C; ++c) {
          a[r][c] = rfma(w0, v0[c], a[r][c]);
          b[r][c] = rfma(w1, v1[c], b[r][c]);
        }
      }
    }
  }
  for (; t < n; ++t) {
    step();
    rvec v0[C];
    load_regs<C>(reader, v[t] + d0, v0);
    for (int r = 0; r < NR; ++r) {
      const rvec w0 = rset1(w[r * w_stride + t]);
      for (int c = 0; c < C; ++c) a[r][c] = rfma(w0, v0[c], a[r][c]);
    }
  }
  for (int r = 0; r < NR; ++r) {
    for (int c = 0; c < C; ++c) {
      rvec sum = a[r][c];
      if constexpr (kTwoSets) sum = radd(sum, b[r][c]);
      rstore(acc + r * D + d0 + c * kRegLanes, sum);
    }
  }
}

// Vectors of D per accumulate_span pass: 4 rows x 4 accumulators fit AVX-512's 32 registers
// with the value and weight vectors, 5 x 2 AVX2's 16 (a pair from load_regs, so D, a multiple
// of 16, needs no single-vector rest there); the baseline's vectors are SSE arrays.
constexpr int kValueSpan = PAGEDSPEC_CPU_LEVEL == 2 ? 4 : (PAGEDSPEC_CPU_LEVEL == 1 ? 2 : 1);
static_assert(kValueSpan == kScoreStep || PAGEDSPEC_CPU_LEVEL != 1,
              "AVX2's value spans and score steps are both one load_pair");

// acc[r] += sum_t w[r][t] * v[t] for NR rows (acc stride D, w stride w_stride) over n value rows
// read straight from the cache, in spans of kValueSpan vectors, then (bf16 at AVX-512) a span of
// one load_pair, then single vectors: every whole 32 of D in even/odd order, as the score steps
// read it.
template <int NR, typename CacheT, CacheFormat F, typename Step>
inline void accumulate_block(float* __restrict acc, const float* __restrict w,
                             const CacheT* const* v, const CacheReader<CacheT, F>& reader, int n,
                             int D, int w_stride, Step&& step) {
  constexpr int kSpan = kValueSpan * kRegLanes;
  int d = 0;
  for (; d + kSpan <= D; d += kSpan) {
    accumulate_span<NR, kValueSpan>(acc, w, v, reader, n, D, w_stride, d, step);
  }
  constexpr int S = kRowStep<CacheReader<CacheT, F>>;
  static_assert(kValueSpan % S == 0, "value spans are whole load_pairs");
  if constexpr (S > 1 && kValueSpan > S) {
    for (; d + S * kRegLanes <= D; d += S * kRegLanes) {
      accumulate_span<NR, S>(acc, w, v, reader, n, D, w_stride, d, step);
    }
  }
  for (; d < D; d += kRegLanes) accumulate_span<NR, 1>(acc, w, v, reader, n, D, w_stride, d, step);
}

#if PAGEDSPEC_CPU_LEVEL == 2
// The bf16 dot-product path (cpu_bf16_dot: AVX512-BF16, bf16 queries on a bf16 cache or on
// the bf16 images of an FP8 cache's codes, D a multiple of 32). A register holds 32 bf16, and
// each vdpbf16ps adds two exact products per float32 lane, so a score takes half the
// instructions of the FMA path and bf16 K rows are read as stored, not widened. With D a
// multiple of 64, FP8 codes are converted in registers as they are read (score_block_fp8_dot,
// accumulate_block_fp8_dot); otherwise through images in the workspace (fp8_images_as_bf16).

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

// The dot path's accumulators pair two positions per lane: each 32-bit lane of a value vector
// holds the bf16 of v[t] and v[t + 1] at one dimension, against the weight pair (w[t], w[t + 1]).
// acc[r] (the path's layout) [d0, d0 + 16 NV) += sum_t w[r][t] * v[t] for NR rows over n positions,
// w the weights as bf16 bits (stride w_stride); load_pairs(t, pair, vectors) gives the NV value
// vectors of positions t and t + 1 (t alone if !pair: its partner must read as zeros). An odd last
// position pairs with zeros and a zero weight: the row after it may be past a row's limit, so it is
// never read. step() once per position (PrefetchSteps).
template <int NR, int NV, typename LoadPairs, typename Step>
[[gnu::always_inline]] inline void accumulate_pairs_dot(float* __restrict acc,
                                                        const uint16_t* __restrict w, int n, int D,
                                                        int w_stride, int d0,
                                                        LoadPairs&& load_pairs, Step&& step) {
  __m512 a[NR][NV];
  for (int r = 0; r < NR; ++r) {
    for (int j = 0; j < NV; ++j) a[r][j] = _mm512_loadu_ps(acc + r * D + d0 + 16 * j);
  }
  const auto pair_step = [&](int t, bool pair) {
    __m512i vectors[NV];
    load_pairs(t, pair, vectors);
    for (int r = 0; r < NR; ++r) {
      const uint16_t* wr = w + r * w_stride + t;
      uint32_t bits = wr[0];
      if (pair) std::memcpy(&bits, wr, sizeof(bits));  // (w[t], w[t + 1]), little-endian
      const __m512i wp = _mm512_set1_epi32(int(bits));
      for (int j = 0; j < NV; ++j) a[r][j] = vdot_bf16(a[r][j], wp, vectors[j]);
    }
  };
  int t = 0;
  for (; t + 2 <= n; t += 2) {
    step();
    step();
    pair_step(t, true);
  }
  if (t < n) {
    step();
    pair_step(t, false);
  }
  for (int r = 0; r < NR; ++r) {
    for (int j = 0; j < NV; ++j) _mm512_storeu_ps(acc + r * D + d0 + 16 * j, a[r][j]);
  }
}

// bf16 rows: v[t] and v[t + 1] interleaved 16 bits at a time (unpacklo / unpackhi within each
// 128-bit lane). So within each 32 dimensions of a row, the first 16 floats hold dimensions 0-3,
// 8-11, 16-19, 24-27 and the second 16 the others; dot_to_natural puts a row back in order.
struct DotLayout {
  alignas(64) int first[16];   // natural dimension j < 16: its lane in (first, second) as 0..31
  alignas(64) int second[16];  // natural dimension 16 + j
};
constexpr DotLayout make_dot_layout() {
  DotLayout t{};
  for (int j = 0; j < 32; ++j) {
    const int lane128 = j / 8, m = j % 8;
    const int src = m < 4 ? 4 * lane128 + m : 16 + 4 * lane128 + (m - 4);
    (j < 16 ? t.first[j] : t.second[j - 16]) = src;
  }
  return t;
}

inline void dot_to_natural(float* __restrict row, int D) {
  static constexpr DotLayout kLayout = make_dot_layout();
  const __m512i first = _mm512_load_si512(kLayout.first);
  const __m512i second = _mm512_load_si512(kLayout.second);
  for (int d = 0; d < D; d += 32) {
    const __m512 lo = _mm512_loadu_ps(row + d), hi = _mm512_loadu_ps(row + d + 16);
    _mm512_storeu_ps(row + d, _mm512_permutex2var_ps(lo, first, hi));
    _mm512_storeu_ps(row + d + 16, _mm512_permutex2var_ps(lo, second, hi));
  }
}

// The dot path's value vectors of positions t and t + 1 from bf16 rows v (t alone if !pair, its
// partner read as zeros): dimensions [d, d + 32) as out[0] (unpacklo) and out[1] (unpackhi).
[[gnu::always_inline]] inline void bf16_value_pair(const uint16_t* const* v, int t, bool pair,
                                                   int d, __m512i* out) {
  const __m512i v0 = _mm512_loadu_si512(v[t] + d);
  const __m512i v1 = pair ? _mm512_loadu_si512(v[t + 1] + d) : _mm512_setzero_si512();
  out[0] = _mm512_unpacklo_epi16(v0, v1);
  out[1] = _mm512_unpackhi_epi16(v0, v1);
}

// accumulate_pairs_dot over bf16 rows: spans of 64 dimensions (4 rows x 4 accumulators), then 32.
template <int NR, int C, typename Step>
[[gnu::always_inline]] inline void accumulate_span_dot(float* __restrict acc,
                                                       const uint16_t* __restrict w,
                                                       const uint16_t* const* v, int n, int D,
                                                       int w_stride, int d0, Step&& step) {
  accumulate_pairs_dot<NR, 2 * C>(
      acc, w, n, D, w_stride, d0,
      [&](int t, bool pair, __m512i* out) {
        for (int c = 0; c < C; ++c) bf16_value_pair(v, t, pair, d0 + 32 * c, out + 2 * c);
      },
      step);
}
template <int NR, typename Step>
inline void accumulate_block_dot(float* __restrict acc, const uint16_t* __restrict w,
                                 const uint16_t* const* v, int n, int D, int w_stride,
                                 Step&& step) {
  int d = 0;
  for (; d + 64 <= D; d += 64) accumulate_span_dot<NR, 2>(acc, w, v, n, D, w_stride, d, step);
  for (; d < D; d += 32) accumulate_span_dot<NR, 1>(acc, w, v, n, D, w_stride, d, step);
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

// The same tables in registers, for lookup128_bytes (VBMI: callers check cpu_avx512_vbmi()).
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

// The dot path's value vectors of positions t and t + 1 from FP8 rows v (t alone if !pair, its
// partner read as code 0, +0): dimensions [d, d + 64) as out[0..3], the codes interleaved byte by
// byte, then converted (fp8_images_in_lanes), so each 32-bit lane pairs their images of one
// dimension.
[[gnu::always_inline]] inline void fp8_value_pair(const uint8_t* const* v, int t, bool pair, int d,
                                                  const Fp8ImageLookup& lookup, __m512i* out) {
  const __m512i c0 = _mm512_loadu_si512(v[t] + d);
  const __m512i c1 = pair ? _mm512_loadu_si512(v[t + 1] + d) : _mm512_setzero_si512();
  fp8_images_in_lanes(_mm512_unpacklo_epi8(c0, c1), lookup, out[0], out[1]);
  fp8_images_in_lanes(_mm512_unpackhi_epi8(c0, c1), lookup, out[2], out[3]);
}

// accumulate_pairs_dot on FP8 V rows (D a multiple of 64), 64 dimensions at a time through
// fp8_value_pair. Vector k's 128-bit lane L holds dimensions 16 L + 4 k .. + 3;
// fp8_dot_to_natural reorders.
template <int NR, typename Step>
inline void accumulate_block_fp8_dot(float* __restrict acc, const uint16_t* __restrict w,
                                     const uint8_t* const* v, int n, int D, int w_stride,
                                     const Fp8ImageLookup& lookup, Step&& step) {
  for (int d0 = 0; d0 < D; d0 += 64) {
    accumulate_pairs_dot<NR, 4>(
        acc, w, n, D, w_stride, d0,
        [&](int t, bool pair, __m512i* out) { fp8_value_pair(v, t, pair, d0, lookup, out); },
        step);
  }
}

// Each 64 floats of a row in accumulate_block_fp8_dot's layout back in dimension order: a 4 x 4
// transpose of 128-bit blocks (natural block 4 L + k is block L of vector k).
inline void fp8_dot_to_natural(float* __restrict row, int D) {
  for (int d = 0; d < D; d += 64) {
    const __m512 a0 = _mm512_loadu_ps(row + d), a1 = _mm512_loadu_ps(row + d + 16);
    const __m512 a2 = _mm512_loadu_ps(row + d + 32), a3 = _mm512_loadu_ps(row + d + 48);
    const __m512 t0 = _mm512_shuffle_f32x4(a0, a1, 0x44), t1 = _mm512_shuffle_f32x4(a2, a3, 0x44);
    const __m512 t2 = _mm512_shuffle_f32x4(a0, a1, 0xEE), t3 = _mm512_shuffle_f32x4(a2, a3, 0xEE);
    _mm512_storeu_ps(row + d, _mm512_shuffle_f32x4(t0, t1, 0x88));
    _mm512_storeu_ps(row + d + 16, _mm512_shuffle_f32x4(t0, t1, 0xDD));
    _mm512_storeu_ps(row + d + 32, _mm512_shuffle_f32x4(t2, t3, 0x88));
    _mm512_storeu_ps(row + d + 48, _mm512_shuffle_f32x4(t2, t3, 0xDD));
  }
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

// P.V for the same tasks on a tile every row sees whole (accumulate_tile_packed): the V rows of
// each position pair interleaved once for all the rows into the vectors accumulate_span_dot and
// accumulate_block_fp8_dot build per block of 4 rows (so the accumulators keep their layout), then
// acc[r] (stride D) [d0, d0 + 16 NV) += sum over pairs p of (w[r][2p], w[r][2p + 1]) . vector
// d0 / 16 + j of pair p, for NR rows (w: bf16 weights, stride w_stride; vectors: D / 16 per pair).
template <int NR, int NV>
[[gnu::always_inline]] inline void accumulate_paired_values(float* __restrict acc,
                                                            const uint16_t* __restrict w,
                                                            int w_stride,
                                                            const __m512i* __restrict vectors,
                                                            int pairs, int D, int d0) {
  if (pairs <= 0) __builtin_unreachable();
  const int per_pair = D / 16;
  __m512 a[NR][NV];
  for (int r = 0; r < NR; ++r) {
    for (int j = 0; j < NV; ++j) a[r][j] = _mm512_loadu_ps(acc + r * D + d0 + 16 * j);
  }
  for (int p = 0; p < pairs; ++p) {
    __m512i v[NV];
    for (int j = 0; j < NV; ++j) v[j] = _mm512_load_si512(vectors + p * per_pair + d0 / 16 + j);
    for (int r = 0; r < NR; ++r) {
      for (int j = 0; j < NV; ++j) a[r][j] = vdot_bf16_bcast(a[r][j], v[j], w + r * w_stride + 2 * p);
    }
  }
  for (int r = 0; r < NR; ++r) {
    for (int j = 0; j < NV; ++j) _mm512_storeu_ps(acc + r * D + d0 + 16 * j, a[r][j]);
  }
}
#endif

// The cache lines of the next tile, asked for a few at a time while the current one is worked
// on, in address order. A KV head's rows are D * elem_size bytes, 2-4 KB apart and scattered by
// the block table. On an AVX2 Zen 2 core, reading every head's rows of a 16-position tile, head
// after head, ran at 8 GB/s with each head's next rows prefetched as they were read, and at
// 14.5 GB/s with the same lines prefetched in address order (its plain streaming read: 15.4).
// The ranges are of the K cache; the V cache, of the same layout, is prefetched at the same
// offsets.
struct TilePrefetch {
  static constexpr int kMaxRuns = 64;  // >= positions per tile: at worst one range per position
  const char* k = nullptr;
  int64_t v_delta = 0;  // V address - K address, for the same element
  bool values = false;  // also the V lines
  uintptr_t begin[kMaxRuns], end[kMaxRuns];  // line-aligned K addresses, ascending ranges
  int num_runs = 0, run = 0;
  uintptr_t cur = 0;
  int lines_per_step = 0;

  void clear() { num_runs = run = 0; }
  // Adds the K bytes [k + off, + bytes) (bytes > 0), merged into the last range where they
  // continue it: a block the table places lower in memory starts a range of its own.
  void add(int64_t off, int64_t bytes) {
    const uintptr_t lo = (uintptr_t(k) + uintptr_t(off)) & ~uintptr_t(63);
    const uintptr_t hi = uintptr_t(k) + uintptr_t(off + bytes);
    if (num_runs > 0 && lo >= begin[num_runs - 1] && lo <= end[num_runs - 1]) {
      end[num_runs - 1] = std::max(end[num_runs - 1], hi);
    } else {
      begin[num_runs] = lo;
      end[num_runs++] = hi;
    }
  }
  // Spreads the lines over `steps` calls of step(), from the first range.
  void pace(int steps) {
    int64_t lines = 0;
    for (int i = 0; i < num_runs; ++i) lines += int64_t(end[i] - begin[i] + 63) / 64;
    lines_per_step = steps > 0 ? int((lines + steps - 1) / steps) : int(lines);
    run = 0;
    cur = num_runs > 0 ? begin[0] : 0;
  }
  // Asks for the n lines from `cur` on, all inside the current range, and moves past them.
  // One tight loop: per line, run checks cost more than the prefetches (callgrind: 12
  // instructions a line).
  [[gnu::always_inline]] void take(int64_t n) {
    const char* p = reinterpret_cast<const char*>(cur);
    for (int64_t i = 0; i < n; ++i) {
      __builtin_prefetch(p + 64 * i, 0, 2);
      if (values) __builtin_prefetch(p + 64 * i + v_delta, 0, 2);
    }
    cur += uintptr_t(64 * n);
  }
  // Asks for up to `lines` more lines (of K, and of V if `values`).
  void advance(int64_t lines) {
    while (lines > 0 && run < num_runs) {
      const int64_t n = std::min(lines, int64_t(end[run] - cur + 63) / 64);
      take(n);
      lines -= n;
      if (cur >= end[run] && ++run < num_runs) cur = begin[run];
    }
  }
  // advance(lines_per_step), inline where the lines stay in the current range: the steps run
  // inside loops whose accumulators live in vector registers, which a call (every one of them
  // caller-saved) would spill.
  [[gnu::always_inline]] void step() {
    if (run >= num_runs) return;
    if (cur + uintptr_t(64 * lines_per_step) >= end[run]) {
      advance(lines_per_step);
      return;
    }
    take(lines_per_step);
  }
  // step() as the AMX decode functions call it, between their tile operations.
  AmxPrefetchStep tile_step() {
    return AmxPrefetchStep{[](void* self) { static_cast<TilePrefetch*>(self)->step(); }, this};
  }
  void drain() { advance(INT64_MAX); }
};

// The P.V loops' prefetch steps: one per position and pass over D, or none (null).
struct PrefetchSteps {
  TilePrefetch* pf;
  void operator()() const {
    if (pf != nullptr) pf->step();
  }
};

inline void scale_row(float* __restrict y, float a, int n) {
#pragma omp simd
  for (int i = 0; i < n; ++i) y[i] *= a;
}

// Whether a row of D query elements holds a NaN, from the bits (exponent all ones, mantissa not
// zero), so that it vectorizes the same for every element type and level. The epilogues make such
// a row's out, lse and attn_mass NaN, whatever a path's inner loops made of its NaN scores.
template <typename QT>
inline bool row_has_nan(const QT* row, int D) {
  if constexpr (sizeof(QT) == 4) {
    const uint32_t* bits = reinterpret_cast<const uint32_t*>(row);
    uint32_t worst = 0;
#pragma omp simd reduction(max : worst)
    for (int d = 0; d < D; ++d) worst = std::max(worst, bits[d] & 0x7fffffffu);
    return worst > 0x7f800000u;
  } else {
    static_assert(sizeof(QT) == 2, "half, bfloat16 or float queries");
    constexpr uint16_t kInf = std::is_same_v<QT, c10::Half> ? 0x7c00 : 0x7f80;
    const uint16_t* bits = reinterpret_cast<const uint16_t*>(row);
    uint16_t worst = 0;
#pragma omp simd reduction(max : worst)
    for (int d = 0; d < D; ++d) worst = std::max(worst, uint16_t(bits[d] & 0x7fff));
    return worst > kInf;
  }
}

// One unit of work. Rows are numbered within the sequence as row = j * G + g for query token j
// and head g of the group, so the rows of one query token are adjacent.
struct Task {
  int seq;
  int kv_head;    // the first KV head
  int num_heads;  // KV heads [kv_head, kv_head + num_heads)
  int row_begin;
  int num_rows;
  int pos_begin;
  int pos_end;
  int partition;  // v2 partition index (0 for v1)
};

// Where a row's query lives and what it may see.
struct RowInfo {
  int token;  // index into query / out / lse
  int head;   // query head
  int limit;  // last visible position (inclusive)
};

template <typename QT, typename CacheT, CacheFormat F>
class CpuPagedAttention {
  using Reader = CacheReader<CacheT, F>;
  // The images an FP8 tile is read through on the FMA path (fp8_image_rows: bf16, exact), their
  // reader, and the head sizes they take.
  using ImageT = c10::BFloat16;
  using ImageReader = CacheReader<ImageT, CacheFormat::kNative>;
  static constexpr ImageReader kImageReader{};
  static constexpr int kImageStep = PAGEDSPEC_CPU_LEVEL == 2 ? 32 : kLanes;
  // The most row blocks a task converts FP8 codes for in registers; beyond, images. One block
  // (decode at group 4) converts each code once either way. AVX2 keeps two: an 8-row task
  // (5 + 3) ran 12.8 ms through images against 12.0, a 12-row one 16.1 against 17.9 (e4m3, B=8
  // ctx=2048, Zen 4 held to avx2); at AVX-512 8 rows (4 + 4) gained, 9.0-9.3 against 9.9-10.0.
  static constexpr int kImageMinBlocks = PAGEDSPEC_CPU_LEVEL == 1 ? 2 : 1;
  // Positions per tile, and so how far ahead the next tile's cache tokens are prefetched: on an
  // AVX2-only Zen 2 every prefetch fills L1, and the next 32 tokens of 8 heads (128 KB in bf16)
  // streamed through it evicted one another and the rows in use before they were read. 16 made
  // bf16 decode 1.5x faster from DRAM there (8 slower, with the online-softmax work per tile).
  // The AVX-512 level keeps 32 (its AMX tiles take 32; Intel's and Zen 4's prefetcht1 fill L2).
  static constexpr int kTile = PAGEDSPEC_CPU_LEVEL == 1 ? kDefaultTile / 2 : kDefaultTile;

 public:
  explicit CpuPagedAttention(const PagedAttentionParams<QT, CacheT>& p)
      : p_(p), bf16_dot_(kDotCapable && p.head_size % 32 == 0 &&
                  cpu_bf16_dot()),
        fp8_images_(F != CacheFormat::kNative && PAGEDSPEC_CPU_LEVEL >= 1 &&
                    p.head_size % kImageStep == 0 &&
                    cpu_fp8_images(PAGEDSPEC_CPU_LEVEL == 2 ? CpuIsa::kAvx512 : CpuIsa::kAvx2)) {}

  RowInfo row_info(int seq, int kv_head, int row) const {
    const int G = p_.group_size();
    const int first = p_.cu_seqlens_q[seq];
    const int q_len = p_.cu_seqlens_q[seq + 1] - first;
    const int j = row / G;
    return RowInfo{first + j, kv_head * G + row % G, causal_limit(p_.seq_lens[seq], q_len, j)};
  }

  // Per-thread scratch for one KV head's rows, sized for head_size.
  struct Workspace {
    int head_size;
    std::vector<float> q, acc, w;
    std::vector<uint16_t> q_vnni;  // the AMX path's query rows (amx_pack_queries), if taken
    bool amx = false;              // this task's scores come from amx_scores
    // The AMX decode path's states, kAmxDecodeChunks of them (attend_item_amx_decode).
    std::unique_ptr<AmxDecode[]> decode;
    bool amx_decode = false;  // this task runs that path
    // The dot path's query rows ([rows, D] bf16 bits) and weights ([rows, kTile] bf16 bits).
    std::vector<uint16_t> q_bf16, w_bf16;
    // ... and for tasks that score through score_tile_lanes (uses_score_lanes), the query rows
    // in row pairs instead (lane_pair_queries).
    std::vector<uint16_t> q_lanes;
    bool dot = false;              // this task runs the bf16 dot-product path
    bool dot_fp8 = false;          // ... on FP8 codes converted in registers (no images)
    std::vector<RowInfo> rows;
    std::vector<SoftmaxState> state;
    std::vector<int> visible;
    const CacheT* krows[kTile];
    const CacheT* vrows[kTile];
    CacheReader<CacheT, F> kreader, vreader;
    const uint16_t* const* dot_vrows = nullptr;  // the dot path: this tile's V rows as bf16
    // The FMA path reads this task's FP8 K and V tiles as images (fp8_image_rows: converted
    // once per tile, then read as a bf16 cache is) instead of converting the codes
    // for every block of rows, which the 20 rows of a 5-token draft at group 4 did 5 times at
    // AVX-512 and 4 at AVX2. v_images: this tile's V rows there.
    bool fp8_images = false;
    const ImageT* const* v_images = nullptr;
    bool acc_even_odd = false;  // acc rows in load_pair's even/odd order (set_acc_order)
    float score_factor = 1.0f;  // the FMA path's scores' power of two (fma_score_factor)

    explicit Workspace(int D)
        : head_size(D), q(size_t(kMaxRows) * D), acc(size_t(kMaxRows) * D),
          w(size_t(kMaxRows) * kTile), rows(kMaxRows), state(kMaxRows), visible(kMaxRows) {}
  };

  // The AMX score path: bf16 queries on a bf16 or FP8 cache on the AVX-512 level, with enough
  // rows per key.
  static constexpr bool kAmxCapable =
      PAGEDSPEC_CPU_LEVEL == 2 && std::is_same_v<QT, c10::BFloat16> &&
      (F != CacheFormat::kNative || std::is_same_v<CacheT, c10::BFloat16>);
  bool use_amx(int R) const {
    if constexpr (kAmxCapable) {
      // FP8 codes reach the tiles through fp8_images_as_bf16 (VBMI; every AMX CPU has it).
      return R >= kAmxMinRows && p_.head_size % kAmxDims == 0 && amx_available() &&
             (F == CacheFormat::kNative || cpu_avx512_vbmi());
    } else {
      return false;
    }
  }

  // The bf16 dot-product path takes the AMX path's operands: bf16 queries on a bf16 cache, or on
  // an FP8 one through the bf16 images of its codes (bf16_rows).
  static constexpr bool kDotCapable = kAmxCapable;
  // Chooses a task's path: AMX tile multiplies, the bf16 dot products or the FMA path.
  void choose_path(Workspace& ws, int R) const {
    ws.amx = use_amx(R);
    set_dot(ws, bf16_dot_ && !ws.amx, R);
  }
  // ... and whether R rows on the FMA path read FP8 tiles as images: where more blocks of rows
  // than kImageMinBlocks would convert each code.
  void set_dot(Workspace& ws, bool dot, int R) const {
    ws.dot = dot;
    ws.fp8_images = fp8_images_ && !dot && R > kImageMinBlocks * kRowBlock;
    // FP8 codes converted as they are read where D allows (score_block_fp8_dot), else images.
    // Converting them once per block of 4 rows, not once per tile, is no slower for the 20 rows
    // of a 5-token draft at group 4 (A/B: 14.4 against 14.5 ms at B=8 ctx=2048, 1 thread).
    ws.dot_fp8 = dot && dot_fp8_codes();
    if (!dot) return;
    ws.q_bf16.resize(size_t(kMaxRows) * p_.head_size);
    ws.q_lanes.resize(size_t(kMaxRows) * p_.head_size);
    ws.w_bf16.resize(size_t(kMaxRows) * kTile);
  }

  // Whether the dot path reads FP8 codes converted in registers (else bf16 rows: a bf16 cache's,
  // or an FP8 cache's images).
  bool dot_fp8_codes() const { return F != CacheFormat::kNative && p_.head_size % 64 == 0; }
  // The dot path's scores for R rows: from bf16 rows through score_tile_lanes up to
  // kLanesMaxRows rows, then through a packed tile (score_tile_packed), as are FP8 codes from
  // kPackedMinRows rows; the P.V of packed tiles builds its V pairs once (accumulate_tile_packed).
  static bool uses_score_lanes(const Workspace& ws, int R) {
    return kDotCapable && ws.dot && !ws.dot_fp8 && R <= kLanesMaxRows;
  }
  static bool scores_packed(int R, bool fp8_codes) {
    return fp8_codes ? R >= kPackedMinRows : R > kLanesMaxRows;
  }

  // The AMX decode path (attend_item_amx_decode) for a plan item: bf16 queries on a bf16 or FP8
  // cache and a head size the accumulator tiles hold. Decode and verification rows alike: the
  // rows go to tile states of up to kAmxDecodeMaxRows each, and positions past some rows' causal
  // limits take vector FMAs.
  bool use_amx_decode() const {
    if constexpr (kAmxCapable) {
      return p_.head_size % 32 == 0 && p_.head_size <= kAmxDecodeMaxDims &&
             amx_decode_available() && (F == CacheFormat::kNative || cpu_avx512_vbmi());
    } else {
      return false;
    }
  }

  // Packs the task's query rows for amx_scores (unscaled bf16: the scale is applied to the
  // float32 scores, so the products are exact as on the FMA path) and configures the tiles.
  void begin_amx(Workspace& ws, int R) const {
    const uint16_t* rows[kMaxRows];
    tile_operands(ws, R, rows);
    ws.q_vnni.resize(size_t(kMaxRows) * p_.head_size);
    amx_pack_queries(rows, R, p_.head_size, ws.q_vnni.data());
    amx_begin();
  }

  // What both AMX paths read: the task's R query rows as bf16 bits (rows[r], ws.rows located).
  void tile_operands(Workspace& ws, int R, const uint16_t** rows) const {
    for (int r = 0; r < R; ++r) rows[r] = reinterpret_cast<const uint16_t*>(query_row(ws.rows[r]));
  }

  // The bf16 images of one tile's FP8 K and V rows, [kTile, D] each (bf16_rows): one pair per
  // thread, shared by all heads, since every path consumes a head's images before it converts
  // the next head's. Per-head pairs (16 KB a head at D = 128, 8 heads to a decode task) left L1
  // and made every image store a miss, and a vector's 16-byte alignment split each 64-byte row
  // access across two lines: FP8 decode at B=8 ctx=2048 on SPR-VM's AMX path took 4.3-4.8 ms
  // against 3.0-3.3.
  enum class Operand { kKeys, kValues };
  struct TileImages {
    std::vector<uint16_t, LineAligned<uint16_t>> k, v;
    const uint16_t* k_rows[kTile];
    const uint16_t* v_rows[kTile];
  };
  static TileImages& tile_images(int D) {
    static thread_local TileImages images;
    images.k.resize(size_t(kTile) * D);
    images.v.resize(size_t(kTile) * D);
    return images;
  }

  // Rows [first, first + n) of `rows` (keys or values) as the bf16 rows the tile multiplies, the
  // dot path and the FMA path's FP8 images (fp8_image_rows) read: a bf16 cache's in place; an FP8
  // cache's converted into the thread's TileImages as the bf16 bits of their images (the values
  // CacheReader reads, so the scale folds in as on the FMA path): at AVX-512 by VBMI lookups
  // (fp8_images_as_bf16), at AVX2 as CacheReader::load16's floats cut to their high halves,
  // exactly. Valid until the next call for the same operand.
  const uint16_t* const* bf16_rows(const CacheT* const* rows, int first, int n,
                                   const Reader& reader, Operand which) const {
    if constexpr (F == CacheFormat::kNative) {
      return reinterpret_cast<const uint16_t* const*>(rows + first);
    } else {
      TileImages& images = tile_images(p_.head_size);
      const bool keys = which == Operand::kKeys;
      const uint16_t** out = keys ? images.k_rows : images.v_rows;
      uint16_t* buf = (keys ? images.k : images.v).data() + size_t(first) * p_.head_size;
#if PAGEDSPEC_CPU_LEVEL == 2
      fp8_images_as_bf16(reinterpret_cast<const uint8_t* const*>(rows) + first, n, p_.head_size,
                         fp8_bytes(reader), buf, out + first);
#elif PAGEDSPEC_CPU_LEVEL == 1
      const int D = p_.head_size;
      for (int t = 0; t < n; ++t) {
        uint16_t* row = buf + size_t(t) * D;
        for (int d = 0; d < D; d += kLanes) {
          const vfloat x = reader.load16(rows[first + t] + d);
          const __m256i lo = _mm256_srli_epi32(_mm256_castps_si256(x.lo), 16);
          const __m256i hi = _mm256_srli_epi32(_mm256_castps_si256(x.hi), 16);
          // packus interleaves the 128-bit lanes (lo 0-3, hi 0-3, lo 4-7, hi 4-7); 0xD8 undoes it.
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(row + d),
                              _mm256_permute4x64_epi64(_mm256_packus_epi32(lo, hi), 0xD8));
        }
        out[first + t] = row;
      }
#else
      (void)rows, (void)n, (void)reader, (void)buf;
#endif
      return out + first;
    }
  }

#if PAGEDSPEC_CPU_LEVEL == 2
  // The FP8 image bytes of format F (reader initialized): every reader of the format holds the
  // same table, so its bytes are split once.
  static const Fp8ImageBytes& fp8_bytes(const Reader& reader) {
    static const Fp8ImageBytes kBytes = fp8_image_bytes(reader.table);
    return kBytes;
  }
  // The in-register conversion's tables in registers, if this task converts FP8 codes there.
  static std::optional<Fp8ImageLookup> fp8_lookup(const Workspace& ws, const Reader& reader) {
    if constexpr (F != CacheFormat::kNative) {
      if (ws.dot_fp8) return Fp8ImageLookup(fp8_bytes(reader));
    }
    return std::nullopt;
  }
  static const uint8_t* const* as_codes(const CacheT* const* rows) {
    return reinterpret_cast<const uint8_t* const*>(rows);
  }
#endif

  // Rows [0, n) of an FP8 tile's K or V rows as the bf16 images the FMA path reads as it reads a
  // bf16 cache (in even/odd order; Workspace::fp8_images). bf16 rather than float32 images: at
  // AVX2 a bf16 cache's q=5 ran 21 ms through its own rows and 25 ms through float32 copies.
  const ImageT* const* fp8_image_rows(const CacheT* const* rows, int n, const Reader& reader,
                                      Operand which) const {
    return reinterpret_cast<const ImageT* const*>(bf16_rows(rows, 0, n, reader, which));
  }

  // Sets pf to the cache lines of positions [first, first + n) of sequence seq, for KV heads
  // [kv_head, kv_head + num_heads) (adjacent in a cache token) of K, and of V if `values`, paced
  // over `steps` calls of pf.step().
  void plan_prefetch(TilePrefetch& pf, int seq, int first, int n, int kv_head, int num_heads,
                     bool values, int steps) const {
    static_assert(kTile <= TilePrefetch::kMaxRuns, "a tile's ranges fit the prefetch");
    pf.k = reinterpret_cast<const char*>(p_.key_cache);
    pf.v_delta = reinterpret_cast<const char*>(p_.value_cache) - pf.k;
    pf.values = values;
    pf.clear();
    const int64_t bytes = int64_t(num_heads) * p_.head_size * int64_t(sizeof(CacheT));
    for (int pos = first; pos < first + n; ++pos) {
      pf.add(p_.cache_offset(seq, pos, kv_head) * int64_t(sizeof(CacheT)), bytes);
    }
    pf.pace(steps);
  }
  // The first tile of a task, for all its heads.
  void plan_first_tile(TilePrefetch& pf, const Task& task, int steps) const {
    const int n = std::min(kTile, task_pos_end(task) - task.pos_begin);
    if (n <= 0) {
      pf.clear();
      return;
    }
    plan_prefetch(pf, task.seq, task.pos_begin, n, task.kv_head, task.num_heads, true, steps);
  }

  // The item's first tile, all of it now (the previous item did not prefetch it).
  void prefetch_first_tile(TilePrefetch& pf, const Task& item) const {
    plan_first_tile(pf, item, 0);
    pf.drain();
  }
  // Sets pf to what follows the item's tile at `start`: its next tile, else the first tile of
  // `next`, the item this thread runs next (if any), paced over `steps` calls of pf.step().
  void plan_after_tile(TilePrefetch& pf, const Task& item, const Task* next, int start,
                       int pos_end, int steps) const {
    if (start + kTile < pos_end) {
      plan_prefetch(pf, item.seq, start + kTile, std::min(kTile, pos_end - start - kTile),
                    item.kv_head, item.num_heads, true, steps);
    } else if (next != nullptr) {
      plan_first_tile(pf, *next, steps);
    } else {
      pf.clear();
    }
  }

  // score_tile through amx_scores, the whole tile in one call, with the same prefetches.
  void score_tile_amx(const Task& task, Workspace& ws, int n, TilePrefetch& pf) const {
    const int D = p_.head_size;
    const float q_scale = score_scale(task.kv_head);
    for (int t = 0; t < n; ++t) pf.step();
    amx_scores(ws.q_vnni.data(), task.num_rows,
               bf16_rows(ws.krows, 0, n, ws.kreader, Operand::kKeys), n, D, q_scale,
               ws.w.data(), kTile);
  }

  // The factor an FP8 cache's images are read with (scale x CacheReader::kImage; 1 for a
  // native cache): folded into the query for K, into the output for V.
  float k_factor(int kv_head) const {
    return F == CacheFormat::kNative ? 1.0f : p_.k_scale.at(kv_head) * Reader::kImage;
  }
  // What q . k is multiplied by to give the log2-domain logit: the softmax scale, log2(e) and
  // the K factor. The FMA path folds it into the loaded queries, the AMX path into its scores.
  float score_scale(int kv_head) const { return p_.scale * kLog2e * k_factor(kv_head); }
  // ... as the FMA path applies it (split_score_factor): the query's part (K factor included)
  // and the scores' power of two.
  ScoreFactor fma_score_factor(int kv_head) const {
    ScoreFactor f = split_score_factor(p_.scale * kLog2e);
    f.query *= k_factor(kv_head);
    return f;
  }
  float v_factor(int kv_head) const {
    return F == CacheFormat::kNative ? 1.0f : p_.v_scale.at(kv_head) * Reader::kImage;
  }

  const QT* query_row(const RowInfo& info) const {
    return p_.query + int64_t(info.token) * p_.q_token_stride +
           int64_t(info.head) * p_.q_head_stride;
  }

  // Locates the task's query rows and loads them: as stored for the dot path (ws.dot, which
  // scales its float32 scores), not at all for the AMX path (ws.amx, which packs the unscaled
  // rows itself), else scaled into the log2 domain (and by the K factor).
  void load_queries(const Task& task, Workspace& ws) const {
    const int D = p_.head_size;
    const ScoreFactor factor = fma_score_factor(task.kv_head);
    const float q_scale = factor.query;
    ws.score_factor = factor.score;
    for (int r = 0; r < task.num_rows; ++r) {
      ws.rows[r] = row_info(task.seq, task.kv_head, task.row_begin + r);
    }
#if PAGEDSPEC_CPU_LEVEL == 2
    if (uses_score_lanes(ws, task.num_rows)) {
      lane_pair_queries(task.num_rows, D, [&](int r) {
        return reinterpret_cast<const uint16_t*>(query_row(ws.rows[r]));
      }, ws.q_lanes.data());
      return;
    }
#endif
    for (int r = 0; r < task.num_rows; ++r) {
      const RowInfo& info = ws.rows[r];
      if (ws.amx || ws.amx_decode) continue;
      const QT* src = query_row(info);
      if (ws.dot) {
        uint16_t* dst = ws.q_bf16.data() + size_t(r) * D;
#if PAGEDSPEC_CPU_LEVEL == 2
        if (ws.dot_fp8) {
          fp8_lane_order_query(reinterpret_cast<const uint16_t*>(src), D, dst);
          continue;
        }
#endif
        std::memcpy(dst, src, size_t(D) * sizeof(QT));
        continue;
      }
      float* dst = ws.q.data() + size_t(r) * D;
#pragma omp simd
      for (int d = 0; d < D; ++d) dst[d] = ScalarConvert<QT>::to_float(src[d]) * q_scale;
#if PAGEDSPEC_CPU_LEVEL >= 1
      if (even_odd_rows(ws)) even_odd_order(dst, D);  // as K is read
#endif
    }
  }

  // Locates the tile's n K and V rows and counts what each row may see of this tile.
  void locate_tile(const Task& task, Workspace& ws, int start, int n) const {
    // One block-table lookup per cache block, not per position; a block's rows in a loop the
    // compiler vectorizes (as 64 scalar stores a tile and head, about 5% of 4-row bf16 decode).
    const int64_t token_stride = p_.cache_token_stride();
    for (int t = 0; t < n;) {
      const int pos = start + t;
      const int run = std::min(n - t, p_.block_size - (pos & (p_.block_size - 1)));
      const int64_t off = p_.cache_offset(task.seq, pos, task.kv_head);
      const CacheT* k = p_.key_cache + off;
      const CacheT* v = p_.value_cache + off;
      for (int i = 0; i < run; ++i) {
        ws.krows[t + i] = k + i * token_stride;
        ws.vrows[t + i] = v + i * token_stride;
      }
      t += run;
    }
    for (int r = 0; r < task.num_rows; ++r) {
      ws.visible[r] = std::clamp(ws.rows[r].limit - start + 1, 0, n);
    }
  }

  // ws.w[r][t] = q[r] . k[t] for every row and every position it may see, blocks of four rows
  // and kScoreTokens positions. Rows ascend in query token, so the last row of a group sees the most.
  // One pf.step() per position of the first row block.
  void score_tile(const Task& task, Workspace& ws, TilePrefetch& pf) const {
    const int D = p_.head_size;
    const int R = task.num_rows;
    // The dot path's scale and K rows as bf16 (those any row sees), or the FMA path's FP8 images.
    [[maybe_unused]] const float dot_scale = score_scale(task.kv_head);
    [[maybe_unused]] const uint16_t* const* dot_krows = nullptr;
    if constexpr (kDotCapable) {
      if (ws.dot && !ws.dot_fp8) {
        dot_krows = bf16_rows(ws.krows, 0, ws.visible[R - 1], ws.kreader, Operand::kKeys);
      }
    }
    const ImageT* const* k_images =
        ws.fp8_images ? fp8_image_rows(ws.krows, ws.visible[R - 1], ws.kreader, Operand::kKeys)
                      : nullptr;
#if PAGEDSPEC_CPU_LEVEL == 2
    const std::optional<Fp8ImageLookup> lookup = fp8_lookup(ws, ws.kreader);
    if constexpr (kDotCapable) {
      if (uses_score_lanes(ws, R)) {
        score_tile_lanes(task, ws, dot_krows, pf);
        return;
      }
      if (ws.dot && scores_packed(R, ws.dot_fp8)) {
        score_tile_packed(task, ws, dot_krows, lookup ? &*lookup : nullptr, pf);
        return;
      }
    }
#endif
    // One score block: through the dot path on FP8 codes or the FMA path.
    const auto block = [&](auto NR, auto NT, int r0, int t, float* out) {
#if PAGEDSPEC_CPU_LEVEL == 2
      if constexpr (kDotCapable && F != CacheFormat::kNative) {
        if (ws.dot_fp8) {
          score_block_fp8_dot<NR, NT>(ws.q_bf16.data() + size_t(r0) * D, as_codes(ws.krows) + t,
                                      D, dot_scale, *lookup, out, kTile);
          return;
        }
      }
#endif
      if constexpr (F != CacheFormat::kNative) {
        if (k_images != nullptr) {
          score_block<NR, NT>(ws.q.data() + size_t(r0) * D, k_images + t, kImageReader, D, out,
                              kTile);
          return;
        }
      }
      score_block<NR, NT>(ws.q.data() + size_t(r0) * D, ws.krows + t, ws.kreader, D, out, kTile);
    };
    for (int r0 = 0; r0 < R; r0 += kRowBlock) {
      const int nr = std::min(kRowBlock, R - r0);
      const int group_visible = ws.visible[r0 + nr - 1];
      with_rows(nr, [&](auto NR) {
        float* w = ws.w.data() + r0 * kTile;
        int t = 0;
        for (; t + kScoreTokens <= group_visible; t += kScoreTokens) {
          if (r0 == 0) {
            for (int i = 0; i < kScoreTokens; ++i) pf.step();
          }
          block(NR, std::integral_constant<int, kScoreTokens>{}, r0, t, w + t);
        }
        for (; t < group_visible; ++t) {
          if (r0 == 0) pf.step();
          block(NR, std::integral_constant<int, 1>{}, r0, t, w + t);
        }
      });
    }
    // The FMA path's scores times the power of two its queries left out (only for scales above
    // 2^16 / log2(e): fma_score_factor); the dot path's blocks scaled theirs whole.
    if (!ws.dot && ws.score_factor != 1.0f) {
      for (int r = 0; r < R; ++r) {
        scale_row(ws.w.data() + r * kTile, ws.score_factor, ws.visible[r]);
      }
    }
  }

#if PAGEDSPEC_CPU_LEVEL == 2
  // score_tile on the dot path through a packed K tile (pack_key_group, score_rows_packed): the
  // rows in blocks of 8 (then 4), a block padded with the rows after it (the workspace holds
  // kMaxRows; their scores are never read), over the groups its last row sees. K rows are the
  // bf16 rows `krows` (a bf16 cache's, or an FP8 cache's images), or with `lookup` FP8 codes
  // converted in registers into the queries' lane order (fp8_images_in_lanes). The prefetch
  // steps (tile_steps) run inside the score loops, spread over all the row blocks: issued
  // among the packing's row loads, one per row, they left the path next to no gain
  // (bench/NOTES.md).
  void score_tile_packed(const Task& task, Workspace& ws, const uint16_t* const* krows,
                         const Fp8ImageLookup* lookup, TilePrefetch& pf) const {
    static_assert(kTile <= 2 * kPackedGroup, "score_rows_packed takes one or two groups");
    static_assert(kMaxRows % 8 == 0, "padded row blocks stay inside the workspace");
    const int D = p_.head_size;
    const int R = task.num_rows;
    const int n = ws.visible[R - 1];
    const int group_dwords = D / 2 * kPackedGroup;
    static thread_local std::vector<uint32_t, LineAligned<uint32_t>> packed;
    packed.resize(size_t(2) * group_dwords);
    const auto step = [&] { pf.step(); };
    for (int g = 0; g * kPackedGroup < n; ++g) {
      const int rows = std::min(kPackedGroup, n - g * kPackedGroup);
      uint32_t* dst = packed.data() + g * group_dwords;
      if (lookup != nullptr) {
        const uint8_t* const* codes = as_codes(ws.krows) + g * kPackedGroup;
        pack_key_group(rows, D, dst, [&](int t, int k, __m512i& lo, __m512i& hi, bool) {
          fp8_images_in_lanes(_mm512_loadu_si512(codes[t] + 64 * k), *lookup, lo, hi);
        });
      } else {
        const uint16_t* const* k_rows = krows + g * kPackedGroup;
        pack_key_group(rows, D, dst, [&](int t, int k, __m512i& lo, __m512i& hi, bool pair) {
          lo = _mm512_loadu_si512(k_rows[t] + 64 * k);
          if (pair) hi = _mm512_loadu_si512(k_rows[t] + 64 * k + 32);
        });
      }
    }
    const float scale = score_scale(task.kv_head);
    for (int r0 = 0; r0 < R;) {
      const int nr = packed_block_rows(R - r0);
      const bool two = ws.visible[std::min(R, r0 + nr) - 1] > kPackedGroup;
      const uint16_t* q = ws.q_bf16.data() + size_t(r0) * D;
      float* w = ws.w.data() + r0 * kTile;
      if (nr == 8) {
        two ? score_rows_packed<8, 2>(q, packed.data(), D, scale, w, kTile, step)
            : score_rows_packed<8, 1>(q, packed.data(), D, scale, w, kTile, step);
      } else {
        two ? score_rows_packed<4, 2>(q, packed.data(), D, scale, w, kTile, step)
            : score_rows_packed<4, 1>(q, packed.data(), D, scale, w, kTile, step);
      }
      r0 += nr;
    }
  }
#endif

#if PAGEDSPEC_CPU_LEVEL == 2
  // score_tile through score_block_lanes (uses_score_lanes): blocks of kRowBlock rows (two row
  // pairs; an odd count's last pair fills the row after it, which the workspace holds and nothing
  // reads) x 8 positions, then 4; a last block of fewer repeats its last K row, and the scores
  // it writes past what the rows see (still inside the tile) are never read. The first row
  // block's prefetch steps, one per position, run among its K lines rather than before it.
  void score_tile_lanes(const Task& task, Workspace& ws, const uint16_t* const* krows,
                        TilePrefetch& pf) const {
    static_assert(kRowBlock == 4 && kTile % 4 == 0 && kMaxRows % 2 == 0,
                  "blocks of two row pairs, whole blocks of 4 positions inside the tile");
    const int D = p_.head_size;
    const int R = task.num_rows;
    const float scale = score_scale(task.kv_head);
    for (int r0 = 0; r0 < R; r0 += kRowBlock) {
      const int pairs = (std::min(kRowBlock, R - r0) + 1) / 2;
      const int group_visible = ws.visible[std::min(R, r0 + kRowBlock) - 1];
      const uint16_t* q = ws.q_lanes.data() + size_t(r0) * D;  // pair r0 / 2, 2 D per pair
      float* w = ws.w.data() + r0 * kTile;
      const auto step = [&] { pf.step(); };
      const auto block = [&](auto NT, int t, const uint16_t* const* k, int steps) {
        pairs == 2 ? score_block_lanes<2, NT>(q, k, D, scale, w + t, kTile, steps, step)
                   : score_block_lanes<1, NT>(q, k, D, scale, w + t, kTile, steps, step);
      };
      int t = 0;
      for (; t + 8 <= group_visible; t += 8) {
        block(std::integral_constant<int, 8>{}, t, krows + t, r0 == 0 ? 8 : 0);
      }
      for (; t < group_visible; t += 4) {
        const uint16_t* k[4];
        for (int i = 0; i < 4; ++i) k[i] = krows[std::min(t + i, group_visible - 1)];
        block(std::integral_constant<int, 4>{}, t, k,
              r0 == 0 ? std::min(4, group_visible - t) : 0);
      }
    }
  }
#endif

  // The rows of the packed paths' next block when `left` rows remain: 8, and a last block of 4
  // where 4 or fewer remain (padded up to it), so R rows take ceil(R / 8) blocks.
  static int packed_block_rows(int left) { return left > 4 ? 8 : 4; }

  // The pf.step() calls attend_tile makes for one head's R rows on an n-position tile:
  // score_tile_packed's, one per kPackedStepPairs pairs of each row block; the AMX paths', one
  // per position; else one per position of the first score block and one per position and pass
  // over D (value_passes) of the first rows' P.V, so that the lines are asked for all through the
  // tile. Without the P.V's share, prefetches came as bursts in the score loop and the memory sat
  // idle through the P.V: float32 decode ran at about the sum of the two (bench/NOTES.md).
  int tile_steps(int R, int n) const {
    if (use_amx(R)) return n;
    if (kDotCapable && bf16_dot_ && scores_packed(R, dot_fp8_codes())) {
      const int blocks = (R + 7) / 8;
      return blocks * ((p_.head_size / 2 + kPackedStepPairs - 1) / kPackedStepPairs);
    }
    return n * (1 + value_passes());
  }
  // accumulate_block's passes over D (spans of kValueSpan vectors, then of one load_pair, then
  // single vectors), or the dot path's (64 dimensions, then 32; FP8 in registers: 64, D being a
  // multiple).
  int value_passes() const {
    const int D = p_.head_size;
    if (kDotCapable && bf16_dot_) return D / 64 + (D % 64) / 32;
    constexpr int kSpan = kValueSpan * kRegLanes, kStep = kRowStep<Reader> * kRegLanes;
    return D / kSpan + (D % kSpan) / kStep + (D % kStep) / kRegLanes;
  }

  template <typename Fn>
  static void with_rows(int nr, Fn&& fn) {
    static_assert(kRowBlock <= 5, "with_rows dispatches blocks of up to 5 rows");
    switch (nr) {
      case 5:
        if constexpr (kRowBlock >= 5) fn(std::integral_constant<int, 5>{});
        break;
      case 4: fn(std::integral_constant<int, 4>{}); break;
      case 3: fn(std::integral_constant<int, 3>{}); break;
      case 2: fn(std::integral_constant<int, 2>{}); break;
      default: fn(std::integral_constant<int, 1>{}); break;
    }
  }

  // The task's first position past what its rows see (rows ascend in query token, so the last
  // row sees the furthest).
  int task_pos_end(const Task& task) const {
    const int last = task.row_begin + task.num_rows - 1;
    return std::min(task.pos_end, row_info(task.seq, task.kv_head, last).limit + 1);
  }

  // Online softmax of a plan item's rows over [pos_begin, pos_end), for every KV head: leaves
  // each head's row states in heads[h].state and their unnormalized accumulators (sum of
  // weight * v) in heads[h].acc. Tiles run outer and heads inner, so the item reads each tile's
  // cache tokens whole, while the next tile's are prefetched in address order (TilePrefetch);
  // the last tile prefetches the first of `next`, the item this thread runs next (if any), and
  // `first_prefetched` says whether the previous item prefetched this one's.
  void attend_item(const Task& item, const Task* next, bool first_prefetched,
                   std::vector<Workspace>& heads, TilePrefetch& pf) const {
    if (use_amx_decode()) {
      attend_item_amx_decode(item, next, first_prefetched, heads, pf);
      return;
    }
    const int HK = item.num_heads;
    for (int h = 0; h < HK; ++h) begin_head(with_head(item, item.kv_head + h), heads[h]);
    const int pos_end = task_pos_end(item);
    if (!first_prefetched) prefetch_first_tile(pf, item);
    for (int start = item.pos_begin; start < pos_end; start += kTile) {
      const int n = std::min(kTile, pos_end - start);
      plan_after_tile(pf, item, next, start, pos_end, HK * tile_steps(item.num_rows, n));
      for (int h = 0; h < HK; ++h) {
        attend_tile(with_head(item, item.kv_head + h), heads[h], start, n, pf);
      }
      pf.drain();
    }
    for (int h = 0; h < HK; ++h) end_head(with_head(item, item.kv_head + h), heads[h]);
  }

  // attend_item through the AMX decode path (cpu/amx.h: AmxDecode), each head's rows in chunks
  // of up to kAmxDecodeMaxRows (one state each). Per tile, three passes over the heads: scores
  // by tile multiplies, then the online softmax and the weight tiles, then P.V, so that each
  // hand-over between tiles and vector code has a few heads' work in between. The next tile's
  // prefetch advances inside the tile functions too (AmxPrefetchStep), not in bursts between
  // passes. Rows over 8 take wide states, so 9 to 16 rows share each key tile and hand-over.
  // The accumulators stay in tile layout from the first tile to the last; a row's running max
  // is raised only past kAmxDecodeMaxSlack (SoftmaxState's max is then the reference of the
  // sum and accumulator, below the largest logit by at most that; every consumer only needs a
  // common reference).
  void attend_item_amx_decode(const Task& item, const Task* next, bool first_prefetched,
                              std::vector<Workspace>& heads, TilePrefetch& pf) const {
    if constexpr (kAmxCapable) {
      const int HK = item.num_heads;
      const int R = item.num_rows;
      const int D = p_.head_size;
      // Rows in `chunks` tile states of chunk_rows each (the last padded with zero queries):
      // chunk c holds rows [c * chunk_rows, + chunk_rows), so row r's weights stay at w[r].
      const int chunks = (R + kAmxDecodeMaxRows - 1) / kAmxDecodeMaxRows;
      const int chunk_rows = (R + chunks - 1) / chunks;
      static const uint16_t kZeroRow[kAmxDecodeMaxDims] = {};
      for (int h = 0; h < HK; ++h) {
        Workspace& ws = heads[h];
        ws.amx = ws.dot = ws.dot_fp8 = false;
        ws.amx_decode = true;
        load_queries(with_head(item, item.kv_head + h), ws);
        const uint16_t* rows[kMaxRows];
        tile_operands(ws, R, rows);
        for (int r = R; r < chunks * chunk_rows; ++r) rows[r] = kZeroRow;
        if (ws.decode == nullptr) ws.decode = std::make_unique<AmxDecode[]>(kAmxDecodeChunks);
        for (int c = 0; c < chunks; ++c) {
          amx_decode_begin(ws.decode[c], rows + c * chunk_rows, chunk_rows, D);
        }
        ws.kreader.init();
        ws.vreader.init();
        std::fill(ws.state.begin(), ws.state.begin() + R, SoftmaxState::empty());
      }
      amx_decode_configure(chunk_rows);
      const AmxPrefetchStep step = pf.tile_step();
      const int pos_end = task_pos_end(item);
      if (!first_prefetched) prefetch_first_tile(pf, item);
      for (int start = item.pos_begin; start < pos_end; start += kTile) {
        const int n = std::min(kTile, pos_end - start);
        const int n16 = (n + 15) & ~15;  // the weight tiles' positions
        // A step per head and pass, and those the tile functions take.
        plan_after_tile(pf, item, next, start, pos_end,
                        HK * (3 + chunks * amx_decode_prefetch_steps(D, n)));
        for (int h = 0; h < HK; ++h) {
          Workspace& ws = heads[h];
          locate_tile(with_head(item, item.kv_head + h), ws, start, n);
          pf.step();
          const uint16_t* const* k = bf16_rows(ws.krows, 0, n, ws.kreader, Operand::kKeys);
          for (int c = 0; c < chunks; ++c) amx_decode_scores(ws.decode[c], k, n, step);
        }
        for (int h = 0; h < HK; ++h) {
          Workspace& ws = heads[h];
          pf.step();
          for (int c = 0; c < chunks; ++c) {
            amx_decode_read_scores(ws.decode[c], n, score_scale(item.kv_head + h),
                                   ws.w.data() + c * chunk_rows * kTile, kTile, step);
          }
          float factor[kMaxRows];
          bool rescale[kAmxDecodeChunks] = {};
          for (int r = 0; r < chunks * chunk_rows; ++r) {
            factor[r] = 1.0f;
            // A row sees the first `visible` positions; the rest weigh 0 (as do padding rows).
            const int visible = r < R ? ws.visible[r] : 0;
            float* w = ws.w.data() + r * kTile;
            if (visible > 0) {
              SoftmaxState& st = ws.state[r];
              const float tile_max = max_weights(w, visible);
              if (tile_max > st.max + kAmxDecodeMaxSlack || st.is_empty()) {
                factor[r] = st.raise_max(tile_max);
                rescale[r / chunk_rows] = true;
              }
              st.sum += exp2_weights(w, visible, st.max);  // zeroes up to a multiple of 16
            }
            for (int t = (visible + 15) & ~15; t < n16; ++t) w[t] = 0.0f;
          }
          for (int c = 0; c < chunks; ++c) {
            if (rescale[c]) amx_decode_scale(ws.decode[c], factor + c * chunk_rows);
            amx_decode_weights(ws.decode[c], ws.w.data() + c * chunk_rows * kTile, kTile, n,
                               step);
          }
        }
        for (int h = 0; h < HK; ++h) {
          Workspace& ws = heads[h];
          pf.step();
          const uint16_t* const* v = bf16_rows(ws.vrows, 0, n, ws.vreader, Operand::kValues);
          for (int c = 0; c < chunks; ++c) {
            // Tile multiplies over the positions all the chunk's rows see, vector FMAs past them
            // (verification rows' last positions), so no row meets a value it may not see.
            const int first = c * chunk_rows, last = std::min(R, first + chunk_rows);
            int common = n;
            for (int r = first; r < last; ++r) common = std::min(common, ws.visible[r]);
            if (common > 0) amx_decode_accumulate(ws.decode[c], v, common, step);
            for (int r = first; r < last; ++r) {
              if (ws.visible[r] > common) {
                amx_decode_accumulate_row(ws.decode[c], r - first, ws.w.data() + r * kTile, v,
                                          common, ws.visible[r]);
              }
            }
          }
        }
        pf.drain();
      }
      amx_end();
      for (int h = 0; h < HK; ++h) {
        for (int c = 0; c < chunks; ++c) {
          amx_decode_result(heads[h].decode[c], heads[h].acc.data() + size_t(c) * chunk_rows * D);
        }
        heads[h].amx_decode = false;
      }
    } else {
      (void)item, (void)next, (void)first_prefetched, (void)heads, (void)pf;
    }
  }

  // The task for one of its heads.
  static Task with_head(Task task, int kv_head) {
    task.kv_head = kv_head;
    task.num_heads = 1;
    return task;
  }

  // A head's rows before its first tile: path, queries, empty states.
  void begin_head(const Task& task, Workspace& ws) const {
    const int R = task.num_rows;
    choose_path(ws, R);
    load_queries(task, ws);
    if (ws.amx) begin_amx(ws, R);
    ws.kreader.init();
    ws.vreader.init();
    std::fill(ws.acc.begin(), ws.acc.begin() + size_t(R) * p_.head_size, 0.0f);
    ws.acc_even_odd = false;
    std::fill(ws.state.begin(), ws.state.begin() + R, SoftmaxState::empty());
  }

  // Whether the FMA path reads this task's K and V rows in load_pair's even/odd order: bf16 rows
  // (a bf16 cache's, Reader::kEvenOddPairs, or an FP8 tile's images, ws.fp8_images).
  static bool even_odd_rows(const Workspace& ws) {
    return Reader::kEvenOddPairs || (ws.fp8_images && ImageReader::kEvenOddPairs);
  }

  // The FMA path accumulates such V rows in that order, where AMX tile multiplies and the
  // epilogue use dimension order: puts a task's R accumulator rows in the order asked,
  // converting them if they are not.
  void set_acc_order(Workspace& ws, int R, bool even_odd) const {
#if PAGEDSPEC_CPU_LEVEL >= 1
    if (even_odd_rows(ws)) {
      if (ws.acc_even_odd == even_odd) return;
      const int D = p_.head_size;
      for (int r = 0; r < R; ++r) {
        float* acc = ws.acc.data() + size_t(r) * D;
        even_odd ? even_odd_order(acc, D) : even_odd_to_natural(acc, D);
      }
      ws.acc_even_odd = even_odd;
    }
#endif
    (void)ws, (void)R, (void)even_odd;
  }

  // Positions [start, start + n) for one head's rows: scores, online softmax, values.
  void attend_tile(const Task& task, Workspace& ws, int start, int n, TilePrefetch& pf) const {
    const int D = p_.head_size;
    const int R = task.num_rows;
    locate_tile(task, ws, start, n);
    if (ws.amx) {
      score_tile_amx(task, ws, n, pf);
    } else {
      score_tile(task, ws, pf);
    }
    // Online softmax per row over the positions it sees (scores past its limit are left unread).
    for (int r = 0; r < R; ++r) {
      const int visible = ws.visible[r];
      float* w = ws.w.data() + r * kTile;
      if (visible > 0) {
        SoftmaxState& st = ws.state[r];
        const float factor = st.raise_max(max_weights(w, visible));
        if (factor != 1.0f) scale_row(ws.acc.data() + size_t(r) * D, factor, D);
        st.sum += exp2_weights(w, visible, st.max);
      }
    }
#if PAGEDSPEC_CPU_LEVEL == 2
    if (ws.dot) {  // V rows and weights as bf16 for the dot path's P.V (those past a row unread)
      if constexpr (kDotCapable) {
        if (!ws.dot_fp8) {
          ws.dot_vrows = bf16_rows(ws.vrows, 0, n, ws.vreader, Operand::kValues);
        }
      }
      for (int r = 0; r < R; ++r) {
        for (int t = 0; t < kTile; t += 16) {
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(ws.w_bf16.data() + r * kTile + t),
                              round_to_bf16(_mm512_loadu_ps(ws.w.data() + r * kTile + t)));
        }
      }
    }
    if constexpr (kDotCapable) {
      if (ws.dot && scores_packed(R, ws.dot_fp8) && ws.visible[0] == n) {
        accumulate_tile_packed(ws, R, n);
        return;
      }
    }
#endif
    if (ws.amx && n == kTile && ws.visible[0] == kTile) {
      // Every row sees the whole tile (rows ascend, so the first sees the least): no position
      // is past a row's limit, so the tile multiply may take them all (the causal tail and
      // partial tiles stay on the FMA path, which accumulates per visible segment).
      set_acc_order(ws, R, false);
      amx_accumulate(ws.w.data(), kTile, R,
                     bf16_rows(ws.vrows, 0, kTile, ws.vreader, Operand::kValues), D,
                     ws.acc.data());
    } else {
      if (!ws.dot) set_acc_order(ws, R, true);
      if (ws.fp8_images) {  // the V rows any row sees
        ws.v_images = fp8_image_rows(ws.vrows, ws.visible[R - 1], ws.vreader, Operand::kValues);
      }
      for (int r0 = 0; r0 < R; r0 += kRowBlock) {
        accumulate_rows(ws, r0, std::min(kRowBlock, R - r0), pf);
      }
    }
  }

#if PAGEDSPEC_CPU_LEVEL == 2
  // P.V on the dot path for a task scored through a packed tile (scores_packed) on a tile that
  // every row sees whole (the causal tail stays on accumulate_rows): each position pair's V
  // vectors built once (an odd last position pairs with zeros and with the zero weight that
  // exp2_weights leaves after it), then blocks of 8 rows (then 4, padded as in
  // score_tile_packed) x 32 dimensions. The blocks of 4 rows rebuilt the pairs for every block.
  void accumulate_tile_packed(Workspace& ws, int R, int n) const {
    const int D = p_.head_size;
    const int pairs = (n + 1) / 2;
    const int per_pair = D / 16;
    static thread_local std::vector<uint32_t, LineAligned<uint32_t>> storage;
    storage.resize(size_t(kTile / 2) * per_pair * 16);
    __m512i* paired = reinterpret_cast<__m512i*>(storage.data());  // [pairs][D / 16] vectors
    const std::optional<Fp8ImageLookup> lookup = fp8_lookup(ws, ws.vreader);
    for (int p = 0; p < pairs; ++p) {
      const int t = 2 * p;
      const bool pair = t + 1 < n;
      __m512i* out = paired + p * per_pair;
      if constexpr (F != CacheFormat::kNative) {
        if (lookup) {  // codes converted in registers (ws.dot_fp8)
          for (int d = 0; d < D; d += 64) {
            fp8_value_pair(as_codes(ws.vrows), t, pair, d, *lookup, out + d / 16);
          }
          continue;
        }
      }
      for (int d = 0; d < D; d += 32) bf16_value_pair(ws.dot_vrows, t, pair, d, out + d / 16);
    }
    for (int r0 = 0; r0 < R;) {
      const int nr = packed_block_rows(R - r0);
      float* acc = ws.acc.data() + size_t(r0) * D;
      const uint16_t* w = ws.w_bf16.data() + r0 * kTile;
      for (int d0 = 0; d0 < D; d0 += 32) {
        nr == 8 ? accumulate_paired_values<8, 2>(acc, w, kTile, paired, pairs, D, d0)
                : accumulate_paired_values<4, 2>(acc, w, kTile, paired, pairs, D, d0);
      }
      r0 += nr;
    }
  }
#endif

  // A head's rows after its last tile: accumulators back in dimension order.
  void end_head(const Task& task, Workspace& ws) const {
    [[maybe_unused]] const int D = p_.head_size;  // used at the avx512 level only
    const int R = task.num_rows;
    if (ws.amx) amx_end();
    set_acc_order(ws, R, false);
#if PAGEDSPEC_CPU_LEVEL == 2
    if (ws.dot) {
      for (int r = 0; r < R; ++r) {
        float* acc = ws.acc.data() + size_t(r) * D;
        ws.dot_fp8 ? fp8_dot_to_natural(acc, D) : dot_to_natural(acc, D);
      }
    }
#endif
  }

  // acc[r] += sum over the positions row r sees of w[r][t] * v[t], for rows r0 .. r0 + nr - 1.
  // Their visible counts never decrease (rows ascend in query token), so the positions split into
  // segments [visible[i-1], visible[i]) that rows i .. nr - 1 all see. Each segment is accumulated
  // for exactly those rows: a position past a row's limit is never multiplied into it, not even by
  // a zero weight, so an inf or NaN in a later draft token's V cannot reach an earlier token
  // (the contract's Isolation). The first segment of the first rows (r0 = 0) makes the P.V's
  // share of the tile's prefetch steps (tile_steps).
  void accumulate_rows(Workspace& ws, int r0, int nr, TilePrefetch& pf) const {
    const int D = p_.head_size;
#if PAGEDSPEC_CPU_LEVEL == 2
    const std::optional<Fp8ImageLookup> lookup = fp8_lookup(ws, ws.vreader);
#endif
    int begin = 0;
    for (int i = 0; i < nr; ++i) {
      const int end = ws.visible[r0 + i];
      if (end > begin) {
        const int row = r0 + i;
        const PrefetchSteps step{r0 == 0 && begin == 0 ? &pf : nullptr};
        with_rows(nr - i, [&](auto NR) {
#if PAGEDSPEC_CPU_LEVEL == 2
          if constexpr (kDotCapable) {
            if constexpr (F != CacheFormat::kNative) {
              if (ws.dot_fp8) {
                accumulate_block_fp8_dot<NR>(ws.acc.data() + size_t(row) * D,
                                             ws.w_bf16.data() + row * kTile + begin,
                                             as_codes(ws.vrows) + begin, end - begin, D, kTile,
                                             *lookup, step);
                return;
              }
            }
            if (ws.dot) {
              accumulate_block_dot<NR>(ws.acc.data() + size_t(row) * D,
                                       ws.w_bf16.data() + row * kTile + begin,
                                       ws.dot_vrows + begin, end - begin, D, kTile, step);
              return;
            }
          }
#endif
          if constexpr (F != CacheFormat::kNative) {
            if (ws.fp8_images) {
              accumulate_block<NR>(ws.acc.data() + size_t(row) * D,
                                   ws.w.data() + row * kTile + begin, ws.v_images + begin,
                                   kImageReader, end - begin, D, kTile, step);
              return;
            }
          }
          accumulate_block<NR>(ws.acc.data() + size_t(row) * D, ws.w.data() + row * kTile + begin,
                               ws.vrows + begin, ws.vreader, end - begin, D, kTile, step);
        });
        begin = end;
      }
    }
  }

  // v1 epilogue: out = acc / sum, lse; NaN for a row whose softmax is undefined (a NaN in its
  // query, or a logit that overflowed to +inf: softmax_undefined); 0 and lse -inf for a row whose
  // state stayed empty (every logit it sees overflowed to -inf: exp2_weights clamps their -inf -
  // -inf to a tiny weight, which must not reach out).
  void write_final(const Task& task, const Workspace& ws) const {
    const int D = p_.head_size;
    for (int r = 0; r < task.num_rows; ++r) {
      const RowInfo& info = ws.rows[r];
      const SoftmaxState& st = ws.state[r];
      const bool undefined = softmax_undefined(st.max) || row_has_nan(query_row(info), D);
      QT* dst = p_.out + int64_t(info.token) * p_.out_token_stride +
                int64_t(info.head) * p_.out_head_stride;
      const int64_t row = int64_t(info.token) * p_.num_heads + info.head;
      if (undefined) {
        write_undefined_row(dst, row, st.sum);
        continue;
      }
      if (st.is_empty()) {
        write_empty_row(dst, row);
        continue;
      }
      const float inv = st.sum > 0.0f ? v_factor(task.kv_head) / st.sum : 0.0f;
      const float* acc = ws.acc.data() + size_t(r) * D;
      for (int d = 0; d < D; ++d) dst[d] = ScalarConvert<QT>::from_float(acc[d] * inv);
      if (p_.lse != nullptr) p_.lse[row] = st.lse();
      if (p_.row_state != nullptr) {
        p_.row_state[2 * row] = st.max;
        p_.row_state[2 * row + 1] = st.sum;
      }
    }
  }

  // A row that sees no position with a finite weight: out 0, lse -inf, no attn_mass.
  void write_empty_row(QT* dst, int64_t row) const {
    const QT zero = ScalarConvert<QT>::from_float(0.0f);
    for (int d = 0; d < p_.head_size; ++d) dst[d] = zero;
    if (p_.lse != nullptr) p_.lse[row] = neg_inf();
    if (p_.row_state != nullptr) {
      p_.row_state[2 * row] = neg_inf();
      p_.row_state[2 * row + 1] = 0.0f;
    }
  }

  // A row whose softmax is undefined: out and lse NaN, and a NaN max for the attn_mass pass.
  void write_undefined_row(QT* dst, int64_t row, float sum) const {
    const QT nan = ScalarConvert<QT>::from_float(quiet_nan());
    for (int d = 0; d < p_.head_size; ++d) dst[d] = nan;
    if (p_.lse != nullptr) p_.lse[row] = quiet_nan();
    if (p_.row_state != nullptr) {
      p_.row_state[2 * row] = quiet_nan();
      p_.row_state[2 * row + 1] = sum;
    }
  }

  // Split epilogue: the partition's partial state per row, at its partial row of the plan.
  void write_partial(const Task& task, const Workspace& ws, const PlanView& plan) const {
    const int D = p_.head_size;
    const int first = p_.cu_seqlens_q[task.seq];
    const int parts = plan.parts(task.seq);
    const int64_t base = plan.partial_base(task.seq);
    for (int r = 0; r < task.num_rows; ++r) {
      const RowInfo& info = ws.rows[r];
      const int64_t idx =
          (base + int64_t(info.token - first) * parts + task.partition) * p_.num_heads + info.head;
      // NaN marks a NaN query for merge_partitions (an overflowed logit's +inf max marks itself).
      p_.part_max[idx] = row_has_nan(query_row(info), D) ? quiet_nan() : ws.state[r].max;
      p_.part_sum[idx] = ws.state[r].sum;
      const float* acc = ws.acc.data() + size_t(r) * D;
      float* part = p_.part_acc + idx * D;
      const float factor = v_factor(task.kv_head);   // partials carry the V factor, as on CUDA
#pragma omp simd
      for (int d = 0; d < D; ++d) part[d] = acc[d] * factor;
    }
  }

  // Split reduction for one (query token, head) of a split sequence: folds the partitions the
  // row can see.
  void merge_partitions(int seq, int token, int head, const PlanView& plan, float* acc) const {
    const int D = p_.head_size;
    const int first = p_.cu_seqlens_q[seq];
    const int q_len = p_.cu_seqlens_q[seq + 1] - first;
    const int limit = causal_limit(p_.seq_lens[seq], q_len, token - first);
    const int parts = std::min(plan.parts(seq), limit / plan.partition_size() + 1);
    const int64_t row = plan.partial_base(seq) + int64_t(token - first) * plan.parts(seq);
    SoftmaxState st = SoftmaxState::empty();
    std::fill(acc, acc + D, 0.0f);
    bool undefined = false;  // a partition of an undefined row (write_partial's NaN, or +inf)
    for (int k = 0; k < parts; ++k) {
      const int64_t idx = (row + k) * p_.num_heads + head;
      undefined |= softmax_undefined(p_.part_max[idx]);
      const SoftmaxMerge m = merge_softmax(st, SoftmaxState{p_.part_max[idx], p_.part_sum[idx]});
      const float* part_acc = p_.part_acc + idx * D;
#pragma omp simd
      for (int d = 0; d < D; ++d) acc[d] = acc[d] * m.weight_a + part_acc[d] * m.weight_b;
      st = m.state;
    }
    QT* dst = p_.out + int64_t(token) * p_.out_token_stride + int64_t(head) * p_.out_head_stride;
    const int64_t out_row = int64_t(token) * p_.num_heads + head;
    if (undefined) {
      write_undefined_row(dst, out_row, st.sum);
      return;
    }
    if (st.is_empty()) {
      write_empty_row(dst, out_row);
      return;
    }
    const float inv = st.sum > 0.0f ? 1.0f / st.sum : 0.0f;
    for (int d = 0; d < D; ++d) dst[d] = ScalarConvert<QT>::from_float(acc[d] * inv);
    if (p_.lse != nullptr) p_.lse[out_row] = st.lse();
    if (p_.row_state != nullptr) {
      p_.row_state[2 * out_row] = st.max;
      p_.row_state[2 * out_row + 1] = st.sum;
    }
  }

  // attn_mass: adds, for every visible position, the sum over all heads and query tokens of
  // exp2(s - max) / sum, the final probability against the row's final state (row_state), with s
  // recomputed exactly as attend_tile() does (so the largest weight is exactly 1 / sum, whatever
  // the logits' magnitude); NaN at every position a row whose softmax is undefined sees.
  // Tasks are (sequence, kMassTile positions) and loop over every KV head and row, so one
  // sequence's mass for a slot is summed inside one task and added once: distinct slots never
  // race, and the add is atomic only because two sequences may share a block (prefix sharing).
  void mass_pass(const float* row_state, const std::vector<Task>& mass_tasks) const {
    const int G = p_.group_size();
    at::parallel_for(0, int64_t(mass_tasks.size()), 1, [&](int64_t begin, int64_t end) {
      Workspace ws(p_.head_size);
      TilePrefetch pf;
      std::vector<float> mass(kMassTile);
      std::vector<float> row_max(kMaxRows), row_inv(kMaxRows);
      for (int64_t i = begin; i < end; ++i) {
        const Task& span = mass_tasks[i];
        const int q_len = p_.cu_seqlens_q[span.seq + 1] - p_.cu_seqlens_q[span.seq];
        const int n_pos = span.pos_end - span.pos_begin;
        std::fill(mass.begin(), mass.begin() + n_pos, 0.0f);
        for (int kv_head = 0; kv_head < p_.num_kv_heads; ++kv_head) {
          ws.kreader.init();
          for (int row0 = 0; row0 < q_len * G; row0 += kMaxRows) {
            const Task task{span.seq, kv_head, 1, row0, std::min(kMaxRows, q_len * G - row0),
                            span.pos_begin, span.pos_end, 0};
            // Scores as attend_tile() computes them (AMX aside).
            set_dot(ws, bf16_dot_, task.num_rows);
            load_queries(task, ws);
            for (int r = 0; r < task.num_rows; ++r) {
              const int64_t row = int64_t(ws.rows[r].token) * p_.num_heads + ws.rows[r].head;
              const float max = row_state[2 * row], sum = row_state[2 * row + 1];
              // An undefined row: NaN at every position (0 x NaN at a -inf score too).
              const bool undefined = softmax_undefined(max);
              row_max[r] = undefined ? 0.0f : max;
              row_inv[r] = undefined ? quiet_nan() : (sum > 0.0f ? 1.0f / sum : 0.0f);
            }
            const int pos_end = task_pos_end(task);
            for (int start = span.pos_begin; start < pos_end; start += kTile) {
              const int n = std::min(kTile, pos_end - start);
              locate_tile(task, ws, start, n);
              // This head's K rows of the next tile (the scores need no V).
              plan_prefetch(pf, span.seq, start + kTile,
                            std::max(0, std::min(kTile, pos_end - start - kTile)), kv_head, 1,
                            false, n);
              score_tile(task, ws, pf);
              pf.drain();
              for (int r = 0; r < task.num_rows; ++r) {
                const float* w = ws.w.data() + r * kTile;
                float* m = mass.data() + (start - span.pos_begin);
                for (int t = 0; t < ws.visible[r]; ++t) {
                  m[t] += softmax_weight(w[t], row_max[r]) * row_inv[r];
                }
              }
            }
          }
        }
        for (int t = 0; t < n_pos; ++t) {
          std::atomic_ref<float>(p_.attn_mass[p_.slot(span.seq, span.pos_begin + t)])
              .fetch_add(mass[t], std::memory_order_relaxed);
        }
      }
    });
  }

 private:
  const PagedAttentionParams<QT, CacheT>& p_;
  const bool bf16_dot_;  // the dot path for every task the AMX path does not take
  // The FMA path may read FP8 tiles as images (Workspace::fp8_images): AVX2, or AVX-512 with
  // VBMI and D a multiple of 32 (cpu_fp8_images, fp8_images_as_bf16).
  const bool fp8_images_;
};

// The plan's work items as CPU tasks: one per item for all its KV heads (attend_item), or, where
// there are fewer items than twice the threads, per item and range of heads.
template <typename QT, typename CacheT>
std::vector<Task> plan_tasks(const PagedAttentionParams<QT, CacheT>& p, const PlanView& plan) {
  const int G = p.group_size();
  const int P = plan.partition_size();
  const int64_t wanted = 2 * int64_t(at::get_num_threads());
  const int64_t ranges = std::clamp<int64_t>((wanted + plan.num_items() - 1) /
                                                 std::max(plan.num_items(), 1),
                                             1, p.num_kv_heads);
  const int heads_per_task = int((p.num_kv_heads + ranges - 1) / ranges);
  std::vector<Task> tasks;
  tasks.reserve(size_t(plan.num_items()) * ranges);
  for (int i = 0; i < plan.num_items(); ++i) {
    const PlanItem item = plan.item(i);
    const int q_len = p.cu_seqlens_q[item.seq + 1] - p.cu_seqlens_q[item.seq];
    const int seq_len = p.seq_lens[item.seq];
    const bool split = plan.parts(item.seq) > 1;
    const int begin = split ? item.partition * P : 0;
    const int end = split ? std::min(seq_len, begin + P) : seq_len;
    for (int kv_head = 0; kv_head < p.num_kv_heads; kv_head += heads_per_task) {
      tasks.push_back(Task{item.seq, kv_head, std::min(heads_per_task, p.num_kv_heads - kv_head),
                           item.row0, std::min(kMaxRows, q_len * G - item.row0), begin, end,
                           item.partition});
    }
  }
  return tasks;
}

template <typename QT, typename CacheT, CacheFormat F>
void run_cpu(PagedAttentionParams<QT, CacheT>& p, const AttentionArgs& args, const PlanView& plan,
             float* workspace, const at::Tensor& query) {
  CpuPagedAttention<QT, CacheT, F> kernel(p);
  const int64_t R = plan.field(kPlanFieldPartialRows);
  p.part_acc = workspace;
  p.part_max = workspace == nullptr ? nullptr : workspace + R * p.num_heads * p.head_size;
  p.part_sum = workspace == nullptr ? nullptr : p.part_max + R * p.num_heads;

  // attn_mass needs each row's final softmax state.
  at::Tensor row_state;
  if (p.attn_mass != nullptr) {
    row_state = at::empty({args.num_tokens, args.num_heads, 2}, query.options().dtype(at::kFloat));
    p.row_state = row_state.data_ptr<float>();
  }

  const std::vector<Task> tasks = plan_tasks(p, plan);
  using Kernel = CpuPagedAttention<QT, CacheT, F>;
  at::parallel_for(0, int64_t(tasks.size()), 1, [&](int64_t begin, int64_t end) {
    // One workspace per KV head of the widest task so far, kept by the thread across calls:
    // allocating and zeroing them per call (36 KB a head at D = 128) cost 3.5 us of a 13 us
    // decode call over 16 positions, 6% of one over 256 (SPR-VM, 1 thread).
    static thread_local std::vector<typename Kernel::Workspace> heads;
    if (!heads.empty() && heads[0].head_size != p.head_size) heads.clear();
    TilePrefetch pf;
    for (int64_t i = begin; i < end; ++i) {
      const Task& task = tasks[i];
      while (int(heads.size()) < task.num_heads) heads.emplace_back(p.head_size);
      kernel.attend_item(task, i + 1 < end ? &tasks[i + 1] : nullptr, i > begin, heads, pf);
      for (int h = 0; h < task.num_heads; ++h) {
        const Task head = Kernel::with_head(task, task.kv_head + h);
        if (plan.parts(task.seq) > 1) {
          kernel.write_partial(head, heads[h], plan);
        } else {
          kernel.write_final(head, heads[h]);
        }
      }
    }
  });

  if (R > 0) {
    // Reduction over the (query token, head) rows of split sequences.
    std::vector<int> split_tokens, token_seq;
    for (int seq = 0; seq < p.num_seqs; ++seq) {
      if (plan.parts(seq) <= 1) continue;
      for (int t = p.cu_seqlens_q[seq]; t < p.cu_seqlens_q[seq + 1]; ++t) {
        split_tokens.push_back(t);
        token_seq.push_back(seq);
      }
    }
    const int64_t rows = int64_t(split_tokens.size()) * p.num_heads;
    at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
      std::vector<float> acc(p.head_size);
      for (int64_t i = begin; i < end; ++i) {
        const int64_t t = i / p.num_heads;
        kernel.merge_partitions(token_seq[t], split_tokens[t], int(i % p.num_heads), plan,
                                acc.data());
      }
    });
  }

  if (p.attn_mass != nullptr) {
    std::vector<Task> mass_tasks;
    for (int seq = 0; seq < p.num_seqs; ++seq) {
      if (p.cu_seqlens_q[seq + 1] == p.cu_seqlens_q[seq]) continue;
      for (int pos = 0; pos < p.seq_lens[seq]; pos += kMassTile) {
        mass_tasks.push_back(
            Task{seq, 0, 0, 0, 0, pos, std::min(p.seq_lens[seq], pos + kMassTile), 0});
      }
    }
    kernel.mass_pass(p.row_state, mass_tasks);
  }
}

}  // namespace

void run_planned_attention(const char* op, at::Tensor& out, const at::Tensor& query,
                           const at::Tensor& key_cache, const at::Tensor& value_cache,
                           const at::Tensor& block_tables, const at::Tensor& seq_lens,
                           const at::Tensor& cu_seqlens_q, double scale,
                           const c10::optional<at::Tensor>& lse,
                           const c10::optional<at::Tensor>& attn_mass, const AttentionArgs& args,
                           const PlanView& plan, float* workspace) {
  PAGEDSPEC_DISPATCH_ACTIVATION(query.scalar_type(), op, "query", [&] {
    PAGEDSPEC_DISPATCH_CACHE_FORMAT(args.format, [&] {
      auto p = make_attention_params<scalar_t, cache_t>(out, query, key_cache, value_cache,
                                                        block_tables, seq_lens, cu_seqlens_q,
                                                        scale, lse, attn_mass, args);
      run_cpu<scalar_t, cache_t, kCacheFormat>(p, args, plan, workspace, query);
    });
  });
}

}  // namespace PAGEDSPEC_CPU_NAMESPACE
}  // namespace pagedspec
