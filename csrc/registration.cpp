// Every pagedspec op schema, in one always-compiled file (the public contract is
// docs/CONTRACT.md). Backend kernels register themselves beside their code:
// csrc/cpu/*.cpp with TORCH_LIBRARY_IMPL(pagedspec, CPU, m) and csrc/cuda/*.cu with CUDA.
// Fake (meta) kernels for torch.compile live in python/pagedspec/_fake.py.
//
// Index dtypes: block_tables, seq_lens, cu_seqlens_q, num_draft_tokens are int32;
// slot_mapping, token ids, sketch keys and block mappings are int64.

#include <Python.h>
#include <torch/library.h>

TORCH_LIBRARY(pagedspec, m) {
  // Writes token t's key/value into cache slot slot_mapping[t] (-1 skips), converting to the
  // cache dtype (FP8: saturate(x / scale), round to nearest even).
  m.def(
      "reshape_and_cache(Tensor key, Tensor value, Tensor(a!) key_cache, Tensor(b!) value_cache, "
      "Tensor slot_mapping, Tensor? k_scale=None, Tensor? v_scale=None) -> ()");

  // Paged attention, one pass per (sequence, KV head group); decode and multi-token verification.
  m.def(
      "paged_attention_v1(Tensor(a!) out, Tensor query, Tensor key_cache, Tensor value_cache, "
      "Tensor block_tables, Tensor seq_lens, Tensor cu_seqlens_q, int max_q_len, float scale, "
      "Tensor? k_scale=None, Tensor? v_scale=None, Tensor(b!)? lse=None, "
      "Tensor(c!)? attn_mass=None) -> ()");
  // Paged attention with the context split into partitions merged by log-sum-exp.
  m.def(
      "paged_attention_v2(Tensor(a!) out, Tensor query, Tensor key_cache, Tensor value_cache, "
      "Tensor block_tables, Tensor seq_lens, Tensor cu_seqlens_q, int max_q_len, float scale, "
      "Tensor? k_scale=None, Tensor? v_scale=None, Tensor(b!)? lse=None, "
      "Tensor(c!)? attn_mass=None) -> ()");
  // Picks v1 or v2 by the documented occupancy/context-length heuristic.
  m.def(
      "paged_attention(Tensor(a!) out, Tensor query, Tensor key_cache, Tensor value_cache, "
      "Tensor block_tables, Tensor seq_lens, Tensor cu_seqlens_q, int max_q_len, float scale, "
      "Tensor? k_scale=None, Tensor? v_scale=None, Tensor(b!)? lse=None, "
      "Tensor(c!)? attn_mass=None) -> ()");

  // out = saturate(input / scale) as FP8 (scale: [] or [input.size(-2)]).
  m.def("quantize_fp8(Tensor(a!) out, Tensor input, Tensor scale) -> ()");
  // out = fp8 input * scale, in out's dtype.
  m.def("dequantize_fp8(Tensor(a!) out, Tensor input, Tensor scale) -> ()");

  // Copy-on-write: copies block src -> dst for every (src, dst) row, in every layer, one launch.
  m.def(
      "copy_blocks(Tensor(a!)[] key_caches, Tensor(b!)[] value_caches, Tensor block_mapping) "
      "-> ()");
  // Offload/reload: copies block mapping[j, 0] of src to block mapping[j, 1] of dst, across devices.
  m.def("swap_blocks(Tensor src, Tensor(a!) dst, Tensor block_mapping) -> ()");

  // Speculative-decoding rejection sampler -> (output_token_ids int64 [B, k+1],
  // num_accepted int32 [B]).
  m.def(
      "rejection_sample(Tensor draft_token_ids, Tensor? draft_probs, Tensor target_probs, "
      "Tensor uniform_accept, Tensor uniform_resample, Tensor? num_draft_tokens=None) "
      "-> (Tensor, Tensor)");
  // Greedy verification: accept while draft == target argmax -> same outputs as rejection_sample.
  m.def(
      "greedy_verify(Tensor draft_token_ids, Tensor target_token_ids, "
      "Tensor? num_draft_tokens=None) -> (Tensor, Tensor)");

  // Count-min sketch update (plain or conservative), saturating int32 counters.
  m.def(
      "cms_update(Tensor(a!) sketch, Tensor keys, Tensor? increments=None, "
      "bool conservative=False) -> ()");
  // Count-min sketch point query -> int32 [n] (min over rows).
  m.def("cms_query(Tensor sketch, Tensor keys) -> Tensor");
  // Ages every counter: counter >>= shift.
  m.def("cms_decay(Tensor(a!) sketch, int shift=1) -> ()");
}

// `import pagedspec._C` loads this library (and so runs the registrations above); the module
// itself only carries build facts for pagedspec.build_info().
#ifndef PAGEDSPEC_CUDA_ARCHS
#define PAGEDSPEC_CUDA_ARCHS ""
#endif
#ifndef PAGEDSPEC_CUDA_VERSION
#define PAGEDSPEC_CUDA_VERSION ""
#endif

extern "C" PyMODINIT_FUNC PyInit__C(void) {
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  PyObject* module = PyModule_Create(&module_def);
  if (module == nullptr) return nullptr;
#ifdef PAGEDSPEC_WITH_CUDA
  PyModule_AddIntConstant(module, "with_cuda", 1);
#else
  PyModule_AddIntConstant(module, "with_cuda", 0);
#endif
  PyModule_AddStringConstant(module, "cuda_archs", PAGEDSPEC_CUDA_ARCHS);
  PyModule_AddStringConstant(module, "cuda_version", PAGEDSPEC_CUDA_VERSION);
  PyModule_AddStringConstant(module, "torch_version", PAGEDSPEC_TORCH_VERSION);
  return module;
}
