"""Caches strided along the block dimension (contract extension "strided block dimension").

vLLM hands an attention layer one page per block holding that block's K and V (and, in its
block-outermost layouts, every layer's pages of a block side by side), so K and V are views
``[num_blocks, block_size, num_kv_heads, head_size]`` whose block stride is larger than a block.
Every op that takes a cache must read and write exactly the same elements through such a view as
through a contiguous cache holding the same blocks: the kernels are the same, only the block
addressing differs, so results are compared bit for bit. The bytes between blocks (other layers'
pages, padding) are filled with NaN and must stay untouched.
"""
from __future__ import annotations

import pytest
import torch

import pagedspec  # noqa: F401
from pagedspec import ops, reference
from conftest import DEVICES, requires_cuda
from test_attention import OPCHECK, OPCHECK_FP8, VARIANTS, Case
from test_attention_plan import planned

FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)

# (layers per block page, padding elements per page): vLLM's layer-compact layouts (one layer's
# pages back to back), a padded page, and a block-outermost layout (three layers' pages per block).
LAYOUTS = {"layer_compact": (1, 0), "padded": (1, 48), "block_outer": (3, 0)}


class Pages:
    """``[num_blocks, layers, 2 * block + pad]`` elements, all NaN (0xFF bytes: NaN in every
    float dtype and both FP8 formats); layer l's K and V are the two halves of its page."""

    def __init__(self, num_blocks, block_size, num_kv_heads, head_size, dtype, *, layers=1,
                 pad=0, device="cpu"):
        self.shape = (num_blocks, block_size, num_kv_heads, head_size)
        self.block = block_size * num_kv_heads * head_size
        width = torch.finfo(dtype).bits // 8 if dtype.is_floating_point else 1
        raw = torch.full((num_blocks, layers, (2 * self.block + pad) * width), 0xFF,
                         dtype=torch.uint8, device=device)
        self.buffer = raw.view(dtype)  # [NB, L, 2 * block + pad]

    def key(self, layer=0):
        return self.buffer[:, layer, : self.block].unflatten(1, self.shape[1:])

    def value(self, layer=0):
        return self.buffer[:, layer, self.block : 2 * self.block].unflatten(1, self.shape[1:])

    def untouched_bytes(self):
        """Bytes outside every layer's K and V blocks (other pages' bytes are in K/V of a layer)."""
        return self.buffer[:, :, 2 * self.block :].contiguous().view(torch.uint8)


def bits(t):
    return t.contiguous().view(torch.uint8)


def _strided_copy(case: Case, layout):
    layers, pad = LAYOUTS[layout]
    pages = Pages(*case.key_cache.shape, case.cache_dtype, layers=layers, pad=pad,
                  device=case.device)
    layer = layers - 1  # the last layer's page: not at the start of a block's bytes
    pages.key(layer).copy_(case.key_cache)
    pages.value(layer).copy_(case.value_cache)
    return pages, pages.key(layer), pages.value(layer)


def test_pages_are_strided_views():
    pages = Pages(5, 16, 2, 64, torch.bfloat16, layers=3, pad=8)
    k, v = pages.key(2), pages.value(2)
    assert k.shape == (5, 16, 2, 64) and not k.is_contiguous()
    assert k.stride() == (3 * (2 * 16 * 2 * 64 + 8), 2 * 64, 64, 1) and v.stride() == k.stride()


# ------------------------------------------------------------------------------------------
# Attention: every entry point, bit for bit against the same blocks in contiguous caches.

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("variant", ["v1", "v2", "auto", "run"])
@pytest.mark.parametrize("dtype, cache_dtype", [(torch.bfloat16, None),
                                                (torch.float32, None),
                                                (torch.float16, torch.float8_e4m3fn)])
@pytest.mark.parametrize("q_lens", [[1, 1, 1], [4, 1, 3]])
def test_attention_matches_contiguous(gen, device, layout, variant, dtype, cache_dtype, q_lens):
    if device == "cuda" and dtype == torch.float32:
        pytest.skip("float32 queries are a CPU-only feature")
    case = Case(gen, seq_lens=[700, 37, 1100], q_lens=q_lens, num_heads=8, num_kv_heads=2,
                head_size=64, block_size=16, dtype=dtype, cache_dtype=cache_dtype, device=device)
    if variant == "run":
        plan = ops.plan_paged_attention(case.seq_lens.cpu(), case.cu_seqlens_q.cpu(), 8, 2, 64,
                                        device, partition_size=256)
        fn = planned(plan)
    else:
        fn = VARIANTS[variant]
    want = case.run(fn, lse=True, mass=True)
    pages, case.key_cache, case.value_cache = _strided_copy(case, layout)
    before = pages.untouched_bytes().clone()
    got = case.run(fn, lse=True, mass=True)
    for name, g, w in zip(("out", "lse", "attn_mass"), got, want):
        assert torch.equal(bits(g), bits(w)), f"{name} differs from the contiguous caches' result"
    assert torch.equal(pages.untouched_bytes(), before)
    # And the reference reads the strided views the same way.
    ref_out, _, _ = case.expected()
    torch.testing.assert_close(got[0].cpu().float(), ref_out.float(), rtol=1.6e-2, atol=1.6e-2)


# ------------------------------------------------------------------------------------------
# reshape_and_cache, copy_blocks, swap_blocks


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("dtype, cache_dtype", [(torch.bfloat16, None), (torch.float32, None),
                                                (torch.bfloat16, torch.float8_e5m2)])
def test_reshape_and_cache_matches_contiguous(gen, device, layout, dtype, cache_dtype):
    cache_dtype = cache_dtype or dtype
    num_blocks, block_size, heads, head_size, tokens = 6, 16, 2, 64, 40
    layers, pad = LAYOUTS[layout]
    pages = Pages(num_blocks, block_size, heads, head_size, cache_dtype, layers=layers, pad=pad,
                  device=device)
    layer = layers - 1
    key = torch.randn(tokens, heads, head_size, generator=gen).to(dtype).to(device)
    value = torch.randn(tokens, heads, head_size, generator=gen).to(dtype).to(device)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:tokens]
    slots[::7] = -1  # padding tokens
    slots = slots.to(device)
    scale = torch.tensor(0.05, device=device) if cache_dtype in FP8 else None
    before = pages.untouched_bytes().clone()
    k_dense = torch.empty(pages.shape, dtype=cache_dtype, device=device)
    k_dense.view(torch.uint8).fill_(0xFF)  # NaN, as the pages
    v_dense = k_dense.clone()
    ops.reshape_and_cache(key, value, k_dense, v_dense, slots, scale, scale)
    ops.reshape_and_cache(key, value, pages.key(layer), pages.value(layer), slots, scale, scale)
    assert torch.equal(bits(pages.key(layer)), bits(k_dense))
    assert torch.equal(bits(pages.value(layer)), bits(v_dense))
    assert torch.equal(pages.untouched_bytes(), before)
    for other in range(layers - 1):  # the other layers' pages were not written either
        assert (bits(pages.key(other)) == 0xFF).all() and (bits(pages.value(other)) == 0xFF).all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_copy_blocks_matches_reference(gen, device, layout):
    layers, pad = LAYOUTS[layout]
    pages = Pages(8, 16, 2, 64, torch.bfloat16, layers=layers, pad=pad, device=device)
    keys = [pages.key(l) for l in range(layers)]
    values = [pages.value(l) for l in range(layers)]
    for t in keys + values:
        t.copy_(torch.randn(t.shape, generator=gen).to(torch.bfloat16))
    mapping = torch.tensor([[0, 5], [3, 1], [2, 7]], device=device)
    want_k = [k.clone() for k in keys]
    want_v = [v.clone() for v in values]
    reference.copy_blocks(want_k, want_v, mapping.cpu() if device == "cpu" else mapping)
    before = pages.untouched_bytes().clone()
    ops.copy_blocks(keys, values, mapping)
    for got, want in zip(keys + values, want_k + want_v):
        assert torch.equal(bits(got), bits(want))
    assert torch.equal(pages.untouched_bytes(), before)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("direction", ["strided_to_dense", "dense_to_strided",
                                       "strided_to_strided"])
@pytest.mark.parametrize("mapping_on", ["cpu", "device"])
def test_swap_blocks_strided(gen, device, direction, mapping_on):
    if device == "cpu" and mapping_on == "device":
        pytest.skip("a device mapping is the CUDA kernel path")
    pages_a = Pages(6, 16, 2, 64, torch.float16, layers=2, pad=16, device=device)
    pages_b = Pages(9, 16, 2, 64, torch.float16, layers=1, pad=0, device=device)
    strided_a, strided_b = pages_a.key(1), pages_b.value(0)
    dense_a = torch.randn(strided_a.shape, generator=gen).half().to(device)
    dense_b = torch.randn(strided_b.shape, generator=gen).half().to(device)
    strided_a.copy_(torch.randn(strided_a.shape, generator=gen).half())
    strided_b.copy_(torch.randn(strided_b.shape, generator=gen).half())
    src, dst = {"strided_to_dense": (strided_a, dense_b), "dense_to_strided": (dense_a, strided_b),
                "strided_to_strided": (strided_a, strided_b)}[direction]
    mapping = torch.tensor([[0, 8], [1, 2], [2, 3], [5, 0]])  # a run (1, 2) -> (2, 3) merges
    want = dst.clone()
    reference.swap_blocks(src, want, mapping)
    before = (pages_a.untouched_bytes().clone(), pages_b.untouched_bytes().clone())
    ops.swap_blocks(src, dst, mapping if mapping_on == "cpu" else mapping.to(device))
    assert torch.equal(bits(dst), bits(want))
    assert torch.equal(pages_a.untouched_bytes(), before[0])
    assert torch.equal(pages_b.untouched_bytes(), before[1])


def test_swap_blocks_k_into_v_of_the_same_pages(gen):
    """K and V views of one page buffer interleave (their byte ranges overlap) but no K block
    overlaps a V block: a swap between them is independent and allowed."""
    pages = Pages(6, 16, 2, 64, torch.float32)
    pages.key().copy_(torch.randn(pages.shape, generator=gen))
    mapping = torch.tensor([[0, 0], [1, 4], [4, 1]])
    want = pages.value().clone()
    reference.swap_blocks(pages.key(), want, mapping)
    ops.swap_blocks(pages.key(), pages.value(), mapping)
    assert torch.equal(bits(pages.value()), bits(want))


def test_swap_blocks_overlapping_strided_blocks_rejected():
    """Blocks of a view shifted by half a block overlap two K blocks each."""
    pages = Pages(6, 16, 2, 64, torch.float32)
    k = pages.key().flatten(1)  # [6, block], block stride 2 * block
    page = 2 * pages.block
    shifted = pages.buffer.view(-1)[pages.block // 2 :][: 4 * page].view(4, page)[:, : pages.block]
    with pytest.raises(RuntimeError, match=r"block_mapping\[0, 0\] must not overlap any dst block"):
        ops.swap_blocks(shifted, k, torch.tensor([[0, 0]]))
    with pytest.raises(ValueError, match="overlaps"):
        reference.swap_blocks(shifted, k, torch.tensor([[0, 0]]))


# ------------------------------------------------------------------------------------------
# Layouts that are not accepted, and the fakes

def _attention_call(case, key_cache, value_cache):
    out = torch.empty_like(case.query)
    ops.paged_attention(out, case.query, key_cache, value_cache, case.block_tables,
                        case.seq_lens, case.cu_seqlens_q, case.max_q_len, case.scale)


BAD_LAYOUTS = {
    # heads and tokens swapped inside a block (vLLM's head-major interior)
    "inner_not_dense": (lambda k: k.transpose(1, 2).contiguous().transpose(1, 2),
                        r"key_cache must be contiguous in every dimension but the first \(block\)"),
    # blocks that overlap: a block stride of half a block
    "overlapping_blocks": (lambda k: k.as_strided(k.shape, (k[0].numel() // 2, *k.stride()[1:])),
                           r"key_cache.stride\(0\) \(block stride\) must be at least one block's"),
}


@pytest.mark.parametrize("bad", list(BAD_LAYOUTS))
@pytest.mark.parametrize("op", ["attention", "reshape_and_cache", "copy_blocks"])
def test_bad_layouts_rejected(gen, bad, op):
    make, match = BAD_LAYOUTS[bad]
    case = Case(gen, seq_lens=[20], q_lens=[1], num_heads=4, num_kv_heads=2, head_size=64,
                block_size=8, dtype=torch.float16)
    k = make(case.key_cache)
    v = make(case.value_cache)
    if op == "copy_blocks":
        match = match.replace("key_cache", r"key_caches\[0\]")
    with pytest.raises(RuntimeError, match=match):
        if op == "attention":
            _attention_call(case, k, v)
        elif op == "reshape_and_cache":
            x = torch.randn(1, 2, 64).half()
            ops.reshape_and_cache(x, x, k, v, torch.tensor([3]))
        else:
            ops.copy_blocks([k], [v], torch.tensor([[0, 1]]))


def test_key_and_value_strides_must_match(gen):
    case = Case(gen, seq_lens=[20], q_lens=[1], num_heads=4, num_kv_heads=2, head_size=64,
                block_size=8, dtype=torch.float16)
    pages = Pages(*case.key_cache.shape, torch.float16, pad=64)
    match = r"value_cache.stride\(0\) \(block stride\) must equal key_cache's"
    with pytest.raises(RuntimeError, match=match):
        _attention_call(case, pages.key(), case.value_cache)
    with pytest.raises(RuntimeError, match=match):
        x = torch.randn(1, 2, 64).half()
        ops.reshape_and_cache(x, x, pages.key(), case.value_cache, torch.tensor([3]))
    with pytest.raises(RuntimeError, match=r"value_caches\[0\].stride\(0\) \(block stride\) must "
                                           r"equal key_caches\[0\]'s"):
        ops.copy_blocks([pages.key()], [case.value_cache], torch.tensor([[0, 1]]))


@pytest.mark.parametrize("cache_dtype", [None, torch.float8_e4m3fn])
def test_opcheck_strided(gen, cache_dtype):
    case = Case(gen, seq_lens=[9, 40], q_lens=[1, 3], num_heads=4, num_kv_heads=2, head_size=64,
                block_size=8, dtype=torch.float16, cache_dtype=cache_dtype)
    _, k, v = _strided_copy(case, "block_outer")
    out = torch.empty_like(case.query)
    lse = torch.empty(case.query.shape[:2])
    mass = torch.zeros(case.num_slots)
    args = (out, case.query, k, v, *case.args()[3:])
    utils = OPCHECK if cache_dtype is None else OPCHECK_FP8
    torch.library.opcheck(torch.ops.pagedspec.paged_attention.default, (*args, lse, mass),
                          test_utils=utils)
    x = torch.randn(5, 2, 64).half()
    scale = None if cache_dtype is None else torch.tensor(0.1)
    torch.library.opcheck(torch.ops.pagedspec.reshape_and_cache.default,
                          (x, x.clone(), k, v, torch.tensor([0, 9, -1, 20, 33]), scale, scale),
                          test_utils=utils)


def test_fakes_reject_what_the_kernels_reject(gen):
    case = Case(gen, seq_lens=[20], q_lens=[1], num_heads=4, num_kv_heads=2, head_size=64,
                block_size=8, dtype=torch.float16)
    make, match = BAD_LAYOUTS["overlapping_blocks"]
    bad_k, bad_v = make(case.key_cache), make(case.value_cache)
    with torch._subclasses.fake_tensor.FakeTensorMode() as mode:
        q = mode.from_tensor(case.query)
        k, v = mode.from_tensor(bad_k), mode.from_tensor(bad_v)
        with pytest.raises(RuntimeError, match=match):
            ops.paged_attention(torch.empty_like(q), q, k, v, mode.from_tensor(case.block_tables),
                                mode.from_tensor(case.seq_lens), mode.from_tensor(case.cu_seqlens_q),
                                1, 0.125)


@requires_cuda
@pytest.mark.cuda
def test_cuda_block_stride_must_be_16_byte_multiple(gen):
    case = Case(gen, seq_lens=[20], q_lens=[1], num_heads=4, num_kv_heads=2, head_size=64,
                block_size=8, dtype=torch.float16, device="cuda")
    pages = Pages(*case.key_cache.shape, torch.float16, pad=4, device="cuda")  # 8-byte pad
    match = r"key_cache.stride\(0\) \(block stride\) must be a multiple of 16 bytes on CUDA"
    with pytest.raises(RuntimeError, match=match):
        _attention_call(case, pages.key(), pages.value())
    x = torch.randn(1, 2, 64, device="cuda").half()
    with pytest.raises(RuntimeError, match=match):
        ops.reshape_and_cache(x, x, pages.key(), pages.value(), torch.tensor([3], device="cuda"))
