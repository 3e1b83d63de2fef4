"""EAGLE draft heads: pagedspec's drafts equal an independent dense reference (the training
script's ``transformers``-built head on the target's ``transformers`` features), the checkpoint
and engine errors, and ``tools/train_eagle.py`` end to end in smoke mode.

Exactness of the emitted tokens with an EAGLE head (greedy for every k, mixed batches with
preemption and the prefix cache, the sampled distribution) is tested beside the other drafters
in ``test_speculative.py``."""
from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from checkpoints import eagle_copy, hf_model, make_checkpoint
from conftest import load_script
from pagedspec import LLM, SamplingParams
from pagedspec.engine.speculative import EagleProposer

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tools" / "train_eagle.py"
PROMPTS = ["def fibonacci(n):", "import os, sys\nclass Stack:"]
TIE = 1e-4

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def script():
    return load_script(SCRIPT)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """A target and an EAGLE head that leans on its features (a feature weight of 0.5: a row
    fed the wrong feature drafts differently)."""
    root = tmp_path_factory.mktemp("eagle")
    target = make_checkpoint(root / "target", "llama", seed=3, num_hidden_layers=3,
                             scale_outputs=0.5)
    return target, eagle_copy(target, root / "eagle", seed=1, feature_weight=0.5)


def reference_drafts(target_hf, head, lm_head: torch.Tensor, tokens: list[int], k: int
                     ) -> tuple[list[int], list[float]]:
    """EAGLE drafting done densely: the target's final hidden states of ``tokens``, the head
    teacher-forced over rows ``i = 0 .. n-2`` (token ``i + 1``, feature ``i``), then each draft
    appended as a row whose feature is the head's output at the row before. Returns the drafts
    and each one's top-2 logit margin."""
    with torch.no_grad():
        features = target_hf.model(input_ids=torch.tensor([tokens])).last_hidden_state[0]
        embedding = target_hf.model.embed_tokens.weight
        ids, feats = list(tokens[1:]), list(features[:-1])
        drafts, margins = [], []
        for _ in range(k):
            g = head(embedding[ids][None], torch.stack(feats)[None],
                     torch.arange(len(ids))[None])[0]
            top = (g[-1] @ lm_head.T).topk(2)
            drafts.append(int(top.indices[0]))
            margins.append(float(top.values[0] - top.values[1]))
            ids.append(drafts[-1])
            feats.append(g[-1])
    return drafts, margins


def spy_on_drafts(llm) -> list[tuple[list[int], list[int]]]:
    """Records every (verified tokens, drafts) the EAGLE proposer returns."""
    proposer = llm.speculator.draft_model
    assert isinstance(proposer, EagleProposer)
    calls, original = [], proposer.propose

    def propose(batch, requests):
        drafts, probs = original(batch, requests)
        calls.extend((list(r.token_ids), list(d)) for r, d in zip(requests, drafts))
        return drafts, probs

    proposer.propose = propose
    return calls


def checked_drafts(calls, target_hf, head, lm_head) -> int:
    """Compares each recorded call with the reference up to a near-tie; returns the drafts
    compared."""
    compared = 0
    for tokens, drafts in calls:
        want, margins = reference_drafts(target_hf, head, lm_head, tokens, len(drafts))
        for j, (got, exp) in enumerate(zip(drafts, want)):
            if margins[j] < TIE:
                break
            assert got == exp, f"{len(tokens)} tokens, draft {j}: {got} != {exp}"
            compared += 1
    return compared


@pytest.fixture(scope="module")
def reference(script, pair):
    target, eagle = pair
    target_hf = hf_model(target)
    config = script.head_config(target)
    head = script.EagleHead(config).float().eval()
    head.load_checkpoint_state(load_file(eagle / "model.safetensors"))
    return target_hf, head, target_hf.lm_head.weight.detach()


@pytest.mark.parametrize("k", [1, 3, 6])
def test_drafts_equal_the_dense_reference(pair, reference, k):
    """Every draft of a greedy run (prompts catching up, then a + 1 rows per step with the
    verification's features) equals the reference's."""
    target, eagle = pair
    llm = LLM(target, dtype="float32", max_model_len=256, speculative_model=eagle,
              num_speculative_tokens=k, speculative_adaptive=False, block_size=8)
    calls = spy_on_drafts(llm)
    llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    assert len(calls) > 10
    assert checked_drafts(calls, *reference) >= len(calls) // 2


def test_the_reference_catches_misplaced_features(pair, reference, monkeypatch):
    """The power of the comparison: feeding each row the feature of the position after its
    own (an off-by-one in the row layout) must fail it."""
    target, eagle = pair
    original = EagleProposer._features_at

    def shifted(self, seq_id, start, end):
        return original(self, seq_id, start + 1, end + 1)

    monkeypatch.setattr(EagleProposer, "_features_at", shifted)
    llm = LLM(target, dtype="float32", max_model_len=256, speculative_model=eagle,
              num_speculative_tokens=3, speculative_adaptive=False)
    calls = spy_on_drafts(llm)
    llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    with pytest.raises(AssertionError):
        checked_drafts(calls, *reference)


def test_eagle_checkpoint_errors(pair, tmp_path):
    """A head over another hidden size, and a head without its fc, are refused by name."""
    target, eagle = pair
    other = make_checkpoint(tmp_path / "wide", "llama", seed=4, hidden_size=128)
    with pytest.raises(ValueError, match="EAGLE head over features of size 64.*hidden size is 128"):
        LLM(other, dtype="float32", speculative_model=eagle)
    broken = eagle_copy(target, tmp_path / "broken")
    tensors = load_file(broken / "model.safetensors")
    del tensors["fc.weight"]
    from safetensors.torch import save_file
    save_file(tensors, broken / "model.safetensors")
    with pytest.raises(ValueError, match="missing tensor 'fc.weight'"):
        LLM(target, dtype="float32", speculative_model=broken)


def test_runner_refuses_features_for_a_model_without_them(pair):
    from pagedspec.engine.runner import ModelRunner

    target, _ = pair
    llm = LLM(target, dtype="float32", max_model_len=64)
    runner: ModelRunner = llm.runner
    with pytest.raises(ValueError, match="features must be given exactly"):
        runner.execute(llm.scheduler.schedule(), features=torch.zeros(1, 64))


# ---- tools/train_eagle.py -------------------------------------------------------------------
@pytest.fixture(scope="module")
def smoke(script, tmp_path_factory):
    """The script in smoke mode on a tiny target, with synthetic continuations and a token-only
    draft directory (vocabulary, held-out prompts) beside it."""
    root = tmp_path_factory.mktemp("train-eagle")
    target = make_checkpoint(root / "target", "llama", seed=5, tie_word_embeddings=True)
    rng = random.Random(0)
    gens = [{"prompt_ids": [rng.randrange(3, 320) for _ in range(rng.randrange(4, 12))],
             "output_ids": [rng.randrange(3, 320) for _ in range(rng.randrange(8, 30))],
             "mode": mode, "kind": "code"} for _ in range(10) for mode in ("greedy", "sampled")]
    (root / "generations.json").write_text(json.dumps(
        {"done": 10, "seconds": 1.0, "generations": gens}))
    token_draft = root / "token-draft"
    token_draft.mkdir()
    (token_draft / "draft_vocab.json").write_text(json.dumps(
        {"token_ids": sorted(random.Random(1).sample(range(320), 200))}))
    (token_draft / "heldout_prompts.json").write_text(json.dumps(
        [{"kind": "code", "messages": [{"role": "user", "content": p}]} for p in PROMPTS]))
    out = root / "eagle"
    assert script.main(["--smoke", "--target", str(target), "--token-draft", str(token_draft),
                        "--generations", str(root / "generations.json"), "--out", str(out),
                        "--work", str(root / "work")]) == 0
    return target, out


@pytest.mark.parametrize("passes", [2, 3])
def test_unrolled_passes_compute_what_the_engines_later_drafts_see(script, passes):
    """Pass p's row j (training-time test) equals the head run causally over what the engine's
    draft p at row j reads: the target's features up to row j - p + 1, then at each later row
    the previous pass's output of the row before it. A wrong mask or shift changes rows."""
    from transformers import LlamaConfig

    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4,
                         num_key_value_heads=2, num_hidden_layers=1, vocab_size=320)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    head = script.make_head(config, torch.rand(64) + 0.5)
    with torch.no_grad():
        head.fc.weight.normal_(0.0, 0.2)          # lean on the feature half as well
    B, T = 2, 7
    embeds, features = torch.randn(B, T, 64), torch.randn(B, T, 64)
    positions = torch.arange(T).expand(B, -1)
    with torch.no_grad():
        outs = head.unrolled(embeds, features, positions, passes)
        assert len(outs) == passes
        torch.testing.assert_close(outs[0], head(embeds, features, positions))
        for p in range(2, passes + 1):
            for j in range(p - 1, T):
                fed = features[:, :j + 1].clone()
                for q in range(2, p + 1):         # draft q sits at row j - (p - q)
                    row = j - (p - q)
                    fed[:, row] = outs[q - 2][:, row - 1]
                want = head(embeds[:, :j + 1], fed, positions[:, :j + 1])[:, j]
                torch.testing.assert_close(outs[p - 1][:, j], want, atol=1e-5, rtol=1e-5)


def test_smoke_run_writes_a_loadable_head(smoke):
    target, out = smoke
    config = json.loads((out / "config.json").read_text())
    assert config["num_hidden_layers"] == 1 and config["pagedspec_eagle"]["fc"] == "fc.weight"
    assert config["pagedspec_borrowed_weights"] == ["model.embed_tokens.weight"]
    tensors = load_file(out / "model.safetensors")
    assert tensors["fc.weight"].shape == (64, 128) and tensors["fc.weight"].dtype == torch.bfloat16
    assert not any(n.startswith(("model.embed_tokens", "lm_head")) for n in tensors)
    report = json.loads((out / "training.json").read_text())
    assert report["training"]["steps"] > 0 and report["data"]["val_sequences"] > 0
    assert [r["temperature"] for r in report["acceptance"]] == [0.0, 0.7]
    assert all(r["drafts"] > 0 and len(r["a"]) == 5 for r in report["acceptance"])
    assert "EAGLE" in (out / "README.md").read_text()


def test_smoke_second_stage_continues_a_head_and_names_it(script, smoke, tmp_path):
    """--init-head with --passes 2: the run starts from the saved head, and its report and card
    carry the starting head's command and acceptance (reproducing needs both stages)."""
    target, first = smoke
    work = first.parent
    out = tmp_path / "eagle-2"
    assert script.main(["--smoke", "--target", str(target), "--token-draft",
                        str(work / "token-draft"), "--generations",
                        str(work / "generations.json"), "--out", str(out), "--work",
                        str(work / "work"), "--init-head", str(first), "--passes", "2"]) == 0
    report = json.loads((out / "training.json").read_text())
    before = json.loads((first / "training.json").read_text())
    assert report["init_command"] == before["command"]
    assert report["stage1"]["acceptance"] == before["acceptance"]
    assert "p2_top1" in report["training"]["val_history"][-1]
    card = (out / "README.md").read_text()
    assert "The head this run started from" in card and before["command"] in card


def test_transformers_assisted_generation_refuses_a_head(pair):
    from pagedspec.models import CheckpointError
    from pagedspec.models.transformers_draft import load_draft_in_transformers

    target, eagle = pair
    with pytest.raises(CheckpointError, match="EAGLE head"):
        load_draft_in_transformers(eagle, hf_model(target))


def test_shipped_head_drafts_for_smollm2():
    """The shipped head beside SmolLM2 (when the target has been fetched): greedy output equal
    to plain decoding, and first-draft acceptance on a few held-out prompts near its card's
    (0.49 over 48 prompts; 0.3 leaves room for the small slice)."""
    from pagedspec.bench.e2e_spec import chat_renderer, render
    from pagedspec.models.loader import cached_model

    if cached_model("smollm2-135m") is None:
        pytest.skip("smollm2-135m is not fetched (tools/fetch_smollm2.sh)")
    head = ROOT / "python" / "pagedspec" / "models" / "data" / "smollm2-135m-eagle"
    prompts = json.loads((head / "heldout_prompts.json").read_text())[:4]
    params = SamplingParams(temperature=0, max_tokens=32)
    plain = LLM("smollm2-135m", dtype="float32", max_model_len=512)
    ids = [render(chat_renderer(plain), p["messages"]) for p in prompts]
    want = [o.outputs[0].token_ids for o in plain.generate(ids, params)]
    llm = LLM("smollm2-135m", dtype="float32", max_model_len=512,
              speculative_model="smollm2-135m-eagle", num_speculative_tokens=2,
              speculative_adaptive=False)
    assert [o.outputs[0].token_ids for o in llm.generate(ids, params)] == want
    assert llm.speculative_metrics()["acceptance_rate_per_position"][0] > 0.3
