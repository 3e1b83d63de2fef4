"""The end-to-end section of the main job (pagedspec.bench.e2e) on tiny models in seconds: every
workload in both dtypes on pagedspec and transformers, the chat workload through a template, the
profiled step split, the report; and the small pieces (stop-token cuts, vLLM's interpreter)."""
from __future__ import annotations

import pytest
import torch

from checkpoints import make_checkpoint
from pagedspec.bench import e2e

pytestmark = pytest.mark.usefixtures("one_thread")

CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}"
                 "{{ eos_token }}{% endfor %}{% if add_generation_prompt %}<|assistant|>"
                 "{% endif %}")


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    path = make_checkpoint(tmp_path_factory.mktemp("e2e") / "chat", "llama", seed=11)
    (path / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    return path


def test_quick_section_runs_every_workload_in_both_dtypes(chat_model):
    report = e2e.run(torch.device("cpu"), model=str(chat_model), quick=True, threads=1,
                     vllm_python_path="none")
    names = [w.name for w in e2e.workloads(quick=True)]
    assert [(r["dtype"], r["workload"]) for r in report.rows] == [
        (d, n) for d in e2e.DTYPES for n in names]
    for r in report.rows:
        for engine in ("pagedspec", "transformers"):
            assert r[f"{engine}_s"] > 0 and r[f"{engine}_output_tokens"] > 0
            if not r["chat"]:      # fixed lengths: every engine produced exactly max_tokens
                assert r[f"{engine}_output_tokens"] == r["max_output_tokens"]
            else:
                assert r[f"{engine}_output_tokens"] <= r["max_output_tokens"]
        assert "vllm_s" not in r
        # float32 greedy tokens equal transformers' (the model is tiny and its logits peaked);
        # bfloat16 may flip near-ties, so only float32 is held to it.
        if r["dtype"] == "float32":
            assert r["transformers_agree"] == 1.0, r["workload"]
    # The profiled split finds the GEMMs and the attention op by name: a renamed op would show
    # up as zero here instead of silently moving into "other".
    assert [(s["dtype"], s["batch"]) for s in report.splits] == [
        (d, b) for d in e2e.DTYPES for b in (1, e2e.MAX_NUM_SEQS)]
    for s in report.splits:
        assert s["gemm_ms"] > 0 and s["attention_ms"] > 0 and s["other_ops_ms"] >= 0
        assert s["gemm_ms"] + s["attention_ms"] + s["other_ops_ms"] <= s["step_ms"] * 1.05
        assert s["weights_stream_ms"] > 0
    chats = [x for x in report.samples if x["workload"] == "chat"]
    assert len(chats) == 3 * len(e2e.DTYPES) and chats[0]["prompt"] == e2e.CHAT_QUESTIONS[0]
    table = e2e.markdown_table(report)
    for text in ("### bfloat16", "### float32", "What bounds a step", "Completions",
                 "vLLM: not run here"):
        assert text in table


def test_compiled_run_warms_up_every_kind_of_step_and_matches_transformers(chat_model):
    torch._dynamo.reset()
    report = e2e.run(torch.device("cpu"), model=str(chat_model), quick=True, threads=1,
                     vllm_python_path="none", dtypes=["float32"], compile=True,
                     workload_names=["decode-b1", "decode-b32"])
    assert report.setup["compile"] and report.setup["pagedspec_warmup_s"]["float32"] > 0
    assert [r["transformers_agree"] for r in report.rows] == [1.0, 1.0]
    assert "compiled forward, warm-up float32" in e2e.markdown_table(report)


def test_chat_prompts_match_transformers_rendering(chat_model):
    from pagedspec import LLM

    llm = LLM(str(chat_model), dtype="float32", device="cpu", max_model_len=256)
    w = next(w for w in e2e.workloads(quick=True) if w.chat)
    prompts = e2e.chat_prompts(llm, chat_model, w)
    assert len(prompts.token_ids) == len(w.output_lens)
    assert prompts.stop_token_ids == [2]
    text = llm.engine.tokenizer.decode(prompts.token_ids[1], skip_special_tokens=False)
    assert text.startswith("<s><|user|>" + e2e.CHAT_QUESTIONS[1]) and text.endswith(
        "</s><|assistant|>")
    # A template transformers renders differently is refused, not measured.
    (chat_model / "chat_template.jinja").write_text(CHAT_TEMPLATE.replace("{{ bos_token }}", ""))
    try:
        skewed = LLM(str(chat_model), dtype="float32", device="cpu", max_model_len=256)
        skewed.checkpoint.chat_template = CHAT_TEMPLATE      # pagedspec keeps the old one
        with pytest.raises(RuntimeError, match="renders"):
            e2e.chat_prompts(skewed, chat_model, w)
    finally:
        (chat_model / "chat_template.jinja").write_text(CHAT_TEMPLATE)


@pytest.mark.parametrize("tokens, stop, cap, expected", [
    ([5, 6, 2, 0, 0], [2], 5, [5, 6, 2]),
    ([5, 6, 7], [2], 2, [5, 6]),
    ([2, 2], [2], 4, [2]),
    ([5, 6, 2], [], 3, [5, 6, 2]),
])
def test_until_stop(tokens, stop, cap, expected):
    assert e2e.until_stop(tokens, stop, cap) == expected


def test_vllm_python_choice(tmp_path):
    assert e2e.vllm_python("none") is None
    assert e2e.vllm_python(str(tmp_path / "python")) == tmp_path / "python"


@pytest.mark.parametrize("kwargs, match", [
    (dict(workload_names=["decode-b1", "decode-b64"]), "workloads must be among"),
    (dict(dtypes=["float16"]), "dtypes must be among"),
])
def test_bad_selections_are_refused_before_loading(kwargs, match):
    with pytest.raises(ValueError, match=match):
        e2e.run(torch.device("cpu"), model="/nonexistent", quick=True, threads=1,
                vllm_python_path="none", **kwargs)
