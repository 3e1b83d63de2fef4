"""The prefix cache's two pieces: content names for full blocks, and which cached free block goes
first when the pool needs one.

Full blocks of verified tokens are named by a chained content hash (:func:`hash_block`) and stay
reusable after their sequence ends until :class:`Evictor` gives them up. The block manager
(:mod:`pagedspec.engine.block_manager`) registers and looks the names up.
"""
from __future__ import annotations

import hashlib
import heapq
from array import array
from typing import Optional, Sequence

import torch

from pagedspec import ops


def hash_block(parent: Optional[int], token_ids: Sequence[int], salt: bytes = b"") -> int:
    """Content hash of one full block: blake2b-64 of (parent hash, token ids), as a signed int64.

    Chaining through the parent makes the hash name the whole prefix, not just this block. The
    salt (e.g. a LoRA or tenant id) only enters the first block; the chain carries it onwards.
    Python's ``hash()`` is randomized per process, so it is not used.
    """
    h = hashlib.blake2b(digest_size=8)
    if parent is None:
        h.update(salt)
    else:
        h.update(parent.to_bytes(8, "little", signed=True))
    h.update(array("q", token_ids).tobytes())
    return int.from_bytes(h.digest(), "little", signed=True)


class Evictor:
    """Cached free blocks; eviction takes the least popular, least recently freed first.

    Popularity is the count-min sketch's estimate of how often a block's content hash was asked
    for (``cms_update`` on every prompt lookup, hits or not). Every ``decay_period`` increments
    ``cms_decay`` halves all counts (TinyLFU aging) and a decay epoch passes, so a block's priority
    ``log2(count) + epoch`` is its popularity in today's units: a count taken k epochs ago is worth
    2^-k of one taken now, which is how recency enters beside frequency. Equal priorities leave in
    the order they were freed (LRU); ``policy="lru"`` ignores popularity, which is plain LRU.
    Heap with lazy deletion: O(log n) per operation, one ``cms_query`` per batch of freed blocks.
    """

    def __init__(self, policy: str = "popularity", num_blocks: int = 1024, sketch_depth: int = 4,
                 sketch_width: Optional[int] = None, decay_period: Optional[int] = None):
        if policy not in ("popularity", "lru"):
            raise ValueError(f"Evictor: policy must be 'popularity' or 'lru', got {policy!r}")
        self.sketch: Optional[torch.Tensor] = None
        if policy == "popularity":
            width = sketch_width or 1 << max(8, (4 * num_blocks - 1).bit_length())
            self.sketch = torch.zeros(sketch_depth, width, dtype=torch.int32)
        # Counts live about 2 pool-fulls of lookups: long enough to rank skewed prefix traffic,
        # short enough that chat histories (recent reuse) are not outranked by stale heads.
        # Longer memory favours skewed workloads more, recency-driven ones less (bench/NOTES.md).
        self.decay_period = decay_period or 2 * num_blocks
        self._since_decay = 0
        self._epoch = 0
        self._heap: list[tuple[float, int, int]] = []  # (priority, push counter, block)
        self._live: dict[int, int] = {}                # block -> push counter of its live entry
        self._counter = 0

    def __len__(self) -> int:
        return len(self._live)

    def __contains__(self, block: int) -> bool:
        return block in self._live

    def record_access(self, hashes: Sequence[int]) -> None:
        """Count one request for each content hash (called for every prompt lookup)."""
        if self.sketch is None or not hashes:
            return
        ops.cms_update(self.sketch, torch.tensor(hashes, dtype=torch.int64), conservative=True)
        self._since_decay += len(hashes)
        if self._since_decay >= self.decay_period:
            ops.cms_decay(self.sketch, 1)
            self._since_decay = 0
            self._epoch += 1

    def push(self, blocks: Sequence[int], hashes: Sequence[int]) -> None:
        """Make blocks evictable; earlier blocks in the list are evicted first on equal priority."""
        if not blocks:
            return
        if self.sketch is not None:
            counts = ops.cms_query(self.sketch, torch.tensor(hashes, dtype=torch.int64))
            # Content never looked up (generated output) counts as asked for once.
            priorities = (counts.double().clamp_(min=1).log2_() + self._epoch).tolist()
        else:
            priorities = [0.0] * len(blocks)
        for block, priority in zip(blocks, priorities):
            self._counter += 1
            self._live[block] = self._counter
            heapq.heappush(self._heap, (priority, self._counter, block))

    def remove(self, block: int) -> None:
        """Take a block back (prefix hit); its heap entry goes stale."""
        del self._live[block]
        if len(self._heap) > 2 * len(self._live) + 64:  # drop stale entries now and then
            self._heap = [e for e in self._heap if self._live.get(e[2]) == e[1]]
            heapq.heapify(self._heap)

    def pop(self) -> int:
        """Evict the lowest-priority block."""
        while True:
            priority, counter, block = heapq.heappop(self._heap)
            if self._live.get(block) == counter:
                del self._live[block]
                return block
