"""Where a decode step's wall time goes: the step profile.

    python -m pagedspec.bench.step_profile [--model M] [--draft D] [--batch 1,8,64]
                                           [--dtype bfloat16] [--threads 2] [--steps 24]
                                           [--quick] [--out DIR]

For each batch size, plain and speculative: the batch's requests are added and stepped through
their prefill, then ``--steps`` decode steps are timed with the core's phase clock
(:class:`pagedspec.engine.core.PhaseClock`) and as many again under ``torch.profiler``. A step's
wall time is split into

  gemm         self time of the target's matrix multiplies (from the profiled steps)
  attention    self time of pagedspec's ops (reshape_and_cache, paged attention)
  forward_rest the rest of the model's forward: elementwise ops, norms, RoPE, and Python
  sample_verify  sampling, greedy / rejection verification, logprobs
  schedule     the scheduler (and the block manager under it)
  drafting     planning drafts and running the drafter
  update       the scheduler's update, KV eviction, the core's per-sequence bookkeeping
  output       output processing (detokenization, stop strings, outputs)

``outside`` is everything but ``gemm`` and ``attention``: the time that is neither a GEMM nor an
attention kernel. The model is ``smollm2-135m`` when it is in the model cache (speculation:
n-gram prompt lookup, as no draft for it ships yet) and the shipped demo pair otherwise; prompts
are slices of a real text (the standard library's ``json`` sources), so prompt lookup finds
drafts as it would on an input-grounded task.
"""
from __future__ import annotations

import argparse
import inspect
import json
import os
import time
from pathlib import Path
from typing import Optional

import torch

from pagedspec.bench.e2e import LINEAR_OPS
from pagedspec.bench.machine import default_out_dir, device_info

PHASES = ["gemm", "attention", "forward_rest", "sample_verify", "schedule", "drafting",
          "update", "output"]


def default_pair() -> tuple[str, str]:
    """(target, speculative model) of the main job: SmolLM2 with n-gram drafting when it is in
    the model cache, else the shipped demo pair."""
    from pagedspec.models.loader import cached_model

    if cached_model("smollm2-135m") is not None:
        return "smollm2-135m", "ngram"
    return "pagedspec-demo", "pagedspec-demo-draft"


def grounded_prompts(tokenizer, vocab_size: int, batch: int, prompt_len: int) -> list[list[int]]:
    """``batch`` prompts of ``prompt_len`` tokens: slices of the json package's sources (real
    text whose continuation often repeats what came before)."""
    import json.decoder
    import json.encoder

    text = inspect.getsource(json.encoder) + inspect.getsource(json.decoder)
    if tokenizer is not None:
        ids = tokenizer.encode(text).ids
    else:
        ids = [b % vocab_size for b in text.encode()]
    stride = max(1, (len(ids) - prompt_len) // max(batch, 1))
    return [ids[(i * stride) % max(1, len(ids) - prompt_len):][:prompt_len] for i in range(batch)]


def _op_seconds(llm, steps: int) -> tuple[float, float, float]:
    """Seconds per step of the target model's GEMMs and pagedspec ops (self CPU time) and of
    its forward (wall, under the profiler), over ``steps`` profiled steps. A draft model's ops
    are left out: they belong to drafting."""
    from torch.profiler import ProfilerActivity, profile

    from pagedspec.engine.core import PhaseClock, _NoClock

    os.environ.setdefault("KINETO_LOG_LEVEL", "5")
    core = llm.engine.core
    runner, execute = core.runner, core.runner.execute

    def target_forward(*args, **kwargs):   # only the target's ops: a draft model's are drafting
        with torch.profiler.record_function(_TARGET_RANGE):
            return execute(*args, **kwargs)

    clock = core.clock = PhaseClock()
    runner.execute = target_forward
    try:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(steps):
                llm.engine.step()
    finally:
        core.clock = _NoClock()
        del runner.execute
    forward = max(clock.seconds.get("forward", 0.0), 1e-12)
    gemm = attention = 0.0
    for event in prof.events():
        parent = event.cpu_parent
        while parent is not None and parent.name != _TARGET_RANGE:
            parent = parent.cpu_parent
        if parent is None:
            continue
        seconds = event.self_cpu_time_total / 1e6
        if event.name.startswith("pagedspec::"):
            attention += seconds
        elif event.name in LINEAR_OPS:   # self times: linear and the mm it calls never overlap
            gemm += seconds
    return gemm / steps, attention / steps, forward / steps


_TARGET_RANGE = "pagedspec.step_profile.target_forward"


def profile_case(llm, prompts: list[list[int]], steps: int, temperature: float = 0.0) -> dict:
    """Adds the prompts, steps through their prefill, then times ``steps`` decode steps by
    phase and profiles as many again; per-step seconds by phase. ``temperature`` > 0: the
    requests sample (seeded), so sampling and rejection sampling are what is timed."""
    from pagedspec import SamplingParams
    from pagedspec.engine.core import PhaseClock, _NoClock

    engine = llm.engine
    config = engine.config
    k = config.num_speculative_tokens if config.speculative_model is not None else 0
    # Room for every step to emit k + 1 tokens through both windows: a sequence that finished
    # inside them would leave steps with less (or nothing) to do.
    for i, prompt in enumerate(prompts):
        params = SamplingParams(temperature=temperature,
                                max_tokens=(2 * steps + 8) * (k + 1) + 16, ignore_eos=True,
                                seed=i if temperature > 0 else None)
        engine.add_request(f"p{i}", prompt, params)
    sched = engine.core.scheduler
    for _ in range(10_000):        # prefill (chunked) until every sequence decodes
        if not sched.waiting and all(s.is_decoding for s in sched.running):
            break
        engine.step()
    for _ in range(4):              # a few decode steps to settle
        engine.step()
    clock = engine.core.clock = PhaseClock()
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    wall = (time.perf_counter() - start) / steps
    engine.core.clock = _NoClock()
    gemm, attention, profiled_forward = _op_seconds(llm, steps)
    if clock.steps != steps or engine.num_unfinished() != len(prompts):
        raise RuntimeError(f"step_profile: sequences finished inside the profiled steps "
                           f"({clock.steps} of {steps} timed steps ran)")
    engine.abort([f"p{i}" for i in range(len(prompts))])
    per = {k: v / clock.steps for k, v in clock.seconds.items()}
    forward = per.get("forward", 0.0)
    if gemm + attention > forward:
        # The two windows' steps differ by more than the ops' own noise (a large batch): apply
        # the profiled shares instead, which the profiler's per-op overhead dilutes a little.
        scale = forward / max(profiled_forward, gemm + attention)
        gemm, attention = gemm * scale, attention * scale
    phases = {
        "gemm": gemm,
        "attention": attention,
        "forward_rest": forward - gemm - attention,
        "sample_verify": per.get("sample_verify", 0.0),
        "schedule": per.get("schedule", 0.0),
        "drafting": per.get("plan_drafts", 0.0) + per.get("draft", 0.0),
        "update": per.get("update_evict", 0.0) + per.get("bookkeeping", 0.0),
        "output": per.get("output_processing", 0.0),
    }
    stats = llm.speculative_metrics()
    return {"step_ms": wall * 1e3, "phases_ms": {k: v * 1e3 for k, v in phases.items()},
            "outside_share": 1.0 - (phases["gemm"] + phases["attention"]) / wall,
            "mean_accepted_length": stats["mean_acceptance_length"] if stats else None}


def markdown(rows: list[dict], info: dict) -> str:
    lines = [f"Step profile on {info.get('name')} ({info['device']}, "
             f"{info.get('torch_threads')} threads, cpu_isa "
             f"{info['pagedspec'].get('cpu_isa')}); per decode step, ms and share of the step", "",
             "| model | mode | batch | step ms | " + " | ".join(PHASES) + " | outside GEMM+attn |",
             "|---|---|---:|---:|" + "---:|" * len(PHASES) + "---:|"]
    for r in rows:
        step = r["step_ms"]
        cells = " | ".join(f"{r['phases_ms'][p]:.2f} ({r['phases_ms'][p] / step:.0%})"
                           for p in PHASES)
        lines.append(f"| {r['model']} | {r['mode']} | {r['batch']} | {step:.2f} | {cells} | "
                     f"{r['outside_share']:.0%} |")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pagedspec.bench.step_profile",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="target (default: smollm2-135m if cached, "
                    "else pagedspec-demo)")
    ap.add_argument("--draft", default=None, help="speculative model or 'ngram' (default: "
                    "ngram for smollm2-135m, pagedspec-demo-draft for the demo)")
    ap.add_argument("--batch", default=None, help="comma-separated batch sizes (1,8,64)")
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=None, help="timed decode steps per case (24)")
    ap.add_argument("--prompt-len", type=int, default=None, help="(128)")
    ap.add_argument("--k", type=int, default=4, help="draft tokens per step (fixed)")
    ap.add_argument("--modes", default="plain,spec")
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="sampling temperature of the requests (0: greedy)")
    ap.add_argument("--quick", action="store_true",
                    help="demo pair; defaults batch 1,4, 4 steps, 32-token prompts")
    ap.add_argument("--compile", action="store_true",
                    help="the compiled forward (warmed up before anything is timed)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)

    from pagedspec import LLM

    torch.set_num_threads(args.threads)
    model, draft = default_pair()
    defaults = ("1,4", 4, 32) if args.quick else ("1,8,64", 24, 128)
    if args.quick:
        model, draft = "pagedspec-demo", "pagedspec-demo-draft"
    args.batch = args.batch or defaults[0]
    args.steps = args.steps or defaults[1]
    args.prompt_len = args.prompt_len or defaults[2]
    model, draft = args.model or model, args.draft or draft
    batches = [int(b) for b in args.batch.split(",")]
    info = device_info(torch.device("cpu"))
    rows = []
    for mode in args.modes.split(","):
        spec = dict(speculative_model=draft, num_speculative_tokens=args.k,
                    speculative_adaptive=False) if mode == "spec" else {}
        llm = LLM(model, dtype=args.dtype, device="cpu", max_num_seqs=max(batches),
                  max_model_len=args.prompt_len + 4 * args.steps * (args.k + 1) + 64,
                  compile=args.compile, **spec)
        llm.engine.warm_up()           # compiled: every kind of step, before any timing
        for batch in batches:
            prompts = grounded_prompts(llm.tokenizer, llm.engine.vocab_size, batch,
                                       args.prompt_len)
            name = mode if mode == "plain" else f"{mode} ({draft}, k={args.k})"
            name += f", T={args.temperature:g}" if args.temperature > 0 else ""
            row = {"model": model, "mode": name + (", compiled" if args.compile else ""),
                   "batch": batch, **profile_case(llm, prompts, args.steps, args.temperature)}
            rows.append(row)
            print(f"{model} {row['mode']} batch {batch}: {row['step_ms']:.2f} ms/step, "
                  f"outside GEMM+attention {row['outside_share']:.0%}", flush=True)
        del llm
    table = markdown(rows, info)
    print(table)
    out = args.out or default_out_dir(torch.device("cpu"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "step_profile.json").write_text(json.dumps({"device": info, "rows": rows}, indent=1))
    (out / "step_profile.md").write_text(table + "\n")
    print(f"wrote {out / 'step_profile.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
