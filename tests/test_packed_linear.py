"""pagedspec_models::packed_linear, the CPU model runner's product of a few rows on weights in its
packed layout (include/pagedspec/packed_linear.h), at every ISA level this CPU runs and on both
bf16 product paths (FMA on widened values; AVX512-BF16 dot products), against a float64
reference; its hand-over to oneDNN above max_packed_rows; its errors; and the layout itself.

Tolerance: both paths multiply exactly (bf16 x bf16 fits a float32; float32 products are rounded
once by the FMA) and sum K products in float32 in some order, so |y - ref| <= K 2^-24 sum_k |x w|
(the standard bound for recursive summation, the rounding error per addition at most 2^-24 of the
partial sum, itself at most sum_k |x w|), doubled for slack; a bfloat16 output adds its own
rounding, 2^-8 |ref| (the unit roundoff at 8 bits of precision). A weight read in the wrong
layout moves the result by O(|x||w|), far outside (test_the_bound_catches_a_wrong_layout)."""
from __future__ import annotations

import pytest
import torch

import pagedspec
from pagedspec.models.llama import PackedWeight, _prepacked, linear, pack_linear_weight

INFO = pagedspec.build_info()
OP = torch.ops.pagedspec_models.packed_linear
DTYPES = [torch.float32, torch.bfloat16]
LEVELS = [pytest.param(level, marks=pytest.mark.skipif(
    level not in INFO["cpu_isa_supported"], reason=f"this CPU lacks the {level} instructions"))
    for level in INFO["cpu_isa_levels"]]


def _dot_supported() -> bool:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PAGEDSPEC_CPU_ISA", "avx512")
        mp.setenv("PAGEDSPEC_CPU_BF16_DOT", "1")
        try:
            return bool(pagedspec._C.cpu_bf16_dot())
        except RuntimeError:          # no AVX-512 here
            return False


# (level, bf16 products): every level on its FMA path, and avx512's dot path.
PATHS = [pytest.param((p.values[0], "fma"), id=f"{p.values[0]}-fma", marks=p.marks)
         for p in LEVELS]
PATHS.append(pytest.param(("avx512", "dot"), id="avx512-dot", marks=pytest.mark.skipif(
    not _dot_supported(), reason="this CPU lacks AVX512-BF16 (or AVX512-VBMI)")))


@pytest.fixture(params=PATHS)
def path(request, monkeypatch):
    level, products = request.param
    monkeypatch.setenv("PAGEDSPEC_CPU_ISA", level)
    monkeypatch.setenv("PAGEDSPEC_CPU_BF16_DOT", "1" if products == "dot" else "0")
    assert pagedspec._C.cpu_isa() == level
    return request.param


def _chunk(dtype: torch.dtype) -> int:
    return 64 // torch.empty((), dtype=dtype).element_size()


def _inputs(gen, dtype, m, n, k, bias=True):
    x = torch.randn(m, k, generator=gen).to(dtype)
    w = (torch.randn(n, k, generator=gen) * k ** -0.5).to(dtype)
    b = torch.randn(n, generator=gen).to(dtype) if bias else None
    return x, w, b


def _check(y, x, w, b):
    x64, w64 = x.double(), w.double()
    ref = x64 @ w64.T + (b.double() if b is not None else 0.0)
    k = x.shape[1]
    bound = 2 * k * 2.0 ** -24 * (x64.abs() @ w64.abs().T) + 1e-30
    if y.dtype == torch.bfloat16:
        bound = bound + 2.0 ** -8 * ref.abs()
    assert y.dtype == x.dtype and y.shape == ref.shape
    excess = ((y.double() - ref).abs() - bound).max().item() if ref.numel() else 0.0
    assert excess <= 0, f"error exceeds the float32-summation bound by {excess:.3g}"


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("n, chunks", [(16, 1), (48, 3), (64, 18)])
@pytest.mark.parametrize("m", [0, 1, 2, 3, 4, 5, 7, 9])
def test_matches_the_reference(path, dtype, n, chunks, m, gen):
    k = chunks * _chunk(dtype)
    for bias in (True, False):
        x, w, b = _inputs(gen, dtype, m, n, k, bias)
        _check(OP(x, pack_linear_weight(w), b), x, w, b)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_a_nan_stays_in_its_row(path, dtype, gen):
    """A NaN in one input row makes that row's outputs NaN and no other's (a tile that mixed
    rows, or read a neighbour's accumulators, would spread it)."""
    x, w, b = _inputs(gen, dtype, 6, 32, 2 * _chunk(dtype))
    x[2, 5] = float("nan")
    y = OP(x, pack_linear_weight(w), b)
    assert torch.isnan(y[2]).all()
    rows = [0, 1, 3, 4, 5]
    assert torch.isfinite(y[rows]).all()
    _check(y[rows], x[rows], w, b)


def test_the_bound_catches_a_wrong_layout(gen):
    """The tolerance is tight enough to fail the kernel reading plain row-major rows as if they
    were packed (the layout step skipped)."""
    for dtype in DTYPES:
        x, w, b = _inputs(gen, dtype, 2, 32, 3 * _chunk(dtype))
        e = _chunk(dtype)
        unpacked = w.contiguous().view(8, 3, 4, e)          # right shape, wrong order
        with pytest.raises(AssertionError, match="exceeds the float32-summation bound"):
            _check(OP(x, unpacked, b), x, w, b)


def test_layout():
    """packed[b, c, r, e] is W[4 b + r, E c + e]."""
    for dtype in DTYPES:
        e = _chunk(dtype)
        w = torch.arange(32 * 2 * e, dtype=torch.float32).view(32, 2 * e).to(dtype)
        p = pack_linear_weight(w)
        assert p.shape == (8, 2, 4, e) and p.is_contiguous()
        for bl, c, r, i in [(0, 0, 0, 0), (1, 0, 2, 3), (7, 1, 3, e - 1), (3, 1, 1, 7)]:
            assert p[bl, c, r, i] == w[4 * bl + r, e * c + i]


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch without oneDNN")
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_more_rows_than_max_packed_rows_go_to_onednn(dtype, gen):
    """With onednn_weight, products of up to max_packed_rows rows are packed_linear's own (bit for
    bit as without it), larger ones oneDNN's on its prepacked weight (bit for bit as calling it)."""
    if dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        pytest.skip("oneDNN does not compute bfloat16 on this CPU")
    _, w, b = _inputs(gen, dtype, 1, 48, 3 * _chunk(dtype))
    packed, onednn = pack_linear_weight(w), _prepacked(w)
    for m in (1, 3, 4, 5, 12):
        x = torch.randn(m, w.shape[1], generator=gen).to(dtype)
        y = OP(x, packed, b, onednn, 4)
        if m <= 4:
            assert torch.equal(y, OP(x, packed, b))
        else:
            assert torch.equal(y, torch.ops.mkldnn._linear_pointwise(x, onednn, b, "none", [], ""))
        _check(y, x, w, b)
        # linear() takes a PackedWeight the same way, any leading shape.
        assert torch.equal(linear(x.view(1, m, -1), PackedWeight(packed, onednn), b)[0], y)


def test_opcheck(gen):
    x, w, b = _inputs(gen, torch.float32, 3, 32, 32)
    torch.library.opcheck(OP, (x, pack_linear_weight(w), b))
    torch.library.opcheck(OP, (x, pack_linear_weight(w)))


def _bad_calls(gen):
    x, w, b = _inputs(gen, torch.float32, 2, 32, 32)
    p = pack_linear_weight(w)
    onednn = _prepacked(w) if torch.backends.mkldnn.is_available() else None
    calls = [
        ("input", "dtype", (x.double(), p, b)),
        ("input", "2 dimensions", (x[None], p, b)),
        ("input", "contiguous", (torch.randn(32, 2, generator=gen).T, p, b)),
        ("weight", "same dtype", (x, p.bfloat16(), b)),
        ("weight", "packed shape", (x, p.view(4, 4, 4, 16), b)),           # K 64 != 32
        ("weight", "packed shape", (x[:, :16].contiguous(), p, b)),         # K 16 != 32
        ("weight", "multiple of 16", (x, p[:2].contiguous(), b)),            # N = 8
        ("weight", "4 dimensions", (x, w, b)),                                # not packed
        ("bias", "shape", (x, p, b[:16])),
        ("bias", "same dtype", (x, p, b.bfloat16())),
    ]
    if onednn is not None:
        calls += [("onednn_weight", "prepacked by oneDNN", (x, p, b, w, 4)),
                  ("onednn_weight", "prepacked by oneDNN",
                   (x, p, b, _prepacked(torch.randn(16, 32, generator=gen)), 4))]
    return calls


def test_errors_name_the_argument(gen):
    for arg, words, args in _bad_calls(gen):
        with pytest.raises(RuntimeError) as info:
            OP(*args)
        message = str(info.value)
        assert message.startswith(f"pagedspec.packed_linear: {arg} "), message
        assert words in message, message


def test_pack_linear_weight_rejects_what_it_cannot_pack():
    for w in (torch.zeros(8, 32), torch.zeros(16, 24), torch.zeros(16, 32, dtype=torch.float16)):
        with pytest.raises(ValueError, match="pack_linear_weight: weight must be"):
            pack_linear_weight(w)
