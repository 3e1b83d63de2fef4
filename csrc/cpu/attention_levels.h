// The CPU attention kernel's levels (cpu/isa.h): the entry point each level's object defines,
// and every header the kernel source needs, included here so that the per-level files can enable
// the level's instructions after them (see cpu/vec.h for why no library code may follow the
// pragma).
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <type_traits>
#include <vector>

#include "attention_checks.h"
#include "cpu/cpu_types.h"
#include "pagedspec/attention.h"
#include "pagedspec/attention_plan.h"

#define PAGEDSPEC_DECLARE_CPU_ATTENTION(NS)                                                     \
  namespace pagedspec::NS {                                                                     \
  /* Runs one validated call through `plan` (workspace: its partial rows, or null). */          \
  void run_planned_attention(const char* op, at::Tensor& out, const at::Tensor& query,          \
                             const at::Tensor& key_cache, const at::Tensor& value_cache,        \
                             const at::Tensor& block_tables, const at::Tensor& seq_lens,        \
                             const at::Tensor& cu_seqlens_q, double scale,                      \
                             const c10::optional<at::Tensor>& lse,                              \
                             const c10::optional<at::Tensor>& attn_mass,                        \
                             const AttentionArgs& args, const PlanView& plan, float* workspace); \
  }

PAGEDSPEC_DECLARE_CPU_ATTENTION(cpu_baseline)
PAGEDSPEC_DECLARE_CPU_ATTENTION(cpu_avx2)
PAGEDSPEC_DECLARE_CPU_ATTENTION(cpu_avx512)
