// Paged attention: the online-softmax state and its log-sum-exp merge, shared by the CPU kernel,
// the CUDA kernels and the v2 reduction, plus the kernel parameter structs. Torch-free.
//
// Logits are kept in the log2 domain (scale * q.k * log2(e)) so that every exponential is an exp2
// (one instruction on the GPU); SoftmaxState::lse() converts back to the natural log the
// contract's `lse` output uses.
//
// Masked logits are -inf and an empty state has max == -inf. Every helper here guards the
// -inf - -inf = NaN case, so a query row that sees no position in some tile or partition simply
// contributes nothing when merged.
#pragma once

#include <math.h>
#include <stdint.h>

#include "pagedspec/codec.h"
#include "pagedspec/macros.h"

namespace pagedspec {

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// Tokens per v2 partition (CPU and CUDA alike, so both split a context the same way).
constexpr int kPartitionSize = 512;

// 2^x. On the GPU one MUFU.EX2 (relative error < 2^-22; results below 2^-126 flush to 0, which
// as softmax weights against a running max are negligible) instead of exp2f's denormal-safe
// sequence; on the host exp2f.
PS_HOST_DEVICE float softmax_exp2(float x) {
#if defined(__CUDA_ARCH__)
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
#else
  return ::exp2f(x);
#endif
}

PS_HOST_DEVICE float neg_inf() {
#if defined(__CUDA_ARCH__)
  return __int_as_float(0xff800000);
#else
  return -INFINITY;
#endif
}

PS_HOST_DEVICE float pos_inf() {
#if defined(__CUDA_ARCH__)
  return __int_as_float(0x7f800000);
#else
  return INFINITY;
#endif
}

PS_HOST_DEVICE float quiet_nan() {
#if defined(__CUDA_ARCH__)
  return __int_as_float(0x7fc00000);
#else
  return NAN;
#endif
}

// Whether a row's softmax is undefined, from its running (or partial) max: NaN, which the
// epilogues store for a row whose query holds a NaN, or +inf, a log2-domain logit that overflowed.
// Such a row's out, lse and attn_mass are NaN (CONTRACT.md, paged_attention's extensions), on
// every path: the paths' inner loops need not agree on what NaN or inf scores do to a state,
// since the epilogues and merges decide from this and from the query alone.
PS_HOST_DEVICE bool softmax_undefined(float max) { return !(max < pos_inf()); }

// How the kernels that fold the log2-domain factor scale x log2(e) into the query before the dot
// product (CPU's FMA path, CUDA) apply it: up to 2^16 (every real model's scale) all of it to the
// query, as always; above, only its mantissa (in [0.5, 1)), the power of two going to the scores
// after the dot product, exactly. So a query element times the factor cannot overflow where the
// logit does not, and a logit overflows (CONTRACT.md, undefined rows) where q.k x scale x log2(e)
// does, as in the reference. The K scale of an FP8 cache multiplies `query` afterwards.
struct ScoreFactor {
  float query;  // multiplies the query (then times the K scale)
  float score;  // multiplies each q.k: 1, or a power of two
};

PS_HOST_DEVICE ScoreFactor split_score_factor(float scale_log2e) {
  if (!(scale_log2e > 65536.0f)) return ScoreFactor{scale_log2e, 1.0f};
  int e = 0;
  const float mantissa = frexpf(scale_log2e, &e);  // scale_log2e = mantissa x 2^e, e <= 128
  if (e > 127) return ScoreFactor{mantissa * 2.0f, ldexpf(1.0f, 127)};
  return ScoreFactor{mantissa, ldexpf(1.0f, e)};
}

// Weight of a log2-domain logit `s` against the running max `max`: exp2(s - max), and exactly 0
// for a masked logit (s == -inf), even when max is -inf too.
PS_HOST_DEVICE float softmax_weight(float s, float max) {
  return s == neg_inf() ? 0.0f : softmax_exp2(s - max);
}

// Online-softmax state of one query row over the positions folded in so far:
// softmax weights are exp2(s - max) / sum.
struct SoftmaxState {
  float max;  // largest log2-domain logit seen; -inf while empty
  float sum;  // sum over seen positions of exp2(s - max)

  static PS_HOST_DEVICE SoftmaxState empty() { return SoftmaxState{neg_inf(), 0.0f}; }

  PS_HOST_DEVICE bool is_empty() const { return max == neg_inf(); }

  // Raises the running max to cover a new tile whose largest logit is `tile_max` and returns the
  // factor every quantity accumulated against the old max (this->sum is rescaled here; the
  // caller rescales its P.V accumulator) must be multiplied by. 1 when the max does not change,
  // 0 when the state was empty. The caller then adds softmax_weight(s, max) of the tile's logits
  // to `sum`.
  PS_HOST_DEVICE float raise_max(float tile_max) {
    const float new_max = tile_max > max ? tile_max : max;
    if (new_max == max) return 1.0f;  // also covers empty state + fully masked tile
    const float factor = max == neg_inf() ? 0.0f : softmax_exp2(max - new_max);
    max = new_max;
    sum *= factor;
    return factor;
  }

  // Natural-log log-sum-exp of the natural-domain logits (-inf for an empty state).
  PS_HOST_DEVICE float lse() const {
    if (sum <= 0.0f) return neg_inf();
    return (max + log2f(sum)) * kLn2;
  }
};

// Merge of two partial states over disjoint positions: the merged state, and the factors the two
// partial accumulators (unnormalized sum of weight * v, each against its own max) must be
// multiplied by before being added: acc = acc_a * weight_a + acc_b * weight_b.
struct SoftmaxMerge {
  SoftmaxState state;
  float weight_a;
  float weight_b;
};

PS_HOST_DEVICE SoftmaxMerge merge_softmax(SoftmaxState a, SoftmaxState b) {
  const float max = a.max > b.max ? a.max : b.max;
  if (max == neg_inf()) return SoftmaxMerge{SoftmaxState::empty(), 0.0f, 0.0f};
  const float wa = a.is_empty() ? 0.0f : softmax_exp2(a.max - max);
  const float wb = b.is_empty() ? 0.0f : softmax_exp2(b.max - max);
  return SoftmaxMerge{SoftmaxState{max, a.sum * wa + b.sum * wb}, wa, wb};
}

// Query token j (0-based within its sequence) of a sequence with KV length seq_len and q_len
// query tokens sees positions 0 .. causal_limit (inclusive).
PS_HOST_DEVICE int causal_limit(int seq_len, int q_len, int j) { return seq_len - q_len + j; }

// Number of partitions of `partition` positions covering `context` positions.
PS_HOST_DEVICE int num_partitions_of(int context, int partition) {
  return int((int64_t(context) + partition - 1) / partition);  // context may be near 2^31
}

// Everything a paged-attention kernel reads and writes. QT: the query / output element type;
// CacheT: the cache element type (QT for native caches, uint8_t for FP8 codes).
// Shapes use T = num_tokens, Hq = num_heads, Hkv = num_kv_heads, D = head_size, B = num_seqs,
// NB = num_blocks, BS = block_size, M = max_blocks_per_seq, P = max_partitions.
template <typename QT, typename CacheT>
struct PagedAttentionParams {
  QT* out;                    // [T, Hq, D]; strides out_token_stride, out_head_stride, 1
  const QT* query;            // [T, Hq, D]; strides q_token_stride, q_head_stride, 1
  const CacheT* key_cache;    // [NB, BS, Hkv, D]; blocks cache_block_stride apart, else dense
  const CacheT* value_cache;  // [NB, BS, Hkv, D]; same strides as key_cache
  const int* block_tables;    // [B, M]; block id of position p of sequence i: [i, p / BS]
  const int* seq_lens;        // [B]; KV length of each sequence, query tokens included
  const int* cu_seqlens_q;    // [B + 1]; sequence i owns query tokens [cu[i], cu[i+1])
  ScaleRef k_scale;           // [] or [Hkv]; FP8 caches only (read value = stored * scale)
  ScaleRef v_scale;           // [] or [Hkv]; FP8 caches only
  float* lse;                 // [T, Hq] natural-log LSE, or null when not requested
  float* attn_mass;           // [NB * BS] accumulated probability per slot, or null

  // Split-KV partial results, one per (partial row, head): see attention_plan.h for which
  // partial row a (query token, partition) has. acc is the unnormalized sum of exp2(s - max) * v
  // over the partition's positions (v scale applied). Null when nothing is split.
  float* part_acc;  // [R, Hq, D]
  float* part_max;  // [R, Hq]; SoftmaxState::max (log2 domain), -inf for an empty partition,
                    // NaN for a row whose softmax is undefined (softmax_undefined)
  float* part_sum;  // [R, Hq]; SoftmaxState::sum
  const int32_t* plan;  // the step's plan (attention_plan.h), or null for the CUDA grid launches
  int64_t partial_rows; // R: rows the workspace holds (reads and writes stay below it)

  float scale;                // softmax scale applied to q.k (natural domain)
  int64_t q_token_stride;     // query.stride(0), elements
  int64_t q_head_stride;      // query.stride(1), elements
  int64_t out_token_stride;   // out.stride(0), elements
  int64_t out_head_stride;    // out.stride(1), elements
  int64_t num_blocks;         // NB: key_cache.size(0)
  int64_t cache_block_stride; // key_cache.stride(0), elements (>= BS * Hkv * D)
  int num_tokens;             // T: query.size(0)
  int num_seqs;               // B: seq_lens.size(0)
  int num_heads;              // Hq: query.size(1)
  int num_kv_heads;           // Hkv: key_cache.size(2)
  int head_size;              // D: query.size(2)
  int block_size;             // BS: key_cache.size(1), a power of two
  int block_shift;            // log2(BS)
  int max_blocks_per_seq;     // M: block_tables.size(1)
  int max_q_len;              // host-side bound on every q_len (>= 1 unless T == 0)
  int max_partitions;         // P: grid launches' partitions per token (v2), else 1
  int partition_size;         // grid launches: kPartitionSize (v2), M * BS (v1)
  int row_chunks;             // CUDA: CTAs per (sequence, KV head, partition), covering its rows
  // [T, Hq, 2]: each row's final (max, sum) state, written by the attention epilogues and read
  // by the attn_mass pass (probability exp2(s - max) / sum, as the softmax itself weighs it: an
  // LSE rounded to float32 would put an error of |lse| x 2^-24 into the exponent), or null when
  // attn_mass is not asked. max is NaN for a row whose softmax is undefined.
  float* row_state;

  PS_HOST_DEVICE int group_size() const { return num_heads / num_kv_heads; }
  PS_HOST_DEVICE int64_t cache_token_stride() const { return int64_t(num_kv_heads) * head_size; }
  // Cache block of position `pos` of sequence `seq`, through the block table. The id is clamped
  // into the cache: ids are validated on the host (always on CPU, with PAGEDSPEC_DEBUG=1 on
  // CUDA), and an unchecked bad id must not make a kernel read outside the cache.
  PS_HOST_DEVICE int block(int seq, int pos) const {
    const int b = block_tables[int64_t(seq) * max_blocks_per_seq + (pos >> block_shift)];
    return b < 0 ? 0 : (b >= num_blocks ? int(num_blocks - 1) : b);
  }
  // Slot (block * BS + offset: the attn_mass index) of position `pos` of sequence `seq`.
  PS_HOST_DEVICE int64_t slot(int seq, int pos) const {
    return (int64_t(block(seq, pos)) << block_shift) + (pos & (block_size - 1));
  }
  // Cache element offset of (position, KV head) of sequence `seq`.
  PS_HOST_DEVICE int64_t cache_offset(int seq, int pos, int kv_head) const {
    return int64_t(block(seq, pos)) * cache_block_stride +
           int64_t(pos & (block_size - 1)) * cache_token_stride() + int64_t(kv_head) * head_size;
  }
};

// The split reduction: merges the partitions of every (query token, head) by log-sum-exp.
template <typename QT>
struct PartitionReduceParams {
  QT* out;                  // [T, Hq, D]; strides out_token_stride, out_head_stride, 1
  float* lse;               // [T, Hq] natural-log LSE, or null
  const float* part_acc;    // [R, Hq, D] unnormalized partial outputs (v scale applied)
  const float* part_max;    // [R, Hq] partial SoftmaxState::max (log2 domain)
  const float* part_sum;    // [R, Hq] partial SoftmaxState::sum
  float* row_state;         // [T, Hq, 2] merged (max, sum) for the attn_mass pass, or null
  const int32_t* plan;      // the plan (attention_plan.h), or null for the v2 grid (row of
                            // token t, partition k: t * P + k)
  int64_t partial_rows;     // R: rows of the workspace (reads stay below it)
  const int* seq_lens;      // [B]
  const int* cu_seqlens_q;  // [B + 1]
  int64_t out_token_stride; // out.stride(0), elements
  int64_t out_head_stride;  // out.stride(1), elements
  int num_seqs;             // B
  int num_heads;            // Hq
  int head_size;            // D
  int max_partitions;       // P (v2 grid)
  int max_context;          // M * BS: bound on seq_lens (clamps unchecked inputs)
};

}  // namespace pagedspec
