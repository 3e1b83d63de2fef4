// The CPU quantize_fp8 / dequantize_fp8 kernels, one source built once per ISA level (cpu/isa.h):
// included only by cpu/kernels_<level>.cpp after the level's `#pragma GCC target`.
namespace pagedspec {
namespace PAGEDSPEC_CPU_NAMESPACE {
namespace {

// Over rows of head_size elements, so the scale is constant along the vectorized inner loop:
// row r uses the scale of head r % num_heads (num_heads is 1 for a per-tensor scale).
template <typename SrcT, typename DstT, typename Fn>
void fp8_convert_cpu_impl(const Fp8ConvertParams<SrcT, DstT>& p, Fn convert) {
  const int64_t rows = p.head_size ? p.numel / p.head_size : 0;
  at::parallel_for(0, rows, 4096 / std::max<int64_t>(p.head_size, 1) + 1,
                   [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float scale = p.scale.at(static_cast<int>(r % p.num_heads));
      const SrcT* in = p.input + r * p.head_size;
      DstT* out = p.out + r * p.head_size;
#pragma omp simd
      for (int64_t d = 0; d < p.head_size; ++d) out[d] = convert(in[d], scale);
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

// dequantize_fp8 over the same rows, 16 codes at a time through the attention kernel's
// CacheReader: its float images (exact) times kImage (exact, a power of two) times the scale is
// decode(code, scale) with its one rounding. NaNs become sign | 0x7FC00000 as fp8_to_float's
// (the images' NaN lose the sign and e5m2's keep a payload), then the store converts in a loop
// that vectorizes. The scalar select chain of decode did not (1.8 GB/s on one AVX-512 core).
template <typename DstT, CacheFormat F>
void dequantize_rows(const Fp8ConvertParams<uint8_t, DstT>& p) {
  const int64_t rows = p.head_size ? p.numel / p.head_size : 0;
  const int D = static_cast<int>(p.head_size);
  at::parallel_for(0, rows, 4096 / std::max(D, 1) + 1, [&](int64_t begin, int64_t end) {
    CacheReader<uint8_t, F> reader;
    reader.init();
    alignas(64) float values[kLanes];
    for (int64_t r = begin; r < end; ++r) {
      const float scale = p.scale.at(static_cast<int>(r % p.num_heads));
      const vfloat image_scale = vset1(reader.kImage), value_scale = vset1(scale);
      const uint8_t* in = p.input + r * D;
      DstT* out = p.out + r * D;
      int d = 0;
      for (; d + kLanes <= D; d += kLanes) {
        // Two products, not one by kImage x scale, which could overflow where decode does not.
        vstore(values, vmul(vmul(reader.load16(in + d), image_scale), value_scale));
#pragma omp simd
        for (int i = 0; i < kLanes; ++i) {
          const uint32_t bits = float_as_bits(values[i]);
          const uint32_t nan = (uint32_t(in[d + i] & 0x80u) << 24) | 0x7FC00000u;
          const float x = bits_as_float((bits & 0x7FFFFFFFu) > 0x7F800000u ? nan : bits);
          out[d + i] = ScalarConvert<DstT>::from_float(x);
        }
      }
      for (; d < D; ++d) {
        out[d] = ScalarConvert<DstT>::from_float(CacheCodec<uint8_t, F>::decode(in[d], scale));
      }
    }
  });
}

}  // namespace

void quantize_fp8(at::Tensor& out, const at::Tensor& input, const Fp8ConvertArgs& args) {
  PAGEDSPEC_DISPATCH_ACTIVATION(input.scalar_type(), "quantize_fp8", "input", [&] {
    PAGEDSPEC_DISPATCH_FP8_FORMAT(args.format, [&] {
      fp8_convert_cpu_impl(make_params<scalar_t, uint8_t>(out, input, args),
                           [](scalar_t x, float s) {
                             return CacheCodec<uint8_t, kFp8Format>::encode(
                                 ScalarConvert<scalar_t>::to_float(x), s);
                           });
    });
  });
}

void dequantize_fp8(at::Tensor& out, const at::Tensor& input, const Fp8ConvertArgs& args) {
  PAGEDSPEC_DISPATCH_ACTIVATION(out.scalar_type(), "dequantize_fp8", "out", [&] {
    PAGEDSPEC_DISPATCH_FP8_FORMAT(args.format, [&] {
      dequantize_rows<scalar_t, kFp8Format>(make_params<uint8_t, scalar_t>(out, input, args));
    });
  });
}

}  // namespace PAGEDSPEC_CPU_NAMESPACE
}  // namespace pagedspec
