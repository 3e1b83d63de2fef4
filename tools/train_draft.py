"""Trains a draft model for speculative decoding with the target SmolLM2-135M-Instruct (or any
Llama-architecture target pagedspec loads), by self-distillation on the target's own answers plus
plain Python source. Seeded and rerunnable on a 2-core CPU in about 90 minutes.

Recipe:

1. Prompts, built here without downloads: instruction templates x topics, two-turn chats (the
   first assistant turn is a fixed short text), and code tasks (write a function from a stdlib
   function's signature and docstring, explain a stdlib function, fix a bug planted in one,
   small classic exercises). They are rendered with the target's chat template and split by a
   seeded shuffle per kind: :data:`HELD_OUT_FRACTION` of each kind is held out and never trained
   on; the first :data:`HELD_OUT_EVAL_PER_KIND` held-out prompts of each kind are evaluated and
   shipped as ``heldout_prompts.json``.
2. Target continuations with pagedspec's engine (float32): for each training prompt, in seeded
   order, one greedy and one temperature-0.7 continuation of at most ``--max-new-tokens`` tokens,
   until ``--gen-minutes`` runs out; the held-out prompts get one greedy continuation (for the
   vocabulary coverage, the validation loss and the acceptance rates only).
3. Plain text: the stdlib's ``*.py`` files (tests excluded) in seeded order, cut into windows of
   ``--seq-len`` tokens, until they make ``--plain-fraction`` of the training tokens.
4. Draft vocabulary (FR-Spec): the N most frequent token ids of the training data plus the special
   tokens the target emitted; N is the smallest of :data:`VOCAB_CHOICES` whose coverage of the
   held-out continuations reaches :data:`MIN_COVERAGE`.
5. Draft: the target's ``LlamaForCausalLM`` config with 2 decoder layers. Its embedding, and so
   its tied head, is the target's, frozen and borrowed at load time (not saved). Loss: next-token
   cross-entropy over the reduced vocabulary on the continuation tokens (prompts are context
   only) and on every plain-text token; labels outside the vocabulary are ignored. Random
   initialization and a copy of the target's layers 0-1 are compared on a short run first.
   AdamW, warmup then cosine to 10% of the peak, gradient clipping 1.0, float32; the step count
   comes from ``--train-minutes`` (the first steps are timed).
6. The draft is saved in bf16 (2 layers + final norm) and the saved weights are evaluated:
   acceptance per draft position at temperature 0 and 0.7 (:func:`acceptance_per_position`) and
   the cost of one forward, with ``transformers``.

    .venv/bin/python tools/train_draft.py                   # ~75 minutes on a 2-core CPU
    .venv/bin/python tools/train_draft.py --smoke --target DIR --out /tmp/d   # seconds
"""
from __future__ import annotations

import argparse
import collections
import importlib
import inspect
import json
import os
import platform
import shlex
import shutil
import sys
import sysconfig
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional, Sequence

import numpy as np
import torch
import torch.nn.functional as F

# The demo pair's recipe, beside this file, for the pieces both recipes share (also when this
# file is loaded by path, as its tests do).
sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_demo_models import SKIP_DIRS, cpu_name, lr_at, make_optimizer  # noqa: E402

EMBEDDING = "model.embed_tokens.weight"
BORROWED_KEY = "pagedspec_borrowed_weights"
DRAFT_LAYERS = 2
KINDS = ("instruction", "chat", "code")
HELD_OUT_FRACTION = 0.1
HELD_OUT_EVAL_PER_KIND = 16
VOCAB_CHOICES = (4096, 8192, 16384)
MIN_COVERAGE = 0.97
SAMPLE_TEMPERATURE = 0.7
MAX_PROMPT_TOKENS = 256           # so that prompt + continuation fits one training sequence
PROBE_STEPS = 6                   # steps timed before the budgeted schedule is fixed
FALLBACK_TEMPLATE = "plain 'User: ...\\nAssistant:' rendering (the target has no chat template)"
SMOKE = dict(kv_cache_gib=0.1, gen_minutes=0.3, train_minutes=0.05, init_trial_steps=3,
             max_new_tokens=8,
             max_prompts=24, tokens_per_step=1024, eval_positions=8, cost_steps=2,
             vocab_choices="64,128,256", max_plain_files=5, eval_per_kind=2, evals=2,
             warmup_steps=2)

# ---- prompts --------------------------------------------------------------------------------
TOPICS = [
    "photosynthesis", "black holes", "the water cycle", "climate change", "the French Revolution",
    "the Roman Empire", "machine learning", "the internet", "vaccines", "volcanoes",
    "plate tectonics", "the human heart", "electric cars", "solar energy", "the stock market",
    "inflation", "democracy", "the printing press", "the theory of evolution", "DNA",
    "the Moon", "Mars exploration", "honey bees", "coral reefs", "rainforests", "earthquakes",
    "the immune system", "sleep", "meditation", "healthy eating", "running", "chess",
    "classical music", "jazz", "the Renaissance", "ancient Egypt", "the Silk Road",
    "World War I", "the Industrial Revolution", "cloud computing", "cryptography",
    "blockchain", "quantum computing", "renewable energy", "recycling", "urban gardening",
    "coffee", "bread baking", "time management", "public speaking", "learning a new language",
    "the Pythagorean theorem", "prime numbers", "probability", "gravity", "magnetism",
    "the speed of light", "weather forecasting", "the Olympic Games", "photography",
]
INSTRUCTION_TEMPLATES = [
    "Explain {topic} in simple terms.",
    "What are the main advantages and disadvantages of {topic}?",
    "Write a short paragraph about {topic}.",
    "Give me three interesting facts about {topic}.",
    "How would you explain {topic} to a ten-year-old?",
    "Summarize the history of {topic} in a few sentences.",
    "List five key terms related to {topic} and define each one.",
    "What are common misconceptions about {topic}?",
    "Write a short poem about {topic}.",
    "What should a beginner learn first about {topic}?",
]
CHAT_OPENERS = ["Can you tell me about {topic}?",
                "I want to understand {topic}. Where do I start?",
                "Why do people care about {topic}?"]
CHAT_FIRST_ANSWER = ("{Topic} is a broad subject. In short: it has a few core ideas, a history "
                     "worth knowing, and many practical uses today. Which part interests you?")
CHAT_FOLLOW_UPS = ["Can you give a concrete example?", "Can you make that shorter?",
                   "Why does that matter in everyday life?",
                   "Explain the most important idea in more detail.",
                   "What is a good way to learn more about it?"]
CODE_EXERCISES = [
    "reverses a string", "checks whether a string is a palindrome", "computes the factorial of n",
    "returns the n-th Fibonacci number", "counts the vowels in a string",
    "finds the largest element of a list", "removes duplicates from a list while keeping order",
    "merges two sorted lists", "checks whether a number is prime",
    "computes the greatest common divisor of two integers", "flattens a nested list",
    "counts word frequencies in a text", "converts Celsius to Fahrenheit",
    "performs binary search on a sorted list", "sorts a list with bubble sort",
    "transposes a matrix given as a list of lists", "checks whether two strings are anagrams",
    "returns the sum of the digits of an integer", "finds the second smallest number in a list",
    "capitalizes the first letter of every word in a sentence", "reads a CSV file into a list of "
    "dictionaries", "validates an email address with a regular expression",
    "computes the mean and median of a list", "rotates a list by k positions",
    "implements a stack class with push, pop and peek", "counts the lines of a text file",
    "finds all pairs in a list that sum to a target", "converts a Roman numeral to an integer",
    "checks whether parentheses in a string are balanced", "chunks a list into pieces of size n",
]
CODE_LANGUAGES = ["Python", "JavaScript"]
CODE_MODULES = ["bisect", "calendar", "colorsys", "copy", "csv", "difflib", "fnmatch", "fractions",
                "functools", "glob", "heapq", "html", "ipaddress", "ntpath", "posixpath", "pprint",
                "random", "shlex", "shutil", "statistics", "string", "textwrap", "tokenize",
                "urllib.parse", "base64", "quopri", "gettext", "mimetypes", "json", "zipfile"]
BUG_PLANTS = [(" == ", " != "), (" < ", " <= "), (" > ", " >= "), ("+ 1", "- 1"),
              (" and ", " or "), ("return True", "return False"), (" not in ", " in ")]


def user(content: str) -> dict:
    return {"role": "user", "content": content}


def instruction_prompts() -> list[dict]:
    return [{"kind": "instruction", "messages": [user(t.format(topic=topic))]}
            for topic in TOPICS for t in INSTRUCTION_TEMPLATES]


def chat_prompts() -> list[dict]:
    """Two user turns around a fixed first answer; each topic gets every opener with a follow-up
    chosen by position, so the follow-ups rotate."""
    prompts = []
    for i, topic in enumerate(TOPICS):
        for j, opener in enumerate(CHAT_OPENERS):
            follow_up = CHAT_FOLLOW_UPS[(i + j) % len(CHAT_FOLLOW_UPS)]
            answer = CHAT_FIRST_ANSWER.format(Topic=topic[0].upper() + topic[1:])
            prompts.append({"kind": "chat", "messages": [
                user(opener.format(topic=topic)), {"role": "assistant", "content": answer},
                user(follow_up)]})
    return prompts


def stdlib_functions() -> list:
    """Public pure-Python functions with a docstring of :data:`CODE_MODULES`, sorted by name."""
    found = []
    for name in CODE_MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        for attr, obj in sorted(vars(module).items()):
            if (inspect.isfunction(obj) and obj.__module__ == module.__name__
                    and not attr.startswith("_") and inspect.getdoc(obj)):
                found.append(obj)
    return found


def short_source(func) -> Optional[str]:
    """The function's dedented source when it has 4 to 25 lines, else None."""
    try:
        source = textwrap.dedent(inspect.getsource(func))
    except (OSError, TypeError):
        return None
    return source if 4 <= source.count("\n") <= 25 else None


def plant_bug(source: str) -> Optional[str]:
    """``source`` with the first applicable :data:`BUG_PLANTS` replacement made once."""
    for old, new in BUG_PLANTS:
        if old in source:
            return source.replace(old, new, 1)
    return None


def code_prompts() -> list[dict]:
    prompts = []
    for func in stdlib_functions():
        name = f"{func.__name__}{inspect.signature(func)}"
        summary = inspect.getdoc(func).strip().split("\n\n")[0].replace("\n", " ")
        prompts.append(user(f"Write a Python function `{name}`. What it should do: {summary}"))
        source = short_source(func)
        if source is None:
            continue
        prompts.append(user(f"Explain what this Python function does:\n\n```python\n{source}```"))
        buggy = plant_bug(source)
        if buggy is not None:
            prompts.append(user("The following Python function has a bug. Find the bug and show "
                                f"the corrected code.\n\n```python\n{buggy}```"))
    prompts += [user(f"Write a {language} function that {task}.")
                for task in CODE_EXERCISES for language in CODE_LANGUAGES]
    return [{"kind": "code", "messages": [m]} for m in prompts]


def build_prompts() -> list[dict]:
    """Every prompt once (modules like posixpath and ntpath share functions): a duplicate split
    across training and held-out would leak."""
    seen, unique = set(), []
    for p in instruction_prompts() + chat_prompts() + code_prompts():
        key = json.dumps(p["messages"], sort_keys=True)
        if key not in seen:
            seen.add(key)
            unique.append(p)
    return unique


def split_prompts(prompts: Sequence[dict], seed: int) -> tuple[list[dict], list[dict]]:
    """(training, held-out): per kind, a seeded shuffle whose first :data:`HELD_OUT_FRACTION`
    is held out. The held-out list is ordered kind by kind in shuffled order."""
    rng = np.random.default_rng([seed, 1])
    train, held_out = [], []
    for kind in KINDS:
        same = [p for p in prompts if p["kind"] == kind]
        order = rng.permutation(len(same))
        cut = max(1, round(HELD_OUT_FRACTION * len(same)))
        held_out += [same[i] for i in order[:cut]]
        train += [same[i] for i in order[cut:]]
    shuffled = np.random.default_rng([seed, 2]).permutation(len(train))
    return [train[i] for i in shuffled], held_out


def eval_prompts(held_out: Sequence[dict], per_kind: int) -> list[dict]:
    """The first ``per_kind`` held-out prompts of each kind, kinds interleaved."""
    by_kind = [[p for p in held_out if p["kind"] == kind][:per_kind] for kind in KINDS]
    return [p for group in zip(*by_kind) for p in group]


class PromptRenderer:
    """Renders messages with the target's chat template (Jinja), or the plain fallback."""

    def __init__(self, template: Optional[str], tokenizer):
        self.tokenizer = tokenizer
        self.template = None
        if template is not None:
            import jinja2

            env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
            self.template = env.from_string(template)

    def text(self, messages: Sequence[dict]) -> str:
        if self.template is not None:
            return self.template.render(messages=messages, add_generation_prompt=True)
        turns = [f"{m['role'].capitalize()}: {m['content']}\n" for m in messages]
        return "".join(turns) + "Assistant:"

    def ids(self, messages: Sequence[dict]) -> list[int]:
        return self.tokenizer.encode(self.text(messages), add_special_tokens=False).ids


# ---- target continuations -------------------------------------------------------------------
@dataclass
class Generation:
    prompt_ids: list[int]
    output_ids: list[int]
    mode: str                        # "greedy" or "sampled"
    kind: str


def generate_chunk(llm, prompt_ids: Sequence[list[int]], kinds: Sequence[str],
                   modes: Sequence[str], max_new_tokens: int, seed: int,
                   first_index: int) -> list[Generation]:
    """One engine call; sampled request i is seeded with ``(seed, first_index + i)``."""
    from pagedspec import SamplingParams

    requests, params = [], []
    for i, ids in enumerate(prompt_ids):
        for mode in modes:
            temperature = 0.0 if mode == "greedy" else SAMPLE_TEMPERATURE
            request_seed = None if mode == "greedy" else seed * 1_000_003 + first_index + i
            requests.append((ids, kinds[i], mode))
            params.append(SamplingParams(temperature=temperature, max_tokens=max_new_tokens,
                                         seed=request_seed))
    outs = llm.generate([r[0] for r in requests], params, use_tqdm=False)
    return [Generation(list(ids), list(o.outputs[0].token_ids), mode, kind)
            for (ids, kind, mode), o in zip(requests, outs)]


def generate_training_data(llm, prompt_ids: Sequence[list[int]], kinds: Sequence[str], *,
                           max_new_tokens: int, seed: int, budget_s: float,
                           chunk: int) -> tuple[list[Generation], int]:
    """Greedy + sampled continuations of the prompts, chunk by chunk, until the next chunk would
    end past ``budget_s`` (judged by the slowest chunk so far). Returns them and the number of
    prompts done."""
    start = time.perf_counter()
    done, slowest, generations = 0, 0.0, []
    while done < len(prompt_ids):
        elapsed = time.perf_counter() - start
        if done and elapsed + slowest > budget_s:
            break
        t0 = time.perf_counter()
        generations += generate_chunk(llm, prompt_ids[done:done + chunk], kinds[done:done + chunk],
                                      ("greedy", "sampled"), max_new_tokens, seed, done)
        slowest = max(slowest, time.perf_counter() - t0)
        done = min(len(prompt_ids), done + chunk)
        tokens = sum(len(g.output_ids) for g in generations)
        print(f"generation: {done}/{len(prompt_ids)} prompts, {tokens:,} tokens, "
              f"{time.perf_counter() - start:.0f}s", flush=True)
    return generations, done


# ---- plain text -----------------------------------------------------------------------------
def stdlib_files(root: Path) -> list[Path]:
    """The stdlib's ``*.py`` files in sorted order, without tests and site-packages."""
    files = []
    for path in sorted(root.rglob("*.py")):
        dirs = path.relative_to(root).parts[:-1]
        if not SKIP_DIRS.intersection(dirs) and not path.name.startswith("_sysconfigdata"):
            files.append(path)
    return files


def plain_windows(tokenizer, files: Sequence[Path], want_tokens: int, seq_len: int,
                  seed: int) -> tuple[list[list[int]], int]:
    """Windows of at most ``seq_len + 1`` tokens cut from the files in seeded order, one file at a
    time (no window crosses files), until they hold ``want_tokens`` targets. Returns the windows
    and the number of files read."""
    order = np.random.default_rng([seed, 3]).permutation(len(files))
    out, targets, used = [], 0, 0
    for i in order:
        if targets >= want_tokens:
            break
        try:
            text = files[i].read_bytes().decode("utf-8")
        except UnicodeDecodeError:
            continue
        ids = tokenizer.encode(text, add_special_tokens=False).ids
        used += 1
        for s in range(0, len(ids) - 1, seq_len):
            window = ids[s:s + seq_len + 1]
            if len(window) >= 16:
                out.append(window)
                targets += len(window) - 1
    return out, used


# ---- examples and the draft vocabulary ------------------------------------------------------
@dataclass
class Example:
    ids: list[int]
    loss_from: int                   # targets ids[loss_from:] are trained on


def chat_example(g: Generation, seq_len: int) -> Example:
    ids = (g.prompt_ids + g.output_ids)[:seq_len + 1]
    return Example(ids, len(g.prompt_ids))


def choose_vocabulary(counts: collections.Counter, always: set[int], held_out: Sequence[int],
                      choices: Sequence[int]) -> tuple[list[int], dict[int, float], int]:
    """The smallest N of ``choices`` whose coverage of ``held_out`` reaches :data:`MIN_COVERAGE`
    (else the smallest within half a point of the best coverage), its token ids (``always``
    first, then by frequency, ties by id; fewer than N when the data has fewer distinct tokens),
    the coverage of every choice, and N."""
    ranked = sorted(always) + [t for t, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
                               if t not in always]
    held = np.asarray(held_out)
    coverage = {n: float(np.isin(held, ranked[:n]).mean()) for n in choices}
    best = max(coverage.values())
    good_enough = min(MIN_COVERAGE, best - 0.005)
    chosen = next(n for n in sorted(choices) if coverage[n] >= good_enough)
    return sorted(ranked[:chosen]), coverage, chosen


def subset_index(token_ids: Sequence[int], vocab_size: int) -> torch.Tensor:
    """Token id -> its row in the draft vocabulary, -100 (ignored) outside it."""
    index = torch.full((vocab_size,), -100, dtype=torch.long)
    index[torch.as_tensor(token_ids)] = torch.arange(len(token_ids))
    return index


def epoch_batches(examples: Sequence[Example], tokens_per_step: int, rng: np.random.Generator
                  ) -> list[list[Example]]:
    """One epoch in batches of at most ``tokens_per_step`` padded tokens: shuffled, cut into
    groups of 64 that are sorted by length (little padding), batched, the batches shuffled."""
    order = rng.permutation(len(examples))
    epoch = []
    for g in range(0, len(order), 64):
        group = sorted((examples[i] for i in order[g:g + 64]), key=lambda e: len(e.ids))
        batch: list[Example] = []
        for e in group:
            if batch and (len(batch) + 1) * len(e.ids) > tokens_per_step:
                epoch.append(batch)
                batch = []
            batch.append(e)
        epoch.append(batch)
    return [epoch[i] for i in rng.permutation(len(epoch))]


def batches(examples: Sequence[Example], tokens_per_step: int, rng: np.random.Generator
            ) -> Iterator[list[Example]]:
    """Endless epochs of :func:`epoch_batches`."""
    while True:
        yield from epoch_batches(examples, tokens_per_step, rng)


def collate(batch: Sequence[Example], index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded inputs and subset labels (-100 on prompts, padding and tokens outside the
    draft vocabulary). Causal attention never looks right, so padding needs no mask."""
    width = max(len(e.ids) for e in batch) - 1
    inputs = torch.zeros(len(batch), width, dtype=torch.long)
    labels = torch.full((len(batch), width), -100, dtype=torch.long)
    for row, e in enumerate(batch):
        ids = torch.as_tensor(e.ids)
        inputs[row, :len(ids) - 1] = ids[:-1]
        targets = index[ids[1:]]
        targets[:max(0, e.loss_from - 1)] = -100
        labels[row, :len(ids) - 1] = targets
    return inputs, labels


# ---- the draft model ------------------------------------------------------------------------
def draft_config(target_hf: Path):
    from transformers import LlamaConfig

    config = LlamaConfig.from_pretrained(target_hf)
    config.num_hidden_layers = DRAFT_LAYERS
    config.tie_word_embeddings = True
    return config


def make_draft(config, embedding: torch.Tensor, target_state: Optional[dict], init: str):
    """A float32 draft with the frozen target embedding; ``init`` "copy" takes the target's
    first layers, "random" keeps transformers' initialization. The final norm starts as the
    target's either way."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM(config).float()
    own = model.state_dict()
    with torch.no_grad():
        model.model.embed_tokens.weight.copy_(embedding)
        for name in own:
            layer = name.startswith("model.layers.")
            copy = name == "model.norm.weight" or (init == "copy" and layer)
            if copy and target_state is not None and name in target_state:
                own[name].copy_(target_state[name])
    model.model.embed_tokens.weight.requires_grad_(False)
    return model


def draft_loss(model, head: torch.Tensor, inputs: torch.Tensor, labels: torch.Tensor
               ) -> torch.Tensor:
    """Cross-entropy over the draft vocabulary (``head`` = its embedding rows), computed only at
    positions with a label."""
    hidden = model.model(input_ids=inputs, use_cache=False).last_hidden_state
    keep = labels != -100
    if not keep.any():                                 # a batch of prompts cut before any answer
        return hidden.sum() * 0
    logits = hidden[keep] @ head.T
    return F.cross_entropy(logits, labels[keep])


@torch.no_grad()
def validation_loss(model, head: torch.Tensor, examples: Sequence[Example], index: torch.Tensor
                    ) -> float:
    model.eval()
    total, count = 0.0, 0
    for e in examples:
        inputs, labels = collate([e], index)
        n = int((labels != -100).sum())
        if n:
            total += float(draft_loss(model, head, inputs, labels)) * n
            count += n
    model.train()
    return total / max(1, count)


def train(model, head: torch.Tensor, examples: Sequence[Example], val: Sequence[Example],
          index: torch.Tensor, *, lr: float, warmup: int, weight_decay: float,
          tokens_per_step: int, steps: Optional[int], budget_s: float, evals: int, seed: int,
          desc: str, max_epochs: Optional[float] = None) -> dict:
    """Trains for ``steps`` steps, or (None) as many as fit ``budget_s`` seconds including the
    validations, measured over the first :data:`PROBE_STEPS` steps, but at most ``max_epochs``
    passes over the data: on a small data set more passes only overfit."""
    epoch_steps = len(epoch_batches(examples, tokens_per_step, np.random.default_rng([seed, 6])))
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = make_optimizer(model, lr, weight_decay)
    stream = batches(examples, tokens_per_step, np.random.default_rng([seed, 4]))
    start = time.perf_counter()
    history = [{"step": 0, "val_loss": validation_loss(model, head, val, index)}]
    eval_s = time.perf_counter() - start
    total, step, losses, tokens, probe_start = steps, 0, [], 0, 0.0
    model.train()
    while total is None or step < total:
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, total, warmup, lr)
        inputs, labels = collate(next(stream), index)
        loss = draft_loss(model, head, inputs, labels)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        losses.append(loss.item())
        tokens += int((labels != -100).sum())
        step += 1
        if total is None and step == 1:
            probe_start = time.perf_counter()          # the first step pays one-time setup
        if total is None and step == PROBE_STEPS:
            per_step = (time.perf_counter() - probe_start) / (PROBE_STEPS - 1)
            left = budget_s - (time.perf_counter() - start) - evals * eval_s
            total = max(PROBE_STEPS, PROBE_STEPS + int(left / per_step))
            if max_epochs is not None:
                total = max(PROBE_STEPS, min(total, int(max_epochs * epoch_steps)))
            print(f"{desc}: {per_step:.2f}s per step, {epoch_steps} steps per epoch -> "
                  f"{total} steps", flush=True)
        if total is not None and step * evals // total > (step - 1) * evals // total:
            history.append({"step": step, "val_loss": validation_loss(model, head, val, index)})
            print(f"{desc}: step {step}/{total}  train loss {np.mean(losses[-20:]):.4f}  val loss "
                  f"{history[-1]['val_loss']:.4f}  {time.perf_counter() - start:.0f}s", flush=True)
    seconds = round(time.perf_counter() - start, 1)
    return {"steps": step, "trained_tokens": tokens, "seconds": seconds,
            "train_loss": float(np.mean(losses[-20:])), "val_loss": history[-1]["val_loss"],
            "val_history": history, "lr": lr, "warmup_steps": warmup,
            "steps_per_epoch": epoch_steps, "epochs": round(step / epoch_steps, 2),
            "max_epochs": max_epochs}


# ---- saving and loading ---------------------------------------------------------------------
def save_draft(model, config, out: Path) -> None:
    """config.json (+ the borrowed-weights key, bf16) and model.safetensors without the
    embedding and the tied head, in bf16."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(out)
    raw = json.loads((out / "config.json").read_text())
    raw.update({"architectures": ["LlamaForCausalLM"], "dtype": "bfloat16",
                "torch_dtype": "bfloat16", BORROWED_KEY: [EMBEDDING]})
    (out / "config.json").write_text(json.dumps(raw, indent=2, sort_keys=True) + "\n")
    tensors = {name: t.detach().to(torch.bfloat16).contiguous()
               for name, t in model.state_dict().items()
               if name not in (EMBEDDING, "lm_head.weight")}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})


def load_draft_for_transformers(draft_dir, target, dtype: torch.dtype = torch.float32):
    """The draft as a ``transformers`` ``LlamaForCausalLM`` in eval mode: the saved tensors plus
    the borrowed embedding (and tied head) from ``target``, a model or its embedding matrix.
    Every parameter comes from one of the two; nothing random is left."""
    from safetensors.torch import load_file
    from transformers import LlamaConfig, LlamaForCausalLM

    draft_dir = Path(draft_dir)
    config = LlamaConfig.from_pretrained(draft_dir)
    borrowed = list(getattr(config, BORROWED_KEY, [EMBEDDING]))
    assert borrowed == [EMBEDDING], borrowed
    embedding = (target if isinstance(target, torch.Tensor)
                 else target.get_input_embeddings().weight)
    model = LlamaForCausalLM(config)
    saved = load_file(str(draft_dir / "model.safetensors"))
    expected = set(model.state_dict()) - {"lm_head.weight"}
    assert set(saved) | set(borrowed) == expected and not set(saved) & set(borrowed), \
        sorted(expected.symmetric_difference(set(saved) | set(borrowed)))
    with torch.no_grad():
        model.load_state_dict(saved, strict=False)
        model.model.embed_tokens.weight.copy_(embedding.detach())
    model.tie_weights()
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    return model.to(dtype).eval()


def load_target_for_transformers(target_hf: Path, dtype: torch.dtype = torch.float32):
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(target_hf, dtype=dtype).eval()


# ---- acceptance rates -----------------------------------------------------------------------
def forward_one(model, cache, tokens: Sequence[int], keep: int = 0) -> torch.Tensor:
    """Logits (float32) of ``tokens`` appended to ``cache``, one row per token (the last
    ``keep`` rows only when ``keep`` > 0)."""
    ids = torch.as_tensor([list(tokens)])
    return model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=keep).logits[0].float()


def crop(cache, length: int) -> None:
    """Keeps the first ``length`` positions (transformers 5 takes the count to remove, < 0)."""
    remove = cache.get_seq_length() - length
    if remove > 0:
        cache.crop(-remove)


def sample_positions(sequences: Sequence[tuple[list[int], list[int]]], k: int, num: int,
                     rng: np.random.Generator) -> list[tuple[int, int]]:
    """``num`` distinct (sequence, t) with k target tokens after t, drawn uniformly."""
    pool = [(s, t) for s, (_, cont) in enumerate(sequences) for t in range(len(cont) - k + 1)]
    picked = rng.choice(len(pool), size=min(num, len(pool)), replace=False)
    return sorted(pool[i] for i in picked)


@torch.no_grad()
def acceptance_per_position(target_model, draft_model, draft_vocab: Sequence[int],
                            sequences: Sequence[tuple[list[int], list[int]]], k: int = 5,
                            temperature: float = 0.0, num_positions: int = 400,
                            seed: int = 0) -> dict:
    """Simulated speculation at positions t of the target's continuations ``sequences`` (pairs of
    prompt and continuation ids): the draft proposes k tokens from the prefix up to t, over the
    draft vocabulary only. Temperature 0: greedy drafts against the continuation's tokens t..t+k-1.
    Otherwise speculative sampling: x_j ~ q_j (softmax(logits / T) on the vocabulary), accepted
    with probability min(1, p_j(x_j) / q_j(x_j)) where p_j is the target's softmax(logits / T)
    given the prefix and the accepted drafts; the first rejection ends the step. Returns a_j, the
    share of positions whose first j drafts were accepted (j = 1..k), and their mean."""
    from transformers import DynamicCache

    rng = np.random.default_rng([seed, 5])
    vocab = torch.as_tensor(list(draft_vocab))
    accepted = []
    positions = sample_positions(sequences, k, num_positions, rng)
    for s in sorted({s for s, _ in positions}):
        prompt, cont = sequences[s]
        full = prompt + cont
        draft_cache, target_cache = DynamicCache(), DynamicCache()
        forward_one(draft_model, draft_cache, full, keep=1)   # cropped per position below
        if temperature > 0:
            forward_one(target_model, target_cache, full, keep=1)
        for t in sorted((t for ss, t in positions if ss == s), reverse=True):
            prefix = len(prompt) + t
            crop(draft_cache, prefix - 1)
            logits = forward_one(draft_model, draft_cache, [full[prefix - 1]])[-1]
            drafts, q_rows = [], []
            for j in range(k):
                if temperature == 0:
                    token = int(vocab[logits[vocab].argmax()])
                else:
                    q = torch.softmax(logits[vocab] / temperature, -1)
                    pick = int(torch.multinomial(q, 1, generator=torch_generator(rng)))
                    token = int(vocab[pick])
                    q_rows.append(float(q[pick]))
                drafts.append(token)
                if j + 1 < k:
                    logits = forward_one(draft_model, draft_cache, [token])[-1]
            if temperature == 0:
                accepted.append(matching_prefix(drafts, cont[t:t + k]))
            else:
                crop(target_cache, prefix - 1)
                p = torch.softmax(forward_one(target_model, target_cache,
                                              [full[prefix - 1]] + drafts[:-1]) / temperature, -1)
                accepted.append(sampled_acceptance(drafts, q_rows, p, rng))
    counts = np.asarray(accepted)
    return {"temperature": temperature, "k": k, "positions": len(counts), "seed": seed,
            "a": [float((counts >= j).mean()) for j in range(1, k + 1)],
            "mean_accepted": float(counts.mean())}


def torch_generator(rng: np.random.Generator) -> torch.Generator:
    return torch.Generator().manual_seed(int(rng.integers(2**62)))


def matching_prefix(drafts: Sequence[int], reference: Sequence[int]) -> int:
    n = 0
    while n < len(drafts) and drafts[n] == reference[n]:
        n += 1
    return n


def sampled_acceptance(drafts: Sequence[int], q: Sequence[float], p: torch.Tensor,
                       rng: np.random.Generator) -> int:
    """How many drafts speculative sampling accepts before the first rejection."""
    for j, token in enumerate(drafts):
        if rng.random() >= min(1.0, float(p[j, token]) / q[j]):
            return j
    return len(drafts)


# ---- cost indication ------------------------------------------------------------------------
@torch.no_grad()
def one_token_seconds(model, dtype: torch.dtype, context: int = 128, steps: int = 20) -> float:
    """Median seconds of one batch-1 forward of one token with a KV cache of ``context``."""
    from transformers import DynamicCache

    model = model.to(dtype)
    cache = DynamicCache()
    vocab = model.config.vocab_size
    model(input_ids=torch.arange(context)[None] % vocab, cache=cache, use_cache=True)
    times = []
    for i in range(steps + 2):
        t0 = time.perf_counter()
        model(input_ids=torch.tensor([[i % vocab]]), cache=cache, use_cache=True)
        times.append(time.perf_counter() - t0)
    model.float()
    return float(np.median(times[2:]))


# ---- target checkpoint ----------------------------------------------------------------------
def target_hf_dir(target: str, given: Optional[Path], work: Path) -> Path:
    """A transformers directory of the target: ``given``, the target itself when it is one, or a
    conversion of its GGUF into ``work``."""
    from pagedspec.models import resolve_model_path
    from pagedspec.models.gguf import convert_gguf

    if given is not None:
        return given
    path = resolve_model_path(target)
    if path.is_dir() and (path / "config.json").exists():
        return path
    out = work / "target-hf"
    if not (out / "config.json").exists():
        convert_gguf(path if path.is_file() else next(iter(sorted(path.glob("*.gguf")))), out)
    return out


def target_embedding(target: str) -> torch.Tensor:
    """The embedding pagedspec's engine uses (dequantized from a GGUF), in float32."""
    from pagedspec.models import load_checkpoint

    return load_checkpoint(target).weights.get(EMBEDDING).float()


def machine() -> dict:
    return {"cpu": cpu_name(), "cores": os.cpu_count(), "threads": torch.get_num_threads(),
            "torch": torch.__version__, "python": platform.python_version(),
            "isa": torch.backends.cpu.get_cpu_capability()}


# ---- model card -----------------------------------------------------------------------------
def acceptance_table(report: dict) -> str:
    rows = ["| temperature | " + " | ".join(f"a{j}" for j in range(1, 6)) + " | mean accepted |",
            "|---|---|---|---|---|---|---|"]
    for r in report["acceptance"]:
        rows.append(f"| {r['temperature']} | " + " | ".join(f"{a:.3f}" for a in r["a"])
                    + f" | {r['mean_accepted']:.2f} |")
    return "\n".join(rows)


def card_model(report: dict) -> str:
    cfg, v = report["config"], report["vocabulary"]
    sizes = (f"hidden {cfg['hidden_size']}, {cfg['num_attention_heads']} heads, "
             f"{cfg['num_key_value_heads']} KV heads, intermediate {cfg['intermediate_size']}")
    coverages = ", ".join(f"{n}: {x:.1%}" for n, x in v["coverage_by_size"].items())
    return f"""A {DRAFT_LAYERS}-layer draft model for speculative decoding with the target
`{report['target']}`, trained by self-distillation with `tools/train_draft.py` in the pagedspec
repository. It has the target's architecture and sizes ({sizes}) but {DRAFT_LAYERS} decoder layers
instead of {report['target_layers']}. Its token embedding, and so its tied LM head, **is the
target's**: it is not stored here (`config.json`: `"{BORROWED_KEY}": ["{EMBEDDING}"]`) and is
taken from the target at load time. `model.safetensors` holds the {DRAFT_LAYERS} layers and the
final norm in bf16 ({report['stored_parameters']:,} parameters).

The draft predicts over a reduced vocabulary (as in FR-Spec): the {v['num_tokens']} most frequent
token ids of its training data plus the special tokens the target emitted, listed in
`draft_vocab.json`. They cover {v['coverage_heldout']:.1%} of the target's output tokens on the
held-out prompts (the smallest size reaching {MIN_COVERAGE:.0%} is chosen, else the smallest
within half a point of the best; the list is shorter than the size when the training data holds
fewer distinct tokens; coverage by size: {coverages})."""


def card_data(report: dict) -> str:
    d, s = report["data"], report["settings"]
    seconds = report.get("generation", {}).get("seconds")
    minutes = "time not recorded" if seconds is None else f"{seconds / 60:.1f}"
    return f"""## Data

Prompts built by the script: {len(TOPICS)} topics x {len(INSTRUCTION_TEMPLATES)} instruction
templates, two-turn chats (a fixed first answer, then a follow-up), and code tasks (write a
function from a standard-library signature and docstring, explain or fix a planted bug in a
standard-library function, {len(CODE_EXERCISES)} exercises in Python and JavaScript):
{d['prompts_built']} prompts ({', '.join(f'{k} {n}' for k, n in d['prompts_by_kind'].items())}),
rendered with the target's chat template. {d['held_out_prompts']} are held out
({HELD_OUT_FRACTION:.0%} of each kind by a seeded shuffle) and never trained on; the
{d['eval_prompts']} in `heldout_prompts.json` ({s['eval_per_kind']} per kind) give the figures
below.

The target (pagedspec engine, float32) continued {d['train_prompts_used']} of the
{d['train_prompts_available']} training prompts within the {s['gen_minutes']}-minute generation
budget ({minutes} minutes), each once greedily and once at temperature {SAMPLE_TEMPERATURE},
at most {s['max_new_tokens']} tokens: {d['continuation_tokens']:,} continuation tokens. Plain text:
{d['plain_tokens']:,} tokens of the Python standard library's sources ({d['plain_files']} files,
tests excluded), {d['plain_share']:.0%} of the trained tokens."""


def card_training(report: dict) -> str:
    t, trial, s, m = (report["training"], report["init_trial"], report["settings"],
                      report["machine"])
    phases = ", ".join(f"{k} {sec / 60:.1f}" for k, sec in report["phase_seconds"].items())
    if "random" in trial:
        why = (f"held-out loss after {trial['steps']} trial steps from each: random "
               f"{trial['random']:.4f}, the target's layers 0-1 {trial['copy']:.4f}")
    else:
        why = "given by `--init`, without a trial"
    return f"""## Training

Next-token cross-entropy over the draft vocabulary on the continuation tokens (the prompt is
context only) and on every plain-text token. Initialization: **{t['init']}** ({why}); the final
norm starts as the target's. AdamW (peak learning rate {t['lr']},
{t['warmup_steps']} warmup steps, cosine to 10%), gradient clipping 1.0, float32, sequences of at
most {s['seq_len']} tokens, {s['tokens_per_step']} padded tokens per step: {t['steps']} steps,
{t['trained_tokens']:,} trained tokens in {t['seconds'] / 60:.1f} minutes. Final training loss
{t['train_loss']:.4f}, held-out loss {t['val_loss']:.4f} (nats per token over the draft
vocabulary, on the target's greedy continuations of the evaluated held-out prompts).

Seed {report['seed']}. Machine: {m['cpu']}, {m['threads']} threads, torch {m['torch']}. Minutes per
phase: {phases}."""


def card_speculation(report: dict) -> str:
    c = report["cost"]
    positions = report["acceptance"][0]["positions"]
    return f"""## Speculative decoding

Acceptance per draft position (k = 5) of the saved bf16 weights (run in float32 with
`transformers`) at {positions} random positions of the target's greedy continuations of the
held-out prompts (seed {report['seed']}). a_j is the share of positions whose first j drafts are
accepted. Temperature 0: the draft's argmax over its vocabulary equals the target's token.
Temperature {SAMPLE_TEMPERATURE}: speculative sampling, draft x ~ q (its vocabulary only),
accepted with probability min(1, p(x)/q(x)), the first rejection ends the step.

{acceptance_table(report)}

Cost indication (`transformers`, batch 1, one token after 128 cached tokens, 2 threads; the draft
with the full 49152-row head, which pagedspec cuts to the draft vocabulary): draft
{c['draft_float32_ms']:.1f} ms float32, {c['draft_bfloat16_ms']:.1f} ms bf16; target
{c['target_float32_ms']:.1f} ms float32, {c['target_bfloat16_ms']:.1f} ms bf16."""


def card_use(report: dict) -> str:
    d = report["data"]
    return f"""## Use

pagedspec: `LLM("{report['target']}", speculative_model="{report['name']}")`; the engine takes the
embedding from the target and restricts the head to `draft_vocab.json`.

transformers (the head there is the full tied embedding, a valid assistant model):

```python
import sys; sys.path.insert(0, "tools")
from transformers import AutoModelForCausalLM, AutoTokenizer
from train_draft import load_draft_for_transformers
target = AutoModelForCausalLM.from_pretrained(TARGET_HF_DIR)     # e.g. a pagedspec-convert output
draft = load_draft_for_transformers("python/pagedspec/models/data/{report['name']}", target)
out = target.generate(**inputs, assistant_model=draft, max_new_tokens=128)
```

## Limits

Useless without its target (it has no embedding of its own). Trained on about
{d['continuation_tokens'] // 1000}k tokens of the target's answers to templated English prompts and
code tasks: expect lower acceptance on other languages, on contexts longer than
{report['settings']['seq_len']} tokens and on other domains. What an engine gains depends on its k,
batch and kernels; the cost above is only an indication.

## Reproduce

```
{report['command']}
```
{reproduce_note(report)}"""


def reproduce_note(report: dict) -> str:
    """Where reused continuations came from, when the run reloaded them."""
    note = report.get("generation", {}).get("note")
    return f"\n{note}" if note else ""


def model_card(report: dict) -> str:
    """The ``README.md``: front matter, then one section per helper."""
    front = ("---\nlibrary_name: transformers\npipeline_tag: text-generation\n"
             "tags: [llama, speculative-decoding, draft-model, pagedspec]\n---\n")
    sections = (card_model, card_data, card_training, card_speculation, card_use)
    return front + f"# {report['name']}\n\n" + "\n\n".join(f(report) for f in sections) + "\n"


# ---- command line ---------------------------------------------------------------------------
def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                                allow_abbrev=False)
    p.add_argument("--target", default="smollm2-135m",
                   help="pagedspec model name, Hugging Face directory or .gguf file")
    p.add_argument("--target-hf", type=Path, default=None,
                   help="transformers directory of the same target (default: the target if it "
                        "is one, else a conversion of its GGUF under --work)")
    p.add_argument("--out", type=Path,
                   default=Path("python/pagedspec/models/data/smollm2-135m-draft"))
    p.add_argument("--work", type=Path, default=Path("/tmp/draft-work"),
                   help="scratch directory (continuations, converted target)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--smoke", action="store_true", help="tiny run (seconds); flags still win")
    p.add_argument("--gen-minutes", type=float, default=35.0, help="generation budget")
    p.add_argument("--train-minutes", type=float, default=30.0, help="training budget")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--gen-chunk", type=int, default=32,
                   help="prompts per engine call (2 requests each; 64 requests fill the batch)")
    p.add_argument("--max-num-seqs", type=int, default=64, help="engine batch")
    p.add_argument("--kv-cache-gib", type=float, default=3.0,
                   help="engine KV cache; the default 1 GiB preempts 64 long sequences")
    p.add_argument("--max-prompts", type=int, default=None, help="use at most N training prompts")
    p.add_argument("--reuse-generations", action="store_true",
                   help="load WORK/generations.json of an earlier run instead of generating")
    p.add_argument("--plain-fraction", type=float, default=0.3,
                   help="share of plain-text tokens among the trained tokens")
    p.add_argument("--max-plain-files", type=int, default=None)
    p.add_argument("--vocab-choices", default=",".join(map(str, VOCAB_CHOICES)))
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--tokens-per-step", type=int, default=8192, help="padded tokens per step")
    p.add_argument("--max-epochs", type=float, default=8.0,
                   help="cap on passes over the training data (the budget may allow more)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup-steps", type=int, default=20)
    p.add_argument("--weight-decay", type=float, default=0.05)
    p.add_argument("--init", choices=("compare", "random", "copy"), default="compare")
    p.add_argument("--init-trial-steps", type=int, default=60)
    p.add_argument("--evals", type=int, default=6, help="validations during training")
    p.add_argument("--eval-per-kind", type=int, default=HELD_OUT_EVAL_PER_KIND)
    p.add_argument("--eval-positions", type=int, default=400, help="positions per temperature")
    p.add_argument("--cost-steps", type=int, default=20)
    args = p.parse_args(argv)
    if args.smoke:
        p.set_defaults(**SMOKE)
        args = p.parse_args(argv)
    args.vocab_choices = [int(n) for n in str(args.vocab_choices).split(",")]
    return args


def write_report(out: Path, report: dict, card: str) -> None:
    """``training.json`` and the model card ``README.md`` into the checkpoint directory."""
    write_json(out / "training.json", report)
    (out / "README.md").write_text(card)
    size = sum(f.stat().st_size for f in out.iterdir())
    print(f"wrote {out} ({size / 1e6:.1f} MB)", flush=True)


class Phases:
    """Seconds per phase of a run: ``phase(name)`` ends the phase begun at the last call (or at
    construction), records it in :attr:`seconds` and prints it."""

    def __init__(self):
        self.seconds: dict[str, float] = {}
        self._clock = time.perf_counter()

    def __call__(self, name: str) -> None:
        now = time.perf_counter()
        self.seconds[name] = round(now - self._clock, 1)
        self._clock = now
        print(f"== {name}: {self.seconds[name]:.0f}s", flush=True)


def write_json(path: Path, value) -> None:
    path.write_text(json.dumps(value, indent=1) + "\n")


def save_generations(path: Path, generations: Sequence[Generation], done: int,
                     seconds: float) -> None:
    write_json(path, {"done": done, "seconds": seconds,
                      "generations": [g.__dict__ for g in generations]})


def load_generations(path: Path) -> tuple[list[Generation], int, Optional[float]]:
    """What :func:`save_generations` wrote: the continuations, the prompts done, the seconds."""
    raw = json.loads(path.read_text())
    return [Generation(**g) for g in raw["generations"]], raw["done"], raw.get("seconds")


@dataclass
class PromptSets:
    all: list[dict]
    train: list[dict]
    held_out: list[dict]
    evaluated: list[dict]

    def by_kind(self) -> dict[str, int]:
        return {k: sum(p["kind"] == k for p in self.all) for k in KINDS}


def prepare_prompts(renderer: PromptRenderer, seed: int, max_prompts: Optional[int],
                    eval_per_kind: int) -> PromptSets:
    """Split before the length filter, so that the split does not depend on the tokenizer."""
    prompts = build_prompts()
    train, held_out = split_prompts(prompts, seed)

    def short(ps: list[dict]) -> list[dict]:
        return [p for p in ps if len(renderer.ids(p["messages"])) <= MAX_PROMPT_TOKENS]

    train, held_out = short(train)[:max_prompts], short(held_out)
    return PromptSets(prompts, train, held_out, eval_prompts(held_out, eval_per_kind))


@dataclass
class TrainingData:
    examples: list[Example]
    val: list[Example]
    draft_vocab: list[int]
    coverage: dict[int, float]
    chosen: int
    always: set[int]
    sizes: dict


def training_data(generations: Sequence[Generation], held_gens: Sequence[Generation], tokenizer,
                  eos_ids: Sequence[int], vocab_size: int, args: argparse.Namespace
                  ) -> TrainingData:
    """Chat examples, plain-text windows up to ``--plain-fraction``, and the draft vocabulary."""
    chat = [chat_example(g, args.seq_len) for g in generations]
    chat_targets = sum(max(0, len(e.ids) - e.loss_from) for e in chat)
    want_plain = int(chat_targets * args.plain_fraction / (1 - args.plain_fraction))
    files = stdlib_files(Path(sysconfig.get_paths()["stdlib"]))[:args.max_plain_files]
    plain, plain_files = plain_windows(tokenizer, files, want_plain, args.seq_len, args.seed)
    plain_targets = sum(len(w) - 1 for w in plain)
    counts = collections.Counter(t for g in generations for t in g.output_ids)
    counts.update(t for w in plain for t in w)
    specials = {i for i, added in tokenizer.get_added_tokens_decoder().items()
                if added.special and i in counts}
    always = specials | set(eos_ids)
    held_tokens = [t for g in held_gens for t in g.output_ids]
    choices = [min(n, vocab_size) for n in args.vocab_choices]
    draft_vocab, coverage, chosen = choose_vocabulary(counts, always, held_tokens, choices)
    examples = chat + [Example(w, 0) for w in plain]
    sizes = {"continuation_tokens": chat_targets,
             "continuation_tokens_by_mode": {
                 mode: sum(len(g.output_ids) for g in generations if g.mode == mode)
                 for mode in ("greedy", "sampled")},
             "prompt_tokens": sum(e.loss_from for e in chat),
             "held_out_continuation_tokens": len(held_tokens),
             "plain_tokens": plain_targets, "plain_files": plain_files,
             "plain_share": plain_targets / max(1, plain_targets + chat_targets),
             "training_sequences": len(examples)}
    val = [chat_example(g, args.seq_len) for g in held_gens]
    return TrainingData(examples, val, draft_vocab, coverage, chosen, always, sizes)


def target_layers(target_hf: Path, layers: int) -> dict[str, torch.Tensor]:
    """The target's first ``layers`` decoder layers and final norm, float32."""
    from safetensors.torch import load_file

    prefixes = tuple(f"model.layers.{i}." for i in range(layers))
    return {n: t.float() for n, t in load_file(str(target_hf / "model.safetensors")).items()
            if n == "model.norm.weight" or n.startswith(prefixes)}


def train_draft(config, embedding: torch.Tensor, target_state: dict, data: TrainingData,
                args: argparse.Namespace, phase) -> tuple:
    """The initialization trial (``--init compare``: the lower held-out loss after
    ``--init-trial-steps`` wins), then the budgeted training. Returns the model, the trial's
    losses and the training record."""
    head = embedding[torch.as_tensor(data.draft_vocab)].contiguous()
    index = subset_index(data.draft_vocab, config.vocab_size)
    common = dict(warmup=args.warmup_steps, weight_decay=args.weight_decay,
                  tokens_per_step=args.tokens_per_step, seed=args.seed, lr=args.lr)
    trial: dict = {"steps": args.init_trial_steps}
    init = args.init
    if init == "compare":
        for candidate in ("random", "copy"):
            torch.manual_seed(args.seed)
            model = make_draft(config, embedding, target_state, candidate)
            result = train(model, head, data.examples, data.val, index,
                           steps=args.init_trial_steps, budget_s=0, evals=1,
                           desc=f"init {candidate}", **common)
            trial[candidate] = result["val_loss"]
            trial[f"{candidate}_seconds"] = result["seconds"]
        init = min(("random", "copy"), key=lambda c: trial[c])
    phase("init_trial")
    torch.manual_seed(args.seed)
    model = make_draft(config, embedding, target_state, init)
    result = train(model, head, data.examples, data.val, index, steps=None,
                   budget_s=args.train_minutes * 60, evals=args.evals, desc="draft",
                   max_epochs=args.max_epochs, **common)
    result["init"] = init
    phase("train")
    return model, trial, result


def write_draft_directory(out: Path, model, config, target_hf: Path, data: TrainingData,
                          evaluated: Sequence[dict]) -> None:
    """Everything but training.json and README.md, which need the evaluation."""
    if out.exists():
        shutil.rmtree(out)
    save_draft(model, config, out)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json",
                 "chat_template.jinja"):
        if (target_hf / name).exists():
            shutil.copy(target_hf / name, out / name)
    write_json(out / "draft_vocab.json", {
        "token_ids": data.draft_vocab, "num_tokens": len(data.draft_vocab),
        "coverage_heldout": data.coverage[data.chosen],
        "source": "The most frequent token ids of the training data (the target's continuations "
                  "and stdlib source), plus the special tokens the target emitted."})
    write_json(out / "heldout_prompts.json", [
        {"kind": p["kind"], "messages": p["messages"]} for p in evaluated])


def evaluate(out: Path, target_hf: Path, draft_vocab: Sequence[int],
             held_gens: Sequence[Generation], args: argparse.Namespace, phase
             ) -> tuple[list[dict], dict, int]:
    """Acceptance per position at temperatures 0 and 0.7 of the saved draft, then the cost
    indication. Returns them and the number of stored parameters."""
    target = load_target_for_transformers(target_hf)
    draft = load_draft_for_transformers(out, target)
    sequences = [(g.prompt_ids, g.output_ids) for g in held_gens]
    acceptance = []
    for temperature in (0.0, SAMPLE_TEMPERATURE):
        acceptance.append(acceptance_per_position(
            target, draft, draft_vocab, sequences, k=5, temperature=temperature,
            num_positions=args.eval_positions, seed=args.seed))
        print(f"acceptance at temperature {temperature}: "
              f"{[round(a, 3) for a in acceptance[-1]['a']]}, "
              f"mean {acceptance[-1]['mean_accepted']:.3f}", flush=True)
    phase("evaluate")
    # Last: the bf16 timing rounds the float32 target's weights.
    cost = {f"{name}_{dtype}_ms": 1000 * one_token_seconds(m, getattr(torch, dtype),
                                                          steps=args.cost_steps)
            for name, m in (("draft", draft), ("target", target))
            for dtype in ("float32", "bfloat16")}
    print("cost: " + ", ".join(f"{k} {v:.1f}" for k, v in cost.items()), flush=True)
    phase("cost")
    stored = sum(t.numel() for n, t in draft.state_dict().items()
                 if n not in (EMBEDDING, "lm_head.weight"))
    return acceptance, cost, stored


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    args.work.mkdir(parents=True, exist_ok=True)
    phase = Phases()
    phases = phase.seconds

    from pagedspec import LLM
    from pagedspec.models import load_checkpoint

    hf = target_hf_dir(args.target, args.target_hf, args.work)
    ckpt = load_checkpoint(args.target)
    tokenizer = ckpt.load_tokenizer()
    renderer = PromptRenderer(ckpt.chat_template, tokenizer)
    prompts = prepare_prompts(renderer, args.seed, args.max_prompts, args.eval_per_kind)
    print(f"prompts: {len(prompts.all)} {prompts.by_kind()}; {len(prompts.train)} for training, "
          f"{len(prompts.held_out)} held out, {len(prompts.evaluated)} evaluated", flush=True)
    phase("prompts")

    gen_path = args.work / "generations.json"
    llm = LLM(args.target, dtype="float32", max_num_seqs=args.max_num_seqs,
              max_model_len=MAX_PROMPT_TOKENS + args.max_new_tokens + 8, seed=args.seed,
              kv_cache_memory=int(args.kv_cache_gib * 2**30))
    held_gens = generate_chunk(llm, [renderer.ids(p["messages"]) for p in prompts.evaluated],
                               [p["kind"] for p in prompts.evaluated], ("greedy",),
                               args.max_new_tokens, args.seed, 0)
    phase("generate_held_out")
    reused = args.reuse_generations and gen_path.exists()
    if reused:
        generations, done, gen_seconds = load_generations(gen_path)
    else:
        start = time.perf_counter()
        generations, done = generate_training_data(
            llm, [renderer.ids(p["messages"]) for p in prompts.train],
            [p["kind"] for p in prompts.train], max_new_tokens=args.max_new_tokens,
            seed=args.seed, budget_s=args.gen_minutes * 60, chunk=args.gen_chunk)
        gen_seconds = round(time.perf_counter() - start, 1)
        save_generations(gen_path, generations, done, gen_seconds)
    del llm
    phase("generate_train")

    data = training_data(generations, held_gens, tokenizer, ckpt.generation.eos_token_ids,
                         ckpt.config.vocab_size, args)
    print(f"data: {data.sizes}; draft vocabulary {len(data.draft_vocab)} (coverage "
          f"{', '.join(f'{n}: {c:.4f}' for n, c in data.coverage.items())})", flush=True)
    phase("data")

    config = draft_config(hf)
    model, trial, result = train_draft(config, target_embedding(args.target),
                                       target_layers(hf, DRAFT_LAYERS), data, args, phase)
    write_draft_directory(args.out, model, config, hf, data, prompts.evaluated)
    del model
    acceptance, cost, stored = evaluate(args.out, hf, data.draft_vocab, held_gens, args, phase)

    report = {
        "name": args.out.name, "target": args.target, "target_hf": str(hf), "seed": args.seed,
        "target_layers": json.loads((hf / "config.json").read_text())["num_hidden_layers"],
        "config": {k: getattr(config, k) for k in ("hidden_size", "num_attention_heads",
                                                   "num_key_value_heads", "intermediate_size",
                                                   "num_hidden_layers", "vocab_size")},
        "stored_parameters": stored,
        "prompt_rendering": "chat template" if ckpt.chat_template else FALLBACK_TEMPLATE,
        "heldout_definition": (f"per kind, a seeded shuffle (numpy default_rng([seed, 1])) of "
                               f"build_prompts(); the first {HELD_OUT_FRACTION:.0%} are held out; "
                               f"prompts over {MAX_PROMPT_TOKENS} tokens are then dropped from "
                               f"both sides; the first {args.eval_per_kind} held-out prompts "
                               "per kind are evaluated (heldout_prompts.json)"),
        "data": {"prompts_built": len(prompts.all), "prompts_by_kind": prompts.by_kind(),
                 "train_prompts_available": len(prompts.train), "train_prompts_used": done,
                 "held_out_prompts": len(prompts.held_out),
                 "eval_prompts": len(prompts.evaluated), **data.sizes},
        "vocabulary": {"num_tokens": len(data.draft_vocab), "choices": sorted(data.coverage),
                       "coverage_by_size": {str(n): c for n, c in data.coverage.items()},
                       "coverage_heldout": data.coverage[data.chosen],
                       "chosen_size": data.chosen, "min_coverage": MIN_COVERAGE,
                       "always_included": sorted(data.always)},
        "generation": {"seconds": gen_seconds, "reused_from_earlier_run": reused},
        "init_trial": trial, "training": result,
        "acceptance": acceptance, "cost": cost, "phase_seconds": phases,
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "machine": machine(),
        "command": shlex.join(["python", "tools/train_draft.py", *argv]),
    }
    write_report(args.out, report, model_card(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
