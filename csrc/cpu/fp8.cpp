// CPU kernels for quantize_fp8 / dequantize_fp8 (the same conversion the FP8 caches use): the
// checks here, the conversion loops built per ISA level (cpu/fp8_impl.h).
#include <ATen/ATen.h>
#include <torch/library.h>

#include "cpu/kernel_levels.h"
#include "fp8_checks.h"

namespace pagedspec {
namespace {

void quantize_fp8_cpu(at::Tensor& out, const at::Tensor& input, const at::Tensor& scale) {
  const auto args = check_fp8_convert("quantize_fp8", out, input, scale, /*quantize=*/true);
  PAGEDSPEC_CPU_CALL(quantize_fp8, out, input, args);
}

void dequantize_fp8_cpu(at::Tensor& out, const at::Tensor& input, const at::Tensor& scale) {
  const auto args = check_fp8_convert("dequantize_fp8", out, input, scale, /*quantize=*/false);
  PAGEDSPEC_CPU_CALL(dequantize_fp8, out, input, args);
}

}  // namespace

TORCH_LIBRARY_IMPL(pagedspec, CPU, m) {
  m.impl("quantize_fp8", &quantize_fp8_cpu);
  m.impl("dequantize_fp8", &dequantize_fp8_cpu);
}

}  // namespace pagedspec
