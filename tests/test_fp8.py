"""quantize_fp8 / dequantize_fp8 against the reference, bit for bit, including every special value
(the same codec backs the FP8 caches, so this also proves their rounding and saturation)."""
from __future__ import annotations

import pytest
import torch

from pagedspec import ops, reference
from conftest import DEVICES

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
