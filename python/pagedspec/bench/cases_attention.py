"""Benchmark cases for paged attention: decode (q_len 1) and speculative verification (q_len 5)
over batch sizes and context lengths, with bf16 and FP8 (e4m3) caches.

Bytes moved are what attention must read and write at least: every sequence's K and V rows once
(seq_len x num_kv_heads x head_size x element size, twice) plus the query and the output. The
block table and index tensors are a few KB and are not counted.

GPU targets: batch 64 / context 4096 / llama3-8b / bf16 decode at >= 85% of the copy
bandwidth; FP8 >= 1.7x faster than bf16 on that shape; batch 1 / context 64k (v2) >= 70%;
verification (q_len 5) within 1.3x of decode on the same context. CPU target: batch 8 / context
2048 at >= 50% of the copy bandwidth and >= 3x the reference.
"""
from __future__ import annotations

import math

import torch

from pagedspec import ops, reference
from pagedspec.bench.core import MODELS, Workload, register

BLOCK_SIZE = 16
# Above this many KV tokens the pure-PyTorch reference (a per-sequence loop that materializes
# float32 K/V for every query head) takes too long or too much memory to be worth timing.
REFERENCE_MAX_TOKENS = 1 << 17

_OPS = {"auto": ops.paged_attention, "v1": ops.paged_attention_v1, "v2": ops.paged_attention_v2}
# "run": paged_attention_run through a plan made (untimed, once per step in an engine, shared by
# every layer) from the real lengths.


def _dtype_name(dtype: torch.dtype) -> str:
    return {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32",
            torch.float8_e4m3fn: "fp8e4m3", torch.float8_e5m2: "fp8e5m2"}[dtype]


def _attention_case(model: str, batch: int, context: int, q_len: int, cache_dtype: torch.dtype,
                    query_dtype: torch.dtype = torch.bfloat16, variant: str = "auto",
                    quick: bool = False, devices=("cpu", "cuda"), table_blocks: int = 0):
    """``table_blocks``: pad every block table to this width (as a table sized for the model's
    longest context, or a CUDA graph's static table, is); 0 keeps it tight."""
    num_heads, num_kv_heads, head_size = MODELS[model]
    kind = "decode" if q_len == 1 else f"verify-q{q_len}"
    name = (f"{kind}/{model}/B={batch}/ctx={context}/{_dtype_name(cache_dtype)}"
            + (f"/{variant}" if variant != "auto" else "")
            + (f"/table={table_blocks}" if table_blocks else ""))
    if query_dtype != torch.bfloat16:
        name += f"/q={_dtype_name(query_dtype)}"

    @register("attention", name, quick=quick, devices=devices, model=model, batch=batch,
              context=context, q_len=q_len, cache=_dtype_name(cache_dtype), variant=variant,
              table_blocks=table_blocks)
    def build(device) -> Workload:
        blocks_per_seq = math.ceil(context / BLOCK_SIZE)
        num_blocks = batch * blocks_per_seq
        shape = (num_blocks, BLOCK_SIZE, num_kv_heads, head_size)
        fp8 = cache_dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
        init_dtype = torch.bfloat16 if fp8 else cache_dtype
        key_cache = torch.randn(shape, dtype=init_dtype, device=device).to(cache_dtype)
        value_cache = torch.randn(shape, dtype=init_dtype, device=device).to(cache_dtype)
        scale_t = torch.tensor(1.0, device=device) if fp8 else None
        block_tables = torch.randperm(num_blocks, device=device).view(batch, blocks_per_seq).int()
        if table_blocks > blocks_per_seq:
            padded = torch.zeros(batch, table_blocks, dtype=torch.int32, device=device)
            padded[:, :blocks_per_seq] = block_tables
            block_tables = padded
        seq_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
        cu_seqlens_q = torch.arange(batch + 1, dtype=torch.int32, device=device) * q_len
        query = torch.randn(batch * q_len, num_heads, head_size, dtype=query_dtype, device=device)
        out = torch.empty_like(query)
        args = (out, query, key_cache, value_cache, block_tables, seq_lens, cu_seqlens_q, q_len,
                head_size ** -0.5, scale_t, scale_t)
        kv_bytes = 2 * batch * context * num_kv_heads * head_size * key_cache.element_size()
        nbytes = kv_bytes + 2 * query.numel() * query.element_size()
        if variant == "run":
            plan = ops.plan_paged_attention(seq_lens.cpu(), cu_seqlens_q.cpu(), num_heads,
                                            num_kv_heads, head_size, device)
            call = lambda: ops.paged_attention_run(*args[:9], plan.plan, plan.workspace,  # noqa
                                                   *args[9:])
        else:
            call = lambda: _OPS[variant](*args)  # noqa: E731
        ref = None
        if batch * context <= REFERENCE_MAX_TOKENS:
            ref = lambda: reference.paged_attention(*args)  # noqa: E731
        return Workload(call, nbytes, ref, items=batch * q_len,
                        items_unit="query tokens")


# Decode across batch sizes and contexts (the big ones only where the memory is).
for _batch, _context, _quick, _devices in [
    (1, 512, False, ("cpu", "cuda")),
    (1, 4096, False, ("cpu", "cuda")),
    (8, 2048, True, ("cpu", "cuda")),          # the CPU target shape
    (16, 512, False, ("cpu", "cuda")),
    (16, 4096, False, ("cpu", "cuda")),
    (1, 32768, False, ("cpu", "cuda")),
    (16, 32768, False, ("cuda",)),
    (64, 512, False, ("cuda",)),
    (64, 4096, True, ("cuda",)),               # the GPU decode target shape
    (64, 32768, False, ("cuda",)),
    (256, 512, False, ("cuda",)),
    (256, 4096, False, ("cuda",)),
    (256, 32768, False, ("cuda",)),
]:
    for _cache in (torch.bfloat16, torch.float8_e4m3fn):
        _attention_case("llama3-8b", _batch, _context, 1, _cache, quick=_quick, devices=_devices)

# CPU target with a float32 cache too.
_attention_case("llama3-8b", 8, 2048, 1, torch.float32, query_dtype=torch.float32, quick=True,
                devices=("cpu",))

# Verification of 4 draft tokens (q_len 5) on the same contexts as decode.
for _batch, _context, _quick, _devices in [
    (8, 2048, True, ("cpu", "cuda")),
    (1, 4096, False, ("cpu", "cuda")),
    (16, 4096, False, ("cpu", "cuda")),
    (64, 4096, True, ("cuda",)),
    (64, 32768, False, ("cuda",)),
]:
    for _cache in (torch.bfloat16, torch.float8_e4m3fn):
        _attention_case("llama3-8b", _batch, _context, 5, _cache, quick=_quick, devices=_devices)

# Long context at batch 1: v2 (what the dispatcher picks) against v1.
for _variant in ("auto", "v1", "v2"):
    _attention_case("llama3-8b", 1, 65536, 1, torch.bfloat16, variant=_variant,
                    quick=_variant == "auto", devices=("cuda",))
_attention_case("llama3-8b", 1, 65536, 1, torch.float8_e4m3fn, devices=("cuda",))
_attention_case("llama3-8b", 1, 16384, 1, torch.bfloat16, variant="v1", devices=("cpu",))
_attention_case("llama3-8b", 1, 16384, 1, torch.bfloat16, variant="v2", devices=("cpu",))

# Other group sizes / head sizes.
for _model in ("llama3-70b-tp8", "tinyllama-h64"):
    _attention_case(_model, 64, 4096, 1, torch.bfloat16, devices=("cuda",))
    _attention_case(_model, 64, 4096, 5, torch.bfloat16, devices=("cuda",))
    _attention_case(_model, 8, 2048, 1, torch.bfloat16, devices=("cpu",))

# Split-KV sized by the real lengths (plan/run) against the grid launches, with a tight table and
# one padded to 8192 blocks (128k tokens at block size 16): on CUDA v2's grid and scratch follow
# the table's width, the plan's follow the lengths; on CPU both follow the lengths.
for _table in (0, 8192):
    for _variant in ("auto", "v2", "run") if _table else ("v2", "run"):  # tight auto: above
        _attention_case("llama3-8b", 64, 4096, 1, torch.bfloat16, variant=_variant,
                        devices=("cuda",), table_blocks=_table)
        _attention_case("llama3-8b", 8, 2048, 1, torch.bfloat16, variant=_variant,
                        devices=("cpu",), table_blocks=_table)
    _attention_case("llama3-8b", 1, 16384, 1, torch.bfloat16, variant="run", devices=("cpu",),
                    table_blocks=_table)
