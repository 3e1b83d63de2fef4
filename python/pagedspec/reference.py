"""Pure-PyTorch meaning of every pagedspec op: the executable form of CONTRACT.md.

Written for clarity, not speed: the tests hold the CPU and CUDA kernels to these functions and the
benchmarks report the kernels' speedup over them. Signatures match :mod:`pagedspec.ops`; ops that
write into buffers do so here too.
"""
from __future__ import annotations

import math
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


def _check_scale(scale: torch.Tensor) -> None:
    """An FP8 scale is finite and positive (anything else turns every value into garbage)."""
    values = scale.detach().float().flatten()
    if not bool((torch.isfinite(values) & (values > 0)).all()):
        raise ValueError(f"FP8 scale must be finite and positive, got {values.tolist()}")


def quantize_fp8(out: torch.Tensor, input: torch.Tensor, scale: torch.Tensor) -> None:
    """out = saturate(input / scale) in out's FP8 format (round to nearest even, NaN kept)."""
    _check_scale(scale)
    fp8_max = FP8_MAX[out.dtype]
    scaled = input.float() / _scale_for_heads(scale, input.dim())
    out.copy_(scaled.clamp(-fp8_max, fp8_max).to(out.dtype))


def dequantize_fp8(out: torch.Tensor, input: torch.Tensor, scale: torch.Tensor) -> None:
    """out = input * scale, computed in float32."""
    _check_scale(scale)
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
    """Token t's K/V go to slot slot_mapping[t] (-1 skips), converted to the cache dtype.

    A slot may be written once per call: a repeated non-negative slot is an error.
    """
    block_size = key_cache.shape[1]
    used = [slot for slot in slot_mapping.tolist() if slot >= 0]
    if len(set(used)) != len(used):
        raise ValueError("reshape_and_cache: a non-negative slot repeats in slot_mapping")
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
    """dst[block_mapping[j, 1]] := src[block_mapping[j, 0]] for every j.

    The pairs must be independent, so their order does not matter: no dst block repeats, and when
    src and dst share memory no src block overlaps any dst block of the call.
    """
    pairs = block_mapping.tolist()
    dsts = [d for _, d in pairs]
    if len(set(dsts)) != len(dsts):
        raise ValueError("swap_blocks: a dst block repeats")
    block_bytes = src[0].nbytes if src.shape[0] else 0
    if src.device == dst.device and block_bytes:
        # Blocks may be strided views (contract extension): block b starts at b * stride(0).
        src_step, dst_step = src.stride(0) * src.element_size(), dst.stride(0) * dst.element_size()
        src_start, dst_start = src.data_ptr(), dst.data_ptr()
        src_end = src_start + (src.shape[0] - 1) * src_step + block_bytes
        dst_end = dst_start + (dst.shape[0] - 1) * dst_step + block_bytes if dst.shape[0] else 0
        if src_start < dst_end and dst_start < src_end:
            for s, _ in pairs:
                a = src_start + s * src_step  # src block s's bytes: [a, a + block_bytes)
                for d in dsts:
                    b = dst_start + d * dst_step
                    if a < b + block_bytes and b < a + block_bytes:
                        raise ValueError(f"swap_blocks: src block {s} overlaps dst block {d}")
    for s, d in pairs:
        dst[d] = src[s].to(dst.device)


# ----------------------------------------------------------------------------------------------
# Paged attention

LOG2E = 1.4426950408889634
# The largest softmax scale: float32 max / log2(e). The kernels scale logits by scale x log2(e) in
# float32 (the log2 domain of their softmax), which must be a finite float32.
MAX_ATTENTION_SCALE = torch.finfo(torch.float32).max / LOG2E


def _attention_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float):
    """Softmax attention of query rows ``q`` [Hq, D] over keys and values [S, Hq, D] (float32):
    (out [Hq, D], lse [Hq], probs [Hq, S]).

    A row whose softmax is undefined gets NaN out, lse and probabilities: a NaN in its query, or
    a logit that overflows to +inf in the log2 domain the kernels compute in (scale x log2(e) x
    q.k in float32, so |scale x q.k| above about 2.36e38). A logit that overflows to -inf there
    weighs 0, and a row all of whose logits do is a row that sees nothing: out 0, lse -inf,
    probabilities 0.
    """
    logits = torch.einsum("hd,shd->hs", q, k) * scale  # [Hq, S]
    log2_logits = logits * LOG2E  # float32, so it overflows where the kernels' logits do
    undefined = q.isnan().any(dim=-1) | (log2_logits == float("inf")).any(dim=-1)
    empty = (log2_logits == float("-inf")).all(dim=-1)
    probs = torch.softmax(logits, dim=-1)
    probs = torch.where(empty[:, None], 0.0, probs)
    probs = torch.where(undefined[:, None], float("nan"), probs)
    out = torch.einsum("hs,shd->hd", probs, v)
    out = torch.where(empty[:, None], 0.0, out)
    out = torch.where(undefined[:, None], float("nan"), out)
    lse = torch.logsumexp(logits, dim=-1)
    lse = torch.where(empty, float("-inf"), lse)
    lse = torch.where(undefined, float("nan"), lse)
    return out, lse, probs


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
    Each token is computed over exactly the positions it sees (a slice, not a mask), so nothing it
    cannot see, not even inf or NaN in a later draft token's K/V, enters its output, lse or mass.
    Writes ``out`` (query's dtype), ``lse`` (natural log, float32 [T, Hq]) and adds the attention
    probability per slot, summed over heads and query tokens, into ``attn_mass``. A (token, head)
    row with a NaN in its query, or a logit that overflows float32 in the log2 domain, gets NaN
    out and lse and adds NaN to every slot it sees (see ``_attention_rows``). ``scale`` must be
    finite, > 0 and at most ``MAX_ATTENTION_SCALE`` (ValueError). ``max_q_len`` is
    only a bound; the lengths come from ``cu_seqlens_q``.
    """
    if not (math.isfinite(scale) and 0 < scale <= MAX_ATTENTION_SCALE):
        raise ValueError(f"paged_attention: scale must be finite, > 0 and at most "
                         f"{MAX_ATTENTION_SCALE:g} (float32 max / log2(e)), got {scale}")
    num_heads = query.shape[1]
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    group = num_heads // num_kv_heads
    cu = cu_seqlens_q.tolist()
    for i, seq_len in enumerate(seq_lens.tolist()):
        first, last = cu[i], cu[i + 1]
        q_len = last - first
        if q_len == 0:
            continue
        positions = torch.arange(seq_len, device=query.device)
        blocks = block_tables[i].long()[positions // block_size]
        offsets = positions % block_size
        slots = blocks * block_size + offsets
        k = dequantize_cache(key_cache[blocks, offsets], k_scale)  # [S, Hkv, D] float32
        v = dequantize_cache(value_cache[blocks, offsets], v_scale)
        k = k.repeat_interleave(group, dim=1)  # [S, Hq, D]: head h reads KV head h // group
        v = v.repeat_interleave(group, dim=1)
        for j in range(q_len):
            seen = seq_len - q_len + j + 1  # positions 0 .. seen - 1
            q = query[first + j].float()  # [Hq, D]
            row_out, row_lse, probs = _attention_rows(q, k[:seen], v[:seen], scale)
            out[first + j] = row_out.to(out.dtype)
            if lse is not None:
                lse[first + j] = row_lse
            if attn_mass is not None:
                attn_mass.index_add_(0, slots[:seen], probs.sum(dim=0))


# v1 and v2 differ only in how the kernels split the work; they mean the same thing.
paged_attention_v1 = paged_attention
paged_attention_v2 = paged_attention


def paged_attention_run(out, query, key_cache, value_cache, block_tables, seq_lens, cu_seqlens_q,
                        max_q_len, scale, plan, workspace, k_scale=None, v_scale=None, lse=None,
                        attn_mass=None) -> None:
    """paged_attention through a plan: the plan only says how the work is split, so the result
    is paged_attention's (the workspace is scratch)."""
    paged_attention(out, query, key_cache, value_cache, block_tables, seq_lens, cu_seqlens_q,
                    max_q_len, scale, k_scale, v_scale, lse, attn_mass)


PLAN_MAGIC = 0x50534B56
ROWS_PER_ITEM = {"cpu": 32, "cuda": 4}  # a CPU task's query rows, a CUDA thread block's
PLAN_WAVES = {"cpu": 4, "cuda": 4}
MIN_PLAN_PARTITION = 256
MAX_CPU_PLAN_PARTITION = 1024


def paged_attention_plan(seq_lens: torch.Tensor, cu_seqlens_q: torch.Tensor, num_heads: int,
                         num_kv_heads: int, device, partition_size: int = 0, max_items: int = -1,
                         max_partial_rows: int = -1, *,
                         concurrency: Optional[int] = None) -> torch.Tensor:
    """The split-KV plan, written from its definition (include/pagedspec/attention_plan.h).

    A work item is (sequence, first query row, partition); rows are j * G + g for query token j
    and head g of a KV head's group, taken ROWS_PER_ITEM at a time. With partition size P, a
    sequence longer than P has ceil(len / P) partitions and a chunk of rows gets one item per
    partition its last row can see; a sequence that fits is one item per chunk, written directly.
    P is chosen as: no split (P = longest) when the longest sequence is under 2 x 256; on CPU,
    the largest of 1024, 512, 256 below the longest whose items x KV heads reach 4 x
    concurrency and that fits the bounds, else the smallest 256 x 2^k below the longest that
    fits the bounds; on CUDA, no split when the unsplit items x KV heads already fill 4 x
    concurrency, else the smallest 256 x 2^k below the longest whose items x KV heads stay
    within 4 x concurrency (and the bounds); else no split. ``concurrency``: CPU threads
    (default ``torch.get_num_threads()``); CUDA SMs x resident thread blocks per SM, which
    must be given.
    """
    kind = torch.device(device).type
    group = num_heads // num_kv_heads
    rows_per_item = ROWS_PER_ITEM[kind]
    assert kind == "cpu" or concurrency is not None, "give the CUDA device's concurrency"
    lens = seq_lens.tolist()
    cu = cu_seqlens_q.tolist()
    q_lens = [cu[i + 1] - cu[i] for i in range(len(lens))]

    def layout(part):
        """(items, parts, partial_base, partial_rows) of splitting at partition size ``part``."""
        items, parts, bases, rows = [], [], [], 0
        for i, (length, q_len) in enumerate(zip(lens, q_lens)):
            p = -(-length // part) if length > part else 1
            parts.append(p)
            bases.append(rows if p > 1 and q_len > 0 else -1)
            if p > 1:
                rows += q_len * p
            for row0 in range(0, q_len * group, rows_per_item):
                last_row = min(row0 + rows_per_item, q_len * group) - 1
                limit = length - q_len + last_row // group
                for k in range(1 if p == 1 else limit // part + 1):
                    items.append((i, row0, k))
        return items, parts, bases, rows

    def fits(shape):
        return ((max_items <= 0 or len(shape[0]) <= max_items)
                and (max_partial_rows <= 0 or shape[3] <= max_partial_rows))

    longest = max([1] + lens)
    chosen = None
    if not fits(layout(longest)):
        raise RuntimeError("pagedspec.paged_attention_plan: max_items or max_partial_rows is too "
                           "small for this step")
    if partition_size < 0:
        chosen = longest
    elif partition_size > 0:
        chosen = partition_size
    elif longest < 2 * MIN_PLAN_PARTITION:
        chosen = longest
    elif kind == "cpu":  # the CPU splits whatever the work
        threads = concurrency if concurrency is not None else torch.get_num_threads()
        part = MAX_CPU_PLAN_PARTITION  # the largest partition that leaves enough tasks
        while part >= MIN_PLAN_PARTITION and chosen is None:
            shape = layout(part) if part < longest else None
            if (shape is not None and len(shape[0]) * num_kv_heads >= PLAN_WAVES[kind] * threads
                    and fits(shape)):
                chosen = part
            part //= 2
        part = MIN_PLAN_PARTITION  # else the smallest that fits
        while part < longest and chosen is None:
            chosen = part if fits(layout(part)) else None
            part *= 2
        chosen = chosen or longest
    elif len(layout(longest)[0]) * num_kv_heads >= PLAN_WAVES[kind] * concurrency:
        chosen = longest
    else:
        part = MIN_PLAN_PARTITION
        while part < longest and chosen is None:
            shape = layout(part)
            if len(shape[0]) * num_kv_heads <= PLAN_WAVES[kind] * concurrency and fits(shape):
                chosen = part
            part *= 2
        chosen = chosen or longest
    items, parts, bases, rows = layout(chosen)
    if not fits((items, parts, bases, rows)):
        raise RuntimeError("pagedspec.paged_attention_plan: max_items or max_partial_rows is too "
                           "small for the forced partition")
    capacity = max_items if max_items > 0 else len(items)
    padding = [(-1, 0, 0)] * (capacity - len(items))
    header = [PLAN_MAGIC, len(lens), len(items), capacity, chosen, rows, rows_per_item, cu[-1]]
    flat = header + parts + bases + [x for item in items + padding for x in item]
    return torch.tensor(flat, dtype=torch.int32)


# ----------------------------------------------------------------------------------------------
# Speculative decoding verification


def _draft_counts(draft_token_ids: torch.Tensor,
                  num_draft_tokens: Optional[torch.Tensor]) -> torch.Tensor:
    """k_b per request as int64 ``[B]`` (k when ``num_draft_tokens`` is None)."""
    batch, k = draft_token_ids.shape
    if num_draft_tokens is None:
        return torch.full((batch,), k, dtype=torch.int64, device=draft_token_ids.device)
    return num_draft_tokens.to(torch.int64)


def _verify_output(draft_token_ids: torch.Tensor, num_accepted: torch.Tensor,
                   emitted: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[B, k+1]``: the accepted draft tokens, then ``emitted`` at column num_accepted, then -1."""
    batch, k = draft_token_ids.shape
    columns = torch.arange(k + 1, device=draft_token_ids.device)
    padded = torch.cat([draft_token_ids, draft_token_ids.new_full((batch, 1), -1)], dim=1)
    accepted = num_accepted[:, None]
    output = torch.where(columns < accepted, padded, -1)
    output = torch.where(columns == accepted, emitted[:, None], output)
    return output, num_accepted.to(torch.int32)


def inverse_cdf(weights: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """Per row of ``weights`` ``[N, V]`` (>= 0), the smallest t with ``w_t > 0`` and
    ``sum_{s<=t} w_s > u * sum_s w_s``, with the sums in float64 (the kernels sum in float32 and
    may differ only where u lands within float32 rounding of a CDF boundary). A row whose
    threshold is not crossed (u = 1 or rounding) gives its last positive-weight token; a row
    without positive weight gives 0."""
    w = weights.to(torch.float64)
    cdf = w.cumsum(dim=-1)
    threshold = uniform.to(torch.float64)[:, None] * cdf[:, -1:]
    crossing = (w > 0) & (cdf > threshold)
    tokens = torch.arange(w.shape[-1], device=w.device)
    first = torch.where(crossing, tokens, w.shape[-1]).min(dim=-1).values
    last_positive = torch.where(w > 0, tokens, 0).max(dim=-1).values
    return torch.where(crossing.any(dim=-1), first, last_positive)


def _positive_part(x: torch.Tensor) -> torch.Tensor:
    """max(x, 0) with NaN as 0, as the kernels read it."""
    return torch.where(x > 0, x, torch.zeros_like(x))


def rejection_sample(draft_token_ids, draft_probs, target_probs, uniform_accept, uniform_resample,
                     num_draft_tokens=None):
    """Speculative-decoding rejection sampling (CONTRACT.md), one request per row.

    Accept draft token x at position i iff ``uniform_accept * q(x) < p(x)`` (q = 1 for a one-hot
    draft); at the first rejection draw from ``max(p - q, 0)`` (or p when that has no mass) with
    ``uniform_resample``; after k_b acceptances draw the bonus token from p at row k_b.
    """
    batch, k = draft_token_ids.shape
    vocab = target_probs.shape[-1]
    device = target_probs.device
    rows = torch.arange(batch, device=device)
    counts = _draft_counts(draft_token_ids, num_draft_tokens)

    # The acceptance test at every drafted position; only those before the first rejection count.
    # Ids past num_draft_tokens are never read (they may be padding such as -1).
    positions = torch.arange(k, device=device)
    drafted = positions < counts[:, None]
    safe_ids = torch.where(drafted, draft_token_ids, 0)
    ids = safe_ids.unsqueeze(-1)
    p = target_probs[:, :k].gather(-1, ids).squeeze(-1)
    q = draft_probs.gather(-1, ids).squeeze(-1) if draft_probs is not None else torch.ones_like(p)
    rejected = ~(uniform_accept * q < p) & drafted
    first_rejection = torch.where(rejected, positions, k).min(dim=-1).values if k else counts
    num_accepted = torch.minimum(first_rejection, counts)
    was_rejected = num_accepted < counts

    # The row the emitted token is drawn from: the residual at a rejection, else the target.
    target_row = target_probs[rows, num_accepted]
    weights = _positive_part(target_row)
    if k > 0:
        draft_position = num_accepted.clamp(max=k - 1)
        if draft_probs is not None:
            draft_row = draft_probs[rows, draft_position]
        else:
            one_hot_token = safe_ids[rows, draft_position]
            draft_row = torch.nn.functional.one_hot(one_hot_token, vocab).to(target_row.dtype)
        residual = _positive_part(target_row - draft_row)
        use_residual = was_rejected & (residual > 0).any(dim=-1)
        weights = torch.where(use_residual[:, None], residual, weights)
    emitted = inverse_cdf(weights, uniform_resample[rows, num_accepted])
    return _verify_output(draft_token_ids, num_accepted, emitted)


def greedy_verify(draft_token_ids, target_token_ids, num_draft_tokens=None):
    """Accept draft tokens while they equal the target's argmax; then emit the target token at
    the first mismatch, or the bonus ``target_token_ids[b, k_b]`` after k_b acceptances."""
    batch, k = draft_token_ids.shape
    counts = _draft_counts(draft_token_ids, num_draft_tokens)
    positions = torch.arange(k, device=draft_token_ids.device)
    mismatch = (draft_token_ids != target_token_ids[:, :k]) & (positions < counts[:, None])
    first_mismatch = torch.where(mismatch, positions, k).min(dim=-1).values if k else counts
    num_accepted = torch.minimum(first_mismatch, counts)
    emitted = target_token_ids.gather(1, num_accepted[:, None]).squeeze(1)
    return _verify_output(draft_token_ids, num_accepted, emitted)


# ----------------------------------------------------------------------------------------------
# Count-min sketch


# torch has no uint64 arithmetic, but int64 add and multiply wrap in two's complement, which is
# arithmetic modulo 2^64 on the same bit patterns; only right shifts and the final modulo need care.
CMS_COUNTER_MAX = 2**31 - 1
_CMS_ROW_SEED = 0x9E3779B97F4A7C15
_FMIX_C1 = 0xFF51AFD7ED558CCD
_FMIX_C2 = 0xC4CEB9FE1A85EC53


def _as_int64(u: int) -> int:
    """The int64 with the bit pattern of the uint64 ``u``."""
    u %= 2**64
    return u - 2**64 if u >= 2**63 else u


def _shr_logical(x: torch.Tensor, s: int) -> torch.Tensor:
    """uint64 ``x >> s`` on int64 bit patterns (torch's ``>>`` is arithmetic)."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def _fmix64(x: torch.Tensor) -> torch.Tensor:
    x = x ^ _shr_logical(x, 33)
    x = x * _as_int64(_FMIX_C1)
    x = x ^ _shr_logical(x, 33)
    x = x * _as_int64(_FMIX_C2)
    return x ^ _shr_logical(x, 33)


def _mod_uint64(x: torch.Tensor, width: int) -> torch.Tensor:
    """uint64 ``x mod width`` on int64 bit patterns: a negative pattern is x + 2^64."""
    r = torch.remainder(x, width)  # floor modulo: in [0, width) for every x
    return torch.where(x < 0, torch.remainder(r + (2**64) % width, width), r)


def cms_columns(keys: torch.Tensor, depth: int, width: int) -> torch.Tensor:
    """Column of every key in every row, int64 ``[depth, n]``:
    ``col_r(key) = fmix64(uint64(key) + (r + 1) * 0x9E3779B97F4A7C15) mod width``."""
    keys = keys.to(torch.int64)
    rows = [_mod_uint64(_fmix64(keys + _as_int64((r + 1) * _CMS_ROW_SEED)), width)
            for r in range(depth)]
    return torch.stack(rows) if rows else keys.new_empty((0, keys.numel()))


def _cms_increments(keys: torch.Tensor, increments) -> torch.Tensor:
    if increments is None:
        return torch.ones(keys.shape, dtype=torch.int64, device=keys.device)
    return increments.to(torch.int64)


def cms_update(sketch, keys, increments=None, conservative=False):
    depth, width = sketch.shape
    cols = cms_columns(keys, depth, width)
    inc = _cms_increments(keys, increments)
    if conservative:
        # e(key): the estimate before the call; S(key): the key's total increment in this call.
        estimate = cms_query(sketch, keys).to(torch.int64)
        distinct, inverse = torch.unique(keys, return_inverse=True)
        total = torch.zeros(distinct.shape, dtype=torch.int64,
                            device=keys.device).index_add_(0, inverse, inc)
        target = torch.clamp(estimate + total[inverse], max=CMS_COUNTER_MAX)
        for r in range(depth):
            row = sketch[r].to(torch.int64).scatter_reduce(0, cols[r], target, reduce="amax")
            sketch[r] = row.to(torch.int32)
        return
    for r in range(depth):
        row = sketch[r].to(torch.int64).index_add_(0, cols[r], inc)  # n * 2^31 fits in int64
        sketch[r] = torch.clamp(row, max=CMS_COUNTER_MAX).to(torch.int32)


def cms_query(sketch, keys):
    depth, width = sketch.shape
    cols = cms_columns(keys, depth, width)
    return torch.gather(sketch, 1, cols).amin(dim=0)


def cms_decay(sketch, shift=1):
    if not 0 <= shift <= 31:
        raise ValueError(f"reference.cms_decay: shift must be in [0, 31], got {shift}")
    sketch.copy_(sketch >> shift)
