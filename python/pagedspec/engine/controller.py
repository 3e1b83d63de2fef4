"""Chooses each step's number of draft tokens from measured costs and acceptance.

The model. A decoding sequence r that drafts k tokens emits ``E_r(k) = 1 + sum_{i<=k}
prod_{j<=i} a_r(j)`` tokens in expectation, where ``a_r(j)`` is the probability that draft j is
accepted given drafts 1..j-1 were: a moving average per draft position over all requests, scaled
by the request's own acceptance relative to the global one (shrunk towards it by a few
pseudo-observations, so a request whose drafts keep failing drafts less, but one unlucky step
does not condemn it); a position seldom reached borrows the estimate of the one before it. A step with ``B`` decoding sequences drafting ``k`` each and ``P`` other
tokens (prefill chunks) costs ``k * d(B) + t(P + B (k + 1))``: ``d`` the draft pass cost by batch
size, ``t`` the target step cost by tokens in the step, both measured on this machine as the run
goes. The controller picks the k in ``0..max_k`` that maximizes ``sum_r E_r(k) / cost(k)``
(k = 0 is plain decoding: ``B / t(P + B)``). This is seed 004's speedup rule ``(1 - a^(k+1)) /
((1 - a) (k c + 1))`` with its two simplifications removed: the target's cost grows with the
tokens verified (it is not free once the batch is compute-bound), and acceptance varies by
position and request.

A check against reality: the realized tokens per second of decode-only steps are kept per batch
size (in powers of two) and k; where steps drafting the chosen k have delivered less than plain
ones within the last ``GOODPUT_MEMORY`` steps, the controller does not draft (after that,
the model may try again, so a change such as acceptance improving is seen).

Switching a draft model back on. While k = 0, the draft model's cache falls behind: the first
drafting pass after a pause also feeds it every token it skipped. That is paid once per
switch, so a drafting k is charged ``L * c / decide_every`` more per step: ``L`` the tokens the
batch's paused draft caches lack, ``c`` the measured seconds per caught-up token, and
``decide_every`` the steps a decision holds at least. Without it, near break-even (batch 8,
SmolLM2 and its draft) k flipped between 0 and 1 and the catch-ups took 5% of the run. A new
request's prompt is paid once in its life if it ever drafts: it is spread over the requests'
mean room instead (spread over decide_every, it kept a draft that won 1.12x at batch 1 off).

Measurements. ``t`` and ``d`` are kept as moving averages in buckets of their argument (each
size up to 32, powers of two above) and interpolated linearly between measured buckets; above
them ``t`` is extrapolated along the slope of the last two (proportionally to the tokens while
only one is known: pessimistic for speculation, so a large k is not chosen on hope). Every
``explore_every`` steps one step uses a neighbour of the best k (best + 1 when speculation is
off), so costs and acceptance stay measured near the choice at the price of one slightly worse
step; while k = 0 keeps winning, the gap doubles up to ``MAX_EXPLORE_EVERY`` (exploring then
costs a verification and a draft model's catch-up). The first two steps draft up to 4 tokens to learn the acceptance, then
one plain step measures the cost without drafts. Learning steps draft for a quarter of the
batch only: at a large batch, where speculation rarely pays, they stay cheap (a draft model
must also catch its cache up on every token it skipped).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import numpy as np


class CostCurve:
    """Seconds as a function of a size, from measurements: a moving average per bucket (each
    size up to :attr:`EXACT_SIZES`, powers of two above), linear interpolation between buckets,
    linear extrapolation above (the slope of the last two buckets; proportional to the size
    while only one is measured), constant below."""

    # Small sizes are not smooth: the products' kernels change with the rows (packed_linear up
    # to 4, oneDNN above), and before packed_linear oneDNN streamed 1-2 rows slower than 3-4, so
    # on SmolLM2 (float32, Zen 4) a target step verifying 3 tokens cost 28-29 ms, one of 1 or 2
    # tokens 35-37 ms. In one power-of-two bucket, 2 and 3 looked alike and the controller kept
    # k = 1 (1.30x) where k = 2 gave 1.65x.
    EXACT_SIZES = 32

    def __init__(self, decay: float = 0.8):
        self.decay = decay
        self._buckets: dict[int, list[float]] = {}   # bucket -> [mean size, mean seconds]
        self._points: Optional[list[tuple[float, float]]] = None   # sorted, until observe

    def observe(self, size: int, seconds: float) -> None:
        self._points = None
        b = self._bucket(size)
        if b not in self._buckets:
            self._buckets[b] = [float(size), seconds]
        else:
            m = self._buckets[b]
            m[0] = self.decay * m[0] + (1 - self.decay) * size
            m[1] = self.decay * m[1] + (1 - self.decay) * seconds

    def _bucket(self, size: int) -> int:
        size = max(int(size), 1)
        return size if size <= self.EXACT_SIZES else self.EXACT_SIZES + size.bit_length()

    def known(self, size: int) -> bool:
        return self._bucket(size) in self._buckets

    def __call__(self, size: int) -> Optional[float]:
        if not self._buckets:
            return None
        if self._points is None:
            self._points = sorted((x, y) for x, y in self._buckets.values())
        points = self._points
        if size <= points[0][0]:
            return points[0][1]
        for (x0, y0), (x1, y1) in zip(points, points[1:]):
            if size <= x1:
                return y0 + (y1 - y0) * (size - x0) / max(x1 - x0, 1e-9)
        x, y = points[-1]
        if len(points) == 1:
            return y * size / max(x, 1e-9)
        (x0, y0) = points[-2]
        slope = max((y - y0) / max(x - x0, 1e-9), 0.0)
        return y + slope * (size - x)


@dataclass
class SpecStats:
    """vLLM's speculative-decoding metrics, plus time per step."""
    num_drafts: int = 0                  # sequence-steps that drafted at least one token
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    drafted_per_position: list[int] = field(default_factory=list)
    draft_seconds: float = 0.0
    target_seconds: float = 0.0
    num_steps: int = 0
    # A draft model's first pass of a step feeds each sequence the tokens its cache lacks: one
    # normally, more after a pause (k = 0 steps, a prefix-cache hit, a new request). Tokens
    # beyond one per sequence, and that pass's seconds when it fed any.
    catch_up_tokens: int = 0
    catch_up_seconds: float = 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens emitted per drafting sequence-step: 1 + accepted / drafts (vLLM's)."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0

    def as_dict(self) -> dict:
        per_pos = [a / d if d else 0.0 for a, d in zip(self.accepted_per_position,
                                                        self.drafted_per_position)]
        return {"num_drafts": self.num_drafts, "num_draft_tokens": self.num_draft_tokens,
                "num_accepted_tokens": self.num_accepted_tokens,
                "acceptance_rate": self.acceptance_rate,
                "mean_acceptance_length": self.mean_acceptance_length,
                "accepted_per_position": list(self.accepted_per_position),
                "acceptance_rate_per_position": per_pos,
                "draft_seconds_per_step": self.draft_seconds / max(self.num_steps, 1),
                "target_seconds_per_step": self.target_seconds / max(self.num_steps, 1),
                "catch_up_tokens": self.catch_up_tokens,
                "catch_up_seconds": self.catch_up_seconds,
                "num_steps": self.num_steps}


@dataclass
class Goodput:
    """Realized tokens per second of one kind of step: decayed sums of tokens and seconds (a
    ratio of sums, not an average of per-step rates: at batch 1 a drafting step's tokens are 1
    or 2 at random, and averaged rates of a few such steps swung by 2x)."""
    MIN_STEPS = 8           # steps behind a rate before it may veto drafting
    tokens: float = 0.0
    seconds: float = 0.0
    count: int = 0
    step: int = 0           # the controller step of the last observation

    def observe(self, tokens: int, seconds: float, step: int, decay: float = 0.9) -> None:
        self.tokens = decay * self.tokens + tokens
        self.seconds = decay * self.seconds + seconds
        self.count += 1
        self.step = step

    @property
    def rate(self) -> float:
        return self.tokens / max(self.seconds, 1e-9)


class SpeculationController:
    """Picks k per step. ``adaptive=False`` always drafts ``max_k`` (a fixed k)."""

    REQUEST_PRIOR = 8.0   # pseudo-drafts at the global rate behind each request's estimate
    # A new k must promise this much more than the current one: switching costs what the model
    # does not see (turning a draft model back on makes it catch up on every skipped token), and
    # near break-even the estimates' noise would otherwise flip k back and forth.
    HYSTERESIS = 1.05
    # Steps a measured loss of drafting vetoes it for; then the model may try again.
    GOODPUT_MEMORY = 64
    # The longest gap between exploration steps. Exploring while k = 0 wins costs a
    # verification and, with a draft model, its cache catching up on every token skipped since
    # the last draft: at batch 64 with a misaligned draft, one such step in 8 cost ~10% of the
    # throughput. So while k = 0 keeps winning the gap doubles, up to this; once drafting
    # pays, it is back to ``explore_every``.
    MAX_EXPLORE_EVERY = 256
    # ... but only while k = 1 is predicted to deliver under this share of k = 0's rate: near
    # break-even the estimates' noise decides, and a few unlucky samples had a draft that won
    # 1.2x at k = 1 stay off for hundreds of steps (SmolLM2 and its draft, batch 1).
    CLOSE_MARGIN = 0.95

    def __init__(self, max_k: int, adaptive: bool = True, warmup_steps: int = 3,
                 explore_every: int = 8, decay: float = 0.9, prior: float = 0.5,
                 decide_every: int = 4):
        if max_k < 1:
            raise ValueError(f"SpeculationController: max_k must be >= 1, got {max_k}")
        self.max_k, self.adaptive = max_k, adaptive
        self.warmup_steps, self.explore_every, self.decay = warmup_steps, explore_every, decay
        self._explore_gap = explore_every
        self._next_explore = explore_every      # the step that explores next
        self._explorations = 0
        self.accept = [prior] * max_k           # P(draft j accepted | drafts < j accepted)
        self.accept_seen = [0] * max_k          # observations behind each estimate
        self.global_rate = prior                # moving per-draft acceptance over requests
        self._request_counts: dict[int, tuple[int, int]] = {}   # key -> (accepted, drafted)
        # Realized tokens/s of decode-only steps, by (batch size bucket, drafted or not): the
        # model's check against reality (what it does not model, such as a draft catching up
        # after a pause, shows here).
        self._goodput: dict[tuple[int, int], Goodput] = {}
        self.target_cost = CostCurve()          # seconds per target step, by tokens
        self.draft_cost = CostCurve()           # seconds per draft pass, by sequences
        self.catch_up_cost: Optional[float] = None   # seconds per token a draft catches up
        self.steps = 0
        self.history: list[int] = []            # the k chosen at each step
        self.draft_limit: Optional[int] = None  # requests that draft this step (None: all)
        # The choice is re-derived every `decide_every` steps or when the batch size changes:
        # the estimates move slowly, and deciding costs ~0.1 ms (a few % of a small step).
        self.decide_every = decide_every
        self._decided: Optional[tuple[int, int, int]] = None    # (batch size, step, k)
        self._margin = 0.0      # the last decision's predicted rate of k = 1 over k = 0's

    # ---- what was measured ------------------------------------------------------------------
    def observe_target(self, num_tokens: int, seconds: float) -> None:
        self.target_cost.observe(num_tokens, seconds)

    def observe_draft(self, num_seqs: int, seconds: float) -> None:
        """One drafting pass (one token for each of ``num_seqs`` sequences) took ``seconds``."""
        self.draft_cost.observe(num_seqs, seconds)

    def observe_catch_up(self, num_seqs: int, num_tokens: int, seconds: float) -> None:
        """A drafting pass that also fed the draft model ``num_tokens - num_seqs`` tokens its
        cache lacked took ``seconds``: what is beyond a plain pass, per caught-up token."""
        plain = self.draft_cost(num_seqs) or 0.0
        per_token = max(seconds - plain, 0.0) / max(num_tokens - num_seqs, 1)
        old = self.catch_up_cost
        self.catch_up_cost = per_token if old is None else 0.8 * old + 0.2 * per_token

    def observe_goodput(self, num_seqs: int, k: int, tokens: int, seconds: float) -> None:
        """A decode-only step's result: ``tokens`` emitted by ``num_seqs`` sequences drafting
        ``k`` each (0: none) in ``seconds`` (drafting included). Kept per k: the warm-up's
        k = 4 losing must not veto a k = 1 that wins (it did, for 64 steps at a time, on
        SmolLM2 and its draft at batch 1)."""
        key = (max(num_seqs, 1).bit_length(), k)
        self._goodput.setdefault(key, Goodput()).observe(tokens, seconds, self.steps)

    def observe_acceptance(self, request_key: int, k: int, accepted: int) -> None:
        d = self.decay
        for j in range(min(accepted + 1, k)):   # positions reached: accepted ones + the first fail
            hit = 1.0 if j < accepted else 0.0
            self.accept[j] = d * self.accept[j] + (1 - d) * hit
            self.accept_seen[j] += 1
        rate = accepted / k
        self.global_rate = d * self.global_rate + (1 - d) * rate
        acc, drafted = self._request_counts.get(request_key, (0, 0))
        self._request_counts[request_key] = (acc + accepted, drafted + k)

    def forget(self, request_key: int) -> None:
        self._request_counts.pop(request_key, None)

    # ---- the choice -----------------------------------------------------------------------
    def _request_scale(self, request_key: int) -> float:
        """The request's acceptance over the global one, shrunk towards 1 by
        ``REQUEST_PRIOR`` pseudo-drafts at the global rate (a request is not judged on one
        unlucky step, and keeps its estimate while it does not draft)."""
        acc, drafted = self._request_counts.get(request_key, (0, 0))
        if self.global_rate <= 0:
            return 1.0
        m = self.REQUEST_PRIOR
        rate = (acc + m * self.global_rate) / (drafted + m)
        return min(rate / self.global_rate, 1.5)

    def expected_tokens(self, request_keys: Sequence[int], room: Sequence[int]) -> np.ndarray:
        """``E[k] = sum_r E_r(min(k, room_r))`` for k = 0..max_k: the tokens the step emits in
        expectation when every request drafts up to k."""
        # A position seldom reached (k was smaller) borrows the estimate before it.
        a = np.array(self.accept)
        seen = np.array(self.accept_seen) >= 3
        seen[0] = True
        a = a[np.maximum.accumulate(np.where(seen, np.arange(self.max_k), 0))]
        scales = np.array([self._request_scale(key) for key in request_keys])
        p = np.cumprod(np.minimum(scales[:, None] * a[None, :], 1.0), axis=1)   # [B, K]
        per_request = np.concatenate([np.ones((len(scales), 1)), 1.0 + np.cumsum(p, axis=1)],
                                     axis=1)                                  # [B, K + 1]
        ks = np.minimum(np.arange(self.max_k + 1)[None, :], np.asarray(room)[:, None])
        return np.take_along_axis(per_request, np.maximum(ks, 0), axis=1).sum(axis=0)

    def predicted_rates(self, request_keys: Sequence[int], room: Sequence[int],
                        other_tokens: int, lacking: int = 0,
                        lacking_new: int = 0) -> list[Optional[float]]:
        """Expected tokens per second of a step drafting up to k, for k = 0..max_k, the
        draft caches lacking ``lacking`` tokens after a pause (their catch-up spread over
        decide_every) and ``lacking_new`` of new requests (spread over the mean room)."""
        horizon = max(float(np.mean(room)) if len(room) else 0.0, self.decide_every)
        switch = (self.catch_up_cost or 0.0) * (lacking / self.decide_every
                                                + lacking_new / horizon)
        emitted = self.expected_tokens(request_keys, room)
        room = np.maximum(np.asarray(room), 0)
        rates: list[Optional[float]] = []
        for k in range(self.max_k + 1):
            ks = np.minimum(room, k)
            t = self.target_cost(other_tokens + len(ks) + int(ks.sum()))
            passes = int(ks.max()) if len(ks) else 0
            d = self.draft_cost(len(request_keys)) if passes else 0.0
            cost = None if t is None or d is None else t + passes * d + (switch if passes else 0)
            rates.append(None if cost is None else emitted[k] / cost)
        return rates

    def choose(self, request_keys: Sequence[int], room: Sequence[int],
               other_tokens: int, lacking: int = 0, lacking_new: int = 0) -> int:
        """k for this step, given the decoding requests (``room``: drafts each may still take
        before its length limit), the step's other (prefill) tokens and the tokens the draft
        model's caches lack beyond a pass's usual, after a pause and for requests that never
        drafted (0 for n-gram drafts). After the call,
        ``draft_limit`` is how many of the requests draft (None: all): learning steps (warm-up,
        exploration) draft for a quarter of the batch only, so what they cost stays small."""
        self.draft_limit = None
        if not request_keys:
            return 0
        self.steps += 1
        B = len(request_keys)
        if not self.adaptive:
            k = self.max_k
        elif self.steps <= self.warmup_steps:
            # Learn the acceptance and the speculative costs, then the plain step's cost.
            k = min(self.max_k, 4) if self.steps < self.warmup_steps else 0
            self.draft_limit = -(-B // 4)
        else:
            if (self._decided is not None and self._decided[0] == B
                    and self.steps - self._decided[1] < self.decide_every):
                k = self._decided[2]          # same batch size, recent decision: keep it
            else:
                rates = [r or 0.0 for r in self.predicted_rates(request_keys, room,
                                                                  other_tokens, lacking,
                                                                  lacking_new)]
                k = -max((r, -k) for k, r in enumerate(rates))[1]
                self._margin = rates[1] / rates[0] if rates[0] > 0 else 0.0
                if self._decided is not None and rates[k] < self.HYSTERESIS * rates[
                        min(self._decided[2], self.max_k)]:
                    k = self._decided[2]      # not clearly better: switching has a cost
                bucket = B.bit_length()
                spec_rate = self._goodput.get((bucket, k))
                plain_rate = self._goodput.get((bucket, 0))
                if (k and spec_rate is not None and plain_rate is not None
                        and spec_rate.count >= Goodput.MIN_STEPS
                        and self.steps - spec_rate.step < self.GOODPUT_MEMORY
                        and spec_rate.rate < plain_rate.rate):
                    k = 0                     # measured, not predicted: drafting loses here
                self._decided = (B, self.steps, k)
            if self.steps >= self._next_explore:
                clear_loss = k == 0 and self._margin < self.CLOSE_MARGIN
                self._explore_gap = (min(2 * self._explore_gap, self.MAX_EXPLORE_EVERY)
                                     if clear_loss else self.explore_every)
                self._next_explore = self.steps + self._explore_gap
                self._explorations += 1
                k = self._explore(k, B, other_tokens)
                self.draft_limit = -(-B // 4)
        self.history.append(k)
        return k

    def _explore(self, best: int, num_seqs: int, other_tokens: int) -> int:
        """A neighbour of the best k, so its cost and (from k = 0) the acceptance stay measured:
        one whose target cost bucket is unmeasured if there is one, else best + 1 and best - 1
        in turn. A neighbour costs little more than the best, so exploring is cheap."""
        up, down = min(best + 1, self.max_k), max(best - 1, 0)
        if best == 0:
            return up                 # no neighbour below: every exploration measures k = 1
        for k in (up, down):
            if not self.target_cost.known(other_tokens + num_seqs * (1 + k)):
                return k
        return up if self._explorations % 2 else down
