// Speculative-decoding verification math shared by the CPU and CUDA kernels: the acceptance test,
// the residual weights, and the exact float32 summation order of the inverse-CDF draw. Torch-free.
//
// Inverse CDF of weights w[0..V) with a uniform u in [0, 1): the smallest t with w[t] > 0 and
// prefix(t) > u * total. Float32 prefix sums depend on the order of the additions, so the order is
// fixed here, and the CPU kernel and the CUDA kernel follow it to the bit (same tokens for the
// same inputs); the pure-PyTorch reference sums in float64 instead, and differs only when u * total
// lands within float32 rounding of a CDF boundary.
//
// The order ("spans"): the row is cut into kSampleSpans contiguous spans of sample_span_size(V)
// elements (trailing spans may be short or empty). In a span, weights are added one by one from
// 0.0f in index order (span_total). The span totals are scanned by scan_span_totals, whose
// association mirrors a 512-thread CUDA block: an inclusive Kogge-Stone scan inside each group of 32
// spans (one warp), a Kogge-Stone scan of the 16 group totals, then each group adds the scanned
// total of the groups before it. With incl[j] the scanned value of span j and excl[j] = incl[j-1]
// (0 for j = 0):
//   total     = incl[kSampleSpans - 1]
//   threshold = u * total
//   prefix(t) = excl[j] + (w[begin_j] + ... + w[t]) (the span's running sum, then one addition)
// Within a span prefix(t) never decreases, and its value at the span's last positive weight is
// excl[j] + span_total[j]; so the token lies in the first span j with excl[j] + span_total[j] >
// threshold, and only that span is read a second time. If no span qualifies (u * total rounded up
// to the largest prefix), the last positive-weight token is taken: a zero-weight token or one past
// the vocabulary is never returned. A row without any positive weight returns token 0 (only
// possible for a target row that is not a distribution).
//
// Weights are residual_weight(p, q) = max(p - q, 0) with NaN read as 0; the bonus draw and the
// zero-residual fallback use q = 0 (w = p), a one-hot draft uses q = 1 at the drafted token.
#pragma once

#include <stdint.h>

#include "pagedspec/macros.h"

namespace pagedspec {

// Spans per row, which is also the CUDA kernel's threads per block (one span per thread).
constexpr int kSampleSpans = 512;
constexpr int kSampleWarpSpans = 32;                             // spans per Kogge-Stone group
constexpr int kSampleGroups = kSampleSpans / kSampleWarpSpans;   // 16
// A span's length is a multiple of this, so each CUDA thread reads whole 64-byte pieces.
constexpr int kSampleSpanQuantum = 16;

// Elements per span for a vocabulary of `vocab` tokens.
PS_HOST_DEVICE int64_t sample_span_size(int64_t vocab) {
  const int64_t per_span = (vocab + kSampleSpans - 1) / kSampleSpans;
  return (per_span + kSampleSpanQuantum - 1) / kSampleSpanQuantum * kSampleSpanQuantum;
}

// Draft token x (draft probability q, target probability p) is accepted iff u * q < p. With
// q = 1 for a deterministic draft. Accepts with probability min(1, p / q); a p of NaN rejects.
PS_HOST_DEVICE bool accept_draft(float u, float p, float q) { return u * q < p; }

// max(p - q, 0), with NaN (from a NaN p or q) as 0 so that a bad row cannot poison the sums.
PS_HOST_DEVICE float residual_weight(float p, float q) {
  const float d = p - q;
  return d > 0.f ? d : 0.f;
}

// One probability row as the inverse CDF sees it: weight(t) = residual_weight(target[t], q_t) with
// q_t = draft[t] when `draft` is set, else 1 at `one_hot` (a deterministic draft; -1 for none).
struct WeightRow {
  const float* target;  // [vocab]
  const float* draft;   // [vocab] or nullptr
  int64_t one_hot;      // drafted token when draft == nullptr; -1 means q = 0 everywhere
  int64_t vocab;

  PS_HOST_DEVICE float weight(int64_t t) const {
    const float q = draft != nullptr ? draft[t] : (t == one_hot ? 1.f : 0.f);
    return residual_weight(target[t], q);
  }
};

// Sum of w[begin..end), added in index order from 0.0f. `Row` is anything with weight(t): a
// WeightRow, or a staged copy of a span's weights.
template <typename Row>
PS_HOST_DEVICE float span_total(const Row& row, int64_t begin, int64_t end) {
  float acc = 0.f;
  for (int64_t t = begin; t < end; ++t) acc = acc + row.weight(t);
  return acc;
}

// The first t in [begin, end) with w[t] > 0 and excl + (*acc + w[begin] + ... + w[t]) > threshold,
// or -1. *acc is the span's running sum before `begin` (0 at the span's start) and is advanced, so
// a span can be walked in pieces.
template <typename Row>
PS_HOST_DEVICE int64_t span_crossing(const Row& row, int64_t begin, int64_t end, float excl,
                                     float threshold, float* acc) {
  float running = *acc;
  for (int64_t t = begin; t < end; ++t) {
    const float w = row.weight(t);
    running = running + w;
    if (w > 0.f && excl + running > threshold) {
      *acc = running;
      return t;
    }
  }
  *acc = running;
  return -1;
}

// In place: totals[kSampleSpans] -> inclusive scan, in the association the CUDA block uses
// (warp Kogge-Stone, Kogge-Stone over the warp totals, then one addition per span).
inline void scan_span_totals(float* x) {
  for (int g = 0; g < kSampleGroups; ++g) {
    float* v = x + g * kSampleWarpSpans;
    // Descending i updates every element from the previous step's values, as the shuffles do.
    for (int off = 1; off < kSampleWarpSpans; off *= 2) {
      for (int i = kSampleWarpSpans - 1; i >= off; --i) v[i] = v[i - off] + v[i];
    }
  }
  float group[kSampleGroups];
  for (int g = 0; g < kSampleGroups; ++g) group[g] = x[g * kSampleWarpSpans + kSampleWarpSpans - 1];
  for (int off = 1; off < kSampleGroups; off *= 2) {
    for (int i = kSampleGroups - 1; i >= off; --i) group[i] = group[i - off] + group[i];
  }
  for (int g = 1; g < kSampleGroups; ++g) {
    for (int i = 0; i < kSampleWarpSpans; ++i) {
      x[g * kSampleWarpSpans + i] = group[g - 1] + x[g * kSampleWarpSpans + i];
    }
  }
}

// Parameters of one rejection_sample launch. Row-major contiguous tensors.
struct RejectionSampleParams {
  const int64_t* draft_token_ids;   // [batch, k]
  const float* draft_probs;         // [batch, k, vocab], or nullptr for a one-hot draft
  const float* target_probs;        // [batch, k + 1, vocab]
  const float* uniform_accept;      // [batch, k]
  const float* uniform_resample;    // [batch, k + 1]
  const int32_t* num_draft_tokens;  // [batch], each in [0, k]; nullptr means k for every request
  int64_t* output_token_ids;        // [batch, k + 1]: accepted, corrected/bonus, then -1
  int32_t* num_accepted;            // [batch]
  int64_t batch;
  int64_t k;                        // draft_token_ids.size(1)
  int64_t vocab;                    // target_probs.size(2)
};

// Parameters of one greedy_verify launch.
struct GreedyVerifyParams {
  const int64_t* draft_token_ids;   // [batch, k]
  const int64_t* target_token_ids;  // [batch, k + 1]: the target's argmax per position
  const int32_t* num_draft_tokens;  // [batch], each in [0, k]; nullptr means k for every request
  int64_t* output_token_ids;        // [batch, k + 1]
  int32_t* num_accepted;            // [batch]
  int64_t batch;
  int64_t k;
};

// num_draft_tokens[b] as used: clamped to [0, k] (the CPU launcher rejects values outside; the
// CUDA one only with PAGEDSPEC_DEBUG=1, so the kernels must stay in bounds on their own).
PS_HOST_DEVICE int64_t clamp_draft_count(int32_t n, int64_t k) {
  return n < 0 ? 0 : (n > k ? k : n);
}

// Greedy verification of request b (shared by both backends; the CUDA kernel runs it per thread).
PS_HOST_DEVICE void greedy_verify_request(const GreedyVerifyParams& p, int64_t b) {
  const int64_t k_b =
      p.num_draft_tokens != nullptr ? clamp_draft_count(p.num_draft_tokens[b], p.k) : p.k;
  const int64_t* draft = p.draft_token_ids + b * p.k;
  const int64_t* target = p.target_token_ids + b * (p.k + 1);
  int64_t* out = p.output_token_ids + b * (p.k + 1);
  int64_t i = 0;
  while (i < k_b && draft[i] == target[i]) {
    out[i] = draft[i];
    ++i;
  }
  out[i] = target[i];  // the first mismatch's target token, or the bonus after k_b accepted
  for (int64_t j = i + 1; j <= p.k; ++j) out[j] = -1;
  p.num_accepted[b] = static_cast<int32_t>(i);
}

}  // namespace pagedspec
