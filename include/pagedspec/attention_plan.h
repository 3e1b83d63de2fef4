// Split-KV plan for paged attention: which work items a step runs and where partial results go,
// computed on the host from the step's real lengths (FlashInfer's plan/run split). Torch-free;
// the CPU kernel, the CUDA kernel and the plan op all read the same layout.
//
// A plan is an int32 array (H = kPlanHeader, B = num_seqs, C = capacity in items):
//   [0, H)                 header, indexed by PlanField
//   [H, H + B)             parts[i]: partitions of sequence i; 1 means not split (written
//                          directly to out / lse by its items, no partial results)
//   [H + B, H + 2B)        partial_base[i]: first partial row of sequence i, -1 when not split.
//                          Query token j of sequence i, partition k has partial row
//                          partial_base[i] + j * parts[i] + k; its (row, head) slot in the
//                          workspace is row * num_heads + head.
//   [H + 2B, H + 2B + 3C)  items: (seq, row0, partition) per work item; items past num_items
//                          are padding (seq = -1), so a plan for fewer items fits a buffer (and
//                          a captured CUDA graph's grid) sized for more.
// A work item covers the query rows [row0, row0 + rows_per_item) of its sequence (row = j * G + g
// for query token j and head g of a KV head's group) for every KV head, and the positions
// [partition * partition_size, (partition + 1) * partition_size) clipped to what those rows see.
//
// Workspace (float32): partial accumulators [R * Hq, D], then maxima [R * Hq], then sums [R * Hq]
// for R = partial_rows; a workspace holds workspace_rows(numel, Hq, D) rows.
#pragma once

#include <stdint.h>

#include "pagedspec/attention.h"
#include "pagedspec/macros.h"

namespace pagedspec {

constexpr int kPlanHeader = 8;

// Query rows per work item: a CPU task's row chunk, a CUDA CTA's rows. A plan is made for one.
constexpr int kCpuAttentionRows = 32;
constexpr int kCudaAttentionRows = 4;
constexpr int32_t kPlanMagic = 0x50534B56;  // "PSKV": a buffer that was never planned fails

enum PlanField : int {
  kPlanFieldMagic = 0,
  kPlanFieldNumSeqs = 1,        // B the plan was made for
  kPlanFieldNumItems = 2,       // live items (<= capacity)
  kPlanFieldCapacity = 3,       // C
  kPlanFieldPartitionSize = 4,  // positions per partition (>= 1)
  kPlanFieldPartialRows = 5,    // R: workspace rows the plan uses
  kPlanFieldRowsPerItem = 6,    // query rows per item: the backend's row chunk
  kPlanFieldNumTokens = 7,      // T the plan was made for
};

PS_HOST_DEVICE int64_t plan_length(int64_t num_seqs, int64_t capacity) {
  return kPlanHeader + 2 * num_seqs + 3 * capacity;
}

// Floats of workspace per partial row: Hq accumulators of D, Hq maxima, Hq sums.
PS_HOST_DEVICE int64_t workspace_floats_per_row(int64_t num_heads, int64_t head_size) {
  return num_heads * (head_size + 2);
}

struct PlanItem {
  int seq;        // -1 for padding
  int row0;       // first query row (multiple of rows_per_item)
  int partition;  // partition index within the sequence
};

// Read access to a plan (host or device memory).
struct PlanView {
  const int32_t* data;  // [plan_length(B, C)]

  PS_HOST_DEVICE int field(PlanField f) const { return data[f]; }
  PS_HOST_DEVICE int num_seqs() const { return data[kPlanFieldNumSeqs]; }
  PS_HOST_DEVICE int num_items() const { return data[kPlanFieldNumItems]; }
  PS_HOST_DEVICE int partition_size() const { return data[kPlanFieldPartitionSize]; }
  PS_HOST_DEVICE int parts(int seq) const { return data[kPlanHeader + seq]; }
  PS_HOST_DEVICE int partial_base(int seq) const { return data[kPlanHeader + num_seqs() + seq]; }
  PS_HOST_DEVICE PlanItem item(int i) const {
    const int32_t* it = data + kPlanHeader + 2 * num_seqs() + 3 * int64_t(i);
    return PlanItem{it[0], it[1], it[2]};
  }
};

// What the planner needs. Lengths are the step's real ones (host memory).
struct PlanRequest {
  const int* seq_lens;      // [B]
  const int* cu_seqlens_q;  // [B + 1]
  int num_seqs;             // B
  int group_size;           // Hq / Hkv
  int num_kv_heads;         // Hkv
  int rows_per_item;        // the backend's query-row chunk (CPU 32, CUDA 4)
  int64_t concurrency;      // work items x KV heads that run at once (CUDA: SMs x resident
                            // CTAs per SM; CPU: threads)
  int waves;                // aim for at most waves x concurrency tasks once split
  bool always_split;        // split every context of at least 2 x kMinPlanPartition, however
                            // much work there is (CPU; the partition size then depends on
                            // the work: choose_partition)
  int forced_partition;     // 0: choose; > 0: this partition size; < 0: never split
  int64_t max_items;        // capacity bound, <= 0 for none
  int64_t max_partial_rows; // workspace bound, <= 0 for none
};

// Smallest partition the planner chooses: below it, merging costs more than parallelism gains.
constexpr int kMinPlanPartition = 256;
// Largest partition the CPU planner prefers: per-item setup, partial writes and the merge made
// 256-position partitions 10-25% slower than 1024 at B = 8, ctx = 2048 on every CPU path
// (bench/NOTES.md), so the CPU takes the largest that still leaves kCpuPlanWaves x threads
// tasks.
constexpr int kMaxCpuPlanPartition = 1024;
constexpr int kCpuPlanWaves = 4;

struct PlanShape {
  int partition_size;
  int64_t num_items;
  int64_t partial_rows;
};

// Partitions a chunk of query rows [row0, row0 + rows_per_item) of a sequence (len positions,
// q_len query tokens, `parts` partitions of `partition` positions) needs: those its last row can
// see (1 for an unsplit sequence). The planner makes one item per needed partition; the plan
// validator checks that each chunk has exactly these.
PS_HOST_DEVICE int partitions_needed(int len, int q_len, int group_size, int rows_per_item,
                                     int row0, int parts, int partition) {
  if (parts == 1) return 1;
  const int rows = q_len * group_size;
  const int last_row = (row0 + rows_per_item < rows ? row0 + rows_per_item : rows) - 1;
  return causal_limit(len, q_len, last_row / group_size) / partition + 1;
}

// Items and partial rows of splitting every sequence longer than `partition` into partitions of
// that size (an item is made only for partitions its rows can see).
inline PlanShape plan_shape(const PlanRequest& r, int partition) {
  PlanShape s{partition, 0, 0};
  for (int i = 0; i < r.num_seqs; ++i) {
    const int q_len = r.cu_seqlens_q[i + 1] - r.cu_seqlens_q[i];
    const int len = r.seq_lens[i];
    if (q_len <= 0) continue;
    const int rows = q_len * r.group_size;
    const int parts = len > partition ? num_partitions_of(len, partition) : 1;
    for (int row0 = 0; row0 < rows; row0 += r.rows_per_item) {
      s.num_items +=
          partitions_needed(len, q_len, r.group_size, r.rows_per_item, row0, parts, partition);
    }
    if (parts > 1) s.partial_rows += int64_t(q_len) * parts;
  }
  return s;
}

inline bool plan_fits(const PlanRequest& r, const PlanShape& s) {
  return (r.max_items <= 0 || s.num_items <= r.max_items) &&
         (r.max_partial_rows <= 0 || s.partial_rows <= r.max_partial_rows);
}

// The partition size: none (the longest length: every sequence direct) unless splitting helps,
// else the smallest power-of-two multiple of kMinPlanPartition whose tasks (items x KV heads)
// stay within waves x concurrency, and within the capacity bounds. With always_split (CPU):
// the largest of 1024, 512, 256 below the longest length whose tasks reach waves x concurrency
// and that fits the bounds; if none does, the smallest multiple that fits the bounds. Returns 0
// when even the unsplit plan exceeds max_items.
inline int choose_partition(const PlanRequest& r) {
  int longest = 1;
  for (int i = 0; i < r.num_seqs; ++i) longest = r.seq_lens[i] > longest ? r.seq_lens[i] : longest;
  const PlanShape unsplit = plan_shape(r, longest);
  if (!plan_fits(r, unsplit)) return 0;
  if (r.forced_partition < 0) return longest;
  if (r.forced_partition > 0) {
    const PlanShape forced = plan_shape(r, r.forced_partition);
    return plan_fits(r, forced) ? r.forced_partition : 0;
  }
  if (r.always_split) {
    if (longest < 2 * kMinPlanPartition) return longest;
    const int64_t wanted = int64_t(r.waves) * r.concurrency;
    for (int part = kMaxCpuPlanPartition; part >= kMinPlanPartition; part /= 2) {
      if (part >= longest) continue;
      const PlanShape s = plan_shape(r, part);
      if (s.num_items * r.num_kv_heads >= wanted && plan_fits(r, s)) return part;
    }
    for (int64_t part = kMinPlanPartition; part < longest; part *= 2) {
      if (plan_fits(r, plan_shape(r, int(part)))) return int(part);
    }
    return longest;
  }
  const int64_t target = int64_t(r.waves) * r.concurrency;
  if (unsplit.num_items * r.num_kv_heads >= target || longest < 2 * kMinPlanPartition) {
    return longest;
  }
  for (int64_t part = kMinPlanPartition; part < longest; part *= 2) {
    const PlanShape s = plan_shape(r, int(part));
    if (s.num_items * r.num_kv_heads <= target && plan_fits(r, s)) return int(part);
  }
  return longest;
}

// Writes the plan for partition size `partition` (from choose_partition) into `out`, which holds
// plan_length(B, capacity) ints with capacity >= plan_shape(r, partition).num_items.
inline void write_plan(const PlanRequest& r, int partition, int64_t capacity, int num_tokens,
                       int32_t* out) {
  const int B = r.num_seqs;
  int32_t* parts = out + kPlanHeader;
  int32_t* base = parts + B;
  int32_t* items = base + B;
  int64_t n = 0, partial_rows = 0;
  for (int i = 0; i < B; ++i) {
    const int q_len = r.cu_seqlens_q[i + 1] - r.cu_seqlens_q[i];
    const int len = r.seq_lens[i];
    const int p = len > partition ? num_partitions_of(len, partition) : 1;
    parts[i] = p;
    base[i] = p > 1 && q_len > 0 ? int32_t(partial_rows) : -1;
    if (q_len <= 0) continue;
    if (p > 1) partial_rows += int64_t(q_len) * p;
    const int rows = q_len * r.group_size;
    for (int row0 = 0; row0 < rows; row0 += r.rows_per_item) {
      const int needed =
          partitions_needed(len, q_len, r.group_size, r.rows_per_item, row0, p, partition);
      for (int k = 0; k < needed; ++k, ++n) {
        items[3 * n] = i;
        items[3 * n + 1] = row0;
        items[3 * n + 2] = k;
      }
    }
  }
  for (int64_t k = n; k < capacity; ++k) {
    items[3 * k] = -1;
    items[3 * k + 1] = 0;
    items[3 * k + 2] = 0;
  }
  out[kPlanFieldMagic] = kPlanMagic;
  out[kPlanFieldNumSeqs] = B;
  out[kPlanFieldNumItems] = int32_t(n);
  out[kPlanFieldCapacity] = int32_t(capacity);
  out[kPlanFieldPartitionSize] = partition;
  out[kPlanFieldPartialRows] = int32_t(partial_rows);
  out[kPlanFieldRowsPerItem] = r.rows_per_item;
  out[kPlanFieldNumTokens] = num_tokens;
}

}  // namespace pagedspec
