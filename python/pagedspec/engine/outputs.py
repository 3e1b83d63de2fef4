"""What a request asks for and what it gets back: :class:`SamplingParams` in,
:class:`RequestOutput` out (vLLM's names, fields and defaults), shared by the offline ``LLM``, the
:class:`~pagedspec.engine.engine.Engine` and the server."""
from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from typing import Optional, Union

from pagedspec.engine.sampler import SamplingRow


class RequestOutputKind(enum.Enum):
    """What each :class:`RequestOutput` of a request carries (vLLM's ``RequestOutputKind``)."""
    CUMULATIVE = 0   # everything so far (the offline API's default)
    DELTA = 1        # only what is new since the request's previous output (streaming)
    FINAL_ONLY = 2   # one output, when the request finishes


@dataclass
class SamplingParams:
    """How to sample one request (vLLM's names and defaults).

    Args:
        temperature: >= 0; 0 is greedy decoding.
        top_k: keep the k most likely tokens (-1: all). top_p: keep the smallest set of most
            likely tokens holding this much mass, in (0, 1]. min_p: drop tokens less likely than
            ``min_p`` times the most likely one, in [0, 1].
        max_tokens: tokens to generate at most (>= 1; also capped by ``max_model_len``).
        stop_token_ids: tokens that end the completion (kept in ``token_ids``), besides the
            checkpoint's eos tokens unless ``ignore_eos``.
        stop: strings that end the completion; the text is cut before the stop string.
        seed: makes the request's samples reproducible whatever else is in the batch.
        n: completions to sample for the prompt.
        logprobs: return the top-``logprobs`` tokens' logprobs for every generated token.
        kv_eviction, kv_budget, kv_sink_tokens, kv_recent_tokens: this request's KV eviction
            policy, each None for the ``LLM``'s (see :class:`LLM` and
            :mod:`pagedspec.engine.kv_eviction`).
        output_kind: what each of the request's outputs carries (:class:`RequestOutputKind`);
            streaming uses ``DELTA``.
    """
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    min_p: float = 0.0
    max_tokens: int = 16
    stop_token_ids: Optional[list[int]] = None
    stop: Optional[Union[str, list[str]]] = None
    ignore_eos: bool = False
    seed: Optional[int] = None
    n: int = 1
    logprobs: Optional[int] = None
    kv_eviction: Optional[str] = None
    kv_budget: Optional[int] = None
    kv_sink_tokens: Optional[int] = None
    kv_recent_tokens: Optional[int] = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE

    def validate(self, vocab_size: int) -> None:
        """Raises ValueError naming the first parameter out of range."""
        def bad(name: str, expected: str) -> ValueError:
            return ValueError(f"SamplingParams.{name} must be {expected}, got "
                              f"{getattr(self, name)!r}")

        def is_int(x) -> bool:          # bool is an int subclass, but never a count
            return isinstance(x, int) and not isinstance(x, bool)

        def is_number(x) -> bool:
            return isinstance(x, (int, float)) and not isinstance(x, bool)

        if not (is_number(self.temperature) and self.temperature >= 0
                and math.isfinite(self.temperature)):
            raise bad("temperature", "a finite number >= 0")
        if not is_int(self.top_k) or not (self.top_k == -1 or self.top_k >= 1):
            raise bad("top_k", "-1 (off) or an int >= 1")
        if not (is_number(self.top_p) and 0 < self.top_p <= 1):
            raise bad("top_p", "in (0, 1]")
        if not (is_number(self.min_p) and 0 <= self.min_p <= 1):
            raise bad("min_p", "in [0, 1]")
        if not is_int(self.max_tokens) or self.max_tokens < 1:
            raise bad("max_tokens", "an int >= 1")
        if not is_int(self.n) or self.n < 1:
            raise bad("n", "an int >= 1")
        if self.logprobs is not None and not (is_int(self.logprobs)
                                              and 0 <= self.logprobs <= vocab_size):
            raise bad("logprobs", f"None or an int in [0, {vocab_size}]")
        if self.seed is not None and not (is_int(self.seed) and -2**63 <= self.seed < 2**64):
            raise bad("seed", "None or an int in [-2**63, 2**64)")
        if self.stop_token_ids is not None and not isinstance(self.stop_token_ids, (list, tuple)):
            raise bad("stop_token_ids", "None or a list of token ids")
        if self.stop is not None and not isinstance(self.stop, (str, list, tuple)):
            raise bad("stop", "a non-empty string or a list of them")
        if any(not is_int(t) or not 0 <= t < vocab_size
               for t in self.stop_token_ids or ()):
            raise bad("stop_token_ids", f"token ids in [0, {vocab_size})")
        if any(not isinstance(s, str) or not s for s in self.stop_strings):
            raise bad("stop", "a non-empty string or a list of them")
        if not isinstance(self.output_kind, RequestOutputKind):
            raise bad("output_kind", "a RequestOutputKind")

    @property
    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def row(self) -> SamplingRow:
        return SamplingRow(float(self.temperature), self.top_k, float(self.top_p),
                           float(self.min_p))


@dataclass
class Logprob:
    logprob: float
    rank: int                                # 1 = the most likely token
    decoded_token: Optional[str] = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: Optional[float]
    logprobs: Optional[list[dict[int, Logprob]]]   # per generated token: the top-n and the token
    finish_reason: Optional[str] = None             # "stop", "length", "abort"; None: running
    stop_reason: Union[int, str, None] = None       # the stop token or string that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """A request's timeline in ``time.monotonic()`` seconds (None until it happens)."""
    arrival_time: float
    first_scheduled_time: Optional[float] = None
    first_token_time: Optional[float] = None
    last_token_time: Optional[float] = None
    finished_time: Optional[float] = None

    @property
    def time_to_first_token(self) -> Optional[float]:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time


@dataclass
class RequestOutput:
    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    num_cached_tokens: int = 0                 # prompt tokens served by the prefix cache

    @property
    def time_per_output_token(self) -> Optional[float]:
        """Mean seconds between output tokens after the first, over all completions."""
        m = self.metrics
        extra = sum(len(o.token_ids) for o in self.outputs) - len(self.outputs)
        if m.first_token_time is None or m.finished_time is None or extra <= 0:
            return None
        return (m.finished_time - m.first_token_time) * len(self.outputs) / extra
