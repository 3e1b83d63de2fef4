"""Every CPU attention path this CPU offers against the contract's rounding-level bound.

"Computed in float32, written in query's dtype" means: the exact result (float64 here, from the
same cache contents dequantized as the contract says) rounded once to the output dtype, plus
float32 accumulation error. Per element:

    |out - exact| <= 2^-p |exact| + ACCUMULATION * max|V|

p the output dtype's significant bits (bf16 8, fp16 11, fp32 24: one rounding, to nearest, is
off by at most 2^-p relative), max|V| over the positions the row attends to. ACCUMULATION = 2^-20
(about 1e-6): float32 sums of up to 4096 terms and the kernels' exp2 stay far under it on these
cases (the worst of the FMA and dot paths, measured on Zen 4 when this was written: 2^-25.4),
while probabilities rounded to bf16 (2^-9 relative each) are off by up to ~2^-11 max|V| there,
and split into two bf16 parts still by 2^-21.8. The bound is shown to reject bf16 probabilities
below (emulated in float64, so on every CPU; and on AMX, the opt-in path that rounds them,
where this CPU has it).

The paths are forced one at a time (PAGEDSPEC_CPU_ISA, _AMX, _BF16_DOT); a path this CPU lacks
skips with a reason naming it, so the summary (-rs) says which paths ran. The shapes are those of
decode, verification (q_len 2-8, GQA groups 4 and 8), a long single sequence and FP8 caches with
per-head scales.
"""
from __future__ import annotations

import math

import pytest
import torch

import pagedspec
from pagedspec import ops, reference
from test_attention import Case

INFO = pagedspec.build_info()
ACCUMULATION = 2.0 ** -20
SIGNIFICANT_BITS = {torch.bfloat16: 8, torch.float16: 11, torch.float32: 24}


def _offers(env: dict[str, str], probe) -> bool:
    with pytest.MonkeyPatch.context() as mp:
        for name, value in env.items():
            mp.setenv(name, value)
        return bool(probe())


HAS_AVX512 = "avx512" in INFO["cpu_isa_supported"]
DOT_ENV = {"PAGEDSPEC_CPU_ISA": "avx512", "PAGEDSPEC_CPU_AMX": "0", "PAGEDSPEC_CPU_BF16_DOT": "1"}
HAS_DOT = HAS_AVX512 and _offers(DOT_ENV, pagedspec._C.cpu_bf16_dot)
HAS_AMX = HAS_AVX512 and _offers({"PAGEDSPEC_CPU_AMX": "1"}, pagedspec._C.cpu_amx)

# name -> (environment, why it may be missing or None). Every path that keeps the contract.
PATHS = {f"{level}-fma": ({"PAGEDSPEC_CPU_ISA": level, "PAGEDSPEC_CPU_AMX": "0",
                           "PAGEDSPEC_CPU_BF16_DOT": "0"},
                          None if level in INFO["cpu_isa_supported"]
                          else f"this CPU lacks the {level} instructions")
         for level in INFO["cpu_isa_levels"]}
PATHS["avx512-bf16-dot"] = (DOT_ENV, None if HAS_DOT else "this CPU has no AVX512-BF16 and VBMI")
PATHS["default"] = ({}, None)
# The opt-in path that rounds probabilities to bf16: held to its stated bound, and shown to
# break the contract's (so that the bound above is known to catch it).
BF16_WEIGHT_PATHS = {
    "avx512-amx": ({"PAGEDSPEC_CPU_ISA": "avx512", "PAGEDSPEC_CPU_AMX": "1"},
                   None if HAS_AMX else "this CPU (or OS) has no AMX-BF16"),
}
DEFAULT_ENV = ("PAGEDSPEC_CPU_ISA", "PAGEDSPEC_CPU_AMX", "PAGEDSPEC_CPU_AMX_DECODE",
               "PAGEDSPEC_CPU_BF16_DOT", "PAGEDSPEC_CPU_FP8_IMAGES")

# (name, q_lens, seq_lens, (heads, kv heads), head size, block size)
SHAPES = [
    ("decode", [1] * 6, [1, 17, 300, 700, 64, 1024], (32, 8), 128, 16),
    ("decode-d64", [1, 1, 1], [33, 513, 96], (16, 2), 64, 16),
    ("verify-g4", [2, 5, 8], [40, 300, 1100], (32, 8), 128, 16),
    ("verify-g8", [3, 8, 4], [300, 64, 777], (32, 4), 128, 8),
    ("verify-d256", [5, 2], [200, 90], (16, 4), 256, 16),
    ("long", [1], [4096], (8, 1), 128, 16),
    ("long-verify", [5], [4096], (16, 2), 128, 16),
]
DTYPES = [  # (query dtype, cache dtype)
    (torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float8_e4m3fn),
    (torch.bfloat16, torch.float8_e5m2), (torch.float16, torch.float16),
    (torch.float32, torch.float32), (torch.float32, torch.float8_e4m3fn),
]


def make_case(gen, shape, dtype, cache_dtype) -> Case:
    _, q_lens, seq_lens, heads, head_size, block_size = shape
    return Case(gen, seq_lens=seq_lens, q_lens=q_lens, num_heads=heads[0],
                num_kv_heads=heads[1], head_size=head_size, block_size=block_size, dtype=dtype,
                cache_dtype=cache_dtype, per_head_scale=True)


def exact_attention(case: Case, weight_rounding=None):
    """float64 attention on the case's cache contents (FP8 dequantized as the contract says:
    the code's value times its scale, in float32): (out [T, Hq, D] float64, max|V| [T, Hq] over
    the positions each row sees). ``weight_rounding`` (a dtype) rounds the normalized
    probabilities to it before P.V: the emulation of a path that does."""
    q_all = case.query.double()
    T, Hq, D = q_all.shape
    Hkv = case.key_cache.shape[2]
    G = Hq // Hkv
    bs = case.key_cache.shape[1]
    out = torch.empty(T, Hq, D, dtype=torch.float64)
    vmax = torch.empty(T, Hq, dtype=torch.float64)
    cu = case.cu_seqlens_q.tolist()
    for i, s in enumerate(case.seq_lens.tolist()):
        pos = torch.arange(s)
        blocks, offsets = case.block_tables[i].long()[pos // bs], pos % bs
        k = reference.dequantize_cache(case.key_cache[blocks, offsets], case.k_scale).double()
        v = reference.dequantize_cache(case.value_cache[blocks, offsets], case.v_scale).double()
        k, v = k.repeat_interleave(G, 1), v.repeat_interleave(G, 1)       # [S, Hq, D]
        q_len = cu[i + 1] - cu[i]
        for j in range(q_len):
            seen = s - q_len + j + 1
            logits = torch.einsum("hd,shd->hs", q_all[cu[i] + j], k[:seen]) * case.scale
            p = torch.softmax(logits, -1)
            if weight_rounding is not None:
                p = p.to(weight_rounding).double()
            out[cu[i] + j] = torch.einsum("hs,shd->hd", p, v[:seen])
            vmax[cu[i] + j] = v[:seen].abs().amax(dim=(0, 2))
    return out, vmax


def excess(out: torch.Tensor, exact: torch.Tensor, vmax: torch.Tensor, dtype) -> float:
    """The largest error over the bound's accumulation term, in units of max|V| (the bound holds
    where this is at most ACCUMULATION)."""
    rounding = 2.0 ** -SIGNIFICANT_BITS[dtype] * exact.abs()
    return ((out.double() - exact).abs() - rounding).div(vmax[..., None]).max().item()


def run_path(monkeypatch, env, case, fn=ops.paged_attention):
    for name in DEFAULT_ENV:
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    out, _, _ = case.run(fn)
    return out


@pytest.mark.parametrize("dtypes", DTYPES, ids=lambda d: f"{d[0]}-{d[1]}".replace("torch.", ""))
@pytest.mark.parametrize("shape", SHAPES, ids=[s[0] for s in SHAPES])
@pytest.mark.parametrize("path", list(PATHS))
def test_path_within_rounding_bound(gen, monkeypatch, path, shape, dtypes):
    env, missing = PATHS[path]
    if missing:
        pytest.skip(f"{path}: {missing}")
    dtype, cache_dtype = dtypes
    case = make_case(gen, shape, dtype, cache_dtype)
    out = run_path(monkeypatch, env, case)
    exact, vmax = exact_attention(case)
    worst = excess(out, exact, vmax, dtype)
    assert worst <= ACCUMULATION, (
        f"{path}: error {worst:.3g} max|V| beyond rounding to {dtype}, bound {ACCUMULATION:.3g}")


@pytest.mark.parametrize("shape", [s for s in SHAPES if s[0] in ("verify-g4", "long")],
                         ids=["verify-g4", "long"])
def test_bound_rejects_bf16_probabilities(gen, shape):
    """Power: probabilities rounded to bf16 before P.V (what the opt-in paths do), emulated in
    float64, break the bound on bf16 outputs; exact probabilities, rounded once, keep it."""
    case = make_case(gen, shape, torch.bfloat16, torch.bfloat16)
    exact, vmax = exact_attention(case)
    assert excess(exact.to(torch.bfloat16), exact, vmax, torch.bfloat16) <= 0
    rounded, _ = exact_attention(case, weight_rounding=torch.bfloat16)
    assert excess(rounded.to(torch.bfloat16), exact, vmax, torch.bfloat16) > 4 * ACCUMULATION


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=str)
@pytest.mark.parametrize("path", list(BF16_WEIGHT_PATHS))
def test_bf16_weight_paths_keep_their_stated_bound(gen, monkeypatch, path, cache_dtype):
    """The opt-in path that rounds probabilities to bf16 (AMX, CONTRACT.md#ext-bf16-paths): each
    weight off by up to 2^-9 relative, so out off by up to 2^-9 max|V| beyond the contract's
    bound, and not within it: it does break the contract's bound (the dot path's P.V did the
    same before it moved to float32 probabilities)."""
    env, missing = BF16_WEIGHT_PATHS[path]
    if missing:
        pytest.skip(f"{path}: {missing}")
    case = make_case(gen, SHAPES[2], torch.bfloat16, cache_dtype)
    out = run_path(monkeypatch, env, case)
    exact, vmax = exact_attention(case)
    worst = excess(out, exact, vmax, torch.bfloat16)
    assert ACCUMULATION < worst <= 2.0 ** -9 + ACCUMULATION


def test_default_configuration_keeps_the_contract(monkeypatch):
    """Whatever this CPU's default resolves to (build_info()["cpu"]), it takes no path that
    rounds probabilities to bf16, and it is among the paths held to the bound above."""
    for name in DEFAULT_ENV:
        monkeypatch.delenv(name, raising=False)
    cpu = pagedspec.build_info()["cpu"]
    assert not cpu["amx"]
    assert cpu["bf16_dot"] == HAS_DOT
    print(f"default CPU configuration here: {cpu}")
