"""``tools/train_draft.py``: end to end in smoke mode on a tiny random target (the files it writes,
the held-out split, the transformers loader), and the shipped SmolLM2 draft's temperature-0
acceptance recomputed on a slice when the target is cached."""
from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import load_script

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tools" / "train_draft.py"
DEMO = ROOT / "python" / "pagedspec" / "models" / "data" / "pagedspec-demo"
SHIPPED = ROOT / "python" / "pagedspec" / "models" / "data" / "smollm2-135m-draft"
TARGET_HF = Path("~/.cache/pagedspec/smollm2-135m-hf").expanduser()
FILES = ["config.json", "model.safetensors", "draft_vocab.json", "tokenizer.json",
         "tokenizer_config.json", "generation_config.json", "training.json",
         "heldout_prompts.json", "README.md"]


@pytest.fixture(scope="module")
def script():
    return load_script(SCRIPT)


def tiny_target(path: Path) -> Path:
    """A random 2-layer Llama with the demo model's tokenizer (no chat template)."""
    import transformers

    tokenizer = json.loads((DEMO / "config.json").read_text())
    config = transformers.LlamaConfig(
        vocab_size=tokenizer["vocab_size"], hidden_size=128, intermediate_size=256,
        num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=64,
        max_position_embeddings=1024, tie_word_embeddings=True, bos_token_id=None,
        eos_token_id=0, pad_token_id=1)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(DEMO / name, path / name)
    return path


@pytest.fixture(scope="module")
def smoke(script, tmp_path_factory):
    root = tmp_path_factory.mktemp("draft")
    target = tiny_target(root / "target")
    out = root / "draft"
    assert script.main(["--smoke", "--target", str(target), "--out", str(out),
                        "--work", str(root / "work")]) == 0
    return target, out


def test_smoke_run_writes_every_file(smoke):
    target, out = smoke
    assert sorted(FILES) == sorted(p.name for p in out.iterdir() if p.name in FILES)
    assert (out / "tokenizer.json").read_bytes() == (target / "tokenizer.json").read_bytes()
    config = json.loads((out / "config.json").read_text())
    assert config["num_hidden_layers"] == 2 and config["tie_word_embeddings"] is True
    assert config["pagedspec_borrowed_weights"] == ["model.embed_tokens.weight"]
    assert config["dtype"] == "bfloat16"
    assert "smoke" in (out / "README.md").read_text() or "draft" in (out / "README.md").read_text()


def test_draft_vocab_is_sorted_unique_and_in_range(smoke):
    target, out = smoke
    vocab = json.loads((out / "draft_vocab.json").read_text())
    ids = vocab["token_ids"]
    vocab_size = json.loads((target / "config.json").read_text())["vocab_size"]
    assert ids == sorted(set(ids)) and vocab["num_tokens"] == len(ids)
    assert 0 <= ids[0] and ids[-1] < vocab_size
    assert 0 <= vocab["coverage_heldout"] <= 1 and vocab["source"]
    assert 0 in ids                                   # the tiny target's eos


def test_safetensors_holds_layers_and_norm_in_bf16(smoke):
    from safetensors.torch import load_file

    _, out = smoke
    tensors = load_file(str(out / "model.safetensors"))
    per_layer = {"input_layernorm.weight", "post_attention_layernorm.weight",
                 "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                 "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
                 "mlp.down_proj.weight"}
    expected = {f"model.layers.{i}.{n}" for i in range(2) for n in per_layer}
    expected.add("model.norm.weight")
    assert set(tensors) == expected
    assert all(t.dtype == torch.bfloat16 for t in tensors.values())


def test_training_json_has_the_numbers(smoke):
    _, out = smoke
    report = json.loads((out / "training.json").read_text())
    assert report["seed"] == 0
    assert report["prompt_rendering"].startswith("plain")     # the tiny target has no template
    for key in ("continuation_tokens", "plain_tokens", "train_prompts_used", "held_out_prompts"):
        assert report["data"][key] > 0, key
    assert report["training"]["steps"] > 0 and math.isfinite(report["training"]["val_loss"])
    assert set(report["init_trial"]) >= {"random", "copy", "steps"}
    assert set(report["phase_seconds"]) >= {"generate_train", "train", "evaluate"}
    for row, temperature in zip(report["acceptance"], (0.0, 0.7)):
        assert row["temperature"] == temperature and len(row["a"]) == 5
        assert all(1 >= a >= b >= 0 for a, b in zip(row["a"], row["a"][1:]))
    assert all(v > 0 for v in report["cost"].values())


def test_held_out_prompts_are_never_trained_on(script, smoke):
    _, out = smoke
    shipped = json.loads((out / "heldout_prompts.json").read_text())
    assert {p["kind"] for p in shipped} == set(script.KINDS)
    train, held_out = script.split_prompts(script.build_prompts(), seed=0)
    key = lambda p: json.dumps(p["messages"], sort_keys=True)   # noqa: E731
    assert not {key(p) for p in train} & {key(p) for p in held_out}
    assert {key(p) for p in shipped} <= {key(p) for p in held_out}
    assert len(held_out) == pytest.approx(0.1 * (len(train) + len(held_out)), abs=3)


def test_loader_borrows_the_embedding_and_gives_finite_logits(script, smoke):
    from transformers import LlamaForCausalLM

    target_dir, out = smoke
    target = LlamaForCausalLM.from_pretrained(target_dir).eval()
    draft = script.load_draft_for_transformers(out, target)
    assert torch.equal(draft.model.embed_tokens.weight, target.model.embed_tokens.weight)
    assert draft.lm_head.weight is draft.model.embed_tokens.weight
    with torch.no_grad():
        logits = draft(torch.tensor([[5, 6, 7, 8]])).logits
    assert logits.shape == (1, 4, target.config.vocab_size) and torch.isfinite(logits).all()


def test_acceptance_of_a_model_with_itself_is_one(script, smoke):
    """A draft identical to the target over the full vocabulary accepts everything."""
    from transformers import LlamaForCausalLM

    target_dir, _ = smoke
    target = LlamaForCausalLM.from_pretrained(target_dir).eval()
    with torch.no_grad():
        prompt = [3, 4, 5, 6]
        cont = target.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False,
                               eos_token_id=None)[0, 4:].tolist()
    vocab = list(range(target.config.vocab_size))
    for temperature in (0.0, 0.7):
        r = script.acceptance_per_position(target, target, vocab, [(prompt, cont)], k=5,
                                           temperature=temperature, num_positions=6)
        assert r["a"] == [1.0] * 5 and r["positions"] == 6


@pytest.mark.skipif(not (TARGET_HF / "model.safetensors").exists() or not SHIPPED.exists(),
                    reason=f"needs the target in {TARGET_HF} (tools/fetch_smollm2.sh and "
                           "pagedspec-convert) and the shipped draft")
def test_shipped_draft_acceptance_matches_the_model_card(script):
    """a_1 at temperature 0 on 40 positions of 6 held-out prompts continued greedily (40 tokens) by
    the transformers target here, within 4 binomial standard errors of the card's figure (400
    positions): sd = sqrt(a(1-a)/40) is about 0.07 at a = 0.7, so the tolerance is about 0.3.
    Positions of one prompt are correlated and the slice is the start of the answers, hence 4
    standard errors rather than 2; a broken loader or vocabulary gives a_1 near 0."""
    from tokenizers import Tokenizer
    from transformers import LlamaForCausalLM

    torch.set_num_threads(2)
    report = json.loads((SHIPPED / "training.json").read_text())
    card_a1 = report["acceptance"][0]["a"][0]
    target = LlamaForCausalLM.from_pretrained(TARGET_HF).eval()
    draft = script.load_draft_for_transformers(SHIPPED, target)
    vocab = json.loads((SHIPPED / "draft_vocab.json").read_text())["token_ids"]
    tokenizer = Tokenizer.from_file(str(SHIPPED / "tokenizer.json"))
    renderer = script.PromptRenderer((TARGET_HF / "chat_template.jinja").read_text(), tokenizer)
    prompts = json.loads((SHIPPED / "heldout_prompts.json").read_text())[:6]
    sequences = []
    with torch.no_grad():
        for p in prompts:
            ids = renderer.ids(p["messages"])
            out = target.generate(torch.tensor([ids]), max_new_tokens=40, do_sample=False)
            sequences.append((ids, out[0, len(ids):].tolist()))
    r = script.acceptance_per_position(target, draft, vocab, sequences, k=5, temperature=0.0,
                                       num_positions=40, seed=1)
    sd = math.sqrt(max(card_a1 * (1 - card_a1), 0.05) / r["positions"])
    assert r["positions"] >= 30
    assert abs(r["a"][0] - card_a1) <= 4 * sd, (r["a"], card_a1)
