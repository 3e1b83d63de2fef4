// The x86 ISA levels the CPU kernels are built for, and the one they run at.
//
// A kernel source is compiled once per level (cpu/kernels_<level>.cpp: the same source after
// `#pragma GCC target`, in its own namespace), and the launcher calls the level cpu_isa() names:
// the best the CPU supports, or the one PAGEDSPEC_CPU_ISA forces (baseline, avx2, avx512; read at
// every call, so tests can run each level in turn). Forcing a level the CPU lacks is an error.
// The structure allows more levels (ARM NEON / SVE) as more entries.
#pragma once

namespace pagedspec {

enum class CpuIsa { kBaseline = 0, kAvx2 = 1, kAvx512 = 2 };

// What each level requires: baseline any x86-64; avx2 AVX2 + FMA + F16C; avx512 AVX-512
// F/BW/VL/DQ (plus the AVX2 level's features).
const char* cpu_isa_name(CpuIsa isa);
bool cpu_supports(CpuIsa isa);
CpuIsa best_cpu_isa();
// The level to run now: PAGEDSPEC_CPU_ISA if set (error if unknown or unsupported), else the best.
CpuIsa cpu_isa();

// The avx512 level's bf16 dot-product path (vdpbf16ps: 32 bf16 products per instruction where an
// FMA takes 16 float32): whether the CPU has it, and whether attention with bf16 queries on a bf16
// or an FP8 cache takes it now, for the tasks the AMX paths leave.
// Opt-in, off by default: its P.V multiplies bf16-rounded probabilities (2^-9 relative error per
// weight), outside the contract's float32-level bound. Where it was measured faster: on AMD (Zen
// 4) for both caches, where a vdpbf16ps issues at the FMA's rate, twice the arithmetic; on Intel
// for FP8 caches only (an Intel core issues it at half the FMA's rate; FP8 caches were 15-20%
// faster on it, their codes becoming bf16 in registers rather than float32).
// PAGEDSPEC_CPU_BF16_DOT=1 turns it on wherever the CPU has the instruction, for both caches
// (read at every call, as PAGEDSPEC_CPU_ISA, so tests can run both paths).
// Supported means AVX512-BF16 and AVX512-VBMI (its FP8 conversion; Zen 4 and every Intel CPU
// with AVX512-BF16 but Cooper Lake have both).
bool cpu_bf16_dot_supported();
bool cpu_bf16_dot();
// Whether the CPU has AVX512-VBMI (byte permutes: the attention's FP8 -> bf16 conversion).
bool cpu_avx512_vbmi();
// Whether the FMA path at `level` (attention with float32 or fp16 queries, or bf16 ones off the
// dot and AMX paths) reads an FP8 tile as images of its codes converted once per tile, for
// tasks of several blocks of rows, rather than converting codes in registers for each
// block: at avx2 (bf16 images through F16C), and at avx512 where the CPU has VBMI (by byte
// lookups; Ice Lake and later, Zen 4); never at baseline. PAGEDSPEC_CPU_FP8_IMAGES=0 turns it
// off (as an AVX-512 CPU without VBMI runs, Skylake-SP, Cascade Lake). Read at every call.
bool cpu_fp8_images(CpuIsa level);

}  // namespace pagedspec
