"""Benchmark cases for the cache-management ops and FP8 conversion.

Bytes moved are what the op must read and write at least: for reshape_and_cache the new K/V rows
(read, input dtype) plus the same rows in the cache (written, cache dtype) plus the slot ids; for
copy/swap twice the blocks copied (read + write); for quantize/dequantize input + output.
"""
from __future__ import annotations

import torch

from pagedspec import ops, reference
from pagedspec.bench.core import MODELS, Workload, register

BLOCK_SIZE = 16


def _cache(num_blocks: int, heads: int, head_size: int, dtype: torch.dtype, device) -> torch.Tensor:
    cache = torch.empty(num_blocks, BLOCK_SIZE, heads, head_size, dtype=torch.bfloat16,
                        device=device).normal_()
    return cache.to(dtype)


def _reshape_and_cache_case(model: str, num_tokens: int, cache_dtype: torch.dtype, quick: bool):
    _, kv_heads, head_size = MODELS[model]
    name = f"reshape_and_cache/{model}/T={num_tokens}/{str(cache_dtype).removeprefix('torch.')}"

    @register("cache", name, quick=quick, model=model, tokens=num_tokens)
    def build(device) -> Workload:
        key = torch.randn(num_tokens, kv_heads, head_size, device=device, dtype=torch.bfloat16)
        value = torch.randn_like(key)
        num_blocks = 2 * num_tokens // BLOCK_SIZE + 1
        key_cache = _cache(num_blocks, kv_heads, head_size, cache_dtype, device)
        value_cache = torch.empty_like(key_cache)
        slots = torch.randperm(num_blocks * BLOCK_SIZE, device=device)[:num_tokens]
        scale = torch.tensor(0.05, device=device)
        args = (key, value, key_cache, value_cache, slots, scale, scale)
        row = kv_heads * head_size
        nbytes = 2 * num_tokens * row * (key.element_size() + key_cache.element_size()) \
            + num_tokens * 8
        return Workload(lambda: ops.reshape_and_cache(*args), nbytes,
                        lambda: reference.reshape_and_cache(*args))


for _model, _tokens, _quick in [("llama3-8b", 256, True), ("llama3-8b", 4096, False),
                                ("llama3-70b-tp8", 256, False), ("tinyllama-h64", 4096, False)]:
    for _dtype in (torch.bfloat16, torch.float8_e4m3fn):
        _reshape_and_cache_case(_model, _tokens, _dtype, _quick)


def _copy_blocks_case(model: str, layers: int, pairs: int, quick: bool):
    _, kv_heads, head_size = MODELS[model]

    @register("cache", f"copy_blocks/{model}/L={layers}/pairs={pairs}", quick=quick,
              model=model, layers=layers, pairs=pairs)
    def build(device) -> Workload:
        num_blocks = 4 * pairs
        keys = [_cache(num_blocks, kv_heads, head_size, torch.bfloat16, device) for _ in range(layers)]
        values = [torch.empty_like(k) for k in keys]
        perm = torch.randperm(num_blocks)
        mapping = torch.stack([perm[:pairs], perm[pairs:2 * pairs]], dim=1).to(device)
        block_bytes = keys[0][0].numel() * keys[0].element_size()
        nbytes = 2 * 2 * layers * pairs * block_bytes
        return Workload(lambda: ops.copy_blocks(keys, values, mapping), nbytes,
                        lambda: reference.copy_blocks(keys, values, mapping))


_copy_blocks_case("llama3-8b", 32, 64, True)
_copy_blocks_case("llama3-70b-tp8", 80, 256, False)


def _swap_blocks_case(model: str, blocks: int, direction: str, quick: bool):
    _, kv_heads, head_size = MODELS[model]

    @register("cache", f"swap_blocks/{model}/blocks={blocks}/{direction}", quick=quick,
              model=model, blocks=blocks)
    def build(device) -> Workload:
        # On CUDA: pinned host <-> GPU with the mapping on the GPU (one kernel over mapped memory);
        # on CPU: host to host.
        host = _cache(2 * blocks, kv_heads, head_size, torch.bfloat16, "cpu")
        if device.type == "cuda":
            host = host.pin_memory()
        gpu = _cache(2 * blocks, kv_heads, head_size, torch.bfloat16, device)
        src, dst = (gpu, host) if direction == "offload" else (host, gpu)
        # Scattered blocks (every other one), the case where per-block copies hurt most.
        ids = torch.arange(0, 2 * blocks, 2)
        mapping = torch.stack([ids, ids.flip(0)], dim=1).to(device)
        block_bytes = host[0].numel() * host.element_size()
        return Workload(lambda: ops.swap_blocks(src, dst, mapping), 2 * blocks * block_bytes,
                        lambda: reference.swap_blocks(src, dst, mapping))


for _direction in ("offload", "reload"):
    _swap_blocks_case("llama3-8b", 256, _direction, _direction == "offload")


def _fp8_case(kind: str, num_tokens: int, quick: bool):
    _, kv_heads, head_size = MODELS["llama3-8b"]

    @register("fp8", f"{kind}_fp8/llama3-8b/T={num_tokens}/per-head", quick=quick,
              tokens=num_tokens)
    def build(device) -> Workload:
        wide = torch.randn(num_tokens, kv_heads, head_size, device=device, dtype=torch.bfloat16)
        narrow = torch.empty(wide.shape, dtype=torch.float8_e4m3fn, device=device)
        scale = torch.rand(kv_heads, device=device) + 0.1
        op, ref = (ops.quantize_fp8, reference.quantize_fp8) if kind == "quantize" else \
            (ops.dequantize_fp8, reference.dequantize_fp8)
        out, inp = (narrow, wide) if kind == "quantize" else (wide, narrow)
        nbytes = wide.numel() * (wide.element_size() + narrow.element_size())
        return Workload(lambda: op(out, inp, scale), nbytes, lambda: ref(out, inp, scale))


for _kind in ("quantize", "dequantize"):
    _fp8_case(_kind, 16384, _kind == "quantize")
