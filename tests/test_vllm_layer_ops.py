"""pagedspec.vllm.layer_ops, the vLLM backend's work, on fake vLLM metadata (no vLLM needed).

The KV tensor is built as vLLM builds it (a flat byte buffer viewed ``[num_blocks, H, N, 2D]`` in
logical order through one of its layouts' stride permutations, with other layers' pages between
blocks in the block-outermost layouts); the step is a mixed batch of chunked-prefill, prefill and
decode requests with a padded query and slot mapping, and a block table padded with block 0. The
result is compared with causal attention computed densely in float32 per request.
Tolerances: the kernels and the dense check both accumulate in float32; outputs are rounded to
bfloat16 (2^-8 relative) or float16, so 2e-2 / 2e-3 absolute on O(1) values.
"""
from __future__ import annotations

import math

import pytest
import torch

import pagedspec  # noqa: F401
from pagedspec import reference
from pagedspec.vllm import layer_ops, version_supported
from conftest import DEVICES

# vLLM's KVCacheLayout stride orders over logical [L, B, H, N, C] (vllm/v1/kv_cache_layout.py).
LAYOUTS = {"LBHNC": (0, 1, 2, 3, 4), "LBNHC": (0, 1, 3, 2, 4), "BLHNC": (1, 0, 2, 3, 4),
           "BLNHC": (1, 0, 3, 2, 4)}
NOT_PAGED = {"LHBNC": (0, 2, 1, 3, 4), "BHLNC": (1, 2, 0, 3, 4)}
TOL = {torch.bfloat16: 2e-2, torch.float16: 2e-3, torch.float32: 1e-5}


def vllm_kv_tensors(num_layers, num_blocks, heads, block_size, head_size, dtype, order,
                    device="cpu"):
    """Per-layer ``[B, H, N, 2D]`` views of one buffer of 0xFF bytes (NaN), physically ordered by
    ``order`` (a permutation of the logical dims [L, B, H, N, C])."""
    logical = (num_layers, num_blocks, heads, block_size, 2 * head_size)
    physical = [logical[d] for d in order]
    strides_physical = [0] * 5
    step = 1
    for i in range(4, -1, -1):
        strides_physical[i] = step
        step *= physical[i]
    strides = [0] * 5
    for i, d in enumerate(order):
        strides[d] = strides_physical[i]
    width = torch.empty((), dtype=dtype).element_size()
    buffer = torch.full((step * width,), 0xFF, dtype=torch.uint8, device=device).view(dtype)
    view = buffer.as_strided(logical, strides)
    return buffer, [view[layer] for layer in range(num_layers)]


def test_views_are_page_halves():
    buffer, layers = vllm_kv_tensors(3, 5, 2, 16, 64, torch.float16, LAYOUTS["BLHNC"])
    k, v = layer_ops.kv_cache_views(layers[1], 2, 64, torch.float16)
    page = 2 * 16 * 2 * 64
    assert k.shape == v.shape == (5, 16, 2, 64)
    assert k.stride() == (3 * page, 128, 64, 1) == v.stride()
    assert k.data_ptr() == layers[1].data_ptr() and v.data_ptr() == k.data_ptr() + page
    assert k.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()


@pytest.mark.parametrize("name", list(NOT_PAGED))
def test_layouts_without_dense_pages_are_refused(name):
    _, layers = vllm_kv_tensors(2, 4, 2, 16, 64, torch.float16, NOT_PAGED[name])
    with pytest.raises(ValueError, match="each block of kv_cache must be one dense page"):
        layer_ops.kv_cache_views(layers[0], 2, 64, torch.float16)


def test_bad_kv_shapes_are_refused():
    _, layers = vllm_kv_tensors(1, 4, 2, 16, 64, torch.float16, LAYOUTS["LBHNC"])
    with pytest.raises(ValueError, match=r"kv_cache must have shape \[num_blocks, 4, "):
        layer_ops.kv_cache_views(layers[0], 4, 32, torch.float16)
    with pytest.raises(ValueError, match="same element size"):
        layer_ops.kv_cache_views(layers[0], 2, 64, torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="kv_cache_dtype must be 'auto' or one of"):
        layer_ops.cache_dtype("int8", torch.float16)


def test_version_rule():
    assert version_supported("0.32.0") and version_supported("0.32.3+cpu")
    assert not version_supported("0.31.9") and not version_supported("0.33.0")
    assert not version_supported("dev")


class Step:
    """A vLLM-like step: request i has ``ctx[i]`` cached tokens and ``new[i]`` new ones."""

    def __init__(self, gen, ctx, new, *, heads=8, kv_heads=2, head_size=64, block_size=16,
                 num_blocks=40, pad_tokens=3, pad_reqs_table=2, device="cpu"):
        self.ctx, self.new = ctx, new
        self.heads, self.kv_heads, self.head_size = heads, kv_heads, head_size
        self.block_size = block_size
        total = [c + n for c, n in zip(ctx, new)]
        width = max(math.ceil(t / block_size) for t in total) + pad_reqs_table
        ids = torch.randperm(num_blocks - 1, generator=gen) + 1  # block 0 is vLLM's null block
        table = torch.zeros(len(ctx), width, dtype=torch.int32)
        used = 0
        for i, t in enumerate(total):
            n = math.ceil(t / block_size)
            table[i, :n] = ids[used: used + n].int()
            used += n
        self.table = table
        self.k = [torch.randn(t, kv_heads, head_size, generator=gen) for t in total]
        self.v = [torch.randn(t, kv_heads, head_size, generator=gen) for t in total]
        self.q = [torch.randn(n, heads, head_size, generator=gen) for n in new]
        self.pad_tokens = pad_tokens
        self.device = device

    def slots(self, i, positions):
        blocks = self.table[i].long()[positions // self.block_size]
        return blocks * self.block_size + positions % self.block_size

    def tokens(self, parts, dtype, pad_rows):
        """Concatenate per-request rows, then `pad_rows` NaN rows (vLLM pads to graph sizes)."""
        rows = torch.cat(parts)
        pad = torch.full((pad_rows, *rows.shape[1:]), float("nan"))
        return torch.cat([rows, pad]).to(dtype).to(self.device)

    def expected(self, dtype):
        outs = []
        for i, (c, n) in enumerate(zip(self.ctx, self.new)):
            group = self.heads // self.kv_heads
            k = self.k[i].to(dtype).float().repeat_interleave(group, 1)
            v = self.v[i].to(dtype).float().repeat_interleave(group, 1)
            q = self.q[i].to(dtype).float()
            logits = torch.einsum("qhd,khd->hqk", q, k) * self.head_size ** -0.5
            visible = torch.arange(c + n)[None, :] <= (c + torch.arange(n))[:, None]
            probs = logits.masked_fill(~visible, float("-inf")).softmax(-1)
            outs.append(torch.einsum("hqk,khd->qhd", probs, v))
        return torch.cat(outs)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("dtype, kv_cache_dtype", [(torch.bfloat16, "auto"),
                                                   (torch.float16, "auto"),
                                                   (torch.float16, "fp8_e4m3")])
def test_mixed_step_matches_dense_attention(gen, device, layout, dtype, kv_cache_dtype):
    # A chunked prefill continuing (ctx 37 + 20), a fresh prefill, two decodes, a long decode.
    step = Step(gen, ctx=[37, 0, 15, 70, 300], new=[20, 9, 1, 1, 1], device=device)
    cache_dtype = layer_ops.cache_dtype(kv_cache_dtype, dtype)
    storage = torch.uint8 if cache_dtype in (torch.float8_e4m3fn, torch.float8_e5m2) else dtype
    _, layers = vllm_kv_tensors(2, 40, step.kv_heads, step.block_size, step.head_size, storage,
                                LAYOUTS[layout], device)
    key_cache, value_cache = layer_ops.kv_cache_views(layers[1], step.kv_heads, step.head_size,
                                                      cache_dtype)
    scale = layer_ops.scale_tensor(torch.tensor(0.05, device=device), cache_dtype)
    assert layer_ops.scale_tensor(torch.tensor(0.05), torch.float16) is None

    # Earlier steps wrote the cached context.
    old = [torch.arange(c) for c in step.ctx]
    layer_ops.write_kv(
        step.tokens([k[:c] for k, c in zip(step.k, step.ctx)], dtype, 0),
        step.tokens([v[:c] for v, c in zip(step.v, step.ctx)], dtype, 0), key_cache,
        value_cache, torch.cat([step.slots(i, p) for i, p in enumerate(old)]).to(device),
        scale, scale)

    # This step: the new tokens' K/V, then attention.
    pad = step.pad_tokens
    new_pos = [c + torch.arange(n) for c, n in zip(step.ctx, step.new)]
    slots = torch.cat([step.slots(i, p) for i, p in enumerate(new_pos)] +
                      [torch.full((pad,), -1)]).to(device)
    key = step.tokens([k[c:] for k, c in zip(step.k, step.ctx)], dtype, pad)
    value = step.tokens([v[c:] for v, c in zip(step.v, step.ctx)], dtype, pad)
    layer_ops.write_kv(key, value, key_cache, value_cache, slots, scale, scale)

    cu = torch.tensor([0, *torch.tensor(step.new).cumsum(0).tolist()], dtype=torch.int32)
    lens = torch.tensor([c + n for c, n in zip(step.ctx, step.new)], dtype=torch.int32)
    num_tokens = sum(step.new)
    meta = layer_ops.build_metadata(
        num_reqs=len(step.new), num_actual_tokens=num_tokens, max_query_len=max(step.new),
        query_start_loc=cu.to(device), seq_lens=lens.to(device),
        block_table=step.table.to(device), slot_mapping=slots, num_heads=step.heads,
        num_kv_heads=step.kv_heads, head_size=step.head_size, query_start_loc_cpu=cu)
    assert (meta.plan is not None) == (device == "cpu")
    query = step.tokens(step.q, dtype, pad)
    output = torch.full((num_tokens + pad, step.heads * step.head_size), 7.0, dtype=dtype,
                        device=device)
    layer_ops.attend(query, key_cache, value_cache, meta, step.head_size ** -0.5, scale, scale,
                     output)
    assert (output[num_tokens:] == 7).all(), "rows past num_actual_tokens were written"
    got = output[:num_tokens].view(num_tokens, step.heads, step.head_size).cpu().float()
    if cache_dtype == dtype:
        want = step.expected(dtype)
        torch.testing.assert_close(got, want, rtol=TOL[dtype], atol=TOL[dtype])
    else:  # FP8: against the reference on what the cache holds (exact dequantization)
        want = torch.empty(num_tokens, step.heads, step.head_size, dtype=dtype)
        reference.paged_attention(want, query[:num_tokens].cpu(), key_cache.cpu(),
                                  value_cache.cpu(), step.table, lens, cu, max(step.new),
                                  step.head_size ** -0.5, scale.cpu(), scale.cpu())
        torch.testing.assert_close(got, want.float(), rtol=TOL[dtype], atol=TOL[dtype])
    # Layer 0's pages were never touched.
    assert (layers[0].contiguous().view(torch.uint8) == 0xFF).all()


def test_empty_step_writes_nothing():
    _, layers = vllm_kv_tensors(1, 4, 2, 16, 64, torch.float16, LAYOUTS["LBHNC"])
    k, v = layer_ops.kv_cache_views(layers[0], 2, 64, torch.float16)
    meta = layer_ops.build_metadata(
        num_reqs=0, num_actual_tokens=0, max_query_len=0,
        query_start_loc=torch.zeros(1, dtype=torch.int32),
        seq_lens=torch.zeros(0, dtype=torch.int32),
        block_table=torch.zeros(0, 4, dtype=torch.int32),
        slot_mapping=torch.zeros(0, dtype=torch.long), num_heads=4, num_kv_heads=2,
        head_size=64)
    out = torch.full((2, 256), 3.0, dtype=torch.float16)
    layer_ops.attend(torch.zeros(2, 4, 64, dtype=torch.float16), k, v, meta, 0.125, None, None,
                     out)
    assert (out == 3).all()
