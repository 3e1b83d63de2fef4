// The CPU kernels (attention, reshape_and_cache, FP8 conversion, rejection sampling, packed linear) built for
// any x86-64 CPU (the baseline level): no extra instructions (SSE2).
#include "cpu/kernel_levels.h"

#define PAGEDSPEC_CPU_LEVEL 0
#define PAGEDSPEC_CPU_NAMESPACE cpu_baseline
#include "cpu/attention_impl.h"
#include "cpu/cache_impl.h"
#include "cpu/fp8_impl.h"
#include "cpu/linear_impl.h"
#include "cpu/sampling_impl.h"
