"""Speculative decoding through the ``LLM`` API: n-gram and draft-model drafters, verification,
rollback in both caches, and the adaptive controller.

Greedy speculation must reproduce plain greedy decoding token for token. Both runs are float32
but batch rows differently, so they agree to rounding, not bit for bit; where the reference's two
best tokens are within 1e-4 (a near-tie, which a random checkpoint has now and then) the runs may
part, and the comparison stops there. Sampled speculation must follow the same distribution as
plain sampling (chi-square against the exact distribution, with a check of the test's power).
"""
from __future__ import annotations

import json
import random
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from scipy import stats

from checkpoints import dense_forward, eagle_copy, hf_model, make_checkpoint
from pagedspec import LLM, SamplingParams
from pagedspec.engine import NgramProposer, SpeculationController
from pagedspec.engine.sequence import SequenceStatus

GREEDY = dict(temperature=0, ignore_eos=True)
PROMPTS = ["def fibonacci(n):", "import os, sys", "class Stack:\n    def push(self, item):",
           "print(", "    return a"]
TIE = 1e-4


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A target whose layers are weak (close to a bigram model: its greedy text repeats, so
    n-gram drafts get accepted), an aligned draft (the target cut to its first layer, sharing
    embeddings and head), and a misaligned one (unrelated random weights)."""
    root = tmp_path_factory.mktemp("spec")
    target = make_checkpoint(root / "target", "llama", seed=3, num_attention_heads=8,
                             num_key_value_heads=2, num_hidden_layers=3, scale_outputs=0.5)
    aligned = first_layer_copy(target, root / "aligned")
    misaligned = make_checkpoint(root / "misaligned", "llama", seed=11, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=1)
    # Half the vocabulary, at random: drafts the target would accept are often out of reach.
    subset = random.Random(5).sample(range(320), 160)
    reduced = reduced_copy(aligned, root / "reduced", subset)
    eagle = eagle_copy(target, root / "eagle")
    return {"target": target, "aligned": aligned, "misaligned": misaligned, "reduced": reduced,
            "eagle": eagle}


def first_layer_copy(src, dst):
    """The checkpoint ``src`` cut to its first layer (same embeddings, norm and head): a draft
    that agrees with the target often, not always."""
    shutil.copytree(src, dst)
    config = json.loads((src / "config.json").read_text())
    config["num_hidden_layers"] = 1
    config.pop("layer_types", None)
    (dst / "config.json").write_text(json.dumps(config))
    tensors = load_file(src / "model.safetensors")
    save_file({k: v for k, v in tensors.items() if not k.startswith("model.layers.")
               or k.startswith("model.layers.0.")}, dst / "model.safetensors")
    return dst


def reduced_copy(src, dst, token_ids: list[int]):
    """The draft ``src`` as a reduced-vocabulary draft in ``dst``: it drafts only ``token_ids``
    (``draft_vocab.json``) and borrows its embedding from the target instead of storing it (as
    the shipped SmolLM2 draft does)."""
    shutil.copytree(src, dst)
    config = json.loads((src / "config.json").read_text())
    config["pagedspec_borrowed_weights"] = ["model.embed_tokens.weight"]
    (dst / "config.json").write_text(json.dumps(config))
    tensors = load_file(src / "model.safetensors")
    save_file({k: v for k, v in tensors.items() if k != "model.embed_tokens.weight"},
              dst / "model.safetensors")
    (dst / "draft_vocab.json").write_text(json.dumps({"token_ids": sorted(token_ids)}))
    return dst


def make_llm(models, spec=None, **kwargs):
    if spec is not None and spec != "ngram":
        spec = models[spec]
    return LLM(models["target"], dtype="float32", device="cpu", max_model_len=256,
               speculative_model=spec, **kwargs)


@pytest.fixture(scope="module")
def plain(models):
    """Plain greedy outputs and their top-2 margins (for near-tie detection)."""
    llm = make_llm(models)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=48, logprobs=2, **GREEDY))
    result = []
    for o in outs:
        c = o.outputs[0]
        margins = [sorted((e.logprob for e in entry.values()), reverse=True)
                   for entry in c.logprobs]
        result.append((c.token_ids, [m[0] - m[1] for m in margins]))
    return result


def assert_greedy_equal(got: list[int], expected: tuple[list[int], list[float]]) -> None:
    tokens, margins = expected
    assert len(got) <= len(tokens)
    for i, (a, b) in enumerate(zip(got, tokens)):
        if margins[i] < TIE:
            return                            # a near-tie: both continuations are greedy
        assert a == b, f"token {i}: {a} != {b} (margin {margins[i]:.2e})"


# ---- n-gram proposer ----------------------------------------------------------------------
def test_ngram_proposer_cases():
    p = NgramProposer(max_n=3)
    assert p.propose(0, [1, 2, 3, 1, 2], 3) == [3, 1, 2]          # 2-gram [1, 2] at 0
    assert p.propose(1, [4, 1, 2, 3, 9, 1, 2, 3], 2) == [9, 1]    # 3-gram beats 1-gram
    assert p.propose(2, [1, 2, 7, 1, 2, 8, 1, 2], 2) == [8, 1]    # the latest match
    assert p.propose(3, [5, 5, 5], 4) == [5, 5, 5, 5]             # runs into its proposal
    assert p.propose(4, [1, 2, 3], 2) == []
    assert p.propose(5, [1], 2) == []
    with pytest.raises(ValueError):
        NgramProposer(max_n=1, min_n=2)


def brute_force_propose(tokens: list[int], k: int, max_n: int, min_n: int) -> list[int]:
    end = len(tokens)
    for n in range(min(max_n, end - 1), min_n - 1, -1):
        for start in range(end - n - 1, -1, -1):
            if tokens[start:start + n] == tokens[end - n:]:
                out = list(tokens)
                for i in range(k):
                    out.append(out[start + n + i])
                return out[end:]
    return []


def test_ngram_proposer_incremental_index_equals_brute_force():
    rng = random.Random(0)
    p = NgramProposer(max_n=4, min_n=2)
    for seq_id in range(20):
        tokens = [rng.randrange(6) for _ in range(3)]
        for _ in range(60):                   # grow as a decode does: 1-3 tokens at a time
            k = rng.randint(1, 5)
            assert p.propose(seq_id, tokens, k) == brute_force_propose(tokens, k, 4, 2)
            tokens += [rng.randrange(6) for _ in range(rng.randint(1, 3))]
        p.forget(seq_id)
    assert not p._index


# ---- greedy speculation == greedy ---------------------------------------------------------
@pytest.mark.parametrize("k", range(1, 9))
def test_greedy_equal_for_every_k(models, plain, k):
    for spec in ("ngram", "aligned", "reduced", "eagle"):
        llm = make_llm(models, spec, num_speculative_tokens=k, speculative_adaptive=False)
        outs = llm.generate(PROMPTS, SamplingParams(max_tokens=48, **GREEDY))
        for o, exp in zip(outs, plain):
            assert_greedy_equal(o.outputs[0].token_ids, exp)
        m = llm.speculative_metrics()
        assert m["num_draft_tokens"] > 0 and 0 < m["num_accepted_tokens"] <= m["num_draft_tokens"]
        assert llm.block_manager.num_free_blocks == llm.block_manager.num_blocks


@pytest.mark.parametrize("spec", ["ngram", "aligned", "misaligned", "reduced", "eagle"])
def test_mixed_batches_prefix_cache_and_preemption(models, plain, spec):
    """Greedy and sampled requests, with different lengths, in one run with a pool that forces
    preemption (recompute, then swap); twice, so the second run hits the prefix cache."""
    greedy = [SamplingParams(max_tokens=48 - 7 * i, **GREEDY) for i in range(len(PROMPTS))]
    sampled = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=30, ignore_eos=True, seed=4)
    for kwargs in (dict(preemption_mode="recompute"),
                   dict(preemption_mode="swap", swap_space=0.01)):
        llm = make_llm(models, spec, num_speculative_tokens=4, num_kv_blocks=20, block_size=8,
                       **kwargs)
        for _ in range(2):
            outs = llm.generate(PROMPTS + PROMPTS[:2], greedy + [sampled, sampled])
            for o, exp in zip(outs, plain):
                tokens = o.outputs[0].token_ids
                assert_greedy_equal(tokens, (exp[0][:len(tokens)], exp[1]))
            assert [len(o.outputs[0].token_ids) for o in outs[-2:]] == [30, 30]
            bm = llm.block_manager
            bm.check_invariants()
            assert bm.num_free_blocks == bm.num_blocks
        assert llm.scheduler.num_preemptions > 0, "the pool never ran short"
    # A pool large enough to keep the first run's blocks: the second run hits the prefix cache.
    llm = make_llm(models, spec, num_speculative_tokens=4, num_kv_blocks=200, block_size=8)
    llm.generate(PROMPTS, greedy)
    again = llm.generate(PROMPTS, greedy)
    assert sum(o.num_cached_tokens for o in again) > 0
    for o, exp in zip(again, plain):
        tokens = o.outputs[0].token_ids
        assert_greedy_equal(tokens, (exp[0][:len(tokens)], exp[1]))


# ---- sampled speculation: the distribution ----------------------------------------------------
@pytest.fixture(scope="module")
def small_vocab(tmp_path_factory):
    """Target and a partly aligned draft over 8 tokens (no tokenizer: token-id prompts)."""
    root = tmp_path_factory.mktemp("v8")
    cfg = dict(vocab_size=8, bos_token_id=None, eos_token_id=None, logit_scale=10.0)
    target = make_checkpoint(root / "t", "llama", seed=5, tokenizer=False, scale_outputs=0.7,
                             **cfg)
    return target, first_layer_copy(target, root / "d")


def exact_three_token_distribution(path, prompt: list[int], temperature: float) -> np.ndarray:
    """P(t1, t2, t3) of sampling three tokens at ``temperature`` from the checkpoint (float64,
    by enumerating the 8 + 64 prefixes)."""
    hf = hf_model(path)

    def next_probs(prefix: list[int]) -> torch.Tensor:
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + prefix])).logits[0, -1].double()
        return (logits / temperature).softmax(-1)

    V = 8
    p = np.zeros((V, V, V))
    p1 = next_probs([])
    for a in range(V):
        p2 = next_probs([a])
        for b in range(V):
            p[a, b] = (p1[a] * p2[b] * next_probs([a, b])).numpy()
    return p


def three_token_counts(llm, prompt, temperature, n) -> np.ndarray:
    out = llm.generate([prompt], SamplingParams(temperature=temperature, n=n, max_tokens=3,
                                                ignore_eos=True, seed=17))[0]
    counts = np.zeros((8, 8, 8))
    for c in out.outputs:
        counts[tuple(c.token_ids)] += 1
    return counts


def chi_square_p(counts: np.ndarray, probs: np.ndarray) -> float:
    counts, probs = counts.ravel(), probs.ravel()
    big = probs * counts.sum() >= 5           # pool the rare cells so the test is valid
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(probs[big], probs[~big].sum()) * counts.sum()
    keep = exp > 0
    return float(stats.chisquare(obs[keep], exp[keep]).pvalue)


def forking_llm(target, draft, n: int) -> LLM:
    """Draft-model speculation, k = 2, with a pool for each of ``n`` forks (no preemption: a
    recomputed fork would not draft)."""
    return LLM(target, dtype="float32", device="cpu", skip_tokenizer_init=True,
               max_model_len=32, speculative_model=draft, num_speculative_tokens=2,
               speculative_adaptive=False, seed=3, num_kv_blocks=n + 8, max_num_seqs=n,
               max_num_batched_tokens=4 * n)


def test_sampled_speculation_keeps_the_target_distribution(small_vocab, monkeypatch):
    """6000 three-token completions (n=6000 forks of one prompt, each drafting on its own after
    the first token) with draft-model speculation, against the exact joint distribution of the
    target's three tokens; cells expecting fewer than 5 are pooled. p < 1e-4 rejects a right
    implementation once in 10^4 runs. Then the power: the same test must reject a loop that
    passes the draft's probabilities to rejection sampling without the temperature (while the
    drafts were drawn with it), which biases the output towards the draft."""
    target, draft = small_vocab
    prompt, temperature, n = [1, 4, 2, 7], 0.4, 6000
    exact = exact_three_token_distribution(target, prompt, temperature)

    def make():
        return forking_llm(target, draft, n)

    llm = make()
    counts = three_token_counts(llm, prompt, temperature, n)
    m = llm.speculative_metrics()
    assert m["num_drafts"] == n and llm.scheduler.num_preemptions == 0
    assert 0.2 < m["acceptance_rate"] < 0.95, m     # drafts both accepted and rejected
    assert chi_square_p(counts, exact) > 1e-4
    plain = LLM(target, dtype="float32", device="cpu", skip_tokenizer_init=True,
                max_model_len=32, seed=3)
    assert chi_square_p(three_token_counts(plain, prompt, temperature, n), exact) > 1e-4

    import pagedspec.engine.core as llm_module
    original = llm_module.verify_drafts

    def without_temperature(items):
        for item in items:
            if item.draft_probs is not None:     # softmax(l/T) -> softmax(l): p^T, renormalized
                raw = item.draft_probs.double() ** item.row.temperature
                item.draft_probs = (raw / raw.sum(-1, keepdim=True)).float()
        return original(items)

    monkeypatch.setattr(llm_module, "verify_drafts", without_temperature)
    wc = three_token_counts(make(), prompt, temperature, n)
    assert chi_square_p(wc, exact) < 1e-6


def test_eagle_head_keeps_the_target_distribution(small_vocab, tmp_path):
    """As above with an EAGLE head drafting (features handed over from the target's passes,
    forks inheriting their parent's): its drafts change acceptance, never the distribution."""
    target, _ = small_vocab
    prompt, temperature, n = [1, 4, 2, 7], 0.4, 6000
    exact = exact_three_token_distribution(target, prompt, temperature)
    llm = forking_llm(target, eagle_copy(target, tmp_path / "eagle"), n)
    counts = three_token_counts(llm, prompt, temperature, n)
    m = llm.speculative_metrics()
    assert m["num_drafts"] == n and llm.scheduler.num_preemptions == 0
    assert 0.2 < m["acceptance_rate"] < 0.95, m
    assert chi_square_p(counts, exact) > 1e-4


# ---- rollback: both caches hold exactly the live tokens' K/V ----------------------------------
def dense_kv(model, tokens: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer, the K (after RoPE) and V of every position, from a dense causal pass."""
    kvs: list = []
    dense_forward(model, tokens, record=kvs)
    return kvs


def cached_kv(kv_cache, blocks: list[int], n: int, layer: int):
    bs = kv_cache.key_caches[0].shape[1]
    slots = torch.tensor([blocks[p // bs] * bs + p % bs for p in range(n)])
    k = kv_cache.key_caches[layer].flatten(0, 1)[slots]
    v = kv_cache.value_caches[layer].flatten(0, 1)[slots]
    return k, v


def test_after_rollback_both_caches_hold_the_live_tokens(models):
    llm = make_llm(models, "aligned", num_speculative_tokens=5, speculative_adaptive=False,
                   num_kv_blocks=64, block_size=8)
    for cache in (llm.kv_cache.key_caches + llm.kv_cache.value_caches
                  + llm.speculator.draft_model.kv_cache.key_caches
                  + llm.speculator.draft_model.kv_cache.value_caches):
        cache.fill_(float("nan"))
    for i, prompt in enumerate(PROMPTS):
        llm.engine.add_request(f"r{i}", prompt, SamplingParams(temperature=0.9, max_tokens=60,
                                                               ignore_eos=True, seed=2))
    for _ in range(12):
        llm.engine.step()
    draft = llm.speculator.draft_model
    assert llm.speculative_metrics()["num_accepted_tokens"] < \
        llm.speculative_metrics()["num_draft_tokens"], "nothing was ever rolled back"
    for seq in llm.scheduler.running:
        assert seq.status is SequenceStatus.RUNNING
        blocks = llm.block_manager.tables[seq.seq_id].blocks
        n = seq.num_computed_tokens
        for model, cache, count in ((llm.model, llm.kv_cache, n),
                                    (llm.draft_model, draft.kv_cache, draft._computed[seq.seq_id])):
            assert 0 < count <= n
            expected = dense_kv(model, seq.token_ids[:count])
            for layer, (k_ref, v_ref) in enumerate(expected):
                k, v = cached_kv(cache, blocks, count, layer)
                torch.testing.assert_close(k, k_ref, rtol=1e-4, atol=1e-4)
                torch.testing.assert_close(v, v_ref, rtol=1e-4, atol=1e-4)


def test_thousands_of_random_steps_leak_no_block(models):
    rng = random.Random(1)
    llm = make_llm(models, "aligned", num_speculative_tokens=4, num_kv_blocks=24, block_size=8,
                   swap_space=0.005, max_num_seqs=6, max_num_batched_tokens=64)
    while llm.speculator.stats.num_steps < 1500:
        n = rng.randint(1, 8)
        prompts = [[rng.randrange(1, 320) for _ in range(rng.randint(1, 40))] for _ in range(n)]
        params = [SamplingParams(temperature=rng.choice([0, 0.7, 1.0]),
                                 max_tokens=rng.randint(1, 50), n=rng.choice([1, 1, 2]),
                                 stop_token_ids=[rng.randrange(320)], seed=rng.choice([None, 5]))
                  for _ in prompts]
        llm.generate(prompts, params, use_tqdm=False)
        llm.block_manager.check_invariants()
        assert llm.block_manager.num_free_blocks == llm.block_manager.num_blocks
        assert not llm.engine.has_unfinished() and not llm.speculator.draft_model._computed
    assert llm.scheduler.num_preemptions > 0


# ---- the controller ---------------------------------------------------------------------------
def test_controller_model_on_synthetic_costs():
    """Memory-bound target (verifying more tokens is almost free): drafts pay when they are
    accepted, not when they are not. Compute-bound target (cost grows with every token): even
    well-accepted drafts of a costly draft model do not pay at a large batch."""
    def run(accept: float, target_cost, draft_cost: float, batch: int) -> list[int]:
        c = SpeculationController(max_k=8)
        rng = random.Random(0)
        keys = list(range(batch))
        for _ in range(200):
            k = c.choose(keys, [100] * batch, 0)
            c.observe_target(batch * (1 + k), target_cost(batch * (1 + k)))
            if k:
                c.observe_draft(batch, draft_cost)
                for key in keys:
                    acc = 0
                    while acc < k and rng.random() < accept:
                        acc += 1
                    c.observe_acceptance(key, k, acc)
        return c.history[-100:]

    memory_bound = lambda t: 1e-2 + 1e-5 * t          # noqa: E731
    compute_bound = lambda t: 1e-4 * t                 # noqa: E731
    assert np.mean(run(0.9, memory_bound, 1e-3, 1)) >= 4
    assert np.mean([k > 0 for k in run(0.0, memory_bound, 1e-3, 1)]) <= 0.1
    assert np.mean([k > 0 for k in run(0.7, compute_bound, 5e-3, 64)]) <= 0.1


def test_controller_charges_a_draft_model_its_catch_up():
    """Turning a draft model back on feeds it every token its cache lacks: near break-even
    (drafting predicted 1.10x), a batch whose draft caches lack many tokens stays at k = 0,
    one whose caches are current drafts; the measured catch-up cost is per caught-up token."""
    c = SpeculationController(max_k=1)
    batch, keys = 8, list(range(8))
    target = lambda t: 2e-2 + 1e-3 * t              # noqa: E731  verifying 8 more: 1.2x a step
    c.observe_target(batch, target(batch))
    c.observe_target(2 * batch, target(2 * batch))
    c.observe_draft(batch, 2e-3)
    for key in keys:
        for _ in range(20):                          # acceptance 0.5 at position 1
            c.observe_acceptance(key, 1, 1)
            c.observe_acceptance(key, 1, 0)
    c.observe_catch_up(batch, batch + 400, 2e-3 + 400 * 5e-5)
    assert c.catch_up_cost == pytest.approx(5e-5)
    c.warmup_steps, c.steps = 0, 1                   # past warm-up, no exploration due
    c._next_explore = 10 ** 9
    assert c.choose(keys, [100] * batch, 0, lacking=0) == 1
    c._decided = None
    assert c.choose(keys, [100] * batch, 0, lacking=48 * batch) == 0   # 48 steps skipped
    c._decided = None       # a new batch's prompts are paid once in its life: it drafts
    assert c.choose(keys, [100] * batch, 0, lacking_new=48 * batch) == 1


def test_controller_explores_rarely_while_drafting_loses_and_recovers():
    """A draft that is never accepted: after warm-up, exploration steps (the only drafting
    ones) come ever more rarely, at most every MAX_EXPLORE_EVERY steps, not one in
    explore_every; once the drafts start being accepted, drafting is back within that gap."""
    c = SpeculationController(max_k=4)
    rng = random.Random(0)
    batch, keys = 64, list(range(64))
    target = lambda t: 1e-2 + 1e-5 * t          # noqa: E731  memory-bound: drafts pay if accepted

    def step(accept: float) -> int:
        k = c.choose(keys, [100] * batch, 0)
        drafting = keys[:c.draft_limit] if c.draft_limit is not None else keys
        c.observe_target(batch + len(drafting) * k, target(batch + len(drafting) * k))
        if k:
            c.observe_draft(len(drafting), 1e-3)
            for key in drafting:
                acc = 0
                while acc < k and rng.random() < accept:
                    acc += 1
                c.observe_acceptance(key, k, acc)
        return k

    losing = [step(0.0) for _ in range(1000)]
    drafting_steps = [i + 1 for i, k in enumerate(losing) if k]
    assert len([i for i in drafting_steps if i > c.warmup_steps]) <= 8, drafting_steps
    assert all(b - a <= c.MAX_EXPLORE_EVERY for a, b in zip(drafting_steps, drafting_steps[1:]))
    winning = [step(0.95) for _ in range(2 * c.MAX_EXPLORE_EVERY)]
    assert np.mean([k > 0 for k in winning[-c.MAX_EXPLORE_EVERY // 2:]]) > 0.8, winning


def with_synthetic_costs(controller: SpeculationController) -> SpeculationController:
    """Feeds the controller a fixed memory-bound cost model in place of the wall clock, so a
    test of how real drafts' acceptance drives k does not depend on the machine's load (a
    descheduled step measured as slow vetoes drafting for a while, as it should in a run)."""
    target = lambda tokens: 1e-2 + 1e-5 * tokens          # noqa: E731
    draft_pass = 2e-3
    observe_goodput = controller.observe_goodput
    controller.observe_target = lambda num_tokens, seconds: SpeculationController.observe_target(
        controller, num_tokens, target(num_tokens))
    controller.observe_draft = lambda num_seqs, seconds: SpeculationController.observe_draft(
        controller, num_seqs, draft_pass)

    def goodput(num_seqs, k, tokens, seconds):
        observe_goodput(num_seqs, k, tokens, target(num_seqs * (1 + k)) + k * draft_pass)
    controller.observe_goodput = goodput
    controller.observe_catch_up = lambda num_seqs, num_tokens, seconds: (
        SpeculationController.observe_catch_up(controller, num_seqs, num_tokens,
                                               draft_pass + 1e-4 * (num_tokens - num_seqs)))
    return controller


def test_controller_turns_a_misaligned_draft_off_and_keeps_an_aligned_one(models):
    params = SamplingParams(max_tokens=64, **GREEDY)
    bad = make_llm(models, "misaligned", num_speculative_tokens=4)
    with_synthetic_costs(bad.speculator.controller)
    bad.generate(PROMPTS[:2], params)
    history = bad.speculator.controller.history
    assert all(k == 0 for i, k in enumerate(history[8:], 9) if i % 8), history
    good = make_llm(models, "ngram", num_speculative_tokens=4)
    with_synthetic_costs(good.speculator.controller)
    good.generate(PROMPTS[:2], params)
    history = good.speculator.controller.history
    assert np.mean([k > 0 for k in history[8:]]) > 0.5, history


@pytest.fixture(scope="module")
def reduced_small_vocab(tmp_path_factory):
    """A tied-embedding target over 8 tokens and its one-layer draft restricted to 6 of them,
    borrowing the target's embedding (which is also its LM head): the shipped draft's form."""
    root = tmp_path_factory.mktemp("v8r")
    # Tied, the embedding's self-similarity makes a large logit scale repeat one token: 2
    # spreads the mass (the excluded two hold 12-20% of each position's).
    cfg = dict(vocab_size=8, bos_token_id=None, eos_token_id=None, logit_scale=2.0,
               tie_word_embeddings=True)
    target = make_checkpoint(root / "t", "llama", seed=5, tokenizer=False, scale_outputs=0.7,
                             **cfg)
    excluded = [1, 6]
    draft = reduced_copy(first_layer_copy(target, root / "full"), root / "d",
                         [t for t in range(8) if t not in excluded])
    return target, draft, excluded


def test_reduced_vocabulary_keeps_the_target_distribution(reduced_small_vocab, monkeypatch):
    """As above, with a draft that drafts 6 of the 8 tokens: the 2 others must still come out
    as often as the target samples them (rejection sampling's residual emits them). The power:
    a loop that verified in the draft's vocabulary (the target's distribution cut to the
    subset, as if the draft's zeros meant the tokens did not exist) must be rejected."""
    target, draft, excluded = reduced_small_vocab
    prompt, temperature, n = [1, 4, 2, 7], 0.7, 6000
    exact = exact_three_token_distribution(target, prompt, temperature)
    assert exact.sum(axis=(1, 2))[excluded].sum() > 0.05     # the test needs their mass
    llm = forking_llm(target, draft, n)
    counts = three_token_counts(llm, prompt, temperature, n)
    m = llm.speculative_metrics()
    assert m["num_drafts"] == n and llm.scheduler.num_preemptions == 0
    assert 0.2 < m["acceptance_rate"] < 0.95, m
    assert counts.sum(axis=(1, 2))[excluded].sum() > 0
    assert chi_square_p(counts, exact) > 1e-4

    import pagedspec.engine.core as core_module
    original = core_module.verify_drafts

    def in_draft_vocabulary(items):
        for item in items:
            item.logits = item.logits.clone()
            item.logits[:, excluded] = float("-inf")
        return original(items)

    monkeypatch.setattr(core_module, "verify_drafts", in_draft_vocabulary)
    wrong = three_token_counts(forking_llm(target, draft, n), prompt, temperature, n)
    assert chi_square_p(wrong, exact) < 1e-6


def test_reduced_draft_checkpoint_errors(models, tmp_path):
    """A borrowing draft does not load alone; a bad draft_vocab.json is refused by name."""
    from pagedspec.models import CheckpointError, load_checkpoint

    ckpt = load_checkpoint(models["reduced"])
    with pytest.raises(CheckpointError, match="loads only as a draft model"):
        ckpt.load_model(torch.float32)
    for ids, msg in (([], "non-empty list"), ([3, 2], "strictly ascending"),
                     ([1, 1], "strictly ascending"), ([0, 320], "outside the vocabulary"),
                     (["a"], "list of ints")):
        bad = tmp_path / f"bad{len(list(tmp_path.iterdir()))}"
        shutil.copytree(models["reduced"], bad)
        (bad / "draft_vocab.json").write_text(json.dumps({"token_ids": ids}))
        with pytest.raises(CheckpointError, match=msg):
            make_llm({**models, "bad": bad}, "bad")
    both = tmp_path / "both"
    shutil.copytree(models["aligned"], both)
    config = json.loads((both / "config.json").read_text())
    config["pagedspec_borrowed_weights"] = ["model.embed_tokens.weight"]
    (both / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="both stored and borrowed"):
        make_llm({**models, "both": both}, "both")
    lent = "model.layers.0.mlp.up_proj.weight"     # the target keeps it fused with the gate
    config["pagedspec_borrowed_weights"] = [lent]
    (both / "config.json").write_text(json.dumps(config))
    tensors = load_file(both / "model.safetensors")
    save_file({k: v for k, v in tensors.items() if k != lent}, both / "model.safetensors")
    with pytest.raises(ValueError, match="cannot lend it.*does not keep it as stored"):
        make_llm({**models, "both": both}, "both")


def test_vocabulary_mismatch_is_refused(models, tmp_path):
    other = make_checkpoint(tmp_path / "v400", "llama", vocab_size=400)
    with pytest.raises(ValueError, match="vocabulary of 400 tokens, the target 320"):
        make_llm({**models, "other": other}, "other")
    short = make_checkpoint(tmp_path / "short", "llama", max_position_embeddings=64)
    with pytest.raises(ValueError, match="covers 64 positions, fewer than max_model_len"):
        make_llm({**models, "short": short}, "short")
    with pytest.raises(ValueError, match="num_speculative_tokens must be"):
        make_llm(models, "ngram", num_speculative_tokens=0)


def test_learning_steps_draft_with_the_most_current_draft_caches():
    """A learning step (warm-up, exploration) drafts for a quarter of the batch: with a draft
    model, the sequences whose draft caches lack the fewest tokens (ties in rotation), and only
    the most current one when every cache is stale, so exploring after a long run of k = 0
    does not feed the draft whole sequences; with n-gram drafts, in rotation, so every request
    gets measured."""
    from types import SimpleNamespace

    from pagedspec.engine.speculator import Speculator

    seqs = [SimpleNamespace(seq_id=i, token_ids=[0] * 100) for i in range(8)]
    computed = {0: 10, 1: 99, 2: 50, 3: 99, 4: 0, 5: 98, 6: 60, 7: 97}
    draft = SimpleNamespace(computed_tokens=lambda seq_id: computed[seq_id])
    controller = SpeculationController(4)
    spec = Speculator(controller, draft_model=draft)
    assert spec._learners(seqs, 2) == {1, 3}
    assert spec._learners(seqs, 4) == {1, 3, 5, 7}
    # every cache stale (after a long run of k = 0, or new sequences): one sequence learns
    computed = {i: c - 40 for i, c in computed.items()}
    assert spec._learners(seqs, 4) in ({1}, {3})
    ngram = Speculator(controller, ngram=NgramProposer())
    seen = set()
    for step in range(4):
        controller.steps = step
        chosen = ngram._learners(seqs, 2)
        assert len(chosen) == 2
        seen |= chosen
    assert seen == set(range(8))
