// AMX (Intel Advanced Matrix Extensions) bf16 tile multiplies for the CPU attention kernel's
// AVX-512 level: scores (q . k) and P.V for up to 32 query rows and 32 positions per call, where
// the AVX-512 FMA path is compute-bound (verification: q_len x group rows per KV head). Built in
// its own object (cpu/amx.cpp, with the AMX target) and called through these plain-typed
// functions.
// Torch-free: bf16 values are passed as their uint16 bit patterns.
#pragma once

#include <stdint.h>

namespace pagedspec {

constexpr int kAmxPositions = 16;  // key positions per tile multiply (tile rows)
constexpr int kAmxRows = 16;       // query rows per accumulator tile (tile columns)
constexpr int kAmxDims = 32;       // head dimensions per tile multiply (64 bytes of bf16)

// Whether the CPU has AMX-TILE and AMX-BF16 and the OS granted this process the tile data state
// (Linux arch_prctl, asked once).
bool amx_supported();
// Whether the AMX paths may run is CpuConfig::amx / amx_decode (cpu/isa.h).

// Query rows in the layout the tile multiply reads (VNNI pairs): for row block b, dimension pair
// p and row n, (q[16 b + n][2 p], q[16 b + n][2 p + 1]) at vnni[((b * D / 2 + p) * 16 + n) * 2].
// Rows past num_rows are zero. q_rows[r]: row r's D values; vnni: ceil(num_rows / 16) * 16 * D.
void amx_pack_queries(const uint16_t* const* q_rows, int num_rows, int D, uint16_t* vnni);

// Tile registers of the calling thread: configured by amx_begin for amx_scores and
// amx_accumulate, released by
// amx_end (one pair per task, not per call: configuring costs about as much as a multiply).
void amx_begin();
void amx_end();

// scores[r * score_stride + t] = scale * sum_d q[r][d] * k[t][d] (float32 accumulation of exact
// bf16 products) for rows r < num_rows and positions t < num_positions (<= 2 * kAmxPositions:
// two key tiles per call); rows and positions past those are not written. k[t]: the bf16 key
// rows (any addresses; each 16 read in place when equally spaced); D a multiple of kAmxDims, at
// most 256; num_rows <= 2 * kAmxRows.
void amx_scores(const uint16_t* vnni, int num_rows, const uint16_t* const* k, int num_positions,
                int D, float scale, float* scores, int score_stride);

// acc[r * D + d] += sum_t w[r * w_stride + t] * v[t][d] for rows r < num_rows over exactly
// kAmxTilePositions value rows v[t] (bf16; every one must be seen by every row: the caller keeps
// positions past a row's causal limit, and unused slots, out of this path), with the weights
// rounded to bf16 (round to nearest even) and float32 accumulation. The tiles read and write acc
// in whole blocks of 16 rows, so acc holds ceil(num_rows / 16) * 16 rows (those past num_rows
// get zero-weight sums). D a multiple of kAmxDims, at most 256; num_rows <= 2 * kAmxRows. Needs
// amx_begin.
constexpr int kAmxTilePositions = 32;  // value rows per tile multiply (64 bytes of bf16 weights)
void amx_accumulate(const float* w, int w_stride, int num_rows, const uint16_t* const* v, int D,
                    float* acc);

// The decode path: up to 16 query rows per state (a decode token's GQA group, or a chunk of a
// verification task's rows), where amx_scores / amx_accumulate's 16-row tiles waste most of the
// tile unit and their accumulator round trip per tile (store, reload at once: about 27 ns a
// tile) made them slower than FMAs at 4 rows. A task with more rows keeps several states.
// - P.V needs no repacking of V: a value tile is 16 positions x 32 dimensions read in place from
//   the cache, and the weight tile holds each row twice, (P, 0) and (0, P) per position pair of
//   bf16 slots, so that accumulator row 2 r + j gets the dimensions of parity j (half the
//   multiplies are by zero; the tile unit has room to spare, the cache reads do not).
// - The caller runs a tile's heads in three passes (all heads' scores, then their softmax and
//   weights, then their P.V), so that what vector code writes is loaded into tiles, and what
//   tiles store is read by vector code, a few heads later: the tile unit waits for stores that
//   have not reached the cache, and a head-after-head order stalled on every hand-over.
// - The accumulators stay in memory between tiles (AmxDecode::acc), where a softmax rescale is
//   a vector multiply.
// Tiles (amx_decode_configure), narrow states (R <= 8): tmm0-3 accumulators (one per 32
// dimensions: 2 R rows x 16 float32), tmm4 scores (16 positions x R rows of float32), tmm5 keys
// or values (16 positions x 32 bf16), tmm6 a query chunk (16 dimension pairs x R rows x 2 bf16),
// tmm7 weights (2 R rows x 16 positions x 2 bf16).
// Wide states (8 < R <= 16) take a verification task's rows in half as many states, so that
// each key tile, score tile and hand-over serves twice the rows: the queries are padded to 16
// rows (tmm4 and tmm6 are then 16 x 64 bytes), tmm6 holds rows 0-7's weights in P.V and tmm7
// rows 8 .. R - 1's, and the accumulators of two chunks of 32 dimensions are in tiles at a time
// (tmm0 / tmm1 rows 0-7, tmm2 / tmm3 rows 8 .. R - 1), loaded and stored once per such pair.
constexpr int kAmxDecodeNarrowRows = 8;  // a narrow state's query rows (2 accumulator rows each)
constexpr int kAmxDecodeMaxRows = 16;    // a wide state's
constexpr int kAmxDecodeMaxDims = 128;   // head size: 4 chunks of 32 dimensions
constexpr int kAmxDecodePositions = 32;  // positions per call (two tile multiplies of 16)

// Up to kAmxDecodeMaxRows rows of one head (about 26 KB).
struct alignas(64) AmxDecode {
  int rows = 0, dims = 0;
  int cols = 0;  // query columns of the query and score tiles: rows, or 16 for a wide state
  // Queries in VNNI pairs per chunk of 32 dimensions: q[c][(p * cols + n) * 2 + i] =
  // q_row[n][32 c + 2 p + i] (rows from `rows` to `cols` zero).
  alignas(64) uint16_t q[kAmxDecodeMaxDims / 32][16 * kAmxDecodeMaxRows * 2];
  alignas(64) float scores[2][16 * kAmxDecodeMaxRows];      // per 16 positions: [position][col]
  alignas(64) uint32_t weights[2][2 * kAmxDecodeMaxRows * 16];  // per 16: [2 r + j][position]
  // Per 16 positions, their rows where not equally spaced (zero padded).
  alignas(64) uint16_t gathered[2][16 * kAmxDecodeMaxDims];
  // The accumulators: acc[c][(2 r + j) * 16 + n] is dimension 32 c + 2 n + j of row r (a narrow
  // state's tile c is rows 0 .. 2 R - 1; a wide state's tiles of chunk c start at rows 0 and 16).
  alignas(64) float acc[kAmxDecodeMaxDims / 32][2 * kAmxDecodeMaxRows * 16];
};

// The caller's software prefetch of the next tile, advanced by the decode functions between
// their tile operations (after each multiply, before each half's vector work), so that the cache
// lines stream in while the tile unit and the vector code work. Issued between whole calls
// instead, each step's burst of prefetches filled the core's miss queue and stalled it, and the
// memory sat idle during the compute that followed: the op took the stream's time plus the
// compute's, not the larger of the two.
struct AmxPrefetchStep {
  void (*advance)(void* ctx) = nullptr;
  void* ctx = nullptr;
  void operator()() const {
    if (advance != nullptr) advance(ctx);
  }
};
// The steps amx_decode_scores, _read_scores, _weights and _accumulate take together for one
// state over n positions of head size D.
int amx_decode_prefetch_steps(int D, int n);

// Packs the rows (R <= kAmxDecodeMaxRows rows of D bf16, D a multiple of 32 and at most
// kAmxDecodeMaxDims) and zeroes the accumulators.
void amx_decode_begin(AmxDecode& s, const uint16_t* const* q_rows, int R, int D);
// Configures the calling thread's tiles for R rows (released by amx_end).
void amx_decode_configure(int R);
// Scores q[r] . k[t] for t < n <= kAmxDecodePositions (float32 accumulation of exact bf16
// products), kept in s; k[t]: key rows, read in place where each 16 are equally spaced.
void amx_decode_scores(AmxDecode& s, const uint16_t* const* k, int n,
                       const AmxPrefetchStep& step);
// w[r * w_stride + t] = scale * those scores, for t < n rounded up to 16 (entries from n on hold
// the score of a zero key; callers mask them).
void amx_decode_read_scores(const AmxDecode& s, int n, float scale, float* w, int w_stride,
                            const AmxPrefetchStep& step);
// The weight tiles from w[r * w_stride + t], t < n rounded up to 16, rounded to bf16 (round to
// nearest even); the entries from n on must be 0.
void amx_decode_weights(AmxDecode& s, const float* w, int w_stride, int n,
                        const AmxPrefetchStep& step);
// Accumulators += those weights . v[t] over t < n <= kAmxDecodePositions (slots from n to the
// next multiple of 16 meet zero rows, never the cache).
void amx_decode_accumulate(AmxDecode& s, const uint16_t* const* v, int n,
                           const AmxPrefetchStep& step);
// Accumulator row r += w[t] * v[t] over t in [first, end) with vector FMAs, the weights rounded
// to bf16 as the tiles round them: for positions some rows of the state must not see, whose
// values may not enter a tile multiply (a zero weight times an inf or NaN value is NaN).
void amx_decode_accumulate_row(AmxDecode& s, int r, const float* w, const uint16_t* const* v,
                               int first, int end);
// Accumulator row r *= factor[r] (an online-softmax rescale).
void amx_decode_scale(AmxDecode& s, const float* factor);
// out[r * D + d] = the accumulated sum of row r, dimension d.
void amx_decode_result(const AmxDecode& s, float* out);

}  // namespace pagedspec
