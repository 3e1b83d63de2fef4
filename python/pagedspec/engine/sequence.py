"""A request's state as the scheduler sees it."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Optional


class SequenceStatus(enum.Enum):
    WAITING = "waiting"      # not on the GPU: new, or preempted to be recomputed
    RUNNING = "running"      # has a GPU block table; prefilling (maybe in chunks) or decoding
    SWAPPED = "swapped"      # preempted, its blocks in CPU swap space
    FINISHED = "finished"    # blocks freed


@dataclass(eq=False)
class Sequence:
    """Token ids (prompt, then output) and how many of them are in the KV cache.

    ``num_computed_tokens`` counts the tokens whose K and V are in the cache; the scheduler asks
    the model for the rest, a chunk at a time. ``draft_token_ids`` are speculative tokens a
    proposer attached for the next step: they are verified in the same pass as the last token.
    ``eos_token_id`` and ``stop_token_ids`` end the sequence when sampled (the token is kept).
    Sequences are ordered by ``(arrival, seq_id)``: smaller is older.
    """
    seq_id: int
    token_ids: list[int]
    max_tokens: int
    arrival: int = 0
    eos_token_id: Optional[int] = None
    stop_token_ids: frozenset = frozenset()  # more tokens that end the sequence, like eos
    num_prompt_tokens: int = -1
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0               # served by the prefix cache, summed over admissions
    num_preemptions: int = 0
    draft_token_ids: list[int] = field(default_factory=list)
    finish_reason: Optional[str] = None      # "length", "stop" or "abort"

    def __post_init__(self):
        if self.num_prompt_tokens < 0:
            self.num_prompt_tokens = len(self.token_ids)

    @property
    def order(self) -> tuple[int, int]:
        return (self.arrival, self.seq_id)

    def __lt__(self, other: "Sequence") -> bool:  # older first, for sorted lists and heaps
        return (self.arrival, self.seq_id) < (other.arrival, other.seq_id)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    def is_stop_token(self, token: int) -> bool:
        return token == self.eos_token_id or token in self.stop_token_ids

    @property
    def is_decoding(self) -> bool:
        """Only the last sampled token (plus drafts) is left to compute."""
        return self.num_computed_tokens + 1 == len(self.token_ids)
