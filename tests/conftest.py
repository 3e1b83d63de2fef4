"""Shared test fixtures: the device grid (CUDA cases skip with a reason when no GPU is present)
and seeded random generators, so every test uses fresh, reproducible random data; and
load_script, a tools/ script as a module."""
from __future__ import annotations

import importlib.util
import sys
import zlib
from pathlib import Path
from types import ModuleType

import pytest
import torch

import pagedspec

HAS_CUDA = pagedspec.build_info()["cuda_available"]
CUDA_SKIP_REASON = (
    "no CUDA GPU available" if "cuda" in pagedspec.build_info()["backends"]
    else "pagedspec was built without CUDA kernels"
)

requires_cuda = pytest.mark.skipif(not HAS_CUDA, reason=CUDA_SKIP_REASON)


def load_script(path: Path) -> ModuleType:
    """A script (tools/*.py) as a module named after its file, for its functions."""
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module          # dataclasses look their module up while defined
    spec.loader.exec_module(module)
    return module

# Parametrize a test over devices with `@pytest.mark.parametrize("device", DEVICES)`.
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.cuda, requires_cuda])]


def pytest_collection_modifyitems(config, items):
    # Anything marked `cuda` skips without a GPU, even if it forgot `requires_cuda`.
    for item in items:
        if "cuda" in item.keywords and not HAS_CUDA:
            item.add_marker(pytest.mark.skip(reason=CUDA_SKIP_REASON))


@pytest.fixture
def gen(request) -> torch.Generator:
    """A CPU generator seeded from the test's id: fresh data per test, same data per rerun."""
    g = torch.Generator()
    g.manual_seed(zlib.crc32(request.node.nodeid.encode()))
    return g


@pytest.fixture(scope="module")
def one_thread():
    """Module-wide single-threaded torch (``pytestmark = pytest.mark.usefixtures("one_thread")``):
    the tiny models' matrices make intra-op threads pure synchronization, which on a loaded
    2-core machine costs ~100x the work (16 ms vs 80 us per projection, measured)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
