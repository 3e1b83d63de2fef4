"""The compiled forward (EngineConfig.compile / LLM(compile=True)): the same greedy tokens and
logits within float rounding as eager mode, through prefill chunks, mixed batches, speculative
verification with a draft model, FP8 KV and preemption, and a bounded number of graphs across a
run of mixed batch sizes (no recompilation per step after warm-up)."""
from __future__ import annotations

import pytest
import torch

from checkpoints import make_checkpoint
from pagedspec import LLM, SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")

GREEDY = dict(temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("compile")
    return (make_checkpoint(root / "target", "llama", seed=7, num_attention_heads=4,
                            num_key_value_heads=2),
            make_checkpoint(root / "draft", "llama", seed=8, num_attention_heads=2,
                            num_key_value_heads=1, num_hidden_layers=1))


def graphs() -> int:
    return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])


@pytest.mark.parametrize("case", ["plain", "fp8", "draft", "preempt"])
def test_compiled_equals_eager(pair, case):
    target, draft = pair
    kwargs = dict(dtype="float32", device="cpu", max_model_len=256, block_size=8,
                  max_num_batched_tokens=64, max_num_seqs=8)   # prompts prefill in chunks
    if case == "fp8":
        kwargs.update(kv_cache_dtype="fp8_e4m3", kv_scales=(0.5, 0.5))
    if case == "draft":
        kwargs.update(speculative_model=str(draft), num_speculative_tokens=3,
                      speculative_adaptive=False)
    if case == "preempt":
        kwargs.update(num_kv_blocks=20, max_num_seqs=4)
    prompts = [[(5 * i + 3 * j) % 300 + 3 for j in range(10 + 17 * i)] for i in range(5)]
    params = [SamplingParams(max_tokens=12 + 5 * i, **GREEDY) for i in range(5)]
    eager = LLM(target, **kwargs)
    expected = eager.generate(prompts, params, use_tqdm=False)
    torch._dynamo.reset()
    llm = LLM(target, compile=True, **kwargs)
    assert llm.runner.compiled
    assert llm.runner.prepacked == torch.backends.mkldnn.is_available()  # packed, compiled
    got = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in expected]
    if case == "preempt":
        assert llm.scheduler.num_preemptions > 0
    # A step's logits: the same within float32 rounding (a fused kernel sums in another order).
    batch = [[9, 8, 7, 6, 5, 4], [3, 4, 5]]
    logits = []
    for engine in (eager, llm):
        runner = engine.runner
        captured = []
        execute = runner.execute
        runner.execute = lambda b, **kw: captured.append(execute(b, **kw)) or captured[-1]
        engine.generate(batch, SamplingParams(max_tokens=3, **GREEDY), use_tqdm=False)
        runner.execute = execute
        logits.append(torch.cat(captured))
    torch.testing.assert_close(logits[1], logits[0], rtol=1e-4, atol=1e-4)


def test_mixed_batch_sizes_do_not_recompile_after_warm_up(pair):
    """Graphs are per kind of step (decode, verification, prefill; one sequence or several),
    not per size: a second run of the same mixed batches, and sizes never seen, add none."""
    target, _ = pair
    torch._dynamo.reset()
    base = graphs()                  # the counter runs over the whole process
    llm = LLM(target, dtype="float32", device="cpu", max_model_len=256, compile=True,
              max_num_batched_tokens=96, max_num_seqs=8)

    def run(sizes, offset=0):
        for n in sizes:
            prompts = [[(7 * i + j) % 300 + 3 for j in range(5 + 11 * i + offset)]
                       for i in range(n)]
            llm.generate(prompts, SamplingParams(max_tokens=6 + offset, **GREEDY),
                         use_tqdm=False)

    # Kinds of step: one sequence or several, times decode / verification-sized / prefill
    # (max_q_len is bucketed to 1, 17 or the model's length): six graphs at most.
    run([1, 3, 5])
    run([2, 7, 4, 6, 1, 8], offset=3)
    seen = graphs() - base
    assert seen <= 6, seen
    run([1, 3, 5])
    run([2, 7, 4, 6, 1, 8], offset=3)
    assert graphs() - base == seen, "the same batches again compiled a new graph"
    run([8, 5, 2, 6], offset=9)
    assert graphs() - base <= 6, "new sizes compiled more than the six kinds of step"


@pytest.mark.parametrize("spec", ["draft", "ngram"])
def test_warm_up_compiles_every_kind_of_step_and_then_forgets_its_requests(pair, spec):
    """After Engine.warm_up, a run of mixed batches with speculation compiles nothing new; the
    warm-up leaves no trace in seeding, speculation statistics or the controller."""
    from pagedspec import EngineConfig
    from pagedspec.engine import Engine

    target, draft = pair
    torch._dynamo.reset()
    config = EngineConfig(model=str(target), dtype="float32", device="cpu", max_model_len=256,
                          compile=True, num_speculative_tokens=3, speculative_adaptive=False,
                          speculative_model=str(draft) if spec == "draft" else "ngram")
    engine = Engine(config)
    assert engine.warm_up() > 0
    spec_state = engine.core.speculator
    assert spec_state.controller.history == [] and spec_state.stats.num_steps == 0
    assert not engine.has_unfinished()

    def run(engine, sizes):
        tokens = {}
        for n in sizes:
            for i in range(n):
                prompt = [(11 * i + j) % 300 + 3 for j in range(9 + 13 * i)]
                engine.add_request(f"r{n}-{i}", prompt, SamplingParams(max_tokens=10))
            while engine.has_unfinished():
                for out in engine.step():
                    tokens[out.request_id] = out.outputs[0].token_ids
        return tokens

    base = graphs()
    warmed = run(engine, (1, 3, 2))
    assert graphs() == base, "a real request compiled a graph the warm-up missed"
    # Unseeded sampling draws from the arrival number: the warm-up's requests must not count
    # (a fixed k, so the draws do not depend on an adaptive controller's timing either).
    assert warmed == run(Engine(config), (1, 3, 2))
    assert Engine(EngineConfig(model=str(target), dtype="float32", device="cpu",
                               max_model_len=64)).warm_up() == 0.0     # eager: nothing to do
    short = Engine(EngineConfig(model=str(target), dtype="float32", device="cpu",
                                max_model_len=24, compile=True))
    assert short.warm_up() > 0 and not short.has_unfinished()    # prompts cut to fit
