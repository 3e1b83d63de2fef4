"""Serving simulation: the scheduler and block manager under a ShareGPT-like workload.

    python -m pagedspec.bench.serving [--quick] [--out DIR] [--seed N]

A stub model step stands in for the GPU (it samples random tokens; a linear cost model,
``STEP_S + TOKEN_S * tokens``, only places the Poisson arrivals in time). Reported:
  memory    KV utilization (slots holding live tokens / slots allocated) against static
            max-length allocation, and concurrent sequences for a fixed pool;
  prefix    prefix-cache block hit rate with LRU eviction and with the sketch-aware evictor on a
            skewed (Zipf) shared-prefix workload polluted by one-off long documents;
  overhead  the scheduler's own time per step (schedule + update) with N running decodes.
Prints a table and writes ``serving.json`` to ``--out``.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

import numpy as np
import torch

from pagedspec.engine import BlockManager, Scheduler, SchedulerConfig

BLOCK_SIZE = 16
MAX_MODEL_LEN = 2048
STEP_S, TOKEN_S = 0.010, 0.00005   # stub cost model: 10 ms a step + 50 us a token


def sharegpt_lengths(rng: np.random.Generator, n: int, prompt_median=110.0, output_median=180.0):
    """Prompt and output lengths shaped like ShareGPT conversations (heavy-tailed lognormals,
    means near 230 and 300 tokens), prompt <= 1024 and prompt + output <= MAX_MODEL_LEN, the
    usual benchmark filter."""
    prompt = np.clip(rng.lognormal(np.log(prompt_median), 1.1, n), 4, 1024).astype(int)
    output = np.clip(rng.lognormal(np.log(output_median), 1.0, n), 1, None).astype(int)
    return prompt, np.minimum(output, MAX_MODEL_LEN - prompt)


def poisson_arrivals(rng: np.random.Generator, n: int, rate: float) -> np.ndarray:
    return np.cumsum(rng.exponential(1.0 / rate, n))


def stub_token(token_ids, position: int) -> int:
    """The stub model's output: a function of the conversation (its first two tokens) and the
    position, so a workload can know a reply in advance and put it in the next turn's prompt."""
    return (token_ids[0] * 31337 + token_ids[min(1, len(token_ids) - 1)] * 7919
            + position * 104729) % 32000


def simulate(sched: Scheduler, requests, on_step=None) -> dict:
    """Run ``requests`` (arrival time, prompt ids, max_tokens) to completion."""
    clock, steps, i, tokens, preempted = 0.0, 0, 0, 0, 0
    while i < len(requests) or sched.has_unfinished():
        while i < len(requests) and requests[i][0] <= clock:
            sched.add(requests[i][1], requests[i][2])
            i += 1
        if not sched.has_unfinished():
            clock = requests[i][0]
            continue
        batch = sched.schedule()
        sampled_rows = set(batch.logits_indices.tolist())
        cu = batch.cu_seqlens_q.tolist()
        sampled = [[stub_token(seq.token_ids, len(seq.token_ids))] if cu[j + 1] - 1 in sampled_rows
                   else [] for j, seq in enumerate(batch.seqs)]
        sched.update(batch, sampled)
        steps += 1
        tokens += batch.num_tokens
        preempted += len(batch.preempted)
        clock += STEP_S + TOKEN_S * batch.num_tokens
        if on_step:
            on_step(sched)
    return {"steps": steps, "tokens": tokens, "preemptions": preempted, "sim_seconds": clock}


# ---- memory ------------------------------------------------------------------------------------
def bench_memory(num_requests: int, seed: int, num_blocks: int = 2048, rate: float = 30.0) -> dict:
    rng = np.random.default_rng(seed)
    prompt, output = sharegpt_lengths(rng, num_requests)
    arrivals = poisson_arrivals(rng, num_requests, rate)
    requests = [(t, rng.integers(0, 32000, p).tolist(), int(o))
                for t, p, o in zip(arrivals, prompt, output)]
    bm = BlockManager(num_blocks, BLOCK_SIZE, enable_prefix_caching=False)
    sched = Scheduler(SchedulerConfig(max_num_seqs=1024, max_num_batched_tokens=4096,
                                      preemption_mode="recompute"), bm)
    live = allocated = static = 0
    peak, concurrent = 0, []

    def on_step(s):
        nonlocal live, allocated, static, peak
        tables = [bm.tables[q.seq_id] for q in s.running]
        live += sum(t.num_tokens for t in tables)
        allocated += BLOCK_SIZE * sum(len(t.blocks) for t in tables)
        static += MAX_MODEL_LEN * len(tables)
        peak = max(peak, len(tables))
        concurrent.append(len(tables))

    stats = simulate(sched, requests, on_step)
    busy = [c for c in concurrent if c]
    return {
        "requests": num_requests, "pool_blocks": num_blocks, "block_size": BLOCK_SIZE,
        "mean_prompt": float(prompt.mean()), "mean_output": float(output.mean()),
        "kv_utilization_paged": live / allocated,
        "kv_waste_paged": 1 - live / allocated,
        "kv_utilization_static": live / static,
        "kv_waste_static": 1 - live / static,
        "max_concurrent_paged": peak,
        "mean_concurrent_paged": statistics.mean(busy),
        "max_concurrent_static": num_blocks * BLOCK_SIZE // MAX_MODEL_LEN,
        **stats,
    }


# ---- prefix cache ------------------------------------------------------------------------------
def zipf_workload(num_requests: int, seed: int, num_prefixes=200, zipf=1.1, doc_share=0.3,
                  rate=10.0):
    """Skewed reuse: a shared system prompt / few-shot prefix drawn by Zipf popularity plus a
    short user turn; a share of requests are one-off long documents that pollute the cache."""
    rng = np.random.default_rng(seed)
    prefix_len = rng.integers(8, 48, num_prefixes) * BLOCK_SIZE
    prefixes = [rng.integers(0, 32000, n).tolist() for n in prefix_len]
    weights = 1.0 / np.arange(1, num_prefixes + 1) ** zipf
    choice = rng.choice(num_prefixes, num_requests, p=weights / weights.sum())
    user, output = sharegpt_lengths(rng, num_requests, prompt_median=40, output_median=60)
    is_doc = rng.random(num_requests) < doc_share
    arrivals = poisson_arrivals(rng, num_requests, rate)
    requests = []
    for k in range(num_requests):
        if is_doc[k]:
            prompt = rng.integers(0, 32000, rng.integers(512, 1536)).tolist()
        else:
            prompt = prefixes[choice[k]] + rng.integers(0, 32000, user[k]).tolist()
        requests.append((arrivals[k], prompt, int(min(output[k], MAX_MODEL_LEN - len(prompt)))))
    return requests


def chat_workload(num_conversations: int, seed: int, turns=5, rate=2.0, think_s=8.0):
    """Recent reuse: multi-turn chats whose every prompt is the whole history (earlier user
    turns and the model's replies) plus a new user message."""
    rng = np.random.default_rng(seed)
    requests = []
    for start in poisson_arrivals(rng, num_conversations, rate):
        history, t = [], start
        for _ in range(turns):
            history += rng.integers(0, 32000, int(rng.lognormal(np.log(60), 0.8)) + 1).tolist()
            out = int(rng.lognormal(np.log(120), 0.8)) + 1
            if len(history) + out > MAX_MODEL_LEN:
                break
            requests.append((t, list(history), out))
            history += [stub_token(history, p) for p in range(len(history), len(history) + out)]
            t += 0.03 * out + rng.exponential(think_s)  # the reply, then the user thinks
    return sorted(requests, key=lambda r: r[0])


def bench_prefix(scale: float, seed: int, num_blocks: int = 2048) -> dict:
    workloads = {"zipf_prefixes_and_documents": zipf_workload(int(1500 * scale), seed),
                 "multi_turn_chat": chat_workload(int(400 * scale), seed)}
    policies = {"lru": {"eviction": "lru"},
                "popularity": {"eviction": "popularity"},           # default decay period (2 C)
                "popularity_long_memory": {"eviction": "popularity",
                                           "decay_period": 10 * num_blocks}}
    out = {"pool_blocks": num_blocks}
    for name, requests in workloads.items():
        out[name] = {"requests": len(requests)}
        for policy, args in policies.items():
            bm = BlockManager(num_blocks, BLOCK_SIZE, **args)
            sched = Scheduler(SchedulerConfig(max_num_seqs=256, max_num_batched_tokens=4096), bm)
            stats = simulate(sched, requests)
            hit_rate = bm.num_hit_blocks / max(1, bm.num_queried_blocks)
            out[name][policy] = {"block_hit_rate": hit_rate, **stats}
    return out


# ---- scheduler overhead ------------------------------------------------------------------------
def bench_overhead(num_seqs: int, seed: int, steps: int = 200, context=(512, 1536)) -> dict:
    rng = np.random.default_rng(seed)
    blocks_per_seq = (context[1] + steps + 2 * BLOCK_SIZE) // BLOCK_SIZE
    eviction = "popularity"
    bm = BlockManager(num_seqs * blocks_per_seq + 64, BLOCK_SIZE, eviction=eviction)
    sched = Scheduler(SchedulerConfig(max_num_seqs=num_seqs,
                                      max_num_batched_tokens=max(8192, 2 * num_seqs)), bm)
    for _ in range(num_seqs):
        sched.add(rng.integers(0, 32000, rng.integers(*context)).tolist(), 10 * steps)
    while sched.waiting or any(not s.is_decoding for s in sched.running):  # prefill, untimed
        batch = sched.schedule()
        sched.update(batch, [[1] if s.is_decoding or s.num_computed_tokens
                             + q >= len(s.token_ids) else [] for s, q in
                             zip(batch.seqs, batch.num_scheduled_tokens)])
    # Wall time, and this thread's CPU time, which leaves out time the OS gave other processes
    # (this machine's cores are shared, so the wall-clock tail is mostly other people's work).
    t_schedule, t_update, cpu = [], [], []
    for _ in range(steps):
        c0, t0 = time.thread_time(), time.perf_counter()
        batch = sched.schedule()
        t1 = time.perf_counter()
        sched.update(batch, [[7]] * len(batch.seqs))
        t2, c1 = time.perf_counter(), time.thread_time()
        assert len(batch.seqs) == num_seqs
        t_schedule.append(t1 - t0)
        t_update.append(t2 - t1)
        cpu.append(c1 - c0)
    total = [a + b for a, b in zip(t_schedule, t_update)]
    return {"running": num_seqs, "eviction": eviction, "steps": steps,
            "schedule_ms": 1e3 * statistics.median(t_schedule),
            "update_ms": 1e3 * statistics.median(t_update),
            "step_ms": 1e3 * statistics.median(total),
            "step_ms_min": 1e3 * min(total),
            "step_ms_p90": 1e3 * float(np.percentile(total, 90)),
            "step_cpu_ms": 1e3 * statistics.median(cpu)}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="bench/results/serving")
    parser.add_argument("--quick", action="store_true", help="smaller workloads (~20 s)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    scale = 0.25 if args.quick else 1.0
    result = {
        "env": {"cpu": platform.processor() or platform.machine(),
                "python": platform.python_version(),
                "torch": torch.__version__,
                "cost_model": {"step_s": STEP_S, "token_s": TOKEN_S}},
        "memory": bench_memory(int(2000 * scale), args.seed),
        "prefix": bench_prefix(scale, args.seed),
        "overhead": [bench_overhead(n, args.seed, steps=int(200 * scale) or 20)
                     for n in (64, 256, 1024)],
    }
    m, p = result["memory"], result["prefix"]
    print(f"memory ({m['requests']} ShareGPT-like requests, pool {m['pool_blocks']} x {BLOCK_SIZE}"
          f" slots, mean prompt {m['mean_prompt']:.0f} / output {m['mean_output']:.0f})")
    print(f"  {'':24}{'paged':>10}{'static':>10}")
    print(f"  {'KV waste':24}{m['kv_waste_paged']:>10.2%}{m['kv_waste_static']:>10.2%}")
    print(f"  {'max concurrent seqs':24}{m['max_concurrent_paged']:>10}"
          f"{m['max_concurrent_static']:>10}")
    print(f"  {'mean concurrent seqs':24}{m['mean_concurrent_paged']:>10.1f}{'':>10}")
    print(f"prefix cache: block hit rate (pool {p['pool_blocks']} blocks)")
    for name in ("zipf_prefixes_and_documents", "multi_turn_chat"):
        row = [f"{name} ({p[name]['requests']} requests)"]
        for policy in ("lru", "popularity", "popularity_long_memory"):
            r = p[name][policy]
            row.append(f"{policy} {r['block_hit_rate']:.1%}")
        print("  " + ", ".join(row))
    print("scheduler overhead per step (schedule + update, median wall time)")
    for o in result["overhead"]:
        print(f"  {o['running']:>5} running decodes  {o['step_ms']:.3f} ms  (schedule "
              f"{o['schedule_ms']:.3f}, update {o['update_ms']:.3f}; min {o['step_ms_min']:.3f}, "
              f"p90 {o['step_ms_p90']:.3f}; CPU time {o['step_cpu_ms']:.3f})")
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "serving.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {path}")
    return result


if __name__ == "__main__":
    main()
