"""vLLM's offline LLM with pagedspec's attention backend against vLLM's own CPU backend.
Needs vLLM: run by tools/test_vllm.sh in .venv-vllm, skipped elsewhere.

Tiny random Llama and Qwen2 checkpoints (built here with transformers), float32 so that greedy
argmaxes are not decided by bfloat16 rounding of near-ties: the two backends differ only in
summation order (~1e-6 relative), so greedy tokens must be equal and logprobs within 1e-3. The
prompts share prefixes (prefix-cache hits on the second pass), are longer than
max_num_batched_tokens (chunked prefill) and are scheduled together (mixed prefill/decode steps).
The negative control (the same backend with the cached context dropped) must diverge.
On a CUDA vLLM (bench/gpu_check.sh runs this file when vLLM imports; not run yet) the stock
backend is FLASH_ATTN and the exact comparison is in float16 (float32 is CPU-only here).
"""
from __future__ import annotations

import gc
import logging
import os

import pytest

# (Set here, not in a conftest.py: a second conftest module would shadow tests/conftest.py's.)
# In-process engine and worker: ~9 s faster per LLM than vLLM's subprocesses on 2 cores, and the
# negative control's backend (registered in this process) reaches the worker.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB: this machine has 24
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0-1")

vllm = pytest.importorskip("vllm", reason="needs vLLM (run tools/test_vllm.sh)")
torch = pytest.importorskip("torch")
from vllm import LLM, SamplingParams  # noqa: E402
from vllm.inputs import TokensPrompt  # noqa: E402
from vllm.platforms import current_platform  # noqa: E402

import pagedspec.vllm  # noqa: E402

# The entry points register the backend when pagedspec is installed; bench/gpu_check.sh runs
# from the source tree, so register here too (idempotent). On CUDA vLLM's own platform honours
# CUSTOM; on CPU pagedspec's platform plugin must be active (an installed pagedspec).
pagedspec.vllm.register()
ON_CPU = current_platform.is_cpu()
STOCK = "CPU_ATTN" if ON_CPU else "FLASH_ATTN"  # vLLM's own backend on this platform
# float32 is CPU-only in the kernels; on CUDA float16 (and the tolerance of its rounding).
EXACT_DTYPE, EXACT_ATOL = ("float32", 1e-3) if ON_CPU else ("float16", 5e-2)

BLOCK = 32
MAX_TOKENS = 12


def _build(kind, path, **extra):
    import transformers

    common = dict(intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=512, max_position_embeddings=1024,
                  bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
    if kind == "llama":
        config = transformers.LlamaConfig(hidden_size=128, head_dim=64, **common, **extra)
        cls = transformers.LlamaForCausalLM
    else:  # vLLM's Qwen2 derives head_dim = hidden / heads: 256 / 4 = 64
        config = transformers.Qwen2Config(hidden_size=256, **common, **extra)
        cls = transformers.Qwen2ForCausalLM
    torch.manual_seed(0)
    model = cls(config)
    with torch.no_grad():  # sharper logits than the default init: fewer near-ties to flip
        model.lm_head.weight.mul_(8.0)
    model.save_pretrained(path, safe_serialization=True)
    return str(path)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return {kind: _build(kind, root / kind) for kind in ("llama", "qwen2")}


def _prompts():
    g = torch.Generator().manual_seed(7)
    shared = torch.randint(3, 500, (70,), generator=g).tolist()  # > 2 blocks: prefix hits
    prompts = [shared + torch.randint(3, 500, (n,), generator=g).tolist() for n in (5, 40, 90)]
    prompts += [torch.randint(3, 500, (n,), generator=g).tolist() for n in (1, 17, 150)]
    return [TokensPrompt(prompt_token_ids=p) for p in prompts]


def _generate(model, backend, dtype=EXACT_DTYPE, kv_cache_dtype="auto", passes=2):
    device_kwargs = {} if ON_CPU else {"gpu_memory_utilization": 0.3}
    llm = LLM(model=model, skip_tokenizer_init=True, dtype=dtype, max_model_len=512,
              **device_kwargs,
              enforce_eager=True, block_size=BLOCK, attention_backend=backend,
              enable_prefix_caching=True, enable_chunked_prefill=True,
              max_num_batched_tokens=64, kv_cache_dtype=kv_cache_dtype, seed=0)
    # Top-2 logprobs: a near-tie decided differently (_assert_same) shows as the runner-up.
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=2, ignore_eos=True)
    results = []
    for _ in range(passes):  # the second pass hits the prefix cache
        outs = llm.generate(_prompts(), params, use_tqdm=False)
        results.append([(list(o.outputs[0].token_ids),
                         [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs,
                                                         o.outputs[0].token_ids)],
                         [{k: v.logprob for k, v in lp.items()} for lp in o.outputs[0].logprobs])
                        for o in outs])
    del llm
    gc.collect()
    return results


def _assert_same(ours, theirs, atol, steps=MAX_TOKENS, near_ties=False):
    """The same greedy tokens with logprobs within atol, over the first `steps` steps. With
    near_ties, a sequence may part at a step where the two choices are within atol of each other
    in both backends (each backend's token the other's runner-up): rounding decides such a tie,
    and after it the contexts differ, so the rest of that sequence is not compared."""
    for p, (mine, stock) in enumerate(zip(ours, theirs)):
        for r, ((tok_a, lp_a, top_a), (tok_b, lp_b, top_b)) in enumerate(zip(mine, stock)):
            where = f"pass {p}, prompt {r}: tokens {tok_a[:steps]} != {tok_b[:steps]}"
            for s in range(min(steps, len(tok_a), len(tok_b))):
                if tok_a[s] != tok_b[s]:
                    assert near_ties, where
                    a, b = tok_a[s], tok_b[s]
                    assert b in top_a[s] and a in top_b[s], (where, s, top_a[s], top_b[s])
                    gaps = (top_a[s][a] - top_a[s][b], top_b[s][b] - top_b[s][a])
                    assert max(gaps) <= atol, (where, s, "not a near-tie", gaps)
                    break
                assert abs(lp_a[s] - lp_b[s]) <= atol, (p, r, s, lp_a[s], lp_b[s])


@pytest.fixture(scope="module")
def stock(models):
    return {kind: _generate(path, STOCK) for kind, path in models.items()}


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_same_greedy_tokens_as_vllms_own_backend(models, stock, kind, monkeypatch):
    from pagedspec.vllm import layer_ops

    calls = {"attend": 0, "write_kv": 0}
    for name in calls:
        def spy(*args, _real=getattr(layer_ops, name), _name=name, **kwargs):
            calls[_name] += 1
            return _real(*args, **kwargs)
        monkeypatch.setattr(layer_ops, name, spy)
    ours = _generate(models[kind], "CUSTOM")
    assert calls["attend"] > 0 and calls["write_kv"] > 0, f"pagedspec's kernels did not run: {calls}"
    _assert_same(ours, stock[kind], atol=EXACT_ATOL)


@pytest.mark.skipif(not ON_CPU, reason="pagedspec's platform plugin is the CPU platform's")
def test_platform_announces_and_validates(caplog):
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    from vllm.v1.attention.selector import AttentionSelectorConfig

    from pagedspec.vllm.platform import PagedSpecCpuPlatform

    assert isinstance(current_platform, PagedSpecCpuPlatform), type(current_platform)
    config = AttentionSelectorConfig(head_size=64, dtype=torch.bfloat16, kv_cache_dtype="auto",
                                     block_size=BLOCK)
    with caplog.at_level(logging.WARNING):
        path = PagedSpecCpuPlatform.get_attn_backend_cls(AttentionBackendEnum.CUSTOM, config)
    assert path == "pagedspec.vllm.backend.PagedSpecAttentionBackend"
    assert any("attention runs through pagedspec's kernels" in r.getMessage()
               for r in caplog.records)
    # Other choices are the stock CPU platform's.
    assert "cpu_attn" in PagedSpecCpuPlatform.get_attn_backend_cls(None, config)
    # What the kernels do not compute is refused with vLLM's reasons, at selection.
    for change, reason in [(dict(has_sliding_window=True), "sliding window not supported"),
                           (dict(has_sink=True), "attention sinks not supported"),
                           (dict(head_size=72), "head_size not supported"),
                           (dict(attn_type="encoder_only"), "attention type encoder_only"),
                           (dict(kv_cache_dtype="int8"), "kv_cache_dtype not supported")]:
        with pytest.raises(ValueError, match=reason):
            PagedSpecCpuPlatform.get_attn_backend_cls(AttentionBackendEnum.CUSTOM,
                                                      config._replace(**change))


@pytest.mark.parametrize("what, kwargs", [("ALiBi", dict(alibi_slopes=[0.5] * 4)),
                                          ("logits soft-capping", dict(logits_soft_cap=30.0))])
def test_impl_refuses_what_selection_cannot_see(what, kwargs):
    from pagedspec.vllm.backend import PagedSpecAttentionImpl

    base = dict(num_heads=4, head_size=64, scale=0.125, num_kv_heads=2, alibi_slopes=None,
                sliding_window=None, kv_cache_dtype="auto")
    with pytest.raises(NotImplementedError, match=what):
        PagedSpecAttentionImpl(**{**base, **kwargs})


def test_negative_control_diverges(models, stock):
    from vllm.plugins import load_general_plugins
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    from vllm.v1.attention import selector

    load_general_plugins()  # pagedspec's registration first, so the override below sticks
    register_backend(AttentionBackendEnum.CUSTOM, "dropped_context.DroppedContextBackend")
    selector._cached_get_attn_backend.cache_clear()  # earlier LLMs' choices, this process
    try:
        broken = _generate(models["llama"], "CUSTOM", passes=1)
    finally:
        register_backend(AttentionBackendEnum.CUSTOM, "pagedspec.vllm.backend."
                         "PagedSpecAttentionBackend")
        selector._cached_get_attn_backend.cache_clear()
    differing = sum(a[0] != b[0] for a, b in zip(broken[0], stock["llama"][0]))
    assert differing >= len(broken[0]) - 1, "dropping the context did not change the tokens"


@pytest.mark.parametrize("dtype, kv_cache_dtype, atol, steps",
                         [("bfloat16", "auto", 0.1, MAX_TOKENS), ("bfloat16", "fp8_e4m3", 0.3, 1),
                          ("bfloat16", "fp8_e5m2", 0.6, 1)])
def test_bfloat16_and_fp8_caches(models, dtype, kv_cache_dtype, atol, steps):
    """bfloat16 activations: the same greedy tokens until a near-tie (seen with vLLM's AVX2
    kernels: prompt 1 parted at step 3), with logprobs within atol. They differ by more than in
    float32: vLLM's AMX kernel multiplies bfloat16 probabilities (2^-8 relative each) where
    pagedspec keeps them in float32, and the lm_head scaled 8x turns that into ~0.03 (measured)
    on logits of ~10.
    FP8 caches (scale 1.0): vLLM's FP8 attention is 2-4% of the largest output off the exact
    result (bench/peers/compare.py), which moved the logprobs by up to 0.17 (e4m3) and 0.32
    (e5m2, one mantissa bit fewer, so twice the bound) and flipped near-ties later in greedy
    sequences (seen at steps 2 and 4): only the first step (the prefill, which reads its K/V back
    from the FP8 cache) must agree. vLLM's CPU backend refuses FP8 caches on CPUs without
    AVX-512: there is nothing to compare with, and the test skips with vLLM's reason."""
    try:
        theirs = _generate(models["llama"], STOCK, dtype=dtype, kv_cache_dtype=kv_cache_dtype,
                           passes=1)
    except NotImplementedError as e:
        if kv_cache_dtype == "auto":
            raise
        pytest.skip(f"vLLM's own {STOCK} backend refuses {kv_cache_dtype} here: {e}")
    ours = _generate(models["llama"], "CUSTOM", dtype=dtype, kv_cache_dtype=kv_cache_dtype,
                     passes=1)
    _assert_same(ours, theirs, atol=atol, steps=steps, near_ties=True)


def test_importing_pagedspec_does_not_import_vllm():
    import subprocess
    import sys

    code = "import sys, pagedspec, pagedspec.vllm; assert 'vllm' not in sys.modules, 'imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_unsupported_vllm_version_fails_clearly(monkeypatch):
    import importlib
    import sys

    import pagedspec.vllm as plugin

    monkeypatch.setattr(vllm, "__version__", "0.99.0")
    assert plugin.cpu_platform() is None
    sys.modules.pop("pagedspec.vllm.unsupported", None)
    with pytest.raises(ImportError, match=r"supports vLLM 0\.32\.x, found vLLM 0\.99\.0"):
        importlib.import_module("pagedspec.vllm.unsupported")
