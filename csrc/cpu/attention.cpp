// CPU launchers for paged_attention_v1 / v2 / paged_attention, paged_attention_plan and
// paged_attention_run: validation, the split-KV plan (v1: never split; v2: 512-position
// partitions; the dispatcher and paged_attention_plan: the planner's choice), then the kernel of
// the ISA level in use (cpu/isa.h; the kernel itself is cpu/attention_impl.h, built per level).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <limits>
#include <vector>

#include "attention_checks.h"
#include "cpu/kernel_levels.h"
#include "pagedspec/attention.h"
#include "pagedspec/attention_plan.h"

namespace pagedspec {
namespace {

constexpr int kMaxRows = kCpuAttentionRows;  // query rows (tokens x heads of a group) per task

// The CPU planner's inputs: query-row chunks of kMaxRows, and every context of at least 512
// split whatever the batch, into partitions of up to 1024 positions that leave at least
// kCpuPlanWaves tasks per thread (choose_partition; bench/NOTES.md measured splitting faster
// than unsplit tasks at batch 1 to 16 and 2k-16k contexts on Sapphire Rapids, and 1024 faster
// than 256 once tasks were plentiful).
PlanRequest cpu_plan_request(int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
                             const int* seq_lens, const int* cu_seqlens_q, int forced_partition) {
  PlanRequest r{};
  r.seq_lens = seq_lens;
  r.cu_seqlens_q = cu_seqlens_q;
  r.num_seqs = static_cast<int>(num_seqs);
  r.group_size = static_cast<int>(num_heads / num_kv_heads);
  r.num_kv_heads = static_cast<int>(num_kv_heads);
  r.rows_per_item = kMaxRows;
  r.always_split = true;
  r.concurrency = at::get_num_threads();
  r.waves = kCpuPlanWaves;
  r.forced_partition = forced_partition;
  return r;
}

// Runs one validated call through a plan: the caller's (paged_attention_run), or one built here
// from the host-resident lengths, with the kernel of the ISA level in use and the paths the CPU
// configuration allows (resolved once for the call).
void run_planned(const char* op, at::Tensor& out, const at::Tensor& query,
                 const at::Tensor& key_cache, const at::Tensor& value_cache,
                 const at::Tensor& block_tables, const at::Tensor& seq_lens,
                 const at::Tensor& cu_seqlens_q, double scale,
                 const c10::optional<at::Tensor>& lse, const c10::optional<at::Tensor>& attn_mass,
                 const AttentionArgs& args, const PlanView& plan, float* workspace) {
  const CpuConfig config = cpu_config();
  PAGEDSPEC_CPU_CALL_AT(config.isa, run_planned_attention, op, out, query, key_cache,
                        value_cache, block_tables, seq_lens, cu_seqlens_q, scale, lse, attn_mass,
                        args, plan, workspace, config);
}

void paged_attention_cpu_impl(const char* op, Variant variant, at::Tensor& out,
                              const at::Tensor& query, const at::Tensor& key_cache,
                              const at::Tensor& value_cache, const at::Tensor& block_tables,
                              const at::Tensor& seq_lens, const at::Tensor& cu_seqlens_q,
                              int64_t max_q_len, double scale,
                              const c10::optional<at::Tensor>& k_scale,
                              const c10::optional<at::Tensor>& v_scale,
                              const c10::optional<at::Tensor>& lse,
                              const c10::optional<at::Tensor>& attn_mass) {
  const AttentionArgs args =
      check_attention(op, out, query, key_cache, value_cache, block_tables, seq_lens,
                      cu_seqlens_q, max_q_len, scale, k_scale, v_scale, lse, attn_mass,
                      /*allow_float32=*/true);
  check_attention_indices(op, args, block_tables, seq_lens, cu_seqlens_q);
  if (args.num_tokens == 0 || args.num_seqs == 0) return;
  const int forced = variant == Variant::kV1 ? -1 : (variant == Variant::kV2 ? kPartitionSize : 0);
  const PlanRequest request = cpu_plan_request(args.num_seqs, args.num_heads, args.num_kv_heads,
                                               seq_lens.const_data_ptr<int>(),
                                               cu_seqlens_q.const_data_ptr<int>(), forced);
  const int partition = choose_partition(request);
  const int64_t items = plan_shape(request, partition).num_items;
  std::vector<int32_t> plan(plan_length(args.num_seqs, items));
  write_plan(request, partition, items, static_cast<int>(args.num_tokens), plan.data());
  const PlanView view{plan.data()};
  at::Tensor workspace;
  const int64_t rows = view.field(kPlanFieldPartialRows);
  if (rows > 0) {
    workspace = at::empty({rows * workspace_floats_per_row(args.num_heads, args.head_size)},
                          query.options().dtype(at::kFloat));
  }
  run_planned(op, out, query, key_cache, value_cache, block_tables, seq_lens, cu_seqlens_q, scale,
              lse, attn_mass, args, view, rows > 0 ? workspace.data_ptr<float>() : nullptr);
}

// paged_attention_plan: the plan for a step's host-resident lengths, for the CPU or a CUDA device.
at::Tensor paged_attention_plan_cpu(const at::Tensor& seq_lens, const at::Tensor& cu_seqlens_q,
                                    int64_t num_heads, int64_t num_kv_heads, c10::Device device,
                                    int64_t partition_size, int64_t max_items,
                                    int64_t max_partial_rows) {
  const char* op = "paged_attention_plan";
  for (const auto& [name, t] : {std::pair<const char*, const at::Tensor*>{"seq_lens", &seq_lens},
                                {"cu_seqlens_q", &cu_seqlens_q}}) {
    check_dtype(op, name, *t, {at::kInt});
    check_dim(op, name, *t, 1);
    check_contiguous(op, name, *t);
    TORCH_CHECK(t->device().is_cpu(), "pagedspec.", op, ": ", name,
                " must be on the CPU (the plan is made on the host before the step), got ",
                t->device());
  }
  const int64_t B = seq_lens.size(0);
  check_size(op, "cu_seqlens_q", cu_seqlens_q, 0, B + 1, "num_seqs + 1");
  TORCH_CHECK(num_kv_heads >= 1 && num_heads >= 1 && num_heads % num_kv_heads == 0 &&
                  num_heads < (int64_t(1) << 31),
              "pagedspec.", op, ": num_heads must be a positive multiple of num_kv_heads, got ",
              num_heads, " and ", num_kv_heads);
  TORCH_CHECK(device.is_cpu() || device.is_cuda(), "pagedspec.", op,
              ": device must be cpu or cuda, got ", device);
  TORCH_CHECK(partition_size >= -1 && partition_size < (int64_t(1) << 31), "pagedspec.", op,
              ": partition_size must be 0 (choose), -1 (never split) or a positive size, got ",
              partition_size);
  const int* lens = seq_lens.const_data_ptr<int>();
  const int* cu = cu_seqlens_q.const_data_ptr<int>();
  TORCH_CHECK(B == 0 || cu[0] == 0, "pagedspec.", op, ": cu_seqlens_q[0] must be 0, got ", cu[0]);
  check_query_ranges(op, B, lens, cu);
  PlanRequest request = cpu_plan_request(B, num_heads, num_kv_heads, lens, cu,
                                         static_cast<int>(partition_size));
  if (device.is_cuda()) {
#ifdef PAGEDSPEC_WITH_CUDA
    request.rows_per_item = kCudaAttentionRows;
    request.concurrency = cuda_attention_slots(device.has_index() ? device.index() : -1);
    request.waves = kCudaPlanWaves;
    request.always_split = false;
#else
    TORCH_CHECK(false, "pagedspec.", op, ": device is ", device,
                " but this build of pagedspec has no CUDA kernels");
#endif
  }
  request.max_items = max_items;
  request.max_partial_rows = max_partial_rows;
  const int partition = choose_partition(request);
  const PlanShape unsplit = plan_shape(request, std::numeric_limits<int>::max());
  TORCH_CHECK(partition > 0, "pagedspec.", op, ": max_items (", max_items, ") or max_partial_rows (",
              max_partial_rows, ") is too small for this step: ",
              request.forced_partition > 0 ? "the forced partition" : "even an unsplit plan",
              " needs ", request.forced_partition > 0
                  ? plan_shape(request, request.forced_partition).num_items : unsplit.num_items,
              " items");
  const PlanShape shape_of_plan = plan_shape(request, partition);
  const int64_t items = shape_of_plan.num_items;
  const int64_t capacity = max_items > 0 ? max_items : items;
  TORCH_CHECK(capacity < (int64_t(1) << 31) && shape_of_plan.partial_rows < (int64_t(1) << 31),
              "pagedspec.", op, ": the plan's items (", capacity, ") and partial rows (",
              shape_of_plan.partial_rows, ") must fit in int32");
  at::Tensor plan = at::empty({plan_length(B, capacity)}, seq_lens.options());
  write_plan(request, partition, capacity, B == 0 ? 0 : cu[B],
             plan.data_ptr<int32_t>());
  return plan;
}

void paged_attention_run_cpu(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                             const at::Tensor& value_cache, const at::Tensor& block_tables,
                             const at::Tensor& seq_lens, const at::Tensor& cu_seqlens_q,
                             int64_t max_q_len, double scale, const at::Tensor& plan,
                             at::Tensor& workspace, const c10::optional<at::Tensor>& k_scale,
                             const c10::optional<at::Tensor>& v_scale,
                             const c10::optional<at::Tensor>& lse,
                             const c10::optional<at::Tensor>& attn_mass) {
  const char* op = "paged_attention_run";
  const AttentionArgs args =
      check_attention(op, out, query, key_cache, value_cache, block_tables, seq_lens,
                      cu_seqlens_q, max_q_len, scale, k_scale, v_scale, lse, attn_mass,
                      /*allow_float32=*/true);
  check_attention_indices(op, args, block_tables, seq_lens, cu_seqlens_q);
  const int64_t rows =
      check_plan_tensors(op, args, plan, workspace, out, query, key_cache, value_cache, lse,
                         attn_mass);
  check_plan_contents(op, args, plan.const_data_ptr<int32_t>(), plan.numel(),
                      seq_lens.const_data_ptr<int>(), cu_seqlens_q.const_data_ptr<int>(), rows,
                      kMaxRows);
  if (args.num_tokens == 0 || args.num_seqs == 0) return;
  run_planned(op, out, query, key_cache, value_cache, block_tables, seq_lens, cu_seqlens_q, scale,
              lse, attn_mass, args, PlanView{plan.const_data_ptr<int32_t>()},
              workspace.numel() > 0 ? workspace.data_ptr<float>() : nullptr);
}

PAGEDSPEC_ATTENTION_ENTRY(paged_attention_v1_cpu, paged_attention_cpu_impl, "paged_attention_v1",
                          Variant::kV1)
PAGEDSPEC_ATTENTION_ENTRY(paged_attention_v2_cpu, paged_attention_cpu_impl, "paged_attention_v2",
                          Variant::kV2)
PAGEDSPEC_ATTENTION_ENTRY(paged_attention_dispatch_cpu, paged_attention_cpu_impl, "paged_attention",
                          Variant::kAuto)

}  // namespace

TORCH_LIBRARY_IMPL(pagedspec, CPU, m) {
  m.impl("paged_attention_v1", &paged_attention_v1_cpu);
  m.impl("paged_attention_v2", &paged_attention_v2_cpu);
  m.impl("paged_attention", &paged_attention_dispatch_cpu);
  m.impl("paged_attention_plan", &paged_attention_plan_cpu);
  m.impl("paged_attention_run", &paged_attention_run_cpu);
}

// The planner reads host memory whatever the device it plans for; registered for CUDA too so
// that CUDA-resident lengths get its "must be on the CPU" error rather than the dispatcher's.
TORCH_LIBRARY_IMPL(pagedspec, CUDA, m) {
  m.impl("paged_attention_plan", &paged_attention_plan_cpu);
}

}  // namespace pagedspec
