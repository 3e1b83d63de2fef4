// Speculative-decoding verification math shared by the CPU and CUDA kernels: the acceptance test,
// the residual weights, and the exact float32 summation order of the inverse-CDF draw. Torch-free.
//
// Inverse CDF of weights w[0..V) with a uniform u in [0, 1): the smallest t with w[t] > 0 and
// prefix(t) > u * total. Float32 prefix sums depend on the order of the additions, so the order is
// fixed here and both kernels follow it to the bit (the CPU and CUDA kernels emit the same tokens
// for the same inputs); the pure-PyTorch reference sums in float64 instead and may differ only
// where u * total lands within float32 rounding of a CDF boundary.
//
// The order is shaped by the CUDA kernel (one 512-thread block per row, coalesced 16-byte loads):
//  1. Tiles. The row is cut into tiles of kSampleTile = 128 weights (a warp's 32 lanes x 4; past V
//     the weights are 0). Inside a tile the prefix sums are a Sklansky scan: the prefix of an
//     element in the right half of an aligned block of 2^(s+1) elements is (total of the left half)
//     + (its prefix inside the right half), and a block's total is left total + right total (a
//     pairwise sum). See tile_prefixes; the CUDA kernel computes the same with warp shuffles.
//  2. Runs. Tile totals T[i] are grouped in kSampleRuns runs of run_length(num_tiles) consecutive
//     tiles, summed from 0.0f in order inside a run; the run totals are scanned by
//     scan_run_totals (the association of a warp Kogge-Stone scan inside each group of 32 runs, a
//     Kogge-Stone scan of the 16 group totals, then one addition per run). With X[j] the scanned
//     total of the runs before run j (0 for j = 0), the tile's exclusive prefix is
//        E[i] = X[j] + (T[first tile of run j] + ... + T[i - 1]), summed from 0.0f.
//  3. total = scanned total of all runs, threshold = u * total, and for t in tile i
//        prefix(t) = E[i] + (Sklansky prefix of t inside the tile).
// Tiles with T[i] == 0 are skipped: E[i] is summed in another order than the previous tile's
// largest prefix and can exceed it by an ulp, so an empty tile could otherwise seem to cross.
// Inside a tile prefix(t) never decreases (a Sklansky scan of non-negative numbers is monotone),
// and its value at the tile's last positive weight is E[i] + T[i]. So the token lies in the first
// tile with E[i] + T[i] > threshold, and that tile is the only part of the row read twice. If no
// tile qualifies (u * total rounded up to the largest prefix), the last positive-weight token is
// taken: neither a zero-weight token nor one past the vocabulary is ever returned. A row without
// any positive weight gives -1 here (the callers fall back to the target row, then to token 0).
//
// Weights are residual_weight(p, q) = max(p - q, 0) with NaN read as 0; the bonus draw and the
// zero-residual fallback use q = 0 (w = p), a one-hot draft uses q = 1 at the drafted token.
#pragma once

#include <stdint.h>

#include "pagedspec/macros.h"

namespace pagedspec {

constexpr int kSampleTile = 128;       // weights per tile: 32 lanes x 4 (one float4 each)
constexpr int kSampleRuns = 512;       // runs of tiles, one per CUDA thread
constexpr int kSampleRunsPerGroup = 32;                              // runs per Kogge-Stone group
constexpr int kSampleGroups = kSampleRuns / kSampleRunsPerGroup;     // 16

PS_HOST_DEVICE int64_t sample_num_tiles(int64_t vocab) {
  return (vocab + kSampleTile - 1) / kSampleTile;
}

// Consecutive tiles per run.
PS_HOST_DEVICE int64_t sample_run_length(int64_t num_tiles) {
  return (num_tiles + kSampleRuns - 1) / kSampleRuns;
}

// Draft token x (draft probability q, target probability p) is accepted iff u * q < p, with
// q = 1 for a deterministic draft: probability min(1, p / q). A NaN p rejects.
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

// In place: w[kSampleTile] -> its Sklansky inclusive prefix sums (step 1 above); w[127] ends as
// the tile's pairwise total.
PS_HOST_DEVICE void tile_prefixes(float* w) {
  for (int half = 1; half < kSampleTile; half *= 2) {
    for (int block = 0; block < kSampleTile; block += 2 * half) {
      const float left_total = w[block + half - 1];
      for (int i = block + half; i < block + 2 * half; ++i) w[i] = left_total + w[i];
    }
  }
}

// The tile's pairwise total (the last value tile_prefixes would produce), without the prefixes.
PS_HOST_DEVICE float tile_total(const float* w) {
  float level[kSampleTile / 2];
  for (int i = 0; i < kSampleTile / 2; ++i) level[i] = w[2 * i] + w[2 * i + 1];
  for (int n = kSampleTile / 4; n >= 1; n /= 2) {
    for (int i = 0; i < n; ++i) level[i] = level[2 * i] + level[2 * i + 1];
  }
  return level[0];
}

// In place: totals[kSampleRuns] -> inclusive scan, in the association the CUDA block uses
// (warp Kogge-Stone, Kogge-Stone over the 16 warp totals, then one addition per run).
PS_HOST_DEVICE void scan_run_totals(float* x) {
  for (int g = 0; g < kSampleGroups; ++g) {
    float* v = x + g * kSampleRunsPerGroup;
    bool all_zero = true;  // short rows leave most runs empty; their scan is all zeros anyway
    for (int i = 0; i < kSampleRunsPerGroup; ++i) all_zero = all_zero && v[i] == 0.f;
    if (all_zero) continue;
    // Descending i updates every element from the previous step's values, as the shuffles do.
    for (int off = 1; off < kSampleRunsPerGroup; off *= 2) {
      for (int i = kSampleRunsPerGroup - 1; i >= off; --i) v[i] = v[i - off] + v[i];
    }
  }
  float group[kSampleGroups];
  for (int g = 0; g < kSampleGroups; ++g) {
    group[g] = x[g * kSampleRunsPerGroup + kSampleRunsPerGroup - 1];
  }
  for (int off = 1; off < kSampleGroups; off *= 2) {
    for (int i = kSampleGroups - 1; i >= off; --i) group[i] = group[i - off] + group[i];
  }
  for (int g = 1; g < kSampleGroups; ++g) {
    for (int i = 0; i < kSampleRunsPerGroup; ++i) {
      x[g * kSampleRunsPerGroup + i] = group[g - 1] + x[g * kSampleRunsPerGroup + i];
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
