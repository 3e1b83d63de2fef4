// Every pagedspec op schema, in one always-compiled file (the public contract is
// docs/CONTRACT.md). Backend kernels register themselves beside their code:
// csrc/cpu/*.cpp with TORCH_LIBRARY_IMPL(pagedspec, CPU, m) and csrc/cuda/*.cu with CUDA. The
// model runner's CPU-only ops (pagedspec_models) are defined here too.
// Fake (meta) kernels for torch.compile live in python/pagedspec/_fake.py.
//
// Index dtypes: block_tables, seq_lens, cu_seqlens_q, num_draft_tokens are int32;
// slot_mapping, token ids, sketch keys and block mappings are int64.

#include <Python.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <torch/library.h>

#include <iterator>

#include "attention_checks.h"
#include "cpu/amx.h"
#include "cpu/isa.h"

#include <cstring>
#include <sstream>
#include <string>

namespace {

// Why a tensor argument cannot reach a pagedspec kernel ("" when it can). The kernels read and
// write raw memory, so a lazily conjugated or negated view, an efficient zero tensor (no storage)
// or a non-strided layout would be misread. Left alone, torch's math-bits fallback would
// materialize such an argument and write it back, which it cannot do for ops returning `()`: it
// asserts and the process later aborts with a corrupted heap.
std::string unplain_reason(const at::Tensor& t) {
  if (!t.defined()) return "";
  if (t.is_conj()) return "a tensor with the conjugate bit set (call .resolve_conj() first)";
  if (t.is_neg()) return "a tensor with the negative bit set (call .resolve_neg() first)";
  if (t._is_zerotensor()) return "an efficient zero tensor (no storage)";
  if (t.layout() != at::kStrided) {
    std::ostringstream os;
    os << "a tensor with layout " << t.layout() << " (call .to_dense() first)";
    return os.str();
  }
  return "";
}

// "swap_blocks" for pagedspec::swap_blocks.
std::string op_name(const c10::OperatorHandle& op) {
  const std::string& qualified = op.schema().name();
  return qualified.substr(qualified.find("::") + 2);
}

// Raises for the first tensor argument (by schema name; list elements as name[i]) that is not a
// plain dense tensor.
void check_plain_arguments(const c10::OperatorHandle& op, const torch::jit::Stack& stack) {
  const std::string name = op_name(op);
  const auto& arguments = op.schema().arguments();
  const size_t first = stack.size() - arguments.size();
  for (size_t i = 0; i < arguments.size(); ++i) {
    const c10::IValue& value = stack[first + i];
    const auto fail = [&](const std::string& arg, const std::string& reason) {
      TORCH_CHECK(false, "pagedspec.", name, ": ", arg,
                  " must be a plain dense tensor (no conjugate/negative bit), got ", reason);
    };
    if (value.isTensor()) {
      const std::string reason = unplain_reason(value.toTensor());
      if (!reason.empty()) fail(arguments[i].name(), reason);
    } else if (value.isTensorList()) {
      const auto list = value.toTensorList();
      for (size_t j = 0; j < list.size(); ++j) {
        const std::string reason = unplain_reason(list.get(j));
        if (!reason.empty()) fail(arguments[i].name() + "[" + std::to_string(j) + "]", reason);
      }
    }
  }
}

// On the Conjugate / Negative / ZeroTensor keys, which sit above the backends: reject, or (no
// offending argument, which the dispatcher's key computation makes unexpected) run the backend
// kernel below those keys.
void reject_math_bits(const c10::OperatorHandle& op, c10::DispatchKeySet keys,
                      torch::jit::Stack* stack) {
  check_plain_arguments(op, *stack);
  // Conjugate is the lowest of the three keys, so this drops all of them (and everything above).
  op.redispatchBoxed(keys & c10::DispatchKeySet(c10::DispatchKeySet::FULL_AFTER,
                                                c10::DispatchKey::Conjugate),
                     stack);
}

// On the sparse backend keys: some argument is sparse whenever this runs, so it always raises
// with that argument's name (instead of the dispatcher's "could not run ... with arguments from
// the 'SparseCPU' backend").
void reject_sparse(const c10::OperatorHandle& op, c10::DispatchKeySet keys,
                   torch::jit::Stack* stack) {
  check_plain_arguments(op, *stack);
  TORCH_CHECK(false, "pagedspec.", op_name(op),
              ": every tensor argument must be a plain dense tensor, got dispatch keys ", keys);
}

// Defines an op and registers the argument guards above for it.
void define(torch::Library& m, const char* schema) {
  m.def(schema);
  const std::string name(schema, std::strchr(schema, '('));
  for (const auto key : {c10::DispatchKey::Conjugate, c10::DispatchKey::Negative,
                         c10::DispatchKey::ZeroTensor}) {
    m.impl(name.c_str(),
           torch::dispatch(key, torch::CppFunction::makeFromBoxedFunction<&reject_math_bits>()));
  }
  for (const auto key : {c10::DispatchKey::SparseCPU, c10::DispatchKey::SparseCUDA,
                         c10::DispatchKey::SparseMeta, c10::DispatchKey::SparseCsrCPU,
                         c10::DispatchKey::SparseCsrCUDA, c10::DispatchKey::SparseCsrMeta}) {
    m.impl(name.c_str(),
           torch::dispatch(key, torch::CppFunction::makeFromBoxedFunction<&reject_sparse>()));
  }
}

}  // namespace

// Every op is defined through define(): besides its schema, it gets the guards that reject
// conjugate / negative / zero / sparse tensor arguments with the argument's name.
TORCH_LIBRARY(pagedspec, m) {
  // Writes token t's key/value into cache slot slot_mapping[t] (-1 skips), converting to the
  // cache dtype (FP8: saturate(x / scale), round to nearest even).
  define(m,
      "reshape_and_cache(Tensor key, Tensor value, Tensor(a!) key_cache, Tensor(b!) value_cache, "
      "Tensor slot_mapping, Tensor? k_scale=None, Tensor? v_scale=None) -> ()");

  // Paged attention, one pass per (sequence, KV head group); decode and multi-token verification.
  define(m,
      "paged_attention_v1(Tensor(a!) out, Tensor query, Tensor key_cache, Tensor value_cache, "
      "Tensor block_tables, Tensor seq_lens, Tensor cu_seqlens_q, int max_q_len, float scale, "
      "Tensor? k_scale=None, Tensor? v_scale=None, Tensor(b!)? lse=None, "
      "Tensor(c!)? attn_mass=None) -> ()");
  // Paged attention with the context split into partitions merged by log-sum-exp.
  define(m,
      "paged_attention_v2(Tensor(a!) out, Tensor query, Tensor key_cache, Tensor value_cache, "
      "Tensor block_tables, Tensor seq_lens, Tensor cu_seqlens_q, int max_q_len, float scale, "
      "Tensor? k_scale=None, Tensor? v_scale=None, Tensor(b!)? lse=None, "
      "Tensor(c!)? attn_mass=None) -> ()");
  // Picks v1 or v2 by the documented occupancy/context-length heuristic.
  define(m,
      "paged_attention(Tensor(a!) out, Tensor query, Tensor key_cache, Tensor value_cache, "
      "Tensor block_tables, Tensor seq_lens, Tensor cu_seqlens_q, int max_q_len, float scale, "
      "Tensor? k_scale=None, Tensor? v_scale=None, Tensor(b!)? lse=None, "
      "Tensor(c!)? attn_mass=None) -> ()");

  // Split-KV plan for a step (host-resident seq_lens / cu_seqlens_q, int32): which work items
  // paged_attention_run launches and where partial results go, chosen from the real lengths and
  // the device (partition_size: 0 chooses, -1 never splits, > 0 forces). max_items /
  // max_partial_rows bound the plan (and size it: a CUDA graph captured with one plan runs any
  // plan made with the same bounds). Returns int32 [8 + 2 * num_seqs + 3 * capacity] on the CPU.
  define(m,
      "paged_attention_plan(Tensor seq_lens, Tensor cu_seqlens_q, int num_heads, "
      "int num_kv_heads, Device device, int partition_size=0, int max_items=-1, "
      "int max_partial_rows=-1) -> Tensor");
  // paged_attention through a plan (on query's device) and a float32 workspace holding the
  // plan's partial rows; same meaning and arguments as paged_attention.
  define(m,
      "paged_attention_run(Tensor(a!) out, Tensor query, Tensor key_cache, Tensor value_cache, "
      "Tensor block_tables, Tensor seq_lens, Tensor cu_seqlens_q, int max_q_len, float scale, "
      "Tensor plan, Tensor(b!) workspace, Tensor? k_scale=None, Tensor? v_scale=None, "
      "Tensor(c!)? lse=None, Tensor(d!)? attn_mass=None) -> ()");

  // out = saturate(input / scale) as FP8 (scale: [] or [input.size(-2)]).
  define(m, "quantize_fp8(Tensor(a!) out, Tensor input, Tensor scale) -> ()");
  // out = fp8 input * scale, in out's dtype.
  define(m, "dequantize_fp8(Tensor(a!) out, Tensor input, Tensor scale) -> ()");

  // Copy-on-write: copies block src -> dst for every (src, dst) row, in every layer, one launch.
  define(m,
      "copy_blocks(Tensor(a!)[] key_caches, Tensor(b!)[] value_caches, Tensor block_mapping) "
      "-> ()");
  // Offload/reload: copies block mapping[j, 0] of src to block mapping[j, 1] of dst, across devices.
  define(m, "swap_blocks(Tensor src, Tensor(a!) dst, Tensor block_mapping) -> ()");

  // Speculative-decoding rejection sampler -> (output_token_ids int64 [B, k+1],
  // num_accepted int32 [B]).
  define(m,
      "rejection_sample(Tensor draft_token_ids, Tensor? draft_probs, Tensor target_probs, "
      "Tensor uniform_accept, Tensor uniform_resample, Tensor? num_draft_tokens=None) "
      "-> (Tensor, Tensor)");
  // Greedy verification: accept while draft == target argmax -> same outputs as rejection_sample.
  define(m,
      "greedy_verify(Tensor draft_token_ids, Tensor target_token_ids, "
      "Tensor? num_draft_tokens=None) -> (Tensor, Tensor)");

  // Count-min sketch update (plain or conservative), saturating int32 counters.
  define(m,
      "cms_update(Tensor(a!) sketch, Tensor keys, Tensor? increments=None, "
      "bool conservative=False) -> ()");
  // Count-min sketch point query -> int32 [n] (min over rows).
  define(m, "cms_query(Tensor sketch, Tensor keys) -> Tensor");
  // Ages every counter: counter >>= shift.
  define(m, "cms_decay(Tensor(a!) sketch, int shift=1) -> ()");
}

// The model runner's own ops: not part of the contract (engines bring their own GEMMs), CPU only.
TORCH_LIBRARY(pagedspec_models, m) {
  // out [M, N] = input [M, K] . W^T (+ bias [N]) for W stored packed
  // (include/pagedspec/packed_linear.h); float32 or bfloat16 throughout, float32 sums. With
  // onednn_weight (W prepacked for oneDNN, mkldnn::_reorder_linear_weight), products of more
  // than max_packed_rows rows take oneDNN's kernel on it instead.
  define(m,
      "packed_linear(Tensor input, Tensor weight, Tensor? bias=None, "
      "Tensor? onednn_weight=None, int max_packed_rows=4) -> Tensor");
}

// `import pagedspec._C` loads this library (and so runs the registrations above); the module
// itself only carries build facts for pagedspec.build_info().
#ifndef PAGEDSPEC_CUDA_ARCHS
#define PAGEDSPEC_CUDA_ARCHS ""
#endif
#ifndef PAGEDSPEC_CUDA_VERSION
#define PAGEDSPEC_CUDA_VERSION ""
#endif

// The CPU configuration now (cpu/isa.h), or a Python RuntimeError for a bad environment value.
static bool read_cpu_config(pagedspec::CpuConfig* config) {
  try {
    *config = pagedspec::cpu_config();
    return true;
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
    return false;
  }
}

// _C.cpu_config(): the whole CPU configuration in use now, as a dict (build_info()["cpu"]).
static PyObject* cpu_config_in_use(PyObject*, PyObject*) {
  pagedspec::CpuConfig c;
  if (!read_cpu_config(&c)) return nullptr;
  return Py_BuildValue("{s:s,s:O,s:O,s:O,s:O,s:O}", "isa", pagedspec::cpu_isa_name(c.isa),
                       "amx", c.amx ? Py_True : Py_False, "amx_decode",
                       c.amx_decode ? Py_True : Py_False, "bf16_dot",
                       c.bf16_dot ? Py_True : Py_False, "fp8_images",
                       c.fp8_images ? Py_True : Py_False, "avx512_vbmi",
                       c.avx512_vbmi ? Py_True : Py_False);
}

// _C.cpu_isa(), cpu_amx(), cpu_bf16_dot() / cpu_bf16_dot_fp8() (one answer: the opt-in covers
// both caches), cpu_fp8_images(): single fields of the configuration, as build_info's keys.
#define PAGEDSPEC_CPU_CONFIG_FIELD(NAME, EXPR)            \
  static PyObject* NAME(PyObject*, PyObject*) {           \
    pagedspec::CpuConfig c;                               \
    if (!read_cpu_config(&c)) return nullptr;             \
    return EXPR;                                          \
  }
PAGEDSPEC_CPU_CONFIG_FIELD(cpu_isa_in_use, PyUnicode_FromString(pagedspec::cpu_isa_name(c.isa)))
PAGEDSPEC_CPU_CONFIG_FIELD(cpu_amx_in_use, PyBool_FromLong(c.amx))
PAGEDSPEC_CPU_CONFIG_FIELD(cpu_bf16_dot_in_use, PyBool_FromLong(c.bf16_dot))
PAGEDSPEC_CPU_CONFIG_FIELD(cpu_fp8_images_in_use, PyBool_FromLong(c.fp8_images))
#undef PAGEDSPEC_CPU_CONFIG_FIELD

static PyMethodDef kMethods[] = {
    {"cpu_config", cpu_config_in_use, METH_NOARGS, "The CPU kernels' configuration in use."},
    {"cpu_isa", cpu_isa_in_use, METH_NOARGS, "The CPU kernels' ISA level in use."},
    {"cpu_amx", cpu_amx_in_use, METH_NOARGS, "Whether CPU attention uses AMX now."},
    {"cpu_bf16_dot", cpu_bf16_dot_in_use, METH_NOARGS,
     "Whether CPU attention on bf16 caches uses AVX512-BF16 dot products now."},
    {"cpu_bf16_dot_fp8", cpu_bf16_dot_in_use, METH_NOARGS,
     "Whether CPU attention on FP8 caches uses AVX512-BF16 dot products now."},
    {"cpu_fp8_images", cpu_fp8_images_in_use, METH_NOARGS,
     "Whether CPU attention's FMA path reads FP8 tiles as images now."},
    {nullptr, nullptr, 0, nullptr}};

extern "C" PyMODINIT_FUNC PyInit__C(void) {
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, kMethods};
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
  // The attention head sizes, from the kernels' one list (the fakes and build_info read it).
  PyObject* head_sizes = PyTuple_New(std::size(pagedspec::kAttentionHeadSizes));
  if (head_sizes == nullptr) return nullptr;
  for (size_t i = 0; i < std::size(pagedspec::kAttentionHeadSizes); ++i) {
    PyTuple_SET_ITEM(head_sizes, i, PyLong_FromLong(pagedspec::kAttentionHeadSizes[i]));
  }
  if (PyModule_AddObject(module, "attention_head_sizes", head_sizes) < 0) return nullptr;
  // The CPU ISA levels the kernels are built for, and those this CPU runs.
  PyObject* levels = PyTuple_New(3);
  PyObject* supported = PyList_New(0);
  if (levels == nullptr || supported == nullptr) return nullptr;
  int i = 0;
  for (auto isa : {pagedspec::CpuIsa::kBaseline, pagedspec::CpuIsa::kAvx2,
                   pagedspec::CpuIsa::kAvx512}) {
    PyTuple_SET_ITEM(levels, i++, PyUnicode_FromString(pagedspec::cpu_isa_name(isa)));
    if (pagedspec::cpu_supports(isa)) {
      PyObject* name = PyUnicode_FromString(pagedspec::cpu_isa_name(isa));
      PyList_Append(supported, name);
      Py_DECREF(name);
    }
  }
  if (PyModule_AddObject(module, "cpu_isa_levels", levels) < 0) return nullptr;
  if (PyModule_AddObject(module, "cpu_isa_supported", supported) < 0) return nullptr;
  return module;
}
