"""The package's build and registration: every op of the contract has a schema with the right
mutation annotations, a CPU kernel, a CUDA kernel when CUDA was built, a fake kernel, a typed
wrapper and a reference.

The op list is ``pagedspec.ops.OP_NAMES``, read from the registered schemas; CONTRACT_OPS below is
the contract's statement of what each op writes, and the two must name the same ops, so an op
added in C++ (or dropped) without its fake, wrapper, reference and contract entry fails here."""
from __future__ import annotations

import pytest
import torch

import pagedspec
from pagedspec import _fake
from pagedspec.ops import OP_NAMES

# op -> the arguments it mutates (CONTRACT.md)
CONTRACT_OPS = {
    "reshape_and_cache": {"key_cache", "value_cache"},
    "paged_attention_v1": {"out", "lse", "attn_mass"},
    "paged_attention_v2": {"out", "lse", "attn_mass"},
    "paged_attention": {"out", "lse", "attn_mass"},
    "paged_attention_plan": set(),
    "paged_attention_run": {"out", "workspace", "lse", "attn_mass"},
    "quantize_fp8": {"out"},
    "dequantize_fp8": {"out"},
    "copy_blocks": {"key_caches", "value_caches"},
    "swap_blocks": {"dst"},
    "rejection_sample": set(),
    "greedy_verify": set(),
    "cms_update": {"sketch"},
    "cms_query": set(),
    "cms_decay": {"sketch"},
}


def test_op_list_is_the_registered_schemas():
    registered = {n.split("::", 1)[1] for n in torch._C._dispatch_get_all_op_names()
                  if n.startswith("pagedspec::")}
    assert set(OP_NAMES) == registered
    assert set(CONTRACT_OPS) == registered, "every registered op has a contract entry, and back"
    assert set(_fake.FAKES) == registered, "every registered op has a fake kernel in _fake.py"


def test_build_info():
    info = pagedspec.build_info()
    assert info["backends"][0] == "cpu"
    assert set(info["backends"]) <= {"cpu", "cuda"}
    assert info["torch_built"].split("+")[0] == torch.__version__.split("+")[0]
    if "cuda" in info["backends"]:
        assert info["cuda_archs"], "a CUDA build names its archs"
        assert info["cuda_version"]
    else:
        assert not info["cuda_available"]
    # The contract's head sizes are all built (CONTRACT.md, cache layout: "at least").
    assert {64, 80, 96, 112, 128, 256} <= set(info["attention_head_sizes"])


@pytest.mark.parametrize("name", OP_NAMES)
def test_schema_marks_exactly_the_mutated_arguments(name):
    schema = getattr(torch.ops.pagedspec, name).default._schema
    written = {a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write}
    assert written == CONTRACT_OPS.get(name), f"{name}: no contract entry or other mutations"
    if written:
        assert len(schema.returns) == 0, "ops that write into buffers return nothing"


@pytest.mark.parametrize("name", OP_NAMES)
def test_every_op_has_cpu_and_fake_kernels(name):
    qualified = f"pagedspec::{name}"
    assert torch._C._dispatch_has_kernel_for_dispatch_key(qualified, "CPU")
    assert torch._C._dispatch_has_kernel_for_dispatch_key(qualified, "Meta") or \
        torch._library.simple_registry.singleton.find(qualified).fake_impl.kernel is not None


@pytest.mark.parametrize("name", OP_NAMES)
def test_every_op_has_a_cuda_kernel_in_a_cuda_build(name):
    if "cuda" not in pagedspec.build_info()["backends"]:
        pytest.skip("pagedspec was built without CUDA kernels")
    assert torch._C._dispatch_has_kernel_for_dispatch_key(f"pagedspec::{name}", "CUDA")


@pytest.mark.parametrize("name", OP_NAMES)
def test_every_op_has_a_typed_wrapper_and_a_reference(name):
    wrapper = getattr(pagedspec.ops, name, None)
    assert callable(wrapper), f"{name}: no wrapper in pagedspec.ops"
    assert wrapper.__doc__ and "[" in wrapper.__doc__, f"{name}: docstring states shapes"
    assert callable(getattr(pagedspec.reference, name, None)), f"{name}: no reference"
