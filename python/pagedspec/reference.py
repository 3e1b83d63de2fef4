"""Pure-PyTorch meaning of every pagedspec op: the executable form of CONTRACT.md.

Written for clarity, not speed: the tests hold the CPU and CUDA kernels to these functions and the
benchmarks report the kernels' speedup over them. Signatures match :mod:`pagedspec.ops`; ops that
write into buffers do so here too.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}


def _is_fp8(dtype: torch.dtype) -> bool:
    return dtype in FP8_MAX


def _scale_for_heads(scale: torch.Tensor, ndim: int) -> torch.Tensor:
    """Broadcast a ``[]`` or ``[H]`` scale against ``[..., H, D]``."""
    scale = scale.to(torch.float32)
    if scale.dim() == 1:
        return scale.reshape((1,) * (ndim - 2) + (-1, 1))
    return scale


# ----------------------------------------------------------------------------------------------
# FP8


def quantize_fp8(out: torch.Tensor, input: torch.Tensor, scale: torch.Tensor) -> None:
    """out = saturate(input / scale) in out's FP8 format (round to nearest even, NaN kept)."""
    fp8_max = FP8_MAX[out.dtype]
    scaled = input.float() / _scale_for_heads(scale, input.dim())
    out.copy_(scaled.clamp(-fp8_max, fp8_max).to(out.dtype))


def dequantize_fp8(out: torch.Tensor, input: torch.Tensor, scale: torch.Tensor) -> None:
    """out = input * scale, computed in float32."""
    out.copy_((input.float() * _scale_for_heads(scale, input.dim())).to(out.dtype))


def dequantize_cache(cache: torch.Tensor, scale: Optional[torch.Tensor]) -> torch.Tensor:
    """A paged cache ``[NB, BS, Hkv, D]`` as float32 values (FP8 read as stored * scale)."""
    if not _is_fp8(cache.dtype):
        return cache.float()
    values = torch.empty(cache.shape, dtype=torch.float32, device=cache.device)
    one = torch.ones((), dtype=torch.float32, device=cache.device)
    dequantize_fp8(values, cache, one if scale is None else scale)
    return values


# ----------------------------------------------------------------------------------------------
# Cache management


def reshape_and_cache(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                      value_cache: torch.Tensor, slot_mapping: torch.Tensor,
                      k_scale: Optional[torch.Tensor] = None,
                      v_scale: Optional[torch.Tensor] = None) -> None:
    """Token t's K/V go to slot slot_mapping[t] (-1 skips), converted to the cache dtype."""
    block_size = key_cache.shape[1]
    for t, slot in enumerate(slot_mapping.tolist()):
        if slot < 0:
            continue
        block, offset = divmod(slot, block_size)
        for src, cache, scale in ((key, key_cache, k_scale), (value, value_cache, v_scale)):
            row = src[t]  # [Hkv, D]
            if _is_fp8(cache.dtype):
                quantized = torch.empty(row.shape, dtype=cache.dtype, device=cache.device)
                one = torch.ones((), dtype=torch.float32, device=row.device)
                quantize_fp8(quantized, row, one if scale is None else scale)
                cache[block, offset] = quantized
            else:
                cache[block, offset] = row.to(cache.dtype)


def copy_blocks(key_caches: Sequence[torch.Tensor], value_caches: Sequence[torch.Tensor],
                block_mapping: torch.Tensor) -> None:
    """For every (src, dst) row: block dst := block src, in every layer's K and V cache."""
    pairs = block_mapping.tolist()
    dsts = [dst for _, dst in pairs]
    srcs = {src for src, _ in pairs}
    if len(set(dsts)) != len(dsts) or srcs.intersection(dsts):
        raise ValueError("copy_blocks: a dst block repeats or is also a src block")
    for cache in (*key_caches, *value_caches):
        for src, dst in pairs:
            cache[dst] = cache[src]


def swap_blocks(src: torch.Tensor, dst: torch.Tensor, block_mapping: torch.Tensor) -> None:
    """dst[block_mapping[j, 1]] := src[block_mapping[j, 0]] for every j, in order."""
    for s, d in block_mapping.tolist():
        dst[d] = src[s].to(dst.device)


# ----------------------------------------------------------------------------------------------
# Paged attention (issue 3)


def paged_attention(out: torch.Tensor, query: torch.Tensor, key_cache: torch.Tensor,
                    value_cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                    cu_seqlens_q: torch.Tensor, max_q_len: int, scale: float,
                    k_scale: Optional[torch.Tensor] = None, v_scale: Optional[torch.Tensor] = None,
                    lse: Optional[torch.Tensor] = None,
                    attn_mass: Optional[torch.Tensor] = None) -> None:
    """Paged attention for decode and verification, computed in float32 sequence by sequence.

    Gathers each sequence's K/V through its block table (only positions < seq_len, so unused
    slots are never read), dequantizes FP8 (stored * scale), and applies causal softmax attention:
    query token j of a sequence with q_len query tokens sees positions 0 .. seq_len - q_len + j.
    Writes ``out`` (query's dtype), ``lse`` (natural log, float32 [T, Hq]) and adds the attention
    probability per slot, summed over heads and query tokens, into ``attn_mass``. ``max_q_len`` is
    only a bound; the lengths come from ``cu_seqlens_q``.
    """
    num_heads, head_size = query.shape[1], query.shape[2]
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    group = num_heads // num_kv_heads
    flat_k = key_cache.view(-1, num_kv_heads, head_size)  # [NB * BS, Hkv, D]
    flat_v = value_cache.view(-1, num_kv_heads, head_size)
    cu = cu_seqlens_q.tolist()
    for i, seq_len in enumerate(seq_lens.tolist()):
        first, last = cu[i], cu[i + 1]
        q_len = last - first
        if q_len == 0:
            continue
        positions = torch.arange(seq_len, device=query.device)
        slots = block_tables[i].long()[positions // block_size] * block_size + positions % block_size
        k = dequantize_cache(flat_k[slots], k_scale)  # [S, Hkv, D] float32
        v = dequantize_cache(flat_v[slots], v_scale)
        k = k.repeat_interleave(group, dim=1)  # [S, Hq, D]: head h reads KV head h // group
        v = v.repeat_interleave(group, dim=1)
        q = query[first:last].float()  # [L, Hq, D]
        logits = torch.einsum("lhd,shd->hls", q, k) * scale  # [Hq, L, S]
        limit = seq_len - q_len + torch.arange(q_len, device=query.device)  # [L]
        masked = positions[None, :] > limit[:, None]  # [L, S]
        logits = logits.masked_fill(masked, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        out[first:last] = torch.einsum("hls,shd->lhd", probs, v).to(out.dtype)
        if lse is not None:
            lse[first:last] = torch.logsumexp(logits, dim=-1).transpose(0, 1)
        if attn_mass is not None:
            attn_mass.index_add_(0, slots, probs.sum(dim=(0, 1)))


# v1 and v2 differ only in how the kernels split the work; they mean the same thing.
paged_attention_v1 = paged_attention
paged_attention_v2 = paged_attention


# ----------------------------------------------------------------------------------------------
# Speculative decoding verification (issue 4)


def rejection_sample(draft_token_ids, draft_probs, target_probs, uniform_accept, uniform_resample,
                     num_draft_tokens=None):
    raise NotImplementedError("reference.rejection_sample: see issue 4")


def greedy_verify(draft_token_ids, target_token_ids, num_draft_tokens=None):
    raise NotImplementedError("reference.greedy_verify: see issue 4")


# ----------------------------------------------------------------------------------------------
# Count-min sketch (issue 5)


def cms_update(sketch, keys, increments=None, conservative=False):
    raise NotImplementedError("reference.cms_update: see issue 5")


def cms_query(sketch, keys):
    raise NotImplementedError("reference.cms_query: see issue 5")


def cms_decay(sketch, shift=1):
    raise NotImplementedError("reference.cms_decay: see issue 5")
