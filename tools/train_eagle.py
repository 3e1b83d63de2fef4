"""Trains an EAGLE-style draft head for SmolLM2-135M-Instruct (or any Llama-architecture target
pagedspec loads): a draft that reads the target's own last hidden state, so that it predicts
the token after next from what the target already computed instead of from the tokens alone.

Why: the token-only draft (``train_draft.py``, 2 layers) accepts 0.46 of its first drafts on
held-out prompts; even free drafting caps its speedup at 1.83x. The target's final hidden state
holds far more of what the next steps will be than the tokens do (EAGLE, Li et al. 2024).

Architecture (what :class:`pagedspec.models.llama.EagleDraft` runs): row ``i`` of a sequence
takes the target's feature ``f_i`` (its final-norm output at position ``i``, the LM head's
input) and the embedding of token ``x_{i+1}``; ``fc([embed(x_{i+1}), f_i])`` (one ``[H, 2H]``
matrix) feeds one Llama decoder layer at position ``i`` and a final RMSNorm, whose output
``g_{i+1}`` is the draft's estimate of ``f_{i+1}``: the target's (borrowed, frozen) LM head on
it gives the draft's distribution of ``x_{i+2}``, restricted to the draft vocabulary of the
token-only draft. Later drafts feed ``g`` back in place of the feature the target has not yet
computed.

Recipe (seeded; about 60 minutes on a 2-core CPU with the defaults):

1. Data: the token-only draft's training continuations (``--generations``, written by
   ``train_draft.py``: one greedy and one temperature-0.7 continuation per training prompt),
   prompts included, plus its vocabulary and held-out prompts. 4% of the prompts (both of their
   continuations) are set aside for validation.
2. Features: the target (``transformers``, bf16) runs every sequence once; its final hidden
   states are kept in bf16.
3. Training, float32: loss = smooth L1 of ``g_{i+1}`` against ``f_{i+1}`` (averaged over the
   hidden size) + ``--cls-weight`` x KL(target || draft) of the next-next token over the draft
   vocabulary (the target's distribution from ``f_{i+1}`` through the same head), on every
   position; the input features get uniform noise of ``--noise`` x their RMS (at inference
   later drafts read the draft's own estimates). With ``--passes`` p > 1 the loss is the mean
   over p unrolled draft passes (training-time test, as in EAGLE-3): pass p's rows read the
   previous pass's outputs in place of the target's features and attend what the engine's
   p-th draft would (:meth:`EagleHead.unrolled`), so later drafts are trained on the inputs
   they get. The decoder layer starts from transformers'
   initialization, ``fc`` as the identity on the feature half, the norm as the target's final
   norm. AdamW, warmup then cosine, clipping 1.0, step count from ``--train-minutes``.
4. Saved in bf16 (fc + 1 layer + norm); the embedding and tied LM head are borrowed from the
   target at load time. Evaluated with pagedspec's engine on the held-out prompts: acceptance
   per draft position with k = 5, at temperature 0 and 0.7.

    .venv/bin/python tools/train_eagle.py                    # ~60 minutes on a 2-core CPU
    .venv/bin/python tools/train_eagle.py --smoke --target DIR --generations G.json --out /tmp/e
"""
from __future__ import annotations

import argparse
import json
import shlex
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from pagedspec.models.llama import EAGLE_FC as FC, EAGLE_KEY   # the format the loader reads

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_demo_models import lr_at, make_optimizer  # noqa: E402
from train_draft import (BORROWED_KEY, EMBEDDING, SAMPLE_TEMPERATURE, Example,  # noqa: E402
                         Phases, epoch_batches, load_generations, machine, target_embedding,
                         target_hf_dir, write_report)

DEFAULT_TOKEN_DRAFT = Path("python/pagedspec/models/data/smollm2-135m-draft")
SMOKE = dict(train_minutes=0.05, max_sequences=12, tokens_per_step=512, eval_prompts=2,
             eval_max_tokens=8, evals=1, warmup_steps=2)


@dataclass
class Sequenced(Example):
    index: int = 0                     # row in the feature list


# ---- the head -------------------------------------------------------------------------------
def head_config(target_hf: Path):
    from transformers import LlamaConfig

    config = LlamaConfig.from_pretrained(target_hf)
    config.num_hidden_layers = 1
    config.tie_word_embeddings = True
    config._attn_implementation = "sdpa"
    return config


class EagleHead(torch.nn.Module):
    """The training-side twin of pagedspec's ``EagleDraft``: teacher-forced over whole
    sequences (causal), ``forward(embeds, features, positions) -> g`` ``[B, T, H]``."""

    def __init__(self, config):
        from transformers.models.llama.modeling_llama import (LlamaDecoderLayer, LlamaRMSNorm,
                                                              LlamaRotaryEmbedding)

        super().__init__()
        H = config.hidden_size
        self.fc = torch.nn.Linear(2 * H, H, bias=False)
        self.layer = LlamaDecoderLayer(config, layer_idx=0)
        self.norm = LlamaRMSNorm(H, eps=config.rms_norm_eps)
        self.rotary = LlamaRotaryEmbedding(config)

    def forward(self, embeds: torch.Tensor, features: torch.Tensor, positions: torch.Tensor
                ) -> torch.Tensor:
        h = self.fc(torch.cat([embeds, features], dim=-1))
        h = self.layer(h, position_ids=positions,
                       position_embeddings=self.rotary(h, positions))
        return self.norm(h)

    def unrolled(self, embeds: torch.Tensor, features: torch.Tensor, positions: torch.Tensor,
                 passes: int) -> list[torch.Tensor]:
        """``passes`` outputs ``[B, T, H]``, each row as the engine's draft ``p`` would compute
        it (training-time test, as in EAGLE-3). Pass 1 is :meth:`forward`. Pass ``p > 1``'s row
        ``j`` reads the token at ``j + 1`` and, in place of the target's feature, pass
        ``p - 1``'s output at row ``j - 1``; it attends what that draft's cache holds: pass 1's
        rows up to ``j - p + 1`` (the rows the target's features fed), pass ``q``'s row
        ``j - (p - q)`` for ``1 < q < p``, and itself. The passes run as one sequence of
        ``passes * T`` rows under that mask, each pass's input built from the one before."""
        outs = [self(embeds, features, positions)]
        T = embeds.shape[1]
        if passes == 1:
            return outs
        i = torch.arange(T)
        inputs = [torch.cat([embeds, features], dim=-1)]
        for p in range(2, passes + 1):
            prev = outs[-1]
            shifted = torch.cat([torch.zeros_like(prev[:, :1]), prev[:, :-1]], dim=1)
            inputs.append(torch.cat([embeds, shifted], dim=-1))
            rows = []
            for q in range(1, p + 1):       # query pass q's attention over every pass's keys
                blocks = [i[None, :] <= (i[:, None] - q + 1)]      # pass 1's keys
                blocks += [i[None, :] == i[:, None] - (q - r) if r <= q
                           else torch.zeros(T, T, dtype=torch.bool) for r in range(2, p + 1)]
                rows.append(torch.cat(blocks, dim=1))
            mask = torch.cat(rows, dim=0)[None, None].expand(embeds.shape[0], 1, p * T, p * T)
            pos = positions.repeat(1, p)
            h = self.fc(torch.cat(inputs, dim=1))
            h = self.layer(h, attention_mask=mask, position_ids=pos,
                           position_embeddings=self.rotary(h, pos))
            outs.append(self.norm(h)[:, (p - 1) * T:])
        return outs

    def state_for_checkpoint(self) -> dict[str, torch.Tensor]:
        out = {FC: self.fc.weight, "model.norm.weight": self.norm.weight}
        out.update({f"model.layers.0.{n}": t for n, t in self.layer.state_dict().items()})
        return out

    def load_checkpoint_state(self, state: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            self.fc.weight.copy_(state[FC])
            self.norm.weight.copy_(state["model.norm.weight"])
            self.layer.load_state_dict({n[len("model.layers.0."):]: t for n, t in state.items()
                                        if n.startswith("model.layers.0.")})


def make_head(config, final_norm: torch.Tensor) -> EagleHead:
    head = EagleHead(config).float()
    H = config.hidden_size
    with torch.no_grad():
        head.fc.weight[:, H:].copy_(torch.eye(H))       # starts by passing the feature on
        head.fc.weight[:, :H].normal_(0.0, 0.02)
        head.norm.weight.copy_(final_norm)
    return head


# ---- data -----------------------------------------------------------------------------------
@torch.inference_mode()
def target_features(target_hf: Path, sequences: Sequence[list[int]], threads: int
                    ) -> list[torch.Tensor]:
    """The target's final hidden states (after its final norm) per sequence, bf16 ``[T, H]``."""
    from transformers import LlamaForCausalLM

    torch.set_num_threads(threads)
    model = LlamaForCausalLM.from_pretrained(target_hf, dtype=torch.bfloat16).eval()
    out, start = [], time.perf_counter()
    for n, ids in enumerate(sequences):
        hidden = model.model(input_ids=torch.tensor([ids]), use_cache=False).last_hidden_state
        out.append(hidden[0].to(torch.bfloat16).clone())
        if n % 200 == 199:
            print(f"features: {n + 1}/{len(sequences)} sequences, "
                  f"{time.perf_counter() - start:.0f}s", flush=True)
    return out


def split_by_prompt(examples: Sequence[Sequenced], fraction: float, seed: int
                    ) -> tuple[list[Sequenced], list[Sequenced]]:
    """(train, validation): a seeded ``fraction`` of the distinct prompts, with every sequence of
    theirs, goes to validation."""
    prompts = sorted({tuple(e.ids[:e.loss_from]) for e in examples})
    rng = np.random.default_rng([seed, 2])
    held = {prompts[i] for i in rng.permutation(len(prompts))[:max(1, int(fraction
                                                                           * len(prompts)))]}
    train = [e for e in examples if tuple(e.ids[:e.loss_from]) not in held]
    val = [e for e in examples if tuple(e.ids[:e.loss_from]) in held]
    return train, val


def collate(batch: Sequence[Sequenced], features: Sequence[torch.Tensor],
            embedding: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Right-padded rows ``i = 0 .. T-2`` of each sequence: next-token embeddings, input
    features ``f_i``, target features ``f_{i+1}``, and the mask of real rows."""
    width = max(len(e.ids) for e in batch) - 1
    H = embedding.shape[1]
    embeds = torch.zeros(len(batch), width, H)
    inputs = torch.zeros(len(batch), width, H)
    targets = torch.zeros(len(batch), width, H)
    mask = torch.zeros(len(batch), width, dtype=torch.bool)
    for row, e in enumerate(batch):
        n = len(e.ids) - 1
        f = features[e.index].float()
        embeds[row, :n] = embedding[torch.as_tensor(e.ids[1:])]
        inputs[row, :n] = f[:n]
        targets[row, :n] = f[1:n + 1]
        mask[row, :n] = True
    return embeds, inputs, targets, mask


def head_loss(head: EagleHead, vocab_head: torch.Tensor, batch: tuple[torch.Tensor, ...],
              cls_weight: float, noise: float, passes: int = 1) -> tuple[torch.Tensor, dict]:
    """The mean over ``passes`` (:meth:`EagleHead.unrolled`) of smooth L1 against the target's
    next feature + ``cls_weight`` x KL(target || draft) of the next-next token; ``p<n>_top1``:
    pass n's agreement with the target's argmax (pass n > 1 leaves out the rows without a row
    before them)."""
    embeds, inputs, targets, mask = batch
    if noise:
        rms = inputs.pow(2).mean(-1, keepdim=True).sqrt()
        inputs = inputs + (torch.rand_like(inputs) * 2 - 1) * noise * rms
    positions = torch.arange(inputs.shape[1]).expand(inputs.shape[0], -1)
    # The target's side once for every pass: pass p keeps the rows from column p - 1 on.
    targets_all = targets[mask]
    log_p_all = F.log_softmax(targets_all @ vocab_head.T, dim=-1)
    column = torch.arange(mask.shape[1]).expand_as(mask)[mask]
    total, parts = 0.0, {}
    for p, g in enumerate(head.unrolled(embeds, inputs, positions, passes), start=1):
        keep = column >= p - 1
        want, log_p, g = targets_all[keep], log_p_all[keep], g[mask][keep]
        reg = F.smooth_l1_loss(g, want, reduction="none").mean(-1).mean()
        log_q = F.log_softmax(g @ vocab_head.T, dim=-1)
        kl = (log_p.exp() * (log_p - log_q)).sum(-1).mean()
        total = total + (reg + cls_weight * kl) / passes
        agree = (log_q.argmax(-1) == log_p.argmax(-1)).float().mean()
        parts.update({f"p{p}_reg": reg.item(), f"p{p}_kl": kl.item(),
                      f"p{p}_top1": agree.item()})
    return total, parts


@torch.no_grad()
def validate(head: EagleHead, vocab_head, val, features, embedding, args) -> dict:
    """Validation figures of two passes whatever ``--passes`` trains (pass 2's agreement is the
    second draft's, which a head trained on one pass has never been taught)."""
    totals, n = {}, 0
    for i in range(0, len(val), 8):
        batch = collate(val[i:i + 8], features, embedding)
        _, parts = head_loss(head, vocab_head, batch, args.cls_weight, 0.0, passes=2)
        rows = int(batch[3].sum())
        for key, value in parts.items():
            totals[key] = totals.get(key, 0.0) + value * rows
        n += rows
    return {k: round(v / max(n, 1), 4) for k, v in totals.items()}


def train(head: EagleHead, vocab_head: torch.Tensor, examples, val, features, embedding,
          args) -> dict:
    """AdamW for ``--train-minutes`` (the step count is fixed after the first timed steps)."""
    rng = np.random.default_rng([args.seed, 3])
    torch.manual_seed(args.seed)
    opt = make_optimizer(head, args.lr, args.weight_decay)
    budget, start = args.train_minutes * 60, time.perf_counter()
    total: Optional[int] = None
    history, step, tokens = [], 0, 0
    epoch_steps = len(epoch_batches(examples, args.tokens_per_step, rng))
    eval_every = None
    while True:
        for batch_examples in epoch_batches(examples, args.tokens_per_step, rng):
            if total is not None and step >= total:
                break
            for group in opt.param_groups:
                group["lr"] = lr_at(step, total, args.warmup_steps, args.lr)
            batch = collate(batch_examples, features, embedding)
            loss, parts = head_loss(head, vocab_head, batch, args.cls_weight, args.noise,
                                      args.passes)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
            opt.step()
            step += 1
            tokens += int(batch[3].sum())
            if total is None and step == 5:
                per_step = (time.perf_counter() - start) / step
                total = max(step + 1, int(budget / per_step))
                total = min(total, int(args.max_epochs * epoch_steps))
                eval_every = max(1, total // args.evals)
                print(f"train: {per_step:.2f}s/step -> {total} steps "
                      f"({total / epoch_steps:.1f} epochs)", flush=True)
            if eval_every and (step % eval_every == 0 or step == total):
                history.append({"step": step, "seconds": round(time.perf_counter() - start),
                                **validate(head, vocab_head, val, features, embedding, args)})
                print(f"train: step {step}/{total} loss {loss.item():.4f} {parts} "
                      f"val {history[-1]}", flush=True)
        if total is not None and step >= total:
            break
    return {"steps": step, "tokens": tokens, "seconds": round(time.perf_counter() - start, 1),
            "epochs": round(step / epoch_steps, 2), "val_history": history}


# ---- saving and evaluation ------------------------------------------------------------------
def save_head(head: EagleHead, config, out: Path, token_draft: Path) -> None:
    from safetensors.torch import save_file

    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    config.save_pretrained(out)
    raw = json.loads((out / "config.json").read_text())
    raw.pop("_attn_implementation", None)
    raw.update({"architectures": ["LlamaForCausalLM"], "dtype": "bfloat16",
                "torch_dtype": "bfloat16", BORROWED_KEY: [EMBEDDING],
                EAGLE_KEY: {"fc": FC, "input": "target_final_hidden_state",
                            "order": ["token_embedding", "feature"]}})
    (out / "config.json").write_text(json.dumps(raw, indent=2, sort_keys=True) + "\n")
    tensors = {n: t.detach().to(torch.bfloat16).contiguous()
               for n, t in head.state_for_checkpoint().items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    # No tokenizer: the head loads only beside its target (it borrows the embedding), whose
    # tokenizer it shares by construction; a copy would add 3.5 MB to the package.
    for name in ("draft_vocab.json", "heldout_prompts.json"):
        shutil.copy(token_draft / name, out / name)


def evaluate(target: str, out: Path, args) -> list[dict]:
    """Acceptance per draft position (k fixed at 5) over the held-out prompts (rendered with
    the target's chat template), at temperature 0 and 0.7, with pagedspec's engine in
    float32."""
    from pagedspec import LLM, SamplingParams
    from pagedspec.bench.e2e_spec import chat_renderer, render

    from pagedspec.models import load_checkpoint

    prompts = json.loads((out / "heldout_prompts.json").read_text())[:args.eval_prompts]
    max_model_len = min(1024, load_checkpoint(target).config.max_position)
    results = []
    for temperature in (0.0, SAMPLE_TEMPERATURE):
        llm = LLM(target, dtype="float32", speculative_model=str(out), num_speculative_tokens=5,
                  speculative_adaptive=False, seed=args.seed, max_model_len=max_model_len)
        renderer = chat_renderer(llm)
        ids = [render(renderer, p["messages"]) if renderer is not None
               else p["messages"][-1]["content"] for p in prompts]
        params = SamplingParams(temperature=temperature, max_tokens=args.eval_max_tokens,
                                seed=args.seed)
        llm.generate(ids, params, use_tqdm=False)
        st = llm.speculative_metrics()
        results.append({"temperature": temperature, "a": st["acceptance_rate_per_position"],
                        "mean_accepted": st["mean_acceptance_length"] - 1,
                        "drafts": st["num_drafts"]})
        print(f"acceptance at temperature {temperature}: "
              f"{[round(x, 3) for x in results[-1]['a']]}, mean accepted "
              f"{results[-1]['mean_accepted']:.3f}", flush=True)
        del llm
    return results


def model_card(report: dict) -> str:
    rows = "\n".join(f"| {r['temperature']} | " + " | ".join(f"{x:.2f}" for x in r["a"])
                     + f" | {r['mean_accepted']:.2f} |" for r in report.get("acceptance", []))
    t, d = report["training"], report["data"]
    last = t["val_history"][-1] if t["val_history"] else {}
    return f"""# {report['name']}: an EAGLE-style draft head for {report['target']}

A draft for speculative decoding that reads the target's final hidden state: one Llama decoder
layer ({report['config']['hidden_size']} hidden, {report['config']['intermediate_size']} MLP)
behind `fc([embed(token), feature])`, then an RMSNorm; the target's embedding and tied LM head
are borrowed at load time (`{BORROWED_KEY}`), the LM head restricted to the
{report['vocabulary']} tokens of `draft_vocab.json` (the token-only draft's vocabulary).
{report['stored_parameters']:,} stored parameters, bf16.

Use: `LLM("{report['target']}", speculative_model="{report['name']}")` (pagedspec only: the
head needs the target's hidden states, which `transformers`' assisted generation does not pass).

## Data
The token-only draft's training continuations of {d['prompts']} training prompts (greedy and
temperature 0.7): {d['sequences']} sequences, {d['tokens']:,} tokens with their prompts, of
which {d['val_sequences']} sequences ({d['val_prompts']} prompts) are validation. Features: the
target in bf16 (`transformers`), {report['phase_seconds'].get('features', 0):.0f} s.

## Training
{t['steps']} steps, {t['epochs']} epochs, {t['seconds'] / 60:.1f} minutes; loss = smooth L1 on
the feature + {report['settings']['cls_weight']} x KL on the next-next token, averaged over
{report['settings'].get('passes', 1)} unrolled draft pass(es) (training-time test), input noise
{report['settings']['noise']} x RMS, lr {report['settings']['lr']}, seed {report['seed']}.
Validation at the end: {last}.

## Acceptance on held-out prompts (pagedspec engine, float32, k = 5)
| temperature | a1 | a2 | a3 | a4 | a5 | mean accepted |
|---|---|---|---|---|---|---|
{rows}

a_j: the share of drafts at position j accepted. Machine: {report['machine']}.
{stage1_note(report)}
Reproduce: `{report['command']}`{init_note(report)}
"""


def stage1_note(report: dict) -> str:
    """The acceptance of the head this run started from, measured the same way, if recorded."""
    stage1 = report.get("stage1")
    if not stage1:
        return ""
    rows = "; ".join(f"temperature {r['temperature']}: "
                     + " ".join(f"{x:.2f}" for x in r["a"]) + f", mean accepted "
                     f"{r['mean_accepted']:.2f}" for r in stage1.get("acceptance", []))
    passes = stage1.get("passes", 1)
    return (f"\nThe head this run started from ({stage1['training']['steps']} steps of "
            f"{'one pass' if passes == 1 else f'{passes} passes'}, "
            f"{stage1['training']['seconds'] / 60:.0f} minutes; validation "
            f"{stage1['val_end']}): {rows}.\n")


def init_note(report: dict) -> str:
    """The recipe of the head a run started from (``--init-head``), which reproducing needs."""
    init = report["settings"].get("init_head")
    if not init:
        return ""
    command = report.get("init_command") or "(unknown)"
    return f", starting from `{init}`, itself trained by `{command}`"


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                                allow_abbrev=False)
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument("--target-hf", type=Path, default=None)
    p.add_argument("--token-draft", type=Path, default=DEFAULT_TOKEN_DRAFT,
                   help="the token-only draft: its vocabulary and held-out prompts are reused")
    p.add_argument("--generations", type=Path, default=Path("/tmp/draft-work/generations.json"),
                   help="train_draft.py's continuations")
    p.add_argument("--out", type=Path,
                   default=Path("python/pagedspec/models/data/smollm2-135m-eagle"))
    p.add_argument("--work", type=Path, default=Path("/tmp/draft-work"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--train-minutes", type=float, default=30.0)
    p.add_argument("--max-sequences", type=int, default=None)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--tokens-per-step", type=int, default=8192)
    p.add_argument("--max-epochs", type=float, default=20.0)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup-steps", type=int, default=30)
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--cls-weight", type=float, default=0.2)
    p.add_argument("--noise", type=float, default=0.1)
    p.add_argument("--init-head", type=Path, default=None,
                   help="start from this saved head (e.g. one trained with --passes 1) "
                        "instead of the identity-feature initialization")
    p.add_argument("--passes", type=int, default=1,
                   help="draft passes unrolled in training (training-time test; 1: EAGLE-1's "
                        "teacher forcing only)")
    p.add_argument("--val-fraction", type=float, default=0.04)
    p.add_argument("--evals", type=int, default=6)
    p.add_argument("--eval-prompts", type=int, default=48)
    p.add_argument("--eval-max-tokens", type=int, default=96)
    p.add_argument("--evaluate-only", action="store_true",
                   help="evaluate --out and rewrite its card, without training")
    args = p.parse_args(argv)
    if args.smoke:
        p.set_defaults(**SMOKE)
        args = p.parse_args(argv)
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    if args.evaluate_only:
        report = json.loads((args.out / "training.json").read_text())
        report["acceptance"] = evaluate(args.target, args.out, args)
        write_report(args.out, report, model_card(report))
        return 0
    args.work.mkdir(parents=True, exist_ok=True)
    phase = Phases()
    phases = phase.seconds

    hf = target_hf_dir(args.target, args.target_hf, args.work)
    generations, done, _ = load_generations(args.generations)
    generations = generations[:args.max_sequences]
    examples = [Sequenced((g.prompt_ids + g.output_ids)[:args.seq_len + 1], len(g.prompt_ids), i)
                for i, g in enumerate(generations)]
    train_set, val = split_by_prompt(examples, args.val_fraction, args.seed)
    features = target_features(hf, [e.ids for e in examples], args.threads)
    phase("features")

    config = head_config(hf)
    vocab = json.loads((args.token_draft / "draft_vocab.json").read_text())["token_ids"]
    embedding = target_embedding(args.target)
    vocab_head = embedding[torch.as_tensor(vocab)].contiguous()
    from safetensors.torch import load_file
    final_norm = load_file(str(hf / "model.safetensors"))["model.norm.weight"].float()
    head = make_head(config, final_norm)
    if args.init_head is not None:
        head.load_checkpoint_state({n: t.float() for n, t in load_file(
            str(args.init_head / "model.safetensors")).items()})
    result = train(head, vocab_head, train_set, val, features, embedding, args)
    phase("train")
    save_head(head, config, args.out, args.token_draft)
    report = {
        "name": args.out.name, "target": args.target, "seed": args.seed,
        "config": {"hidden_size": config.hidden_size,
                   "intermediate_size": config.intermediate_size, "num_hidden_layers": 1},
        "stored_parameters": sum(t.numel() for t in head.state_for_checkpoint().values()),
        "vocabulary": len(vocab),
        "data": {"prompts": done, "sequences": len(examples),
                 "tokens": sum(len(e.ids) for e in examples), "val_sequences": len(val),
                 "val_prompts": len({tuple(e.ids[:e.loss_from]) for e in val})},
        "training": result, "phase_seconds": phases,
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "machine": machine(),
        "command": shlex.join(["python", "tools/train_eagle.py", *argv]),
    }
    if args.init_head is not None and (args.init_head / "training.json").exists():
        init = json.loads((args.init_head / "training.json").read_text())
        report["init_command"] = init.get("command")
        if init.get("training", {}).get("val_history"):   # the starting head, for the card
            report["stage1"] = {
                "training": {k: init["training"][k] for k in ("steps", "epochs", "seconds")},
                "passes": init.get("settings", {}).get("passes", 1),
                "val_end": init["training"]["val_history"][-1],
                "phase_seconds": init.get("phase_seconds"),
                "acceptance": init.get("acceptance", [])}
    # Written before the evaluation too: should it fail, --evaluate-only reruns just that.
    write_report(args.out, report, model_card(report))
    report["acceptance"] = evaluate(args.target, args.out, args)
    phase("evaluate")
    write_report(args.out, report, model_card(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
