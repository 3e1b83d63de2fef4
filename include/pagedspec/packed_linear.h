// The packed weight layout of pagedspec_models::packed_linear, the CPU model runner's product for
// a few rows (decode and verification steps), and the parameters its kernels take. Torch-free.
//
// A weight W [N, K] (out_features x in_features, as F.linear takes it) is stored as
// [N / kPackedRows][K / E][kPackedRows][E], E = kPackedChunkBytes / sizeof(element): block b
// holds rows 4 b .. 4 b + 3, chunk c of a block their elements E c .. E c + E - 1, one 64-byte
// cache line per row. A product reads one block at a time, its lines in address order: one
// sequential stream per thread, where F.linear's row-major rows read 16 at a time are 16 strided
// ones and oneDNN's layouts are made for larger products (bench/log/
// 2026-12-07-packed-linear-zen4.md).
#pragma once

#include <cstdint>

namespace pagedspec {

constexpr int kPackedRows = 4;         // weight rows per block
constexpr int kPackedRowsMultiple = 16;  // N must be a multiple: a kernel task's rows
constexpr int kPackedChunkBytes = 64;  // one cache line per row and chunk (K: a multiple of E)

// Elements of a chunk: 32 bf16 or 16 float32.
constexpr int packed_chunk_elems(int element_bytes) { return kPackedChunkBytes / element_bytes; }

enum class PackedLinearDtype { kFloat32, kBFloat16 };

// One validated call: out [M, N] = input [M, K] . W^T (+ bias [N]), every pointer contiguous and
// of `dtype` (bias may be null).
struct PackedLinearParams {
  const void* input;
  const void* weight;  // packed
  const void* bias;
  void* out;
  int64_t M, N, K;
  PackedLinearDtype dtype;
};

}  // namespace pagedspec
