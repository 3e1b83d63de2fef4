"""KV eviction (streaming, h2o, random) through the LLM API: budgets, sinks and recent windows
hold after every step over thousands of random steps (with preemption and with a draft model),
blocks never leak, a budget that is never reached changes nothing, H2O keeps exactly the blocks
an independent dense reference keeps, and bad budgets are refused at admission."""
from __future__ import annotations

import itertools
import random

import pytest
import torch

from checkpoints import make_checkpoint
from pagedspec import LLM, SamplingParams
from pagedspec.engine.kv_eviction import MASS_SCALE, KVEvictionPolicy

pytestmark = pytest.mark.usefixtures("one_thread")

BS = 8
GREEDY = dict(temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("evict")
    target = make_checkpoint(root / "target", "llama", seed=5, num_attention_heads=4,
                             num_key_value_heads=2, num_hidden_layers=2)
    draft = make_checkpoint(root / "draft", "llama", seed=6, num_attention_heads=2,
                            num_key_value_heads=1, num_hidden_layers=1)
    return {"target": target, "draft": draft}


def make_llm(models, **kwargs):
    return LLM(models["target"], dtype="float32", device="cpu", max_model_len=256,
               block_size=BS, **kwargs)


def generate_stepwise(llm, prompts, params, after_step):
    """``llm.generate`` through the engine's public API, calling ``after_step()`` after every
    step (eviction is the step's last act, so it sees every eviction's result); outputs in
    prompt order."""
    engine = llm.engine
    params = params if isinstance(params, list) else [params] * len(prompts)
    ids = [f"req-{next(REQUEST_IDS)}" for _ in prompts]
    for request_id, prompt, p in zip(ids, prompts, params):
        engine.add_request(request_id, prompt, p)
    finals = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
        after_step()
    return [finals[i] for i in ids]


REQUEST_IDS = itertools.count()


def check_budgets(llm, log):
    """After a step: every running sequence with a policy holds at most its budget, and its
    sinks and recent window are all still in its table."""
    bm = llm.block_manager
    for seq in llm.scheduler.running:
        policy = llm.kv_budgets.policies.get(seq.seq_id)
        if policy is None or seq.seq_id not in bm.tables or bm.tables[seq.seq_id].on_cpu:
            continue
        table = bm.tables[seq.seq_id]
        length = table.num_tokens + table.num_evicted
        sinks = range(min(-(-policy.sink_tokens // BS), -(-length // BS)))
        recent = range(max(0, length - policy.window(BS)) // BS, -(-length // BS))
        assert set(sinks) | set(recent) <= set(table.logical), (seq.seq_id, table.logical)
        if llm.speculator is None:
            assert table.num_tokens <= policy.budget, (table.num_tokens, policy.budget)
        log.append(table.num_evicted)


@pytest.mark.parametrize("mode", ["streaming", "h2o", "random"])
@pytest.mark.parametrize("speculative", [False, True])
def test_random_steps_keep_budgets_and_leak_no_block(models, mode, speculative):
    rng = random.Random(f"{mode}{speculative}")
    spec = dict(speculative_model=models["draft"], num_speculative_tokens=3) if speculative \
        else {}
    llm = make_llm(models, kv_eviction=mode, kv_budget=48, kv_sink_tokens=4,
                   num_kv_blocks=24, swap_space=0.002, max_num_seqs=5,
                   max_num_batched_tokens=96, **spec)
    log = []
    while llm.runner.num_steps < (500 if speculative else 1500):
        n = rng.randint(1, 6)
        prompts = [[rng.randrange(3, 120) for _ in range(rng.randint(1, 90))] for _ in range(n)]
        params = [SamplingParams(temperature=rng.choice([0, 1.0]), max_tokens=rng.randint(1, 120),
                                 n=rng.choice([1, 1, 2]), seed=rng.choice([None, 3]),
                                 ignore_eos=True,
                                 kv_budget=rng.choice([None, 32, 64]))
                  for _ in prompts]
        outs = generate_stepwise(llm, prompts, params, lambda: check_budgets(llm, log))
        assert all(len(c.token_ids) == p.max_tokens for o, p in zip(outs, params)
                   for c in o.outputs)
        llm.block_manager.check_invariants()
        assert llm.block_manager.num_free_blocks == llm.block_manager.num_blocks
        assert not llm.kv_budgets.policies
    assert max(log) > 0, "the budgets made sequences evict"
    assert llm.scheduler.num_preemptions > 0


def test_unreached_budget_changes_nothing(models):
    prompts = [[5 + i for i in range(40)], [9, 8, 7, 6] * 5, [3] * 60]
    params = SamplingParams(max_tokens=40, **GREEDY)
    plain = make_llm(models).generate(prompts, params, use_tqdm=False)
    for mode in ("streaming", "h2o", "random"):
        # The longest sequence is 100 tokens: a 104-token budget (13 blocks) never evicts.
        llm = make_llm(models, kv_eviction=mode, kv_budget=104)
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain]
        assert llm.kv_budgets.num_evicted_blocks == 0


def test_streaming_keeps_sinks_and_the_window(models):
    llm = make_llm(models, kv_eviction="streaming", kv_budget=40, kv_sink_tokens=8)
    seen = []
    generate_stepwise(llm, [[4] * 30], SamplingParams(max_tokens=60, **GREEDY), lambda: seen.append(
        [list(llm.block_manager.tables[s.seq_id].logical) for s in llm.scheduler.running]))
    # 90 tokens at the end, 40 kept: the sink block (0) and the newest blocks.
    last = [t for t in seen if t][-1][0]
    assert last[0] == 0 and last[1:] == list(range(last[1], last[1] + len(last) - 1))
    assert len(last) * BS - (BS - 89 % BS - 1) <= 40


@pytest.mark.parametrize("budget, recent", [(40, 16), (56, None)])
def test_h2o_keeps_what_dense_attention_says(models, budget, recent):
    """The engine's H2O against an independent dense implementation: every layer's K/V kept per
    position, attention probabilities computed explicitly over the kept positions, their sum
    over heads, layers and query tokens accumulated per block as round(mass * 256), and the same
    rule (sinks and recent window protected, the lowest score evicted, the older block on a
    tie). Both must keep the same blocks after every step and emit the same greedy tokens."""
    prompt = [(7 * i) % 50 + 3 for i in range(45)]
    max_tokens = 70
    llm = make_llm(models, kv_eviction="h2o", kv_budget=budget, kv_sink_tokens=4,
                   kv_recent_tokens=recent)
    engine_kept = []

    def record():
        running = llm.scheduler.running    # the last step finishes the request first
        if running:
            engine_kept.append(list(llm.block_manager.tables[running[0].seq_id].logical))
    out = generate_stepwise(llm, [prompt], SamplingParams(max_tokens=max_tokens, **GREEDY),
                            record)[0].outputs[0].token_ids
    policy = KVEvictionPolicy("h2o", budget, 4, recent)
    ref_tokens, ref_kept = dense_h2o(llm.model, prompt, max_tokens, policy)
    assert out == ref_tokens
    # The engine's last step finishes the request before its eviction runs.
    assert engine_kept[:len(ref_kept) - 1] == ref_kept[:len(engine_kept)]
    assert any(len(k) * BS < len(prompt) + max_tokens - BS for k in ref_kept), "evicted"


def dense_h2o(model, prompt, max_tokens, policy):
    """Greedy generation with H2O over dense per-position K/V (float64 mass)."""
    num_layers = model.num_layers
    keys = [dict() for _ in range(num_layers)]     # layer -> position -> [Hkv, D]
    values = [dict() for _ in range(num_layers)]
    kept: list[int] = []                           # logical blocks in the cache
    scores: dict[int, int] = {}
    tokens, out, kept_log = list(prompt), [], []

    def step(positions):
        mass = {}

        def attend(layer, q, k, v):
            for i, p in enumerate(positions):
                keys[layer][p], values[layer][p] = k[i], v[i]
            visible_base = [p for b in kept for p in range(b * BS, (b + 1) * BS)
                            if p < positions[0]]
            rows = []
            for i, p in enumerate(positions):
                vis = visible_base + positions[:i + 1]
                kk = torch.stack([keys[layer][x] for x in vis])      # [S, Hkv, D]
                vv = torch.stack([values[layer][x] for x in vis])
                g = q.shape[1] // kk.shape[1]
                kk, vv = kk.repeat_interleave(g, 1), vv.repeat_interleave(g, 1)
                probs = torch.softmax(torch.einsum("hd,shd->hs", q[i], kk) * model.scale, -1)
                rows.append(torch.einsum("hs,shd->hd", probs, vv))
                for x, m in zip(vis, probs.double().sum(0).tolist()):
                    mass[x] = mass.get(x, 0.0) + m
            return torch.stack(rows)

        with torch.no_grad():
            hidden = model.forward(torch.tensor([tokens[p] for p in positions]),
                                   torch.tensor(positions), attend)
            logits = model.compute_logits(hidden[-1:])
        for b in {x // BS for x in mass}:
            block_mass = sum(m for x, m in mass.items() if x // BS == b)
            scores[b] = scores.get(b, 0) + int(round(block_mass * MASS_SCALE))
        return int(logits.argmax())

    def evict(computed):
        length = computed
        total = sum(min(BS, length - b * BS) for b in kept)   # cache tokens
        sinks, _ = policy.protected_blocks(BS)
        recent_start = max(0, length - policy.window(BS)) // BS
        if total <= policy.budget:
            return
        excess = -(-(total - policy.budget) // BS)
        candidates = [b for b in kept if sinks <= b < min(recent_start, computed // BS)]
        for b in sorted(candidates, key=lambda b: (scores.get(b, 0), b))[:excess]:
            kept.remove(b)

    positions = list(range(len(prompt)))
    for _ in range(max_tokens):
        for b in {p // BS for p in positions}:
            if b not in kept:
                kept.append(b)
        kept.sort()
        token = step(positions)
        out.append(token)
        tokens.append(token)
        evict(positions[-1] + 1)
        kept_log.append(list(kept))
        positions = [len(tokens) - 1]
    return out, kept_log


@pytest.mark.parametrize("kwargs, match", [
    (dict(kv_eviction="h2o", kv_budget=16), "kv_budget .16 tokens. must hold"),
    (dict(kv_eviction="streaming"), "kv_budget must be a positive"),
    (dict(kv_eviction="lru", kv_budget=64), "kv_eviction must be one of"),
    (dict(kv_eviction="h2o", kv_budget=64, kv_recent_tokens=60), "must hold the 4 sink"),
])
def test_bad_budgets_are_refused(models, kwargs, match):
    with pytest.raises(ValueError, match=match):
        make_llm(models, **kwargs)


def test_a_request_budget_too_small_is_refused_at_admission(models):
    llm = make_llm(models, kv_eviction="h2o", kv_budget=64)
    good = SamplingParams(max_tokens=4, **GREEDY)
    bad = SamplingParams(max_tokens=4, kv_budget=20, **GREEDY)
    with pytest.raises(ValueError, match="request 1's kv_budget .20 tokens. must hold"):
        llm.generate([[5] * 10, [6] * 10], [good, bad], use_tqdm=False)
    # Nothing was queued: the next call runs alone.
    assert len(llm.generate([[5] * 10], good, use_tqdm=False)) == 1


def test_eviction_benchmark_runs(models, tmp_path):
    """The evaluation (pagedspec.bench.eviction) end to end on a tiny model: a row per policy
    and budget, budgets respected, the 100% budget equal to the full cache, and the full cache's
    perplexity equal to transformers' teacher-forced perplexity of the same windows (so every
    chunk row and decode row scores the token after its own position)."""
    import math

    import transformers

    from pagedspec.bench import eviction

    text = tmp_path / "code.py"
    text.write_text("".join(f"def f{i}(x):\n    return x * {i} + {i % 7}\n\n" for i in range(900)))
    context = 448       # + 32 decoded tokens: within the tiny model's 512 positions
    report = eviction.run(models["target"], torch.device("cpu"), context=context, docs=2,
                          texts=[text], prompts=2)
    rows = report["rows"]
    assert {(r["policy"], r["budget"]) for r in rows} >= {("none", None), ("h2o", 96)}
    full = rows[0]
    for r in rows:
        assert r["retrieval_prompts"] == 2 and 0 <= r["retrieved"] <= 2
        assert sum(r["retrieved_by_depth"]) == r["retrieved"]
    for r in rows[1:]:
        assert r["peak_kv_tokens"] <= r["budget"]
        if r["budget"] >= context + eviction.DECODE:
            assert r["perplexity"] == pytest.approx(full["perplexity"], rel=1e-6)
            assert r["evicted_blocks"] == 0
        else:
            assert r["evicted_blocks"] > 0 and r["kv_share"] < 1
    assert "| h2o | 96 |" in eviction.markdown_table(report)

    from pagedspec.models.loader import load_checkpoint
    tokenizer = load_checkpoint(models["target"]).load_tokenizer()
    windows = eviction.held_out_windows(tokenizer, context, 2, text.read_text())
    hf = transformers.AutoModelForCausalLM.from_pretrained(models["target"],
                                                           dtype=torch.float32).eval()
    with torch.no_grad():
        ids = torch.tensor(windows)
        logprobs = torch.log_softmax(hf(ids).logits.float(), dim=-1)
    nll = -logprobs[:, :-1].gather(-1, ids[:, 1:, None]).mean()
    # float32 end to end over ~1k scored tokens: the mean NLL agrees to ~1e-5 relative.
    assert full["perplexity"] == pytest.approx(math.exp(float(nll)), rel=1e-4)


def test_retrieval_prompts_place_the_facts(models):
    """Each retrieval prompt is ``context`` tokens with its four facts in depth order and a
    question about the fact at depth ``i % 4``, whose code the prompt states once."""
    from pagedspec.bench import eviction
    from pagedspec.models.loader import load_checkpoint

    tokenizer = load_checkpoint(models["target"]).load_tokenizer()
    text = "".join(f"Line {i}: the quick brown fox jumps over the lazy dog.\n" for i in range(800))
    prompts = eviction.retrieval_prompts(tokenizer, 768, 8, text, seed=3)
    assert [p.depth for p in prompts] == [0, 1, 2, 3] * 2
    for p in prompts:
        assert len(p.token_ids) == 768
        decoded = tokenizer.decode(p.token_ids)
        assert decoded.count(p.code) == 1
        found = decoded.index(f"is {p.code}.")
        starts = [i for i in range(len(decoded)) if decoded.startswith("The access code", i)]
        assert len(starts) == eviction.FACTS + 1            # four facts and the question
        assert starts[p.depth] < found < starts[p.depth + 1]
        vault = decoded[starts[p.depth]:found].split("the ")[1].split(" vault")[0]
        assert decoded.rstrip().endswith(f"the {vault} vault is")
