"""Benchmark cases for the count-min sketch: plain and conservative updates, and queries, of n keys
(1e4 to 1e7) on a depth-4 sketch 2^16 or 2^22 counters wide.

Bytes moved, per call, at least:
  update: keys read (8 n) + increments read (4 n) + every touched counter read and written
          (2 * 4 * depth * n);
  query:  keys read (8 n) + every touched counter read (4 * depth * n) + estimates written (4 n).
Touched counters are random 4-byte accesses, so the achieved "bandwidth" is far below a copy's:
the number to read is items/s (updates or queries per second).

The reference is the obvious pure-PyTorch count-min sketch: the contract's hash computed with
torch ops (reference.cms_columns, inside the timed call, as the kernel hashes inside its call),
turned into indices into the flattened [depth * width] sketch, then one index_add_ (update) or
one gather and a min over rows (query). It does not saturate (index_add_ on int32 wraps), which
only makes it faster than a correct one. The conservative update has no such one-liner; its
reference is reference.cms_update(conservative=True).
"""
from __future__ import annotations

import torch

from pagedspec import ops, reference
from pagedspec.bench.core import Workload, register

DEPTH = 4


def _flat_indices(keys: torch.Tensor, depth: int, width: int) -> torch.Tensor:
    """Index of every (row, key) counter in the flattened sketch: int64 [depth * n]."""
    cols = reference.cms_columns(keys, depth, width)
    rows = torch.arange(depth, device=keys.device, dtype=torch.int64).unsqueeze(1) * width
    return (cols + rows).reshape(-1)


def torch_update(sketch: torch.Tensor, keys: torch.Tensor, increments: torch.Tensor) -> None:
    depth, width = sketch.shape
    flat = _flat_indices(keys, depth, width)
    sketch.view(-1).index_add_(0, flat, increments.repeat(depth))


def torch_query(sketch: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    depth, width = sketch.shape
    flat = _flat_indices(keys, depth, width)
    return sketch.view(-1)[flat].view(depth, -1).amin(dim=0)


def _inputs(n: int, width: int, device):
    g = torch.Generator().manual_seed(n ^ width)
    keys = torch.randint(-(2**63), 2**63 - 1, (n,), generator=g, dtype=torch.int64)
    inc = torch.randint(1, 16, (n,), generator=g, dtype=torch.int32)
    sketch = torch.randint(0, 1000, (DEPTH, width), generator=g, dtype=torch.int32)
    return sketch.to(device), keys.to(device), inc.to(device)


def _case(kind: str, n: int, width: int, quick: bool, devices=("cpu", "cuda")):
    name = f"{kind}/d={DEPTH}/w=2^{width.bit_length() - 1}/n={n:.0e}".replace("e+0", "e")

    @register("sketch", name, quick=quick, devices=devices, kind=kind, n=n, width=width,
              depth=DEPTH)
    def build(device) -> Workload:
        sketch, keys, inc = _inputs(n, width, device)
        ref_sketch = sketch.clone()
        if kind == "query":
            nbytes = 8 * n + 4 * DEPTH * n + 4 * n
            return Workload(lambda: ops.cms_query(sketch, keys), nbytes,
                            lambda: torch_query(ref_sketch, keys), n, "queries")
        nbytes = 8 * n + 4 * n + 2 * 4 * DEPTH * n
        if kind == "update":
            return Workload(lambda: ops.cms_update(sketch, keys, inc), nbytes,
                            lambda: torch_update(ref_sketch, keys, inc), n, "updates")
        return Workload(lambda: ops.cms_update(sketch, keys, inc, conservative=True), nbytes,
                        lambda: reference.cms_update(ref_sketch, keys, inc, conservative=True),
                        n, "updates")


# Quick: a small and a large batch on the L2-sized and the DRAM-sized sketch (a few seconds on
# CPU, references included). n = 1e7 runs on CPU too, but slowly for the references.
for _width in (1 << 16, 1 << 22):
    for _n in (10**4, 10**5, 10**6, 10**7):
        _quick = (_n, _width) in ((10**4, 1 << 16), (10**6, 1 << 22))
        _case("update", _n, _width, _quick)
        _case("query", _n, _width, _quick)
        if _n <= 10**6 or _width == 1 << 16:
            _case("update_conservative", _n, _width, _quick and _n == 10**4)
