// CPU kernels for rejection_sample and greedy_verify. The inverse-CDF draw follows the summation
// order fixed in include/pagedspec/sampling.h to the bit, so the CPU and CUDA kernels emit the same
// tokens for the same inputs. Requests run in parallel; a request reads its probability row once
// (plus one 128-weight tile again where the CDF crosses u).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

#include "pagedspec/sampling.h"
#include "sampling_checks.h"

namespace pagedspec {
namespace {

// w[0..kSampleTile) = the weights of tile `tile` (0 past the vocabulary).
template <bool kDraftRow>
void load_tile_weights(const WeightRow& row, int64_t tile, float* w) {
  const int64_t begin = tile * kSampleTile;
  const int n = static_cast<int>(std::min<int64_t>(kSampleTile, row.vocab - begin));
  const float* target = row.target + begin;
  if constexpr (kDraftRow) {
    const float* draft = row.draft + begin;
    for (int i = 0; i < n; ++i) w[i] = residual_weight(target[i], draft[i]);
  } else {
    for (int i = 0; i < n; ++i) w[i] = residual_weight(target[i], 0.f);
    const int64_t hot = row.one_hot - begin;  // a one-hot draft: q = 1 at the drafted token
    if (hot >= 0 && hot < n) w[hot] = residual_weight(target[hot], 1.f);
  }
  std::fill(w + n, w + kSampleTile, 0.f);
}

// The first t of tile `tile` with w[t] > 0 and tile_excl + (its prefix in the tile) > threshold,
// or -1.
template <bool kDraftRow>
int64_t first_crossing_in_tile(const WeightRow& row, int64_t tile, float tile_excl,
                               float threshold) {
  alignas(64) float w[kSampleTile];
  alignas(64) float prefix[kSampleTile];
  load_tile_weights<kDraftRow>(row, tile, w);
  std::copy(w, w + kSampleTile, prefix);
  tile_prefixes(prefix);
  for (int c = 0; c < kSampleTile; ++c) {
    if (w[c] > 0.f && tile_excl + prefix[c] > threshold) return tile * kSampleTile + c;
  }
  return -1;
}

// The last token with a positive weight, or -1.
int64_t last_positive_weight(const WeightRow& row) {
  for (int64_t t = row.vocab - 1; t >= 0; --t) {
    if (row.weight(t) > 0.f) return t;
  }
  return -1;
}

// Inverse CDF of the row's weights with uniform u, in the order of sampling.h (the same tiles and
// runs as the CUDA block). `tile_totals` is scratch. Returns -1 when no weight is positive.
template <bool kDraftRow>
int64_t inverse_cdf(const WeightRow& row, float u, std::vector<float>& tile_totals) {
  const int64_t num_tiles = sample_num_tiles(row.vocab);
  const int64_t run_length = sample_run_length(num_tiles);
  tile_totals.resize(num_tiles);
  alignas(64) float w[kSampleTile];
  for (int64_t i = 0; i < num_tiles; ++i) {
    load_tile_weights<kDraftRow>(row, i, w);
    tile_totals[i] = tile_total(w);
  }
  if (num_tiles == 1) {
    // One tile, one non-empty run: the scan adds only exact zeros, so total = T[0] and E[0] = 0.
    const float total = tile_totals[0];
    if (!(total > 0.f)) return -1;
    const int64_t t = first_crossing_in_tile<kDraftRow>(row, 0, 0.f, u * total);
    return t >= 0 ? t : last_positive_weight(row);
  }
  float runs[kSampleRuns];
  for (int j = 0; j < kSampleRuns; ++j) {
    float partial = 0.f;
    const int64_t end = std::min<int64_t>((j + 1) * run_length, num_tiles);
    for (int64_t i = j * run_length; i < end; ++i) partial = partial + tile_totals[i];
    runs[j] = partial;
  }
  scan_run_totals(runs);
  const float total = runs[kSampleRuns - 1];
  if (!(total > 0.f)) return -1;
  const float threshold = u * total;
  for (int j = 0; j < kSampleRuns; ++j) {
    const float runs_before = j > 0 ? runs[j - 1] : 0.f;
    float partial = 0.f;
    const int64_t end = std::min<int64_t>((j + 1) * run_length, num_tiles);
    for (int64_t i = j * run_length; i < end; ++i) {
      const float tile_excl = runs_before + partial;
      // Empty tiles are skipped: their prefix is computed in another order than the previous
      // tile's and can exceed it by an ulp, which would make an empty tile "cross".
      if (tile_totals[i] > 0.f && tile_excl + tile_totals[i] > threshold) {
        // The first non-empty tile whose largest prefix crosses holds the token.
        const int64_t t = first_crossing_in_tile<kDraftRow>(row, i, tile_excl, threshold);
        return t >= 0 ? t : last_positive_weight(row);  // always t >= 0, see sampling.h
      }
      partial = partial + tile_totals[i];
    }
  }
  // u * total rounded up to the largest prefix.
  return last_positive_weight(row);
}

int64_t sample_row(const WeightRow& row, float u, std::vector<float>& tile_totals) {
  return row.draft != nullptr ? inverse_cdf<true>(row, u, tile_totals)
                              : inverse_cdf<false>(row, u, tile_totals);
}

void rejection_sample_request(const RejectionSampleParams& p, int64_t b,
                              std::vector<float>& scratch) {
  const int64_t k = p.k, vocab = p.vocab;
  const int64_t k_b =
      p.num_draft_tokens != nullptr ? clamp_draft_count(p.num_draft_tokens[b], k) : k;
  const int64_t* ids = p.draft_token_ids + b * k;
  int64_t first = k_b;  // first rejected position, k_b when all are accepted
  for (int64_t i = 0; i < k_b; ++i) {
    const int64_t x = ids[i];
    const bool in_vocab = x >= 0 && x < vocab;  // always true after the host checks
    const float target_p = in_vocab ? p.target_probs[(b * (k + 1) + i) * vocab + x] : 0.f;
    const float draft_q =
        p.draft_probs != nullptr && in_vocab ? p.draft_probs[(b * k + i) * vocab + x] : 1.f;
    if (!in_vocab || !accept_draft(p.uniform_accept[b * k + i], target_p, draft_q)) {
      first = i;
      break;
    }
  }
  const float* target_row = p.target_probs + (b * (k + 1) + first) * vocab;
  const float u = p.uniform_resample[b * (k + 1) + first];
  int64_t token = -1;
  if (first < k_b) {  // rejected: the residual max(target - draft, 0)
    const WeightRow residual{target_row,
                             p.draft_probs != nullptr ? p.draft_probs + (b * k + first) * vocab
                                                      : nullptr,
                             p.draft_probs != nullptr ? -1 : ids[first], vocab};
    token = sample_row(residual, u, scratch);
  }
  if (token < 0) {  // bonus token, or a residual without mass: the target row itself
    token = sample_row(WeightRow{target_row, nullptr, -1, vocab}, u, scratch);
    if (token < 0) token = 0;  // not a distribution at all; stay inside the vocabulary
  }
  int64_t* out = p.output_token_ids + b * (k + 1);
  std::copy(ids, ids + first, out);
  out[first] = token;
  std::fill(out + first + 1, out + k + 1, int64_t{-1});
  p.num_accepted[b] = static_cast<int32_t>(first);
}

std::tuple<at::Tensor, at::Tensor> rejection_sample_cpu(
    const at::Tensor& draft_token_ids, const c10::optional<at::Tensor>& draft_probs,
    const at::Tensor& target_probs, const at::Tensor& uniform_accept,
    const at::Tensor& uniform_resample, const c10::optional<at::Tensor>& num_draft_tokens) {
  const RejectionSampleArgs args =
      check_rejection_sample(draft_token_ids, draft_probs, target_probs, uniform_accept,
                             uniform_resample, num_draft_tokens);
  if (num_draft_tokens.has_value()) {
    check_num_draft_tokens_values("rejection_sample", *num_draft_tokens, args.k);
  }
  check_draft_ids_values("rejection_sample", draft_token_ids, num_draft_tokens, args.vocab);
  auto [output_token_ids, num_accepted] = make_verify_outputs(draft_token_ids);
  const RejectionSampleParams p = make_rejection_sample_params(
      draft_token_ids, draft_probs, target_probs, uniform_accept, uniform_resample,
      num_draft_tokens, output_token_ids, num_accepted, args);
  // A request reads about one probability row; small vocabularies batch many requests per task.
  const int64_t grain = std::max<int64_t>(1, 32768 / (args.vocab + 64));
  at::parallel_for(0, args.batch, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch;  // tile totals of the row being sampled
    for (int64_t b = begin; b < end; ++b) rejection_sample_request(p, b, scratch);
  });
  return {output_token_ids, num_accepted};
}

std::tuple<at::Tensor, at::Tensor> greedy_verify_cpu(
    const at::Tensor& draft_token_ids, const at::Tensor& target_token_ids,
    const c10::optional<at::Tensor>& num_draft_tokens) {
  check_greedy_verify(draft_token_ids, target_token_ids, num_draft_tokens);
  const int64_t k = draft_token_ids.size(1);
  if (num_draft_tokens.has_value()) {
    check_num_draft_tokens_values("greedy_verify", *num_draft_tokens, k);
  }
  auto [output_token_ids, num_accepted] = make_verify_outputs(draft_token_ids);
  const GreedyVerifyParams p = make_greedy_verify_params(
      draft_token_ids, target_token_ids, num_draft_tokens, output_token_ids, num_accepted);
  at::parallel_for(0, p.batch, 4096, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) greedy_verify_request(p, b);
  });
  return {output_token_ids, num_accepted};
}

}  // namespace

TORCH_LIBRARY_IMPL(pagedspec, CPU, m) {
  m.impl("rejection_sample", &rejection_sample_cpu);
  m.impl("greedy_verify", &greedy_verify_cpu);
}

}  // namespace pagedspec
