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
// Whether the AMX path may run now: amx_supported() and PAGEDSPEC_CPU_AMX is not 0 (read at every
// call, so tests can compare both paths; the AMX path also needs the avx512 level).
bool amx_available();

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

}  // namespace pagedspec
