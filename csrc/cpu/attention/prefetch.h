// TilePrefetch (the next tile's cache lines, asked for in address order while this tile is
// worked on) and PrefetchSteps (its steps inside the P.V loops): one mechanism every path paces
// its steps through. What to prefetch and how many steps a tile takes are the kernel's
// (plan_prefetch, plan_after_tile, tile_steps in kernel.h).
// A part of cpu/attention_impl.h, included only there, inside its namespaces.
#ifndef PAGEDSPEC_CPU_ATTENTION_PARTS
#error "a part of cpu/attention_impl.h, included only there: include that instead"
#endif

// The cache lines of the next tile, asked for a few at a time while the current one is worked
// on, in address order. A KV head's rows are D * elem_size bytes, 2-4 KB apart and scattered by
// the block table. On an AVX2 Zen 2 core, reading every head's rows of a 16-position tile, head
// after head, ran at 8 GB/s with each head's next rows prefetched as they were read, and at
// 14.5 GB/s with the same lines prefetched in address order (its plain streaming read: 15.4).
// The ranges are of the K cache; the V cache, of the same layout, is prefetched at the same
// offsets.
struct TilePrefetch {
  static constexpr int kMaxRuns = 64;  // >= positions per tile: at worst one range per position
  const char* k = nullptr;
  int64_t v_delta = 0;  // V address - K address, for the same element
  bool values = false;  // also the V lines
  uintptr_t begin[kMaxRuns], end[kMaxRuns];  // line-aligned K addresses, ascending ranges
  int num_runs = 0, run = 0;
  uintptr_t cur = 0;
  int lines_per_step = 0;

  void clear() { num_runs = run = 0; }
  // Adds the K bytes [k + off, + bytes) (bytes > 0), merged into the last range where they
  // continue it: a block the table places lower in memory starts a range of its own.
  void add(int64_t off, int64_t bytes) {
    const uintptr_t lo = (uintptr_t(k) + uintptr_t(off)) & ~uintptr_t(63);
    const uintptr_t hi = uintptr_t(k) + uintptr_t(off + bytes);
    if (num_runs > 0 && lo >= begin[num_runs - 1] && lo <= end[num_runs - 1]) {
      end[num_runs - 1] = std::max(end[num_runs - 1], hi);
    } else {
      begin[num_runs] = lo;
      end[num_runs++] = hi;
    }
  }
  // Spreads the lines over `steps` calls of step(), from the first range.
  void pace(int steps) {
    int64_t lines = 0;
    for (int i = 0; i < num_runs; ++i) lines += int64_t(end[i] - begin[i] + 63) / 64;
    lines_per_step = steps > 0 ? int((lines + steps - 1) / steps) : int(lines);
    run = 0;
    cur = num_runs > 0 ? begin[0] : 0;
  }
  // Asks for the n lines from `cur` on, all inside the current range, and moves past them.
  // One tight loop: per line, run checks cost more than the prefetches (callgrind: 12
  // instructions a line).
  [[gnu::always_inline]] void take(int64_t n) {
    const char* p = reinterpret_cast<const char*>(cur);
    for (int64_t i = 0; i < n; ++i) {
      __builtin_prefetch(p + 64 * i, 0, 2);
      if (values) __builtin_prefetch(p + 64 * i + v_delta, 0, 2);
    }
    cur += uintptr_t(64 * n);
  }
  // Asks for up to `lines` more lines (of K, and of V if `values`).
  void advance(int64_t lines) {
    while (lines > 0 && run < num_runs) {
      const int64_t n = std::min(lines, int64_t(end[run] - cur + 63) / 64);
      take(n);
      lines -= n;
      if (cur >= end[run] && ++run < num_runs) cur = begin[run];
    }
  }
  // advance(lines_per_step), inline where the lines stay in the current range: the steps run
  // inside loops whose accumulators live in vector registers, which a call (every one of them
  // caller-saved) would spill.
  [[gnu::always_inline]] void step() {
    if (run >= num_runs) return;
    if (cur + uintptr_t(64 * lines_per_step) >= end[run]) {
      advance(lines_per_step);
      return;
    }
    take(lines_per_step);
  }
  // step() as the AMX decode functions call it, between their tile operations.
  AmxPrefetchStep tile_step() {
    return AmxPrefetchStep{[](void* self) { static_cast<TilePrefetch*>(self)->step(); }, this};
  }
  void drain() { advance(INT64_MAX); }
};

// The P.V loops' prefetch steps: one per position and pass over D, or none (null).
struct PrefetchSteps {
  TilePrefetch* pf;
  void operator()() const {
    if (pf != nullptr) pf->step();
  }
};
