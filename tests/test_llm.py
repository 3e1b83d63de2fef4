"""The offline API (``LLM``, ``SamplingParams``) on tiny random checkpoints, against
``transformers`` and against itself under batching, prefix caching, preemption and forking.

Greedy outputs must be token-for-token those of ``transformers``' ``generate(do_sample=False)``
(float32, where the two differ only in rounding); a request's tokens must not depend on what else
is in the batch; sampled tokens must follow the processed distribution (chi-square, with a check
that the test rejects a sampler that skips a processing step).
"""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from scipy import stats

from checkpoints import hf_model, make_checkpoint
from pagedspec import LLM, SamplingParams
from pagedspec.engine.sampler import SamplingRow, processed_probs, sample

PROMPTS = ["def fibonacci(n):", "import os, sys", "class Stack:\n    def push(self, item):",
           "print(", "    return a"]
GREEDY = dict(temperature=0, ignore_eos=True)


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("llm")
    return {arch: make_checkpoint(root / arch, arch, seed=3, **cfg) for arch, cfg in [
        ("llama", dict(num_attention_heads=8, num_key_value_heads=2)),
        ("qwen2", dict(num_attention_heads=14, num_key_value_heads=2)),
        ("mistral", dict(num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=True)),
    ]}


@pytest.fixture(scope="module")
def llm(dirs):
    return LLM(dirs["llama"], dtype="float32", device="cpu", max_model_len=256)


def hf_greedy(hf, ids: list[int], n: int) -> list[int]:
    hf.generation_config.eos_token_id = None        # never stop early (ignore_eos)
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False,
                          pad_token_id=0)
    return out[0, len(ids):].tolist()


def texts_and_ids(outputs):
    return [[(c.text, c.token_ids) for c in o.outputs] for o in outputs]


# ---- greedy == transformers ------------------------------------------------------------------
@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_greedy_equals_transformers_generate(dirs, arch):
    llm = LLM(dirs[arch], dtype="float32", device="cpu", max_model_len=256)
    hf = hf_model(dirs[arch])
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=24, **GREEDY), use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs):
        ids = llm.tokenizer.encode(prompt).ids
        assert out.prompt == prompt and out.prompt_token_ids == ids
        expected = hf_greedy(hf, ids, 24)
        assert out.outputs[0].token_ids == expected, prompt
        assert out.outputs[0].text == llm.tokenizer.decode(expected, skip_special_tokens=True)
        assert out.outputs[0].finish_reason == "length" and out.finished


def test_batching_prefix_cache_preemption_and_forks_keep_greedy_tokens(dirs):
    path = dirs["llama"]
    params = [SamplingParams(max_tokens=n, **GREEDY) for n in (30, 12, 41, 7, 25)]
    alone = [LLM(path, dtype="float32", device="cpu", max_model_len=256, seed=1)
             .generate([p], [sp], use_tqdm=False)[0] for p, sp in zip(PROMPTS, params)]
    expected = [o.outputs[0].token_ids for o in alone]

    def run(**kwargs):
        llm = LLM(path, dtype="float32", device="cpu", max_model_len=256, **kwargs)
        got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
        bm = llm.block_manager
        bm.check_invariants()
        assert not llm.scheduler.has_unfinished() and bm.num_free_blocks == bm.num_blocks
        return got, llm

    # One batch, prefill chunked by a small token budget.
    got, llm = run(max_num_batched_tokens=24, max_num_seqs=4)
    assert got == expected
    # Prefix-cache hits: the same prompts again, and prompts extending them.
    again = llm.generate(PROMPTS, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in again] == expected
    assert sum(o.num_cached_tokens for o in again) > 0
    # Preemption by recompute and by swap: the pool holds about two requests at a time.
    for kwargs in (dict(preemption_mode="recompute"),
                   dict(preemption_mode="swap", swap_space=0.01)):
        got, llm = run(num_kv_blocks=8, block_size=8, max_num_seqs=8, **kwargs)
        assert got == expected, kwargs
        assert llm.scheduler.num_preemptions > 0, "the pool never ran short"
    # n > 1: greedy children are copies of the single completion (copy-on-write, no leak).
    llm = LLM(path, dtype="float32", device="cpu", max_model_len=256, num_kv_blocks=64,
              block_size=8)
    forked = llm.generate([PROMPTS[0], PROMPTS[2]], SamplingParams(max_tokens=20, n=3, **GREEDY),
                          use_tqdm=False)
    for out, exp in zip(forked, [expected[0], expected[2]]):
        assert [c.index for c in out.outputs] == [0, 1, 2]
        assert all(c.token_ids == exp[:20] for c in out.outputs)
    assert llm.block_manager.num_free_blocks == llm.block_manager.num_blocks


# ---- sampling ---------------------------------------------------------------------------------
def test_seeded_request_ignores_the_rest_of_the_batch(llm):
    params = SamplingParams(temperature=0.9, top_k=40, top_p=0.95, max_tokens=20, seed=1234,
                            ignore_eos=True)
    alone = llm.generate([PROMPTS[0]], params, use_tqdm=False)[0].outputs[0].token_ids
    others = [SamplingParams(temperature=1.3, max_tokens=15, ignore_eos=True),
              SamplingParams(max_tokens=9, **GREEDY),
              SamplingParams(temperature=0.5, n=2, min_p=0.1, max_tokens=25, ignore_eos=True)]
    batch = llm.generate(PROMPTS[1:4] + [PROMPTS[0]], others + [params], use_tqdm=False)
    assert batch[-1].outputs[0].token_ids == alone
    unseeded = [llm.generate([PROMPTS[0]], SamplingParams(temperature=0.9, max_tokens=20,
                                                          ignore_eos=True), use_tqdm=False)
                [0].outputs[0].token_ids for _ in range(2)]
    assert unseeded[0] != unseeded[1], "unseeded requests must differ from one another"
    other_seed = llm.generate([PROMPTS[0]], SamplingParams(
        temperature=0.9, top_k=40, top_p=0.95, max_tokens=20, seed=99, ignore_eos=True),
        use_tqdm=False)[0].outputs[0].token_ids
    assert other_seed != alone


def reference_probs(logits: np.ndarray, temperature: float, top_k: int, top_p: float,
                    min_p: float) -> np.ndarray:
    """An independent float64 statement of the processing (transformers' warper order)."""
    z = logits.astype(np.float64) / temperature
    order = np.argsort(-z, kind="stable")
    keep = np.ones_like(z, dtype=bool)
    if top_k > 0:
        keep[order[top_k:]] = False
    p = np.exp(z - z.max()) * keep
    p /= p.sum()
    if top_p < 1:
        above = np.cumsum(p[order]) - p[order]
        keep[order[above >= top_p]] = False
        keep[order[0]] = True
        p = p * keep
        p /= p.sum()
    if min_p > 0:
        p = p * (p >= min_p * p.max())
        p /= p.sum()
    return p


def chi_square_p(counts: np.ndarray, probs: np.ndarray) -> float:
    """p-value of the counts under ``probs``; a count where the probability is 0 gives 0."""
    n = counts.sum()
    if counts[probs == 0].any():
        return 0.0
    mask = probs > 0
    return float(stats.chisquare(counts[mask], probs[mask] * n).pvalue)


SETTINGS = [SamplingRow(1.0), SamplingRow(0.7, top_k=5), SamplingRow(1.5, top_p=0.8),
            SamplingRow(1.0, min_p=0.05), SamplingRow(0.8, top_k=8, top_p=0.9, min_p=0.02)]


@pytest.mark.parametrize("row", SETTINGS, ids=str)
def test_sampler_follows_processed_distribution(gen, row):
    """40k draws over 16 tokens; p < 1e-4 would reject the right sampler once in 10^4 runs. The
    same test must reject the sampler fed the unprocessed distribution (its power)."""
    V, N = 16, 40_000
    logits = torch.randn(V, generator=gen) * 2
    expected = reference_probs(logits.numpy(), row.temperature, row.top_k, row.top_p, row.min_p)
    torch.testing.assert_close(processed_probs(logits[None], [row])[0].double(),
                               torch.from_numpy(expected), rtol=1e-5, atol=1e-6)
    g = torch.Generator().manual_seed(int(torch.randint(1 << 30, (1,), generator=gen)))
    tokens = sample(logits.expand(N, V), [row] * N, [g] * N)
    counts = np.bincount(tokens, minlength=V)
    assert chi_square_p(counts, expected) > 1e-4
    if row != SamplingRow(1.0):
        plain = reference_probs(logits.numpy(), 1.0, -1, 1.0, 0.0)
        assert chi_square_p(counts, plain) < 1e-6, "the test cannot tell processing apart"


def test_draw_takes_one_uniform_per_row_and_never_a_zero_probability_token(monkeypatch):
    """Row i's token is the inverse CDF at the one uniform its generator gives next (so a
    request's tokens do not depend on its neighbours), and a token of probability 0 is never
    drawn, whatever the uniform (0 and just under 1 included)."""
    from pagedspec.engine.sampler import draw

    V = 5000
    probs = torch.zeros(4, V)
    probs[0, [3, 4000]] = torch.tensor([0.25, 0.75])
    probs[1, V - 2] = 1.0                      # the last token has probability 0
    probs[2] = torch.rand(V)
    probs[3, 0] = 1.0
    gens = [torch.Generator().manual_seed(s) for s in (1, 2, 3, 4)]
    twins = [torch.Generator().manual_seed(s) for s in (1, 2, 3, 4)]
    tokens = draw(probs, gens).tolist()
    for i, (g, twin) in enumerate(zip(gens, twins)):
        u = float(torch.rand(1, generator=twin))
        cdf = probs[i].double().cumsum(0)
        assert tokens[i] == int((cdf > u * cdf[-1]).nonzero()[0])
        assert torch.equal(g.get_state(), twin.get_state())      # exactly one uniform taken
    rand = torch.rand
    for u in (0.0, 1.0 - 2**-24):
        monkeypatch.setattr(torch, "rand", lambda *a, u=u, **k: torch.full((1,), u))
        picked = draw(probs[:2], gens[:2]).tolist()
        monkeypatch.setattr(torch, "rand", rand)
        assert picked == [3 if u == 0 else 4000, V - 2]


def test_llm_samples_the_processed_distribution_at_one_step(dirs):
    """Through the whole API: 3000 one-token completions of one prompt (n=3000 forks) against the
    processed distribution of transformers' logits for that prompt."""
    path = dirs["llama"]
    llm = LLM(path, dtype="float32", device="cpu", max_model_len=64, seed=5)
    params = SamplingParams(temperature=1.2, top_k=20, top_p=0.9, n=3000, max_tokens=1,
                            ignore_eos=True)
    out = llm.generate([PROMPTS[0]], params, use_tqdm=False)[0]
    tokens = [c.token_ids[0] for c in out.outputs]
    with torch.no_grad():
        logits = hf_model(path)(torch.tensor([out.prompt_token_ids])).logits[0, -1]
    expected = reference_probs(logits.numpy(), 1.2, 20, 0.9, 0.0)
    counts = np.bincount(tokens, minlength=expected.size)
    assert chi_square_p(counts, expected) > 1e-4
    assert chi_square_p(counts, reference_probs(logits.numpy(), 1.2, -1, 1.0, 0.0)) < 1e-6


# ---- stops, logprobs, the iterator -------------------------------------------------------------
def test_stop_strings_stop_tokens_and_eos(dirs, tmp_path):
    llm = LLM(dirs["llama"], dtype="float32", device="cpu", max_model_len=256)
    full = llm.generate(PROMPTS[0], SamplingParams(max_tokens=40, **GREEDY))[0].outputs[0]
    assert full.text == llm.tokenizer.decode(full.token_ids, skip_special_tokens=True)
    stop = full.text[len(full.text) // 2:len(full.text) // 2 + 2]
    cut = llm.generate(PROMPTS[0], SamplingParams(max_tokens=40, stop=[stop, "\x00never"],
                                                  **GREEDY))[0].outputs[0]
    assert cut.text == full.text[:full.text.index(stop)]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop
    assert full.token_ids[:len(cut.token_ids)] == cut.token_ids
    token = full.token_ids[10]
    first = full.token_ids.index(token)
    by_id = llm.generate(PROMPTS[0], SamplingParams(max_tokens=40, stop_token_ids=[token],
                                                    **GREEDY))[0].outputs[0]
    assert by_id.token_ids == full.token_ids[:first + 1]
    assert by_id.finish_reason == "stop" and by_id.stop_reason == token
    # The checkpoint's eos (generation_config.json) ends a completion unless ignore_eos.
    (dirs["llama"] / "generation_config.json").write_text(json.dumps({"eos_token_id": [token]}))
    try:
        eos_llm = LLM(dirs["llama"], dtype="float32", device="cpu", max_model_len=256)
        stopped = eos_llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=40))
        assert stopped[0].outputs[0].token_ids == full.token_ids[:first + 1]
        ignored = eos_llm.generate(PROMPTS[0], SamplingParams(max_tokens=40, **GREEDY))
        assert ignored[0].outputs[0].token_ids == full.token_ids
    finally:
        (dirs["llama"] / "generation_config.json").write_text(json.dumps({"eos_token_id": 2}))
    # max_model_len caps the completion.
    capped = LLM(dirs["llama"], dtype="float32", device="cpu", max_model_len=16)
    out = capped.generate(PROMPTS[0], SamplingParams(max_tokens=40, **GREEDY))[0]
    assert len(out.prompt_token_ids) + len(out.outputs[0].token_ids) == 16
    assert out.outputs[0].finish_reason == "length"


def test_logprobs_are_the_model_distribution(llm, dirs):
    out = llm.generate(PROMPTS[1], SamplingParams(max_tokens=6, logprobs=3, **GREEDY))[0]
    c = out.outputs[0]
    with torch.no_grad():
        ref = hf_model(dirs["llama"])(torch.tensor([out.prompt_token_ids + c.token_ids])
                                      ).logits[0].log_softmax(-1)
    n = len(out.prompt_token_ids)
    total = 0.0
    for i, (token, entry) in enumerate(zip(c.token_ids, c.logprobs)):
        row = ref[n - 1 + i]
        top = row.topk(3)
        assert list(entry)[:3] == top.indices.tolist()
        assert [e.rank for e in entry.values()][:3] == [1, 2, 3]
        for t, e in entry.items():
            assert abs(e.logprob - row[t].item()) < 1e-4
        assert entry[token].rank == 1            # greedy picks the most likely token
        total += entry[token].logprob
    assert abs(c.cumulative_logprob - total) < 1e-6


def test_generate_iter_and_metrics(llm):
    params = [SamplingParams(max_tokens=n, **GREEDY) for n in (20, 3, 9)]
    seen = [o.request_id for o in llm.generate_iter(PROMPTS[:3], params)]
    assert len(seen) == 3
    assert seen[0] == str(min(int(s) for s in seen) + 1), "the shortest request finishes first"
    it = llm.generate_iter(PROMPTS[:3], params)
    first = next(it)
    assert first.finished and first.metrics.time_to_first_token > 0
    it.close()                                   # abandoned: the others are freed
    assert not llm.scheduler.has_unfinished()
    assert llm.block_manager.num_free_blocks == llm.block_manager.num_blocks
    out = llm.generate(PROMPTS[0], SamplingParams(max_tokens=8, **GREEDY))[0]
    assert out.metrics.finished_time >= out.metrics.first_token_time > out.metrics.arrival_time
    assert out.time_per_output_token > 0


def test_token_id_prompts_and_no_tokenizer(dirs, tmp_path):
    llm = LLM(dirs["llama"], dtype="float32", device="cpu", max_model_len=64,
              skip_tokenizer_init=True)
    outs = llm.generate([[1, 5, 9], [1, 7]], SamplingParams(max_tokens=4, **GREEDY))
    assert [o.prompt for o in outs] == [None, None]
    assert all(len(o.outputs[0].token_ids) == 4 and o.outputs[0].text == "" for o in outs)
    with pytest.raises(ValueError, match="text prompts need a tokenizer"):
        llm.generate("hello")


def test_fp8_kv_cache_through_the_api(dirs):
    base = LLM(dirs["llama"], dtype="bfloat16", device="cpu", max_model_len=128)
    greedy = SamplingParams(max_tokens=12, **GREEDY)
    ref = base.generate(PROMPTS[:2], greedy)
    for kv_dtype, scales in (("fp8_e4m3", None), ("fp8_e5m2", (0.05, 0.05))):
        llm = LLM(dirs["llama"], dtype="bfloat16", device="cpu", max_model_len=128,
                  kv_cache_dtype=kv_dtype, kv_scales=scales)
        assert llm.kv_cache.key_caches[0].dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
        outs = llm.generate(PROMPTS[:2], greedy)
        # Greedy paths may part where two logits are within the FP8 error; the first tokens
        # (a short context, sharp logits) agree.
        assert [o.outputs[0].token_ids[:2] for o in outs] == \
               [o.outputs[0].token_ids[:2] for o in ref]
    assert float(llm.kv_cache.k_scales[0]) == pytest.approx(0.05)
    with pytest.raises(ValueError, match="kv_scales"):
        LLM(dirs["llama"], device="cpu", kv_cache_dtype="fp8_e4m3", kv_scales="bogus")
    with pytest.raises(ValueError, match="positive and finite"):
        LLM(dirs["llama"], device="cpu", kv_cache_dtype="fp8_e4m3", kv_scales=(0.0, 1.0))


# ---- bad input ----------------------------------------------------------------------------------
@pytest.mark.parametrize("params,message", [
    (dict(max_tokens=0), "max_tokens must be an int >= 1"),
    (dict(top_p=0.0), r"top_p must be in \(0, 1\]"),
    (dict(top_p=1.5), r"top_p must be in \(0, 1\]"),
    (dict(temperature=-0.1), "temperature must be a finite number >= 0"),
    (dict(n=0), "n must be an int >= 1"),
    (dict(top_k=0), "top_k must be -1"),
    (dict(min_p=2.0), r"min_p must be in \[0, 1\]"),
    (dict(logprobs=-1), "logprobs must be"),
    (dict(stop_token_ids=[10**6]), "stop_token_ids must be"),
    (dict(stop=[""]), "stop must be"),
])
def test_bad_sampling_params_fail_before_any_work(llm, params, message):
    good = SamplingParams(max_tokens=3, **GREEDY)
    with pytest.raises(ValueError, match=r"SamplingParams\." + message):
        llm.generate(PROMPTS[:3], [good, SamplingParams(**params), good])
    assert not llm.scheduler.has_unfinished()          # nothing was queued
    assert len(llm.generate(PROMPTS[:2], good)) == 2   # and the LLM still works


def test_bad_requests_and_engine_settings(llm, dirs):
    good = SamplingParams(max_tokens=3, **GREEDY)
    with pytest.raises(ValueError, match="prompt 1 has 300 tokens; max_model_len is 256"):
        llm.generate([[1, 2], [3] * 300], good)
    with pytest.raises(ValueError, match="prompt 0 is empty"):
        llm.generate([[]], good)
    with pytest.raises(ValueError, match=r"token-id prompt must hold ints in \[0, 320\)"):
        llm.generate([[1, 400]], good)
    with pytest.raises(ValueError, match="2 SamplingParams for 3 prompts"):
        llm.generate(PROMPTS[:3], [good, good])
    assert not llm.scheduler.has_unfinished()
    small = LLM(dirs["llama"], device="cpu", num_kv_blocks=2, block_size=8, max_model_len=256)
    with pytest.raises(ValueError, match="needs 43 KV slots .* holds 16"):
        small.generate([[1] * 3], SamplingParams(max_tokens=40))
    for kwargs, message in [(dict(dtype="int8"), "dtype must be"),
                            (dict(kv_cache_dtype="int4"), "kv_cache_dtype must be"),
                            (dict(block_size=12), "block_size must be"),
                            (dict(max_model_len=10**6), "max_model_len must be in"),
                            (dict(device="tpu"), "device must be"),
                            (dict(max_num_seqs=0), "max_num_seqs must be")]:
        with pytest.raises(ValueError, match=message):
            LLM(dirs["llama"], **kwargs)


def test_sliding_window_is_refused_unless_it_covers_the_context(tmp_path):
    path = make_checkpoint(tmp_path / "mistral-sw", "mistral", sliding_window=64,
                           max_position_embeddings=256)
    with pytest.raises(ValueError, match="sliding window of 64 tokens"):
        LLM(path, device="cpu")
    llm = LLM(path, device="cpu", max_model_len=64)   # the window covers every position
    assert len(llm.generate("def", SamplingParams(max_tokens=4))[0].outputs[0].token_ids) <= 4


@pytest.mark.cuda
def test_cuda_generation_matches_cpu_where_logits_are_clear(dirs):
    """The same bf16 model on both devices: greedy tokens agree while the top two logits are
    further apart than bf16's rounding (random-weight models have no near-ties early on)."""
    params = SamplingParams(max_tokens=8, **GREEDY)
    cpu = LLM(dirs["llama"], dtype="bfloat16", device="cpu", max_model_len=128)
    gpu = LLM(dirs["llama"], dtype="bfloat16", device="cuda", max_model_len=128)
    a, b = cpu.generate(PROMPTS, params), gpu.generate(PROMPTS, params)
    assert [o.outputs[0].token_ids[:3] for o in a] == [o.outputs[0].token_ids[:3] for o in b]
    with pytest.raises(ValueError, match="float32 is not supported on CUDA"):
        LLM(dirs["llama"], dtype="float32", device="cuda")
    sampled = gpu.generate(PROMPTS[:2], SamplingParams(temperature=1.0, seed=3, max_tokens=8,
                                                       n=2, logprobs=2, ignore_eos=True))
    assert all(len(c.token_ids) == 8 for o in sampled for c in o.outputs)
