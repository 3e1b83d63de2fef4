"""End-to-end speculative decoding: speedup over plain decoding on a target/draft pair.

    python -m pagedspec.bench.e2e_spec [--model DIR --draft-model DIR] [--device ...] [--quick]

``python -m pagedspec.bench`` runs this after the end-to-end section when a draft is known (the
shipped ``pagedspec-demo`` / ``pagedspec-demo-draft`` pair by default).

What is measured, greedy, on held-out code prompts (the modules the pair was not trained on, cut
after a function header, up to 192 tokens), at batch 1, 8 and 64 (the prompts repeated):
plain decoding; the draft model at fixed k = 1..8 and with the adaptive controller; n-gram
prompt lookup, fixed k = 4 and adaptive; and a misaligned draft (the draft with every weight
tensor's entries shuffled) at fixed k = 4 and adaptive: the case where speculation must switch
itself off. Per run: output tokens/s, speedup over plain in the same run, acceptance rate, mean
acceptance length, and the speedup the measured costs predict for a fixed k,
``E(k) * t_plain / (k * t_draft + t_verify(k))`` with ``E(k) = 1 + sum_{j<=k} a_j``, ``a_j``
the run's share of drafts accepted through position j. At batch 1, ``transformers``' ``generate`` and its
assisted generation (``assistant_model=``, the same draft) run on the same prompts as the peer.
Every engine first runs the workload once at half length, untimed: the timed runs show the
adaptive controller's steady state (what a long-running server sees), not its warm-up. Each
speculative configuration is timed 3 times, alternating with plain runs; its speedup is the ratio
of the two medians (the machine's drift between configurations cancels).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sysconfig
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch

from pagedspec.bench import core
from pagedspec.engine.controller import SpecStats

DEMO_TARGET, DEMO_DRAFT = "pagedspec-demo", "pagedspec-demo-draft"
BATCHES = (1, 8, 64)
REPEATS = 3                  # timed runs per configuration, alternating with plain runs
MAX_PROMPT_TOKENS = 192


@dataclass
class SpecReport:
    setup: dict
    rows: list[dict] = field(default_factory=list)
    peer: list[dict] = field(default_factory=list)   # transformers at batch 1
    samples: list[dict] = field(default_factory=list)  # greedy completions (plain, batch 1)

    def json_fields(self) -> dict:
        return {"e2e_speculative": self.rows, "e2e_speculative_peer": self.peer,
                "e2e_speculative_setup": self.setup, "e2e_speculative_samples": self.samples}


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
    for rel in info["corpus"].get("held_out_paths", []):
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


def shuffled_copy(src: Path, dst: Path, seed: int = 0) -> Path:
    """``src`` with every tensor's entries permuted: same shapes and statistics, no knowledge."""
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


def _generate(llm, prompts, max_tokens: int, device) -> tuple[float, list[list[int]]]:
    from pagedspec import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    core.synchronize(device)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    core.synchronize(device)
    return time.perf_counter() - start, [o.outputs[0].token_ids for o in outs]


def run(device: torch.device, target: Path, draft: Path, *, quick: bool = False) -> SpecReport:
    import transformers

    from pagedspec import LLM

    transformers.utils.logging.disable_progress_bar()
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    max_tokens = 32 if quick else 128
    batches = (1, 8) if quick else BATCHES
    fixed_ks = (1, 4) if quick else tuple(range(1, 9))
    common = dict(dtype=dtype, device=str(device), max_num_seqs=max(batches), block_size=16)
    base = LLM(str(target), **common)
    prompts = held_out_prompts(target, base.tokenizer)
    if not prompts:
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(0, base.model.vocab_size, (64,), generator=g).tolist()
                   for _ in range(8)]
    setup = {"target": str(target), "draft": str(draft), "dtype": str(dtype).split(".")[-1],
             "device": str(device), "max_tokens": max_tokens, "num_prompts": len(prompts),
             "prompt_tokens": [len(p) for p in prompts], "torch_threads": torch.get_num_threads(),
             "cpu_capability": torch.backends.cpu.get_cpu_capability()}
    report = SpecReport(setup)
    with tempfile.TemporaryDirectory(prefix="pagedspec-misaligned-") as tmp:
        misaligned = shuffled_copy(draft, Path(tmp) / "draft")
        configs = [("plain", None, 0, False)]
        configs += [(f"draft k={k}", draft, k, False) for k in fixed_ks]
        configs += [("draft adaptive", draft, 8, True), ("ngram k=4", "ngram", 4, False),
                    ("ngram adaptive", "ngram", 8, True),
                    ("misaligned k=4", misaligned, 4, False),
                    ("misaligned adaptive", misaligned, 8, True)]
        for batch in batches:
            work = [prompts[i % len(prompts)] for i in range(batch)]
            _generate(base, work, max_tokens // 2, device)                    # warm up
            plain_tokens: list[list[int]] = []
            for name, spec, k, adaptive in configs:
                if batch == max(BATCHES) and name.startswith("draft k=") and k not in (1, 2, 4, 8):
                    continue
                if spec is None:
                    seconds, plain_tokens = _generate(base, work, max_tokens, device)
                    t_plain = seconds / max_tokens                 # one step per token
                    row = {"batch": batch, "config": name, "k": 0, "adaptive": False,
                           "seconds": seconds, "output_tok_s": batch * max_tokens / seconds}
                    if batch == 1 and base.tokenizer is not None:
                        report.samples = [{"prompt": base.tokenizer.decode(p)[-200:],
                                           "completion": base.tokenizer.decode(t)}
                                          for p, t in zip(work, plain_tokens)]
                    report.rows.append(row)
                    print(progress_line(row), flush=True)
                    continue
                llm = LLM(str(target), speculative_model=str(spec) if spec != "ngram" else "ngram",
                          num_speculative_tokens=k, speculative_adaptive=adaptive, **common)
                # Warm up on the workload itself (half length): the timed runs then show the
                # controller's steady state, as in a long-running server, not its first steps.
                _generate(llm, work, max_tokens // 2, device)
                llm.speculator.stats = SpecStats()                  # count the timed runs only
                first_step = len(llm.speculator.controller.history)
                # Alternate plain and speculative runs; the medians' ratio is the speedup.
                plain_times, spec_times = [], []
                for _ in range(REPEATS):
                    plain_times.append(_generate(base, work, max_tokens, device)[0])
                    seconds, tokens = _generate(llm, work, max_tokens, device)
                    spec_times.append(seconds)
                seconds, t_plain = statistics.median(spec_times), statistics.median(plain_times)
                m = llm.speculative_metrics()
                row = {"batch": batch, "config": name, "k": k, "adaptive": adaptive,
                       "seconds": seconds, "output_tok_s": batch * max_tokens / seconds,
                       "plain_seconds": t_plain, "speedup": t_plain / seconds,
                       "acceptance_rate": m["acceptance_rate"],
                       "mean_acceptance_length": m["mean_acceptance_length"],
                       "mean_k": _mean(llm.speculator.controller.history[first_step:]),
                       "agree": sum(a == b for a, b in zip(tokens, plain_tokens)) / batch,
                       "draft_s_per_step": m["draft_seconds_per_step"],
                       "target_s_per_step": m["target_seconds_per_step"]}
                if not adaptive and m["num_steps"]:
                    passes = 1 if spec == "ngram" else k
                    row["predicted_speedup"] = predicted_speedup(
                        k, m["acceptance_rate_per_position"], t_plain / max_tokens,
                        m["draft_seconds_per_step"] / passes, m["target_seconds_per_step"])
                report.rows.append(row)
                print(progress_line(row), flush=True)
        if 1 in batches:
            report.peer = run_transformers_peer(target, draft, prompts, max_tokens, dtype,
                                                device)
            for r in report.peer:
                print(f"transformers {r['config']:18s} batch 1: {r['output_tok_s']:8.1f} tok/s")
    return report


def run_transformers_peer(target: Path, draft: Path, prompts, max_tokens: int, dtype,
                          device) -> list[dict]:
    """transformers' plain and assisted greedy generation, one prompt at a time (assisted
    generation takes batch 1), the same prompts and lengths."""
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(target, dtype=dtype).to(device).eval()
    assistant = transformers.AutoModelForCausalLM.from_pretrained(draft, dtype=dtype).to(
        device).eval()
    for m in (hf, assistant):
        m.generation_config.eos_token_id = None
    rows = []
    for name, extra in (("generate", {}), ("assisted", {"assistant_model": assistant})):
        ids = torch.tensor([prompts[0]], device=device)
        hf.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0, **extra)
        start = time.perf_counter()
        for p in prompts:
            ids = torch.tensor([p], device=device)
            hf.generate(ids, max_new_tokens=max_tokens, do_sample=False, pad_token_id=0,
                        **extra)
        core.synchronize(device)
        seconds = time.perf_counter() - start
        rows.append({"config": name, "batch": 1, "seconds": seconds,
                     "output_tok_s": len(prompts) * max_tokens / seconds})
    return rows


def _mean(xs: list[int]) -> float:
    return sum(xs) / len(xs) if xs else 0.0


def progress_line(row: dict) -> str:
    line = f"batch {row['batch']:3d} {row['config']:20s} {row['output_tok_s']:9.1f} tok/s"
    if "speedup" in row:
        line += (f"  {row['speedup']:5.2f}x  accept {row['acceptance_rate']:5.1%}  "
                 f"len {row['mean_acceptance_length']:4.2f}  mean k {row['mean_k']:4.2f}")
        if "predicted_speedup" in row:
            line += f"  predicted {row['predicted_speedup']:5.2f}x"
    return line


def markdown_table(report: SpecReport) -> str:
    s = report.setup
    lines = ["## Speculative decoding end to end", "",
             f"Target {Path(s['target']).name}, draft {Path(s['draft']).name}, {s['dtype']} on "
             f"{s['device']}, {s['torch_threads']} threads, CPU capability "
             f"{s['cpu_capability']}; greedy, {s['num_prompts']} held-out code prompts "
             f"({min(s['prompt_tokens'])}-{max(s['prompt_tokens'])} tokens) repeated to the "
             f"batch, {s['max_tokens']} new tokens each. Speedup: plain seconds / this run's, in "
             "the same run; predicted: from the run's measured draft/target step costs and "
             "acceptance per position.", "",
             "| batch | config | output tok/s | speedup | predicted | acceptance | mean accepted "
             "length | mean k | same tokens as plain |",
             "|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in report.rows:
        if "speedup" not in r:
            lines.append(f"| {r['batch']} | plain | {r['output_tok_s']:,.1f} | 1.00x | | | | 0 "
                         "| |")
            continue
        pred = f"{r['predicted_speedup']:.2f}x" if "predicted_speedup" in r else ""
        lines.append(f"| {r['batch']} | {r['config']} | {r['output_tok_s']:,.1f} | "
                     f"{r['speedup']:.2f}x | {pred} | {r['acceptance_rate']:.1%} | "
                     f"{r['mean_acceptance_length']:.2f} | {r['mean_k']:.2f} | "
                     f"{r['agree']:.0%} |")
    if report.peer:
        lines += ["", "transformers at batch 1 (same prompts, same lengths, one at a time): " +
                  ", ".join(f"{r['config']} {r['output_tok_s']:,.1f} tok/s"
                            for r in report.peer)]
    for sample in report.samples[:1]:
        lines += ["", "A greedy completion (plain decoding, batch 1; the prompt's end, then the "
                  "completion after `<<<`):", "", "```python",
                  sample["prompt"] + "<<<" + sample["completion"], "```"]
    return "\n".join(lines)


def resolve_pair(model: Optional[str], draft: Optional[str]) -> Optional[tuple[Path, Path]]:
    """The target/draft pair to measure: the given ones, else the shipped demo pair when the
    target is the demo model (or none is given); None when no draft is known."""
    from pagedspec.models import CheckpointError, resolve_model_path

    try:
        if draft is not None:
            return resolve_model_path(model or DEMO_TARGET), resolve_model_path(draft)
        if model in (None, DEMO_TARGET):
            return resolve_model_path(DEMO_TARGET), resolve_model_path(DEMO_DRAFT)
    except CheckpointError:
        return None
    return None


def main(argv: Optional[list[str]] = None) -> int:
    from pagedspec.bench.machine import default_out_dir, resolve_device

    parser = argparse.ArgumentParser(prog="pagedspec-bench-e2e-spec",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help=f"target (default {DEMO_TARGET})")
    parser.add_argument("--draft-model", default=None, help=f"draft (default {DEMO_DRAFT})")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    pair = resolve_pair(args.model, args.draft_model)
    if pair is None:
        parser.error("no draft model: pass --model and --draft-model, or ship the demo pair")
    device = resolve_device(args.device)
    report = run(device, *pair, quick=args.quick)
    out = args.out or default_out_dir(device)
    out.mkdir(parents=True, exist_ok=True)
    table = markdown_table(report)
    (out / "speculative.md").write_text(table + "\n")
    (out / "speculative.json").write_text(json.dumps(report.json_fields(), indent=2))
    print("\n" + table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
