// CPU kernels for rejection_sample and greedy_verify. The inverse-CDF draw follows the summation
// order fixed in include/pagedspec/sampling.h to the bit, so the CPU and CUDA kernels emit the same
// tokens for the same inputs.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>

#include "pagedspec/sampling.h"
#include "sampling_checks.h"

namespace pagedspec {
namespace {

// Spans summed side by side: each span is still its own chain in index order (as span_total), and
// independent chains keep several adders busy instead of waiting on one.
constexpr int kLockstepSpans = 8;

// totals[j] = span_total of span j, for all kSampleSpans spans.
template <bool kDraftRow>
void span_totals(const WeightRow& row, int64_t span, float* totals) {
  const int64_t vocab = row.vocab;
  const int64_t full_spans = std::min<int64_t>(vocab / span, kSampleSpans);
  int j = 0;
  for (; j + kLockstepSpans <= full_spans; j += kLockstepSpans) {
    const float* target = row.target + j * span;
    const float* draft = kDraftRow ? row.draft + j * span : nullptr;
    float acc[kLockstepSpans] = {};
    for (int64_t s = 0; s < span; ++s) {
      for (int l = 0; l < kLockstepSpans; ++l) {
        const float q = kDraftRow ? draft[l * span + s] : 0.f;
        acc[l] = acc[l] + residual_weight(target[l * span + s], q);
      }
    }
    std::copy(acc, acc + kLockstepSpans, totals + j);
  }
  for (; j < kSampleSpans; ++j) {
    const int64_t begin = std::min<int64_t>(j * span, vocab);
    totals[j] = span_total(row, begin, std::min<int64_t>(begin + span, vocab));
  }
  // The lockstep loop read a one-hot draft as q = 0: redo the one span holding the drafted token.
  if (!kDraftRow && row.one_hot >= 0 && row.one_hot < vocab) {
    const int64_t j1 = row.one_hot / span;
    totals[j1] = span_total(row, j1 * span, std::min<int64_t>((j1 + 1) * span, vocab));
  }
}

// Inverse CDF of the row's weights with uniform u, in the order of sampling.h. Returns -1 when no
// weight is positive (the caller falls back to the target row).
int64_t inverse_cdf(const WeightRow& row, float u) {
  const int64_t span = sample_span_size(row.vocab);
  float totals[kSampleSpans], incl[kSampleSpans];
  if (row.draft != nullptr) {
    span_totals<true>(row, span, totals);
  } else {
    span_totals<false>(row, span, totals);
  }
  std::copy(totals, totals + kSampleSpans, incl);
  scan_span_totals(incl);
  const float total = incl[kSampleSpans - 1];
  if (!(total > 0.f)) return -1;
  const float threshold = u * total;
  for (int j = 0; j < kSampleSpans; ++j) {
    const float excl = j > 0 ? incl[j - 1] : 0.f;
    if (excl + totals[j] > threshold) {
      const int64_t begin = j * span;
      float acc = 0.f;
      const int64_t t =
          span_crossing(row, begin, std::min<int64_t>(begin + span, row.vocab), excl, threshold,
                        &acc);
      if (t >= 0) return t;
      break;  // cannot happen (the span's last positive weight crosses); clamp below
    }
  }
  // u * total rounded up to the largest prefix: the last positive-weight token.
  for (int64_t t = row.vocab - 1; t >= 0; --t) {
    if (row.weight(t) > 0.f) return t;
  }
  return -1;
}

void rejection_sample_request(const RejectionSampleParams& p, int64_t b) {
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
    token = inverse_cdf(residual, u);
  }
  if (token < 0) {  // bonus token, or a residual without mass: the target row itself
    token = inverse_cdf(WeightRow{target_row, nullptr, -1, vocab}, u);
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
  RejectionSampleParams p{};
  p.draft_token_ids = draft_token_ids.const_data_ptr<int64_t>();
  p.draft_probs = draft_probs.has_value() ? draft_probs->const_data_ptr<float>() : nullptr;
  p.target_probs = target_probs.const_data_ptr<float>();
  p.uniform_accept = uniform_accept.const_data_ptr<float>();
  p.uniform_resample = uniform_resample.const_data_ptr<float>();
  p.num_draft_tokens =
      num_draft_tokens.has_value() ? num_draft_tokens->const_data_ptr<int32_t>() : nullptr;
  p.output_token_ids = output_token_ids.data_ptr<int64_t>();
  p.num_accepted = num_accepted.data_ptr<int32_t>();
  p.batch = args.batch;
  p.k = args.k;
  p.vocab = args.vocab;
  // A request reads about one probability row; small vocabularies batch many requests per task.
  const int64_t grain = std::max<int64_t>(1, 32768 / (args.vocab + 64));
  at::parallel_for(0, args.batch, grain, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) rejection_sample_request(p, b);
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
  GreedyVerifyParams p{};
  p.draft_token_ids = draft_token_ids.const_data_ptr<int64_t>();
  p.target_token_ids = target_token_ids.const_data_ptr<int64_t>();
  p.num_draft_tokens =
      num_draft_tokens.has_value() ? num_draft_tokens->const_data_ptr<int32_t>() : nullptr;
  p.output_token_ids = output_token_ids.data_ptr<int64_t>();
  p.num_accepted = num_accepted.data_ptr<int32_t>();
  p.batch = draft_token_ids.size(0);
  p.k = k;
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
