"""Speculative decoding over the scheduler and the model runner, with an n-gram draft.

The whole loop, from prompts to outputs::

    import torch
    from pagedspec.engine import (BlockManager, KVCache, ModelRunner, NgramProposer, Scheduler,
                                  SchedulerConfig, SpeculativeDecoder)
    from pagedspec.models import load_checkpoint

    model = load_checkpoint(checkpoint_dir).load_model(torch.float32)   # a local HF directory
    kv = KVCache(model.num_layers, num_blocks=64, block_size=16,
                 num_kv_heads=model.num_kv_heads, head_size=model.head_size,
                 dtype=torch.float32)
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64),
                      BlockManager(num_blocks=64, block_size=16))
    decoder = SpeculativeDecoder(sched, ModelRunner(model, kv), NgramProposer(k=4))
    outputs = decoder.generate([[1, 2, 3, 1, 2, 3, 1, 2], [7, 8, 9]], max_tokens=16)
    # outputs[i]: the generated token ids of prompt i (greedy: identical to plain decoding)
    # decoder.runner.num_steps: target forward passes taken

Each step: the proposer attaches up to ``k`` draft tokens to every decoding sequence; the
scheduler builds one batch in which such a sequence is one causal query of ``k + 1`` rows (its
last token, then the drafts), beside prefill chunks and plain decodes; the runner returns the
target's logits at all ``k + 1`` rows; :func:`pagedspec.ops.greedy_verify` (temperature 0) or
:func:`pagedspec.ops.rejection_sample` (temperature > 0; the n-gram draft is deterministic, so
``draft_probs=None``) turns them into the accepted drafts plus one corrected or bonus token; and
:meth:`Scheduler.update` appends those and rolls the rejected drafts' KV slots back. The emitted
tokens follow the target's distribution exactly (greedy: the same tokens as plain decoding), while
every accepted draft saves one target step.
"""
from __future__ import annotations

from typing import Optional, Sequence as Seq

import torch

from pagedspec import ops
from pagedspec.engine.runner import ModelRunner
from pagedspec.engine.scheduler import Scheduler, StepBatch
from pagedspec.engine.sequence import Sequence


class NgramProposer:
    """Prompt-lookup drafting: find the last earlier occurrence of the sequence's trailing n-gram
    (longest n first, ``max_n`` down to ``min_n``) and propose the ``k`` tokens that followed it.

    When the match is close to the end, the continuation runs into the proposal itself (the
    matched pattern keeps repeating), so there are always ``k`` drafts once any n-gram matches.
    Deterministic: its draft distribution is one-hot.
    """

    def __init__(self, k: int, max_n: int = 3, min_n: int = 1):
        if k < 1 or not 1 <= min_n <= max_n:
            raise ValueError(f"NgramProposer: need k >= 1 and 1 <= min_n <= max_n, got k={k}, "
                             f"min_n={min_n}, max_n={max_n}")
        self.k, self.max_n, self.min_n = k, max_n, min_n

    def propose(self, token_ids: Seq[int]) -> list[int]:
        tokens = list(token_ids)
        end = len(tokens)
        for n in range(min(self.max_n, end - 1), self.min_n - 1, -1):
            tail = tokens[end - n:]
            for start in range(end - n - 1, -1, -1):             # latest occurrence first
                if tokens[start:start + n] == tail:
                    for i in range(self.k):                      # copy what followed it
                        tokens.append(tokens[start + n + i])
                    return tokens[end:]
        return []


class SpeculativeDecoder:
    """Drives ``scheduler`` and ``runner`` step by step; no proposer means plain decoding.

    Args:
        scheduler, runner: the scheduler and a runner over the matching KV cache.
        proposer: drafts tokens for decoding sequences (e.g. :class:`NgramProposer`), or None.
        temperature: 0 for greedy decoding, else sampling from ``softmax(logits / temperature)``.
        generator: the ``torch.Generator`` sampling draws from (on the runner's device).
    """

    def __init__(self, scheduler: Scheduler, runner: ModelRunner,
                 proposer: Optional[NgramProposer] = None, temperature: float = 0.0,
                 generator: Optional[torch.Generator] = None):
        if temperature < 0:
            raise ValueError(f"SpeculativeDecoder: temperature must be >= 0, got {temperature}")
        self.scheduler, self.runner, self.proposer = scheduler, runner, proposer
        self.temperature, self.generator = temperature, generator
        self.num_drafted = 0           # draft tokens verified
        self.num_accepted = 0          # of which accepted

    def generate(self, prompts: Seq[Seq[int]], max_tokens: int,
                 eos_token_id: Optional[int] = None) -> list[list[int]]:
        """Run ``prompts`` to completion; their generated token ids, in prompt order."""
        seqs = [self.scheduler.add(p, max_tokens, eos_token_id) for p in prompts]
        while self.scheduler.has_unfinished():
            self.step()
        return [s.output_token_ids for s in seqs]

    def step(self) -> list[Sequence]:
        """One scheduler step: draft, run the target, verify, update. Returns finished ones."""
        if self.proposer is not None:
            for seq in self.scheduler.running:
                if seq.is_decoding:    # the scheduler trims drafts to the length limit
                    seq.draft_token_ids = self.proposer.propose(seq.token_ids)
        batch = self.scheduler.schedule()
        logits = self.runner.execute(batch)
        return self.scheduler.update(batch, self.verify(batch, logits))

    def verify(self, batch: StepBatch, logits: torch.Tensor) -> list[list[int]]:
        """New tokens per sequence of ``batch`` from the target's ``logits`` at its
        ``logits_indices``: none for a partial prefill, else accepted drafts + one more."""
        # A sequence has 0 logits rows (prefill chunk short of the prompt's end) or 1 + k_i.
        has_rows = [i for i in range(len(batch.seqs)) if self._has_logits(batch, i)]
        sampled: list[list[int]] = [[] for _ in batch.seqs]
        if not has_rows:
            return sampled
        dev = logits.device
        ks = [batch.num_draft_tokens[i] for i in has_rows]
        k = max(ks)
        assert logits.shape[0] == sum(ks) + len(ks), "logits rows != 1 + drafts per sequence"
        # Drafts padded to k with token 0; the ops never read past num_draft_tokens.
        drafts = torch.tensor([batch.seqs[i].draft_token_ids[:k_i] + [0] * (k - k_i)
                               for i, k_i in zip(has_rows, ks)], dtype=torch.int64)
        drafts = drafts.view(len(ks), k)
        num_drafts = torch.tensor(ks, dtype=torch.int32)
        # Row j of request b is logits row first_b + min(j, k_b): padding repeats the last row.
        first = torch.cumsum(num_drafts + 1, 0) - (num_drafts + 1)
        rows = first[:, None] + torch.minimum(torch.arange(k + 1), num_drafts[:, None])
        target = logits[rows.to(dev)]                                     # [B', k + 1, V]
        drafts, num_drafts = drafts.to(dev), num_drafts.to(dev)
        if self.temperature == 0:
            out, accepted = ops.greedy_verify(drafts, target.argmax(-1), num_drafts)
        else:
            probs = torch.softmax(target / self.temperature, dim=-1)
            out, accepted = ops.rejection_sample(drafts, None, probs, num_draft_tokens=num_drafts,
                                                 generator=self.generator)
        out, accepted = out.tolist(), accepted.tolist()
        for row, i in enumerate(has_rows):
            sampled[i] = out[row][:accepted[row] + 1]
            self.num_drafted += ks[row]
            self.num_accepted += accepted[row]
        return sampled

    @staticmethod
    def _has_logits(batch: StepBatch, i: int) -> bool:
        """Whether sequence i's rows reach the end of its known tokens (so it samples)."""
        seq = batch.seqs[i]
        computed_after = seq.num_computed_tokens + batch.num_scheduled_tokens[i]
        return computed_after >= len(seq.token_ids)
