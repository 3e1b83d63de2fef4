"""Count-min sketch (cms_update / cms_query / cms_decay): bit-identical to an independent NumPy
implementation of the contract, to the pure-PyTorch reference and across devices; the count-min
guarantees on Zipf streams; bad inputs."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from pagedspec import ops, reference
from conftest import DEVICES, requires_cuda

MAX = 2**31 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
OPCHECK_UTILS = ("test_schema", "test_faketensor", "test_autograd_registration")

# ----------------------------------------------------------------------------------------------
# Independent reference: NumPy uint64 arithmetic (arrays wrap modulo 2^64) straight from
# CONTRACT.md, sharing no code with pagedspec.reference.

_SEED = np.uint64(0x9E3779B97F4A7C15)
_C1 = np.uint64(0xFF51AFD7ED558CCD)
_C2 = np.uint64(0xC4CEB9FE1A85EC53)
_S33 = np.uint64(33)


def np_fmix64(x: np.ndarray) -> np.ndarray:
    x = x ^ (x >> _S33)
    x = x * _C1
    x = x ^ (x >> _S33)
    x = x * _C2
    return x ^ (x >> _S33)


def np_columns(keys: np.ndarray, depth: int, width: int) -> np.ndarray:
    """int64 [depth, n]: fmix64(uint64(key) + (r + 1) * seed) mod width."""
    u = keys.astype(np.int64).view(np.uint64)
    with np.errstate(over="ignore"):
        rows = [np_fmix64(u + np.uint64(r + 1) * _SEED) % np.uint64(width) for r in range(depth)]
    return np.stack(rows).astype(np.int64)


def np_query(sketch: np.ndarray, keys: np.ndarray) -> np.ndarray:
    cols = np_columns(keys, *sketch.shape)
    return np.take_along_axis(sketch, cols, axis=1).min(axis=0)


def np_update(sketch: np.ndarray, keys: np.ndarray, inc: np.ndarray | None,
              conservative: bool) -> None:
    depth, width = sketch.shape
    inc = np.ones(keys.shape, np.int64) if inc is None else inc.astype(np.int64)
    cols = np_columns(keys, depth, width)
    if conservative:
        estimate = np_query(sketch, keys).astype(np.int64)
        _, inverse = np.unique(keys, return_inverse=True)
        total = np.zeros(inverse.max() + 1 if keys.size else 0, np.int64)
        np.add.at(total, inverse, inc)
        target = np.minimum(estimate + total[inverse], MAX)
        for r in range(depth):
            row = sketch[r].astype(np.int64)
            np.maximum.at(row, cols[r], target)
            sketch[r] = row
        return
    for r in range(depth):
        row = sketch[r].astype(np.int64)
        np.add.at(row, cols[r], inc)
        sketch[r] = np.minimum(row, MAX)


def py_column(key: int, row: int, width: int) -> int:
    """A third spelling of the hash, in Python integers, for spot checks."""
    m = 2**64 - 1
    x = ((key & m) + (row + 1) * 0x9E3779B97F4A7C15) & m
    x ^= x >> 33
    x = (x * 0xFF51AFD7ED558CCD) & m
    x ^= x >> 33
    x = (x * 0xC4CEB9FE1A85EC53) & m
    x ^= x >> 33
    return x % width


# ----------------------------------------------------------------------------------------------
# Data


def random_keys(gen: torch.Generator, n: int, duplicates: bool = True) -> torch.Tensor:
    """Keys over the whole int64 range (negative and huge ones), the extremes, and, when
    `duplicates`, a third of them drawn from a small pool so that keys repeat within a batch."""
    keys = torch.randint(INT64_MIN, INT64_MAX, (n,), generator=gen, dtype=torch.int64)
    keys[: min(n, 4)] = torch.tensor([INT64_MIN, INT64_MAX, 0, -1])[: min(n, 4)]
    if duplicates and n >= 8:
        pool = torch.randint(-1000, 1000, (max(1, n // 16),), generator=gen, dtype=torch.int64)
        pick = torch.randint(0, pool.numel(), (n // 3,), generator=gen)
        keys[4: 4 + n // 3] = pool[pick][: n - 4]
        keys = keys[torch.randperm(n, generator=gen)]
    return keys


def random_increments(gen: torch.Generator, n: int, kind: str):
    if kind == "none":
        return None
    if kind == "small":
        return torch.randint(0, 100, (n,), generator=gen, dtype=torch.int32)
    if kind == "zero":
        return torch.zeros(n, dtype=torch.int32)
    if kind == "huge":  # near saturation: two of these overflow int32
        return torch.randint(MAX // 2, MAX + 1, (n,), generator=gen, dtype=torch.int32)
    if kind == "mixed":  # zeros, ones and huge values together
        v = torch.randint(0, MAX, (n,), generator=gen, dtype=torch.int32)
        v[torch.rand(n, generator=gen) < 0.3] = 0
        v[torch.rand(n, generator=gen) < 0.3] = 1
        return v
    raise ValueError(kind)


def random_sketch(gen: torch.Generator, depth: int, width: int, near_max: bool = False):
    """Fresh random counters (never an all-zero sketch): small ones, or ones near saturation."""
    if near_max:
        return torch.randint(MAX - 1000, MAX + 1, (depth, width), generator=gen, dtype=torch.int32)
    return torch.randint(0, 50, (depth, width), generator=gen, dtype=torch.int32)


def _np(t: torch.Tensor | None):
    return None if t is None else t.cpu().numpy()


# ----------------------------------------------------------------------------------------------
# The hash


def test_hash_spellings_agree(gen):
    keys = random_keys(gen, 64, duplicates=False)
    for width in (1, 7, 1 << 16, 1000003, (1 << 62) + 12345):
        cols = np_columns(keys.numpy(), 16, width)
        ref = reference.cms_columns(keys, 16, width)
        assert torch.equal(torch.from_numpy(cols), ref), width
        for i in range(0, 64, 9):
            for r in (0, 5, 15):
                assert cols[r, i] == py_column(int(keys[i]), r, width)


def test_hash_fixed_points():
    """Pinned values of the contract's formula (computed once in Python integers). They must
    never change: a sketch saved by one build is queried by another."""
    pinned = {  # key: (row 0, row 1, row 15) full 64-bit hashes
        0: (0x9CA066F1A4AB2EEA, 0xD30B054265133DD7, 0xE26C4D18580B84AD),
        -1: (0x25B775FAECA8F520, 0x45E66A6E12C4C3F4, 0xE3FBBE8491DD2C1D),
        INT64_MAX: (0xC08BD8386A9CE924, 0x23BA167E8BAA2797, 0x1326681561D08367),
    }
    for key, hashes in pinned.items():
        assert tuple(py_column(key, r, 2**64) for r in (0, 1, 15)) == hashes
        sketch = torch.zeros(16, 1000, dtype=torch.int32)
        ops.cms_update(sketch, torch.tensor([key]))
        assert [int(sketch[r].argmax()) for r in (0, 1, 15)] == [h % 1000 for h in hashes]
        assert int(sketch.sum()) == 16


# ----------------------------------------------------------------------------------------------
# Bit-identical to the references

SHAPES = [(1, 1), (1, 64), (2, 1000), (4, 1 << 12), (4, 3001), (7, 257), (16, 1 << 10), (16, 999)]
INC_KINDS = ["none", "small", "zero", "huge", "mixed"]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("conservative", [False, True], ids=["plain", "conservative"])
@pytest.mark.parametrize("inc_kind", INC_KINDS)
@pytest.mark.parametrize("depth,width", SHAPES)
def test_update_matches_references(device, depth, width, inc_kind, conservative, gen):
    sketch = random_sketch(gen, depth, width, near_max=inc_kind == "mixed")
    expected = sketch.numpy().copy()
    via_torch = sketch.clone()
    sketch = sketch.to(device)
    for n in (1500, 1, 700):  # several calls, so later ones start from the earlier ones' sketch
        keys = random_keys(gen, n)
        inc = random_increments(gen, n, inc_kind)
        ops.cms_update(sketch, keys.to(device), None if inc is None else inc.to(device),
                       conservative)
        np_update(expected, keys.numpy(), _np(inc), conservative)
        reference.cms_update(via_torch, keys, inc, conservative)
        assert np.array_equal(sketch.cpu().numpy(), expected)
        assert torch.equal(via_torch, torch.from_numpy(expected))
    queries = torch.cat([random_keys(gen, 300), keys[:100]])
    got = ops.cms_query(sketch, queries.to(device))
    assert got.dtype == torch.int32 and got.shape == (400,)
    assert np.array_equal(got.cpu().numpy(), np_query(expected, queries.numpy()))
    assert torch.equal(reference.cms_query(via_torch, queries), got.cpu())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("conservative", [False, True], ids=["plain", "conservative"])
@pytest.mark.parametrize("depth", [1, 3, 4])
def test_update_large_batches_shared_rows(device, depth, conservative, gen):
    """Batches large enough that the CPU kernel splits rows between threads (atomic counter
    updates) when there are fewer rows than threads, with hot duplicate keys and saturation."""
    threads = torch.get_num_threads()
    torch.set_num_threads(4)
    try:
        width = 5000
        sketch = random_sketch(gen, depth, width).to(device)
        expected = sketch.cpu().numpy().copy()
        n = 120_000
        keys = random_keys(gen, n)
        keys[::7] = 42  # one very hot key
        inc = random_increments(gen, n, "mixed")
        inc[: n // 2] = torch.randint(0, 3, (n // 2,), generator=gen, dtype=torch.int32)
        ops.cms_update(sketch, keys.to(device), inc.to(device), conservative)
        np_update(expected, keys.numpy(), inc.numpy(), conservative)
        assert np.array_equal(sketch.cpu().numpy(), expected)
        ops.cms_update(sketch, keys.to(device), None, conservative)
        np_update(expected, keys.numpy(), None, conservative)
        assert np.array_equal(sketch.cpu().numpy(), expected)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("device", DEVICES)
def test_saturation_never_wraps(device):
    """Many duplicates of large increments on one counter: the sum far exceeds 2^32, so a
    wrapping (non-saturating) add would land anywhere; the counter must read 2^31 - 1."""
    for conservative in (False, True):
        sketch = torch.full((3, 17), 5, dtype=torch.int32, device=device)
        keys = torch.full((10_000,), -7, dtype=torch.int64, device=device)
        inc = torch.full((10_000,), MAX - 3, dtype=torch.int32, device=device)
        ops.cms_update(sketch, keys, inc, conservative)
        cols = reference.cms_columns(keys[:1].cpu(), 3, 17)[:, 0]
        hit = sketch.cpu()[torch.arange(3), cols]
        assert torch.all(hit == MAX)
        assert ops.cms_query(sketch, keys[:1]).item() == MAX
        # Untouched counters stay as they were.
        assert int((sketch.cpu() != 5).sum()) == 3
        ops.cms_update(sketch, keys, inc, conservative)  # a saturated counter stays saturated
        assert ops.cms_query(sketch, keys[:1]).item() == MAX


@pytest.mark.parametrize("device", DEVICES)
def test_conservative_semantics_example(device):
    """The contract's rule on a hand-made case: e(key) before the call, S(key) aggregated over
    duplicates, counters raised to max(c, e + S), never lowered."""
    sketch = torch.zeros(2, 1 << 20, dtype=torch.int32)  # wide: these keys collide nowhere
    keys = torch.tensor([10, 20, 10, 30], dtype=torch.int64)
    cols = reference.cms_columns(keys, 2, 1 << 20)
    sketch[0, cols[0, 0]] = 5  # key 10: rows read (5, 3): estimate 3
    sketch[1, cols[1, 0]] = 3
    sketch[0, cols[0, 1]] = 9  # key 20: rows read (9, 0): estimate 0
    sketch = sketch.to(device)
    ops.cms_update(sketch, keys.to(device), torch.tensor([2, 4, 1, 6], dtype=torch.int32,
                                                         device=device), conservative=True)
    s = sketch.cpu()
    assert (s[0, cols[0, 0]], s[1, cols[1, 0]]) == (6, 6)  # max(5, 3+3), max(3, 3+3)
    assert (s[0, cols[0, 1]], s[1, cols[1, 1]]) == (9, 4)  # max(9, 0+4), max(0, 0+4)
    assert (s[0, cols[0, 3]], s[1, cols[1, 3]]) == (6, 6)
    assert int(s.sum()) == 6 + 6 + 9 + 4 + 6 + 6


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("width", [1, 10, 4096])
def test_decay(device, width, gen):
    sketch = torch.randint(0, MAX, (5, width), generator=gen, dtype=torch.int32)
    sketch[0, 0] = MAX
    for shift in (0, 1, 7, 31):
        got = sketch.clone().to(device)
        ops.cms_decay(got, shift)
        assert np.array_equal(got.cpu().numpy(), sketch.numpy() >> shift)
        via_torch = sketch.clone()
        reference.cms_decay(via_torch, shift)
        assert torch.equal(via_torch, got.cpu())
    got = sketch.clone().to(device)
    ops.cms_decay(got)  # default shift 1
    assert torch.equal(got.cpu(), sketch >> 1)


@pytest.mark.parametrize("device", DEVICES)
def test_empty_batches(device, gen):
    sketch = random_sketch(gen, 3, 100).to(device)
    before = sketch.clone()
    empty = torch.empty(0, dtype=torch.int64, device=device)
    ops.cms_update(sketch, empty)
    ops.cms_update(sketch, empty, torch.empty(0, dtype=torch.int32, device=device), True)
    assert torch.equal(sketch, before)
    out = ops.cms_query(sketch, empty)
    assert out.shape == (0,) and out.dtype == torch.int32


@requires_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("conservative", [False, True], ids=["plain", "conservative"])
@pytest.mark.parametrize("depth,width", [(4, 1 << 16), (5, 100003), (16, 1 << 10)])
def test_cpu_and_cuda_identical(depth, width, conservative, gen):
    """A sketch built on the GPU, saved and loaded on the CPU, answers exactly as one built on
    the CPU: same counters after a long sequence of mixed calls."""
    cpu = random_sketch(gen, depth, width)
    gpu = cpu.cuda()
    for step in range(6):
        keys = random_keys(gen, 50_000)
        inc = random_increments(gen, 50_000, ["none", "small", "mixed"][step % 3])
        ops.cms_update(cpu, keys, inc, conservative)
        ops.cms_update(gpu, keys.cuda(), None if inc is None else inc.cuda(), conservative)
        if step == 3:
            ops.cms_decay(cpu, 2)
            ops.cms_decay(gpu, 2)
    assert torch.equal(cpu, gpu.cpu())
    q = random_keys(gen, 10_000)
    assert torch.equal(ops.cms_query(cpu, q), ops.cms_query(gpu.cpu(), q))
    assert torch.equal(ops.cms_query(cpu, q), ops.cms_query(gpu, q.cuda()).cpu())


# ----------------------------------------------------------------------------------------------
# Count-min guarantees on Zipf streams of a million updates

ZIPF_UNIVERSE = 100_000
ZIPF_UPDATES = 1_000_000


@pytest.fixture(scope="module")
def zipf_stream():
    """A million updates over 100k distinct random int64 keys, key of rank k drawn with
    probability proportional to k^-1.1. Returns (stream keys, distinct keys, true counts)."""
    rng = np.random.default_rng(20240605)
    distinct = rng.integers(INT64_MIN, INT64_MAX, size=ZIPF_UNIVERSE, dtype=np.int64,
                            endpoint=True)
    distinct = np.unique(distinct)
    p = 1.0 / np.arange(1, distinct.size + 1) ** 1.1
    ranks = rng.choice(distinct.size, size=ZIPF_UPDATES, p=p / p.sum())
    truth = np.bincount(ranks, minlength=distinct.size)
    return torch.from_numpy(distinct[ranks]), torch.from_numpy(distinct), truth


def _estimates(device, stream, distinct, depth, width, conservative, batch=ZIPF_UPDATES):
    sketch = torch.zeros(depth, width, dtype=torch.int32, device=device)
    for b in range(0, stream.numel(), batch):
        ops.cms_update(sketch, stream[b: b + batch].to(device), conservative=conservative)
    return ops.cms_query(sketch, distinct.to(device)).cpu().numpy().astype(np.int64)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("depth,width", [(1, 1 << 10), (2, 1 << 10), (4, 1 << 10), (4, 1 << 12)])
def test_zipf_error_bound(device, depth, width, zipf_stream):
    """Estimates never fall below the truth, and the fraction of keys whose overestimate exceeds
    (e / w) * N is at most e^-d (the count-min bound: Markov per row, independent rows). Margin:
    four binomial standard deviations of a fraction over the ~100k keys; the observed fractions
    are in fact far below the bound, because Zipf mass sits on few buckets."""
    stream, distinct, truth = zipf_stream
    est = _estimates(device, stream, distinct, depth, width, conservative=False)
    assert np.all(est >= truth)
    bound = math.exp(-depth)
    margin = 4 * math.sqrt(bound * (1 - bound) / truth.size)
    frac = float(np.mean(est - truth > math.e / width * ZIPF_UPDATES))
    assert frac <= bound + margin, (frac, bound)


@pytest.mark.parametrize("device", DEVICES)
def test_zipf_conservative_between_truth_and_plain(device, zipf_stream):
    """Conservative estimates, updated in 100 batches of 10k, are never below the truth and never
    above the plain estimates of the same stream (counter-wise domination, by induction)."""
    stream, distinct, truth = zipf_stream
    depth, width = 4, 1 << 10
    plain = _estimates(device, stream, distinct, depth, width, False)
    cons = _estimates(device, stream, distinct, depth, width, True, batch=10_000)
    assert np.all(cons >= truth)
    assert np.all(cons <= plain)
    # Not a guarantee, a sanity check that conservative updating does something: its mean error
    # is well below the plain sketch's.
    assert np.mean(cons - truth) < 0.5 * np.mean(plain - truth)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("conservative", [False, True], ids=["plain", "conservative"])
def test_zipf_heavy_hitters(device, conservative, zipf_stream):
    """The top 1% of keys by true count (1000 keys, plus ties at the boundary) are the top of the
    estimates of a 4 x 2^14 sketch: recall >= 0.95 plain, >= 0.99 conservative (observed on this
    stream: 0.980 and 0.998; at width 2^12 it drops to 0.74 and 0.86)."""
    stream, distinct, truth = zipf_stream
    est = _estimates(device, stream, distinct, 4, 1 << 14, conservative, batch=100_000)
    k = truth.size // 100
    threshold = np.sort(truth)[-k]
    heavy = np.flatnonzero(truth >= threshold)
    top_est = np.argsort(-est, kind="stable")[: heavy.size]
    recall = np.intersect1d(heavy, top_est).size / heavy.size
    assert recall >= (0.99 if conservative else 0.95), recall


# ----------------------------------------------------------------------------------------------
# opcheck and bad inputs


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device, gen):
    sketch = random_sketch(gen, 4, 1000).to(device)
    keys = random_keys(gen, 300).to(device)
    inc = random_increments(gen, 300, "small").to(device)
    for args in [(sketch, keys, inc, False), (sketch, keys, inc, True),
                 (sketch, keys, None, False)]:
        torch.library.opcheck(torch.ops.pagedspec.cms_update.default, args,
                              test_utils=OPCHECK_UTILS)
    torch.library.opcheck(torch.ops.pagedspec.cms_query.default, (sketch, keys),
                          test_utils=OPCHECK_UTILS)
    torch.library.opcheck(torch.ops.pagedspec.cms_decay.default, (sketch, 3),
                          test_utils=OPCHECK_UTILS)


def _sk(depth=4, width=100, dtype=torch.int32):
    return torch.zeros(depth, width, dtype=dtype)


KEYS = torch.arange(10, dtype=torch.int64)


@pytest.mark.parametrize(
    "call,match",
    [
        (lambda: ops.cms_update(_sk(), KEYS.float()),
         r"cms_update: keys must have dtype in \{Long\}, got Float"),
        (lambda: ops.cms_update(_sk(), KEYS.int()),
         r"cms_update: keys must have dtype in \{Long\}, got Int"),
        (lambda: ops.cms_query(_sk(), KEYS.double()),
         r"cms_query: keys must have dtype in \{Long\}, got Double"),
        (lambda: ops.cms_update(_sk(), KEYS.view(2, 5)),
         r"cms_update: keys must have 1 dimensions"),
        (lambda: ops.cms_update(_sk(), KEYS[::2]), r"cms_update: keys must be contiguous"),
        (lambda: ops.cms_update(_sk(), KEYS, torch.tensor([1] * 9 + [-1], dtype=torch.int32)),
         r"cms_update: increments must be >= 0, got increments\[9\] = -1"),
        (lambda: ops.cms_update(_sk(), KEYS, torch.ones(10, dtype=torch.int32) * -5, True),
         r"cms_update: increments must be >= 0, got increments\[0\] = -5"),
        (lambda: ops.cms_update(_sk(), KEYS, torch.ones(9, dtype=torch.int32)),
         r"cms_update: increments.size\(0\) must be 10 \(one per key\), got 9"),
        (lambda: ops.cms_update(_sk(), KEYS, torch.ones(10, dtype=torch.int64)),
         r"cms_update: increments must have dtype in \{Int\}, got Long"),
        (lambda: ops.cms_update(_sk(depth=17), KEYS),
         r"cms_update: sketch depth \(size\(0\)\) must be in \[1, 16\], got 17"),
        (lambda: ops.cms_query(_sk(depth=0), KEYS),
         r"cms_query: sketch depth \(size\(0\)\) must be in \[1, 16\], got 0"),
        (lambda: ops.cms_update(_sk(width=0), KEYS),
         r"cms_update: sketch width \(size\(1\)\) must be >= 1, got 0"),
        (lambda: ops.cms_query(_sk(dtype=torch.int64), KEYS),
         r"cms_query: sketch must have dtype in \{Int\}, got Long"),
        (lambda: ops.cms_update(torch.zeros(400, dtype=torch.int32), KEYS),
         r"cms_update: sketch must have 2 dimensions"),
        (lambda: ops.cms_update(_sk(width=200)[:, ::2], KEYS),
         r"cms_update: sketch must be contiguous"),
        (lambda: ops.cms_decay(_sk(), 32), r"cms_decay: shift must be in \[0, 31\], got 32"),
        (lambda: ops.cms_decay(_sk(), -1), r"cms_decay: shift must be in \[0, 31\], got -1"),
        (lambda: ops.cms_decay(_sk(depth=20)),
         r"cms_decay: sketch depth \(size\(0\)\) must be in \[1, 16\], got 20"),
        (lambda: ops.cms_decay(_sk(dtype=torch.float32)),
         r"cms_decay: sketch must have dtype in \{Int\}, got Float"),
    ],
)
def test_bad_inputs(call, match):
    with pytest.raises(RuntimeError, match=match):
        call()


@requires_cuda
@pytest.mark.cuda
def test_bad_inputs_mixed_devices():
    with pytest.raises(RuntimeError, match=r"cms_update: keys must be on the same device as "
                                           r"sketch"):
        ops.cms_update(_sk().cuda(), KEYS)
    with pytest.raises(RuntimeError, match=r"cms_update: increments must be on the same device"):
        ops.cms_update(_sk().cuda(), KEYS.cuda(), torch.ones(10, dtype=torch.int32))
    with pytest.raises(RuntimeError, match=r"cms_query: keys must be on the same device"):
        ops.cms_query(_sk().cuda(), KEYS)


@requires_cuda
@pytest.mark.cuda
def test_cuda_negative_increments(gen):
    """On CUDA, checking increments >= 0 needs a device-to-host copy, so it runs only with
    PAGEDSPEC_DEBUG=1 (set at process start, hence the subprocess). Without it, a negative
    increment counts as 0: it never lowers or corrupts a counter."""
    import os
    import subprocess
    import sys

    if os.environ.get("PAGEDSPEC_DEBUG") != "1":
        sketch = random_sketch(gen, 4, 1000).cuda()
        keys = random_keys(gen, 500)
        inc = random_increments(gen, 500, "small")
        inc[::3] = -5
        expected = sketch.cpu().numpy().copy()
        np_update(expected, keys.numpy(), inc.clamp(min=0).numpy(), False)
        ops.cms_update(sketch, keys.cuda(), inc.cuda())
        assert np.array_equal(sketch.cpu().numpy(), expected)
    code = ("import torch; from pagedspec import ops\n"
            "s = torch.zeros(4, 100, dtype=torch.int32, device='cuda')\n"
            "k = torch.arange(5, device='cuda')\n"
            "i = torch.tensor([1, 2, -3, 4, 5], dtype=torch.int32, device='cuda')\n"
            "try:\n    ops.cms_update(s, k, i)\nexcept RuntimeError as e:\n    print(e)\n")
    env = dict(os.environ, PAGEDSPEC_DEBUG="1")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120)
    assert "cms_update: increments must be >= 0, got increments[2] = -3" in out.stdout, out


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_large_conservative_batch_is_independent_of_thread_count(threads, gen):
    """Large batches (>= 2^14 keys) run the multi-threaded paths: the conservative sketch must
    equal the reference bit for bit whatever the number of threads."""
    keys = torch.randint(-(2**62), 2**62, (39999,), generator=gen)
    keys[::3] = keys[1::3]  # a third of the keys repeat another
    inc = torch.randint(0, 1 << 27, (39999,), generator=gen, dtype=torch.int32)
    sketch = torch.randint(0, 1 << 20, (4, 3001), generator=gen, dtype=torch.int32)
    expected = sketch.numpy().copy()
    np_update(expected, keys.numpy(), inc.numpy(), conservative=True)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        ops.cms_update(sketch, keys, inc, conservative=True)
    finally:
        torch.set_num_threads(previous)
    assert np.array_equal(sketch.numpy(), expected)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("conservative", [False, True], ids=["plain", "conservative"])
@pytest.mark.parametrize("alias", ["keys", "increments"])
def test_update_inputs_in_the_sketch_memory_are_rejected(device, conservative, alias, gen):
    """keys or increments that are views of the sketch's own memory would change while the
    update writes the sketch (differently on each backend): an error naming the argument, with
    the sketch untouched. The same values copied out of it are accepted, as the reference
    computes them."""
    sketch = torch.randint(0, 100, (4, 32), generator=gen, dtype=torch.int32).to(device)
    flat = sketch.view(-1)
    if alias == "keys":
        keys, increments = flat.view(torch.int64)[8:16], None
    else:
        keys, increments = torch.randint(-50, 50, (8,), generator=gen).to(device), flat[40:48]
    before = sketch.clone()
    with pytest.raises(RuntimeError, match=f"pagedspec.cms_update: {alias} must not share "
                                           "memory with sketch, got overlapping tensors"):
        ops.cms_update(sketch, keys, increments, conservative)
    assert torch.equal(sketch, before)
    keys, increments = keys.clone(), None if increments is None else increments.clone()
    want = sketch.cpu().clone()
    reference.cms_update(want, keys.cpu(), None if increments is None else increments.cpu(),
                         conservative)
    ops.cms_update(sketch, keys, increments, conservative)
    assert torch.equal(sketch.cpu(), want)
