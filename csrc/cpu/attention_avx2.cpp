// The CPU attention kernel built for AVX2 CPUs: cpu/attention_impl.h with AVX2, FMA and F16C enabled.
#include "cpu/attention_levels.h"
#pragma GCC target("avx2,fma,f16c")
#define PAGEDSPEC_CPU_LEVEL 1
#define PAGEDSPEC_CPU_NAMESPACE cpu_avx2
#include "cpu/attention_impl.h"
