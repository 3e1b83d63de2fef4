"""End-to-end generation: pagedspec's ``LLM.generate`` against ``transformers``' ``generate``.

    python -m pagedspec.bench.e2e [--model DIR] [--device auto|cpu|cuda] [--quick] [--out DIR]
                                  [--vllm-results FILE]

``python -m pagedspec.bench`` runs this section too, after the kernel cases (``--no-e2e`` skips
it, ``--op e2e`` runs only it).

What is measured: both engines load the same checkpoint (``--model``, else the shipped
``pagedspec-demo``, else a random Llama built here with transformers: vocab 32000, hidden 512,
8 layers, 8 query / 4 KV heads of 64, about 56M parameters; ``--quick`` builds a tiny one) in the
same dtype (float32 on CPU, bfloat16 on CUDA) on the same device, and decode greedily the same
prompts (random token ids from a seeded generator) to fixed output lengths: ``ignore_eos`` for
pagedspec; for transformers no eos token and ``do_sample=False``, so neither stops early. Each
engine serves one short warm-up request first. pagedspec runs with its defaults (prefix caching
on, the default per-step token budget) but ``max_num_seqs=32`` and a KV cache sized for the
largest workload; transformers with its default attention and cache. Workloads:

  decode-b1    one 32-token prompt, 128 new tokens;
  decode-b32-fixed  32 prompts of 32 tokens, 128 new tokens each (the shape of the vLLM-CPU
               reference figures);
  decode-b32   32 requests, prompts of 16..256 and outputs of 64..192 tokens (uniform).
               pagedspec gives every request its own ``max_tokens``; transformers pads the batch
               on the left and generates the longest output for all, of which only each
               request's own length counts as useful output;
  prefill      16 prompts of 1024 tokens, 8 new tokens each.

Reported per workload: wall seconds, output / prompt / total (prompt + output) tokens per second
for both engines, the speedup (transformers seconds over pagedspec seconds), pagedspec's mean
time to first token and time per output token, and how many requests' greedy tokens agree
between the engines. decode-b32 is then rerun with 32 new tokens per request under
``torch.profiler``: the share of its wall time spent in ``pagedspec::`` ops, in aten linear /
matmul ops (self time; device time on CUDA) and in everything else (Python, sampling, other aten
ops: the wall time minus the two). vLLM-CPU is not run here: ``--vllm-results FILE`` adds its
figures (``{"batch1_tok_s": .., "batch32_tok_s": ..}``, output tokens/s) as extra columns.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Optional

import torch

from pagedspec.bench import core
from pagedspec.bench.machine import default_out_dir, device_info, resolve_device

OP = "e2e"                    # the runner's --op name for this section
DEMO_MODEL = "pagedspec-demo"
BLOCK_SIZE = 16
MAX_NUM_SEQS = 32
# Self time in these counts as "linear" in the step-time shares (linear and matmul dispatch to
# the GEMM ops below them, so mostly those hold the time).
LINEAR_OPS = frozenset({"aten::linear", "aten::matmul", "aten::mm", "aten::addmm", "aten::bmm",
                        "aten::baddbmm", "aten::mv", "aten::addmv", "aten::_addmm_activation"})
NO_VLLM_NOTE = "vLLM-CPU: not measured in this run (see bench/peers/)"

# The random Llama built when no checkpoint is given (about 56M parameters), and the --quick one.
RANDOM_MODEL = dict(vocab_size=32000, hidden_size=512, intermediate_size=1376,
                    num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4,
                    head_dim=64, max_position_embeddings=2048)
QUICK_MODEL = dict(vocab_size=4096, hidden_size=128, intermediate_size=352,
                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                   head_dim=64, max_position_embeddings=2048)


@dataclass
class Workload:
    """Requests of random token ids, each with a fixed output length."""
    name: str
    description: str
    prompt_lens: list[int]
    output_lens: list[int]
    seed: int
    prefill_heavy: bool = False          # its prompt tokens/s is reported
    vllm_key: Optional[str] = None       # its figure in the --vllm-results file
    profile_new_tokens: Optional[int] = None   # rerun it this short under the profiler

    def prompts(self, vocab_size: int) -> list[list[int]]:
        rng = random.Random(self.seed)
        return [[rng.randrange(vocab_size) for _ in range(n)] for n in self.prompt_lens]

    def fitted(self, max_model_len: int) -> Workload:
        """The same workload with prompts cut so prompt + output fits ``max_model_len`` (the
        1024-token prefill prompts on a model with a 1024-token context)."""
        lens = [min(p, max_model_len - o) for p, o in zip(self.prompt_lens, self.output_lens)]
        if lens == self.prompt_lens:
            return self
        return dataclasses.replace(self, prompt_lens=lens, description=self.description.replace(
            f"{self.prompt_lens[0]}-token", f"{lens[0]}-token"))

    def profiled(self) -> Optional[Workload]:
        """The profiled rerun: the same prompt lengths, fresh prompts (no prefix-cache hits),
        ``profile_new_tokens`` each."""
        if self.profile_new_tokens is None:
            return None
        return Workload(f"{self.name}-profile", f"{self.name} prompts, "
                        f"{self.profile_new_tokens} new", self.prompt_lens,
                        [self.profile_new_tokens] * len(self.prompt_lens), self.seed + 100)


def _uniform(rng: random.Random, n: int, lo: int, hi: int) -> list[int]:
    return [rng.randint(lo, hi) for _ in range(n)]


def workloads(quick: bool = False) -> list[Workload]:
    """The timed workloads (``--quick``: the same shapes, far fewer tokens)."""
    rng = random.Random(0)
    if quick:
        b1_out, b32_prompt, b32_out, profile_out = 16, (16, 64), (8, 24), 8
        pre_n, pre_len, pre_out = 4, 256, 4
    else:
        b1_out, b32_prompt, b32_out, profile_out = 128, (16, 256), (64, 192), 32
        pre_n, pre_len, pre_out = 16, 1024, 8
    return [
        Workload("decode-b1", f"1 x 32-token prompt, {b1_out} new", [32], [b1_out], seed=1,
                 vllm_key="batch1_tok_s"),
        # The shape vLLM-CPU's reference figures were taken on: 32 x 128 greedy tokens.
        Workload("decode-b32-fixed", f"32 x 32-token prompts, {b1_out} new each", [32] * 32,
                 [b1_out] * 32, seed=4, vllm_key="batch32_tok_s"),
        Workload("decode-b32", f"32 requests, prompts {b32_prompt[0]}..{b32_prompt[1]}, outputs "
                 f"{b32_out[0]}..{b32_out[1]}", _uniform(rng, 32, *b32_prompt),
                 _uniform(rng, 32, *b32_out), seed=2, profile_new_tokens=profile_out),
        Workload("prefill", f"{pre_n} x {pre_len}-token prompts, {pre_out} new",
                 [pre_len] * pre_n, [pre_out] * pre_n, seed=3, prefill_heavy=True),
    ]


@dataclass
class EngineRun:
    """One engine's pass over a workload."""
    seconds: float
    tokens: list[list[int]]              # each request's output (its useful length)
    computed_tokens: int                 # output tokens the engine generated, padding included
    ttft_s: Optional[float] = None       # mean time to first token (pagedspec only)
    tpot_s: Optional[float] = None       # mean time per output token after the first


@dataclass
class Report:
    """What one run of the section measured: its setup and a row per workload."""
    setup: dict                          # model, dtype, device, threads, ISA
    rows: list[dict] = field(default_factory=list)
    vllm: Optional[dict[str, float]] = None

    def json_fields(self) -> dict:
        """The keys this section adds to results.json."""
        return {"e2e": self.rows, "e2e_setup": {**self.setup, "vllm_results": self.vllm}}


def cpu_isa() -> dict:
    """The vector ISA torch dispatches to, the relevant /proc/cpuinfo flags, torch's threads."""
    flags: list[str] = []
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags = sorted(f for f in line.split(":", 1)[1].split()
                               if f == "avx2" or f.startswith(("avx512", "amx")))
                break
    except OSError:
        pass
    return {"cpu_capability": torch.backends.cpu.get_cpu_capability(), "cpu_flags": flags,
            "torch_threads": torch.get_num_threads()}


def build_random_checkpoint(path: Path, quick: bool) -> Path:
    """Writes a random float32 LlamaForCausalLM (``torch.manual_seed(0)``) into ``path``."""
    import transformers

    cfg = transformers.LlamaConfig(**(QUICK_MODEL if quick else RANDOM_MODEL),
                                   tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).to(torch.float32).eval().save_pretrained(path)
    return path


@contextmanager
def checkpoint_dir(model: Optional[str], quick: bool) -> Iterator[tuple[Path, str]]:
    """The checkpoint to run and how to name it: ``model``, else the demo model, else a random
    one in a temporary directory (removed on exit)."""
    from pagedspec.models import CheckpointError, resolve_model_path

    if model is not None:
        yield resolve_model_path(model), str(model)
        return
    try:
        demo: Optional[Path] = resolve_model_path(DEMO_MODEL)
    except CheckpointError:
        demo = None
    if demo is not None:
        yield demo, DEMO_MODEL
        return
    with tempfile.TemporaryDirectory(prefix="pagedspec-e2e-") as tmp:
        name = "random Llama (seed 0" + (", quick)" if quick else ")")
        yield build_random_checkpoint(Path(tmp), quick), name


def load_vllm_results(path: str) -> dict[str, float]:
    """The peer's figures, ``{"batch1_tok_s": float, "batch32_tok_s": float}`` (an argparse
    type: a bad file is a usage error before anything runs)."""
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
def run_pagedspec(llm, prompts: list[list[int]], output_lens: list[int],
                  device: torch.device) -> EngineRun:
    """Greedy ``llm.generate``, every request with its own ``max_tokens``."""
    from pagedspec import SamplingParams

    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in output_lens]
    core.synchronize(device)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    core.synchronize(device)
    seconds = time.perf_counter() - start
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    ttfts = [o.metrics.time_to_first_token for o in outs
             if o.metrics.time_to_first_token is not None]
    tpots = [o.time_per_output_token for o in outs if o.time_per_output_token is not None]
    return EngineRun(seconds, tokens, sum(map(len, tokens)),
                     sum(ttfts) / len(ttfts) if ttfts else None,
                     sum(tpots) / len(tpots) if tpots else None)


def run_transformers(model, prompts: list[list[int]], output_lens: list[int],
                     device: torch.device) -> EngineRun:
    """Greedy ``model.generate`` on the left-padded batch, ``max(output_lens)`` new tokens for all
    (``model.generation_config.eos_token_id`` is None: no request stops early)."""
    width, new = max(map(len, prompts)), max(output_lens)
    input_ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(input_ids)
    for i, p in enumerate(prompts):
        input_ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    input_ids, mask = input_ids.to(device), mask.to(device)
    core.synchronize(device)
    start = time.perf_counter()
    out = model.generate(input_ids=input_ids, attention_mask=mask, max_new_tokens=new,
                         do_sample=False, pad_token_id=0)
    core.synchronize(device)
    seconds = time.perf_counter() - start
    generated = out[:, width:].tolist()
    assert all(len(g) == new for g in generated), "transformers stopped early"
    return EngineRun(seconds, [g[:n] for g, n in zip(generated, output_lens)], len(prompts) * new)


def profile_shares(llm, prompts: list[list[int]], max_tokens: int,
                   device: torch.device) -> dict[str, float]:
    """Shares of a profiled ``generate``'s wall time in ``pagedspec::`` ops, in aten linear /
    matmul ops, and elsewhere. Op time is self CPU time on CPU, self device time on CUDA."""
    from torch.profiler import ProfilerActivity, profile

    from pagedspec import SamplingParams

    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    else:   # kineto probes for a GPU anyway and logs an ERROR line when there is none
        os.environ.setdefault("KINETO_LOG_LEVEL", "5")
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        core.synchronize(device)
        wall = time.perf_counter() - start
    attr = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    kernels = linear = 0.0
    for event in prof.key_averages():
        seconds = getattr(event, attr) / 1e6
        if event.key.startswith("pagedspec::"):
            kernels += seconds
        elif event.key in LINEAR_OPS:
            linear += seconds
    return {"share_pagedspec_ops": kernels / wall, "share_linear": linear / wall,
            "share_other": 1.0 - (kernels + linear) / wall, "profile_seconds": wall}


# ---- the section --------------------------------------------------------------------------------
def _row(w: Workload, ours: EngineRun, hf: EngineRun) -> dict:
    prompt_tokens, useful = sum(w.prompt_lens), sum(w.output_lens)
    agree = sum(a[:len(b)] == b[:len(a)] for a, b in zip(ours.tokens, hf.tokens))
    row = {"workload": w.name, "description": w.description, "requests": len(w.prompt_lens),
           "prompt_tokens": prompt_tokens, "output_tokens": useful,
           "prefill_heavy": w.prefill_heavy,
           "transformers_computed_tokens": hf.computed_tokens}
    for engine, r in (("pagedspec", ours), ("transformers", hf)):
        row.update({f"{engine}_s": r.seconds,
                    f"{engine}_output_tok_s": useful / r.seconds,
                    f"{engine}_prompt_tok_s": prompt_tokens / r.seconds,
                    f"{engine}_total_tok_s": (prompt_tokens + useful) / r.seconds})
    row.update(speedup=hf.seconds / ours.seconds,
               ttft_ms=None if ours.ttft_s is None else ours.ttft_s * 1e3,
               tpot_ms=None if ours.tpot_s is None else ours.tpot_s * 1e3,
               greedy_agree=agree / len(w.prompt_lens))
    return row


PROGRESS_HEADER = (f"{'workload':12s} {'reqs':>4s} {'prompt':>7s} {'output':>7s} | "
                   f"{'pagedspec s':>11s} {'out tok/s':>10s} | {'HF s':>8s} {'out tok/s':>10s} | "
                   f"{'speedup':>7s} {'agree':>6s}")


def progress_line(row: dict) -> str:
    return (f"{row['workload']:12s} {row['requests']:4d} {row['prompt_tokens']:7d} "
            f"{row['output_tokens']:7d} | {row['pagedspec_s']:11.3f} "
            f"{row['pagedspec_output_tok_s']:10.1f} | {row['transformers_s']:8.3f} "
            f"{row['transformers_output_tok_s']:10.1f} | {row['speedup']:6.2f}x "
            f"{row['greedy_agree']:6.0%}")


def run(device: torch.device, *, model: Optional[str] = None, quick: bool = False,
        vllm: Optional[dict[str, float]] = None) -> Report:
    """Runs every workload on both engines and the profiled rerun; prints a line per workload.
    ``vllm``: the peer's figures (:func:`load_vllm_results`), reported beside ours."""
    import transformers

    from pagedspec import LLM

    transformers.utils.logging.disable_progress_bar()   # the per-workload lines are the output
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    with checkpoint_dir(model, quick) as (path, name):
        max_len = json.loads((path / "config.json").read_text()).get(
            "max_position_embeddings", 2048)
        timed = [w.fitted(max_len) for w in workloads(quick)]
        num_blocks = max(sum(-(-(p + o) // BLOCK_SIZE)
                             for p, o in zip(w.prompt_lens, w.output_lens))
                         for w in [*timed, *filter(None, (t.profiled() for t in timed))])
        print(f"e2e: loading {name} ({path}) in {str(dtype).removeprefix('torch.')} on {device}")
        llm = LLM(str(path), dtype=dtype, device=str(device), max_num_seqs=MAX_NUM_SEQS,
                  num_kv_blocks=num_blocks + MAX_NUM_SEQS,   # a spare block per sequence slot
                  block_size=BLOCK_SIZE,
                  skip_tokenizer_init=not (path / "tokenizer.json").is_file())
        hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
        hf.generation_config.eos_token_id = None
        cfg = hf.config
        setup = {"model": name, "model_path": str(path), "parameters": hf.num_parameters(),
                 "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
                 "num_layers": cfg.num_hidden_layers, "num_heads": cfg.num_attention_heads,
                 "num_kv_heads": cfg.num_key_value_heads,
                 "dtype": str(dtype).removeprefix("torch."), "device": str(device),
                 "quick": quick, **cpu_isa()}
        report = Report(setup, vllm=vllm)
        warm = [[(7 * i + 1) % cfg.vocab_size for i in range(8)]]
        run_pagedspec(llm, warm, [4], device)
        run_transformers(hf, warm, [4], device)

        print(PROGRESS_HEADER)
        for w in timed:
            prompts = w.prompts(cfg.vocab_size)
            row = _row(w, run_pagedspec(llm, prompts, w.output_lens, device),
                       run_transformers(hf, prompts, w.output_lens, device))
            if vllm is not None and w.vllm_key is not None:
                row["vllm_output_tok_s"] = vllm[w.vllm_key]
            profiled = w.profiled()
            if profiled is not None:
                row.update(profile_shares(llm, profiled.prompts(cfg.vocab_size),
                                          profiled.output_lens[0], device),
                           profile_new_tokens=profiled.output_lens[0])
            report.rows.append(row)
            print(progress_line(row), flush=True)
            if profiled is not None:
                print(f"{'':12s} profiled rerun, {row['profile_new_tokens']} new tokens each "
                      f"({row['profile_seconds']:.2f} s): pagedspec:: "
                      f"{row['share_pagedspec_ops']:.0%}, linear {row['share_linear']:.0%}, "
                      f"other {row['share_other']:.0%}", flush=True)
    return report


# ---- report -------------------------------------------------------------------------------------
def _pair(row: dict, key: str, fmt: str) -> str:
    return f"{row[f'pagedspec_{key}']:{fmt}} / {row[f'transformers_{key}']:{fmt}}"


def markdown_table(report: Report) -> str:
    s = report.setup
    vllm = report.vllm is not None
    lines = ["## End to end", "",
             f"Model: {s['model']} ({s['parameters'] / 1e6:.1f}M parameters: {s['num_layers']} "
             f"layers, hidden {s['hidden_size']}, {s['num_heads']} / {s['num_kv_heads']} heads, "
             f"vocab {s['vocab_size']}), {s['dtype']} on {s['device']}, {s['torch_threads']} "
             f"torch threads, CPU capability {s['cpu_capability']}. pagedspec `LLM.generate` vs "
             "transformers `generate` (HF), greedy, fixed output lengths, the same random-token "
             "prompts, after one warm-up request each.", "",
             "| workload | requests | prompt + output tokens | seconds (pagedspec / HF) "
             "| output tok/s (pagedspec / HF) | prompt tok/s (pagedspec / HF) "
             "| total tok/s (pagedspec / HF) | speedup | TTFT (ms) | TPOT (ms) | greedy agree "
             "| step time: pagedspec:: / linear / other |"
             + (" vLLM-CPU output tok/s | pagedspec / vLLM-CPU |" if vllm else ""),
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
             + ("---:|---:|" if vllm else "")]
    for r in report.rows:
        shares = (f"{r['share_pagedspec_ops']:.0%} / {r['share_linear']:.0%} / "
                  f"{r['share_other']:.0%}" if "share_linear" in r else "-")
        ttft = f"{r['ttft_ms']:.1f}" if r["ttft_ms"] is not None else "-"
        tpot = f"{r['tpot_ms']:.2f}" if r["tpot_ms"] is not None else "-"
        prompt_rate = _pair(r, "prompt_tok_s", ",.0f") if r["prefill_heavy"] else "-"
        line = (f"| {r['workload']} ({r['description']}) | {r['requests']} | "
                f"{r['prompt_tokens']:,} + {r['output_tokens']:,} | {_pair(r, 's', '.3f')} | "
                f"{_pair(r, 'output_tok_s', ',.1f')} | {prompt_rate} | "
                f"{_pair(r, 'total_tok_s', ',.0f')} | {r['speedup']:.2f}x | {ttft} | {tpot} | "
                f"{r['greedy_agree']:.0%} | {shares} |")
        if vllm:
            peer = r.get("vllm_output_tok_s")
            line += (f" {peer:,.1f} | {r['pagedspec_output_tok_s'] / peer:.2f}x |" if peer
                     else " - | - |")
        lines.append(line)
    op_time = "device" if s["device"].startswith("cuda") else "CPU"
    padded = [r for r in report.rows if r["transformers_computed_tokens"] != r["output_tokens"]]
    lines.append("")
    for r in padded:
        lines.append(f"- {r['workload']}: HF pads the batch on the left and generates the longest "
                     f"output for every request ({r['transformers_computed_tokens']:,} tokens "
                     f"computed); only each request's own output length "
                     f"({r['output_tokens']:,} in all) counts as useful output, for both engines.")
    lines += ["- speedup: HF seconds / pagedspec seconds. TTFT, TPOT: pagedspec's means over the "
              "requests, from the start of `generate`. greedy agree: requests whose pagedspec "
              "tokens equal HF's.",
              *(f"- step time: shares of the wall time of a profiled rerun of {r['workload']} "
                f"({r['profile_new_tokens']} new tokens each, {r['profile_seconds']:.2f} s) in "
                f"`pagedspec::` ops / aten linear and matmul ops (self {op_time} time) / the "
                "rest (Python, sampling, other aten ops)."
                for r in report.rows if "profile_new_tokens" in r),
              "- vLLM-CPU: output tokens/s read from the --vllm-results file (measured "
              "elsewhere on the same workloads)" if vllm else f"- {NO_VLLM_NOTE}"]
    return "\n".join(lines)


def plot(report: Report, path: Path, title: str) -> Optional[Path]:
    """``e2e.png``: output and total tokens/s per workload, pagedspec vs transformers (vLLM-CPU
    too when given)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    rows = report.rows
    labels = [r["workload"] for r in rows]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, key, what in ((axes[0], "output_tok_s", "output tokens/s"),
                          (axes[1], "total_tok_s", "total (prompt + output) tokens/s")):
        series = [("pagedspec", [r[f"pagedspec_{key}"] for r in rows], "tab:blue"),
                  ("transformers", [r[f"transformers_{key}"] for r in rows], "tab:orange")]
        if key == "output_tok_s" and report.vllm is not None:
            series.append(("vLLM-CPU", [r.get("vllm_output_tok_s", 0.0) for r in rows],
                           "tab:gray"))
        width = 0.8 / len(series)
        for i, (name, values, color) in enumerate(series):
            xs = [x + (i - (len(series) - 1) / 2) * width for x in range(len(rows))]
            ax.bar(xs, values, width, label=name, color=color)
        for x, r in enumerate(rows):
            top = max(values[x] for _, values, _ in series)
            ax.annotate(f"{r['speedup']:.2f}x", (x, top), ha="center", va="bottom", fontsize=8)
        ax.set_xticks(range(len(rows)), labels)
        ax.set_ylabel(what)
        ax.set_title("labels: speedup, transformers s / pagedspec s", fontsize=9)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """This section's options, shared by ``pagedspec.bench`` and ``pagedspec.bench.e2e``."""
    parser.add_argument("--model", default=None,
                        help=f"checkpoint directory for the end-to-end runs (default: "
                             f"{DEMO_MODEL} if shipped, else a random Llama built on the fly)")
    parser.add_argument("--vllm-results", type=load_vllm_results, default=None, metavar="FILE",
                        help='vLLM-CPU figures {"batch1_tok_s": .., "batch32_tok_s": ..} to '
                             "report beside ours")


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="pagedspec-bench-e2e",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--quick", action="store_true",
                        help="a tiny random model and few tokens (a smoke test, not a measurement)")
    parser.add_argument("--out", type=Path, default=None, help="output folder")
    add_arguments(parser)
    args = parser.parse_args(argv)

    device = resolve_device(args.device)
    info = {**device_info(device), **cpu_isa()}
    report = run(device, model=args.model, quick=args.quick, vllm=args.vllm_results)
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
