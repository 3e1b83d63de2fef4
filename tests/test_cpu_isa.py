"""Every CPU ISA level the kernels are built for and this CPU runs, forced in turn with
PAGEDSPEC_CPU_ISA (so a level that is never the default here is still verified): the attention
grid, FP8 decoding bit for bit, isolation and plans, FP8 conversions and reshape_and_cache bit for
bit, against the reference, and the rejection sampler's tokens identical at every level. Levels this
CPU lacks skip with a reason; forcing one is an error."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import pagedspec
from pagedspec import ops
import test_attention
import test_cache
import test_fp8
import test_sampling
from test_attention import (EDGE_CASES, EDGE_IDS, FP8, GRID, VARIANTS, Case, _grid_id,
                            check_case, check_nan_query_rows, check_overflowing_logits,
                            check_scale_near_float32_limit, edge_case, nan_rows_of)
from test_attention_plan import planned

INFO = pagedspec.build_info()
LEVELS = [pytest.param(level, marks=pytest.mark.skipif(
    level not in INFO["cpu_isa_supported"], reason=f"this CPU lacks the {level} instructions"))
    for level in INFO["cpu_isa_levels"]]


@pytest.fixture(params=LEVELS)
def level(request, monkeypatch):
    monkeypatch.setenv("PAGEDSPEC_CPU_ISA", request.param)
    assert pagedspec._C.cpu_isa() == request.param
    return request.param


def _amx_supported() -> bool:
    # PAGEDSPEC_CPU_AMX=1 opts in wherever the CPU (and OS) has AMX-BF16.
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PAGEDSPEC_CPU_AMX", "1")
        return pagedspec._C.cpu_amx()


HAS_AMX = _amx_supported()


def test_only_the_exact_paths_run_by_default(monkeypatch):
    """AMX multiplies bf16-rounded probabilities, outside the contract's float32-level bound: it
    runs only when opted in. The dot path's scores are exact products summed in float32 and its
    P.V is the FMA path's: it runs by default wherever the CPU has it, and build_info says so."""
    for name in ("PAGEDSPEC_CPU_AMX", "PAGEDSPEC_CPU_AMX_DECODE", "PAGEDSPEC_CPU_BF16_DOT"):
        monkeypatch.delenv(name, raising=False)
    info = pagedspec.build_info()
    assert not info["cpu_amx"] and not pagedspec._C.cpu_amx()
    assert info["cpu_bf16_dot"] == info["cpu_bf16_dot_fp8"] == HAS_BF16_DOT
    monkeypatch.setenv("PAGEDSPEC_CPU_AMX_DECODE", "1")     # not an opt-in of its own
    assert not pagedspec._C.cpu_amx()
    print(f"paths this CPU offers: AMX (opt-in) {HAS_AMX}, bf16 dot (default) {HAS_BF16_DOT}")


def _check_bf16_case(gen, variant, q_lens, seq_lens, heads, head_size, cache_dtype, block_size):
    """bf16 queries on a bf16 or FP8 cache (per-head scales), every output against the reference."""
    case = Case(gen, seq_lens=seq_lens, q_lens=q_lens, num_heads=heads[0], num_kv_heads=heads[1],
                head_size=head_size, block_size=block_size, dtype=torch.bfloat16,
                cache_dtype=cache_dtype, per_head_scale=cache_dtype in FP8)
    check_case(case, VARIANTS[variant], lse=True, mass=(variant == "v1"))


@pytest.mark.parametrize("amx", ["1", "0"])
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("q_lens, seq_lens, heads", [([5, 5, 5], [5, 48, 513], (32, 8)),
                                                     ([2, 9, 1], [33, 700, 64], (8, 1)),
                                                     ([3, 1, 4], [300, 17, 95], (16, 2))])
@pytest.mark.parametrize("head_size", [64, 128, 256])
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, *FP8], ids=str)
@pytest.mark.parametrize("block_size", [16, 8])
def test_amx_path_matches_reference(gen, monkeypatch, amx, variant, q_lens, seq_lens, heads,
                                    head_size, cache_dtype, block_size):
    """bf16 queries with 8 or more rows per KV head, on a bf16 or FP8 cache (its codes converted
    exactly to bf16 images), run the avx512 level's AMX tile multiplies (scores from exact bf16
    products; weights rounded to bf16 for P.V, 2^-9 relative, inside bf16 output's tolerance) or,
    with PAGEDSPEC_CPU_AMX=0, the FMA path: both against the reference. Block size 8 puts the
    16 keys of a tile multiply in two scattered blocks (gathered, not read in place)."""
    if amx == "1" and not HAS_AMX:
        pytest.skip("this CPU (or OS) has no AMX-BF16")
    if "avx512" not in INFO["cpu_isa_supported"]:
        pytest.skip("the AMX path is part of the avx512 level")
    monkeypatch.setenv("PAGEDSPEC_CPU_AMX", amx)
    assert pagedspec._C.cpu_amx() == (amx == "1")
    _check_bf16_case(gen, variant, q_lens, seq_lens, heads, head_size, cache_dtype, block_size)


@pytest.mark.skipif(not HAS_AMX, reason="this CPU (or OS) has no AMX-BF16")
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, *FP8], ids=str)
def test_amx_path_is_taken(gen, monkeypatch, cache_dtype):
    """The two paths round differently, so equal outputs would mean AMX never ran."""
    # Head size 256: smaller ones take the AMX decode path (tested below).
    case = Case(gen, seq_lens=[700, 1100], q_lens=[5, 8], num_heads=32, num_kv_heads=8,
                head_size=256, block_size=16, dtype=torch.bfloat16, cache_dtype=cache_dtype)
    monkeypatch.setenv("PAGEDSPEC_CPU_AMX", "1")
    with_amx, _, _ = case.run(ops.paged_attention)
    monkeypatch.setenv("PAGEDSPEC_CPU_AMX", "0")
    without, _, _ = case.run(ops.paged_attention)
    assert not torch.equal(with_amx, without)
    torch.testing.assert_close(with_amx.float(), without.float(), rtol=1.6e-2, atol=1.6e-2)


@pytest.mark.parametrize("amx_decode", ["1", "0"])
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("q_lens, seq_lens, heads", [([1, 1, 1], [1, 31, 1100], (8, 8)),
                                                     ([1, 1], [700, 33], (16, 4)),
                                                     ([1, 1, 1], [17, 513, 96], (16, 2)),
                                                     ([1, 5, 1], [300, 48, 95], (32, 8)),
                                                     ([5, 3, 8], [1100, 33, 8], (32, 8)),
                                                     ([4, 2], [65, 300], (64, 8)),
                                                     ([7, 2], [40, 97], (8, 8))])
@pytest.mark.parametrize("head_size", [64, 96, 128, 256])
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, *FP8], ids=str)
@pytest.mark.parametrize("block_size", [16, 8])
def test_amx_decode_path_matches_reference(gen, monkeypatch, amx_decode, variant, q_lens,
                                           seq_lens, heads, head_size, cache_dtype, block_size):
    """Decode and verification rows on bf16 or FP8 caches run the avx512 level's AMX decode path
    where the head size is a multiple of 32 up to 128 (weights rounded to bf16 as on the AMX
    path), or with PAGEDSPEC_CPU_AMX_DECODE=0 the FMA or many-row AMX path; 256 stays off it
    either way. Groups of 1 to 8 heads and 1 to 8 query tokens give 1 to 32 rows a task: one
    narrow tile state (up to 8 rows) or one or two wide ones (9 to 16 rows each, the queries
    padded to 16; 20 rows: 10 + 10, 12 rows: one). Block size 8 gathers each 16 keys of
    a tile multiply from two blocks; the lengths leave partial tiles, and tiles where some rows
    of a state see no position at all (33 with 3 draft tokens, 65 with 4)."""
    if amx_decode == "1" and not HAS_AMX:
        pytest.skip("this CPU (or OS) has no AMX-BF16")
    if "avx512" not in INFO["cpu_isa_supported"]:
        pytest.skip("the AMX path is part of the avx512 level")
    monkeypatch.setenv("PAGEDSPEC_CPU_AMX", "1")
    monkeypatch.setenv("PAGEDSPEC_CPU_AMX_DECODE", amx_decode)
    _check_bf16_case(gen, variant, q_lens, seq_lens, heads, head_size, cache_dtype, block_size)


def _decode_case(gen, cache_dtype, seq_lens=(700, 1100, 40), q_len=1):
    return Case(gen, seq_lens=list(seq_lens), q_lens=[q_len] * len(seq_lens), num_heads=32,
                num_kv_heads=8, head_size=128, block_size=16, dtype=torch.bfloat16,
                cache_dtype=cache_dtype)


@pytest.mark.skipif(not HAS_AMX, reason="this CPU (or OS) has no AMX-BF16")
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, *FP8], ids=str)
@pytest.mark.parametrize("q_len", [1, 5])
def test_amx_decode_path_is_taken(gen, monkeypatch, cache_dtype, q_len):
    """The AMX decode path rounds its weights to bf16 and the FMA path does not, so equal outputs
    would mean the decode path never ran. With 5 query tokens (20 rows a KV head) the other side
    is the many-row AMX path, which rounds the same weights to bf16 but sums in another order."""
    case = _decode_case(gen, cache_dtype, q_len=q_len)
    monkeypatch.setenv("PAGEDSPEC_CPU_AMX", "1")
    monkeypatch.setenv("PAGEDSPEC_CPU_AMX_DECODE", "1")
    with_amx, lse_amx, _ = case.run(ops.paged_attention, lse=True)
    monkeypatch.setenv("PAGEDSPEC_CPU_AMX_DECODE", "0")
    without, lse_fma, _ = case.run(ops.paged_attention, lse=True)
    assert not torch.equal(with_amx, without)
    torch.testing.assert_close(with_amx.float(), without.float(), rtol=1.6e-2, atol=1.6e-2)
    # The LSE comes from float32 sums of float32 weights on both paths.
    torch.testing.assert_close(lse_amx, lse_fma, rtol=2e-5, atol=2e-5)


@pytest.mark.skipif(not HAS_AMX, reason="this CPU (or OS) has no AMX-BF16")
@pytest.mark.parametrize("rising", [True, False])
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("q_len", [1, 5])
def test_amx_decode_rescales_its_accumulators(gen, monkeypatch, rising, variant, q_len):
    """Keys scaled by position so that logits climb by far more than the path's slack (8 in the
    log2 domain) from tile to tile, or fall: the running max is raised and the accumulators in
    tile layout rescaled many times, or never after the first tile."""
    case = _decode_case(gen, torch.bfloat16, seq_lens=(1100, 300), q_len=q_len)
    num_blocks, block_size = case.key_cache.shape[:2]
    for seq, seq_len in enumerate([1100, 300]):
        for b in range((seq_len + block_size - 1) // block_size):
            pos = b * block_size + torch.arange(block_size, dtype=torch.float32)
            factor = 1 + (pos if rising else seq_len - pos).clamp(min=0) / 24
            block = int(case.block_tables[seq, b])
            case.key_cache[block] = (case.key_cache[block].float() * factor[:, None, None]).to(
                torch.bfloat16)
    monkeypatch.setenv("PAGEDSPEC_CPU_AMX", "1")
    monkeypatch.setenv("PAGEDSPEC_CPU_AMX_DECODE", "1")
    check_case(case, VARIANTS[variant])


def _bf16_dot_supported() -> bool:
    # PAGEDSPEC_CPU_BF16_DOT=1 (the default) turns the path on wherever the CPU has it.
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PAGEDSPEC_CPU_BF16_DOT", "1")
        return pagedspec._C.cpu_bf16_dot()


HAS_BF16_DOT = _bf16_dot_supported()


@pytest.mark.parametrize("dot", ["1", "0"])
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("q_lens, seq_lens, heads", [([5, 5, 5], [5, 48, 513], (32, 8)),
                                                     ([2, 9, 1], [33, 700, 64], (8, 1)),
                                                     ([1, 1, 1], [1, 31, 1100], (8, 2)),
                                                     ([3, 1, 4], [40, 700, 97], (16, 16)),
                                                     ([3, 13, 2], [19, 300, 1041], (12, 3))])
@pytest.mark.parametrize("head_size", [64, 96, 128, 256])
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, *FP8], ids=str)
@pytest.mark.parametrize("block_size", [16, 8])
def test_bf16_dot_path_matches_reference(gen, monkeypatch, dot, variant, q_lens, seq_lens, heads,
                                         head_size, cache_dtype, block_size):
    """bf16 queries on a bf16 or FP8 cache (its codes converted exactly to bf16 images: in
    registers where the head size is a multiple of 64, through image rows at 96) at the
    avx512 level, through AVX512-BF16 dot products
    (PAGEDSPEC_CPU_BF16_DOT=1: exact products, float32 sums in another order; P.V on the FMA
    path) and through the FMA path alone (=0), with AMX off so that every task takes the path
    asked for (test_cpu_accuracy.py holds both to the rounding-level bound). Head size 96 leaves a
    32-wide span after the 64-wide ones; odd visible counts pair the last position with zero.
    Tasks of 8 rows and more score against a packed K tile in blocks of 8 and 4 rows (20 = 8 + 8 + 4, 12 = 8 + 4,
    a 52-row draft as 32 + 20), over one or two 16-position groups (a 5-token sequence gives its
    one tile fewer than 16 positions, a 19-token one a second group of 3)."""
    if dot == "1" and not HAS_BF16_DOT:
        pytest.skip("this CPU has no AVX512-BF16 with AVX512-VBMI")
    if "avx512" not in INFO["cpu_isa_supported"]:
        pytest.skip("the bf16 dot path is part of the avx512 level")
    monkeypatch.setenv("PAGEDSPEC_CPU_ISA", "avx512")
    monkeypatch.setenv("PAGEDSPEC_CPU_AMX", "0")
    monkeypatch.setenv("PAGEDSPEC_CPU_BF16_DOT", dot)
    assert pagedspec._C.cpu_bf16_dot() == pagedspec._C.cpu_bf16_dot_fp8() == (dot == "1")
    _check_bf16_case(gen, variant, q_lens, seq_lens, heads, head_size, cache_dtype, block_size)


@pytest.mark.skipif(not HAS_BF16_DOT, reason="this CPU has no AVX512-BF16 with AVX512-VBMI")
def test_bf16_dot_takes_both_caches(monkeypatch):
    """The dot path runs for bf16 and FP8 caches alike, whether or not AMX takes other tasks,
    unless PAGEDSPEC_CPU_BF16_DOT=0; any other value than 0 or 1 is an error naming it."""
    for amx in ("0", "1"):
        monkeypatch.setenv("PAGEDSPEC_CPU_AMX", amx)
        monkeypatch.delenv("PAGEDSPEC_CPU_BF16_DOT", raising=False)
        assert pagedspec._C.cpu_bf16_dot() and pagedspec._C.cpu_bf16_dot_fp8()
        for forced in ("0", "1"):
            monkeypatch.setenv("PAGEDSPEC_CPU_BF16_DOT", forced)
            assert pagedspec._C.cpu_bf16_dot() == pagedspec._C.cpu_bf16_dot_fp8() == (
                forced == "1")
        monkeypatch.setenv("PAGEDSPEC_CPU_BF16_DOT", "yes")
        with pytest.raises(RuntimeError, match="PAGEDSPEC_CPU_BF16_DOT must be one of 0, 1"):
            pagedspec._C.cpu_bf16_dot()


@pytest.mark.skipif(not HAS_BF16_DOT, reason="this CPU has no AVX512-BF16 with AVX512-VBMI")
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, *FP8], ids=str)
@pytest.mark.parametrize("head_size", [128, 96])
@pytest.mark.parametrize("draft_len, heads", [(5, (32, 8)), (4, (8, 8))])
def test_bf16_dot_path_is_taken_and_isolates(gen, monkeypatch, cache_dtype, head_size, draft_len,
                                             heads):
    """The dot and FMA paths sum scores in different orders, so equal lse would mean the dot
    path never ran; and a later draft token's K and V set to NaN leave the earlier tokens
    bit-identical on it. On FP8 caches head size 128 converts the codes in registers, 96 through
    bf16 image rows; the drafts give tasks of 20 rows (the packed K tile) and of 4 (one score
    block)."""
    monkeypatch.setenv("PAGEDSPEC_CPU_ISA", "avx512")
    monkeypatch.setenv("PAGEDSPEC_CPU_AMX", "0")
    num_heads, num_kv_heads = heads
    case = Case(gen, seq_lens=[700, 1099], q_lens=[1, draft_len], num_heads=num_heads,
                num_kv_heads=num_kv_heads, head_size=head_size, block_size=16,
                dtype=torch.bfloat16, cache_dtype=cache_dtype)
    monkeypatch.setenv("PAGEDSPEC_CPU_BF16_DOT", "0")
    fma, fma_lse, _ = case.run(ops.paged_attention, lse=True)
    monkeypatch.setenv("PAGEDSPEC_CPU_BF16_DOT", "1")
    dot, dot_lse, _ = case.run(ops.paged_attention, lse=True)
    # Both exact but for float32 sums: bf16 outputs mostly agree, float32 lse to its last bits.
    assert not torch.equal(dot_lse, fma_lse)
    torch.testing.assert_close(dot_lse, fma_lse, rtol=2e-6, atol=2e-6)
    torch.testing.assert_close(dot.float(), fma.float(), rtol=8e-3, atol=8e-3)
    slot = int(case.block_tables[1, 1098 // 16]) * 16 + 1098 % 16  # the last draft token's row
    for cache in (case.key_cache, case.value_cache):
        cache.view(-1, num_kv_heads, head_size)[slot] = float("nan")  # in every format
    out, lse, _ = case.run(ops.paged_attention, lse=True)
    last = draft_len  # the last draft token's index in the batch (after the decode token)
    assert torch.equal(out[:last], dot[:last]) and torch.equal(lse[:last], dot_lse[:last])
    assert not torch.isfinite(out[last]).all()


def test_levels_are_reported(monkeypatch):
    assert INFO["cpu_isa_levels"] == ["baseline", "avx2", "avx512"]
    assert isinstance(INFO["cpu_amx"], bool) and isinstance(INFO["cpu_bf16_dot"], bool)
    assert isinstance(INFO["cpu_bf16_dot_fp8"], bool) and isinstance(INFO["cpu_fp8_images"], bool)
    assert "baseline" in INFO["cpu_isa_supported"]
    monkeypatch.delenv("PAGEDSPEC_CPU_ISA", raising=False)
    assert pagedspec.build_info()["cpu_isa"] == INFO["cpu_isa_supported"][-1], \
        "the best level runs by default"


def test_one_configuration_reported_whole(monkeypatch):
    """build_info()["cpu"] is the configuration the kernels resolve per call, the cpu_* keys
    its fields; a change of the environment shows at the next call."""
    for name in ("PAGEDSPEC_CPU_ISA", "PAGEDSPEC_CPU_AMX", "PAGEDSPEC_CPU_AMX_DECODE",
                 "PAGEDSPEC_CPU_BF16_DOT", "PAGEDSPEC_CPU_FP8_IMAGES"):
        monkeypatch.delenv(name, raising=False)
    info = pagedspec.build_info()
    cpu = info["cpu"]
    assert set(cpu) == {"isa", "amx", "amx_decode", "bf16_dot", "fp8_images", "avx512_vbmi"}
    assert (info["cpu_isa"], info["cpu_amx"], info["cpu_bf16_dot"], info["cpu_fp8_images"]) == (
        cpu["isa"], cpu["amx"], cpu["bf16_dot"], cpu["fp8_images"])
    assert cpu["fp8_images"] == (cpu["isa"] == "avx2" or (cpu["isa"] == "avx512"
                                                         and cpu["avx512_vbmi"]))
    monkeypatch.setenv("PAGEDSPEC_CPU_FP8_IMAGES", "0")
    assert not pagedspec.build_info()["cpu"]["fp8_images"]
    monkeypatch.setenv("PAGEDSPEC_CPU_ISA", "baseline")
    assert pagedspec.build_info()["cpu"]["isa"] == "baseline"
    print(f"CPU configuration by default here: {cpu}")


@pytest.mark.parametrize("name, value, accepted", [
    ("PAGEDSPEC_CPU_AMX", "yes", "0, 1"), ("PAGEDSPEC_CPU_AMX_DECODE", "2", "0, 1"),
    ("PAGEDSPEC_CPU_BF16_DOT", "true", "0, 1"), ("PAGEDSPEC_CPU_FP8_IMAGES", "off", "0, 1"),
    ("PAGEDSPEC_CPU_ISA", "avx9", "baseline, avx2, avx512")])
def test_one_grammar_for_every_setting(gen, monkeypatch, name, value, accepted):
    """Every setting is unset, 0 or 1 (the level: its name); anything else fails the call with
    the variable and what it accepts, in build_info and in an attention call alike."""
    monkeypatch.setenv(name, value)
    message = f"{name} must be one of {accepted} \\(or unset\\), got '{value}'"
    with pytest.raises(RuntimeError, match=message):
        pagedspec.build_info()
    case = Case(gen, seq_lens=[20], q_lens=[1], num_heads=4, num_kv_heads=2, head_size=64,
                block_size=16, dtype=torch.float32, cache_dtype=torch.float32)
    with pytest.raises(RuntimeError, match=message):
        case.run(ops.paged_attention)


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("row", GRID, ids=[_grid_id(r) for r in GRID])
def test_attention_grid_at_every_level(gen, level, variant, row):
    dtype, cache_dtype, head_size, block_size, (hq, hkv), q_lens, seq_lens = row
    case = Case(gen, seq_lens=seq_lens, q_lens=q_lens, num_heads=hq, num_kv_heads=hkv,
                head_size=head_size, block_size=block_size, dtype=dtype, cache_dtype=cache_dtype,
                per_head_scale=(head_size % 32 == 0))
    check_case(case, VARIANTS[variant], lse=True, mass=(variant == "v1"))


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("head_size", [80, 96, 112])
@pytest.mark.parametrize("q_lens, seq_lens, heads", [([5, 1, 3], [5, 700, 40], (32, 8)),
                                                     ([1, 2, 1], [1, 33, 1100], (8, 2))])
def test_bf16_rows_in_even_odd_order_at_every_level(gen, monkeypatch, level, variant, head_size,
                                                    q_lens, seq_lens, heads):
    """bf16 caches on the FMA path (PAGEDSPEC_CPU_BF16_DOT=0, AMX off) read K and V rows 16 (AVX2)
    or 32 (AVX-512) elements at a time in even/odd order, with the queries and accumulators put
    in the same order: at AVX-512, head size 96 ends on a span of one 32, and 80 and 112 on a last
    16 read in dimension order. Verification rows, short and split sequences, against the
    reference."""
    monkeypatch.setenv("PAGEDSPEC_CPU_BF16_DOT", "0")
    monkeypatch.setenv("PAGEDSPEC_CPU_AMX", "0")
    case = Case(gen, seq_lens=seq_lens, q_lens=q_lens, num_heads=heads[0], num_kv_heads=heads[1],
                head_size=head_size, block_size=16, dtype=torch.bfloat16,
                cache_dtype=torch.bfloat16)
    check_case(case, VARIANTS[variant], lse=True, mass=(variant == "v1"))


def _fp8_images(level: str) -> bool:
    # The default at `level`: at avx2, and at avx512 where the CPU has AVX512-VBMI.
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("PAGEDSPEC_CPU_FP8_IMAGES", raising=False)
        mp.setenv("PAGEDSPEC_CPU_ISA", level)
        return pagedspec._C.cpu_fp8_images()


FP8_IMAGE_LEVELS = [level for level in ("avx2", "avx512")
                    if level in INFO["cpu_isa_supported"] and _fp8_images(level)]


@pytest.fixture(params=["avx2", "avx512"])
def image_level(request, monkeypatch):
    """A level whose FMA path can read FP8 tiles as images, forced, its other paths off."""
    if request.param not in FP8_IMAGE_LEVELS:
        pytest.skip(f"this CPU lacks {request.param}" + (" with AVX512-VBMI"
                                                         if request.param == "avx512" else ""))
    monkeypatch.setenv("PAGEDSPEC_CPU_ISA", request.param)
    monkeypatch.setenv("PAGEDSPEC_CPU_BF16_DOT", "0")
    monkeypatch.setenv("PAGEDSPEC_CPU_AMX", "0")
    return request.param


@pytest.mark.parametrize("images", ["1", "0"])
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("q_lens, seq_lens, heads", [([5, 1, 3], [5, 700, 40], (32, 8)),
                                                     ([1, 2, 1], [1, 33, 1100], (16, 2))])
@pytest.mark.parametrize("head_size", [64, 96, 128, 80])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("cache_dtype", FP8, ids=str)
def test_fp8_tiles_as_images_on_the_fma_path(gen, monkeypatch, image_level, images, variant,
                                             q_lens, seq_lens, heads, head_size, dtype,
                                             cache_dtype):
    """The FMA path (the dot and AMX paths off) on FP8 caches: tasks with more rows than the
    images need (more than 4 at avx512, 10 at avx2: here 20 and 12 rows at group 4, 16 and 8 at
    group 8) read each tile's codes converted once to bf16 images (PAGEDSPEC_CPU_FP8_IMAGES=1)
    in even/odd order, with the queries and accumulators in that order (at avx512 head size 80,
    not a multiple of 32, never), or converted in registers block by block (=0); the other tasks
    convert in registers either way. Verification rows, short and split sequences, per-head
    scales, every query type, against the reference."""
    monkeypatch.setenv("PAGEDSPEC_CPU_FP8_IMAGES", images)
    assert pagedspec._C.cpu_fp8_images() == (images == "1")
    case = Case(gen, seq_lens=seq_lens, q_lens=q_lens, num_heads=heads[0], num_kv_heads=heads[1],
                head_size=head_size, block_size=16, dtype=dtype, cache_dtype=cache_dtype,
                per_head_scale=True)
    check_case(case, VARIANTS[variant], lse=True, mass=(variant == "v1"))


@pytest.mark.parametrize("cache_dtype", FP8, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_fp8_images_are_taken_and_isolate(gen, monkeypatch, image_level, cache_dtype, dtype):
    """Images and codes converted in registers give the same floats, summed in another order
    (even/odd against dimension order), so equal outputs would mean the images never ran; and a
    later draft token's K and V set to NaN leave the earlier tokens bit-identical on them."""
    case = Case(gen, seq_lens=[700, 1099], q_lens=[1, 5], num_heads=32, num_kv_heads=8,
                head_size=128, block_size=16, dtype=dtype, cache_dtype=cache_dtype)
    monkeypatch.setenv("PAGEDSPEC_CPU_FP8_IMAGES", "0")
    codes, codes_lse, _ = case.run(ops.paged_attention, lse=True)
    monkeypatch.setenv("PAGEDSPEC_CPU_FP8_IMAGES", "1")
    images, images_lse, _ = case.run(ops.paged_attention, lse=True)
    if dtype == torch.float32:
        assert not torch.equal(images, codes)
    # float32 sums of the same products in another order; bf16 outputs round them.
    tol = 1e-5 if dtype == torch.float32 else 1.6e-2
    torch.testing.assert_close(images.float(), codes.float(), rtol=tol, atol=tol)
    torch.testing.assert_close(images_lse, codes_lse, rtol=1e-5, atol=1e-5)
    slot = int(case.block_tables[1, 1098 // 16]) * 16 + 1098 % 16  # the last draft token's row
    for cache in (case.key_cache, case.value_cache):
        cache.view(-1, 8, 128)[slot] = float("nan")
    out, lse, _ = case.run(ops.paged_attention, lse=True)
    last = 5  # the last draft token's index in the batch (after the decode token)
    assert torch.equal(out[:last], images[:last]) and torch.equal(lse[:last], images_lse[:last])
    assert not torch.isfinite(out[last]).all()


@pytest.mark.parametrize("scale", [0.37, 3.0, 1e-3])
@pytest.mark.parametrize("cache_dtype", FP8)
def test_fp8_images_decode_every_code_exactly(monkeypatch, image_level, cache_dtype, scale):
    """Every FP8 code as the V of a one-position sequence read by 16 query heads of one KV head
    (a task of more rows than the images need at either level): each output exactly stored *
    scale, NaN staying NaN."""
    monkeypatch.setenv("PAGEDSPEC_CPU_FP8_IMAGES", "1")
    n, heads, head_size = 256, 16, 64
    codes = torch.arange(n, dtype=torch.uint8)
    key_cache = torch.zeros(n, 1, 1, head_size, dtype=torch.uint8).view(cache_dtype)
    value_cache = codes.view(n, 1, 1, 1).expand(n, 1, 1, head_size).contiguous().view(cache_dtype)
    query = torch.randn(n, heads, head_size).half()
    want = (codes.view(cache_dtype).float() * scale).half()[:, None, None].expand(n, heads,
                                                                                  head_size)
    out = torch.empty_like(query)
    ops.paged_attention(out, query, key_cache, value_cache,
                        torch.arange(n, dtype=torch.int32).view(n, 1),
                        torch.ones(n, dtype=torch.int32), torch.arange(n + 1, dtype=torch.int32),
                        1, 1.0, torch.tensor(scale), torch.tensor(scale))
    assert torch.equal(torch.isnan(out), torch.isnan(want))
    finite = ~torch.isnan(want)
    assert torch.equal(out[finite], want[finite])


@pytest.mark.parametrize("scale", [0.37, 3.0, 1e-3])
@pytest.mark.parametrize("cache_dtype", FP8)
def test_fp8_decoding_is_exact_at_every_level(level, cache_dtype, scale):
    # Every FP8 code as the V of a one-position sequence: exactly stored * scale (NaN stays NaN).
    test_attention.test_fp8_decode_is_exact("cpu", cache_dtype, scale)


@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("wide", [torch.float32, torch.float16, torch.bfloat16])
def test_fp8_conversions_at_every_level(gen, level, fp8, wide):
    # Bit for bit against the reference: quantization of random and of every 16-bit input, and
    # dequantization of every code (per head and per tensor).
    for per_head in (False, True):
        test_fp8.test_quantize_matches_reference_bitwise("cpu", fp8, wide, per_head, gen)
        test_fp8.test_dequantize_every_code("cpu", fp8, wide, per_head, gen)
    if wide != torch.float32:
        test_fp8.test_quantize_every_16bit_input("cpu", fp8, wide)


@pytest.mark.parametrize("in_dtype, cache_dtype", test_cache.DTYPE_PAIRS)
@pytest.mark.parametrize("geometry", test_cache.GEOMETRIES)
def test_reshape_and_cache_at_every_level(gen, level, in_dtype, cache_dtype, geometry):
    for scale_kind in ("tensor", "head"):
        test_cache.test_reshape_and_cache_matches_reference("cpu", in_dtype, cache_dtype,
                                                            geometry, scale_kind, gen)


@pytest.mark.parametrize("partition_size", [-1, 256])
def test_plans_and_isolation_at_every_level(gen, level, partition_size):
    case = Case(gen, seq_lens=[1100, 37], q_lens=[5, 3], num_heads=8, num_kv_heads=2,
                head_size=128, block_size=16, dtype=torch.bfloat16)
    plan = ops.plan_paged_attention(case.seq_lens, case.cu_seqlens_q, 8, 2, 128, "cpu",
                                    partition_size=partition_size)
    run = planned(plan)
    clean = case.run(run, lse=True)
    check_case(case, run, mass=True)
    # A later draft token's V set to inf leaves the earlier tokens bit-identical.
    slot = int(case.block_tables[0, 1099 // 16]) * 16 + 1099 % 16
    case.value_cache.view(-1, 2, 128)[slot] = float("inf")
    out, lse, _ = case.run(run, lse=True)
    assert torch.equal(out[:4], clean[0][:4]) and torch.equal(lse[:4], clean[1][:4])


def _boundary_draws(gen, batch, vocab):
    """Bonus-token draws (k = 0: each request samples its target row) whose uniform is a CDF
    boundary t0 / total in float64, so u * total lands within float32 rounding of a prefix and the
    token depends on the order of the additions."""
    probs = torch.softmax(torch.randn(batch, 1, vocab, generator=gen) * 3, dim=-1)
    cdf = probs[:, 0].double().cumsum(-1)
    t0 = torch.randint(0, vocab - 1, (batch,), generator=gen)
    u = (cdf[torch.arange(batch), t0] / cdf[:, -1]).float().view(batch, 1)
    return dict(draft_token_ids=torch.empty(batch, 0, dtype=torch.int64), draft_probs=None,
                target_probs=probs, uniform_accept=torch.empty(batch, 0), uniform_resample=u,
                num_draft_tokens=None)


def _tokens_at_each_level(inputs, monkeypatch):
    tokens = {}
    for level in INFO["cpu_isa_supported"]:
        monkeypatch.setenv("PAGEDSPEC_CPU_ISA", level)
        tokens[level] = ops.rejection_sample(**inputs)
    return tokens


@pytest.mark.parametrize("vocab", [1000, 32077, 70001])  # partial last tiles; 547 tiles > 512 runs
def test_rejection_sample_is_identical_at_every_level(gen, vocab, monkeypatch):
    # The vector levels sum the tiles' weights in registers; the order of sampling.h must hold to
    # the bit, so every level emits the baseline's (scalar) tokens.
    inputs = _boundary_draws(gen, 512, vocab)
    tokens = _tokens_at_each_level(inputs, monkeypatch)
    base_out, base_acc = tokens["baseline"]
    for level, (out, acc) in tokens.items():
        assert torch.equal(out, base_out) and torch.equal(acc, base_acc), level
    # The draws are sensitive to the order: plain sequential float32 sums (another order) move
    # some of these tokens, so a level that summed differently would be caught.
    probs = inputs["target_probs"][:, 0].numpy()
    prefix = np.cumsum(probs, axis=-1, dtype=np.float32)
    threshold = inputs["uniform_resample"][:, 0].numpy() * prefix[:, -1]
    sequential = np.argmax(prefix > threshold[:, None], axis=-1)
    assert (sequential != base_out[:, 0].numpy()).sum() >= 5
    # Draft-probability and one-hot requests (residual rows) as well.
    for one_hot in (False, True):
        inputs = test_sampling._random_inputs(gen, 64, 4, vocab, one_hot_draft=one_hot,
                                              sparse=True)
        tokens = _tokens_at_each_level(inputs, monkeypatch)
        for level, (out, acc) in tokens.items():
            assert torch.equal(out, tokens["baseline"][0]), (level, one_hot)
            assert torch.equal(acc, tokens["baseline"][1]), (level, one_hot)


def test_forcing_an_unknown_or_missing_level_is_an_error(gen, monkeypatch):
    case = Case(gen, seq_lens=[10], q_lens=[1], num_heads=4, num_kv_heads=2, head_size=64,
                block_size=8, dtype=torch.float32)
    monkeypatch.setenv("PAGEDSPEC_CPU_ISA", "sse9")
    with pytest.raises(RuntimeError,
                       match="PAGEDSPEC_CPU_ISA must be one of baseline, avx2, avx512"):
        case.run(ops.paged_attention)
    missing = [x for x in INFO["cpu_isa_levels"] if x not in INFO["cpu_isa_supported"]]
    if missing:
        monkeypatch.setenv("PAGEDSPEC_CPU_ISA", missing[0])
        with pytest.raises(RuntimeError, match="lacks its instructions"):
            case.run(ops.paged_attention)


# Attention's edge semantics (undefined rows, huge scales) at every level this CPU runs (the ids
# name the level, and the case the path it takes there: the FMA path on native caches, FP8
# codes converted in registers, or, at avx2, FP8 tiles read as bf16 images). The kernels decide
# them in the shared epilogue and split merge, so v1 (one pass) and v2 / the dispatcher (split
# sequences) both run.


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("row", EDGE_CASES, ids=EDGE_IDS)
def test_nan_query_row_at_every_level(gen, level, variant, row):
    """A NaN in a query row: that row NaN (out, lse, the mass of the slots it sees), every other
    row and slot bit-identical to the call without it, and the reference's result."""
    case = edge_case(gen, row)
    check_nan_query_rows(case, VARIANTS[variant], nan_rows_of(gen, case))


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("row", EDGE_CASES, ids=EDGE_IDS)
def test_scale_near_float32_limit_at_every_level(gen, level, variant, row):
    check_scale_near_float32_limit(edge_case(gen, row), VARIANTS[variant])


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_overflowing_logits_at_every_level(gen, level, variant, dtype):
    case = Case(gen, seq_lens=[1, 40, 700], q_lens=[1, 2, 3], num_heads=8, num_kv_heads=2,
                head_size=64, block_size=16, dtype=dtype)
    check_overflowing_logits(case, VARIANTS[variant])
