"""Iteration-level continuous batching over the paged block pool.

Every step (:meth:`Scheduler.schedule`):
1. Running sequences, oldest first, get their next tokens: one per decoding sequence (plus its
   draft tokens), a chunk of the prompt for a prefilling one. Prefill chunks are capped so that
   the token budget still covers every decode after them: long prompts are split across steps
   (chunked prefill) and never stall decodes.
2. If that needed no preemption: swapped-out sequences come back, oldest first, while blocks and
   budget allow; then waiting requests are admitted in arrival order (first come, first served:
   admission stops at the first one that does not fit, so a large request is never overtaken
   forever) while blocks (keeping a small watermark free), the budget and ``max_num_seqs`` allow.
   A new request reuses the longest cached prefix of its prompt.
3. The step's inputs for the model runner are built with a handful of numpy calls.
After the model step, :meth:`Scheduler.update` appends the sampled tokens, rolls back rejected
draft tokens, registers newly full verified blocks in the prefix cache, and retires finished
sequences at once, freeing their blocks.

Preemption: when a running sequence needs a block and none is free, the newest running sequence
is preempted (the one needing the block itself, if it is the newest), repeatedly, until the block
fits. So the oldest request always progresses, and since a request is only accepted if it fits
the pool alone, every request completes. The victim is *swapped* (its blocks copied to CPU swap
space, resumed before any waiting request) when ``preemption_mode`` is ``"swap"``, or ``"auto"``
and it holds at least ``swap_min_tokens`` computed tokens; otherwise, or when swap space is full,
it is *recomputed*: its blocks are freed (full ones stay in the prefix cache, so a recompute is
often cheap) and it rejoins the waiting queue in its arrival place, later re-prefilling prompt
and output. Rationale: re-prefilling n tokens costs compute growing faster than n, a swap costs
2 n token-sizes of transfer and CPU memory; short contexts are cheaper to recompute.

Prefix-cache eviction (:class:`pagedspec.engine.prefix_cache.Evictor`): blocks of finished or preempted
sequences stay cached until memory is needed; free blocks without content go first. Among cached
ones the victim has the lowest ``log2(popularity) + epoch``: popularity is the count-min sketch's
count of prompt lookups of the block's content hash, halved every decay period (one epoch), so
the priority is the count in today's units and stale fame fades (recency); ties go least recently
freed, the tail of a prefix before its head. With ``eviction="lru"`` it is plain LRU. On a Zipf
shared-prefix workload polluted by one-off documents this beats LRU (bench/NOTES.md).
"""
from __future__ import annotations

import heapq
import itertools
from bisect import insort
from dataclasses import dataclass, field
from typing import Optional, Sequence as Seq

import numpy as np
import torch

from pagedspec.engine.block_manager import BlockManager, BlockOps
from pagedspec.engine.sequence import Sequence, SequenceStatus


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 256                # running sequences at most
    max_num_batched_tokens: int = 2048     # token budget per step
    preemption_mode: str = "auto"          # "auto", "recompute" or "swap"
    swap_min_tokens: int = 512             # "auto": swap victims with at least this many tokens
    watermark: float = 0.01                # fraction of blocks admission leaves free


def slot_mapping(block_tables: np.ndarray, table_rows: np.ndarray, cache_positions: np.ndarray,
                 block_size: int) -> np.ndarray:
    """Each token's KV slot (int64): the block that row ``table_rows[t]`` of ``block_tables``
    holds at ``cache_positions[t]``, times ``block_size``, plus the offset inside it."""
    blocks = block_tables[table_rows, cache_positions // block_size].astype(np.int64)
    return blocks * block_size + cache_positions % block_size


@dataclass
class StepBatch:
    """One step for the model runner. Token rows are grouped by sequence, in ``seqs`` order."""
    seqs: list[Sequence]
    num_scheduled_tokens: list[int]
    num_draft_tokens: list[int]            # draft tokens verified in this step, per sequence
    input_ids: torch.Tensor                # int64 [T]
    positions: torch.Tensor                # int64 [T]
    slot_mapping: torch.Tensor             # int64 [T], for reshape_and_cache
    block_tables: torch.Tensor             # int32 [B, M]
    seq_lens: torch.Tensor                 # int32 [B], cache length incl. this step's tokens
                                           # (positions minus evicted tokens)
    cu_seqlens_q: torch.Tensor             # int32 [B + 1]
    max_q_len: int
    logits_indices: torch.Tensor           # int64 [L]: rows to sample from (1 + drafts per seq)
    block_ops: BlockOps                    # apply before the forward pass (KVCache.apply)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.numel())


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager,
                 device: torch.device | str = "cpu"):
        if config.preemption_mode not in ("auto", "recompute", "swap"):
            raise ValueError(f"Scheduler: preemption_mode must be auto, recompute or swap, got "
                             f"{config.preemption_mode!r}")
        if config.max_num_batched_tokens <= config.max_num_seqs:
            raise ValueError("Scheduler: max_num_batched_tokens must exceed max_num_seqs, so "
                             "prefills progress beside a full batch of decodes")
        self.config, self.block_manager = config, block_manager
        self.device = torch.device(device)
        self.running: list[Sequence] = []               # sorted, oldest first
        self.waiting: list[Sequence] = []               # heap, oldest first
        self.swapped: list[Sequence] = []               # heap, oldest first
        self._ids = itertools.count()
        self._arrivals = itertools.count()
        self.num_preemptions = 0                        # over the scheduler's lifetime

    # ---- requests -----------------------------------------------------------------------------
    def add(self, prompt_token_ids: Seq[int], max_tokens: int,
            eos_token_id: Optional[int] = None, stop_token_ids: Seq[int] = ()) -> Sequence:
        """Queue a request. It must fit the pool alone (so it can always complete)."""
        bm = self.block_manager
        if not prompt_token_ids or max_tokens < 1:
            raise ValueError("Scheduler.add: need a non-empty prompt and max_tokens >= 1")
        if len(prompt_token_ids) + max_tokens > bm.num_blocks * bm.block_size:
            raise ValueError(f"Scheduler.add: {len(prompt_token_ids)} + {max_tokens} tokens exceed "
                             f"the pool of {bm.num_blocks} x {bm.block_size} slots")
        seq = Sequence(next(self._ids), list(prompt_token_ids), max_tokens,
                       next(self._arrivals), eos_token_id, frozenset(stop_token_ids))
        heapq.heappush(self.waiting, seq)
        return seq

    def fork(self, seq: Sequence) -> Sequence:
        """A running sequence's copy sharing all its blocks (parallel sampling); call between
        steps. The child may push the running count past ``max_num_seqs``."""
        if seq.status is not SequenceStatus.RUNNING:
            raise ValueError("Scheduler.fork: only running sequences can be forked")
        child = Sequence(next(self._ids), list(seq.token_ids), seq.max_tokens, seq.arrival,
                         seq.eos_token_id, seq.stop_token_ids, seq.num_prompt_tokens,
                         SequenceStatus.RUNNING, seq.num_computed_tokens)
        self.block_manager.fork(seq.seq_id, child.seq_id)
        insort(self.running, child)
        return child

    def has_unfinished(self) -> bool:
        return bool(self.running or self.waiting or self.swapped)

    # ---- one step -----------------------------------------------------------------------------
    def schedule(self) -> StepBatch:
        bm, cfg = self.block_manager, self.config
        budget = cfg.max_num_batched_tokens
        scheduled: list[tuple[Sequence, int]] = []
        preempted: list[Sequence] = []
        running = self.running
        # Tokens the decodes still to be visited need; prefill chunks leave them room.
        reserve = 0
        for seq in running:
            if seq.num_computed_tokens + 1 == len(seq.token_ids):  # decoding
                if seq.draft_token_ids:  # never draft past max_tokens
                    del seq.draft_token_ids[seq.num_prompt_tokens + seq.max_tokens
                                            - len(seq.token_ids) - 1:]
                reserve += 1 + len(seq.draft_token_ids)
        append_slots = bm.append_slots
        i = 0
        while i < len(running):
            seq = running[i]
            num = len(seq.token_ids) - seq.num_computed_tokens
            if num == 1:                                 # decoding
                num += len(seq.draft_token_ids)
                reserve -= num
                if num > budget:
                    num = 0
            else:
                num = min(num, budget - reserve)
            if num <= 0:
                i += 1
                continue
            while not append_slots(seq.seq_id, num):
                victim = running.pop()           # the newest; never one scheduled already
                if victim is not seq and victim.is_decoding:
                    reserve -= 1 + len(victim.draft_token_ids)
                self._preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    break
            if seq.status is not SequenceStatus.RUNNING:
                break                            # it was the newest and is preempted
            scheduled.append((seq, num))
            budget -= num
            i += 1

        if not preempted:
            while self.swapped and len(running) < cfg.max_num_seqs:
                seq = self.swapped[0]
                num = min(len(seq.token_ids) - seq.num_computed_tokens, budget)
                if num <= 0 or not bm.swap_in(seq.seq_id, num):
                    break
                heapq.heappop(self.swapped)
                assert bm.append_slots(seq.seq_id, num)
                self._start(seq, num, scheduled)
                budget -= num
            watermark = int(cfg.watermark * bm.num_blocks) if running else 0
            while self.waiting and not self.swapped and len(running) < cfg.max_num_seqs and budget:
                seq = self.waiting[0]
                num_cached = bm.allocate(seq.seq_id, seq.token_ids, budget, watermark)
                if num_cached is None:
                    break
                heapq.heappop(self.waiting)
                seq.num_computed_tokens = num_cached
                seq.num_cached_tokens += num_cached
                num = bm.num_tokens(seq.seq_id) - num_cached
                self._start(seq, num, scheduled)
                budget -= num
        return self._build(scheduled, bm.end_step(), preempted)

    def _start(self, seq: Sequence, num: int, scheduled: list) -> None:
        seq.status = SequenceStatus.RUNNING
        insort(self.running, seq)
        scheduled.append((seq, num))

    def _preempt(self, seq: Sequence) -> None:
        cfg = self.config
        seq.draft_token_ids = []
        seq.num_preemptions += 1
        self.num_preemptions += 1
        swap = cfg.preemption_mode == "swap" or (
            cfg.preemption_mode == "auto" and seq.num_computed_tokens >= cfg.swap_min_tokens)
        if swap and self.block_manager.swap_out(seq.seq_id):
            seq.status = SequenceStatus.SWAPPED
            heapq.heappush(self.swapped, seq)
        else:
            self.block_manager.free(seq.seq_id)
            seq.num_computed_tokens = 0
            seq.status = SequenceStatus.WAITING
            heapq.heappush(self.waiting, seq)

    def _build(self, scheduled: list[tuple[Sequence, int]], block_ops: BlockOps,
               preempted: list[Sequence]) -> StepBatch:
        """The kernels' inputs, from per-sequence scalars with a few vectorized numpy calls."""
        bm, n, tables = self.block_manager, len(scheduled), self.block_manager.tables
        seqs, input_ids, per_seq = [], [], []
        for seq, q in scheduled:
            c, tokens = seq.num_computed_tokens, seq.token_ids
            seqs.append(seq)
            table = tables[seq.seq_id]
            per_seq += (q, c, len(tokens), table.row, table.num_evicted)
            if q == 1:
                input_ids.append(tokens[c])
            else:
                chunk = tokens[c:c + q]
                input_ids += chunk
                if len(chunk) < q:
                    input_ids += seq.draft_token_ids[:q - len(chunk)]
        q_lens, starts, ends, rows, evicted = np.array(per_seq, np.int64).reshape(n, 5).T
        cu = np.zeros(n + 1, np.int64)
        np.cumsum(q_lens, out=cu[1:])
        seq_lens = starts + q_lens
        positions = np.arange(cu[-1]) - np.repeat(cu[:-1] - starts, q_lens)
        # The cache holds a sequence's positions minus its evicted blocks (all of them before
        # the new tokens): the kernels see cache lengths and slots, the model true positions.
        cache_lens = seq_lens - evicted
        cache_positions = positions - np.repeat(evicted, q_lens)
        bs = bm.block_size
        # At least two columns: a compiled forward would get a graph of its own for tables one
        # block wide (sizes of 1 are specialized); the kernels never read past a length.
        width = max(2, int(-(-cache_lens.max() // bs))) if n else 0
        block_tables = bm.table_matrix[rows, :width]
        slots = slot_mapping(block_tables, np.repeat(np.arange(n), q_lens), cache_positions, bs)
        drafts = np.maximum(seq_lens - ends, 0)
        num_logits = (seq_lens >= ends) * (1 + drafts)
        first = np.repeat(cu[1:] - num_logits, num_logits)
        logits_indices = first + np.arange(first.size) - np.repeat(
            np.cumsum(num_logits) - num_logits, num_logits)
        dev = self.device
        t = lambda a, dtype: torch.from_numpy(np.ascontiguousarray(a)).to(dev, dtype)  # noqa: E731
        return StepBatch(
            seqs=seqs, num_scheduled_tokens=q_lens.tolist(), num_draft_tokens=drafts.tolist(),
            input_ids=torch.tensor(input_ids, dtype=torch.int64, device=dev),
            positions=t(positions, torch.int64), slot_mapping=t(slots, torch.int64),
            block_tables=t(block_tables, torch.int32), seq_lens=t(cache_lens, torch.int32),
            cu_seqlens_q=t(cu, torch.int32), max_q_len=int(q_lens.max()) if n else 0,
            logits_indices=t(logits_indices, torch.int64), block_ops=block_ops,
            preempted=preempted)

    def update(self, batch: StepBatch, sampled: Seq[Seq[int]]) -> list[Sequence]:
        """Take the model's output for ``batch`` and return the sequences that finished.

        ``sampled[i]`` holds the new tokens of ``batch.seqs[i]``: none for a prefill chunk that
        does not reach the end of the prompt, one for a decode, and for a sequence that verified
        k draft tokens, the accepted drafts followed by the corrected or bonus token.
        """
        bm, bs = self.block_manager, self.block_manager.block_size
        finished = []
        for seq, num, drafts, new in zip(batch.seqs, batch.num_scheduled_tokens,
                                         batch.num_draft_tokens, sampled):
            old = seq.num_computed_tokens
            if drafts:
                seq.draft_token_ids = []
                rejected = drafts + 1 - len(new)
                if rejected:
                    bm.truncate(seq.seq_id, rejected)
                    num -= rejected
            seq.num_computed_tokens = old + num
            if new:
                seq.token_ids += new
                if (seq.eos_token_id is not None or seq.stop_token_ids
                        or len(seq.token_ids) >= seq.num_prompt_tokens + seq.max_tokens):
                    self._check_finished(seq, new)
            if (old + num) // bs != old // bs:        # a block filled up: cache it
                bm.cache_blocks(seq.seq_id, seq.token_ids, old + num)
            if seq.finish_reason is not None:
                bm.free(seq.seq_id)
                seq.status = SequenceStatus.FINISHED
                finished.append(seq)
        if finished:
            self.running = [s for s in self.running if s.status is SequenceStatus.RUNNING]
        return finished

    def finish(self, seq: Sequence, reason: str = "abort") -> None:
        """End a request early, between steps, wherever it is (e.g. a stop string was produced
        or the caller gave up); its blocks are freed."""
        if seq.status is SequenceStatus.FINISHED:
            return
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        else:
            queue = self.waiting if seq.status is SequenceStatus.WAITING else self.swapped
            queue.remove(seq)
            heapq.heapify(queue)
        if seq.seq_id in self.block_manager.tables:
            self.block_manager.free(seq.seq_id)
        seq.draft_token_ids = []
        seq.finish_reason = reason
        seq.status = SequenceStatus.FINISHED

    @staticmethod
    def _check_finished(seq: Sequence, new: Seq[int]) -> None:
        limit = seq.num_prompt_tokens + seq.max_tokens
        stop = next((i for i, t in enumerate(new) if seq.is_stop_token(t)), None)
        if stop is not None:
            eos = len(seq.token_ids) - len(new) + stop
            if eos < limit:
                del seq.token_ids[eos + 1:]
                seq.finish_reason = "stop"
                return
        if len(seq.token_ids) >= limit:
            del seq.token_ids[limit:]
            seq.finish_reason = "length"
