// The CPU paged-attention kernel, one source built once per ISA level (cpu/isa.h): included only
// by cpu/kernels_<level>.cpp, after cpu/kernel_levels.h (every header) and the level's
// `#pragma GCC target`, with PAGEDSPEC_CPU_LEVEL and PAGEDSPEC_CPU_NAMESPACE defined.
//
// A task is (sequence, KV heads, chunk of query rows, range of positions). A head's query rows are
// all query tokens x all query heads of its group, so each K/V row is read from memory once per
// task and used by every row. Positions are walked in tiles of kTile, and within a tile head after
// head (so a tile's cache tokens are read whole, see TilePrefetch): K rows are read
// straight from the cache and decoded in registers (CacheReader: bf16/fp16 conversions, FP8 as
// exactly CacheCodec::decode), scored against the rows in 4-row x 4-position blocks (5 x 2 at
// AVX2), folded into each row's online-softmax state (include/pagedspec/attention.h, the same
// helpers as the CUDA kernels), then the V rows are decoded and accumulated with the weights.
// What a row may not see (past its causal limit, or past seq_len) never enters its softmax or its
// accumulator, not even with a zero weight, so inf or NaN in unused slots or in a later draft
// token cannot reach it.
// The next tile's cache tokens are prefetched, in address order, while this tile is scored.
// On the AVX-512 level, bf16 tasks may instead score and accumulate with AMX tile multiplies
// (cpu/amx.h, AMX machines: the decode path, accumulators kept in tile layout, for decode and
// verification rows at head sizes up to 128; the many-row path above that) or with AVX512-BF16
// dot-product scores (cpu_bf16_dot; exact products summed in float32, P.V on the FMA path):
// row pairs in the lanes of 256-bit products for up to kLanesMaxRows rows (score_tile_lanes;
// 4 x 4 blocks on FP8 codes converted in registers), and for more rows (verification, wide GQA
// groups) a K tile packed pair-major once for all the rows (score_tile_packed, scores in lanes
// position by position). Tasks of several blocks of rows on the FMA path read an FP8 tile
// as the bf16 images of its codes converted once per tile (with VBMI at AVX-512, through F16C at
// AVX2; Workspace::fp8_images), instead of converting the codes as each block of rows reads them.
//
// The work comes from a split-KV plan (attention_plan.h): one task per (item, KV head); items of
// split sequences write a partial (acc, max, sum), merged afterwards with merge_softmax.
// attn_mass: a separate pass after the final LSE is known (see mass_pass), so the fast path pays
//     nothing for it.
//
// The parts, under cpu/attention/, by role (so that a path can be read, measured or deleted on
// its own), in the order they depend on one another. They are fragments, not headers: this
// file opens the three namespaces once and includes them inside (kernel.h includes its member
// parts inside the kernel class likewise), so that each part holds only its code and the
// preprocessed translation units are token for token those of the single file they were split
// from. #pragma once would add nothing (each is included once, by one file); each part
// stops with #error where PAGEDSPEC_CPU_ATTENTION_PARTS, defined only here, is missing.
#include "cpu/vec.h"

namespace pagedspec {
namespace PAGEDSPEC_CPU_NAMESPACE {
namespace {

#define PAGEDSPEC_CPU_ATTENTION_PARTS
#include "cpu/attention/buffers.h"   // LineAligned, sizes and per-path thresholds
#include "cpu/attention/fma_path.h"  // score and P.V blocks of the FMA path (every level)
#include "cpu/attention/dot_path.h"  // blocks of the AVX512-BF16 dot-product path (AVX-512)
#include "cpu/attention/prefetch.h"  // TilePrefetch, PrefetchSteps
#include "cpu/attention/task.h"      // Task, RowInfo, row helpers
#include "cpu/attention/kernel.h"    // CpuPagedAttention, with its member parts
#include "cpu/attention/run.h"       // plan_tasks, run_cpu
#undef PAGEDSPEC_CPU_ATTENTION_PARTS

}  // namespace

void run_planned_attention(const char* op, at::Tensor& out, const at::Tensor& query,
                           const at::Tensor& key_cache, const at::Tensor& value_cache,
                           const at::Tensor& block_tables, const at::Tensor& seq_lens,
                           const at::Tensor& cu_seqlens_q, double scale,
                           const c10::optional<at::Tensor>& lse,
                           const c10::optional<at::Tensor>& attn_mass, const AttentionArgs& args,
                           const PlanView& plan, float* workspace, const CpuConfig& config) {
  PAGEDSPEC_DISPATCH_ACTIVATION(query.scalar_type(), op, "query", [&] {
    PAGEDSPEC_DISPATCH_CACHE_FORMAT(args.format, [&] {
      auto p = make_attention_params<scalar_t, cache_t>(out, query, key_cache, value_cache,
                                                        block_tables, seq_lens, cu_seqlens_q,
                                                        scale, lse, attn_mass, args);
      run_cpu<scalar_t, cache_t, kCacheFormat>(p, args, plan, workspace, query, config);
    });
  });
}

}  // namespace PAGEDSPEC_CPU_NAMESPACE
}  // namespace pagedspec
