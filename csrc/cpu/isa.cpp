#include "cpu/isa.h"

#include <c10/util/Exception.h>

#include <cstdlib>
#include <string>

namespace pagedspec {

const char* cpu_isa_name(CpuIsa isa) {
  switch (isa) {
    case CpuIsa::kAvx512: return "avx512";
    case CpuIsa::kAvx2: return "avx2";
    default: return "baseline";
  }
}

bool cpu_supports(CpuIsa isa) {
#if defined(__x86_64__) || defined(__i386__)
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                    __builtin_cpu_supports("f16c");
  switch (isa) {
    case CpuIsa::kAvx512:
      return avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
    case CpuIsa::kAvx2: return avx2;
    default: return true;
  }
#else
  return isa == CpuIsa::kBaseline;
#endif
}

CpuIsa best_cpu_isa() {
  static const CpuIsa best = cpu_supports(CpuIsa::kAvx512) ? CpuIsa::kAvx512
                             : cpu_supports(CpuIsa::kAvx2) ? CpuIsa::kAvx2
                                                           : CpuIsa::kBaseline;
  return best;
}

CpuIsa cpu_isa() {
  const char* forced = std::getenv("PAGEDSPEC_CPU_ISA");
  if (forced == nullptr || *forced == '\0') return best_cpu_isa();
  const std::string name(forced);
  for (CpuIsa isa : {CpuIsa::kBaseline, CpuIsa::kAvx2, CpuIsa::kAvx512}) {
    if (name == cpu_isa_name(isa)) {
      TORCH_CHECK(cpu_supports(isa), "pagedspec: PAGEDSPEC_CPU_ISA=", name,
                  " but this CPU lacks its instructions (best level here: ",
                  cpu_isa_name(best_cpu_isa()), ")");
      return isa;
    }
  }
  TORCH_CHECK(false, "pagedspec: PAGEDSPEC_CPU_ISA must be baseline, avx2 or avx512, got '", name,
              "'");
}

bool cpu_avx512_vbmi() {
#if defined(__x86_64__) || defined(__i386__)
  static const bool supported =
      cpu_supports(CpuIsa::kAvx512) && __builtin_cpu_supports("avx512vbmi");
  return supported;
#else
  return false;
#endif
}

bool cpu_fp8_images(CpuIsa level) {
  const char* env = std::getenv("PAGEDSPEC_CPU_FP8_IMAGES");
  if (env != nullptr && std::string(env) == "0") return false;
  return level == CpuIsa::kAvx2 || (level == CpuIsa::kAvx512 && cpu_avx512_vbmi());
}

bool cpu_bf16_dot_supported() {
#if defined(__x86_64__) || defined(__i386__)
  static const bool supported = cpu_supports(CpuIsa::kAvx512) &&
                                __builtin_cpu_supports("avx512bf16") && cpu_avx512_vbmi();
  return supported;
#else
  return false;
#endif
}

bool cpu_bf16_dot() {
  const char* env = std::getenv("PAGEDSPEC_CPU_BF16_DOT");
  return env != nullptr && std::string(env) == "1" && cpu_bf16_dot_supported();
}

}  // namespace pagedspec
