// A tile's K or V rows as bf16 rows (bf16_rows): a bf16 cache's in place, an FP8 cache's
// converted into the thread's TileImages. The AMX paths, the dot path and the FMA path's FP8
// images (fp8_image_rows) all read them; the dot path's FP8 lookup tables (fp8_bytes,
// fp8_lookup) come from the same reader table.
// Members of CpuPagedAttention, included only by cpu/attention/kernel.h, inside the class body
// at this place in its member order.
#ifndef PAGEDSPEC_CPU_ATTENTION_PARTS
#error "a part of cpu/attention_impl.h, included only there: include that instead"
#endif

  // The bf16 images of one tile's FP8 K and V rows, [kTile, D] each (bf16_rows): one pair per
  // thread, shared by all heads, since every path consumes a head's images before it converts
  // the next head's. Per-head pairs (16 KB a head at D = 128, 8 heads to a decode task) left L1
  // and made every image store a miss, and a vector's 16-byte alignment split each 64-byte row
  // access across two lines: FP8 decode at B=8 ctx=2048 on SPR-VM's AMX path took 4.3-4.8 ms
  // against 3.0-3.3.
  enum class Operand { kKeys, kValues };
  struct TileImages {
    std::vector<uint16_t, LineAligned<uint16_t>> k, v;
    const uint16_t* k_rows[kTile];
    const uint16_t* v_rows[kTile];
  };
  static TileImages& tile_images(int D) {
    static thread_local TileImages images;
    images.k.resize(size_t(kTile) * D);
    images.v.resize(size_t(kTile) * D);
    return images;
  }

  // Rows [first, first + n) of `rows` (keys or values) as the bf16 rows the tile multiplies, the
  // dot path and the FMA path's FP8 images (fp8_image_rows) read: a bf16 cache's in place; an FP8
  // cache's converted into the thread's TileImages as the bf16 bits of their images (the values
  // CacheReader reads, so the scale folds in as on the FMA path): at AVX-512 by VBMI lookups
  // (fp8_images_as_bf16), at AVX2 as CacheReader::load16's floats cut to their high halves,
  // exactly. Valid until the next call for the same operand.
  const uint16_t* const* bf16_rows(const CacheT* const* rows, int first, int n,
                                   const Reader& reader, Operand which) const {
    if constexpr (F == CacheFormat::kNative) {
      return reinterpret_cast<const uint16_t* const*>(rows + first);
    } else {
      TileImages& images = tile_images(p_.head_size);
      const bool keys = which == Operand::kKeys;
      const uint16_t** out = keys ? images.k_rows : images.v_rows;
      uint16_t* buf = (keys ? images.k : images.v).data() + size_t(first) * p_.head_size;
#if PAGEDSPEC_CPU_LEVEL == 2
      fp8_images_as_bf16(reinterpret_cast<const uint8_t* const*>(rows) + first, n, p_.head_size,
                         fp8_bytes(reader), buf, out + first);
#elif PAGEDSPEC_CPU_LEVEL == 1
      const int D = p_.head_size;
      for (int t = 0; t < n; ++t) {
        uint16_t* row = buf + size_t(t) * D;
        for (int d = 0; d < D; d += kLanes) {
          const vfloat x = reader.load16(rows[first + t] + d);
          const __m256i lo = _mm256_srli_epi32(_mm256_castps_si256(x.lo), 16);
          const __m256i hi = _mm256_srli_epi32(_mm256_castps_si256(x.hi), 16);
          // packus interleaves the 128-bit lanes (lo 0-3, hi 0-3, lo 4-7, hi 4-7); 0xD8 undoes it.
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(row + d),
                              _mm256_permute4x64_epi64(_mm256_packus_epi32(lo, hi), 0xD8));
        }
        out[first + t] = row;
      }
#else
      (void)rows, (void)n, (void)reader, (void)buf;
#endif
      return out + first;
    }
  }

#if PAGEDSPEC_CPU_LEVEL == 2
  // The FP8 image bytes of format F (reader initialized): every reader of the format holds the
  // same table, so its bytes are split once.
  static const Fp8ImageBytes& fp8_bytes(const Reader& reader) {
    static const Fp8ImageBytes kBytes = fp8_image_bytes(reader.table);
    return kBytes;
  }
  // The in-register conversion's tables in registers, if this task converts FP8 codes there.
  static std::optional<Fp8ImageLookup> fp8_lookup(const Workspace& ws, const Reader& reader) {
    if constexpr (F != CacheFormat::kNative) {
      if (ws.dot_fp8) return Fp8ImageLookup(fp8_bytes(reader));
    }
    return std::nullopt;
  }
  static const uint8_t* const* as_codes(const CacheT* const* rows) {
    return reinterpret_cast<const uint8_t* const*>(rows);
  }
#endif

  // Rows [0, n) of an FP8 tile's K or V rows as the bf16 images the FMA path reads as it reads a
  // bf16 cache (in even/odd order; Workspace::fp8_images). bf16 rather than float32 images: at
  // AVX2 a bf16 cache's q=5 ran 21 ms through its own rows and 25 ms through float32 copies.
  const ImageT* const* fp8_image_rows(const CacheT* const* rows, int n, const Reader& reader,
                                      Operand which) const {
    return reinterpret_cast<const ImageT* const*>(bf16_rows(rows, 0, n, reader, which));
  }
