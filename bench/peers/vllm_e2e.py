"""End-to-end vLLM-CPU throughput with pagedspec's attention backend against vLLM's own.

Run from the repo root after ``bash tools/test_vllm.sh`` (which builds .venv-vllm with pagedspec
installed in it):

    .venv-vllm/bin/python bench/peers/vllm_e2e.py                     # demo target, batch 1 and 32
    .venv-vllm/bin/python bench/peers/vllm_e2e.py --model DIR --rounds 3 --out /tmp/e2e

Each (backend, batch) is one process (vLLM's offline LLM, engine in-process, greedy, fixed
prompt and output lengths, ignore_eos); processes alternate backends, ``--rounds`` times. A
process warms up with one generate of the same shape, then times ``--repeats`` generates and
reports the median. The two backends' greedy tokens are compared (float32 runs must agree; in
bfloat16 near-ties may flip, so only the agreement is reported). Writes ``table.md`` and
``results.json`` to the output folder (default ``bench/results/vllm-e2e-<time>/``).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
DEMO = os.path.join(ROOT, "python", "pagedspec", "models", "data", "pagedspec-demo")
BACKENDS = ("CPU_ATTN", "CUSTOM")  # vLLM's own, pagedspec's
LABEL = {"CPU_ATTN": "vLLM CPU_ATTN", "CUSTOM": "pagedspec"}


def worker(args) -> None:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", args.threads_bind)
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=args.model, skip_tokenizer_init=True, dtype=args.dtype,
              max_model_len=args.prompt_len + args.output_len, enforce_eager=True,
              attention_backend=args.backend, enable_prefix_caching=False, seed=0,
              max_num_seqs=max(args.batch, 1))
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    vocab = 4000
    prompts = [TokensPrompt(prompt_token_ids=[(7919 * (i + 1) + 104729 * j) % vocab + 2
                                              for j in range(args.prompt_len)])
               for i in range(args.batch)]
    llm.generate(prompts, params, use_tqdm=False)  # warm-up
    times, tokens = [], None
    for _ in range(args.repeats):
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        times.append(time.perf_counter() - start)
        tokens = [list(o.outputs[0].token_ids) for o in outs]
    seconds = statistics.median(times)
    print(json.dumps({"backend": args.backend, "batch": args.batch, "seconds": seconds,
                      "output_tok_s": args.batch * args.output_len / seconds,
                      "tokens": tokens}))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=DEMO)
    p.add_argument("--batches", default="1,32")
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads-bind", default="0-1")
    p.add_argument("--out", default=None)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--backend", default="CUSTOM", help=argparse.SUPPRESS)
    p.add_argument("--batch", type=int, default=1, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args)

    out = args.out or os.path.join(ROOT, "bench", "results",
                                   time.strftime("vllm-e2e-%Y%m%d-%H%M%S"))
    os.makedirs(out, exist_ok=True)
    results = []
    for round_ in range(args.rounds):
        for batch in [int(b) for b in args.batches.split(",")]:
            for backend in (BACKENDS if round_ % 2 == 0 else BACKENDS[::-1]):
                cmd = [sys.executable, __file__, "--worker", "--backend", backend, "--batch",
                       str(batch), "--model", args.model, "--prompt-len", str(args.prompt_len),
                       "--output-len", str(args.output_len), "--dtype", args.dtype,
                       "--repeats", str(args.repeats), "--threads-bind", args.threads_bind]
                run = subprocess.run(cmd, capture_output=True, text=True)
                lines = [line for line in run.stdout.splitlines() if line.startswith("{")]
                if run.returncode != 0 or not lines:
                    sys.exit(f"worker failed ({backend}, batch {batch}):\n{run.stderr[-3000:]}")
                results.append(json.loads(lines[-1]))
                print(f"round {round_} batch {batch:3d} {LABEL[backend]:14s} "
                      f"{results[-1]['output_tok_s']:8.1f} tok/s", flush=True)

    rows = ["| batch | vLLM CPU_ATTN tok/s | pagedspec tok/s | pagedspec / vLLM | greedy tokens "
            "equal |", "|---|---|---|---|---|"]
    for batch in [int(b) for b in args.batches.split(",")]:
        med = {b: statistics.median(r["output_tok_s"] for r in results
                                    if r["backend"] == b and r["batch"] == batch)
               for b in BACKENDS}
        toks = {b: next(r["tokens"] for r in results if r["backend"] == b and r["batch"] == batch)
                for b in BACKENDS}
        equal = sum(a == b for a, b in zip(toks["CPU_ATTN"], toks["CUSTOM"]))
        rows.append(f"| {batch} | {med['CPU_ATTN']:.1f} | {med['CUSTOM']:.1f} | "
                    f"{med['CUSTOM'] / med['CPU_ATTN']:.2f} | {equal}/{batch} |")
    import torch

    machine = {"cpu_capability": torch.backends.cpu.get_cpu_capability(),
               "torch": torch.__version__, "model": args.model, "dtype": args.dtype,
               "prompt_len": args.prompt_len, "output_len": args.output_len,
               "threads_bind": args.threads_bind}
    table = "\n".join(rows)
    with open(os.path.join(out, "table.md"), "w") as f:
        f.write(table + "\n\n" + json.dumps(machine) + "\n")
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump({"machine": machine, "results": results}, f)
    print(table)
    print(f"written to {out}")


if __name__ == "__main__":
    main()
