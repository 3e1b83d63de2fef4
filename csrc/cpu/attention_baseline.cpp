// The CPU attention kernel built for any x86-64 CPU (the baseline level): cpu/attention_impl.h with no extra instructions (SSE2).
#include "cpu/attention_levels.h"

#define PAGEDSPEC_CPU_LEVEL 0
#define PAGEDSPEC_CPU_NAMESPACE cpu_baseline
#include "cpu/attention_impl.h"
