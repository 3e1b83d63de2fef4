// CPU kernels for paged_attention_v1 / paged_attention_v2 / paged_attention.
//
// A task is (sequence, KV head, chunk of query rows, range of positions). Its query rows are all
// query tokens x all query heads of that KV head's group, so each K/V row is read from memory
// once per task and used by every row. Positions are walked in tiles of kTile: K rows are read
// straight from the cache and decoded in registers (CacheReader: bf16/fp16 conversions, FP8 as
// exactly CacheCodec::decode), scored against the rows in 4-row x 4-position blocks, folded into
// each row's online-softmax state (include/pagedspec/attention.h, the same helpers as the CUDA
// kernels), then the V rows are decoded and accumulated with the weights. What a row may not see
// (past its causal limit, or past seq_len) never enters its softmax or its accumulator, not even
// with a zero weight, so inf or NaN in unused slots or in a later draft token cannot reach it.
// The next tile's K rows and this tile's V rows are prefetched while scoring (the rows are
// scattered by the block table, so the hardware prefetchers cannot run ahead).
//
// v1: one task per (sequence, KV head, row chunk) over the whole context.
// v2: one task per (sequence, KV head, row chunk, partition of kPartitionSize positions) writing
//     a partial (acc, max, sum), then a merge over partitions with merge_softmax.
// attn_mass: a separate pass after the final LSE is known (see mass_pass), so the fast path pays
//     nothing for it.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <limits>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
// GCC 12's AVX-512 intrinsics build their pass-through operand with _mm512_undefined_ps()
// (`__m512 __Y = __Y;`), which -Wall reports as uninitialized at every inlined use.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#endif

#include "attention_checks.h"
#include "cpu/cpu_types.h"
#include "pagedspec/attention.h"
#include "pagedspec/attention_plan.h"

namespace pagedspec {
namespace {

constexpr int kTile = 32;      // positions decoded and scored together
constexpr int kMaxRows = kCpuAttentionRows;  // query rows (tokens x heads of a group) per task
constexpr int kMassTile = 256; // positions per attn_mass task
constexpr int kScoreTokens = 4; // key rows per score block (with 4 query rows: 16 dot products)

// 16-float vectors: AVX-512 registers when the build has them, otherwise arrays the compiler
// vectorizes for whatever it targets. Every supported head size is a multiple of 16.
constexpr int kLanes = 16;
#if defined(__AVX512F__)
using vfloat = __m512;
inline vfloat vload(const float* p) { return _mm512_loadu_ps(p); }
inline void vstore(float* p, vfloat v) { _mm512_storeu_ps(p, v); }
inline vfloat vzero() { return _mm512_setzero_ps(); }
inline vfloat vset1(float x) { return _mm512_set1_ps(x); }
inline vfloat vfma(vfloat a, vfloat b, vfloat c) { return _mm512_fmadd_ps(a, b, c); }
inline vfloat vadd(vfloat a, vfloat b) { return _mm512_add_ps(a, b); }
inline float vsum(vfloat v) {
  // Halves, quarters, pairs, lanes (GCC 12's _mm512_reduce_add_ps warns under -Wall).
  v = _mm512_add_ps(v, _mm512_shuffle_f32x4(v, v, 0x4E));
  v = _mm512_add_ps(v, _mm512_shuffle_f32x4(v, v, 0xB1));
  v = _mm512_add_ps(v, _mm512_permute_ps(v, 0x4E));
  v = _mm512_add_ps(v, _mm512_permute_ps(v, 0xB1));
  return _mm512_cvtss_f32(v);
}
#else
struct vfloat {
  float v[kLanes];
};
inline vfloat vload(const float* p) {
  vfloat r;
  for (int i = 0; i < kLanes; ++i) r.v[i] = p[i];
  return r;
}
inline void vstore(float* p, vfloat x) {
  for (int i = 0; i < kLanes; ++i) p[i] = x.v[i];
}
inline vfloat vset1(float x) {
  vfloat r;
  for (int i = 0; i < kLanes; ++i) r.v[i] = x;
  return r;
}
inline vfloat vzero() { return vset1(0.0f); }
inline vfloat vfma(vfloat a, vfloat b, vfloat c) {
  for (int i = 0; i < kLanes; ++i) c.v[i] += a.v[i] * b.v[i];
  return c;
}
inline vfloat vadd(vfloat a, vfloat b) {
  for (int i = 0; i < kLanes; ++i) a.v[i] += b.v[i];
  return a;
}
inline float vsum(vfloat x) {
  for (int w = kLanes / 2; w > 0; w /= 2) {
    for (int i = 0; i < w; ++i) x.v[i] += x.v[i + w];
  }
  return x.v[0];
}
#endif

// w[i] = exp2(w[i] - max) for i < n (the softmax weights of a tile); returns their sum. Lanes
// from n up to the next multiple of 16 are set to 0. The AVX-512 path evaluates 2^x as
// 2^round(x) * p(x - round(x)) with p the degree-7 Taylor polynomial of e^(f ln 2) on |f| <= 1/2
// (truncation error < 6e-9, below float rounding); elsewhere it is the scalar softmax_exp2.
inline float exp2_weights(float* w, int n, float max) {
#if defined(__AVX512F__)
  constexpr float c[8] = {1.0f,          0.69314718f,   0.24022651f,  0.055504109f,
                          0.0096181291f, 0.0013333558f, 1.5403530e-4f, 1.5252734e-5f};
  __m512 total = _mm512_setzero_ps();
  const __m512 vmax = _mm512_set1_ps(max);
  for (int i = 0; i < n; i += kLanes) {
    __m512 x = _mm512_sub_ps(_mm512_loadu_ps(w + i), vmax);
    x = _mm512_max_ps(x, _mm512_set1_ps(-150.0f));
    const __m512 k = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(x, k);
    __m512 p = _mm512_set1_ps(c[7]);
    for (int j = 6; j >= 0; --j) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(c[j]));
    const __mmask16 live = n - i >= kLanes ? __mmask16(0xFFFF) : __mmask16((1u << (n - i)) - 1);
    const __m512 e = _mm512_maskz_mov_ps(live, _mm512_scalef_ps(p, k));
    _mm512_storeu_ps(w + i, e);
    total = _mm512_add_ps(total, e);
  }
  return vsum(total);
#else
  float sum = 0.0f;
  for (int i = 0; i < n; ++i) {
    w[i] = softmax_exp2(w[i] - max);
    sum += w[i];
  }
  for (int i = n; i % kLanes != 0; ++i) w[i] = 0.0f;
  return sum;
#endif
}

// Reads 16 cache elements as floats, exactly as CacheCodec::decode(code, scale) (FP8) or
// ScalarConvert (native) would. Without AVX-512, FP8 codes are looked up in a per-head table of
// CacheCodec::decode. With AVX-512: bf16 is a 16-bit shift and fp16 the hardware conversion; an
// e5m2 code is the top byte of the fp16 with the same value; an e4m3 code's 7 magnitude bits
// shifted left by 7 (sign to bit 15) form the fp16 of value * 2^-8, subnormals included, so
// fp16 -> float times (scale * 2^8) rounds exactly as value * scale does. The one e4m3 code
// with no image there, NaN (S.1111.111), is patched in.
template <typename CacheT, CacheFormat F>
struct CacheReader {
  float table[256];
  float scale;

  void init(float s) {
    scale = s;
    if constexpr (F != CacheFormat::kNative) {
      for (int c = 0; c < 256; ++c) table[c] = CacheCodec<uint8_t, F>::decode(uint8_t(c), s);
    }
  }

  vfloat load16(const CacheT* __restrict p) const {
#if defined(__AVX512F__)
    if constexpr (std::is_same_v<CacheT, float>) {
      return _mm512_loadu_ps(p);
    } else if constexpr (std::is_same_v<CacheT, c10::BFloat16>) {
      const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
      return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
    } else if constexpr (std::is_same_v<CacheT, c10::Half>) {
      return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    }
#if defined(__AVX512BW__) && defined(__AVX512VL__)
    if constexpr (F == CacheFormat::kE5M2) {
      const __m256i codes = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
      return _mm512_mul_ps(_mm512_cvtph_ps(_mm256_slli_epi16(codes, 8)), _mm512_set1_ps(scale));
    } else if constexpr (F == CacheFormat::kE4M3) {
      const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
      const __m256i codes = _mm256_cvtepu8_epi16(raw);
      const __m256i magnitude = _mm256_slli_epi16(_mm256_and_si256(codes, _mm256_set1_epi16(0x7F)), 7);
      const __m256i sign = _mm256_slli_epi16(_mm256_and_si256(codes, _mm256_set1_epi16(0x80)), 8);
      const __m512 value = _mm512_mul_ps(_mm512_cvtph_ps(_mm256_or_si256(magnitude, sign)),
                                         _mm512_set1_ps(scale * 256.0f));
      const __mmask16 nan =
          _mm_cmpeq_epi8_mask(_mm_and_si128(raw, _mm_set1_epi8(0x7F)), _mm_set1_epi8(0x7F));
      return _mm512_mask_mov_ps(value, nan, _mm512_set1_ps(__builtin_nanf("")));
    }
#endif
#endif
    alignas(64) float tmp[kLanes];
    if constexpr (F == CacheFormat::kNative) {
      for (int i = 0; i < kLanes; ++i) tmp[i] = ScalarConvert<CacheT>::to_float(p[i]);
    } else {
      for (int i = 0; i < kLanes; ++i) tmp[i] = table[p[i]];
    }
    return vload(tmp);
  }
};

#if defined(__AVX512F__)
// Horizontal sums of 16 vectors at once: lane i of the result is the sum of x[i]'s lanes. Each
// level adds the two halves of every input's live lanes while packing two inputs into one
// vector (16 -> 8 -> 4 -> 2 -> 1 live lanes per input): 30 permutes and 15 adds for 16 sums,
// against 8 operations per sum for one reduction at a time.
struct Sum16Tables {
  alignas(64) int lo[4][16];
  alignas(64) int hi[4][16];
};

constexpr Sum16Tables make_sum16_tables() {
  Sum16Tables t{};
  int live = 16;
  for (int level = 0; level < 4; ++level) {
    live /= 2;
    const int per_operand = 16 / (2 * live);  // inputs each operand holds at this level
    // Output lane j: input j / live of the pair (the first operand's, then the second's), its
    // lane j % live plus the lane `live` above it.
    for (int j = 0; j < 16; ++j) {
      const int input = j / live;
      const int src = (input % per_operand) * 2 * live + j % live + (input >= per_operand ? 16 : 0);
      t.lo[level][j] = src;
      t.hi[level][j] = src + live;
    }
  }
  return t;
}

inline __m512 sum16(const __m512* x) {
  static constexpr Sum16Tables kTables = make_sum16_tables();
  __m512 v[16];
  for (int i = 0; i < 16; ++i) v[i] = x[i];
  for (int level = 0, n = 16; n > 1; ++level, n /= 2) {
    const __m512i lo = _mm512_load_si512(kTables.lo[level]);
    const __m512i hi = _mm512_load_si512(kTables.hi[level]);
    for (int i = 0; i < n / 2; ++i) {
      v[i] = _mm512_add_ps(_mm512_permutex2var_ps(v[2 * i], lo, v[2 * i + 1]),
                           _mm512_permutex2var_ps(v[2 * i], hi, v[2 * i + 1]));
    }
  }
  return v[0];
}
#endif

// out[r * NT + t] = q[r] . k[t] for NR query rows (stride D) and NT key rows read straight from
// the cache: each key vector is decoded once for all NR rows, each query vector loaded once for
// all NT keys.
template <int NR, int NT, typename CacheT, CacheFormat F>
inline void score_block(const float* __restrict q, const CacheT* const* k,
                        const CacheReader<CacheT, F>& reader, int D, float* out) {
  vfloat acc[NR][NT];
  for (int r = 0; r < NR; ++r) {
    for (int t = 0; t < NT; ++t) acc[r][t] = vzero();
  }
  for (int d = 0; d < D; d += kLanes) {
    vfloat kv[NT];
    for (int t = 0; t < NT; ++t) kv[t] = reader.load16(k[t] + d);
    for (int r = 0; r < NR; ++r) {
      const vfloat qv = vload(q + r * D + d);
      for (int t = 0; t < NT; ++t) acc[r][t] = vfma(qv, kv[t], acc[r][t]);
    }
  }
#if defined(__AVX512F__)
  if constexpr (NR * NT == 16) {
    _mm512_storeu_ps(out, sum16(&acc[0][0]));
    return;
  }
#endif
  for (int r = 0; r < NR; ++r) {
    for (int t = 0; t < NT; ++t) out[r * NT + t] = vsum(acc[r][t]);
  }
}

// acc[r] += sum_t w[r][t] * v[t] for NR rows (acc stride D, w stride kTile) over n value rows
// read straight from the cache. The accumulators stay in registers across the rows and each V
// vector is decoded once for all NR rows.
template <int NR, typename CacheT, CacheFormat F>
inline void accumulate_block(float* __restrict acc, const float* __restrict w,
                             const CacheT* const* v, const CacheReader<CacheT, F>& reader, int n,
                             int D, int w_stride) {
  for (int d = 0; d < D; d += kLanes) {
    // Two accumulators per row (even and odd positions) so that, with few rows, the FMA latency
    // chains are not what limits the loop.
    vfloat a[NR], b[NR];
    for (int r = 0; r < NR; ++r) {
      a[r] = vload(acc + r * D + d);
      b[r] = vzero();
    }
    int t = 0;
    for (; t + 2 <= n; t += 2) {
      const vfloat v0 = reader.load16(v[t] + d);
      const vfloat v1 = reader.load16(v[t + 1] + d);
      for (int r = 0; r < NR; ++r) {
        a[r] = vfma(vset1(w[r * w_stride + t]), v0, a[r]);
        b[r] = vfma(vset1(w[r * w_stride + t + 1]), v1, b[r]);
      }
    }
    if (t < n) {
      const vfloat v0 = reader.load16(v[t] + d);
      for (int r = 0; r < NR; ++r) a[r] = vfma(vset1(w[r * w_stride + t]), v0, a[r]);
    }
    for (int r = 0; r < NR; ++r) vstore(acc + r * D + d, vadd(a[r], b[r]));
  }
}

// Asks for the cache lines of `bytes` bytes at `ptr`. Each (position, KV head) row is only
// D * elem_size bytes, scattered by the block table, so the hardware prefetchers cannot run ahead;
// the kernel prefetches a tile ahead instead.
inline void prefetch_row(const void* ptr, int bytes) {
  const char* p = static_cast<const char*>(ptr);
  for (int off = 0; off < bytes; off += 64) __builtin_prefetch(p + off, 0, 2);
}

inline void scale_row(float* __restrict y, float a, int n) {
#pragma omp simd
  for (int i = 0; i < n; ++i) y[i] *= a;
}

// One unit of work. Rows are numbered within the sequence as row = j * G + g for query token j
// and head g of the group, so the rows of one query token are adjacent.
struct Task {
  int seq;
  int kv_head;
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

template <typename QT, typename CacheT, CacheFormat F>
class CpuPagedAttention {
 public:
  explicit CpuPagedAttention(const PagedAttentionParams<QT, CacheT>& p) : p_(p) {}

  RowInfo row_info(int seq, int kv_head, int row) const {
    const int G = p_.group_size();
    const int first = p_.cu_seqlens_q[seq];
    const int q_len = p_.cu_seqlens_q[seq + 1] - first;
    const int j = row / G;
    return RowInfo{first + j, kv_head * G + row % G, causal_limit(p_.seq_lens[seq], q_len, j)};
  }

  // Per-thread scratch, sized once per parallel_for chunk.
  struct Workspace {
    std::vector<float> q, acc, w;
    std::vector<RowInfo> rows;
    std::vector<SoftmaxState> state;
    std::vector<int> visible;
    const CacheT* krows[kTile];
    const CacheT* vrows[kTile];
    const CacheT* next_krows[kTile];  // null past the end
    CacheReader<CacheT, F> kreader, vreader;

    explicit Workspace(int D)
        : q(size_t(kMaxRows) * D), acc(size_t(kMaxRows) * D), w(size_t(kMaxRows) * kTile),
          rows(kMaxRows), state(kMaxRows), visible(kMaxRows) {}
  };

  // Loads the task's query rows, scaled into the log2 domain.
  void load_queries(const Task& task, Workspace& ws) const {
    const int D = p_.head_size;
    const float q_scale = p_.scale * kLog2e;
    for (int r = 0; r < task.num_rows; ++r) {
      const RowInfo info = row_info(task.seq, task.kv_head, task.row_begin + r);
      ws.rows[r] = info;
      const QT* src = p_.query + int64_t(info.token) * p_.q_token_stride +
                      int64_t(info.head) * p_.q_head_stride;
      float* dst = ws.q.data() + size_t(r) * D;
#pragma omp simd
      for (int d = 0; d < D; ++d) dst[d] = ScalarConvert<QT>::to_float(src[d]) * q_scale;
    }
  }

  // Locates the tile's n K and V rows and the next tile's K rows (prefetched while this tile is
  // scored), and counts what each row may see of this tile.
  void locate_tile(const Task& task, Workspace& ws, int start, int n, int next_n) const {
    for (int t = 0; t < n; ++t) {
      const int64_t off = p_.cache_offset(task.seq, start + t, task.kv_head);
      ws.krows[t] = p_.key_cache + off;
      ws.vrows[t] = p_.value_cache + off;
    }
    for (int t = 0; t < kTile; ++t) {
      ws.next_krows[t] = t < next_n
          ? p_.key_cache + p_.cache_offset(task.seq, start + kTile + t, task.kv_head)
          : nullptr;
    }
    for (int r = 0; r < task.num_rows; ++r) {
      ws.visible[r] = std::clamp(ws.rows[r].limit - start + 1, 0, n);
    }
  }

  // ws.w[r][t] = q[r] . k[t] for every row and every position it may see, blocks of four rows
  // and kScoreTokens positions. Rows ascend in query token, so the last row of a group sees the most.
  void score_tile(int R, Workspace& ws, bool want_values) const {
    const int D = p_.head_size;
    const int row_bytes = D * int(sizeof(CacheT));
    for (int r0 = 0; r0 < R; r0 += 4) {
      const int nr = std::min(4, R - r0);
      const int group_visible = ws.visible[r0 + nr - 1];
      with_rows(nr, [&](auto NR) {
        float out[4 * kScoreTokens];
        const float* q = ws.q.data() + size_t(r0) * D;
        int t = 0;
        for (; t + kScoreTokens <= group_visible; t += kScoreTokens) {
          if (r0 == 0) {
            // Prefetches interleaved with the work keep a steady number of misses in flight:
            // this tile's V rows (read after the scores) and the next tile's K rows.
            for (int i = t; i < t + kScoreTokens; ++i) {
              if (want_values) prefetch_row(ws.vrows[i], row_bytes);
              if (ws.next_krows[i] != nullptr) prefetch_row(ws.next_krows[i], row_bytes);
            }
          }
          score_block<NR, kScoreTokens>(q, ws.krows + t, ws.kreader, D, out);
          for (int i = 0; i < NR; ++i) {
            for (int j = 0; j < kScoreTokens; ++j) ws.w[(r0 + i) * kTile + t + j] = out[i * kScoreTokens + j];
          }
        }
        for (; t < group_visible; ++t) {
          if (r0 == 0) {
            if (want_values) prefetch_row(ws.vrows[t], row_bytes);
            if (ws.next_krows[t] != nullptr) prefetch_row(ws.next_krows[t], row_bytes);
          }
          score_block<NR, 1>(q, ws.krows + t, ws.kreader, D, out);
          for (int i = 0; i < NR; ++i) ws.w[(r0 + i) * kTile + t] = out[i];
        }
      });
    }
  }

  template <typename Fn>
  static void with_rows(int nr, Fn&& fn) {
    switch (nr) {
      case 4: fn(std::integral_constant<int, 4>{}); break;
      case 3: fn(std::integral_constant<int, 3>{}); break;
      case 2: fn(std::integral_constant<int, 2>{}); break;
      default: fn(std::integral_constant<int, 1>{}); break;
    }
  }

  // Online softmax of the task's rows over [pos_begin, pos_end): leaves each row's state in
  // ws.state and its unnormalized accumulator (sum of weight * v) in ws.acc.
  void attend(const Task& task, Workspace& ws) const {
    const int D = p_.head_size;
    const int R = task.num_rows;
    load_queries(task, ws);
    ws.kreader.init(p_.k_scale.at(task.kv_head));
    ws.vreader.init(p_.v_scale.at(task.kv_head));
    std::fill(ws.acc.begin(), ws.acc.begin() + size_t(R) * D, 0.0f);
    std::fill(ws.state.begin(), ws.state.begin() + R, SoftmaxState::empty());
    // Rows are in query-token order, so the last row sees the furthest.
    const int pos_end = std::min(task.pos_end, ws.rows[R - 1].limit + 1);
    for (int start = task.pos_begin; start < pos_end; start += kTile) {
      const int n = std::min(kTile, pos_end - start);
      locate_tile(task, ws, start, n, std::min(kTile, pos_end - start - kTile));
      if (start == task.pos_begin) {
        for (int t = 0; t < n; ++t) prefetch_row(ws.krows[t], D * int(sizeof(CacheT)));
      }
      score_tile(R, ws, true);
      // Online softmax per row over the positions it sees (scores past its limit are left unread).
      for (int r = 0; r < R; ++r) {
        const int visible = ws.visible[r];
        float* w = ws.w.data() + r * kTile;
        if (visible > 0) {
          float tile_max = neg_inf();
          for (int t = 0; t < visible; ++t) tile_max = std::max(tile_max, w[t]);
          SoftmaxState& st = ws.state[r];
          const float factor = st.raise_max(tile_max);
          if (factor != 1.0f) scale_row(ws.acc.data() + size_t(r) * D, factor, D);
          st.sum += exp2_weights(w, visible, st.max);
        }
      }
      for (int r0 = 0; r0 < R; r0 += 4) accumulate_rows(ws, r0, std::min(4, R - r0));
    }
  }

  // acc[r] += sum over the positions row r sees of w[r][t] * v[t], for rows r0 .. r0 + nr - 1.
  // Their visible counts never decrease (rows ascend in query token), so the positions split into
  // segments [visible[i-1], visible[i]) that rows i .. nr - 1 all see. Each segment is accumulated
  // for exactly those rows: a position past a row's limit is never multiplied into it, not even by
  // a zero weight, so an inf or NaN in a later draft token's V cannot reach an earlier token
  // (the contract's Isolation).
  void accumulate_rows(Workspace& ws, int r0, int nr) const {
    const int D = p_.head_size;
    int begin = 0;
    for (int i = 0; i < nr; ++i) {
      const int end = ws.visible[r0 + i];
      if (end > begin) {
        const int row = r0 + i;
        with_rows(nr - i, [&](auto NR) {
          accumulate_block<NR>(ws.acc.data() + size_t(row) * D, ws.w.data() + row * kTile + begin,
                               ws.vrows + begin, ws.vreader, end - begin, D, kTile);
        });
        begin = end;
      }
    }
  }

  // v1 epilogue: out = acc / sum, lse.
  void write_final(const Task& task, const Workspace& ws) const {
    const int D = p_.head_size;
    for (int r = 0; r < task.num_rows; ++r) {
      const RowInfo& info = ws.rows[r];
      const SoftmaxState& st = ws.state[r];
      const float inv = st.sum > 0.0f ? 1.0f / st.sum : 0.0f;
      const float* acc = ws.acc.data() + size_t(r) * D;
      QT* dst = p_.out + int64_t(info.token) * p_.out_token_stride +
                int64_t(info.head) * p_.out_head_stride;
      for (int d = 0; d < D; ++d) dst[d] = ScalarConvert<QT>::from_float(acc[d] * inv);
      if (p_.lse != nullptr) p_.lse[int64_t(info.token) * p_.num_heads + info.head] = st.lse();
    }
  }

  // Split epilogue: the partition's partial state per row, at its partial row of the plan.
  void write_partial(const Task& task, const Workspace& ws, const PlanView& plan) const {
    const int D = p_.head_size;
    const int first = p_.cu_seqlens_q[task.seq];
    const int parts = plan.parts(task.seq);
    const int64_t base = plan.partial_base(task.seq);
    for (int r = 0; r < task.num_rows; ++r) {
      const RowInfo& info = ws.rows[r];
      const int64_t idx =
          (base + int64_t(info.token - first) * parts + task.partition) * p_.num_heads + info.head;
      p_.part_max[idx] = ws.state[r].max;
      p_.part_sum[idx] = ws.state[r].sum;
      std::copy_n(ws.acc.data() + size_t(r) * D, D, p_.part_acc + idx * D);
    }
  }

  // Split reduction for one (query token, head) of a split sequence: folds the partitions the
  // row can see.
  void merge_partitions(int seq, int token, int head, const PlanView& plan, float* acc) const {
    const int D = p_.head_size;
    const int first = p_.cu_seqlens_q[seq];
    const int q_len = p_.cu_seqlens_q[seq + 1] - first;
    const int limit = causal_limit(p_.seq_lens[seq], q_len, token - first);
    const int parts = std::min(plan.parts(seq), limit / plan.partition_size() + 1);
    const int64_t row = plan.partial_base(seq) + int64_t(token - first) * plan.parts(seq);
    SoftmaxState st = SoftmaxState::empty();
    std::fill(acc, acc + D, 0.0f);
    for (int k = 0; k < parts; ++k) {
      const int64_t idx = (row + k) * p_.num_heads + head;
      const SoftmaxMerge m = merge_softmax(st, SoftmaxState{p_.part_max[idx], p_.part_sum[idx]});
      const float* part_acc = p_.part_acc + idx * D;
#pragma omp simd
      for (int d = 0; d < D; ++d) acc[d] = acc[d] * m.weight_a + part_acc[d] * m.weight_b;
      st = m.state;
    }
    const float inv = st.sum > 0.0f ? 1.0f / st.sum : 0.0f;
    QT* dst = p_.out + int64_t(token) * p_.out_token_stride + int64_t(head) * p_.out_head_stride;
    for (int d = 0; d < D; ++d) dst[d] = ScalarConvert<QT>::from_float(acc[d] * inv);
    if (p_.lse != nullptr) p_.lse[int64_t(token) * p_.num_heads + head] = st.lse();
  }

  // attn_mass: adds, for every visible position, the sum over all heads and query tokens of
  // exp2(s - lse_log2), the final probability, with s recomputed exactly as attend() does.
  // Tasks are (sequence, kMassTile positions) and loop over every KV head and row, so one
  // sequence's mass for a slot is summed inside one task and added once: distinct slots never
  // race, and the add is atomic only because two sequences may share a block (prefix sharing).
  void mass_pass(const float* lse, const std::vector<Task>& mass_tasks) const {
    const int G = p_.group_size();
    at::parallel_for(0, int64_t(mass_tasks.size()), 1, [&](int64_t begin, int64_t end) {
      Workspace ws(p_.head_size);
      std::vector<float> mass(kMassTile);
      std::vector<float> lse2(kMaxRows);
      for (int64_t i = begin; i < end; ++i) {
        const Task& span = mass_tasks[i];
        const int q_len = p_.cu_seqlens_q[span.seq + 1] - p_.cu_seqlens_q[span.seq];
        const int n_pos = span.pos_end - span.pos_begin;
        std::fill(mass.begin(), mass.begin() + n_pos, 0.0f);
        for (int kv_head = 0; kv_head < p_.num_kv_heads; ++kv_head) {
          ws.kreader.init(p_.k_scale.at(kv_head));
          for (int row0 = 0; row0 < q_len * G; row0 += kMaxRows) {
            const Task task{span.seq, kv_head, row0, std::min(kMaxRows, q_len * G - row0),
                            span.pos_begin, span.pos_end, 0};
            load_queries(task, ws);
            for (int r = 0; r < task.num_rows; ++r) {
              lse2[r] = lse[int64_t(ws.rows[r].token) * p_.num_heads + ws.rows[r].head] * kLog2e;
            }
            const int pos_end = std::min(span.pos_end, ws.rows[task.num_rows - 1].limit + 1);
            for (int start = span.pos_begin; start < pos_end; start += kTile) {
              const int n = std::min(kTile, pos_end - start);
              locate_tile(task, ws, start, n, std::min(kTile, pos_end - start - kTile));
              score_tile(task.num_rows, ws, false);
              for (int r = 0; r < task.num_rows; ++r) {
                const float* w = ws.w.data() + r * kTile;
                float* m = mass.data() + (start - span.pos_begin);
                for (int t = 0; t < ws.visible[r]; ++t) m[t] += softmax_exp2(w[t] - lse2[r]);
              }
            }
          }
        }
        for (int t = 0; t < n_pos; ++t) {
          std::atomic_ref<float>(p_.attn_mass[p_.slot(span.seq, span.pos_begin + t)])
              .fetch_add(mass[t], std::memory_order_relaxed);
        }
      }
    });
  }

 private:
  const PagedAttentionParams<QT, CacheT>& p_;
};

// The plan's work items as CPU tasks: one per (item, KV head).
template <typename QT, typename CacheT>
std::vector<Task> plan_tasks(const PagedAttentionParams<QT, CacheT>& p, const PlanView& plan) {
  const int G = p.group_size();
  const int P = plan.partition_size();
  std::vector<Task> tasks;
  tasks.reserve(size_t(plan.num_items()) * p.num_kv_heads);
  for (int i = 0; i < plan.num_items(); ++i) {
    const PlanItem item = plan.item(i);
    const int q_len = p.cu_seqlens_q[item.seq + 1] - p.cu_seqlens_q[item.seq];
    const int seq_len = p.seq_lens[item.seq];
    const bool split = plan.parts(item.seq) > 1;
    const int begin = split ? item.partition * P : 0;
    const int end = split ? std::min(seq_len, begin + P) : seq_len;
    for (int kv_head = 0; kv_head < p.num_kv_heads; ++kv_head) {
      tasks.push_back(Task{item.seq, kv_head, item.row0, std::min(kMaxRows, q_len * G - item.row0),
                           begin, end, item.partition});
    }
  }
  return tasks;
}

template <typename QT, typename CacheT, CacheFormat F>
void run_cpu(PagedAttentionParams<QT, CacheT>& p, const AttentionArgs& args, const PlanView& plan,
             float* workspace, const at::Tensor& query) {
  CpuPagedAttention<QT, CacheT, F> kernel(p);
  const int64_t R = plan.field(kPlanFieldPartialRows);
  p.part_acc = workspace;
  p.part_max = workspace == nullptr ? nullptr : workspace + R * p.num_heads * p.head_size;
  p.part_sum = workspace == nullptr ? nullptr : p.part_max + R * p.num_heads;

  // attn_mass needs the final LSE: the caller's buffer, or a scratch one.
  at::Tensor lse_scratch;
  if (p.attn_mass != nullptr && p.lse == nullptr) {
    lse_scratch = at::empty({args.num_tokens, args.num_heads}, query.options().dtype(at::kFloat));
    p.lse = lse_scratch.data_ptr<float>();
  }

  const std::vector<Task> tasks = plan_tasks(p, plan);
  at::parallel_for(0, int64_t(tasks.size()), 1, [&](int64_t begin, int64_t end) {
    typename CpuPagedAttention<QT, CacheT, F>::Workspace ws(p.head_size);
    for (int64_t i = begin; i < end; ++i) {
      kernel.attend(tasks[i], ws);
      if (plan.parts(tasks[i].seq) > 1) {
        kernel.write_partial(tasks[i], ws, plan);
      } else {
        kernel.write_final(tasks[i], ws);
      }
    }
  });

  if (R > 0) {
    // Reduction over the (query token, head) rows of split sequences.
    std::vector<int> split_tokens, token_seq;
    for (int seq = 0; seq < p.num_seqs; ++seq) {
      if (plan.parts(seq) <= 1) continue;
      for (int t = p.cu_seqlens_q[seq]; t < p.cu_seqlens_q[seq + 1]; ++t) {
        split_tokens.push_back(t);
        token_seq.push_back(seq);
      }
    }
    const int64_t rows = int64_t(split_tokens.size()) * p.num_heads;
    at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
      std::vector<float> acc(p.head_size);
      for (int64_t i = begin; i < end; ++i) {
        const int64_t t = i / p.num_heads;
        kernel.merge_partitions(token_seq[t], split_tokens[t], int(i % p.num_heads), plan,
                                acc.data());
      }
    });
  }

  if (p.attn_mass != nullptr) {
    std::vector<Task> mass_tasks;
    for (int seq = 0; seq < p.num_seqs; ++seq) {
      if (p.cu_seqlens_q[seq + 1] == p.cu_seqlens_q[seq]) continue;
      for (int pos = 0; pos < p.seq_lens[seq]; pos += kMassTile) {
        mass_tasks.push_back(Task{seq, 0, 0, 0, pos, std::min(p.seq_lens[seq], pos + kMassTile), 0});
      }
    }
    kernel.mass_pass(p.lse, mass_tasks);
  }
}

// The CPU planner's inputs: query-row chunks of kMaxRows, and every context longer than 512
// split into 256-position partitions whatever the batch: measured 15-25% faster than unsplit at
// batch 1 to 16 and 2k-16k contexts (decode and q_len 5, Sapphire Rapids, bench/NOTES.md), a
// partition's K/V (about 128 KB per KV head at D = 128, bf16) staying in L2 while its tiles
// are scored and accumulated.
PlanRequest cpu_plan_request(const AttentionArgs& args, const int* seq_lens,
                             const int* cu_seqlens_q, int forced_partition) {
  PlanRequest r{};
  r.seq_lens = seq_lens;
  r.cu_seqlens_q = cu_seqlens_q;
  r.num_seqs = static_cast<int>(args.num_seqs);
  r.group_size = static_cast<int>(args.num_heads / args.num_kv_heads);
  r.num_kv_heads = static_cast<int>(args.num_kv_heads);
  r.rows_per_item = kMaxRows;
  r.concurrency = at::get_num_threads();
  r.waves = 2;
  r.always_split = true;
  r.forced_partition = forced_partition;
  return r;
}

// Runs one validated call through a plan: the caller's (paged_attention_run), or one built here
// from the host-resident lengths (v1: never split; v2: kPartitionSize partitions; the dispatcher:
// the planner's choice).
void run_planned(const char* op, at::Tensor& out, const at::Tensor& query,
                 const at::Tensor& key_cache, const at::Tensor& value_cache,
                 const at::Tensor& block_tables, const at::Tensor& seq_lens,
                 const at::Tensor& cu_seqlens_q, double scale,
                 const c10::optional<at::Tensor>& lse, const c10::optional<at::Tensor>& attn_mass,
                 const AttentionArgs& args, const PlanView& plan, float* workspace) {
  PAGEDSPEC_DISPATCH_ACTIVATION(query.scalar_type(), op, "query", [&] {
    PAGEDSPEC_DISPATCH_CACHE_FORMAT(args.format, [&] {
      auto p = make_attention_params<scalar_t, cache_t>(out, query, key_cache, value_cache,
                                                        block_tables, seq_lens, cu_seqlens_q,
                                                        scale, lse, attn_mass, args);
      run_cpu<scalar_t, cache_t, kCacheFormat>(p, args, plan, workspace, query);
    });
  });
}

void paged_attention_cpu_impl(const char* op, Variant variant, at::Tensor& out,
                              const at::Tensor& query, const at::Tensor& key_cache,
                              const at::Tensor& value_cache, const at::Tensor& block_tables,
                              const at::Tensor& seq_lens, const at::Tensor& cu_seqlens_q,
                              int64_t max_q_len, double scale,
                              const c10::optional<at::Tensor>& k_scale,
                              const c10::optional<at::Tensor>& v_scale,
                              const c10::optional<at::Tensor>& lse,
                              const c10::optional<at::Tensor>& attn_mass) {
  const AttentionArgs args =
      check_attention(op, out, query, key_cache, value_cache, block_tables, seq_lens,
                      cu_seqlens_q, max_q_len, scale, k_scale, v_scale, lse, attn_mass,
                      /*allow_float32=*/true);
  check_attention_indices(op, args, block_tables, seq_lens, cu_seqlens_q);
  if (args.num_tokens == 0 || args.num_seqs == 0) return;
  const int forced = variant == Variant::kV1 ? -1 : (variant == Variant::kV2 ? kPartitionSize : 0);
  const PlanRequest request = cpu_plan_request(args, seq_lens.const_data_ptr<int>(),
                                               cu_seqlens_q.const_data_ptr<int>(), forced);
  const int partition = choose_partition(request);
  const int64_t items = plan_shape(request, partition).num_items;
  std::vector<int32_t> plan(plan_length(args.num_seqs, items));
  write_plan(request, partition, items, static_cast<int>(args.num_tokens), plan.data());
  const PlanView view{plan.data()};
  at::Tensor workspace;
  const int64_t rows = view.field(kPlanFieldPartialRows);
  if (rows > 0) {
    workspace = at::empty({rows * workspace_floats_per_row(args.num_heads, args.head_size)},
                          query.options().dtype(at::kFloat));
  }
  run_planned(op, out, query, key_cache, value_cache, block_tables, seq_lens, cu_seqlens_q, scale,
              lse, attn_mass, args, view, rows > 0 ? workspace.data_ptr<float>() : nullptr);
}

// paged_attention_plan: the plan for a step's host-resident lengths, for the CPU or a CUDA device.
at::Tensor paged_attention_plan_cpu(const at::Tensor& seq_lens, const at::Tensor& cu_seqlens_q,
                                    int64_t num_heads, int64_t num_kv_heads, c10::Device device,
                                    int64_t partition_size, int64_t max_items,
                                    int64_t max_partial_rows) {
  const char* op = "paged_attention_plan";
  for (const auto& [name, t] : {std::pair<const char*, const at::Tensor*>{"seq_lens", &seq_lens},
                                {"cu_seqlens_q", &cu_seqlens_q}}) {
    check_dtype(op, name, *t, {at::kInt});
    check_dim(op, name, *t, 1);
    check_contiguous(op, name, *t);
    TORCH_CHECK(t->device().is_cpu(), "pagedspec.", op, ": ", name,
                " must be on the CPU (the plan is made on the host before the step), got ",
                t->device());
  }
  const int64_t B = seq_lens.size(0);
  check_size(op, "cu_seqlens_q", cu_seqlens_q, 0, B + 1, "num_seqs + 1");
  TORCH_CHECK(num_kv_heads >= 1 && num_heads >= 1 && num_heads % num_kv_heads == 0 &&
                  num_heads < (int64_t(1) << 31),
              "pagedspec.", op, ": num_heads must be a positive multiple of num_kv_heads, got ",
              num_heads, " and ", num_kv_heads);
  TORCH_CHECK(device.is_cpu() || device.is_cuda(), "pagedspec.", op,
              ": device must be cpu or cuda, got ", device);
  TORCH_CHECK(partition_size >= -1 && partition_size < (int64_t(1) << 31), "pagedspec.", op,
              ": partition_size must be 0 (choose), -1 (never split) or a positive size, got ",
              partition_size);
  const int* lens = seq_lens.const_data_ptr<int>();
  const int* cu = cu_seqlens_q.const_data_ptr<int>();
  TORCH_CHECK(B == 0 || cu[0] == 0, "pagedspec.", op, ": cu_seqlens_q[0] must be 0, got ", cu[0]);
  for (int64_t i = 0; i < B; ++i) {
    TORCH_CHECK(cu[i + 1] >= cu[i], "pagedspec.", op, ": cu_seqlens_q must be non-decreasing, got ",
                "cu_seqlens_q[", i, "] = ", cu[i], " > cu_seqlens_q[", i + 1, "] = ", cu[i + 1]);
    TORCH_CHECK(lens[i] >= cu[i + 1] - cu[i], "pagedspec.", op, ": seq_lens[", i,
                "] must be >= its q_len, got seq_len = ", lens[i], ", q_len = ", cu[i + 1] - cu[i]);
  }
  const AttentionArgs shape{CacheFormat::kNative, {}, {}, B == 0 ? 0 : cu[B], B, num_heads,
                            num_kv_heads, 0, 0, 1, 0, 0};
  PlanRequest request = cpu_plan_request(shape, lens, cu, static_cast<int>(partition_size));
  if (device.is_cuda()) {
#ifdef PAGEDSPEC_WITH_CUDA
    request.rows_per_item = kCudaAttentionRows;
    request.concurrency = cuda_attention_slots(device.has_index() ? device.index() : -1);
    request.waves = kCudaPlanWaves;
    request.always_split = false;
#else
    TORCH_CHECK(false, "pagedspec.", op, ": device is ", device,
                " but this build of pagedspec has no CUDA kernels");
#endif
  }
  request.max_items = max_items;
  request.max_partial_rows = max_partial_rows;
  const int partition = choose_partition(request);
  const PlanShape unsplit = plan_shape(request, std::numeric_limits<int>::max());
  TORCH_CHECK(partition > 0, "pagedspec.", op, ": max_items (", max_items, ") or max_partial_rows (",
              max_partial_rows, ") is too small for this step: ",
              request.forced_partition > 0 ? "the forced partition" : "even an unsplit plan",
              " needs ", request.forced_partition > 0
                  ? plan_shape(request, request.forced_partition).num_items : unsplit.num_items,
              " items");
  const PlanShape shape_of_plan = plan_shape(request, partition);
  const int64_t items = shape_of_plan.num_items;
  const int64_t capacity = max_items > 0 ? max_items : items;
  TORCH_CHECK(capacity < (int64_t(1) << 31) && shape_of_plan.partial_rows < (int64_t(1) << 31),
              "pagedspec.", op, ": the plan's items (", capacity, ") and partial rows (",
              shape_of_plan.partial_rows, ") must fit in int32");
  at::Tensor plan = at::empty({plan_length(B, capacity)}, seq_lens.options());
  write_plan(request, partition, capacity, static_cast<int>(shape.num_tokens),
             plan.data_ptr<int32_t>());
  return plan;
}

void paged_attention_run_cpu(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                             const at::Tensor& value_cache, const at::Tensor& block_tables,
                             const at::Tensor& seq_lens, const at::Tensor& cu_seqlens_q,
                             int64_t max_q_len, double scale, const at::Tensor& plan,
                             at::Tensor& workspace, const c10::optional<at::Tensor>& k_scale,
                             const c10::optional<at::Tensor>& v_scale,
                             const c10::optional<at::Tensor>& lse,
                             const c10::optional<at::Tensor>& attn_mass) {
  const char* op = "paged_attention_run";
  const AttentionArgs args =
      check_attention(op, out, query, key_cache, value_cache, block_tables, seq_lens,
                      cu_seqlens_q, max_q_len, scale, k_scale, v_scale, lse, attn_mass,
                      /*allow_float32=*/true);
  check_attention_indices(op, args, block_tables, seq_lens, cu_seqlens_q);
  const int64_t rows =
      check_plan_tensors(op, args, plan, workspace, out, query, key_cache, value_cache, lse,
                         attn_mass);
  check_plan_contents(op, args, plan.const_data_ptr<int32_t>(), plan.numel(),
                      seq_lens.const_data_ptr<int>(), cu_seqlens_q.const_data_ptr<int>(), rows,
                      kMaxRows);
  if (args.num_tokens == 0 || args.num_seqs == 0) return;
  run_planned(op, out, query, key_cache, value_cache, block_tables, seq_lens, cu_seqlens_q, scale,
              lse, attn_mass, args, PlanView{plan.const_data_ptr<int32_t>()},
              workspace.numel() > 0 ? workspace.data_ptr<float>() : nullptr);
}

PAGEDSPEC_ATTENTION_ENTRY(paged_attention_v1_cpu, paged_attention_cpu_impl, "paged_attention_v1",
                          Variant::kV1)
PAGEDSPEC_ATTENTION_ENTRY(paged_attention_v2_cpu, paged_attention_cpu_impl, "paged_attention_v2",
                          Variant::kV2)
PAGEDSPEC_ATTENTION_ENTRY(paged_attention_dispatch_cpu, paged_attention_cpu_impl, "paged_attention",
                          Variant::kAuto)

}  // namespace

TORCH_LIBRARY_IMPL(pagedspec, CPU, m) {
  m.impl("paged_attention_v1", &paged_attention_v1_cpu);
  m.impl("paged_attention_v2", &paged_attention_v2_cpu);
  m.impl("paged_attention", &paged_attention_dispatch_cpu);
  m.impl("paged_attention_plan", &paged_attention_plan_cpu);
  m.impl("paged_attention_run", &paged_attention_run_cpu);
}

// The planner reads host memory whatever the device it plans for; registered for CUDA too so
// that CUDA-resident lengths get its "must be on the CPU" error rather than the dispatcher's.
TORCH_LIBRARY_IMPL(pagedspec, CUDA, m) {
  m.impl("paged_attention_plan", &paged_attention_plan_cpu);
}

}  // namespace pagedspec
