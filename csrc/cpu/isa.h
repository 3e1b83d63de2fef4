// The x86 ISA levels the CPU kernels are built for, and the one they run at.
//
// A kernel source is compiled once per level (cpu/kernels_<level>.cpp: the same source after
// `#pragma GCC target`, in its own namespace), and the launcher calls the level the configuration
// names (CpuConfig below): the best the CPU supports, or the one PAGEDSPEC_CPU_ISA forces
// (baseline, avx2, avx512; read at every call, so tests can run each level in turn). Forcing a
// level the CPU lacks is an error.
// The structure allows more levels (ARM NEON / SVE) as more entries.
#pragma once

namespace pagedspec {

enum class CpuIsa { kBaseline = 0, kAvx2 = 1, kAvx512 = 2 };

// What each level requires: baseline any x86-64; avx2 AVX2 + FMA + F16C; avx512 AVX-512
// F/BW/VL/DQ (plus the AVX2 level's features).
const char* cpu_isa_name(CpuIsa isa);
bool cpu_supports(CpuIsa isa);
CpuIsa best_cpu_isa();

// The CPU kernels' configuration, whole: the level they run at and the optional attention paths
// they may take. Parsed in one place (cpu_config) with one grammar from five environment
// variables, each unset (its default), "0" or "1" (PAGEDSPEC_CPU_ISA: a level's name); any other
// value is an error naming the variable and what it accepts. Each op call resolves it once (so
// tests may switch paths between calls) and hands it down; build_info()["cpu"] reports it.
struct CpuConfig {
  // PAGEDSPEC_CPU_ISA: the level to run (an error if the CPU lacks it), else the best here.
  CpuIsa isa;
  // PAGEDSPEC_CPU_AMX=1: the avx512 level's attention with bf16 queries (bf16 or FP8 caches)
  // takes AMX tile multiplies where the CPU has AMX-BF16 and the OS grants the tile state.
  // Opt-in: its P.V multiplies bf16-rounded probabilities (2^-9 relative error per weight),
  // outside the contract's float32-level bound.
  bool amx;
  // ... and among them the decode path (accumulators kept in tile layout), unless
  // PAGEDSPEC_CPU_AMX_DECODE=0 (for comparisons; no opt-in of its own).
  bool amx_decode;
  // The avx512 level's AVX512-BF16 dot-product scores (vdpbf16ps: 32 exact bf16 products per
  // instruction, summed in float32, where an FMA takes 16 float32) for bf16 queries on bf16 or
  // FP8 caches, the tasks the AMX paths leave; their P.V stays on the FMA path (float32
  // probabilities), so the path keeps the contract's bound. On by default where the CPU has
  // AVX512-BF16 and AVX512-VBMI (its FP8 conversion; Zen 4 and every Intel CPU with AVX512-BF16
  // but Cooper Lake): 1.05-1.26x the FMA path on Zen 4, decode and verification, both caches.
  // PAGEDSPEC_CPU_BF16_DOT=0 turns it off.
  bool bf16_dot;
  // Whether the FMA path at `isa` (float32 or fp16 queries, or bf16 ones off the dot and AMX
  // paths) reads an FP8 tile as images of its codes converted once per tile, for tasks of
  // several blocks of rows, rather than converting codes in registers for each block: at avx2
  // (bf16 images through F16C) and at avx512 where the CPU has VBMI (byte lookups; Ice Lake and
  // later, Zen 4); never at baseline. PAGEDSPEC_CPU_FP8_IMAGES=0 turns it off (as an AVX-512 CPU
  // without VBMI runs: Skylake-SP, Cascade Lake).
  bool fp8_images;
  // Not a setting: whether the CPU has AVX512-VBMI (byte permutes: FP8 -> bf16 conversion).
  bool avx512_vbmi;
};

// The configuration now (reads the environment; throws c10::Error on a bad value).
CpuConfig cpu_config();
// The level to run now: cpu_config().isa.
CpuIsa cpu_isa();
// Whether the CPU has the dot path's instructions (AVX512-BF16 and AVX512-VBMI).
bool cpu_bf16_dot_supported();

}  // namespace pagedspec
