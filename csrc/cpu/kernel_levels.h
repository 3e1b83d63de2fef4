// The CPU kernels built per ISA level (cpu/isa.h): the entry points each level's object
// (cpu/kernels_<level>.cpp) defines, PAGEDSPEC_CPU_CALL to call the level in use, and every
// header the kernel sources need, included here so that the per-level files can enable the
// level's instructions after them (see cpu/vec.h for why no library code may follow the pragma).
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <memory>
#include <optional>
#include <type_traits>
#include <vector>

#include <cstring>

#include "attention_checks.h"
#include "cache_checks.h"
#include "cpu/amx.h"
#include "cpu/cpu_types.h"
#include "cpu/isa.h"
#include "fp8_checks.h"
#include "pagedspec/attention.h"
#include "pagedspec/attention_plan.h"
#include "pagedspec/packed_linear.h"
#include "pagedspec/sampling.h"

#define PAGEDSPEC_DECLARE_CPU_KERNELS(NS)                                                       \
  namespace pagedspec::NS {                                                                     \
  /* Attention: one validated call through `plan` (workspace: its partial rows, or null). */    \
  void run_planned_attention(const char* op, at::Tensor& out, const at::Tensor& query,          \
                             const at::Tensor& key_cache, const at::Tensor& value_cache,        \
                             const at::Tensor& block_tables, const at::Tensor& seq_lens,        \
                             const at::Tensor& cu_seqlens_q, double scale,                      \
                             const c10::optional<at::Tensor>& lse,                              \
                             const c10::optional<at::Tensor>& attn_mass,                        \
                             const AttentionArgs& args, const PlanView& plan, float* workspace, \
                             const CpuConfig& config);                                          \
  void reshape_and_cache(const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache, \
                         at::Tensor& value_cache, const at::Tensor& slot_mapping,               \
                         const ReshapeAndCacheArgs& args);                                      \
  void quantize_fp8(at::Tensor& out, const at::Tensor& input, const Fp8ConvertArgs& args);      \
  void dequantize_fp8(at::Tensor& out, const at::Tensor& input, const Fp8ConvertArgs& args);    \
  /* rejection_sample over every request of validated parameters. */                            \
  void rejection_sample(const RejectionSampleParams& p);                                        \
  /* pagedspec_models::packed_linear; bf16_dot: AVX512-BF16 products for bf16 (avx512 only). */ \
  void packed_linear(const PackedLinearParams& p, bool bf16_dot);                               \
  }

PAGEDSPEC_DECLARE_CPU_KERNELS(cpu_baseline)
PAGEDSPEC_DECLARE_CPU_KERNELS(cpu_avx2)
PAGEDSPEC_DECLARE_CPU_KERNELS(cpu_avx512)

// Calls entry point FN of ISA level ISA; PAGEDSPEC_CPU_CALL, of the level in use
// (cpu_config().isa: the best here, or PAGEDSPEC_CPU_ISA).
#define PAGEDSPEC_CPU_CALL(FN, ...) PAGEDSPEC_CPU_CALL_AT(::pagedspec::cpu_isa(), FN, __VA_ARGS__)
#define PAGEDSPEC_CPU_CALL_AT(ISA, FN, ...)                               \
  [&] {                                                                   \
    switch (ISA) {                                                        \
      case ::pagedspec::CpuIsa::kAvx512:                                  \
        return ::pagedspec::cpu_avx512::FN(__VA_ARGS__);                  \
      case ::pagedspec::CpuIsa::kAvx2:                                    \
        return ::pagedspec::cpu_avx2::FN(__VA_ARGS__);                    \
      default:                                                            \
        return ::pagedspec::cpu_baseline::FN(__VA_ARGS__);                \
    }                                                                     \
  }()
