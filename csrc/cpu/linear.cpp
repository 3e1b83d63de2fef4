// CPU launcher for pagedspec_models::packed_linear (the kernel, built per ISA level:
// cpu/linear_impl.h; the layout: pagedspec/packed_linear.h).
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <torch/library.h>

#include <string>

#include "checks.h"
#include "cpu/kernel_levels.h"
#include "pagedspec/packed_linear.h"

namespace pagedspec {
namespace {

// oneDNN's product on a weight it prepacked (mkldnn::_linear_pointwise, no post-op), through the
// dispatcher: a boxed call, as its schema's C++ signature varies across torch versions.
at::Tensor onednn_linear(const at::Tensor& input, const at::Tensor& weight,
                         const c10::optional<at::Tensor>& bias) {
  static const c10::OperatorHandle op =
      c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  torch::jit::Stack stack{input,
                          weight,
                          bias.has_value() ? c10::IValue(*bias) : c10::IValue(),
                          c10::IValue(std::string("none")),
                          c10::IValue(c10::List<c10::optional<at::Scalar>>()),
                          c10::IValue(std::string(""))};
  op.callBoxed(&stack);
  return stack.back().toTensor();
}

at::Tensor packed_linear_cpu(const at::Tensor& input, const at::Tensor& weight,
                             const c10::optional<at::Tensor>& bias,
                             const c10::optional<at::Tensor>& onednn_weight,
                             int64_t max_packed_rows) {
  const char* op = "packed_linear";
  check_dtype(op, "input", input, {at::kFloat, at::kBFloat16});
  check_dim(op, "input", input, 2);
  check_contiguous(op, "input", input);
  check_same_dtype(op, "weight", weight, "input", input);
  check_same_device(op, "weight", weight, "input", input);
  check_dim(op, "weight", weight, 4);
  check_contiguous(op, "weight", weight);
  const int64_t elems = packed_chunk_elems(static_cast<int>(input.element_size()));
  const int64_t M = input.size(0), K = input.size(1), N = weight.size(0) * kPackedRows;
  TORCH_CHECK(weight.size(1) * elems == K && weight.size(2) == kPackedRows &&
                  weight.size(3) == elems && N % kPackedRowsMultiple == 0,
              "pagedspec.", op, ": weight must have the packed shape [N / ", kPackedRows, ", ", K,
              " / ", elems, ", ", kPackedRows, ", ", elems, "] for input [", M, ", ", K,
              "], N a multiple of ", kPackedRowsMultiple,
              " (pagedspec.models.llama.pack_linear_weight), got ", weight.sizes());
  if (bias.has_value()) {
    check_same_dtype(op, "bias", *bias, "input", input);
    check_same_device(op, "bias", *bias, "input", input);
    check_shape(op, "bias", *bias, {N});
    check_contiguous(op, "bias", *bias);
  }
  if (onednn_weight.has_value()) {
    TORCH_CHECK(onednn_weight->is_mkldnn() && onednn_weight->dim() == 2 &&
                    onednn_weight->size(0) == N && onednn_weight->size(1) == K &&
                    onednn_weight->scalar_type() == input.scalar_type(),
                "pagedspec.", op, ": onednn_weight must be the same [", N, ", ", K, "] ",
                input.scalar_type(), " weight prepacked by oneDNN, got ",
                onednn_weight->is_mkldnn() ? "" : "a non-oneDNN tensor ", onednn_weight->sizes(),
                " ", onednn_weight->scalar_type());
    if (M > max_packed_rows) return onednn_linear(input, *onednn_weight, bias);
  }
  at::Tensor out = at::empty({M, N}, input.options());
  if (M == 0 || N == 0) return out;
  if (K == 0) return bias.has_value() ? out.copy_(bias->expand({M, N})) : out.zero_();
  const PackedLinearParams p{input.const_data_ptr(),
                             weight.const_data_ptr(),
                             bias.has_value() ? bias->const_data_ptr() : nullptr,
                             out.data_ptr(),
                             M,
                             N,
                             K,
                             input.scalar_type() == at::kBFloat16 ? PackedLinearDtype::kBFloat16
                                                                  : PackedLinearDtype::kFloat32};
  const CpuConfig config = cpu_config();
  PAGEDSPEC_CPU_CALL_AT(config.isa, packed_linear, p, config.bf16_dot);
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(pagedspec_models, CPU, m) { m.impl("packed_linear", &packed_linear_cpu); }
// A oneDNN-prepacked onednn_weight carries the MkldnnCPU key, which then selects the kernel.
TORCH_LIBRARY_IMPL(pagedspec_models, MkldnnCPU, m) { m.impl("packed_linear", &packed_linear_cpu); }

}  // namespace pagedspec
