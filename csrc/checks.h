// Argument validation shared by every launcher (CPU and CUDA). Torch-dependent by design: the
// kernels under include/pagedspec/ never see a Tensor.
//
// Every message has the form "pagedspec.<op>: <argument> <expected>, got <given>" so a caller can
// tell at once which argument is wrong and why.
#pragma once

#include <ATen/ATen.h>
#include <ATen/MemoryOverlap.h>
#include <c10/util/Optional.h>
#include <c10/util/accumulate.h>

#include <cmath>
#include <cstdlib>
#include <initializer_list>
#include <sstream>
#include <string>
#include <utility>

#include "pagedspec/codec.h"

namespace pagedspec {

// True when PAGEDSPEC_DEBUG=1: enables checks on CUDA that need a device-to-host copy.
inline bool debug_checks_enabled() {
  static const bool enabled = [] {
    const char* v = std::getenv("PAGEDSPEC_DEBUG");
    return v != nullptr && std::string(v) == "1";
  }();
  return enabled;
}

inline std::string dtype_list(std::initializer_list<at::ScalarType> allowed) {
  std::ostringstream os;
  bool first = true;
  for (auto t : allowed) {
    os << (first ? "" : ", ") << t;
    first = false;
  }
  return os.str();
}

inline void check_dtype(const char* op, const char* name, const at::Tensor& t,
                        std::initializer_list<at::ScalarType> allowed) {
  for (auto a : allowed) {
    if (t.scalar_type() == a) return;
  }
  TORCH_CHECK(false, "pagedspec.", op, ": ", name, " must have dtype in {", dtype_list(allowed),
              "}, got ", t.scalar_type());
}

inline void check_same_dtype(const char* op, const char* name, const at::Tensor& t,
                             const char* ref_name, const at::Tensor& ref) {
  TORCH_CHECK(t.scalar_type() == ref.scalar_type(), "pagedspec.", op, ": ", name,
              " must have the same dtype as ", ref_name, " (", ref.scalar_type(), "), got ",
              t.scalar_type());
}

inline void check_dim(const char* op, const char* name, const at::Tensor& t, int64_t ndim) {
  TORCH_CHECK(t.dim() == ndim, "pagedspec.", op, ": ", name, " must have ", ndim,
              " dimensions, got ", t.dim(), " (shape ", t.sizes(), ")");
}

inline void check_size(const char* op, const char* name, const at::Tensor& t, int64_t dim,
                       int64_t expected, const char* what = nullptr) {
  TORCH_CHECK(t.size(dim) == expected, "pagedspec.", op, ": ", name, ".size(", dim, ") must be ",
              expected, what ? " (" : "", what ? what : "", what ? ")" : "", ", got ", t.size(dim),
              " (shape ", t.sizes(), ")");
}

inline void check_shape(const char* op, const char* name, const at::Tensor& t,
                        at::IntArrayRef expected) {
  TORCH_CHECK(t.sizes() == expected, "pagedspec.", op, ": ", name, " must have shape ", expected,
              ", got ", t.sizes());
}

inline void check_contiguous(const char* op, const char* name, const at::Tensor& t) {
  TORCH_CHECK(t.is_contiguous(), "pagedspec.", op, ": ", name,
              " must be contiguous, got strides ", t.strides(), " for shape ", t.sizes());
}

// A paged cache (or swap_blocks' src/dst) may be a strided view along its block dimension (dim
// 0): every other dimension is dense, and the block stride is at least one block's elements, so
// blocks never overlap (contract extension "strided block dimension": vLLM hands out one page
// per block holding both K and V). Returns the block stride in elements; one block's elements
// when there is at most one block (its stride is then never used).
inline int64_t check_block_strided(const char* op, const std::string& name, const at::Tensor& t) {
  int64_t block_elems = 1;
  for (int64_t d = t.dim() - 1; d >= 1; --d) {
    TORCH_CHECK(t.size(d) == 1 || t.stride(d) == block_elems, "pagedspec.", op, ": ", name,
                " must be contiguous in every dimension but the first (block) one, got strides ",
                t.strides(), " for shape ", t.sizes());
    block_elems *= t.size(d);
  }
  if (t.dim() == 0 || t.size(0) <= 1) return block_elems;
  TORCH_CHECK(t.stride(0) >= block_elems, "pagedspec.", op, ": ", name,
              ".stride(0) (block stride) must be at least one block's elements (", block_elems,
              ") so that blocks do not overlap, got strides ", t.strides(), " for shape ",
              t.sizes());
  return t.stride(0);
}

// The bytes [begin, end) a tensor's elements lie in (non-negative strides), for overlap tests of
// strided views.
inline std::pair<uintptr_t, uintptr_t> byte_range(const at::Tensor& t) {
  int64_t last = 0;  // offset of the last element, in elements
  for (int64_t d = 0; d < t.dim(); ++d) last += (t.size(d) - 1) * std::abs(t.stride(d));
  const auto begin = reinterpret_cast<uintptr_t>(t.const_data_ptr());
  return {begin, begin + static_cast<uintptr_t>((last + 1) * t.element_size())};
}

// Whether two tensors may share memory: never when their storages differ; otherwise torch's
// answer for dense tensors, else whether their byte ranges intersect (conservative for
// interleaved views of one buffer, which no caller of these ops needs).
inline bool may_share_memory(const at::Tensor& a, const at::Tensor& b) {
  if (a.numel() == 0 || b.numel() == 0) return false;
  if (!a.storage().is_alias_of(b.storage())) return false;
  if (a.is_non_overlapping_and_dense() && b.is_non_overlapping_and_dense()) {
    return at::get_overlap_status(a, b) != at::MemOverlapStatus::No;
  }
  const auto [a0, a1] = byte_range(a);
  const auto [b0, b1] = byte_range(b);
  return a0 < b1 && b0 < a1;
}

inline void check_same_device(const char* op, const char* name, const at::Tensor& t,
                              const char* ref_name, const at::Tensor& ref) {
  TORCH_CHECK(t.device() == ref.device(), "pagedspec.", op, ": ", name,
              " must be on the same device as ", ref_name, " (", ref.device(), "), got ",
              t.device());
}

inline void check_device_type(const char* op, const char* name, const at::Tensor& t,
                              at::DeviceType type) {
  TORCH_CHECK(t.device().type() == type, "pagedspec.", op, ": ", name, " must be on ", type,
              ", got ", t.device());
}

// Which storage format a cache dtype is. Throws for dtypes no cache may have.
inline CacheFormat cache_format(const char* op, const char* name, const at::Tensor& cache) {
  switch (cache.scalar_type()) {
    case at::kHalf:
    case at::kBFloat16:
    case at::kFloat:
      return CacheFormat::kNative;
    case at::kFloat8_e4m3fn:
      return CacheFormat::kE4M3;
    case at::kFloat8_e5m2:
      return CacheFormat::kE5M2;
    default:
      TORCH_CHECK(false, "pagedspec.", op, ": ", name,
                  " must have dtype in {Half, BFloat16, Float, Float8_e4m3fn, Float8_e5m2}, got ",
                  cache.scalar_type());
  }
}

// CUDA launchers: a cache must start on a 16-byte boundary, and a strided cache's block stride
// must be a multiple of 16 bytes, since the kernels access it 16 bytes at a time at offsets
// that are multiples of 16 from each block's start (whole slots or blocks; the launchers pick
// narrower accesses when a slot or block is not a multiple of 16 bytes). A view at an odd offset
// would otherwise fault. Same rule for the attention kernels' caches.
inline void check_cache_alignment(const char* op, const std::string& name, const at::Tensor& cache,
                                  int64_t block_stride) {
  const auto address = reinterpret_cast<uintptr_t>(cache.const_data_ptr());
  TORCH_CHECK(address % 16 == 0, "pagedspec.", op, ": ", name,
              " must start on a 16-byte boundary on CUDA (the kernel accesses it 16 bytes at a "
              "time), got address ", cache.const_data_ptr(), " (storage offset ",
              cache.storage_offset(), " elements of ", cache.element_size(), " bytes)");
  const int64_t dense = cache.dim() == 0 ? 1 : c10::multiply_integers(cache.sizes().slice(1));
  const int64_t stride_bytes = block_stride * static_cast<int64_t>(cache.element_size());
  TORCH_CHECK(block_stride == dense || stride_bytes % 16 == 0, "pagedspec.", op, ": ", name,
              ".stride(0) (block stride) must be a multiple of 16 bytes on CUDA when blocks are "
              "not contiguous (each block is accessed 16 bytes at a time from its start), got ",
              block_stride, " elements = ", stride_bytes, " bytes");
}

// key_cache and value_cache of one call: 4-D paged caches of one shape, dtype and block stride
// (the kernels address both with one offset). Returns the block stride in elements.
inline int64_t check_cache_pair(const char* op, const at::Tensor& key_cache,
                                const at::Tensor& value_cache) {
  check_dim(op, "key_cache", key_cache, 4);
  check_dim(op, "value_cache", value_cache, 4);
  const int64_t block_stride = check_block_strided(op, "key_cache", key_cache);
  check_block_strided(op, "value_cache", value_cache);
  (void)cache_format(op, "key_cache", key_cache);
  check_same_dtype(op, "value_cache", value_cache, "key_cache", key_cache);
  check_shape(op, "value_cache", value_cache, key_cache.sizes());
  TORCH_CHECK(value_cache.size(0) <= 1 || value_cache.stride(0) == key_cache.stride(0),
              "pagedspec.", op, ": value_cache.stride(0) (block stride) must equal key_cache's (",
              key_cache.stride(0), "), got ", value_cache.stride(0));
  return block_stride;
}

// Host-side: every entry of a float32 scale is finite and positive (a zero, negative, infinite or
// NaN scale turns every stored or read value into garbage). `s` must be a contiguous CPU tensor.
inline void check_scale_values(const char* op, const char* name, const at::Tensor& s) {
  const float* p = s.const_data_ptr<float>();
  for (int64_t i = 0; i < s.numel(); ++i) {
    if (std::isfinite(p[i]) && p[i] > 0.0f) continue;
    if (s.dim() == 0) {
      TORCH_CHECK(false, "pagedspec.", op, ": ", name, " must be finite and positive, got ", p[i]);
    }
    TORCH_CHECK(false, "pagedspec.", op, ": ", name, " must be finite and positive, got ", name,
                "[", i, "] = ", p[i]);
  }
}

// Validates an FP8 scale (float32, [] or [num_heads], contiguous, on `device`, finite and
// positive) and returns a view of it for the kernels. The values are checked whenever the scale
// is on the host, and on CUDA only with PAGEDSPEC_DEBUG=1 (it needs a device-to-host copy).
inline ScaleRef make_scale_ref(const char* op, const char* name, const at::Tensor& s,
                               int64_t num_heads, const at::Device& device) {
  check_dtype(op, name, s, {at::kFloat});
  TORCH_CHECK(s.device() == device, "pagedspec.", op, ": ", name, " must be on ", device,
              ", got ", s.device());
  const bool per_head = s.dim() == 1 && s.size(0) == num_heads;
  TORCH_CHECK(s.dim() == 0 || per_head, "pagedspec.", op, ": ", name,
              " must have shape [] or [", num_heads, "], got ", s.sizes());
  // The kernels read scale[head] from the data pointer: a strided or expanded scale would be
  // read out of place (or out of bounds).
  check_contiguous(op, name, s);
  if (s.is_cpu()) {
    check_scale_values(op, name, s);
  } else if (debug_checks_enabled()) {
    check_scale_values(op, name, s.cpu());
  }
  return ScaleRef{s.const_data_ptr<float>(), per_head};
}

// An optional scale: absent reads as 1.0.
inline ScaleRef make_scale_ref(const char* op, const char* name,
                               const c10::optional<at::Tensor>& scale, int64_t num_heads,
                               const at::Device& device) {
  if (!scale.has_value()) return ScaleRef{nullptr, false};
  return make_scale_ref(op, name, *scale, num_heads, device);
}

}  // namespace pagedspec

// Dtype dispatch over the activation dtypes (query / key / value / dequantized output).
// Binds `scalar_t` to at::Half, at::BFloat16 or float.
#define PAGEDSPEC_DISPATCH_ACTIVATION(DTYPE, OP, ARGNAME, ...)                            \
  [&] {                                                                                   \
    switch (DTYPE) {                                                                      \
      case at::kHalf: {                                                                   \
        using scalar_t = at::Half;                                                        \
        return __VA_ARGS__();                                                             \
      }                                                                                   \
      case at::kBFloat16: {                                                               \
        using scalar_t = at::BFloat16;                                                    \
        return __VA_ARGS__();                                                             \
      }                                                                                   \
      case at::kFloat: {                                                                  \
        using scalar_t = float;                                                           \
        return __VA_ARGS__();                                                             \
      }                                                                                   \
      default:                                                                            \
        TORCH_CHECK(false, "pagedspec.", OP, ": ", ARGNAME,                               \
                    " must have dtype in {Half, BFloat16, Float}, got ", DTYPE);          \
    }                                                                                     \
  }()

// Dispatch over the cache storage format for a given activation dtype `scalar_t`.
// Binds `cache_t` (scalar_t for native caches, uint8_t for FP8) and `kCacheFormat`.
#define PAGEDSPEC_DISPATCH_CACHE_FORMAT(FORMAT, ...)                                      \
  [&] {                                                                                   \
    switch (FORMAT) {                                                                     \
      case ::pagedspec::CacheFormat::kNative: {                                           \
        using cache_t [[maybe_unused]] = scalar_t;                                                         \
        static constexpr auto kCacheFormat = ::pagedspec::CacheFormat::kNative;                  \
        return __VA_ARGS__();                                                             \
      }                                                                                   \
      case ::pagedspec::CacheFormat::kE4M3: {                                             \
        using cache_t [[maybe_unused]] = uint8_t;                                                          \
        static constexpr auto kCacheFormat = ::pagedspec::CacheFormat::kE4M3;                    \
        return __VA_ARGS__();                                                             \
      }                                                                                   \
      case ::pagedspec::CacheFormat::kE5M2: {                                             \
        using cache_t [[maybe_unused]] = uint8_t;                                                          \
        static constexpr auto kCacheFormat = ::pagedspec::CacheFormat::kE5M2;                    \
        return __VA_ARGS__();                                                             \
      }                                                                                   \
    }                                                                                     \
  }()

// Dispatch over the two FP8 formats. Binds `kFp8Format` (CacheFormat::kE4M3 or kE5M2).
#define PAGEDSPEC_DISPATCH_FP8_FORMAT(FORMAT, ...)                                        \
  [&] {                                                                                   \
    if ((FORMAT) == ::pagedspec::CacheFormat::kE4M3) {                                    \
      static constexpr auto kFp8Format = ::pagedspec::CacheFormat::kE4M3;                 \
      return __VA_ARGS__();                                                               \
    }                                                                                     \
    static constexpr auto kFp8Format = ::pagedspec::CacheFormat::kE5M2;                   \
    return __VA_ARGS__();                                                                 \
  }()
