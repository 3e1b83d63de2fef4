"""Scheduler: continuous batching, chunked prefill, preemption, prefix reuse, speculative rollback.

A stub model runner executes every step for real on a tiny CPU KV cache: it applies the step's
block moves, writes each token's K/V at its ``slot_mapping`` slot, and checks that every sequence's
context, read through ``block_tables`` and ``seq_lens``, is exactly its tokens. So a wrong slot, a
missed copy-on-write or swap, or a bad prefix hit fails the test, not just a bookkeeping assert.
"""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from pagedspec.engine import BlockManager, Scheduler, SchedulerConfig, SequenceStatus
from test_blocks import BS, make_cache, write_tokens


def next_token(seq, position: int) -> int:
    """The stub model's deterministic 'prediction' for a position (exact in float32)."""
    return 1 + (seq.seq_id * 7919 + position * 31) % 5000


class StubRunner:
    """Runs a step against a real cache and samples tokens. With ``draft_len`` > 0 it also plays
    the proposer: every decoding sequence gets that many drafts, of which a random prefix is
    accepted (the target's own token follows, as rejection sampling would emit)."""

    def __init__(self, sched: Scheduler, num_cpu_blocks: int = 0, draft_len: int = 0, seed=0):
        bm = sched.block_manager
        self.sched, self.kv = sched, make_cache(bm.num_blocks, num_cpu_blocks)
        self.draft_len, self.rng = draft_len, random.Random(seed)
        self.steps = 0

    def propose(self):
        for seq in self.sched.running:
            if self.draft_len and seq.is_decoding:
                k = self.rng.randint(0, self.draft_len)
                start = len(seq.token_ids)
                seq.draft_token_ids = [next_token(seq, start + j) if self.rng.random() < 0.7
                                       else 9999 for j in range(k)]

    def step(self):
        self.propose()
        sched = self.sched
        batch = sched.schedule()
        self.steps += 1
        self.check_batch(batch)
        self.kv.apply(batch.block_ops)
        write_tokens(self.kv, batch.slot_mapping.tolist(), batch.input_ids.tolist())
        self.check_contexts(batch)
        sampled = []
        logits = set(batch.logits_indices.tolist())
        cu = batch.cu_seqlens_q.tolist()
        for i, seq in enumerate(batch.seqs):
            rows = [r for r in range(cu[i], cu[i + 1]) if r in logits]
            k = batch.num_draft_tokens[i]
            assert len(rows) == (1 + k if rows else 0)
            if not rows:
                sampled.append([])
                continue
            end = len(seq.token_ids)
            accepted = 0
            while accepted < k and seq.draft_token_ids[accepted] == next_token(seq, end + accepted):
                accepted += 1
            sampled.append(seq.draft_token_ids[:accepted] + [next_token(seq, end + accepted)])
        return batch, sched.update(batch, sampled)

    def check_batch(self, batch):
        sched, bm = self.sched, self.sched.block_manager
        n = len(batch.seqs)
        q = np.array(batch.num_scheduled_tokens, dtype=np.int64)
        assert q.sum() <= sched.config.max_num_batched_tokens
        assert (q > 0).all() and len({s.seq_id for s in batch.seqs}) == n
        assert batch.input_ids.dtype == batch.slot_mapping.dtype == torch.int64
        assert batch.block_tables.dtype == batch.seq_lens.dtype == torch.int32
        assert batch.cu_seqlens_q.tolist() == [0] + np.cumsum(q).tolist()
        assert batch.max_q_len == (q.max() if n else 0)
        slots = batch.slot_mapping.tolist()
        assert len(set(slots)) == len(slots), "two tokens of one step share a slot"
        bt = batch.block_tables.numpy()
        for i, seq in enumerate(batch.seqs):
            assert seq.status is SequenceStatus.RUNNING
            assert bm.num_tokens(seq.seq_id) == batch.seq_lens[i].item()
            rows = range(batch.cu_seqlens_q[i].item(), batch.cu_seqlens_q[i + 1].item())
            for r, p in zip(rows, range(seq.num_computed_tokens, batch.seq_lens[i].item())):
                assert batch.positions[r].item() == p
                assert slots[r] == bt[i, p // BS] * BS + p % BS
                assert bm.ref_counts[bt[i, p // BS]] == 1, "a written block is shared"

    def check_contexts(self, batch):
        keys = self.kv.key_caches[0][:, :, 0, 0].reshape(-1)
        bt = batch.block_tables.numpy()
        for i, seq in enumerate(batch.seqs):
            n = batch.seq_lens[i].item()
            pos = np.arange(n)
            slots = torch.from_numpy(bt[i, pos // BS].astype(np.int64) * BS + pos % BS)
            expected = (seq.token_ids + seq.draft_token_ids)[:n]
            assert keys[slots].tolist() == expected, f"sequence {seq.seq_id} reads wrong KV"

    def run(self, max_steps=10_000, on_step=None):
        finished = []
        while self.sched.has_unfinished():
            assert self.steps < max_steps, "requests starve"
            batch, done = self.step()
            finished += done
            if on_step:
                on_step(batch)
        return finished


def make(num_blocks=64, num_cpu_blocks=0, max_num_seqs=16, budget=64, mode="recompute",
         eviction="lru", **cfg):
    bm = BlockManager(num_blocks, BS, num_cpu_blocks, eviction=eviction)
    config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                             preemption_mode=mode, **cfg)
    return Scheduler(config, bm)


def check_scheduler(sched):
    bm = sched.block_manager
    bm.check_invariants()
    assert [s.order for s in sched.running] == sorted(s.order for s in sched.running)
    for seq in sched.running:
        assert seq.status is SequenceStatus.RUNNING
        assert bm.num_tokens(seq.seq_id) == seq.num_computed_tokens < len(seq.token_ids) + 1
    for seq in sched.swapped:
        assert seq.status is SequenceStatus.SWAPPED and bm.tables[seq.seq_id].on_cpu
    for seq in sched.waiting:
        assert seq.status is SequenceStatus.WAITING and seq.seq_id not in bm.tables
    live = len(sched.running) + len(sched.waiting) + len(sched.swapped)
    assert live == len(bm.tables) + len(sched.waiting)


# ---- tests -------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode,eviction", [("recompute", "lru"), ("swap", "popularity"),
                                           ("auto", "popularity")])
def test_overload_of_ten_times_the_pool_completes(mode, eviction):
    sched = make(num_blocks=48, num_cpu_blocks=24, max_num_seqs=12, budget=40, mode=mode,
                 eviction=eviction, swap_min_tokens=24)
    rng = random.Random(1)
    requests = []
    for i in range(80):
        prompt = [rng.randrange(1, 50) for _ in range(rng.randint(1, 60))]
        requests.append(sched.add(prompt, rng.randint(1, 40)))
    demand = sum(len(r.token_ids) + r.max_tokens for r in requests)
    assert demand >= 10 * 48 * BS
    runner = StubRunner(sched, num_cpu_blocks=24)
    preempted = []

    def on_step(batch):
        check_scheduler(sched)
        assert len(sched.running) <= 12
        preempted.extend(batch.preempted)

    finished = runner.run(on_step=on_step)
    assert sorted(s.seq_id for s in finished) == sorted(r.seq_id for r in requests)
    for r in requests:
        assert r.finish_reason == "length" and len(r.output_token_ids) == r.max_tokens
    assert preempted, "the pool was never short: the test does not test preemption"
    assert sched.block_manager.num_free_blocks == 48


def test_chunked_prefill_never_stalls_decodes():
    sched = make(num_blocks=128, budget=32, max_num_seqs=8)
    for i in range(5):
        sched.add([i + 1] * 3, 100)
    runner = StubRunner(sched)
    runner.step()                                          # five short prefills
    long = sched.add(list(range(1, 200)), 4)
    chunks = []
    while long.num_computed_tokens < 199:
        batch, _ = runner.step()
        q = dict(zip((s.seq_id for s in batch.seqs), batch.num_scheduled_tokens))
        assert all(q.get(s.seq_id) == 1 for s in sched.running if s is not long)
        chunks.append(q.get(long.seq_id, 0))
    assert max(chunks) == 32 - 5 and sum(chunks) == 199 and len(chunks) == 8


def test_newest_is_preempted_first_and_resumes_before_newer_requests():
    sched = make(num_blocks=6, budget=64, max_num_seqs=4)
    seqs = [sched.add([10 * i + 1] * (2 * BS), 20) for i in range(3)]  # 2 blocks each
    runner = StubRunner(sched)
    runner.step()                                          # prefills fill the pool
    late = sched.add([77] * 4, 2)
    batch, _ = runner.step()                               # each decode needs a 3rd block
    assert batch.preempted == [seqs[2]]
    assert seqs[2].status is SequenceStatus.WAITING and seqs[2].num_computed_tokens == 0
    assert sorted(sched.waiting) == [seqs[2], late]
    first_run = {}

    def on_step(batch):
        check_scheduler(sched)
        for seq in batch.seqs:
            first_run.setdefault(seq.seq_id, runner.steps)

    runner.run(on_step=on_step)
    assert first_run[seqs[2].seq_id] <= first_run[late.seq_id]
    assert seqs[0].num_preemptions == 0
    assert all(len(s.output_token_ids) == 20 for s in seqs)


@pytest.mark.parametrize("mode,cpu,expect", [("auto", 8, "swapped"), ("auto", 0, "waiting"),
                                             ("swap", 0, "waiting"), ("recompute", 8, "waiting")])
def test_preemption_rule(mode, cpu, expect):
    sched = make(num_blocks=6, num_cpu_blocks=cpu, budget=64, max_num_seqs=4, mode=mode,
                 swap_min_tokens=2 * BS - 1)
    seqs = [sched.add([i + 1] * (2 * BS), 20) for i in range(3)]
    runner = StubRunner(sched, num_cpu_blocks=cpu)
    runner.step()
    batch, _ = runner.step()
    assert batch.preempted[0] is seqs[2]
    assert seqs[2].status is SequenceStatus(expect)
    runner.run(on_step=lambda b: check_scheduler(sched))
    assert all(len(s.output_token_ids) == 20 for s in seqs)


def test_short_victims_are_recomputed_in_auto_mode():
    sched = make(num_blocks=6, num_cpu_blocks=8, budget=64, max_num_seqs=4, mode="auto",
                 swap_min_tokens=100)
    seqs = [sched.add([i + 1] * (2 * BS), 20) for i in range(3)]
    runner = StubRunner(sched, num_cpu_blocks=8)
    runner.step()
    batch, _ = runner.step()
    assert batch.preempted[0] is seqs[2] and seqs[2].status is SequenceStatus.WAITING


def test_shared_prompt_prefix_is_served_from_the_cache():
    sched = make(num_blocks=64, budget=64)
    system = list(range(100, 100 + 3 * BS))
    first = sched.add(system + [1, 2, 3], 5)
    runner = StubRunner(sched)
    runner.run()
    second = sched.add(system + [4, 5], 5)
    batch, _ = runner.step()
    assert second.num_cached_tokens == 3 * BS
    assert batch.num_scheduled_tokens == [2]                # only the new tokens are computed
    table = sched.block_manager.tables[second.seq_id]
    assert table.blocks[:3] == batch.block_tables[0, :3].tolist()
    runner.run()
    assert first.finish_reason == second.finish_reason == "length"


def test_recompute_reuses_its_own_cached_blocks():
    sched = make(num_blocks=8, budget=64, max_num_seqs=4)
    a = sched.add([3] * (3 * BS), 30)
    b = sched.add([4] * (3 * BS), 30)
    runner = StubRunner(sched)
    runner.run(on_step=lambda batch: check_scheduler(sched))
    assert b.num_preemptions >= 1 and b.num_cached_tokens > 0
    assert a.num_preemptions == 0


def test_speculative_drafts_roll_back_and_only_verified_blocks_are_cached():
    sched = make(num_blocks=40, num_cpu_blocks=16, budget=64, max_num_seqs=6, mode="auto",
                 swap_min_tokens=20, eviction="popularity")
    rng = random.Random(5)
    for _ in range(14):
        sched.add([rng.randrange(1, 9) for _ in range(rng.randint(1, 30))], rng.randint(5, 40))
    runner = StubRunner(sched, num_cpu_blocks=16, draft_len=4, seed=3)
    bm = sched.block_manager
    drafts_seen = []

    def on_step(batch):
        check_scheduler(sched)
        drafts_seen.extend(k for k in batch.num_draft_tokens if k)
        for seq in sched.running:  # every registered hash names verified tokens of a sequence
            t = bm.tables[seq.seq_id]
            assert len(t.hashes) * BS <= seq.num_computed_tokens

    runner.run(on_step=on_step)
    assert drafts_seen and bm.num_free_blocks == 40


def test_parallel_sampling_by_fork_copies_on_write():
    sched = make(num_blocks=32, budget=32)
    parent = sched.add(list(range(1, 2 * BS + 4)), 6)
    runner = StubRunner(sched)
    runner.step()                                          # prefill; one token sampled
    children = [sched.fork(parent) for _ in range(3)]
    batch, _ = runner.step()
    assert batch.block_ops.copies.shape == (3, 2)           # one call, three copies
    runner.run(on_step=lambda b: check_scheduler(sched))
    outputs = {tuple(s.output_token_ids) for s in [parent] + children}
    assert len(outputs) == 4                               # each continued on its own


def test_eos_finishes_early_and_frees():
    sched = make(num_blocks=16, budget=32)
    seq = sched.add([1, 2, 3], 50)
    runner = StubRunner(sched)
    runner.step()
    seq.eos_token_id = next_token(seq, len(seq.token_ids) + 1)  # the token after the next
    runner.run()
    assert seq.finish_reason == "stop" and len(seq.output_token_ids) == 3
    assert sched.block_manager.num_free_blocks == 16


def test_rejects_requests_that_can_never_fit():
    sched = make(num_blocks=4, budget=32)
    with pytest.raises(ValueError, match="exceed"):
        sched.add([1] * 30, 3)
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        Scheduler(SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=64),
                  BlockManager(4, BS))


def test_empty_step():
    sched = make()
    batch = sched.schedule()
    assert batch.num_tokens == 0 and batch.block_tables.shape[0] == 0
    assert sched.update(batch, []) == []


def test_serving_bench_runs():
    from pagedspec.bench import serving
    memory = serving.bench_memory(40, 0, num_blocks=256)
    assert memory["kv_waste_paged"] < 0.1 < memory["kv_waste_static"]
    assert serving.bench_overhead(8, 0, steps=3)["running"] == 8


# ---- stateful ----------------------------------------------------------------------------------
class SchedulerMachine(RuleBasedStateMachine):
    """Random arrivals, forks and drafts between real steps; at the end everything completes."""

    @initialize(mode=st.sampled_from(["recompute", "swap", "auto"]),
                eviction=st.sampled_from(["lru", "popularity"]), drafts=st.integers(0, 3))
    def setup(self, mode, eviction, drafts):
        self.sched = make(num_blocks=24, num_cpu_blocks=12, max_num_seqs=6, budget=24,
                          mode=mode, eviction=eviction, swap_min_tokens=12)
        self.runner = StubRunner(self.sched, num_cpu_blocks=12, draft_len=drafts)
        self.all = []

    @rule(prompts=st.lists(st.tuples(st.integers(0, 2), st.integers(1, 40), st.integers(1, 30)),
                           min_size=1, max_size=4))
    def arrive(self, prompts):
        for family, length, max_tokens in prompts:
            self.all.append(self.sched.add([1 + family] * length + [50 + length], max_tokens))

    @rule(steps=st.integers(1, 4))
    def step(self, steps):
        for _ in range(steps):
            self.runner.step()
            check_scheduler(self.sched)

    @rule(i=st.integers(0, 99))
    def fork(self, i):
        running = [s for s in self.sched.running if s.is_decoding]
        if running:
            self.all.append(self.sched.fork(running[i % len(running)]))

    @invariant()
    def consistent(self):
        if hasattr(self, "sched"):
            check_scheduler(self.sched)

    def teardown(self):
        if hasattr(self, "sched"):
            self.runner.run(max_steps=self.runner.steps + 2000)
            assert all(s.status is SequenceStatus.FINISHED for s in self.all)
            assert self.sched.block_manager.num_free_blocks == 24


TestSchedulerMachine = SchedulerMachine.TestCase
TestSchedulerMachine.settings = settings(max_examples=40, stateful_step_count=25, deadline=None,
                                         suppress_health_check=[HealthCheck.too_slow])
