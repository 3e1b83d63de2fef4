"""Fake (meta) kernels: output shapes and dtypes without computing, so ``torch.compile`` can trace
the ops and ``torch.library.opcheck`` can check their schemas.

A fake kernel validates exactly what the C++ launchers validate without reading tensor contents
(``csrc/checks.h`` and ``csrc/*_checks.h``: dtypes, ranks, sizes, contiguity, devices, optional
arguments, scale shapes) and raises ``RuntimeError`` with the same message form,
``pagedspec.<op>: <argument> <expected>, got <given>``. Checks of index *values* (block ids, slots,
draft ids) need the data and stay in the real kernels.

The dispatcher sends a call to the Meta kernel (this one) as soon as any argument is a meta
tensor, so a meta tensor mixed with CPU or CUDA tensors is an error here, naming the meta
argument: otherwise the call would silently do nothing and return uninitialized outputs.
"""
from __future__ import annotations

import math
from typing import Optional, Sequence

import torch
from torch.library import register_fake

from pagedspec import _C
from pagedspec.ops import OP_NAMES
from pagedspec.reference import MAX_ATTENTION_SCALE

_DTYPE_NAMES = {  # the names the C++ messages print (c10::ScalarType)
    torch.float16: "Half", torch.bfloat16: "BFloat16", torch.float32: "Float",
    torch.float64: "Double", torch.float8_e4m3fn: "Float8_e4m3fn",
    torch.float8_e5m2: "Float8_e5m2", torch.int32: "Int", torch.int64: "Long",
}
_ACTIVATION = (torch.float16, torch.bfloat16, torch.float32)
_CACHE = (*_ACTIVATION, torch.float8_e4m3fn, torch.float8_e5m2)
_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def _name(dtype: torch.dtype) -> str:
    return _DTYPE_NAMES.get(dtype, str(dtype))


def _shape(t: torch.Tensor) -> list:
    return list(t.shape)


def _check(cond, op: str, message) -> None:
    """``torch._check`` (works for symbolic sizes too) with the C++ message form."""
    torch._check(cond, lambda: f"pagedspec.{op}: {message() if callable(message) else message}")


def _dtype(op, name, t, allowed) -> None:
    _check(t.dtype in allowed, op, lambda: f"{name} must have dtype in "
           f"{{{', '.join(_name(a) for a in allowed)}}}, got {_name(t.dtype)}")


def _same_dtype(op, name, t, ref_name, ref) -> None:
    _check(t.dtype == ref.dtype, op, lambda: f"{name} must have the same dtype as {ref_name} "
           f"({_name(ref.dtype)}), got {_name(t.dtype)}")


def _dim(op, name, t, ndim) -> None:
    _check(t.dim() == ndim, op,
           lambda: f"{name} must have {ndim} dimensions, got {t.dim()} (shape {_shape(t)})")


def _size(op, name, t, dim, expected, what=None) -> None:
    _check(t.size(dim) == expected, op, lambda: f"{name}.size({dim}) must be {expected}"
           f"{f' ({what})' if what else ''}, got {t.size(dim)} (shape {_shape(t)})")


def _exact_shape(op, name, t, expected) -> None:
    expected = list(expected)
    _check(_shape(t) == expected, op,
           lambda: f"{name} must have shape {expected}, got {_shape(t)}")


def _contiguous(op, name, t) -> None:
    _check(t.is_contiguous(), op, lambda: f"{name} must be contiguous, got strides "
           f"{list(t.stride())} for shape {_shape(t)}")


def _last_dim_contiguous(op, name, t) -> None:
    _check(t.stride(-1) == 1, op, lambda: f"{name} must be contiguous in the last (head_size) "
           f"dimension, got strides {list(t.stride())}")


def _no_meta_mix(op: str, tensors: dict, optional: tuple = ()) -> None:
    """A meta tensor among real-device tensors: the dispatcher routed the whole call here. Also
    rejects None (an undefined tensor from ``torch.ops``) for a required tensor argument."""
    for n, t in tensors.items():
        _check(t is not None or n in optional, op, f"{n} must be a defined Tensor, got None")
    present = {n: t for n, t in tensors.items() if t is not None}
    meta = [n for n, t in present.items() if t.device.type == "meta"]
    real = [n for n, t in present.items() if t.device.type != "meta"]
    if meta and real:
        _check(False, op, lambda: f"{meta[0]} must be on the same device as {real[0]} "
               f"({present[real[0]].device}), got meta (meta tensors cannot be mixed with "
               f"tensors on a real device)")


def _same_device(op, name, t, ref_name, ref) -> None:
    _check(t.device == ref.device, op, lambda: f"{name} must be on the same device as "
           f"{ref_name} ({ref.device}), got {t.device}")


def _scale(op, name, scale: Optional[torch.Tensor], num_heads, device) -> None:
    """csrc/checks.h make_scale_ref: float32, [] or [num_heads], on `device`, contiguous."""
    if scale is None:
        return
    _dtype(op, name, scale, (torch.float32,))
    _check(scale.device == device, op, lambda: f"{name} must be on {device}, got {scale.device}")
    _check(scale.dim() == 0 or (scale.dim() == 1 and scale.size(0) == num_heads), op,
           lambda: f"{name} must have shape [] or [{num_heads}], got {_shape(scale)}")
    _check(scale.is_contiguous(), op, f"{name} must be contiguous")


def _block_strided(op, name, t) -> int:
    """csrc/checks.h check_block_strided: dense but for the block dimension, whose stride is at
    least one block. Returns the block stride in elements."""
    block = 1
    for d in range(t.dim() - 1, 0, -1):
        _check(t.size(d) == 1 or t.stride(d) == block, op,
               lambda: f"{name} must be contiguous in every dimension but the first (block) one, "
               f"got strides {list(t.stride())} for shape {_shape(t)}")
        block *= t.size(d)
    if t.dim() == 0 or t.size(0) <= 1:
        return block
    _check(t.stride(0) >= block, op,
           lambda: f"{name}.stride(0) (block stride) must be at least one block's elements "
           f"({block}) so that blocks do not overlap, got strides {list(t.stride())} for shape "
           f"{_shape(t)}")
    return t.stride(0)


def _cache_tensor(op, name, cache) -> int:
    _dim(op, name, cache, 4)
    stride = _block_strided(op, name, cache)
    _dtype(op, name, cache, _CACHE)
    return stride


def _cache_pair(op, key_cache, value_cache) -> None:
    """csrc/checks.h check_cache_pair."""
    _dim(op, "key_cache", key_cache, 4)
    _dim(op, "value_cache", value_cache, 4)
    _block_strided(op, "key_cache", key_cache)
    _block_strided(op, "value_cache", value_cache)
    _dtype(op, "key_cache", key_cache, _CACHE)
    _same_dtype(op, "value_cache", value_cache, "key_cache", key_cache)
    _exact_shape(op, "value_cache", value_cache, key_cache.shape)
    _check(value_cache.size(0) <= 1 or value_cache.stride(0) == key_cache.stride(0), op,
           lambda: f"value_cache.stride(0) (block stride) must equal key_cache's "
           f"({key_cache.stride(0)}), got {value_cache.stride(0)}")


# ------------------------------------------------------------------------------------------
# cache ops (csrc/cache_checks.h)

def _reshape_and_cache_fake(key, value, key_cache, value_cache, slot_mapping, k_scale=None,
                            v_scale=None) -> None:
    op = "reshape_and_cache"
    _no_meta_mix(op, dict(key=key, value=value, key_cache=key_cache, value_cache=value_cache,
                          slot_mapping=slot_mapping, k_scale=k_scale, v_scale=v_scale),
                 optional=("k_scale", "v_scale"))
    _dtype(op, "key", key, _ACTIVATION)
    _same_dtype(op, "value", value, "key", key)
    _dim(op, "key", key, 3)
    _exact_shape(op, "value", value, key.shape)
    _cache_pair(op, key_cache, value_cache)
    _size(op, "key", key, 1, key_cache.size(2), "num_kv_heads of key_cache")
    _size(op, "key", key, 2, key_cache.size(3), "head_size of key_cache")
    _check(key.stride(2) == 1 and value.stride(2) == 1, op,
           lambda: "key and value must be contiguous in the last (head_size) dimension, got "
           f"strides {key.stride(2)} and {value.stride(2)}")
    _dtype(op, "slot_mapping", slot_mapping, (torch.int64,))
    _dim(op, "slot_mapping", slot_mapping, 1)
    _size(op, "slot_mapping", slot_mapping, 0, key.size(0), "num_tokens of key")
    _contiguous(op, "slot_mapping", slot_mapping)
    for name, t in (("value", value), ("key_cache", key_cache), ("value_cache", value_cache),
                    ("slot_mapping", slot_mapping)):
        _same_device(op, name, t, "key", key)
    if key_cache.dtype in _FP8:
        _scale(op, "k_scale", k_scale, key_cache.size(2), key.device)
        _scale(op, "v_scale", v_scale, key_cache.size(2), key.device)
    else:
        _same_dtype(op, "key_cache", key_cache, "key", key)


def _block_mapping(op, mapping) -> None:
    _dtype(op, "block_mapping", mapping, (torch.int64,))
    _dim(op, "block_mapping", mapping, 2)
    _size(op, "block_mapping", mapping, 1, 2, "(src, dst) pairs")
    _contiguous(op, "block_mapping", mapping)


def _copy_blocks_fake(key_caches: Sequence[torch.Tensor], value_caches: Sequence[torch.Tensor],
                      block_mapping) -> None:
    op = "copy_blocks"
    named = {f"key_caches[{i}]": t for i, t in enumerate(key_caches)}
    named.update({f"value_caches[{i}]": t for i, t in enumerate(value_caches)})
    _no_meta_mix(op, {**named, "block_mapping": block_mapping})
    _check(len(key_caches) == len(value_caches), op, lambda: "key_caches and value_caches must "
           f"have the same length, got {len(key_caches)} and {len(value_caches)}")
    _block_mapping(op, block_mapping)
    if not key_caches:
        return
    ref = key_caches[0]
    stride = _cache_tensor(op, "key_caches[0]", ref)
    for i, (k, v) in enumerate(zip(key_caches, value_caches)):
        for name, t in ((f"key_caches[{i}]", k), (f"value_caches[{i}]", v)):
            _check(t.shape == ref.shape and t.dtype == ref.dtype and t.device == ref.device, op,
                   lambda: f"{name} must match key_caches[0] (shape {_shape(ref)}, "
                   f"{_name(ref.dtype)}, {ref.device}), got shape {_shape(t)}, "
                   f"{_name(t.dtype)}, {t.device}")
            _check(_block_strided(op, name, t) == stride, op,
                   lambda: f"{name}.stride(0) (block stride) must equal key_caches[0]'s "
                   f"({stride}), got {t.stride(0)}")
    _same_device(op, "block_mapping", block_mapping, "key_caches[0]", ref)


def _swap_blocks_fake(src, dst, block_mapping) -> None:
    op = "swap_blocks"
    _no_meta_mix(op, dict(src=src, dst=dst, block_mapping=block_mapping))
    _check(src.dim() >= 1, op, "src must have at least 1 dimension")
    _block_strided(op, "src", src)
    _check(dst.dim() >= 1, op, "dst must have at least 1 dimension")
    _block_strided(op, "dst", dst)
    _same_dtype(op, "dst", dst, "src", src)
    _check(src.dim() == dst.dim() and src.shape[1:] == dst.shape[1:], op,
           lambda: f"dst must have the same block shape as src ({_shape(src)} vs {_shape(dst)}); "
           "only the number of blocks may differ")
    _block_mapping(op, block_mapping)
    # src and dst may be on different devices: CPU and (at most) one accelerator device.
    tensors = (("src", src), ("dst", dst), ("block_mapping", block_mapping))
    accel = next((t.device for _, t in tensors if t.device.type not in ("cpu", "meta")), None)
    for name, t in tensors:
        _check(t.device.type in ("cpu", "meta") or t.device == accel, op,
               lambda: f"{name} must be on CPU or on {accel}, got {t.device}")


# ------------------------------------------------------------------------------------------
# attention (csrc/attention_checks.h check_attention)

_HEAD_SIZES = _C.attention_head_sizes  # the kernels' one list


def _attention_fake(op, out, query, key_cache, value_cache, block_tables, seq_lens, cu_seqlens_q,
                    max_q_len, scale, k_scale=None, v_scale=None, lse=None,
                    attn_mass=None) -> None:
    _no_meta_mix(op, dict(out=out, query=query, key_cache=key_cache, value_cache=value_cache,
                          block_tables=block_tables, seq_lens=seq_lens,
                          cu_seqlens_q=cu_seqlens_q, k_scale=k_scale, v_scale=v_scale, lse=lse,
                          attn_mass=attn_mass),
                 optional=("k_scale", "v_scale", "lse", "attn_mass"))
    # float32 queries are a CPU-only feature (the CUDA launcher passes allow_float32=false).
    allowed = (torch.float16, torch.bfloat16) if query.device.type == "cuda" else _ACTIVATION
    _dtype(op, "query", query, allowed)
    _dim(op, "query", query, 3)
    _last_dim_contiguous(op, "query", query)
    _same_dtype(op, "out", out, "query", query)
    _exact_shape(op, "out", out, query.shape)
    _last_dim_contiguous(op, "out", out)
    _cache_pair(op, key_cache, value_cache)
    fp8 = key_cache.dtype in _FP8
    _check(fp8 or key_cache.dtype == query.dtype, op,
           lambda: f"key_cache must have query's dtype ({_name(query.dtype)}) or an FP8 dtype "
           f"(Float8_e4m3fn, Float8_e5m2), got {_name(key_cache.dtype)}")
    num_tokens, num_heads, head_size = query.shape
    num_blocks, block_size, num_kv_heads = key_cache.shape[:3]
    _size(op, "key_cache", key_cache, 3, head_size, "head_size of query")
    _check(head_size in _HEAD_SIZES, op, lambda: "query.size(2) (head_size) must be one of "
           f"{{{', '.join(map(str, _HEAD_SIZES))}}}, got {head_size}")
    power_of_two = (block_size & (block_size - 1)) == 0 if isinstance(block_size, int) else True
    _check(1 <= block_size <= 1024 and power_of_two, op,
           lambda: "key_cache.size(1) (block_size) must be a power of two in [1, 1024], got "
           f"{block_size}")
    _check(num_kv_heads >= 1 and num_heads % num_kv_heads == 0, op,
           lambda: f"query.size(1) (num_heads = {num_heads}) must be a multiple of "
           f"key_cache.size(2) (num_kv_heads), got num_kv_heads = {num_kv_heads}")
    _dtype(op, "block_tables", block_tables, (torch.int32,))
    _dim(op, "block_tables", block_tables, 2)
    _contiguous(op, "block_tables", block_tables)
    _dtype(op, "seq_lens", seq_lens, (torch.int32,))
    _dim(op, "seq_lens", seq_lens, 1)
    _contiguous(op, "seq_lens", seq_lens)
    num_seqs = seq_lens.size(0)
    _size(op, "block_tables", block_tables, 0, num_seqs, "num_seqs of seq_lens")
    _dtype(op, "cu_seqlens_q", cu_seqlens_q, (torch.int32,))
    _dim(op, "cu_seqlens_q", cu_seqlens_q, 1)
    _contiguous(op, "cu_seqlens_q", cu_seqlens_q)
    _size(op, "cu_seqlens_q", cu_seqlens_q, 0, num_seqs + 1, "num_seqs + 1")
    _check(max_q_len >= 0, op, lambda: f"max_q_len must be >= 0, got {max_q_len}")
    _check(num_tokens == 0 or max_q_len >= 1, op,
           lambda: f"max_q_len must be >= 1 when there are query tokens, got {max_q_len}")
    _check(num_tokens < 2 ** 31 and num_blocks * block_size < 2 ** 31, op,
           lambda: "num_tokens and num_blocks * block_size must fit in int32, got "
           f"{num_tokens} and {num_blocks * block_size}")
    _check(num_tokens * num_heads < 2 ** 31, op,
           lambda: f"num_tokens x num_heads must fit in int32, got {num_tokens} x {num_heads}")
    _check(math.isfinite(scale) and scale > 0, op,
           lambda: f"scale must be finite and > 0, got {scale}")
    _check(scale <= MAX_ATTENTION_SCALE, op,
           lambda: f"scale must be at most {MAX_ATTENTION_SCALE:g} (float32 max / log2(e): logits "
           f"are scaled by scale x log2(e) in float32), got {scale}")
    if lse is not None:
        _dtype(op, "lse", lse, (torch.float32,))
        _exact_shape(op, "lse", lse, (num_tokens, num_heads))
        _contiguous(op, "lse", lse)
    if attn_mass is not None:
        _dtype(op, "attn_mass", attn_mass, (torch.float32,))
        _exact_shape(op, "attn_mass", attn_mass, (num_blocks * block_size,))
        _contiguous(op, "attn_mass", attn_mass)
    for name, t in (("out", out), ("key_cache", key_cache), ("value_cache", value_cache),
                    ("block_tables", block_tables), ("seq_lens", seq_lens),
                    ("cu_seqlens_q", cu_seqlens_q), ("lse", lse), ("attn_mass", attn_mass)):
        if t is not None:
            _same_device(op, name, t, "query", query)
    if fp8:
        _scale(op, "k_scale", k_scale, num_kv_heads, query.device)
        _scale(op, "v_scale", v_scale, num_kv_heads, query.device)


def _attention_variant(op: str):
    def fake(out, query, key_cache, value_cache, block_tables, seq_lens, cu_seqlens_q, max_q_len,
             scale, k_scale=None, v_scale=None, lse=None, attn_mass=None) -> None:
        _attention_fake(op, out, query, key_cache, value_cache, block_tables, seq_lens,
                        cu_seqlens_q, max_q_len, scale, k_scale, v_scale, lse, attn_mass)
    return fake


# ------------------------------------------------------------------------------------------
# FP8 conversion (csrc/fp8_checks.h)

def _paged_attention_plan_fake(seq_lens, cu_seqlens_q, num_heads, num_kv_heads, device,
                               partition_size=0, max_items=-1, max_partial_rows=-1):
    op = "paged_attention_plan"
    _no_meta_mix(op, dict(seq_lens=seq_lens, cu_seqlens_q=cu_seqlens_q))
    for name, t in (("seq_lens", seq_lens), ("cu_seqlens_q", cu_seqlens_q)):
        _dtype(op, name, t, (torch.int32,))
        _dim(op, name, t, 1)
        _contiguous(op, name, t)
        _check(t.device.type != "cuda", op, lambda: f"{name} must be on the CPU (the plan is "
               f"made on the host before the step), got {t.device}")
    num_seqs = seq_lens.size(0)
    _size(op, "cu_seqlens_q", cu_seqlens_q, 0, num_seqs + 1, "num_seqs + 1")
    _check(num_kv_heads >= 1 and num_heads >= 1 and num_heads % num_kv_heads == 0, op,
           lambda: "num_heads must be a positive multiple of num_kv_heads, got "
           f"{num_heads} and {num_kv_heads}")
    _check(torch.device(device).type in ("cpu", "cuda"), op,
           lambda: f"device must be cpu or cuda, got {device}")
    _check(partition_size >= -1, op, lambda: "partition_size must be 0 (choose), -1 (never "
           f"split) or a positive size, got {partition_size}")
    # The capacity is the number of items unless max_items fixes it: data-dependent then.
    if max_items > 0:
        capacity = max_items
    else:
        try:
            capacity = torch.library.get_ctx().new_dynamic_size()
        except RuntimeError as e:  # plain meta tensors: no values, no dynamic sizes
            raise RuntimeError(f"pagedspec.{op}: max_items must be given to plan on meta "
                               "tensors (the plan's length depends on seq_lens' values), got "
                               f"{max_items}") from e
    return seq_lens.new_empty(8 + 2 * num_seqs + 3 * capacity)


def _paged_attention_run_fake(out, query, key_cache, value_cache, block_tables, seq_lens,
                              cu_seqlens_q, max_q_len, scale, plan, workspace, k_scale=None,
                              v_scale=None, lse=None, attn_mass=None) -> None:
    op = "paged_attention_run"
    _no_meta_mix(op, dict(out=out, query=query, plan=plan, workspace=workspace))
    _attention_fake(op, out, query, key_cache, value_cache, block_tables, seq_lens, cu_seqlens_q,
                    max_q_len, scale, k_scale, v_scale, lse, attn_mass)
    num_seqs = seq_lens.size(0)
    _dtype(op, "plan", plan, (torch.int32,))
    _dim(op, "plan", plan, 1)
    _contiguous(op, "plan", plan)
    _same_device(op, "plan", plan, "query", query)
    fixed = 8 + 2 * num_seqs
    _check(plan.numel() >= fixed and (plan.numel() - fixed) % 3 == 0, op,
           lambda: f"plan must have {fixed} + 3 x capacity elements for {num_seqs} sequences "
           f"(from paged_attention_plan), got {plan.numel()}")
    _dtype(op, "workspace", workspace, (torch.float32,))
    _dim(op, "workspace", workspace, 1)
    _contiguous(op, "workspace", workspace)
    _same_device(op, "workspace", workspace, "query", query)


def _fp8_convert_fake(op: str, quantize: bool):
    def fake(out, input, scale) -> None:
        _no_meta_mix(op, dict(out=out, input=input, scale=scale))
        fp8, wide = (out, input) if quantize else (input, out)
        fp8_name, wide_name = ("out", "input") if quantize else ("input", "out")
        _dtype(op, fp8_name, fp8, _FP8)
        _dtype(op, wide_name, wide, _ACTIVATION)
        _exact_shape(op, "out", out, input.shape)
        _contiguous(op, "out", out)
        _contiguous(op, "input", input)
        _same_device(op, "out", out, "input", input)
        heads = input.size(-2) if input.dim() >= 2 else 1
        _dtype(op, "scale", scale, (torch.float32,))
        _same_device(op, "scale", scale, "input", input)
        _check(scale.dim() == 0 or (scale.dim() == 1 and input.dim() >= 2
                                    and scale.size(0) == heads), op,
               lambda: f"scale must have shape [] or [input.size(-2)] = [{heads}], got "
               f"{_shape(scale)}")
    return fake


# ------------------------------------------------------------------------------------------
# sampling (csrc/sampling_checks.h)

def _tensor(op, name, t, dtype, ndim, ref, ref_name) -> None:
    _dtype(op, name, t, (dtype,))
    _dim(op, name, t, ndim)
    _same_device(op, name, t, ref_name, ref)
    _contiguous(op, name, t)


def _draft_tokens(op, draft_token_ids, num_draft_tokens) -> None:
    _tensor(op, "draft_token_ids", draft_token_ids, torch.int64, 2, draft_token_ids,
            "draft_token_ids")
    if num_draft_tokens is not None:
        _tensor(op, "num_draft_tokens", num_draft_tokens, torch.int32, 1, draft_token_ids,
                "draft_token_ids")
        _size(op, "num_draft_tokens", num_draft_tokens, 0, draft_token_ids.size(0),
              "batch size of draft_token_ids")


def _verify_outputs(draft_token_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    batch, k = draft_token_ids.shape
    output_token_ids = draft_token_ids.new_empty((batch, k + 1), dtype=torch.int64)
    num_accepted = draft_token_ids.new_empty((batch,), dtype=torch.int32)
    return output_token_ids, num_accepted


def _rejection_sample_fake(draft_token_ids, draft_probs, target_probs, uniform_accept,
                           uniform_resample, num_draft_tokens=None):
    op = "rejection_sample"
    _no_meta_mix(op, dict(draft_token_ids=draft_token_ids, draft_probs=draft_probs,
                          target_probs=target_probs, uniform_accept=uniform_accept,
                          uniform_resample=uniform_resample, num_draft_tokens=num_draft_tokens),
                 optional=("draft_probs", "num_draft_tokens"))
    _draft_tokens(op, draft_token_ids, num_draft_tokens)
    batch, k = draft_token_ids.shape
    ref = draft_token_ids
    _tensor(op, "target_probs", target_probs, torch.float32, 3, ref, "draft_token_ids")
    _size(op, "target_probs", target_probs, 0, batch, "batch size of draft_token_ids")
    _size(op, "target_probs", target_probs, 1, k + 1,
          "k + 1: one row per draft token plus the bonus position")
    vocab = target_probs.size(2)
    _check(vocab > 0, op, lambda: "target_probs.size(2) (vocabulary size) must be positive, got "
           f"shape {_shape(target_probs)}")
    if draft_probs is not None:
        _tensor(op, "draft_probs", draft_probs, torch.float32, 3, ref, "draft_token_ids")
        _size(op, "draft_probs", draft_probs, 0, batch, "batch size of draft_token_ids")
        _size(op, "draft_probs", draft_probs, 1, k, "k = draft_token_ids.size(1)")
        _size(op, "draft_probs", draft_probs, 2, vocab, "vocabulary size of target_probs")
    _tensor(op, "uniform_accept", uniform_accept, torch.float32, 2, ref, "draft_token_ids")
    _exact_shape(op, "uniform_accept", uniform_accept, (batch, k))
    _tensor(op, "uniform_resample", uniform_resample, torch.float32, 2, ref, "draft_token_ids")
    _exact_shape(op, "uniform_resample", uniform_resample, (batch, k + 1))
    return _verify_outputs(draft_token_ids)


def _greedy_verify_fake(draft_token_ids, target_token_ids, num_draft_tokens=None):
    op = "greedy_verify"
    _no_meta_mix(op, dict(draft_token_ids=draft_token_ids, target_token_ids=target_token_ids,
                          num_draft_tokens=num_draft_tokens), optional=("num_draft_tokens",))
    _draft_tokens(op, draft_token_ids, num_draft_tokens)
    _tensor(op, "target_token_ids", target_token_ids, torch.int64, 2, draft_token_ids,
            "draft_token_ids")
    _exact_shape(op, "target_token_ids", target_token_ids,
                 (draft_token_ids.size(0), draft_token_ids.size(1) + 1))
    return _verify_outputs(draft_token_ids)


# ------------------------------------------------------------------------------------------
# count-min sketch (csrc/sketch_checks.h)

_SKETCH_MAX_DEPTH = 16


def _sketch(op, sketch) -> None:
    _dtype(op, "sketch", sketch, (torch.int32,))
    _dim(op, "sketch", sketch, 2)
    _contiguous(op, "sketch", sketch)
    _check(1 <= sketch.size(0) <= _SKETCH_MAX_DEPTH, op,
           lambda: f"sketch depth (size(0)) must be in [1, {_SKETCH_MAX_DEPTH}], got "
           f"{sketch.size(0)} (shape {_shape(sketch)})")
    _check(sketch.size(1) >= 1, op, lambda: f"sketch width (size(1)) must be >= 1, got "
           f"{sketch.size(1)} (shape {_shape(sketch)})")


def _sketch_keys(op, keys, sketch) -> None:
    _dtype(op, "keys", keys, (torch.int64,))
    _dim(op, "keys", keys, 1)
    _contiguous(op, "keys", keys)
    _same_device(op, "keys", keys, "sketch", sketch)
    _check(keys.size(0) <= 2 ** 30, op, lambda: "keys must have at most 2^30 elements (split "
           f"larger batches), got {keys.size(0)}")


def _cms_update_fake(sketch, keys, increments=None, conservative=False) -> None:
    op = "cms_update"
    _no_meta_mix(op, dict(sketch=sketch, keys=keys, increments=increments),
                 optional=("increments",))
    _sketch(op, sketch)
    _sketch_keys(op, keys, sketch)
    if increments is not None:
        _dtype(op, "increments", increments, (torch.int32,))
        _dim(op, "increments", increments, 1)
        _size(op, "increments", increments, 0, keys.size(0), "one per key")
        _contiguous(op, "increments", increments)
        _same_device(op, "increments", increments, "sketch", sketch)


def _cms_query_fake(sketch, keys):
    op = "cms_query"
    _no_meta_mix(op, dict(sketch=sketch, keys=keys))
    _sketch(op, sketch)
    _sketch_keys(op, keys, sketch)
    return keys.new_empty((keys.size(0),), dtype=torch.int32)


def _cms_decay_fake(sketch, shift=1) -> None:
    op = "cms_decay"
    _no_meta_mix(op, dict(sketch=sketch))
    _sketch(op, sketch)
    _check(0 <= shift <= 31, op, lambda: f"shift must be in [0, 31], got {shift}")


FAKES = {
    "reshape_and_cache": _reshape_and_cache_fake,
    "copy_blocks": _copy_blocks_fake,
    "swap_blocks": _swap_blocks_fake,
    "paged_attention_v1": _attention_variant("paged_attention_v1"),
    "paged_attention_v2": _attention_variant("paged_attention_v2"),
    "paged_attention": _attention_variant("paged_attention"),
    "paged_attention_plan": _paged_attention_plan_fake,
    "paged_attention_run": _paged_attention_run_fake,
    "quantize_fp8": _fp8_convert_fake("quantize_fp8", quantize=True),
    "dequantize_fp8": _fp8_convert_fake("dequantize_fp8", quantize=False),
    "rejection_sample": _rejection_sample_fake,
    "greedy_verify": _greedy_verify_fake,
    "cms_update": _cms_update_fake,
    "cms_query": _cms_query_fake,
    "cms_decay": _cms_decay_fake,
}

# Ops registered in C++ without a fake here are left alone (tests/test_build.py fails on them).
for _name_ in OP_NAMES:
    if _name_ in FAKES:
        register_fake(f"pagedspec::{_name_}")(FAKES[_name_])
