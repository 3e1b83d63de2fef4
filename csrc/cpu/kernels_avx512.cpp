// The CPU kernels (attention, reshape_and_cache, FP8 conversion, rejection sampling, packed linear) built for
// AVX-512 CPUs: AVX-512 F/BW/VL/DQ (and AVX2, FMA, F16C) enabled.
#include "cpu/kernel_levels.h"
// GCC 12's AVX-512 intrinsics build their pass-through operand with _mm512_undefined_ps()
// (`__m512 __Y = __Y;`), which -Wall reports as uninitialized at every inlined use.
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")
#define PAGEDSPEC_CPU_LEVEL 2
#define PAGEDSPEC_CPU_NAMESPACE cpu_avx512
#include "cpu/attention_impl.h"
#include "cpu/cache_impl.h"
#include "cpu/fp8_impl.h"
#include "cpu/linear_impl.h"
#include "cpu/sampling_impl.h"
