// The CPU quantize_fp8 / dequantize_fp8 kernels, one source built once per ISA level (cpu/isa.h):
// included only by cpu/kernels_<level>.cpp after the level's `#pragma GCC target`.
#include "cpu/vec.h"

namespace pagedspec {
namespace PAGEDSPEC_CPU_NAMESPACE {
namespace {

// Calls row_fn(in, out, scale) for each row of head_size elements, in parallel: row r uses the
// scale of head r % num_heads (num_heads is 1 for a per-tensor scale).
template <typename SrcT, typename DstT, typename Fn>
void for_each_row(const Fp8ConvertParams<SrcT, DstT>& p, Fn row_fn) {
  const int64_t rows = p.head_size ? p.numel / p.head_size : 0;
  at::parallel_for(0, rows, 4096 / std::max<int64_t>(p.head_size, 1) + 1,
                   [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      row_fn(p.input + r * p.head_size, p.out + r * p.head_size,
             p.scale.at(static_cast<int>(r % p.num_heads)));
    }
  });
}

template <typename SrcT, typename DstT>
Fp8ConvertParams<SrcT, DstT> make_params(const at::Tensor& out, const at::Tensor& input,
                                         const Fp8ConvertArgs& args) {
  return Fp8ConvertParams<SrcT, DstT>{static_cast<const SrcT*>(input.const_data_ptr()),
                                      static_cast<DstT*>(out.data_ptr()), args.scale, args.numel,
                                      args.head_size, args.num_heads};
}

// One row of dequantize_fp8, 16 codes at a time through the attention kernel's CacheReader: its
// float images (exact) times kImage (exact, a power of two) times the scale is decode(code,
// scale) with its one rounding. NaNs become sign | 0x7FC00000 as fp8_to_float's (the images' NaN
// lose the sign and e5m2's keep a payload), then the store converts in a loop that vectorizes.
// The scalar select chain of decode did not (1.8 GB/s on one AVX-512 core).
template <CacheFormat F, typename DstT>
void dequantize_fp8_row(const CacheReader<uint8_t, F>& reader, const uint8_t* __restrict in,
                        DstT* __restrict out, int n, float scale) {
  const vfloat image_scale = vset1(reader.kImage), value_scale = vset1(scale);
  alignas(64) float values[kLanes];
  int d = 0;
  for (; d + kLanes <= n; d += kLanes) {
    // Two products, not one by kImage x scale, which could overflow where decode does not.
    vstore(values, vmul(vmul(reader.load16(in + d), image_scale), value_scale));
#pragma omp simd
    for (int i = 0; i < kLanes; ++i) {
      const uint32_t bits = float_as_bits(values[i]);
      const uint32_t nan = (uint32_t(in[d + i] & 0x80u) << 24) | 0x7FC00000u;
      const float value = bits_as_float((bits & 0x7FFFFFFFu) > 0x7F800000u ? nan : bits);
      out[d + i] = ScalarConvert<DstT>::from_float(value);
    }
  }
  for (; d < n; ++d) {
    out[d] = ScalarConvert<DstT>::from_float(dequantize_fp8_value<F>(in[d], scale));
  }
}

}  // namespace

void quantize_fp8(at::Tensor& out, const at::Tensor& input, const Fp8ConvertArgs& args) {
  PAGEDSPEC_DISPATCH_ACTIVATION(input.scalar_type(), "quantize_fp8", "input", [&] {
    PAGEDSPEC_DISPATCH_FP8_FORMAT(args.format, [&] {
      const auto p = make_params<scalar_t, uint8_t>(out, input, args);
      for_each_row(p, [&](const scalar_t* in, uint8_t* row_out, float scale) {
        quantize_fp8_row<kFp8Format>(in, row_out, p.head_size, scale);
      });
    });
  });
}

void dequantize_fp8(at::Tensor& out, const at::Tensor& input, const Fp8ConvertArgs& args) {
  PAGEDSPEC_DISPATCH_ACTIVATION(out.scalar_type(), "dequantize_fp8", "out", [&] {
    PAGEDSPEC_DISPATCH_FP8_FORMAT(args.format, [&] {
      const auto p = make_params<uint8_t, scalar_t>(out, input, args);
      CacheReader<uint8_t, kFp8Format> reader;  // read-only once built: shared by the threads
      reader.init();
      for_each_row(p, [&](const uint8_t* in, scalar_t* row_out, float scale) {
        dequantize_fp8_row(reader, in, row_out, static_cast<int>(p.head_size), scale);
      });
    });
  });
}

}  // namespace PAGEDSPEC_CPU_NAMESPACE
}  // namespace pagedspec
