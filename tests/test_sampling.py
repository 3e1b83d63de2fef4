"""rejection_sample and greedy_verify: against the reference by example, and exact in
distribution by chi-square tests strong enough to reject two classic wrong samplers."""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from scipy import stats

from pagedspec import ops, reference
from conftest import DEVICES, requires_cuda

# Statistical tests. The correct sampler must pass every check with p-value >= P_PASS (a false
# alarm has probability 1e-4 per check for a correct sampler; the seeds are fixed, so the outcome
# is reproducible); the deliberately wrong samplers must be rejected with p-value < P_REJECT.
P_PASS = 1e-4
P_REJECT = 1e-6
NUM_SAMPLES = 200_000

OPCHECK_UTILS = ("test_schema", "test_faketensor", "test_autograd_registration")


# ----------------------------------------------------------------------------------------------
# Helpers


def _softmax(logits: torch.Tensor) -> torch.Tensor:
    return torch.softmax(logits.double(), dim=-1).float()


def _random_inputs(gen, batch, k, vocab, *, one_hot_draft=False, sparse=False, with_counts=True):
    """Realistic verification inputs: the draft is the target's logits plus noise (so both
    acceptances and rejections happen), draft tokens are sampled from the draft, and with
    `sparse` a third of every row is exactly zero (top-k / top-p truncated distributions)."""
    target_logits = torch.randn(batch, k + 1, vocab, generator=gen) * 2
    draft_logits = target_logits[:, :k] + torch.randn(batch, k, vocab, generator=gen)
    if sparse:
        target_logits[torch.rand(target_logits.shape, generator=gen) < 1 / 3] = -float("inf")
        draft_logits[torch.rand(draft_logits.shape, generator=gen) < 1 / 3] = -float("inf")
        target_logits[..., 0] = 0.0  # keep every row non-empty
        draft_logits[..., 0] = 0.0
    target = _softmax(target_logits)
    draft = _softmax(draft_logits)
    ids = torch.multinomial(draft.reshape(-1, vocab), 1, generator=gen).reshape(batch, k)
    counts = None
    if with_counts:
        counts = torch.randint(0, k + 1, (batch,), generator=gen, dtype=torch.int32)
        counts[: batch // 2] = k  # half the requests use every draft position
    return dict(
        draft_token_ids=ids,
        draft_probs=None if one_hot_draft else draft,
        target_probs=target,
        uniform_accept=torch.rand(batch, k, generator=gen),
        uniform_resample=torch.rand(batch, k + 1, generator=gen),
        num_draft_tokens=counts,
    )


def _to(inputs: dict, device) -> dict:
    return {name: t.to(device) if t is not None else None for name, t in inputs.items()}


def _sampling_rows(inputs: dict, num_accepted: torch.Tensor) -> torch.Tensor:
    """float32 [B, V]: the weights the emitted token of each request is drawn from (residual at a
    rejection, or the target row when that has no mass or for the bonus token)."""
    ids, draft = inputs["draft_token_ids"], inputs["draft_probs"]
    target = inputs["target_probs"]
    batch, k = ids.shape
    counts = (inputs["num_draft_tokens"].long() if inputs["num_draft_tokens"] is not None
              else torch.full((batch,), k))
    acc = num_accepted.long().cpu()
    rows = torch.arange(batch)
    target_row = target.cpu()[rows, acc]
    draft = draft.cpu() if draft is not None else None
    weights = target_row.clamp(min=0)
    for b in torch.nonzero(acc < counts.cpu()).flatten().tolist():
        i = int(acc[b])
        if draft is not None:
            q = draft[b, i]
        else:
            q = torch.zeros_like(target_row[b])
            q[ids[b, i]] = 1.0
        residual = (target_row[b] - q).clamp(min=0)
        if residual.sum() > 0:
            weights[b] = residual
    return weights


def _within_rounding(weights: torch.Tensor, u: float, token: int, rel_tol: float) -> bool:
    """Whether `token` is the inverse-CDF answer for u up to float32 rounding: it has positive
    weight and u * total lies within rel_tol * total of the token's CDF interval, computed in
    float64."""
    w = weights.double()
    if not 0 <= token < w.numel() or w[token] <= 0:
        return False
    cdf = w.cumsum(0)
    total = float(cdf[-1])
    threshold = u * total
    lower = float(cdf[token - 1]) if token > 0 else 0.0
    tol = rel_tol * total
    return lower - tol <= threshold < float(cdf[token]) + tol


def _rounding_tolerance(vocab: int) -> float:
    """Relative error bound of the kernels' float32 prefix sums (order in
    include/pagedspec/sampling.h): a sum of non-negative numbers by an addition tree of height h
    is within h * 2^-24 of the exact sum, relative to the total. Height: 7 inside a 128-weight
    tile, run_length tiles in a run, 10 in the run scan, 2 to place the tile, plus 3 roundings for
    the threshold u * total; 32 covers everything but the run length with room to spare."""
    tiles = -(-vocab // 128)
    run_length = -(-tiles // 512)
    return (32 + run_length) * 2.0**-24


def _assert_matches_reference(inputs: dict, out: torch.Tensor, acc: torch.Tensor):
    expected_out, expected_acc = reference.rejection_sample(**_to(inputs, "cpu"))
    out, acc = out.cpu(), acc.cpu()
    assert out.dtype == torch.int64 and acc.dtype == torch.int32
    # The acceptance test is the same float32 comparison everywhere: exact.
    assert torch.equal(acc, expected_acc)
    batch, width = out.shape
    columns = torch.arange(width)
    not_emitted = columns != acc.long()[:, None]
    assert torch.equal(out[not_emitted], expected_out[not_emitted])  # accepted tokens and -1
    emitted = out[torch.arange(batch), acc.long()]
    expected_emitted = expected_out[torch.arange(batch), acc.long()]
    weights = _sampling_rows(inputs, acc)
    u = inputs["uniform_resample"].cpu()[torch.arange(batch), acc.long()]
    rel_tol = _rounding_tolerance(weights.shape[-1])
    mismatches = 0
    for b in range(batch):
        token, expected = int(emitted[b]), int(expected_emitted[b])
        # Never a zero-weight token, never outside the vocabulary, and within rounding.
        assert _within_rounding(weights[b], float(u[b]), token, rel_tol), (b, token, expected)
        if token != expected:
            # Allowed only when u lands within float rounding of the boundary between the two.
            assert _within_rounding(weights[b], float(u[b]), expected, rel_tol), (b, token)
            mismatches += 1
    assert mismatches <= max(1, batch // 20)


# ----------------------------------------------------------------------------------------------
# Example-based: the kernels against the reference


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("one_hot_draft", [False, True], ids=["draft_probs", "one_hot"])
@pytest.mark.parametrize("k", [1, 4, 8])
@pytest.mark.parametrize("vocab, batch", [(1, 16), (3, 64), (128, 64), (1000, 48), (4099, 32),
                                          (32000, 12), (128256, 4)])
def test_rejection_sample_matches_reference(device, one_hot_draft, k, vocab, batch, gen):
    inputs = _random_inputs(gen, batch, k, vocab, one_hot_draft=one_hot_draft,
                            sparse=vocab in (128, 4099))
    out, acc = ops.rejection_sample(**_to(inputs, device))
    _assert_matches_reference(inputs, out, acc)


@pytest.mark.parametrize("device", DEVICES)
def test_rejection_sample_without_num_draft_tokens_uses_k(device, gen):
    inputs = _random_inputs(gen, 40, 3, 500, with_counts=False)
    out, acc = ops.rejection_sample(**_to(inputs, device))
    _assert_matches_reference(inputs, out, acc)
    full = dict(inputs, num_draft_tokens=torch.full((40,), 3, dtype=torch.int32))
    out_full, acc_full = ops.rejection_sample(**_to(full, device))
    assert torch.equal(out.cpu(), out_full.cpu()) and torch.equal(acc.cpu(), acc_full.cpu())


@pytest.mark.parametrize("device", DEVICES)
def test_zero_draft_tokens_emit_the_bonus_from_row_zero(device, gen):
    inputs = _random_inputs(gen, 32, 4, 300)
    inputs["num_draft_tokens"] = torch.zeros(32, dtype=torch.int32)
    inputs["draft_token_ids"][:, 1:] = -1  # unread past num_draft_tokens: padding is fine
    out, acc = ops.rejection_sample(**_to(inputs, device))
    assert torch.equal(acc.cpu(), torch.zeros(32, dtype=torch.int32))
    assert torch.equal(out.cpu()[:, 1:], torch.full((32, 4), -1))
    _assert_matches_reference(inputs, out, acc)


@pytest.mark.parametrize("device", DEVICES)
def test_k_zero(device, gen):
    inputs = _random_inputs(gen, 8, 0, 50, with_counts=False)
    out, acc = ops.rejection_sample(**_to(inputs, device))
    assert out.shape == (8, 1) and torch.equal(acc.cpu(), torch.zeros(8, dtype=torch.int32))
    _assert_matches_reference(inputs, out, acc)


@pytest.mark.parametrize("device", DEVICES)
def test_empty_batch(device):
    out, acc = ops.rejection_sample(
        torch.empty(0, 3, dtype=torch.int64, device=device), None,
        torch.empty(0, 4, 10, device=device), torch.empty(0, 3, device=device),
        torch.empty(0, 4, device=device))
    assert out.shape == (0, 4) and acc.shape == (0,)


@pytest.mark.parametrize("device", DEVICES)
def test_inverse_cdf_edges(device):
    """u = 0 takes the first positive weight (not the zero-weight token 0); u just below 1 and
    u = 1 (out of range, or u * total rounding up) take the last positive weight, never a
    zero-weight token or one past the vocabulary."""
    vocab = 300
    row = torch.zeros(vocab)
    row[[7, 100, 250]] = torch.tensor([0.2, 0.5, 0.3])
    uniforms = torch.tensor([0.0, 0.19999, 0.2000001, 0.5, 0.69999, 0.7000001, 1 - 2**-24, 1.0])
    expected = torch.tensor([7, 7, 100, 100, 100, 250, 250, 250])
    batch = len(uniforms)
    target = row.expand(batch, 1, vocab).contiguous()
    args = (torch.empty(batch, 0, dtype=torch.int64), None, target, torch.empty(batch, 0),
            uniforms[:, None])
    out, _ = ops.rejection_sample(*(a.to(device) if a is not None else None for a in args))
    assert torch.equal(out.cpu()[:, 0], expected)
    ref, _ = reference.rejection_sample(*args)
    assert torch.equal(ref[:, 0], expected)


@pytest.mark.parametrize("device", DEVICES)
def test_residual_without_mass_falls_back_to_target(device):
    """draft == target and a drafted token of probability 0 is rejected (0 < 0 fails); the
    residual max(p - q, 0) is then zero everywhere, and the token comes from the target row."""
    vocab = 64
    p = torch.zeros(vocab)
    p[10:20] = 0.1
    target = p.expand(4, 2, vocab).contiguous()
    draft = p.expand(4, 1, vocab).contiguous()
    ids = torch.tensor([[3], [3], [50], [50]])
    ur = torch.tensor([[0.0, 0.5], [0.55, 0.5], [0.95, 0.5], [0.999, 0.5]])
    args = (ids, draft, target, torch.rand(4, 1), ur)
    out, acc = ops.rejection_sample(*(a.to(device) for a in args))
    assert torch.equal(acc.cpu(), torch.zeros(4, dtype=torch.int32))
    assert torch.equal(out.cpu()[:, 0], torch.tensor([10, 15, 19, 19]))
    assert torch.equal(reference.rejection_sample(*args)[0][:, 0], torch.tensor([10, 15, 19, 19]))


@pytest.mark.parametrize("device", DEVICES)
def test_one_hot_draft_never_resamples_the_rejected_token(device, gen):
    """With a deterministic draft the residual is the target without the drafted token."""
    batch, vocab = 4000, 5
    target = torch.tensor([0.1, 0.4, 0.2, 0.2, 0.1]).expand(batch, 2, vocab).contiguous()
    ids = torch.full((batch, 1), 1)
    args = (ids, None, target, torch.rand(batch, 1, generator=gen),
            torch.rand(batch, 2, generator=gen))
    out, acc = ops.rejection_sample(*(a.to(device) if a is not None else None for a in args))
    out, acc = out.cpu(), acc.cpu()
    assert (out[acc == 0, 0] != 1).all()
    assert (out[acc == 1, 0] == 1).all()


@requires_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("vocab", [5, 1000, 4099, 32000, 128256])
@pytest.mark.parametrize("one_hot_draft", [False, True])
def test_cpu_and_cuda_emit_identical_tokens(vocab, one_hot_draft, gen):
    """Both kernels sum in the order fixed in sampling.h: identical tokens, no tolerance."""
    inputs = _random_inputs(gen, 64, 4, vocab, one_hot_draft=one_hot_draft, sparse=True)
    cpu = ops.rejection_sample(**inputs)
    cuda = ops.rejection_sample(**_to(inputs, "cuda"))
    assert torch.equal(cpu[0], cuda[0].cpu()) and torch.equal(cpu[1], cuda[1].cpu())


@requires_cuda
@pytest.mark.cuda
def test_cuda_unaligned_rows_use_the_scalar_path(gen):
    """A storage offset breaks 16-byte alignment: the kernel must fall back, same tokens."""
    inputs = _random_inputs(gen, 16, 2, 1024)
    base = torch.empty(inputs["target_probs"].numel() + 1)
    target = base[1:].view_as(inputs["target_probs"]).copy_(inputs["target_probs"])
    shifted = dict(inputs, target_probs=target)
    assert torch.equal(ops.rejection_sample(**_to(shifted, "cuda"))[0].cpu(),
                       ops.rejection_sample(**inputs)[0])


@requires_cuda
@pytest.mark.cuda
def test_cuda_large_vocabulary_uses_more_shared_memory(gen):
    """2M tokens need 62.5 KiB of tile totals, past the 48 KiB default: the launcher opts in."""
    inputs = _random_inputs(gen, 2, 1, 2_000_000, with_counts=False)
    cpu = ops.rejection_sample(**inputs)
    cuda = ops.rejection_sample(**_to(inputs, "cuda"))
    assert torch.equal(cpu[0], cuda[0].cpu()) and torch.equal(cpu[1], cuda[1].cpu())


@requires_cuda
@pytest.mark.cuda
@pytest.mark.skipif(os.environ.get("PAGEDSPEC_DEBUG") == "1",
                    reason="PAGEDSPEC_DEBUG=1 copies ids to the host, which graphs forbid")
def test_cuda_rejection_sample_is_graph_capturable(gen):
    inputs = _to(_random_inputs(gen, 16, 4, 1000), "cuda")
    expected = ops.rejection_sample(**inputs)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the capture stream, as torch recommends
        ops.rejection_sample(**inputs)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, acc = ops.rejection_sample(**inputs)
    out.fill_(-7)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, expected[0]) and torch.equal(acc, expected[1])


def test_generator_draws_independent_uniforms(gen):
    """The wrapper draws uniform_accept [B, k], then uniform_resample [B, k+1], from the
    generator: two separate draws, so no random number serves both the acceptance test and the
    resampling; the same seed reproduces the result, and the state advances between calls."""
    inputs = _random_inputs(gen, 64, 3, 50)
    del inputs["uniform_accept"], inputs["uniform_resample"]
    g1 = torch.Generator().manual_seed(123)
    out1 = ops.rejection_sample(**inputs, generator=g1)
    out2 = ops.rejection_sample(**inputs, generator=g1)
    g2 = torch.Generator().manual_seed(123)
    ua = torch.rand(64, 3, generator=g2)
    ur = torch.rand(64, 4, generator=g2)
    explicit = ops.rejection_sample(**inputs, uniform_accept=ua, uniform_resample=ur)
    assert torch.equal(out1[0], explicit[0]) and torch.equal(out1[1], explicit[1])
    assert not torch.equal(out1[0], out2[0])


# ----------------------------------------------------------------------------------------------
# greedy_verify


def _greedy_loop(draft, target, counts):
    batch, k = draft.shape
    out = torch.full((batch, k + 1), -1, dtype=torch.int64)
    acc = torch.zeros(batch, dtype=torch.int32)
    for b in range(batch):
        n = k if counts is None else int(counts[b])
        i = 0
        while i < n and draft[b, i] == target[b, i]:
            out[b, i] = draft[b, i]
            i += 1
        out[b, i] = target[b, i]
        acc[b] = i
    return out, acc


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("k", [1, 3, 8])
@pytest.mark.parametrize("with_counts", [False, True])
def test_greedy_verify_matches_loop(device, k, with_counts, gen):
    batch, vocab = 300, 4  # a small vocabulary: long runs of matches
    target = torch.randint(0, vocab, (batch, k + 1), generator=gen)
    draft = torch.where(torch.rand(batch, k, generator=gen) < 0.8, target[:, :k],
                        torch.randint(0, vocab, (batch, k), generator=gen))
    counts = None
    if with_counts:
        counts = torch.randint(0, k + 1, (batch,), generator=gen, dtype=torch.int32)
        counts[:10] = 0
    expected = _greedy_loop(draft, target, counts)
    args = (draft.to(device), target.to(device), counts.to(device) if with_counts else None)
    out, acc = ops.greedy_verify(*args)
    assert out.dtype == torch.int64 and acc.dtype == torch.int32
    assert torch.equal(out.cpu(), expected[0]) and torch.equal(acc.cpu(), expected[1])
    ref = reference.greedy_verify(draft, target, counts)
    assert torch.equal(ref[0], expected[0]) and torch.equal(ref[1], expected[1])


@pytest.mark.parametrize("device", DEVICES)
def test_greedy_verify_k_zero(device):
    target = torch.tensor([[5], [7]], device=device)
    out, acc = ops.greedy_verify(torch.empty(2, 0, dtype=torch.int64, device=device), target)
    assert torch.equal(out.cpu(), torch.tensor([[5], [7]])) and acc.tolist() == [0, 0]


# ----------------------------------------------------------------------------------------------
# opcheck and bad inputs


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("one_hot_draft", [False, True])
def test_rejection_sample_opcheck(device, one_hot_draft, gen):
    inputs = _to(_random_inputs(gen, 6, 3, 40, one_hot_draft=one_hot_draft), device)
    args = tuple(inputs.values())
    torch.library.opcheck(torch.ops.pagedspec.rejection_sample.default, args,
                          test_utils=OPCHECK_UTILS)


@pytest.mark.parametrize("device", DEVICES)
def test_greedy_verify_opcheck(device, gen):
    target = torch.randint(0, 9, (5, 4), generator=gen).to(device)
    draft = target[:, :3].clone()
    counts = torch.tensor([3, 2, 0, 1, 3], dtype=torch.int32, device=device)
    torch.library.opcheck(torch.ops.pagedspec.greedy_verify.default, (draft, target, counts),
                          test_utils=OPCHECK_UTILS)
    torch.library.opcheck(torch.ops.pagedspec.greedy_verify.default, (draft, target, None),
                          test_utils=OPCHECK_UTILS)


def _bad(inputs: dict, **changes) -> dict:
    return dict(inputs, **changes)


@pytest.mark.parametrize("device", DEVICES)
def test_rejection_sample_bad_inputs(device, gen):
    good = _to(_random_inputs(gen, 4, 3, 20), device)
    t, q = good["target_probs"], good["draft_probs"]
    cases = [
        (dict(draft_probs=q[..., :19].contiguous()), r"draft_probs\.size\(2\) must be 20 "
                                                     r"\(vocabulary size of target_probs\)"),
        (dict(target_probs=t[:, :3].contiguous()), r"target_probs\.size\(1\) must be 4"),
        (dict(draft_probs=q[:, :2].contiguous()), r"draft_probs\.size\(1\) must be 3"),
        (dict(target_probs=t.double()), r"target_probs must have dtype in \{Float\}"),
        (dict(draft_probs=q.half()), r"draft_probs must have dtype"),
        (dict(draft_token_ids=good["draft_token_ids"].int()), r"draft_token_ids must have dtype"),
        (dict(num_draft_tokens=good["num_draft_tokens"].long()),
         r"num_draft_tokens must have dtype in \{Int\}"),
        (dict(num_draft_tokens=good["num_draft_tokens"][:3]),
         r"num_draft_tokens\.size\(0\) must be 4"),
        (dict(uniform_accept=good["uniform_accept"][:, :2].contiguous()),
         r"uniform_accept must have shape \[4, 3\]"),
        (dict(uniform_resample=good["uniform_resample"][:, :3].contiguous()),
         r"uniform_resample must have shape \[4, 4\]"),
        (dict(uniform_resample=good["uniform_resample"].double()), r"uniform_resample must have"),
        (dict(target_probs=t.transpose(0, 1).contiguous().transpose(0, 1)),
         r"target_probs must be contiguous"),
        (dict(target_probs=t[..., :0]), r"target_probs\.size\(2\) \(vocabulary size\) must be "
                                        r"positive"),
        (dict(target_probs=t[0]), r"target_probs must have 3 dimensions"),
    ]
    for changes, message in cases:
        with pytest.raises(RuntimeError, match=message):
            ops.rejection_sample(**_bad(good, **changes))


def test_rejection_sample_bad_values_cpu(gen):
    """Checks that read values: always on CPU (on CUDA only with PAGEDSPEC_DEBUG=1)."""
    good = _random_inputs(gen, 4, 3, 20, with_counts=False)
    for bad_id in (20, -1, 1 << 40):
        ids = good["draft_token_ids"].clone()
        ids[2, 1] = bad_id
        with pytest.raises(RuntimeError, match=rf"draft_token_ids\[2, 1\] must be a token id in "
                                               rf"\[0, 20\).*got {bad_id}"):
            ops.rejection_sample(**_bad(good, draft_token_ids=ids))
    counts = torch.tensor([3, 4, 0, 1], dtype=torch.int32)
    with pytest.raises(RuntimeError, match=r"num_draft_tokens\[1\] must be in \[0, 3\] .*got 4"):
        ops.rejection_sample(**_bad(good, num_draft_tokens=counts))
    counts = torch.tensor([3, 1, -2, 1], dtype=torch.int32)
    with pytest.raises(RuntimeError, match=r"num_draft_tokens\[2\] must be in \[0, 3\] .*got -2"):
        ops.rejection_sample(**_bad(good, num_draft_tokens=counts))
    # Ids past num_draft_tokens are never read and may be anything.
    ids = good["draft_token_ids"].clone()
    ids[:, 2] = -1
    counts = torch.full((4,), 2, dtype=torch.int32)
    ops.rejection_sample(**_bad(good, draft_token_ids=ids, num_draft_tokens=counts))


@requires_cuda
@pytest.mark.cuda
def test_cuda_bad_draft_id_is_rejected_not_read(gen):
    """Without PAGEDSPEC_DEBUG=1 the CUDA kernel cannot report an id outside the vocabulary; it
    must not read out of bounds: the position counts as rejected, the id is never emitted."""
    good = _random_inputs(gen, 4, 3, 20, with_counts=False)
    ids = good["draft_token_ids"].clone()
    ids[:, 0] = 1 << 40
    bad = _to(_bad(good, draft_token_ids=ids), "cuda")
    if os.environ.get("PAGEDSPEC_DEBUG") == "1":
        with pytest.raises(RuntimeError, match=r"draft_token_ids\[0, 0\]"):
            ops.rejection_sample(**bad)
        return
    out, acc = ops.rejection_sample(**bad)
    torch.cuda.synchronize()
    assert acc.tolist() == [0, 0, 0, 0]
    assert ((out[:, 0] >= 0) & (out[:, 0] < 20)).all()


@requires_cuda
@pytest.mark.cuda
def test_rejection_sample_mixed_devices(gen):
    good = _to(_random_inputs(gen, 4, 3, 20), "cuda")
    with pytest.raises(RuntimeError, match=r"target_probs must be on the same device"):
        ops.rejection_sample(**_bad(good, target_probs=good["target_probs"].cpu()))


@pytest.mark.parametrize("device", DEVICES)
def test_greedy_verify_bad_inputs(device):
    draft = torch.zeros(3, 2, dtype=torch.int64, device=device)
    target = torch.zeros(3, 3, dtype=torch.int64, device=device)
    with pytest.raises(RuntimeError, match=r"target_token_ids must have shape \[3, 3\]"):
        ops.greedy_verify(draft, target[:, :2].contiguous())
    with pytest.raises(RuntimeError, match=r"target_token_ids must have dtype"):
        ops.greedy_verify(draft, target.int())
    with pytest.raises(RuntimeError, match=r"draft_token_ids must have dtype"):
        ops.greedy_verify(draft.int(), target)
    with pytest.raises(RuntimeError, match=r"num_draft_tokens\.size\(0\) must be 3"):
        ops.greedy_verify(draft, target, torch.zeros(2, dtype=torch.int32, device=device))
    if device == "cpu":
        with pytest.raises(RuntimeError, match=r"num_draft_tokens\[0\] must be in \[0, 2\]"):
            ops.greedy_verify(draft, target, torch.tensor([3, 0, 0], dtype=torch.int32))


# ----------------------------------------------------------------------------------------------
# Statistical exactness
#
# Every request of a batch verifies k draft tokens against the same target/draft pair at every
# position, with the draft tokens sampled from the draft distribution (or, for one-hot drafts,
# from an arbitrary proposal). Then
#   - the first emitted token follows the target distribution p,
#   - position 0 accepts with probability a = sum_x min(p(x), q(x)) (sum_x g(x) p(x) for a
#     one-hot draft proposing from g),
#   - the number of accepted tokens is truncated-geometric: P(j) = a^j (1 - a) for j < k,
#     P(k) = a^k, so the mean number emitted is (1 - a^(k+1)) / (1 - a).


def _pair(kind: str, vocab: int, gen) -> tuple[torch.Tensor, torch.Tensor]:
    """(p, q): target and draft distributions of one kind, float32 [V]."""
    def rand_dist(scale=1.0):
        return _softmax(torch.randn(vocab, generator=gen) * scale)

    third = max(1, vocab // 3)
    if kind == "equal":
        p = rand_dist()
        return p, p.clone()
    if kind == "nearly_equal":
        p = rand_dist()
        return p, _softmax(p.double().log() + 0.05 * torch.randn(vocab, generator=gen).double())
    if kind == "disjoint":
        p, q = rand_dist(), rand_dist()
        p[vocab // 2:] = 0
        q[: vocab // 2] = 0
        return p / p.sum(), q / q.sum()
    if kind == "draft_zero_where_target_not":
        p, q = rand_dist(), rand_dist()
        q[:third] = 0
        return p, q / q.sum()
    if kind == "target_zero_where_draft_not":
        p, q = rand_dist(), rand_dist()
        p[-third:] = 0
        return p / p.sum(), q
    if kind == "peaked_vs_flat":
        return rand_dist(3.0), torch.full((vocab,), 1.0 / vocab)
    if kind == "flat_vs_peaked":
        return torch.full((vocab,), 1.0 / vocab), rand_dist(3.0)
    if kind == "random":
        return rand_dist(), rand_dist()
    raise ValueError(kind)


def _exact(p: torch.Tensor) -> np.ndarray:
    """The float32 weights as the exact distribution they define."""
    p = p.double().numpy()
    return p / p.sum()


def _batch(p, q, k, gen, num=NUM_SAMPLES, one_hot_draft=False):
    """NUM_SAMPLES requests, each verifying k tokens against (p, q) at every position."""
    vocab = p.numel()
    proposal = q if not one_hot_draft else p * 0 + torch.linspace(1, 2, vocab)  # any g works
    ids = torch.multinomial(proposal, num * k, replacement=True, generator=gen).reshape(num, k)
    return dict(
        draft_token_ids=ids,
        draft_probs=None if one_hot_draft else q.expand(num, k, vocab).contiguous(),
        target_probs=p.expand(num, k + 1, vocab).contiguous(),
        uniform_accept=torch.rand(num, k, generator=gen),
        uniform_resample=torch.rand(num, k + 1, generator=gen),
        num_draft_tokens=None,
    ), proposal


def _chisquare(observed: np.ndarray, expected_probs: np.ndarray) -> float:
    """Pearson chi-square p-value of counts against probabilities. Cells of probability 0 must be
    empty (else p = 0); cells expecting fewer than 5 counts are pooled into one."""
    observed = np.asarray(observed, dtype=np.float64)
    expected = np.asarray(expected_probs, dtype=np.float64) * observed.sum()
    if observed[expected == 0].sum() > 0:
        return 0.0
    keep = expected >= 5
    obs = np.append(observed[keep], observed[~keep & (expected > 0)].sum())
    exp = np.append(expected[keep], expected[~keep & (expected > 0)].sum())
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    if len(obs) < 2:
        return 1.0
    exp = exp * obs.sum() / exp.sum()  # guard against float drift in the probabilities
    return float(stats.chisquare(obs, exp).pvalue)


def _first_token_pvalue(sampler, inputs, p) -> float:
    out, _ = sampler(**inputs)
    counts = np.bincount(out[:, 0].cpu().numpy(), minlength=p.numel())
    return _chisquare(counts, _exact(p))


def _acceptance_pvalue(sampler, inputs, a: float) -> float:
    _, acc = sampler(**inputs)
    accepted = int((acc.cpu() > 0).sum())
    return _chisquare(np.array([accepted, len(acc) - accepted]), np.array([a, 1 - a]))


def _acceptance(p, q, proposal=None) -> float:
    p = _exact(p)
    if proposal is not None:  # one-hot draft: accept x with probability p(x)
        return float((_exact(proposal) * p).sum())
    return float(np.minimum(p, _exact(q)).sum())


def _op_sampler(device):
    def run(**inputs):
        out, acc = ops.rejection_sample(**_to(inputs, device))
        return out.cpu(), acc.cpu()
    return run


STAT_CASES = [  # (kind, vocab, k): every vocabulary from 4 to 64 tokens appears
    ("equal", 8, 3),
    ("nearly_equal", 16, 2),
    ("disjoint", 12, 2),
    ("draft_zero_where_target_not", 32, 1),
    ("target_zero_where_draft_not", 24, 2),
    ("peaked_vs_flat", 64, 1),
    ("flat_vs_peaked", 4, 4),
    ("random", 40, 2),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind, vocab, k", STAT_CASES, ids=[c[0] for c in STAT_CASES])
def test_rejection_sample_is_exact(device, kind, vocab, k, gen):
    p, q = _pair(kind, vocab, gen)
    inputs, _ = _batch(p, q, k, gen)
    out, acc = _op_sampler(device)(**inputs)
    num = len(acc)

    # The first emitted token follows the target distribution.
    counts = np.bincount(out[:, 0].numpy(), minlength=vocab)
    assert _chisquare(counts, _exact(p)) >= P_PASS

    # Position 0 accepts with probability a = sum_x min(p(x), q(x)).
    a = _acceptance(p, q)
    a = 1.0 if a > 1 - 1e-12 else (0.0 if a < 1e-12 else a)  # float64 noise of exact 0 and 1
    accepted = int((acc > 0).sum())
    if a in (0.0, 1.0):
        assert accepted == num * a
    else:
        assert _chisquare(np.array([accepted, num - accepted]), np.array([a, 1 - a])) >= P_PASS

    # The accepted count is truncated-geometric, so the mean emitted is (1 - a^(k+1)) / (1 - a).
    j = np.arange(k + 1)
    geometric = np.where(j < k, a**j * (1 - a), a**k)
    assert _chisquare(np.bincount(acc.numpy(), minlength=k + 1), geometric) >= P_PASS
    emitted = acc.double().numpy() + 1
    mean = float((geometric * (j + 1.0)).sum())
    if a < 1:
        assert mean == pytest.approx((1 - a ** (k + 1)) / (1 - a), rel=1e-9)
    var = float((geometric * (j + 1.0 - mean) ** 2).sum())
    # z-test of the mean at the same level: |z| < 3.9 <=> two-sided p-value >= 1e-4.
    assert abs(emitted.mean() - mean) <= stats.norm.isf(P_PASS / 2) * np.sqrt(var / num) + 1e-12
    # Every emitted token is a real token, the rest is padding.
    columns = torch.arange(k + 1)
    assert (out[columns <= acc[:, None].long()] >= 0).all()
    assert (out[columns > acc[:, None].long()] == -1).all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind, vocab, k", [("random", 16, 2), ("peaked_vs_flat", 33, 3)])
def test_one_hot_draft_is_exact(device, kind, vocab, k, gen):
    """A deterministic draft (draft_probs=None) proposing tokens from any g: the output still
    follows p, and position 0 accepts with probability sum_x g(x) p(x)."""
    p, _ = _pair(kind, vocab, gen)
    inputs, proposal = _batch(p, None, k, gen, one_hot_draft=True)
    out, acc = _op_sampler(device)(**inputs)
    assert _chisquare(np.bincount(out[:, 0].numpy(), minlength=vocab), _exact(p)) >= P_PASS
    a = _acceptance(p, None, proposal)
    accepted = int((acc > 0).sum())
    assert _chisquare(np.array([accepted, len(acc) - accepted]), np.array([a, 1 - a])) >= P_PASS


def _chain(sampler, p1, p2, q1, q2, gen, num=NUM_SAMPLES):
    """First two tokens of speculative decoding along a two-step chain with target p1 then
    p2[x1] (and draft q1, q2[x1]): one verification of k = 2 draft tokens, and for the requests
    that emitted only one token a second verification (k = 1) for the next position."""
    vocab = p1.numel()
    x0 = torch.multinomial(q1, num, replacement=True, generator=gen)
    x1 = torch.multinomial(q2[x0], 1, generator=gen).squeeze(1)
    bonus = torch.full((num, vocab), 1.0 / vocab)  # position 3's target: irrelevant here
    out, acc = sampler(
        draft_token_ids=torch.stack([x0, x1], 1),
        draft_probs=torch.stack([q1.expand(num, vocab), q2[x0]], 1).contiguous(),
        target_probs=torch.stack([p1.expand(num, vocab), p2[x0], bonus], 1).contiguous(),
        uniform_accept=torch.rand(num, 2, generator=gen),
        uniform_resample=torch.rand(num, 3, generator=gen),
        num_draft_tokens=None)
    first, second = out[:, 0].clone(), out[:, 1].clone()
    again = torch.nonzero(acc == 0).flatten()
    y0 = first[again]
    n = len(again)
    z = torch.multinomial(q2[y0], 1, generator=gen)
    out2, _ = sampler(
        draft_token_ids=z,
        draft_probs=q2[y0][:, None].contiguous(),
        target_probs=torch.stack([p2[y0], torch.full((n, vocab), 1.0 / vocab)], 1).contiguous(),
        uniform_accept=torch.rand(n, 1, generator=gen),
        uniform_resample=torch.rand(n, 2, generator=gen),
        num_draft_tokens=None)
    second[again] = out2[:, 0]
    return first, second


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["random", "peaked_vs_flat", "target_zero_where_draft_not"])
def test_first_two_tokens_follow_the_chain(device, kind, gen):
    """The first two emitted tokens follow the target's joint distribution p1(x) p2(y | x)."""
    vocab = 6
    p1, q1 = _pair(kind, vocab, gen)
    pairs = [_pair(kind, vocab, gen) for _ in range(vocab)]
    p2 = torch.stack([pq[0] for pq in pairs])
    q2 = torch.stack([pq[1] for pq in pairs])
    first, second = _chain(_op_sampler(device), p1, p2, q1, q2, gen)
    joint = np.bincount((first * vocab + second).numpy(), minlength=vocab * vocab)
    expected = (_exact(p1)[:, None] * np.stack([_exact(r) for r in p2])).ravel()
    assert _chisquare(joint, expected) >= P_PASS


# Two classic mistakes, kept to prove the tests above have the power to catch them.


def _python_sampler(accept, residual):
    """A vectorized sampler with a pluggable acceptance rule and resampling distribution."""
    def run(draft_token_ids, draft_probs, target_probs, uniform_accept, uniform_resample,
            num_draft_tokens=None):
        batch, k = draft_token_ids.shape
        rows = torch.arange(batch)
        ids = draft_token_ids.unsqueeze(-1)
        p = target_probs[:, :k].gather(-1, ids).squeeze(-1)
        q = draft_probs.gather(-1, ids).squeeze(-1)
        rejected = ~accept(uniform_accept, p, q)
        positions = torch.arange(k)
        first = torch.where(rejected, positions, k).min(dim=-1).values
        was_rejected = first < k
        target_row = target_probs[rows, first]
        draft_row = draft_probs[rows, first.clamp(max=k - 1)]
        weights = torch.where(was_rejected[:, None], residual(target_row, draft_row), target_row)
        emitted = reference.inverse_cdf(weights, uniform_resample[rows, first])
        out = torch.where(positions < first[:, None], draft_token_ids, -1)
        out = torch.cat([out, torch.full((batch, 1), -1)], 1)
        out[rows, first] = emitted
        return out, first.to(torch.int32)
    return run


def _correct_residual(target_row, draft_row):
    return (target_row - draft_row).clamp(min=0)


WRONG_SAMPLERS = {
    # Resamples a rejected position from the target instead of the residual max(p - q, 0).
    "resample_from_target": _python_sampler(lambda u, p, q: u * q < p,
                                            lambda target_row, draft_row: target_row),
    # Accepts exactly when p >= q, deterministically, instead of with probability min(1, p/q).
    "accept_iff_p_ge_q": _python_sampler(lambda u, p, q: p >= q, _correct_residual),
}


def test_python_sampler_harness_is_correct_when_given_the_right_rules(gen):
    """The harness itself (with the right rules) passes, so the rejections below are due to the
    injected mistakes, not to the harness."""
    p, q = _pair("peaked_vs_flat", 16, gen)
    inputs, _ = _batch(p, q, 2, gen)
    right = _python_sampler(lambda u, p, q: u * q < p, _correct_residual)
    assert _first_token_pvalue(right, inputs, p) >= P_PASS
    assert _acceptance_pvalue(right, inputs, _acceptance(p, q)) >= P_PASS


@pytest.mark.parametrize("name", list(WRONG_SAMPLERS))
# Kinds where the mistakes move a lot of probability (with nearly equal distributions, a ~ 0.98,
# resampling from the target shifts only ~2% of the mass: 200k samples do not always see it).
@pytest.mark.parametrize("kind, vocab", [("peaked_vs_flat", 16), ("random", 40),
                                         ("target_zero_where_draft_not", 24)])
def test_statistical_tests_reject_wrong_samplers(name, kind, vocab, gen):
    p, q = _pair(kind, vocab, gen)
    inputs, _ = _batch(p, q, 2, gen)
    sampler = WRONG_SAMPLERS[name]
    # The first-token test catches both mistakes on its own ...
    assert _first_token_pvalue(sampler, inputs, p) < P_REJECT
    # ... and the chain test catches them too.
    pairs = [_pair(kind, 6, gen) for _ in range(7)]
    p1, q1 = pairs[0]
    p2 = torch.stack([pq[0] for pq in pairs[1:]])
    q2 = torch.stack([pq[1] for pq in pairs[1:]])
    first, second = _chain(sampler, p1, p2, q1, q2, gen)
    joint = np.bincount((first * 6 + second).numpy(), minlength=36)
    expected = (_exact(p1)[:, None] * np.stack([_exact(r) for r in p2])).ravel()
    assert _chisquare(joint, expected) < P_REJECT
    if name == "accept_iff_p_ge_q":  # the acceptance-rate test sees this one directly
        assert _acceptance_pvalue(sampler, inputs, _acceptance(p, q)) < P_REJECT


@pytest.mark.parametrize("device", DEVICES)
def test_inverse_cdf_is_monotone_across_empty_tiles(device):
    """Regression: with whole 128-token tiles of zero weight (as after top-k filtering), a float
    rounding gap between two tiles' prefixes once let an empty tile 'cross' and the draw jump to
    the row's last positive token. Sweeping u across each CDF boundary, one ulp at a time, the
    drawn token must never decrease and must always have positive weight."""
    vocab = 32000
    rng = np.random.default_rng(0)
    support = [0, 128, 256, 384, 12800, 25600]
    ids = torch.zeros(1, 0, dtype=torch.int64, device=device)
    for _ in range(20):
        weights = np.zeros(vocab, np.float32)
        weights[support] = np.concatenate([rng.random(4) * 0.2, [0.1, 0.1]]).astype(np.float32)
        target = torch.from_numpy(weights).view(1, 1, vocab).to(device)
        total = float(weights.astype(np.float64).sum())
        cdf = np.cumsum(weights[support].astype(np.float64)) / total
        for boundary in cdf[:-1]:
            u = np.float32(boundary) - np.float32(64) * np.spacing(np.float32(boundary))
            us = [u]
            for _ in range(128):
                us.append(np.nextafter(us[-1], np.float32(2)))
            tokens = []
            for value in us:
                out, _ = ops.rejection_sample(ids, None, target, torch.zeros(1, 0, device=device),
                                              torch.tensor([[value]], device=device))
                tokens.append(int(out[0, 0]))
            assert all(t in support for t in tokens)
            assert tokens == sorted(tokens), f"non-monotone draw near u={boundary}: {tokens}"


@requires_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("one_hot_draft", [False, True])
def test_cuda_vocabulary_limit_follows_the_device_shared_memory(one_hot_draft, gen):
    """The kernel keeps 4 bytes of shared memory per 128 tokens, so its largest vocabulary is set
    by the device's opt-in shared memory per block (7.37 M on sm_90, 3.17 M on sm_89): a vocabulary
    just past it is a clear error, one well inside it runs."""
    optin = torch.cuda.get_device_properties(0).shared_memory_per_block_optin
    static_bytes = 2192  # SampleShared (ptxas); `inside` leaves 1 KiB more room
    over = optin // 4 * 128 + 128
    inside = (optin - static_bytes - 1024) // 4 * 128
    for vocab, fits in ((over, False), (inside, True)):
        target = torch.zeros(1, 2, vocab, device="cuda")
        target[:, :, int(torch.randint(0, vocab, (1,), generator=gen))] = 1.0
        draft = None if one_hot_draft else target[:, :1].clone()
        args = (torch.zeros(1, 1, dtype=torch.int64, device="cuda"), draft, target,
                torch.rand(1, 1, generator=gen).cuda(), torch.rand(1, 2, generator=gen).cuda())
        if fits:
            ops.rejection_sample(*args)
            torch.cuda.synchronize()
        else:
            with pytest.raises(RuntimeError, match=r"rejection_sample: target_probs.size\(2\) "
                                                   r"\(vocabulary size\) must be at most \d+ on this GPU"):
                ops.rejection_sample(*args)


# ---- the engine's greedy argmax ----------------------------------------------------------------
@pytest.mark.parametrize("vocab", [100, 4096, 4097, 49152, 50001])
@pytest.mark.parametrize("rows", [1, 7, 64])
def test_row_argmax_is_torch_argmax(vocab, rows, monkeypatch):
    """Same indices as ``torch.argmax`` (the first maximum), whatever the width (chunks of
    1024 and a short last one), with ties across and inside chunks, NaN and all -inf rows."""
    from pagedspec.engine import sampler
    from pagedspec.engine.sampler import ARGMAX_CHUNK, row_argmax

    g = torch.Generator().manual_seed(rows * 100003 + vocab)
    x = torch.randn(rows, vocab, generator=g)
    # Round to a coarse grid: many rows hold their maximum more than once, often in
    # different chunks.
    x = (x * 2).round() / 2
    if rows > 1:
        x[0] = float("-inf")
    if rows > 2:
        x[1, vocab // 2] = float("nan")
        x[1, vocab - 1] = float("nan")
    if rows > 3:
        x[2, :] = 0.0
        x[2, vocab - 1] = 1.0                  # the maximum in the last (short) chunk
    if rows > 4 and vocab > ARGMAX_CHUNK + 3:
        x[3, :] = -1.0
        x[3, ARGMAX_CHUNK + 3] = x[3, vocab - 1] = 5.0     # a tie: the first wins
    assert torch.equal(row_argmax(x), x.argmax(dim=-1))
    assert torch.equal(row_argmax(x.bfloat16()), x.bfloat16().argmax(dim=-1))
    monkeypatch.setattr(sampler, "ARGMAX_SMALL", 0)          # the two passes at every size
    assert torch.equal(row_argmax(x), x.argmax(dim=-1))

