"""Steps over persistent, padded buffers (pagedspec.engine.cuda_graphs.StepGraphs).

On the CPU the padded steps run eagerly (``capture=False``): everything but the capture is
checked against the unpadded step, through decodes, verification with a draft model (its own
runner padded too) and with n-gram drafts (rows per sequence that differ within a step), FP8 KV
and preemption. With a GPU, graph replay must equal the padded eager forward bit for bit and the
unpadded engine's greedy tokens."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from checkpoints import make_checkpoint
from conftest import requires_cuda
from pagedspec import LLM, SamplingParams
from pagedspec.engine.cuda_graphs import ROW_BUCKETS, StepGraphs, seq_buckets

pytestmark = pytest.mark.usefixtures("one_thread")

GREEDY = dict(temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("graphs")
    return (make_checkpoint(root / "target", "llama", seed=3, num_attention_heads=4,
                            num_key_value_heads=2),
            make_checkpoint(root / "draft", "llama", seed=4, num_attention_heads=2,
                            num_key_value_heads=1, num_hidden_layers=1))


def test_seq_buckets_cover_every_batch_size():
    assert seq_buckets(1) == [1]
    assert seq_buckets(8) == [1, 2, 4, 8]
    assert seq_buckets(30) == [1, 2, 4, 8, 16, 24, 30]
    assert seq_buckets(64)[-3:] == [48, 56, 64]
    assert ROW_BUCKETS[-1] == 16


def _padded(llm: LLM, capture: bool = False) -> list[StepGraphs]:
    """Turns on the padded steps of the engine's runners; returns their StepGraphs."""
    core = llm.engine.core
    for runner in core.runners:
        runner.enable_graphs(core.scheduler.config.max_num_seqs, core.max_model_len,
                             capture=capture)
    return [r.graphs for r in core.runners]


def _prompts(seed: int, n: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    # Repeated periods, so n-gram drafting finds matches; lengths vary per prompt.
    return [(torch.randint(3, 300, (5,), generator=g).repeat(3 + i)[: 7 + 9 * i]).tolist()
            for i in range(n)]


@pytest.mark.parametrize("case", ["plain", "draft", "ngram", "fp8", "preempt", "eviction"])
def test_padded_steps_give_the_unpadded_tokens(pair, case):
    target, draft = pair
    kwargs = dict(dtype="float32", device="cpu", max_model_len=192, block_size=8,
                  max_num_seqs=6, max_num_batched_tokens=48)   # chunked prefill, buckets 1-6
    if case == "draft":
        kwargs.update(speculative_model=str(draft), num_speculative_tokens=3,
                      speculative_adaptive=False)
    if case == "ngram":      # per-sequence drafts of 0-5 tokens: rows per sequence differ
        kwargs.update(speculative_model="ngram", num_speculative_tokens=5,
                      speculative_adaptive=False)
    if case == "fp8":
        kwargs.update(kv_cache_dtype="fp8_e4m3", kv_scales=(0.5, 0.5))
    if case == "preempt":
        kwargs.update(num_kv_blocks=14, max_num_seqs=4)
    if case == "eviction":   # cache lengths below positions
        kwargs.update(kv_eviction="streaming", kv_budget=32, kv_sink_tokens=4)
    prompts = _prompts(11, 5)
    params = [SamplingParams(max_tokens=14 + 3 * i, **GREEDY) for i in range(5)]
    expected = LLM(target, **kwargs).generate(prompts, params, use_tqdm=False)
    llm = LLM(target, **kwargs)
    graphs = _padded(llm)
    got = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in expected]
    assert all(g.num_runs > 0 for g in graphs), "no step took the padded path"
    if case == "preempt":
        assert llm.scheduler.num_preemptions > 0


def test_padded_logits_equal_unpadded_within_rounding(pair):
    """Three sequences (bucket 4) decoding, then verifying 1-4 rows each: the real rows'
    logits are the unpadded step's up to float32 GEMM rounding, with NaN in unused cache slots
    (the padding rows read them; real rows must not)."""
    target, _ = pair
    kwargs = dict(dtype="float32", device="cpu", max_model_len=128, block_size=8,
                  max_num_seqs=8, speculative_model="ngram", num_speculative_tokens=3,
                  speculative_adaptive=False)
    logits = []
    for padded in (False, True):
        llm = LLM(target, **kwargs)
        for cache in llm.engine.core.kv_cache.key_caches + llm.engine.core.kv_cache.value_caches:
            cache.fill_(float("nan"))
        if padded:
            graphs = _padded(llm)[0]
        runner = llm.engine.core.runner
        captured = []
        execute = runner.execute
        runner.execute = lambda b, **kw: captured.append(
            (b.num_scheduled_tokens, execute(b, **kw))) or captured[-1][1]
        llm.generate(_prompts(5, 3), SamplingParams(max_tokens=10, **GREEDY), use_tqdm=False)
        logits.append(captured)
    assert graphs.num_runs > 0
    assert [q for q, _ in logits[0]] == [q for q, _ in logits[1]]
    for (q, a), (_, b) in zip(*logits):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5, msg=f"rows {q}")


def test_steps_that_do_not_fit_stay_unpadded(pair):
    """Prefill chunks over 16 rows and FP8 calibration steps run the unpadded forward."""
    target, _ = pair
    llm = LLM(target, dtype="float32", device="cpu", max_model_len=128, max_num_seqs=4,
              kv_cache_dtype="fp8_e4m3", kv_scales="calibrate")
    graphs = _padded(llm)[0]
    runner = llm.engine.core.runner
    llm.generate([[7] * 40], SamplingParams(max_tokens=2, **GREEDY), use_tqdm=False)
    # 40 prompt rows, then one decode row, both during calibration (256 tokens): no padding.
    assert graphs.num_runs == 0 and runner.calibrate_fp8
    llm.generate([[9] * 3] * 2, SamplingParams(max_tokens=120, **GREEDY), use_tqdm=False)
    assert not runner.calibrate_fp8 and graphs.num_runs > 0


def test_a_failed_capture_falls_back_to_uncaptured_steps(pair, monkeypatch):
    """A capture the device refuses warns once and leaves the padded steps running uncaptured,
    with the same tokens."""
    target, _ = pair
    kwargs = dict(dtype="float32", device="cpu", max_model_len=128, max_num_seqs=4)
    prompts = _prompts(7, 3)
    params = SamplingParams(max_tokens=8, **GREEDY)
    expected = LLM(target, **kwargs).generate(prompts, params, use_tqdm=False)
    llm = LLM(target, **kwargs)
    graphs = _padded(llm)[0]
    graphs.capture = True                  # as on a GPU, whose capture then fails

    def refuse(b, q):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(graphs, "_capture", refuse)
    with pytest.warns(RuntimeWarning, match="steps run uncaptured"):
        got = llm.generate(prompts, params, use_tqdm=False)
    assert not graphs.capture and not graphs.graphs and graphs.num_runs > 1
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in expected]


def test_capture_needs_a_cuda_device(pair):
    llm = LLM(pair[0], dtype="float32", device="cpu", max_model_len=64)
    with pytest.raises(ValueError, match="capture=True needs a CUDA device"):
        StepGraphs(llm.engine.core.runner, 4, 64, capture=True)
    with pytest.raises(ValueError, match="max_num_seqs"):
        StepGraphs(llm.engine.core.runner, 0, 64, capture=False)


@pytest.mark.cuda
@requires_cuda
@pytest.mark.parametrize("spec", [None, "ngram"])
def test_graph_replay_equals_padded_eager_bit_for_bit(pair, spec):
    """Replayed graphs run the kernels the padded eager forward runs, on the same buffers: the
    logits are equal bit for bit, and the tokens are the unpadded engine's."""
    target, _ = pair
    kwargs = dict(dtype="float32", device="cuda", max_model_len=192, max_num_seqs=6,
                  cuda_graphs=False)
    if spec:
        kwargs.update(speculative_model=spec, num_speculative_tokens=3,
                      speculative_adaptive=False)
    prompts = _prompts(23, 5)
    params = SamplingParams(max_tokens=24, **GREEDY)
    expected = LLM(target, **kwargs).generate(prompts, params, use_tqdm=False)
    outs, logits = [], []
    for capture in (False, True):
        llm = LLM(target, **kwargs)
        graphs = _padded(llm, capture=capture)[0]
        runner = llm.engine.core.runner
        captured = []
        execute = runner.execute
        runner.execute = lambda b, **kw: captured.append(execute(b, **kw).clone()) \
            or captured[-1]
        outs.append(llm.generate(prompts, params, use_tqdm=False))
        logits.append(captured)
        assert graphs.num_runs > 0
    assert graphs.graphs, "nothing was captured"
    for a, b in zip(*logits):
        assert torch.equal(a, b)
    for got in outs:
        assert [o.outputs[0].token_ids for o in got] == \
            [o.outputs[0].token_ids for o in expected]


@pytest.mark.cuda
@requires_cuda
def test_engine_captures_graphs_by_default_on_cuda(pair):
    llm = LLM(pair[0], dtype="float32", device="cuda", max_model_len=64, max_num_seqs=4)
    runner = llm.engine.core.runner
    assert runner.graphs is not None and runner.graphs.capture
    llm.generate(_prompts(2, 3), SamplingParams(max_tokens=8, **GREEDY), use_tqdm=False)
    assert runner.graphs.graphs and runner.graphs.num_runs > 0
    assert np.all([key[0] in runner.graphs.sizes for key in runner.graphs.graphs])
