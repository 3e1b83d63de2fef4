// Validation for paged_attention_v1 / v2 / paged_attention, shared by the CPU and CUDA launchers so
// both reject the same inputs with the same messages. Checks on the contents of the index tensors
// (need a device-to-host copy on CUDA) are in check_attention_indices, which the CPU launcher
// always runs and the CUDA launcher runs only with PAGEDSPEC_DEBUG=1.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Optional.h>

#include <cmath>
#include <string>
#include <utility>
#include <vector>

#include "checks.h"
#include "pagedspec/attention.h"
#include "pagedspec/attention_plan.h"

namespace pagedspec {

// Head sizes the kernels are built for (the CUDA kernels are specialized on them): the one list,
// used by the checks, their message, the CUDA dispatch and build_info().
constexpr int kAttentionHeadSizes[] = {64, 80, 96, 112, 128, 256};

inline bool attention_head_size_supported(int64_t head_size) {
  for (int d : kAttentionHeadSizes) {
    if (d == head_size) return true;
  }
  return false;
}

// "{64, 80, 96, 112, 128, 256}", for messages.
inline std::string attention_head_sizes_text() {
  std::string text = "{";
  for (int d : kAttentionHeadSizes) text += (text.size() > 1 ? ", " : "") + std::to_string(d);
  return text + "}";
}

// The elements of a 3-D tensor with a unit last stride (out) never share memory: after ordering
// the two outer dimensions by stride, each stride covers the extent of the dimensions inside it.
// (at::has_internal_overlap answers "too hard" for most strided views.)
inline bool rows_overlap(const at::Tensor& t) {
  int64_t stride[2] = {t.stride(0), t.stride(1)};
  int64_t size[2] = {t.size(0), t.size(1)};
  if (stride[0] < stride[1] || (stride[0] == stride[1] && size[0] < size[1])) {
    std::swap(stride[0], stride[1]);
    std::swap(size[0], size[1]);
  }
  const int64_t inner = t.size(2);  // extent of the contiguous last dimension
  const bool inner_ok = size[1] <= 1 || stride[1] >= inner;
  const bool outer_ok = size[0] <= 1 || stride[0] >= (size[1] <= 1 ? inner : stride[1] * size[1]);
  return !(inner_ok && outer_ok);
}

// Block sizes: a power of two up to 1024 (the kernels split positions with shifts and masks).
inline bool attention_block_size_supported(int64_t block_size) {
  return block_size >= 1 && block_size <= 1024 && (block_size & (block_size - 1)) == 0;
}

// The largest softmax scale: float32 max / log2(e), so that scale x log2(e) is a finite float32.
constexpr double kMaxAttentionScale = 3.4028234663852886e38 / 1.4426950408889634;

// Validated shapes and formats of one call.
struct AttentionArgs {
  CacheFormat format;
  ScaleRef k_scale;
  ScaleRef v_scale;
  int64_t num_tokens;
  int64_t num_seqs;
  int64_t num_heads;
  int64_t num_kv_heads;
  int64_t head_size;
  int64_t num_blocks;
  int64_t block_size;
  int64_t max_blocks_per_seq;
  int64_t max_q_len;
  int64_t cache_block_stride = 0;  // key_cache.stride(0) (= value_cache's), elements

  // Bound on q_len for sizing launches: the caller's max_q_len, but never above num_tokens.
  int64_t launch_max_q_len() const { return std::min(max_q_len, num_tokens); }
  int block_shift() const {
    int shift = 0;
    while ((int64_t(1) << shift) < block_size) ++shift;
    return shift;
  }
  // Longest context the block table can describe: the host-side bound the CUDA grid launches
  // (v2, the dispatcher, attn_mass) size by, since the real seq_lens live on the device. Their
  // scratch is num_tokens x max_partitions() partial rows, so tables padded far past the real
  // lengths cost memory there (paged_attention_run sizes by the plan instead).
  int64_t max_context() const { return max_blocks_per_seq * block_size; }
  int64_t max_partitions() const {
    return std::max<int64_t>(1, (max_context() + kPartitionSize - 1) / kPartitionSize);
  }
};

// Shapes, dtypes, devices and layouts. `allow_float32`: float32 queries are a CPU-only feature.
inline AttentionArgs check_attention(const char* op, const at::Tensor& out,
                                     const at::Tensor& query, const at::Tensor& key_cache,
                                     const at::Tensor& value_cache, const at::Tensor& block_tables,
                                     const at::Tensor& seq_lens, const at::Tensor& cu_seqlens_q,
                                     int64_t max_q_len, double scale,
                                     const c10::optional<at::Tensor>& k_scale,
                                     const c10::optional<at::Tensor>& v_scale,
                                     const c10::optional<at::Tensor>& lse,
                                     const c10::optional<at::Tensor>& attn_mass,
                                     bool allow_float32) {
  if (allow_float32) {
    check_dtype(op, "query", query, {at::kHalf, at::kBFloat16, at::kFloat});
  } else {
    check_dtype(op, "query", query, {at::kHalf, at::kBFloat16});
  }
  check_dim(op, "query", query, 3);
  TORCH_CHECK(query.stride(2) == 1, "pagedspec.", op,
              ": query must be contiguous in the last (head_size) dimension, got strides ",
              query.strides());
  check_same_dtype(op, "out", out, "query", query);
  check_shape(op, "out", out, query.sizes());
  TORCH_CHECK(out.stride(2) == 1, "pagedspec.", op,
              ": out must be contiguous in the last (head_size) dimension, got strides ",
              out.strides());

  const int64_t cache_block_stride = check_cache_pair(op, key_cache, value_cache);
  const CacheFormat format = cache_format(op, "key_cache", key_cache);
  if (format == CacheFormat::kNative) {
    TORCH_CHECK(key_cache.scalar_type() == query.scalar_type(), "pagedspec.", op,
                ": key_cache must have query's dtype (", query.scalar_type(),
                ") or an FP8 dtype (Float8_e4m3fn, Float8_e5m2), got ", key_cache.scalar_type());
  }

  const int64_t num_tokens = query.size(0);
  const int64_t num_heads = query.size(1);
  const int64_t head_size = query.size(2);
  const int64_t num_blocks = key_cache.size(0);
  const int64_t block_size = key_cache.size(1);
  const int64_t num_kv_heads = key_cache.size(2);
  check_size(op, "key_cache", key_cache, 3, head_size, "head_size of query");
  TORCH_CHECK(attention_head_size_supported(head_size), "pagedspec.", op,
              ": query.size(2) (head_size) must be one of ", attention_head_sizes_text(), ", got ",
              head_size);
  TORCH_CHECK(attention_block_size_supported(block_size), "pagedspec.", op,
              ": key_cache.size(1) (block_size) must be a power of two in [1, 1024], got ",
              block_size);
  TORCH_CHECK(num_kv_heads >= 1 && num_heads % num_kv_heads == 0, "pagedspec.", op,
              ": query.size(1) (num_heads = ", num_heads,
              ") must be a multiple of key_cache.size(2) (num_kv_heads), got num_kv_heads = ",
              num_kv_heads);

  check_dtype(op, "block_tables", block_tables, {at::kInt});
  check_dim(op, "block_tables", block_tables, 2);
  check_contiguous(op, "block_tables", block_tables);
  check_dtype(op, "seq_lens", seq_lens, {at::kInt});
  check_dim(op, "seq_lens", seq_lens, 1);
  check_contiguous(op, "seq_lens", seq_lens);
  const int64_t num_seqs = seq_lens.size(0);
  check_size(op, "block_tables", block_tables, 0, num_seqs, "num_seqs of seq_lens");
  check_dtype(op, "cu_seqlens_q", cu_seqlens_q, {at::kInt});
  check_dim(op, "cu_seqlens_q", cu_seqlens_q, 1);
  check_contiguous(op, "cu_seqlens_q", cu_seqlens_q);
  check_size(op, "cu_seqlens_q", cu_seqlens_q, 0, num_seqs + 1, "num_seqs + 1");
  TORCH_CHECK(max_q_len >= 0, "pagedspec.", op, ": max_q_len must be >= 0, got ", max_q_len);
  TORCH_CHECK(num_tokens == 0 || max_q_len >= 1, "pagedspec.", op,
              ": max_q_len must be >= 1 when there are query tokens, got ", max_q_len);
  TORCH_CHECK(num_tokens < (int64_t(1) << 31) && num_blocks * block_size < (int64_t(1) << 31),
              "pagedspec.", op, ": num_tokens and num_blocks * block_size must fit in int32, got ",
              num_tokens, " and ", num_blocks * block_size);
  // The kernels index heads and (token, head) rows in int32.
  TORCH_CHECK(num_tokens * num_heads < (int64_t(1) << 31), "pagedspec.", op,
              ": num_tokens x num_heads must fit in int32, got ", num_tokens, " x ", num_heads);
  // The kernels scale logits by scale x log2(e) in float32 (the log2 domain of their softmax):
  // a scale whose factor is not a finite float32 would turn every logit into inf or NaN.
  TORCH_CHECK(std::isfinite(scale) && scale > 0.0, "pagedspec.", op,
              ": scale must be finite and > 0, got ", scale);
  TORCH_CHECK(scale <= kMaxAttentionScale, "pagedspec.", op, ": scale must be at most ",
              kMaxAttentionScale,
              " (float32 max / log2(e): logits are scaled by scale x log2(e) in float32), got ",
              scale);
  TORCH_CHECK(!rows_overlap(out), "pagedspec.", op,
              ": out must not overlap itself in memory (each (token, head) row is written "
              "once), got sizes ", out.sizes(), " and strides ", out.strides());

  if (lse.has_value()) {
    check_dtype(op, "lse", *lse, {at::kFloat});
    check_shape(op, "lse", *lse, {num_tokens, num_heads});
    check_contiguous(op, "lse", *lse);
  }
  if (attn_mass.has_value()) {
    check_dtype(op, "attn_mass", *attn_mass, {at::kFloat});
    check_shape(op, "attn_mass", *attn_mass, {num_blocks * block_size});
    check_contiguous(op, "attn_mass", *attn_mass);
  }

  for (const auto& [name, t] : {std::pair<const char*, const at::Tensor*>{"out", &out},
                                {"key_cache", &key_cache},
                                {"value_cache", &value_cache},
                                {"block_tables", &block_tables},
                                {"seq_lens", &seq_lens},
                                {"cu_seqlens_q", &cu_seqlens_q}}) {
    check_same_device(op, name, *t, "query", query);
  }
  if (lse.has_value()) check_same_device(op, "lse", *lse, "query", query);
  if (attn_mass.has_value()) check_same_device(op, "attn_mass", *attn_mass, "query", query);

  // out is written while the inputs are read (and the attn_mass pass re-reads query after out is
  // written), so it may share memory with nothing but itself.
  const std::pair<const char*, const at::Tensor*> read_or_written[] = {
      {"query", &query}, {"key_cache", &key_cache}, {"value_cache", &value_cache},
      {"lse", lse.has_value() ? &*lse : nullptr},
      {"attn_mass", attn_mass.has_value() ? &*attn_mass : nullptr}};
  for (const auto& [name, t] : read_or_written) {
    if (t == nullptr) continue;
    TORCH_CHECK(!may_share_memory(out, *t), "pagedspec.", op,
                ": out must not share memory with ", name, ", got overlapping tensors");
  }
  if (lse.has_value() && attn_mass.has_value()) {
    TORCH_CHECK(!may_share_memory(*lse, *attn_mass), "pagedspec.", op, ": lse must not share memory with attn_mass, got overlapping "
                "tensors");
  }

  AttentionArgs args{format,     ScaleRef{nullptr, false}, ScaleRef{nullptr, false},
                     num_tokens, num_seqs,     num_heads,    num_kv_heads,
                     head_size,  num_blocks,   block_size,   block_tables.size(1),
                     max_q_len,  cache_block_stride};
  if (format != CacheFormat::kNative) {
    args.k_scale = make_scale_ref(op, "k_scale", k_scale, num_kv_heads, query.device());
    args.v_scale = make_scale_ref(op, "v_scale", v_scale, num_kv_heads, query.device());
  }
  return args;
}

// cu_seqlens_q never decreases (checked over the whole tensor first: a decreasing step is a
// cu_seqlens_q error even when it also makes some q_len look too long), and every sequence's KV
// length holds its query tokens. Host memory; shared by the attention ops and the planner.
inline void check_query_ranges(const char* op, int64_t num_seqs, const int* lens, const int* cu) {
  for (int64_t i = 0; i < num_seqs; ++i) {
    TORCH_CHECK(cu[i + 1] >= cu[i], "pagedspec.", op, ": cu_seqlens_q must be non-decreasing, got ",
                "cu_seqlens_q[", i, "] = ", cu[i], " > cu_seqlens_q[", i + 1, "] = ", cu[i + 1]);
  }
  for (int64_t i = 0; i < num_seqs; ++i) {
    TORCH_CHECK(lens[i] >= cu[i + 1] - cu[i], "pagedspec.", op, ": seq_lens[", i,
                "] must be >= its q_len (the query tokens are in the cache), got seq_len = ",
                lens[i], ", q_len = ", cu[i + 1] - cu[i]);
  }
}

// Host-side checks of the index contents; the tensors must be on the CPU. cu_seqlens_q starts at
// 0, never decreases and ends at num_tokens; every q_len <= max_q_len and <= seq_len; seq_len
// fits the block table; every block a sequence uses is a valid block id.
inline void check_attention_indices(const char* op, const AttentionArgs& args,
                                    const at::Tensor& block_tables, const at::Tensor& seq_lens,
                                    const at::Tensor& cu_seqlens_q) {
  const int* tables = block_tables.const_data_ptr<int>();
  const int* lens = seq_lens.const_data_ptr<int>();
  const int* cu = cu_seqlens_q.const_data_ptr<int>();
  TORCH_CHECK(cu[0] == 0, "pagedspec.", op, ": cu_seqlens_q[0] must be 0, got ", cu[0]);
  TORCH_CHECK(cu[args.num_seqs] == args.num_tokens, "pagedspec.", op, ": cu_seqlens_q[",
              args.num_seqs, "] must equal num_tokens (query.size(0) = ", args.num_tokens,
              "), got ", cu[args.num_seqs]);
  check_query_ranges(op, args.num_seqs, lens, cu);
  for (int64_t i = 0; i < args.num_seqs; ++i) {
    const int64_t q_len = int64_t(cu[i + 1]) - cu[i];
    TORCH_CHECK(q_len <= args.max_q_len, "pagedspec.", op, ": max_q_len (", args.max_q_len,
                ") must bound every q_len, got q_len = ", q_len, " for sequence ", i);
    const int64_t seq_len = lens[i];
    TORCH_CHECK(seq_len <= args.max_context(), "pagedspec.", op, ": seq_lens[", i,
                "] must be <= block_tables.size(1) * block_size = ", args.max_context(),
                " (beyond the block table), got ", seq_len);
    const int64_t used = (seq_len + args.block_size - 1) / args.block_size;
    for (int64_t b = 0; b < used; ++b) {
      const int block = tables[i * args.max_blocks_per_seq + b];
      TORCH_CHECK(block >= 0 && block < args.num_blocks, "pagedspec.", op, ": block_tables[", i,
                  ", ", b, "] must be a block id in [0, ", args.num_blocks, "), got ", block);
    }
  }
}

// paged_attention_run's plan and workspace: dtypes, shapes, device (no contents). Returns the
// workspace's capacity in partial rows.
inline int64_t check_plan_tensors(const char* op, const AttentionArgs& args, const at::Tensor& plan,
                                  const at::Tensor& workspace, const at::Tensor& out,
                                  const at::Tensor& query, const at::Tensor& key_cache,
                                  const at::Tensor& value_cache,
                                  const c10::optional<at::Tensor>& lse,
                                  const c10::optional<at::Tensor>& attn_mass) {
  check_dtype(op, "plan", plan, {at::kInt});
  check_dim(op, "plan", plan, 1);
  check_contiguous(op, "plan", plan);
  check_same_device(op, "plan", plan, "query", query);
  const int64_t fixed = plan_length(args.num_seqs, 0);
  TORCH_CHECK(plan.numel() >= fixed && (plan.numel() - fixed) % 3 == 0, "pagedspec.", op,
              ": plan must have ", fixed, " + 3 x capacity elements for ", args.num_seqs,
              " sequences (from paged_attention_plan), got ", plan.numel());
  check_dtype(op, "workspace", workspace, {at::kFloat});
  check_dim(op, "workspace", workspace, 1);
  check_contiguous(op, "workspace", workspace);
  check_same_device(op, "workspace", workspace, "query", query);
  const std::pair<const char*, const at::Tensor*> others[] = {
      {"out", &out}, {"query", &query}, {"key_cache", &key_cache}, {"value_cache", &value_cache},
      {"plan", &plan}, {"lse", lse.has_value() ? &*lse : nullptr},
      {"attn_mass", attn_mass.has_value() ? &*attn_mass : nullptr}};
  for (const auto& [name, t] : others) {
    TORCH_CHECK(t == nullptr || !may_share_memory(workspace, *t), "pagedspec.", op,
                ": workspace must not share memory with ", name, ", got overlapping tensors");
  }
  return workspace.numel() / workspace_floats_per_row(args.num_heads, args.head_size);
}

// A plan's contents against the call (host memory): made for these lengths and this backend,
// every (sequence, row chunk) covered once per partition it needs, the workspace big enough.
inline void check_plan_contents(const char* op, const AttentionArgs& args, const int32_t* data,
                                int64_t plan_numel, const int* seq_lens, const int* cu,
                                int64_t workspace_rows, int rows_per_item) {
  const PlanView plan{data};
  const int64_t B = args.num_seqs;
  const int64_t capacity = (plan_numel - plan_length(B, 0)) / 3;
  auto fail = [&](const std::string& what) {
    TORCH_CHECK(false, "pagedspec.", op, ": plan ", what,
                " (make it with paged_attention_plan for this step's seq_lens and "
                "cu_seqlens_q, on this device)");
  };
  if (plan.field(kPlanFieldMagic) != kPlanMagic) fail("is not a plan (bad header)");
  if (plan.num_seqs() != B) {
    fail("was made for " + std::to_string(plan.num_seqs()) + " sequences, got " +
         std::to_string(B));
  }
  if (plan.field(kPlanFieldNumTokens) != args.num_tokens) {
    fail("was made for " + std::to_string(plan.field(kPlanFieldNumTokens)) +
         " query tokens, got " + std::to_string(args.num_tokens));
  }
  if (plan.field(kPlanFieldRowsPerItem) != rows_per_item) {
    fail("was made for another device type (" + std::to_string(plan.field(kPlanFieldRowsPerItem)) +
         " query rows per item, this backend uses " + std::to_string(rows_per_item) + ")");
  }
  const int P = plan.partition_size();
  const int64_t rows = plan.field(kPlanFieldPartialRows);
  if (P < 1 || plan.num_items() < 0 || plan.num_items() > capacity ||
      plan.field(kPlanFieldCapacity) != capacity || rows < 0) {
    fail("header is inconsistent");
  }
  if (rows > workspace_rows) {
    TORCH_CHECK(false, "pagedspec.", op, ": workspace must hold the plan's ", rows,
                " partial rows (", rows * workspace_floats_per_row(args.num_heads, args.head_size),
                " floats), got ", workspace_rows, " rows");
  }
  const int G = static_cast<int>(args.num_heads / args.num_kv_heads);
  std::vector<int64_t> first_chunk(B + 1, 0);  // index of each sequence's first row chunk
  for (int64_t i = 0; i < B; ++i) {
    const int q_len = cu[i + 1] - cu[i];
    const int parts = plan.parts(int(i));
    const int64_t base = plan.partial_base(int(i));
    const bool ok = parts == 1
        ? base == -1
        : parts == num_partitions_of(seq_lens[i], P) && (q_len == 0 ? base == -1 : base >= 0 &&
                                                          base + int64_t(q_len) * parts <= rows);
    if (!ok) fail("does not match sequence " + std::to_string(i) + "'s length or query tokens");
    first_chunk[i + 1] = first_chunk[i] + (int64_t(q_len) * G + rows_per_item - 1) / rows_per_item;
  }
  std::vector<int64_t> seen(first_chunk[B], 0);  // partitions covered per row chunk
  for (int n = 0; n < plan.num_items(); ++n) {
    const PlanItem item = plan.item(n);
    if (item.seq < 0 || item.seq >= B) fail("item " + std::to_string(n) + " names no sequence");
    const int q_len = cu[item.seq + 1] - cu[item.seq];
    if (item.row0 < 0 || item.row0 % rows_per_item != 0 || item.row0 >= q_len * G ||
        item.partition < 0 || item.partition >= plan.parts(item.seq)) {
      fail("item " + std::to_string(n) + " is out of range");
    }
    const int64_t chunk = first_chunk[item.seq] + item.row0 / rows_per_item;
    if (seen[chunk] != item.partition) {
      fail("item " + std::to_string(n) + " is out of order or repeated");
    }
    ++seen[chunk];
  }
  for (int64_t i = 0; i < B; ++i) {
    const int q_len = cu[i + 1] - cu[i];
    for (int row0 = 0; row0 < q_len * G; row0 += rows_per_item) {
      const int needed = partitions_needed(seq_lens[i], q_len, G, rows_per_item, row0,
                                           plan.parts(int(i)), P);
      if (seen[first_chunk[i] + row0 / rows_per_item] != needed) {
        fail("does not cover sequence " + std::to_string(i) + "'s rows " + std::to_string(row0) +
             ".. (" + std::to_string(needed) + " partitions needed)");
      }
    }
  }
}

// Kernel parameters from validated tensors, for the CPU and CUDA launchers alike. QT / CacheT are
// the backend's scalar types (at::Half on CPU, __half on CUDA): the tensors' bits are the same.
template <typename QT, typename CacheT>
PagedAttentionParams<QT, CacheT> make_attention_params(
    const at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
    const at::Tensor& value_cache, const at::Tensor& block_tables, const at::Tensor& seq_lens,
    const at::Tensor& cu_seqlens_q, double scale, const c10::optional<at::Tensor>& lse,
    const c10::optional<at::Tensor>& attn_mass, const AttentionArgs& args) {
  PagedAttentionParams<QT, CacheT> p{};
  p.out = static_cast<QT*>(out.data_ptr());
  p.query = static_cast<const QT*>(query.const_data_ptr());
  p.key_cache = static_cast<const CacheT*>(key_cache.const_data_ptr());
  p.value_cache = static_cast<const CacheT*>(value_cache.const_data_ptr());
  p.block_tables = block_tables.const_data_ptr<int>();
  p.seq_lens = seq_lens.const_data_ptr<int>();
  p.cu_seqlens_q = cu_seqlens_q.const_data_ptr<int>();
  p.k_scale = args.k_scale;
  p.v_scale = args.v_scale;
  p.lse = lse.has_value() ? lse->data_ptr<float>() : nullptr;
  p.attn_mass = attn_mass.has_value() ? attn_mass->data_ptr<float>() : nullptr;
  p.scale = static_cast<float>(scale);
  p.q_token_stride = query.stride(0);
  p.q_head_stride = query.stride(1);
  p.out_token_stride = out.stride(0);
  p.out_head_stride = out.stride(1);
  p.num_blocks = args.num_blocks;
  p.cache_block_stride = args.cache_block_stride;
  p.num_tokens = static_cast<int>(args.num_tokens);
  p.num_seqs = static_cast<int>(args.num_seqs);
  p.num_heads = static_cast<int>(args.num_heads);
  p.num_kv_heads = static_cast<int>(args.num_kv_heads);
  p.head_size = static_cast<int>(args.head_size);
  p.block_size = static_cast<int>(args.block_size);
  p.block_shift = args.block_shift();
  p.max_blocks_per_seq = static_cast<int>(args.max_blocks_per_seq);
  p.max_q_len = static_cast<int>(args.launch_max_q_len());
  p.max_partitions = 1;
  return p;
}

#ifdef PAGEDSPEC_WITH_CUDA
// Attention CTAs that run at once on a CUDA device (SMs x resident CTAs per SM), for the planner;
// device_index -1 is the current device. Defined in cuda/attention.cu.
int64_t cuda_attention_slots(int device_index);
#endif
// The CUDA planner splits until the tasks fill this many waves of cuda_attention_slots (the v1
// dispatcher's rule: with fewer waves, the last one leaves SMs idle).
constexpr int kCudaPlanWaves = 4;

// Which kernel an entry point runs: v1, v2, or the backend's dispatcher rule.
enum class Variant { kV1, kV2, kAuto };

}  // namespace pagedspec

// Defines an op entry point NAME with the attention schema's signature that calls
// IMPL(OP, VARIANT, out, query, ...): the three ops share one implementation per backend.
#define PAGEDSPEC_ATTENTION_ENTRY(NAME, IMPL, OP, VARIANT)                                      \
  void NAME(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,              \
            const at::Tensor& value_cache, const at::Tensor& block_tables,                      \
            const at::Tensor& seq_lens, const at::Tensor& cu_seqlens_q, int64_t max_q_len,      \
            double scale, const c10::optional<at::Tensor>& k_scale,                             \
            const c10::optional<at::Tensor>& v_scale, const c10::optional<at::Tensor>& lse,     \
            const c10::optional<at::Tensor>& attn_mass) {                                       \
    IMPL(OP, VARIANT, out, query, key_cache, value_cache, block_tables, seq_lens, cu_seqlens_q, \
         max_q_len, scale, k_scale, v_scale, lse, attn_mass);                                   \
  }
