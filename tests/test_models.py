"""The Llama family (Llama, Qwen2, Mistral) through the paged kernels against ``transformers``, and
the checkpoint loader's errors.

Every case builds a random checkpoint with ``transformers`` in a temporary directory, loads it
with pagedspec's loader and runs it through :class:`pagedspec.engine.ModelRunner` (K/V written
by ``reshape_and_cache``, read by ``paged_attention``) over a scrambled block table whose unused
slots hold NaN. Tokens are fed in steps that cover a whole-prompt prefill, chunked prefill,
single-token decodes and a multi-token verification pass; every row's logits are compared with
``transformers``' forward pass over the same prefix.
"""
from __future__ import annotations

import json
import shutil

import pytest
import torch

import pagedspec
from checkpoints import BASE, hf_model, make_checkpoint
from pagedspec.engine import BlockOps, KVCache, ModelRunner, StepBatch
from pagedspec.models import CheckpointError, LlamaConfig, load_checkpoint
from pagedspec.models.llama import PackedWeight


# name -> (architecture, config overrides)
CONFIGS = {
    "llama-mha": ("llama", dict(num_attention_heads=4, num_key_value_heads=4)),
    "llama-gqa4": ("llama", dict(num_attention_heads=8, num_key_value_heads=2)),
    "llama-gqa8-tied": ("llama", dict(num_attention_heads=8, num_key_value_heads=1,
                                      tie_word_embeddings=True)),
    "llama3-rope": ("llama", dict(rope_parameters=dict(
        rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0,
        high_freq_factor=4.0, original_max_position_embeddings=32))),
    "llama-linear-rope-bias-h128": ("llama", dict(
        head_dim=128, attention_bias=True, mlp_bias=True,
        rope_parameters=dict(rope_type="linear", rope_theta=10000.0, factor=2.0))),
    "qwen2-14x2": ("qwen2", dict(num_attention_heads=14, num_key_value_heads=2)),
    "mistral-gqa4": ("mistral", dict(num_attention_heads=8, num_key_value_heads=2)),
}


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def checkpoint_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    return {name: make_checkpoint(root / name, arch, seed=i, tokenizer=False, **cfg)
            for i, (name, (arch, cfg)) in enumerate(CONFIGS.items())}


def paged_logits(model, token_ids: list[int], steps: list[int], block_size: int = 16,
                 cache_dtype=None, gen=None) -> tuple[torch.Tensor, KVCache]:
    """Logits ``[n, V]`` of every position, feeding ``steps[i]`` tokens at step i.

    Two copies of the sequence run side by side in every step (the second a step behind, so
    one step mixes query lengths), over a block table scrambled across the pool."""
    assert sum(steps) == len(token_ids)
    n_blocks = -(-len(token_ids) // block_size)
    kv = KVCache(model.num_layers, 2 * n_blocks + 3, block_size, model.num_kv_heads,
                 model.head_size, dtype=cache_dtype or model.dtype, device=model.device)
    for cache in kv.key_caches + kv.value_caches:
        if cache.dtype.is_floating_point and cache.element_size() > 1:
            cache.fill_(float("nan"))           # a slot read before it is written shows up
    runner = ModelRunner(model, kv, calibrate_fp8=kv.is_fp8)
    perm = torch.randperm(kv.key_caches[0].shape[0], generator=gen)[:2 * n_blocks]
    tables = perm.view(2, n_blocks).to(torch.int32)
    rows: list[list[torch.Tensor]] = [[], []]
    done = [0, 0]
    schedule = [(steps[i] if i < len(steps) else 0, steps[i - 1] if 0 < i <= len(steps) else 0)
                for i in range(len(steps) + 1)]
    for q_lens in schedule:
        seqs = [s for s in range(2) if q_lens[s]]
        pos = torch.cat([torch.arange(done[s], done[s] + q_lens[s]) for s in seqs])
        owner = torch.cat([torch.full((q_lens[s],), s) for s in seqs])
        slots = tables[owner, pos // block_size].long() * block_size + pos % block_size
        lens = [done[s] + q_lens[s] for s in seqs]
        cu = torch.tensor([0] + [q_lens[s] for s in seqs]).cumsum(0).to(torch.int32)
        batch = StepBatch(
            seqs=[], num_scheduled_tokens=[], num_draft_tokens=[],
            input_ids=torch.tensor(token_ids)[pos], positions=pos, slot_mapping=slots,
            block_tables=tables[seqs], seq_lens=torch.tensor(lens, dtype=torch.int32),
            cu_seqlens_q=cu, max_q_len=max(q_lens), logits_indices=torch.arange(len(pos)),
            block_ops=BlockOps.empty())
        logits = runner.execute(batch, all_rows=True)
        for j, s in enumerate(seqs):
            rows[s].append(logits[int(cu[j]):int(cu[j + 1])])
            done[s] += q_lens[s]
    # The copies meet different batches: the projections' GEMMs block differently by row
    # count, so they agree to rounding, not bit for bit.
    first, second = torch.cat(rows[0]), torch.cat(rows[1])
    scale = first.abs().max().item()
    torch.testing.assert_close(first, second, rtol=1e-2, atol=1e-2 * scale)
    return first, kv


def hf_logits(hf, token_ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([token_ids])).logits[0].float()


# prefill of 20 (one step), chunked prefill (7 + 9), decodes, a 5-token verification pass
STEPS = [20, 7, 9, 1, 1, 1, 5, 1]


@pytest.mark.parametrize("name", list(CONFIGS))
def test_logits_match_transformers_float32(checkpoint_dirs, gen, name):
    path = checkpoint_dirs[name]
    model = load_checkpoint(path).load_model(torch.float32)
    hf = hf_model(path)
    tokens = torch.randint(0, BASE["vocab_size"], (sum(STEPS),), generator=gen).tolist()
    ours, _ = paged_logits(model, tokens, STEPS, gen=gen)
    ref = hf_logits(hf, tokens)
    # float32 throughout; the paths differ only in summation order (online softmax over pages
    # vs SDPA, fused vs separate projections): ~1e-6 of the logit scale. A wrong slot, position
    # or rotation changes logits by O(scale).
    scale = ref.abs().max().item()
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4 * scale)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("name", ["llama-gqa4", "qwen2-14x2"])
def test_logits_half_precision_as_close_as_transformers(checkpoint_dirs, gen, name, dtype):
    """In 16-bit, neither implementation equals the float32 result; ours must be about as close
    to it as transformers' own run in the same dtype (each rounding is 2^-8 / 2^-11 relative, and
    the two round at different places, so their errors are comparable, not equal)."""
    path = checkpoint_dirs[name]
    model = load_checkpoint(path).load_model(dtype)
    tokens = torch.randint(0, BASE["vocab_size"], (sum(STEPS),), generator=gen).tolist()
    ours, _ = paged_logits(model, tokens, STEPS, gen=gen)
    exact = hf_logits(hf_model(path), tokens)
    theirs = hf_logits(hf_model(path, dtype), tokens)
    err_ours = (ours - exact).abs().max().item()
    err_theirs = (theirs - exact).abs().max().item()
    assert err_ours <= 2 * err_theirs + 1e-3 * exact.abs().max().item(), (err_ours, err_theirs)


@pytest.mark.parametrize("fp8,bound", [(torch.float8_e4m3fn, 0.05), (torch.float8_e5m2, 0.10)],
                         ids=["e4m3", "e5m2"])
def test_fp8_kv_cache_logits_close_to_16_bit_cache(checkpoint_dirs, gen, fp8, bound):
    """FP8 stores K/V with 3 (e4m3) or 2 (e5m2) mantissa bits: each element is off by up to
    2^-4 / 2^-3 of itself. Scores and the weighted sum of V average those errors over the head
    size and the context, so logits move by a few percent of their range: measured 1.3% / 3.2%
    of the range here, bounded at 5% / 10% (about 3x margin), while a wrong scale (unscaled
    saturation, a scale applied twice) moves them by tens of percent."""
    path = checkpoint_dirs["llama-gqa4"]
    model = load_checkpoint(path).load_model(torch.bfloat16)
    tokens = torch.randint(0, BASE["vocab_size"], (sum(STEPS),), generator=gen).tolist()
    ref, _ = paged_logits(model, tokens, STEPS, gen=gen)
    ours, kv = paged_logits(model, tokens, STEPS, cache_dtype=fp8, gen=gen)
    assert kv.key_caches[0].dtype == fp8
    assert all(0 < float(s) != 1.0 for s in kv.k_scales + kv.v_scales), "scales not calibrated"
    span = (ref.max() - ref.min()).item()
    err = (ours - ref).abs().max().item()
    assert 0 < err <= bound * span, (err, span)


def test_config_spellings_agree(checkpoint_dirs):
    """transformers 5 writes ``rope_parameters``; earlier versions ``rope_theta`` +
    ``rope_scaling`` (with ``type`` or ``rope_type``). Both must parse to the same config."""
    raw = json.loads((checkpoint_dirs["llama3-rope"] / "config.json").read_text())
    new = LlamaConfig.from_dict(raw)
    params = dict(raw.pop("rope_parameters"))
    old = dict(raw, rope_theta=params.pop("rope_theta"),
               rope_scaling=dict(params, type=params.pop("rope_type")))
    assert LlamaConfig.from_dict(old) == new
    assert new.rope_theta == 500000.0 and new.rope_scaling["rope_type"] == "llama3"
    derived = {k: v for k, v in raw.items() if k != "head_dim"}
    derived["hidden_size"] = 128
    assert LlamaConfig.from_dict(dict(derived, rope_theta=1.0)).head_size == 128 // 4


def test_sharded_checkpoint_and_derived_head_dim(tmp_path, gen):
    path = make_checkpoint(tmp_path / "sharded", "llama", shards=True, tokenizer=False,
                           hidden_size=256, num_attention_heads=4, head_dim=None)
    cfg = json.loads((path / "config.json").read_text())
    cfg.pop("head_dim", None)                  # derived: hidden_size / num_attention_heads
    (path / "config.json").write_text(json.dumps(cfg))
    assert (path / "model.safetensors.index.json").exists()
    ckpt = load_checkpoint(path)
    assert len(set(ckpt.weight_files.values())) > 1 and ckpt.config.head_size == 64
    tokens = torch.randint(0, BASE["vocab_size"], (12,), generator=gen).tolist()
    ours, _ = paged_logits(ckpt.load_model(torch.float32), tokens, [12], gen=gen)
    ref = hf_logits(hf_model(path), tokens)
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())


# ---- malformed checkpoints -------------------------------------------------------------------
@pytest.fixture
def good_dir(tmp_path):
    return make_checkpoint(tmp_path / "good", "llama")


def _rewrite_config(path, **changes):
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


def _rewrite_weights(path, edit):
    from safetensors.torch import load_file, save_file

    tensors = load_file(path / "model.safetensors")
    edit(tensors)
    save_file(tensors, path / "model.safetensors")


def test_missing_tensor(good_dir):
    _rewrite_weights(good_dir, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(CheckpointError, match=r"missing tensor 'model\.layers\.1\.mlp\.up_proj"):
        load_checkpoint(good_dir).load_model(torch.float32)


def test_extra_tensor(good_dir):
    _rewrite_weights(good_dir, lambda t: t.update({"model.layers.0.mystery.weight":
                                                   torch.zeros(3)}))
    with pytest.raises(CheckpointError, match=r"model\.safetensors: unexpected tensor "
                                              r"'model\.layers\.0\.mystery\.weight'"):
        load_checkpoint(good_dir).load_model(torch.float32)


def test_wrong_shape(good_dir):
    def edit(t):
        t["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(64, 64)
    _rewrite_weights(good_dir, edit)
    with pytest.raises(CheckpointError, match=r"model\.safetensors: tensor 'model\.layers\.0\."
                                              r"self_attn\.k_proj\.weight' has shape \[64, 64\], "
                                              r"expected \[128, 64\]"):
        load_checkpoint(good_dir).load_model(torch.float32)


@pytest.mark.parametrize("changes,message", [
    (dict(model_type="gpt2", architectures=["GPT2LMHeadModel"]), "architecture.*not supported"),
    (dict(model_type="gemma"), "model_type 'gemma' is not supported"),
    (dict(hidden_act="gelu"), "hidden_act 'gelu' is not supported"),
    (dict(num_key_value_heads=3), "multiple of num_key_value_heads"),
    (dict(rope_parameters=dict(rope_type="yarn", rope_theta=1e4, factor=4.0)),
     "RoPE scaling type 'yarn'"),
    (dict(vocab_size=None), "missing required key 'vocab_size'"),
])
def test_bad_config(good_dir, changes, message):
    _rewrite_config(good_dir, **changes)
    with pytest.raises(CheckpointError, match=r"config\.json: .*" + message):
        load_checkpoint(good_dir)


def test_missing_files(good_dir, tmp_path):
    no_tok = tmp_path / "no-tokenizer"
    shutil.copytree(good_dir, no_tok)
    (no_tok / "tokenizer.json").unlink()
    with pytest.raises(CheckpointError, match="missing tokenizer.json"):
        load_checkpoint(no_tok).load_tokenizer()
    (good_dir / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        load_checkpoint(good_dir)
    (good_dir / "config.json").unlink()
    with pytest.raises(CheckpointError, match=r"config\.json: file not found"):
        load_checkpoint(good_dir)
    with pytest.raises(CheckpointError, match="not a checkpoint directory"):
        load_checkpoint(tmp_path / "nowhere")


def test_generation_config_eos_ids(good_dir):
    (good_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    assert load_checkpoint(good_dir).generation.eos_token_ids == (2, 7)
    (good_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": "x"}))
    with pytest.raises(CheckpointError, match="generation_config.json: eos_token_id"):
        load_checkpoint(good_dir)


# ---- CUDA ---------------------------------------------------------------------------------------
@pytest.mark.cuda
@pytest.mark.parametrize("name", ["llama-gqa4", "qwen2-14x2", "llama3-rope"])
def test_logits_on_cuda_as_close_as_transformers(checkpoint_dirs, gen, name):
    """bf16 on the GPU (the CUDA attention kernels take 16-bit queries), judged as on CPU:
    about as close to the float32 result as transformers' own bf16 run."""
    path = checkpoint_dirs[name]
    model = load_checkpoint(path).load_model(torch.bfloat16, "cuda")
    tokens = torch.randint(0, BASE["vocab_size"], (sum(STEPS),), generator=gen).tolist()
    ours, _ = paged_logits(model, tokens, STEPS, gen=gen)
    exact = hf_logits(hf_model(path), tokens)
    theirs = hf_logits(hf_model(path, torch.bfloat16), tokens)
    err_ours = (ours.cpu() - exact).abs().max().item()
    err_theirs = (theirs - exact).abs().max().item()
    assert err_ours <= 2 * err_theirs + 1e-3 * exact.abs().max().item(), (err_ours, err_theirs)


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch without oneDNN")
@pytest.mark.parametrize("level", ["default", "avx2"])
def test_prepacked_weights_compute_the_same_logits(checkpoint_dirs, gen, level, monkeypatch):
    """Eager float32 CPU runners (and bfloat16 ones where oneDNN computes bfloat16) re-lay the
    projections and LM head out: packed_linear's layout with oneDNN's beside it where the CPU
    kernels run at the avx512 level, oneDNN's alone below it (forced here with
    PAGEDSPEC_CPU_ISA=avx2). The logits move by float32 rounding only (a wrong layout or
    transposition moves them by O(1)), float16 keeps plain weights, and a vocabulary is
    restricted before packing or not at all (the compiled forward on packed weights:
    tests/test_compile.py)."""
    from checkpoints import dense_forward

    if level != "default":
        if level not in pagedspec.build_info()["cpu_isa_supported"]:
            pytest.skip(f"this CPU lacks the {level} instructions")
        monkeypatch.setenv("PAGEDSPEC_CPU_ISA", level)
    packed_layout = pagedspec._C.cpu_isa() == "avx512"

    path = checkpoint_dirs["llama-gqa4"]
    tokens = torch.randint(0, BASE["vocab_size"], (12,), generator=gen).tolist()
    model = load_checkpoint(path).load_model(torch.float32)
    with torch.no_grad():
        plain = model.compute_logits(dense_forward(model, tokens))
        assert model.prepack_weights()
        qkv = model.layers[0].qkv
        assert isinstance(qkv, PackedWeight) if packed_layout else qkv.is_mkldnn
        assert not model.prepack_weights()                   # once
        packed = model.compute_logits(dense_forward(model, tokens))
    scale = plain.abs().max().item()
    torch.testing.assert_close(packed, plain, rtol=1e-5, atol=1e-5 * scale)
    with pytest.raises(RuntimeError, match="before prepack_weights"):
        model.restrict_vocab(torch.arange(10))
    assert not load_checkpoint(path).load_model(torch.float16).prepack_weights()
    bf16 = load_checkpoint(path).load_model(torch.bfloat16)
    with torch.no_grad():
        plain = bf16.compute_logits(dense_forward(bf16, tokens))
        packed_bf16 = bf16.prepack_weights()
        assert packed_bf16 == torch.ops.mkldnn._is_mkldnn_bf16_supported()
        packed = bf16.compute_logits(dense_forward(bf16, tokens))
    # bfloat16 outputs of each projection: two roundings of 2^-8 apart at most per layer.
    torch.testing.assert_close(packed, plain, rtol=0.05, atol=0.05 * plain.abs().max().item())
