// attend_item_amx_decode, the AMX decode path's item loop (cpu/amx.h: AmxDecode), which takes
// the place of attend_item where use_amx_decode holds. The AMX score path of many-row tasks is
// a few lines in kernel.h (begin_amx, score_tile_amx) and its P.V a branch of attend_tile.
// Members of CpuPagedAttention, included only by cpu/attention/kernel.h, inside the class body
// at this place in its member order.
#ifndef PAGEDSPEC_CPU_ATTENTION_PARTS
#error "a part of cpu/attention_impl.h, included only there: include that instead"
#endif

  // attend_item through the AMX decode path (cpu/amx.h: AmxDecode), each head's rows in chunks
  // of up to kAmxDecodeMaxRows (one state each). Per tile, three passes over the heads: scores
  // by tile multiplies, then the online softmax and the weight tiles, then P.V, so that each
  // hand-over between tiles and vector code has a few heads' work in between. The next tile's
  // prefetch advances inside the tile functions too (AmxPrefetchStep), not in bursts between
  // passes. Rows over 8 take wide states, so 9 to 16 rows share each key tile and hand-over.
  // The accumulators stay in tile layout from the first tile to the last; a row's running max
  // is raised only past kAmxDecodeMaxSlack (SoftmaxState's max is then the reference of the
  // sum and accumulator, below the largest logit by at most that; every consumer only needs a
  // common reference).
  void attend_item_amx_decode(const Task& item, const Task* next, bool first_prefetched,
                              std::vector<Workspace>& heads, TilePrefetch& pf) const {
    if constexpr (kAmxCapable) {
      const int HK = item.num_heads;
      const int R = item.num_rows;
      const int D = p_.head_size;
      // Rows in `chunks` tile states of chunk_rows each (the last padded with zero queries):
      // chunk c holds rows [c * chunk_rows, + chunk_rows), so row r's weights stay at w[r].
      const int chunks = (R + kAmxDecodeMaxRows - 1) / kAmxDecodeMaxRows;
      const int chunk_rows = (R + chunks - 1) / chunks;
      static const uint16_t kZeroRow[kAmxDecodeMaxDims] = {};
      for (int h = 0; h < HK; ++h) {
        Workspace& ws = heads[h];
        enter_path(ws, Path::kAmxDecode, R);
        load_queries(with_head(item, item.kv_head + h), ws);
        const uint16_t* rows[kMaxRows];
        tile_operands(ws, R, rows);
        for (int r = R; r < chunks * chunk_rows; ++r) rows[r] = kZeroRow;
        if (ws.decode == nullptr) ws.decode = std::make_unique<AmxDecode[]>(kAmxDecodeChunks);
        for (int c = 0; c < chunks; ++c) {
          amx_decode_begin(ws.decode[c], rows + c * chunk_rows, chunk_rows, D);
        }
        ws.kreader.init();
        ws.vreader.init();
        std::fill(ws.state.begin(), ws.state.begin() + R, SoftmaxState::empty());
      }
      amx_decode_configure(chunk_rows);
      const AmxPrefetchStep step = pf.tile_step();
      const int pos_end = task_pos_end(item);
      if (!first_prefetched) prefetch_first_tile(pf, item);
      for (int start = item.pos_begin; start < pos_end; start += kTile) {
        const int n = std::min(kTile, pos_end - start);
        const int n16 = (n + 15) & ~15;  // the weight tiles' positions
        // A step per head and pass, and those the tile functions take.
        plan_after_tile(pf, item, next, start, pos_end,
                        HK * (3 + chunks * amx_decode_prefetch_steps(D, n)));
        for (int h = 0; h < HK; ++h) {
          Workspace& ws = heads[h];
          locate_tile(with_head(item, item.kv_head + h), ws, start, n);
          pf.step();
          const uint16_t* const* k = bf16_rows(ws.krows, 0, n, ws.kreader, Operand::kKeys);
          for (int c = 0; c < chunks; ++c) amx_decode_scores(ws.decode[c], k, n, step);
        }
        for (int h = 0; h < HK; ++h) {
          Workspace& ws = heads[h];
          pf.step();
          for (int c = 0; c < chunks; ++c) {
            amx_decode_read_scores(ws.decode[c], n, score_scale(item.kv_head + h),
                                   ws.w.data() + c * chunk_rows * kTile, kTile, step);
          }
          float factor[kMaxRows];
          bool rescale[kAmxDecodeChunks] = {};
          for (int r = 0; r < chunks * chunk_rows; ++r) {
            factor[r] = 1.0f;
            // A row sees the first `visible` positions; the rest weigh 0 (as do padding rows).
            const int visible = r < R ? ws.visible[r] : 0;
            float* w = ws.w.data() + r * kTile;
            if (visible > 0) {
              SoftmaxState& st = ws.state[r];
              const float tile_max = max_weights(w, visible);
              if (tile_max > st.max + kAmxDecodeMaxSlack || st.is_empty()) {
                factor[r] = st.raise_max(tile_max);
                rescale[r / chunk_rows] = true;
              }
              st.sum += exp2_weights(w, visible, st.max);  // zeroes up to a multiple of 16
            }
            for (int t = (visible + 15) & ~15; t < n16; ++t) w[t] = 0.0f;
          }
          for (int c = 0; c < chunks; ++c) {
            if (rescale[c]) amx_decode_scale(ws.decode[c], factor + c * chunk_rows);
            amx_decode_weights(ws.decode[c], ws.w.data() + c * chunk_rows * kTile, kTile, n,
                               step);
          }
        }
        for (int h = 0; h < HK; ++h) {
          Workspace& ws = heads[h];
          pf.step();
          const uint16_t* const* v = bf16_rows(ws.vrows, 0, n, ws.vreader, Operand::kValues);
          for (int c = 0; c < chunks; ++c) {
            // Tile multiplies over the positions all the chunk's rows see, vector FMAs past them
            // (verification rows' last positions), so no row meets a value it may not see.
            const int first = c * chunk_rows, last = std::min(R, first + chunk_rows);
            int common = n;
            for (int r = first; r < last; ++r) common = std::min(common, ws.visible[r]);
            if (common > 0) amx_decode_accumulate(ws.decode[c], v, common, step);
            for (int r = first; r < last; ++r) {
              if (ws.visible[r] > common) {
                amx_decode_accumulate_row(ws.decode[c], r - first, ws.w.data() + r * kTile, v,
                                          common, ws.visible[r]);
              }
            }
          }
        }
        pf.drain();
      }
      amx_end();
      for (int h = 0; h < HK; ++h) {
        for (int c = 0; c < chunks; ++c) {
          amx_decode_result(heads[h].decode[c], heads[h].acc.data() + size_t(c) * chunk_rows * D);
        }
        heads[h].path = Path::kFma;  // the item is done; the next task chooses again
      }
    } else {
      (void)item, (void)next, (void)first_prefetched, (void)heads, (void)pf;
    }
  }
