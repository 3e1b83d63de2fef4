#include "cpu/isa.h"

#include "cpu/amx.h"

#include <c10/util/Exception.h>

#include <cstdlib>
#include <initializer_list>
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

namespace {

// One grammar for every variable: unset or empty is the default; otherwise one of `accepted`.
// Returns the index of the value in `accepted`, or -1 when unset.
int env_choice(const char* name, std::initializer_list<const char*> accepted) {
  const char* env = std::getenv(name);
  if (env == nullptr || *env == '\0') return -1;
  int i = 0;
  std::string list;
  for (const char* a : accepted) {
    if (std::string(env) == a) return i;
    list += (i++ ? ", " : "") + std::string(a);
  }
  TORCH_CHECK(false, "pagedspec: ", name, " must be one of ", list, " (or unset), got '", env,
              "'");
}

// A boolean setting: "0" or "1", else `unset`.
bool env_flag(const char* name, bool unset) {
  const int choice = env_choice(name, {"0", "1"});
  return choice < 0 ? unset : choice == 1;
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

}  // namespace

bool cpu_bf16_dot_supported() {
#if defined(__x86_64__) || defined(__i386__)
  static const bool supported = cpu_supports(CpuIsa::kAvx512) &&
                                __builtin_cpu_supports("avx512bf16") && cpu_avx512_vbmi();
  return supported;
#else
  return false;
#endif
}

CpuConfig cpu_config() {
  CpuConfig c{};
  const int level = env_choice("PAGEDSPEC_CPU_ISA", {"baseline", "avx2", "avx512"});
  c.isa = level < 0 ? best_cpu_isa() : static_cast<CpuIsa>(level);
  TORCH_CHECK(cpu_supports(c.isa), "pagedspec: PAGEDSPEC_CPU_ISA=", cpu_isa_name(c.isa),
              " but this CPU lacks its instructions (best level here: ",
              cpu_isa_name(best_cpu_isa()), ")");
  c.avx512_vbmi = cpu_avx512_vbmi();
  c.amx = env_flag("PAGEDSPEC_CPU_AMX", false) && amx_supported();
  c.amx_decode = env_flag("PAGEDSPEC_CPU_AMX_DECODE", true) && c.amx;
  c.bf16_dot = env_flag("PAGEDSPEC_CPU_BF16_DOT", true) && cpu_bf16_dot_supported();
  c.fp8_images = env_flag("PAGEDSPEC_CPU_FP8_IMAGES", true) &&
                 (c.isa == CpuIsa::kAvx2 || (c.isa == CpuIsa::kAvx512 && c.avx512_vbmi));
  return c;
}

CpuIsa cpu_isa() { return cpu_config().isa; }

}  // namespace pagedspec
