// CUDA kernels for the count-min sketch: cms_update (plain and conservative), cms_query, cms_decay.
//
// One thread per key (grid-stride), looping over rows with the row hash from pagedspec/sketch.h,
// so the GPU computes exactly the CPU's columns. Every launch is asynchronous: no host sync, and
// scratch memory comes from torch's caching allocator (CUDA-graph safe).
#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>

#include "cuda/cuda_utils.cuh"
#include "pagedspec/sketch.h"
#include "sketch_checks.h"

namespace pagedspec {
namespace {

constexpr int kThreads = 256;

// Blocks for a grid-stride loop over n items: enough resident warps per SM to hide the latency
// of the random counter accesses, no more.
int grid_size(int64_t n, int device) {
  return static_cast<int>(std::min<int64_t>(ceil_div(n, kThreads), 16LL * sm_count(device)));
}

// Saturating add on a shared counter without a CAS loop. Counters and increments are in
// [0, 2^31 - 1], so from a counter <= 2^31 - 1 one add cannot wrap uint32, and the add that first
// carries the counter past 2^31 - 1 sees it (old + inc > MAX) and then stores MAX. Every later add
// to an overflowed counter also sees old + inc > MAX and stores MAX after itself; so whatever the
// interleaving, the last operation on the counter is a store of MAX, or no add overflowed and it
// holds the exact sum. Callers skip inc == 0, and issue all of a key's adds before testing any
// returned value (add_overflowed), so that they are in flight together.
__device__ __forceinline__ uint32_t atomic_add_u32(int32_t* counter, int32_t inc) {
  return atomicAdd(reinterpret_cast<unsigned int*>(counter), static_cast<unsigned int>(inc));
}
__device__ __forceinline__ bool add_overflowed(uint32_t old, int32_t inc) {
  return static_cast<uint64_t>(old) + static_cast<uint32_t>(inc) >
         static_cast<uint64_t>(kSketchCounterMax);
}

__device__ __forceinline__ int64_t grid_stride() {
  return static_cast<int64_t>(gridDim.x) * blockDim.x;
}
__device__ __forceinline__ int64_t thread_index() {
  return static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
}

// Plain update: every row's counter of every key gains the key's increment, saturating.
__global__ void __launch_bounds__(kThreads) cms_plain_update_kernel(const SketchUpdateParams p) {
  const SketchGeometry geo = p.geo;
  for (int64_t i = thread_index(); i < p.n; i += grid_stride()) {
    const int64_t key = p.keys[i];
    const int32_t inc = p.increment(i);
    if (inc == 0) continue;
    uint32_t old[kSketchMaxDepth];
#pragma unroll
    for (int r = 0; r < kSketchMaxDepth; ++r) {
      if (r < geo.depth) {
        old[r] = atomic_add_u32(p.sketch + r * geo.width + geo.column(key, r), inc);
      }
    }
#pragma unroll
    for (int r = 0; r < kSketchMaxDepth; ++r) {
      if (r < geo.depth && add_overflowed(old[r], inc)) {
        atomicExch(p.sketch + r * geo.width + geo.column(key, r), kSketchCounterMax);
      }
    }
  }
}

// min over rows of the key's counters.
__device__ __forceinline__ int32_t estimate(const int32_t* __restrict__ sketch,
                                            const SketchGeometry& geo, int64_t key) {
  int32_t est = kSketchCounterMax;
#pragma unroll
  for (int r = 0; r < kSketchMaxDepth; ++r) {
    if (r < geo.depth) est = min(est, __ldg(sketch + r * geo.width + geo.column(key, r)));
  }
  return est;
}

__global__ void __launch_bounds__(kThreads) cms_query_kernel(const SketchQueryParams p) {
  for (int64_t i = thread_index(); i < p.n; i += grid_stride()) {
    p.out[i] = estimate(p.sketch, p.geo, p.keys[i]);
  }
}

// Conservative update, phase 1 and 2 (see SketchConservativeScratch): each key's estimate before
// the call, and the per-key sum of increments through an open-addressing table whose entries
// hold the index of the key's first inserted occurrence. Counters are only read here.
__global__ void __launch_bounds__(kThreads)
    cms_conservative_aggregate_kernel(const SketchUpdateParams p,
                                      const SketchConservativeScratch s) {
  const uint64_t mask = static_cast<uint64_t>(s.capacity - 1);
  for (int64_t i = thread_index(); i < p.n; i += grid_stride()) {
    const int64_t key = p.keys[i];
    s.estimate[i] = estimate(p.sketch, p.geo, key);
    uint64_t h = sketch_dedup_hash(key) & mask;
    while (true) {
      // An entry is written once, so a plain (L2) read that sees it taken is final; only an
      // apparently empty entry needs the CAS. This keeps the duplicates of a hot key from
      // serializing on one CAS each.
      int32_t owner = __ldcg(s.table_key + h);
      if (owner == -1) owner = atomicCAS(s.table_key + h, -1, static_cast<int32_t>(i));
      if (owner == -1 || p.keys[owner] == key) break;
      h = (h + 1) & mask;
    }
    s.slot[i] = static_cast<int32_t>(h);
    const int32_t inc = p.increment(i);
    if (inc != 0) {
      atomicAdd(reinterpret_cast<unsigned long long*>(s.table_sum + h),
                static_cast<unsigned long long>(inc));
    }
  }
}

// Phase 3: every counter the key hits becomes max(counter, sat(estimate + sum)). atomicMax
// commutes, so the result is the max over the keys hitting a counter, whatever their order.
__global__ void __launch_bounds__(kThreads)
    cms_conservative_raise_kernel(const SketchUpdateParams p, const SketchConservativeScratch s) {
  const SketchGeometry geo = p.geo;
  for (int64_t i = thread_index(); i < p.n; i += grid_stride()) {
    const int32_t est = s.estimate[i];
    const int32_t target = sat_add_wide(est, static_cast<int64_t>(s.table_sum[s.slot[i]]));
    if (target <= est) continue;  // no increment for this key: every counter is already >= est
    const int64_t key = p.keys[i];
#pragma unroll
    for (int r = 0; r < kSketchMaxDepth; ++r) {
      if (r < geo.depth) atomicMax(p.sketch + r * geo.width + geo.column(key, r), target);
    }
  }
}

// counter >>= shift over the whole sketch, VEC counters per access.
template <int VEC>
__global__ void __launch_bounds__(kThreads)
    cms_decay_kernel(int32_t* __restrict__ counters, int64_t numel, int shift) {
  using V = Vec<int32_t, VEC>;
  V* vecs = reinterpret_cast<V*>(counters);
  for (int64_t i = thread_index(); i < numel / VEC; i += grid_stride()) {
    V v = vecs[i];
#pragma unroll
    for (int j = 0; j < VEC; ++j) v.v[j] >>= shift;
    vecs[i] = v;
  }
}

SketchUpdateParams make_update_params(at::Tensor& sketch, const at::Tensor& keys,
                                      const c10::optional<at::Tensor>& increments,
                                      const SketchGeometry& geo) {
  SketchUpdateParams p{};
  p.sketch = sketch.data_ptr<int32_t>();
  p.keys = keys.const_data_ptr<int64_t>();
  p.increments = increments.has_value() ? increments->const_data_ptr<int32_t>() : nullptr;
  p.n = keys.size(0);
  p.geo = geo;
  return p;
}

void cms_update_cuda(at::Tensor& sketch, const at::Tensor& keys,
                     const c10::optional<at::Tensor>& increments, bool conservative) {
  const SketchGeometry geo = check_cms_update(sketch, keys, increments);
  if (increments.has_value() && debug_checks_enabled()) {
    check_increments_nonnegative("cms_update", increments->cpu());
  }
  const int64_t n = keys.size(0);
  if (n == 0) return;
  const c10::cuda::CUDAGuard guard(sketch.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const SketchUpdateParams p = make_update_params(sketch, keys, increments, geo);
  const int grid = grid_size(n, sketch.get_device());
  if (!conservative) {
    cms_plain_update_kernel<<<grid, kThreads, 0, stream>>>(p);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return;
  }
  // Scratch on the current stream through the caching allocator (graph-capturable).
  const int64_t capacity = sketch_table_capacity(n);
  at::Tensor per_key = at::empty({2, n}, keys.options().dtype(at::kInt));
  at::Tensor table_key = at::full({capacity}, -1, keys.options().dtype(at::kInt));
  at::Tensor table_sum = at::zeros({capacity}, keys.options().dtype(at::kLong));
  SketchConservativeScratch s{};
  s.estimate = per_key[0].data_ptr<int32_t>();
  s.slot = per_key[1].data_ptr<int32_t>();
  s.table_key = table_key.data_ptr<int32_t>();
  s.table_sum = reinterpret_cast<uint64_t*>(table_sum.data_ptr<int64_t>());
  s.capacity = capacity;
  cms_conservative_aggregate_kernel<<<grid, kThreads, 0, stream>>>(p, s);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  cms_conservative_raise_kernel<<<grid, kThreads, 0, stream>>>(p, s);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

at::Tensor cms_query_cuda(const at::Tensor& sketch, const at::Tensor& keys) {
  const SketchGeometry geo = check_cms_query(sketch, keys);
  at::Tensor out = at::empty({keys.size(0)}, keys.options().dtype(at::kInt));
  if (keys.size(0) == 0) return out;
  const c10::cuda::CUDAGuard guard(sketch.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  SketchQueryParams p{};
  p.sketch = sketch.const_data_ptr<int32_t>();
  p.keys = keys.const_data_ptr<int64_t>();
  p.out = out.data_ptr<int32_t>();
  p.n = keys.size(0);
  p.geo = geo;
  cms_query_kernel<<<grid_size(p.n, sketch.get_device()), kThreads, 0, stream>>>(p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

void cms_decay_cuda(at::Tensor& sketch, int64_t shift) {
  check_cms_decay(sketch, shift);
  const int64_t numel = sketch.numel();
  const c10::cuda::CUDAGuard guard(sketch.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  int32_t* counters = sketch.data_ptr<int32_t>();
  const int s = static_cast<int>(shift);
  const int device = sketch.get_device();
  constexpr int kVec = kVec16<int32_t>;
  // 16-byte accesses over the aligned multiple-of-4 body; a short scalar launch for the rest.
  const bool aligned = is_aligned(counters, 16);
  const int64_t body = aligned ? numel / kVec * kVec : 0;
  if (body > 0) {
    cms_decay_kernel<kVec><<<grid_size(body / kVec, device), kThreads, 0, stream>>>(counters, body,
                                                                                    s);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  if (numel > body) {
    cms_decay_kernel<1><<<grid_size(numel - body, device), kThreads, 0, stream>>>(
        counters + body, numel - body, s);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
}

}  // namespace

TORCH_LIBRARY_IMPL(pagedspec, CUDA, m) {
  m.impl("cms_update", &cms_update_cuda);
  m.impl("cms_query", &cms_query_cuda);
  m.impl("cms_decay", &cms_decay_cuda);
}

}  // namespace pagedspec
