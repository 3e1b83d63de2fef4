"""Every op rejects tensor arguments that are not plain dense tensors (conjugate or negative bit,
efficient zero tensors, sparse layouts) with an error naming the argument, before torch's
math-bits fallback runs: that fallback cannot write back into the `()`-returning ops' buffers and
left the process to abort later with a corrupted heap."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch

import pagedspec  # noqa: F401  (registers the ops)


def _attention_args(gen):
    heads, kv_heads, head_size = 4, 2, 64
    return dict(
        out=torch.empty(2, heads, head_size), query=torch.randn(2, heads, head_size, generator=gen),
        key_cache=torch.randn(2, 8, kv_heads, head_size, generator=gen),
        value_cache=torch.randn(2, 8, kv_heads, head_size, generator=gen),
        block_tables=torch.tensor([[0, 1], [1, 0]], dtype=torch.int32),
        seq_lens=torch.tensor([5, 12], dtype=torch.int32),
        cu_seqlens_q=torch.tensor([0, 1, 2], dtype=torch.int32), max_q_len=1, scale=0.125,
        k_scale=torch.ones(()), v_scale=torch.ones(()), lse=torch.empty(2, heads),
        attn_mass=torch.zeros(16))


def _verify_args(gen):
    batch, k, vocab = 2, 3, 50
    probs = lambda *shape: torch.softmax(torch.randn(*shape, generator=gen), -1)
    return dict(draft_token_ids=torch.randint(0, vocab, (batch, k), generator=gen),
                draft_probs=probs(batch, k, vocab), target_probs=probs(batch, k + 1, vocab),
                uniform_accept=torch.rand(batch, k, generator=gen),
                uniform_resample=torch.rand(batch, k + 1, generator=gen),
                num_draft_tokens=torch.tensor([3, 1], dtype=torch.int32))


# op -> a valid call's arguments by schema name (fresh random data per call).
VALID_ARGS = {
    "reshape_and_cache": lambda gen: dict(
        key=torch.randn(3, 2, 64, generator=gen), value=torch.randn(3, 2, 64, generator=gen),
        key_cache=torch.zeros(2, 8, 2, 64, dtype=torch.float8_e4m3fn),
        value_cache=torch.zeros(2, 8, 2, 64, dtype=torch.float8_e4m3fn),
        slot_mapping=torch.tensor([4, -1, 9]), k_scale=torch.ones(2), v_scale=torch.ones(())),
    "paged_attention_v1": _attention_args,
    "paged_attention_v2": _attention_args,
    "paged_attention": _attention_args,
    "quantize_fp8": lambda gen: dict(out=torch.empty(3, 4, 16, dtype=torch.float8_e5m2),
                                     input=torch.randn(3, 4, 16, generator=gen),
                                     scale=torch.rand(4, generator=gen) + 0.5),
    "dequantize_fp8": lambda gen: dict(out=torch.empty(3, 4, 16),
                                       input=torch.randn(3, 4, 16, generator=gen).to(torch.float8_e5m2),
                                       scale=torch.rand((), generator=gen) + 0.5),
    "copy_blocks": lambda gen: dict(key_caches=[torch.randn(4, 8, 2, 16, generator=gen) for _ in range(2)],
                                    value_caches=[torch.randn(4, 8, 2, 16, generator=gen) for _ in range(2)],
                                    block_mapping=torch.tensor([[0, 1], [0, 3]])),
    "swap_blocks": lambda gen: dict(src=torch.randn(4, 8, 16, generator=gen), dst=torch.zeros(3, 8, 16),
                                    block_mapping=torch.tensor([[3, 0], [1, 2]])),
    "rejection_sample": _verify_args,
    "greedy_verify": lambda gen: dict(
        draft_token_ids=torch.randint(0, 9, (2, 3), generator=gen),
        target_token_ids=torch.randint(0, 9, (2, 4), generator=gen),
        num_draft_tokens=torch.tensor([3, 2], dtype=torch.int32)),
    "cms_update": lambda gen: dict(sketch=torch.zeros(2, 64, dtype=torch.int32),
                                   keys=torch.randint(-100, 100, (5,), generator=gen),
                                   increments=torch.randint(0, 9, (5,), generator=gen, dtype=torch.int32),
                                   conservative=True),
    "cms_query": lambda gen: dict(sketch=torch.randint(0, 9, (2, 64), generator=gen, dtype=torch.int32),
                                  keys=torch.randint(-100, 100, (5,), generator=gen)),
    "cms_decay": lambda gen: dict(sketch=torch.randint(0, 99, (2, 64), generator=gen, dtype=torch.int32),
                                  shift=2),
}


def _call(name: str, args: dict):
    op = getattr(torch.ops.pagedspec, name).default
    return op(*[args[a.name] for a in op._schema.arguments])


def _tensor_slots(args: dict):
    """(argument label, getter, setter) for every tensor argument, list elements included."""
    for key, value in args.items():
        if isinstance(value, torch.Tensor):
            yield key, value, lambda t, key=key: args.__setitem__(key, t)
        elif isinstance(value, list):
            for i, t in enumerate(value):
                yield f"{key}[{i}]", t, lambda t, key=key, i=i: args[key].__setitem__(i, t)


def _unplain(t: torch.Tensor, kind: str) -> torch.Tensor:
    if kind == "conjugate":  # a complex view with the conjugate bit (dtype is wrong too: the
        return torch.zeros(t.shape, dtype=torch.complex64).conj()  # guard must speak first)
    if kind == "negative":
        return torch._neg_view(t.clone())
    if kind == "zero":
        return torch._efficientzerotensor(t.shape, dtype=t.dtype)
    if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        return torch.zeros(t.shape).to_sparse()  # FP8 has no sparse kernels; dtype is secondary
    return t.to_sparse()


KINDS = {"conjugate": "a tensor with the conjugate bit set", "negative": "a tensor with the negative bit set",
         "zero": "an efficient zero tensor", "sparse": "a tensor with layout Sparse"}


@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("name", sorted(VALID_ARGS))
def test_unplain_tensor_arguments_are_rejected_by_name(name, kind, gen):
    assert {a.name for a in getattr(torch.ops.pagedspec, name).default._schema.arguments} == \
        set(VALID_ARGS[name](gen)), "VALID_ARGS names every schema argument"
    _call(name, VALID_ARGS[name](gen))  # the valid call runs
    labels = [label for label, _, _ in _tensor_slots(VALID_ARGS[name](gen))]
    assert labels
    for label in labels:
        args = VALID_ARGS[name](gen)
        for other, t, put in _tensor_slots(args):
            if other == label:
                put(_unplain(t, kind))
        pattern = (rf"pagedspec\.{name}: {re.escape(label)} must be a "
                   rf"plain dense tensor \(no conjugate/negative bit\), got {KINDS[kind]}")
        with pytest.raises(RuntimeError, match=pattern):
            _call(name, args)


def test_conjugate_lse_view_of_attention_is_rejected(gen):
    """The review's case: a `.conj().imag` view (float32 with the negative bit) as lse."""
    args = _attention_args(gen)
    args["lse"] = torch.zeros(2, 4, dtype=torch.complex64).conj().imag
    assert args["lse"].is_neg()
    with pytest.raises(RuntimeError, match=r"paged_attention: lse must be a plain dense tensor"):
        _call("paged_attention", args)


@pytest.mark.parametrize("case", ["swap_blocks_conj_dst", "attention_neg_lse"])
def test_math_bit_arguments_no_longer_corrupt_the_heap(case):
    """The reproducers ran torch's math-bits fallback, which asserted and left a corrupted heap
    (the process aborted at a later allocation). Now the call raises and the process exits
    cleanly, after plenty of further allocations."""
    calls = {
        "swap_blocks_conj_dst": (
            "src = torch.zeros(3, 8, dtype=torch.complex64)\n"
            "dst = torch.zeros(3, 8, dtype=torch.complex64).conj()\n"
            "call = lambda: ops.swap_blocks(src, dst, torch.tensor([[0, 1]]))\n"),
        "attention_neg_lse": (
            "q = torch.randn(2, 4, 64); kc = torch.randn(2, 8, 2, 64)\n"
            "i32 = lambda *v: torch.tensor(v, dtype=torch.int32)\n"
            "lse = torch.zeros(2, 4, dtype=torch.complex64).conj().imag\n"
            "call = lambda: ops.paged_attention(torch.empty_like(q), q, kc, kc.clone(),\n"
            "    i32([0, 1], [1, 0]), i32(5, 12), i32(0, 1, 2), 1, 0.125, lse=lse)\n"),
    }
    code = ("import torch\nfrom pagedspec import ops\n" + calls[case] +
            "for _ in range(3):\n"
            "    try:\n        call()\n    except RuntimeError as e:\n        message = str(e)\n"
            "junk = [torch.randn(1000 + i) for i in range(2000)]\n"
            "print(message)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ))
    assert proc.returncode == 0, proc
    assert "must be a plain dense tensor (no conjugate/negative bit)" in proc.stdout, proc
