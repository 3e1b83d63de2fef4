// mass_pass, the attn_mass pass: run after the final softmax states are known, rescoring every
// visible position as attend_tile does, so that calls without attn_mass pay nothing for it.
// Members of CpuPagedAttention, included only by cpu/attention/kernel.h, inside the class body
// at this place in its member order.
#ifndef PAGEDSPEC_CPU_ATTENTION_PARTS
#error "a part of cpu/attention_impl.h, included only there: include that instead"
#endif

  // attn_mass: adds, for every visible position, the sum over all heads and query tokens of
  // exp2(s - max) / sum, the final probability against the row's final state (row_state), with s
  // recomputed exactly as attend_tile() does (so the largest weight is exactly 1 / sum, whatever
  // the logits' magnitude); NaN at every position a row whose softmax is undefined sees.
  // Tasks are (sequence, kMassTile positions) and loop over every KV head and row, so one
  // sequence's mass for a slot is summed inside one task and added once: distinct slots never
  // race, and the add is atomic only because two sequences may share a block (prefix sharing).
  void mass_pass(const float* row_state, const std::vector<Task>& mass_tasks) const {
    const int G = p_.group_size();
    at::parallel_for(0, int64_t(mass_tasks.size()), 1, [&](int64_t begin, int64_t end) {
      Workspace ws(p_.head_size);
      TilePrefetch pf;
      std::vector<float> mass(kMassTile);
      std::vector<float> row_max(kMaxRows), row_inv(kMaxRows);
      for (int64_t i = begin; i < end; ++i) {
        const Task& span = mass_tasks[i];
        const int q_len = p_.cu_seqlens_q[span.seq + 1] - p_.cu_seqlens_q[span.seq];
        const int n_pos = span.pos_end - span.pos_begin;
        std::fill(mass.begin(), mass.begin() + n_pos, 0.0f);
        for (int kv_head = 0; kv_head < p_.num_kv_heads; ++kv_head) {
          ws.kreader.init();
          for (int row0 = 0; row0 < q_len * G; row0 += kMaxRows) {
            const Task task{span.seq, kv_head, 1, row0, std::min(kMaxRows, q_len * G - row0),
                            span.pos_begin, span.pos_end, 0};
            // Scores as attend_tile() computes them (AMX aside).
            enter_path(ws, choose_path(task.num_rows, /*amx=*/false), task.num_rows);
            load_queries(task, ws);
            for (int r = 0; r < task.num_rows; ++r) {
              const int64_t row = int64_t(ws.rows[r].token) * p_.num_heads + ws.rows[r].head;
              const float max = row_state[2 * row], sum = row_state[2 * row + 1];
              // An undefined row: NaN at every position (0 x NaN at a -inf score too).
              const bool undefined = softmax_undefined(max);
              row_max[r] = undefined ? 0.0f : max;
              row_inv[r] = undefined ? quiet_nan() : (sum > 0.0f ? 1.0f / sum : 0.0f);
            }
            const int pos_end = task_pos_end(task);
            for (int start = span.pos_begin; start < pos_end; start += kTile) {
              const int n = std::min(kTile, pos_end - start);
              locate_tile(task, ws, start, n);
              // This head's K rows of the next tile (the scores need no V).
              plan_prefetch(pf, span.seq, start + kTile,
                            std::max(0, std::min(kTile, pos_end - start - kTile)), kv_head, 1,
                            false, n);
              score_tile(task, ws, pf);
              pf.drain();
              for (int r = 0; r < task.num_rows; ++r) {
                const float* w = ws.w.data() + r * kTile;
                float* m = mass.data() + (start - span.pos_begin);
                for (int t = 0; t < ws.visible[r]; ++t) {
                  m[t] += softmax_weight(w[t], row_max[r]) * row_inv[r];
                }
              }
            }
          }
        }
        for (int t = 0; t < n_pos; ++t) {
          std::atomic_ref<float>(p_.attn_mass[p_.slot(span.seq, span.pos_begin + t)])
              .fetch_add(mass[t], std::memory_order_relaxed);
        }
      }
    });
  }
