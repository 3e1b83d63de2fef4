// The CPU packed_linear kernel (pagedspec/packed_linear.h: the layout), one source built once per
// ISA level (cpu/isa.h): included only by cpu/kernels_<level>.cpp after the level's
// `#pragma GCC target`.
//
// A product of a few rows is bound by reading the weights once, so the kernel reads them as one
// sequential stream per thread: each thread takes whole tasks of 16 weight rows (four packed
// blocks), and a tile of up to kTileRows input rows against one block keeps M x 4 accumulators in
// registers, each the partial dot products of one (input row, weight row) pair along K, reduced
// across lanes once at the end; further tiles of input rows reread the task's blocks from the
// cache. (Four blocks read side by side, or one block in two passes, streamed 1.2-2x slower on
// Zen 4.)
// Products: FMA on float32 (bf16 weights widened exactly), or at avx512 with
// CpuConfig::bf16_dot the AVX512-BF16 dot product on bf16 pairs (exact products, float32 sums,
// denormals flushed), which reads the input without widening it. The sums are float32 either
// way; only their order differs from F.linear's.
#include "cpu/vec.h"

namespace pagedspec {
namespace PAGEDSPEC_CPU_NAMESPACE {
namespace {

// Input rows per tile: 4 x 4 accumulators fill half the zmm registers; at avx2 a vfloat is two
// of the sixteen ymm registers, so one row's four take half of them.
#if PAGEDSPEC_CPU_LEVEL == 2
constexpr int kTileRows = 4;
#else
constexpr int kTileRows = 1;
#endif
constexpr int kTaskRows = kPackedRowsMultiple;
constexpr int kBlockRows = kPackedRows;

// sums[r] = the sum of acc[r]'s lanes, r < G: a pairwise tree across the G vectors (G - 1 pair
// sums for G outputs, where a reduction per vector costs four shuffles and adds each).
template <int G>
inline void reduce_lanes(const vfloat (&acc)[G], float* sums) {
#if PAGEDSPEC_CPU_LEVEL >= 1
  vfloat t[G];
  for (int r = 0; r < G; ++r) t[r] = acc[r];
  for (int n = G; n > 1; n /= 2) {
    for (int i = 0; i < n / 2; ++i) t[i] = vpair_sums(t[2 * i], t[2 * i + 1]);
  }
  vfloat v = t[0];  // lanes r * 16 / G ..: row r's partial sums, 16 / G of them
  for (int w = G; w < kLanes; w *= 2) v = vpair_sums(v, v);
  float lanes[kLanes];
  vstore(lanes, v);
  for (int r = 0; r < G; ++r) sums[r] = lanes[r];
#else
  for (int r = 0; r < G; ++r) sums[r] = vsum(acc[r]);
#endif
}

// sums[m * kTaskRows + r] = x row m . row r of `block` (its chunk c at block + (4 c + r) E), for
// m < M, r < 4; x is float32 [M, K] (row stride K).
template <typename T, int M>
void fma_block(const float* __restrict x, int64_t K, const T* __restrict block,
               float* __restrict sums) {
  constexpr int E = packed_chunk_elems(sizeof(T));
  CacheReader<T, CacheFormat::kNative> reader;
  vfloat acc[M][kBlockRows];
  for (int m = 0; m < M; ++m) {
    for (int r = 0; r < kBlockRows; ++r) acc[m][r] = vzero();
  }
  for (int64_t c = 0; c < K / E; ++c) {
    for (int s = 0; s < E; s += kLanes) {
      vfloat xv[M];
      for (int m = 0; m < M; ++m) xv[m] = vload(x + m * K + c * E + s);
      for (int r = 0; r < kBlockRows; ++r) {
        const vfloat wv = reader.load16(block + (c * kBlockRows + r) * E + s);
        for (int m = 0; m < M; ++m) acc[m][r] = vfma(xv[m], wv, acc[m][r]);
      }
    }
  }
  for (int m = 0; m < M; ++m) reduce_lanes<kBlockRows>(acc[m], sums + m * kTaskRows);
}

#if PAGEDSPEC_CPU_LEVEL == 2
// fma_block on bf16 pairs: x and the block as raw bf16 bits, 32 per vector.
template <int M>
void dot_block(const uint16_t* __restrict x, int64_t K, const uint16_t* __restrict block,
               float* __restrict sums) {
  constexpr int E = packed_chunk_elems(2);
  vfloat acc[M][kBlockRows];
  for (int m = 0; m < M; ++m) {
    for (int r = 0; r < kBlockRows; ++r) acc[m][r] = vzero();
  }
  for (int64_t c = 0; c < K / E; ++c) {
    __m512i xv[M];
    for (int m = 0; m < M; ++m) xv[m] = _mm512_loadu_si512(x + m * K + c * E);
    for (int r = 0; r < kBlockRows; ++r) {
      const __m512i wv = _mm512_loadu_si512(block + (c * kBlockRows + r) * E);
      for (int m = 0; m < M; ++m) acc[m][r] = vdot_bf16(acc[m][r], xv[m], wv);
    }
  }
  for (int m = 0; m < M; ++m) reduce_lanes<kBlockRows>(acc[m], sums + m * kTaskRows);
}
#endif

// One tile: M input rows against the task's kTaskRows weight rows (its blocks, from `task`), into
// sums [M][kTaskRows].
template <typename T, int M>
void task_tile(const void* x, int64_t K, const T* task, bool dot, float* sums) {
  for (int g0 = 0; g0 < kTaskRows; g0 += kBlockRows) {
    const T* block = task + g0 * K;
#if PAGEDSPEC_CPU_LEVEL == 2
    if constexpr (std::is_same_v<T, c10::BFloat16>) {
      if (dot) {
        dot_block<M>(static_cast<const uint16_t*>(x), K,
                     reinterpret_cast<const uint16_t*>(block), sums + g0);
        continue;
      }
    }
#endif
    (void)dot;
    fma_block<T, M>(static_cast<const float*>(x), K, block, sums + g0);
  }
}

template <typename T>
void packed_linear_typed(const PackedLinearParams& p, bool dot) {
  const int64_t M = p.M, N = p.N, K = p.K;
  const T* input = static_cast<const T*>(p.input);
  const T* weight = static_cast<const T*>(p.weight);
  const T* bias = static_cast<const T*>(p.bias);
  T* out = static_cast<T*>(p.out);
  // The FMA path reads float32 input rows: bf16 ones are widened once here (exactly).
  std::vector<float> widened;
  const void* x = input;
  if (std::is_same_v<T, c10::BFloat16> && !dot) {
    widened.resize(static_cast<size_t>(M * K));
    for (int64_t i = 0; i < M * K; ++i) widened[i] = ScalarConvert<T>::to_float(input[i]);
    x = widened.data();
  }
  const size_t x_bytes = dot ? sizeof(T) : sizeof(float);
  // Enough blocks per task that splitting pays for itself (~64k multiply-adds).
  const int64_t grain = 65536 / std::max<int64_t>(kTaskRows * K * M, 1) + 1;
  at::parallel_for(0, N / kTaskRows, grain, [&](int64_t begin, int64_t end) {
    float sums[kTileRows * kTaskRows];
    for (int64_t b = begin; b < end; ++b) {
      const int64_t n0 = b * kTaskRows;
      const T* task = weight + n0 * K;
      for (int64_t m0 = 0; m0 < M; m0 += kTileRows) {
        const void* xt = static_cast<const char*>(x) + m0 * K * x_bytes;
        const int rows = static_cast<int>(std::min<int64_t>(kTileRows, M - m0));
        switch (rows) {
#if PAGEDSPEC_CPU_LEVEL == 2
          case 1: task_tile<T, 1>(xt, K, task, dot, sums); break;
          case 2: task_tile<T, 2>(xt, K, task, dot, sums); break;
          case 3: task_tile<T, 3>(xt, K, task, dot, sums); break;
          default: task_tile<T, 4>(xt, K, task, dot, sums); break;
#else
          default: task_tile<T, 1>(xt, K, task, dot, sums); break;
#endif
        }
        for (int m = 0; m < rows; ++m) {
          T* row = out + (m0 + m) * N + n0;
          for (int r = 0; r < kTaskRows; ++r) {
            float y = sums[m * kTaskRows + r];
            if (bias != nullptr) y += ScalarConvert<T>::to_float(bias[n0 + r]);
            row[r] = ScalarConvert<T>::from_float(y);
          }
        }
      }
    }
  });
}

}  // namespace

void packed_linear(const PackedLinearParams& p, bool bf16_dot) {
  if (p.dtype == PackedLinearDtype::kBFloat16) {
    packed_linear_typed<c10::BFloat16>(p, bf16_dot && PAGEDSPEC_CPU_LEVEL == 2);
  } else {
    packed_linear_typed<float>(p, false);
  }
}

}  // namespace PAGEDSPEC_CPU_NAMESPACE
}  // namespace pagedspec
