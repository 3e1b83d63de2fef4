// The CPU reshape_and_cache kernel, one source built once per ISA level (cpu/isa.h): included
// only by cpu/kernels_<level>.cpp after the level's `#pragma GCC target` (the conversion loops
// vectorize for the level's instructions).
#include "cpu/vec.h"

namespace pagedspec {
namespace PAGEDSPEC_CPU_NAMESPACE {
namespace {

template <typename InT, typename CacheT, CacheFormat F>
void reshape_and_cache_cpu_impl(const ReshapeAndCacheParams<InT, CacheT>& p) {
  using Codec = CacheCodec<CacheT, F>;
  // A native cache holds the input dtype, so a head row is copied bit for bit.
  constexpr bool kCopyRows = F == CacheFormat::kNative && std::is_same_v<InT, CacheT>;
  const int heads = p.geo.num_kv_heads;
  const int head_size = p.geo.head_size;
  at::parallel_for(0, p.num_tokens, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t slot = p.slot_mapping[t];
      if (slot < 0) continue;  // padding token
      CacheT* k_dst = p.key_cache + p.geo.slot_offset(slot);
      CacheT* v_dst = p.value_cache + p.geo.slot_offset(slot);
      for (int h = 0; h < heads; ++h) {
        const InT* k_src = p.key + t * p.key_token_stride + h * p.key_head_stride;
        const InT* v_src = p.value + t * p.value_token_stride + h * p.value_head_stride;
        const float ks = p.k_scale.at(h);
        const float vs = p.v_scale.at(h);
        CacheT* kd = k_dst + h * head_size;
        CacheT* vd = v_dst + h * head_size;
        if constexpr (kCopyRows) {
          std::memcpy(kd, k_src, head_size * sizeof(CacheT));
          std::memcpy(vd, v_src, head_size * sizeof(CacheT));
          continue;
        } else if constexpr (F != CacheFormat::kNative && PAGEDSPEC_CPU_LEVEL == 1) {
          // GCC leaves the loop below scalar for AVX2 (quantize_fp8_row's explicit form is 2.2x
          // faster there); for AVX-512 it vectorizes it, and K and V in one loop beat two rows
          // by 10%.
          quantize_fp8_row<F>(k_src, kd, head_size, ks);
          quantize_fp8_row<F>(v_src, vd, head_size, vs);
          continue;
        }
#pragma omp simd
        for (int d = 0; d < head_size; ++d) {
          kd[d] = Codec::encode(ScalarConvert<InT>::to_float(k_src[d]), ks);
          vd[d] = Codec::encode(ScalarConvert<InT>::to_float(v_src[d]), vs);
        }
      }
    }
  });
}

}  // namespace

void reshape_and_cache(const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache,
                       at::Tensor& value_cache, const at::Tensor& slot_mapping,
                       const ReshapeAndCacheArgs& args) {
  PAGEDSPEC_DISPATCH_ACTIVATION(key.scalar_type(), "reshape_and_cache", "key", [&] {
    PAGEDSPEC_DISPATCH_CACHE_FORMAT(args.format, [&] {
      const auto p = make_reshape_and_cache_params<scalar_t, cache_t>(
          key, value, key_cache, value_cache, slot_mapping, args);
      reshape_and_cache_cpu_impl<scalar_t, cache_t, kCacheFormat>(p);
    });
  });
}

}  // namespace PAGEDSPEC_CPU_NAMESPACE
}  // namespace pagedspec
