"""reshape_and_cache, copy_blocks and swap_blocks against the reference, bit for bit."""
from __future__ import annotations

import pytest
import torch

from pagedspec import ops, reference
from conftest import DEVICES, requires_cuda

FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
# (input dtype, cache dtype): native caches hold the input dtype; FP8 caches take any input.
DTYPE_PAIRS = [(torch.float16, torch.float16), (torch.bfloat16, torch.bfloat16),
               (torch.float32, torch.float32)] + [(w, f) for w in
                                                  (torch.float16, torch.bfloat16, torch.float32)
                                                  for f in FP8]
# (num_blocks, block_size, num_kv_heads, head_size)
GEOMETRIES = [(16, 16, 8, 128), (9, 8, 1, 64), (5, 32, 2, 80), (4, 64, 4, 96), (7, 16, 2, 112),
              (3, 8, 2, 256)]
OPCHECK_FP8 = ("test_faketensor", "test_autograd_registration")  # see test_fp8.py


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def _empty_cache(shape, dtype, device, gen) -> torch.Tensor:
    """A cache whose every slot holds garbage: NaN for float caches, random codes for FP8, so a
    write to the wrong slot or a missed write shows up."""
    if dtype in FP8:
        return torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8).view(dtype).to(device)
    return torch.full(shape, float("nan"), dtype=dtype).to(device)


def _random_slots(gen, num_tokens: int, num_slots: int, pad_every: int = 5) -> torch.Tensor:
    """Distinct slots in random order, with some -1 padding entries."""
    slots = torch.randperm(num_slots, generator=gen)[:num_tokens]
    slots[::pad_every] = -1
    return slots.to(torch.int64)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("in_dtype, cache_dtype", DTYPE_PAIRS)
@pytest.mark.parametrize("geometry", GEOMETRIES)
@pytest.mark.parametrize("scale_kind", ["tensor", "head"])
def test_reshape_and_cache_matches_reference(device, in_dtype, cache_dtype, geometry, scale_kind,
                                             gen):
    num_blocks, block_size, heads, head_size = geometry
    num_tokens = min(37, num_blocks * block_size)
    # key and value are slices of a fused QKV projection: strided in the token dimension.
    qkv = (torch.randn(num_tokens, 3 * heads, head_size, generator=gen) * 20).to(in_dtype)
    qkv = qkv.to(device)
    key, value = qkv[:, heads:2 * heads], qkv[:, 2 * heads:]
    shape = (num_blocks, block_size, heads, head_size)
    key_cache = _empty_cache(shape, cache_dtype, device, gen)
    value_cache = _empty_cache(shape, cache_dtype, device, gen)
    slots = _random_slots(gen, num_tokens, num_blocks * block_size).to(device)
    scale_shape = (heads,) if scale_kind == "head" else ()
    k_scale = (torch.rand(scale_shape, generator=gen) * 2 + 0.05).to(device)
    v_scale = (torch.rand(scale_shape, generator=gen) * 2 + 0.05).to(device)
    expected_k, expected_v = key_cache.clone(), value_cache.clone()
    ops.reshape_and_cache(key, value, key_cache, value_cache, slots, k_scale, v_scale)
    reference.reshape_and_cache(key, value, expected_k, expected_v, slots, k_scale, v_scale)
    assert torch.equal(_bits(key_cache), _bits(expected_k))
    assert torch.equal(_bits(value_cache), _bits(expected_v))


@pytest.mark.parametrize("device", DEVICES)
def test_reshape_and_cache_fp8_without_scale_means_one(device, gen):
    key = torch.randn(6, 2, 64, generator=gen).to(device)
    cache = torch.zeros(2, 8, 2, 64, dtype=torch.float8_e4m3fn, device=device)
    expected = cache.clone()
    slots = torch.arange(6, dtype=torch.int64, device=device)
    ops.reshape_and_cache(key, key, cache, cache.clone(), slots)
    reference.reshape_and_cache(key, key, expected, expected.clone(), slots)
    assert torch.equal(_bits(cache), _bits(expected))


@pytest.mark.parametrize("device", DEVICES)
def test_reshape_and_cache_opcheck(device, gen):
    key = torch.randn(10, 2, 64, generator=gen).to(device)
    value = torch.randn(10, 2, 64, generator=gen).to(device)
    slots = _random_slots(gen, 10, 32).to(device)
    caches = [torch.randn(4, 8, 2, 64, generator=gen).to(device) for _ in range(2)]
    torch.library.opcheck(torch.ops.pagedspec.reshape_and_cache.default,
                          (key, value, *caches, slots))
    fp8 = [torch.empty(4, 8, 2, 64, dtype=torch.float8_e5m2, device=device) for _ in range(2)]
    scale = torch.tensor(0.5, device=device)
    torch.library.opcheck(torch.ops.pagedspec.reshape_and_cache.default,
                          (key, value, *fp8, slots, scale, scale), test_utils=OPCHECK_FP8)


def _reshape_args(**overrides):
    args = dict(key=torch.randn(4, 2, 64), value=torch.randn(4, 2, 64),
                key_cache=torch.zeros(2, 8, 2, 64), value_cache=torch.zeros(2, 8, 2, 64),
                slot_mapping=torch.arange(4, dtype=torch.int64), k_scale=None, v_scale=None)
    args.update(overrides)
    return args


@pytest.mark.parametrize(
    "overrides, match",
    [
        (dict(key=torch.randn(4, 2, 64).long()), r"key must have dtype in \{Half, BFloat16, Float\}, got Long"),
        (dict(value=torch.randn(4, 2, 64).half()), r"value must have the same dtype as key \(Float\), got Half"),
        (dict(key=torch.randn(4, 128), value=torch.randn(4, 128)), r"key must have 3 dimensions, got 2"),
        (dict(key_cache=torch.zeros(2, 8, 64, 2).transpose(2, 3)), r"key_cache must be contiguous"),
        (dict(key_cache=torch.zeros(2, 8, 2, 64).half(), value_cache=torch.zeros(2, 8, 2, 64).half()),
         r"key_cache must have the same dtype as key \(Float\), got Half"),
        (dict(key_cache=torch.zeros(2, 8, 4, 64), value_cache=torch.zeros(2, 8, 4, 64)),
         r"key.size\(1\) must be 4 \(num_kv_heads of key_cache\), got 2"),
        (dict(key_cache=torch.zeros(2, 8, 2, 64, dtype=torch.int8)), r"key_cache must have dtype in"),
        (dict(slot_mapping=torch.arange(4, dtype=torch.int32)), r"slot_mapping must have dtype in \{Long\}, got Int"),
        (dict(slot_mapping=torch.arange(3, dtype=torch.int64)), r"slot_mapping.size\(0\) must be 4 \(num_tokens of key\), got 3"),
        (dict(slot_mapping=torch.tensor([0, 1, 16, 2])), r"slot_mapping\[2\] must be -1 or in \[0, 16\), got 16"),
        (dict(slot_mapping=torch.tensor([0, -2, 1, 2])), r"slot_mapping\[1\] must be -1 or in \[0, 16\), got -2"),
        (dict(key_cache=torch.zeros(2, 8, 2, 64, dtype=torch.float8_e4m3fn),
              value_cache=torch.zeros(2, 8, 2, 64, dtype=torch.float8_e4m3fn),
              k_scale=torch.ones(3)), r"k_scale must have shape \[\] or \[2\], got \[3\]"),
        (dict(key_cache=torch.zeros(2, 8, 2, 64, dtype=torch.float8_e4m3fn),
              value_cache=torch.zeros(2, 8, 2, 64, dtype=torch.float8_e4m3fn),
              v_scale=torch.ones((), dtype=torch.float16)), r"v_scale must have dtype in \{Float\}, got Half"),
    ],
)
def test_reshape_and_cache_bad_inputs(overrides, match):
    with pytest.raises(RuntimeError, match=match):
        ops.reshape_and_cache(**_reshape_args(**overrides))


@pytest.mark.parametrize("repeats", [2, 3])
def test_reshape_and_cache_rejects_duplicate_slots(repeats, gen):
    """Two tokens in one slot would race (which one lands depends on thread timing), so a repeated
    non-negative slot is an error; -1 padding may repeat freely."""
    num_tokens, num_slots = 12, 32
    slots = _random_slots(gen, num_tokens, num_slots, pad_every=4)
    slots[[0, 4]] = -1
    first = int(torch.randint(1, 4, (1,), generator=gen))
    later = torch.randperm(num_tokens - 5, generator=gen)[:repeats - 1] + 5
    slots[later] = int(slots[first])
    args = _reshape_args(key=torch.randn(num_tokens, 2, 64, generator=gen),
                         value=torch.randn(num_tokens, 2, 64, generator=gen),
                         key_cache=torch.zeros(4, 8, 2, 64), value_cache=torch.zeros(4, 8, 2, 64),
                         slot_mapping=slots)
    with pytest.raises(RuntimeError, match=rf"reshape_and_cache: slot_mapping\[{int(later.min())}\] "
                       rf"must differ from every other non-negative slot .*, got "
                       rf"{int(slots[first])}, the same as slot_mapping\[{first}\]"):
        ops.reshape_and_cache(**args)
    with pytest.raises(ValueError, match="repeats"):
        reference.reshape_and_cache(**args)
    args["slot_mapping"] = torch.tensor([-1] * num_tokens)  # padding only: nothing written
    ops.reshape_and_cache(**args)
    assert not args["key_cache"].any()


@requires_cuda
@pytest.mark.cuda
def test_reshape_and_cache_duplicate_slots_on_cuda(gen):
    """CUDA checks duplicates only under PAGEDSPEC_DEBUG=1 (a device-to-host copy). Without it,
    every element of a repeated slot holds one of its tokens' values and no other slot changes."""
    import os
    import subprocess
    import sys

    if os.environ.get("PAGEDSPEC_DEBUG") != "1":
        key = torch.randn(6, 2, 64, generator=gen).half().cuda()
        slots = torch.tensor([3, 7, 3, -1, 3, 9]).cuda()
        cache = torch.zeros(2, 8, 2, 64, dtype=torch.half, device="cuda")
        ops.reshape_and_cache(key, key, cache, cache.clone(), slots)
        flat = cache.view(16, 2, 64)
        assert torch.equal(flat[7], key[1]) and torch.equal(flat[9], key[5])
        landed = flat[3]
        assert ((landed == key[0]) | (landed == key[2]) | (landed == key[4])).all()
        untouched = [s for s in range(16) if s not in (3, 7, 9)]
        assert not flat[untouched].any()
    code = ("import torch; from pagedspec import ops\n"
            "k = torch.randn(3, 2, 64, device='cuda')\n"
            "c = torch.zeros(2, 8, 2, 64, device='cuda')\n"
            "try:\n    ops.reshape_and_cache(k, k, c, c.clone(), torch.tensor([5, 1, 5], device='cuda'))\n"
            "except RuntimeError as e:\n    print(e)\n")
    env = dict(os.environ, PAGEDSPEC_DEBUG="1")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120)
    assert "slot_mapping[2] must differ from every other non-negative slot" in out.stdout, out


def _cow_mapping(gen, num_blocks: int, n: int) -> torch.Tensor:
    """n (src, dst) pairs with distinct dsts, no dst used as a src: a valid copy-on-write step."""
    perm = torch.randperm(num_blocks, generator=gen)
    dst = perm[:n]
    src = perm[n:][torch.randint(0, num_blocks - n, (n,), generator=gen)]  # srcs may repeat
    return torch.stack([src, dst], dim=1).to(torch.int64)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float8_e4m3fn])
@pytest.mark.parametrize("num_layers", [1, 3, 70])  # 70 > the 64 layers one CUDA launch carries
def test_copy_blocks_matches_reference(device, dtype, num_layers, gen):
    shape = (12, 8, 2, 64)
    def layer():
        if dtype in FP8:
            return torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8).view(dtype)
        return torch.randn(shape, generator=gen).to(dtype)
    keys = [layer().to(device) for _ in range(num_layers)]
    values = [layer().to(device) for _ in range(num_layers)]
    mapping = _cow_mapping(gen, 12, 5).to(device)
    expected_keys = [k.clone() for k in keys]
    expected_values = [v.clone() for v in values]
    ops.copy_blocks(keys, values, mapping)
    reference.copy_blocks(expected_keys, expected_values, mapping)
    for got, want in zip(keys + values, expected_keys + expected_values):
        assert torch.equal(_bits(got), _bits(want))


@pytest.mark.parametrize("device", DEVICES)
def test_copy_blocks_opcheck(device, gen):
    keys = [torch.randn(6, 8, 2, 64, generator=gen).to(device) for _ in range(2)]
    values = [torch.randn(6, 8, 2, 64, generator=gen).to(device) for _ in range(2)]
    mapping = _cow_mapping(gen, 6, 2).to(device)
    torch.library.opcheck(torch.ops.pagedspec.copy_blocks.default, (keys, values, mapping))


@pytest.mark.parametrize(
    "mapping, match",
    [
        ([[0, 1], [1, 2]], r"block_mapping\[0, 1\] = 1 is also a src block"),
        ([[0, 2], [1, 2]], r"block_mapping\[1, 1\] = 2 repeats an earlier dst block"),
        ([[0, 6]], r"block_mapping\[0, 1\] \(dst block\) must be in \[0, 6\), got 6"),
        ([[-1, 3]], r"block_mapping\[0, 0\] \(src block\) must be in \[0, 6\), got -1"),
    ],
)
def test_copy_blocks_bad_mapping(mapping, match):
    caches = [torch.randn(6, 8, 2, 64)]
    with pytest.raises(RuntimeError, match=match):
        ops.copy_blocks(caches, [torch.randn(6, 8, 2, 64)], torch.tensor(mapping))


def test_copy_blocks_bad_layers():
    with pytest.raises(RuntimeError, match=r"value_caches\[1\] must match key_caches\[0\]"):
        ops.copy_blocks([torch.zeros(4, 8, 2, 64)] * 2,
                        [torch.zeros(4, 8, 2, 64), torch.zeros(5, 8, 2, 64)],
                        torch.tensor([[0, 1]]))
    with pytest.raises(RuntimeError, match=r"block_mapping must have dtype in \{Long\}, got Int"):
        ops.copy_blocks([torch.zeros(4, 8, 2, 64)], [torch.zeros(4, 8, 2, 64)],
                        torch.tensor([[0, 1]], dtype=torch.int32))
    with pytest.raises(RuntimeError, match=r"key_caches and value_caches must have the same length"):
        ops.copy_blocks([torch.zeros(4, 8, 2, 64)], [], torch.tensor([[0, 1]]))


def test_swap_blocks_cpu_matches_reference(gen):
    src = torch.randn(10, 16, 4, 64, generator=gen).to(torch.bfloat16)
    dst = torch.full((7, 16, 4, 64), float("nan"), dtype=torch.bfloat16)
    # Includes a run of consecutive blocks (3,4,5 -> 0,1,2) and scattered ones.
    mapping = torch.tensor([[3, 0], [4, 1], [5, 2], [9, 6], [0, 4]])
    expected = dst.clone()
    ops.swap_blocks(src, dst, mapping)
    reference.swap_blocks(src, expected, mapping)
    assert torch.equal(dst.view(torch.int16), expected.view(torch.int16))


def _independent_same_tensor_mapping(gen, num_blocks: int, n: int) -> torch.Tensor:
    """n pairs within one tensor whose src blocks are never dst blocks: any order gives one result."""
    perm = torch.randperm(num_blocks, generator=gen)
    return torch.stack([perm[n:2 * n], perm[:n]], dim=1).to(torch.int64)


def test_swap_blocks_within_one_tensor(gen):
    cache = torch.randn(12, 8, 2, 64, generator=gen)
    mapping = _independent_same_tensor_mapping(gen, 12, 5)
    expected = cache.clone()
    reference.swap_blocks(expected.clone(), expected, mapping)
    ops.swap_blocks(cache, cache, mapping)
    assert torch.equal(cache, expected)


# Pairs within one tensor whose result depends on their order, or a repeated dst.
DEPENDENT_PAIRS = [
    ([[1, 2], [2, 3]], r"block_mapping\[1, 0\] must not overlap any dst block .* got src block 2, "
                       r"which overlaps dst block 2 of block_mapping\[0, 1\]"),  # chain
    ([[1, 2], [3, 1]], r"block_mapping\[0, 0\] must not overlap .* dst block 1 of block_mapping\[1, 1\]"),
    ([[0, 1], [1, 2]], r"block_mapping\[1, 0\] must not overlap"),  # a run whose ranges overlap
    ([[4, 4]], r"block_mapping\[0, 0\] must not overlap .* dst block 4 of block_mapping\[0, 1\]"),
    ([[0, 5], [1, 6], [2, 5]], r"block_mapping\[2, 1\] must differ from every other dst block .*"
                               r"got 5, the same as block_mapping\[0, 1\]"),
]


@pytest.mark.parametrize("mapping, match", DEPENDENT_PAIRS)
def test_swap_blocks_rejects_order_dependent_pairs(mapping, match, gen):
    """The CUDA kernel copies all pairs at once, so pairs whose order matters are an error on
    every path (not "applied in order" on some and a race on others)."""
    cache = torch.randn(8, 4, 2, 16, generator=gen)
    before = cache.clone()
    with pytest.raises(RuntimeError, match=match):
        ops.swap_blocks(cache, cache, torch.tensor(mapping))
    assert torch.equal(cache, before), "nothing is copied when the mapping is rejected"
    with pytest.raises(ValueError):
        reference.swap_blocks(cache, cache, torch.tensor(mapping))


def test_swap_blocks_repeated_dst_between_tensors_is_rejected(gen):
    src, dst = torch.randn(4, 8, 16, generator=gen), torch.zeros(4, 8, 16)
    with pytest.raises(RuntimeError, match=r"block_mapping\[1, 1\] must differ from every other dst"):
        ops.swap_blocks(src, dst, torch.tensor([[0, 2], [1, 2]]))


@pytest.mark.parametrize("shift_elems", [1, 8, 32, 100])
def test_swap_blocks_overlapping_views(shift_elems, gen):
    """src and dst as views of one buffer at different offsets (also by part of a block): the
    overlap is found on byte addresses, not block ids."""
    block = 64  # elements per block
    buf = torch.randn(16 * block + shift_elems, generator=gen)
    src = buf[:16 * block].view(16, block)
    dst = buf[shift_elems:].view(16, block)
    covers = lambda s, d: (s * block < shift_elems + (d + 1) * block and
                           shift_elems + d * block < (s + 1) * block)
    bad = [(s, d) for s in range(16) for d in range(16) if covers(s, d)][::7]
    for s, d in bad:
        with pytest.raises(RuntimeError, match=r"must not overlap any dst block"):
            ops.swap_blocks(src, dst, torch.tensor([[s, d]]))
    ok = torch.tensor([[0, 12], [1, 14]]) if shift_elems < block else torch.tensor([[0, 10]])
    expected = buf.clone()
    reference.swap_blocks(expected[:16 * block].view(16, block),
                          expected[shift_elems:].view(16, block), ok)
    ops.swap_blocks(src, dst, ok)
    assert torch.equal(buf, expected)


def test_swap_blocks_opcheck(gen):
    src = torch.randn(4, 8, 2, 64, generator=gen)
    dst = torch.randn(3, 8, 2, 64, generator=gen)
    torch.library.opcheck(torch.ops.pagedspec.swap_blocks.default,
                          (src, dst, torch.tensor([[1, 0], [3, 2]])))


@pytest.mark.parametrize(
    "dst, mapping, match",
    [
        (torch.zeros(3, 8, 2, 64), [[4, 0]], r"block_mapping\[0, 0\] \(src block\) must be in \[0, 4\), got 4"),
        (torch.zeros(3, 8, 2, 64), [[0, 3]], r"block_mapping\[0, 1\] \(dst block\) must be in \[0, 3\), got 3"),
        (torch.zeros(3, 8, 2, 32), [[0, 0]], r"dst must have the same block shape as src"),
        (torch.zeros(3, 8, 2, 64).half(), [[0, 0]], r"dst must have the same dtype as src"),
    ],
)
def test_swap_blocks_bad_inputs(dst, mapping, match):
    with pytest.raises(RuntimeError, match=match):
        ops.swap_blocks(torch.zeros(4, 8, 2, 64), dst, torch.tensor(mapping))


@requires_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("mapping_on", ["cpu", "cuda"])
@pytest.mark.parametrize("direction", ["out", "in"])
def test_swap_blocks_between_pinned_host_and_gpu(mapping_on, direction, gen):
    gpu = torch.randn(12, 16, 8, 128, generator=gen).half().cuda()
    host = torch.randn(20, 16, 8, 128, generator=gen).half().pin_memory()
    mapping = torch.tensor([[1, 5], [2, 6], [3, 7], [11, 0], [0, 19]])
    if direction == "in":
        mapping = mapping[:, [1, 0]].contiguous()
        src, dst = host, gpu
    else:
        src, dst = gpu, host
    expected = dst.clone().cpu()
    ops.swap_blocks(src, dst, mapping.to(mapping_on))
    torch.cuda.synchronize()
    reference.swap_blocks(src.cpu(), expected, mapping)
    assert torch.equal(dst.cpu().view(torch.int16), expected.view(torch.int16))


@requires_cuda
@pytest.mark.cuda
def test_swap_blocks_device_mapping_needs_pinned_host():
    with pytest.raises(RuntimeError, match=r"src must be in pinned host memory"):
        ops.swap_blocks(torch.zeros(4, 8), torch.zeros(4, 8, device="cuda"),
                        torch.tensor([[0, 1]], device="cuda"))


@requires_cuda
@pytest.mark.cuda
def test_cache_ops_reject_mixed_devices():
    with pytest.raises(RuntimeError, match=r"slot_mapping must be on the same device as key"):
        ops.reshape_and_cache(**_reshape_args(
            key=torch.randn(4, 2, 64, device="cuda"), value=torch.randn(4, 2, 64, device="cuda"),
            key_cache=torch.zeros(2, 8, 2, 64, device="cuda"),
            value_cache=torch.zeros(2, 8, 2, 64, device="cuda")))
    with pytest.raises(RuntimeError, match=r"block_mapping must be on the same device as key_caches\[0\]"):
        ops.copy_blocks([torch.zeros(4, 8, 2, 64, device="cuda")],
                        [torch.zeros(4, 8, 2, 64, device="cuda")], torch.tensor([[0, 1]]))
    with pytest.raises(RuntimeError, match=r"scale must be on the same device as input"):
        ops.quantize_fp8(torch.empty(4, 64, dtype=torch.float8_e4m3fn, device="cuda"),
                         torch.randn(4, 64, device="cuda"), torch.tensor(1.0))


@requires_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("mapping, match", DEPENDENT_PAIRS)
def test_swap_blocks_cuda_host_mapping_rejects_order_dependent_pairs(mapping, match, gen):
    """With the mapping on the host, CUDA checks (and never merges overlapping ranges into one
    cudaMemcpyAsync, whose behaviour on overlap is undefined)."""
    cache = torch.randn(8, 4, 2, 16, generator=gen).cuda()
    with pytest.raises(RuntimeError, match=match):
        ops.swap_blocks(cache, cache, torch.tensor(mapping))


@requires_cuda
@pytest.mark.cuda
def test_swap_blocks_cuda_within_one_tensor(gen):
    for mapping_on in ("cpu", "cuda"):
        cache = torch.randn(12, 8, 2, 64, generator=gen).cuda()
        mapping = _independent_same_tensor_mapping(gen, 12, 5)
        expected = cache.cpu()
        reference.swap_blocks(expected.clone(), expected, mapping)
        ops.swap_blocks(cache, cache, mapping.to(mapping_on))
        assert torch.equal(cache.cpu(), expected)


@requires_cuda
@pytest.mark.cuda
def test_swap_blocks_cuda_device_mapping_checks_under_debug():
    """A CUDA-resident mapping is checked only with PAGEDSPEC_DEBUG=1 (it needs a copy)."""
    import os
    import subprocess
    import sys

    code = ("import torch; from pagedspec import ops\n"
            "c = torch.randn(8, 4, 16, device='cuda')\n"
            "try:\n    ops.swap_blocks(c, c, torch.tensor([[1, 2], [2, 3]], device='cuda'))\n"
            "except RuntimeError as e:\n    print(e)\n")
    env = dict(os.environ, PAGEDSPEC_DEBUG="1")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120)
    assert "block_mapping[1, 0] must not overlap any dst block" in out.stdout, out


def _misaligned_cache(shape, dtype=torch.float16, device="cuda") -> torch.Tensor:
    """A contiguous cache view one element past a 16-byte boundary."""
    numel = 1
    for n in shape:
        numel *= n
    return torch.zeros(numel + 1, dtype=dtype, device=device)[1:].view(shape)


@requires_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("which", ["key_cache", "value_cache"])
@pytest.mark.parametrize("cache_dtype", [torch.float16, torch.float8_e4m3fn])
def test_reshape_and_cache_cuda_rejects_misaligned_cache(which, cache_dtype, gen):
    key = torch.randn(4, 2, 64, generator=gen).half().cuda()
    caches = {"key_cache": torch.zeros(2, 8, 2, 64, dtype=cache_dtype, device="cuda"),
              "value_cache": torch.zeros(2, 8, 2, 64, dtype=cache_dtype, device="cuda")}
    caches[which] = _misaligned_cache((2, 8, 2, 64), cache_dtype)
    with pytest.raises(RuntimeError, match=rf"reshape_and_cache: {which} must start on a 16-byte "
                                           r"boundary on CUDA .* \(storage offset 1 elements"):
        ops.reshape_and_cache(key, key.clone(), caches["key_cache"], caches["value_cache"],
                              torch.arange(4, device="cuda"))


@requires_cuda
@pytest.mark.cuda
def test_copy_blocks_cuda_rejects_misaligned_cache(gen):
    good = [torch.zeros(4, 8, 2, 64, dtype=torch.float16, device="cuda") for _ in range(3)]
    bad = _misaligned_cache((4, 8, 2, 64))
    with pytest.raises(RuntimeError, match=r"copy_blocks: value_caches\[1\] must start on a "
                                           r"16-byte boundary on CUDA"):
        ops.copy_blocks(good[:2], [good[2], bad], torch.tensor([[0, 1]], device="cuda"))
