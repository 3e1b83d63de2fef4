"""The shipped demo pair (``pagedspec-demo``, ``pagedspec-demo-draft``): found by name, loadable
by pagedspec and by ``transformers`` with the same logits, the trained weights (held-out loss
recomputed on a slice stays near the model card's figure), and fit for speculation."""
from __future__ import annotations

import json
import math
import sysconfig
from pathlib import Path

import pytest
import torch

from checkpoints import dense_forward
from pagedspec import LLM, SamplingParams
from pagedspec.models import load_checkpoint, resolve_model_path

NAMES = ["pagedspec-demo", "pagedspec-demo-draft"]
FILES = ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
         "generation_config.json", "README.md", "training.json"]


pytestmark = pytest.mark.usefixtures("one_thread")


def held_out_text(info: dict, chars: int = 6000) -> str:
    """The start of the first held-out module the model card names."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    return (stdlib / info["corpus"]["held_out_paths"][0]).read_text()[:chars]


def test_shipped_by_name_and_small():
    dirs = [resolve_model_path(n) for n in NAMES]
    for d in dirs:
        assert all((d / f).is_file() for f in FILES), d
    size = sum((d / "model.safetensors").stat().st_size for d in dirs)
    assert size <= 40e6, f"{size / 1e6:.1f} MB"
    tokenizers = [json.loads((d / "tokenizer.json").read_text())["model"]["vocab"] for d in dirs]
    assert tokenizers[0] == tokenizers[1], "the pair must share one tokenizer"


@pytest.mark.parametrize("name", NAMES)
def test_pagedspec_and_transformers_agree(name):
    """Both load the bf16 checkpoint; in float32 the logits agree to summation order."""
    import transformers

    path = resolve_model_path(name)
    info = json.loads((path / "training.json").read_text())
    tok = transformers.PreTrainedTokenizerFast.from_pretrained(path)
    ids = tok(held_out_text(info, 1500))["input_ids"][:256]
    ckpt = load_checkpoint(name)
    assert ckpt.load_tokenizer().encode(held_out_text(info, 1500)).ids[:256] == ids
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    llm = LLM(name, dtype="float32", device="cpu", max_model_len=512)
    out = llm.generate([ids], SamplingParams(temperature=0, max_tokens=1, logprobs=5))[0]
    top = out.outputs[0].logprobs[0]
    expected = ref[-1].log_softmax(-1).topk(5)
    assert list(top)[:5] == expected.indices.tolist()
    for t, v in zip(expected.indices.tolist(), expected.values.tolist()):
        assert abs(top[t].logprob - v) < 1e-3


@pytest.mark.parametrize("name", NAMES)
def test_held_out_loss_matches_the_model_card(name):
    """Cross-entropy on a held-out slice, in bits per byte: a trained model is far below a
    random one (~log2(vocab) / bytes per token), and near the card's figure for the whole
    held-out set (a slice is easier or harder than the average by a few tenths)."""
    path = resolve_model_path(name)
    info = json.loads((path / "training.json").read_text())
    key = "target" if name == "pagedspec-demo" else "draft"
    card_bpb = info[key]["bits_per_byte"]
    text = held_out_text(info)
    ckpt = load_checkpoint(name)
    tok = ckpt.load_tokenizer()
    ids = tok.encode(text).ids[:1024]
    model = ckpt.load_model(torch.float32)
    logits = model.compute_logits(dense_forward(model, ids))
    nats = torch.nn.functional.cross_entropy(logits[:-1], torch.tensor(ids[1:]),
                                             reduction="sum").item()
    bytes_ = len(tok.decode(ids[1:]).encode())
    bpb = nats / math.log(2) / bytes_
    assert bpb < card_bpb + 0.35, (bpb, card_bpb)
    uniform = math.log2(info["tokenizer"]["vocab_size"]) * (len(ids) - 1) / bytes_
    assert bpb < 0.6 * uniform, (bpb, uniform)       # an untrained model is at ~uniform


def test_greedy_completions_look_like_python():
    llm = LLM("pagedspec-demo", dtype="float32", device="cpu", max_model_len=512)
    prompts = ["def parse_args(argv):\n", "import os\n\n\nclass Cache:\n    def __init__(self",
               "def median(data):\n    data = sorted(data)\n"]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=48))
    for o in outs:
        text = o.outputs[0].text
        assert text.strip(), o.prompt
        assert sum(c.isascii() for c in text) / len(text) > 0.95, text
        words = [w for w in ("self", "return", "if", "=", "(", ":", "\n") if w in text]
        assert len(words) >= 3, text


def test_speculation_with_the_pair_is_exact_and_accepted():
    plain = LLM("pagedspec-demo", dtype="float32", device="cpu", max_model_len=512)
    spec = LLM("pagedspec-demo", dtype="float32", device="cpu", max_model_len=512,
               speculative_model="pagedspec-demo-draft", num_speculative_tokens=4,
               speculative_adaptive=False)
    prompt = "def median(data):\n    data = sorted(data)\n    n = len(data)\n"
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    a = plain.generate(prompt, params)[0].outputs[0].token_ids
    b = spec.generate(prompt, params)[0].outputs[0].token_ids
    same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
    assert same >= 32, (same, a, b)          # float32 either way; rows batch differently
    assert spec.speculative_metrics()["acceptance_rate"] > 0.4
