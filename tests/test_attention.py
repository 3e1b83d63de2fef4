"""Paged attention v1 / v2 / dispatcher against the pure-PyTorch reference (itself checked against
scaled_dot_product_attention on contiguous K/V).

Every case uses shuffled block ids, NaN (or NaN codes) in every slot a sequence does not own and
in unused blocks, and fresh random data. Tolerances follow the output precision: the kernel and
the reference both compute in float32 and differ only in summation order (~1e-6 relative), so a
result is off by at most about one unit in the last place of the output dtype:
float32 1e-5, float16 2e-3 (2^-9 ulp in [1, 2) plus margin), bfloat16 1.6e-2 (2^-7 ulp in [1, 2)
plus margin). The same inputs (FP8 codes included) go to both sides, so FP8 caches need no extra
tolerance: the reference dequantizes exactly as the contract says.
"""
from __future__ import annotations

import math
import os

import pytest
import torch
import torch.nn.functional as F

import pagedspec  # noqa: F401
from pagedspec import ops, reference
from conftest import DEVICES, requires_cuda

FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
VARIANTS = {
    "v1": ops.paged_attention_v1,
    "v2": ops.paged_attention_v2,
    "auto": ops.paged_attention,
}


class Case:
    """A paged-attention problem: query, paged caches (NaN outside every sequence), block tables
    with shuffled block ids, seq lens and cu_seqlens_q."""

    def __init__(self, gen, *, seq_lens, q_lens, num_heads=8, num_kv_heads=2, head_size=64,
                 block_size=16, dtype=torch.float32, cache_dtype=None, per_head_scale=False,
                 spare_blocks=3, device="cpu", shared_prefix_blocks=0):
        cache_dtype = cache_dtype or dtype
        self.dtype, self.cache_dtype = dtype, cache_dtype
        assert len(seq_lens) == len(q_lens)
        num_seqs = len(seq_lens)
        max_blocks = max(1, max(math.ceil(s / block_size) for s in seq_lens))
        num_blocks = num_seqs * max_blocks + spare_blocks
        shape = (num_blocks, block_size, num_kv_heads, head_size)
        k = torch.randn(shape, generator=gen)
        v = torch.randn(shape, generator=gen)
        self.k_scale = self.v_scale = None
        if cache_dtype in FP8:
            if per_head_scale:
                self.k_scale = torch.rand(num_kv_heads, generator=gen) * 0.5 + 0.01
                self.v_scale = torch.rand(num_kv_heads, generator=gen) * 0.5 + 0.01
            else:
                self.k_scale = torch.tensor(0.02)
                self.v_scale = torch.tensor(0.03)
            key_cache = torch.empty(shape, dtype=cache_dtype)
            value_cache = torch.empty(shape, dtype=cache_dtype)
            reference.quantize_fp8(key_cache, k, self.k_scale)
            reference.quantize_fp8(value_cache, v, self.v_scale)
        else:
            key_cache, value_cache = k.to(cache_dtype), v.to(cache_dtype)
        perm = torch.randperm(num_blocks, generator=gen)
        tables = perm[: num_seqs * max_blocks].view(num_seqs, max_blocks).clone()
        if shared_prefix_blocks:  # every sequence starts with sequence 0's first blocks
            tables[:, :shared_prefix_blocks] = tables[0, :shared_prefix_blocks]
        # Poison every slot no sequence owns: unused blocks and the tails of last blocks.
        owned = torch.zeros(num_blocks * block_size, dtype=torch.bool)
        for i, s in enumerate(seq_lens):
            pos = torch.arange(s)
            owned[tables[i][pos // block_size] * block_size + pos % block_size] = True
        for cache in (key_cache, value_cache):
            flat = cache.view(num_blocks * block_size, num_kv_heads, head_size)
            if cache_dtype in FP8:
                flat.view(torch.uint8)[~owned] = 0x7F  # NaN in both FP8 formats
            else:
                flat[~owned] = float("nan")
        q = torch.randn(sum(q_lens), num_heads, head_size, generator=gen)
        cu = [0]
        for n in q_lens:
            cu.append(cu[-1] + n)
        self.device = device
        self.query = q.to(dtype).to(device)
        self.key_cache = key_cache.to(device)
        self.value_cache = value_cache.to(device)
        self.block_tables = tables.int().to(device)
        self.seq_lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
        self.cu_seqlens_q = torch.tensor(cu, dtype=torch.int32, device=device)
        self.max_q_len = max(q_lens) if q_lens else 0
        self.scale = head_size ** -0.5
        if self.k_scale is not None:
            self.k_scale, self.v_scale = self.k_scale.to(device), self.v_scale.to(device)
        self.num_slots = num_blocks * block_size

    def run(self, fn, *, lse=False, mass=False, out=None):
        out = torch.full_like(self.query, float("nan")) if out is None else out
        lse_t = (torch.full(self.query.shape[:2], float("nan"), device=self.device)
                 if lse else None)
        mass_t = torch.zeros(self.num_slots, device=self.device) if mass else None
        fn(out, self.query, self.key_cache, self.value_cache, self.block_tables, self.seq_lens,
           self.cu_seqlens_q, self.max_q_len, self.scale, self.k_scale, self.v_scale, lse_t,
           mass_t)
        return out, lse_t, mass_t

    def args(self):
        return (self.query, self.key_cache, self.value_cache, self.block_tables, self.seq_lens,
                self.cu_seqlens_q, self.max_q_len, self.scale, self.k_scale, self.v_scale)

    def expected(self, *, lse=False, mass=False):
        cpu = lambda t: None if t is None else t.cpu()  # noqa: E731
        q = self.query.cpu()
        out = torch.empty_like(q)
        lse_t = torch.empty(q.shape[:2]) if lse else None
        mass_t = torch.zeros(self.num_slots) if mass else None
        reference.paged_attention(out, q, self.key_cache.cpu(), self.value_cache.cpu(),
                                  self.block_tables.cpu(), self.seq_lens.cpu(),
                                  self.cu_seqlens_q.cpu(), self.max_q_len, self.scale,
                                  cpu(self.k_scale), cpu(self.v_scale), lse_t, mass_t)
        return out, lse_t, mass_t


def assert_close(actual, expected, dtype, what="out"):
    tol = TOL[dtype]
    assert not torch.isnan(actual).any(), f"{what} has NaN"
    torch.testing.assert_close(actual.cpu().float(), expected.float(), rtol=tol, atol=tol,
                               msg=lambda m: f"{what}: {m}")


def check_case(case: Case, fn, *, lse=True, mass=False):
    out, lse_t, mass_t = case.run(fn, lse=lse, mass=mass)
    want_out, want_lse, want_mass = case.expected(lse=lse, mass=mass)
    assert_close(out, want_out, case.dtype)
    if lse:
        # float32 on both sides over the same float32 logits.
        torch.testing.assert_close(lse_t.cpu(), want_lse, rtol=2e-5, atol=2e-5)
    if mass:
        torch.testing.assert_close(mass_t.cpu(), want_mass, rtol=1e-4, atol=1e-5)


# ------------------------------------------------------------------------------------------
# The reference is the spec: check it against SDPA on contiguous K/V.


@pytest.mark.parametrize("q_len, group", [(1, 1), (5, 4), (3, 8)])
def test_reference_matches_sdpa(gen, q_len, group):
    num_kv_heads, head_size, seq_len = 2, 64, 45
    case = Case(gen, seq_lens=[seq_len, 17], q_lens=[q_len, 1], num_heads=num_kv_heads * group,
                num_kv_heads=num_kv_heads, head_size=head_size, block_size=8)
    out, lse, _ = case.expected(lse=True)
    # Contiguous K/V of sequence 0, straight from the cache through its block table.
    pos = torch.arange(seq_len)
    slots = case.block_tables[0].long()[pos // 8] * 8 + pos % 8
    k = case.key_cache.view(-1, num_kv_heads, head_size)[slots].double()
    v = case.value_cache.view(-1, num_kv_heads, head_size)[slots].double()
    q = case.query[:q_len].double()
    k = k.repeat_interleave(group, 1).transpose(0, 1)  # [Hq, S, D]
    v = v.repeat_interleave(group, 1).transpose(0, 1)
    visible = pos[None, :] <= (seq_len - q_len + torch.arange(q_len))[:, None]  # [L, S]
    want = F.scaled_dot_product_attention(q.transpose(0, 1), k, v, attn_mask=visible,
                                          scale=case.scale).transpose(0, 1)
    torch.testing.assert_close(out[:q_len].double(), want, rtol=1e-5, atol=1e-5)
    logits = torch.einsum("lhd,hsd->hls", q, k) * case.scale
    want_lse = logits.masked_fill(~visible, float("-inf")).logsumexp(-1).transpose(0, 1)
    torch.testing.assert_close(lse[:q_len].double(), want_lse, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------------------
# Kernels against the reference. Each row covers several axes at once; together they cover every
# dtype, cache format, head size, block size, GQA ratio (1, 4, 8) and q_len (1, 2, 5), with
# seq lens of 1, block boundaries and a few hundred tokens.

GRID = [
    # dtype, cache dtype, head size, block size, (heads, kv heads), q_lens, seq_lens
    (torch.float32, None, 64, 16, (8, 2), [1, 2, 5], [1, 16, 300]),
    (torch.float16, None, 128, 8, (8, 8), [1, 1, 1], [8, 9, 77]),
    (torch.bfloat16, None, 256, 32, (8, 1), [2, 5, 1], [33, 64, 5]),
    (torch.float16, None, 80, 16, (16, 2), [1, 5, 2], [17, 31, 600]),
    (torch.float16, None, 96, 64, (4, 1), [5, 1, 1], [64, 65, 130]),
    (torch.bfloat16, None, 112, 32, (32, 8), [1, 2, 1], [2, 95, 257]),
    (torch.bfloat16, None, 128, 16, (32, 8), [5, 5, 5], [5, 48, 513]),
    (torch.bfloat16, None, 64, 8, (8, 1), [1, 1, 2], [1, 7, 1030]),
    (torch.float16, torch.float8_e4m3fn, 128, 16, (32, 8), [1, 5, 2], [1, 100, 700]),
    (torch.bfloat16, torch.float8_e4m3fn, 64, 32, (8, 1), [2, 1, 5], [40, 31, 96]),
    (torch.bfloat16, torch.float8_e5m2, 96, 8, (8, 2), [1, 2, 5], [11, 16, 333]),
    (torch.float16, torch.float8_e5m2, 256, 64, (4, 4), [5, 1, 1], [130, 1, 64]),
    (torch.float16, torch.float8_e5m2, 112, 16, (16, 2), [1, 1, 5], [15, 16, 17]),
    (torch.float32, torch.float8_e4m3fn, 80, 8, (8, 1), [1, 2, 1], [9, 2, 150]),
]


def _grid_id(row):
    dtype, cache, d, bs, (hq, hkv), q_lens, _ = row
    cache_name = "native" if cache is None else str(cache).removeprefix("torch.float8_")
    return (f"{str(dtype).removeprefix('torch.')}-{cache_name}-D{d}-BS{bs}-G{hq // hkv}"
            f"-q{max(q_lens)}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("row", GRID, ids=[_grid_id(r) for r in GRID])
def test_matches_reference(gen, device, variant, row):
    dtype, cache_dtype, head_size, block_size, (hq, hkv), q_lens, seq_lens = row
    if device == "cuda" and dtype == torch.float32:
        pytest.skip("float32 queries are CPU-only")
    case = Case(gen, seq_lens=seq_lens, q_lens=q_lens, num_heads=hq, num_kv_heads=hkv,
                head_size=head_size, block_size=block_size, dtype=dtype, cache_dtype=cache_dtype,
                per_head_scale=(head_size % 32 == 0), device=device)
    check_case(case, VARIANTS[variant], lse=True, mass=(variant == "v1"))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("q_len", [1, 5])
def test_long_context(gen, device, q_len):
    # ~16k tokens: many v2 partitions and a v1 pass far longer than any shared-memory budget.
    case = Case(gen, seq_lens=[16_000 + q_len, 3000], q_lens=[q_len, 1], num_heads=8,
                num_kv_heads=2, head_size=128, block_size=32, dtype=torch.bfloat16,
                device=device)
    want, want_lse, _ = case.expected(lse=True)
    for fn in VARIANTS.values():
        out, lse, _ = case.run(fn, lse=True)
        assert_close(out, want, torch.bfloat16)
        torch.testing.assert_close(lse.cpu(), want_lse, rtol=2e-5, atol=2e-5)


@pytest.mark.slow
@pytest.mark.parametrize("device", DEVICES)
def test_very_long_context(gen, device):
    case = Case(gen, seq_lens=[131_072], q_lens=[2], num_heads=4, num_kv_heads=1, head_size=64,
                block_size=64, dtype=torch.float16, device=device)
    want, _, _ = case.expected()
    for fn in (ops.paged_attention_v1, ops.paged_attention_v2):
        assert_close(case.run(fn)[0], want, torch.float16)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype, cache_dtype", [(torch.float16, None),
                                                (torch.bfloat16, torch.float8_e4m3fn)])
def test_v1_equals_v2(gen, device, dtype, cache_dtype):
    # Contexts straddling partition boundaries (512) and query tokens on both sides of one.
    case = Case(gen, seq_lens=[511, 512, 513, 1030, 1536], q_lens=[1, 2, 5, 3, 1], num_heads=8,
                num_kv_heads=2, head_size=64, block_size=16, dtype=dtype, cache_dtype=cache_dtype,
                device=device)
    out1, lse1, mass1 = case.run(ops.paged_attention_v1, lse=True, mass=True)
    out2, lse2, mass2 = case.run(ops.paged_attention_v2, lse=True, mass=True)
    assert_close(out1, out2.cpu(), dtype)
    torch.testing.assert_close(lse1, lse2, rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(mass1, mass2, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("cache_dtype", FP8)
@pytest.mark.parametrize("scale", [0.37, 3.0, 1e-3])
def test_fp8_decode_is_exact(device, cache_dtype, scale):
    # 256 one-position sequences, sequence c's V row holding code c: the output is that value,
    # which must be exactly stored * scale (NaN codes stay NaN, e5m2 infinities stay infinite).
    n, head_size = 256, 64
    codes = torch.arange(n, dtype=torch.uint8)
    key_cache = torch.zeros(n, 1, 1, head_size, dtype=torch.uint8).view(cache_dtype)
    value_cache = codes.view(n, 1, 1, 1).expand(n, 1, 1, head_size).contiguous().view(cache_dtype)
    scale_t = torch.tensor(scale)
    query = torch.randn(n, 1, head_size).half()
    want = (codes.view(cache_dtype).float() * scale_t).half()
    args = [query, key_cache, value_cache, torch.arange(n, dtype=torch.int32).view(n, 1),
            torch.ones(n, dtype=torch.int32), torch.arange(n + 1, dtype=torch.int32), 1, 1.0,
            scale_t, scale_t]
    args = [a.to(device) if isinstance(a, torch.Tensor) else a for a in args]
    for fn in (ops.paged_attention_v1, ops.paged_attention_v2):
        out = torch.empty_like(args[0])
        fn(out, *args)
        got = out.cpu()[:, 0, :]
        assert torch.equal(torch.isnan(got), torch.isnan(want)[:, None].expand_as(got))
        finite = ~torch.isnan(want)
        assert torch.equal(got[finite], want[finite, None].expand(-1, head_size))


# ------------------------------------------------------------------------------------------
# attn_mass, lse, layouts, edge cases


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("variant", ["v1", "v2"])
def test_attn_mass_total_and_accumulation(gen, device, variant):
    case = Case(gen, seq_lens=[1, 40, 700], q_lens=[1, 5, 2], num_heads=8, num_kv_heads=2,
                head_size=64, block_size=16, dtype=torch.float16, device=device)
    _, _, mass = case.run(VARIANTS[variant], mass=True)
    # Each query token spreads exactly one unit of probability per head.
    num_tokens, num_heads = case.query.shape[:2]
    assert abs(mass.sum().item() - num_tokens * num_heads) < 1e-3
    assert (mass >= 0).all()
    # It accumulates into what is there, and only on slots that were read.
    start = torch.rand(case.num_slots, generator=gen).to(device)
    again = start.clone()
    VARIANTS[variant](torch.empty_like(case.query), *case.args(), None, again)
    torch.testing.assert_close(again - start, mass, rtol=1e-4, atol=1e-5)
    _, _, want = case.expected(mass=True)
    torch.testing.assert_close(mass.cpu(), want, rtol=1e-4, atol=1e-5)
    assert (want[mass.cpu() == 0] == 0).all()


@pytest.mark.parametrize("device", DEVICES)
def test_attn_mass_shared_prefix(gen, device):
    # Three sequences share their first two blocks (prefix caching): their mass adds up there.
    case = Case(gen, seq_lens=[40, 35, 64], q_lens=[1, 2, 1], num_heads=8, num_kv_heads=2,
                head_size=64, block_size=16, dtype=torch.float16, device=device,
                shared_prefix_blocks=2)
    _, _, mass = case.run(ops.paged_attention, mass=True)
    _, _, want = case.expected(mass=True)
    torch.testing.assert_close(mass.cpu(), want, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("device", DEVICES)
def test_strided_query_and_out(gen, device):
    # query / out as head-major views of wider rows (e.g. a fused QKV projection).
    case = Case(gen, seq_lens=[30, 70], q_lens=[2, 1], num_heads=4, num_kv_heads=2,
                head_size=64, block_size=16, dtype=torch.float16, device=device)
    wide = torch.randn(3, 6, 64, generator=gen).half().to(device)
    wide[:, :4] = case.query
    case.query = wide[:, :4]
    out_wide = torch.full((3, 5, 64), 7.0, dtype=torch.float16, device=device)
    out = out_wide[:, 1:]
    case.run(ops.paged_attention_v1, out=out)
    want, _, _ = case.expected()
    assert_close(out, want, torch.float16)
    assert (out_wide[:, 0] == 7.0).all()


@pytest.mark.parametrize("device", DEVICES)
def test_empty_query_ranges(gen, device):
    # A sequence with q_len 0 (nothing to compute) between two real ones; no tokens at all.
    case = Case(gen, seq_lens=[20, 33, 9], q_lens=[2, 0, 1], num_heads=4, num_kv_heads=4,
                head_size=64, block_size=8, dtype=torch.float16, device=device)
    check_case(case, ops.paged_attention, mass=True)
    empty = Case(gen, seq_lens=[5], q_lens=[0], head_size=64, dtype=torch.float16, device=device)
    out, _, mass = empty.run(ops.paged_attention_v2, mass=True)
    assert out.numel() == 0 and (mass == 0).all()


@pytest.mark.parametrize("device", DEVICES)
def test_inf_and_nan_in_unused_slots(gen, device):
    # Beyond NaN, +-inf and huge values in unused slots must not leak either.
    case = Case(gen, seq_lens=[3, 21], q_lens=[1, 2], num_heads=4, num_kv_heads=1,
                head_size=64, block_size=16, dtype=torch.float16, device=device)
    for cache in (case.key_cache, case.value_cache):
        flat = cache.view(-1, 1, 64)
        bad = torch.isnan(flat)
        flat[bad] = torch.tensor([float("inf"), float("-inf"), 6e4], dtype=flat.dtype,
                                 device=device).repeat(bad.sum().item() // 3 + 1)[: bad.sum().item()]
    check_case(case, ops.paged_attention_v2, mass=True)


ISOLATION_FNS = {**VARIANTS, "reference": reference.paged_attention}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fn", list(ISOLATION_FNS))
@pytest.mark.parametrize("num_heads, num_kv_heads, q_len", [(2, 1, 2), (4, 4, 3), (8, 1, 9),
                                                            (16, 2, 5)])
@pytest.mark.parametrize("poison", ["k_inf", "v_inf", "v_nan", "k_nan"])
# bf16 queries: with the opt-in bf16 paths, the CPU's AMX and dot paths (on the bf16 cache, and
# on FP8 caches through their images).
@pytest.mark.parametrize("dtype, cache_dtype", [(torch.float16, None), (torch.bfloat16, None),
                                                (torch.bfloat16, FP8[0]), (torch.bfloat16, FP8[1])],
                         ids=["fp16", "bf16", "bf16-e4m3", "bf16-e5m2"])
@pytest.mark.parametrize("bf16_paths", ["default", "opt-in"])
def test_isolation_from_later_draft_tokens(gen, monkeypatch, device, fn, num_heads, num_kv_heads,
                                           q_len, poison, dtype, cache_dtype, bf16_paths):
    # The contract's Isolation: a token's out, lse and mass do not depend on positions past its
    # causal limit. Poison the K or V of the last query token of each sequence (a later draft
    # token) and every earlier token must give bit-identical results to the clean run. The
    # 1100-token sequence spans three v2 partitions; row chunks then hold tokens whose limits
    # differ (the shapes where a zero-weight multiply would turn an inf into NaN).
    if fn == "reference" and device != "cpu":
        pytest.skip("the reference runs on CPU tensors here")
    if bf16_paths == "opt-in":
        monkeypatch.setenv("PAGEDSPEC_CPU_AMX", "1")
        monkeypatch.setenv("PAGEDSPEC_CPU_BF16_DOT", "1")
        if fn == "reference" or device != "cpu" or dtype != torch.bfloat16 or not (
                pagedspec._C.cpu_amx() or pagedspec._C.cpu_bf16_dot()):
            pytest.skip("the opt-in bf16 paths: CPU kernels, bf16 queries, AMX or AVX512-BF16")
    case = Case(gen, seq_lens=[37, 1100, q_len], q_lens=[q_len, q_len, q_len],
                num_heads=num_heads, num_kv_heads=num_kv_heads, head_size=64, block_size=16,
                dtype=dtype, cache_dtype=cache_dtype, device=device)
    run = ISOLATION_FNS[fn]
    clean_out, clean_lse, clean_mass = case.run(run, lse=True, mass=True)
    cache = case.key_cache if poison.startswith("k") else case.value_cache
    bad = float("inf") if poison.endswith("inf") else float("nan")
    seq_lens = case.seq_lens.tolist()
    last_slots = []
    for i, s in enumerate(seq_lens):
        p = s - 1
        slot = int(case.block_tables[i, p // 16]) * 16 + p % 16
        cache.view(-1, num_kv_heads, 64)[slot] = bad
        last_slots.append(slot)
    out, lse_t, mass_t = case.run(run, lse=True, mass=True)
    earlier = torch.ones(case.query.shape[0], dtype=torch.bool)
    earlier[case.cu_seqlens_q[1:].long().cpu() - 1] = False  # the poisoned tokens themselves
    assert not torch.isnan(out[earlier]).any() and not torch.isnan(lse_t[earlier]).any()
    assert torch.equal(out[earlier], clean_out[earlier])
    assert torch.equal(lse_t[earlier], clean_lse[earlier])
    if poison.startswith("v"):
        # V does not enter the mass at all; CUDA adds it with atomics (low bits vary run to run).
        if device == "cpu":
            assert torch.equal(mass_t, clean_mass)
        else:
            torch.testing.assert_close(mass_t, clean_mass, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("seq_lens", [[4000], [300] * 40])
def test_dispatcher_agrees_with_v1_and_v2(gen, device, seq_lens):
    # One long sequence (the dispatcher's v2 side) and many short ones (its v1 side).
    case = Case(gen, seq_lens=seq_lens, q_lens=[1] * len(seq_lens), num_heads=4, num_kv_heads=1,
                head_size=64, block_size=16, dtype=torch.float16, device=device)
    out, lse, _ = case.run(ops.paged_attention, lse=True)
    for fn in (ops.paged_attention_v1, ops.paged_attention_v2):
        other, other_lse, _ = case.run(fn, lse=True)
        assert_close(out, other.cpu(), torch.float16)
        torch.testing.assert_close(lse, other_lse, rtol=2e-5, atol=2e-5)


# ------------------------------------------------------------------------------------------
# opcheck and bad inputs


# test_schema compares tensors with arithmetic torch lacks for FP8 dtypes (see test_fp8.py), so
# FP8 caches run the other checks only.
OPCHECK = ("test_schema", "test_faketensor", "test_autograd_registration")
OPCHECK_FP8 = ("test_faketensor", "test_autograd_registration")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("cache_dtype", [None, torch.float8_e4m3fn])
@pytest.mark.parametrize("name", ["paged_attention_v1", "paged_attention_v2", "paged_attention"])
def test_opcheck(gen, device, name, cache_dtype):
    case = Case(gen, seq_lens=[9, 40], q_lens=[1, 3], num_heads=4, num_kv_heads=2,
                head_size=64, block_size=8, dtype=torch.float16, cache_dtype=cache_dtype,
                device=device)
    out = torch.empty_like(case.query)
    lse = torch.empty(case.query.shape[:2], device=device)
    mass = torch.zeros(case.num_slots, device=device)
    torch.library.opcheck(getattr(torch.ops.pagedspec, name).default,
                          (out, *case.args(), lse, mass),
                          test_utils=OPCHECK if cache_dtype is None else OPCHECK_FP8)


def _bad(gen, **changes):
    case = Case(gen, seq_lens=[10, 20], q_lens=[1, 2], num_heads=4, num_kv_heads=2,
                head_size=64, block_size=8, dtype=torch.float16)
    args = dict(out=torch.empty_like(case.query), query=case.query, key_cache=case.key_cache,
                value_cache=case.value_cache, block_tables=case.block_tables,
                seq_lens=case.seq_lens, cu_seqlens_q=case.cu_seqlens_q,
                max_q_len=case.max_q_len, scale=case.scale, k_scale=None, v_scale=None, lse=None,
                attn_mass=None)
    for key, value in changes.items():
        args[key] = value(args) if callable(value) else value
    return args


BAD = [
    ("heads not divisible", dict(query=lambda a: torch.randn(3, 3, 64).half(),
                                 out=lambda a: torch.empty(3, 3, 64).half()), "num_heads"),
    ("seq_len beyond table", dict(seq_lens=torch.tensor([10, 40], dtype=torch.int32)),
     "beyond the block table"),
    ("cache dtype", dict(key_cache=lambda a: a["key_cache"].float(),
                         value_cache=lambda a: a["value_cache"].float()), "key_cache"),
    ("value dtype", dict(value_cache=lambda a: a["value_cache"].bfloat16()), "value_cache"),
    ("out dtype", dict(out=lambda a: a["out"].float()), "out"),
    ("query dtype", dict(query=lambda a: a["query"].double(), out=lambda a: a["out"].double()),
     "query"),
    ("head size", dict(query=lambda a: torch.randn(3, 4, 32).half(),
                       out=lambda a: torch.empty(3, 4, 32).half(),
                       key_cache=lambda a: a["key_cache"][..., :32].contiguous(),
                       value_cache=lambda a: a["value_cache"][..., :32].contiguous()),
     "head_size"),
    ("block size", dict(key_cache=lambda a: a["key_cache"][:, :6].contiguous(),
                        value_cache=lambda a: a["value_cache"][:, :6].contiguous()),
     "block_size"),
    ("block id", dict(block_tables=lambda a: a["block_tables"].clone().fill_(10_000)),
     "block_tables"),
    ("q_len > seq_len", dict(seq_lens=torch.tensor([10, 1], dtype=torch.int32)), "seq_lens"),
    ("cu_seqlens end", dict(cu_seqlens_q=torch.tensor([0, 1, 2], dtype=torch.int32)),
     "cu_seqlens_q"),
    ("cu_seqlens decreasing", dict(cu_seqlens_q=torch.tensor([0, 4, 3], dtype=torch.int32),
                                   max_q_len=4), "non-decreasing"),
    ("max_q_len too small", dict(max_q_len=1), "max_q_len"),
    ("seq_lens dtype", dict(seq_lens=lambda a: a["seq_lens"].long()), "seq_lens"),
    ("block_tables rows", dict(block_tables=lambda a: a["block_tables"][:1]), "block_tables"),
    ("lse shape", dict(lse=torch.empty(3, 5)), "lse"),
    ("attn_mass shape", dict(attn_mass=torch.zeros(7)), "attn_mass"),
    ("k_scale shape", dict(key_cache=lambda a: a["key_cache"].to(torch.float8_e4m3fn),
                           value_cache=lambda a: a["value_cache"].to(torch.float8_e4m3fn),
                           k_scale=torch.ones(3)), "k_scale"),
    # A decreasing step that also makes q_len 0 -> 4 look too long: cu_seqlens_q is to blame.
    ("cu_seqlens decreasing, long step", dict(cu_seqlens_q=torch.tensor([0, 4, 3],
                                                                      dtype=torch.int32)),
     "cu_seqlens_q must be non-decreasing"),
    ("scale zero", dict(scale=0.0), "scale must be finite and > 0, got 0"),
    ("scale nan", dict(scale=float("nan")), "scale must be finite and > 0, got nan"),
    ("scale inf", dict(scale=float("inf")), "scale must be finite and > 0"),
    ("scale negative", dict(scale=-0.125), "scale must be finite and > 0"),
    ("out rows overlap", dict(out=lambda a: torch.zeros(1, 4, 64).half().expand(3, 4, 64)),
     "out must not overlap itself"),
    ("out heads overlap", dict(out=lambda a: torch.zeros(3 * 64 + 64).half()
                               .as_strided((3, 4, 64), (64, 16, 1))),
     "out must not overlap itself"),
    ("out is query", dict(out=lambda a: a["query"]), "out must not share memory with query"),
    ("out inside key_cache", dict(out=lambda a: a["key_cache"].view(-1, 4, 64)[:3]),
     "out must not share memory with key_cache"),
    ("lse is attn_mass", dict(attn_mass=torch.zeros(72),
                              lse=lambda a: a["attn_mass"][:12].view(3, 4)),
     "lse must not share memory with attn_mass"),
    ("num_tokens x num_heads overflow",
     dict(query=lambda a: torch.zeros(1, 1, 64).half().expand(3, 1 << 30, 64),
          out=lambda a: torch.zeros(1, 1, 64).half().expand(3, 1 << 30, 64)),
     "must fit in int32"),
]


@pytest.mark.cuda
@requires_cuda
def test_float32_query_is_cpu_only(gen):
    case = Case(gen, seq_lens=[10], q_lens=[1], num_heads=4, num_kv_heads=2, head_size=64,
                block_size=8, dtype=torch.float32, device="cuda")
    with pytest.raises(RuntimeError, match="query must have dtype in {Half, BFloat16}"):
        case.run(ops.paged_attention)


@pytest.mark.parametrize("name", ["paged_attention_v1", "paged_attention_v2", "paged_attention"])
@pytest.mark.parametrize("what, changes, match", BAD, ids=[b[0] for b in BAD])
def test_bad_inputs(gen, name, what, changes, match):
    args = _bad(gen, **changes)
    with pytest.raises(RuntimeError, match=match):
        getattr(ops, name)(**args)


@pytest.mark.cuda
@requires_cuda
@pytest.mark.skipif(os.environ.get("PAGEDSPEC_DEBUG") == "1",
                    reason="checks these unchecked inputs would fail with PAGEDSPEC_DEBUG=1")
@pytest.mark.parametrize("fn", list(VARIANTS.values()), ids=list(VARIANTS))
def test_unchecked_cuda_inputs_still_define_every_output(gen, fn):
    # Without PAGEDSPEC_DEBUG the CUDA launchers do not read the index tensors; every element of
    # out and lse is still written: rows no sequence owns (cu_seqlens_q[B] < T) and rows that
    # see nothing (seq_len 0 below q_len 1) get 0 and lse -inf; the rest match the reference.
    case = Case(gen, seq_lens=[40, 9], q_lens=[2, 1], num_heads=4, num_kv_heads=2,
                head_size=64, block_size=16, dtype=torch.float16, device="cuda")
    want, want_lse, _ = case.expected(lse=True)
    case.seq_lens = torch.tensor([40, 0], dtype=torch.int32, device="cuda")  # row 2 sees nothing
    out, lse, _ = case.run(fn, lse=True)
    assert_close(out[:2], want[:2], torch.float16)
    assert (out[2] == 0).all() and (lse[2] == float("-inf")).all()
    case.seq_lens = torch.tensor([40, 9], dtype=torch.int32, device="cuda")
    case.cu_seqlens_q = torch.tensor([0, 2, 2], dtype=torch.int32, device="cuda")  # 2 unowned
    out, lse, _ = case.run(fn, lse=True)
    assert_close(out[:2], want[:2], torch.float16)
    assert (out[2] == 0).all() and (lse[2] == float("-inf")).all()


# ------------------------------------------------------------------------------------------
# Rows whose softmax is undefined and logits near the float32 limit (CONTRACT.md, paged_attention's
# extensions: "Undefined rows" and attn_mass). The kernels decide both in their epilogue and split
# merge, whatever a path's inner loops make of NaN or inf scores, so every case runs v1 (one pass),
# v2 and the dispatcher (split sequences, merged), and tests/test_cpu_isa.py runs them at every
# CPU level.

# id (the path the case takes at the avx2 level), dtype, cache dtype, head size, (heads, kv heads),
# q_lens, seq_lens. The long sequences are split by v2 and the dispatcher. At avx2 an FP8 task of
# more than 10 rows reads its tiles as bf16 images, of up to 10 converts codes in registers.
EDGE_CASES = [
    ("f32-decode-G4", torch.float32, None, 128, (8, 2), [1, 1, 1], [5, 700, 1100]),
    ("bf16-verify-G4", torch.bfloat16, None, 64, (32, 8), [5, 1, 3], [40, 600, 17]),
    ("f16-e5m2-codes-G8", torch.float16, torch.float8_e5m2, 128, (16, 2), [1, 1, 1], [9, 700, 33]),
    ("bf16-e4m3-images-verify", torch.bfloat16, torch.float8_e4m3fn, 128, (32, 8), [5, 4, 1],
     [30, 800, 64]),
]
EDGE_IDS = [c[0] for c in EDGE_CASES]


def edge_case(gen, row, device="cpu") -> Case:
    _, dtype, cache_dtype, head_size, (hq, hkv), q_lens, seq_lens = row
    if device == "cuda" and dtype == torch.float32:
        pytest.skip("float32 queries are CPU-only")
    return Case(gen, seq_lens=seq_lens, q_lens=q_lens, num_heads=hq, num_kv_heads=hkv,
                head_size=head_size, block_size=16, dtype=dtype, cache_dtype=cache_dtype,
                per_head_scale=True, device=device)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[a.element_size()]
    return torch.equal(a.cpu().contiguous().view(ints), b.cpu().contiguous().view(ints))


def seen_slots(case: Case, token: int) -> torch.Tensor:
    """The cache slots query token `token` attends to."""
    cu = case.cu_seqlens_q.tolist()
    seq = next(i for i in range(len(cu) - 1) if cu[i] <= token < cu[i + 1])
    q_len = cu[seq + 1] - cu[seq]
    pos = torch.arange(int(case.seq_lens[seq]) - q_len + token - cu[seq] + 1)
    block_size = case.key_cache.shape[1]
    return case.block_tables[seq].cpu().long()[pos // block_size] * block_size + pos % block_size


def nan_rows_of(gen, case: Case) -> list:
    """(token, head, dim) for one NaN per chosen query row: a random head of the first token of
    the longest (split) sequence, and of the last token of the first sequence (a verification
    row's later tokens stay in its task), at random dimensions."""
    cu = case.cu_seqlens_q.tolist()
    longest = int(case.seq_lens.cpu().argmax())
    heads, dims = case.query.shape[1:]
    pick = lambda n: int(torch.randint(n, (1,), generator=gen))  # noqa: E731
    return [(cu[longest], pick(heads), pick(dims)), (cu[1] - 1, pick(heads), pick(dims))]


def check_nan_query_rows(case: Case, fn, rows) -> None:
    """A NaN at (token, head, dim) for each of `rows`: those rows' out and lse are NaN and
    attn_mass is NaN at every slot they see, in the kernel and in the reference; every other row
    of out and lse, and every other slot's mass, is bit-identical to the call without the NaN
    (mass close on CUDA, which adds it with atomics) and matches the reference."""
    clean_out, clean_lse, clean_mass = case.run(fn, lse=True, mass=True)
    for token, head, dim in rows:
        case.query[token, head, dim] = float("nan")
    out, lse, mass = (t.cpu() for t in case.run(fn, lse=True, mass=True))
    want_out, want_lse, want_mass = case.expected(lse=True, mass=True)
    nan_rows = torch.zeros(case.query.shape[:2], dtype=torch.bool)
    nan_slots = torch.zeros(case.num_slots, dtype=torch.bool)
    for token, head, _ in rows:
        nan_rows[token, head] = True
        nan_slots[seen_slots(case, token)] = True
    for what, got, want, where in (("out", out, want_out, nan_rows[..., None].expand_as(out)),
                                   ("lse", lse, want_lse, nan_rows),
                                   ("attn_mass", mass, want_mass, nan_slots)):
        assert torch.equal(want.isnan(), where), f"reference {what}: NaN elsewhere"
        assert torch.equal(got.isnan(), where), f"{what}: NaN not where the reference has it"
    assert _same_bits(out[~nan_rows], clean_out.cpu()[~nan_rows])
    assert _same_bits(lse[~nan_rows], clean_lse.cpu()[~nan_rows])
    if case.device == "cpu":
        assert _same_bits(mass[~nan_slots], clean_mass[~nan_slots])
    assert_close(out[~nan_rows], want_out[~nan_rows], case.dtype)
    torch.testing.assert_close(lse[~nan_rows], want_lse[~nan_rows], rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(mass[~nan_slots], want_mass[~nan_slots], rtol=1e-4, atol=1e-5)


def check_matches_reference_nonfinite(case: Case, fn) -> tuple:
    """out, lse and attn_mass against the reference where some may be NaN or infinite: the same
    NaN and infinity pattern, finite values within rounding. Returns the reference's outputs."""
    got = [t.cpu() for t in case.run(fn, lse=True, mass=True)]
    want = case.expected(lse=True, mass=True)
    for what, a, b, tol in (("out", got[0].float(), want[0].float(), TOL[case.dtype]),
                            ("lse", got[1], want[1], 2e-5), ("attn_mass", got[2], want[2], 1e-4)):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol, equal_nan=True,
                                   msg=lambda m: f"{what}: {m}")  # noqa: B023
    return want


def check_scale_near_float32_limit(case: Case, fn) -> None:
    """scale 1e30 on unit-size data: logits of about 1e31, finite, so every row's softmax is all
    but one-hot. attn_mass against the row's final softmax state stays finite and sums to one per
    row (through an LSE rounded to float32 it was 0 or inf at logits this size)."""
    case.scale = 1e30
    _, _, want_mass = check_matches_reference_nonfinite(case, fn)
    assert torch.isfinite(want_mass).all()
    num_tokens, num_heads = case.query.shape[:2]
    assert abs(want_mass.sum().item() - num_tokens * num_heads) < 1e-3


def check_overflowing_logits(case: Case, fn) -> None:
    """scale 1e37 (scale x log2(e) = 1.44e37): a few rows' queries made so that their logits
    overflow float32 by a wide margin while every product q_i x scale x log2(e) x k_i stays finite
    (the kernels fold the scale into the query first), the others tiny (logits of about 1e31).
    A row with a +inf logit is NaN (out, lse, the mass of every slot it sees); a row whose logits
    are all -inf sees nothing (out 0, lse -inf, no mass); the others are finite, as in the
    reference. The first sequence must have length 1 and the second at least 6 positions."""
    assert int(case.seq_lens[0]) == 1 and int(case.seq_lens[1]) >= 6
    case.scale = 1e37
    group = case.query.shape[1] // case.key_cache.shape[2]
    block_size = case.key_cache.shape[1]

    def key(seq, pos):  # [Hkv, D] float32
        block = case.block_tables[seq, pos // block_size].long()
        return reference.dequantize_cache(case.key_cache[block, pos % block_size].cpu(), None)

    k0, k5 = key(0, 0), key(1, 5)
    query = case.query.cpu().float() * 1e-6
    # q = -2 sign(k): q.k = -2 sum |k_i|, about -100 (every term <= 0): -inf, the row's one logit.
    query[0, 0] = -2 * k0[0].sign()
    query[0, group] = 2 * k0[1].sign()  # about +100: +inf
    # The second sequence's first token sees 5: about 50 there (+inf, 7e38 in the log2 domain),
    # about N(0, 8) elsewhere (finite).
    first = int(case.cu_seqlens_q[1])
    query[first, 0] = k5[0].sign()
    case.query = query.to(case.dtype).to(case.device)
    want_out, want_lse, _ = check_matches_reference_nonfinite(case, fn)
    assert (want_out[0, 0] == 0).all() and want_lse[0, 0] == float("-inf")
    assert want_out[0, group].isnan().all() and want_lse[0, group].isnan()
    assert want_out[first, 0].isnan().all() and want_lse[first, 0].isnan()
    assert torch.isfinite(want_lse[first, 1:]).all() and torch.isfinite(want_lse[first + 1:]).all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("row", EDGE_CASES, ids=EDGE_IDS)
def test_nan_query_row_gives_nan_row(gen, device, variant, row):
    case = edge_case(gen, row, device)
    check_nan_query_rows(case, VARIANTS[variant], nan_rows_of(gen, case))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("row", EDGE_CASES, ids=EDGE_IDS)
def test_scale_near_float32_limit(gen, device, variant, row):
    check_scale_near_float32_limit(edge_case(gen, row, device), VARIANTS[variant])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_overflowing_logits(gen, device, variant, dtype):
    if device == "cuda" and dtype == torch.float32:
        pytest.skip("float32 queries are CPU-only")
    case = Case(gen, seq_lens=[1, 40, 700], q_lens=[1, 2, 3], num_heads=8, num_kv_heads=2,
                head_size=64, block_size=16, dtype=dtype, device=device)
    check_overflowing_logits(case, VARIANTS[variant])


def test_reference_nan_row_as_sdpa(gen):
    """The reference's NaN row is SDPA's: a NaN in one query row makes that row NaN, and only it."""
    case = Case(gen, seq_lens=[45], q_lens=[3], num_heads=4, num_kv_heads=4, head_size=64,
                block_size=8)
    case.query[1, 2, 7] = float("nan")
    out, lse, _ = case.expected(lse=True)
    pos = torch.arange(45)
    slots = case.block_tables[0].long()[pos // 8] * 8 + pos % 8
    k = case.key_cache.view(-1, 4, 64)[slots].transpose(0, 1)
    v = case.value_cache.view(-1, 4, 64)[slots].transpose(0, 1)
    visible = pos[None, :] <= (42 + torch.arange(3))[:, None]
    want = F.scaled_dot_product_attention(case.query.transpose(0, 1), k, v, attn_mask=visible,
                                          scale=case.scale).transpose(0, 1)
    assert torch.equal(out.isnan(), want.isnan()) and out[1, 2].isnan().all()
    assert lse.isnan().sum() == 1 and lse[1, 2].isnan()
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5, equal_nan=True)


@pytest.mark.parametrize("scale", [3e38, 1e300])
def test_scale_above_float32_range_over_log2e_is_rejected(gen, scale):
    """scale x log2(e) must be a finite float32: the op, its fake kernel and the reference reject
    larger scales, naming `scale`."""
    case = Case(gen, seq_lens=[5], q_lens=[1], num_heads=4, num_kv_heads=2, head_size=64,
                block_size=8)
    case.scale = scale
    with pytest.raises(RuntimeError, match="pagedspec.paged_attention: scale must be at most "
                                           "2.35866e\\+38 \\(float32 max / log2\\(e\\)"):
        case.run(ops.paged_attention)
    meta = [t.to("meta") if isinstance(t, torch.Tensor) else t for t in case.args()]
    with pytest.raises(RuntimeError, match="pagedspec.paged_attention: scale must be at most"):
        torch.ops.pagedspec.paged_attention(torch.empty_like(meta[0]), *meta, None, None)
    with pytest.raises(ValueError, match="scale"):
        case.expected()
    case.scale = reference.MAX_ATTENTION_SCALE  # the largest accepted
    case.run(ops.paged_attention)
