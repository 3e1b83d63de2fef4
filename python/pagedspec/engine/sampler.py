"""Turns a step's logits into tokens: greedy or sampled per row, each row with its own settings and
its own random generator, so a request's tokens do not depend on what else is in the batch.

Processing order (as ``transformers``' logits warpers): temperature, top-k, top-p, min-p; then
one categorical draw per row from the renormalized distribution, by inverse CDF with one uniform
from that row's generator.
Temperature 0 means greedy (argmax of the raw logits; the other settings are ignored).
Logprobs, when asked for, are those of the raw model distribution (``log_softmax`` of the logits
before any processing), as vLLM reports by default.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from pagedspec import ops


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


# Columns per chunk of :func:`row_argmax`'s first pass, and the entries under which it leaves
# the argmax to PyTorch.
ARGMAX_CHUNK = 1024
ARGMAX_SMALL = 1 << 18


def row_argmax(logits: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(dim=-1)`` of a float ``[B, V]`` tensor, the same indices (the first
    maximum; the first NaN where a row has one), in two passes on the CPU: each chunk of
    :data:`ARGMAX_CHUNK` columns' maximum, then the argmax inside the first chunk holding the
    row's. PyTorch's CPU argmax over the last dimension does not vectorize (~0.7 ns an entry):
    on SmolLM2's 49152 tokens at batch 64 it took 2.1 ms (Zen 4, 2 threads), these two passes
    0.3 ms. Their few ops cost ~50 us however small the input, so under
    :data:`ARGMAX_SMALL` entries PyTorch's argmax is the faster."""
    B, V = logits.shape
    C = ARGMAX_CHUNK
    if (logits.device.type != "cpu" or B * V < ARGMAX_SMALL or V < 4 * C
            or not logits.is_contiguous()):
        return logits.argmax(dim=-1)
    full = V // C * C
    chunk_max = logits[:, :full].view(B, V // C, C).amax(dim=-1)
    if full < V:
        chunk_max = torch.cat([chunk_max, logits[:, full:].amax(dim=-1, keepdim=True)], dim=1)
    # A short last chunk reads its own columns, then the last column again: never earlier.
    columns = (chunk_max.argmax(dim=-1, keepdim=True) * C
               + torch.arange(C, device=logits.device)).clamp_(max=V - 1)
    inside = logits.gather(1, columns).argmax(dim=-1, keepdim=True)
    return columns.gather(1, inside)[:, 0]


def draw(probs: torch.Tensor, generators: Sequence[torch.Generator]) -> torch.Tensor:
    """One token per row of float32 ``probs`` ``[B, V]`` (int64 ``[B]``), row i by inverse CDF
    with one uniform from ``generators[i]`` (on the probabilities' device): the contract's
    inverse CDF, through :func:`pagedspec.ops.rejection_sample` with no drafts, never a
    zero-probability token. ``torch.multinomial`` per row cost 1.1-1.3 ms a row of SmolLM2's
    49152 tokens (Zen 4, 2 threads): 74 ms of a batch-64 step that samples."""
    B = probs.shape[0]
    dev = probs.device
    uniforms = torch.cat([torch.rand(1, generator=g, device=dev) for g in generators]).view(B, 1)
    no_drafts = torch.empty(B, 0, dtype=torch.int64, device=dev)
    tokens, _ = ops.rejection_sample(no_drafts, None, probs[:, None, :].contiguous(),
                                     uniforms.new_empty(B, 0), uniforms)
    return tokens[:, 0]


def sample(logits: torch.Tensor, rows: Sequence[SamplingRow],
           generators: Sequence[Optional[torch.Generator]]) -> list[int]:
    """One token per row of float32 ``logits`` ``[B, V]``; row i draws from ``generators[i]``
    (which must live on the logits' device) exactly once if it samples, never if greedy."""
    tokens = row_argmax(logits).tolist()
    sampled = [i for i, r in enumerate(rows) if r.temperature > 0]
    if sampled:
        probs = processed_probs(logits[sampled], [rows[i] for i in sampled])
        drawn = draw(probs, [generators[i] for i in sampled]).tolist()
        for i, t in zip(sampled, drawn):
            tokens[i] = t
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
