"""Turns a step's logits into tokens: greedy or sampled per row, each row with its own settings and
its own random generator, so a request's tokens do not depend on what else is in the batch.

Processing order (as ``transformers``' logits warpers): temperature, top-k, top-p, min-p; then
one categorical draw per row from the renormalized distribution, from that row's generator.
Temperature 0 means greedy (argmax of the raw logits; the other settings are ignored).
Logprobs, when asked for, are those of the raw model distribution (``log_softmax`` of the logits
before any processing), as vLLM reports by default.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch


@dataclass(frozen=True)
class SamplingRow:
    """One row's settings: ``temperature`` >= 0 (0 = greedy), ``top_k`` >= 1 or -1 (off),
    ``top_p`` in (0, 1], ``min_p`` in [0, 1]."""
    temperature: float = 0.0
    top_k: int = -1
    top_p: float = 1.0
    min_p: float = 0.0


def processed_probs(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """The distribution each sampled row draws from: float32 ``[B, V]`` of float32 logits
    ``[B, V]`` (rows with temperature 0 are not meaningful here)."""
    dev = logits.device
    temp = torch.tensor([r.temperature if r.temperature > 0 else 1.0 for r in rows],
                        dtype=torch.float32, device=dev)
    scores = logits.float() / temp[:, None]
    V = scores.shape[-1]
    need_k = any(0 < r.top_k < V for r in rows)
    need_p = any(r.top_p < 1.0 for r in rows)
    if need_k or need_p:
        sorted_scores, order = scores.sort(dim=-1, descending=True)
        drop = torch.zeros_like(sorted_scores, dtype=torch.bool)
        if need_k:
            k = torch.tensor([r.top_k if 0 < r.top_k < V else V for r in rows], device=dev)
            drop |= torch.arange(V, device=dev)[None, :] >= k[:, None]
            sorted_scores = sorted_scores.masked_fill(drop, float("-inf"))
        if need_p:
            p = torch.tensor([r.top_p for r in rows], dtype=torch.float32, device=dev)
            probs = sorted_scores.softmax(dim=-1)
            # Drop a token when the tokens above it already hold top_p of the mass; the most
            # likely token always stays.
            mass_above = probs.cumsum(dim=-1) - probs
            drop |= mass_above >= p[:, None]
            drop[:, 0] = False
        scores = scores.scatter(-1, order, sorted_scores.masked_fill(drop, float("-inf")))
    probs = scores.softmax(dim=-1)
    if any(r.min_p > 0 for r in rows):
        min_p = torch.tensor([r.min_p for r in rows], dtype=torch.float32, device=dev)
        keep = probs >= min_p[:, None] * probs.amax(dim=-1, keepdim=True)
        probs = probs * keep
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def sample(logits: torch.Tensor, rows: Sequence[SamplingRow],
           generators: Sequence[Optional[torch.Generator]]) -> list[int]:
    """One token per row of float32 ``logits`` ``[B, V]``; row i draws from ``generators[i]``
    (which must live on the logits' device) exactly once if it samples, never if greedy."""
    tokens = logits.argmax(dim=-1).tolist()
    sampled = [i for i, r in enumerate(rows) if r.temperature > 0]
    if sampled:
        probs = processed_probs(logits[sampled], [rows[i] for i in sampled])
        for j, i in enumerate(sampled):
            tokens[i] = int(torch.multinomial(probs[j], 1, generator=generators[i]))
    return tokens


def top_logprobs(logits: torch.Tensor, tokens: Sequence[int], num: Sequence[int]
                 ) -> list[tuple[float, int, list[tuple[int, float]]]]:
    """Per row: (logprob of ``tokens[i]``, its rank (1 = most likely), the ``num[i]`` most likely
    (token, logprob) pairs) under the raw distribution of float32 ``logits`` ``[B, V]``."""
    logprobs = logits.float().log_softmax(dim=-1)
    chosen = torch.tensor(tokens, device=logits.device)
    chosen_lp = logprobs.gather(1, chosen[:, None])[:, 0]
    ranks = (logprobs > chosen_lp[:, None]).sum(dim=-1) + 1
    k = max(num) if num else 0
    top_lp, top_ids = logprobs.topk(k, dim=-1) if k else (logprobs[:, :0], logprobs[:, :0])
    out = []
    for i, (lp, rank) in enumerate(zip(chosen_lp.tolist(), ranks.tolist())):
        pairs = list(zip(top_ids[i, :num[i]].tolist(), top_lp[i, :num[i]].tolist()))
        out.append((lp, rank, pairs))
    return out
