"""KV eviction: perplexity, memory and speed at a KV budget, for each policy.

    python -m pagedspec.bench.eviction [--model DIR] [--context 1024] [--docs 8] [--out DIR]

Teacher-forced perplexity of held-out code (the modules the model was not trained on, from its
``training.json``; any text files with ``--text``) in windows of ``--context`` tokens: each
window's first ``PREFILL`` tokens are one prefill, then every later token is one decode step
whose logits score the true next token, and whose attention (and eviction) runs over what the
cache kept. The windows decode together as one batch. Policies: none (the full cache), and
streaming, h2o and random at budgets of 100%, 50%, 25% and ~10% of the context. Per run: the
perplexity over all scored tokens and over the second half of each window (where the budget
bites), the mean and peak KV tokens held per sequence and their share of the full cache's
(memory saved = 1 - that), and decode tokens/s (batch tokens per second of decode steps).
The runs use the engine itself: the scheduler, the paged runner through ``paged_attention_run``
with ``attn_mass``, and :class:`pagedspec.engine.kv_eviction.KVBudgets`, as ``LLM`` does.
"""
from __future__ import annotations

import argparse
import json
import math
import sysconfig
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

import torch

from pagedspec.engine import BlockManager, KVCache, ModelRunner, Scheduler, SchedulerConfig
from pagedspec.engine.kv_eviction import KVBudgets, KVEvictionPolicy
from pagedspec.models.loader import load_checkpoint

PREFILL = 16
BLOCK_SIZE = 16
FRACTIONS = (1.0, 0.5, 0.25, 0.1)
POLICIES = ("streaming", "h2o", "random")


@dataclass
class EvictionRun:
    policy: str
    budget: Optional[int]           # tokens per sequence (None: the full cache)
    fraction: float                 # budget / context
    perplexity: float
    perplexity_second_half: float
    mean_kv_tokens: float           # per sequence, over the decode steps
    peak_kv_tokens: int
    kv_share: float                 # mean_kv_tokens / the full cache's
    tokens_per_s: float
    evicted_blocks: int


def held_out_windows(model_dir: Path, tokenizer, context: int, docs: int,
                     texts: Optional[list[Path]] = None) -> list[list[int]]:
    """``docs`` windows of ``context`` tokens from the held-out modules (or ``texts``)."""
    paths = list(texts or [])
    if not paths:
        meta = json.loads((model_dir / "training.json").read_text())
        stdlib = Path(sysconfig.get_paths()["stdlib"])
        paths = [stdlib / rel for rel in meta["corpus"]["held_out_paths"]]
    stream: list[int] = []
    for path in paths:
        if path.is_file():
            stream += tokenizer.encode(path.read_text(encoding="utf-8", errors="replace")).ids
    windows = [stream[i:i + context] for i in range(0, len(stream) - context + 1, context)]
    if len(windows) < docs:
        raise ValueError(f"bench.eviction: {len(stream)} held-out tokens make {len(windows)} "
                         f"windows of {context}; {docs} asked for")
    return windows[:docs]


def run_policy(model, windows: list[list[int]], policy: KVEvictionPolicy,
               device: torch.device) -> EvictionRun:
    """Teacher-forced decoding of ``windows`` (one batch) under ``policy``."""
    context = len(windows[0])
    blocks_per_seq = -(-context // BLOCK_SIZE) + 1
    num_blocks = len(windows) * blocks_per_seq
    cache = KVCache(model.num_layers, num_blocks, BLOCK_SIZE, model.num_kv_heads,
                    model.head_size, model.dtype, device)
    bm = BlockManager(num_blocks, BLOCK_SIZE, enable_prefix_caching=False)
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=len(windows),
                                          max_num_batched_tokens=len(windows) * PREFILL), bm)
    runner = ModelRunner(model, cache)
    budgets = KVBudgets()
    seqs = []
    for w in windows:
        seq = scheduler.add(w[:PREFILL], context - PREFILL, None, [])
        budgets.set(seq.seq_id, policy)
        seqs.append(seq)
    truth = {s.seq_id: w for s, w in zip(seqs, windows)}
    nll: list[float] = []
    nll_late: list[float] = []
    kv_tokens: list[int] = []
    decode_seconds, decode_tokens = 0.0, 0
    while True:
        batch = scheduler.schedule()
        if not batch.seqs:
            break
        seq_ids = [s.seq_id for s in batch.seqs]
        mass = budgets.mass_buffer(bm, seq_ids, device)
        start = time.perf_counter()
        logits = runner.execute(batch, attn_mass=mass)
        logprobs = torch.log_softmax(logits.float(), dim=-1).cpu()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if batch.max_q_len == 1:
            decode_seconds += time.perf_counter() - start
            decode_tokens += len(batch.seqs)
        if mass is not None:
            budgets.record(bm, seq_ids, mass)
        sampled = []
        for row, seq in enumerate(batch.seqs):
            position = len(seq.token_ids)             # the token these logits predict
            target = truth[seq.seq_id][position]
            value = -float(logprobs[row, target])
            nll.append(value)
            if position >= context // 2:
                nll_late.append(value)
            sampled.append([target])
        scheduler.update(batch, sampled)
        budgets.enforce(bm, [(s.seq_id, s.num_computed_tokens) for s in batch.seqs
                             if s.seq_id in bm.tables])
        kv_tokens += [bm.tables[s.seq_id].num_tokens for s in batch.seqs if s.seq_id in bm.tables]
    full = (context + PREFILL) / 2                      # the full cache's mean over the run
    mean_kv = sum(kv_tokens) / max(1, len(kv_tokens))
    return EvictionRun(policy.mode, policy.budget, (policy.budget or context) / context,
                       math.exp(sum(nll) / len(nll)), math.exp(sum(nll_late) / len(nll_late)),
                       mean_kv, max(kv_tokens, default=0), mean_kv / full,
                       decode_tokens / decode_seconds if decode_seconds else 0.0,
                       budgets.num_evicted_blocks)


def budgets_for(context: int) -> list[int]:
    """The budgets of FRACTIONS of the context, in whole blocks (at least 6: sinks + window)."""
    budgets = [max(6 * BLOCK_SIZE, int(context * f) // BLOCK_SIZE * BLOCK_SIZE) for f in FRACTIONS]
    return sorted(set(budgets), reverse=True)


def run(model_dir, device: torch.device, context: int = 1024, docs: int = 8,
        texts: Optional[list[Path]] = None) -> dict:
    ckpt = load_checkpoint(model_dir)
    model = ckpt.load_model(torch.float32 if device.type == "cpu" else torch.bfloat16, device)
    windows = held_out_windows(ckpt.path, ckpt.load_tokenizer(), context, docs, texts)
    rows = [run_policy(model, windows, KVEvictionPolicy(), device)]
    for budget in budgets_for(context):
        for mode in POLICIES:
            rows.append(run_policy(model, windows, KVEvictionPolicy(mode, budget, 4), device))
    return {"model": str(ckpt.path), "context": context, "docs": docs, "prefill": PREFILL,
            "block_size": BLOCK_SIZE, "sink_tokens": 4, "threads": torch.get_num_threads(),
            "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "rows": [asdict(r) for r in rows]}


def markdown_table(report: dict) -> str:
    lines = [f"KV eviction on {Path(report['model']).name}: {report['docs']} held-out windows "
             f"of {report['context']} tokens, teacher-forced; block size "
             f"{report['block_size']}, {report['sink_tokens']} sink tokens, recent window: the "
             "rest of the budget (streaming) or half of it (h2o, random)", "",
             "| policy | budget | of context | perplexity | 2nd-half ppl | mean KV / full | "
             "memory saved | peak KV tokens | decode tok/s |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in report["rows"]:
        budget = "full" if r["budget"] is None else str(r["budget"])
        lines.append(f"| {r['policy']} | {budget} | {r['fraction']:.0%} | {r['perplexity']:.3f} | "
                     f"{r['perplexity_second_half']:.3f} | {r['kv_share']:.0%} | "
                     f"{1 - r['kv_share']:.0%} | {r['peak_kv_tokens']} | "
                     f"{r['tokens_per_s']:.0f} |")
    return "\n".join(lines) + "\n"


def plot(report: dict, path: Path) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(6, 4))
    full = next(r for r in report["rows"] if r["budget"] is None)
    ax.axhline(full["perplexity_second_half"], color="gray", linestyle="--", label="full cache")
    for mode in POLICIES:
        rows = sorted((r for r in report["rows"] if r["policy"] == mode),
                      key=lambda r: r["fraction"])
        ax.plot([r["fraction"] for r in rows], [r["perplexity_second_half"] for r in rows],
                marker="o", label=mode)
    ax.set_xscale("log")
    ax.set_xlabel("KV budget / context")
    ax.set_ylabel("perplexity, second half of each window")
    ax.set_title(f"KV eviction, {Path(report['model']).name}, context {report['context']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="pagedspec-demo", help="checkpoint (default: the "
                        "shipped demo target)")
    parser.add_argument("--text", type=Path, action="append", default=[],
                        help="text files to score instead of the held-out modules")
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--docs", type=int, default=8)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", type=Path, default=Path("bench/results/eviction"))
    args = parser.parse_args(argv)
    report = run(args.model, torch.device(args.device), args.context, args.docs, args.text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "eviction.json").write_text(json.dumps(report, indent=1))
    table = markdown_table(report)
    (args.out / "eviction.md").write_text(table)
    plot(report, args.out / "eviction.png")
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
