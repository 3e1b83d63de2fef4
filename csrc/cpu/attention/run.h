// run_cpu, a planned call on the CPU: the plan's items as tasks (plan_tasks), the threads' loop
// over them with their kept workspaces, then the split reduction and the attn_mass pass.
// A part of cpu/attention_impl.h, included only there, inside its namespaces.
#ifndef PAGEDSPEC_CPU_ATTENTION_PARTS
#error "a part of cpu/attention_impl.h, included only there: include that instead"
#endif

// The plan's work items as CPU tasks: one per item for all its KV heads (attend_item), or, where
// there are fewer items than twice the threads, per item and range of heads.
template <typename QT, typename CacheT>
std::vector<Task> plan_tasks(const PagedAttentionParams<QT, CacheT>& p, const PlanView& plan) {
  const int G = p.group_size();
  const int P = plan.partition_size();
  const int64_t wanted = 2 * int64_t(at::get_num_threads());
  const int64_t ranges = std::clamp<int64_t>((wanted + plan.num_items() - 1) /
                                                 std::max(plan.num_items(), 1),
                                             1, p.num_kv_heads);
  const int heads_per_task = int((p.num_kv_heads + ranges - 1) / ranges);
  std::vector<Task> tasks;
  tasks.reserve(size_t(plan.num_items()) * ranges);
  for (int i = 0; i < plan.num_items(); ++i) {
    const PlanItem item = plan.item(i);
    const int q_len = p.cu_seqlens_q[item.seq + 1] - p.cu_seqlens_q[item.seq];
    const int seq_len = p.seq_lens[item.seq];
    const bool split = plan.parts(item.seq) > 1;
    const int begin = split ? item.partition * P : 0;
    const int end = split ? std::min(seq_len, begin + P) : seq_len;
    for (int kv_head = 0; kv_head < p.num_kv_heads; kv_head += heads_per_task) {
      tasks.push_back(Task{item.seq, kv_head, std::min(heads_per_task, p.num_kv_heads - kv_head),
                           item.row0, std::min(kMaxRows, q_len * G - item.row0), begin, end,
                           item.partition});
    }
  }
  return tasks;
}

template <typename QT, typename CacheT, CacheFormat F>
void run_cpu(PagedAttentionParams<QT, CacheT>& p, const AttentionArgs& args, const PlanView& plan,
             float* workspace, const at::Tensor& query, const CpuConfig& config) {
  CpuPagedAttention<QT, CacheT, F> kernel(p, config);
  const int64_t R = plan.field(kPlanFieldPartialRows);
  p.part_acc = workspace;
  p.part_max = workspace == nullptr ? nullptr : workspace + R * p.num_heads * p.head_size;
  p.part_sum = workspace == nullptr ? nullptr : p.part_max + R * p.num_heads;

  // attn_mass needs each row's final softmax state.
  at::Tensor row_state;
  if (p.attn_mass != nullptr) {
    row_state = at::empty({args.num_tokens, args.num_heads, 2}, query.options().dtype(at::kFloat));
    p.row_state = row_state.data_ptr<float>();
  }

  const std::vector<Task> tasks = plan_tasks(p, plan);
  using Kernel = CpuPagedAttention<QT, CacheT, F>;
  at::parallel_for(0, int64_t(tasks.size()), 1, [&](int64_t begin, int64_t end) {
    // One workspace per KV head of the widest task so far, kept by the thread across calls:
    // allocating and zeroing them per call (36 KB a head at D = 128) cost 3.5 us of a 13 us
    // decode call over 16 positions, 6% of one over 256 (SPR-VM, 1 thread).
    static thread_local std::vector<typename Kernel::Workspace> heads;
    if (!heads.empty() && heads[0].head_size != p.head_size) heads.clear();
    TilePrefetch pf;
    for (int64_t i = begin; i < end; ++i) {
      const Task& task = tasks[i];
      while (int(heads.size()) < task.num_heads) heads.emplace_back(p.head_size);
      kernel.attend_item(task, i + 1 < end ? &tasks[i + 1] : nullptr, i > begin, heads, pf);
      for (int h = 0; h < task.num_heads; ++h) {
        const Task head = Kernel::with_head(task, task.kv_head + h);
        if (plan.parts(task.seq) > 1) {
          kernel.write_partial(head, heads[h], plan);
        } else {
          kernel.write_final(head, heads[h]);
        }
      }
    }
  });

  if (R > 0) {
    // Reduction over the (query token, head) rows of split sequences.
    std::vector<int> split_tokens, token_seq;
    for (int seq = 0; seq < p.num_seqs; ++seq) {
      if (plan.parts(seq) <= 1) continue;
      for (int t = p.cu_seqlens_q[seq]; t < p.cu_seqlens_q[seq + 1]; ++t) {
        split_tokens.push_back(t);
        token_seq.push_back(seq);
      }
    }
    const int64_t rows = int64_t(split_tokens.size()) * p.num_heads;
    at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
      std::vector<float> acc(p.head_size);
      for (int64_t i = begin; i < end; ++i) {
        const int64_t t = i / p.num_heads;
        kernel.merge_partitions(token_seq[t], split_tokens[t], int(i % p.num_heads), plan,
                                acc.data());
      }
    });
  }

  if (p.attn_mass != nullptr) {
    std::vector<Task> mass_tasks;
    for (int seq = 0; seq < p.num_seqs; ++seq) {
      if (p.cu_seqlens_q[seq + 1] == p.cu_seqlens_q[seq]) continue;
      for (int pos = 0; pos < p.seq_lens[seq]; pos += kMassTile) {
        mass_tasks.push_back(
            Task{seq, 0, 0, 0, 0, pos, std::min(p.seq_lens[seq], pos + kMassTile), 0});
      }
    }
    kernel.mass_pass(p.row_state, mass_tasks);
  }
}
