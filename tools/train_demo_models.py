"""Trains pagedspec's demo checkpoints: a small Llama-architecture target model and a much smaller
draft model for speculative decoding, both on the Python standard library of the interpreter that
runs this script, sharing one tokenizer. Seeded and rerunnable on a CPU.

Recipe:

1. Corpus: every ``*.py`` file under ``sysconfig.get_paths()["stdlib"]`` in sorted path order,
   without ``site-packages``, the test suites (``test/``, ``tests/``, ``idlelib/idle_test/``) and
   the files generated for this machine's build (``_sysconfigdata_*.py``, ``config-*/``). The
   modules in :data:`HELD_OUT` are kept out of tokenizer and model training and serve for
   validation, bits per byte and the acceptance rates.
2. Tokenizer: byte-level BPE (``tokenizers``), ``<|endoftext|>`` as id 0 (eos and document
   separator), ``<|pad|>`` as id 1, no BOS. Documents are concatenated as
   ``eos doc eos doc ... eos`` and models train on random windows of ``--seq-len`` tokens.
3. Target: ``LlamaForCausalLM`` trained with next-token cross-entropy. AdamW (betas 0.9/0.95,
   weight decay on matrices only), linear warmup then cosine decay to 10% of the peak learning
   rate, gradient clipping at 1.0, bf16 autocast where the CPU has native bf16 (AVX512_BF16 or
   AMX). The step count is fixed (``--steps``) or derived from a wall-time budget: the first
   steps are timed and the cosine schedule is set to end when the budget does.
4. Draft: a one-layer ``LlamaForCausalLM`` trained by distillation from the trained target on the
   same kind of windows: ``(1 - w) KL(p_target || p_draft) + w CE`` at temperature 1 with a small
   ``w = --ce-weight``. Speculative decoding accepts a drafted token when it agrees with the
   target (greedy) or with probability ``sum_x min(p_target(x), p_draft(x))`` (rejection
   sampling), so what the draft must learn is the target's distribution, not the data's: a draft
   trained on the data alone spends its tiny capacity on tokens the target gets wrong anyway.
5. Both models are rounded to bf16 (what is saved), then measured: held-out bits per byte, and the
   draft's acceptance rates against the target on held-out prompts, at temperature 0 (per-token
   agreement of the draft's argmax with the target's greedy continuation) and 1 (mean expected
   acceptance probability on a sampled continuation).

Each model directory holds ``config.json``, ``model.safetensors`` (bf16),
``generation_config.json``, ``tokenizer.json``, ``tokenizer_config.json``, ``training.json`` (the
numbers of both models) and a model card ``README.md``.

    .venv/bin/python tools/train_demo_models.py                # ~40 + 15 minutes on a CPU
    .venv/bin/python tools/train_demo_models.py --smoke --out /tmp/demo   # seconds, tiny models
"""
from __future__ import annotations

import argparse
import inspect
import json
import math
import os
import platform
import shlex
import sys
import sysconfig
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Optional, Sequence

import numpy as np
import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from tokenizers import Tokenizer
    from transformers import LlamaForCausalLM

# Held-out modules, relative to the stdlib root (a trailing "/" means every file under it); all
# exist, with these names, in CPython 3.9 to 3.13.
HELD_OUT = ["bisect.py", "csv.py", "fractions.py", "heapq.py", "json/", "statistics.py",
            "string.py", "textwrap.py"]
SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}
EOS, PAD = "<|endoftext|>", "<|pad|>"             # ids 0 and 1
HEAD_SIZES = (64, 80, 96, 112, 128, 256)          # what the pagedspec attention kernels support
PROMPT_TOKENS, GEN_TOKENS = 128, 64               # acceptance-rate prompts and continuations
PROBE_STEPS = 8                                   # steps timed before fixing a budgeted schedule
MIN_LR_FRACTION = 0.1                             # the cosine decays to this fraction of the peak
TARGET_NAME, DRAFT_NAME = "pagedspec-demo", "pagedspec-demo-draft"
STEP_FLAGS = ("--steps", "--target-steps", "--draft-steps")
SMOKE = dict(vocab_size=300, seq_len=64, batch_size=2, steps=5, warmup_steps=1, evals=2,
             eval_windows=2, accept_prompts=2, max_train_files=20, max_held_out_files=2,
             target_hidden=64, target_layers=1, target_heads=1, target_kv_heads=1,
             target_intermediate=128, draft_hidden=64, draft_layers=1, draft_heads=1,
             draft_kv_heads=1, draft_intermediate=128)


# ---- corpus and tokenizer -------------------------------------------------------------------
@dataclass
class Corpus:
    train_files: list[str]
    held_out_files: list[str]
    train_texts: list[str] = field(repr=False)
    held_out_texts: list[str] = field(repr=False)


def matches(rel: str, entry: str) -> bool:
    """Whether the stdlib-relative path ``rel`` is the :data:`HELD_OUT` entry or under it."""
    return rel.startswith(entry) if entry.endswith("/") else rel == entry


def load_corpus(root: Path, max_train_files: Optional[int],
                max_held_out_files: Optional[int]) -> Corpus:
    """The stdlib's ``*.py`` files in sorted path order, split into training and held-out files;
    files that are not valid UTF-8 are skipped."""
    train: list[tuple[str, str]] = []
    held_out: list[tuple[str, str]] = []
    for rel in sorted(p.relative_to(root).as_posix() for p in root.rglob("*.py")):
        *dirs, name = rel.split("/")
        if (SKIP_DIRS.intersection(dirs) or any(d.startswith("config-") for d in dirs)
                or name.startswith("_sysconfigdata")):
            continue
        try:
            text = (root / rel).read_bytes().decode("utf-8")
        except UnicodeDecodeError:
            continue
        (held_out if any(matches(rel, h) for h in HELD_OUT) else train).append((rel, text))
    missing = [h for h in HELD_OUT if not any(matches(r, h) for r, _ in held_out)]
    if missing:
        raise SystemExit(f"{root}: held-out modules not found: {', '.join(missing)}")
    train, held_out = train[:max_train_files], held_out[:max_held_out_files]
    return Corpus([r for r, _ in train], [r for r, _ in held_out],
                  [t for _, t in train], [t for _, t in held_out])


def train_tokenizer(texts: Sequence[str], vocab_size: int) -> Tokenizer:
    """A byte-level BPE over ``texts`` with ``<|endoftext|>`` = 0 and ``<|pad|>`` = 1."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS, PAD],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer, length=len(texts))
    return tok


def token_stream(tok: Tokenizer, texts: Sequence[str], eos_id: int) -> np.ndarray:
    """``eos doc eos doc ... eos`` as one int64 array."""
    parts = [np.array([eos_id], dtype=np.int64)]
    for enc in tok.encode_batch(list(texts)):
        parts += [np.asarray(enc.ids, dtype=np.int64), parts[0]]
    return np.concatenate(parts)


def save_tokenizer(tok: Tokenizer, path: Path, context: int) -> None:
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOS, "pad_token": PAD,
         "model_max_length": context}, indent=2) + "\n")


# ---- models ---------------------------------------------------------------------------------
@dataclass
class Sizes:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int


SIZE_HELP = {"hidden": "hidden size", "layers": "decoder layers", "heads": "attention heads",
             "kv_heads": "key/value heads (grouped-query attention)",
             "intermediate": "SwiGLU intermediate size"}


def make_model(sizes: Sizes, vocab_size: int, head_dim: int, context: int) -> LlamaForCausalLM:
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=vocab_size, hidden_size=sizes.hidden, intermediate_size=sizes.intermediate,
        num_hidden_layers=sizes.layers, num_attention_heads=sizes.heads,
        num_key_value_heads=sizes.kv_heads, head_dim=head_dim, max_position_embeddings=context,
        rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=None,
        eos_token_id=0, pad_token_id=1)
    model = transformers.LlamaForCausalLM(config)
    model.generation_config = transformers.GenerationConfig(eos_token_id=0, pad_token_id=1)
    return model


def parameter_count(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())       # the tied embedding counts once


def round_to_bf16(model: torch.nn.Module) -> None:
    """Rounds the float32 weights to bf16 values in place: later measurements describe the
    weights that are saved."""
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16))


def save_model(model: LlamaForCausalLM, tok: Tokenizer, path: Path, context: int) -> None:
    path.mkdir(parents=True, exist_ok=True)
    model.to(torch.bfloat16).save_pretrained(path)
    save_tokenizer(tok, path, context)


# ---- precision and machine ------------------------------------------------------------------
def cpu_has_bf16() -> bool:
    """Native bf16 arithmetic (AVX512_BF16 or AMX tiles). ``get_cpu_capability`` stops at
    ``AVX512`` on most builds, so the CPU feature probes decide."""
    capability = torch.backends.cpu.get_cpu_capability()
    probes = (getattr(torch.cpu, "_is_avx512_bf16_supported", None),
              getattr(torch.cpu, "_is_amx_tile_supported", None))
    return ("BF16" in capability or "AMX" in capability
            or any(probe is not None and probe() for probe in probes))


def isa_description() -> str:
    extras = [name for name, probe in (("AVX512_BF16", "_is_avx512_bf16_supported"),
                                       ("AMX", "_is_amx_tile_supported"))
              if getattr(torch.cpu, probe, lambda: False)()]
    return torch.backends.cpu.get_cpu_capability() + (f" + {', '.join(extras)}" if extras else "")


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


# ---- training -------------------------------------------------------------------------------
LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class TrainResult:
    steps: int
    tokens: int
    seconds: float
    train_loss: float
    val_loss: float
    lr: float
    warmup_steps: int
    val_history: list[dict[str, float]]           # {"step", "val_loss"} from step 0 on


def lr_at(step: int, total: Optional[int], warmup: int, peak: float) -> float:
    """Linear warmup over ``warmup`` steps, then cosine decay to ``MIN_LR_FRACTION * peak`` at
    ``total`` (None: not yet known, the peak)."""
    if step < warmup:
        return peak * (step + 1) / warmup
    if total is None:
        return peak
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    cosine = 0.5 * (1 + math.cos(math.pi * progress))
    return peak * (MIN_LR_FRACTION + (1 - MIN_LR_FRACTION) * cosine)


def make_optimizer(model: torch.nn.Module, lr: float, weight_decay: float) -> torch.optim.AdamW:
    """AdamW with weight decay on the matrices (embedding included) and none on the norms."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.ndim >= 2], "weight_decay": weight_decay},
              {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95))


def sample_batch(data: np.ndarray, rng: np.random.Generator, batch: int,
                 seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    starts = rng.integers(0, len(data) - seq_len - 1, size=batch)
    window = torch.from_numpy(data[starts[:, None] + np.arange(seq_len + 1)])
    return window[:, :-1], window[:, 1:]


def windows(stream: np.ndarray, seq_len: int) -> list[torch.Tensor]:
    """Consecutive windows of ``seq_len + 1`` tokens overlapping by one, so that every token
    after the first is a target exactly once; the last may be shorter."""
    return [torch.from_numpy(stream[i:i + seq_len + 1]) for i in range(0, len(stream) - 1, seq_len)]


@torch.no_grad()
def held_out_nats(model: LlamaForCausalLM, chunks: Sequence[torch.Tensor], eos_id: int, bf16: bool,
                  batch: int) -> tuple[float, int]:
    """Total cross-entropy (nats) of the non-separator targets of ``chunks``, and their count."""
    model.eval()
    by_length: dict[int, list[torch.Tensor]] = {}
    for chunk in chunks:                                 # batches of equal-length windows
        by_length.setdefault(len(chunk), []).append(chunk)
    total, count = 0.0, 0
    for same in by_length.values():
        for i in range(0, len(same), batch):
            x = torch.stack(same[i:i + batch])
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                logits = model(x[:, :-1]).logits
            targets = x[:, 1:].flatten()
            nats = F.cross_entropy(logits.float().flatten(0, 1), targets, reduction="none")
            keep = targets != eos_id
            total += float(nats[keep].sum())
            count += int(keep.sum())
    return total, count


def train(model: LlamaForCausalLM, loss_fn: LossFn, data: np.ndarray,
          val_chunks: Sequence[torch.Tensor], *, eos_id: int, rng: np.random.Generator,
          batch: int, seq_len: int, lr: float, warmup: int, weight_decay: float,
          steps: Optional[int], budget_s: float, evals: int, bf16: bool,
          desc: str) -> TrainResult:
    """Trains ``model`` on random windows of ``data`` for ``steps`` steps, or, when ``steps`` is
    None, for as many as fit in ``budget_s`` seconds (validations included) as measured over
    the first :data:`PROBE_STEPS` steps. Validates before the first step and ``evals`` times
    evenly spaced after, the last after the last step."""
    from tqdm.auto import tqdm

    optimizer = make_optimizer(model, lr, weight_decay)
    params = [p for group in optimizer.param_groups for p in group["params"]]
    start = time.perf_counter()

    def validate() -> float:
        nats, count = held_out_nats(model, val_chunks, eos_id, bf16, batch)
        return nats / count

    val_history = [{"step": 0, "val_loss": validate()}]
    eval_seconds = time.perf_counter() - start
    total = steps
    bar = tqdm(total=total, desc=desc, file=sys.stderr, dynamic_ncols=True)
    losses: list[float] = []
    train_seconds, probe_start, step = 0.0, 0.0, 0
    while total is None or step < total:
        rate_lr = lr_at(step, total, warmup, lr)
        for group in optimizer.param_groups:
            group["lr"] = rate_lr
        inputs, targets = sample_batch(data, rng, batch, seq_len)
        t0 = time.perf_counter()
        model.train()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = loss_fn(inputs, targets)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        losses.append(loss.item())
        train_seconds += time.perf_counter() - t0
        step += 1
        if total is None and step == 1:
            probe_start = time.perf_counter()           # the first step pays one-time setup
        if total is None and step == PROBE_STEPS:
            per_step = (time.perf_counter() - probe_start) / (PROBE_STEPS - 1)
            left = budget_s - (time.perf_counter() - start) - evals * eval_seconds
            total = max(PROBE_STEPS, PROBE_STEPS + int(left / per_step))
            bar.total = total
        bar.update(1)
        bar.set_postfix(loss=f"{np.mean(losses[-10:]):.3f}", lr=f"{rate_lr:.2e}",
                        tok_s=f"{step * batch * seq_len / train_seconds:.0f}", refresh=False)
        if total is not None and step * evals // total > (step - 1) * evals // total:
            val_history.append({"step": step, "val_loss": validate()})
            bar.write(f"{desc}: step {step}/{total}  train loss {np.mean(losses[-10:]):.4f}  "
                      f"val loss {val_history[-1]['val_loss']:.4f}")
    bar.close()
    return TrainResult(steps=step, tokens=step * batch * seq_len,
                       seconds=round(time.perf_counter() - start, 2),
                       train_loss=float(np.mean(losses[-10:])),
                       val_loss=val_history[-1]["val_loss"], lr=lr, warmup_steps=warmup,
                       val_history=val_history)


def next_token_loss(model: LlamaForCausalLM) -> LossFn:
    def loss_fn(inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = model(inputs).logits.float()
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())
    return loss_fn


def distillation_loss(draft: LlamaForCausalLM, target: LlamaForCausalLM,
                      ce_weight: float) -> LossFn:
    """``(1 - ce_weight) * KL(p_target || p_draft) + ce_weight * CE(data, p_draft)``, per token,
    at temperature 1."""
    def loss_fn(inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            target_logp = F.log_softmax(target(inputs).logits.float(), -1).flatten(0, 1)
        draft_logp = F.log_softmax(draft(inputs).logits.float(), -1).flatten(0, 1)
        kl = F.kl_div(draft_logp, target_logp, log_target=True, reduction="batchmean")
        return (1 - ce_weight) * kl + ce_weight * F.nll_loss(draft_logp, targets.flatten())
    return loss_fn


# ---- acceptance rates -----------------------------------------------------------------------
@torch.no_grad()
def continue_prompts(model: LlamaForCausalLM, prompts: torch.Tensor, n: int, temperature: float,
                     bf16: bool, generator: torch.Generator) -> torch.Tensor:
    """``n`` tokens after each prompt, greedy (temperature 0) or sampled, with a KV cache."""
    from transformers import DynamicCache

    # transformers 5.x renamed the forward's ``past_key_values`` to ``cache``
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    cache = {name: DynamicCache()}
    tokens = []
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        logits = model(prompts, use_cache=True, **cache).logits[:, -1]
        for _ in range(n):
            if temperature == 0:
                token = logits.argmax(-1)
            else:
                probs = torch.softmax(logits.float() / temperature, -1)
                token = torch.multinomial(probs, 1, generator=generator)[:, 0]
            tokens.append(token)
            logits = model(token[:, None], use_cache=True, **cache).logits[:, -1]
    return torch.stack(tokens, 1)


@torch.no_grad()
def next_token_probs(model: LlamaForCausalLM, prompts: torch.Tensor, continuation: torch.Tensor,
                     bf16: bool) -> torch.Tensor:
    """The model's next-token distributions at the positions of ``continuation``."""
    seq = torch.cat([prompts, continuation], 1)[:, :-1]
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        logits = model(seq).logits[:, prompts.shape[1] - 1:]
    return torch.softmax(logits.float(), -1)


def acceptance_rates(target: LlamaForCausalLM, draft: LlamaForCausalLM, stream: np.ndarray,
                     num_prompts: int, bf16: bool, seed: int) -> dict[str, float]:
    """Greedy speculation: the fraction of the target's greedy tokens that the draft's argmax
    matches (same prefix). Rejection sampling at temperature 1: the mean over a sampled
    continuation of ``sum_x min(p_target(x), p_draft(x))``, a token's acceptance probability."""
    target.eval()
    draft.eval()
    starts = np.linspace(0, len(stream) - PROMPT_TOKENS - 1, num_prompts).astype(np.int64)
    prompts = torch.from_numpy(stream[starts[:, None] + np.arange(PROMPT_TOKENS)])
    generator = torch.Generator().manual_seed(seed)
    greedy = continue_prompts(target, prompts, GEN_TOKENS, 0.0, bf16, generator)
    draft_greedy = next_token_probs(draft, prompts, greedy, bf16).argmax(-1)
    sampled = continue_prompts(target, prompts, GEN_TOKENS, 1.0, bf16, generator)
    overlap = torch.minimum(next_token_probs(target, prompts, sampled, bf16),
                            next_token_probs(draft, prompts, sampled, bf16)).sum(-1)
    return {"temperature_0": float((draft_greedy == greedy).float().mean()),
            "temperature_1": float(overlap.mean())}


# ---- reports --------------------------------------------------------------------------------
def training_table(report: dict) -> str:
    """The model card's Markdown table comparing the target's and the draft's training."""
    t, d = report["target"], report["draft"]
    window = f"{report['batch_size']} × {report['seq_len']}"
    rows = [
        ("", f"target (`{TARGET_NAME}`)", f"draft (`{DRAFT_NAME}`)"),
        ("---", "---", "---"),
        ("parameters", f"{t['parameters']:,}", f"{d['parameters']:,}"),
        ("objective", "next-token cross-entropy",
         f"KL(target ‖ draft) + {d['ce_weight']} × cross-entropy"),
        ("steps × batch × sequence", f"{t['steps']} × {window}", f"{d['steps']} × {window}"),
        ("tokens seen", f"{t['tokens']:,}", f"{d['tokens']:,}"),
        ("peak learning rate", f"{t['lr']}", f"{d['lr']}"),
        ("wall time", f"{t['seconds'] / 60:.1f} min", f"{d['seconds'] / 60:.1f} min"),
        ("final train loss (nats/token; the draft's: its own objective)",
         f"{t['train_loss']:.4f}", f"{d['train_loss']:.4f}"),
        ("final held-out cross-entropy (nats/token)", f"{t['val_loss']:.4f}",
         f"{d['val_loss']:.4f}"),
        ("held-out bits per byte", f"{t['bits_per_byte']:.4f}", f"{d['bits_per_byte']:.4f}"),
    ]
    return "\n".join("| " + " | ".join(row) + " |" for row in rows)


def model_card(name: str, role: str, report: dict) -> str:
    """The ``README.md`` of the checkpoint ``name``."""
    a = report["acceptance"]
    me = report["target"] if name == TARGET_NAME else report["draft"]
    sizes = me["sizes"]
    held_out = ", ".join(f"`{h}`" for h in HELD_OUT)
    return f"""---
library_name: transformers
pipeline_tag: text-generation
tags: [llama, python, speculative-decoding, pagedspec]
---
# {name}

{role} Both models share one byte-level BPE tokenizer ({report['tokenizer']['vocab_size']}
tokens, `<|endoftext|>` = 0 as eos and document separator, `<|pad|>` = 1, no BOS) and were
trained from scratch with `tools/train_demo_models.py` in the pagedspec repository. They are
demo models for testing and benchmarking paged attention and speculative decoding: they complete
Python code in the style of the standard library and nothing else.

## Data

The `*.py` files of the standard library of Python {report['corpus']['python']}
({report['corpus']['train_files']} training files, {report['corpus']['train_tokens']:,} tokens;
without `site-packages`, the test suites and build-generated files). Held out from tokenizer and
model training, for validation: {held_out} ({report['corpus']['held_out_files']} files,
{report['corpus']['held_out_tokens']:,} tokens, {report['corpus']['held_out_bytes']:,} bytes).

## Model

`LlamaForCausalLM`: hidden size {sizes['hidden']}, layers {sizes['layers']}, attention heads
{sizes['heads']} (KV heads {sizes['kv_heads']}) of size {report['head_dim']}, intermediate size
{sizes['intermediate']}, tied embeddings, RoPE theta 10000, context {report['context']} tokens;
{me['parameters']:,} parameters, stored in bf16.

## Training

{training_table(report)}

AdamW (betas 0.9/0.95, weight decay {report['weight_decay']} on matrices), linear warmup then
cosine decay to {MIN_LR_FRACTION:.0%} of the peak, gradient clipping at 1.0,
{'bf16 autocast' if report['bf16'] else 'float32'}; seed {report['seed']}. Machine:
{report['machine']['cpu']} ({report['machine']['isa']}), {report['machine']['threads']} threads,
torch {report['machine']['torch']}. Measurements are of the saved bf16 weights.

## Speculative decoding

The draft's acceptance rate against the target on {a['prompts']} held-out prompts of
{PROMPT_TOKENS} tokens, over {GEN_TOKENS} target tokens each:

- temperature 0 (greedy; the draft's argmax equals the target's token): **{a['temperature_0']:.3f}**
- temperature 1 (rejection sampling; mean of sum_x min(p_target, p_draft) on a sampled
  continuation): **{a['temperature_1']:.3f}**

## Reproduce

From the root of the pagedspec repository, with `transformers` and `tokenizers` installed:

```
{report['command']}
```

Time budgets make the step counts depend on the machine; these step counts on any machine:

```
{report['command_fixed_steps']}
```
"""


def write_outputs(out: Path, target: LlamaForCausalLM, draft: LlamaForCausalLM,
                  tok: Tokenizer, report: dict, context: int) -> None:
    roles = {TARGET_NAME: (target, "The target model of a pair for speculative decoding; its "
                                   f"draft is `{DRAFT_NAME}`."),
             DRAFT_NAME: (draft, "The draft model of a pair for speculative decoding, distilled "
                                 f"from the target `{TARGET_NAME}`.")}
    for name, (model, role) in roles.items():
        path = out / name
        save_model(model, tok, path, context)
        (path / "training.json").write_text(json.dumps(report, indent=2) + "\n")
        (path / "README.md").write_text(model_card(name, role, report))


# ---- command line ---------------------------------------------------------------------------
def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                                allow_abbrev=False)
    p.add_argument("--out", type=Path, default=Path("python/pagedspec/models/data"),
                   help=f"writes OUT/{TARGET_NAME} and OUT/{DRAFT_NAME}")
    p.add_argument("--seed", type=int, default=0, help="seeds torch and the batch sampler")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                   help="torch CPU threads")
    p.add_argument("--smoke", action="store_true",
                   help="tiny models, corpus and step counts (seconds); explicit flags still win")
    p.add_argument("--vocab-size", type=int, default=4096, help="BPE vocabulary size")
    p.add_argument("--context", type=int, default=1024, help="max_position_embeddings")
    p.add_argument("--seq-len", type=int, default=1024, help="training window in tokens")
    p.add_argument("--batch-size", type=int, default=8, help="windows per step")
    p.add_argument("--head-dim", type=int, default=64, choices=HEAD_SIZES,
                   help="attention head size (the sizes pagedspec's kernels support)")
    for model, sizes in (("target", Sizes(384, 6, 6, 2, 1024)),
                         ("draft", Sizes(128, 1, 2, 1, 384))):
        for key, value in asdict(sizes).items():
            p.add_argument(f"--{model}-{key.replace('_', '-')}", type=int, default=value,
                           help=f"{model} {SIZE_HELP[key]}")
    p.add_argument("--target-minutes", type=float, default=40.0,
                   help="target training budget (validations included)")
    p.add_argument("--draft-minutes", type=float, default=15.0,
                   help="draft training budget (validations included)")
    p.add_argument("--steps", type=int, default=None,
                   help="fixed step count for both models instead of the time budgets")
    p.add_argument("--target-steps", type=int, default=None,
                   help="fixed target step count (overrides --steps)")
    p.add_argument("--draft-steps", type=int, default=None,
                   help="fixed draft step count (overrides --steps)")
    p.add_argument("--lr", type=float, default=2e-3, help="target peak learning rate")
    p.add_argument("--draft-lr", type=float, default=3e-3, help="draft peak learning rate")
    p.add_argument("--warmup-steps", type=int, default=30, help="linear warmup steps")
    p.add_argument("--weight-decay", type=float, default=0.1, help="AdamW decay on matrices")
    p.add_argument("--ce-weight", type=float, default=0.1,
                   help="weight of the data cross-entropy in the draft's distillation loss")
    p.add_argument("--bf16", choices=("auto", "on", "off"), default="auto",
                   help="bf16 autocast; auto: where the CPU has AVX512_BF16 or AMX")
    p.add_argument("--evals", type=int, default=10, help="validations per model")
    p.add_argument("--eval-windows", type=int, default=16,
                   help="held-out windows of --seq-len tokens per validation")
    p.add_argument("--accept-prompts", type=int, default=32,
                   help="held-out prompts for the acceptance rates")
    p.add_argument("--max-train-files", type=int, default=None,
                   help="use only the first N training files")
    p.add_argument("--max-held-out-files", type=int, default=None,
                   help="use only the first N held-out files")
    args = p.parse_args(argv)
    if args.smoke:
        p.set_defaults(**SMOKE)
        args = p.parse_args(argv)
    if any(n is not None and n < 1 for n in (args.steps, args.target_steps, args.draft_steps)):
        p.error("step counts must be >= 1")
    if args.seq_len > args.context:
        p.error(f"--seq-len {args.seq_len} exceeds --context {args.context}")
    for model in ("target", "draft"):
        if getattr(args, f"{model}_heads") % getattr(args, f"{model}_kv_heads"):
            p.error(f"--{model}-heads must be a multiple of --{model}-kv-heads")
    return args


def model_sizes(args: argparse.Namespace, model: str) -> Sizes:
    return Sizes(*(getattr(args, f"{model}_{f.name}") for f in fields(Sizes)))


def without_step_flags(argv: Sequence[str]) -> list[str]:
    """``argv`` without ``--steps``, ``--target-steps`` and ``--draft-steps`` and their values."""
    kept: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
        elif arg in STEP_FLAGS:
            skip = True
        elif arg.split("=", 1)[0] not in STEP_FLAGS:
            kept.append(arg)
    return kept


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    bf16 = args.bf16 == "on" or (args.bf16 == "auto" and cpu_has_bf16())
    target_steps = args.target_steps if args.target_steps is not None else args.steps
    draft_steps = args.draft_steps if args.draft_steps is not None else args.steps

    t0 = time.perf_counter()
    corpus = load_corpus(Path(sysconfig.get_paths()["stdlib"]), args.max_train_files,
                         args.max_held_out_files)
    tok = train_tokenizer(corpus.train_texts, args.vocab_size)
    eos_id, pad_id = tok.token_to_id(EOS), tok.token_to_id(PAD)
    assert (eos_id, pad_id) == (0, 1), (eos_id, pad_id)
    vocab = tok.get_vocab_size()
    train_data = token_stream(tok, corpus.train_texts, eos_id)
    held_out = token_stream(tok, corpus.held_out_texts, eos_id)
    held_out_bytes = sum(len(t.encode("utf-8")) for t in corpus.held_out_texts)
    all_chunks = windows(held_out, args.seq_len)
    val_chunks = [c for c in all_chunks if len(c) == args.seq_len + 1][:args.eval_windows]
    print(f"corpus: {len(corpus.train_files)} training files ({len(train_data):,} tokens), "
          f"{len(corpus.held_out_files)} held-out ({len(held_out):,} tokens, "
          f"{held_out_bytes:,} bytes); vocab {vocab}; {time.perf_counter() - t0:.1f}s")
    if not val_chunks or len(held_out) <= PROMPT_TOKENS + GEN_TOKENS:
        raise SystemExit("held-out set too small for --seq-len and the acceptance prompts")

    target = make_model(model_sizes(args, "target"), vocab, args.head_dim, args.context)
    draft = make_model(model_sizes(args, "draft"), vocab, args.head_dim, args.context)
    print(f"parameters: target {parameter_count(target):,}, draft {parameter_count(draft):,}; "
          f"{'bf16 autocast' if bf16 else 'float32'}, {torch.get_num_threads()} threads")
    common = dict(eos_id=eos_id, batch=args.batch_size, seq_len=args.seq_len,
                  warmup=args.warmup_steps, weight_decay=args.weight_decay, evals=args.evals,
                  bf16=bf16)

    target_result = train(target, next_token_loss(target), train_data, val_chunks,
                          rng=np.random.default_rng([args.seed, 0]), lr=args.lr,
                          steps=target_steps, budget_s=args.target_minutes * 60,
                          desc="target", **common)
    round_to_bf16(target)
    target.eval().requires_grad_(False)
    draft_result = train(draft, distillation_loss(draft, target, args.ce_weight), train_data,
                         val_chunks, rng=np.random.default_rng([args.seed, 1]), lr=args.draft_lr,
                         steps=draft_steps, budget_s=args.draft_minutes * 60, desc="draft",
                         **common)
    round_to_bf16(draft)

    bits_per_byte = {}
    for name, model in (("target", target), ("draft", draft)):
        nats, _ = held_out_nats(model, all_chunks, eos_id, bf16, args.batch_size)
        bits_per_byte[name] = nats / math.log(2) / held_out_bytes
    acceptance = acceptance_rates(target, draft, held_out, args.accept_prompts, bf16, args.seed)
    print(f"held-out bits per byte: target {bits_per_byte['target']:.4f}, draft "
          f"{bits_per_byte['draft']:.4f}; acceptance: temperature 0 "
          f"{acceptance['temperature_0']:.3f}, temperature 1 {acceptance['temperature_1']:.3f}")

    command = shlex.join(["python", "tools/train_demo_models.py", *argv])
    report = {
        "seed": args.seed,
        "corpus": {"python": f"{sys.version_info.major}.{sys.version_info.minor}",
                   "held_out": HELD_OUT, "train_files": len(corpus.train_files),
                   "held_out_files": len(corpus.held_out_files),
                   "held_out_paths": corpus.held_out_files,
                   "train_tokens": int(len(train_data)), "held_out_tokens": int(len(held_out)),
                   "held_out_bytes": held_out_bytes},
        "tokenizer": {"type": "byte-level BPE", "vocab_size": vocab, "eos_token": EOS,
                      "eos_token_id": eos_id, "pad_token": PAD, "pad_token_id": pad_id},
        "context": args.context, "seq_len": args.seq_len, "batch_size": args.batch_size,
        "head_dim": args.head_dim, "weight_decay": args.weight_decay, "bf16": bf16,
        "machine": {"cpu": cpu_name(), "isa": isa_description(),
                    "threads": torch.get_num_threads(), "torch": torch.__version__},
        "target": {"sizes": asdict(model_sizes(args, "target")),
                   "parameters": parameter_count(target), **asdict(target_result),
                   "bits_per_byte": bits_per_byte["target"]},
        "draft": {"sizes": asdict(model_sizes(args, "draft")),
                  "parameters": parameter_count(draft), **asdict(draft_result),
                  "ce_weight": args.ce_weight, "bits_per_byte": bits_per_byte["draft"]},
        "acceptance": {"prompts": args.accept_prompts, "prompt_tokens": PROMPT_TOKENS,
                       "generated_tokens": GEN_TOKENS, **acceptance},
        "command": command,
        "command_fixed_steps": shlex.join(
            ["python", "tools/train_demo_models.py", *without_step_flags(argv),
             "--target-steps", str(target_result.steps), "--draft-steps", str(draft_result.steps)]),
    }
    write_outputs(args.out, target, draft, tok, report, args.context)
    print(f"wrote {args.out / TARGET_NAME} and {args.out / DRAFT_NAME} "
          f"in {time.perf_counter() - t0:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
