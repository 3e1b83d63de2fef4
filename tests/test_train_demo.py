"""``tools/train_demo_models.py`` end to end in smoke mode (tiny models, a few steps, seconds): the
corpus split, the files it writes, and that both checkpoints load in ``transformers`` and in
pagedspec, whose greedy tokens and logprobs must be those of ``transformers``."""
from __future__ import annotations

import json
import math
import subprocess
import sys
import sysconfig
from pathlib import Path

import numpy as np
import pytest
import torch

from pagedspec import LLM, SamplingParams
from pagedspec.models import load_checkpoint
from conftest import load_script

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tools" / "train_demo_models.py"
FILES = ["config.json", "model.safetensors", "generation_config.json", "tokenizer.json",
         "tokenizer_config.json", "training.json", "README.md"]
CODE = 'def mean(xs):\n    """The mean."""\n    return sum(xs) / len(xs)  # ünïcode\n'


@pytest.fixture(scope="module")
def out(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("demo")
    command = [sys.executable, str(SCRIPT), "--smoke", "--threads", "1", "--out", str(out)]
    proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return out


@pytest.fixture(scope="module")
def script():
    """The script as a module, for its functions."""
    return load_script(SCRIPT)


def test_held_out_modules_exist_and_stay_out_of_training(script):
    corpus = script.load_corpus(Path(sysconfig.get_paths()["stdlib"]), None, None)
    for entry in script.HELD_OUT:
        assert any(script.matches(f, entry) for f in corpus.held_out_files), entry
    assert not set(corpus.train_files) & set(corpus.held_out_files)
    assert all(not any(script.matches(f, e) for e in script.HELD_OUT) for f in corpus.train_files)
    assert corpus.train_files == sorted(corpus.train_files) and len(corpus.train_files) > 300
    assert not any(part in ("test", "tests", "site-packages")
                   for f in corpus.train_files for part in f.split("/")[:-1])


def test_lr_schedule_warms_up_then_decays_to_a_tenth(script):
    lrs = [script.lr_at(s, 100, 10, 1.0) for s in range(101)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(lrs[9:], lrs[10:]))
    assert lrs[100] == pytest.approx(0.1)


@pytest.mark.parametrize("name", ["pagedspec-demo", "pagedspec-demo-draft"])
def test_smoke_run_writes_a_checkpoint(out, name):
    path = out / name
    assert sorted(p.name for p in path.iterdir()) == sorted(FILES)
    report = json.loads((path / "training.json").read_text())
    assert report == json.loads((out / "pagedspec-demo" / "training.json").read_text())
    for model in ("target", "draft"):
        r = report[model]
        assert r["steps"] == 5 and r["tokens"] == 5 * report["batch_size"] * report["seq_len"]
        assert r["parameters"] > 0 and math.isfinite(r["val_loss"]) and r["bits_per_byte"] > 0
    assert all(0 <= report["acceptance"][t] <= 1 for t in ("temperature_0", "temperature_1"))
    assert report["corpus"]["held_out_paths"] and report["seed"] == 0
    card = (path / "README.md").read_text()
    assert "Python " + report["corpus"]["python"] in card and report["command"] in card
    assert json.loads((path / "generation_config.json").read_text())["eos_token_id"] == 0
    assert json.loads((path / "config.json").read_text())["dtype"] == "bfloat16"


@pytest.mark.parametrize("name", ["pagedspec-demo", "pagedspec-demo-draft"])
def test_loads_in_transformers(out, name):
    import transformers

    path = out / name
    hf = transformers.AutoModelForCausalLM.from_pretrained(path)
    assert hf.config.tie_word_embeddings and hf.config.head_dim == 64
    tok = transformers.PreTrainedTokenizerFast.from_pretrained(path)
    assert (tok.eos_token_id, tok.pad_token_id, tok.bos_token_id) == (0, 1, None)
    ids = tok(CODE)["input_ids"]
    assert 0 not in ids and tok.decode(ids) == CODE


@pytest.mark.parametrize("name", ["pagedspec-demo", "pagedspec-demo-draft"])
def test_pagedspec_greedy_equals_transformers(out, name):
    import transformers

    path = out / name
    ck = load_checkpoint(path)
    assert ck.generation.eos_token_ids == (0,) and ck.config.head_size == 64
    ck.load_model(torch.float32)
    prompt = ck.load_tokenizer().encode(CODE).ids
    assert ck.load_tokenizer().decode(prompt) == CODE

    llm = LLM(path, dtype="float32", device="cpu", max_model_len=128, max_num_seqs=2)
    got = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True,
                                                logprobs=1), use_tqdm=False)[0].outputs[0]
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    with torch.no_grad():
        seq = hf.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False,
                          pad_token_id=1)
        logprobs = torch.log_softmax(hf(seq).logits[0, len(prompt) - 1:-1].float(), -1)
    expected = seq[0, len(prompt):].tolist()
    assert got.token_ids == expected
    for token, entry, row in zip(expected, got.logprobs, logprobs):
        assert entry[token].logprob == pytest.approx(float(row[token]), abs=1e-4)


def test_time_budget_sets_the_step_count(script):
    torch.manual_seed(0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)                 # a shared machine's busy cores do not stall it
    try:
        model = script.make_model(script.Sizes(64, 1, 1, 1, 128), 300, 64, 128)
        data = torch.randint(2, 300, (5000,)).numpy()
        val = script.windows(data[:200], 32)[:2]
        result = script.train(model, script.next_token_loss(model), data, val, eos_id=0,
                              rng=np.random.default_rng(0), batch=2, seq_len=32, lr=1e-3,
                              warmup=2, weight_decay=0.1, steps=None, budget_s=1.5, evals=3,
                              bf16=False, desc="budget")
    finally:
        torch.set_num_threads(threads)
    assert result.steps >= script.PROBE_STEPS
    assert result.seconds < 1.5 * 1.5 + 0.5             # the schedule ends with the budget
    assert result.val_history[-1]["step"] == result.steps
    assert result.tokens == result.steps * 2 * 32
    assert len(result.val_history) == 1 + 3           # before the first step, then evals=3
