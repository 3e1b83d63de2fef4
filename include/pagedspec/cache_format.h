// How a paged cache (or an FP8 tensor of quantize_fp8 / dequantize_fp8) stores its elements: the
// one enum for the FP8 distinction, shared by the codec, the FP8 conversion and every kernel.
#pragma once

namespace pagedspec {

// kNative: the activation dtype itself; kE4M3 / kE5M2: OCP FP8 codes in uint8 storage, scaled.
enum class CacheFormat : int { kNative = 0, kE4M3 = 1, kE5M2 = 2 };

}  // namespace pagedspec
