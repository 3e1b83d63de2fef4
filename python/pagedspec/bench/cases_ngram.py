"""Benchmark case for n-gram prompt lookup: one decode step's proposals for a batch of long
sequences (256 sequences of 2048 tokens, k = 4).

Per call, every sequence gains one token (as after a decode step) and gets a proposal: the
incremental index takes the new token's n-grams, then the trailing n-grams are looked up. The
one-time indexing of each prompt happens at build time, outside the timing, as the engine does
it once per request. There is no kernel and no byte traffic to speak of: the number to read is
the time per step (and items/s = proposals per second). The reference is the direct search: for
each sequence, scan backwards for the latest earlier occurrence of its trailing n-gram (what
vLLM's proposer does, there compiled with numba).
"""
from __future__ import annotations

import random

from pagedspec.bench.core import Workload, register
from pagedspec.engine.speculative import NgramProposer

K, MAX_N, MIN_N = 4, 3, 1


def direct_search(tokens: list[int], k: int) -> list[int]:
    end = len(tokens)
    for n in range(min(MAX_N, end - 1), MIN_N - 1, -1):
        tail = tokens[end - n:]
        for start in range(end - n - 1, -1, -1):
            if tokens[start:start + n] == tail:
                out: list[int] = []
                for i in range(start + n, start + n + k):
                    out.append(tokens[i] if i < end else out[i - end])
                return out
    return []


def _build(num_seqs: int, length: int):
    def build(device) -> Workload:
        rng = random.Random(0)
        # Code-like token streams: a vocabulary of 4096 with recurring phrases.
        phrases = [[rng.randrange(4096) for _ in range(rng.randint(2, 12))] for _ in range(300)]
        seqs = []
        for _ in range(num_seqs):
            tokens: list[int] = []
            while len(tokens) < length:
                tokens += rng.choice(phrases) if rng.random() < 0.7 else [rng.randrange(4096)]
            seqs.append(tokens[:length])
        proposer = NgramProposer(MAX_N, MIN_N)
        for i, tokens in enumerate(seqs):
            proposer.update(i, tokens)

        def run():
            for i, tokens in enumerate(seqs):
                tokens.append(rng.randrange(4096))
                proposer.propose(i, tokens, K)

        def reference():
            for tokens in seqs:
                direct_search(tokens, K)

        return Workload(run, 0, reference, items=num_seqs, items_unit="proposals")
    return build


for _seqs, _len in ((256, 2048), (32, 2048), (256, 256)):
    register("ngram", f"ngram propose B={_seqs} len={_len} k={K}", quick=_seqs == 32,
             devices=("cpu", "cuda"), seqs=_seqs, length=_len)(_build(_seqs, _len))
