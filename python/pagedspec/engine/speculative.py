"""Speculative decoding: drafters that propose tokens, and the verification of a step's drafts.

A step with speculation (driven by :class:`pagedspec.LLM`): the controller picks how many tokens
each decoding sequence drafts; the scheduler reserves slots for them beside prefill chunks and
plain decodes; the drafter fills them in; one target pass computes every row, a sequence with k
drafts being one causal query of k + 1 rows (its last token, then the drafts);
:func:`verify_drafts` turns each such sequence's k + 1 logits rows into its accepted drafts plus
one corrected or bonus token (:func:`pagedspec.ops.greedy_verify` for greedy requests,
:func:`pagedspec.ops.rejection_sample` for sampled ones, with both distributions processed the
same way); :meth:`Scheduler.update` rolls rejected slots back. The emitted tokens follow the
target's distribution exactly (greedy: the same tokens as plain decoding).

Drafters:

- :class:`NgramProposer`: prompt lookup. The continuation of the latest earlier occurrence of the
  sequence's trailing n-gram. An index of every n-gram's latest position is kept per sequence and
  updated as tokens arrive, so a proposal costs a few dictionary lookups however long the
  sequence is. Deterministic: its draft distribution is one-hot (``draft_probs=None``).
- :class:`DraftModelProposer`: a smaller model with the same vocabulary and its own paged KV
  cache, indexed by the target's block tables (so block moves, rollback and eviction are the
  same bookkeeping for both). It drafts all sequences of a step together: a first pass feeds each
  sequence the tokens its cache lacks (normally the last step's corrected or bonus token; the
  whole prompt the first time), then one pass of one token per further draft position.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Optional, Sequence as Seq

import numpy as np
import torch

from pagedspec import ops
from pagedspec.engine.block_manager import BlockOps
from pagedspec.engine.kv_cache import KVCache
from pagedspec.engine.model import CausalLM
from pagedspec.engine.runner import ModelRunner
from pagedspec.engine.sampler import SamplingRow, draw, processed_probs, row_argmax
from pagedspec.engine.scheduler import StepBatch, slot_mapping

class NgramProposer:
    """Prompt lookup: find the latest earlier occurrence of the trailing n-gram (longest n
    first, ``max_n`` down to ``min_n``) and propose the ``k`` tokens that followed it.

    When the match is close to the end, the continuation runs into the proposal itself (the
    matched pattern keeps repeating), so there are always ``k`` drafts once any n-gram matches.
    """

    def __init__(self, max_n: int = 3, min_n: int = 1):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"NgramProposer: need 1 <= min_n <= max_n, got min_n={min_n}, "
                             f"max_n={max_n}")
        self.max_n, self.min_n = max_n, min_n
        # seq id -> (tokens indexed so far, {n-gram tuple: start of its latest occurrence that
        # has a successor})
        self._index: dict[int, tuple[int, dict[tuple, int]]] = {}

    def update(self, seq_id: int, token_ids: Seq[int]) -> dict[tuple, int]:
        """Indexes the tokens added since the last call (all of them the first time)."""
        end = len(token_ids)
        done, index = self._index.get(seq_id, (0, {}))
        lo, hi = self.min_n, self.max_n
        for p in range(max(done, 1), end):          # n-grams ending just before position p
            for n in range(lo, min(hi, p) + 1):
                index[tuple(token_ids[p - n:p])] = p - n
        self._index[seq_id] = (end, index)
        return index

    def propose(self, seq_id: int, token_ids: Seq[int], k: int) -> list[int]:
        """Up to ``k`` draft tokens following ``token_ids`` (none when no n-gram recurs)."""
        index = self.update(seq_id, token_ids)
        end, lo, hi = len(token_ids), self.min_n, self.max_n
        if k <= 0:
            return []
        for n in range(min(hi, end - 1), lo - 1, -1):
            start = index.get(tuple(token_ids[end - n:end]))
            if start is not None:
                out: list[int] = []
                for i in range(start + n, start + n + k):
                    out.append(token_ids[i] if i < end else out[i - end])
                return out
        return []

    def forget(self, seq_id: int) -> None:
        self._index.pop(seq_id, None)


@dataclass
class DraftRequest:
    """One sequence to draft for: its row in the step's batch, how many tokens, how to sample."""
    batch_index: int
    seq_id: int
    token_ids: Seq[int]            # the sequence's verified tokens (the drafts follow them)
    num_computed: int              # tokens the target has in its cache
    k: int
    row: SamplingRow
    generator: torch.Generator
    num_evicted: int = 0           # tokens evicted from the shared block table (KV eviction)


def draft_distribution(logits: torch.Tensor, rows: Seq[SamplingRow]) -> torch.Tensor:
    """The distribution a sampled draft is drawn from and reported to rejection sampling: the
    draft's logits processed exactly as the target's are (temperature, top-k, top-p, min-p).
    Exactness needs the reported probabilities to be the ones drawn from, whatever they are;
    processing them like the target's makes the two distributions, and so acceptance, close."""
    return processed_probs(logits, rows)


def _first_writer_only(slot_mapping: torch.Tensor) -> torch.Tensor:
    """Catch-up passes of sequences that share blocks (forks, prefix hits) recompute the shared
    positions for each sharer, with the same token at the same position, so the same K/V: only
    the first token per slot writes it (reshape_and_cache takes each slot once); the others read
    it in the same pass, since every layer writes before it attends."""
    uniq, inverse = torch.unique(slot_mapping, return_inverse=True)
    order = torch.arange(slot_mapping.numel())
    first = torch.full((uniq.numel(),), slot_mapping.numel()).scatter_reduce_(
        0, inverse, order, "amin")
    return torch.where(first[inverse] == order, slot_mapping, -1)


class DraftModelProposer:
    """Drafts with ``model`` over ``kv_cache``, which has the target cache's block count and
    block size (the block tables are shared). Call :meth:`apply_moves` with every step's block
    moves, drafting or not, so both caches stay in step.

    ``vocab``: the draft's reduced vocabulary (int64 ``[N]`` token ids, ascending), or None for
    the whole one. The draft then computes logits for those tokens only, and its distribution
    is zero elsewhere: its tokens are drawn from, and its reported probabilities are, that
    distribution, so verification stays exact (a target token outside the subset is never
    drafted; rejection sampling still emits it through the residual ``max(p - q, 0)``)."""

    def __init__(self, model: CausalLM, kv_cache: KVCache, calibrate_fp8: bool = False,
                 compile: bool = False, vocab: Optional[torch.Tensor] = None):
        self.full_vocab_size = model.vocab_size
        self.vocab = None
        if vocab is not None:
            if (vocab.dim() != 1 or vocab.dtype != torch.int64 or vocab.numel() == 0
                    or int(vocab.min()) < 0 or int(vocab.max()) >= model.vocab_size):
                raise ValueError(f"DraftModelProposer: vocab must be int64 [N] token ids in "
                                 f"[0, {model.vocab_size}), got {vocab.dtype} "
                                 f"{list(vocab.shape)}")
            model.restrict_vocab(vocab)
            self.vocab = vocab.to(kv_cache.device)
        self.runner = ModelRunner(model, kv_cache, calibrate_fp8=calibrate_fp8, compile=compile)
        self.kv_cache, self.device = kv_cache, kv_cache.device
        self.block_size = kv_cache.key_caches[0].shape[1]
        self.pass_times: list[tuple[int, int, float]] = []  # last propose: (seqs, tokens, s)
        # seq id -> tokens whose draft K/V are in the draft cache (a prefix of the sequence)
        self._computed: dict[int, int] = {}

    def apply_moves(self, moves: BlockOps) -> None:
        self.kv_cache.apply(moves)

    def propose(self, batch: StepBatch, requests: Seq[DraftRequest]
                ) -> tuple[list[list[int]], list[Optional[torch.Tensor]]]:
        """``(drafts, probs)`` per request: ``k`` tokens, and for sampled requests the float32
        ``[k, V]`` distributions they were drawn from (None for greedy ones)."""
        if not requests:
            return [], []
        tables = batch.block_tables
        # The index arithmetic on the host, in numpy: a pass's few rows made a dozen small torch
        # ops of ~10-25 us each (0.6 ms of a two-pass drafting call, batch 1 or 8).
        host_tables = tables.cpu().numpy()
        bs = self.block_size
        self.pass_times = []
        drafts: list[list[int]] = [[] for _ in requests]
        probs: list[list[torch.Tensor]] = [[] for _ in requests]
        # Pass 1 catches each cache up and drafts one token; pass j > 1 feeds draft j - 1.
        for j in range(max(r.k for r in requests)):
            active = [i for i, r in enumerate(requests) if r.k > j]
            input_ids, positions, q_lens, features = [], [], [], []
            for i in active:
                ids, pos, feats = self._rows(requests[i], j, drafts[i], i)
                input_ids += ids
                positions += pos
                q_lens.append(len(ids))
                if feats is not None:
                    features.append(feats)
            q = np.array(q_lens)
            owners = np.array([requests[i].batch_index for i in active])
            evicted = np.array([requests[i].num_evicted for i in active])
            cu = np.zeros(len(active) + 1, np.int64)
            np.cumsum(q, out=cu[1:])
            pos = np.array(positions, np.int64)
            cache_pos = pos - np.repeat(evicted, q)              # the cache's positions
            slots = slot_mapping(host_tables, np.repeat(owners, q), cache_pos, bs)
            written = torch.from_numpy(slots)              # the slots this pass writes
            if j == 0 and np.unique(slots).size < slots.size:
                written = _first_writer_only(written)
            step = StepBatch(
                seqs=[], num_scheduled_tokens=q_lens, num_draft_tokens=[0] * len(active),
                input_ids=torch.tensor(input_ids, dtype=torch.int64),
                positions=torch.from_numpy(pos), slot_mapping=written,
                block_tables=tables[torch.from_numpy(owners).to(tables.device)],
                seq_lens=torch.from_numpy((cache_pos[cu[1:] - 1] + 1).astype(np.int32)),
                cu_seqlens_q=torch.from_numpy(cu.astype(np.int32)), max_q_len=int(q.max()),
                logits_indices=torch.from_numpy(cu[1:] - 1), block_ops=BlockOps.empty())
            start = time.perf_counter()
            logits = self.runner.execute(             # [n, N] on a reduced vocabulary
                step, features=torch.cat(features) if features else None)
            self._after_pass(active, step)
            choice = row_argmax(logits)
            sampled = [a for a, i in enumerate(active) if requests[i].row.temperature > 0]
            if sampled:
                dist = draft_distribution(logits[sampled],
                                          [requests[active[a]].row for a in sampled])
                choice[sampled] = draw(dist, [requests[active[a]].generator for a in sampled])
                dist = self._full_vocab(dist)
                for b, a in enumerate(sampled):
                    probs[active[a]].append(dist[b])
            tokens = (choice if self.vocab is None else self.vocab[choice]).tolist()
            for a, i in enumerate(active):
                drafts[i].append(tokens[a])
            self.pass_times.append((len(active), len(input_ids), time.perf_counter() - start))
        for r in requests:
            self._computed[r.seq_id] = self._computed_after(r)
        return drafts, [torch.stack(p) if p else None for p in probs]

    # The row layout of the passes: the hooks an EAGLE draft overrides.
    def _rows(self, r: DraftRequest, j: int, drafts: list[int], i: int
              ) -> tuple[Seq[int], Seq[int], Optional[torch.Tensor]]:
        """Pass ``j``'s rows for request ``r`` (``i``-th of the step): token ids, positions,
        features (None: the model takes none). Pass 0 feeds every token the draft cache lacks
        through the last verified one, pass j > 0 draft j - 1."""
        n = len(r.token_ids)
        if j == 0:
            start = min(self._computed.get(r.seq_id, 0), r.num_computed, n - 1)
            return r.token_ids[start:n], range(start, n), None
        return [drafts[-1]], [n + j - 1], None

    def _after_pass(self, active: list[int], step: StepBatch) -> None:
        """After each pass (``active``: the requests it ran, in row order)."""

    def _computed_after(self, r: DraftRequest) -> int:
        """Tokens whose draft K/V are current after drafting: up to the last verified token,
        then drafts 1 .. k-1 (verification rolls the rejected ones back)."""
        return len(r.token_ids) + r.k - 1

    def _full_vocab(self, dist: torch.Tensor) -> torch.Tensor:
        """Distributions ``[n, N]`` over the reduced vocabulary as ``[n, V]`` over the whole,
        zero outside it."""
        if self.vocab is None:
            return dist
        full = dist.new_zeros((dist.shape[0], self.full_vocab_size))
        full[:, self.vocab] = dist
        return full

    def on_verified(self, seq_id: int, num_tokens_before: int, k: int, accepted: int) -> None:
        """After verification: the draft K/V of rejected drafts are stale."""
        if seq_id in self._computed:
            self._computed[seq_id] = min(self._computed[seq_id], num_tokens_before + accepted)

    def computed_tokens(self, seq_id: int) -> int:
        """Tokens of the sequence the draft cache holds (KV eviction keeps to them)."""
        return self._computed.get(seq_id, 0)

    # Whether the drafter reads the target's final hidden states (the engine then hands them
    # over after each target pass, :meth:`observe_target`).
    reads_target_hidden = False

    def fork(self, parent_id: int, child_id: int) -> None:
        """``child_id`` was forked from ``parent_id`` after its prompt (n > 1): the shared
        blocks hold the same draft K/V, nothing to do here."""

    def forget(self, seq_id: int) -> None:
        self._computed.pop(seq_id, None)


class EagleProposer(DraftModelProposer):
    """Drafts with an EAGLE head (:class:`pagedspec.models.llama.EagleDraft`), which reads the
    target's final hidden states: the engine hands them over after each target pass
    (:meth:`observe_target`) and the target runner keeps them (``keep_hidden``).

    The draft's row for position ``i`` takes the token at ``i + 1`` and the target's feature at
    ``i``, so its cache lags the target's by one position: after a verification that accepted
    ``a`` drafts, the first pass feeds the ``a + 1`` rows whose features that verification
    computed (the draft's earlier rows there had read its own estimates), and its last row
    drafts token 1; pass j > 0 feeds draft j - 1 with the draft's output at the row before in
    place of the feature. A forked sequence (n > 1) inherits its parent's features; a position
    without any (a prefix-cache hit) reads zeros: acceptance suffers there, exactness never
    does."""

    def __init__(self, model: CausalLM, kv_cache: KVCache, calibrate_fp8: bool = False,
                 compile: bool = False, vocab: Optional[torch.Tensor] = None):
        super().__init__(model, kv_cache, calibrate_fp8, compile, vocab)
        self.runner.keep_hidden = True          # its own passes feed the next one
        self.hidden_size = model.config.hidden_size
        # seq id -> (position of the first row, rows held, the target's features there and
        # after, not yet fed to the draft: [m_i, H] chunks as the steps delivered them,
        # concatenated only when a draft pass reads them, so a step costs O(1) per sequence
        # however long it is; appending by concatenation cost 2.5 ms a step at batch 64)
        self._features: dict[int, tuple[int, int, list[torch.Tensor]]] = {}
        self._last: dict[int, torch.Tensor] = {}     # request index -> its last row's output

    reads_target_hidden = True

    def observe_target(self, seq_id: int, position: int, hidden: torch.Tensor) -> None:
        """The target's final hidden states ``[m, H]`` at ``position`` .. ``position + m - 1``
        (verified positions only). A position the target recomputes (after a preemption) makes
        the draft's rows from there stale too."""
        if seq_id in self._computed:
            self._computed[seq_id] = min(self._computed[seq_id], position)
        start, held, chunks = self._features.get(seq_id, (position, 0, []))
        if position == start + held:
            chunks.append(hidden)
        elif start <= position < start + held:     # a rewrite from inside the held range
            chunks = [torch.cat(chunks)[:position - start], hidden]
        else:                                      # a gap, or recomputation from before start
            start, chunks = position, [hidden]
        self._features[seq_id] = (start, position - start + hidden.shape[0], chunks)

    def _features_at(self, seq_id: int, start: int, end: int) -> torch.Tensor:
        """The features of positions ``start .. end - 1`` (zeros where the target's are
        unknown); those before ``end`` are dropped, fed from now on."""
        out = torch.zeros(end - start, self.hidden_size, device=self.device)
        first, _, chunks = self._features.pop(seq_id, (end, 0, []))
        if chunks:
            held = torch.cat(chunks) if len(chunks) > 1 else chunks[0]
            lo, hi = max(start, first), min(end, first + held.shape[0])
            if lo < hi:
                out[lo - start:hi - start] = held[lo - first:hi - first]
            rest = held[max(end - first, 0):]
            if rest.shape[0]:
                self._features[seq_id] = (max(end, first), rest.shape[0], [rest])
        return out

    def _rows(self, r: DraftRequest, j: int, drafts: list[int], i: int
              ) -> tuple[Seq[int], Seq[int], Optional[torch.Tensor]]:
        n = len(r.token_ids)
        if j == 0:
            start = min(self._computed.get(r.seq_id, 0), r.num_computed, n - 2)
            return (r.token_ids[start + 1:n], range(start, n - 1),
                    self._features_at(r.seq_id, start, n - 1))
        return [drafts[-1]], [n + j - 2], self._last[i]

    def _after_pass(self, active: list[int], step: StepBatch) -> None:
        last = self.runner.hidden[step.logits_indices.to(self.device)]
        self._last = {i: last[a:a + 1] for a, i in enumerate(active)}

    def _computed_after(self, r: DraftRequest) -> int:
        return len(r.token_ids) - 1          # rows through n - 2 read the target's features

    def fork(self, parent_id: int, child_id: int) -> None:
        if parent_id in self._features:
            start, held, chunks = self._features[parent_id]
            self._features[child_id] = (start, held, list(chunks))   # read-only: sharing is safe

    def forget(self, seq_id: int) -> None:
        super().forget(seq_id)
        self._features.pop(seq_id, None)


@dataclass
class Verification:
    """One sequence's drafts and the target's ``k + 1`` logits rows for them."""
    logits: torch.Tensor                     # float32 [k + 1, V]
    drafts: list[int]                        # k tokens
    draft_probs: Optional[torch.Tensor]      # float32 [k, V]; None: one-hot (n-gram, greedy)
    row: SamplingRow
    generator: torch.Generator


def verify_drafts(items: Seq[Verification]) -> list[list[int]]:
    """Each sequence's accepted drafts followed by one corrected or bonus token.

    Greedy requests go through :func:`ops.greedy_verify` on the target's argmax, sampled ones
    through :func:`ops.rejection_sample` on the processed target distribution, with the uniforms
    drawn from each request's own generator (k for acceptance, then k + 1 for resampling)."""
    out: list[list[int]] = [[] for _ in items]
    greedy = [i for i, v in enumerate(items) if v.row.temperature == 0]
    sampled = [i for i, v in enumerate(items) if v.row.temperature > 0]
    for group, is_greedy in ((greedy, True), (sampled, False)):
        if not group:
            continue
        dev = items[group[0]].logits.device
        k = max(len(items[i].drafts) for i in group)
        ks = torch.tensor([len(items[i].drafts) for i in group], dtype=torch.int32)
        drafts = torch.tensor([items[i].drafts + [0] * (k - len(items[i].drafts)) for i in group],
                              dtype=torch.int64).view(len(group), k)
        # Rows past a request's k_b repeat its last row; the ops never read them.
        target = torch.stack([_pad_rows(items[i].logits, k + 1) for i in group])
        if is_greedy:
            tokens, accepted = ops.greedy_verify(drafts.to(dev), row_argmax(
                target.view(-1, target.shape[-1])).view(target.shape[:2]),
                                                 ks.to(dev))
        else:
            rows = [items[i].row for i in group]
            V = target.shape[-1]
            target_probs = processed_probs(target.view(-1, V),
                                           [r for r in rows for _ in range(k + 1)])
            target_probs = target_probs.view(len(group), k + 1, V)
            one_hot = items[group[0]].draft_probs is None
            draft_probs = None if one_hot else torch.stack(
                [_pad_rows(items[i].draft_probs, k) for i in group])
            u_accept = torch.zeros(len(group), k, device=dev)
            u_resample = torch.zeros(len(group), k + 1, device=dev)
            for b, i in enumerate(group):
                kb = len(items[i].drafts)
                g = items[i].generator
                u_accept[b, :kb] = torch.rand(kb, generator=g, device=dev)
                u_resample[b, :kb + 1] = torch.rand(kb + 1, generator=g, device=dev)
            tokens, accepted = ops.rejection_sample(drafts.to(dev), draft_probs, target_probs,
                                                    u_accept, u_resample, ks.to(dev))
        tokens, accepted = tokens.tolist(), accepted.tolist()
        for b, i in enumerate(group):
            out[i] = tokens[b][:accepted[b] + 1]
    return out


def _pad_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    """``x`` ``[r, V]`` padded to ``[rows, V]`` by repeating its last row (rows > r), or
    zeros when ``x`` has no row."""
    if x.shape[0] == rows:
        return x
    if x.shape[0] == 0:
        return x.new_zeros((rows, x.shape[1]))
    return torch.cat([x, x[-1:].expand(rows - x.shape[0], -1)])
