"""What one engine step did, for dashboards: :class:`StepStats` (the server turns it into
Prometheus metrics with vLLM's names; the engine itself depends on no metrics library)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


@dataclass
class FinishedRequestStats:
    """One request that ended in the step, with its timeline in seconds."""
    finish_reason: str            # "stop", "length" or "abort" (the last completion's, for n > 1)
    e2e_latency: float            # arrival -> finished
    queue_time: float             # arrival -> first scheduled (0 if never scheduled)
    prefill_time: float           # first scheduled -> first token
    decode_time: float            # first token -> finished
    num_prompt_tokens: int
    num_generation_tokens: int    # over all its completions
    max_tokens: int
    n: int


@dataclass
class SpecDecodingStats:
    """This step's speculative decoding, as vLLM counts it."""
    num_drafts: int = 0                       # sequences that verified at least one draft
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)


@dataclass
class StepStats:
    """One engine step (also what :meth:`Engine.stats` returns between steps)."""
    num_running: int = 0
    num_waiting: int = 0
    num_swapped: int = 0
    kv_cache_usage: float = 0.0               # fraction of the KV blocks in use, 0..1
    num_prompt_tokens: int = 0                # prompt tokens computed in this step
    num_generation_tokens: int = 0            # tokens emitted in this step
    num_preemptions: int = 0
    time_to_first_tokens: list[float] = field(default_factory=list)
    inter_token_latencies: list[float] = field(default_factory=list)   # per non-first token
    finished: list[FinishedRequestStats] = field(default_factory=list)
    spec: Optional[SpecDecodingStats] = None  # None without speculation
