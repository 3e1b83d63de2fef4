// AMX bf16 scores (cpu/amx.h). Compiled with the AMX target; called only where CpuConfig::amx allows.
#include "cpu/amx.h"

#if defined(__x86_64__)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <array>
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

namespace {

// In place: r[j] becomes column j of the 16 x 16 matrix whose rows r held (64 shuffles).
void transpose16(__m512 r[16]) {
  __m512 t[16];
  for (int i = 0; i < 16; i += 2) {  // per 128-bit lane: rows i and i + 1 interleaved
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  __m512 u[16];  // u[4 g + c], 128-bit lane L: rows 4 g .. 4 g + 3 of column 4 L + c
  for (int g = 0; g < 16; g += 4) {
    for (int j = 0; j < 2; ++j) {
      const __m512d a = _mm512_castps_pd(t[g + j]), b = _mm512_castps_pd(t[g + j + 2]);
      u[g + 2 * j] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, b));
      u[g + 2 * j + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, b));
    }
  }
  for (int c = 0; c < 4; ++c) {  // column 4 L + c: lane L of u[c], u[4 + c], u[8 + c], u[12 + c]
    const __m512 x0 = _mm512_shuffle_f32x4(u[c], u[4 + c], 0x44);  // lanes 0, 1 of each
    const __m512 x1 = _mm512_shuffle_f32x4(u[c], u[4 + c], 0xEE);  // lanes 2, 3 of each
    const __m512 y0 = _mm512_shuffle_f32x4(u[8 + c], u[12 + c], 0x44);
    const __m512 y1 = _mm512_shuffle_f32x4(u[8 + c], u[12 + c], 0xEE);
    r[c] = _mm512_shuffle_f32x4(x0, y0, 0x88);
    r[4 + c] = _mm512_shuffle_f32x4(x0, y0, 0xDD);
    r[8 + c] = _mm512_shuffle_f32x4(x1, y1, 0x88);
    r[12 + c] = _mm512_shuffle_f32x4(x1, y1, 0xDD);
  }
}

// The bits of 16 finite float32 values rounded to bf16 (round to nearest even), still in the
// high half of each 32-bit lane.
__m512i round_to_bf16_bits(__m512 x) {
  const __m512i bits = _mm512_castps_si512(x);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  return _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
}

// Rows rows[0 .. count) (count <= 16, D bf16 each) as one tile operand of 16 rows: in place
// when there are 16 equally spaced ones (one cache block), else copied into buf ([16, D], rows
// past count zero). Returns the base; *stride_bytes gets the row stride.
const uint16_t* tile_rows(const uint16_t* const* rows, int count, int D, uint16_t* buf,
                          int64_t* stride_bytes) {
  const int64_t stride = count > 1 ? rows[1] - rows[0] : D;
  bool strided = count == 16 && stride > 0;
  for (int t = 2; strided && t < 16; ++t) strided = rows[t] - rows[t - 1] == stride;
  if (strided) {
    *stride_bytes = stride * int64_t(sizeof(uint16_t));
    return rows[0];
  }
  for (int t = 0; t < 16; ++t) {
    if (t < count) {
      std::memcpy(buf + t * D, rows[t], D * sizeof(uint16_t));
    } else {
      std::memset(buf + t * D, 0, D * sizeof(uint16_t));
    }
  }
  *stride_bytes = D * int64_t(sizeof(uint16_t));
  return buf;
}

}  // namespace

void amx_scores(const uint16_t* vnni, int num_rows, const uint16_t* const* k, int num_positions,
                int D, float scale, float* scores, int score_stride) {
  // Each half of the positions (one key tile of 16 rows) is read in place when its rows are
  // equally spaced (one block of the cache), else gathered (rows past num_positions are zero;
  // their scores are not written).
  alignas(64) uint16_t gathered[2][kAmxPositions * 256];
  const int halves = (num_positions + kAmxPositions - 1) / kAmxPositions;
  const uint16_t* base[2] = {nullptr, nullptr};
  int64_t stride_bytes[2] = {0, 0};
  int count[2] = {0, 0};
  for (int h = 0; h < halves; ++h) {
    count[h] = std::min(kAmxPositions, num_positions - h * kAmxPositions);
    base[h] = tile_rows(k + h * kAmxPositions, count[h], D, gathered[h], &stride_bytes[h]);
  }
  // Accumulators: tmm0 / tmm1 for the positions of half 0 / 1 against row block 0, tmm2 / tmm3
  // against row block 1; keys tmm4 / tmm5; queries tmm6 / tmm7. Four independent chains of
  // multiplies over the dimensions, where 16 positions per call made two.
  const bool two_halves = halves > 1;
  const bool two_blocks = num_rows > kAmxRows;
  const int64_t q_stride = kAmxRows * 2 * sizeof(uint16_t);
  _tile_zero(0);
  if (two_halves) _tile_zero(1);
  if (two_blocks) _tile_zero(2);
  if (two_halves && two_blocks) _tile_zero(3);
  for (int d0 = 0; d0 < D; d0 += kAmxDims) {
    // Row block b's dims d0 .. d0 + 31 are pairs d0 / 2 .. d0 / 2 + 15: 16 rows of 64 bytes.
    _tile_loadd(6, vnni + size_t(d0 / 2) * kAmxRows * 2, q_stride);
    _tile_loadd(4, base[0] + d0, stride_bytes[0]);
    _tile_dpbf16ps(0, 4, 6);
    if (two_halves) {
      _tile_loadd(5, base[1] + d0, stride_bytes[1]);
      _tile_dpbf16ps(1, 5, 6);
    }
    if (two_blocks) {
      _tile_loadd(7, vnni + (size_t(D / 2) + d0 / 2) * kAmxRows * 2, q_stride);
      _tile_dpbf16ps(2, 4, 7);
      if (two_halves) _tile_dpbf16ps(3, 5, 7);
    }
  }
  alignas(64) float c[2][2][kAmxPositions * kAmxRows];  // [block][half]: [position][row]
  _tile_stored(0, c[0][0], kAmxRows * sizeof(float));
  if (two_halves) _tile_stored(1, c[0][1], kAmxRows * sizeof(float));
  if (two_blocks) _tile_stored(2, c[1][0], kAmxRows * sizeof(float));
  if (two_halves && two_blocks) _tile_stored(3, c[1][1], kAmxRows * sizeof(float));
  // Each [position][row] tile transposed in registers into rows of scores (a scalar copy per
  // score was a third of this function's time).
  const __m512 vscale = _mm512_set1_ps(scale);
  for (int b = 0; b < (two_blocks ? 2 : 1); ++b) {
    const int rows = std::min(kAmxRows, num_rows - b * kAmxRows);
    for (int h = 0; h < halves; ++h) {
      __m512 r[16];
      for (int t = 0; t < 16; ++t) r[t] = _mm512_load_ps(c[b][h] + t * kAmxRows);
      transpose16(r);
      const __mmask16 mask = __mmask16((1u << count[h]) - 1u);
      for (int j = 0; j < rows; ++j) {
        _mm512_mask_storeu_ps(scores + size_t(b * kAmxRows + j) * score_stride + h * kAmxPositions,
                              mask, _mm512_mul_ps(r[j], vscale));
      }
    }
  }
}

void amx_accumulate(const float* w, int w_stride, int num_rows, const uint16_t* const* v, int D,
                    float* acc) {
  // Weights as bf16, round to nearest even (finite: they are exp2 of non-positive numbers).
  alignas(64) uint16_t weights[2][kAmxRows * kAmxTilePositions] = {};
  for (int r = 0; r < num_rows; ++r) {
    for (int half = 0; half < kAmxTilePositions; half += 16) {
      const __m512i rounded = round_to_bf16_bits(_mm512_loadu_ps(w + size_t(r) * w_stride + half));
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
  // The accumulator rows are the tiles' C operands in place (16 rows of 16 floats, D floats
  // apart), instead of a zeroed tile added to them with vector operations. Tiles: weights
  // tmm5 / tmm6 (row blocks 0 / 1); an even chunk's values tmm7 and accumulators tmm0 / tmm1, an
  // odd chunk's tmm4 and tmm2 / tmm3, so that four multiplies are in flight, not one.
  const bool two_blocks = num_rows > kAmxRows;
  const int64_t acc_stride = int64_t(D) * sizeof(float);
  _tile_loadd(5, weights[0], kAmxTilePositions * sizeof(uint16_t));
  if (two_blocks) _tile_loadd(6, weights[1], kAmxTilePositions * sizeof(uint16_t));
  for (int chunk = 0; chunk < D / 16; chunk += 2) {
    float* even0 = acc + chunk * 16;
    float* even1 = even0 + size_t(kAmxRows) * D;
    _tile_loadd(7, values[chunk], 64);
    _tile_loadd(0, even0, acc_stride);
    _tile_dpbf16ps(0, 5, 7);
    if (two_blocks) {
      _tile_loadd(1, even1, acc_stride);
      _tile_dpbf16ps(1, 6, 7);
    }
    _tile_loadd(4, values[chunk + 1], 64);
    _tile_loadd(2, even0 + 16, acc_stride);
    _tile_dpbf16ps(2, 5, 4);
    if (two_blocks) {
      _tile_loadd(3, even1 + 16, acc_stride);
      _tile_dpbf16ps(3, 6, 4);
    }
    _tile_stored(0, even0, acc_stride);
    _tile_stored(2, even0 + 16, acc_stride);
    if (two_blocks) {
      _tile_stored(1, even1, acc_stride);
      _tile_stored(3, even1 + 16, acc_stride);
    }
  }
}

// The decode path (cpu/amx.h: AmxDecode).
namespace {

TileConfig make_decode_config(int R) {
  TileConfig c;
  for (int t = 0; t < 8; ++t) c.colsb[t] = 64;
  if (R > kAmxDecodeNarrowRows) {  // a wide state (cpu/amx.h)
    const uint8_t high_rows = uint8_t(2 * (R - kAmxDecodeNarrowRows));
    for (int t = 0; t < 8; ++t) c.rows[t] = 16;
    c.rows[2] = c.rows[3] = high_rows;  // accumulators of rows 8 .. R - 1
    c.rows[7] = high_rows;              // their weights
    return c;
  }
  for (int t = 0; t < 4; ++t) c.rows[t] = uint8_t(2 * R);  // accumulators
  c.rows[4] = 16;                                          // scores: 16 positions x R rows
  c.colsb[4] = uint16_t(4 * R);
  c.rows[5] = 16;                                          // 16 key or value rows
  c.rows[6] = 16;                                          // a query chunk: 16 pairs x R rows
  c.colsb[6] = uint16_t(4 * R);
  c.rows[7] = uint8_t(2 * R);                              // weights
  return c;
}

// Lane i: i * R, the index of entry i of row 0 in a [16][R] array of 32-bit entries (the
// queries' pairs and the scores tile).
__m512i row_major_slots(int R) {
  return _mm512_mullo_epi32(
      _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0), _mm512_set1_epi32(R));
}

}  // namespace

int amx_decode_prefetch_steps(int D, int n) {
  const int halves = (n + 15) / 16;
  return halves * (D / 32 + 1 + 1 + D / 32);  // scores, read_scores, weights, accumulate
}

void amx_decode_begin(AmxDecode& s, const uint16_t* const* q_rows, int R, int D) {
  s.rows = R;
  s.dims = D;
  s.cols = R > kAmxDecodeNarrowRows ? 16 : R;
  // Per chunk, the [row][pair] matrix of 32-bit pairs (a row's 32 dimensions are one register)
  // transposed in registers into [pair][col] (padding columns zero): 16 scatters a chunk cost
  // about as much as the rest of a 256-position task's setup.
  const __mmask16 cols = __mmask16((1u << s.cols) - 1u);
  for (int c = 0; c < D / 32; ++c) {
    __m512 m[16];
    for (int n = 0; n < 16; ++n) {
      m[n] = n < R ? _mm512_castsi512_ps(_mm512_loadu_si512(q_rows[n] + 32 * c))
                   : _mm512_setzero_ps();
    }
    transpose16(m);
    for (int p = 0; p < 16; ++p) _mm512_mask_storeu_ps(s.q[c] + p * s.cols * 2, cols, m[p]);
  }
  // The accumulator rows the state uses: 2 R of each chunk.
  for (int c = 0; c < D / 32; ++c) std::memset(s.acc[c], 0, size_t(2 * R) * 16 * sizeof(float));
}

void amx_decode_configure(int R) {
  // Static, as amx_begin's: GCC treats _tile_loadconfig as reading only the palette byte of a
  // local configuration and drops the stores of the rest (the next tile instruction faults).
  static const auto configs = [] {
    std::array<TileConfig, kAmxDecodeMaxRows + 1> c{};
    for (int r = 1; r <= kAmxDecodeMaxRows; ++r) c[r] = make_decode_config(r);
    return c;
  }();
  _tile_loadconfig(&configs[R]);
}

void amx_decode_scores(AmxDecode& s, const uint16_t* const* k, int n,
                       const AmxPrefetchStep& step) {
  const int C = s.cols, D = s.dims;
  for (int h = 0; h * 16 < n; ++h) {
    int64_t stride = 0;
    const uint16_t* base =
        tile_rows(k + h * 16, std::min(16, n - h * 16), D, s.gathered[h], &stride);
    _tile_zero(4);
    for (int c = 0; c < D / 32; ++c) {
      _tile_loadd(5, base + 32 * c, stride);
      _tile_loadd(6, s.q[c], 4 * C);
      _tile_dpbf16ps(4, 5, 6);
      step();
    }
    _tile_stored(4, s.scores[h], 4 * C);
  }
}

void amx_decode_read_scores(const AmxDecode& s, int n, float scale, float* w, int w_stride,
                            const AmxPrefetchStep& step) {
  const int R = s.rows;
  const __m512 vscale = _mm512_set1_ps(scale);
  if (s.cols == 16) {  // a wide state: the [position][16] tile transposed in registers
    for (int h = 0; h * 16 < n; ++h) {
      __m512 t[16];
      for (int p = 0; p < 16; ++p) t[p] = _mm512_load_ps(s.scores[h] + p * 16);
      step();
      transpose16(t);
      for (int r = 0; r < R; ++r) {
        _mm512_storeu_ps(w + size_t(r) * w_stride + h * 16, _mm512_mul_ps(t[r], vscale));
      }
    }
    return;
  }
  // Position t of row r is at [t * R + r].
  const __m512i lanes = row_major_slots(R);
  for (int h = 0; h * 16 < n; ++h) {
    step();
    for (int r = 0; r < R; ++r) {
      const __m512 row =
          _mm512_i32gather_ps(_mm512_add_epi32(lanes, _mm512_set1_epi32(r)), s.scores[h], 4);
      _mm512_storeu_ps(w + size_t(r) * w_stride + h * 16, _mm512_mul_ps(row, vscale));
    }
  }
}

void amx_decode_weights(AmxDecode& s, const float* w, int w_stride, int n,
                        const AmxPrefetchStep& step) {
  const __m512i high = _mm512_set1_epi32(int(0xFFFF0000u));
  for (int h = 0; h * 16 < n; ++h) {
    // Row 2 r: (bf16 weight, 0) per position; row 2 r + 1: (0, bf16 weight).
    uint32_t* tile = s.weights[h];
    step();
    for (int r = 0; r < s.rows; ++r) {
      const __m512i rounded = round_to_bf16_bits(_mm512_loadu_ps(w + size_t(r) * w_stride + h * 16));
      _mm512_store_si512(tile + (2 * r) * 16, _mm512_srli_epi32(rounded, 16));
      _mm512_store_si512(tile + (2 * r + 1) * 16, _mm512_and_si512(rounded, high));
    }
  }
}

namespace {
// amx_decode_accumulate for a wide state: per pair of 32-dimension chunks, its four accumulator
// tiles loaded once, each value tile multiplied by both weight tiles.
void accumulate_wide(AmxDecode& s, const uint16_t* const* v, int n, const AmxPrefetchStep& step) {
  const int chunks = s.dims / 32;
  const int64_t high = 2 * kAmxDecodeNarrowRows * 16;  // rows 8 .. R - 1 of a chunk's (floats)
  int64_t stride[2] = {0, 0};
  const uint16_t* base[2] = {nullptr, nullptr};
  for (int h = 0; h * 16 < n; ++h) {
    base[h] = tile_rows(v + h * 16, std::min(16, n - h * 16), s.dims, s.gathered[h], &stride[h]);
  }
  for (int c = 0; c < chunks; c += 2) {
    const bool pair = c + 1 < chunks;
    _tile_loadd(0, s.acc[c], 64);
    _tile_loadd(2, s.acc[c] + high, 64);
    if (pair) {
      _tile_loadd(1, s.acc[c + 1], 64);
      _tile_loadd(3, s.acc[c + 1] + high, 64);
    }
    for (int h = 0; h * 16 < n; ++h) {
      _tile_loadd(6, s.weights[h], 64);
      _tile_loadd(7, s.weights[h] + 2 * kAmxDecodeNarrowRows * 16, 64);
      _tile_loadd(5, base[h] + 32 * c, stride[h]);
      _tile_dpbf16ps(0, 6, 5);
      _tile_dpbf16ps(2, 7, 5);
      step();
      if (pair) {
        _tile_loadd(5, base[h] + 32 * (c + 1), stride[h]);
        _tile_dpbf16ps(1, 6, 5);
        _tile_dpbf16ps(3, 7, 5);
        step();
      }
    }
    _tile_stored(0, s.acc[c], 64);
    _tile_stored(2, s.acc[c] + high, 64);
    if (pair) {
      _tile_stored(1, s.acc[c + 1], 64);
      _tile_stored(3, s.acc[c + 1] + high, 64);
    }
  }
}
}  // namespace

void amx_decode_accumulate(AmxDecode& s, const uint16_t* const* v, int n,
                           const AmxPrefetchStep& step) {
  const int D = s.dims;
  if (s.cols == 16) {
    accumulate_wide(s, v, n, step);
    return;
  }
  _tile_loadd(0, s.acc[0], 64);
  if (D > 32) _tile_loadd(1, s.acc[1], 64);
  if (D > 64) _tile_loadd(2, s.acc[2], 64);
  if (D > 96) _tile_loadd(3, s.acc[3], 64);
  for (int h = 0; h * 16 < n; ++h) {
    _tile_loadd(7, s.weights[h], 64);
    int64_t stride = 0;
    const uint16_t* base =
        tile_rows(v + h * 16, std::min(16, n - h * 16), D, s.gathered[h], &stride);
    _tile_loadd(5, base, stride);
    _tile_dpbf16ps(0, 7, 5);
    step();
    if (D > 32) {
      _tile_loadd(5, base + 32, stride);
      _tile_dpbf16ps(1, 7, 5);
      step();
    }
    if (D > 64) {
      _tile_loadd(5, base + 64, stride);
      _tile_dpbf16ps(2, 7, 5);
      step();
    }
    if (D > 96) {
      _tile_loadd(5, base + 96, stride);
      _tile_dpbf16ps(3, 7, 5);
      step();
    }
  }
  _tile_stored(0, s.acc[0], 64);
  if (D > 32) _tile_stored(1, s.acc[1], 64);
  if (D > 64) _tile_stored(2, s.acc[2], 64);
  if (D > 96) _tile_stored(3, s.acc[3], 64);
}

void amx_decode_accumulate_row(AmxDecode& s, int r, const float* w, const uint16_t* const* v,
                               int first, int end) {
  const __m512i high = _mm512_set1_epi32(int(0xFFFF0000u));
  for (int t = first; t < end; ++t) {
    // The weight as the tiles see it (bf16, round to nearest even), in every lane.
    const __m512 weight = _mm512_castsi512_ps(
        _mm512_and_si512(round_to_bf16_bits(_mm512_set1_ps(w[t])), high));
    for (int c = 0; c < s.dims / 32; ++c) {
      // 32-bit lane n holds dimensions 2 n (low half) and 2 n + 1 (high half): as bf16 they are
      // float32 with 16 zero bits appended, the accumulator rows 2 r and 2 r + 1 of chunk c.
      const __m512i pairs = _mm512_loadu_si512(v[t] + 32 * c);
      const __m512 v_even = _mm512_castsi512_ps(_mm512_slli_epi32(pairs, 16));
      const __m512 v_odd = _mm512_castsi512_ps(_mm512_and_si512(pairs, high));
      float* even = s.acc[c] + (2 * r) * 16;
      float* odd = even + 16;
      _mm512_store_ps(even, _mm512_fmadd_ps(weight, v_even, _mm512_load_ps(even)));
      _mm512_store_ps(odd, _mm512_fmadd_ps(weight, v_odd, _mm512_load_ps(odd)));
    }
  }
}

void amx_decode_scale(AmxDecode& s, const float* factor) {
  for (int c = 0; c < s.dims / 32; ++c) {
    for (int m = 0; m < 2 * s.rows; ++m) {
      float* row = s.acc[c] + m * 16;
      _mm512_store_ps(row, _mm512_mul_ps(_mm512_load_ps(row), _mm512_set1_ps(factor[m / 2])));
    }
  }
}

void amx_decode_result(const AmxDecode& s, float* out) {
  const __m512i lo = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  const __m512i hi = _mm512_add_epi32(lo, _mm512_set1_epi32(8));
  for (int c = 0; c < s.dims / 32; ++c) {
    for (int r = 0; r < s.rows; ++r) {
      const __m512 even = _mm512_load_ps(s.acc[c] + (2 * r) * 16);
      const __m512 odd = _mm512_load_ps(s.acc[c] + (2 * r + 1) * 16);
      float* dst = out + size_t(r) * s.dims + 32 * c;
      _mm512_storeu_ps(dst, _mm512_permutex2var_ps(even, lo, odd));
      _mm512_storeu_ps(dst + 16, _mm512_permutex2var_ps(even, hi, odd));
    }
  }
}

}  // namespace pagedspec

#else  // not x86-64: no AMX; the kernels never call the tile functions (CpuConfig::amx is false)

#include <cstdlib>

namespace pagedspec {
bool amx_supported() { return false; }
void amx_pack_queries(const uint16_t* const*, int, int, uint16_t*) { std::abort(); }
void amx_begin() { std::abort(); }
void amx_end() { std::abort(); }
void amx_scores(const uint16_t*, int, const uint16_t* const*, int, int, float, float*, int) {
  std::abort();
}
void amx_accumulate(const float*, int, int, const uint16_t* const*, int, float*) { std::abort(); }
void amx_decode_begin(AmxDecode&, const uint16_t* const*, int, int) { std::abort(); }
void amx_decode_configure(int) { std::abort(); }
int amx_decode_prefetch_steps(int, int) { std::abort(); }
void amx_decode_scores(AmxDecode&, const uint16_t* const*, int, const AmxPrefetchStep&) {
  std::abort();
}
void amx_decode_read_scores(const AmxDecode&, int, float, float*, int, const AmxPrefetchStep&) {
  std::abort();
}
void amx_decode_weights(AmxDecode&, const float*, int, int, const AmxPrefetchStep&) {
  std::abort();
}
void amx_decode_accumulate(AmxDecode&, const uint16_t* const*, int, const AmxPrefetchStep&) {
  std::abort();
}
void amx_decode_accumulate_row(AmxDecode&, int, const float*, const uint16_t* const*, int, int) {
  std::abort();
}
void amx_decode_scale(AmxDecode&, const float*) { std::abort(); }
void amx_decode_result(const AmxDecode&, float*) { std::abort(); }
}  // namespace pagedspec

#endif
