// The CPU rejection sampler, one source built once per ISA level (cpu/isa.h): included only by
// cpu/kernels_<level>.cpp after the level's `#pragma GCC target`. The inverse-CDF draw follows the
// summation order fixed in include/pagedspec/sampling.h to the bit at every level: the levels differ
// only in vector width, and no product feeds a sum here, so FMA contraction cannot change a bit.
// Requests run in parallel; a request reads its probability row once (plus one 128-weight tile
// again where the CDF crosses u).
#include "cpu/vec.h"

namespace pagedspec {
namespace PAGEDSPEC_CPU_NAMESPACE {
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

// tile_total of tile `tile`'s weights, read straight from the row: residual_weight and the tree
// of sampling.h level by level in vectors (vrelu is residual_weight's max(d, 0) with NaN as 0;
// vpair_sums makes the same additions in the same association, and IEEE addition commutes, so the
// lane order inside one addition does not matter). A partial last tile, the tile of a one-hot
// draft's token, and the baseline level (sampling.h's scalar definition, which the tests compare
// every level against) take the scalar path.
template <bool kDraftRow>
float tile_weight_total(const WeightRow& row, int64_t tile) {
#if PAGEDSPEC_CPU_LEVEL > 0
  static_assert(kSampleTile == 8 * kLanes, "the tree below starts from 8 vectors");
  const int64_t begin = tile * kSampleTile;
  const bool hot = !kDraftRow && row.one_hot >= begin && row.one_hot < begin + kSampleTile;
  if (begin + kSampleTile <= row.vocab && !hot) {
    vfloat v[8];
    for (int j = 0; j < 8; ++j) {
      const vfloat q = kDraftRow ? vload(row.draft + begin + j * kLanes) : vzero();
      v[j] = vrelu(vsub(vload(row.target + begin + j * kLanes), q));
    }
    for (int n = 8; n > 1; n /= 2) {  // 128 -> 64 -> 32 -> 16 partial sums
      for (int j = 0; j < n / 2; ++j) v[j] = vpair_sums(v[2 * j], v[2 * j + 1]);
    }
    for (int n = kLanes; n > 1; n /= 2) v[0] = vpair_sums(v[0], vzero());  // 16 -> 1
    alignas(64) float lanes[kLanes];
    vstore(lanes, v[0]);
    return lanes[0];
  }
#endif
  alignas(64) float w[kSampleTile];
  load_tile_weights<kDraftRow>(row, tile, w);
  return tile_total(w);
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
  for (int64_t i = 0; i < num_tiles; ++i) tile_totals[i] = tile_weight_total<kDraftRow>(row, i);
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

}  // namespace

void rejection_sample(const RejectionSampleParams& p) {
  // A request reads about one probability row; small vocabularies batch many requests per task.
  const int64_t grain = std::max<int64_t>(1, 32768 / (p.vocab + 64));
  at::parallel_for(0, p.batch, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch;  // tile totals of the row being sampled
    for (int64_t b = begin; b < end; ++b) rejection_sample_request(p, b, scratch);
  });
}

}  // namespace PAGEDSPEC_CPU_NAMESPACE
}  // namespace pagedspec
