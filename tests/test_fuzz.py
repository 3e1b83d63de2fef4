"""A bounded, seeded fuzzer over every op, the fake kernels against the CPU kernels, and the
regression cases of the first fuzzer run.

Fuzzer: for every op, start from a small valid call, apply one or two random mutations (dtype,
rank, size, non-contiguous, bad indices, aliasing, overlapping outputs, meta tensors, neg-bit
inputs, None for optional arguments, bad ints) and call the CPU op. It must either succeed with
the outputs of ``pagedspec.reference`` on the same arguments, or raise RuntimeError / TypeError /
ValueError naming the op and an argument, leaving every output unwritten. Mutations known to
crash the process run only in a subprocess (see the regression section). Seeded
(``PAGEDSPEC_FUZZ_SEED``, default 0); ``PAGEDSPEC_FUZZ_ITERS`` calls per op (default 200).

The explicit regression cases at the end reproduce each finding of the first fuzzer run (and of
this one), so a fix that regresses fails by name.
"""
from __future__ import annotations

import copy
import json
import os
import random
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch

import pagedspec  # noqa: F401
from pagedspec import ops, reference
from pagedspec.ops import OP_NAMES

P = torch.ops.pagedspec
ITERS = int(os.environ.get("PAGEDSPEC_FUZZ_ITERS", "200"))
SEED = int(os.environ.get("PAGEDSPEC_FUZZ_SEED", "0"))
ERRORS = (RuntimeError, TypeError, ValueError)
FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
ATTENTION = ("paged_attention_v1", "paged_attention_v2", "paged_attention")


# ------------------------------------------------------------------------------------------
# Valid calls (small shapes)

def _schema(name):
    return getattr(P, name).default._schema


def _mutable(name) -> set:
    return {a.name for a in _schema(name).arguments
            if a.alias_info is not None and a.alias_info.is_write}


def _arg_names(name) -> list:
    return [a.name for a in _schema(name).arguments]


def _fp8_scale(g, heads, per_head):
    return (torch.rand(heads, generator=g) * 0.5 + 0.05) if per_head else torch.tensor(0.25)


def _layout(rng):
    """None (contiguous caches) half the time, else the padding between pages."""
    return None if rng.random() < 0.5 else rng.choice([0, 16])


def _paged(layout, key_cache, value_cache):
    """The same caches, or (layout = padding) as the K|V halves of one page per block: a strided
    block dimension, as vLLM's layouts give them."""
    if layout is None:
        return key_cache, value_cache
    nb, block = key_cache.shape[0], key_cache[0].numel()
    pages = torch.zeros(nb, 2 * block + layout, dtype=key_cache.dtype)
    k = pages[:, :block].unflatten(1, key_cache.shape[1:])
    v = pages[:, block: 2 * block].unflatten(1, key_cache.shape[1:])
    k.copy_(key_cache)
    v.copy_(value_cache)
    return k, v


def valid_reshape_and_cache(g, rng):
    T, H, D, NB, BS = 4, 2, 8, 3, 4
    cache_dtype = rng.choice([torch.float32, torch.float8_e4m3fn])
    key, value = torch.randn(T, H, D, generator=g), torch.randn(T, H, D, generator=g)
    slots = torch.randperm(NB * BS, generator=g)[:T].clone()
    slots[rng.randrange(T)] = -1
    k_scale = v_scale = None
    if cache_dtype in FP8:
        per_head = rng.random() < 0.5
        k_scale, v_scale = _fp8_scale(g, H, per_head), _fp8_scale(g, H, per_head)
    key_cache, value_cache = _paged(_layout(rng), torch.zeros(NB, BS, H, D).to(cache_dtype),
                                    torch.zeros(NB, BS, H, D).to(cache_dtype))
    return dict(key=key, value=value, key_cache=key_cache, value_cache=value_cache,
                slot_mapping=slots, k_scale=k_scale, v_scale=v_scale)


def valid_attention(g, rng):
    Hq, Hkv, D, BS = 4, 2, 64, 8
    seq_lens, q_lens = [5, 11], [1, 2]
    max_blocks, NB = 2, 6
    cache_dtype = rng.choice([torch.float32, torch.float32, torch.float8_e4m3fn])
    k, v = torch.randn(NB, BS, Hkv, D, generator=g), torch.randn(NB, BS, Hkv, D, generator=g)
    k_scale = v_scale = None
    if cache_dtype in FP8:
        per_head = rng.random() < 0.5
        k_scale, v_scale = _fp8_scale(g, Hkv, per_head), _fp8_scale(g, Hkv, per_head)
        key_cache, value_cache = torch.empty_like(k, dtype=cache_dtype), torch.empty_like(
            v, dtype=cache_dtype)
        reference.quantize_fp8(key_cache, k, k_scale)
        reference.quantize_fp8(value_cache, v, v_scale)
    else:
        key_cache, value_cache = k, v
    key_cache, value_cache = _paged(_layout(rng), key_cache, value_cache)
    T = sum(q_lens)
    tables = torch.randperm(NB, generator=g)[: 2 * max_blocks].view(2, max_blocks).int()
    return dict(out=torch.zeros(T, Hq, D), query=torch.randn(T, Hq, D, generator=g),
                key_cache=key_cache, value_cache=value_cache, block_tables=tables.contiguous(),
                seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
                cu_seqlens_q=torch.tensor([0, 1, 3], dtype=torch.int32), max_q_len=2,
                scale=D ** -0.5, k_scale=k_scale, v_scale=v_scale,
                lse=torch.zeros(T, Hq) if rng.random() < 0.7 else None,
                attn_mass=torch.zeros(NB * BS) if rng.random() < 0.7 else None)


def valid_paged_attention_plan(g, rng):
    return dict(seq_lens=torch.tensor([700, 11], dtype=torch.int32),
                cu_seqlens_q=torch.tensor([0, 1, 3], dtype=torch.int32), num_heads=4,
                num_kv_heads=2, device=torch.device("cpu"),
                partition_size=rng.choice([0, -1, 256]), max_items=40,
                max_partial_rows=-1)


def valid_paged_attention_run(g, rng):
    args = valid_attention(g, rng)
    plan = ops.plan_paged_attention(args["seq_lens"], args["cu_seqlens_q"], 4, 2, 64, "cpu",
                                    partition_size=rng.choice([-1, 4, 8]))
    return dict(**{k: v for k, v in args.items() if k not in ("k_scale", "v_scale", "lse",
                                                              "attn_mass")},
                plan=plan.plan, workspace=plan.workspace, k_scale=args["k_scale"],
                v_scale=args["v_scale"], lse=args["lse"], attn_mass=args["attn_mass"])


def valid_quantize_fp8(g, rng):
    x = torch.randn(2, 3, 8, generator=g) * 3
    return dict(out=torch.zeros(2, 3, 8, dtype=rng.choice(FP8)), input=x,
                scale=_fp8_scale(g, 3, rng.random() < 0.5))


def valid_dequantize_fp8(g, rng):
    codes = torch.randn(2, 3, 8, generator=g).to(rng.choice(FP8))
    return dict(out=torch.zeros(2, 3, 8), input=codes, scale=_fp8_scale(g, 3, rng.random() < 0.5))


def valid_copy_blocks(g, rng):
    shape = (4, 4, 2, 8)
    layout = _layout(rng)  # one block stride for every layer
    layers = [_paged(layout, torch.randn(shape, generator=g), torch.randn(shape, generator=g))
              for _ in range(2)]
    return dict(key_caches=[k for k, _ in layers], value_caches=[v for _, v in layers],
                block_mapping=torch.tensor([[0, 2], [1, 3]]))


def valid_swap_blocks(g, rng):
    return dict(src=torch.randn(3, 4, 2, 8, generator=g), dst=torch.zeros(4, 4, 2, 8),
                block_mapping=torch.tensor([[0, 1], [2, 3]]))


def _probs(g, *shape):
    return torch.softmax(torch.randn(*shape, generator=g) * 2, dim=-1)


def valid_rejection_sample(g, rng):
    B, k, V = 2, 3, 10
    return dict(draft_token_ids=torch.randint(0, V, (B, k), generator=g),
                draft_probs=_probs(g, B, k, V) if rng.random() < 0.7 else None,
                target_probs=_probs(g, B, k + 1, V),
                uniform_accept=torch.rand(B, k, generator=g),
                uniform_resample=torch.rand(B, k + 1, generator=g),
                num_draft_tokens=(torch.tensor([3, 1], dtype=torch.int32)
                                  if rng.random() < 0.5 else None))


def valid_greedy_verify(g, rng):
    B, k = 2, 3
    return dict(draft_token_ids=torch.randint(0, 4, (B, k), generator=g),
                target_token_ids=torch.randint(0, 4, (B, k + 1), generator=g),
                num_draft_tokens=(torch.tensor([2, 3], dtype=torch.int32)
                                  if rng.random() < 0.5 else None))


def _sketch(g):
    return torch.randint(0, 100, (3, 16), generator=g, dtype=torch.int32)


def valid_cms_update(g, rng):
    keys = torch.randint(-50, 50, (6,), generator=g)
    return dict(sketch=_sketch(g), keys=keys,
                increments=(torch.randint(0, 5, (6,), generator=g, dtype=torch.int32)
                            if rng.random() < 0.5 else None),
                conservative=rng.random() < 0.5)


def valid_cms_query(g, rng):
    return dict(sketch=_sketch(g), keys=torch.randint(-50, 50, (6,), generator=g))


def valid_cms_decay(g, rng):
    return dict(sketch=_sketch(g), shift=rng.randrange(32))


VALID = {
    "reshape_and_cache": valid_reshape_and_cache,
    **{name: valid_attention for name in ATTENTION},
    "paged_attention_plan": valid_paged_attention_plan,
    "paged_attention_run": valid_paged_attention_run,
    "quantize_fp8": valid_quantize_fp8,
    "dequantize_fp8": valid_dequantize_fp8,
    "copy_blocks": valid_copy_blocks,
    "swap_blocks": valid_swap_blocks,
    "rejection_sample": valid_rejection_sample,
    "greedy_verify": valid_greedy_verify,
    "cms_update": valid_cms_update,
    "cms_query": valid_cms_query,
    "cms_decay": valid_cms_decay,
}

# Arguments holding indices, and the values that are out of range for them (per valid call).
INDEX_ARGS = {"slot_mapping", "block_tables", "seq_lens", "cu_seqlens_q", "block_mapping",
              "draft_token_ids", "num_draft_tokens", "target_token_ids", "increments"}
BAD_INDEX_VALUES = (-2, -1, 3, 10, 12, 24, 48, 2 ** 31 - 1, -(2 ** 31))


def test_every_op_has_a_valid_call():
    assert set(VALID) == set(OP_NAMES)


# ------------------------------------------------------------------------------------------
# Running a call and judging the outcome

def _call(name, args):
    op = getattr(P, name).default
    return op(*[args[a] for a in _arg_names(name)])


def _reference(name, args):
    return getattr(reference, name)(*[args[a] for a in _arg_names(name)])


def _tensors_of(value):
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for t in value if isinstance(t, torch.Tensor)]
    return []


def _snapshot(name, args):
    """Bit-exact copies of every mutable argument (meta tensors have no contents)."""
    snap = {}
    for a in _mutable(name):
        for i, t in enumerate(_tensors_of(args.get(a))):
            if t.device.type != "meta" and t.layout == torch.strided:
                snap[(a, i)] = t.detach().clone().contiguous()
    return snap


def _bits(t):
    t = t.detach().resolve_conj().resolve_neg().contiguous().reshape(-1)
    return t.view(torch.uint8) if t.dtype != torch.bool else t


def _unchanged(name, args, snap):
    for (a, i), before in snap.items():
        now = _tensors_of(args[a])[i]
        if not torch.equal(_bits(now.clone()), _bits(before)):
            return f"{a}[{i}]" if isinstance(args[a], list) else a
    return None


TOL = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 1.6e-2, torch.float64: 1e-6}


def _close(actual, expected) -> bool:
    if actual.shape != expected.shape or actual.dtype != expected.dtype:
        return False
    if actual.dtype in FP8 or not actual.is_floating_point():
        return torch.equal(_bits(actual.clone()), _bits(expected.clone())) or (
            actual.is_floating_point() and torch.allclose(
                actual.float(), expected.float(), rtol=0, atol=0, equal_nan=True))
    tol = TOL.get(actual.dtype, 1e-4)
    return torch.allclose(actual.float(), expected.float(), rtol=tol, atol=tol, equal_nan=True)


SCRATCH = {"workspace"}  # written, but its contents mean nothing after the call


def judge(name, args):
    """Call the CPU op on `args`; return None if the outcome is acceptable, else a problem."""
    arg_names = _arg_names(name)
    snap = _snapshot(name, args)
    ref_args = copy.deepcopy(args)  # deepcopy keeps aliasing between arguments
    try:
        result = _call(name, args)
    except ERRORS as e:
        msg = str(e)
        if not any(_tensors_of(v) for v in args.values()) and f"pagedspec::{name}" in msg:
            return None  # no tensor left to dispatch on: the dispatcher's own error (wrappers
            # name the argument, see test_wrapper_rejects_python_level_mistakes)
        if f"pagedspec.{name}" not in msg:
            return f"error does not name the op: {type(e).__name__}: {msg[:200]}"
        if not any(a in msg for a in arg_names):
            return f"error names no argument: {msg[:200]}"
        changed = _unchanged(name, args, snap)
        if changed:
            return f"raised ({msg[:120]}) but wrote {changed}"
        return None
    devices = {t.device.type for v in args.values() for t in _tensors_of(v)}
    if "meta" in devices:  # an all-meta call runs the fake kernel: nothing to compare
        return None if devices == {"meta"} else f"accepted meta mixed with {devices}"
    try:
        expected = _reference(name, ref_args)
    except Exception as e:  # noqa: BLE001
        return f"op accepted a call the reference rejects ({type(e).__name__}: {e})"
    for a in _mutable(name) - SCRATCH:
        for i, (got, want) in enumerate(zip(_tensors_of(args[a]), _tensors_of(ref_args[a]))):
            if not _close(got, want):
                return f"{a}[{i}] differs from the reference"
    if result is not None:
        if isinstance(result, torch.Tensor):
            result, expected = (result,), (expected,)
        for i, (got, want) in enumerate(zip(result, expected)):
            if not _close(got, want.to(got.dtype) if got.dtype != want.dtype else want):
                return f"output {i} differs from the reference"
    return None


# ------------------------------------------------------------------------------------------
# Mutations: each takes (name, args, g, rng) and edits args in place, returning a label.

DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int32, torch.int64,
          torch.uint8, torch.bool, torch.float8_e4m3fn, torch.complex64)


def _tensor_slots(name, args):
    slots = []
    for a in _arg_names(name):
        v = args.get(a)
        if isinstance(v, torch.Tensor) and v.device.type != "meta":
            slots.append((a, None))
        elif isinstance(v, list):
            slots.extend((a, i) for i, t in enumerate(v)
                         if isinstance(t, torch.Tensor) and t.device.type != "meta")
    return slots


def _get(args, slot):
    a, i = slot
    return args[a] if i is None else args[a][i]


def _set(args, slot, value):
    a, i = slot
    if i is None:
        args[a] = value
    else:
        args[a] = list(args[a])
        args[a][i] = value


@torch.no_grad()
def _retype(t, dtype):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # complex -> real discards the imaginary part: intended
        if t.dtype in FP8 or dtype in FP8:
            return t.float().to(dtype)
        return t.to(dtype)


def m_dtype(name, args, g, rng):
    slot = rng.choice(_tensor_slots(name, args))
    dtype = rng.choice(DTYPES)
    _set(args, slot, _retype(_get(args, slot), dtype))
    return f"dtype {slot[0]} -> {dtype}"


def m_rank(name, args, g, rng):
    slot = rng.choice(_tensor_slots(name, args))
    t = _get(args, slot)
    if t.dim() > 0 and t.size(-1) > 0 and rng.random() < 0.5:
        _set(args, slot, t.select(-1, 0).contiguous() if rng.random() < 0.5 else t.flatten())
    else:
        _set(args, slot, t.unsqueeze(rng.randrange(t.dim() + 1)))
    return f"rank {slot[0]}"


def m_size(name, args, g, rng):
    slot = rng.choice(_tensor_slots(name, args))
    t = _get(args, slot)
    if t.dim() == 0:
        return "size (scalar kept)"
    d = rng.randrange(t.dim())
    n = max(0, t.size(d) + rng.choice([-1, 1, 2]))
    if t.size(d) == 0:
        shape = list(t.shape)
        shape[d] = n
        _set(args, slot, torch.zeros(shape, dtype=t.dtype))
    else:
        _set(args, slot, t.index_select(d, torch.arange(n) % t.size(d)))
    return f"size {slot[0]}.size({d}) -> {n}"


def m_noncontiguous(name, args, g, rng):
    """Same values, non-contiguous layout: padded last dim, or a transposed copy."""
    slot = rng.choice(_tensor_slots(name, args))
    t = _get(args, slot)
    if t.dim() >= 2 and rng.random() < 0.5:
        v = t.transpose(0, 1).contiguous().transpose(0, 1)
    else:
        v = torch.empty(*t.shape, 2, dtype=t.dtype).select(-1, 0) if t.dim() else t
        if t.dim():
            v.copy_(t)
    _set(args, slot, v)
    return f"non-contiguous {slot[0]}"


def m_bad_index(name, args, g, rng):
    slots = [s for s in _tensor_slots(name, args) if s[0] in INDEX_ARGS]
    if not slots:
        return m_dtype(name, args, g, rng)
    slot = rng.choice(slots)
    t = _get(args, slot).clone()
    if t.numel() == 0:
        return "bad index (empty)"
    value = rng.choice(BAD_INDEX_VALUES)
    if t.dtype in (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8):
        info = torch.iinfo(t.dtype)
        value = max(info.min, min(info.max, value))
    t[tuple(rng.randrange(n) for n in t.shape)] = value
    _set(args, slot, t)
    return f"index {slot[0]} <- {value}"


def m_alias(name, args, g, rng):
    """An output aliases an input (or another output) of the same shape and dtype."""
    outs = [s for s in _tensor_slots(name, args) if s[0] in _mutable(name)]
    if not outs:
        return m_dtype(name, args, g, rng)
    out = rng.choice(outs)
    target = _get(args, out)
    others = [s for s in _tensor_slots(name, args) if s != out
              and _get(args, s).shape == target.shape and _get(args, s).dtype == target.dtype]
    if not others:
        return "alias (none possible)"
    src = rng.choice(others)
    _set(args, out, _get(args, src))
    return f"alias {out[0]} = {src[0]}"


def m_overlap(name, args, g, rng):
    """An output whose rows overlap in memory (stride 0 in dim 0)."""
    outs = [s for s in _tensor_slots(name, args) if s[0] in _mutable(name)
            and _get(args, s).dim() >= 1 and _get(args, s).size(0) > 1]
    if not outs:
        return m_dtype(name, args, g, rng)
    slot = rng.choice(outs)
    t = _get(args, slot)
    _set(args, slot, t[:1].clone().expand_as(t))
    return f"overlapping {slot[0]}"


def m_meta(name, args, g, rng):
    slot = rng.choice(_tensor_slots(name, args))
    _set(args, slot, _get(args, slot).to("meta"))
    return f"meta {slot[0]}"


def m_neg_input(name, args, g, rng):
    """A float input (never an output) with the neg bit set; same values."""
    slots = [s for s in _tensor_slots(name, args) if s[0] not in _mutable(name)
             and _get(args, s).dtype in (torch.float32, torch.float16, torch.bfloat16)]
    if not slots:
        return "neg (no float input)"
    slot = rng.choice(slots)
    _set(args, slot, torch._neg_view(-_get(args, slot)))
    return f"neg-bit {slot[0]}"


def m_none(name, args, g, rng):
    """None for an optional argument (valid), or for a required tensor (invalid)."""
    schema = _schema(name)
    optional = [a.name for a in schema.arguments if a.type.kind() == "OptionalType"]
    required = [a.name for a in schema.arguments if a.type.kind() == "TensorType"]
    if optional and rng.random() < 0.7:
        pick = rng.choice(optional)
    elif required:
        pick = rng.choice(required)
    else:
        return "none (nothing)"
    args[pick] = None
    return f"None {pick}"


def m_bad_int(name, args, g, rng):
    ints = [a for a in ("max_q_len", "shift") if a in args]
    if not ints:
        return m_bad_index(name, args, g, rng)
    a = rng.choice(ints)
    args[a] = rng.choice([-1, 0, 32, 2 ** 31, -(2 ** 40)])
    return f"{a} <- {args[a]}"


def m_cu_seqlens(name, args, g, rng):
    if ("cu_seqlens_q", None) not in _tensor_slots(name, args) or args["cu_seqlens_q"].numel() < 2:
        return m_size(name, args, g, rng)
    cu = args["cu_seqlens_q"].clone()
    cu[1] = rng.choice([4, -1, 0, 3])
    args["cu_seqlens_q"] = cu
    return f"cu_seqlens_q <- {cu.tolist()}"


MUTATIONS = [m_dtype, m_rank, m_size, m_noncontiguous, m_bad_index, m_alias, m_overlap, m_meta,
             m_neg_input, m_none, m_bad_int, m_cu_seqlens]


def _fuzz_cases(name):
    rng = random.Random(f"{SEED}:{name}")
    for it in range(ITERS):
        g = torch.Generator().manual_seed(rng.randrange(2 ** 31))
        args = VALID[name](g, rng)
        labels = []
        for _ in range(1 if rng.random() < 0.7 else 2):
            if _tensor_slots(name, args):  # a mutation needs a real tensor to work on
                labels.append(rng.choice(MUTATIONS)(name, args, g, rng))
        yield it, args, labels


@pytest.mark.parametrize("name", OP_NAMES)
def test_fuzz(name):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    problems, calls = [], 0
    try:
        for it, args, labels in _fuzz_cases(name):
            calls += 1
            problem = judge(name, args)
            if problem:
                problems.append(f"#{it} {labels}: {problem}")
    finally:
        torch.set_num_threads(threads)
    assert calls > ITERS // 2
    assert not problems, "\n".join(problems[:10])


@pytest.mark.parametrize("name", OP_NAMES)
def test_valid_calls_match_the_reference(name):
    rng = random.Random(f"valid:{SEED}:{name}")
    for _ in range(5):
        args = VALID[name](torch.Generator().manual_seed(rng.randrange(2 ** 31)), rng)
        assert judge(name, args) is None


# ------------------------------------------------------------------------------------------
# Fake kernels: reject what the CPU kernel rejects (on meta copies), accept good calls


def _to_meta(value):
    if isinstance(value, torch.Tensor):
        return value.to("meta")
    if isinstance(value, list):
        return [_to_meta(v) for v in value]
    return value


def _bad(name, **changes):
    def build():
        rng = random.Random(0)
        args = VALID[name](torch.Generator().manual_seed(0), rng)
        for key, value in changes.items():
            args[key] = value(args) if callable(value) else value
        return args
    return name, build


def _fp8_cache(a):
    return a["key_cache"].float().to(torch.float8_e4m3fn)


BAD_SHAPES = [
    ("reshape_and_cache key dtype", *_bad("reshape_and_cache", key=lambda a: a["key"].double())),
    ("reshape_and_cache value shape", *_bad("reshape_and_cache", value=lambda a: a["value"][:2])),
    ("reshape_and_cache heads", *_bad("reshape_and_cache", key=lambda a: a["key"][:, :1],
                                      value=lambda a: a["value"][:, :1])),
    ("reshape_and_cache key last dim", *_bad("reshape_and_cache",
                                             key=lambda a: a["key"].transpose(1, 2).contiguous()
                                             .transpose(1, 2))),
    ("reshape_and_cache cache rank", *_bad("reshape_and_cache",
                                           key_cache=lambda a: a["key_cache"][0])),
    ("reshape_and_cache cache dtype", *_bad("reshape_and_cache",
                                            value_cache=lambda a: a["value_cache"].half())),
    ("reshape_and_cache slots dtype", *_bad("reshape_and_cache",
                                            slot_mapping=lambda a: a["slot_mapping"].int())),
    ("reshape_and_cache slots size", *_bad("reshape_and_cache",
                                           slot_mapping=lambda a: a["slot_mapping"][:3])),
    ("reshape_and_cache scale shape", *_bad("reshape_and_cache", key_cache=_fp8_cache,
                                            value_cache=_fp8_cache, k_scale=torch.ones(5))),
    ("reshape_and_cache scale dtype", *_bad("reshape_and_cache", key_cache=_fp8_cache,
                                            value_cache=_fp8_cache,
                                            v_scale=torch.ones((), dtype=torch.float64))),
    ("attention query dtype", *_bad("paged_attention", query=lambda a: a["query"].double(),
                                    out=lambda a: a["out"].double())),
    ("attention out shape", *_bad("paged_attention", out=lambda a: a["out"][:2])),
    ("attention out dtype", *_bad("paged_attention_v1", out=lambda a: a["out"].half())),
    ("attention head size", *_bad("paged_attention_v2",
                                  query=lambda a: a["query"][..., :32].contiguous(),
                                  out=lambda a: a["out"][..., :32].contiguous())),
    ("attention block size", *_bad("paged_attention",
                                   key_cache=lambda a: a["key_cache"][:, :6].contiguous(),
                                   value_cache=lambda a: a["value_cache"][:, :6].contiguous())),
    ("attention heads", *_bad("paged_attention", query=lambda a: a["query"][:, :3].contiguous(),
                              out=lambda a: a["out"][:, :3].contiguous())),
    ("attention cache contiguity", *_bad("paged_attention",
                                         key_cache=lambda a: a["key_cache"].transpose(0, 1)
                                         .contiguous().transpose(0, 1))),
    ("attention tables dtype", *_bad("paged_attention",
                                     block_tables=lambda a: a["block_tables"].long())),
    ("attention tables rows", *_bad("paged_attention",
                                    block_tables=lambda a: a["block_tables"][:1])),
    ("attention cu_seqlens size", *_bad("paged_attention",
                                        cu_seqlens_q=lambda a: a["cu_seqlens_q"][:2])),
    ("attention max_q_len", *_bad("paged_attention", max_q_len=-1)),
    ("attention lse shape", *_bad("paged_attention", lse=torch.zeros(3, 5))),
    ("attention attn_mass dtype", *_bad("paged_attention",
                                        attn_mass=torch.zeros(48, dtype=torch.float64))),
    ("attention k_scale shape", *_bad("paged_attention", key_cache=_fp8_cache,
                                      value_cache=lambda a: a["value_cache"].float().to(
                                          torch.float8_e4m3fn), k_scale=torch.ones(3))),
    ("quantize out dtype", *_bad("quantize_fp8", out=lambda a: a["out"].float())),
    ("quantize shape", *_bad("quantize_fp8", out=lambda a: a["out"][:1])),
    ("quantize scale shape", *_bad("quantize_fp8", scale=torch.ones(2))),
    ("quantize scale dtype", *_bad("quantize_fp8", scale=torch.ones((), dtype=torch.float64))),
    ("dequantize input dtype", *_bad("dequantize_fp8", input=lambda a: a["input"].float())),
    ("dequantize contiguity", *_bad("dequantize_fp8",
                                    out=lambda a: a["out"].transpose(0, 1).contiguous()
                                    .transpose(0, 1))),
    ("copy_blocks lengths", *_bad("copy_blocks", value_caches=lambda a: a["value_caches"][:1])),
    ("copy_blocks layer shape", *_bad("copy_blocks", value_caches=lambda a: [
        a["value_caches"][0], a["value_caches"][1][:3]])),
    ("copy_blocks mapping shape", *_bad("copy_blocks", block_mapping=torch.zeros(2, 3,
                                                                            dtype=torch.long))),
    ("copy_blocks mapping dtype", *_bad("copy_blocks",
                                        block_mapping=lambda a: a["block_mapping"].int())),
    ("swap_blocks block shape", *_bad("swap_blocks", dst=torch.zeros(4, 4, 2, 4))),
    ("swap_blocks dtype", *_bad("swap_blocks", dst=torch.zeros(4, 4, 2, 8).half())),
    ("swap_blocks mapping rank", *_bad("swap_blocks", block_mapping=torch.zeros(4,
                                                                            dtype=torch.long))),
    ("rejection ids rank", *_bad("rejection_sample",
                                 draft_token_ids=lambda a: a["draft_token_ids"].view(-1))),
    ("rejection target rows", *_bad("rejection_sample",
                                    target_probs=lambda a: a["target_probs"][:, :3].contiguous())),
    ("rejection draft vocab", *_bad("rejection_sample", draft_probs=torch.rand(2, 3, 9))),
    ("rejection uniform shape", *_bad("rejection_sample", uniform_accept=torch.rand(2, 4))),
    ("rejection counts dtype", *_bad("rejection_sample",
                                     num_draft_tokens=torch.tensor([1, 1]))),
    ("greedy target shape", *_bad("greedy_verify", target_token_ids=torch.zeros(2, 3,
                                                                               dtype=torch.long))),
    ("greedy counts size", *_bad("greedy_verify",
                                 num_draft_tokens=torch.tensor([1], dtype=torch.int32))),
    ("cms_update sketch depth", *_bad("cms_update",
                                      sketch=torch.zeros(17, 4, dtype=torch.int32))),
    ("cms_update increments size", *_bad("cms_update",
                                         increments=torch.ones(5, dtype=torch.int32))),
    ("cms_query keys dtype", *_bad("cms_query", keys=lambda a: a["keys"].int())),
    ("cms_query sketch rank", *_bad("cms_query", sketch=lambda a: a["sketch"][0])),
    ("cms_decay shift", *_bad("cms_decay", shift=32)),
]


def _message_argument(e) -> str:
    """The argument a 'pagedspec.<op>: <argument> ...' message starts with."""
    return str(e).split(": ", 1)[1].split()[0]


@pytest.mark.parametrize("what, name, build", BAD_SHAPES, ids=[b[0] for b in BAD_SHAPES])
def test_fake_rejects_what_the_cpu_kernel_rejects(what, name, build):
    with pytest.raises(RuntimeError, match=f"pagedspec.{name}: ") as cpu:
        _call(name, build())
    meta_args = {k: _to_meta(v) for k, v in build().items()}
    with pytest.raises(RuntimeError, match=f"pagedspec.{name}: ") as fake:
        _call(name, meta_args)
    assert _message_argument(fake.value) == _message_argument(cpu.value)


@pytest.mark.parametrize("name", OP_NAMES)
def test_fake_accepts_valid_calls_and_rejects_meta_mixed_with_cpu(name):
    rng = random.Random(1)
    args = VALID[name](torch.Generator().manual_seed(1), rng)
    meta_args = {k: _to_meta(v) for k, v in args.items()}
    result = _call(name, meta_args)
    if result is not None:
        cpu_result = _call(name, copy.deepcopy(args))
        for got, want in zip(result, cpu_result):
            assert got.device.type == "meta"
            assert (got.shape, got.dtype) == (want.shape, want.dtype)
    for slot in _tensor_slots(name, args) if len(_tensor_slots(name, args)) > 1 else ():
        mixed = dict(args)
        _set(mixed, slot, _get(args, slot).to("meta"))
        with pytest.raises(RuntimeError, match=f"pagedspec.{name}: .*meta"):
            _call(name, mixed)


OPCHECK = ("test_schema", "test_faketensor", "test_autograd_registration")


@pytest.mark.parametrize("name", OP_NAMES)
def test_opcheck_on_valid_calls(name):
    rng = random.Random(2)
    args = VALID[name](torch.Generator().manual_seed(2), rng)
    # test_schema compares tensors with arithmetic torch lacks for FP8 (see test_fp8.py).
    has_fp8 = any(t.dtype in FP8 for v in args.values() for t in _tensors_of(v))
    torch.library.opcheck(getattr(P, name).default, tuple(args[a] for a in _arg_names(name)),
                          test_utils=OPCHECK[1:] if has_fp8 else OPCHECK)


# ------------------------------------------------------------------------------------------
# pagedspec.ops wrappers: Python-level mistakes raise RuntimeError naming the op and argument


def _valid(name):
    return VALID[name](torch.Generator().manual_seed(3), random.Random(3))


def _attention_with(**changes):
    args = {**_valid("paged_attention"), **changes}
    return lambda: ops.paged_attention(**args)


WRAPPER_MISTAKES = [
    ("paged_attention_plan heads None", "paged_attention_plan", "num_heads",
     lambda: ops.paged_attention_plan(torch.zeros(1, dtype=torch.int32),
                                      torch.zeros(2, dtype=torch.int32), None, 1, "cpu")),
    ("paged_attention_run plan None", "paged_attention_run", "plan",
     lambda: ops.paged_attention_run(*[torch.zeros(1)] * 7, 1, 0.1, None, torch.zeros(1))),
    ("rejection_sample 1-D ids", "rejection_sample", "draft_token_ids",
     lambda: ops.rejection_sample(torch.zeros(3, dtype=torch.long), None, torch.rand(1, 4, 5))),
    ("rejection_sample target None", "rejection_sample", "target_probs",
     lambda: ops.rejection_sample(torch.zeros(1, 3, dtype=torch.long), None, None)),
    ("rejection_sample generator", "rejection_sample", "generator",
     lambda: ops.rejection_sample(torch.zeros(1, 3, dtype=torch.long), None,
                                  torch.rand(1, 4, 5), generator=7)),
    ("rejection_sample draft_probs list", "rejection_sample", "draft_probs",
     lambda: ops.rejection_sample(torch.zeros(1, 3, dtype=torch.long), [0.5],
                                  torch.rand(1, 4, 5))),
    ("attention max_q_len None", "paged_attention", "max_q_len", _attention_with(max_q_len=None)),
    ("attention max_q_len float", "paged_attention", "max_q_len", _attention_with(max_q_len=1.5)),
    ("attention scale str", "paged_attention", "scale", _attention_with(scale="0.1")),
    ("attention query None", "paged_attention", "query", _attention_with(query=None)),
    ("attention lse list", "paged_attention", "lse", _attention_with(lse=[0.0])),
    ("reshape_and_cache slots list", "reshape_and_cache", "slot_mapping",
     lambda: ops.reshape_and_cache(**{**_valid("reshape_and_cache"), "slot_mapping": [0, 1]})),
    ("quantize scale float", "quantize_fp8", "scale",
     lambda: ops.quantize_fp8(**{**_valid("quantize_fp8"), "scale": 2.0})),
    ("dequantize out None", "dequantize_fp8", "out",
     lambda: ops.dequantize_fp8(**{**_valid("dequantize_fp8"), "out": None})),
    ("copy_blocks tensor as list", "copy_blocks", "key_caches",
     lambda: ops.copy_blocks(torch.zeros(2, 4, 4, 2, 8), [], torch.zeros(0, 2, dtype=torch.long))),
    ("copy_blocks None layer", "copy_blocks", "value_caches[0]",
     lambda: ops.copy_blocks([torch.zeros(4, 4, 2, 8)], [None], torch.zeros(0, 2,
                                                                           dtype=torch.long))),
    ("swap_blocks mapping list", "swap_blocks", "block_mapping",
     lambda: ops.swap_blocks(torch.zeros(2, 8), torch.zeros(2, 8), [[0, 1]])),
    ("greedy target None", "greedy_verify", "target_token_ids",
     lambda: ops.greedy_verify(torch.zeros(1, 3, dtype=torch.long), None)),
    ("cms_update conservative str", "cms_update", "conservative",
     lambda: ops.cms_update(**{**_valid("cms_update"), "conservative": "yes"})),
    ("cms_query keys list", "cms_query", "keys",
     lambda: ops.cms_query(torch.zeros(2, 4, dtype=torch.int32), [1, 2])),
    ("cms_decay shift None", "cms_decay", "shift",
     lambda: ops.cms_decay(torch.zeros(2, 4, dtype=torch.int32), None)),
    ("cms_decay shift float", "cms_decay", "shift",
     lambda: ops.cms_decay(torch.zeros(2, 4, dtype=torch.int32), 1.0)),
    ("cms_decay sketch None", "cms_decay", "sketch", lambda: ops.cms_decay(None)),
]


@pytest.mark.parametrize("what, name, arg, call", WRAPPER_MISTAKES,
                         ids=[w[0] for w in WRAPPER_MISTAKES])
def test_wrapper_rejects_python_level_mistakes(what, name, arg, call):
    with pytest.raises(RuntimeError) as info:
        call()
    assert str(info.value).startswith(f"pagedspec.{name}: {arg} "), str(info.value)


def test_every_wrapper_has_a_python_level_mistake_case():
    assert {w[1] for w in WRAPPER_MISTAKES} == set(OP_NAMES) - {"paged_attention_v1",
                                                                "paged_attention_v2"}


# ==========================================================================================
# Regression cases from the first fuzzer run (15,218 mutated calls) and from this one: each
# reproduces one finding, fixed, so that it stays fixed.
# ==========================================================================================

def _raises_naming(name, arg, fn):
    with pytest.raises(ERRORS) as info:
        fn()
    msg = str(info.value)
    assert f"pagedspec.{name}" in msg and arg in msg, msg


# Cases that may crash the process: run in one subprocess, each in a forked child, reporting the
# child's exit status (0: raised a clear error, 3: returned, 4: wrong error, or -signal).
CRASH_CASES = {}


def _crash_case(fn):
    CRASH_CASES[fn.__name__] = fn
    return fn


@_crash_case
def crash_fp8_quantize_expanded_scale():
    x = torch.zeros(1, 1 << 24, 1)
    P.quantize_fp8(torch.empty(1, 1 << 24, 1, dtype=torch.float8_e4m3fn), x,
                   torch.tensor([2.0]).expand(1 << 24))


@_crash_case
def crash_fp8_dequantize_expanded_scale():
    x = torch.zeros(1, 1 << 24, 1, dtype=torch.float8_e4m3fn)
    P.dequantize_fp8(torch.empty(1, 1 << 24, 1), x, torch.tensor([2.0]).expand(1 << 24))


@_crash_case
def crash_swap_blocks_conj_dst():
    src = torch.zeros(3, 8, dtype=torch.complex64)
    P.swap_blocks(src, torch.zeros(3, 8, dtype=torch.complex64).conj(), torch.tensor([[0, 1]]))


@_crash_case
def crash_attention_neg_bit_lse():
    args = valid_attention(torch.Generator().manual_seed(0), random.Random(0))
    args["lse"] = torch.zeros(3, 4, dtype=torch.complex64).conj().imag
    _call("paged_attention", args)


@_crash_case
def crash_attention_2_31_stride0_heads():
    heads = 1 << 31
    query = torch.randn(1, 1, 64).expand(1, heads, 64)
    out = torch.zeros(1, 1, 64).expand(1, heads, 64)
    cache = torch.randn(2, 8, 1, 64)
    P.paged_attention(out, query, cache, cache.clone(), torch.tensor([[0]], dtype=torch.int32),
                      torch.tensor([3], dtype=torch.int32),
                      torch.tensor([0, 1], dtype=torch.int32), 1, 0.125)


_DRIVER = textwrap.dedent("""
    import json, os, sys
    sys.path.insert(0, {tests!r})
    import torch
    torch.set_num_threads(1)
    import test_fuzz
    results = {{}}
    for name in {names!r}:
        pid = os.fork()
        if pid == 0:
            code = 3
            try:
                test_fuzz.CRASH_CASES[name]()
            except (RuntimeError, TypeError, ValueError) as e:
                code = 0 if 'pagedspec.' in str(e) else 4
            except BaseException:
                code = 4
            os._exit(code)
        _, status = os.waitpid(pid, 0)
        results[name] = os.waitstatus_to_exitcode(status)
    print('RESULTS ' + json.dumps(results))
""")


@pytest.fixture(scope="module")
def crash_results():
    script = _DRIVER.format(tests=os.path.dirname(os.path.abspath(__file__)),
                            names=sorted(CRASH_CASES))
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULTS ")]
    assert line, f"driver failed: rc={proc.returncode}\n{proc.stderr[-2000:]}"
    return json.loads(line[0][len("RESULTS "):])


@pytest.mark.parametrize("case", [
    pytest.param("crash_fp8_quantize_expanded_scale"),
    pytest.param("crash_fp8_dequantize_expanded_scale"),
    pytest.param("crash_swap_blocks_conj_dst"),
    pytest.param("crash_attention_neg_bit_lse"),
    pytest.param("crash_attention_2_31_stride0_heads"),
])
def test_crash_prone_call_raises_cleanly(crash_results, case):
    assert crash_results[case] == 0, f"exit status {crash_results[case]} " \
        "(3: returned without error, 4: unclear error, negative: killed by that signal)"


def test_every_crash_case_is_checked():
    assert len(CRASH_CASES) == 5


@pytest.mark.parametrize("name", ["quantize_fp8", "dequantize_fp8"])
def test_fp8_strided_scale(name):
    args = (valid_quantize_fp8 if name == "quantize_fp8" else valid_dequantize_fp8)(
        torch.Generator().manual_seed(0), random.Random(0))
    args["input"], args["out"] = args["input"][:, :2].contiguous(), args["out"][:, :2].contiguous()
    args["scale"] = torch.tensor([1.0, 9, 2, 9])[::2]
    _raises_naming(name, "scale", lambda: _call(name, args))


@pytest.mark.parametrize("name", ATTENTION)
def test_attention_out_rows_overlap(name):
    args = valid_attention(torch.Generator().manual_seed(0), random.Random(0))
    args["out"] = torch.zeros(1, *args["out"].shape[1:]).expand_as(args["out"])
    _raises_naming(name, "out", lambda: _call(name, args))


@pytest.mark.parametrize("name", ATTENTION)
def test_attention_out_aliases_query_with_attn_mass(name):
    args = valid_attention(torch.Generator().manual_seed(0), random.Random(0))
    args["attn_mass"] = torch.zeros(args["key_cache"].shape[0] * args["key_cache"].shape[1])
    expected = copy.deepcopy(args)
    _reference(name, expected)
    args["out"] = args["query"]
    try:
        _call(name, args)
    except ERRORS as e:
        assert f"pagedspec.{name}" in str(e) and ("out" in str(e) or "query" in str(e))
        return
    torch.testing.assert_close(args["attn_mass"], expected["attn_mass"], rtol=1e-4, atol=1e-5)


def test_duplicate_slots():
    args = valid_reshape_and_cache(torch.Generator().manual_seed(0), random.Random(0))
    args["slot_mapping"] = torch.tensor([1, 5, 1, -1])
    _raises_naming("reshape_and_cache", "slot_mapping", lambda: _call("reshape_and_cache", args))


BAD_SCALES = [0.0, float("inf"), float("nan")]


@pytest.mark.parametrize("value", BAD_SCALES)
@pytest.mark.parametrize("which", ["k_scale", "v_scale"])
@pytest.mark.parametrize("name, valid", [("reshape_and_cache", valid_reshape_and_cache),
                                         ("paged_attention", valid_attention)])
def test_bad_fp8_cache_scale(name, valid, which, value):
    args = valid(torch.Generator().manual_seed(0), random.Random(0))
    args["key_cache"] = args["key_cache"].to(torch.float8_e4m3fn)
    args["value_cache"] = args["value_cache"].to(torch.float8_e4m3fn)
    args["k_scale"], args["v_scale"] = torch.tensor(0.5), torch.tensor(0.5)
    args[which] = torch.tensor(value)
    _raises_naming(name, which, lambda: _call(name, args))


@pytest.mark.parametrize("value", BAD_SCALES)
@pytest.mark.parametrize("name", ["quantize_fp8", "dequantize_fp8"])
def test_fp8_convert_bad_scale(name, value):
    args = (valid_quantize_fp8 if name == "quantize_fp8" else valid_dequantize_fp8)(
        torch.Generator().manual_seed(0), random.Random(0))
    args["scale"] = torch.tensor(value)
    _raises_naming(name, "scale", lambda: _call(name, args))


@pytest.mark.parametrize("value", [0.0, -0.125, float("inf"), float("nan"), 3e38, 1e300])
@pytest.mark.parametrize("name", ATTENTION)
def test_attention_bad_softmax_scale(name, value):
    args = valid_attention(torch.Generator().manual_seed(0), random.Random(0))
    args["scale"] = value
    _raises_naming(name, "scale", lambda: _call(name, args))


@pytest.mark.parametrize("name", ATTENTION)
def test_cu_seqlens_not_monotonic_named(name):
    args = valid_attention(torch.Generator().manual_seed(0), random.Random(0))
    args["cu_seqlens_q"] = torch.tensor([0, 4, 3], dtype=torch.int32)
    args["max_q_len"] = 1
    _raises_naming(name, "cu_seqlens_q", lambda: _call(name, args))


SPARSE = [
    ("cms_query", "keys"),
    ("cms_update", "sketch"),
    ("swap_blocks", "src"),
    ("paged_attention", "query"),
    ("reshape_and_cache", "slot_mapping"),
    ("greedy_verify", "target_token_ids"),
]


@pytest.mark.parametrize("name, arg", SPARSE)
def test_sparse_argument_is_named(name, arg):
    args = VALID[name](torch.Generator().manual_seed(0), random.Random(0))
    args[arg] = args[arg].to_sparse()
    _raises_naming(name, arg, lambda: _call(name, args))


def test_undefined_tensors_named():
    # Found by this fuzzer: with src and dst both undefined, swap_blocks reports
    # "Cannot report itemsize of Tensor that doesn't have initialized dtype" (no op, no argument).
    _raises_naming("swap_blocks", "src",
                   lambda: P.swap_blocks(None, None, torch.tensor([[0, 1]])))


# Attention and sketch edge semantics, found by a fuzzer run with values the mutations above do
# not make.

@pytest.mark.parametrize("name", ATTENTION)
def test_attention_nan_query_row_is_nan(name):
    """A NaN in one query row gave that row a finite output (AVX2 clamps NaN weights to 2^-126):
    now NaN out and lse for that (token, head), NaN mass wherever it looks, as the reference."""
    for seed in range(4):
        args = valid_attention(torch.Generator().manual_seed(seed), random.Random(seed))
        args["lse"], args["attn_mass"] = torch.zeros(3, 4), torch.zeros(6 * 8)
        args["query"][1, seed % 4, 7 * seed] = float("nan")
        assert judge(name, args) is None
        assert args["out"][1, seed % 4].isnan().all() and args["lse"][1, seed % 4].isnan()
        assert not args["out"][[0, 2]].isnan().any() and args["attn_mass"].isnan().any()


@pytest.mark.parametrize("scale", [1e10, 1e20, 1e30, 1e36])
@pytest.mark.parametrize("name", ATTENTION)
def test_attention_huge_scale_matches_reference(name, scale):
    """Logits of 1e11 to 1e37: attn_mass through an LSE rounded to float32 was 0 or inf at the
    largest weight (and lse inf where the log2-domain logit overflowed); now as the reference."""
    for seed in range(6):
        args = valid_attention(torch.Generator().manual_seed(seed), random.Random(seed))
        args["lse"], args["attn_mass"] = torch.zeros(3, 4), torch.zeros(6 * 8)
        args["scale"] = scale
        assert judge(name, args) is None, seed
        assert torch.isfinite(args["attn_mass"]).all()


@pytest.mark.parametrize("alias", ["keys", "increments"])
def test_cms_update_input_in_sketch_memory(alias):
    """keys (or increments) as a view of the sketch's memory gave results other than the
    reference's: now an error naming the argument."""
    args = valid_cms_update(torch.Generator().manual_seed(0), random.Random(0))
    flat = args["sketch"].view(-1)
    if alias == "keys":
        args["keys"] = flat.view(torch.int64)[:6]
    else:
        args["increments"] = flat[10:16]
    _raises_naming("cms_update", alias, lambda: _call("cms_update", args))
    assert judge("cms_update", args) is None  # and the sketch is left unwritten
