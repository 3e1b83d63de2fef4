// Validation for the count-min sketch ops, shared by the CPU and CUDA launchers so both reject
// exactly the same inputs with the same messages.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Optional.h>

#include <limits>

#include "checks.h"
#include "pagedspec/sketch.h"

namespace pagedspec {

// sketch: int32 [depth, width], contiguous, depth 1..16, width >= 1.
inline SketchGeometry check_sketch(const char* op, const at::Tensor& sketch) {
  check_dtype(op, "sketch", sketch, {at::kInt});
  check_dim(op, "sketch", sketch, 2);
  check_contiguous(op, "sketch", sketch);
  TORCH_CHECK(sketch.size(0) >= 1 && sketch.size(0) <= kSketchMaxDepth, "pagedspec.", op,
              ": sketch depth (size(0)) must be in [1, ", kSketchMaxDepth, "], got ",
              sketch.size(0), " (shape ", sketch.sizes(), ")");
  TORCH_CHECK(sketch.size(1) >= 1, "pagedspec.", op,
              ": sketch width (size(1)) must be >= 1, got ", sketch.size(1), " (shape ",
              sketch.sizes(), ")");
  return SketchGeometry::make(static_cast<int>(sketch.size(0)), sketch.size(1));
}

// keys: int64 [n], contiguous, on the sketch's device; n <= 2^30: the conservative update's
// de-duplication table has the next power of two >= 2n slots, indexed with int32.
inline void check_sketch_keys(const char* op, const at::Tensor& keys, const at::Tensor& sketch) {
  check_dtype(op, "keys", keys, {at::kLong});
  check_dim(op, "keys", keys, 1);
  check_contiguous(op, "keys", keys);
  check_same_device(op, "keys", keys, "sketch", sketch);
  TORCH_CHECK(keys.size(0) <= (int64_t(1) << 30), "pagedspec.", op,
              ": keys must have at most 2^30 elements (split larger batches), got ",
              keys.size(0));
}

// increments: int32 [n], contiguous, on the sketch's device (values are checked separately).
inline void check_sketch_increments(const char* op, const c10::optional<at::Tensor>& increments,
                                    const at::Tensor& keys, const at::Tensor& sketch) {
  if (!increments.has_value()) return;
  const at::Tensor& inc = *increments;
  check_dtype(op, "increments", inc, {at::kInt});
  check_dim(op, "increments", inc, 1);
  check_size(op, "increments", inc, 0, keys.size(0), "one per key");
  check_contiguous(op, "increments", inc);
  check_same_device(op, "increments", inc, "sketch", sketch);
}

// Host-side: every increment is >= 0. `inc` must be a CPU int32 tensor.
inline void check_increments_nonnegative(const char* op, const at::Tensor& inc) {
  const int32_t* p = inc.const_data_ptr<int32_t>();
  const int64_t n = inc.numel();
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(p[i] >= 0, "pagedspec.", op, ": increments must be >= 0, got increments[", i,
                "] = ", p[i]);
  }
}

inline SketchGeometry check_cms_update(const at::Tensor& sketch, const at::Tensor& keys,
                                       const c10::optional<at::Tensor>& increments) {
  const char* op = "cms_update";
  const SketchGeometry geo = check_sketch(op, sketch);
  check_sketch_keys(op, keys, sketch);
  check_sketch_increments(op, increments, keys, sketch);
  // The sketch is written while keys and increments are read (the conservative update reads
  // them again after the estimates), so an input in the sketch's memory would change under the
  // update, differently on each backend.
  TORCH_CHECK(!may_share_memory(sketch, keys), "pagedspec.", op,
              ": keys must not share memory with sketch, got overlapping tensors");
  TORCH_CHECK(!increments.has_value() || !may_share_memory(sketch, *increments), "pagedspec.",
              op, ": increments must not share memory with sketch, got overlapping tensors");
  return geo;
}

inline SketchGeometry check_cms_query(const at::Tensor& sketch, const at::Tensor& keys) {
  const char* op = "cms_query";
  const SketchGeometry geo = check_sketch(op, sketch);
  check_sketch_keys(op, keys, sketch);
  return geo;
}

inline void check_cms_decay(const at::Tensor& sketch, int64_t shift) {
  const char* op = "cms_decay";
  (void)check_sketch(op, sketch);
  TORCH_CHECK(shift >= 0 && shift <= 31, "pagedspec.", op, ": shift must be in [0, 31], got ",
              shift);
}

}  // namespace pagedspec
