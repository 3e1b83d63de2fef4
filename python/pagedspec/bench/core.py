"""The benchmark registry and timing: op families register cases, the runner times them.

A case builds its tensors once for a device and returns a :class:`Workload`: the kernel call, the
pure-PyTorch reference call, and the bytes the kernel must move at least (what its bandwidth is
computed from). Cases live in ``cases_<family>.py`` beside this file.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

# Shapes taken from real models: (query heads, KV heads, head size) per GPU.
MODELS = {
    "llama3-8b": (32, 8, 128),       # Llama-3-8B
    "llama3-70b-tp8": (8, 1, 128),   # Llama-3-70B (64 q / 8 kv heads) split over 8 GPUs
    "tinyllama-h64": (32, 4, 64),    # TinyLlama-1.1B: a small head-size-64 model
}


@dataclass
class Workload:
    run: Callable[[], object]                    # the pagedspec kernel call
    bytes_moved: int                             # minimum bytes read + written by one call
    reference: Optional[Callable[[], object]] = None  # the same work in pure PyTorch
    items: Optional[int] = None                  # work items per call (e.g. sketch updates)
    items_unit: str = ""                         # what an item is, e.g. "updates"


@dataclass
class Case:
    op: str                                      # op family, the --op filter matches it
    name: str                                    # unique, human-readable parameters
    build: Callable[[torch.device], Workload]
    quick: bool = False                          # part of --quick
    devices: tuple = ("cpu", "cuda")
    params: dict = field(default_factory=dict)   # for tables and plots


CASES: list[Case] = []


def register(op: str, name: str, quick: bool = False, devices=("cpu", "cuda"), **params):
    """Decorator: ``@register("cache", "reshape_and_cache/llama3-8b/T=256", quick=True)`` on a
    function ``build(device) -> Workload``."""

    def wrap(build: Callable[[torch.device], Workload]):
        CASES.append(Case(op, name, build, quick, tuple(devices), params))
        return build

    return wrap


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_call(fn: Callable[[], object], device: torch.device, *, min_reps: int = 5,
              max_reps: int = 200, budget_s: float = 1.0, warmup: int = 2) -> float:
    """Median seconds per call. CUDA: events around each call (the L2 is not flushed, the
    caches under test are larger than it in the bandwidth cases); CPU: perf_counter."""
    for _ in range(warmup):
        fn()
    synchronize(device)
    times: list[float] = []
    start_all = time.perf_counter()
    while len(times) < max_reps and (len(times) < min_reps
                                     or time.perf_counter() - start_all < budget_s):
        if device.type == "cuda":
            begin = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            begin.record()
            fn()
            end.record()
            end.synchronize()
            times.append(begin.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure_copy_bandwidth(device: torch.device, nbytes: int = 1 << 30) -> float:
    """Bytes per second of a large device-to-device copy (read + write counted), the ceiling the
    kernels' bandwidth is compared against. 1 GiB on CUDA; 256 MiB on CPU."""
    if device.type != "cuda":
        nbytes = min(nbytes, 256 << 20)
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_(0, 255)
    dst = torch.empty_like(src)
    seconds = time_call(lambda: dst.copy_(src), device, min_reps=10, budget_s=2.0)
    return 2 * nbytes / seconds
