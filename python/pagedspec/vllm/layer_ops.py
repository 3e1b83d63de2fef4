"""The vLLM attention backend's work, without vLLM: how a vLLM KV page maps onto pagedspec's
caches, the per-step metadata, and the two calls an attention layer makes (write K/V, attend).

:mod:`pagedspec.vllm.backend` wraps these in vLLM's classes; keeping them here lets the main test
suite check them on fake metadata, with no vLLM installed, on CPU and CUDA alike.

vLLM gives each layer one tensor per KV cache group, viewed ``[num_blocks, H, N, C]`` in logical
order over whatever physical layout it resolved (``C`` = 2 x head_size: K and V). The backend
accepts only layouts in which one block's bytes of one layer form a single dense run (a *page*),
and reads each page as ``[2, block_size, num_kv_heads, head_size]``: K then V, each a block of a
pagedspec cache. So K and V are two views ``[num_blocks, block_size, num_kv_heads, head_size]``
whose block stride is the page stride (twice a block, or more when vLLM puts other layers' pages
between blocks): the contract's strided block dimension. The page content is the backend's own,
as it is for every vLLM backend; vLLM itself only moves whole pages.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from pagedspec import ops

# vLLM's cache dtype names (CacheConfig.cache_dtype) and the pagedspec cache dtypes they mean;
# "auto" is the model's dtype. vLLM's "fp8" is e4m3.
CACHE_DTYPES = {
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
}


def cache_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The dtype of pagedspec's caches for vLLM's ``kv_cache_dtype`` and the model's dtype."""
    if kv_cache_dtype == "auto":
        return model_dtype
    if kv_cache_dtype not in CACHE_DTYPES:
        raise ValueError(f"pagedspec.vllm: kv_cache_dtype must be 'auto' or one of "
                         f"{sorted(CACHE_DTYPES)}, got {kv_cache_dtype!r}")
    return CACHE_DTYPES[kv_cache_dtype]


def kv_cache_views(kv_cache: torch.Tensor, num_kv_heads: int, head_size: int,
                   dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V caches ``[num_blocks, block_size, num_kv_heads, head_size]`` of ``dtype`` over one
    layer's vLLM KV tensor ``[num_blocks, num_kv_heads, block_size, 2 * head_size]`` (logical
    order, any physical order in which each block is one dense page).

    The page is read as K's block then V's block. FP8 pages (vLLM stores them as uint8) are
    viewed as ``dtype``, which must have the same element size as the tensor.
    """
    if kv_cache.dim() != 4:
        raise ValueError(f"pagedspec.vllm: kv_cache must have 4 dimensions [num_blocks, "
                         f"num_kv_heads, block_size, 2 * head_size], got shape "
                         f"{list(kv_cache.shape)}")
    num_blocks, heads, block_size, content = kv_cache.shape
    if heads != num_kv_heads or content != 2 * head_size:
        raise ValueError(f"pagedspec.vllm: kv_cache must have shape [num_blocks, {num_kv_heads}, "
                         f"block_size, {2 * head_size}] (K and V of {num_kv_heads} heads of "
                         f"{head_size}), got {list(kv_cache.shape)}")
    if kv_cache.element_size() != dtype.itemsize:
        raise ValueError(f"pagedspec.vllm: a {dtype} cache needs a kv_cache of the same element "
                         f"size, got {kv_cache.dtype}")
    # The page: the three inner dimensions must tile one dense run of heads x tokens x content.
    inner = sorted(zip(kv_cache.stride()[1:], kv_cache.shape[1:]))
    expected = 1
    for stride, size in inner:
        if size != 1 and stride != expected:
            raise ValueError(
                "pagedspec.vllm: each block of kv_cache must be one dense page (a block-compact "
                "or layer-compact KV cache layout such as LBHNC or LBNHC), got strides "
                f"{list(kv_cache.stride())} for shape {list(kv_cache.shape)}")
        expected *= size
    page = heads * block_size * content
    block_stride = kv_cache.stride(0) if num_blocks > 1 else page
    if block_stride < page:
        raise ValueError(f"pagedspec.vllm: kv_cache's blocks overlap (block stride "
                         f"{block_stride} < page {page} elements)")
    base = kv_cache.view(dtype) if kv_cache.dtype != dtype else kv_cache
    shape = (num_blocks, block_size, num_kv_heads, head_size)
    strides = (block_stride, num_kv_heads * head_size, head_size, 1)
    offset = base.storage_offset()
    key = base.as_strided(shape, strides, offset)
    value = base.as_strided(shape, strides, offset + page // 2)
    return key, value


@dataclass
class PagedSpecMetadata:
    """One step's attention metadata (every layer of a KV cache group shares it).

    Shapes: B = requests, T = tokens of the step (``num_actual_tokens``; vLLM may pad the
    layer's inputs past it), M = block-table width.
    """
    num_actual_tokens: int
    max_query_len: int
    query_start_loc: torch.Tensor  # int32 [B + 1]: pagedspec's cu_seqlens_q
    seq_lens: torch.Tensor  # int32 [B]: context length, the step's tokens included
    block_table: torch.Tensor  # int32 [B, M], padded with block 0 (vLLM's null block)
    slot_mapping: torch.Tensor  # int64 [>= T]; -1 = padding
    plan: Optional[ops.PagedAttentionPlan] = None  # CPU: the step's split-KV plan


def build_metadata(*, num_reqs: int, num_actual_tokens: int, max_query_len: int,
                   query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                   block_table: torch.Tensor, slot_mapping: torch.Tensor, num_heads: int,
                   num_kv_heads: int, head_size: int,
                   query_start_loc_cpu: Optional[torch.Tensor] = None,
                   seq_lens_cpu: Optional[torch.Tensor] = None) -> PagedSpecMetadata:
    """Metadata for one step from vLLM's common attention metadata.

    On CPU the lengths are host tensors, so the step gets one split-KV plan
    (:func:`pagedspec.ops.plan_paged_attention`) that every layer runs through. On CUDA the
    lengths live on the device and reading them would synchronize, so each layer calls
    :func:`pagedspec.ops.paged_attention`, whose dispatcher sizes by the block table.
    """
    meta = PagedSpecMetadata(
        num_actual_tokens=num_actual_tokens, max_query_len=max_query_len,
        query_start_loc=query_start_loc[: num_reqs + 1], seq_lens=seq_lens[:num_reqs],
        block_table=block_table[:num_reqs], slot_mapping=slot_mapping)
    if seq_lens.device.type == "cpu" and num_actual_tokens > 0:
        cu_cpu = (query_start_loc_cpu if query_start_loc_cpu is not None
                  else query_start_loc)[: num_reqs + 1]
        lens_cpu = (seq_lens_cpu if seq_lens_cpu is not None else seq_lens)[:num_reqs]
        meta.plan = ops.plan_paged_attention(lens_cpu.int(), cu_cpu.int(), num_heads,
                                             num_kv_heads, head_size, seq_lens.device)
    return meta


def write_kv(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
             value_cache: torch.Tensor, slot_mapping: torch.Tensor,
             k_scale: Optional[torch.Tensor], v_scale: Optional[torch.Tensor]) -> None:
    """``reshape_and_cache`` of the step's K/V ``[>= n, num_kv_heads, head_size]`` (strided views
    of the fused QKV) into slot_mapping's ``n`` slots; scales are used by FP8 caches only."""
    n = slot_mapping.shape[0]
    ops.reshape_and_cache(key[:n], value[:n], key_cache, value_cache, slot_mapping,
                          k_scale, v_scale)


def attend(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
           meta: PagedSpecMetadata, scale: float, k_scale: Optional[torch.Tensor],
           v_scale: Optional[torch.Tensor], output: torch.Tensor) -> torch.Tensor:
    """Causal paged attention of the step's queries ``[>= T, Hq, D]`` into ``output``
    (``[>= T, Hq * D]`` or ``[>= T, Hq, D]``); rows past T are left as they are."""
    t = meta.num_actual_tokens
    if t == 0:
        return output
    num_heads, head_size = query.shape[-2], query.shape[-1]
    out = output[:t].view(t, num_heads, head_size)
    args = (out, query[:t], key_cache, value_cache, meta.block_table, meta.seq_lens,
            meta.query_start_loc, meta.max_query_len, scale)
    if meta.plan is not None:
        ops.paged_attention_run(*args, meta.plan.plan, meta.plan.workspace, k_scale, v_scale)
    else:
        ops.paged_attention(*args, k_scale, v_scale)
    return output


def scale_tensor(scale: Optional[torch.Tensor], dtype: torch.dtype) -> Optional[torch.Tensor]:
    """vLLM's per-layer K or V scale (a float32 tensor of one element) as pagedspec's ``[]``
    scale for an FP8 cache; None for other caches (which ignore scales)."""
    if dtype not in (torch.float8_e4m3fn, torch.float8_e5m2) or scale is None:
        return None
    return scale.reshape(()) if scale.numel() == 1 else scale
