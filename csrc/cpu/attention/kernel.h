// CpuPagedAttention, the kernel: a plan item's loop (attend_item: tiles outer, heads inner),
// and per head and tile locate_tile, score_tile, the online softmax and P.V (attend_tile,
// accumulate_rows), with query loading, the K and V factors and prefetch planning. Members
// with a role of their own are parts included inside the class body where they stand in its
// member order: workspace.h (scratch, path choice), tile_images.h (bf16 rows of FP8 tiles),
// dot_tiles.h, amx_decode.h, epilogue.h, mass_pass.h. The paths' branches in the loop, and
// the short AMX and dot members between them, stay here.
// A part of cpu/attention_impl.h, included only there, inside its namespaces.
#ifndef PAGEDSPEC_CPU_ATTENTION_PARTS
#error "a part of cpu/attention_impl.h, included only there: include that instead"
#endif

template <typename QT, typename CacheT, CacheFormat F>
class CpuPagedAttention {
  using Reader = CacheReader<CacheT, F>;
  // The images an FP8 tile is read through on the FMA path (fp8_image_rows: bf16, exact), their
  // reader, and the head sizes they take.
  using ImageT = c10::BFloat16;
  using ImageReader = CacheReader<ImageT, CacheFormat::kNative>;
  static constexpr ImageReader kImageReader{};
  static constexpr int kImageStep = PAGEDSPEC_CPU_LEVEL == 2 ? 32 : kLanes;
  // The most row blocks a task converts FP8 codes for in registers; beyond, images. One block
  // (decode at group 4) converts each code once either way. AVX2 keeps two: an 8-row task
  // (5 + 3) ran 12.8 ms through images against 12.0, a 12-row one 16.1 against 17.9 (e4m3, B=8
  // ctx=2048, Zen 4 held to avx2); at AVX-512 8 rows (4 + 4) gained, 9.0-9.3 against 9.9-10.0.
  static constexpr int kImageMinBlocks = PAGEDSPEC_CPU_LEVEL == 1 ? 2 : 1;
  // Positions per tile, and so how far ahead the next tile's cache tokens are prefetched: on an
  // AVX2-only Zen 2 every prefetch fills L1, and the next 32 tokens of 8 heads (128 KB in bf16)
  // streamed through it evicted one another and the rows in use before they were read. 16 made
  // bf16 decode 1.5x faster from DRAM there (8 slower, with the online-softmax work per tile).
  // The AVX-512 level keeps 32 (its AMX tiles take 32; Intel's and Zen 4's prefetcht1 fill L2).
  static constexpr int kTile = PAGEDSPEC_CPU_LEVEL == 1 ? kDefaultTile / 2 : kDefaultTile;

 public:
  // `config`: the call's CPU configuration (cpu/isa.h), whose isa is this level.
  CpuPagedAttention(const PagedAttentionParams<QT, CacheT>& p, const CpuConfig& config)
      : p_(p), bf16_dot_(kDotCapable && p.head_size % 32 == 0 && config.bf16_dot),
        fp8_images_(F != CacheFormat::kNative && PAGEDSPEC_CPU_LEVEL >= 1 &&
                    p.head_size % kImageStep == 0 && config.fp8_images),
        amx_(kAmxCapable && config.amx && (F == CacheFormat::kNative || config.avx512_vbmi)),
        amx_decode_(amx_ && config.amx_decode) {}

  RowInfo row_info(int seq, int kv_head, int row) const {
    const int G = p_.group_size();
    const int first = p_.cu_seqlens_q[seq];
    const int q_len = p_.cu_seqlens_q[seq + 1] - first;
    const int j = row / G;
    return RowInfo{first + j, kv_head * G + row % G, causal_limit(p_.seq_lens[seq], q_len, j)};
  }

#include "cpu/attention/workspace.h"

  // Packs the task's query rows for amx_scores (unscaled bf16: the scale is applied to the
  // float32 scores, so the products are exact as on the FMA path) and configures the tiles.
  void begin_amx(Workspace& ws, int R) const {
    const uint16_t* rows[kMaxRows];
    tile_operands(ws, R, rows);
    ws.q_vnni.resize(size_t(kMaxRows) * p_.head_size);
    amx_pack_queries(rows, R, p_.head_size, ws.q_vnni.data());
    amx_begin();
  }

  // What both AMX paths read: the task's R query rows as bf16 bits (rows[r], ws.rows located).
  void tile_operands(Workspace& ws, int R, const uint16_t** rows) const {
    for (int r = 0; r < R; ++r) rows[r] = reinterpret_cast<const uint16_t*>(query_row(ws.rows[r]));
  }

#include "cpu/attention/tile_images.h"

  // Sets pf to the cache lines of positions [first, first + n) of sequence seq, for KV heads
  // [kv_head, kv_head + num_heads) (adjacent in a cache token) of K, and of V if `values`, paced
  // over `steps` calls of pf.step().
  void plan_prefetch(TilePrefetch& pf, int seq, int first, int n, int kv_head, int num_heads,
                     bool values, int steps) const {
    static_assert(kTile <= TilePrefetch::kMaxRuns, "a tile's ranges fit the prefetch");
    pf.k = reinterpret_cast<const char*>(p_.key_cache);
    pf.v_delta = reinterpret_cast<const char*>(p_.value_cache) - pf.k;
    pf.values = values;
    pf.clear();
    const int64_t bytes = int64_t(num_heads) * p_.head_size * int64_t(sizeof(CacheT));
    for (int pos = first; pos < first + n; ++pos) {
      pf.add(p_.cache_offset(seq, pos, kv_head) * int64_t(sizeof(CacheT)), bytes);
    }
    pf.pace(steps);
  }
  // The first tile of a task, for all its heads.
  void plan_first_tile(TilePrefetch& pf, const Task& task, int steps) const {
    const int n = std::min(kTile, task_pos_end(task) - task.pos_begin);
    if (n <= 0) {
      pf.clear();
      return;
    }
    plan_prefetch(pf, task.seq, task.pos_begin, n, task.kv_head, task.num_heads, true, steps);
  }

  // The item's first tile, all of it now (the previous item did not prefetch it).
  void prefetch_first_tile(TilePrefetch& pf, const Task& item) const {
    plan_first_tile(pf, item, 0);
    pf.drain();
  }
  // Sets pf to what follows the item's tile at `start`: its next tile, else the first tile of
  // `next`, the item this thread runs next (if any), paced over `steps` calls of pf.step().
  void plan_after_tile(TilePrefetch& pf, const Task& item, const Task* next, int start,
                       int pos_end, int steps) const {
    if (start + kTile < pos_end) {
      plan_prefetch(pf, item.seq, start + kTile, std::min(kTile, pos_end - start - kTile),
                    item.kv_head, item.num_heads, true, steps);
    } else if (next != nullptr) {
      plan_first_tile(pf, *next, steps);
    } else {
      pf.clear();
    }
  }

  // score_tile through amx_scores, the whole tile in one call, with the same prefetches.
  void score_tile_amx(const Task& task, Workspace& ws, int n, TilePrefetch& pf) const {
    const int D = p_.head_size;
    const float q_scale = score_scale(task.kv_head);
    for (int t = 0; t < n; ++t) pf.step();
    amx_scores(ws.q_vnni.data(), task.num_rows,
               bf16_rows(ws.krows, 0, n, ws.kreader, Operand::kKeys), n, D, q_scale,
               ws.w.data(), kTile);
  }

  // The factor an FP8 cache's images are read with (scale x CacheReader::kImage; 1 for a
  // native cache): folded into the query for K, into the output for V.
  float k_factor(int kv_head) const {
    return F == CacheFormat::kNative ? 1.0f : p_.k_scale.at(kv_head) * Reader::kImage;
  }
  // What q . k is multiplied by to give the log2-domain logit: the softmax scale, log2(e) and
  // the K factor. The FMA path folds it into the loaded queries, the AMX path into its scores.
  float score_scale(int kv_head) const { return p_.scale * kLog2e * k_factor(kv_head); }
  // ... as the FMA path applies it (split_score_factor): the query's part (K factor included)
  // and the scores' power of two.
  ScoreFactor fma_score_factor(int kv_head) const {
    ScoreFactor f = split_score_factor(p_.scale * kLog2e);
    f.query *= k_factor(kv_head);
    return f;
  }
  float v_factor(int kv_head) const {
    return F == CacheFormat::kNative ? 1.0f : p_.v_scale.at(kv_head) * Reader::kImage;
  }

  const QT* query_row(const RowInfo& info) const {
    return p_.query + int64_t(info.token) * p_.q_token_stride +
           int64_t(info.head) * p_.q_head_stride;
  }

  // Locates the task's query rows and loads them: as stored for the dot path (which scales its
  // float32 scores), not at all for the AMX paths (Path::kAmx packs the unscaled
  // rows itself), else scaled into the log2 domain (and by the K factor).
  void load_queries(const Task& task, Workspace& ws) const {
    const int D = p_.head_size;
    const ScoreFactor factor = fma_score_factor(task.kv_head);
    const float q_scale = factor.query;
    ws.score_factor = factor.score;
    for (int r = 0; r < task.num_rows; ++r) {
      ws.rows[r] = row_info(task.seq, task.kv_head, task.row_begin + r);
    }
#if PAGEDSPEC_CPU_LEVEL == 2
    if (uses_score_lanes(ws, task.num_rows)) {
      lane_pair_queries(task.num_rows, D, [&](int r) {
        return reinterpret_cast<const uint16_t*>(query_row(ws.rows[r]));
      }, ws.q_lanes.data());
      return;
    }
#endif
    for (int r = 0; r < task.num_rows; ++r) {
      const RowInfo& info = ws.rows[r];
      if (ws.path == Path::kAmx || ws.path == Path::kAmxDecode) continue;
      const QT* src = query_row(info);
      if (ws.path == Path::kDot) {
        uint16_t* dst = ws.q_bf16.data() + size_t(r) * D;
#if PAGEDSPEC_CPU_LEVEL == 2
        if (ws.dot_fp8) {
          fp8_lane_order_query(reinterpret_cast<const uint16_t*>(src), D, dst);
          continue;
        }
#endif
        std::memcpy(dst, src, size_t(D) * sizeof(QT));
        continue;
      }
      float* dst = ws.q.data() + size_t(r) * D;
#pragma omp simd
      for (int d = 0; d < D; ++d) dst[d] = ScalarConvert<QT>::to_float(src[d]) * q_scale;
#if PAGEDSPEC_CPU_LEVEL >= 1
      if (even_odd_rows(ws)) even_odd_order(dst, D);  // as K is read
#endif
    }
  }

  // Locates the tile's n K and V rows and counts what each row may see of this tile.
  void locate_tile(const Task& task, Workspace& ws, int start, int n) const {
    // One block-table lookup per cache block, not per position; a block's rows in a loop the
    // compiler vectorizes (as 64 scalar stores a tile and head, about 5% of 4-row bf16 decode).
    const int64_t token_stride = p_.cache_token_stride();
    for (int t = 0; t < n;) {
      const int pos = start + t;
      const int run = std::min(n - t, p_.block_size - (pos & (p_.block_size - 1)));
      const int64_t off = p_.cache_offset(task.seq, pos, task.kv_head);
      const CacheT* k = p_.key_cache + off;
      const CacheT* v = p_.value_cache + off;
      for (int i = 0; i < run; ++i) {
        ws.krows[t + i] = k + i * token_stride;
        ws.vrows[t + i] = v + i * token_stride;
      }
      t += run;
    }
    for (int r = 0; r < task.num_rows; ++r) {
      ws.visible[r] = std::clamp(ws.rows[r].limit - start + 1, 0, n);
    }
  }

  // ws.w[r][t] = q[r] . k[t] for every row and every position it may see, blocks of four rows
  // and kScoreTokens positions. Rows ascend in query token, so the last row of a group sees the most.
  // One pf.step() per position of the first row block.
  void score_tile(const Task& task, Workspace& ws, TilePrefetch& pf) const {
    const int D = p_.head_size;
    const int R = task.num_rows;
    // The dot path's scale and K rows as bf16 (those any row sees), or the FMA path's FP8 images.
    [[maybe_unused]] const float dot_scale = score_scale(task.kv_head);
    [[maybe_unused]] const uint16_t* const* dot_krows = nullptr;
    if constexpr (kDotCapable) {
      if (ws.path == Path::kDot && !ws.dot_fp8) {
        dot_krows = bf16_rows(ws.krows, 0, ws.visible[R - 1], ws.kreader, Operand::kKeys);
      }
    }
    const ImageT* const* k_images =
        ws.fp8_images && ws.path != Path::kDot
            ? fp8_image_rows(ws.krows, ws.visible[R - 1], ws.kreader, Operand::kKeys)
            : nullptr;
#if PAGEDSPEC_CPU_LEVEL == 2
    const std::optional<Fp8ImageLookup> lookup = fp8_lookup(ws, ws.kreader);
    if constexpr (kDotCapable) {
      if (uses_score_lanes(ws, R)) {
        score_tile_lanes(task, ws, dot_krows, pf);
        return;
      }
      if (ws.path == Path::kDot && scores_packed(R, ws.dot_fp8)) {
        score_tile_packed(task, ws, dot_krows, lookup ? &*lookup : nullptr, pf);
        return;
      }
    }
#endif
    // One score block: through the dot path on FP8 codes or the FMA path.
    const auto block = [&](auto NR, auto NT, int r0, int t, float* out) {
#if PAGEDSPEC_CPU_LEVEL == 2
      if constexpr (kDotCapable && F != CacheFormat::kNative) {
        if (ws.dot_fp8) {
          score_block_fp8_dot<NR, NT>(ws.q_bf16.data() + size_t(r0) * D, as_codes(ws.krows) + t,
                                      D, dot_scale, *lookup, out, kTile);
          return;
        }
      }
#endif
      if constexpr (F != CacheFormat::kNative) {
        if (k_images != nullptr) {
          score_block<NR, NT>(ws.q.data() + size_t(r0) * D, k_images + t, kImageReader, D, out,
                              kTile);
          return;
        }
      }
      score_block<NR, NT>(ws.q.data() + size_t(r0) * D, ws.krows + t, ws.kreader, D, out, kTile);
    };
    for (int r0 = 0; r0 < R; r0 += kRowBlock) {
      const int nr = std::min(kRowBlock, R - r0);
      const int group_visible = ws.visible[r0 + nr - 1];
      with_rows(nr, [&](auto NR) {
        float* w = ws.w.data() + r0 * kTile;
        int t = 0;
        for (; t + kScoreTokens <= group_visible; t += kScoreTokens) {
          if (r0 == 0) {
            for (int i = 0; i < kScoreTokens; ++i) pf.step();
          }
          block(NR, std::integral_constant<int, kScoreTokens>{}, r0, t, w + t);
        }
        for (; t < group_visible; ++t) {
          if (r0 == 0) pf.step();
          block(NR, std::integral_constant<int, 1>{}, r0, t, w + t);
        }
      });
    }
    // The FMA path's scores times the power of two its queries left out (only for scales above
    // 2^16 / log2(e): fma_score_factor); the dot path's blocks scaled theirs whole.
    if (ws.path != Path::kDot && ws.score_factor != 1.0f) {
      for (int r = 0; r < R; ++r) {
        scale_row(ws.w.data() + r * kTile, ws.score_factor, ws.visible[r]);
      }
    }
  }

#include "cpu/attention/dot_tiles.h"

  // The rows of the packed paths' next block when `left` rows remain: 8, and a last block of 4
  // where 4 or fewer remain (padded up to it), so R rows take ceil(R / 8) blocks.
  static int packed_block_rows(int left) { return left > 4 ? 8 : 4; }

  // The pf.step() calls attend_tile makes for one head's R rows on an n-position tile: the AMX
  // path's, one per position; score_tile_packed's, one per kPackedStepPairs pairs of each row
  // block; else one per position of the first score block; and then one per position and pass
  // over D (value_passes) of the first rows' P.V, so that the lines are asked for all through the
  // tile. Without the P.V's share, prefetches came as bursts in the score loop and the memory sat
  // idle through the P.V: float32 decode ran at about the sum of the two (bench/NOTES.md).
  int tile_steps(int R, int n) const {
    const Path path = choose_path(R);
    if (path == Path::kAmx) return n;
    if (path == Path::kDot && scores_packed(R, dot_fp8_codes())) {
      const int blocks = (R + 7) / 8;
      return blocks * ((p_.head_size / 2 + kPackedStepPairs - 1) / kPackedStepPairs) +
             n * value_passes();
    }
    return n * (1 + value_passes());
  }
  // accumulate_block's passes over D (spans of kValueSpan vectors, then of one load_pair, then
  // single vectors): the FMA path's P.V, which every path but AMX's whole tiles takes.
  int value_passes() const {
    const int D = p_.head_size;
    constexpr int kSpan = kValueSpan * kRegLanes, kStep = kRowStep<Reader> * kRegLanes;
    return D / kSpan + (D % kSpan) / kStep + (D % kStep) / kRegLanes;
  }

  template <typename Fn>
  static void with_rows(int nr, Fn&& fn) {
    static_assert(kRowBlock <= 5, "with_rows dispatches blocks of up to 5 rows");
    switch (nr) {
      case 5:
        if constexpr (kRowBlock >= 5) fn(std::integral_constant<int, 5>{});
        break;
      case 4: fn(std::integral_constant<int, 4>{}); break;
      case 3: fn(std::integral_constant<int, 3>{}); break;
      case 2: fn(std::integral_constant<int, 2>{}); break;
      default: fn(std::integral_constant<int, 1>{}); break;
    }
  }

  // The task's first position past what its rows see (rows ascend in query token, so the last
  // row sees the furthest).
  int task_pos_end(const Task& task) const {
    const int last = task.row_begin + task.num_rows - 1;
    return std::min(task.pos_end, row_info(task.seq, task.kv_head, last).limit + 1);
  }

  // Online softmax of a plan item's rows over [pos_begin, pos_end), for every KV head: leaves
  // each head's row states in heads[h].state and their unnormalized accumulators (sum of
  // weight * v) in heads[h].acc. Tiles run outer and heads inner, so the item reads each tile's
  // cache tokens whole, while the next tile's are prefetched in address order (TilePrefetch);
  // the last tile prefetches the first of `next`, the item this thread runs next (if any), and
  // `first_prefetched` says whether the previous item prefetched this one's.
  void attend_item(const Task& item, const Task* next, bool first_prefetched,
                   std::vector<Workspace>& heads, TilePrefetch& pf) const {
    if (choose_path(item.num_rows) == Path::kAmxDecode) {
      attend_item_amx_decode(item, next, first_prefetched, heads, pf);
      return;
    }
    const int HK = item.num_heads;
    for (int h = 0; h < HK; ++h) begin_head(with_head(item, item.kv_head + h), heads[h]);
    const int pos_end = task_pos_end(item);
    if (!first_prefetched) prefetch_first_tile(pf, item);
    for (int start = item.pos_begin; start < pos_end; start += kTile) {
      const int n = std::min(kTile, pos_end - start);
      plan_after_tile(pf, item, next, start, pos_end, HK * tile_steps(item.num_rows, n));
      for (int h = 0; h < HK; ++h) {
        attend_tile(with_head(item, item.kv_head + h), heads[h], start, n, pf);
      }
      pf.drain();
    }
    for (int h = 0; h < HK; ++h) end_head(with_head(item, item.kv_head + h), heads[h]);
  }

#include "cpu/attention/amx_decode.h"

  // The task for one of its heads.
  static Task with_head(Task task, int kv_head) {
    task.kv_head = kv_head;
    task.num_heads = 1;
    return task;
  }

  // A head's rows before its first tile: path, queries, empty states.
  void begin_head(const Task& task, Workspace& ws) const {
    const int R = task.num_rows;
    enter_path(ws, choose_path(R), R);
    load_queries(task, ws);
    if (ws.path == Path::kAmx) begin_amx(ws, R);
    ws.kreader.init();
    ws.vreader.init();
    std::fill(ws.acc.begin(), ws.acc.begin() + size_t(R) * p_.head_size, 0.0f);
    ws.acc_even_odd = false;
    std::fill(ws.state.begin(), ws.state.begin() + R, SoftmaxState::empty());
  }

  // Whether the FMA path reads this task's K and V rows in load_pair's even/odd order: bf16 rows
  // (a bf16 cache's, Reader::kEvenOddPairs, or an FP8 tile's images, ws.fp8_images).
  static bool even_odd_rows(const Workspace& ws) {
    return Reader::kEvenOddPairs || (ws.fp8_images && ImageReader::kEvenOddPairs);
  }

  // The FMA path accumulates such V rows in that order, where AMX tile multiplies and the
  // epilogue use dimension order: puts a task's R accumulator rows in the order asked,
  // converting them if they are not.
  void set_acc_order(Workspace& ws, int R, bool even_odd) const {
#if PAGEDSPEC_CPU_LEVEL >= 1
    if (even_odd_rows(ws)) {
      if (ws.acc_even_odd == even_odd) return;
      const int D = p_.head_size;
      for (int r = 0; r < R; ++r) {
        float* acc = ws.acc.data() + size_t(r) * D;
        even_odd ? even_odd_order(acc, D) : even_odd_to_natural(acc, D);
      }
      ws.acc_even_odd = even_odd;
    }
#endif
    (void)ws, (void)R, (void)even_odd;
  }

  // Positions [start, start + n) for one head's rows: scores, online softmax, values.
  void attend_tile(const Task& task, Workspace& ws, int start, int n, TilePrefetch& pf) const {
    const int D = p_.head_size;
    const int R = task.num_rows;
    locate_tile(task, ws, start, n);
    if (ws.path == Path::kAmx) {
      score_tile_amx(task, ws, n, pf);
    } else {
      score_tile(task, ws, pf);
    }
    // Online softmax per row over the positions it sees (scores past its limit are left unread).
    for (int r = 0; r < R; ++r) {
      const int visible = ws.visible[r];
      float* w = ws.w.data() + r * kTile;
      if (visible > 0) {
        SoftmaxState& st = ws.state[r];
        const float factor = st.raise_max(max_weights(w, visible));
        if (factor != 1.0f) scale_row(ws.acc.data() + size_t(r) * D, factor, D);
        st.sum += exp2_weights(w, visible, st.max);
      }
    }
    if (ws.path == Path::kAmx && n == kTile && ws.visible[0] == kTile) {
      // Every row sees the whole tile (rows ascend, so the first sees the least): no position
      // is past a row's limit, so the tile multiply may take them all (the causal tail and
      // partial tiles stay on the FMA path, which accumulates per visible segment).
      set_acc_order(ws, R, false);
      amx_accumulate(ws.w.data(), kTile, R,
                     bf16_rows(ws.vrows, 0, kTile, ws.vreader, Operand::kValues), D,
                     ws.acc.data());
    } else {
      set_acc_order(ws, R, true);
      if (ws.fp8_images) {  // the V rows any row sees
        ws.v_images = fp8_image_rows(ws.vrows, ws.visible[R - 1], ws.vreader, Operand::kValues);
      }
      for (int r0 = 0; r0 < R; r0 += kRowBlock) {
        accumulate_rows(ws, r0, std::min(kRowBlock, R - r0), pf);
      }
    }
  }

  // A head's rows after its last tile: accumulators back in dimension order.
  void end_head(const Task& task, Workspace& ws) const {
    if (ws.path == Path::kAmx) amx_end();
    set_acc_order(ws, task.num_rows, false);
  }

  // acc[r] += sum over the positions row r sees of w[r][t] * v[t], for rows r0 .. r0 + nr - 1.
  // Their visible counts never decrease (rows ascend in query token), so the positions split into
  // segments [visible[i-1], visible[i]) that rows i .. nr - 1 all see. Each segment is accumulated
  // for exactly those rows: a position past a row's limit is never multiplied into it, not even by
  // a zero weight, so an inf or NaN in a later draft token's V cannot reach an earlier token
  // (the contract's Isolation). The first segment of the first rows (r0 = 0) makes the P.V's
  // share of the tile's prefetch steps (tile_steps).
  void accumulate_rows(Workspace& ws, int r0, int nr, TilePrefetch& pf) const {
    const int D = p_.head_size;
    int begin = 0;
    for (int i = 0; i < nr; ++i) {
      const int end = ws.visible[r0 + i];
      if (end > begin) {
        const int row = r0 + i;
        const PrefetchSteps step{r0 == 0 && begin == 0 ? &pf : nullptr};
        with_rows(nr - i, [&](auto NR) {
          if constexpr (F != CacheFormat::kNative) {
            if (ws.fp8_images) {
              accumulate_block<NR>(ws.acc.data() + size_t(row) * D,
                                   ws.w.data() + row * kTile + begin, ws.v_images + begin,
                                   kImageReader, end - begin, D, kTile, step);
              return;
            }
          }
          accumulate_block<NR>(ws.acc.data() + size_t(row) * D, ws.w.data() + row * kTile + begin,
                               ws.vrows + begin, ws.vreader, end - begin, D, kTile, step);
        });
        begin = end;
      }
    }
  }

#include "cpu/attention/epilogue.h"
#include "cpu/attention/mass_pass.h"

 private:
  const PagedAttentionParams<QT, CacheT>& p_;
  const bool bf16_dot_;  // the dot path for every task the AMX path does not take
  // The FMA path may read FP8 tiles as images (Workspace::fp8_images): AVX2, or AVX-512 with
  // VBMI and D a multiple of 32 (CpuConfig::fp8_images, fp8_images_as_bf16).
  const bool fp8_images_;
  // The AMX paths (CpuConfig::amx; FP8 codes reach the tiles through fp8_images_as_bf16, VBMI):
  // the many-row score path (use_amx) and the decode path (use_amx_decode).
  const bool amx_;
  const bool amx_decode_;
};
