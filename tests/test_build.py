"""The package's build and registration: every op of the contract has a schema with the right
mutation annotations, a CPU kernel, a CUDA kernel when CUDA was built, and a fake kernel."""
from __future__ import annotations

import pytest
import torch

import pagedspec

# op -> the arguments it mutates (CONTRACT.md)
CONTRACT_OPS = {
    "reshape_and_cache": {"key_cache", "value_cache"},
    "paged_attention_v1": {"out", "lse", "attn_mass"},
    "paged_attention_v2": {"out", "lse", "attn_mass"},
    "paged_attention": {"out", "lse", "attn_mass"},
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


@pytest.mark.parametrize("name", sorted(CONTRACT_OPS))
def test_schema_marks_exactly_the_mutated_arguments(name):
    schema = getattr(torch.ops.pagedspec, name).default._schema
    written = {a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write}
    assert written == CONTRACT_OPS[name]
    if written:
        assert len(schema.returns) == 0, "ops that write into buffers return nothing"


@pytest.mark.parametrize("name", sorted(CONTRACT_OPS))
def test_every_op_has_cpu_and_fake_kernels(name):
    qualified = f"pagedspec::{name}"
    assert torch._C._dispatch_has_kernel_for_dispatch_key(qualified, "CPU")
    assert torch._C._dispatch_has_kernel_for_dispatch_key(qualified, "Meta") or \
        torch._library.simple_registry.singleton.find(qualified).fake_impl.kernel is not None


@pytest.mark.parametrize("name", sorted(CONTRACT_OPS))
def test_every_op_has_a_cuda_kernel_in_a_cuda_build(name):
    if "cuda" not in pagedspec.build_info()["backends"]:
        pytest.skip("pagedspec was built without CUDA kernels")
    assert torch._C._dispatch_has_kernel_for_dispatch_key(f"pagedspec::{name}", "CUDA")


def test_every_op_has_a_typed_wrapper_and_a_reference():
    for name in CONTRACT_OPS:
        wrapper = getattr(pagedspec.ops, name)
        assert wrapper.__doc__ and "[" in wrapper.__doc__, f"{name}: docstring states shapes"
        assert callable(getattr(pagedspec.reference, name))
