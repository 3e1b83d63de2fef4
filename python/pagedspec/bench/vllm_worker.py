"""vLLM's offline ``LLM`` on the end-to-end section's workloads: the peer process of
:mod:`pagedspec.bench.e2e`.

    .venv-vllm/bin/python python/pagedspec/bench/vllm_worker.py SPEC.json RESULT.json

Run by file path with the vLLM environment's Python: it imports the standard library and vLLM
only, never pagedspec (whose extension is built against another torch). SPEC.json::

    {"model": DIR, "dtype": "bfloat16" | "float32", "threads": int, "max_model_len": int,
     "max_num_seqs": int, "speculative_config": {...} (optional, vLLM's, e.g. n-gram),
     "workloads": [{"name": str, "prompts": [[int, ...], ...], "max_tokens": [int, ...],
                    "ignore_eos": bool, "stop_token_ids": [int, ...],
                    "one_at_a_time": bool (optional: one ``generate`` per prompt)}, ...]}

One engine (engine core in this process, eager mode, prefix caching off, greedy) serves a
one-request warm-up and then each workload once, in order, as one ``generate`` call (or one per
prompt, one after another); the prompts are token ids (``skip_tokenizer_init``), so the stop
tokens are given explicitly. RESULT.json::

    {"vllm_version": str, "load_s": float,
     "workloads": [{"name": str, "seconds": float, "tokens": [[int, ...], ...]}, ...]}
"""
from __future__ import annotations

import json
import os
import sys
import time


def main(spec_path: str, result_path: str) -> int:
    with open(spec_path) as f:
        spec = json.load(f)
    threads = int(spec["threads"])
    # The engine core in this process (timed with the caller's clock), its OpenMP threads bound
    # to the first ``threads`` cores as pagedspec's and transformers' torch threads are counted.
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{threads - 1}")
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    start = time.perf_counter()
    llm = LLM(model=spec["model"], skip_tokenizer_init=True, dtype=spec["dtype"],
              max_model_len=int(spec["max_model_len"]), enforce_eager=True,
              enable_prefix_caching=False, seed=0, max_num_seqs=int(spec["max_num_seqs"]),
              speculative_config=spec.get("speculative_config"))
    load_s = time.perf_counter() - start
    warm = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    llm.generate([TokensPrompt(prompt_token_ids=list(range(3, 11)))], warm, use_tqdm=False)
    results = []
    for w in spec["workloads"]:
        prompts = [TokensPrompt(prompt_token_ids=p) for p in w["prompts"]]
        params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=w["ignore_eos"],
                                 stop_token_ids=w["stop_token_ids"] or None)
                  for n in w["max_tokens"]]
        groups = ([([p], [q]) for p, q in zip(prompts, params)] if w.get("one_at_a_time")
                  else [(prompts, params)])
        start = time.perf_counter()
        outs = [o for ps, qs in groups for o in llm.generate(ps, qs, use_tqdm=False)]
        seconds = time.perf_counter() - start
        results.append({"name": w["name"], "seconds": seconds,
                        "tokens": [list(o.outputs[0].token_ids) for o in outs]})
        print(f"vllm {w['name']}: {seconds:.3f} s", file=sys.stderr, flush=True)
    with open(result_path, "w") as f:
        json.dump({"vllm_version": vllm.__version__, "load_s": load_s, "workloads": results}, f)
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(f"usage: {sys.argv[0]} SPEC.json RESULT.json")
    raise SystemExit(main(sys.argv[1], sys.argv[2]))
