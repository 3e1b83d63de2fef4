"""KV eviction under a per-sequence token budget: StreamingLLM (attention sinks + a recent window)
and block-level H2O (sinks + recent window + the blocks that received the most attention), plus a
random baseline for evaluations.

Eviction works on whole, full blocks: the block manager drops them from the sequence's table
(:meth:`pagedspec.engine.BlockManager.evict`), so block tables stay plain tables, kept blocks
are never copied, and a block another sequence shares stays in that sequence's table.

Positions: keys are cached after RoPE, at their original positions, and stay there; the query of
a new token is rotated at its own original position. Attention between a query and a kept key
therefore sees their true distance, as in H2O. StreamingLLM proper reassigns positions inside the
cache (a key's position is its cache index) so that the model never sees a position past its
training length; that needs re-rotating cached keys (or caching them before RoPE), which is not
implemented here: both policies keep original positions, so a sequence must still fit the model's
``max_model_len``. What eviction buys here is memory (and the attention time over it).

The H2O signal: ``paged_attention``'s ``attn_mass`` (the attention probability each slot
received, summed over query heads, query tokens and, as the runner accumulates one buffer over
the forward pass, layers) of every decode, verification and prefill step, summed per block.
Long-horizon scores live in a count-min sketch keyed by (sequence, logical block), so the
bookkeeping stays one fixed ``[depth, width]`` int32 tensor however many requests come and go.
Mass becomes integer increments as ``round(mass * 2^8)``: the sketch's counters are integers,
1/256 of one head's attention is far below what separates heavy from light blocks, and a block
that takes all of a 32-layer x 32-head model's attention every step (1024 per step, 2^18
units) saturates the 2^31 counters only after 8192 steps without decay; ``cms_decay`` halves
every counter each ``decay_every`` steps (aging, as TinyLFU does), which keeps them bounded and
weighs recent attention more. Ties in score evict the older block first. A block shared by
several sequences (prefix caching, forks) collects every sharer's attention: its score is an
upper bound for each of them.
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Iterable, Optional, Sequence

import torch

from pagedspec import ops
from pagedspec.engine.block_manager import BlockManager, BlockTable, cdiv

MODES = ("none", "streaming", "h2o", "random")
MASS_SCALE = 256.0   # sketch units per unit of attention mass (see the module docstring)


@dataclass(frozen=True)
class KVEvictionPolicy:
    """How one sequence keeps its KV cache within ``budget`` tokens.

    Attributes:
        mode: ``"none"`` (keep everything), ``"streaming"`` (sinks + the most recent tokens),
            ``"h2o"`` (sinks + recent window + the blocks with the most accumulated attention)
            or ``"random"`` (sinks + recent window + random blocks: a baseline).
        budget: tokens of cache per sequence (None with mode "none").
        sink_tokens: the first tokens, never evicted (StreamingLLM's attention sinks).
        recent_tokens: the last tokens, never evicted; None means the rest of the budget for
            streaming and half of it for h2o / random (H2O's even split).
    """
    mode: str = "none"
    budget: Optional[int] = None
    sink_tokens: int = 4
    recent_tokens: Optional[int] = None

    @property
    def active(self) -> bool:
        return self.mode != "none"

    def window(self, block_size: int) -> int:
        """The recent window in tokens: ``recent_tokens``, or by default what the budget leaves
        after the sink blocks and one block of slack (streaming), or half the budget (h2o,
        random)."""
        if self.recent_tokens is not None:
            return self.recent_tokens
        if self.mode == "streaming":
            return max(0, self.budget - (cdiv(self.sink_tokens, block_size) + 1) * block_size)
        return self.budget // 2

    def protected_blocks(self, block_size: int) -> tuple[int, int]:
        """(sink blocks, recent blocks): whole blocks never evicted. The recent window covers
        the last ``window()`` tokens wherever the block boundaries fall, so it may span one
        block more than ``window() / block_size``."""
        return (cdiv(self.sink_tokens, block_size),
                cdiv(self.window(block_size), block_size) + 1)

    def check(self, block_size: int, who: str = "kv_budget") -> None:
        """ValueError unless the budget holds the sinks and the recent window in whole blocks
        (then an over-budget sequence always has a block it may evict)."""
        if self.mode not in MODES:
            raise ValueError(f"kv_eviction must be one of {MODES}, got {self.mode!r}")
        if not self.active:
            return
        if self.budget is None or self.budget <= 0:
            raise ValueError(f"{who} must be a positive number of tokens with "
                             f"kv_eviction={self.mode!r}, got {self.budget}")
        if self.sink_tokens < 0 or self.window(block_size) < 0:
            raise ValueError(f"kv_sink_tokens and kv_recent_tokens must be >= 0, got "
                             f"{self.sink_tokens} and {self.window(block_size)}")
        sinks, recent = self.protected_blocks(block_size)
        if (sinks + recent) * block_size > self.budget:
            raise ValueError(
                f"{who} ({self.budget} tokens) must hold the {self.sink_tokens} sink tokens and "
                f"the {self.window(block_size)}-token recent window in whole blocks of "
                f"{block_size}: at "
                f"least {(sinks + recent) * block_size} tokens")


def block_key(seq_id: int, logical_block: int) -> int:
    """The sketch key of a sequence's logical block (int64)."""
    return (seq_id << 24) ^ logical_block


class KVBudgets:
    """Per-sequence policies, the attention-mass sketch, and the eviction step.

    ``record`` takes a step's per-block attention mass; ``enforce`` evicts blocks of sequences
    over their budget. Both are called between the forward pass and the next schedule.
    """

    def __init__(self, sketch_depth: int = 4, sketch_width: int = 1 << 16,
                 decay_every: int = 1024, seed: int = 0):
        self.policies: dict[int, KVEvictionPolicy] = {}
        self.sketch = torch.zeros(sketch_depth, sketch_width, dtype=torch.int32)
        self.decay_every = decay_every
        self.rng = random.Random(seed)
        self.num_records = 0
        self.num_evicted_blocks = 0

    def set(self, seq_id: int, policy: KVEvictionPolicy) -> None:
        if policy.active:
            self.policies[seq_id] = policy

    def forget(self, seq_id: int) -> None:
        self.policies.pop(seq_id, None)

    def mass_buffer(self, bm: BlockManager, seq_ids: Iterable[int],
                    device: torch.device) -> Optional[torch.Tensor]:
        """The zeroed ``attn_mass`` buffer (float32 ``[num_blocks * block_size]``) for a step of
        these sequences, or None when none of them is h2o (the step then skips the mass pass)."""
        if not any(self.policies.get(s, _NONE).mode == "h2o" for s in seq_ids):
            return None
        return torch.zeros(bm.num_blocks * bm.block_size, device=device)

    def record(self, bm: BlockManager, seq_ids: Sequence[int], attn_mass: torch.Tensor) -> None:
        """Add a step's attention mass (``mass_buffer``'s, after the forward pass) to the scores
        of the h2o sequences' blocks."""
        block_mass = attn_mass.view(bm.num_blocks, -1).sum(1).cpu()
        keys, blocks = [], []
        for seq_id in seq_ids:
            if self.policies.get(seq_id, _NONE).mode != "h2o":
                continue
            table = bm.tables[seq_id]
            keys += [block_key(seq_id, b) for b in table.logical]
            blocks += table.blocks
        if keys:
            increments = (block_mass[torch.tensor(blocks)] * MASS_SCALE).round().clamp_(
                0, 2 ** 31 - 1).to(torch.int32)
            ops.cms_update(self.sketch, torch.tensor(keys, dtype=torch.int64), increments)
        self.num_records += 1
        if self.decay_every and self.num_records % self.decay_every == 0:
            ops.cms_decay(self.sketch, 1)

    def scores(self, seq_id: int, logical_blocks: Sequence[int]) -> list[int]:
        if not logical_blocks:
            return []
        keys = torch.tensor([block_key(seq_id, b) for b in logical_blocks], dtype=torch.int64)
        return ops.cms_query(self.sketch, keys).tolist()

    def victims(self, seq_id: int, table: BlockTable, block_size: int,
                computed_tokens: int) -> list[int]:
        """Table indices to evict so that the sequence fits its budget (empty when it does).
        Candidates: full blocks past the sinks, before the recent window, and wholly inside the
        first ``computed_tokens`` positions (so a draft cache that lags behind never has to
        write into an evicted block)."""
        policy = self.policies.get(seq_id, _NONE)
        if not policy.active or table.num_tokens <= policy.budget:
            return []
        excess = cdiv(table.num_tokens - policy.budget, block_size)
        sinks, _ = policy.protected_blocks(block_size)
        length = table.num_tokens + table.num_evicted          # the sequence's positions
        recent_start = max(0, length - policy.window(block_size)) // block_size
        limit = min(recent_start, computed_tokens // block_size)
        candidates = [i for i, b in enumerate(table.logical) if sinks <= b < limit]
        if policy.mode == "streaming":
            chosen = candidates[:excess]                       # the oldest first
        elif policy.mode == "random":
            chosen = self.rng.sample(candidates, min(excess, len(candidates)))
        else:                                                  # h2o: the lightest first
            scores = self.scores(seq_id, [table.logical[i] for i in candidates])
            order = sorted(range(len(candidates)), key=lambda j: (scores[j], j))
            chosen = [candidates[j] for j in order[:excess]]
        return sorted(chosen)

    def enforce(self, bm: BlockManager, seqs: Iterable[tuple[int, int]]) -> int:
        """Evict over-budget sequences' blocks; ``seqs`` are (seq_id, computed tokens) of
        sequences on the GPU. Returns the number of blocks evicted."""
        evicted = 0
        for seq_id, computed in seqs:
            table = bm.tables.get(seq_id)
            if table is None or table.on_cpu:
                continue
            drop = self.victims(seq_id, table, bm.block_size, computed)
            if drop:
                bm.evict(seq_id, drop)
                evicted += len(drop)
        self.num_evicted_blocks += evicted
        return evicted


_NONE = KVEvictionPolicy()
