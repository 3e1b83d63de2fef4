"""Speculation as one pluggable part of the engine step: :class:`Speculator` holds a drafter
(n-gram prompt lookup or a draft model), the controller that picks each step's k, and the
speculative metrics. The core calls it at four points of a step: :meth:`plan` (before
scheduling), :meth:`draft` (after scheduling, before the target runs), :meth:`record` (per
verified sequence) and :meth:`observe_step` (after the step). Without speculation the core holds
no Speculator and none of this runs."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence as Seq

import torch

from pagedspec.engine.controller import SpecStats, SpeculationController
from pagedspec.engine.metrics import SpecDecodingStats
from pagedspec.engine.sampler import SamplingRow
from pagedspec.engine.scheduler import StepBatch
from pagedspec.engine.sequence import Sequence
from pagedspec.engine.speculative import DraftModelProposer, DraftRequest, NgramProposer

# A draft cache lacking at most this many of a sequence's tokens counts as current (a learning
# step may then draft for a quarter of the batch, at a few tokens of catch-up each).
CURRENT_DRAFT_TOKENS = 8
# Tokens a sequence's first drafting pass feeds when its draft cache was current after the last
# step: the corrected or bonus token and the last accepted draft. More is catching up.
REGULAR_FIRST_PASS_TOKENS = 2

# seq id -> (its sampling row, its generator, tokens evicted from its block table)
SeqLookup = Callable[[int], tuple[SamplingRow, torch.Generator, int]]


@dataclass(eq=False)
class Speculator:
    controller: SpeculationController
    ngram: Optional[NgramProposer] = None
    draft_model: Optional[DraftModelProposer] = None
    stats: SpecStats = field(default_factory=SpecStats)          # over the engine's life
    step_stats: SpecDecodingStats = field(default_factory=SpecDecodingStats)  # the last step's
    _draft_seconds: float = 0.0           # the draft model's time in the current step

    def forget(self, seq_id: int) -> None:
        for part in (self.ngram, self.draft_model, self.controller):
            if part is not None:
                part.forget(seq_id)

    def computed_tokens(self, seq_id: int) -> Optional[int]:
        """Tokens of the sequence the draft model's cache holds (None without a draft model):
        KV eviction may drop only blocks both caches have computed."""
        return self.draft_model.computed_tokens(seq_id) if self.draft_model else None

    def plan(self, running: Seq[Sequence], max_num_batched_tokens: int) -> None:
        """Before scheduling: the step's k from the controller, and each decoding sequence's
        drafts (n-gram proposals, or placeholders the draft model fills in after scheduling,
        once the scheduler has given the draft positions their slots)."""
        self.step_stats = SpecDecodingStats()
        self._draft_seconds = 0.0
        decoding = [s for s in running if s.is_decoding]
        room = [s.num_prompt_tokens + s.max_tokens - len(s.token_ids) - 1 for s in decoding]
        prefill = sum(len(s.token_ids) - s.num_computed_tokens for s in running
                      if not s.is_decoding)
        other = min(prefill, max_num_batched_tokens - len(decoding))
        k = self.controller.choose([s.seq_id for s in decoding], room, max(other, 0),
                                   *self._lacking(decoding))
        if self.ngram is not None:        # index new tokens outside the timed proposal
            for seq in decoding:
                self.ngram.update(seq.seq_id, seq.token_ids)
        limit = self.controller.draft_limit
        if k and limit is not None and limit < len(decoding):
            room = [r if i in self._learners(decoding, limit) else 0 for i, r in enumerate(room)]
        if not k:
            return
        start = time.perf_counter()
        for seq, r in zip(decoding, room):
            kr = min(k, r)
            if kr > 0:
                seq.draft_token_ids = (self.ngram.propose(seq.seq_id, seq.token_ids, kr)
                                       if self.ngram is not None else [0] * kr)
        if self.ngram is not None:              # the model drafter is timed when it runs
            seconds = time.perf_counter() - start
            self.controller.observe_draft(len(decoding), seconds)
            self.stats.draft_seconds += seconds

    def _learners(self, decoding: Seq[Sequence], limit: int) -> set[int]:
        """The ``limit`` sequences (indices into ``decoding``) that draft in a learning step
        (warm-up, exploration). N-gram drafts cost nothing to start: the choice rotates, so
        every request's acceptance gets measured. A draft model must first feed a sequence
        every token its cache lacks, which after a long run of k = 0 steps is every token
        since the sequence last drafted (with rotation, four explorations back; a new
        sequence's whole prompt): it takes the sequences whose caches are the most current,
        in rotation among equals, and when even the most current lacks more than
        ``CURRENT_DRAFT_TOKENS``, that one alone (at batch 32 a quarter of new sequences
        catching up on their prompts took 3.3% of the time while k stayed 0 in 96% of the
        steps)."""
        n = len(decoding)
        first = self.controller.steps * limit % n
        order = [(first + i) % n for i in range(n)]              # rotate who learns
        if self.draft_model is not None:
            model = self.draft_model
            missing = [len(s.token_ids) - model.computed_tokens(s.seq_id) for s in decoding]
            order.sort(key=missing.__getitem__)
            if missing[order[0]] > CURRENT_DRAFT_TOKENS:
                limit = 1     # every cache is stale: one sequence learns, at one's catch-up
        return set(order[:limit])

    def _lacking(self, decoding: Seq[Sequence]) -> tuple[int, int]:
        """Tokens the draft model's caches lack beyond the two a drafting pass feeds anyway
        (the bonus token and the last accepted draft), what switching drafting on would feed:
        (over caches that drafted before, over new requests' empty ones)."""
        model = self.draft_model
        paused = new = 0
        if model is not None:
            for s in decoding:
                computed = model.computed_tokens(s.seq_id)
                lacking = max(len(s.token_ids) - computed - REGULAR_FIRST_PASS_TOKENS, 0)
                if computed:
                    paused += lacking
                else:
                    new += lacking
        return paused, new

    def draft(self, batch: StepBatch, lookup: SeqLookup, synchronize: Callable[[float], float]
              ) -> list[Optional[torch.Tensor]]:
        """After scheduling: keeps the draft cache in step with the batch's block moves, runs
        the draft model for the drafting sequences and writes its tokens into the batch; returns
        each sequence's draft distributions (None where none: greedy, n-gram or not drafting)."""
        draft_probs: list[Optional[torch.Tensor]] = [None] * len(batch.seqs)
        model = self.draft_model
        if model is None:
            return draft_probs
        model.apply_moves(batch.block_ops)        # both caches make the same block moves
        requests = []
        for i, seq in enumerate(batch.seqs):
            k = batch.num_draft_tokens[i]
            if k:
                row, generator, num_evicted = lookup(seq.seq_id)
                requests.append(DraftRequest(i, seq.seq_id, seq.token_ids,
                                             seq.num_computed_tokens, k, row, generator,
                                             num_evicted))
        if not requests:
            return draft_probs
        start = time.perf_counter()
        drafts, probs = model.propose(batch, requests)
        cu = batch.cu_seqlens_q.tolist()
        ids = batch.input_ids
        for r, tokens, p in zip(requests, drafts, probs):
            first = cu[r.batch_index] + 1          # the drafts follow the last verified token
            ids[first:first + r.k] = torch.tensor(tokens, dtype=ids.dtype, device=ids.device)
            batch.seqs[r.batch_index].draft_token_ids = tokens
            draft_probs[r.batch_index] = p
        total = synchronize(start)
        self.stats.draft_seconds += total
        self._draft_seconds = total
        # The controller learns the cost of a drafting pass (one token per sequence), with the
        # Python bookkeeping around the passes spread over them; the first pass also catches
        # the draft cache up, which costs more the first time (the prompt): it is left out then.
        passes = model.pass_times
        seqs, tokens, seconds = passes[0]
        extra = (total - sum(t for _, _, t in passes)) / len(passes)
        if tokens > seqs:
            self.stats.catch_up_tokens += tokens - seqs
            self.stats.catch_up_seconds += seconds
        if tokens > REGULAR_FIRST_PASS_TOKENS * seqs:
            self.controller.observe_catch_up(seqs, tokens, seconds + extra)
        for num_seqs, num_tokens, seconds in passes:
            if num_tokens <= REGULAR_FIRST_PASS_TOKENS * num_seqs:
                self.controller.observe_draft(num_seqs, seconds + extra)
        return draft_probs

    @property
    def reads_target_hidden(self) -> bool:
        """Whether the drafter reads the target's hidden states (an EAGLE head): the engine
        then hands them over after each target pass (:meth:`observe_target_hidden`)."""
        return self.draft_model is not None and self.draft_model.reads_target_hidden

    def observe_target_hidden(self, batch: StepBatch, hidden: torch.Tensor,
                              new_tokens: dict[int, list[int]]) -> None:
        """Before the scheduler's update: the target's final hidden states ``[T, H]`` of this
        step's rows go to the EAGLE drafter, for each sequence those of its verified positions
        (a verification's accepted drafts and the row before them, a prefill chunk's every
        row)."""
        model = self.draft_model
        cu = batch.cu_seqlens_q.tolist()
        for i, seq in enumerate(batch.seqs):
            k = batch.num_draft_tokens[i]
            valid = batch.num_scheduled_tokens[i] - k
            if k:
                valid += len(new_tokens.get(seq.seq_id, [None])) - 1
            model.observe_target(seq.seq_id, seq.num_computed_tokens,
                                 hidden[cu[i]:cu[i] + valid])

    def fork(self, parent_id: int, child_id: int) -> None:
        """``child_id`` was forked from ``parent_id`` after its prompt (n > 1): the drafter
        learns of it (an EAGLE head gives the child its parent's prompt features)."""
        if self.draft_model is not None:
            self.draft_model.fork(parent_id, child_id)

    def record(self, seq: Sequence, k: int, accepted: int) -> None:
        """One sequence verified ``k`` drafts and accepted the first ``accepted``."""
        for st in (self.stats, self.step_stats):
            st.num_drafts += 1
            st.num_draft_tokens += k
            st.num_accepted_tokens += accepted
        st = self.stats
        while len(st.drafted_per_position) < k:
            st.drafted_per_position.append(0)
            st.accepted_per_position.append(0)
        per_pos = self.step_stats.num_accepted_tokens_per_pos
        per_pos.extend([0] * (k - len(per_pos)))
        for j in range(k):
            st.drafted_per_position[j] += 1
            st.accepted_per_position[j] += j < accepted
            per_pos[j] += j < accepted
        self.controller.observe_acceptance(seq.seq_id, k, accepted)
        if self.draft_model is not None:
            self.draft_model.on_verified(seq.seq_id, len(seq.token_ids), k, accepted)

    def observe_target(self, seconds: float) -> None:
        self.stats.target_seconds += seconds
        self.stats.num_steps += 1

    def observe_step(self, batch: StepBatch, num_verified: int, num_new_tokens: int,
                     elapsed: float) -> None:
        """After the step: what the controller weighs is the whole step but the drafting
        (scheduling, verification, sampling and bookkeeping included), by tokens in the step."""
        self.controller.observe_target(batch.num_tokens, elapsed - self._draft_seconds)
        decode_only = batch.seqs and all(
            batch.num_scheduled_tokens[i] == 1 + batch.num_draft_tokens[i]
            for i in range(len(batch.seqs)))
        # All drafted, or none. A draft model's catch-up (new prompts, tokens since a pause) is
        # part of what drafting costs: left out, the goodput of drafting at batch 8 read 1.0x
        # plain while the run delivered 0.91x, 5% of it catching up.
        if decode_only and num_verified in (0, len(batch.seqs)):
            self.controller.observe_goodput(len(batch.seqs), max(batch.num_draft_tokens),
                                            num_new_tokens, elapsed)
