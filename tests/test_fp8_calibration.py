"""FP8 KV-scale calibration over the first few hundred tokens (:mod:`pagedspec.engine.runner`):
scales that keep growing with a running amax across small first requests, blocks written under a
smaller scale requantized so they still decode right, and on the real SmolLM2-135M (when fetched)
a one-token first request that no longer ruins greedy agreement with float32.

Requests run through :class:`ModelRunner` one sequence per step, each in its own blocks, as the
scheduler would feed them (a long prompt in prefill chunks that read the earlier chunks' K/V
from the FP8 cache)."""
from __future__ import annotations

import pytest
import torch

from checkpoints import dense_forward, make_checkpoint
from pagedspec.engine import BlockOps, KVCache, ModelRunner, StepBatch
from pagedspec.engine.runner import CALIBRATION_TOKENS
from pagedspec.models import cached_model, load_checkpoint

pytestmark = pytest.mark.usefixtures("one_thread")

E4M3_HEADROOM = 448.0 / 2


class Driver:
    """Feeds whole requests to a runner: request i gets fresh blocks, its prompt goes in
    ``chunk``-token prefill steps; returns float32 logits of every prompt position."""

    def __init__(self, model, cache_dtype, num_blocks: int, block_size: int = 16, **runner_kw):
        self.block_size = block_size
        self.kv = KVCache(model.num_layers, num_blocks, block_size, model.num_kv_heads,
                          model.head_size, dtype=cache_dtype, device=model.device)
        self.runner = ModelRunner(model, self.kv, calibrate_fp8=self.kv.is_fp8, **runner_kw)
        self.next_block = 0
        self.tables: list[torch.Tensor] = []

    def run(self, token_ids: list[int], chunk: int = 10**9) -> torch.Tensor:
        n, bs = len(token_ids), self.block_size
        n_blocks = -(-n // bs)
        table = torch.arange(self.next_block, self.next_block + n_blocks, dtype=torch.int32)
        self.next_block += n_blocks
        self.tables.append(table)
        rows = []
        for start in range(0, n, chunk):
            pos = torch.arange(start, min(n, start + chunk))
            batch = StepBatch(
                seqs=[], num_scheduled_tokens=[], num_draft_tokens=[],
                input_ids=torch.tensor(token_ids)[pos], positions=pos,
                slot_mapping=table[pos // bs].long() * bs + pos % bs,
                block_tables=table[None], seq_lens=torch.tensor([int(pos[-1]) + 1],
                                                                dtype=torch.int32),
                cu_seqlens_q=torch.tensor([0, len(pos)], dtype=torch.int32),
                max_q_len=len(pos), logits_indices=torch.arange(len(pos)),
                block_ops=BlockOps.empty())
            rows.append(self.runner.execute(batch, all_rows=True))
        return torch.cat(rows)

    def cached(self, request: int, layer: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Request ``request``'s first ``n`` cached K and V of ``layer``, dequantized with the
        layer's current scales: float32 ``[n, Hkv, D]`` each."""
        table, bs = self.tables[request], self.block_size
        pos = torch.arange(n)
        blocks, offsets = table[pos // bs].long(), pos % bs
        k = self.kv.key_caches[layer][blocks, offsets].float() * self.kv.k_scales[layer]
        v = self.kv.value_caches[layer][blocks, offsets].float() * self.kv.v_scales[layer]
        return k, v


def pow2_scale(amax: torch.Tensor) -> torch.Tensor:
    return torch.exp2(torch.ceil(torch.log2(amax / E4M3_HEADROOM)))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = make_checkpoint(tmp_path_factory.mktemp("fp8") / "llama", "llama", tokenizer=False,
                           hidden_size=64, intermediate_size=128, num_attention_heads=4,
                           num_key_value_heads=2, head_dim=64, max_position_embeddings=1024)
    return load_checkpoint(path).load_model(torch.float32)


def test_scales_grow_with_running_amax_until_enough_tokens(tiny, gen):
    """Small first requests (1, 3, 40 tokens) keep raising the scales to the running amax of
    every K/V seen, a long one crosses the calibration budget, and after it they stay fixed."""
    model = tiny
    lengths = [1, 3, 40, CALIBRATION_TOKENS, 30]
    driver = Driver(model, torch.float8_e4m3fn, num_blocks=40)
    running = torch.zeros(model.num_layers, 2)
    history, amaxes = [], []
    for i, n in enumerate(lengths):
        tokens = torch.randint(0, 320, (n,), generator=gen).tolist()
        record: list = []
        dense_forward(model, tokens, record)
        amax = torch.tensor([[k.abs().max(), v.abs().max()] for k, v in record])
        calibrating = driver.runner.calibrate_fp8
        driver.run(tokens, chunk=64)
        scales = torch.tensor([[float(k), float(v)] for k, v in
                               zip(driver.kv.k_scales, driver.kv.v_scales)])
        if calibrating:
            running = torch.maximum(running, amax)
            tracked = torch.stack([torch.stack(p) for p in driver.runner._amax])
            # layer 0 sees the dense pass's K/V to float32 rounding; later layers' inputs went
            # through attention over FP8 K/V (a few percent off, as in test_models)
            torch.testing.assert_close(tracked[0], running[0], rtol=1e-5, atol=0)
            torch.testing.assert_close(tracked[1:], running[1:], rtol=0.05, atol=0)
            assert torch.equal(scales, pow2_scale(tracked))
            amaxes.append(tracked)
        history.append(scales)
        assert driver.runner.calibrate_fp8 == (sum(lengths[:i + 1]) < CALIBRATION_TOKENS)
    assert all(torch.all(later >= earlier) for earlier, later in zip(history, history[1:]))
    # one token's K/V are not the largest: the amax keeps growing past the first request's
    # everywhere, and the scales (powers of two) with it in places
    assert bool(torch.all(amaxes[3] > amaxes[0])), (amaxes[0], amaxes[3])
    assert bool(torch.any(history[3] > history[0])), (history[0], history[3])
    assert torch.equal(history[4], history[3])            # fixed once calibrated


@pytest.mark.parametrize("requantize", [True, False], ids=["requantized", "mutant-not"])
def test_blocks_written_under_a_smaller_scale_still_decode(tiny, gen, monkeypatch, requantize):
    """A 2-token request, then a long one that raises every scale: the first request's cached
    K/V still dequantize to its true K/V within FP8 precision (e4m3: 2^-4 relative, plus the
    subnormal step 2^-9 of the scale). The mutant that skips requantization (the bug a growing
    scale would otherwise bring) must miss that bound."""
    import pagedspec.engine.runner as runner_mod

    if not requantize:
        monkeypatch.setattr(runner_mod, "_requantize", lambda cache, blocks, ratio: None)
    driver = Driver(tiny, torch.float8_e4m3fn, num_blocks=30)

    def layer0_amax(token: int) -> float:
        record: list = []
        dense_forward(tiny, [token], record)
        return max(float(t.abs().max()) for t in record[0])

    # the quietest of a few random first tokens, so that the long request raises layer 0's
    # scales; layer 0 is checked because its K/V are the embeddings' projections, exact in
    # both runs (later layers' inputs carry the FP8 attention error of the layers before)
    candidates = torch.randint(0, 320, (16,), generator=gen).tolist()
    first = [min(candidates, key=layer0_amax)] * 2
    record: list = []
    dense_forward(tiny, first, record)
    driver.run(first)
    scales = lambda: [float(driver.kv.k_scales[0]), float(driver.kv.v_scales[0])]  # noqa: E731
    before = scales()
    driver.run(torch.randint(0, 320, (300,), generator=gen).tolist(), chunk=100)
    assert any(after > b for after, b in zip(scales(), before)), (before, scales())
    worst = 0.0
    k, v = driver.cached(0, 0, 2)
    for got, true, scale in ((k, record[0][0], driver.kv.k_scales[0]),
                             (v, record[0][1], driver.kv.v_scales[0])):
        bound = 2.0**-4 * true.abs() + 2.0**-9 * float(scale)
        worst = max(worst, float(((got - true).abs() / bound).max()))
    assert (worst <= 1.0) == requantize, worst


# ---- the real model ---------------------------------------------------------------------------
SMOLLM2 = cached_model("smollm2-135m")


def _long_prompt(tokenizer, n: int) -> list[int]:
    """``n`` tokens of English prose and code: the standard library's own documentation."""
    import argparse
    import json
    import textwrap

    text = "\n\n".join(m.__doc__ for m in (argparse, json, textwrap))
    ids = tokenizer.encode(text).ids
    assert len(ids) >= n
    return ids[:n]


@pytest.mark.skipif(SMOLLM2 is None, reason="SmolLM2-135M-Instruct is not in the model cache; "
                                            "run tools/fetch_smollm2.sh to fetch it")
def test_one_token_first_request_keeps_greedy_agreement_on_smollm2():
    """SmolLM2-135M in float32 with an e4m3 cache: a one-token request first, then a 512-token
    prompt in 128-token chunks. The greedy choice at each prompt position must agree with the
    float32 cache's about as often as with fixed scales of 1.0 (measured here: 94.9% with 1.0,
    93.9% calibrated, the same with or without the warm-up request). The control calibrates from
    the first step alone (``calibration_tokens=1``, the old rule, whose power-of-two rounding
    already gives it 2-4x headroom): measured 86.7%, so the setup does show the hazard."""
    ckpt = load_checkpoint("smollm2-135m")
    model = ckpt.load_model(torch.float32)
    prompt = _long_prompt(ckpt.load_tokenizer(), 512)

    def argmaxes(cache_dtype, **kw) -> torch.Tensor:
        driver = Driver(model, cache_dtype, num_blocks=40, **kw)
        driver.run(prompt[:1])                          # the one-token first request
        return driver.run(prompt, chunk=128).argmax(-1)

    exact = argmaxes(torch.float32)
    ours = (argmaxes(torch.float8_e4m3fn) == exact).float().mean().item()
    single_step = (argmaxes(torch.float8_e4m3fn, calibration_tokens=1) == exact
                   ).float().mean().item()
    print(f"greedy agreement with float32: calibrated over {CALIBRATION_TOKENS} tokens "
          f"{ours:.3f}, from the first step only {single_step:.3f}")
    # 0.92: two points under the measured 93.9% (10 of 512 positions), for other CPUs' rounding
    assert ours >= 0.92, (ours, single_step)
    assert single_step < ours - 0.04, (ours, single_step)
