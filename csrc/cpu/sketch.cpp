// CPU kernels for the count-min sketch: cms_update (plain and conservative), cms_query, cms_decay.
//
// Keys are processed in chunks: first the chunk's columns for one row (a tight loop the compiler
// vectorizes for power-of-two widths), then the counter accesses, with a software prefetch
// kPrefetchDistance counters ahead so that cache and TLB misses on wide rows overlap.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <vector>

#include "pagedspec/sketch.h"
#include "sketch_checks.h"

namespace pagedspec {
namespace {

constexpr int64_t kChunk = 1024;           // (row, key) counters whose columns are computed at once
constexpr int64_t kPrefetchDistance = 128; // counters ahead to prefetch: ~ DRAM latency / loop step
constexpr int64_t kAtomicBlock = 1 << 14;  // keys per task when rows are shared by tasks
// Below this many keys a call runs on the calling thread: waking the pool costs more than the work.
constexpr int64_t kParallelMinKeys = 1 << 14;

// Grain for at::parallel_for over rows: all rows in one task for small batches.
inline int64_t row_grain(int64_t n, int depth) { return n < kParallelMinKeys ? depth : 1; }

// cols[j] = col_row(keys[j]) for j < count (count <= kChunk).
template <bool kPow2>
inline void row_columns(const SketchGeometry& geo, const int64_t* keys, int64_t count, int row,
                        int64_t* cols) {
  if constexpr (kPow2) {
    for (int64_t j = 0; j < count; ++j) cols[j] = geo.reduce_pow2(sketch_row_hash(keys[j], row));
  } else {
    uint64_t h[kChunk];
    for (int64_t j = 0; j < count; ++j) h[j] = sketch_row_hash(keys[j], row);
    for (int64_t j = 0; j < count; ++j) cols[j] = geo.reduce_barrett(h[j]);
  }
}

template <typename Fn>
inline void dispatch_pow2(bool pow2, Fn&& fn) {
  if (pow2) {
    fn(std::true_type{});
  } else {
    fn(std::false_type{});
  }
}

// Calls visit(j) for j in [0, count) while keeping the counters at ptr(j + kPrefetchDistance)
// in flight: random counter accesses on wide rows are cache (and TLB) misses, and this overlaps
// tens of them instead of the handful the out-of-order window finds on its own.
template <bool kWrite, typename Ptr, typename Visit>
inline void visit_prefetched(int64_t count, Ptr&& ptr, Visit&& visit) {
  const int64_t head = std::min(count, kPrefetchDistance);
  for (int64_t j = 0; j < head; ++j) __builtin_prefetch(ptr(j), kWrite, 1);
  for (int64_t j = 0; j < count; ++j) {
    if (j + kPrefetchDistance < count) __builtin_prefetch(ptr(j + kPrefetchDistance), kWrite, 1);
    visit(j);
  }
}

// Saturating add on a counter shared with other threads: a CAS loop (uncontended it costs about
// what a locked add does).
inline void atomic_sat_add(int32_t* counter, int32_t inc) {
  std::atomic_ref<int32_t> ref(*counter);
  int32_t old = ref.load(std::memory_order_relaxed);
  while (!ref.compare_exchange_weak(old, sat_add(old, inc), std::memory_order_relaxed)) {
  }
}

// Keys [begin, end) into row `row` of the sketch. kAtomic: other threads update the same row.
template <bool kPow2, bool kAtomic>
void update_row_range(const SketchUpdateParams& p, int row, int64_t begin, int64_t end) {
  int32_t* counters = p.sketch + row * p.geo.width;
  int64_t cols[kChunk];
  for (int64_t c0 = begin; c0 < end; c0 += kChunk) {
    const int64_t count = std::min(kChunk, end - c0);
    row_columns<kPow2>(p.geo, p.keys + c0, count, row, cols);
    visit_prefetched<true>(
        count, [&](int64_t j) { return counters + cols[j]; },
        [&](int64_t j) {
          const int32_t inc = p.increment(c0 + j);
          if constexpr (kAtomic) {
            if (inc != 0) atomic_sat_add(counters + cols[j], inc);
          } else {
            counters[cols[j]] = sat_add(counters[cols[j]], inc);
          }
        });
  }
}

// Plain update. Saturating adds commute, so any split of the work gives the same sketch. One task
// per row when there are enough rows to keep every thread busy (no atomics needed); otherwise
// tasks of (row, block of keys) with atomic counter updates.
void plain_update(const SketchUpdateParams& p) {
  const int depth = p.geo.depth;
  const bool share_rows = depth < at::get_num_threads() && p.n >= 4 * kAtomicBlock;
  dispatch_pow2(p.geo.pow2, [&](auto pow2) {
    constexpr bool kPow2 = decltype(pow2)::value;
    if (!share_rows) {
      at::parallel_for(0, depth, row_grain(p.n, depth), [&](int64_t r0, int64_t r1) {
        for (int64_t r = r0; r < r1; ++r) update_row_range<kPow2, false>(p, r, 0, p.n);
      });
      return;
    }
    const int64_t blocks = (p.n + kAtomicBlock - 1) / kAtomicBlock;
    at::parallel_for(0, blocks * depth, 1, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) {
        const int row = static_cast<int>(t % depth);
        const int64_t begin = (t / depth) * kAtomicBlock;
        update_row_range<kPow2, true>(p, row, begin, std::min(p.n, begin + kAtomicBlock));
      }
    });
  });
}

// out[i] = min over rows of the key's counters, for keys [begin, end). A chunk's columns are
// computed for every row first, so that one prefetch window runs over all its counters.
template <bool kPow2>
void query_range(const int32_t* sketch, const SketchGeometry& geo, const int64_t* keys,
                 int32_t* out, int64_t begin, int64_t end) {
  int64_t cols[kChunk];  // [depth, keys_per_chunk], as offsets into the whole sketch
  const int64_t keys_per_chunk = kChunk / kSketchMaxDepth * (kSketchMaxDepth / geo.depth);
  for (int64_t c0 = begin; c0 < end; c0 += keys_per_chunk) {
    const int64_t count = std::min(keys_per_chunk, end - c0);
    for (int r = 0; r < geo.depth; ++r) {
      int64_t* row_cols = cols + r * count;
      row_columns<kPow2>(geo, keys + c0, count, r, row_cols);
      for (int64_t j = 0; j < count; ++j) row_cols[j] += r * geo.width;
    }
    int32_t* o = out + c0;
    for (int64_t j = 0; j < count; ++j) o[j] = kSketchCounterMax;
    const int64_t total = count * geo.depth;
    for (int64_t t = 0; t < std::min(total, kPrefetchDistance); ++t) {
      __builtin_prefetch(sketch + cols[t], 0, 1);
    }
    for (int64_t t0 = 0; t0 < total; t0 += count) {  // one row after the other
      for (int64_t j = 0; j < count; ++j) {
        const int64_t t = t0 + j;
        if (t + kPrefetchDistance < total) {
          __builtin_prefetch(sketch + cols[t + kPrefetchDistance], 0, 1);
        }
        o[j] = std::min(o[j], sketch[cols[t]]);
      }
    }
  }
}

void query(const int32_t* sketch, const SketchGeometry& geo, const int64_t* keys, int32_t* out,
           int64_t n) {
  dispatch_pow2(geo.pow2, [&](auto pow2) {
    at::parallel_for(0, n, kParallelMinKeys, [&](int64_t begin, int64_t end) {
      query_range<decltype(pow2)::value>(sketch, geo, keys, out, begin, end);
    });
  });
}

// Conservative update, in the phases SketchConservativeScratch describes. The dedup table is
// built sequentially: it is a hash-map pass over the keys, cheap next to the counter traffic.
void conservative_update(const SketchUpdateParams& p) {
  const int64_t n = p.n;
  std::vector<int32_t> estimate(n);
  query(p.sketch, p.geo, p.keys, estimate.data(), n);

  struct Entry {
    int64_t key;
    int64_t sum;  // -1: empty; else the key's total, at most n * (2^31 - 1) < 2^62
  };
  const int64_t capacity = sketch_table_capacity(n);
  const uint64_t mask = static_cast<uint64_t>(capacity - 1);
  std::vector<Entry> table(capacity, Entry{0, -1});
  std::vector<int32_t> slot(n);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t key = p.keys[i];
    uint64_t h = sketch_dedup_hash(key) & mask;
    while (table[h].sum >= 0 && table[h].key != key) h = (h + 1) & mask;
    if (table[h].sum < 0) table[h] = Entry{key, 0};
    table[h].sum += p.increment(i);
    slot[i] = static_cast<int32_t>(h);
  }
  // Reuse `estimate` for the target value sat(e + S) of each key.
  int32_t* target = estimate.data();
  at::parallel_for(0, n, kParallelMinKeys, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) target[i] = sat_add_wide(target[i], table[slot[i]].sum);
  });

  // Raise every hit counter to the max of the targets of the keys hitting it (max commutes).
  dispatch_pow2(p.geo.pow2, [&](auto pow2) {
    constexpr bool kPow2 = decltype(pow2)::value;
    at::parallel_for(0, p.geo.depth, row_grain(n, p.geo.depth), [&](int64_t r0, int64_t r1) {
      int64_t cols[kChunk];
      for (int64_t r = r0; r < r1; ++r) {
        int32_t* counters = p.sketch + r * p.geo.width;
        for (int64_t c0 = 0; c0 < n; c0 += kChunk) {
          const int64_t count = std::min(kChunk, n - c0);
          row_columns<kPow2>(p.geo, p.keys + c0, count, static_cast<int>(r), cols);
          visit_prefetched<true>(
              count, [&](int64_t j) { return counters + cols[j]; },
              [&](int64_t j) {
                counters[cols[j]] = std::max(counters[cols[j]], target[c0 + j]);
              });
        }
      }
    });
  });
}

void cms_update_cpu(at::Tensor& sketch, const at::Tensor& keys,
                    const c10::optional<at::Tensor>& increments, bool conservative) {
  const SketchGeometry geo = check_cms_update(sketch, keys, increments);
  check_device_type("cms_update", "sketch", sketch, at::kCPU);
  if (increments.has_value()) check_increments_nonnegative("cms_update", *increments);
  if (keys.size(0) == 0) return;
  SketchUpdateParams p{};
  p.sketch = sketch.data_ptr<int32_t>();
  p.keys = keys.const_data_ptr<int64_t>();
  p.increments = increments.has_value() ? increments->const_data_ptr<int32_t>() : nullptr;
  p.n = keys.size(0);
  p.geo = geo;
  if (conservative) {
    conservative_update(p);
  } else {
    plain_update(p);
  }
}

at::Tensor cms_query_cpu(const at::Tensor& sketch, const at::Tensor& keys) {
  const SketchGeometry geo = check_cms_query(sketch, keys);
  at::Tensor out = at::empty({keys.size(0)}, keys.options().dtype(at::kInt));
  if (keys.size(0) == 0) return out;
  query(sketch.const_data_ptr<int32_t>(), geo, keys.const_data_ptr<int64_t>(),
        out.data_ptr<int32_t>(), keys.size(0));
  return out;
}

void cms_decay_cpu(at::Tensor& sketch, int64_t shift) {
  check_cms_decay(sketch, shift);
  int32_t* c = sketch.data_ptr<int32_t>();
  const int s = static_cast<int>(shift);
  at::parallel_for(0, sketch.numel(), 1 << 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) c[i] >>= s;
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(pagedspec, CPU, m) {
  m.impl("cms_update", &cms_update_cpu);
  m.impl("cms_query", &cms_query_cpu);
  m.impl("cms_decay", &cms_decay_cpu);
}

}  // namespace pagedspec
