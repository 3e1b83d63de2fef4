// What a task's rows become after its last tile: write_final (v1: out, lse, row_state),
// write_partial (a split item's partial state), merge_partitions (the split reduction), and the
// finished row the first and last both write (write_row; its empty and undefined forms
// write_empty_row, write_undefined_row).
// Members of CpuPagedAttention, included only by cpu/attention/kernel.h, inside the class body
// at this place in its member order.
#ifndef PAGEDSPEC_CPU_ATTENTION_PARTS
#error "a part of cpu/attention_impl.h, included only there: include that instead"
#endif

  // v1 epilogue: out = acc / sum, lse; NaN for a row whose softmax is undefined (a NaN in its
  // query, or a logit that overflowed to +inf: softmax_undefined); 0 and lse -inf for a row whose
  // state stayed empty (every logit it sees overflowed to -inf: exp2_weights clamps their -inf -
  // -inf to a tiny weight, which must not reach out).
  void write_final(const Task& task, const Workspace& ws) const {
    const int D = p_.head_size;
    for (int r = 0; r < task.num_rows; ++r) {
      const RowInfo& info = ws.rows[r];
      const SoftmaxState& st = ws.state[r];
      const bool undefined = softmax_undefined(st.max) || row_has_nan(query_row(info), D);
      write_row(info.token, info.head, st, undefined, ws.acc.data() + size_t(r) * D,
                v_factor(task.kv_head));
    }
  }

  // A finished row of both epilogues: out = acc * factor / sum, lse and row_state; or an
  // undefined row or an empty one. v1 passes the V factor; the split reduction 1, its partials
  // carrying it already.
  void write_row(int token, int head, const SoftmaxState& st, bool undefined, const float* acc,
                 float factor) const {
    QT* dst = p_.out + int64_t(token) * p_.out_token_stride + int64_t(head) * p_.out_head_stride;
    const int64_t row = int64_t(token) * p_.num_heads + head;
    if (undefined) {
      write_undefined_row(dst, row, st.sum);
      return;
    }
    if (st.is_empty()) {
      write_empty_row(dst, row);
      return;
    }
    const float inv = st.sum > 0.0f ? factor / st.sum : 0.0f;
    for (int d = 0; d < p_.head_size; ++d) dst[d] = ScalarConvert<QT>::from_float(acc[d] * inv);
    if (p_.lse != nullptr) p_.lse[row] = st.lse();
    if (p_.row_state != nullptr) {
      p_.row_state[2 * row] = st.max;
      p_.row_state[2 * row + 1] = st.sum;
    }
  }

  // A row that sees no position with a finite weight: out 0, lse -inf, no attn_mass.
  void write_empty_row(QT* dst, int64_t row) const {
    const QT zero = ScalarConvert<QT>::from_float(0.0f);
    for (int d = 0; d < p_.head_size; ++d) dst[d] = zero;
    if (p_.lse != nullptr) p_.lse[row] = neg_inf();
    if (p_.row_state != nullptr) {
      p_.row_state[2 * row] = neg_inf();
      p_.row_state[2 * row + 1] = 0.0f;
    }
  }

  // A row whose softmax is undefined: out and lse NaN, and a NaN max for the attn_mass pass.
  void write_undefined_row(QT* dst, int64_t row, float sum) const {
    const QT nan = ScalarConvert<QT>::from_float(quiet_nan());
    for (int d = 0; d < p_.head_size; ++d) dst[d] = nan;
    if (p_.lse != nullptr) p_.lse[row] = quiet_nan();
    if (p_.row_state != nullptr) {
      p_.row_state[2 * row] = quiet_nan();
      p_.row_state[2 * row + 1] = sum;
    }
  }

  // Split epilogue: the partition's partial state per row, at its partial row of the plan.
  void write_partial(const Task& task, const Workspace& ws, const PlanView& plan) const {
    const int D = p_.head_size;
    const int first = p_.cu_seqlens_q[task.seq];
    const int parts = plan.parts(task.seq);
    const int64_t base = plan.partial_base(task.seq);
    for (int r = 0; r < task.num_rows; ++r) {
      const RowInfo& info = ws.rows[r];
      const int64_t idx =
          (base + int64_t(info.token - first) * parts + task.partition) * p_.num_heads + info.head;
      // NaN marks a NaN query for merge_partitions (an overflowed logit's +inf max marks itself).
      p_.part_max[idx] = row_has_nan(query_row(info), D) ? quiet_nan() : ws.state[r].max;
      p_.part_sum[idx] = ws.state[r].sum;
      const float* acc = ws.acc.data() + size_t(r) * D;
      float* part = p_.part_acc + idx * D;
      const float factor = v_factor(task.kv_head);   // partials carry the V factor, as on CUDA
#pragma omp simd
      for (int d = 0; d < D; ++d) part[d] = acc[d] * factor;
    }
  }

  // Split reduction for one (query token, head) of a split sequence: folds the partitions the
  // row can see.
  void merge_partitions(int seq, int token, int head, const PlanView& plan, float* acc) const {
    const int D = p_.head_size;
    const int first = p_.cu_seqlens_q[seq];
    const int q_len = p_.cu_seqlens_q[seq + 1] - first;
    const int limit = causal_limit(p_.seq_lens[seq], q_len, token - first);
    const int parts = std::min(plan.parts(seq), limit / plan.partition_size() + 1);
    const int64_t row = plan.partial_base(seq) + int64_t(token - first) * plan.parts(seq);
    SoftmaxState st = SoftmaxState::empty();
    std::fill(acc, acc + D, 0.0f);
    bool undefined = false;  // a partition of an undefined row (write_partial's NaN, or +inf)
    for (int k = 0; k < parts; ++k) {
      const int64_t idx = (row + k) * p_.num_heads + head;
      undefined |= softmax_undefined(p_.part_max[idx]);
      const SoftmaxMerge m = merge_softmax(st, SoftmaxState{p_.part_max[idx], p_.part_sum[idx]});
      const float* part_acc = p_.part_acc + idx * D;
#pragma omp simd
      for (int d = 0; d < D; ++d) acc[d] = acc[d] * m.weight_a + part_acc[d] * m.weight_b;
      st = m.state;
    }
    write_row(token, head, st, undefined, acc, 1.0f);
  }
