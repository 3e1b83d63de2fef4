// CUDA kernels for paged_attention_v1 / v2 / paged_attention / paged_attention_run.
//
// One CTA serves one work item: (sequence, KV head, chunk of up to kRows query rows, range of
// positions). Its rows are the query tokens x query heads of that KV head's group, so for decode
// with groups up to 4 every K/V byte of the range is read from memory once for the whole group
// (longer row lists, e.g. verification, run as several CTAs over the same K/V, whose re-reads
// mostly hit L2). Where the work items come from:
//   plan (paged_attention_run): blockIdx.x indexes the plan's items (attention_plan.h), made on
//     the host from the step's real lengths; padding items exit at once.
//   grid (v1 / v2 / paged_attention): blockIdx.x = (sequence, row chunk) and blockIdx.y =
//     (partition, KV head), with the partition count from the block table's width (the lengths
//     live on the device): padded tables cost idle CTAs and scratch, which the plan avoids.
//
// The kernel's steps (named functions below): locate the work, load the scaled queries, then per
// step of kStep positions per warp: load K/V, score, fold into the online softmax, accumulate
// P.V; finally merge the lane groups and warps and write out/lse (direct) or a partial result
// (split), which reduce_partitions_kernel merges. Each lane owns 16 consecutive head dimensions
// of a position (16-byte loads, decoded in registers); scores are reduced over the lanes of a
// position with shuffles; the softmax helpers are include/pagedspec/attention.h's, as on CPU.
// What a row may not see never enters its softmax or accumulator (selected, not multiplied by a
// zero weight), so inf/NaN in a later draft token's K/V cannot reach an earlier token.
//
// attn_mass: attn_mass_kernel, after each row's final softmax state is known, recomputes the scores
// and atomically adds each position's probability (summed over the CTA's rows) to its slot.
//
// A row whose softmax is undefined (a NaN in its query, or a logit that overflows to +inf in the
// log2 domain) gets NaN out, lse and attn_mass, decided in the epilogue and the merge from the
// query and the running max, not by what NaN scores do in the loop (contract extension).
//
// FP8: codes are converted to float exactly (hardware e4m3/e5m2 -> f16x2, then f16 -> f32; every
// FP8 value is representable in f16, so this equals fp8_to_float in include/pagedspec/fp8.h) and
// the per-head scales are folded in: k_scale into the query scaling, v_scale into the output.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <cuda_fp8.h>

#include <climits>
#include <iterator>
#include <type_traits>
#include <utility>

#include "attention_checks.h"
#include "cuda/cuda_utils.cuh"
#include "pagedspec/attention.h"
#include "pagedspec/attention_plan.h"

namespace pagedspec {
namespace {

constexpr int kWarpSize = 32;
constexpr int kWarps = 4;
constexpr int kThreads = kWarps * kWarpSize;
constexpr int kReduceThreads = 128;
constexpr unsigned kFullMask = 0xffffffffu;

constexpr int next_pow2(int x) {
  int p = 1;
  while (p < x) p *= 2;
  return p;
}

// How a CTA lays positions and head dimensions over its threads. Each lane owns kElems = 16
// consecutive head dimensions of a position (one 16-byte load for FP8, two for half/bf16), so a
// K or V row is spread over D / 16 lanes (rounded up to a power of two: 8 for D = 80..128) and
// scores need only log2 of that many shuffle levels; the softmax bookkeeping, which every lane
// of a position repeats, is shared by few lanes. A lane holds kRows x kElems query values and as
// many accumulators: 4 rows (decode up to a group size of 4 in one CTA) keep that at 128
// registers; more rows are split over more CTAs.
template <typename CacheT, int D>
struct Layout {
  static constexpr int kElems = 16;                               // elements per lane
  static constexpr int kVec = 16 / int(sizeof(CacheT));           // elements per 16-byte load
  static constexpr int kLoads = kElems / kVec;                    // 16-byte loads per lane
  static constexpr int kSlices = D / kElems;                      // lanes a row needs
  static constexpr int kLanes = next_pow2(kSlices);               // lanes sharing a position
  static constexpr int kGroups = kWarpSize / kLanes;              // positions a warp loads at once
  static constexpr int kUnroll = 2;                               // positions per group per step
  static constexpr int kStep = kGroups * kUnroll;                 // positions per warp step
  static constexpr int kRows = kCudaAttentionRows;                // query rows per CTA (4)
  static_assert(D % kElems == 0, "head size must be a multiple of 16");
  static_assert(kLanes <= kWarpSize, "a row must fit in one warp");
};

// 16 bytes of cache -> kVec floats (FP8: the unscaled value of each code).
template <typename CacheT, CacheFormat F>
__device__ __forceinline__ void decode_vector(const uint4& raw, float* out) {
  const uint32_t words[4] = {raw.x, raw.y, raw.z, raw.w};
  if constexpr (F == CacheFormat::kNative) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      float2 f;
      if constexpr (std::is_same_v<CacheT, __nv_bfloat16>) {
        __nv_bfloat162 pair;
        memcpy(&pair, &words[i], 4);
        f = __bfloat1622float2(pair);
      } else {
        __half2 pair;
        memcpy(&pair, &words[i], 4);
        f = __half22float2(pair);
      }
      out[2 * i] = f.x;
      out[2 * i + 1] = f.y;
    }
  } else {
    constexpr __nv_fp8_interpretation_t kind = F == CacheFormat::kE4M3 ? __NV_E4M3 : __NV_E5M2;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const auto codes = static_cast<__nv_fp8x2_storage_t>(words[i / 2] >> (16 * (i % 2)));
      const __half2 pair(__nv_cvt_fp8x2_to_halfraw2(codes, kind));
      const float2 f = __half22float2(pair);
      out[2 * i] = f.x;
      out[2 * i + 1] = f.y;
    }
  }
}

// What one CTA computes, uniform across the CTA. Rows are numbered within the sequence as
// row = j * G + g for query token j and head g of the KV head's group.
struct CtaWork {
  int seq;
  int kv_head;
  int row0;          // first row
  int num_rows;      // rows in this CTA (<= kRows)
  int q_begin;       // the sequence's first query token
  int q_len;
  int seq_len;
  int ctx_begin;     // positions read: [ctx_begin, ctx_end)
  int ctx_end;
  bool split;        // partial result (merged by reduce_partitions_kernel) instead of out / lse
  int64_t partial_row;  // split: partial row of the CTA's first query token
  int parts;         // split: partitions of the sequence (partial rows per query token)
};

// Locates the CTA's work from the plan or from the grid. False: nothing to do (a padding item,
// or an unchecked bad input, clamped so that nothing is read or written out of bounds).
template <int kRows, typename QT, typename CacheT>
__device__ __forceinline__ bool locate_work(const PagedAttentionParams<QT, CacheT>& p,
                                            CtaWork& w) {
  int part, partition_size;
  if (p.plan != nullptr) {
    const PlanView plan{p.plan};
    if (plan.num_seqs() != p.num_seqs || int(blockIdx.x) >= plan.num_items()) return false;
    const PlanItem item = plan.item(blockIdx.x);
    if (item.seq < 0 || item.seq >= p.num_seqs) return false;
    w.seq = item.seq;
    w.row0 = item.row0;
    w.kv_head = blockIdx.y;
    w.parts = plan.parts(w.seq);
    w.split = w.parts > 1 && plan.partial_base(w.seq) >= 0;
    w.partial_row = plan.partial_base(w.seq);
    part = w.split ? item.partition : 0;
    partition_size = w.split ? plan.partition_size() : INT_MAX;
  } else {
    w.seq = blockIdx.x / p.row_chunks;
    w.row0 = (blockIdx.x % p.row_chunks) * kRows;
    w.kv_head = blockIdx.y % p.num_kv_heads;
    part = blockIdx.y / p.num_kv_heads;
    partition_size = p.partition_size;
    w.parts = p.max_partitions;
    w.split = p.part_acc != nullptr;
    w.partial_row = int64_t(p.cu_seqlens_q[w.seq]) * p.max_partitions;
  }
  w.q_begin = p.cu_seqlens_q[w.seq];
  w.q_len = p.cu_seqlens_q[w.seq + 1] - w.q_begin;
  if (w.q_len <= 0 || w.q_begin < 0 || w.q_begin + w.q_len > p.num_tokens) return false;
  const int G = p.group_size();
  if (w.row0 < 0 || w.row0 >= w.q_len * G) return false;
  w.num_rows = min(kRows, w.q_len * G - w.row0);
  w.seq_len = min(p.seq_lens[w.seq], p.max_blocks_per_seq << p.block_shift);
  w.partial_row += int64_t(w.row0 / G) * w.parts + part;
  const int last_limit = causal_limit(w.seq_len, w.q_len, (w.row0 + w.num_rows - 1) / G);
  w.ctx_begin = int(min(int64_t(part) * partition_size, int64_t(INT_MAX)));
  w.ctx_end = min(w.seq_len, last_limit + 1);
  if (int64_t(w.ctx_begin) + partition_size < w.ctx_end) w.ctx_end = w.ctx_begin + partition_size;
  return true;
}

// The CTA's row r: query / out / lse token, query head, last visible position (-1: padding).
struct RowPlace {
  int token;
  int head;
  int limit;
};

__device__ __forceinline__ RowPlace place_row(const CtaWork& w, int r, int G) {
  const int row = w.row0 + r;
  if (r >= w.num_rows) return RowPlace{w.q_begin, w.kv_head * G, -1};
  return RowPlace{w.q_begin + row / G, w.kv_head * G + row % G,
                  causal_limit(w.seq_len, w.q_len, row / G)};
}

// This lane's 16-dimension slice of every row's query, scaled into the log2 domain (k_scale
// folded in for FP8); zeros for padding rows and for lanes past the head size.
template <int kRows, int kElems, typename QT, typename CacheT>
__device__ __forceinline__ void load_queries(const PagedAttentionParams<QT, CacheT>& p,
                                             const CtaWork& w, float q_scale, int slice,
                                             bool active, float (&q)[kRows][kElems],
                                             int (&limit)[kRows]) {
  const int G = p.group_size();
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    const RowPlace place = place_row(w, r, G);
    limit[r] = place.limit;
    const QT* src = p.query + int64_t(place.token) * p.q_token_stride +
                    int64_t(place.head) * p.q_head_stride + slice * kElems;
#pragma unroll
    for (int e = 0; e < kElems; ++e) {
      q[r][e] = (r < w.num_rows && active) ? ScalarConvert<QT>::to_float(src[e]) * q_scale : 0.0f;
    }
  }
}

// Bit r set for each of the CTA's rows whose query holds a NaN (scaling by a finite q_scale keeps
// NaN NaN and makes nothing else NaN), the same in every lane: each warp's lanes hold every slice.
// The epilogue makes those rows' out and lse NaN whatever their NaN scores did to the softmax.
template <int kRows, int kElems>
__device__ __forceinline__ unsigned nan_query_rows(const float (&q)[kRows][kElems]) {
  unsigned bits = 0;
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
#pragma unroll
    for (int e = 0; e < kElems; ++e) bits |= isnan(q[r][e]) ? 1u << r : 0u;
  }
  return __reduce_or_sync(kFullMask, bits);
}

// One step's K (and V) rows: this lane's 16-byte slices of positions pos[u]; positions at or
// past ctx_end are never loaded (unused slots stay unread).
template <typename L, typename QT, typename CacheT>
__device__ __forceinline__ void load_kv(const PagedAttentionParams<QT, CacheT>& p,
                                        const CtaWork& w, int base, int group, int slice,
                                        bool active, bool with_values,
                                        int (&pos)[L::kUnroll],
                                        uint4 (&kraw)[L::kUnroll][L::kLoads],
                                        uint4 (&vraw)[L::kUnroll][L::kLoads]) {
#pragma unroll
  for (int u = 0; u < L::kUnroll; ++u) {
    pos[u] = base + u * L::kGroups + group;
#pragma unroll
    for (int i = 0; i < L::kLoads; ++i) {
      kraw[u][i] = make_uint4(0, 0, 0, 0);
      vraw[u][i] = make_uint4(0, 0, 0, 0);
    }
    if (pos[u] < w.ctx_end && active) {
      const int64_t off = p.cache_offset(w.seq, pos[u], w.kv_head) + slice * L::kElems;
      const uint4* k_src = reinterpret_cast<const uint4*>(p.key_cache + off);
      const uint4* v_src = reinterpret_cast<const uint4*>(p.value_cache + off);
#pragma unroll
      for (int i = 0; i < L::kLoads; ++i) kraw[u][i] = __ldg(k_src + i);
      if (with_values) {
#pragma unroll
        for (int i = 0; i < L::kLoads; ++i) vraw[u][i] = __ldg(v_src + i);
      }
    }
  }
}

// s[u][r] = q[r] . k[u]: partial dot products over this lane's slice, summed over the kLanes
// lanes of the position (every lane of the group ends with the full score). Padding rows are
// scored too (query 0): no per-row branches in the hot loop.
template <typename L, typename CacheT, CacheFormat F>
__device__ __forceinline__ void score(const uint4 (&kraw)[L::kUnroll][L::kLoads],
                                      const float (&q)[L::kRows][L::kElems],
                                      float (&s)[L::kUnroll][L::kRows]) {
#pragma unroll
  for (int u = 0; u < L::kUnroll; ++u) {
    float kf[L::kElems];
#pragma unroll
    for (int i = 0; i < L::kLoads; ++i) decode_vector<CacheT, F>(kraw[u][i], kf + i * L::kVec);
#pragma unroll
    for (int r = 0; r < L::kRows; ++r) {
      float dot = 0.0f;
#pragma unroll
      for (int e = 0; e < L::kElems; ++e) dot = fmaf(q[r][e], kf[e], dot);
#pragma unroll
      for (int off = L::kLanes / 2; off > 0; off /= 2) dot += __shfl_xor_sync(kFullMask, dot, off);
      s[u][r] = dot;
    }
  }
}

// s *= factor: the scores' power of two from split_score_factor, for scales above 2^16.
template <typename L>
__device__ __forceinline__ void scale_scores(float (&s)[L::kUnroll][L::kRows], float factor) {
#pragma unroll
  for (int u = 0; u < L::kUnroll; ++u) {
#pragma unroll
    for (int r = 0; r < L::kRows; ++r) s[u][r] *= factor;
  }
}

// Two resident CTAs per SM (8 warps) is what the ~210-250 registers allow; with 2 positions x 2
// (K, V) x 32 bytes per lane that keeps 32 KB of loads in flight per SM.
constexpr int kMinCtasPerSm = 2;

// Rows of out no sequence owns (cu_seqlens_q[B] < T, possible only unchecked): zeros and lse
// -inf, written by the grid's first CTA so that every output element is defined.
template <typename QT, typename CacheT>
__device__ void write_unowned_rows(const PagedAttentionParams<QT, CacheT>& p) {
  const int owned = max(0, min(p.cu_seqlens_q[p.num_seqs], p.num_tokens));
  const int64_t n = int64_t(p.num_tokens - owned) * p.num_heads * p.head_size;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
    const int64_t row = i / p.head_size;
    const int token = owned + int(row / p.num_heads);
    const int head = int(row % p.num_heads);
    p.out[int64_t(token) * p.out_token_stride + int64_t(head) * p.out_head_stride +
          i % p.head_size] = ScalarConvert<QT>::from_float(0.0f);
    if (i % p.head_size == 0 && p.lse != nullptr) {
      p.lse[int64_t(token) * p.num_heads + head] = neg_inf();
    }
  }
}

template <typename QT, typename CacheT, CacheFormat F, int D>
__global__ void __launch_bounds__(kThreads, kMinCtasPerSm)
    paged_attention_kernel(const PagedAttentionParams<QT, CacheT> p) {
  using L = Layout<CacheT, D>;
  constexpr int kElems = L::kElems;
  constexpr int kRows = L::kRows;
  constexpr int kLanes = L::kLanes;
  constexpr int kUnroll = L::kUnroll;
  constexpr bool kFp8 = F != CacheFormat::kNative;

  __shared__ float s_max[kWarps][kRows];
  __shared__ float s_sum[kWarps][kRows];
  __shared__ float s_acc[kWarps][kRows][D];

  if (blockIdx.x == 0 && blockIdx.y == 0) write_unowned_rows(p);
  CtaWork w;
  if (!locate_work<kRows>(p, w)) return;
  // A split partition past every row's limit is never merged: nothing to write. A direct CTA
  // always writes (zeros and lse -inf for rows that see nothing).
  if (w.split && w.ctx_begin >= w.ctx_end) return;

  const int lane = threadIdx.x % kWarpSize;
  const int warp = threadIdx.x / kWarpSize;
  const int group = lane / kLanes;
  const int slice = lane % kLanes;         // which 16 dimensions of a row
  const bool active = slice < L::kSlices;  // lanes past the head size hold zeros

  int limit[kRows];
  float q[kRows][kElems];
  // The log2-domain factor, its power of two applied to the scores above 2^16 (split_score_factor).
  const ScoreFactor factor = split_score_factor(p.scale * kLog2e);
  load_queries(p, w, factor.query * (kFp8 ? p.k_scale.at(w.kv_head) : 1.0f), slice, active, q,
               limit);
  const unsigned nan_rows = nan_query_rows(q);

  SoftmaxState state[kRows];
  float acc[kRows][kElems];
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    state[r] = SoftmaxState::empty();
#pragma unroll
    for (int e = 0; e < kElems; ++e) acc[r][e] = 0.0f;
  }

  // Main loop: warps interleave steps of kStep positions.
  for (int base = w.ctx_begin + warp * L::kStep; base < w.ctx_end; base += kWarps * L::kStep) {
    int pos[kUnroll];
    uint4 kraw[kUnroll][L::kLoads], vraw[kUnroll][L::kLoads];
    load_kv<L>(p, w, base, group, slice, active, /*with_values=*/true, pos, kraw, vraw);
    float s[kUnroll][kRows];
    score<L, CacheT, F>(kraw, q, s);
    if (factor.score != 1.0f) scale_scores<L>(s, factor.score);  // uniform across the CTA

    // Online softmax, one state per row per lane group, over the positions each row sees.
    bool seen[kUnroll][kRows];
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      float tile_max = neg_inf();
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        seen[u][r] = pos[u] < w.ctx_end && pos[u] <= limit[r];
        if (!seen[u][r]) s[u][r] = neg_inf();
        tile_max = fmaxf(tile_max, s[u][r]);
      }
      const float factor = state[r].raise_max(tile_max);
      if (factor != 1.0f) {
#pragma unroll
        for (int e = 0; e < kElems; ++e) acc[r][e] *= factor;
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        s[u][r] = softmax_weight(s[u][r], state[r].max);
        state[r].sum += s[u][r];
      }
    }
    // P.V, selected rather than multiplied by a zero weight: a V row a row cannot see (a later
    // draft token's, possibly inf or NaN) must not reach it (the contract's Isolation).
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      float vf[kElems];
#pragma unroll
      for (int i = 0; i < L::kLoads; ++i) decode_vector<CacheT, F>(vraw[u][i], vf + i * L::kVec);
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
#pragma unroll
        for (int e = 0; e < kElems; ++e) {
          acc[r][e] = seen[u][r] ? fmaf(s[u][r], vf[e], acc[r][e]) : acc[r][e];
        }
      }
    }
  }

  // Merge the lane groups of each warp, then the warps, by log-sum-exp.
#pragma unroll
  for (int off = kLanes; off < kWarpSize; off *= 2) {
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      if (r >= w.num_rows) continue;
      const SoftmaxState other{__shfl_xor_sync(kFullMask, state[r].max, off),
                               __shfl_xor_sync(kFullMask, state[r].sum, off)};
      const SoftmaxMerge m = merge_softmax(state[r], other);
#pragma unroll
      for (int e = 0; e < kElems; ++e) {
        const float theirs = __shfl_xor_sync(kFullMask, acc[r][e], off);
        acc[r][e] = acc[r][e] * m.weight_a + theirs * m.weight_b;
      }
      state[r] = m.state;
    }
  }
  if (group == 0) {
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      if (r >= w.num_rows) continue;
      if (slice == 0) {
        s_max[warp][r] = state[r].max;
        s_sum[warp][r] = state[r].sum;
      }
      if (active) {
#pragma unroll
        for (int e = 0; e < kElems; ++e) s_acc[warp][r][slice * kElems + e] = acc[r][e];
      }
    }
  }
  __syncthreads();

  // Write: out / lse (direct) or the partial result at the row's partial row (split).
  const float v_scale = kFp8 ? p.v_scale.at(w.kv_head) : 1.0f;
  const int G = p.group_size();
  for (int idx = threadIdx.x; idx < w.num_rows * D; idx += kThreads) {
    const int r = idx / D;
    const int d = idx % D;
    SoftmaxState merged = SoftmaxState::empty();
    float a = 0.0f;
#pragma unroll
    for (int k = 0; k < kWarps; ++k) {
      const SoftmaxMerge m = merge_softmax(merged, SoftmaxState{s_max[k][r], s_sum[k][r]});
      a = a * m.weight_a + s_acc[k][r][d] * m.weight_b;
      merged = m.state;
    }
    const RowPlace place = place_row(w, r, G);
    const bool nan_query = (nan_rows >> r) & 1u;
    if (!w.split) {
      // A row whose softmax is undefined (a NaN query, or an overflowed logit's +inf max): NaN.
      const bool undefined = nan_query || softmax_undefined(merged.max);
      const float inv = merged.sum > 0.0f ? v_scale / merged.sum : 0.0f;
      p.out[int64_t(place.token) * p.out_token_stride + int64_t(place.head) * p.out_head_stride +
            d] = ScalarConvert<QT>::from_float(undefined ? quiet_nan() : a * inv);
      const int64_t out_row = int64_t(place.token) * p.num_heads + place.head;
      if (d == 0 && p.lse != nullptr) p.lse[out_row] = undefined ? quiet_nan() : merged.lse();
      if (d == 0 && p.row_state != nullptr) {
        p.row_state[2 * out_row] = undefined ? quiet_nan() : merged.max;
        p.row_state[2 * out_row + 1] = merged.sum;
      }
    } else {
      const int64_t row = w.partial_row + int64_t((w.row0 + r) / G - w.row0 / G) * w.parts;
      if (row < 0 || row >= p.partial_rows) continue;  // a plan that does not fit (unchecked)
      const int64_t slot = row * p.num_heads + place.head;
      p.part_acc[slot * D + d] = a * v_scale;
      if (d == 0) {
        // NaN marks a NaN query for the merge (an overflowed logit's +inf max marks itself).
        p.part_max[slot] = nan_query ? quiet_nan() : merged.max;
        p.part_sum[slot] = merged.sum;
      }
    }
  }
}

// attn_mass: after each row's final softmax state is known (p.row_state), adds each visible
// position's probability exp2(s - max) / sum, summed over the CTA's rows, to its slot; s is
// recomputed exactly as the attention pass computed it, so the largest weight is exactly 1 / sum
// whatever the logits' magnitude. A row whose softmax is undefined adds NaN everywhere it sees.
// Same work items as the attention pass (K only); partitioned whatever the variant, since there
// is no reduction to pay for.
template <typename QT, typename CacheT, CacheFormat F, int D>
__global__ void __launch_bounds__(kThreads, kMinCtasPerSm)
    attn_mass_kernel(const PagedAttentionParams<QT, CacheT> p) {
  using L = Layout<CacheT, D>;
  constexpr int kRows = L::kRows;
  constexpr int kUnroll = L::kUnroll;
  constexpr bool kFp8 = F != CacheFormat::kNative;

  CtaWork w;
  if (!locate_work<kRows>(p, w) || w.ctx_begin >= w.ctx_end) return;
  const int lane = threadIdx.x % kWarpSize;
  const int warp = threadIdx.x / kWarpSize;
  const int group = lane / L::kLanes;
  const int slice = lane % L::kLanes;
  const bool active = slice < L::kSlices;

  int limit[kRows];
  float q[kRows][L::kElems];
  // The log2-domain factor, its power of two applied to the scores above 2^16 (split_score_factor).
  const ScoreFactor factor = split_score_factor(p.scale * kLog2e);
  load_queries(p, w, factor.query * (kFp8 ? p.k_scale.at(w.kv_head) : 1.0f), slice, active, q,
               limit);
  float row_max[kRows], row_inv[kRows];  // final max (0 for an undefined row) and 1 / sum
  const int G = p.group_size();
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    const RowPlace place = place_row(w, r, G);
    const int64_t out_row = int64_t(place.token) * p.num_heads + place.head;
    const float max = r < w.num_rows ? p.row_state[2 * out_row] : neg_inf();
    const float sum = r < w.num_rows ? p.row_state[2 * out_row + 1] : 0.0f;
    const bool undefined = softmax_undefined(max);
    row_max[r] = undefined ? 0.0f : max;
    row_inv[r] = undefined ? quiet_nan() : (sum > 0.0f ? 1.0f / sum : 0.0f);
  }

  for (int base = w.ctx_begin + warp * L::kStep; base < w.ctx_end; base += kWarps * L::kStep) {
    int pos[kUnroll];
    uint4 kraw[kUnroll][L::kLoads], vraw[kUnroll][L::kLoads];
    load_kv<L>(p, w, base, group, slice, active, /*with_values=*/false, pos, kraw, vraw);
    float s[kUnroll][kRows];
    score<L, CacheT, F>(kraw, q, s);
    if (factor.score != 1.0f) scale_scores<L>(s, factor.score);  // uniform across the CTA
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      float mass = 0.0f;
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        if (pos[u] < w.ctx_end && pos[u] <= limit[r]) {
          mass += softmax_weight(s[u][r], row_max[r]) * row_inv[r];
        }
      }
      if (slice == 0 && pos[u] < w.ctx_end && mass != 0.0f) {  // NaN is added too
        atomicAdd(p.attn_mass + p.slot(w.seq, pos[u]), mass);
      }
    }
  }
}

// Split second pass: one CTA per (query token, head) of a split sequence folds the partitions
// its row can see. Tokens of direct sequences (plan) and unowned tokens exit at once.
template <typename QT>
__global__ void __launch_bounds__(kReduceThreads)
    reduce_partitions_kernel(const PartitionReduceParams<QT> p) {
  const int token = blockIdx.x;
  const int head = blockIdx.y;
  if (token >= p.cu_seqlens_q[p.num_seqs]) return;
  // The sequence owning this token: the last i with cu_seqlens_q[i] <= token.
  int lo = 0, hi = p.num_seqs;
  while (hi - lo > 1) {
    const int mid = (lo + hi) / 2;
    if (p.cu_seqlens_q[mid] <= token) {
      lo = mid;
    } else {
      hi = mid;
    }
  }
  const int q_begin = p.cu_seqlens_q[lo];
  const int q_len = p.cu_seqlens_q[lo + 1] - q_begin;
  if (token < q_begin || token >= q_begin + q_len) return;
  int parts, partition_size;
  int64_t row;
  if (p.plan != nullptr) {
    const PlanView plan{p.plan};
    if (plan.num_seqs() != p.num_seqs || plan.parts(lo) <= 1 || plan.partial_base(lo) < 0) return;
    parts = plan.parts(lo);
    partition_size = plan.partition_size();
    row = plan.partial_base(lo) + int64_t(token - q_begin) * parts;
  } else {
    parts = p.max_partitions;
    partition_size = kPartitionSize;
    row = int64_t(token) * parts;
  }
  const int seq_len = min(p.seq_lens[lo], p.max_context);
  const int limit = causal_limit(seq_len, q_len, token - q_begin);
  const int n = limit < 0 ? 0 : int(min(int64_t(min(limit / partition_size + 1, parts)),
                                        max(int64_t(0), p.partial_rows - row)));
  const int64_t out_row = int64_t(token) * p.num_heads + head;
  for (int d = threadIdx.x; d < p.head_size; d += blockDim.x) {
    SoftmaxState merged = SoftmaxState::empty();
    float a = 0.0f;
    bool undefined = false;  // a partition of an undefined row (a NaN query's NaN, or +inf)
    for (int k = 0; k < n; ++k) {
      const int64_t slot = (row + k) * p.num_heads + head;
      undefined |= softmax_undefined(p.part_max[slot]);
      const SoftmaxMerge m = merge_softmax(merged, SoftmaxState{p.part_max[slot], p.part_sum[slot]});
      a = a * m.weight_a + p.part_acc[slot * p.head_size + d] * m.weight_b;
      merged = m.state;
    }
    const float inv = merged.sum > 0.0f ? 1.0f / merged.sum : 0.0f;
    p.out[int64_t(token) * p.out_token_stride + int64_t(head) * p.out_head_stride + d] =
        ScalarConvert<QT>::from_float(undefined ? quiet_nan() : a * inv);
    if (d == 0 && p.lse != nullptr) p.lse[out_row] = undefined ? quiet_nan() : merged.lse();
    if (d == 0 && p.row_state != nullptr) {
      p.row_state[2 * out_row] = undefined ? quiet_nan() : merged.max;
      p.row_state[2 * out_row + 1] = merged.sum;
    }
  }
}

template <typename Kernel>
int resident_ctas_per_sm(Kernel kernel) {
  int ctas = 0;
  C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&ctas, kernel, kThreads, 0));
  return std::max(ctas, 1);
}

// Dispatcher rule (CUDA, grid launches): v2 when v1 would run fewer than kCudaPlanWaves full
// waves of CTAs (num_seqs x num_kv_heads x row chunks < waves x SMs x resident CTAs per SM, the
// last from the occupancy calculator, asked on the current device each call) and the block
// table can describe a context of at least two partitions (the host-side bound on the context,
// since seq_lens live on the device). With few waves, v1 leaves SMs idle while the last CTAs
// finish; v2's finer CTAs fill them for the price of writing and re-reading the partials (under
// 1% of the K/V bytes for 512-position partitions) and one small extra launch.
bool cuda_prefers_v2(const AttentionArgs& args, int64_t row_chunks, int device, int ctas_per_sm) {
  const int64_t v1_ctas = args.num_seqs * args.num_kv_heads * row_chunks;
  return v1_ctas < int64_t(kCudaPlanWaves) * sm_count(device) * ctas_per_sm &&
         args.max_context() >= 2 * int64_t(kPartitionSize);
}

// One launch's buffers and kernels.
template <typename QT, typename CacheT, CacheFormat F, int D>
struct AttentionLaunch {
  const char* op;
  cudaStream_t stream;

  void attend(const PagedAttentionParams<QT, CacheT>& p, dim3 grid) const {
    paged_attention_kernel<QT, CacheT, F, D><<<grid, kThreads, 0, stream>>>(p);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }

  void reduce(const PagedAttentionParams<QT, CacheT>& p, const AttentionArgs& args) const {
    PartitionReduceParams<QT> r{};
    r.out = p.out;
    r.lse = p.lse;
    r.part_acc = p.part_acc;
    r.part_max = p.part_max;
    r.part_sum = p.part_sum;
    r.row_state = p.row_state;
    r.plan = p.plan;
    r.partial_rows = p.partial_rows;
    r.seq_lens = p.seq_lens;
    r.cu_seqlens_q = p.cu_seqlens_q;
    r.out_token_stride = p.out_token_stride;
    r.out_head_stride = p.out_head_stride;
    r.num_seqs = p.num_seqs;
    r.num_heads = p.num_heads;
    r.head_size = D;
    r.max_partitions = p.max_partitions;
    r.max_context = static_cast<int>(args.max_context());
    const dim3 grid(static_cast<unsigned>(args.num_tokens), static_cast<unsigned>(args.num_heads));
    reduce_partitions_kernel<QT><<<grid, kReduceThreads, 0, stream>>>(r);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }

  void mass(PagedAttentionParams<QT, CacheT> p, float* attn_mass, dim3 grid) const {
    p.attn_mass = attn_mass;
    attn_mass_kernel<QT, CacheT, F, D><<<grid, kThreads, 0, stream>>>(p);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
};

// attn_mass needs each row's final softmax state, which the attention pass (and the merge)
// write into scratch [T, Hq, 2]. Returns the caller's attn_mass (taken out of p, so the
// attention pass does not see it).
template <typename QT, typename CacheT>
float* prepare_mass(PagedAttentionParams<QT, CacheT>& p, const AttentionArgs& args,
                    const at::Tensor& query, at::Tensor& row_state) {
  p.row_state = nullptr;
  if (p.attn_mass != nullptr) {
    row_state =
        at::empty({args.num_tokens, args.num_heads, 2}, query.options().dtype(at::kFloat));
    p.row_state = row_state.data_ptr<float>();
  }
  float* attn_mass = p.attn_mass;
  p.attn_mass = nullptr;
  return attn_mass;
}

// v1 / v2 / the dispatcher: grids from the block table's width.
template <typename QT, typename CacheT, CacheFormat F, int D>
void launch_grid(PagedAttentionParams<QT, CacheT> p, const AttentionArgs& args, Variant variant,
                 const char* op, const at::Tensor& query, cudaStream_t stream) {
  using L = Layout<CacheT, D>;
  const AttentionLaunch<QT, CacheT, F, D> launch{op, stream};
  p.row_chunks = ceil_div(args.launch_max_q_len() * (args.num_heads / args.num_kv_heads),
                          L::kRows);
  const bool chosen_automatically = variant == Variant::kAuto;
  if (chosen_automatically) {
    const int ctas_per_sm = resident_ctas_per_sm(paged_attention_kernel<QT, CacheT, F, D>);
    variant = cuda_prefers_v2(args, p.row_chunks, query.get_device(), ctas_per_sm) ? Variant::kV2
                                                                                   : Variant::kV1;
  }
  const int64_t P = args.max_partitions();
  TORCH_CHECK(args.max_context() < (int64_t(1) << 31), "pagedspec.", op,
              ": block_tables describe a context of ", args.max_context(),
              " positions; at most 2^31 - 1 are supported");
  // Only the partitioned grids (v2 and the attn_mass pass) put partitions in grid.y; v1 has no
  // such limit, so the dispatcher falls back to it rather than failing.
  const bool fits_partitioned_grid = args.num_kv_heads * P <= 65535;
  if (variant == Variant::kV2 && !fits_partitioned_grid && p.attn_mass == nullptr &&
      chosen_automatically) {
    variant = Variant::kV1;
  }
  TORCH_CHECK(fits_partitioned_grid || (variant == Variant::kV1 && p.attn_mass == nullptr),
              "pagedspec.", op, ": num_kv_heads x partitions of the block table's context (",
              args.num_kv_heads, " x ", P, ") exceeds the CUDA grid limit of 65535 for ",
              p.attn_mass != nullptr ? "attn_mass" : "the split pass",
              "; use paged_attention_plan / paged_attention_run (sized by the real lengths)");
  TORCH_CHECK(args.num_seqs * int64_t(p.row_chunks) < (int64_t(1) << 31), "pagedspec.", op,
              ": too many sequences x row chunks for one launch");

  at::Tensor row_state, workspace;
  float* attn_mass = prepare_mass(p, args, query, row_state);
  const unsigned x = static_cast<unsigned>(args.num_seqs * p.row_chunks);
  const dim3 partitioned(x, static_cast<unsigned>(args.num_kv_heads * P));
  if (variant == Variant::kV1) {
    p.max_partitions = 1;
    p.partition_size = static_cast<int>(args.max_context());
    launch.attend(p, dim3(x, static_cast<unsigned>(args.num_kv_heads)));
  } else {
    // Scratch sized by the table's width: T x P partial rows.
    p.max_partitions = static_cast<int>(P);
    p.partition_size = kPartitionSize;
    p.partial_rows = args.num_tokens * P;
    workspace = at::empty({p.partial_rows * workspace_floats_per_row(args.num_heads, D)},
                          query.options().dtype(at::kFloat));
    p.part_acc = workspace.data_ptr<float>();
    p.part_max = p.part_acc + p.partial_rows * args.num_heads * D;
    p.part_sum = p.part_max + p.partial_rows * args.num_heads;
    launch.attend(p, partitioned);
    launch.reduce(p, args);
  }
  if (attn_mass != nullptr) {
    p.part_acc = p.part_max = p.part_sum = nullptr;
    p.max_partitions = static_cast<int>(P);
    p.partition_size = kPartitionSize;
    launch.mass(p, attn_mass, partitioned);
  }
}

// paged_attention_run: the plan's items, a fixed grid of its capacity (graph-capturable: a new
// plan with the same capacity changes only device memory).
template <typename QT, typename CacheT, CacheFormat F, int D>
void launch_plan(PagedAttentionParams<QT, CacheT> p, const AttentionArgs& args,
                 const at::Tensor& plan, const at::Tensor& workspace, int64_t workspace_rows,
                 const char* op, const at::Tensor& query, cudaStream_t stream) {
  const AttentionLaunch<QT, CacheT, F, D> launch{op, stream};
  const int64_t capacity = (plan.numel() - plan_length(args.num_seqs, 0)) / 3;
  TORCH_CHECK(capacity < (int64_t(1) << 31) && args.num_kv_heads <= 65535, "pagedspec.", op,
              ": plan capacity (", capacity, ") or num_kv_heads (", args.num_kv_heads,
              ") exceeds the CUDA grid limits");
  p.plan = plan.const_data_ptr<int32_t>();
  p.partial_rows = workspace_rows;
  if (workspace_rows > 0) {
    p.part_acc = workspace.data_ptr<float>();
    p.part_max = p.part_acc + workspace_rows * args.num_heads * D;
    p.part_sum = p.part_max + workspace_rows * args.num_heads;
  }
  at::Tensor row_state;
  float* attn_mass = prepare_mass(p, args, query, row_state);
  const dim3 grid(static_cast<unsigned>(std::max<int64_t>(capacity, 1)),
                  static_cast<unsigned>(args.num_kv_heads));
  launch.attend(p, grid);
  if (workspace_rows > 0) launch.reduce(p, args);  // an empty workspace means nothing is split
  if (attn_mass != nullptr) launch.mass(p, attn_mass, grid);
}

// Calls fn(std::integral_constant<int, D>) for the supported head size D (kAttentionHeadSizes:
// the one list).
template <typename Fn, size_t... I>
void dispatch_head_size(int64_t head_size, const char* op, Fn&& fn, std::index_sequence<I...>) {
  const bool found =
      ((head_size == kAttentionHeadSizes[I]
            ? (fn(std::integral_constant<int, kAttentionHeadSizes[I]>{}), true)
            : false) || ...);
  TORCH_CHECK(found, "pagedspec.", op, ": query.size(2) (head_size) must be one of ",
              attention_head_sizes_text(), ", got ", head_size);
}

template <typename Fn>
void dispatch_head_size(int64_t head_size, const char* op, Fn&& fn) {
  dispatch_head_size(head_size, op, std::forward<Fn>(fn),
                     std::make_index_sequence<std::size(kAttentionHeadSizes)>{});
}

// One validated call, as the typed launch below receives it.
struct AttentionCall {
  const char* op;
  Variant variant;
  at::Tensor& out;
  const at::Tensor& query;
  const at::Tensor& key_cache;
  const at::Tensor& value_cache;
  const at::Tensor& block_tables;
  const at::Tensor& seq_lens;
  const at::Tensor& cu_seqlens_q;
  double scale;
  const c10::optional<at::Tensor>& lse;
  const c10::optional<at::Tensor>& attn_mass;
  const at::Tensor* plan;       // null: the grid launches
  const at::Tensor* workspace;
  int64_t workspace_rows;
  const AttentionArgs& args;
  cudaStream_t stream;
};

// Cache format and head size dispatch for query dtype scalar_t (a template, so that the float
// branch, which the checks reject on CUDA, instantiates no kernels).
template <typename scalar_t>
void launch_typed(const AttentionCall& c) {
  if constexpr (std::is_same_v<scalar_t, float>) {
    TORCH_CHECK(false, "pagedspec.", c.op, ": query must have dtype in {Half, BFloat16}");
  } else {
    using QT = device_t<scalar_t>;
    PAGEDSPEC_DISPATCH_CACHE_FORMAT(c.args.format, [&] {
      using CacheT = std::conditional_t<kCacheFormat == CacheFormat::kNative, QT, uint8_t>;
      auto p = make_attention_params<QT, CacheT>(c.out, c.query, c.key_cache, c.value_cache,
                                                 c.block_tables, c.seq_lens, c.cu_seqlens_q,
                                                 c.scale, c.lse, c.attn_mass, c.args);
      dispatch_head_size(c.args.head_size, c.op, [&](auto d_tag) {
        constexpr int D = decltype(d_tag)::value;
        if (c.plan != nullptr) {
          launch_plan<QT, CacheT, kCacheFormat, D>(p, c.args, *c.plan, *c.workspace,
                                                   c.workspace_rows, c.op, c.query, c.stream);
        } else {
          launch_grid<QT, CacheT, kCacheFormat, D>(p, c.args, c.variant, c.op, c.query, c.stream);
        }
      });
    });
  }
}

// Validation shared by every entry point, then dtype / cache format / head size dispatch (the
// checks.h macros, as every launcher uses) into launch_grid or launch_plan.
void paged_attention_cuda(const char* op, Variant variant, at::Tensor& out, const at::Tensor& query,
                          const at::Tensor& key_cache, const at::Tensor& value_cache,
                          const at::Tensor& block_tables, const at::Tensor& seq_lens,
                          const at::Tensor& cu_seqlens_q, int64_t max_q_len, double scale,
                          const c10::optional<at::Tensor>& k_scale,
                          const c10::optional<at::Tensor>& v_scale,
                          const c10::optional<at::Tensor>& lse,
                          const c10::optional<at::Tensor>& attn_mass, const at::Tensor* plan,
                          const at::Tensor* workspace) {
  const AttentionArgs args =
      check_attention(op, out, query, key_cache, value_cache, block_tables, seq_lens,
                      cu_seqlens_q, max_q_len, scale, k_scale, v_scale, lse, attn_mass,
                      /*allow_float32=*/false);
  int64_t workspace_rows = 0;
  if (plan != nullptr) {
    workspace_rows = check_plan_tensors(op, args, *plan, *workspace, out, query, key_cache,
                                        value_cache, lse, attn_mass);
  }
  if (debug_checks_enabled()) {
    const at::Tensor lens = seq_lens.cpu(), cu = cu_seqlens_q.cpu();
    check_attention_indices(op, args, block_tables.cpu(), lens, cu);
    if (plan != nullptr) {
      const at::Tensor plan_host = plan->cpu();
      check_plan_contents(op, args, plan_host.const_data_ptr<int32_t>(), plan_host.numel(),
                          lens.const_data_ptr<int>(), cu.const_data_ptr<int>(), workspace_rows,
                          kCudaAttentionRows);
    }
  }
  if (args.num_tokens == 0 || args.num_seqs == 0) return;
  check_cache_alignment(op, "key_cache", key_cache, args.cache_block_stride);
  check_cache_alignment(op, "value_cache", value_cache, args.cache_block_stride);
  const c10::cuda::CUDAGuard guard(query.device());
  const AttentionCall call{op, variant, out, query, key_cache, value_cache, block_tables,
                           seq_lens, cu_seqlens_q, scale, lse, attn_mass, plan, workspace,
                           workspace_rows, args, c10::cuda::getCurrentCUDAStream()};
  PAGEDSPEC_DISPATCH_ACTIVATION(query.scalar_type(), op, "query",
                                [&] { launch_typed<scalar_t>(call); });
}

void paged_attention_cuda_impl(const char* op, Variant variant, at::Tensor& out,
                               const at::Tensor& query, const at::Tensor& key_cache,
                               const at::Tensor& value_cache, const at::Tensor& block_tables,
                               const at::Tensor& seq_lens, const at::Tensor& cu_seqlens_q,
                               int64_t max_q_len, double scale,
                               const c10::optional<at::Tensor>& k_scale,
                               const c10::optional<at::Tensor>& v_scale,
                               const c10::optional<at::Tensor>& lse,
                               const c10::optional<at::Tensor>& attn_mass) {
  paged_attention_cuda(op, variant, out, query, key_cache, value_cache, block_tables, seq_lens,
                       cu_seqlens_q, max_q_len, scale, k_scale, v_scale, lse, attn_mass, nullptr,
                       nullptr);
}

void paged_attention_run_cuda(at::Tensor& out, const at::Tensor& query,
                              const at::Tensor& key_cache, const at::Tensor& value_cache,
                              const at::Tensor& block_tables, const at::Tensor& seq_lens,
                              const at::Tensor& cu_seqlens_q, int64_t max_q_len, double scale,
                              const at::Tensor& plan, at::Tensor& workspace,
                              const c10::optional<at::Tensor>& k_scale,
                              const c10::optional<at::Tensor>& v_scale,
                              const c10::optional<at::Tensor>& lse,
                              const c10::optional<at::Tensor>& attn_mass) {
  paged_attention_cuda("paged_attention_run", Variant::kAuto, out, query, key_cache, value_cache,
                       block_tables, seq_lens, cu_seqlens_q, max_q_len, scale, k_scale, v_scale,
                       lse, attn_mass, &plan, &workspace);
}

PAGEDSPEC_ATTENTION_ENTRY(paged_attention_v1_cuda, paged_attention_cuda_impl, "paged_attention_v1",
                          Variant::kV1)
PAGEDSPEC_ATTENTION_ENTRY(paged_attention_v2_cuda, paged_attention_cuda_impl, "paged_attention_v2",
                          Variant::kV2)
PAGEDSPEC_ATTENTION_ENTRY(paged_attention_dispatch_cuda, paged_attention_cuda_impl, "paged_attention",
                          Variant::kAuto)

}  // namespace

// SMs x resident attention CTAs per SM of one device, for the planner (paged_attention_plan).
int64_t cuda_attention_slots(int device_index) {
  const int device = device_index >= 0 ? device_index : c10::cuda::current_device();
  const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
  const int ctas = resident_ctas_per_sm(
      paged_attention_kernel<__nv_bfloat16, __nv_bfloat16, CacheFormat::kNative, 128>);
  return int64_t(sm_count(device)) * ctas;
}

TORCH_LIBRARY_IMPL(pagedspec, CUDA, m) {
  m.impl("paged_attention_v1", &paged_attention_v1_cuda);
  m.impl("paged_attention_v2", &paged_attention_v2_cuda);
  m.impl("paged_attention", &paged_attention_dispatch_cuda);
  m.impl("paged_attention_run", &paged_attention_run_cuda);
}

}  // namespace pagedspec
