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

}  // namespace pagedspec
