"""Benchmark cases for the speculative-decoding verification ops (op family "sampling").

rejection_sample over batch {1, 64, 256} x k {1, 4, 8} x vocabulary {32000, 128256} (Llama-2 and
Llama-3 vocabularies), with a realistic draft: the draft's logits are the target's plus noise
(acceptance around 0.6), draft tokens sampled from the draft.

Bytes moved are the probability rows the kernel reads, counted from the outcome of the fixed
inputs (every timed call repeats it): per request, 8 bytes (p and q) per drafted position tested,
plus the row the emitted token is drawn from: target and draft row (2 * V * 4 bytes) at a
rejection, the target row (V * 4 bytes) for the bonus token. A one-tile (512-byte) re-read of
the crossing tile and the token ids and uniforms are not counted.

On CPU the cases whose probabilities exceed 512 MiB (the largest batch x k x vocabulary
combinations, up to 2.2 GB) run on CUDA only: building them and timing the reference on a shared
host would take minutes per case.
"""
from __future__ import annotations

import torch

from pagedspec import ops, reference
from pagedspec.bench.core import Workload, register

CPU_PROBS_LIMIT = 512 << 20  # bytes of target + draft probabilities for a case to run on CPU


def _inputs(batch: int, k: int, vocab: int, device) -> dict:
    gen = torch.Generator(device=device).manual_seed(batch * 1000 + k * 10 + vocab)
    target_logits = torch.randn(batch, k + 1, vocab, generator=gen, device=device) * 2
    draft_logits = target_logits[:, :k] + torch.randn(batch, k, vocab, generator=gen,
                                                      device=device)
    target = torch.softmax(target_logits, dim=-1)
    del target_logits
    draft = torch.softmax(draft_logits, dim=-1)
    del draft_logits
    ids = torch.multinomial(draft.reshape(-1, vocab), 1, generator=gen).reshape(batch, k)
    return dict(draft_token_ids=ids, draft_probs=draft, target_probs=target,
                uniform_accept=torch.rand(batch, k, generator=gen, device=device),
                uniform_resample=torch.rand(batch, k + 1, generator=gen, device=device))


def _rows_read_bytes(inputs: dict, num_accepted: torch.Tensor) -> int:
    """Probability bytes the kernel reads for this outcome (module docstring)."""
    batch, k = inputs["draft_token_ids"].shape
    vocab = inputs["target_probs"].shape[-1]
    rejected = int((num_accepted < k).sum())
    rows = batch + (rejected if inputs["draft_probs"] is not None else 0)
    return rows * vocab * 4 + batch * k * 8


def _rejection_sample_case(batch: int, k: int, vocab: int, quick: bool):
    probs_bytes = batch * (2 * k + 1) * vocab * 4
    devices = ("cpu", "cuda") if probs_bytes <= CPU_PROBS_LIMIT else ("cuda",)

    @register("sampling", f"rejection_sample/B={batch}/k={k}/V={vocab}", quick=quick,
              devices=devices, batch=batch, k=k, vocab=vocab)
    def build(device) -> Workload:
        inputs = _inputs(batch, k, vocab, device)
        _, num_accepted = ops.rejection_sample(**inputs)
        return Workload(lambda: ops.rejection_sample(**inputs),
                        _rows_read_bytes(inputs, num_accepted),
                        lambda: reference.rejection_sample(**inputs),
                        items=batch, items_unit="requests")


for _batch in (1, 64, 256):
    for _k in (1, 4, 8):
        for _vocab in (32000, 128256):
            _rejection_sample_case(_batch, _k, _vocab,
                                   quick=(_batch, _k, _vocab) in ((64, 4, 32000), (64, 4, 128256)))
