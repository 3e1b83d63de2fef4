// AMX bf16 scores (cpu/amx.h). Compiled with the AMX target; called only when amx_available().
#include "cpu/amx.h"

#if defined(__x86_64__)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>

// GCC 12's AVX-512 intrinsics build their pass-through operand with _mm512_undefined_ps()
// (`__m512 __Y = __Y;`), which -Wall reports as uninitialized at every inlined use.
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl")
#include <immintrin.h>

namespace pagedspec {
namespace {

constexpr long kArchReqXcompPerm = 0x1023;  // arch_prctl: ask for an extended state component
constexpr long kXfeatureXtiledata = 18;     // the AMX tile data state

bool cpu_has_amx_bf16() {
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
  return (d & (1u << 24)) != 0 && (d & (1u << 22)) != 0;  // AMX-TILE, AMX-BF16
}

// The tile configuration (palette 1), every tile 16 rows of 64 bytes. Scores: tmm0 / tmm1
// accumulators (16 positions x 16 query rows of float32), tmm2 keys (16 positions x 32 bf16),
// tmm3 / tmm4 queries (16 dimension pairs x 16 rows x 2 bf16). Values: tmm0 / tmm1 accumulators
// (16 query rows x 16 dimensions of float32), tmm5 / tmm6 weights (16 rows x 32 positions of
// bf16), tmm7 values (16 position pairs x 16 dimensions x 2 bf16).
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

TileConfig make_config() {
  TileConfig c;
  for (int t = 0; t < 8; ++t) {
    c.rows[t] = 16;
    c.colsb[t] = 64;
  }
  return c;
}

}  // namespace

bool amx_supported() {
  static const bool supported = cpu_has_amx_bf16() &&
      syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  return supported;
}

bool amx_available() {
  const char* env = std::getenv("PAGEDSPEC_CPU_AMX");  // read at every call, as PAGEDSPEC_CPU_ISA
  return (env == nullptr || std::string(env) != "0") && amx_supported();
}

void amx_pack_queries(const uint16_t* const* q_rows, int num_rows, int D, uint16_t* vnni) {
  const int blocks = (num_rows + kAmxRows - 1) / kAmxRows;
  std::memset(vnni, 0, size_t(blocks) * kAmxRows * D * sizeof(uint16_t));
  for (int r = 0; r < num_rows; ++r) {
    const int b = r / kAmxRows, n = r % kAmxRows;
    for (int p = 0; p < D / 2; ++p) {
      uint16_t* dst = vnni + ((size_t(b) * (D / 2) + p) * kAmxRows + n) * 2;
      dst[0] = q_rows[r][2 * p];
      dst[1] = q_rows[r][2 * p + 1];
    }
  }
}

void amx_begin() {
  static const TileConfig config = make_config();
  _tile_loadconfig(&config);
}

void amx_end() { _tile_release(); }

void amx_scores(const uint16_t* vnni, int num_rows, const uint16_t* const* k, int num_positions,
                int D, float scale, float* scores, int score_stride) {
  // Keys: read in place when the 16 rows are equally spaced (one block of the cache), else
  // gathered (rows past num_positions are zero; their scores are not written).
  alignas(64) uint16_t gathered[kAmxPositions * 256];
  const uint16_t* base = k[0];
  int64_t stride = num_positions > 1 ? k[1] - k[0] : D;
  bool strided = num_positions == kAmxPositions && stride > 0;
  for (int t = 2; strided && t < kAmxPositions; ++t) strided = k[t] - k[t - 1] == stride;
  if (!strided) {
    for (int t = 0; t < kAmxPositions; ++t) {
      if (t < num_positions) {
        std::memcpy(gathered + t * D, k[t], D * sizeof(uint16_t));
      } else {
        std::memset(gathered + t * D, 0, D * sizeof(uint16_t));
      }
    }
    base = gathered;
    stride = D;
  }
  const bool two_blocks = num_rows > kAmxRows;
  _tile_zero(0);
  _tile_zero(1);
  for (int d0 = 0; d0 < D; d0 += kAmxDims) {
    _tile_loadd(2, base + d0, stride * int64_t(sizeof(uint16_t)));
    // Row block b's dims d0 .. d0 + 31 are pairs d0 / 2 .. d0 / 2 + 15: 16 rows of 64 bytes.
    _tile_loadd(3, vnni + size_t(d0 / 2) * kAmxRows * 2, kAmxRows * 2 * sizeof(uint16_t));
    _tile_dpbf16ps(0, 2, 3);
    if (two_blocks) {
      _tile_loadd(4, vnni + (size_t(D / 2) + d0 / 2) * kAmxRows * 2,
                  kAmxRows * 2 * sizeof(uint16_t));
      _tile_dpbf16ps(1, 2, 4);
    }
  }
  alignas(64) float c[2][kAmxPositions * kAmxRows];  // [position][row] per block
  _tile_stored(0, c[0], kAmxRows * sizeof(float));
  if (two_blocks) _tile_stored(1, c[1], kAmxRows * sizeof(float));
  for (int r = 0; r < num_rows; ++r) {
    const float* col = c[r / kAmxRows] + r % kAmxRows;
    float* dst = scores + size_t(r) * score_stride;
    for (int t = 0; t < num_positions; ++t) dst[t] = col[t * kAmxRows] * scale;
  }
}

void amx_accumulate(const float* w, int w_stride, int num_rows, const uint16_t* const* v, int D,
                    float* acc) {
  // Weights as bf16, round to nearest even (finite: they are exp2 of non-positive numbers).
  alignas(64) uint16_t weights[2][kAmxRows * kAmxTilePositions] = {};
  for (int r = 0; r < num_rows; ++r) {
    for (int half = 0; half < kAmxTilePositions; half += 16) {
      const __m512i bits = _mm512_castps_si512(_mm512_loadu_ps(w + size_t(r) * w_stride + half));
      const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
      const __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(&weights[r / kAmxRows][(r % kAmxRows) *
                                                                  kAmxTilePositions + half]),
                          _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16)));
    }
  }
  // Values in VNNI pairs: chunk c (dimensions 16 c .. 16 c + 15), pair p: (v[2p][d], v[2p+1][d])
  // for each of its 16 dimensions, 64 bytes.
  alignas(64) uint16_t values[256 / 16][kAmxTilePositions / 2 * 32];
  const __m512i lo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8,
                                      39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
  const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
  for (int pair = 0; pair < kAmxTilePositions / 2; ++pair) {
    for (int d0 = 0; d0 < D; d0 += 32) {
      const __m512i a = _mm512_loadu_si512(v[2 * pair] + d0);
      const __m512i b = _mm512_loadu_si512(v[2 * pair + 1] + d0);
      _mm512_store_si512(values[d0 / 16] + pair * 32, _mm512_permutex2var_epi16(a, lo, b));
      _mm512_store_si512(values[d0 / 16 + 1] + pair * 32, _mm512_permutex2var_epi16(a, hi, b));
    }
  }
  const int blocks = (num_rows + kAmxRows - 1) / kAmxRows;
  _tile_loadd(5, weights[0], kAmxTilePositions * sizeof(uint16_t));
  if (blocks > 1) _tile_loadd(6, weights[1], kAmxTilePositions * sizeof(uint16_t));
  alignas(64) float c[2][kAmxRows * 16];  // [row][dimension] per block
  for (int chunk = 0; chunk < D / 16; ++chunk) {
    _tile_loadd(7, values[chunk], 64);
    _tile_zero(0);
    _tile_dpbf16ps(0, 5, 7);
    _tile_stored(0, c[0], 16 * sizeof(float));
    if (blocks > 1) {
      _tile_zero(1);
      _tile_dpbf16ps(1, 6, 7);
      _tile_stored(1, c[1], 16 * sizeof(float));
    }
    for (int r = 0; r < num_rows; ++r) {
      float* dst = acc + size_t(r) * D + chunk * 16;
      _mm512_storeu_ps(dst, _mm512_add_ps(_mm512_loadu_ps(dst),
                                          _mm512_load_ps(c[r / kAmxRows] + (r % kAmxRows) * 16)));
    }
  }
}

}  // namespace pagedspec

#else  // not x86-64: no AMX; the kernels never call the tile functions (amx_available() is false)

#include <cstdlib>

namespace pagedspec {
bool amx_supported() { return false; }
bool amx_available() { return false; }
void amx_pack_queries(const uint16_t* const*, int, int, uint16_t*) { std::abort(); }
void amx_begin() { std::abort(); }
void amx_end() { std::abort(); }
void amx_scores(const uint16_t*, int, const uint16_t* const*, int, int, float, float*, int) {
  std::abort();
}
void amx_accumulate(const float*, int, int, const uint16_t* const*, int, float*) { std::abort(); }
}  // namespace pagedspec

#endif
