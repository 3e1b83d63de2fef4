"""vLLM side of the peer benchmark (run with ``.venv-vllm/bin/python``; see setup_vllm_cpu.sh).

For each case it loads the inputs the pagedspec worker saved (``<data-dir>/<key>.pt``: pagedspec's
block-size-16 paged cache, block tables, lengths, query), takes every sequence's K/V rows out of
that cache, writes them into vLLM's own CPU cache layout with vLLM's
``torch.ops._C.cpu_attn_reshape_and_cache`` and runs ``torch.ops._C.cpu_attention_with_kv_cache``
there, for each block size asked (``--block-sizes``, default 16 and 128).

vLLM's CPU cache (as its CPU attention backend allocates it): one tensor
``[num_blocks, num_kv_heads, block_size, 2 * head_size]`` per layer, viewed as
``[num_blocks, num_kv_heads, 2 * block_size, head_size]`` and split in two along dim 2, so each
(block, KV head) holds its block_size K rows and then its block_size V rows (head-major block
interiors; its AMX kernels pack pairs of rows further). FP8 caches are uint8 holding e4m3 bytes (kv_cache_dtype ``fp8_e4m3``, a per-tensor
float scale). The kernel ISA is chosen as the backend chooses it (``_get_attn_isa`` where
vllm.v1.attention.backends.cpu_attn imports, else the same rule: AMX for bf16 with a block size
that is a multiple of 32 on AMX machines, ``vec`` for other multiples of 32, ``vec16`` otherwise).
The scheduler metadata (``get_scheduler_metadata``, KV split on as by default) is built once per
thread count, untimed, as the backend builds it once per step for all layers; its build time is
reported separately.

With ``--outputs`` it writes vLLM's outputs to ``<out-dir>`` without timing; otherwise it times and prints one JSON line per
(case, thread count).
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

# vLLM picks one of its three builds of vllm._C from torch's view of the CPU (platforms/cpu.py:
# AVX-512 with BF16 -> _C, AVX-512 -> _C_AVX512, else _C_AVX2) and its attention ISA the same way.
# The benchmark's --isa (common.PEER_ISA_ENV) hides from both choices what a CPU of that class
# lacks: avx2 hides AVX-512, BF16 and AMX, so vLLM runs the code it runs on an AVX2-only CPU;
# avx512 hides BF16 and AMX, so it runs _C_AVX512 as on a Skylake-SP or Ice Lake server.
FORCED_ISA = os.environ.get(common.PEER_ISA_ENV, "")
if FORCED_ISA in common.PEER_ISAS:
    if FORCED_ISA == "avx2":
        torch.cpu._is_avx512_supported = lambda: False
    torch.cpu._is_avx512_bf16_supported = lambda: False
    torch.cpu._is_amx_tile_supported = lambda: False
elif FORCED_ISA:
    sys.exit(f"vllm_attention.py: {common.PEER_ISA_ENV} must be one of {sorted(common.PEER_ISAS)} "
             f"or empty, got {FORCED_ISA!r}")

import vllm  # noqa: E402
import vllm._custom_ops  # noqa: E402,F401  (loads vllm._C: registers torch.ops._C.*)

_C = torch.ops._C

# Linux hands out AMX tile state only to a process that asked for it (arch_prctl
# ARCH_REQ_XCOMP_PERM); without it vLLM's "amx" attention kernels die of SIGILL. In a vLLM server
# something else (oneDNN's first AMX matmul) asks first; here nothing does, so ask through torch.
AMX_READY = torch.cpu._is_amx_tile_supported() and bool(torch._C._cpu._init_amx())


def vllm_library() -> str:
    """Which build of vllm._C this process loaded (its file name)."""
    with open("/proc/self/maps") as f:
        names = {os.path.basename(line.split()[-1]) for line in f if "/vllm/_C" in line}
    return ",".join(sorted(names)) or "?"


def attn_isa(dtype: torch.dtype, block_size: int, kv_cache_dtype: str) -> tuple[str, str]:
    """(isa, where the choice came from)."""
    try:
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa
        return _get_attn_isa(dtype, block_size, common.HEAD_SIZE, kv_cache_dtype), "vllm"
    except ImportError:  # the backend module needs the serving stack; the ops do not
        pass
    if block_size % 32 == 0:
        if torch.cpu._is_amx_tile_supported() and dtype == torch.bfloat16:
            return "amx", "rule"
        return "vec", "rule"
    return "vec16", "rule"


def token_rows(data: dict):
    """(key, value, positions, slots): every sequence's K/V rows, sequence after sequence, as
    ``[total_tokens, Hkv, D]`` in the query's dtype (FP8 dequantized with scale 1, exact), taken
    from pagedspec's cache through its block table; ``slots`` are their pagedspec slots."""
    bs = data["block_size"]
    positions, slots = [], []
    for i, seq_len in enumerate(data["seq_lens"].tolist()):
        pos = torch.arange(seq_len)
        slots.append(data["block_tables"][i].long()[pos // bs] * bs + pos % bs)
        positions.append(pos)
    slots = torch.cat(slots)
    dtype = data["query"].dtype
    key = data["key_cache"].view(-1, *data["key_cache"].shape[2:])[slots].to(dtype)
    value = data["value_cache"].view(-1, *data["value_cache"].shape[2:])[slots].to(dtype)
    return key, value, torch.cat(positions), slots


class VllmCase:
    """One case's inputs in vLLM's layout at one block size."""

    def __init__(self, data: dict, block_size: int, seed: int):
        self.data = data
        self.block_size = block_size
        self.fp8 = data["dtype"] == "fp8e4m3"
        self.kv_cache_dtype = "fp8_e4m3" if self.fp8 else "auto"
        self.query = data["query"]
        self.dtype = self.query.dtype
        self.isa, self.isa_from = attn_isa(self.dtype, block_size, self.kv_cache_dtype)
        self.seq_lens = data["seq_lens"].to(torch.int32)
        self.query_start_loc = data["cu_seqlens_q"].to(torch.int32)
        batch = self.seq_lens.numel()
        blocks_per_seq = math.ceil(int(self.seq_lens.max()) / block_size)
        num_blocks = batch * blocks_per_seq
        gen = torch.Generator().manual_seed(seed + block_size)
        self.block_table = (torch.randperm(num_blocks, generator=gen)
                            .view(batch, blocks_per_seq).to(torch.int32))
        cache_dtype = torch.uint8 if self.fp8 else self.dtype
        hkv, d = common.NUM_KV_HEADS, common.HEAD_SIZE
        self.kv_cache = torch.zeros(num_blocks, hkv, block_size, 2 * d, dtype=cache_dtype)
        kv = self.kv_cache.view(num_blocks, hkv, 2 * block_size, d)
        self.key_cache, self.value_cache = kv.chunk(2, dim=2)

        key, value, positions, _ = token_rows(data)
        seq_of_token = torch.repeat_interleave(torch.arange(batch), self.seq_lens.long())
        slot_mapping = (self.block_table.long()[seq_of_token, positions // block_size]
                        * block_size + positions % block_size)
        self.k_scale, self.v_scale = float(data["k_scale"]), float(data["v_scale"])
        t0 = time.perf_counter()
        _C.cpu_attn_reshape_and_cache(key, value, self.key_cache, self.value_cache,
                                      slot_mapping, self.isa, self.k_scale, self.v_scale,
                                      self.kv_cache_dtype)
        self.reshape_s = time.perf_counter() - t0
        self.output = torch.empty_like(self.query)
        self.metadata = None

    def plan(self) -> float:
        """Build the scheduler metadata for the current thread count; returns seconds taken."""
        t0 = time.perf_counter()
        self.metadata = _C.get_scheduler_metadata(
            self.seq_lens.numel(), self.query.shape[1], common.NUM_KV_HEADS, common.HEAD_SIZE,
            self.seq_lens, self.dtype, self.query_start_loc, True, -1, self.isa, True, None,
            self.kv_cache_dtype)
        return time.perf_counter() - t0

    def __call__(self) -> None:
        _C.cpu_attention_with_kv_cache(
            self.query, self.key_cache, self.value_cache, self.output, self.query_start_loc,
            self.seq_lens, self.data["scale"], True, None, -1, self.block_table, 0.0,
            self.metadata, None, None, self.k_scale, self.v_scale, self.kv_cache_dtype)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", required=True, help="JSON list of cases, or @file")
    parser.add_argument("--data-dir", required=True, help="input .pt files from the pagedspec side")
    parser.add_argument("--block-sizes", default="16,128")
    parser.add_argument("--outputs", action="store_true",
                        help="write outputs for the agreement check instead of timing")
    parser.add_argument("--out-dir", help="where --outputs writes (default: --data-dir)")
    parser.add_argument("--budget", type=float, default=0.5, help="seconds timed per column")
    parser.add_argument("--copy-budget", type=float, default=0.5)
    args = parser.parse_args(argv)
    block_sizes = [int(b) for b in args.block_sizes.split(",") if b]
    for case in common.load_cases(args.cases):
        key = common.case_key(case)
        data = common.load_inputs(os.path.join(args.data_dir, key + ".pt"))
        torch.set_num_threads(max(case["threads"]))
        runs, unsupported = {}, {}
        for bs in block_sizes:
            try:
                runs[bs] = VllmCase(data, bs, case["seed"])
            except RuntimeError as e:  # e.g. FP8 needs a block size that is a multiple of 32
                unsupported[f"vllm{bs}"] = {"unsupported": str(e).splitlines()[0],
                                            "block_size": bs}
        base = {"side": "vllm", "case": common.case_name(case), "key": key,
                "vllm": vllm.__version__, "amx_ready": AMX_READY,
                **common.machine_info(vllm_library())}
        if args.outputs:
            out_dir = args.out_dir or args.data_dir
            os.makedirs(out_dir, exist_ok=True)
            info = dict(unsupported)
            for bs, run in runs.items():
                run.plan()
                run()
                torch.save(run.output, os.path.join(out_dir, f"vllm{bs}_{key}.pt"))
                info[f"vllm{bs}"] = {"isa": run.isa, "isa_from": run.isa_from,
                                     "reshape_and_cache_s": run.reshape_s}
            common.emit({**base, "outputs": info})
            continue
        nbytes = common.bytes_moved(case)
        for threads in case["threads"]:
            torch.set_num_threads(threads)
            copy_bps = common.copy_bandwidth(budget_s=args.copy_budget)
            impls = dict(unsupported)
            for bs, run in runs.items():
                plan_s = run.plan()
                seconds, reps = common.time_call(run, budget_s=args.budget)
                impls[f"vllm{bs}"] = {"ms": seconds * 1e3, "gbps": nbytes / seconds / 1e9,
                                      "reps": reps, "block_size": bs, "isa": run.isa,
                                      "plan_ms": plan_s * 1e3}
            common.emit({**base, "threads": threads, "bytes": nbytes,
                         "copy_gbps": copy_bps / 1e9, "impls": impls})
    return 0

if __name__ == "__main__":
    sys.exit(main())
