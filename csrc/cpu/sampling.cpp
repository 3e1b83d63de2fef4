// CPU launchers for rejection_sample (its kernel built per ISA level: cpu/sampling_impl.h) and
// greedy_verify. The inverse-CDF draw follows the summation order fixed in
// include/pagedspec/sampling.h to the bit, so the CPU and CUDA kernels emit the same tokens for the
// same inputs.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "cpu/kernel_levels.h"
#include "pagedspec/sampling.h"
#include "sampling_checks.h"

namespace pagedspec {
namespace {

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
  PAGEDSPEC_CPU_CALL(rejection_sample, p);
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
