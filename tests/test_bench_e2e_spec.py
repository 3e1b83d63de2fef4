"""The speculative section of the main job (pagedspec.bench.e2e_spec) on tiny models in seconds: a
chat target and a reduced-vocabulary draft that borrows its embedding (the shipped SmolLM2
draft's form) with held-out chat prompts, through every kind of configuration, the transformers
peer (plain, assisted with the same draft, prompt lookup) and the report; and its pieces."""
from __future__ import annotations

import json
import random

import pytest
import torch

from checkpoints import make_checkpoint
from pagedspec.bench import e2e_spec
from test_bench_e2e import CHAT_TEMPLATE
from test_speculative import first_layer_copy, reduced_copy

pytestmark = pytest.mark.usefixtures("one_thread")

HELD_OUT = [{"kind": "instruction", "messages": [{"role": "user", "content": "Say hello."}]},
            {"kind": "code", "messages": [{"role": "user", "content": "def add(a, b):"}]},
            {"kind": "chat", "messages": [{"role": "user", "content": "Hi"},
                                          {"role": "assistant", "content": "Hello!"},
                                          {"role": "user", "content": "How are you?"}]}]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("spec-bench")
    target = make_checkpoint(root / "target", "llama", seed=3, scale_outputs=0.5,
                             tie_word_embeddings=True, logit_scale=4.0)
    (target / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    draft = reduced_copy(first_layer_copy(target, root / "full"), root / "draft",
                         random.Random(0).sample(range(320), 240))
    (draft / e2e_spec.HELD_OUT_FILE).write_text(json.dumps(HELD_OUT))
    return target, draft


def test_quick_run_covers_every_configuration_and_the_peer(pair):
    target, draft = pair
    report = e2e_spec.run(torch.device("cpu"), target, draft, quick=True, batches=(1, 2),
                          repeats=1, max_tokens=6)
    assert list(report.setup["workloads"]) == ["held-out"]          # quick: one workload
    cells = {(r["batch"], r["config"]) for r in report.rows}
    expected = {(1, c.name) for c in e2e_spec.configs("held-out", 0.0, 1, True)}
    expected |= {(2, c.name) for c in e2e_spec.configs("held-out", 0.0, 2, True)}
    assert cells == expected | {(1, "plain"), (2, "plain")}
    for r in report.rows:
        assert r["output_tok_s"] > 0
        if r["config"] == "plain":
            continue
        assert r["speedup"] > 0 and 1.0 <= r["mean_acceptance_length"]
        assert r["agree"] == 1.0, r          # greedy speculation reproduces plain decoding
        if r["config"].startswith("draft k="):
            assert r["draft_pass_over_step"] > 0 and r["predicted_speedup"] > 0
            assert len(r["acceptance_per_position"]) == r["k"]
    assert [(p["workload"], p["config"]) for p in report.peer] == [
        ("held-out", "generate"), ("held-out", "assisted (draft)"),
        ("held-out", "prompt lookup")]
    assert all(p["tokens"] > 0 for p in report.peer)
    table = e2e_spec.markdown_table(report)
    assert "misaligned adaptive" in table and "assisted (draft)" in table


def test_only_filters_configurations_but_keeps_plain(pair):
    target, draft = pair
    report = e2e_spec.run(torch.device("cpu"), target, draft, quick=True, batches=(1,),
                          repeats=1, max_tokens=4, only="adaptive")
    assert [r["config"] for r in report.rows] == ["plain", "draft adaptive", "ngram adaptive"]


@pytest.mark.parametrize("ignore_eos", [False, True])
def test_ignore_eos_makes_every_request_generate_max_tokens(pair, monkeypatch, ignore_eos):
    """--ignore-eos: every request, plain or speculative, generates max_tokens tokens, past
    the end of its turn (sampled runs of two engines then do the same work whatever they emit);
    without it the held-out chats stop at theirs."""
    target, draft = pair
    made = []
    sampling_params = e2e_spec.sampling_params

    def recording(*args, **kwargs):
        out = sampling_params(*args, **kwargs)
        made.extend(out)
        return out

    monkeypatch.setattr(e2e_spec, "sampling_params", recording)
    report = e2e_spec.run(torch.device("cpu"), target, draft, quick=True, batches=(2,),
                          repeats=1, max_tokens=5, temperatures=(0.7,), only="draft adaptive",
                          ignore_eos=ignore_eos)
    assert report.setup["ignore_eos"] is ignore_eos
    described = "5 tokens each (--ignore-eos)" in report.setup["workloads"]["held-out"][
        "description"]
    assert described is ignore_eos
    assert made and {p.ignore_eos for p in made} == {ignore_eos}


def test_workloads_render_the_held_out_prompts_and_the_grounded_task(pair):
    from pagedspec import LLM

    target, draft = pair
    llm = LLM(str(target), dtype="float32", device="cpu")
    held_out, grounded = e2e_spec.spec_workloads(target, draft, llm, quick=False)
    assert len(held_out.prompts) == len(HELD_OUT) and held_out.stop
    text = llm.tokenizer.decode(held_out.prompts[2])
    assert "Hello!" in text and "How are you?" in text
    assert len(grounded.prompts) == 8
    passage = llm.tokenizer.decode(grounded.prompts[0])
    assert e2e_spec.GROUNDED_INSTRUCTION.strip()[:20] in passage


def test_typos_change_words_not_their_letters():
    text = " ".join(["documentation", "interpreter", "object", "value", "is", "a"] * 20)
    typo = e2e_spec.with_typos(text, random.Random(1))
    assert typo != text
    pairs = list(zip(text.split(" "), typo.split(" ")))
    assert len(pairs) == 120
    assert all(sorted(a) == sorted(b) and a[0] == b[0] and a[-1] == b[-1] for a, b in pairs)
    assert 0 < sum(a != b for a, b in pairs) < 40


def test_configs_keep_the_misaligned_draft_off_batch_one():
    for temperature in (0.0, 0.7):
        assert not any(c.spec == "misaligned" for c in e2e_spec.configs("held-out", temperature,
                                                                          1, False))
    assert any(c.spec == "misaligned" for c in e2e_spec.configs("held-out", 0.0, 64, False))
    assert all(c.adaptive for c in e2e_spec.configs("held-out", 0.7, 32, False))


def test_transformers_draft_matches_pagedspecs_first_layer_copy(pair):
    """The borrowing draft in transformers (its embedding filled from the target) computes
    what the unreduced first-layer copy it came from computes."""
    from checkpoints import hf_model
    from pagedspec.models import CheckpointError
    from pagedspec.models.transformers_draft import load_draft_in_transformers

    target, draft = pair
    hf_target = hf_model(target)
    ours = load_draft_in_transformers(draft, hf_target)
    full = hf_model(draft.parent / "full")
    ids = torch.tensor([[5, 17, 99, 3, 250]])
    with torch.no_grad():
        torch.testing.assert_close(ours(ids).logits, full(ids).logits)
    with pytest.raises(CheckpointError, match="does not have"):
        load_draft_in_transformers(draft, torch.nn.Linear(2, 2))
