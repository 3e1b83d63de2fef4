// The dot path's score loops over a tile, which score_tile hands off to (AVX-512 level only):
// score_tile_packed (many rows, a packed K tile) and score_tile_lanes (up to kLanesMaxRows
// rows). Their blocks are in dot_path.h; the P.V is the FMA path's (accumulate_rows).
// Members of CpuPagedAttention, included only by cpu/attention/kernel.h, inside the class body
// at this place in its member order.
#ifndef PAGEDSPEC_CPU_ATTENTION_PARTS
#error "a part of cpu/attention_impl.h, included only there: include that instead"
#endif

#if PAGEDSPEC_CPU_LEVEL == 2
  // score_tile on the dot path through a packed K tile (pack_key_group, score_rows_packed): the
  // rows in blocks of 8 (then 4), a block padded with the rows after it (the workspace holds
  // kMaxRows; their scores are never read), over the groups its last row sees. K rows are the
  // bf16 rows `krows` (a bf16 cache's, or an FP8 cache's images), or with `lookup` FP8 codes
  // converted in registers into the queries' lane order (fp8_images_in_lanes). The prefetch
  // steps (tile_steps) run inside the score loops, spread over all the row blocks: issued
  // among the packing's row loads, one per row, they left the path next to no gain
  // (bench/NOTES.md).
  void score_tile_packed(const Task& task, Workspace& ws, const uint16_t* const* krows,
                         const Fp8ImageLookup* lookup, TilePrefetch& pf) const {
    static_assert(kTile <= 2 * kPackedGroup, "score_rows_packed takes one or two groups");
    static_assert(kMaxRows % 8 == 0, "padded row blocks stay inside the workspace");
    const int D = p_.head_size;
    const int R = task.num_rows;
    const int n = ws.visible[R - 1];
    const int group_dwords = D / 2 * kPackedGroup;
    static thread_local std::vector<uint32_t, LineAligned<uint32_t>> packed;
    packed.resize(size_t(2) * group_dwords);
    const auto step = [&] { pf.step(); };
    for (int g = 0; g * kPackedGroup < n; ++g) {
      const int rows = std::min(kPackedGroup, n - g * kPackedGroup);
      uint32_t* dst = packed.data() + g * group_dwords;
      if (lookup != nullptr) {
        const uint8_t* const* codes = as_codes(ws.krows) + g * kPackedGroup;
        pack_key_group(rows, D, dst, [&](int t, int k, __m512i& lo, __m512i& hi, bool) {
          fp8_images_in_lanes(_mm512_loadu_si512(codes[t] + 64 * k), *lookup, lo, hi);
        });
      } else {
        const uint16_t* const* k_rows = krows + g * kPackedGroup;
        pack_key_group(rows, D, dst, [&](int t, int k, __m512i& lo, __m512i& hi, bool pair) {
          lo = _mm512_loadu_si512(k_rows[t] + 64 * k);
          if (pair) hi = _mm512_loadu_si512(k_rows[t] + 64 * k + 32);
        });
      }
    }
    const float scale = score_scale(task.kv_head);
    for (int r0 = 0; r0 < R;) {
      const int nr = packed_block_rows(R - r0);
      const bool two = ws.visible[std::min(R, r0 + nr) - 1] > kPackedGroup;
      const uint16_t* q = ws.q_bf16.data() + size_t(r0) * D;
      float* w = ws.w.data() + r0 * kTile;
      if (nr == 8) {
        two ? score_rows_packed<8, 2>(q, packed.data(), D, scale, w, kTile, step)
            : score_rows_packed<8, 1>(q, packed.data(), D, scale, w, kTile, step);
      } else {
        two ? score_rows_packed<4, 2>(q, packed.data(), D, scale, w, kTile, step)
            : score_rows_packed<4, 1>(q, packed.data(), D, scale, w, kTile, step);
      }
      r0 += nr;
    }
  }
#endif

#if PAGEDSPEC_CPU_LEVEL == 2
  // score_tile through score_block_lanes (uses_score_lanes): blocks of kRowBlock rows (two row
  // pairs; an odd count's last pair fills the row after it, which the workspace holds and nothing
  // reads) x 8 positions, then 4; a last block of fewer repeats its last K row, and the scores
  // it writes past what the rows see (still inside the tile) are never read. The first row
  // block's prefetch steps, one per position, run among its K lines rather than before it.
  void score_tile_lanes(const Task& task, Workspace& ws, const uint16_t* const* krows,
                        TilePrefetch& pf) const {
    static_assert(kRowBlock == 4 && kTile % 4 == 0 && kMaxRows % 2 == 0,
                  "blocks of two row pairs, whole blocks of 4 positions inside the tile");
    const int D = p_.head_size;
    const int R = task.num_rows;
    const float scale = score_scale(task.kv_head);
    for (int r0 = 0; r0 < R; r0 += kRowBlock) {
      const int pairs = (std::min(kRowBlock, R - r0) + 1) / 2;
      const int group_visible = ws.visible[std::min(R, r0 + kRowBlock) - 1];
      const uint16_t* q = ws.q_lanes.data() + size_t(r0) * D;  // pair r0 / 2, 2 D per pair
      float* w = ws.w.data() + r0 * kTile;
      const auto step = [&] { pf.step(); };
      const auto block = [&](auto NT, int t, const uint16_t* const* k, int steps) {
        pairs == 2 ? score_block_lanes<2, NT>(q, k, D, scale, w + t, kTile, steps, step)
                   : score_block_lanes<1, NT>(q, k, D, scale, w + t, kTile, steps, step);
      };
      int t = 0;
      for (; t + 8 <= group_visible; t += 8) {
        block(std::integral_constant<int, 8>{}, t, krows + t, r0 == 0 ? 8 : 0);
      }
      for (; t < group_visible; t += 4) {
        const uint16_t* k[4];
        for (int i = 0; i < 4; ++i) k[i] = krows[std::min(t + i, group_visible - 1)];
        block(std::integral_constant<int, 4>{}, t, k,
              r0 == 0 ? std::min(4, group_visible - t) : 0);
      }
    }
  }
#endif
