// Validation for rejection_sample and greedy_verify, shared by the CPU and CUDA launchers so both
// reject exactly the same inputs with the same messages.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Optional.h>

#include "checks.h"
#include "pagedspec/sampling.h"

namespace pagedspec {

// Dtype, rank, contiguity and device of an index or probability tensor, in one call.
inline void check_tensor(const char* op, const char* name, const at::Tensor& t,
                         at::ScalarType dtype, int64_t ndim, const at::Tensor& ref,
                         const char* ref_name) {
  check_dtype(op, name, t, {dtype});
  check_dim(op, name, t, ndim);
  check_same_device(op, name, t, ref_name, ref);
  check_contiguous(op, name, t);
}

// draft_token_ids [batch, k] and num_draft_tokens [batch] (optional), common to both ops.
inline void check_draft_tokens(const char* op, const at::Tensor& draft_token_ids,
                               const c10::optional<at::Tensor>& num_draft_tokens) {
  check_tensor(op, "draft_token_ids", draft_token_ids, at::kLong, 2, draft_token_ids,
               "draft_token_ids");
  if (num_draft_tokens.has_value()) {
    const at::Tensor& n = *num_draft_tokens;
    check_tensor(op, "num_draft_tokens", n, at::kInt, 1, draft_token_ids, "draft_token_ids");
    check_size(op, "num_draft_tokens", n, 0, draft_token_ids.size(0),
               "batch size of draft_token_ids");
  }
}

// Host-side: every num_draft_tokens[b] in [0, k]. `n` must be a CPU int32 tensor.
inline void check_num_draft_tokens_values(const char* op, const at::Tensor& n, int64_t k) {
  const int32_t* v = n.const_data_ptr<int32_t>();
  for (int64_t b = 0; b < n.numel(); ++b) {
    TORCH_CHECK(v[b] >= 0 && v[b] <= k, "pagedspec.", op, ": num_draft_tokens[", b,
                "] must be in [0, ", k, "] (k = draft_token_ids.size(1)), got ", v[b]);
  }
}

// Host-side: every draft token id in [0, vocab). Only the first num_draft_tokens[b] ids of
// request b are read, so only those are checked (the rest may be padding such as -1).
inline void check_draft_ids_values(const char* op, const at::Tensor& ids,
                                   const c10::optional<at::Tensor>& num_draft_tokens,
                                   int64_t vocab) {
  const int64_t* v = ids.const_data_ptr<int64_t>();
  const int64_t batch = ids.size(0), k = ids.size(1);
  const int32_t* n = num_draft_tokens.has_value()
                         ? num_draft_tokens->const_data_ptr<int32_t>()
                         : nullptr;
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t k_b = n != nullptr ? n[b] : k;
    for (int64_t i = 0; i < k_b; ++i) {
      const int64_t x = v[b * k + i];
      TORCH_CHECK(x >= 0 && x < vocab, "pagedspec.", op, ": draft_token_ids[", b, ", ", i,
                  "] must be a token id in [0, ", vocab,
                  ") (vocabulary size of target_probs), got ", x);
    }
  }
}

// Validated sizes of a rejection_sample call.
struct RejectionSampleArgs {
  int64_t batch;
  int64_t k;
  int64_t vocab;
};

inline RejectionSampleArgs check_rejection_sample(
    const at::Tensor& draft_token_ids, const c10::optional<at::Tensor>& draft_probs,
    const at::Tensor& target_probs, const at::Tensor& uniform_accept,
    const at::Tensor& uniform_resample, const c10::optional<at::Tensor>& num_draft_tokens) {
  const char* op = "rejection_sample";
  check_draft_tokens(op, draft_token_ids, num_draft_tokens);
  const int64_t batch = draft_token_ids.size(0), k = draft_token_ids.size(1);
  const at::Tensor& ref = draft_token_ids;
  check_tensor(op, "target_probs", target_probs, at::kFloat, 3, ref, "draft_token_ids");
  check_size(op, "target_probs", target_probs, 0, batch, "batch size of draft_token_ids");
  check_size(op, "target_probs", target_probs, 1, k + 1,
             "k + 1: one row per draft token plus the bonus position");
  const int64_t vocab = target_probs.size(2);
  TORCH_CHECK(vocab > 0, "pagedspec.", op,
              ": target_probs.size(2) (vocabulary size) must be positive, got shape ",
              target_probs.sizes());
  if (draft_probs.has_value()) {
    const at::Tensor& q = *draft_probs;
    check_tensor(op, "draft_probs", q, at::kFloat, 3, ref, "draft_token_ids");
    check_size(op, "draft_probs", q, 0, batch, "batch size of draft_token_ids");
    check_size(op, "draft_probs", q, 1, k, "k = draft_token_ids.size(1)");
    check_size(op, "draft_probs", q, 2, vocab, "vocabulary size of target_probs");
  }
  check_tensor(op, "uniform_accept", uniform_accept, at::kFloat, 2, ref, "draft_token_ids");
  check_shape(op, "uniform_accept", uniform_accept, {batch, k});
  check_tensor(op, "uniform_resample", uniform_resample, at::kFloat, 2, ref, "draft_token_ids");
  check_shape(op, "uniform_resample", uniform_resample, {batch, k + 1});
  return RejectionSampleArgs{batch, k, vocab};
}

inline void check_greedy_verify(const at::Tensor& draft_token_ids,
                                const at::Tensor& target_token_ids,
                                const c10::optional<at::Tensor>& num_draft_tokens) {
  const char* op = "greedy_verify";
  check_draft_tokens(op, draft_token_ids, num_draft_tokens);
  check_tensor(op, "target_token_ids", target_token_ids, at::kLong, 2, draft_token_ids,
               "draft_token_ids");
  check_shape(op, "target_token_ids", target_token_ids,
              {draft_token_ids.size(0), draft_token_ids.size(1) + 1});
}

// The two outputs of both ops: int64 [batch, k + 1] and int32 [batch].
inline std::tuple<at::Tensor, at::Tensor> make_verify_outputs(const at::Tensor& draft_token_ids) {
  const int64_t batch = draft_token_ids.size(0), k = draft_token_ids.size(1);
  return {at::empty({batch, k + 1}, draft_token_ids.options().dtype(at::kLong)),
          at::empty({batch}, draft_token_ids.options().dtype(at::kInt))};
}

// Kernel parameters from validated tensors (shared by the CPU and CUDA launchers).
inline RejectionSampleParams make_rejection_sample_params(
    const at::Tensor& draft_token_ids, const c10::optional<at::Tensor>& draft_probs,
    const at::Tensor& target_probs, const at::Tensor& uniform_accept,
    const at::Tensor& uniform_resample, const c10::optional<at::Tensor>& num_draft_tokens,
    at::Tensor& output_token_ids, at::Tensor& num_accepted, const RejectionSampleArgs& args) {
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
  return p;
}

inline GreedyVerifyParams make_greedy_verify_params(
    const at::Tensor& draft_token_ids, const at::Tensor& target_token_ids,
    const c10::optional<at::Tensor>& num_draft_tokens, at::Tensor& output_token_ids,
    at::Tensor& num_accepted) {
  GreedyVerifyParams p{};
  p.draft_token_ids = draft_token_ids.const_data_ptr<int64_t>();
  p.target_token_ids = target_token_ids.const_data_ptr<int64_t>();
  p.num_draft_tokens =
      num_draft_tokens.has_value() ? num_draft_tokens->const_data_ptr<int32_t>() : nullptr;
  p.output_token_ids = output_token_ids.data_ptr<int64_t>();
  p.num_accepted = num_accepted.data_ptr<int32_t>();
  p.batch = draft_token_ids.size(0);
  p.k = draft_token_ids.size(1);
  return p;
}

}  // namespace pagedspec
