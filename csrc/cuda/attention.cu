// CUDA kernels for paged_attention_v1 / paged_attention_v2 / paged_attention.
//
// One CTA serves one (sequence, KV head, partition, chunk of up to 4 query rows). Its rows are
// the query tokens x query heads of that KV head's group, so for decode with groups up to 4 every
// K/V byte of the partition is read from memory once for the whole group, not once per query
// head (longer row lists, e.g. verification, run as several CTAs over the same K/V, whose
// re-reads mostly hit L2).
//
// Inside a CTA, each warp takes steps of kStep positions; a position's K (and V) row is split
// across D / 16 lanes, each loading its 16 elements with 16-byte loads (two for half/bf16, one
// for FP8) and decoding them in registers. A lane keeps its slice of every row's scaled query and
// output accumulator in registers; scores are reduced over the lanes of a position with
// shuffles. Each lane group runs its own online softmax (include/pagedspec/attention.h, the
// helpers the CPU kernel uses), and the groups, then the warps, are merged with merge_softmax at
// the end. Nothing about the context length lives in shared memory, so v1 handles any length.
//
// v1: one partition spanning the context; the CTA writes out and lse directly.
// v2: partitions of kPartitionSize positions in separate CTAs, each writing a partial
//     (acc, max, sum) to scratch, merged by reduce_partitions_kernel.
// attn_mass: a second launch of the same kernel in "mass mode" after the final LSE is known; it
//     recomputes the scores and atomically adds each position's probability (summed over the
//     CTA's rows) to its slot. The fast path does not pay for it.
//
// FP8: codes are converted to float exactly (hardware e4m3/e5m2 -> f16x2, then f16 -> f32; every
// FP8 value is representable in f16, so this equals fp8_to_float in include/pagedspec/fp8.h) and
// the per-head scales are folded in: k_scale into the query scaling, v_scale into the output.
// stored * scale is thus applied exactly as the contract says, up to float rounding order.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <cuda_fp8.h>

#include <type_traits>

#include "attention_checks.h"
#include "cuda/cuda_utils.cuh"
#include "pagedspec/attention.h"

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
  static constexpr int kRows = 4;                                 // query rows per CTA
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

// The row (query token j, head g of the group) numbering of a CTA: row = j * G + g.
struct RowPlace {
  int token;  // query / out / lse row
  int head;   // query head
  int limit;  // last visible position, -1 for a padding row
};

template <typename QT, typename CacheT>
__device__ __forceinline__ RowPlace place_row(const PagedAttentionParams<QT, CacheT>& p, int row,
                                              int num_rows, int q_begin, int q_len, int seq_len,
                                              int kv_head) {
  const int G = p.group_size();
  if (row >= num_rows) return RowPlace{q_begin, kv_head * G, -1};
  return RowPlace{q_begin + row / G, kv_head * G + row % G, causal_limit(seq_len, q_len, row / G)};
}

// Two resident CTAs per SM (8 warps) is what the ~210-250 registers allow; with 2 positions x 2
// (K, V) x 32 bytes per lane that keeps 32 KB of loads in flight per SM.
constexpr int kMinCtasPerSm = 2;

template <typename QT, typename CacheT, CacheFormat F, int D>
__global__ void __launch_bounds__(kThreads, kMinCtasPerSm)
    paged_attention_kernel(const PagedAttentionParams<QT, CacheT> p) {
  using L = Layout<CacheT, D>;
  constexpr int kElems = L::kElems;
  constexpr int kVec = L::kVec;
  constexpr int kLoads = L::kLoads;
  constexpr int kRows = L::kRows;
  constexpr int kLanes = L::kLanes;
  constexpr int kUnroll = L::kUnroll;
  constexpr bool kFp8 = F != CacheFormat::kNative;

  __shared__ float s_max[kWarps][kRows];
  __shared__ float s_sum[kWarps][kRows];
  __shared__ float s_acc[kWarps][kRows][D];

  // --- Which work this CTA does (all of it uniform across the CTA). ---
  const int seq = blockIdx.x / p.row_chunks;
  const int row0 = (blockIdx.x % p.row_chunks) * kRows;
  const int kv_head = blockIdx.y % p.num_kv_heads;
  const int part = blockIdx.y / p.num_kv_heads;
  const int q_begin = p.cu_seqlens_q[seq];
  const int q_len = p.cu_seqlens_q[seq + 1] - q_begin;
  // Unchecked inputs (PAGEDSPEC_DEBUG=0) are clamped so nothing is read out of bounds.
  if (q_len <= 0 || q_begin < 0 || q_begin + q_len > p.num_tokens) return;
  const int G = p.group_size();
  if (row0 >= q_len * G) return;
  const int num_rows = min(kRows, q_len * G - row0);
  const int seq_len = min(p.seq_lens[seq], p.max_blocks_per_seq << p.block_shift);
  const int last_limit = causal_limit(seq_len, q_len, (row0 + num_rows - 1) / G);
  const int ctx_begin = part * p.partition_size;
  const int ctx_end = min(min(seq_len, last_limit + 1), ctx_begin + p.partition_size);
  // A partition past every row's limit is never read by the reduction: nothing to write.
  if (ctx_begin >= ctx_end) return;

  const int lane = threadIdx.x % kWarpSize;
  const int warp = threadIdx.x / kWarpSize;
  const int group = lane / kLanes;
  const int slice = lane % kLanes;                 // which 16 dimensions of a row
  const bool active = slice < L::kSlices;          // lanes past the head size hold zeros
  const bool mass_mode = p.mass_lse != nullptr;

  int limit[kRows];
  float q[kRows][kElems];
  float lse2[kRows];  // mass mode: final LSE in the log2 domain
  const float q_scale = p.scale * kLog2e * (kFp8 ? p.k_scale.at(kv_head) : 1.0f);
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    const RowPlace place = place_row(p, row0 + r, num_rows, q_begin, q_len, seq_len, kv_head);
    limit[r] = place.limit;
    const QT* src = p.query + int64_t(place.token) * p.q_token_stride +
                    int64_t(place.head) * p.q_head_stride + slice * kElems;
#pragma unroll
    for (int e = 0; e < kElems; ++e) {
      q[r][e] = (r < num_rows && active) ? ScalarConvert<QT>::to_float(src[e]) * q_scale : 0.0f;
    }
    lse2[r] = 0.0f;
    if (mass_mode && r < num_rows) {
      lse2[r] = p.mass_lse[int64_t(place.token) * p.num_heads + place.head] * kLog2e;
    }
  }

  SoftmaxState state[kRows];
  float acc[kRows][kElems];
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    state[r] = SoftmaxState::empty();
#pragma unroll
    for (int e = 0; e < kElems; ++e) acc[r][e] = 0.0f;
  }

  // --- Main loop: warps interleave steps of kStep positions. ---
  for (int base = ctx_begin + warp * L::kStep; base < ctx_end; base += kWarps * L::kStep) {
    int pos[kUnroll];
    uint4 kraw[kUnroll][kLoads], vraw[kUnroll][kLoads];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      pos[u] = base + u * L::kGroups + group;
#pragma unroll
      for (int i = 0; i < kLoads; ++i) {
        kraw[u][i] = make_uint4(0, 0, 0, 0);
        vraw[u][i] = make_uint4(0, 0, 0, 0);
      }
      // Positions past ctx_end (<= seq_len) are never loaded: unused slots stay unread.
      if (pos[u] < ctx_end && active) {
        const int64_t off = p.cache_offset(seq, pos[u], kv_head) + slice * kElems;
        const uint4* k_src = reinterpret_cast<const uint4*>(p.key_cache + off);
        const uint4* v_src = reinterpret_cast<const uint4*>(p.value_cache + off);
#pragma unroll
        for (int i = 0; i < kLoads; ++i) kraw[u][i] = __ldg(k_src + i);
        if (!mass_mode) {
#pragma unroll
          for (int i = 0; i < kLoads; ++i) vraw[u][i] = __ldg(v_src + i);
        }
      }
    }
    // Scores: partial dot products over this lane's slice, then summed over the kLanes lanes
    // (every lane of the group ends with the full score).
    float s[kUnroll][kRows];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      float kf[kElems];
#pragma unroll
      for (int i = 0; i < kLoads; ++i) decode_vector<CacheT, F>(kraw[u][i], kf + i * kVec);
      // Every row, padding rows included (their query is 0 and their limit -1, so they end up
      // with weight 0): no per-row branches in the hot loop.
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        float dot = 0.0f;
#pragma unroll
        for (int e = 0; e < kElems; ++e) dot = fmaf(q[r][e], kf[e], dot);
#pragma unroll
        for (int off = kLanes / 2; off > 0; off /= 2) dot += __shfl_xor_sync(kFullMask, dot, off);
        s[u][r] = dot;
      }
    }

    if (mass_mode) {
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        float mass = 0.0f;
#pragma unroll
        for (int r = 0; r < kRows; ++r) {
          if (pos[u] <= limit[r] && pos[u] < ctx_end && lse2[r] > neg_inf()) {
            mass += softmax_exp2(s[u][r] - lse2[r]);
          }
        }
        if (slice == 0 && pos[u] < ctx_end && mass > 0.0f) {
          atomicAdd(p.attn_mass + p.slot(seq, pos[u]), mass);
        }
      }
      continue;
    }

    // Online softmax, one state per row per lane group, over the positions each row sees.
    bool seen[kUnroll][kRows];
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      float tile_max = neg_inf();
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        seen[u][r] = pos[u] < ctx_end && pos[u] <= limit[r];
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
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      float vf[kElems];
#pragma unroll
      for (int i = 0; i < kLoads; ++i) decode_vector<CacheT, F>(vraw[u][i], vf + i * kVec);
      // Selected, not multiplied by a zero weight: a V row a row cannot see (a later draft
      // token's, possibly inf or NaN) must not reach it (the contract's Isolation).
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
#pragma unroll
        for (int e = 0; e < kElems; ++e) {
          acc[r][e] = seen[u][r] ? fmaf(s[u][r], vf[e], acc[r][e]) : acc[r][e];
        }
      }
    }
  }
  if (mass_mode) return;

  // --- Merge the lane groups of each warp, then the warps, by log-sum-exp. ---
#pragma unroll
  for (int off = kLanes; off < kWarpSize; off *= 2) {
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      if (r >= num_rows) continue;
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
      if (r >= num_rows) continue;
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

  const float v_scale = kFp8 ? p.v_scale.at(kv_head) : 1.0f;
  for (int idx = threadIdx.x; idx < num_rows * D; idx += kThreads) {
    const int r = idx / D;
    const int d = idx % D;
    SoftmaxState merged = SoftmaxState::empty();
    float a = 0.0f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      const SoftmaxMerge m = merge_softmax(merged, SoftmaxState{s_max[w][r], s_sum[w][r]});
      a = a * m.weight_a + s_acc[w][r][d] * m.weight_b;
      merged = m.state;
    }
    const RowPlace place = place_row(p, row0 + r, num_rows, q_begin, q_len, seq_len, kv_head);
    if (p.part_acc == nullptr) {
      const float inv = merged.sum > 0.0f ? v_scale / merged.sum : 0.0f;
      p.out[int64_t(place.token) * p.out_token_stride + int64_t(place.head) * p.out_head_stride +
            d] = ScalarConvert<QT>::from_float(a * inv);
      if (d == 0 && p.lse != nullptr) {
        p.lse[int64_t(place.token) * p.num_heads + place.head] = merged.lse();
      }
    } else {
      const int64_t slot =
          (int64_t(place.token) * p.num_heads + place.head) * p.max_partitions + part;
      p.part_acc[slot * D + d] = a * v_scale;
      if (d == 0) {
        p.part_max[slot] = merged.max;
        p.part_sum[slot] = merged.sum;
      }
    }
  }
}

// v2 second pass: one CTA per (query token, head) folds the partitions its row can see.
template <typename QT>
__global__ void __launch_bounds__(kReduceThreads)
    reduce_partitions_kernel(const PartitionReduceParams<QT> p) {
  const int token = blockIdx.x;
  const int head = blockIdx.y;
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
  const int seq_len = min(p.seq_lens[lo], p.max_context);
  const int limit = causal_limit(seq_len, q_len, token - q_begin);
  const int parts = limit < 0 ? 0 : min(limit / kPartitionSize + 1, p.max_partitions);
  const int64_t base = (int64_t(token) * p.num_heads + head) * p.max_partitions;
  SoftmaxState merged = SoftmaxState::empty();
  for (int d = threadIdx.x; d < p.head_size; d += blockDim.x) {
    merged = SoftmaxState::empty();
    float a = 0.0f;
    for (int k = 0; k < parts; ++k) {
      const SoftmaxMerge m =
          merge_softmax(merged, SoftmaxState{p.part_max[base + k], p.part_sum[base + k]});
      a = a * m.weight_a + p.part_acc[(base + k) * p.head_size + d] * m.weight_b;
      merged = m.state;
    }
    const float inv = merged.sum > 0.0f ? 1.0f / merged.sum : 0.0f;
    p.out[int64_t(token) * p.out_token_stride + int64_t(head) * p.out_head_stride + d] =
        ScalarConvert<QT>::from_float(a * inv);
    if (d == 0 && p.lse != nullptr) p.lse[int64_t(token) * p.num_heads + head] = merged.lse();
  }
}

// Dispatcher rule (CUDA): v2 when v1 would run fewer than kV1MinWaves full waves of CTAs
// (num_seqs x num_kv_heads x row chunks < kV1MinWaves x SMs x resident CTAs per SM, the last from
// the occupancy calculator) and the block table can describe a context of at least two
// partitions (max_blocks_per_seq x block_size >= 2 x kPartitionSize: the host-side bound on the
// context, since seq_lens live on the device). With few waves, v1 leaves SMs idle while the last
// CTAs finish (and at batch 1 most SMs have nothing to do at all); v2's finer CTAs fill them for
// the price of writing and re-reading the partials (under 1% of the K/V bytes for 512-position
// partitions) and one small extra launch.
constexpr int kV1MinWaves = 4;

template <typename Kernel>
int resident_ctas_per_sm(Kernel kernel) {
  int ctas = 0;
  C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&ctas, kernel, kThreads, 0));
  return std::max(ctas, 1);
}

bool cuda_prefers_v2(const AttentionArgs& args, int64_t row_chunks, int device,
                     int ctas_per_sm) {
  const int64_t v1_ctas = args.num_seqs * args.num_kv_heads * row_chunks;
  return v1_ctas < int64_t(kV1MinWaves) * sm_count(device) * ctas_per_sm &&
         args.max_context() >= 2 * int64_t(kPartitionSize);
}

template <typename QT, typename CacheT, CacheFormat F, int D>
void launch(PagedAttentionParams<QT, CacheT> p, const AttentionArgs& args, Variant variant,
            const at::Tensor& query, cudaStream_t stream) {
  using L = Layout<CacheT, D>;
  const char* op = "paged_attention";
  p.row_chunks = ceil_div(args.launch_max_q_len() * (args.num_heads / args.num_kv_heads),
                          L::kRows);
  const bool chosen_automatically = variant == Variant::kAuto;
  if (chosen_automatically) {
    static const int ctas_per_sm =
        resident_ctas_per_sm(paged_attention_kernel<QT, CacheT, F, D>);
    variant = cuda_prefers_v2(args, p.row_chunks, query.get_device(), ctas_per_sm)
                  ? Variant::kV2
                  : Variant::kV1;
  }
  const auto fopts = query.options().dtype(at::kFloat);
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
              p.attn_mass != nullptr ? "attn_mass" : "paged_attention_v2",
              "; use paged_attention_v1 without attn_mass");
  TORCH_CHECK(args.num_seqs * int64_t(p.row_chunks) < (int64_t(1) << 31), "pagedspec.", op,
              ": too many sequences x row chunks for one launch");

  // attn_mass needs the final LSE: the caller's buffer, or scratch.
  at::Tensor lse_scratch;
  if (p.attn_mass != nullptr && p.lse == nullptr) {
    lse_scratch = at::empty({args.num_tokens, args.num_heads}, fopts);
    p.lse = lse_scratch.data_ptr<float>();
  }
  float* attn_mass = p.attn_mass;
  p.attn_mass = nullptr;
  p.mass_lse = nullptr;

  const dim3 block(kThreads);
  at::Tensor part_acc, part_max, part_sum;
  if (variant == Variant::kV1) {
    p.max_partitions = 1;
    p.partition_size = static_cast<int>(args.max_context());
    const dim3 grid(static_cast<unsigned>(args.num_seqs * p.row_chunks),
                    static_cast<unsigned>(args.num_kv_heads));
    paged_attention_kernel<QT, CacheT, F, D><<<grid, block, 0, stream>>>(p);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  } else {
    p.max_partitions = static_cast<int>(P);
    p.partition_size = kPartitionSize;
    part_acc = at::empty({args.num_tokens, args.num_heads, P, args.head_size}, fopts);
    part_max = at::empty({args.num_tokens, args.num_heads, P}, fopts);
    part_sum = at::empty({args.num_tokens, args.num_heads, P}, fopts);
    p.part_acc = part_acc.data_ptr<float>();
    p.part_max = part_max.data_ptr<float>();
    p.part_sum = part_sum.data_ptr<float>();
    const dim3 grid(static_cast<unsigned>(args.num_seqs * p.row_chunks),
                    static_cast<unsigned>(args.num_kv_heads * P));
    paged_attention_kernel<QT, CacheT, F, D><<<grid, block, 0, stream>>>(p);
    C10_CUDA_KERNEL_LAUNCH_CHECK();

    PartitionReduceParams<QT> r{};
    r.out = p.out;
    r.lse = p.lse;
    r.part_acc = p.part_acc;
    r.part_max = p.part_max;
    r.part_sum = p.part_sum;
    r.seq_lens = p.seq_lens;
    r.cu_seqlens_q = p.cu_seqlens_q;
    r.out_token_stride = p.out_token_stride;
    r.out_head_stride = p.out_head_stride;
    r.num_seqs = p.num_seqs;
    r.num_heads = p.num_heads;
    r.head_size = D;
    r.max_partitions = p.max_partitions;
    r.max_context = static_cast<int>(args.max_context());
    const dim3 rgrid(static_cast<unsigned>(args.num_tokens), static_cast<unsigned>(args.num_heads));
    reduce_partitions_kernel<QT><<<rgrid, kReduceThreads, 0, stream>>>(r);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }

  if (attn_mass != nullptr) {
    // Partitioned grid whatever the variant: the pass has no reduction and wants parallelism.
    p.attn_mass = attn_mass;
    p.mass_lse = p.lse;
    p.part_acc = p.part_max = p.part_sum = nullptr;
    p.max_partitions = static_cast<int>(P);
    p.partition_size = kPartitionSize;
    const dim3 grid(static_cast<unsigned>(args.num_seqs * p.row_chunks),
                    static_cast<unsigned>(args.num_kv_heads * P));
    paged_attention_kernel<QT, CacheT, F, D><<<grid, block, 0, stream>>>(p);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
}

template <typename Fn>
void dispatch_head_size(int64_t head_size, const char* op, Fn&& fn) {
  switch (head_size) {
    case 64: return fn(std::integral_constant<int, 64>{});
    case 80: return fn(std::integral_constant<int, 80>{});
    case 96: return fn(std::integral_constant<int, 96>{});
    case 112: return fn(std::integral_constant<int, 112>{});
    case 128: return fn(std::integral_constant<int, 128>{});
    case 256: return fn(std::integral_constant<int, 256>{});
    default:
      TORCH_CHECK(false, "pagedspec.", op, ": query.size(2) (head_size) must be one of ",
                  attention_head_sizes_text(), ", got ", head_size);
  }
}

template <typename QT>
void dispatch_cache(const char* op, Variant variant, at::Tensor& out, const at::Tensor& query,
                    const at::Tensor& key_cache, const at::Tensor& value_cache,
                    const at::Tensor& block_tables, const at::Tensor& seq_lens,
                    const at::Tensor& cu_seqlens_q, double scale,
                    const c10::optional<at::Tensor>& lse,
                    const c10::optional<at::Tensor>& attn_mass, const AttentionArgs& args,
                    cudaStream_t stream) {
  auto run = [&](auto cache_tag, auto format_tag) {
    using CacheT = typename decltype(cache_tag)::type;
    constexpr CacheFormat F = decltype(format_tag)::value;
    auto p = make_attention_params<QT, CacheT>(out, query, key_cache, value_cache, block_tables,
                                               seq_lens, cu_seqlens_q, scale, lse, attn_mass,
                                               args);
    dispatch_head_size(args.head_size, op, [&](auto d_tag) {
      launch<QT, CacheT, F, decltype(d_tag)::value>(p, args, variant, query, stream);
    });
  };
  switch (args.format) {
    case CacheFormat::kNative:
      return run(std::type_identity<QT>{},
                 std::integral_constant<CacheFormat, CacheFormat::kNative>{});
    case CacheFormat::kE4M3:
      return run(std::type_identity<uint8_t>{},
                 std::integral_constant<CacheFormat, CacheFormat::kE4M3>{});
    case CacheFormat::kE5M2:
      return run(std::type_identity<uint8_t>{},
                 std::integral_constant<CacheFormat, CacheFormat::kE5M2>{});
  }
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
  const AttentionArgs args =
      check_attention(op, out, query, key_cache, value_cache, block_tables, seq_lens,
                      cu_seqlens_q, max_q_len, scale, k_scale, v_scale, lse, attn_mass,
                      /*allow_float32=*/false);
  if (debug_checks_enabled()) {
    check_attention_indices(op, args, block_tables.cpu(), seq_lens.cpu(), cu_seqlens_q.cpu());
  }
  if (args.num_tokens == 0 || args.num_seqs == 0) return;
  for (const auto& [name, cache] : {std::pair<const char*, const at::Tensor*>{"key_cache", &key_cache},
                                    {"value_cache", &value_cache}}) {
    TORCH_CHECK(is_aligned(cache->const_data_ptr(), 16), "pagedspec.", op,
                ": ", name, " must start on a 16-byte boundary (the kernel loads 16 bytes at a "
                "time), got address ", cache->const_data_ptr());
  }
  const c10::cuda::CUDAGuard guard(query.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  if (query.scalar_type() == at::kHalf) {
    dispatch_cache<__half>(op, variant, out, query, key_cache, value_cache, block_tables,
                           seq_lens, cu_seqlens_q, scale, lse, attn_mass, args, stream);
  } else {
    dispatch_cache<__nv_bfloat16>(op, variant, out, query, key_cache, value_cache, block_tables,
                                  seq_lens, cu_seqlens_q, scale, lse, attn_mass, args, stream);
  }
}

PAGEDSPEC_ATTENTION_ENTRY(paged_attention_v1_cuda, paged_attention_cuda_impl, "paged_attention_v1",
                          Variant::kV1)
PAGEDSPEC_ATTENTION_ENTRY(paged_attention_v2_cuda, paged_attention_cuda_impl, "paged_attention_v2",
                          Variant::kV2)
PAGEDSPEC_ATTENTION_ENTRY(paged_attention_dispatch_cuda, paged_attention_cuda_impl, "paged_attention",
                          Variant::kAuto)

}  // namespace

TORCH_LIBRARY_IMPL(pagedspec, CUDA, m) {
  m.impl("paged_attention_v1", &paged_attention_v1_cuda);
  m.impl("paged_attention_v2", &paged_attention_v2_cuda);
  m.impl("paged_attention", &paged_attention_dispatch_cuda);
}

}  // namespace pagedspec
