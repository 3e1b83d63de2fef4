// Workspace, a thread's scratch for one KV head's rows, and the per-task path choice
// (choose_path over use_amx_decode, use_amx and the dot path's capability; enter_path; the dot
// path's score layouts): which path a task takes is decided here and nowhere else.
// Members of CpuPagedAttention, included only by cpu/attention/kernel.h, inside the class body
// at this place in its member order.
#ifndef PAGEDSPEC_CPU_ATTENTION_PARTS
#error "a part of cpu/attention_impl.h, included only there: include that instead"
#endif

  // Per-thread scratch for one KV head's rows, sized for head_size.
  struct Workspace {
    int head_size;
    std::vector<float> q, acc, w;
    std::vector<uint16_t> q_vnni;  // the AMX path's query rows (amx_pack_queries), if taken
    Path path = Path::kFma;        // this task's path (choose_path)
    // The AMX decode path's states, kAmxDecodeChunks of them (attend_item_amx_decode).
    std::unique_ptr<AmxDecode[]> decode;
    // The dot path's query rows ([rows, D] bf16 bits).
    std::vector<uint16_t> q_bf16;
    // ... and for tasks that score through score_tile_lanes (uses_score_lanes), the query rows
    // in row pairs instead (lane_pair_queries).
    std::vector<uint16_t> q_lanes;
    bool dot_fp8 = false;  // the dot path on FP8 codes converted in registers (no images)
    std::vector<RowInfo> rows;
    std::vector<SoftmaxState> state;
    std::vector<int> visible;
    const CacheT* krows[kTile];
    const CacheT* vrows[kTile];
    CacheReader<CacheT, F> kreader, vreader;
    // The FMA path reads this task's FP8 K and V tiles as images (fp8_image_rows: converted
    // once per tile, then read as a bf16 cache is) instead of converting the codes
    // for every block of rows, which the 20 rows of a 5-token draft at group 4 did 5 times at
    // AVX-512 and 4 at AVX2. v_images: this tile's V rows there.
    bool fp8_images = false;
    const ImageT* const* v_images = nullptr;
    bool acc_even_odd = false;  // acc rows in load_pair's even/odd order (set_acc_order)
    float score_factor = 1.0f;  // the FMA path's scores' power of two (fma_score_factor)

    explicit Workspace(int D)
        : head_size(D), q(size_t(kMaxRows) * D), acc(size_t(kMaxRows) * D),
          w(size_t(kMaxRows) * kTile), rows(kMaxRows), state(kMaxRows), visible(kMaxRows) {}
  };

  // The AMX score path: bf16 queries on a bf16 or FP8 cache on the AVX-512 level, with enough
  // rows per key.
  static constexpr bool kAmxCapable =
      PAGEDSPEC_CPU_LEVEL == 2 && std::is_same_v<QT, c10::BFloat16> &&
      (F != CacheFormat::kNative || std::is_same_v<CacheT, c10::BFloat16>);
  bool use_amx(int R) const {
    if constexpr (kAmxCapable) {
      return R >= kAmxMinRows && p_.head_size % kAmxDims == 0 && amx_;
    } else {
      return false;
    }
  }

  // The bf16 dot-product path takes the AMX path's operands: bf16 queries on a bf16 cache, or on
  // an FP8 one through the bf16 images of its codes (bf16_rows).
  static constexpr bool kDotCapable = kAmxCapable;

  // The one place a task's path is chosen, from the configuration and the task's R rows:
  // AMX decode (a whole plan item's heads, accumulators in tiles), AMX tile multiplies (scores
  // and whole-tile P.V), AVX512-BF16 dot-product scores, or the FMA path (every level, every
  // dtype; the others fall back to it for what they leave, such as a causal tail's P.V).
  // `amx` false: the paths whose scores match attend_tile's without AMX (the mass pass).
  Path choose_path(int R, bool amx = true) const {
    if (amx && use_amx_decode()) return Path::kAmxDecode;
    if (amx && use_amx(R)) return Path::kAmx;
    return bf16_dot_ ? Path::kDot : Path::kFma;
  }
  // Sets a task's path and what follows from it and R: whether the FMA path's P.V (and, off the
  // dot path, its scores) read FP8 tiles as images (where more blocks of rows than
  // kImageMinBlocks would convert each code), and whether the dot path converts FP8 codes in
  // registers.
  void enter_path(Workspace& ws, Path path, int R) const {
    ws.path = path;
    const bool dot = path == Path::kDot;
    ws.fp8_images = fp8_images_ && path != Path::kAmxDecode && R > kImageMinBlocks * kRowBlock;
    // FP8 codes converted as they are read where D allows (score_block_fp8_dot), else images.
    // Converting them once per block of 4 rows, not once per tile, is no slower for the 20 rows
    // of a 5-token draft at group 4 (A/B: 14.4 against 14.5 ms at B=8 ctx=2048, 1 thread).
    ws.dot_fp8 = dot && dot_fp8_codes();
    if (!dot) return;
    ws.q_bf16.resize(size_t(kMaxRows) * p_.head_size);
    ws.q_lanes.resize(size_t(kMaxRows) * p_.head_size);
  }

  // Whether the dot path reads FP8 codes converted in registers (else bf16 rows: a bf16 cache's,
  // or an FP8 cache's images).
  bool dot_fp8_codes() const { return F != CacheFormat::kNative && p_.head_size % 64 == 0; }
  // The dot path's scores for R rows: from bf16 rows through score_tile_lanes up to
  // kLanesMaxRows rows, then through a packed tile (score_tile_packed), as are FP8 codes from
  // kPackedMinRows rows.
  static bool uses_score_lanes(const Workspace& ws, int R) {
    return kDotCapable && ws.path == Path::kDot && !ws.dot_fp8 && R <= kLanesMaxRows;
  }
  static bool scores_packed(int R, bool fp8_codes) {
    return fp8_codes ? R >= kPackedMinRows : R > kLanesMaxRows;
  }

  // The AMX decode path (attend_item_amx_decode) for a plan item: bf16 queries on a bf16 or FP8
  // cache and a head size the accumulator tiles hold. Decode and verification rows alike: the
  // rows go to tile states of up to kAmxDecodeMaxRows each, and positions past some rows' causal
  // limits take vector FMAs.
  bool use_amx_decode() const {
    if constexpr (kAmxCapable) {
      return p_.head_size % 32 == 0 && p_.head_size <= kAmxDecodeMaxDims && amx_decode_;
    } else {
      return false;
    }
  }
