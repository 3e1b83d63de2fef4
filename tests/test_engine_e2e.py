"""End to end below the API: the scheduler and the paged model runner on a tiny random Llama
checkpoint (built with ``transformers``, loaded with pagedspec's loader, CPU).

The paged runner's logits are checked against ``transformers``' own forward pass of the same
checkpoint at every row of every step, through chunked prefill, prefix-cache hits and decode
steps. KV caches start as NaN, so a read of a slot that was never written poisons the logits.
(Speculative decoding through the whole API: tests/test_speculative.py.)
"""
from __future__ import annotations

import pytest
import torch

from checkpoints import BASE, hf_model, make_checkpoint
from pagedspec.engine import BlockManager, KVCache, ModelRunner, Scheduler, SchedulerConfig
from pagedspec.models import load_checkpoint

VOCAB = BASE["vocab_size"]


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("llama"), "llama", seed=0)


@pytest.fixture(scope="module")
def model(model_dir):
    return load_checkpoint(model_dir).load_model(torch.float32)


@pytest.fixture(scope="module")
def hf(model_dir):
    return hf_model(model_dir)


def make_engine(model, num_blocks: int = 64, block_size: int = 16, budget: int = 64,
                max_num_seqs: int = 8) -> tuple[Scheduler, ModelRunner]:
    kv = KVCache(model.num_layers, num_blocks, block_size, model.num_kv_heads, model.head_size,
                 dtype=torch.float32)
    for cache in kv.key_caches + kv.value_caches:
        cache.fill_(float("nan"))
    sched = Scheduler(SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                                      preemption_mode="recompute"),
                      BlockManager(num_blocks, block_size))
    return sched, ModelRunner(model, kv)


def random_prompt(gen: torch.Generator, n: int) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=gen).tolist()


# ---- (a) paged runner == transformers ----------------------------------------------------------
def check_against_dense(hf, engine: tuple[Scheduler, ModelRunner], counts: dict) -> None:
    """Run the scheduler to completion with greedy sampling, comparing every step's logits, at
    every row, with transformers' forward of each sequence's tokens up to that row."""
    sched, runner = engine
    while sched.has_unfinished():
        batch = sched.schedule()
        logits = runner.execute(batch, all_rows=True)                  # [T, V]
        cu = batch.cu_seqlens_q.tolist()
        for i, seq in enumerate(batch.seqs):
            positions = batch.positions[cu[i]:cu[i + 1]]
            end = int(positions[-1]) + 1
            counts["chunked"] += end < len(seq.token_ids)
            counts["decode"] += batch.num_scheduled_tokens[i] == 1
            with torch.no_grad():
                dense = hf(torch.tensor([seq.token_ids[:end]])).logits[0][positions]
            # float32 throughout; the paths differ only in summation order (online softmax over
            # pages vs SDPA, fused vs separate projections), errors ~1e-6 of the logit scale after
            # two layers. 1e-4 of the scale is ~100x that, and far below real bugs (a wrong slot
            # or position changes logits by O(1)).
            tol = 1e-4 * dense.abs().max().item()
            torch.testing.assert_close(logits[cu[i]:cu[i + 1]], dense, rtol=1e-4, atol=tol)
        sampled = logits[batch.logits_indices].argmax(-1).tolist()
        new, j = [], 0
        for i, seq in enumerate(batch.seqs):
            has = seq.num_computed_tokens + batch.num_scheduled_tokens[i] >= len(seq.token_ids)
            new.append(sampled[j:j + 1] if has else [])
            j += has
        assert j == len(sampled)
        sched.update(batch, new)
    sched.block_manager.check_invariants()


@pytest.mark.parametrize("block_size", [8, 16])
def test_paged_runner_matches_transformers(model, hf, gen, block_size):
    engine = make_engine(model, num_blocks=96, block_size=block_size, budget=32, max_num_seqs=4)
    sched = engine[0]
    counts = {"chunked": 0, "decode": 0}
    prompts = [random_prompt(gen, n) for n in (1, 7, 29, 45, 16, 3)]
    seqs = [sched.add(p, 12) for p in prompts]
    check_against_dense(hf, engine, counts)
    assert counts["chunked"] > 0 and counts["decode"] > 0, counts
    # Prompts sharing the first ones' full blocks are served from the prefix cache.
    later = [sched.add(seqs[3].token_ids[:40] + random_prompt(gen, 5), 6),
             sched.add(prompts[2] + random_prompt(gen, 9), 6)]
    check_against_dense(hf, engine, counts)
    assert all(s.num_cached_tokens > 0 for s in later)


def test_runner_rejects_mismatched_cache(model):
    kv = KVCache(model.num_layers + 1, 4, 16, model.num_kv_heads, model.head_size,
                 dtype=torch.float32)
    with pytest.raises(ValueError, match="layers"):
        ModelRunner(model, kv)
    kv = KVCache(model.num_layers, 4, 16, model.num_kv_heads, 128, dtype=torch.float32)
    with pytest.raises(ValueError, match="head size"):
        ModelRunner(model, kv)
