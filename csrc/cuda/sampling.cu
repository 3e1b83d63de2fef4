// CUDA kernels for rejection_sample and greedy_verify.
//
// rejection_sample: one launch for the whole batch, one 512-thread block per request.
//  1. Acceptance: the block's threads test every drafted position at once (single elements of the
//     probability rows); the first rejection wins (shared-memory atomicMin).
//  2. The emitted token: an inverse CDF over the residual max(target - draft, 0) at the first
//     rejection, or over the target row for the bonus token, summed in the order fixed by
//     include/pagedspec/sampling.h (so the tokens equal the CPU kernel's to the bit):
//     - one pass over the row: each warp takes 128-weight tiles (a coalesced 16-byte load per lane
//       per row read; kTilesInFlight tiles in flight per warp) and reduces each to its pairwise
//       total with a shuffle butterfly; the tile totals stay in shared memory (4 bytes per tile);
//     - a block scan of the tile totals (each thread one run of tiles) gives the total, hence
//       u * total, and each tile's exclusive prefix; the first tile whose largest prefix crosses
//       u * total holds the token;
//     - warp 0 reads that one tile again and finds the crossing weight with a warp scan.
//     So a row is read once (plus one 512-byte tile), instead of the two passes a
//     "total first, then search" scheme needs; the price is 4 bytes of shared memory per 128
//     weights (4 KiB at a 128k vocabulary).
// No host synchronization and no host-side allocation: the launch can be captured in a graph.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <climits>

#include "cuda/cuda_utils.cuh"
#include "pagedspec/sampling.h"
#include "sampling_checks.h"

namespace pagedspec {
namespace {

constexpr int kThreads = kSampleRuns;  // one run of tiles per thread
constexpr int kWarps = kThreads / 32;
constexpr unsigned kFullMask = 0xffffffffu;
// Tiles each warp loads before reducing any: enough bytes in flight per SM to cover DRAM latency
// (16 warps x 8 tiles x 512 B = 64 KiB per row read).
constexpr int kTilesInFlight = 8;

struct SampleShared {
  float groups[kSampleGroups];  // warp totals of the run scan, then their scan
  float runs[kSampleRuns];      // inclusive scan of the run totals
  int warp_min[kWarps];         // per-warp candidate (min tile index / max token)
  int first_rejection;          // first rejected draft position, or k_b
  float tile_excl;              // exclusive prefix of the crossing tile
  int token;                    // the drawn token, broadcast from warp 0
};

__device__ __forceinline__ int64_t min_i64(int64_t a, int64_t b) { return a < b ? a : b; }

// 4 consecutive floats from row[e..e+3] (e a multiple of 4), 0 at or past `vocab`. kVec = 4: one
// 16-byte load (vocab % 4 == 0 and the row is 16-byte aligned); kVec = 1: four scalar loads.
template <int kVec>
__device__ __forceinline__ float4 load4(const float* row, int64_t e, int64_t vocab) {
  if constexpr (kVec == 4) {
    return e < vocab ? __ldg(reinterpret_cast<const float4*>(row + e)) : make_float4(0, 0, 0, 0);
  } else {
    float4 v;
    v.x = e < vocab ? __ldg(row + e) : 0.f;
    v.y = e + 1 < vocab ? __ldg(row + e + 1) : 0.f;
    v.z = e + 2 < vocab ? __ldg(row + e + 2) : 0.f;
    v.w = e + 3 < vocab ? __ldg(row + e + 3) : 0.f;
    return v;
  }
}

__device__ __forceinline__ float4 residual4(float4 p, float4 q) {
  return make_float4(residual_weight(p.x, q.x), residual_weight(p.y, q.y),
                     residual_weight(p.z, q.z), residual_weight(p.w, q.w));
}

// The draft row as a float4 of q at e..e+3 when there is none: 1 at the one-hot token, else 0.
__device__ __forceinline__ float4 one_hot4(int64_t one_hot, int64_t e) {
  const int64_t rel = one_hot - e;
  return make_float4(rel == 0 ? 1.f : 0.f, rel == 1 ? 1.f : 0.f, rel == 2 ? 1.f : 0.f,
                     rel == 3 ? 1.f : 0.f);
}

template <int kVec, bool kDraftRow>
__device__ __forceinline__ float4 load_weights4(const WeightRow& row, int64_t e) {
  const float4 p = load4<kVec>(row.target, e, row.vocab);
  const float4 q = kDraftRow ? load4<kVec>(row.draft, e, row.vocab) : one_hot4(row.one_hot, e);
  return residual4(p, q);
}

// Pass 1: tile_totals[i] = pairwise total of tile i (tile_total in sampling.h: (x + y) + (z + w)
// per lane, then a butterfly over lanes 1, 2, 4, 8, 16 apart, i.e. adjacent pairs first).
template <int kVec, bool kDraftRow>
__device__ void tile_totals_pass(const WeightRow& row, int64_t num_tiles, float* tile_totals) {
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  for (int64_t first = warp; first < num_tiles; first += int64_t(kWarps) * kTilesInFlight) {
    // All loads first, so kTilesInFlight tiles per row are in flight at once.
    float4 p[kTilesInFlight], q[kTilesInFlight];
#pragma unroll
    for (int u = 0; u < kTilesInFlight; ++u) {
      const int64_t e = (first + u * kWarps) * kSampleTile + 4 * lane;
      p[u] = load4<kVec>(row.target, e, row.vocab);
      if constexpr (kDraftRow) q[u] = load4<kVec>(row.draft, e, row.vocab);
    }
#pragma unroll
    for (int u = 0; u < kTilesInFlight; ++u) {
      const int64_t tile = first + u * kWarps;
      const int64_t e = tile * kSampleTile + 4 * lane;
      float4 w;
      if constexpr (kDraftRow) {
        w = residual4(p[u], q[u]);
      } else {
        w = residual4(p[u], one_hot4(row.one_hot, e));
      }
      float s = (w.x + w.y) + (w.z + w.w);
#pragma unroll
      for (int m = 1; m < 32; m *= 2) s = s + __shfl_xor_sync(kFullMask, s, m);
      if (lane == 0 && tile < num_tiles) tile_totals[tile] = s;
    }
  }
}

// Warp 0: the first token of tile `tile` with a positive weight whose prefix crosses the
// threshold (tile_prefixes in sampling.h, with the left halves' totals exchanged by shuffles),
// or -1. Every lane returns the same value.
template <int kVec, bool kDraftRow>
__device__ int64_t first_crossing_in_tile(const WeightRow& row, int64_t tile, float tile_excl,
                                          float threshold) {
  const int lane = threadIdx.x & 31;
  const int64_t e = tile * kSampleTile + 4 * lane;
  const float4 w = load_weights4<kVec, kDraftRow>(row, e);
  float4 prefix;
  prefix.x = w.x;
  prefix.y = w.x + w.y;
  prefix.z = prefix.y + w.z;
  prefix.w = prefix.y + (w.z + w.w);
  float own = prefix.w;  // this lane's block total at the current level
#pragma unroll
  for (int m = 1; m < 32; m *= 2) {
    const float other = __shfl_xor_sync(kFullMask, own, m);
    if (lane & m) {  // right half of the 2m-lane block: add the left half's total
      prefix.x = other + prefix.x;
      prefix.y = other + prefix.y;
      prefix.z = other + prefix.z;
      prefix.w = other + prefix.w;
    }
    own = other + own;
  }
  const bool hit_x = w.x > 0.f && tile_excl + prefix.x > threshold;
  const bool hit_y = w.y > 0.f && tile_excl + prefix.y > threshold;
  const bool hit_z = w.z > 0.f && tile_excl + prefix.z > threshold;
  const bool hit_w = w.w > 0.f && tile_excl + prefix.w > threshold;
  const unsigned hits = __ballot_sync(kFullMask, hit_x || hit_y || hit_z || hit_w);
  if (hits == 0) return -1;
  const int first_lane = __ffs(hits) - 1;
  const int component = __shfl_sync(kFullMask, hit_x ? 0 : hit_y ? 1 : hit_z ? 2 : 3, first_lane);
  return tile * kSampleTile + 4 * first_lane + component;
}

// The last positive-weight token of the row (rare path: u * total rounded up to the largest
// prefix), or -1. Reads the whole row again.
__device__ int64_t last_positive_weight(const WeightRow& row, SampleShared& sh) {
  __syncthreads();  // sh.warp_min may still be read
  int last = -1;
  for (int64_t t = threadIdx.x; t < row.vocab; t += kThreads) {
    if (row.weight(t) > 0.f) last = static_cast<int>(t);
  }
  last = __reduce_max_sync(kFullMask, last);
  if ((threadIdx.x & 31) == 0) sh.warp_min[threadIdx.x >> 5] = last;
  __syncthreads();
  int result = -1;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) result = max(result, sh.warp_min[w]);
  __syncthreads();
  return result;
}

// The block's inverse CDF of the row's weights with uniform u (sampling.h); -1 when no weight is
// positive. Called by all threads; returns the same token to all.
template <int kVec, bool kDraftRow>
__device__ int64_t inverse_cdf(const WeightRow& row, float u, float* tile_totals,
                               SampleShared& sh) {
  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const int64_t num_tiles = sample_num_tiles(row.vocab);
  __syncthreads();  // shared memory may still be read by an earlier call
  tile_totals_pass<kVec, kDraftRow>(row, num_tiles, tile_totals);
  __syncthreads();

  // Runs: thread tid sums its tiles in order; then the run totals are scanned (scan_run_totals).
  const int64_t run_length = sample_run_length(num_tiles);
  const int64_t run_begin = min_i64(tid * run_length, num_tiles);
  const int64_t run_end = min_i64(run_begin + run_length, num_tiles);
  float run_total = 0.f;
  for (int64_t i = run_begin; i < run_end; ++i) run_total = run_total + tile_totals[i];
  float x = run_total;
#pragma unroll
  for (int off = 1; off < kSampleRunsPerGroup; off *= 2) {
    const float y = __shfl_up_sync(kFullMask, x, off);
    if (lane >= off) x = y + x;
  }
  if (lane == kSampleRunsPerGroup - 1) sh.groups[warp] = x;
  __syncthreads();
  if (warp == 0) {
    float g = lane < kSampleGroups ? sh.groups[lane] : 0.f;
#pragma unroll
    for (int off = 1; off < kSampleGroups; off *= 2) {
      const float y = __shfl_up_sync(kFullMask, g, off);
      if (lane >= off) g = y + g;
    }
    __syncwarp();
    if (lane < kSampleGroups) sh.groups[lane] = g;
  }
  __syncthreads();
  sh.runs[tid] = warp > 0 ? sh.groups[warp - 1] + x : x;
  __syncthreads();
  const float total = sh.runs[kSampleRuns - 1];
  if (!(total > 0.f)) return -1;  // the same for every thread
  const float threshold = u * total;

  // The first tile of this run whose largest prefix crosses, then the first over the block.
  const float runs_before = tid > 0 ? sh.runs[tid - 1] : 0.f;
  int candidate = INT_MAX;
  float candidate_excl = 0.f;
  float partial = 0.f;
  for (int64_t i = run_begin; i < run_end; ++i) {
    const float tile_excl = runs_before + partial;
    // Empty tiles are skipped, as on the CPU (sampling.h says why).
    if (tile_totals[i] > 0.f && tile_excl + tile_totals[i] > threshold) {
      candidate = static_cast<int>(i);
      candidate_excl = tile_excl;
      break;
    }
    partial = partial + tile_totals[i];
  }
  const int warp_candidate = __reduce_min_sync(kFullMask, candidate);
  if (lane == 0) sh.warp_min[warp] = warp_candidate;
  __syncthreads();
  int crossing = INT_MAX;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) crossing = min(crossing, sh.warp_min[w]);
  if (crossing != INT_MAX) {  // the same for every thread
    if (candidate == crossing) sh.tile_excl = candidate_excl;  // its one owner
    __syncthreads();
    if (warp == 0) {
      const int64_t t =
          first_crossing_in_tile<kVec, kDraftRow>(row, crossing, sh.tile_excl, threshold);
      if (lane == 0) sh.token = static_cast<int>(t);
    }
    __syncthreads();
    if (sh.token >= 0) return sh.token;  // always, see sampling.h
  }
  return last_positive_weight(row, sh);
}

template <int kVec>
__global__ void __launch_bounds__(kThreads)
    rejection_sample_kernel(const RejectionSampleParams p) {
  extern __shared__ float tile_totals[];  // [sample_num_tiles(vocab)]
  __shared__ SampleShared sh;
  const int tid = threadIdx.x;
  const int64_t b = blockIdx.x;
  const int64_t k = p.k;
  const int64_t vocab = p.vocab;
  const int64_t k_b =
      p.num_draft_tokens != nullptr ? clamp_draft_count(p.num_draft_tokens[b], k) : k;
  const int64_t* ids = p.draft_token_ids + b * k;

  // 1. Acceptance at every drafted position at once; the first rejection wins.
  if (tid == 0) sh.first_rejection = static_cast<int>(k_b);
  __syncthreads();
  for (int64_t i = tid; i < k_b; i += kThreads) {
    const int64_t x = ids[i];
    // An id outside the vocabulary (caught on the host only with PAGEDSPEC_DEBUG=1) is rejected,
    // never read through.
    const bool in_vocab = x >= 0 && x < vocab;
    const float target_p = in_vocab ? p.target_probs[(b * (k + 1) + i) * vocab + x] : 0.f;
    const float draft_q =
        p.draft_probs != nullptr && in_vocab ? p.draft_probs[(b * k + i) * vocab + x] : 1.f;
    if (!in_vocab || !accept_draft(p.uniform_accept[b * k + i], target_p, draft_q)) {
      atomicMin(&sh.first_rejection, static_cast<int>(i));
    }
  }
  __syncthreads();
  const int64_t first = sh.first_rejection;
  int64_t* out = p.output_token_ids + b * (k + 1);
  for (int64_t j = tid; j <= k; j += kThreads) {
    if (j != first) out[j] = j < first ? ids[j] : -1;
  }

  // 2. The corrected token (residual) or the bonus token (target row).
  const float* target_row = p.target_probs + (b * (k + 1) + first) * vocab;
  const float u = p.uniform_resample[b * (k + 1) + first];
  int64_t token = -1;
  if (first < k_b) {
    if (p.draft_probs != nullptr) {
      const WeightRow residual{target_row, p.draft_probs + (b * k + first) * vocab, -1, vocab};
      token = inverse_cdf<kVec, true>(residual, u, tile_totals, sh);
    } else {
      const WeightRow residual{target_row, nullptr, ids[first], vocab};
      token = inverse_cdf<kVec, false>(residual, u, tile_totals, sh);
    }
  }
  if (token < 0) {  // bonus token, or a residual without mass: the target row itself
    token = inverse_cdf<kVec, false>(WeightRow{target_row, nullptr, -1, vocab}, u, tile_totals,
                                     sh);
    if (token < 0) token = 0;  // not a distribution at all; stay inside the vocabulary
  }
  if (tid == 0) {
    out[first] = token;
    p.num_accepted[b] = static_cast<int32_t>(first);
  }
}

constexpr int kGreedyThreads = 128;

__global__ void __launch_bounds__(kGreedyThreads) greedy_verify_kernel(const GreedyVerifyParams p) {
  const int64_t b = blockIdx.x * int64_t(kGreedyThreads) + threadIdx.x;
  if (b < p.batch) greedy_verify_request(p, b);
}


// What rejection_sample_kernel<kVec> can use on one device: the tile totals take 4 bytes of
// dynamic shared memory per 128 tokens, beside the kernel's static shared memory (SampleShared),
// within the device's opt-in maximum per block. So the largest vocabulary is
// floor((opt-in - static) / 4) * 128: with its 2192 static bytes (ptxas), about 7.37 M tokens
// on sm_90 (227 KiB), 5.27 M on sm_80 (163 KiB), 3.17 M on sm_86 / sm_89 (99 KiB).
struct SampleSmemLimit {
  size_t max_dynamic_bytes;
  int64_t max_vocab;
};

template <int kVec>
const SampleSmemLimit& sample_smem_limit(int device) {
  static PerDeviceOnce<SampleSmemLimit> cache;  // one per kernel instantiation and device
  return cache.get(device, [](int d) {
    cudaFuncAttributes attr{};
    C10_CUDA_CHECK(cudaFuncGetAttributes(&attr, rejection_sample_kernel<kVec>));
    const int64_t optin = device_info(d).max_smem_optin_bytes;
    const int64_t static_bytes = static_cast<int64_t>(attr.sharedSizeBytes);
    const int64_t dynamic = std::max<int64_t>(optin - static_bytes, 0);
    // Raise the kernel's limit to the device maximum once (on this device: the caller holds its
    // guard): a per-call value could be lowered by another host thread between its
    // cudaFuncSetAttribute and our launch.
    if (static_bytes + dynamic > 48 * 1024) {
      C10_CUDA_CHECK(cudaFuncSetAttribute(rejection_sample_kernel<kVec>,
                                          cudaFuncAttributeMaxDynamicSharedMemorySize,
                                          static_cast<int>(dynamic)));
    }
    return SampleSmemLimit{static_cast<size_t>(dynamic),
                           dynamic / int64_t(sizeof(float)) * kSampleTile};
  });
}

// Checks that `bytes` of tile totals fit this device's shared memory (a clear error naming the
// largest vocabulary otherwise).
template <int kVec>
void check_sample_smem(size_t bytes, int64_t vocab, int device) {
  const SampleSmemLimit& limit = sample_smem_limit<kVec>(device);
  TORCH_CHECK(bytes <= limit.max_dynamic_bytes,
              "pagedspec.rejection_sample: target_probs.size(2) (vocabulary size) must be at most ",
              limit.max_vocab, " on this GPU (the kernel keeps 4 bytes of shared memory per 128 "
              "tokens; device ", device, " allows ", device_info(device).max_smem_optin_bytes,
              " bytes per block), got ", vocab);
}

std::tuple<at::Tensor, at::Tensor> rejection_sample_cuda(
    const at::Tensor& draft_token_ids, const c10::optional<at::Tensor>& draft_probs,
    const at::Tensor& target_probs, const at::Tensor& uniform_accept,
    const at::Tensor& uniform_resample, const c10::optional<at::Tensor>& num_draft_tokens) {
  const RejectionSampleArgs args =
      check_rejection_sample(draft_token_ids, draft_probs, target_probs, uniform_accept,
                             uniform_resample, num_draft_tokens);
  if (debug_checks_enabled()) {
    c10::optional<at::Tensor> counts_cpu;
    if (num_draft_tokens.has_value()) {
      counts_cpu = num_draft_tokens->cpu();
      check_num_draft_tokens_values("rejection_sample", *counts_cpu, args.k);
    }
    check_draft_ids_values("rejection_sample", draft_token_ids.cpu(), counts_cpu, args.vocab);
  }
  auto [output_token_ids, num_accepted] = make_verify_outputs(draft_token_ids);
  if (args.batch == 0) return {output_token_ids, num_accepted};
  const c10::cuda::CUDAGuard guard(target_probs.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const RejectionSampleParams p = make_rejection_sample_params(
      draft_token_ids, draft_probs, target_probs, uniform_accept, uniform_resample,
      num_draft_tokens, output_token_ids, num_accepted, args);
  const size_t smem = static_cast<size_t>(sample_num_tiles(args.vocab)) * sizeof(float);
  // 16-byte loads need every row 16-byte aligned: vocab % 4 == 0 and aligned base pointers.
  const bool vectorizable = args.vocab % 4 == 0 && is_aligned(p.target_probs, 16) &&
                            (p.draft_probs == nullptr || is_aligned(p.draft_probs, 16));
  const int device = target_probs.get_device();
  if (vectorizable) {
    check_sample_smem<4>(smem, args.vocab, device);
    rejection_sample_kernel<4><<<args.batch, kThreads, smem, stream>>>(p);
  } else {
    check_sample_smem<1>(smem, args.vocab, device);
    rejection_sample_kernel<1><<<args.batch, kThreads, smem, stream>>>(p);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {output_token_ids, num_accepted};
}

std::tuple<at::Tensor, at::Tensor> greedy_verify_cuda(
    const at::Tensor& draft_token_ids, const at::Tensor& target_token_ids,
    const c10::optional<at::Tensor>& num_draft_tokens) {
  check_greedy_verify(draft_token_ids, target_token_ids, num_draft_tokens);
  const int64_t batch = draft_token_ids.size(0), k = draft_token_ids.size(1);
  if (debug_checks_enabled() && num_draft_tokens.has_value()) {
    check_num_draft_tokens_values("greedy_verify", num_draft_tokens->cpu(), k);
  }
  auto [output_token_ids, num_accepted] = make_verify_outputs(draft_token_ids);
  if (batch == 0) return {output_token_ids, num_accepted};
  const c10::cuda::CUDAGuard guard(draft_token_ids.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const GreedyVerifyParams p = make_greedy_verify_params(
      draft_token_ids, target_token_ids, num_draft_tokens, output_token_ids, num_accepted);
  greedy_verify_kernel<<<ceil_div(batch, kGreedyThreads), kGreedyThreads, 0, stream>>>(p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {output_token_ids, num_accepted};
}

}  // namespace

TORCH_LIBRARY_IMPL(pagedspec, CUDA, m) {
  m.impl("rejection_sample", &rejection_sample_cuda);
  m.impl("greedy_verify", &greedy_verify_cuda);
}

}  // namespace pagedspec
