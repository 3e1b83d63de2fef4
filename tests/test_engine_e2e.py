"""End to end: scheduler + paged model runner + speculative decoding on tiny random Llama
checkpoints (built with ``transformers``, loaded with pagedspec's loader, CPU).

The paged runner's logits are checked against ``transformers``' own forward pass of the same
checkpoint, through chunked prefill, prefix-cache hits and decode steps; then greedy speculative
decoding must emit exactly plain greedy decoding's tokens, in fewer target steps when drafts are
accepted, also when a small pool forces preemption (recompute and swap). KV caches start as NaN,
so a read of a slot that was never written poisons the logits.
"""
from __future__ import annotations

import pytest
import torch

from checkpoints import BASE, hf_model, make_checkpoint
from pagedspec.engine import (BlockManager, KVCache, ModelRunner, NgramProposer, Scheduler,
                              SchedulerConfig, SpeculativeDecoder)
from pagedspec.models import load_checkpoint

VOCAB = BASE["vocab_size"]
MAX_TOKENS = 40


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    # The matrices are tiny: intra-op threads only add synchronization, which on a loaded
    # machine costs ~100x the work itself (16 ms vs 80 us per projection here).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("llama"), "llama", seed=0)


@pytest.fixture(scope="module")
def model(model_dir):
    return load_checkpoint(model_dir).load_model(torch.float32)


@pytest.fixture(scope="module")
def hf(model_dir):
    return hf_model(model_dir)


@pytest.fixture(scope="module")
def spec_model(tmp_path_factory):
    # Smaller layer outputs: closer to a bigram model whose greedy output soon repeats itself,
    # so n-gram drafts get accepted often (a random full-strength model rarely repeats).
    path = make_checkpoint(tmp_path_factory.mktemp("llama-spec"), "llama", seed=0,
                           scale_outputs=0.5)
    return load_checkpoint(path).load_model(torch.float32)


def make_engine(model, num_blocks: int = 64, block_size: int = 16, budget: int = 64,
                max_num_seqs: int = 8, mode: str = "recompute", num_cpu_blocks: int = 0,
                **decoder_args) -> SpeculativeDecoder:
    kv = KVCache(model.num_layers, num_blocks, block_size, model.num_kv_heads, model.head_size,
                 dtype=torch.float32, num_cpu_blocks=num_cpu_blocks)
    for cache in kv.key_caches + kv.value_caches:
        cache.fill_(float("nan"))
    sched = Scheduler(SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                                      preemption_mode=mode),
                      BlockManager(num_blocks, block_size, num_cpu_blocks))
    return SpeculativeDecoder(sched, ModelRunner(model, kv), **decoder_args)


def random_prompt(gen: torch.Generator, n: int) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=gen).tolist()


# ---- (a) paged runner == transformers ----------------------------------------------------------
def check_against_dense(hf, decoder: SpeculativeDecoder, counts: dict) -> None:
    """Run the scheduler to completion with greedy sampling, comparing every step's logits, at
    every row, with transformers' forward of each sequence's tokens up to that row."""
    sched, runner = decoder.scheduler, decoder.runner
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
        for i in range(len(batch.seqs)):
            has = SpeculativeDecoder._has_logits(batch, i)
            new.append(sampled[j:j + 1] if has else [])
            j += has
        assert j == len(sampled)
        sched.update(batch, new)
    sched.block_manager.check_invariants()


@pytest.mark.parametrize("block_size", [8, 16])
def test_paged_runner_matches_transformers(model, hf, gen, block_size):
    decoder = make_engine(model, num_blocks=96, block_size=block_size, budget=32, max_num_seqs=4)
    counts = {"chunked": 0, "decode": 0}
    prompts = [random_prompt(gen, n) for n in (1, 7, 29, 45, 16, 3)]
    seqs = [decoder.scheduler.add(p, 12) for p in prompts]
    check_against_dense(hf, decoder, counts)
    assert counts["chunked"] > 0 and counts["decode"] > 0, counts
    # Prompts sharing the first ones' full blocks are served from the prefix cache.
    later = [decoder.scheduler.add(seqs[3].token_ids[:40] + random_prompt(gen, 5), 6),
             decoder.scheduler.add(prompts[2] + random_prompt(gen, 9), 6)]
    check_against_dense(hf, decoder, counts)
    assert all(s.num_cached_tokens > 0 for s in later)


def test_runner_rejects_mismatched_cache(model):
    kv = KVCache(model.num_layers + 1, 4, 16, model.num_kv_heads, model.head_size,
                 dtype=torch.float32)
    with pytest.raises(ValueError, match="layers"):
        ModelRunner(model, kv)
    kv = KVCache(model.num_layers, 4, 16, model.num_kv_heads, 128, dtype=torch.float32)
    with pytest.raises(ValueError, match="head size"):
        ModelRunner(model, kv)


# ---- the proposer ------------------------------------------------------------------------------
def test_ngram_proposer():
    assert NgramProposer(3).propose([1, 2, 3, 1, 2]) == [3, 1, 2]      # 2-gram [1, 2] at 0
    assert NgramProposer(2).propose([4, 1, 2, 3, 9, 1, 2, 3]) == [9, 1]  # 3-gram beats 1-gram
    assert NgramProposer(2).propose([1, 2, 7, 1, 2, 8, 1, 2]) == [8, 1]  # the latest match
    assert NgramProposer(4).propose([5, 5, 5]) == [5, 5, 5, 5]          # runs into its proposal
    assert NgramProposer(2).propose([1, 2, 3]) == []
    assert NgramProposer(2).propose([1]) == []
    with pytest.raises(ValueError):
        NgramProposer(0)


# ---- (b) greedy speculative == greedy ----------------------------------------------------------
def spec_prompts(model, gen: torch.Generator) -> list[list[int]]:
    """Repetitive prompts (a prefix, the model's own continuation of it, the prefix again: the
    continuation is then a likely draft), periodic ones, and random ones."""
    prompts = []
    for n in (6, 12):
        head = random_prompt(gen, n)
        cont = make_engine(model).generate([head], 20)[0]
        prompts.append(head + cont + head)
    prompts += [[3, 1, 4, 1, 5] * 4, [7, 8] * 6]
    prompts += [random_prompt(gen, n) for n in (9, 30)]
    return prompts


@pytest.mark.parametrize("k", [1, 4])
def test_greedy_speculative_equals_greedy(spec_model, gen, k):
    prompts = spec_prompts(spec_model, gen)
    total_accepted = 0
    for prompt in prompts:                      # one at a time: steps are counted exactly
        plain = make_engine(spec_model)
        expected = plain.generate([prompt], MAX_TOKENS)
        spec = make_engine(spec_model, proposer=NgramProposer(k))
        assert spec.generate([prompt], MAX_TOKENS) == expected
        assert spec.num_accepted <= spec.num_drafted
        # Every accepted draft saves exactly one target step (prefill steps are the same).
        assert spec.runner.num_steps == plain.runner.num_steps - spec.num_accepted
        total_accepted += spec.num_accepted
    assert total_accepted >= len(prompts), "n-gram drafts are hardly ever accepted"

    # All together, continuous batching with chunked prefill, and with a stop token.
    plain = make_engine(spec_model, budget=24)
    expected = plain.generate(prompts, MAX_TOKENS)
    spec = make_engine(spec_model, budget=24, proposer=NgramProposer(k))
    assert spec.generate(prompts, MAX_TOKENS) == expected
    # A batch step serves every sequence, so the batch saves steps only where its slowest
    # sequence accepts drafts (a random prompt hardly does); it never costs steps.
    assert spec.runner.num_steps <= plain.runner.num_steps
    eos = expected[0][MAX_TOKENS // 2]
    stop = expected[0][:expected[0].index(eos) + 1]
    got = make_engine(spec_model, proposer=NgramProposer(k)).generate([prompts[0]], MAX_TOKENS,
                                                                      eos_token_id=eos)
    assert got == [stop]


# ---- (c) sampling ------------------------------------------------------------------------------
def test_sampling_speculative_runs_and_is_reproducible(spec_model, gen):
    prompts = spec_prompts(spec_model, gen)

    def sample(seed: int, temperature: float = 0.8) -> tuple[list[list[int]], SpeculativeDecoder]:
        g = torch.Generator().manual_seed(seed)
        decoder = make_engine(spec_model, budget=24, proposer=NgramProposer(4),
                              temperature=temperature, generator=g)
        return decoder.generate(prompts, MAX_TOKENS), decoder

    outputs, decoder = sample(1)
    assert all(len(o) == MAX_TOKENS for o in outputs)
    assert all(0 <= t < VOCAB for o in outputs for t in o)
    assert decoder.num_drafted > 0 and 0 < decoder.num_accepted <= decoder.num_drafted
    assert sample(1)[0] == outputs                     # same generator seed, same tokens
    assert sample(2)[0] != outputs
    decoder.scheduler.block_manager.check_invariants()
    # Near zero temperature the target distribution is one-hot on the argmax, so rejection
    # sampling must reproduce greedy decoding: this checks which logits row verifies which draft.
    greedy = make_engine(spec_model, budget=24).generate(prompts, MAX_TOKENS)
    assert sample(3, temperature=1e-4)[0] == greedy


# ---- (d) preemption ----------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["recompute", "swap"])
@pytest.mark.parametrize("k", [0, 4])
def test_preemption_keeps_greedy_outputs(spec_model, gen, mode, k):
    prompts = spec_prompts(spec_model, gen)[:4] + [random_prompt(gen, 20)]
    expected = make_engine(spec_model).generate(prompts, MAX_TOKENS)
    # 10 blocks of 16 slots; each request needs up to 5 blocks, together about 20.
    decoder = make_engine(spec_model, num_blocks=10, budget=24, mode=mode,
                          num_cpu_blocks=32 if mode == "swap" else 0,
                          proposer=NgramProposer(k) if k else None)
    seqs = [decoder.scheduler.add(p, MAX_TOKENS) for p in prompts]
    while decoder.scheduler.has_unfinished():
        decoder.step()
    assert [s.output_token_ids for s in seqs] == expected
    assert sum(s.num_preemptions for s in seqs) > 0, "the pool never ran short"
    bm = decoder.scheduler.block_manager
    bm.check_invariants()
    assert bm.num_free_blocks == bm.num_blocks


def test_docstring_example_runs(model_dir):
    import textwrap

    import pagedspec.engine.speculative as speculative
    lines = []                       # the indented block after "::"
    for line in speculative.__doc__.split("::", 1)[1].splitlines()[1:]:
        if line.strip() and not line.startswith("    "):
            break
        lines.append(line)
    example = textwrap.dedent("\n".join(lines))
    scope: dict = {"checkpoint_dir": model_dir}
    exec(example, scope)
    outputs = scope["outputs"]
    assert [len(o) for o in outputs] == [16, 16]
    assert all(0 <= t < VOCAB for o in outputs for t in o)
