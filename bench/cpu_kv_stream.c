// How fast one core can read a paged KV cache in the orders an attention kernel may walk it, with
// no attention arithmetic: the memory side of the CPU decode bound (bench/NOTES.md).
//
// The caches are K and V of [blocks, 16, 8 heads, 128] bf16 (the contract's layout), 8
// sequences of 2048 positions (64 MiB in all), blocks shuffled as a block table would. Each
// pattern reads every (position, head) row of K and V once:
//   per-head        one head's positions in order, then the next head; each row prefetched
//                   `ahead` positions before it is read (0: none).
//   tile-heads      tiles of `tile` positions; within a tile, head after head, K rows then V
//                   rows; each head's next-tile K rows and this tile's V rows prefetched as its
//                   K rows are read (the kernel's order before its tiles took every head).
//   tile-address    as tile-heads, but the next tile's cache tokens (every head, K and V) are
//                   prefetched in address order, a few lines per row read (the kernel's order).
//   tokens          positions in order, every head of a position at once (plain streaming).
// `work` adds that many rounds of 10 independent FMAs after each row, to see whether the reads
// hide under arithmetic.
//
// Build and run (one core, nothing else running):
//   gcc -O2 -mavx2 -mfma -o /tmp/cpu_kv_stream bench/cpu_kv_stream.c
//   taskset -c 0 /tmp/cpu_kv_stream [work] [resident_blocks]
// resident_blocks > 0 maps every block to one of that many, so the same walk runs from cache.
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

enum { kBlock = 16, kHeads = 8, kDim = 128, kSeqs = 8, kCtx = 2048 };

static uint16_t *key_cache, *value_cache;
static int* block_table;  // [kSeqs, kCtx / kBlock]
static int work_rounds;

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

static const uint16_t* row(const uint16_t* cache, int seq, int pos, int head) {
  const size_t block = (size_t)block_table[seq * (kCtx / kBlock) + pos / kBlock];
  return cache + ((block * kBlock + pos % kBlock) * kHeads + head) * kDim;
}

// Reads one 256-byte row into the running sum, then the optional arithmetic.
static __m256i read_row(const uint16_t* r, __m256i acc) {
  for (int i = 0; i < kDim; i += 16) {
    acc = _mm256_add_epi16(acc, _mm256_loadu_si256((const __m256i*)(r + i)));
  }
  if (work_rounds == 0) return acc;
  __m256 x[10];
  for (int i = 0; i < 10; ++i) x[i] = _mm256_castsi256_ps(acc);
  for (int w = 0; w < work_rounds; ++w) {
    for (int i = 0; i < 10; ++i) x[i] = _mm256_fmadd_ps(x[i], x[i], x[i]);
  }
  for (int i = 1; i < 10; ++i) x[0] = _mm256_add_ps(x[0], x[i]);
  return _mm256_castps_si256(x[0]);
}

static void prefetch_bytes(const void* p, int bytes) {
  for (int off = 0; off < bytes; off += 64) __builtin_prefetch((const char*)p + off, 0, 2);
}

static __m256i per_head(int ahead) {
  __m256i acc = _mm256_setzero_si256();
  for (int s = 0; s < kSeqs; ++s) {
    for (int h = 0; h < kHeads; ++h) {
      for (int p = 0; p < kCtx; ++p) {
        if (ahead > 0 && p + ahead < kCtx) {
          prefetch_bytes(row(key_cache, s, p + ahead, h), 2 * kDim);
          prefetch_bytes(row(value_cache, s, p + ahead, h), 2 * kDim);
        }
        acc = read_row(row(key_cache, s, p, h), acc);
        acc = read_row(row(value_cache, s, p, h), acc);
      }
    }
  }
  return acc;
}

static __m256i tile_heads(int tile, int address_order) {
  __m256i acc = _mm256_setzero_si256();
  const int lines_per_token = kHeads * 2 * kDim / 64;
  for (int s = 0; s < kSeqs; ++s) {
    for (int p0 = 0; p0 < kCtx; p0 += tile) {
      const int next = p0 + tile;
      int line = 0;  // address_order: the next tile's lines asked for so far
      for (int h = 0; h < kHeads; ++h) {
        for (int p = p0; p < p0 + tile; ++p) {
          if (next < kCtx && address_order) {
            for (int i = 0; i < 4 && line < tile * lines_per_token; ++i, ++line) {
              const int pos = next + line / lines_per_token;
              const int in_token = (line % lines_per_token) * 64;
              __builtin_prefetch((const char*)row(key_cache, s, pos, 0) + in_token, 0, 2);
              __builtin_prefetch((const char*)row(value_cache, s, pos, 0) + in_token, 0, 2);
            }
          } else if (!address_order) {
            if (next < kCtx) prefetch_bytes(row(key_cache, s, p + tile, h), 2 * kDim);
            prefetch_bytes(row(value_cache, s, p, h), 2 * kDim);
          }
          acc = read_row(row(key_cache, s, p, h), acc);
        }
        for (int p = p0; p < p0 + tile; ++p) acc = read_row(row(value_cache, s, p, h), acc);
      }
    }
  }
  return acc;
}

static __m256i tokens(void) {
  __m256i acc = _mm256_setzero_si256();
  for (int s = 0; s < kSeqs; ++s) {
    for (int p = 0; p < kCtx; ++p) {
      for (int h = 0; h < kHeads; ++h) {
        acc = read_row(row(key_cache, s, p, h), acc);
        acc = read_row(row(value_cache, s, p, h), acc);
      }
    }
  }
  return acc;
}

int main(int argc, char** argv) {
  work_rounds = argc > 1 ? atoi(argv[1]) : 0;
  const int resident = argc > 2 ? atoi(argv[2]) : 0;
  const int blocks = kSeqs * kCtx / kBlock;
  const size_t elems = (size_t)blocks * kBlock * kHeads * kDim;
  key_cache = aligned_alloc(4096, elems * 2);
  value_cache = aligned_alloc(4096, elems * 2);
  block_table = malloc(sizeof(int) * blocks);
  if (!key_cache || !value_cache || !block_table) return 1;
  memset(key_cache, 1, elems * 2);
  memset(value_cache, 1, elems * 2);
  srand(1);
  for (int i = 0; i < blocks; ++i) block_table[i] = i;
  for (int i = blocks - 1; i > 0; --i) {
    const int j = rand() % (i + 1), t = block_table[i];
    block_table[i] = block_table[j];
    block_table[j] = t;
  }
  if (resident > 0) {
    for (int i = 0; i < blocks; ++i) block_table[i] %= resident;
  }
  struct {
    const char* name;
    int kind, arg;
  } cases[] = {{"per-head ahead=0", 0, 0},    {"per-head ahead=4", 0, 4},
               {"per-head ahead=16", 0, 16},  {"tile-heads tile=16", 1, 16},
               {"tile-heads tile=32", 1, 32}, {"tile-address tile=16", 2, 16},
               {"tile-address tile=32", 2, 32}, {"tokens", 3, 0}};
  const double bytes = 2.0 * elems * 2;
  int sink = 0;
  printf("work=%d resident_blocks=%d: best of 5\n", work_rounds, resident);
  for (size_t c = 0; c < sizeof cases / sizeof cases[0]; ++c) {
    double best = 1e30;
    for (int r = 0; r < 5; ++r) {
      const double t0 = now();
      __m256i acc;
      switch (cases[c].kind) {
        case 0: acc = per_head(cases[c].arg); break;
        case 1: acc = tile_heads(cases[c].arg, 0); break;
        case 2: acc = tile_heads(cases[c].arg, 1); break;
        default: acc = tokens(); break;
      }
      const double t = now() - t0;
      best = t < best ? t : best;
      sink += _mm256_extract_epi16(acc, 0);
    }
    printf("%-22s %7.2f ms %6.1f GB/s %6.1f ns per (position, head)\n", cases[c].name,
           best * 1e3, bytes / best / 1e9, best * 1e9 / ((double)kSeqs * kCtx * kHeads));
  }
  return sink == 12345;  // keeps the reads
}
