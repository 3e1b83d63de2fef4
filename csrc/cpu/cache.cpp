// CPU kernels for the cache-management ops: reshape_and_cache (its conversion loops built per ISA
// level: cpu/cache_impl.h), copy_blocks, swap_blocks.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstring>
#include <type_traits>

#include "cache_checks.h"
#include "cpu/cpu_types.h"
#include "cpu/kernel_levels.h"

namespace pagedspec {
namespace {

void reshape_and_cache_cpu(const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache,
                           at::Tensor& value_cache, const at::Tensor& slot_mapping,
                           const c10::optional<at::Tensor>& k_scale,
                           const c10::optional<at::Tensor>& v_scale) {
  const ReshapeAndCacheArgs args =
      check_reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale);
  check_slot_mapping_values("reshape_and_cache", slot_mapping, args.geo.num_slots());
  PAGEDSPEC_CPU_CALL(reshape_and_cache, key, value, key_cache, value_cache, slot_mapping, args);
}

void copy_blocks_cpu(at::TensorList key_caches, at::TensorList value_caches,
                     const at::Tensor& block_mapping) {
  const CopyBlocksArgs args = check_copy_blocks(key_caches, value_caches, block_mapping);
  if (key_caches.empty()) return;
  check_block_mapping_values("copy_blocks", block_mapping, args.num_blocks, args.num_blocks,
                             /*forbid_aliasing=*/true);
  const int64_t* map = block_mapping.const_data_ptr<int64_t>();
  const int64_t n = block_mapping.size(0);
  const int64_t layers = static_cast<int64_t>(key_caches.size());
  // One task per (layer, pair, key|value): the copies are independent because no dst is a src.
  at::parallel_for(0, layers * n * 2, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t layer = i / (2 * n);
      const int64_t j = (i / 2) % n;
      const at::Tensor& cache = (i % 2 == 0) ? key_caches[layer] : value_caches[layer];
      char* base = static_cast<char*>(cache.data_ptr());
      const int64_t stride = args.block_stride * static_cast<int64_t>(cache.element_size());
      std::memcpy(base + map[2 * j + 1] * stride, base + map[2 * j] * stride, args.block_bytes);
    }
  });
}

void swap_blocks_cpu(const at::Tensor& src, at::Tensor& dst, const at::Tensor& block_mapping) {
  const SwapBlocksArgs args = check_swap_blocks(src, dst, block_mapping);
  check_device_type("swap_blocks", "block_mapping", block_mapping, at::kCPU);
  check_block_mapping_values("swap_blocks", block_mapping, src.size(0), dst.size(0),
                             /*forbid_aliasing=*/false);
  // The pairs are independent (as the CUDA kernel needs), so their order does not matter.
  check_swap_pairs_independent("swap_blocks", block_mapping, src, dst, args.block_bytes,
                               args.src_block_stride, args.dst_block_stride);
  const int64_t* map = block_mapping.const_data_ptr<int64_t>();
  const char* s = static_cast<const char*>(src.const_data_ptr());
  char* d = static_cast<char*>(dst.data_ptr());
  for (int64_t j = 0; j < block_mapping.size(0); ++j) {
    std::memcpy(d + map[2 * j + 1] * args.dst_block_stride, s + map[2 * j] * args.src_block_stride,
                args.block_bytes);
  }
}

}  // namespace

TORCH_LIBRARY_IMPL(pagedspec, CPU, m) {
  m.impl("reshape_and_cache", &reshape_and_cache_cpu);
  m.impl("copy_blocks", &copy_blocks_cpu);
  m.impl("swap_blocks", &swap_blocks_cpu);
}

}  // namespace pagedspec
