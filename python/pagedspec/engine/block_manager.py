"""The block pool's bookkeeping: which physical block holds which part of which sequence.

:class:`BlockManager` is pure bookkeeping. Every sequence owns a block table that grows one block
at a time, so at most one partly filled block per sequence is wasted. Blocks are reference
counted: a fork shares all of them and the first write into a shared block copies it
(copy-on-write). Full blocks of verified tokens are named by a chained content hash and stay
reusable after their sequence ends (prefix caching, :mod:`pagedspec.engine.prefix_cache`).
The block moves a step needs (copies and swaps) are returned as :class:`BlockOps`, which
:class:`pagedspec.engine.kv_cache.KVCache` applies.

A GPU block is always in exactly one state:
  free      ref 0, no hash, in ``free_blocks``;
  cached    ref 0, hash registered, in the evictor (a prefix hit takes it back; eviction
            empties it);
  owned     ref >= 1: the number of block tables that hold it;
  deferred  ref 0, but read or written by this step's block moves: it returns to free or cached
            at :meth:`BlockManager.end_step`. This is why one step's moves never conflict: no
            block is both a source and a destination, no destination repeats, and nothing that a
            move reads is overwritten by the same step's forward pass.
CPU swap blocks are owned by exactly one swapped-out table, free, or deferred.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Optional, Sequence

import numpy as np
import torch

from pagedspec.engine.prefix_cache import Evictor, hash_block


def cdiv(a: int, b: int) -> int:
    return -(a // -b)


@dataclass
class BlockTable:
    """One sequence's blocks: cache position c lives in ``blocks[c // block_size]``.

    ``num_tokens`` counts the token slots in use (computed, or being computed this step);
    ``hashes`` are the chained content hashes of its first full, verified blocks; ``row`` is its
    row in ``BlockManager.table_matrix`` while on the GPU; ``on_cpu`` means it is swapped out and
    ``blocks`` are CPU swap-space ids.

    KV eviction (:meth:`BlockManager.evict`) drops whole, full blocks from the table:
    ``num_evicted`` tokens are gone, ``logical[i]`` is the sequence's own block index (token
    position // block_size) of ``blocks[i]``, and a token at position p >= every evicted block
    sits at cache position ``p - num_evicted``. Without eviction cache position = position.
    """
    blocks: list[int] = field(default_factory=list)
    num_tokens: int = 0
    hashes: list[int] = field(default_factory=list)
    row: int = -1
    on_cpu: bool = False
    logical: list[int] = field(default_factory=list)
    num_evicted: int = 0


@dataclass
class BlockOps:
    """One step's block moves, int64 ``[n, 2]`` (src, dst) each, applied in this order before the
    forward pass: ``swap_out`` (GPU -> CPU), ``swap_in`` (CPU -> GPU), ``copies`` (GPU, CoW)."""
    swap_out: torch.Tensor
    swap_in: torch.Tensor
    copies: torch.Tensor

    @staticmethod
    def empty() -> "BlockOps":
        """No moves (a forward pass outside the scheduler's steps)."""
        return BlockOps(_NO_MOVES, _NO_MOVES, _NO_MOVES)


_NO_MOVES = torch.zeros((0, 2), dtype=torch.int64)


def _mapping(pairs: list[tuple[int, int]]) -> torch.Tensor:
    return torch.tensor(pairs, dtype=torch.int64).view(-1, 2) if pairs else _NO_MOVES


class BlockManager:
    """Block tables, reference counts, copy-on-write, prefix cache, rollback and swap.

    Args:
        num_blocks: GPU blocks in the pool.
        block_size: tokens per block.
        num_cpu_blocks: blocks of CPU swap space.
        enable_prefix_caching: register full verified blocks by content hash and reuse them.
        eviction: ``"popularity"`` (sketch + recency) or ``"lru"``; see :class:`Evictor`.
        salt: bytes mixed into every chain's first hash (isolates tenants / adapters).
    """

    def __init__(self, num_blocks: int, block_size: int, num_cpu_blocks: int = 0, *,
                 enable_prefix_caching: bool = True, eviction: str = "popularity",
                 salt: bytes = b"", **evictor_args):
        self.num_blocks, self.block_size = num_blocks, block_size
        self.num_cpu_blocks = num_cpu_blocks
        self.enable_prefix_caching, self.salt = enable_prefix_caching, salt
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[Optional[int]] = [None] * num_blocks  # hash of a registered block
        self.cached: dict[int, int] = {}                            # hash -> registered block
        self.free_blocks: deque[int] = deque(range(num_blocks))
        self.evictor = Evictor(eviction, num_blocks, **evictor_args)
        self.cpu_free: deque[int] = deque(range(num_cpu_blocks))
        self.tables: dict[int, BlockTable] = {}
        # Mirror of the GPU block tables, one row per sequence: the scheduler slices its step's
        # block_tables out of it with one fancy index instead of copying Python lists.
        self.table_matrix = np.zeros((64, 64), dtype=np.int32)
        self._free_rows = list(range(63, -1, -1))
        # This step's moves, and the blocks they touch (see the module docstring).
        self._copies: list[tuple[int, int]] = []
        self._swap_out: list[tuple[int, int]] = []
        self._swap_in: list[tuple[int, int]] = []
        self._touched: set[int] = set()      # GPU blocks read or written by this step's moves
        self._written: set[int] = set()      # GPU blocks written by this step's moves
        self._copy_dsts: set[int] = set()    # the subset written by this step's copies
        self._cpu_touched: set[int] = set()
        self.deferred: set[int] = set()
        self.cpu_deferred: list[int] = []
        self.num_queried_blocks = 0          # prefix-cache statistics over full prompt blocks
        self.num_hit_blocks = 0

    # ---- capacity ------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks that an allocation can take now: free ones and evictable cached ones."""
        return len(self.free_blocks) + len(self.evictor)

    @property
    def num_free_cpu_blocks(self) -> int:
        return len(self.cpu_free)

    def num_tokens(self, seq_id: int) -> int:
        return self.tables[seq_id].num_tokens

    # ---- block and row primitives -------------------------------------------------------------
    def _take(self) -> int:
        if self.free_blocks:
            block = self.free_blocks.popleft()
        else:
            block = self.evictor.pop()
            del self.cached[self.block_hash[block]]
            self.block_hash[block] = None
        self.ref_counts[block] = 1
        return block

    def _release(self, blocks: Sequence[int]) -> None:
        """Drop one reference to each block; those reaching 0 go free, cached or deferred."""
        unowned = []
        for block in blocks:
            self.ref_counts[block] -= 1
            if not self.ref_counts[block]:
                unowned.append(block)
        self._file(unowned)

    def _file(self, blocks: Sequence[int]) -> None:
        """Put unowned blocks where they belong, keeping their order."""
        cached_blocks = []
        for block in blocks:
            if block in self._touched:
                self.deferred.add(block)
            elif self.block_hash[block] is None:
                self.free_blocks.append(block)
            else:
                cached_blocks.append(block)
        self.evictor.push(cached_blocks, [self.block_hash[b] for b in cached_blocks])

    def _unregister(self, block: int) -> None:
        del self.cached[self.block_hash[block]]
        self.block_hash[block] = None

    def _set_row(self, table: BlockTable) -> None:
        if not self._free_rows:
            rows = self.table_matrix.shape[0]
            self.table_matrix = np.concatenate([self.table_matrix,
                                                np.zeros_like(self.table_matrix)])
            self._free_rows = list(range(2 * rows - 1, rows - 1, -1))
        table.row = self._free_rows.pop()
        self._write_row(table, 0)

    def _write_row(self, table: BlockTable, start: int) -> None:
        """Mirror ``table.blocks[start:]`` into the table matrix."""
        n = len(table.blocks)
        if n > self.table_matrix.shape[1]:
            pad = max(n, 2 * self.table_matrix.shape[1]) - self.table_matrix.shape[1]
            self.table_matrix = np.pad(self.table_matrix, ((0, 0), (0, pad)))
        self.table_matrix[table.row, start:n] = table.blocks[start:]

    def _drop_row(self, table: BlockTable) -> None:
        self._free_rows.append(table.row)
        table.row = -1

    # ---- prefix cache -------------------------------------------------------------------------
    def hash_blocks(self, token_ids: Sequence[int], num_blocks: int,
                    parent: Optional[int] = None, start: int = 0) -> list[int]:
        """Chained hashes of blocks ``start .. start+num_blocks-1`` of ``token_ids``."""
        bs, hashes = self.block_size, []
        for i in range(start, start + num_blocks):
            parent = hash_block(parent, token_ids[i * bs:(i + 1) * bs], self.salt)
            hashes.append(parent)
        return hashes

    def lookup(self, token_ids: Sequence[int]) -> tuple[list[int], list[int]]:
        """``(hashes, hit_blocks)``: the hashes of the full blocks a new sequence with these tokens
        may reuse, and the registered blocks of its longest cached prefix. The last token is never
        served from the cache: the model must compute at least one token to sample from."""
        if not self.enable_prefix_caching:
            return [], []
        hashes = self.hash_blocks(token_ids, (len(token_ids) - 1) // self.block_size)
        hits = []
        for h in hashes:
            block = self.cached.get(h)
            if block is None:
                break
            hits.append(block)
        return hashes, hits

    def cache_blocks(self, seq_id: int, token_ids: Sequence[int], num_verified: int) -> None:
        """Register the sequence's full blocks within its first ``num_verified`` tokens.

        Call it only with verified tokens (never draft tokens still to be checked), so blocks
        holding unverified tokens never enter the prefix cache.
        """
        table = self.tables[seq_id]
        end = min(num_verified, table.num_tokens, len(token_ids)) // self.block_size
        done = len(table.hashes)
        # After an eviction, later K/V were computed over a partial context: they must not serve
        # another sequence's prefix (and table indices no longer match token positions).
        if not self.enable_prefix_caching or end <= done or table.on_cpu or table.num_evicted:
            return
        table.hashes += self.hash_blocks(token_ids, end - done,
                                         table.hashes[-1] if done else None, done)
        for i in range(done, end):
            block, h = table.blocks[i], table.hashes[i]
            if h not in self.cached and self.block_hash[block] is None:
                self.cached[h] = block
                self.block_hash[block] = h

    # ---- sequence lifecycle -------------------------------------------------------------------
    def allocate(self, seq_id: int, token_ids: Sequence[int], max_new_tokens: Optional[int] = None,
                 min_free_blocks: int = 0) -> Optional[int]:
        """Create a table for a new sequence, reusing its longest cached prefix, and reserve slots
        for up to ``max_new_tokens`` more of ``token_ids`` (all of them when None).

        Returns the number of tokens served from the cache, or None, with nothing changed, when
        fewer than ``min_free_blocks`` blocks would be left free.
        """
        if seq_id in self.tables:
            raise ValueError(f"BlockManager.allocate: sequence {seq_id} already has a table")
        hashes, hits = self.lookup(token_ids)
        num_cached = len(hits) * self.block_size
        num_new = len(token_ids) - num_cached
        if max_new_tokens is not None:
            num_new = min(num_new, max_new_tokens)
        needed = (cdiv(num_cached + num_new, self.block_size) - len(hits)
                  + sum(1 for b in hits if b in self.evictor))
        if needed + min_free_blocks > self.num_free_blocks:
            return None
        for block in hits:
            if self.ref_counts[block] == 0:
                if block in self.evictor:
                    self.evictor.remove(block)
                else:
                    self.deferred.discard(block)
            self.ref_counts[block] += 1
        self.evictor.record_access(hashes)
        self.num_queried_blocks += len(hashes)
        self.num_hit_blocks += len(hits)
        table = BlockTable(list(hits), num_cached, hashes[:len(hits)], logical=list(range(len(hits))))
        self.tables[seq_id] = table
        self._set_row(table)
        assert self.append_slots(seq_id, num_new)
        return num_cached

    def append_slots(self, seq_id: int, num_tokens: int) -> bool:
        """Reserve slots for ``num_tokens`` more tokens, growing the table block by block.

        Writing into a shared, partly filled last block first copies it (copy-on-write, recorded
        for this step's :class:`BlockOps`); writing into a registered one that nobody else holds
        unregisters it. Returns False, with nothing changed, when the pool is short.
        """
        table = self.tables[seq_id]
        if table.on_cpu:
            raise ValueError(f"BlockManager.append_slots: sequence {seq_id} is swapped out")
        if num_tokens <= 0:
            return num_tokens == 0
        bs = self.block_size
        total = table.num_tokens + num_tokens
        needed = -(-total // bs) - len(table.blocks)
        last = table.blocks[-1] if table.num_tokens % bs else -1  # partly filled last block
        cow = last >= 0 and self.ref_counts[last] > 1
        if needed > 0 or cow:
            if needed + cow > self.num_free_blocks:
                return False
            start = len(table.blocks) - cow
            if cow:
                # apply() swaps in before it copies, so a block swapped in this step may be a
                # copy source; a block another copy writes may not (copy_blocks runs all pairs
                # at once and rejects a dst that is also a src).
                if last in self._copy_dsts:
                    raise RuntimeError(f"BlockManager: block {last} of sequence {seq_id} is "
                                       "written by this step's copies; call end_step() first")
                copy = self._take()
                self.ref_counts[last] -= 1
                table.blocks[-1] = copy
                self._copies.append((last, copy))
                self._touched.update((last, copy))
                self._written.add(copy)
                self._copy_dsts.add(copy)
            next_logical = len(table.blocks) + table.num_evicted // bs
            table.logical.extend(range(next_logical, next_logical + needed))
            table.blocks.extend(self._take() for _ in range(needed))
            self._write_row(table, start)
        if last >= 0 and not cow and self.block_hash[last] is not None:
            self._unregister(last)  # sole holder after a truncation: its content is changing
        table.num_tokens = total
        return True

    def truncate(self, seq_id: int, num_tokens: int) -> None:
        """Roll back the last ``num_tokens`` tokens (rejected draft tokens); emptied blocks return
        to the pool."""
        table = self.tables[seq_id]
        if not 0 <= num_tokens <= table.num_tokens or table.on_cpu:
            raise ValueError(f"BlockManager.truncate: cannot drop {num_tokens} of "
                             f"{table.num_tokens} tokens of sequence {seq_id}")
        table.num_tokens -= num_tokens
        keep = cdiv(table.num_tokens, self.block_size)
        self._release(table.blocks[keep:][::-1])
        del table.blocks[keep:]
        del table.logical[keep:]
        del table.hashes[table.num_tokens // self.block_size:]

    def fork(self, parent_id: int, child_id: int) -> None:
        """The child shares every block of the parent (parallel sampling, beam search)."""
        parent = self.tables[parent_id]
        if parent.on_cpu or child_id in self.tables:
            raise ValueError(f"BlockManager.fork: cannot fork {parent_id} into {child_id}")
        for block in parent.blocks:
            self.ref_counts[block] += 1
        child = BlockTable(list(parent.blocks), parent.num_tokens, list(parent.hashes),
                           logical=list(parent.logical), num_evicted=parent.num_evicted)
        self.tables[child_id] = child
        self._set_row(child)

    def evict(self, seq_id: int, indices: Sequence[int]) -> None:
        """KV eviction: drop the full blocks at table indices ``indices`` from this sequence's
        table. A block others share stays theirs; one nobody holds returns to the pool (to the
        prefix cache if its content is registered: that content is still a valid prefix).
        Kept blocks are not moved: the table just closes up."""
        table = self.tables[seq_id]
        drop = sorted(set(indices))
        # Full blocks only, never the last one: new tokens keep following the kept ones.
        last = min(table.num_tokens // self.block_size, len(table.blocks) - 1) - 1
        if table.on_cpu or not drop or drop[0] < 0 or drop[-1] > last:
            raise ValueError(f"BlockManager.evict: sequence {seq_id} can drop only full blocks "
                             f"0..{last} (not its last) while on the GPU, got {drop}")
        released = []
        for i in reversed(drop):
            released.append(table.blocks.pop(i))
            del table.logical[i]
            if i < len(table.hashes):
                del table.hashes[i]
        self._release(released)
        n = len(drop) * self.block_size
        table.num_tokens -= n
        table.num_evicted += n
        self._write_row(table, drop[0])

    def free(self, seq_id: int) -> None:
        """Release the sequence's blocks, last block first (a prefix's tail is useless without its
        head, so on equal priority the tail is evicted first)."""
        table = self.tables.pop(seq_id)
        if table.on_cpu:
            self._release_cpu(table.blocks)
        else:
            self._release(table.blocks[::-1])
            self._drop_row(table)

    # ---- swap ---------------------------------------------------------------------------------
    def _release_cpu(self, blocks: Sequence[int]) -> None:
        for block in blocks:
            (self.cpu_deferred if block in self._cpu_touched else self.cpu_free).append(block)

    def swap_out(self, seq_id: int) -> bool:
        """Move the sequence's blocks to CPU swap space; False (nothing changed) if it is full."""
        table = self.tables[seq_id]
        if table.on_cpu or len(table.blocks) > len(self.cpu_free):
            return False
        if not self._written.isdisjoint(table.blocks):
            raise RuntimeError(f"BlockManager.swap_out: sequence {seq_id} was written by this "
                               "step's moves; call end_step() first")
        cpu_blocks = [self.cpu_free.popleft() for _ in table.blocks]
        self._swap_out += zip(table.blocks, cpu_blocks)
        self._touched.update(table.blocks)
        self._cpu_touched.update(cpu_blocks)
        self._release(table.blocks[::-1])
        self._drop_row(table)
        table.blocks, table.on_cpu = cpu_blocks, True
        return True

    def swap_in(self, seq_id: int, extra_tokens: int = 0) -> bool:
        """Bring a swapped-out sequence back, if its blocks plus room for ``extra_tokens`` more
        tokens fit; False (nothing changed) otherwise. Its full blocks re-enter the prefix cache
        unless their content is cached already."""
        table = self.tables[seq_id]
        needed = cdiv(table.num_tokens + extra_tokens, self.block_size)
        if not table.on_cpu or needed > self.num_free_blocks:
            return False
        gpu_blocks = [self._take() for _ in table.blocks]
        self._swap_in += zip(table.blocks, gpu_blocks)
        self._touched.update(gpu_blocks)
        self._written.update(gpu_blocks)
        self._cpu_touched.update(table.blocks)
        self._release_cpu(table.blocks)
        table.blocks, table.on_cpu = gpu_blocks, False
        self._set_row(table)
        for h, block in zip(table.hashes, gpu_blocks):
            if self.enable_prefix_caching and h not in self.cached:
                self.cached[h] = block
                self.block_hash[block] = h
        return True

    # ---- step boundary ------------------------------------------------------------------------
    def end_step(self) -> BlockOps:
        """Hand over this step's block moves and return deferred blocks to the pool."""
        moves = BlockOps(_mapping(self._swap_out), _mapping(self._swap_in), _mapping(self._copies))
        self._swap_out, self._swap_in, self._copies = [], [], []
        self._touched.clear()
        self._written.clear()
        self._copy_dsts.clear()
        self._cpu_touched.clear()
        deferred, self.deferred = sorted(self.deferred), set()
        self._file(deferred)
        self.cpu_free.extend(self.cpu_deferred)
        self.cpu_deferred = []
        return moves

    # ---- invariants (tests and debugging) -----------------------------------------------------
    def check_invariants(self) -> None:
        """Assert the pool's invariants; O(pool size), for tests and debugging."""
        refs = [0] * self.num_blocks
        cpu_owned: list[int] = []
        rows = set()
        for seq_id, t in self.tables.items():
            assert len(t.blocks) == cdiv(t.num_tokens, self.block_size), f"table {seq_id} size"
            assert len(t.logical) == len(t.blocks), f"table {seq_id} logical indices"
            assert t.logical == sorted(set(t.logical)), f"table {seq_id} logical order"
            assert not t.logical or t.logical[-1] < len(t.blocks) + t.num_evicted // \
                self.block_size, f"table {seq_id}: a block past the next logical index"
            assert len(set(t.blocks)) == len(t.blocks), f"table {seq_id} repeats a block"
            assert len(t.hashes) <= t.num_tokens // self.block_size, f"table {seq_id} hashes"
            if t.on_cpu:
                assert t.row == -1
                cpu_owned += t.blocks
                continue
            assert t.row not in rows and t.row >= 0, f"table {seq_id} row"
            rows.add(t.row)
            assert self.table_matrix[t.row, :len(t.blocks)].tolist() == t.blocks
            for block in t.blocks:
                refs[block] += 1
        assert refs == self.ref_counts, "reference counts differ from table references"
        free, cached = set(self.free_blocks), set(self.evictor._live)
        assert len(free) == len(self.free_blocks), "free list repeats a block"
        groups = [free, cached, self.deferred, {b for b in range(self.num_blocks) if refs[b]}]
        assert sum(map(len, groups)) == self.num_blocks, "a block is lost or in two states"
        assert set().union(*groups) == set(range(self.num_blocks))
        assert all(self.block_hash[b] is None for b in free), "a free block has a hash"
        assert all(self.block_hash[b] is not None for b in cached), "a cached block has no hash"
        assert all(self.block_hash[b] == h for h, b in self.cached.items())
        assert sum(h is not None for h in self.block_hash) == len(self.cached)
        cpu = cpu_owned + list(self.cpu_free) + self.cpu_deferred
        assert sorted(cpu) == list(range(self.num_cpu_blocks)), "a CPU block is lost or shared"
        assert len(rows) + len(self._free_rows) == self.table_matrix.shape[0]
