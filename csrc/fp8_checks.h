// Validation for quantize_fp8 / dequantize_fp8, shared by the CPU and CUDA launchers.
#pragma once

#include <ATen/ATen.h>

#include "checks.h"
#include "pagedspec/cache_params.h"

namespace pagedspec {

struct Fp8ConvertArgs {
  ScaleRef scale;
  CacheFormat format;  // FP8 format of the quantized side
  int64_t numel;
  int64_t head_size;
  int64_t num_heads;
};

// `fp8` is the FP8 tensor (out of quantize, input of dequantize); `wide` the other side.
inline Fp8ConvertArgs check_fp8_convert(const char* op, const at::Tensor& out,
                                        const at::Tensor& input, const at::Tensor& scale,
                                        bool quantize) {
  const at::Tensor& fp8 = quantize ? out : input;
  const at::Tensor& wide = quantize ? input : out;
  const char* fp8_name = quantize ? "out" : "input";
  const char* wide_name = quantize ? "input" : "out";
  check_dtype(op, fp8_name, fp8, {at::kFloat8_e4m3fn, at::kFloat8_e5m2});
  check_dtype(op, wide_name, wide, {at::kHalf, at::kBFloat16, at::kFloat});
  check_shape(op, "out", out, input.sizes());
  check_contiguous(op, "out", out);
  check_contiguous(op, "input", input);
  check_same_device(op, "out", out, "input", input);
  const int64_t heads = input.dim() >= 2 ? input.size(-2) : 1;
  Fp8ConvertArgs args{};
  args.format = fp8.scalar_type() == at::kFloat8_e4m3fn ? CacheFormat::kE4M3 : CacheFormat::kE5M2;
  check_dtype(op, "scale", scale, {at::kFloat});
  check_same_device(op, "scale", scale, "input", input);
  TORCH_CHECK(scale.dim() == 0 || (scale.dim() == 1 && input.dim() >= 2 && scale.size(0) == heads),
              "pagedspec.", op, ": scale must have shape [] or [input.size(-2)] = [", heads,
              "], got ", scale.sizes());
  // Contiguity (a strided per-head scale would be read at the wrong place) and values.
  args.scale = make_scale_ref(op, "scale", scale, heads, input.device());
  args.numel = input.numel();
  args.head_size = input.dim() >= 1 ? input.size(-1) : 1;
  args.num_heads = args.scale.per_head ? heads : 1;
  return args;
}

}  // namespace pagedspec
