// Kernel parameters for the cache-management ops: reshape_and_cache, copy_blocks, swap_blocks,
// quantize_fp8 / dequantize_fp8. Torch-free: launchers fill these from validated tensors.
#pragma once

#include <stdint.h>

#include "pagedspec/codec.h"

namespace pagedspec {

// Paged cache geometry, shared by every op that touches key_cache / value_cache.
// A cache is [num_blocks, block_size, num_kv_heads, head_size]: each block dense, blocks
// block_stride elements apart (one block's elements for a contiguous cache, more for a view of
// larger per-block pages). key_cache and value_cache share the geometry.
struct CacheGeometry {
  int64_t num_blocks;    // cache.size(0)
  int block_size;        // cache.size(1): tokens per block
  int num_kv_heads;      // cache.size(2)
  int head_size;         // cache.size(3)
  int64_t block_stride;  // cache.stride(0), elements: >= block_size * slot_stride()

  PS_HOST_DEVICE int64_t slot_stride() const { return int64_t(num_kv_heads) * head_size; }
  PS_HOST_DEVICE int64_t num_slots() const { return num_blocks * block_size; }
  // Element offset of slot `slot` (block slot / block_size, token slot % block_size).
  PS_HOST_DEVICE int64_t slot_offset(int64_t slot) const {
    return (slot / block_size) * block_stride + (slot % block_size) * slot_stride();
  }
};

template <typename InT, typename CacheT>
struct ReshapeAndCacheParams {
  const InT* key;             // [num_tokens, num_kv_heads, head_size], strides below
  const InT* value;           // [num_tokens, num_kv_heads, head_size], strides below
  CacheT* key_cache;          // [num_blocks, block_size, num_kv_heads, head_size]; geo
  CacheT* value_cache;        // [num_blocks, block_size, num_kv_heads, head_size]; geo
  const int64_t* slot_mapping;  // [num_tokens]; -1 = skip (padding)
  ScaleRef k_scale;           // [] or [num_kv_heads]; FP8 caches only
  ScaleRef v_scale;           // [] or [num_kv_heads]; FP8 caches only
  int64_t num_tokens;
  int64_t key_token_stride;    // key.stride(0), elements
  int64_t key_head_stride;     // key.stride(1), elements (stride(2) is 1)
  int64_t value_token_stride;  // value.stride(0)
  int64_t value_head_stride;   // value.stride(1)
  CacheGeometry geo;
};

// copy_blocks: up to kMaxLayers layers per launch, passed by value so the launch needs no device
// array of pointers (and so no host-to-device copy, which would break CUDA-graph capture).
constexpr int kCopyBlocksMaxLayers = 64;

struct CopyBlocksParams {
  void* key_caches[kCopyBlocksMaxLayers];    // each [num_blocks, block_size, heads, head_size]
  void* value_caches[kCopyBlocksMaxLayers];  // same shape and dtype as key_caches
  const int64_t* block_mapping;  // [num_pairs, 2] (src, dst) block ids
  int num_layers;                // <= kCopyBlocksMaxLayers in this launch
  int64_t num_pairs;             // block_mapping.size(0)
  int64_t block_bytes;           // bytes of one block of one cache
  int64_t block_stride_bytes;    // bytes from one block to the next (>= block_bytes), every cache
};

// swap_blocks: src and dst are addressable from the device (device memory or mapped pinned host
// memory), with the same block size in bytes; each has its own block stride.
struct SwapBlocksParams {
  const char* src;               // [src_num_blocks, ...]; block b at src + b * src_block_stride
  char* dst;                     // [dst_num_blocks, ...]; block b at dst + b * dst_block_stride
  const int64_t* block_mapping;  // [num_pairs, 2] (src, dst) block ids
  int64_t num_pairs;             // block_mapping.size(0)
  int64_t block_bytes;           // bytes of one block
  int64_t src_block_stride;      // bytes, >= block_bytes
  int64_t dst_block_stride;      // bytes, >= block_bytes
};

// quantize_fp8 / dequantize_fp8 over a contiguous tensor viewed as [rows, num_heads, head_size]
// (the scale index is the head, i.e. dim -2 of the original tensor).
template <typename SrcT, typename DstT>
struct Fp8ConvertParams {
  const SrcT* input;  // [numel], contiguous
  DstT* out;          // [numel], contiguous
  ScaleRef scale;     // [] or [num_heads]
  int64_t numel;
  int64_t head_size;  // input.size(-1): elements per head
  int64_t num_heads;  // input.size(-2) when per-head; 1 otherwise
};

}  // namespace pagedspec
