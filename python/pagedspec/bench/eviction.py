"""KV eviction: perplexity, retrieval, memory and speed at a KV budget, for each policy.

    python -m pagedspec.bench.eviction [--model M] [--context 2048] [--docs 3] [--prompts 8]
                                       [--fractions 0.5,0.25,0.1] [--out DIR]

The model: ``--model`` (default SmolLM2-135M-Instruct when cached, else the shipped demo model).
The text: long held-out prose from the standard library, Python's own documentation
(``pydoc_data.topics``, about 460k characters; ``--text`` files instead), never a hub.

Perplexity: ``--docs`` windows of ``--context`` tokens, each fed through the engine's pieces (the
scheduler, the paged runner through ``paged_attention_run`` with ``attn_mass``, and
:class:`pagedspec.engine.kv_eviction.KVBudgets`, as ``LLM`` uses them) as a prompt in chunks of
``CHUNK`` tokens, one chunk per step, the policy enforced after every step, as a long
conversation streams in; every row's logits score the true next token (teacher forcing), then
``DECODE`` more true tokens are decoded one per step (timed: decode tokens/s at the full context
under the budget). Chunks of one block evict as often as token-by-token decoding does (eviction
drops whole full blocks, one per block filled). Per run: perplexity over all scored tokens and
over the second half of each window (where the budget bites), the mean and peak KV tokens held
per sequence and their share of the full cache's (memory saved = 1 - that).

Retrieval: ``--prompts`` prompts of ``--context`` tokens of the same documentation with
``FACTS`` facts ("The access code for the amber vault is 48213.") at depths of 5%, 30%, 55% and
80%, each prompt asking at its end for one of them (each depth asked for equally often); the
prompt streams in as above, then ``ANSWER_TOKENS`` greedy tokens answer. A prompt counts as
retrieved when the code appears in the answer.

Policies: none (the full cache), and streaming, h2o and random at budgets of ``--fractions`` of
the context, in whole blocks.
"""
from __future__ import annotations

import argparse
import json
import math
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Optional

import torch

from pagedspec.engine import BlockManager, KVCache, ModelRunner, Scheduler, SchedulerConfig
from pagedspec.engine.kv_eviction import KVBudgets, KVEvictionPolicy
from pagedspec.models.loader import default_model, load_checkpoint

BLOCK_SIZE = 16
CHUNK = 16                  # prompt tokens per step: one block, as often as decoding evicts
DECODE = 32                 # tokens decoded one per step after each window (the timed part)
SINK_TOKENS = 4
FRACTIONS = (1.0, 0.5, 0.25, 0.1)
POLICIES = ("streaming", "h2o", "random")
FACTS = 4                   # facts per retrieval prompt
FACT_DEPTHS = (0.05, 0.30, 0.55, 0.80)
ANSWER_TOKENS = 8
VAULTS = ("amber", "cobalt", "juniper", "saffron", "violet", "granite", "harbor", "maple",
          "orchid", "silver", "tundra", "walnut")


@dataclass
class EvictionRun:
    policy: str
    budget: Optional[int]           # tokens per sequence (None: the full cache)
    fraction: float                 # budget / context
    perplexity: float
    perplexity_second_half: float
    mean_kv_tokens: float           # per sequence, after each step
    peak_kv_tokens: int
    kv_share: float                 # mean_kv_tokens / the full cache's
    tokens_per_s: float             # decode steps at the end of the windows
    evicted_blocks: int
    retrieved: int                  # retrieval prompts answered with the right code
    retrieval_prompts: int
    retrieved_by_depth: list[int]   # per FACT_DEPTHS entry


def documentation_text() -> str:
    """Python's documentation as the standard library ships it (``pydoc_data.topics``)."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in sorted(topics))


def corpus_text(texts: Optional[list[Path]] = None) -> str:
    """The ``texts`` files joined, else :func:`documentation_text`."""
    if texts:
        return "\n\n".join(p.read_text(encoding="utf-8", errors="replace") for p in texts)
    return documentation_text()


def held_out_windows(tokenizer, context: int, docs: int, text: str) -> list[list[int]]:
    """``docs`` consecutive windows of ``context + DECODE`` tokens of ``text``. Raises
    ValueError when the text is too short."""
    stream = tokenizer.encode(text, add_special_tokens=False).ids
    span = context + DECODE
    windows = [stream[i:i + span] for i in range(0, len(stream) - span + 1, span)]
    if len(windows) < docs:
        raise ValueError(f"bench.eviction: {len(stream)} tokens of text make {len(windows)} "
                         f"windows of {span}; {docs} asked for")
    return windows[:docs]


@dataclass
class RetrievalPrompt:
    token_ids: list[int]
    code: str                       # the answer
    depth: int                      # index into FACT_DEPTHS of the fact asked for


def retrieval_prompts(tokenizer, context: int, count: int, text: str,
                      seed: int = 0) -> list[RetrievalPrompt]:
    """``count`` prompts of about ``context`` tokens: filler from ``text`` (a different stretch
    per prompt) with :data:`FACTS` facts at :data:`FACT_DEPTHS`, ending with a question about
    the fact at depth ``i % FACTS`` for prompt ``i``."""
    rng = random.Random(seed)
    encode = lambda s: tokenizer.encode(s, add_special_tokens=False).ids   # noqa: E731
    stream = encode(text)
    prompts = []
    for i in range(count):
        vaults = rng.sample(VAULTS, FACTS)
        codes = [str(rng.randrange(10000, 100000)) for _ in range(FACTS)]
        asked = i % FACTS
        facts = [encode(f"\nThe access code for the {v} vault is {c}.\n")
                 for v, c in zip(vaults, codes)]
        question = encode(f"\n\nQuestion: What is the access code for the {vaults[asked]} vault?"
                          f"\nAnswer: The access code for the {vaults[asked]} vault is")
        filler_len = context - len(question) - sum(map(len, facts))
        if filler_len <= 0 or len(stream) <= filler_len:
            raise ValueError(f"bench.eviction: a {context}-token retrieval prompt needs more "
                             f"filler than {len(stream)} tokens of text allow")
        start = rng.randrange(len(stream) - filler_len)
        filler = stream[start:start + filler_len]
        ids: list[int] = []
        cut = 0
        for depth, fact in zip(FACT_DEPTHS, facts):
            at = int(depth * filler_len)
            ids += filler[cut:at] + fact
            cut = at
        ids += filler[cut:] + question
        prompts.append(RetrievalPrompt(ids, codes[asked], asked))
    return prompts


class _Engine:
    """The engine's pieces for one sequence at a time: a KV cache for ``max_len`` tokens, a fresh
    block manager, scheduler (``CHUNK`` tokens per step) and KVBudgets per sequence."""

    def __init__(self, model, max_len: int, device: torch.device):
        self.model, self.device = model, device
        self.num_blocks = -(-max_len // BLOCK_SIZE) + 2
        self.cache = KVCache(model.num_layers, self.num_blocks, BLOCK_SIZE, model.num_kv_heads,
                             model.head_size, model.dtype, device)
        self.runner = ModelRunner(model, self.cache)

    def run(self, prompt: list[int], max_tokens: int, policy: KVEvictionPolicy,
            on_step: Callable[[object, torch.Tensor], list[int]], all_rows: bool,
            kv_tokens: list[int]) -> tuple[float, int, int]:
        """Feeds ``prompt`` (``CHUNK`` tokens a step) and ``max_tokens`` decode steps under
        ``policy``. ``on_step(batch, logits)`` returns the step's new token (or none for a
        mid-prompt chunk). Appends the sequence's KV tokens after every step to ``kv_tokens``;
        returns (decode seconds, decode steps, evicted blocks)."""
        bm = BlockManager(self.num_blocks, BLOCK_SIZE, enable_prefix_caching=False)
        scheduler = Scheduler(SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=CHUNK), bm)
        budgets = KVBudgets()
        seq = scheduler.add(list(prompt), max_tokens, None, [])
        budgets.set(seq.seq_id, policy)
        decode_seconds, decode_steps = 0.0, 0
        while True:
            batch = scheduler.schedule()
            if not batch.seqs:
                break
            seq_ids = [s.seq_id for s in batch.seqs]
            mass = budgets.mass_buffer(bm, seq_ids, self.device)
            start = time.perf_counter()
            logits = self.runner.execute(batch, all_rows=all_rows, attn_mass=mass)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            if batch.max_q_len == 1:
                decode_seconds += time.perf_counter() - start
                decode_steps += 1
            if mass is not None:
                budgets.record(bm, seq_ids, mass)
            new = on_step(batch, logits)
            scheduler.update(batch, [new])
            budgets.enforce(bm, [(s.seq_id, s.num_computed_tokens) for s in batch.seqs
                                 if s.seq_id in bm.tables])
            if seq.seq_id in bm.tables:
                kv_tokens.append(bm.tables[seq.seq_id].num_tokens)
        return decode_seconds, decode_steps, budgets.num_evicted_blocks


def run_policy(engine: _Engine, windows: list[list[int]], prompts: list[RetrievalPrompt],
               policy: KVEvictionPolicy, context: int, tokenizer) -> EvictionRun:
    """Perplexity over ``windows`` and retrieval over ``prompts`` under ``policy``."""
    nll: list[float] = []
    nll_late: list[float] = []
    kv_tokens: list[int] = []
    decode_seconds, decode_steps, evicted = 0.0, 0, 0
    for window in windows:
        def score(batch, logits, window=window):
            logprobs = torch.log_softmax(logits.float(), dim=-1).cpu()
            positions = batch.positions.tolist()
            for row, position in enumerate(positions):
                if position + 1 < len(window):
                    value = -float(logprobs[row, window[position + 1]])
                    nll.append(value)
                    if position + 1 >= context // 2:
                        nll_late.append(value)
            seq = batch.seqs[0]
            last = positions[-1] + 1
            # A step that reaches the end of the prompt (or decodes) samples the true token.
            return [window[last]] if last >= seq.num_prompt_tokens and last < len(window) else []
        s, n, e = engine.run(window[:context], DECODE, policy, score, True, kv_tokens)
        decode_seconds, decode_steps, evicted = decode_seconds + s, decode_steps + n, evicted + e

    retrieved_by_depth = [0] * FACTS
    for p in prompts:
        answer: list[int] = []

        def greedy(batch, logits, p=p, answer=answer):
            last = int(batch.positions[-1]) + 1
            if last < len(p.token_ids):
                return []
            answer.append(int(logits[-1].argmax()))
            return [answer[-1]]
        engine.run(p.token_ids, ANSWER_TOKENS, policy, greedy, False, [])
        if p.code in tokenizer.decode(answer):
            retrieved_by_depth[p.depth] += 1

    mean_kv = sum(kv_tokens) / max(1, len(kv_tokens))
    return EvictionRun(policy.mode, policy.budget, (policy.budget or context) / context,
                       math.exp(sum(nll) / len(nll)), math.exp(sum(nll_late) / len(nll_late)),
                       mean_kv, max(kv_tokens, default=0), 1.0,   # kv_share: set by run()
                       decode_steps / decode_seconds if decode_seconds else 0.0,
                       evicted, sum(retrieved_by_depth), len(prompts), retrieved_by_depth)


def budgets_for(context: int, fractions=FRACTIONS) -> list[int]:
    """The budgets of ``fractions`` of the context, in whole blocks (at least 6: sinks +
    window)."""
    budgets = [max(6 * BLOCK_SIZE, int(context * f) // BLOCK_SIZE * BLOCK_SIZE)
               for f in fractions]
    return sorted(set(budgets), reverse=True)


def run(model_dir, device: torch.device, context: int = 2048, docs: int = 3,
        texts: Optional[list[Path]] = None, prompts: int = 8,
        fractions=FRACTIONS, dtype: Optional[torch.dtype] = None) -> dict:
    """Every policy at every budget (and the full cache) on the same windows and prompts; the
    report as a JSON-able dict with a row (:class:`EvictionRun`) per run. ``context`` must be a
    multiple of ``CHUNK``; ValueError otherwise, or when the text is too short."""
    if context % CHUNK or context < 8 * CHUNK:
        raise ValueError(f"bench.eviction: context must be a multiple of {CHUNK} and at least "
                         f"{8 * CHUNK}, got {context}")
    ckpt = load_checkpoint(model_dir)
    dtype = dtype or (torch.float32 if device.type == "cpu" else torch.bfloat16)
    longest = context + DECODE + ANSWER_TOKENS
    if longest > ckpt.config.max_position:
        raise ValueError(f"bench.eviction: context + {DECODE + ANSWER_TOKENS} tokens must fit "
                         f"the model's {ckpt.config.max_position} positions, got context {context}")
    model = ckpt.load_model(dtype, device)
    tokenizer = ckpt.load_tokenizer()
    text = corpus_text(texts)
    windows = held_out_windows(tokenizer, context, docs, text)
    # The retrieval prompts' filler comes from the text after the windows where it is long
    # enough (held out from the perplexity windows), from all of it otherwise.
    used = len(tokenizer.decode(sum(windows, [])))
    rest = text[used:] if len(text) - used > 16 * context else text
    asks = retrieval_prompts(tokenizer, context, prompts, rest) if prompts else []
    engine = _Engine(model, longest, device)
    rows = [run_policy(engine, windows, asks, KVEvictionPolicy(), context, tokenizer)]
    print(_line(rows[-1]), flush=True)
    for budget in budgets_for(context, fractions):
        for mode in POLICIES:
            rows.append(run_policy(engine, windows, asks,
                                   KVEvictionPolicy(mode, budget, SINK_TOKENS), context,
                                   tokenizer))
            print(_line(rows[-1]), flush=True)
    for r in rows:   # the share of the full cache's mean (the same steps, nothing evicted)
        r.kv_share = r.mean_kv_tokens / rows[0].mean_kv_tokens
    return {"model": str(ckpt.path), "dtype": str(dtype).removeprefix("torch."),
            "context": context, "docs": docs, "chunk": CHUNK, "decode": DECODE,
            "retrieval_prompts": len(asks), "fact_depths": list(FACT_DEPTHS),
            "text": [str(p) for p in texts] if texts else "pydoc_data.topics",
            "block_size": BLOCK_SIZE, "sink_tokens": SINK_TOKENS,
            "threads": torch.get_num_threads(),
            "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "rows": [asdict(r) for r in rows]}


def _line(r: EvictionRun) -> str:
    return (f"{r.policy:9s} budget {r.budget or 'full'}: ppl {r.perplexity:.3f}, 2nd half "
            f"{r.perplexity_second_half:.3f}, retrieved {r.retrieved}/{r.retrieval_prompts} "
            f"{json.dumps(asdict(r))}")


def markdown_table(report: dict) -> str:
    depths = "/".join(f"{d:.0%}" for d in report["fact_depths"])
    lines = [f"KV eviction on {Path(report['model']).name} ({report['dtype']}): "
             f"{report['docs']} windows of {report['context']} tokens of {report['text']}, "
             f"fed {report['chunk']} tokens a step with the policy enforced after every step, "
             f"then {report['decode']} decode steps; {report['retrieval_prompts']} retrieval "
             f"prompts of {report['context']} tokens (4 facts at depths {depths}, one asked "
             f"for at the end). Block size {report['block_size']}, {report['sink_tokens']} sink "
             "tokens, recent window: the rest of the budget (streaming) or half of it (h2o, "
             "random).", "",
             "| policy | budget | of context | perplexity | 2nd-half ppl | retrieved "
             f"| by depth ({depths}) | mean KV / full | peak KV tokens | decode tok/s |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in report["rows"]:
        budget = "full" if r["budget"] is None else str(r["budget"])
        lines.append(f"| {r['policy']} | {budget} | {r['fraction']:.0%} | {r['perplexity']:.3f} | "
                     f"{r['perplexity_second_half']:.3f} | "
                     f"{r['retrieved']}/{r['retrieval_prompts']} | "
                     f"{' / '.join(map(str, r['retrieved_by_depth']))} | {r['kv_share']:.0%} | "
                     f"{r['peak_kv_tokens']} | {r['tokens_per_s']:.1f} |")
    return "\n".join(lines) + "\n"


def plot(report: dict, path: Path) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, (ax, ax_r) = plt.subplots(1, 2, figsize=(11, 4))
    full = next(r for r in report["rows"] if r["budget"] is None)
    ax.axhline(full["perplexity_second_half"], color="gray", linestyle="--", label="full cache")
    ax_r.axhline(full["retrieved"], color="gray", linestyle="--", label="full cache")
    for mode in POLICIES:
        rows = sorted((r for r in report["rows"] if r["policy"] == mode),
                      key=lambda r: r["fraction"])
        ax.plot([r["fraction"] for r in rows], [r["perplexity_second_half"] for r in rows],
                marker="o", label=mode)
        ax_r.plot([r["fraction"] for r in rows], [r["retrieved"] for r in rows], marker="o",
                  label=mode)
    for a in (ax, ax_r):
        a.set_xscale("log")
        a.set_xlabel("KV budget / context")
        a.legend()
    ax.set_ylabel("perplexity, second half of each window")
    ax_r.set_ylabel(f"retrieved (of {report['retrieval_prompts']})")
    fig.suptitle(f"KV eviction, {Path(report['model']).name}, context {report['context']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="checkpoint (default: smollm2-135m when "
                        "cached, else the shipped demo target)")
    parser.add_argument("--text", type=Path, action="append", default=[],
                        help="text files to use instead of pydoc_data.topics")
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--docs", type=int, default=3, help="perplexity windows")
    parser.add_argument("--prompts", type=int, default=8, help="retrieval prompts")
    parser.add_argument("--fractions", default=",".join(map(str, FRACTIONS)),
                        help="budgets as fractions of the context, comma-separated")
    parser.add_argument("--dtype", default=None, choices=["float32", "bfloat16"],
                        help="default: float32 on CPU, bfloat16 on CUDA")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", type=Path, default=Path("bench/results/eviction"))
    args = parser.parse_args(argv)
    fractions = [float(f) for f in args.fractions.split(",") if f]
    if not fractions or any(not 0 < f <= 1 for f in fractions):
        parser.error(f"--fractions must be numbers in (0, 1], got {args.fractions!r}")
    report = run(args.model or default_model(), torch.device(args.device), args.context,
                 args.docs, args.text, args.prompts, fractions,
                 getattr(torch, args.dtype) if args.dtype else None)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "eviction.json").write_text(json.dumps(report, indent=1))
    table = markdown_table(report)
    (args.out / "eviction.md").write_text(table)
    plot(report, args.out / "eviction.png")
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
