"""What the compiled CUDA kernels do with memory, read from their SASS without a GPU: hot kernels
use 16-byte global loads, and no kernel touches local memory (spills or stack arrays)."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

import pagedspec

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import sass_report  # noqa: E402

pytestmark = pytest.mark.skipif("cuda" not in pagedspec.build_info()["backends"],
                                reason="pagedspec was built without CUDA kernels")

# (regex on the demangled kernel name, SASS memory op every matching kernel must contain)
VECTORIZED = [
    (r"reshape_and_cache_kernel<.*, 8>", "LDG.128"),
    (r"reshape_and_cache_kernel<float, .*, 4>", "LDG.128"),
    (r"copy_blocks_kernel<uint4>", "LDG.128"),
    (r"swap_blocks_kernel<uint4>", "LDG.128"),
    (r"rejection_sample_kernel<4>", "LDG.128"),
    (r"paged_attention_kernel<", "LDG.128"),
    (r"fp8_convert_kernel<(__half|__nv_bfloat16|float), unsigned char, .*, 8>", "STG.64"),
]


@pytest.fixture(scope="module", params=pagedspec.build_info()["cuda_archs"] or ["none"])
def kernels(request):
    arch = "sm_" + request.param.replace(".", "")
    if sass_report.find_cuobjdump() is None:
        pytest.skip("cuobjdump not found (CUDA toolkit or triton's wheel)")
    try:
        ops = sass_report.kernel_memory_ops(sass_report.default_library(), arch)
    except subprocess.CalledProcessError as exc:
        pytest.skip(f"cuobjdump failed: {exc.stderr[:200]}")
    names = sass_report.demangle(sorted(ops))
    return {names[k]: v for k, v in ops.items()}


def test_no_kernel_uses_local_memory(kernels):
    offenders = [name for name, ops in kernels.items() if ops["LDL"] or ops["STL"]]
    assert not offenders, f"local memory in: {offenders}"


@pytest.mark.parametrize("pattern, op", VECTORIZED)
def test_hot_kernels_use_wide_accesses(kernels, pattern, op):
    matching = {name: ops for name, ops in kernels.items() if re.search(pattern, name)}
    assert matching, f"no kernel matches {pattern}"
    for name, ops in matching.items():
        assert ops[op] > 0, f"{name} has no {op}: {dict(ops)}"
