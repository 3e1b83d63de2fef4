// Path (a task's), Task (one unit of work), RowInfo (where a row's query lives and what it may see) and the two
// row helpers the kernel's loop and epilogues share (scale_row, row_has_nan).
// A part of cpu/attention_impl.h, included only there, inside its namespaces.
#ifndef PAGEDSPEC_CPU_ATTENTION_PARTS
#error "a part of cpu/attention_impl.h, included only there: include that instead"
#endif

inline void scale_row(float* __restrict y, float a, int n) {
#pragma omp simd
  for (int i = 0; i < n; ++i) y[i] *= a;
}

// Whether a row of D query elements holds a NaN, from the bits (exponent all ones, mantissa not
// zero), so that it vectorizes the same for every element type and level. The epilogues make such
// a row's out, lse and attn_mass NaN, whatever a path's inner loops made of its NaN scores.
template <typename QT>
inline bool row_has_nan(const QT* row, int D) {
  if constexpr (sizeof(QT) == 4) {
    const uint32_t* bits = reinterpret_cast<const uint32_t*>(row);
    uint32_t worst = 0;
#pragma omp simd reduction(max : worst)
    for (int d = 0; d < D; ++d) worst = std::max(worst, bits[d] & 0x7fffffffu);
    return worst > 0x7f800000u;
  } else {
    static_assert(sizeof(QT) == 2, "half, bfloat16 or float queries");
    constexpr uint16_t kInf = std::is_same_v<QT, c10::Half> ? 0x7c00 : 0x7f80;
    const uint16_t* bits = reinterpret_cast<const uint16_t*>(row);
    uint16_t worst = 0;
#pragma omp simd reduction(max : worst)
    for (int d = 0; d < D; ++d) worst = std::max(worst, uint16_t(bits[d] & 0x7fff));
    return worst > kInf;
  }
}

// The paths a task's rows can take (CpuPagedAttention::choose_path picks one per task).
enum class Path : uint8_t {
  kFma,        // vector FMAs on float32 (every level, every dtype)
  kDot,        // AVX512-BF16 dot-product scores, the FMA path's P.V (bf16 queries)
  kAmx,        // AMX tile multiplies for scores and whole-tile P.V (opt-in, bf16 queries)
  kAmxDecode,  // AMX with accumulators kept in tiles, a plan item's heads at once (opt-in)
};

// One unit of work. Rows are numbered within the sequence as row = j * G + g for query token j
// and head g of the group, so the rows of one query token are adjacent.
struct Task {
  int seq;
  int kv_head;    // the first KV head
  int num_heads;  // KV heads [kv_head, kv_head + num_heads)
  int row_begin;
  int num_rows;
  int pos_begin;
  int pos_end;
  int partition;  // v2 partition index (0 for v1)
};

// Where a row's query lives and what it may see.
struct RowInfo {
  int token;  // index into query / out / lse
  int head;   // query head
  int limit;  // last visible position (inclusive)
};
