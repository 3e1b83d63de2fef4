// CUDA kernels for the cache-management ops: reshape_and_cache, copy_blocks, swap_blocks.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <vector>

#include "cache_checks.h"
#include "cuda/cuda_utils.cuh"
#include "pagedspec/cache_params.h"

namespace pagedspec {
namespace {

constexpr int kThreads = 256;

// One thread block per token; each thread converts VEC consecutive elements of one head (VEC
// divides head_size, so a vector never straddles two heads and loads are 16 bytes wide).
template <typename InT, typename CacheT, CacheFormat F, int VEC>
__global__ void __launch_bounds__(kThreads)
    reshape_and_cache_kernel(const ReshapeAndCacheParams<InT, CacheT> p) {
  using Codec = CacheCodec<CacheT, F>;
  const int64_t t = blockIdx.x;
  const int64_t slot = p.slot_mapping[t];
  // -1 is padding; an out-of-range slot (caught on the host only with PAGEDSPEC_DEBUG=1) is
  // dropped rather than written out of bounds. A slot repeated by several tokens (also a debug
  // check) is written by each of their blocks: every element ends up holding one of those
  // tokens' values, which one unspecified, and nothing outside the slot is touched.
  if (slot < 0 || slot >= p.geo.num_slots()) return;
  const int head_size = p.geo.head_size;
  const int vecs = p.geo.num_kv_heads * head_size / VEC;
  CacheT* k_dst = p.key_cache + p.geo.slot_offset(slot);
  CacheT* v_dst = p.value_cache + p.geo.slot_offset(slot);
  for (int i = threadIdx.x; i < vecs; i += blockDim.x) {
    const int h = i * VEC / head_size;
    const int d = i * VEC % head_size;
    const auto k_in = *reinterpret_cast<const Vec<InT, VEC>*>(
        p.key + t * p.key_token_stride + h * p.key_head_stride + d);
    const auto v_in = *reinterpret_cast<const Vec<InT, VEC>*>(
        p.value + t * p.value_token_stride + h * p.value_head_stride + d);
    const float ks = p.k_scale.at(h);
    const float vs = p.v_scale.at(h);
    Vec<CacheT, VEC> k_out, v_out;
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      k_out.v[j] = Codec::encode(ScalarConvert<InT>::to_float(k_in.v[j]), ks);
      v_out.v[j] = Codec::encode(ScalarConvert<InT>::to_float(v_in.v[j]), vs);
    }
    *reinterpret_cast<Vec<CacheT, VEC>*>(k_dst + i * VEC) = k_out;
    *reinterpret_cast<Vec<CacheT, VEC>*>(v_dst + i * VEC) = v_out;
  }
}

void reshape_and_cache_cuda(const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache,
                            at::Tensor& value_cache, const at::Tensor& slot_mapping,
                            const c10::optional<at::Tensor>& k_scale,
                            const c10::optional<at::Tensor>& v_scale) {
  const ReshapeAndCacheArgs args =
      check_reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale);
  if (debug_checks_enabled()) {
    check_slot_mapping_values("reshape_and_cache", slot_mapping.cpu(), args.geo.num_slots());
  }
  if (args.num_tokens == 0) return;
  check_cache_alignment("reshape_and_cache", "key_cache", key_cache, args.geo.block_stride);
  check_cache_alignment("reshape_and_cache", "value_cache", value_cache, args.geo.block_stride);
  const c10::cuda::CUDAGuard guard(key.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  PAGEDSPEC_DISPATCH_ACTIVATION(key.scalar_type(), "reshape_and_cache", "key", [&] {
    using in_t = device_t<scalar_t>;
    PAGEDSPEC_DISPATCH_CACHE_FORMAT(args.format, [&] {
      using store_t = std::conditional_t<kCacheFormat == CacheFormat::kNative, in_t, uint8_t>;
      const auto p = make_reshape_and_cache_params<in_t, store_t>(key, value, key_cache,
                                                                  value_cache, slot_mapping, args);
      constexpr int kVec = kVec16<in_t>;
      // 16-byte loads need every row start aligned; otherwise fall back to scalar accesses. (The
      // caches start 16-byte aligned and strided blocks are 16-byte multiples apart, checked
      // above, and a slot is a multiple of kVec elements when head_size is, so the cache side of
      // a vector access is aligned too.)
      const bool vectorizable =
          args.geo.head_size % kVec == 0 && p.key_token_stride % kVec == 0 &&
          p.key_head_stride % kVec == 0 && p.value_token_stride % kVec == 0 &&
          p.value_head_stride % kVec == 0 && is_aligned(p.key, 16) && is_aligned(p.value, 16);
      if (vectorizable) {
        reshape_and_cache_kernel<in_t, store_t, kCacheFormat, kVec>
            <<<args.num_tokens, kThreads, 0, stream>>>(p);
      } else {
        reshape_and_cache_kernel<in_t, store_t, kCacheFormat, 1>
            <<<args.num_tokens, kThreads, 0, stream>>>(p);
      }
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  });
}

// Copies one block of `block_bytes` bytes from src to dst, 16 bytes per access when VecT is uint4.
template <typename VecT>
__device__ __forceinline__ void copy_block_bytes(const char* src, char* dst, int64_t block_bytes) {
  const int64_t n = block_bytes / static_cast<int64_t>(sizeof(VecT));
  const VecT* s = reinterpret_cast<const VecT*>(src);
  VecT* d = reinterpret_cast<VecT*>(dst);
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) d[i] = s[i];
}

// grid = (num_pairs, num_layers): one thread block copies one block of one layer's K and V.
template <typename VecT>
__global__ void __launch_bounds__(kThreads)
    copy_blocks_kernel(const CopyBlocksParams p, int64_t num_blocks) {
  const int64_t pair = blockIdx.x;
  const int layer = blockIdx.y;
  const int64_t src = p.block_mapping[2 * pair];
  const int64_t dst = p.block_mapping[2 * pair + 1];
  if (src < 0 || src >= num_blocks || dst < 0 || dst >= num_blocks) return;
  for (void* base : {p.key_caches[layer], p.value_caches[layer]}) {
    char* bytes = static_cast<char*>(base);
    copy_block_bytes<VecT>(bytes + src * p.block_stride_bytes, bytes + dst * p.block_stride_bytes,
                           p.block_bytes);
  }
}

void copy_blocks_cuda(at::TensorList key_caches, at::TensorList value_caches,
                      const at::Tensor& block_mapping) {
  const CopyBlocksArgs args = check_copy_blocks(key_caches, value_caches, block_mapping);
  if (key_caches.empty() || block_mapping.size(0) == 0) return;
  if (debug_checks_enabled()) {
    check_block_mapping_values("copy_blocks", block_mapping.cpu(), args.num_blocks,
                               args.num_blocks, /*forbid_aliasing=*/true);
  }
  const int64_t layers = static_cast<int64_t>(key_caches.size());
  // The uint4 path (block_bytes % 16 == 0) needs each cache's base and block stride 16-byte
  // aligned.
  for (int64_t l = 0; l < layers; ++l) {
    check_cache_alignment("copy_blocks", "key_caches[" + std::to_string(l) + "]", key_caches[l],
                          args.block_stride);
    check_cache_alignment("copy_blocks", "value_caches[" + std::to_string(l) + "]",
                          value_caches[l], args.block_stride);
  }
  const int64_t block_stride_bytes =
      args.block_stride * static_cast<int64_t>(key_caches[0].element_size());
  const c10::cuda::CUDAGuard guard(key_caches[0].device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  // Layer pointers travel in the kernel's parameters: one launch per kCopyBlocksMaxLayers layers.
  for (int64_t first = 0; first < layers; first += kCopyBlocksMaxLayers) {
    CopyBlocksParams p{};
    p.num_layers = static_cast<int>(std::min<int64_t>(kCopyBlocksMaxLayers, layers - first));
    for (int l = 0; l < p.num_layers; ++l) {
      p.key_caches[l] = key_caches[first + l].data_ptr();
      p.value_caches[l] = value_caches[first + l].data_ptr();
    }
    p.block_mapping = block_mapping.const_data_ptr<int64_t>();
    p.num_pairs = block_mapping.size(0);
    p.block_bytes = args.block_bytes;
    p.block_stride_bytes = block_stride_bytes;
    const dim3 grid(static_cast<unsigned>(p.num_pairs), static_cast<unsigned>(p.num_layers));
    if (args.block_bytes % 16 == 0) {
      copy_blocks_kernel<uint4><<<grid, kThreads, 0, stream>>>(p, args.num_blocks);
    } else {
      copy_blocks_kernel<uint8_t><<<grid, kThreads, 0, stream>>>(p, args.num_blocks);
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
}

// grid = num_pairs: one thread block per (src, dst) pair. src/dst may be mapped pinned host memory.
template <typename VecT>
__global__ void __launch_bounds__(kThreads)
    swap_blocks_kernel(const SwapBlocksParams p, int64_t src_blocks, int64_t dst_blocks) {
  const int64_t pair = blockIdx.x;
  const int64_t src = p.block_mapping[2 * pair];
  const int64_t dst = p.block_mapping[2 * pair + 1];
  if (src < 0 || src >= src_blocks || dst < 0 || dst >= dst_blocks) return;
  copy_block_bytes<VecT>(p.src + src * p.src_block_stride, p.dst + dst * p.dst_block_stride,
                         p.block_bytes);
}

// Device-visible address of a tensor: itself on the GPU, its mapped alias if pinned host memory.
const void* device_address(const at::Tensor& t, const char* name) {
  if (t.is_cuda()) return t.const_data_ptr();
  TORCH_CHECK(t.is_pinned(), "pagedspec.swap_blocks: ", name,
              " must be in pinned host memory when block_mapping is on CUDA (the kernel reads "
              "it directly over the bus), got pageable memory");
  void* alias = nullptr;
  C10_CUDA_CHECK(cudaHostGetDevicePointer(&alias, const_cast<void*>(t.const_data_ptr()), 0));
  return alias;
}

void swap_blocks_cuda(const at::Tensor& src, at::Tensor& dst, const at::Tensor& block_mapping) {
  const char* op = "swap_blocks";
  const SwapBlocksArgs args = check_swap_blocks(src, dst, block_mapping);
  const at::Tensor& gpu_side = src.is_cuda() ? src : dst.is_cuda() ? dst : block_mapping;
  TORCH_CHECK(gpu_side.is_cuda(), "pagedspec.", op, ": no tensor is on CUDA");
  for (const auto& [name, t] : {std::pair<const char*, const at::Tensor*>{"src", &src},
                                {"dst", &dst},
                                {"block_mapping", &block_mapping}}) {
    TORCH_CHECK(t->is_cpu() || t->device() == gpu_side.device(), "pagedspec.", op, ": ", name,
                " must be on CPU or on ", gpu_side.device(), ", got ", t->device());
  }
  const int64_t n = block_mapping.size(0);
  if (n == 0 || args.block_bytes == 0) return;
  const c10::cuda::CUDAGuard guard(gpu_side.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const char* s = static_cast<const char*>(src.const_data_ptr());
  char* d = static_cast<char*>(dst.data_ptr());

  if (block_mapping.is_cpu()) {
    // The host knows the mapping: one async copy per run of consecutive blocks (a 2-D copy of
    // `run` rows of block_bytes when either side's blocks are strided). The pairs are
    // independent (checked), so a merged run's src and dst ranges never overlap.
    check_block_mapping_values(op, block_mapping, src.size(0), dst.size(0),
                               /*forbid_aliasing=*/false);
    check_swap_pairs_independent(op, block_mapping, src, dst, args.block_bytes,
                                 args.src_block_stride, args.dst_block_stride);
    const int64_t* map = block_mapping.const_data_ptr<int64_t>();
    for (int64_t j = 0; j < n;) {
      int64_t run = 1;
      while (j + run < n && map[2 * (j + run)] == map[2 * j] + run &&
             map[2 * (j + run) + 1] == map[2 * j + 1] + run) {
        ++run;
      }
      char* run_dst = d + map[2 * j + 1] * args.dst_block_stride;
      const char* run_src = s + map[2 * j] * args.src_block_stride;
      if (args.src_block_stride == args.block_bytes && args.dst_block_stride == args.block_bytes) {
        C10_CUDA_CHECK(cudaMemcpyAsync(run_dst, run_src, run * args.block_bytes,
                                       cudaMemcpyDefault, stream));
      } else {
        C10_CUDA_CHECK(cudaMemcpy2DAsync(run_dst, args.dst_block_stride, run_src,
                                         args.src_block_stride, args.block_bytes, run,
                                         cudaMemcpyDefault, stream));
      }
      j += run;
    }
    return;
  }

  // The mapping is on the device: one kernel, with host memory accessed through its mapping. Its
  // pairs run concurrently; dependent pairs (a repeated dst, or src and dst sharing memory with a
  // pair reading what a pair writes) are caught only with PAGEDSPEC_DEBUG=1, and otherwise leave
  // the affected dst blocks with unspecified bytes (still only inside those blocks).
  if (debug_checks_enabled()) {
    const at::Tensor mapping_cpu = block_mapping.cpu();
    check_block_mapping_values(op, mapping_cpu, src.size(0), dst.size(0),
                               /*forbid_aliasing=*/false);
    check_swap_pairs_independent(op, mapping_cpu, src, dst, args.block_bytes,
                                 args.src_block_stride, args.dst_block_stride);
  }
  SwapBlocksParams p{};
  p.src = static_cast<const char*>(device_address(src, "src"));
  p.dst = static_cast<char*>(const_cast<void*>(device_address(dst, "dst")));
  p.block_mapping = block_mapping.const_data_ptr<int64_t>();
  p.num_pairs = n;
  p.block_bytes = args.block_bytes;
  p.src_block_stride = args.src_block_stride;
  p.dst_block_stride = args.dst_block_stride;
  const bool vec16 = args.block_bytes % 16 == 0 && args.src_block_stride % 16 == 0 &&
                     args.dst_block_stride % 16 == 0 && is_aligned(p.src, 16) &&
                     is_aligned(p.dst, 16);
  if (vec16) {
    swap_blocks_kernel<uint4><<<n, kThreads, 0, stream>>>(p, src.size(0), dst.size(0));
  } else {
    swap_blocks_kernel<uint8_t><<<n, kThreads, 0, stream>>>(p, src.size(0), dst.size(0));
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

TORCH_LIBRARY_IMPL(pagedspec, CUDA, m) {
  m.impl("reshape_and_cache", &reshape_and_cache_cuda);
  m.impl("copy_blocks", &copy_blocks_cuda);
  m.impl("swap_blocks", &swap_blocks_cuda);
}

}  // namespace pagedspec
