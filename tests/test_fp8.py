"""quantize_fp8 / dequantize_fp8 against the reference, bit for bit, including every special value
(the same codec backs the FP8 caches, so this also proves their rounding and saturation)."""
from __future__ import annotations

import pytest
import torch

from pagedspec import ops, reference
from conftest import DEVICES, requires_cuda

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
WIDE = [torch.float16, torch.bfloat16, torch.float32]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.element_size() == 1 else t.view(
        {2: torch.int16, 4: torch.int32}[t.element_size()])


def _assert_quantize_matches_reference(x: torch.Tensor, scale: torch.Tensor, fp8: torch.dtype):
    """The op's FP8 codes equal the reference's bit for bit."""
    out = torch.empty(x.shape, dtype=fp8, device=x.device)
    expected = torch.empty_like(out)
    ops.quantize_fp8(out, x, scale)
    reference.quantize_fp8(expected, x, scale)
    assert torch.equal(_bits(out), _bits(expected)), f"scale {scale.tolist()}"


def _special_values(gen: torch.Generator, n: int, fp8: torch.dtype) -> torch.Tensor:
    """Random values spanning every magnitude class of the FP8 format: subnormals, normals, exact
    ties between two codes, values past the largest finite, infinities, NaN, signed zeros."""
    fp8_max = reference.FP8_MAX[fp8]
    log_lo = -12.0 if fp8 == torch.float8_e4m3fn else -20.0
    exponents = torch.rand(n, generator=gen) * (torch.log2(torch.tensor(fp8_max * 4)) - log_lo) + log_lo
    signs = torch.where(torch.rand(n, generator=gen) < 0.5, -1.0, 1.0)
    values = signs * torch.exp2(exponents)
    # Exact midpoints between adjacent codes (ties must round to even).
    codes = torch.randint(0, 0x7E, (n // 8,), generator=gen, dtype=torch.uint8)
    lo = codes.view(fp8).float()
    hi = (codes + 1).view(fp8).float()
    values[: n // 8] = (lo + hi) / 2
    specials = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan"), -float("nan"),
                             fp8_max, -fp8_max, fp8_max * 1.04, 1e30, -1e30, 1e-30])
    values[-len(specials):] = specials
    return values


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("wide", WIDE)
@pytest.mark.parametrize("per_head", [False, True])
def test_quantize_matches_reference_bitwise(device, fp8, wide, per_head, gen):
    heads, head_size = 4, 64
    x = _special_values(gen, 3 * heads * head_size * 8, fp8).reshape(-1, heads, head_size)
    x = x.to(wide).to(device)
    scale = (torch.rand(heads if per_head else (), generator=gen) * 3 + 0.25).to(device)
    _assert_quantize_matches_reference(x, scale, fp8)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("wide", [torch.float16, torch.bfloat16])
def test_quantize_every_16bit_input(device, fp8, wide):
    """Exhaustive: all 65536 half / bfloat16 bit patterns, with scale 1 and an odd scale."""
    x = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(wide).to(device)
    for s in (1.0, 0.37):
        scale = torch.tensor(s, device=device)
        _assert_quantize_matches_reference(x, scale, fp8)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fp8", FP8)
def test_quantize_random_float32_bit_patterns(device, fp8, gen):
    bits = torch.randint(-(2**31), 2**31 - 1, (1 << 18,), generator=gen, dtype=torch.int64)
    x = bits.to(torch.int32).view(torch.float32).to(device)
    scale = torch.tensor(1.0, device=device)
    _assert_quantize_matches_reference(x, scale, fp8)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("wide", WIDE)
@pytest.mark.parametrize("per_head", [False, True])
def test_dequantize_every_code(device, fp8, wide, per_head, gen):
    heads = 4
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).repeat(heads * 2)
    x = codes.view(fp8).reshape(2, heads, 256).to(device)
    scale = (torch.rand(heads if per_head else (), generator=gen) * 3 + 0.25).to(device)
    out = torch.empty(x.shape, dtype=wide, device=device)
    expected = torch.empty_like(out)
    ops.dequantize_fp8(out, x, scale)
    reference.dequantize_fp8(expected, x, scale)
    torch.testing.assert_close(out, expected, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fp8", FP8)
def test_round_trip_is_identity_on_codes(device, fp8):
    """dequantize then quantize with the same scale returns every finite code unchanged (e5m2
    infinities saturate to the largest finite code, as the contract says)."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    x = codes.view(fp8).to(device)
    values = torch.empty(256, dtype=torch.float32, device=device)
    back = torch.empty(256, dtype=fp8, device=device)
    scale = torch.tensor(0.5, device=device)
    ops.dequantize_fp8(values, x, scale)
    ops.quantize_fp8(back, values, scale)
    finite = torch.isfinite(values)
    assert torch.equal(_bits(back)[finite], _bits(x)[finite])


# opcheck's test_schema compares tensors with arithmetic that torch does not implement for FP8
# dtypes ("mul_cpu_reduced_float" not implemented for 'Float8_e4m3fn'), so it cannot run on these
# ops; the remaining opcheck tests run, and test_only_out_is_written checks the mutation schema.
OPCHECK_FP8 = ("test_faketensor", "test_autograd_registration", "test_aot_dispatch_dynamic")


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device, gen):
    x = torch.randn(3, 4, 64, generator=gen).to(device)
    scale = torch.rand(4, generator=gen).to(device) + 0.5
    q = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=device)
    torch.library.opcheck(torch.ops.pagedspec.quantize_fp8.default, (q, x, scale),
                          test_utils=OPCHECK_FP8)
    ops.quantize_fp8(q, x, scale)
    torch.library.opcheck(torch.ops.pagedspec.dequantize_fp8.default,
                          (torch.empty_like(x), q, scale), test_utils=OPCHECK_FP8)


@pytest.mark.parametrize("device", DEVICES)
def test_only_out_is_written(device, gen):
    """The schema says only `out` is mutated: input and scale keep their bits."""
    x = torch.randn(2, 4, 64, generator=gen).to(device)
    scale = torch.rand(4, generator=gen).to(device) + 0.5
    x0, s0 = x.clone(), scale.clone()
    q = torch.empty(x.shape, dtype=torch.float8_e5m2, device=device)
    ops.quantize_fp8(q, x, scale)
    q0 = q.view(torch.uint8).clone()
    ops.dequantize_fp8(torch.empty_like(x), q, scale)
    assert torch.equal(x, x0) and torch.equal(scale, s0)
    assert torch.equal(q.view(torch.uint8), q0)


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: (torch.empty(4, 64, dtype=torch.float16), torch.randn(4, 64), torch.tensor(1.0)),
         r"quantize_fp8: out must have dtype in \{Float8_e4m3fn, Float8_e5m2\}, got Half"),
        (lambda: (torch.empty(4, 64, dtype=torch.float8_e4m3fn), torch.randn(4, 64).long(),
                  torch.tensor(1.0)), r"input must have dtype in \{Half, BFloat16, Float\}, got Long"),
        (lambda: (torch.empty(4, 32, dtype=torch.float8_e4m3fn), torch.randn(4, 64), torch.tensor(1.0)),
         r"out must have shape \[4, 64\], got \[4, 32\]"),
        (lambda: (torch.empty(4, 64, dtype=torch.float8_e4m3fn), torch.randn(4, 64), torch.ones(3)),
         r"scale must have shape \[\] or \[input.size\(-2\)\] = \[4\], got \[3\]"),
        (lambda: (torch.empty(4, 64, dtype=torch.float8_e4m3fn), torch.randn(4, 64),
                  torch.tensor(1.0, dtype=torch.float64)), r"scale must have dtype in \{Float\}, got Double"),
        (lambda: (torch.empty(4, 64, dtype=torch.float8_e4m3fn), torch.randn(64, 4).t(), torch.tensor(1.0)),
         r"input must be contiguous"),
    ],
)
def test_bad_inputs(make, match):
    out, x, scale = make()
    with pytest.raises(RuntimeError, match=match):
        ops.quantize_fp8(out, x, scale)


def test_dequantize_bad_input_dtype():
    with pytest.raises(RuntimeError, match=r"dequantize_fp8: input must have dtype in \{Float8_e4m3fn"):
        ops.dequantize_fp8(torch.empty(4), torch.randn(4), torch.tensor(1.0))


def _convert(op: str, x: torch.Tensor, scale: torch.Tensor, fp8: torch.dtype = torch.float8_e4m3fn):
    """Runs quantize_fp8 on x, or dequantize_fp8 on x's FP8 codes (quantized with scale 1)."""
    if op == "quantize_fp8":
        ops.quantize_fp8(torch.empty(x.shape, dtype=fp8, device=x.device), x, scale)
    else:
        codes = x.to(fp8)
        ops.dequantize_fp8(torch.empty(x.shape, device=x.device), codes, scale)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("op", ["quantize_fp8", "dequantize_fp8"])
@pytest.mark.parametrize("layout", ["expanded", "strided"])
def test_non_contiguous_scale_is_rejected(device, op, layout, gen):
    """The kernels read scale[head] from its data pointer, so a per-head scale must be contiguous:
    an expanded one was read past its single element (a crash for large head counts), a strided
    one silently gave heads the wrong scales."""
    heads = 4
    x = torch.randn(3, heads, 16, generator=gen).to(device)
    if layout == "expanded":
        scale = (torch.rand(1, generator=gen) + 0.5).to(device).expand(heads)
    else:
        scale = (torch.rand(2 * heads, generator=gen) + 0.5).to(device)[::2]
    with pytest.raises(RuntimeError, match=rf"{op}: scale must be contiguous, got strides "):
        _convert(op, x, scale)


def test_expanded_scale_over_many_heads_does_not_crash():
    """The review's reproducer: 2^24 heads sharing one expanded scale element."""
    x = torch.zeros(1, 1 << 24, 1)
    with pytest.raises(RuntimeError, match=r"quantize_fp8: scale must be contiguous"):
        ops.quantize_fp8(torch.empty(x.shape, dtype=torch.float8_e4m3fn), x,
                         torch.tensor([2.0]).expand(1 << 24))


BAD_SCALES = [0.0, -0.5, float("inf"), float("-inf"), float("nan")]


@pytest.mark.parametrize("op", ["quantize_fp8", "dequantize_fp8"])
@pytest.mark.parametrize("bad", BAD_SCALES)
@pytest.mark.parametrize("per_head", [False, True])
def test_non_finite_or_non_positive_scale_is_rejected(op, bad, per_head, gen):
    heads = 5
    x = torch.randn(2, heads, 32, generator=gen)
    if per_head:
        scale = torch.rand(heads, generator=gen) + 0.5
        at = int(torch.randint(0, heads, (1,), generator=gen))
        scale[at] = bad
        match = rf"{op}: scale must be finite and positive, got scale\[{at}\] = "
    else:
        scale = torch.tensor(bad)
        match = rf"{op}: scale must be finite and positive, got "
    with pytest.raises(RuntimeError, match=match):
        _convert(op, x, scale)


@pytest.mark.cuda
@requires_cuda
def test_cuda_scale_values_are_checked_under_debug():
    """A CUDA-resident scale's values need a device-to-host copy to check: only with
    PAGEDSPEC_DEBUG=1 (read at process start, hence the subprocess)."""
    import os
    import subprocess
    import sys

    code = ("import torch; from pagedspec import ops\n"
            "x = torch.randn(4, 2, 64, device='cuda')\n"
            "out = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device='cuda')\n"
            "try:\n    ops.quantize_fp8(out, x, torch.tensor([1.0, 0.0], device='cuda'))\n"
            "except RuntimeError as e:\n    print(e)\n")
    env = dict(os.environ, PAGEDSPEC_DEBUG="1")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120)
    assert "quantize_fp8: scale must be finite and positive, got scale[1] = 0" in out.stdout, out


def _fp8_cache_call(op: str, gen, k_scale, v_scale):
    """A minimal valid call of an op that reads k_scale / v_scale of an FP8 cache."""
    heads, head_size = 2, 64
    cache = [torch.randint(0, 0x70, (2, 8, heads, head_size), generator=gen,
                           dtype=torch.uint8).view(torch.float8_e4m3fn) for _ in range(2)]
    if op == "reshape_and_cache":
        kv = torch.randn(3, heads, head_size, generator=gen)
        ops.reshape_and_cache(kv, kv.clone(), *cache, torch.tensor([0, 5, 9]), k_scale, v_scale)
        return
    query = torch.randn(2, 2 * heads, head_size, generator=gen)
    getattr(ops, op)(torch.empty_like(query), query, *cache,
                     torch.tensor([[0, 1], [1, 0]], dtype=torch.int32),
                     torch.tensor([5, 12], dtype=torch.int32),
                     torch.tensor([0, 1, 2], dtype=torch.int32), 1, 0.125, k_scale, v_scale)


@pytest.mark.parametrize("op", ["reshape_and_cache", "paged_attention_v1", "paged_attention_v2",
                                "paged_attention"])
@pytest.mark.parametrize("which", ["k_scale", "v_scale"])
@pytest.mark.parametrize("bad", BAD_SCALES)
def test_cache_scales_must_be_finite_and_positive(op, which, bad, gen):
    """The same rule for every op that reads an FP8 cache's scales (make_scale_ref, checks.h)."""
    scales = {"k_scale": torch.rand(2, generator=gen) + 0.5,
              "v_scale": torch.rand((), generator=gen) + 0.5}
    scales[which] = torch.full(scales[which].shape, bad)
    match = rf"{op}: {which} must be finite and positive, got " + (rf"{which}\[0\] = "
                                                                   if which == "k_scale" else "")
    with pytest.raises(RuntimeError, match=match):
        _fp8_cache_call(op, gen, scales["k_scale"], scales["v_scale"])
    # Valid scales pass (so the failure above is the scale's).
    _fp8_cache_call(op, gen, torch.rand(2, generator=gen) + 0.5, torch.rand((), generator=gen) + 0.5)
