// The kernel's sizes and per-path thresholds (tile, rows per task, row and key blocks, where the
// AMX, packed and lane paths start) and LineAligned: what every path and the path choice
// (workspace.h) read, in one place so that a threshold is tuned beside its measurement.
// A part of cpu/attention_impl.h, included only there, inside its namespaces.
#ifndef PAGEDSPEC_CPU_ATTENTION_PARTS
#error "a part of cpu/attention_impl.h, included only there: include that instead"
#endif

// A std::vector allocator on cache-line boundaries, for buffers that 64-byte stores and tile
// loads go through row by row: a row across two lines costs two accesses.
template <typename T>
struct LineAligned {
  using value_type = T;
  LineAligned() = default;
  template <typename U>
  LineAligned(const LineAligned<U>&) {}
  T* allocate(size_t n) {
    return static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t(64)));
  }
  void deallocate(T* p, size_t) { ::operator delete(p, std::align_val_t(64)); }
  friend bool operator==(const LineAligned&, const LineAligned&) { return true; }
  friend bool operator!=(const LineAligned&, const LineAligned&) { return false; }
};

constexpr int kDefaultTile = 32;  // positions per tile (CpuPagedAttention::kTile)
constexpr int kMaxRows = kCpuAttentionRows;  // query rows (tokens x heads of a group) per task
constexpr int kMassTile = 256; // positions per attn_mass task
// Rows from which the AVX-512 level scores bf16 tiles with AMX tile multiplies (cpu/amx.h): a
// tile multiply computes 16 rows whatever the count, so below this the FMA path is as fast.
constexpr int kAmxMinRows = 8;
static_assert(kDefaultTile == kAmxTilePositions, "amx_accumulate takes one whole tile of values");
static_assert(kDefaultTile == kAmxDecodePositions, "the AMX decode calls take one tile");
// Rows from which the dot path scores FP8 codes through a packed K tile (score_tile_packed): its
// transposition costs a position as much as the sums of 4 x 4 blocks of 512-bit products for
// about 6 rows (D = 128), and 4-row decode tasks measured 5-10% slower through it than through
// those blocks (EPYC-VM, bf16), which score_tile_lanes has since replaced.
constexpr int kPackedMinRows = 8;
// Rows up to which the dot path scores bf16 rows through score_tile_lanes instead, which reads
// a task's K rows once per 4 rows (EPYC-VM, 1 thread): at 8 rows (decode at group 8, B=1
// ctx=4096) it beat the packed tile, 1.12-1.21 against 1.26-1.28 ms; at 12 rows (3 tokens at
// group 4, B=8 ctx=2048) it lost, 8.5 against 7.7-8.2.
constexpr int kLanesMaxRows = 8;
constexpr int kPackedGroup = 16;     // positions per group of the packed tile (a score register)
constexpr int kPackedStepPairs = 4;  // a head's bf16 pairs per prefetch step of score_rows_packed
// The AMX decode path raises a row's running max only when a tile's scores exceed it by more
// than this (log2 domain): weights up to 2^8 are exact enough in bf16 and float32 sums, and the
// accumulators, which live in tile layout, are rescaled about once per task instead of per tile.
constexpr float kAmxDecodeMaxSlack = 8.0f;
// The AMX decode path's tile states per task: enough for a task's kMaxRows rows.
constexpr int kAmxDecodeChunks = (kMaxRows + kAmxDecodeMaxRows - 1) / kAmxDecodeMaxRows;
// Query rows per score and value block. Each accumulator is one FMA latency chain, and two FMA
// pipes of 5-cycle latency (Zen 2) need 10 chains to stay busy: AVX2 takes 5 rows (5 x 2 score
// accumulators beside 4 key vectors and a query vector, 5 x 2 value accumulators), so a
// verification step's FMAs are no longer latency-bound at 80% of peak there; AVX-512 keeps 4
// (16 score accumulators).
constexpr int kRowBlock = PAGEDSPEC_CPU_LEVEL == 1 ? 5 : 4;
// Key rows per score block: with kRowBlock query rows, 16 (AVX-512, baseline: 4 x 4) or 10
// (AVX2: 5 x 2 in 16 registers) accumulators.
constexpr int kScoreTokens = PAGEDSPEC_CPU_LEVEL == 1 ? 2 : 4;
// Register vectors of a key row read per step (load_regs): AVX2 reads 16 elements at a time, so
// that a bf16 row takes one load per 16 (CacheReader::load_pair); every head size is a multiple
// of 16.
constexpr int kScoreStep = PAGEDSPEC_CPU_LEVEL == 1 ? 2 : 1;
// ... and per cache element type: bf16 rows at AVX-512 in steps of one load_pair too (32
// elements in even/odd order, a row's last 16 at D = 80, 112 as one natural vector); the other
// types there one vector a step.
template <typename Reader>
constexpr int kRowStep = Reader::kEvenOddPairs ? 2 : kScoreStep;
