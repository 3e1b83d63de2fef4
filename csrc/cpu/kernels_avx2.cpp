// The CPU kernels (attention, reshape_and_cache, FP8 conversion, rejection sampling, packed linear) built for
// AVX2 CPUs: AVX2, FMA and F16C enabled.
#include "cpu/kernel_levels.h"
#pragma GCC target("avx2,fma,f16c")
#define PAGEDSPEC_CPU_LEVEL 1
#define PAGEDSPEC_CPU_NAMESPACE cpu_avx2
#include "cpu/attention_impl.h"
#include "cpu/cache_impl.h"
#include "cpu/fp8_impl.h"
#include "cpu/linear_impl.h"
#include "cpu/sampling_impl.h"
