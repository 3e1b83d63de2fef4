"""The engine API (``Engine``: add_request / abort / step / has_unfinished; ``AsyncEngine``):
requests driven one step at a time, aborted at every stage (waiting, prefilling, decoding,
drafting, swapped) with the block manager's invariants checked after every step, the three
output kinds, stop strings that are never half-sent, seeding independent of request ids, the
step statistics, and the async driver: concurrent streams equal to the offline ``LLM``, a
cancelled consumer freeing its blocks while the others continue, bad input refused at once."""
from __future__ import annotations

import asyncio
import random
import threading

import pytest

from checkpoints import make_checkpoint
from pagedspec import LLM, EngineConfig, RequestOutputKind, SamplingParams
from pagedspec.engine import async_engine
from pagedspec.engine import (AsyncEngine, Engine, EngineOverloadedError, SequenceStatus)

pytestmark = pytest.mark.usefixtures("one_thread")

GREEDY = dict(temperature=0.0, ignore_eos=True)
PROMPTS = ["def fibonacci(n):", "import os, sys", "class Stack:\n    def push(self, item):",
           "print(", "    return a"]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("engine") / "llama", "llama", seed=4,
                           num_attention_heads=4, num_key_value_heads=2)


def make_engine(ckpt, **kwargs) -> Engine:
    kwargs = {"dtype": "float32", "device": "cpu", "max_model_len": 256, **kwargs}
    return Engine(EngineConfig(model=str(ckpt), **kwargs))


def run_to_end(engine: Engine, check=None, limit: int = 2000) -> dict:
    """Steps until nothing is left (bounded); the final output per request id."""
    finals = {}
    for _ in range(limit):
        if not engine.has_unfinished():
            return finals
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
        if check is not None:
            check()
    raise AssertionError(f"the engine did not finish within {limit} steps")


def idle(engine: Engine) -> None:
    bm = engine.core.block_manager
    bm.check_invariants()
    assert bm.num_free_blocks == bm.num_blocks and not bm.tables
    assert not engine.has_unfinished() and not engine.output_processor.requests
    assert not engine.core.kv_budgets.policies


def test_engine_steps_equal_the_offline_llm(ckpt):
    params = SamplingParams(max_tokens=20, **GREEDY)
    expected = LLM(ckpt, dtype="float32", device="cpu", max_model_len=256).generate(
        PROMPTS, params, use_tqdm=False)
    engine = make_engine(ckpt)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"user-{i}", prompt, params)
    finals = run_to_end(engine, engine.core.block_manager.check_invariants)
    assert [finals[f"user-{i}"].outputs[0].token_ids for i in range(len(PROMPTS))] == \
           [o.outputs[0].token_ids for o in expected]
    assert [finals[f"user-{i}"].outputs[0].text for i in range(len(PROMPTS))] == \
           [o.outputs[0].text for o in expected]
    idle(engine)


@pytest.mark.parametrize("stage", ["waiting", "prefilling", "decoding", "drafting", "swapped"])
def test_abort_at_every_stage_frees_everything(ckpt, stage):
    rng = random.Random(stage)
    extra = {}
    if stage == "drafting":
        extra = dict(speculative_model="ngram", num_speculative_tokens=3,
                     speculative_adaptive=False)
    if stage == "swapped":
        # Room for about two sequences: the newest is preempted (swapped) when they grow.
        extra = dict(num_kv_blocks=16, swap_space=0.01, preemption_mode="swap",
                     block_size=8, max_num_seqs=3)
    if stage == "prefilling":
        extra = dict(max_num_batched_tokens=20, max_num_seqs=4)
    if stage == "waiting":
        extra = dict(max_num_seqs=1)
    engine = make_engine(ckpt, **extra)
    long_prompt = [rng.randrange(3, 300) for _ in range(60)]
    prompts = [long_prompt, [5, 6, 7] * 5, [9, 10, 11, 12] * 4]
    params = SamplingParams(max_tokens=40, **GREEDY)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    core = engine.core
    victim = None

    def find_victim():
        for request in core.requests.values():
            seq = request.seqs[0]
            if stage == "waiting" and seq.status is SequenceStatus.WAITING:
                return request.request_id
            if stage == "swapped" and seq.status is SequenceStatus.SWAPPED:
                return request.request_id
            if stage == "prefilling" and seq.status is SequenceStatus.RUNNING \
                    and 0 < seq.num_computed_tokens < seq.num_prompt_tokens:
                return request.request_id
            if stage == "decoding" and seq.status is SequenceStatus.RUNNING \
                    and len(seq.output_token_ids) >= 2:
                return request.request_id
            if stage == "drafting" and seq.status is SequenceStatus.RUNNING \
                    and core.speculator.stats.num_draft_tokens > 0 and seq.output_token_ids:
                return request.request_id
        return None

    for _ in range(200):
        victim = find_victim()
        if victim is not None:
            break
        engine.step()
        core.block_manager.check_invariants()
    assert victim is not None, f"no request reached the {stage} stage"
    others = [r for r in core.requests if r != victim]
    engine.abort([victim, "no-such-request"])
    core.block_manager.check_invariants()
    assert victim not in core.requests
    finals = run_to_end(engine, core.block_manager.check_invariants)
    assert victim not in finals and set(others) <= set(finals)
    assert all(len(finals[r].outputs[0].token_ids) == 40 for r in others)
    idle(engine)
    reasons = [f.finish_reason for f in engine.stats().finished]
    assert "abort" not in reasons        # counted in the step after the abort, not again


def test_aborted_requests_are_counted_once(ckpt):
    engine = make_engine(ckpt)
    engine.add_request("a", [5, 6, 7], SamplingParams(max_tokens=30, **GREEDY))
    engine.add_request("b", [8, 9], SamplingParams(max_tokens=3, **GREEDY))
    engine.step()
    engine.abort(["a"])
    reasons = []
    while engine.has_unfinished():
        engine.step()
        reasons += [f.finish_reason for f in engine.stats().finished]
    engine.step()                       # idle: nothing more to report
    reasons += [f.finish_reason for f in engine.stats().finished]
    assert sorted(reasons) == ["abort", "length"]


def test_output_kinds(ckpt):
    engine = make_engine(ckpt)
    base = dict(max_tokens=24, n=2, temperature=0.8, seed=11, ignore_eos=True, logprobs=2)
    for kind in RequestOutputKind:
        engine.add_request(kind.name, "def fibonacci(n):",
                           SamplingParams(**base, output_kind=kind))
    seen = {kind.name: [] for kind in RequestOutputKind}
    while engine.has_unfinished():
        for out in engine.step():
            seen[out.request_id].append(out)
    final = seen["FINAL_ONLY"]
    assert len(final) == 1 and final[0].finished
    cumulative = seen["CUMULATIVE"]
    assert len(cumulative) > 2 and cumulative[-1].finished
    assert not any(o.finished for o in cumulative[:-1])
    # The same seed: the three requests sampled the same completions.
    for index in range(2):
        deltas = [c for o in seen["DELTA"] for c in o.outputs if c.index == index]
        whole = final[0].outputs[index]
        assert "".join(c.text for c in deltas) == whole.text
        assert sum((c.token_ids for c in deltas), []) == whole.token_ids
        assert sum((c.logprobs for c in deltas), []) == whole.logprobs
        assert cumulative[-1].outputs[index].token_ids == whole.token_ids
        assert deltas[-1].finish_reason == "length"
        # Cumulative outputs only ever grow.
        texts = [o.outputs[index].text for o in cumulative if len(o.outputs) > index]
        assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))
    assert len(final[0].outputs[0].logprobs) == 24


def test_stop_strings_are_never_half_sent(ckpt):
    """A stop string of several characters whose tokens arrive one by one: no delta ever
    carries a prefix of it, and the final text ends right before it."""
    engine = make_engine(ckpt)
    plain = LLM(ckpt, dtype="float32", device="cpu", max_model_len=256).generate(
        "def fibonacci(n):", SamplingParams(max_tokens=40, **GREEDY), use_tqdm=False)
    text = plain[0].outputs[0].text
    assert len(text) > 20
    stop = text[12:17]                       # five characters from the middle of the text
    first = text.find(stop)
    engine.add_request("s", "def fibonacci(n):", SamplingParams(
        max_tokens=40, stop=[stop, "never-seen-stop"], output_kind=RequestOutputKind.DELTA,
        **GREEDY))
    deltas = []
    while engine.has_unfinished():
        for out in engine.step():
            deltas.append(out.outputs[0])
    sent = ""
    for d in deltas:
        sent += d.text
        assert stop not in sent
        if not d.finish_reason:
            # What has been sent is never past the start of the stop string.
            assert len(sent) <= first
    assert sent == text[:first]
    assert deltas[-1].finish_reason == "stop" and deltas[-1].stop_reason == stop
    idle(engine)


def test_seeding_does_not_depend_on_request_ids(ckpt):
    """Unseeded sampled requests draw from generators derived from the engine's seed and their
    arrival order, whatever their ids are (ids are the caller's strings)."""
    params = SamplingParams(max_tokens=12, temperature=1.0, ignore_eos=True)
    outs = []
    for ids in (["a", "b"], ["zzz-1", "7"]):
        engine = make_engine(ckpt, seed=5)
        for request_id, prompt in zip(ids, PROMPTS):
            engine.add_request(request_id, prompt, params)
        finals = run_to_end(engine)
        outs.append([finals[i].outputs[0].token_ids for i in ids])
    assert outs[0] == outs[1]
    engine = make_engine(ckpt, seed=6)
    engine.add_request("a", PROMPTS[0], params)
    assert run_to_end(engine)["a"].outputs[0].token_ids != outs[0][0]


def test_bad_requests_are_refused_and_nothing_is_queued(ckpt):
    engine = make_engine(ckpt, max_model_len=64)
    good = SamplingParams(max_tokens=4, **GREEDY)
    engine.add_request("ok", [5, 6], good)
    for request_id, prompt, params, message in [
        ("ok", [1], good, "already in use"),
        ("x", [1], SamplingParams(top_p=2.0), r"SamplingParams\.top_p must be in \(0, 1\]"),
        ("x", [1], SamplingParams(max_tokens=True), r"SamplingParams\.max_tokens"),
        ("x", [1], SamplingParams(n=0), r"SamplingParams\.n must be"),
        ("x", [1], SamplingParams(stop=5), r"SamplingParams\.stop must be"),
        ("x", [1], SamplingParams(seed=2 ** 64), r"SamplingParams\.seed must be"),
        ("x", [1] * 80, good, "prompt has 80 tokens; max_model_len is 64"),
        ("x", [], good, "prompt is empty"),
        ("x", [1, 10 ** 6], good, r"token-id prompt must hold ints in \[0, 320\)"),
        ("x", 3.5, good, "prompt must be a string or a list of token ids"),
        ("x", [1], "greedy", "expected SamplingParams"),
    ]:
        with pytest.raises(ValueError, match=message):
            engine.add_request(request_id, prompt, params)
    assert list(engine.core.requests) == ["ok"]
    assert len(run_to_end(engine)["ok"].outputs[0].token_ids) == 4
    idle(engine)


def test_step_statistics(ckpt):
    engine = make_engine(ckpt, speculative_model="ngram", num_speculative_tokens=2,
                         speculative_adaptive=False)
    prompt = [5, 6, 7, 8] * 6
    engine.add_request("a", prompt, SamplingParams(max_tokens=10, **GREEDY))
    engine.add_request("b", prompt[:10], SamplingParams(max_tokens=6, **GREEDY))
    prompt_tokens = generated = drafts = accepted = 0
    ttfts, finished = [], []
    while engine.has_unfinished():
        engine.step()
        s = engine.stats()
        prompt_tokens += s.num_prompt_tokens
        generated += s.num_generation_tokens
        ttfts += s.time_to_first_tokens
        finished += s.finished
        drafts += s.spec.num_draft_tokens
        accepted += s.spec.num_accepted_tokens
        assert sum(s.spec.num_accepted_tokens_per_pos) == s.spec.num_accepted_tokens
        assert 0 <= s.kv_cache_usage <= 1
    # The second prompt is a prefix of the first: its full blocks may come from the cache.
    assert len(prompt) <= prompt_tokens <= len(prompt) + 10
    assert generated == 16 and len(ttfts) == 2 and drafts > 0 and accepted <= drafts
    assert sorted(f.num_generation_tokens for f in finished) == [6, 10]
    assert all(f.finish_reason == "length" and f.e2e_latency >= f.queue_time >= 0
               for f in finished)
    assert engine.stats().num_running == engine.stats().num_waiting == 0


# ---- the async driver ---------------------------------------------------------------------
def test_async_streams_equal_the_offline_llm_and_a_cancelled_one_frees_its_blocks(ckpt):
    params = SamplingParams(max_tokens=16, output_kind=RequestOutputKind.DELTA, **GREEDY)
    expected = LLM(ckpt, dtype="float32", device="cpu", max_model_len=256).generate(
        PROMPTS, SamplingParams(max_tokens=16, **GREEDY), use_tqdm=False)
    engine = AsyncEngine(EngineConfig(model=str(ckpt), dtype="float32", device="cpu",
                                      max_model_len=256))
    bm = engine.engine.core.block_manager

    async def consume(i: int, prompt: str) -> tuple[str, list[int]]:
        text, tokens = "", []
        async for out in engine.generate(f"r{i}", prompt, params):
            text += out.outputs[0].text
            tokens += out.outputs[0].token_ids
        return text, tokens

    async def cancelled() -> None:
        long = SamplingParams(max_tokens=200, output_kind=RequestOutputKind.DELTA, **GREEDY)
        async for out in engine.generate("victim", "def fibonacci(n):", long):
            if len(out.outputs[0].token_ids) and bm.num_free_blocks < bm.num_blocks:
                raise asyncio.CancelledError      # as a disconnected client's task is

    async def main():
        victim = asyncio.ensure_future(cancelled())
        results = await asyncio.gather(*(consume(i, p) for i, p in enumerate(PROMPTS)))
        with pytest.raises(asyncio.CancelledError):
            await victim
        for _ in range(200):                       # the abort lands before the next step
            if bm.num_free_blocks == bm.num_blocks and engine.num_unfinished() == 0:
                break
            await asyncio.sleep(0.01)
        return results

    try:
        results = asyncio.run(main())
        assert results == [(o.outputs[0].text, o.outputs[0].token_ids) for o in expected]
        assert bm.num_free_blocks == bm.num_blocks and not engine.engine.has_unfinished()
        bm.check_invariants()
    finally:
        engine.shutdown()


def test_async_builds_and_steps_the_engine_on_one_thread(ckpt, monkeypatch):
    """All of the model's torch work runs on the driver thread (one OpenMP pool: see the
    module's docstring); a configuration that fails to build raises from the constructor."""
    threads = []

    class Recorded(Engine):
        def __init__(self, config):
            threads.append(("build", threading.current_thread()))
            super().__init__(config)

        def step(self):
            threads.append(("step", threading.current_thread()))
            return super().step()

    monkeypatch.setattr(async_engine, "Engine", Recorded)
    engine = AsyncEngine(EngineConfig(model=str(ckpt), dtype="float32", device="cpu",
                                      max_model_len=64))

    async def main():
        return [o async for o in engine.generate("a", [5, 6], SamplingParams(
            max_tokens=3, **GREEDY))]

    try:
        assert len(asyncio.run(main())[-1].outputs[0].token_ids) == 3
    finally:
        engine.shutdown()
    assert {kind for kind, _ in threads} == {"build", "step"}
    assert {t for _, t in threads} == {engine._thread} != {threading.main_thread()}
    with pytest.raises(ValueError, match="max_model_len"):
        AsyncEngine(EngineConfig(model=str(ckpt), dtype="float32", device="cpu",
                                 max_model_len=10 ** 9))


def test_async_refuses_bad_input_and_overload_at_once(ckpt):
    engine = AsyncEngine(EngineConfig(model=str(ckpt), dtype="float32", device="cpu",
                                      max_model_len=64, max_num_seqs=2), max_waiting=1)
    good = SamplingParams(max_tokens=30, **GREEDY)

    async def main():
        with pytest.raises(ValueError, match=r"SamplingParams\.temperature"):
            engine.add_request("bad", [1, 2], SamplingParams(temperature=-1))
        streams = [engine.add_request(f"g{i}", [5 + i, 6], good) for i in range(3)]
        with pytest.raises(EngineOverloadedError, match="max-waiting"):
            engine.add_request("flood", [1, 2], good)
        with pytest.raises(ValueError, match="already in use"):
            engine.add_request("g0", [1, 2], good)
        lengths = []
        for stream in streams:
            outs = [o async for o in stream]
            lengths.append(len(outs[-1].outputs[0].token_ids))
        return lengths

    try:
        assert asyncio.run(main()) == [30, 30, 30]
    finally:
        engine.shutdown()
