// The FMA path's blocks, on every level: score_block (q . k for a block of rows and positions,
// K decoded in registers) and accumulate_span / accumulate_block (P.V, accumulators held in
// registers). The other paths fall back to them for what they do not take (causal tails,
// partial tiles), and FP8 images go through them too.
// A part of cpu/attention_impl.h, included only there, inside its namespaces.
#ifndef PAGEDSPEC_CPU_ATTENTION_PARTS
#error "a part of cpu/attention_impl.h, included only there: include that instead"
#endif

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
