// Validation for the cache-management ops, shared by the CPU and CUDA launchers so both reject
// exactly the same inputs with the same messages.
#pragma once

#include <ATen/ATen.h>

#include <c10/util/accumulate.h>

#include <algorithm>
#include <string>
#include <unordered_set>
#include <utility>
#include <vector>

#include "checks.h"
#include "pagedspec/cache_params.h"

namespace pagedspec {

// A 4-D paged cache: dense blocks, any block stride of at least a block (check_block_strided).
// Returns the block stride in elements.
inline int64_t check_cache_tensor(const char* op, const std::string& name,
                                  const at::Tensor& cache) {
  check_dim(op, name.c_str(), cache, 4);
  const int64_t block_stride = check_block_strided(op, name, cache);
  (void)cache_format(op, name.c_str(), cache);
  return block_stride;
}

inline CacheGeometry cache_geometry(const at::Tensor& cache, int64_t block_stride) {
  return CacheGeometry{cache.size(0), static_cast<int>(cache.size(1)),
                       static_cast<int>(cache.size(2)), static_cast<int>(cache.size(3)),
                       block_stride};
}

// Validated arguments of reshape_and_cache (everything but the data pointers' types).
struct ReshapeAndCacheArgs {
  CacheGeometry geo;
  CacheFormat format;
  ScaleRef k_scale;
  ScaleRef v_scale;
  int64_t num_tokens;
};

inline ReshapeAndCacheArgs check_reshape_and_cache(
    const at::Tensor& key, const at::Tensor& value, const at::Tensor& key_cache,
    const at::Tensor& value_cache, const at::Tensor& slot_mapping,
    const c10::optional<at::Tensor>& k_scale, const c10::optional<at::Tensor>& v_scale) {
  const char* op = "reshape_and_cache";
  check_dtype(op, "key", key, {at::kHalf, at::kBFloat16, at::kFloat});
  check_same_dtype(op, "value", value, "key", key);
  check_dim(op, "key", key, 3);
  check_shape(op, "value", value, key.sizes());
  const int64_t block_stride = check_cache_pair(op, key_cache, value_cache);
  check_size(op, "key", key, 1, key_cache.size(2), "num_kv_heads of key_cache");
  check_size(op, "key", key, 2, key_cache.size(3), "head_size of key_cache");
  TORCH_CHECK(key.stride(2) == 1 && value.stride(2) == 1, "pagedspec.", op,
              ": key and value must be contiguous in the last (head_size) dimension, got strides ",
              key.stride(2), " and ", value.stride(2));
  check_dtype(op, "slot_mapping", slot_mapping, {at::kLong});
  check_dim(op, "slot_mapping", slot_mapping, 1);
  check_size(op, "slot_mapping", slot_mapping, 0, key.size(0), "num_tokens of key");
  check_contiguous(op, "slot_mapping", slot_mapping);
  for (const auto& [name, t] : {std::pair<const char*, const at::Tensor*>{"value", &value},
                                {"key_cache", &key_cache},
                                {"value_cache", &value_cache},
                                {"slot_mapping", &slot_mapping}}) {
    check_same_device(op, name, *t, "key", key);
  }
  const CacheFormat format = cache_format(op, "key_cache", key_cache);
  if (format == CacheFormat::kNative) {
    check_same_dtype(op, "key_cache", key_cache, "key", key);
  }
  ReshapeAndCacheArgs args{cache_geometry(key_cache, block_stride), format, ScaleRef{nullptr, false},
                           ScaleRef{nullptr, false}, key.size(0)};
  if (format != CacheFormat::kNative) {
    args.k_scale = make_scale_ref(op, "k_scale", k_scale, args.geo.num_kv_heads, key.device());
    args.v_scale = make_scale_ref(op, "v_scale", v_scale, args.geo.num_kv_heads, key.device());
  }
  return args;
}

// Kernel parameters from validated tensors, for the CPU and CUDA launchers alike. InT / CacheT
// are the backend's scalar types (at::Half on CPU, __half on CUDA; uint8_t for FP8 caches).
template <typename InT, typename CacheT>
ReshapeAndCacheParams<InT, CacheT> make_reshape_and_cache_params(
    const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache, at::Tensor& value_cache,
    const at::Tensor& slot_mapping, const ReshapeAndCacheArgs& args) {
  ReshapeAndCacheParams<InT, CacheT> p{};
  p.key = static_cast<const InT*>(key.const_data_ptr());
  p.value = static_cast<const InT*>(value.const_data_ptr());
  p.key_cache = static_cast<CacheT*>(key_cache.data_ptr());
  p.value_cache = static_cast<CacheT*>(value_cache.data_ptr());
  p.slot_mapping = slot_mapping.const_data_ptr<int64_t>();
  p.k_scale = args.k_scale;
  p.v_scale = args.v_scale;
  p.num_tokens = args.num_tokens;
  p.key_token_stride = key.stride(0);
  p.key_head_stride = key.stride(1);
  p.value_token_stride = value.stride(0);
  p.value_head_stride = value.stride(1);
  p.geo = args.geo;
  return p;
}

// Host-side: every slot is -1 or inside the cache, and no slot is written twice (which token
// would land is otherwise up to thread timing). `slots` must be a CPU int64 tensor.
inline void check_slot_mapping_values(const char* op, const at::Tensor& slots, int64_t num_slots) {
  const int64_t* p = slots.const_data_ptr<int64_t>();
  std::vector<std::pair<int64_t, int64_t>> used;  // (slot, token), non-negative slots only
  used.reserve(static_cast<size_t>(slots.numel()));
  for (int64_t t = 0; t < slots.numel(); ++t) {
    TORCH_CHECK(p[t] >= -1 && p[t] < num_slots, "pagedspec.", op, ": slot_mapping[", t,
                "] must be -1 or in [0, ", num_slots, "), got ", p[t]);
    if (p[t] >= 0) used.emplace_back(p[t], t);
  }
  std::sort(used.begin(), used.end());
  for (size_t i = 1; i < used.size(); ++i) {
    TORCH_CHECK(used[i].first != used[i - 1].first, "pagedspec.", op, ": slot_mapping[",
                used[i].second, "] must differ from every other non-negative slot (each slot is "
                "written at most once per call), got ", used[i].first,
                ", the same as slot_mapping[", used[i - 1].second, "]");
  }
}

// Shape/dtype of a block mapping: int64 [n, 2], contiguous.
inline void check_block_mapping_shape(const char* op, const at::Tensor& mapping) {
  check_dtype(op, "block_mapping", mapping, {at::kLong});
  check_dim(op, "block_mapping", mapping, 2);
  check_size(op, "block_mapping", mapping, 1, 2, "(src, dst) pairs");
  check_contiguous(op, "block_mapping", mapping);
}

// Host-side: ids in range; for copy-on-write also no dst that is a src and no repeated dst
// (either would make the result depend on the copy order). `mapping` must be on CPU.
inline void check_block_mapping_values(const char* op, const at::Tensor& mapping,
                                       int64_t src_blocks, int64_t dst_blocks,
                                       bool forbid_aliasing) {
  const int64_t* p = mapping.data_ptr<int64_t>();
  const int64_t n = mapping.size(0);
  for (int64_t j = 0; j < n; ++j) {
    TORCH_CHECK(p[2 * j] >= 0 && p[2 * j] < src_blocks, "pagedspec.", op, ": block_mapping[", j,
                ", 0] (src block) must be in [0, ", src_blocks, "), got ", p[2 * j]);
    TORCH_CHECK(p[2 * j + 1] >= 0 && p[2 * j + 1] < dst_blocks, "pagedspec.", op,
                ": block_mapping[", j, ", 1] (dst block) must be in [0, ", dst_blocks, "), got ",
                p[2 * j + 1]);
  }
  if (!forbid_aliasing) return;
  std::unordered_set<int64_t> srcs, dsts;
  for (int64_t j = 0; j < n; ++j) srcs.insert(p[2 * j]);
  for (int64_t j = 0; j < n; ++j) {
    const int64_t dst = p[2 * j + 1];
    TORCH_CHECK(!srcs.count(dst), "pagedspec.", op, ": block_mapping[", j, ", 1] = ", dst,
                " is also a src block; a dst must not be copied from in the same call");
    TORCH_CHECK(dsts.insert(dst).second, "pagedspec.", op, ": block_mapping[", j, ", 1] = ", dst,
                " repeats an earlier dst block; each dst may be written once");
  }
}

// Whether two tensors' byte ranges overlap (views of one buffer at any offsets and strides).
inline bool bytes_overlap(const at::Tensor& a, const at::Tensor& b) {
  if (a.device() != b.device() || a.numel() == 0 || b.numel() == 0) return false;
  const auto [a0, a1] = byte_range(a);
  const auto [b0, b1] = byte_range(b);
  return a0 < b1 && b0 < a1;
}

// Host-side, swap_blocks: the result must not depend on the order of the pairs, so that the CUDA
// kernel (every pair at once) and the host paths (copies in order, consecutive pairs merged into
// one copy) agree. So no dst block is written twice, and, when src and dst share memory, no pair
// reads bytes that a pair (itself included) writes: that rules out chains (a src that is an
// earlier dst), their reverse, and merged copy ranges that overlap. Overlap is decided on byte
// addresses, so views of one buffer at any offset are covered. `mapping` must be on CPU and its
// ids in range (check_block_mapping_values).
inline void check_swap_pairs_independent(const char* op, const at::Tensor& mapping,
                                         const at::Tensor& src, const at::Tensor& dst,
                                         int64_t block_bytes, int64_t src_stride,
                                         int64_t dst_stride) {
  const int64_t* p = mapping.const_data_ptr<int64_t>();
  const int64_t n = mapping.size(0);
  std::vector<std::pair<int64_t, int64_t>> dsts;  // (dst block, pair), sorted
  dsts.reserve(static_cast<size_t>(n));
  for (int64_t j = 0; j < n; ++j) dsts.emplace_back(p[2 * j + 1], j);
  std::sort(dsts.begin(), dsts.end());
  for (size_t i = 1; i < dsts.size(); ++i) {
    TORCH_CHECK(dsts[i].first != dsts[i - 1].first, "pagedspec.", op, ": block_mapping[",
                dsts[i].second, ", 1] must differ from every other dst block (each dst block is "
                "written at most once per call), got ", dsts[i].first, ", the same as "
                "block_mapping[", dsts[i - 1].second, ", 1]");
  }
  if (block_bytes == 0 || !bytes_overlap(src, dst)) return;
  // In dst's address space, src block s spans [delta + s * src_stride, + block_bytes) and dst
  // block d spans [d * dst_stride, + block_bytes) (dst_stride >= block_bytes, so blocks are
  // disjoint): the dst blocks that can meet src block s are floor((first - block_bytes + 1) /
  // dst_stride) .. floor(last / dst_stride), each tested exactly.
  const int64_t delta = static_cast<int64_t>(reinterpret_cast<uintptr_t>(src.const_data_ptr()) -
                                             reinterpret_cast<uintptr_t>(dst.const_data_ptr()));
  const auto floor_div = [](int64_t a, int64_t b) { return a >= 0 ? a / b : -((-a + b - 1) / b); };
  for (int64_t j = 0; j < n; ++j) {
    const int64_t first = delta + p[2 * j] * src_stride;
    const int64_t last = first + block_bytes - 1;
    const int64_t lo = floor_div(first - block_bytes + 1, dst_stride);
    const int64_t hi = floor_div(last, dst_stride);
    auto it = std::lower_bound(dsts.begin(), dsts.end(), std::pair<int64_t, int64_t>{lo, -1});
    for (; it != dsts.end() && it->first <= hi; ++it) {
      const int64_t d0 = it->first * dst_stride;
      TORCH_CHECK(!(d0 <= last && first <= d0 + block_bytes - 1), "pagedspec.", op,
                  ": block_mapping[", j, ", 0] must not overlap any dst block of the call when "
                  "src and dst share memory (pairs are not ordered: CUDA copies them all at "
                  "once), got src block ", p[2 * j], ", which overlaps dst block ", it->first,
                  " of block_mapping[", it->second, ", 1]");
    }
  }
}

// Validated arguments of copy_blocks.
struct CopyBlocksArgs {
  int64_t num_blocks;
  int64_t block_bytes;
  int64_t block_stride;  // elements, shared by every cache
};

inline CopyBlocksArgs check_copy_blocks(const at::TensorList& key_caches,
                                        const at::TensorList& value_caches,
                                        const at::Tensor& block_mapping) {
  const char* op = "copy_blocks";
  TORCH_CHECK(key_caches.size() == value_caches.size(), "pagedspec.", op,
              ": key_caches and value_caches must have the same length, got ", key_caches.size(),
              " and ", value_caches.size());
  check_block_mapping_shape(op, block_mapping);
  if (key_caches.empty()) return CopyBlocksArgs{0, 0, 0};
  const at::Tensor& ref = key_caches[0];
  const int64_t block_stride = check_cache_tensor(op, "key_caches[0]", ref);
  for (size_t l = 0; l < key_caches.size(); ++l) {
    for (const at::Tensor* t : {&key_caches[l], &value_caches[l]}) {
      const std::string name = std::string(t == &key_caches[l] ? "key_caches[" : "value_caches[") +
                               std::to_string(l) + "]";
      TORCH_CHECK(t->sizes() == ref.sizes() && t->scalar_type() == ref.scalar_type() &&
                      t->device() == ref.device(),
                  "pagedspec.", op, ": ", name, " must match key_caches[0] (shape ", ref.sizes(),
                  ", ", ref.scalar_type(), ", ", ref.device(), "), got shape ", t->sizes(), ", ",
                  t->scalar_type(), ", ", t->device());
      // One block stride for all: the kernel takes one per launch.
      TORCH_CHECK(check_block_strided(op, name, *t) == block_stride, "pagedspec.", op, ": ",
                  name, ".stride(0) (block stride) must equal key_caches[0]'s (", block_stride,
                  "), got ", t->stride(0));
    }
  }
  check_same_device(op, "block_mapping", block_mapping, "key_caches[0]", ref);
  return CopyBlocksArgs{ref.size(0),
                        c10::multiply_integers(ref.sizes().slice(1)) *
                            static_cast<int64_t>(ref.element_size()),
                        block_stride};
}

// Validated arguments of swap_blocks.
struct SwapBlocksArgs {
  int64_t block_bytes;
  int64_t src_block_stride;  // bytes
  int64_t dst_block_stride;  // bytes
};

inline SwapBlocksArgs check_swap_blocks(const at::Tensor& src, const at::Tensor& dst,
                                        const at::Tensor& block_mapping) {
  const char* op = "swap_blocks";
  // None through torch.ops arrives as an undefined tensor (the other ops reach a dtype check
  // first, which names the argument; these two are compared before any).
  TORCH_CHECK(src.defined(), "pagedspec.", op, ": src must be a Tensor, got None");
  TORCH_CHECK(dst.defined(), "pagedspec.", op, ": dst must be a Tensor, got None");
  TORCH_CHECK(src.dim() >= 1, "pagedspec.", op, ": src must have at least 1 dimension");
  const int64_t src_stride = check_block_strided(op, "src", src);
  TORCH_CHECK(dst.dim() >= 1, "pagedspec.", op, ": dst must have at least 1 dimension");
  const int64_t dst_stride = check_block_strided(op, "dst", dst);
  check_same_dtype(op, "dst", dst, "src", src);
  TORCH_CHECK(src.dim() == dst.dim() && src.sizes().slice(1) == dst.sizes().slice(1),
              "pagedspec.", op, ": dst must have the same block shape as src (", src.sizes(),
              " vs ", dst.sizes(), "); only the number of blocks may differ");
  check_block_mapping_shape(op, block_mapping);
  const auto element_size = static_cast<int64_t>(src.element_size());
  return SwapBlocksArgs{c10::multiply_integers(src.sizes().slice(1)) * element_size,
                        src_stride * element_size, dst_stride * element_size};
}

}  // namespace pagedspec
