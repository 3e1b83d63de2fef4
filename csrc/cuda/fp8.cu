// CUDA kernels for quantize_fp8 / dequantize_fp8, using the same codec as the FP8 caches.
#include <ATen/ATen.h>
#include <torch/library.h>

#include "cuda/cuda_utils.cuh"
#include "fp8_checks.h"

namespace pagedspec {
namespace {

constexpr int kThreads = 256;

template <typename WideT, CacheFormat F>
struct Quantize {
  static __device__ __forceinline__ uint8_t apply(WideT x, float scale) {
    return CacheCodec<uint8_t, F>::encode(ScalarConvert<WideT>::to_float(x), scale);
  }
};

template <typename WideT, CacheFormat F>
struct Dequantize {
  static __device__ __forceinline__ WideT apply(uint8_t c, float scale) {
    return ScalarConvert<WideT>::from_float(CacheCodec<uint8_t, F>::decode(c, scale));
  }
};

// Grid-stride over chunks of VEC elements; VEC divides head_size, so a chunk has one scale.
template <typename SrcT, typename DstT, typename Op, int VEC>
__global__ void __launch_bounds__(kThreads)
    fp8_convert_kernel(const Fp8ConvertParams<SrcT, DstT> p) {
  const int64_t chunks = p.numel / VEC;
  for (int64_t c = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; c < chunks;
       c += int64_t(gridDim.x) * blockDim.x) {
    const int64_t i = c * VEC;
    const float scale = p.scale.at(p.scale.per_head ? (i / p.head_size) % p.num_heads : 0);
    const auto in = *reinterpret_cast<const Vec<SrcT, VEC>*>(p.input + i);
    Vec<DstT, VEC> out;
#pragma unroll
    for (int j = 0; j < VEC; ++j) out.v[j] = Op::apply(in.v[j], scale);
    *reinterpret_cast<Vec<DstT, VEC>*>(p.out + i) = out;
  }
}

template <typename SrcT, typename DstT, typename Op>
void launch_fp8_convert(const at::Tensor& out, const at::Tensor& input,
                        const Fp8ConvertArgs& args) {
  const Fp8ConvertParams<SrcT, DstT> p{static_cast<const SrcT*>(input.const_data_ptr()),
                                       static_cast<DstT*>(out.data_ptr()), args.scale, args.numel,
                                       args.head_size, args.num_heads};
  if (p.numel == 0) return;
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  constexpr int kVec = 8;  // 8 elements: 16 bytes of half/bf16, 8 bytes of FP8
  const bool vectorizable = args.head_size % kVec == 0 && p.numel % kVec == 0 &&
                            is_aligned(p.input, sizeof(SrcT) * kVec) &&
                            is_aligned(p.out, sizeof(DstT) * kVec);
  const int vec = vectorizable ? kVec : 1;
  const int64_t chunks = p.numel / vec;
  const int blocks = static_cast<int>(std::min<int64_t>(
      (chunks + kThreads - 1) / kThreads, int64_t(sm_count(input.get_device())) * 16));
  if (vectorizable) {
    fp8_convert_kernel<SrcT, DstT, Op, kVec><<<blocks, kThreads, 0, stream>>>(p);
  } else {
    fp8_convert_kernel<SrcT, DstT, Op, 1><<<blocks, kThreads, 0, stream>>>(p);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void quantize_fp8_cuda(at::Tensor& out, const at::Tensor& input, const at::Tensor& scale) {
  const auto args = check_fp8_convert("quantize_fp8", out, input, scale, /*quantize=*/true);
  const c10::cuda::CUDAGuard guard(input.device());
  PAGEDSPEC_DISPATCH_ACTIVATION(input.scalar_type(), "quantize_fp8", "input", [&] {
    using wide_t = device_t<scalar_t>;
    PAGEDSPEC_DISPATCH_FP8_FORMAT(args.format, [&] {
      launch_fp8_convert<wide_t, uint8_t, Quantize<wide_t, kFp8Format>>(out, input, args);
    });
  });
}

void dequantize_fp8_cuda(at::Tensor& out, const at::Tensor& input, const at::Tensor& scale) {
  const auto args = check_fp8_convert("dequantize_fp8", out, input, scale, /*quantize=*/false);
  const c10::cuda::CUDAGuard guard(input.device());
  PAGEDSPEC_DISPATCH_ACTIVATION(out.scalar_type(), "dequantize_fp8", "out", [&] {
    using wide_t = device_t<scalar_t>;
    PAGEDSPEC_DISPATCH_FP8_FORMAT(args.format, [&] {
      launch_fp8_convert<uint8_t, wide_t, Dequantize<wide_t, kFp8Format>>(out, input, args);
    });
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(pagedspec, CUDA, m) {
  m.impl("quantize_fp8", &quantize_fp8_cuda);
  m.impl("dequantize_fp8", &dequantize_fp8_cuda);
}

}  // namespace pagedspec
