"""Side-by-side paged attention: pagedspec against vLLM's CPU backend (and torch's SDPA).

Run from the repo root with the main venv (``.venv-vllm`` made by setup_vllm_cpu.sh):

    .venv/bin/python bench/peers/compare.py                       # every case, 1 and 2 threads
    .venv/bin/python bench/peers/compare.py --budget 0.2 --rounds 3 --out /tmp/peers
    .venv/bin/python bench/peers/compare.py --shapes q1_b8_c2048 --dtypes bf16 --threads 1

For each case (a shape and a cache dtype) it first has each side write its outputs and checks,
before anything is timed, that vLLM's agree with pagedspec's (and with the pure-PyTorch
reference where the case is small); a disagreement fails the case loudly and it is not timed.
Then it alternates processes, pagedspec, vLLM, pagedspec, vLLM, ... for ``--rounds`` rounds; each
process times every thread count (median over ``--budget`` seconds after warm-up) and its own copy
bandwidth. A column's time is the median of its rounds' medians. Bytes moved are K and V rows
read once plus the query and the output (as python/pagedspec/bench/cases_attention.py counts).

Writes ``table.md`` and ``results.json`` (every worker line, the agreement numbers, the machine)
to the output folder (default ``bench/results/peers-<time>/``). Exit status 1 if any case failed.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
import common  # noqa: E402

VLLM_PYTHON = os.path.join(ROOT, ".venv-vllm", "bin", "python")

# Shapes of cases_attention.py's CPU decode and verification cases, Llama-3-8B heads.
SHAPES = {
    "q1_b1_c4096": {"q_len": 1, "batch": 1, "context": 4096},
    "q1_b8_c2048": {"q_len": 1, "batch": 8, "context": 2048},
    "q1_b16_c4096": {"q_len": 1, "batch": 16, "context": 4096},
    "q5_b8_c2048": {"q_len": 5, "batch": 8, "context": 2048},
}

# Agreement: max |a - b| / max |b| and RMS(a - b) / RMS(b) must both be within these. bf16 output:
# a few bf16 ulps of the largest output. fp32: accumulated rounding only. FP8 (bf16 output from
# the same e4m3 cache bytes): vLLM's FP8 kernel is measured at ~2-4% of max |out| (RMS ~1.5%) from
# the exact reference on these random inputs, so its bound is looser; pagedspec's is ~1e-4.
TOLERANCE = {"bf16": (2e-2, 1e-2), "fp32": (1e-4, 1e-5), "fp8e4m3": (6e-2, 3e-2)}

COLUMNS = [("pagedspec", "pagedspec"), ("vllm16", "vLLM bs16"), ("vllm128", "vLLM bs128"),
           ("sdpa", "SDPA")]


def run_worker(python: str, script: str, cases: list[dict], extra: list[str], env: dict,
               log) -> list[dict]:
    cmd = [python, os.path.join(HERE, script), "--cases", json.dumps(cases), *extra]
    log.write(f"$ {' '.join(cmd)}\n")
    log.flush()
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=log, env=env, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{script} exited with {proc.returncode} (see {log.name})")
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def agreement(a, b) -> dict:
    """Normalized max and RMS errors of a against b (float64)."""
    a, b = a.double(), b.double()
    diff = a - b
    finite = bool(a.isfinite().all())
    return {"max": float(diff.abs().max() / b.abs().max()),
            "rms": float(diff.pow(2).mean().sqrt() / b.pow(2).mean().sqrt()), "finite": finite}


def check_outputs(case: dict, out_dir: str, vllm_columns: list[str]) -> dict:
    """Every output against pagedspec's, and pagedspec's and vLLM's against the reference where
    it exists. Returns {pair: {max, rms, finite, ok}} plus "ok"."""
    import torch
    key = common.case_key(case)

    def load(name):
        path = os.path.join(out_dir, f"{name}_{key}.pt")
        return torch.load(path) if os.path.exists(path) else None

    max_tol, rms_tol = TOLERANCE[case["dtype"]]
    outputs = {name: load(name) for name in ["pagedspec", "sdpa", "reference", *vllm_columns]}
    pairs = [(name, "pagedspec") for name in ["sdpa", *vllm_columns]]
    if outputs["reference"] is not None:
        pairs += [(name, "reference") for name in ["pagedspec", *vllm_columns]]
    result = {"ok": True}
    for a, b in pairs:
        if outputs[a] is None or outputs[b] is None:
            continue
        err = agreement(outputs[a], outputs[b])
        err["ok"] = err["finite"] and err["max"] <= max_tol and err["rms"] <= rms_tol
        result[f"{a} vs {b}"] = err
        result["ok"] = result["ok"] and err["ok"]
    return result


def aggregate(records: list[dict]) -> dict:
    """{(case, threads): {"bytes", impl: {ms, gbps, copy_gbps, frac, rounds, ...}}} with each
    impl's time the median over rounds and its copy bandwidth the median of its own side's."""
    table: dict = {}
    for rec in records:
        row = table.setdefault((rec["case"], rec["threads"]), {"bytes": rec["bytes"]})
        for impl, m in rec["impls"].items():
            slot = row.setdefault(impl, {"ms": [], "copy_gbps": [], "extra": {}})
            if "unsupported" in m:
                slot["unsupported"] = m["unsupported"]
                continue
            slot["ms"].append(m["ms"])
            slot["copy_gbps"].append(rec["copy_gbps"])
            slot["extra"] = {k: v for k, v in m.items() if k not in ("ms", "gbps", "reps")}
    for row in table.values():
        for impl, slot in row.items():
            if impl == "bytes" or not slot["ms"]:
                continue
            nbytes = slot["extra"].get("bytes", row["bytes"])
            ms = statistics.median(slot["ms"])
            copy = statistics.median(slot["copy_gbps"])
            gbps = nbytes / (ms / 1e3) / 1e9
            slot.update(rounds_ms=slot.pop("ms"), ms=ms, gbps=gbps, copy_gbps=copy,
                        frac=gbps / copy)
    return table


def _fmt_ms(slot) -> str:
    if slot is None:
        return "-"
    if "ms" not in slot or isinstance(slot["ms"], list):
        return "n/a" if "unsupported" in slot else "-"
    spread = ""
    if len(slot.get("rounds_ms", [])) > 1:
        spread = f" ({min(slot['rounds_ms']):.2f}-{max(slot['rounds_ms']):.2f})"
    return f"{slot['ms']:.2f}{spread}"


def _fmt_bw(slot) -> str:
    if slot is None or "gbps" not in slot:
        return "-"
    return f"{slot['gbps']:.1f} ({slot['frac']:.2f})"


def _fmt_ratio(a, b) -> str:
    if not a or not b or "gbps" not in a or "gbps" not in b:
        return "-"
    return f"{a['ms'] / b['ms']:.2f}"


def format_table(table: dict, failed: dict | None = None, disagree=()) -> str:
    """The markdown table: one row per (case, threads). ``failed``: {case: why}, rows of their
    own; ``disagree``: cases timed although their outputs disagree, marked."""
    failed = failed or {}
    head = (["case", "threads"] + [f"{label} ms" for _, label in COLUMNS]
            + [f"{label} GB/s (x copy)" for _, label in COLUMNS]
            + ["pagedspec/vLLM bs16", "pagedspec/vLLM bs128"])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for (case, threads), row in table.items():  # in the order the cases ran
        cells = [case + (" **(outputs disagree)**" if case in disagree else ""), str(threads)]
        cells += [_fmt_ms(row.get(impl)) for impl, _ in COLUMNS]
        cells += [_fmt_bw(row.get(impl)) for impl, _ in COLUMNS]
        cells += [_fmt_ratio(row.get("pagedspec"), row.get("vllm16")),
                  _fmt_ratio(row.get("pagedspec"), row.get("vllm128"))]
        lines.append("| " + " | ".join(cells) + " |")
    for case, why in sorted(failed.items()):
        lines.append(f"| {case} | - | FAILED: {why} |" + " |" * (len(head) - 3))
    return "\n".join(lines) + "\n"


def machine_description() -> dict:
    info = {}
    try:
        out = subprocess.run(["lscpu"], stdout=subprocess.PIPE, text=True).stdout
        for line in out.splitlines():
            name, _, value = line.partition(":")
            if name.strip() in ("Model name", "CPU(s)", "Thread(s) per core"):
                info[name.strip()] = value.strip()
            if name.strip() == "Flags":
                wanted = ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16",
                          "amx_tile", "amx_int8", "amx_fp8", "avx_vnni", "avx512_vnni")
                info["flags (selected)"] = [f for f in value.split() if f in wanted]
    except OSError:
        pass
    return info


def build_cases(shapes, dtypes, threads, seed=0) -> list[dict]:
    return [{**SHAPES[s], "dtype": d, "threads": list(threads), "seed": seed}
            for s in shapes for d in dtypes]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="output folder (default bench/results/peers-<time>)")
    parser.add_argument("--shapes", default=",".join(SHAPES), help=f"from {list(SHAPES)}")
    parser.add_argument("--dtypes", default=",".join(common.DTYPES))
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--budget", type=float, default=0.3, help="seconds timed per column")
    parser.add_argument("--copy-budget", type=float, default=0.3)
    parser.add_argument("--block-sizes", default="16,128", help="vLLM block sizes")
    parser.add_argument("--no-vllm", action="store_true", help="pagedspec and SDPA only")
    parser.add_argument("--allow-disagreement", action="store_true",
                        help="time a case whose outputs disagree anyway (marked in the table; "
                             "the exit status is still 1)")
    parser.add_argument("--keep-data", action="store_true", help="keep the input .pt files")
    parser.add_argument("--vllm-python", default=VLLM_PYTHON)
    parser.add_argument("--isa", choices=("best",) + tuple(common.PEER_ISAS), default="best",
                        help="best: each side's best kernels for this CPU; otherwise both sides "
                             "held to what a CPU of that class runs: "
                             + "; ".join(f"{k}: {v}" for k, v in common.PEER_ISAS.items()))
    args = parser.parse_args(argv)

    threads = [int(t) for t in args.threads.split(",")]
    if max(threads) > 2:
        print("note: this machine has 2 cores; more threads oversubscribe it", file=sys.stderr)
    out = args.out or os.path.join(ROOT, "bench", "results",
                                   "peers-" + time.strftime("%Y%m%d-%H%M%S"))
    data_dir, outputs_dir = os.path.join(out, "data"), os.path.join(out, "outputs")
    os.makedirs(outputs_dir, exist_ok=True)
    use_vllm = not args.no_vllm
    if use_vllm and not os.path.exists(args.vllm_python):
        print(f"error: {args.vllm_python} missing: run bench/peers/setup_vllm_cpu.sh "
              f"(or pass --no-vllm)", file=sys.stderr)
        return 2
    block_sizes = [int(b) for b in args.block_sizes.split(",") if b]
    vllm_columns = [f"vllm{bs}" for bs in block_sizes] if use_vllm else []
    env = dict(os.environ, OMP_NUM_THREADS=str(max(threads)),
               MKL_NUM_THREADS=str(max(threads)), VLLM_LOGGING_LEVEL="ERROR",
               PYTHONWARNINGS="ignore")
    if args.isa != "best":
        env.update(common.pagedspec_isa_env(args.isa), **{common.PEER_ISA_ENV: args.isa})
    ps_python = sys.executable
    cases = build_cases(args.shapes.split(","), args.dtypes.split(","), threads)

    records, checks, failed, disagree, setup = [], {}, {}, {}, []
    with open(os.path.join(out, "workers.log"), "w") as log:
        for case in cases:
            name = common.case_name(case)
            print(f"[peers] {name} threads={threads}", flush=True)
            common_args = ["--data-dir", data_dir]
            timing = ["--budget", str(args.budget), "--copy-budget", str(args.copy_budget)]
            try:
                setup += run_worker(ps_python, "pagedspec_attention.py", [case],
                                    common_args + ["--outputs", "--out-dir", outputs_dir],
                                    env, log)
                if use_vllm:
                    setup += run_worker(args.vllm_python, "vllm_attention.py", [case],
                                        common_args + ["--outputs", "--out-dir", outputs_dir,
                                                       "--block-sizes", args.block_sizes],
                                        env, log)
                check = check_outputs(case, outputs_dir, vllm_columns)
                checks[name] = check
                for pair, err in check.items():
                    if pair != "ok":
                        print(f"    {pair:24s} max {err['max']:.2e} rms {err['rms']:.2e} "
                              f"{'ok' if err['ok'] else 'DISAGREES'}", flush=True)
                if not check["ok"]:
                    bad = [p for p, e in check.items() if p != "ok" and not e["ok"]]
                    timed = args.allow_disagreement
                    (disagree if timed else failed)[name] = "outputs disagree: " + ", ".join(bad)
                    print(f"!!! [peers] {name}: OUTPUTS DISAGREE ({', '.join(bad)}); "
                          f"{'timed anyway (--allow-disagreement)' if timed else 'not timed'}",
                          file=sys.stderr, flush=True)
                    if not timed:
                        continue
                for r in range(args.rounds):
                    records += run_worker(ps_python, "pagedspec_attention.py", [case],
                                          common_args + timing, env, log)
                    if use_vllm:
                        records += run_worker(args.vllm_python, "vllm_attention.py", [case],
                                              common_args + timing
                                              + ["--block-sizes", args.block_sizes], env, log)
            except RuntimeError as e:
                failed[name] = str(e)
                print(f"!!! [peers] {name}: {e}", file=sys.stderr, flush=True)
            finally:
                if not args.keep_data:
                    path = os.path.join(data_dir, common.case_key(case) + ".pt")
                    if os.path.exists(path):
                        os.remove(path)
    if not args.keep_data:
        shutil.rmtree(data_dir, ignore_errors=True)

    table = aggregate(records)
    md = format_table(table, failed, disagree)
    machine = machine_description()
    sides = {}
    for rec in setup + records:
        sides.setdefault(rec["side"], {k: rec[k] for k in ("torch", "cpu_capability", "kernel")
                                       if k in rec})
    vllm_info = [r for r in setup if r["side"] == "vllm"]
    vllm_isas = sorted({(col, rec["case"].rsplit("/", 1)[-1], impl["isa"]) for rec in records
                        if rec["side"] == "vllm" for col, impl in rec["impls"].items()
                        if "isa" in impl})
    # vLLM's own reasons, as it raised them (block size, or FP8 on a CPU without AVX-512).
    rejections: dict = {}
    for rec in records:
        for col, impl in rec["impls"].items():
            if rec["side"] == "vllm" and "unsupported" in impl:
                rejections.setdefault(impl["unsupported"].rstrip("."), set()).add(col)
    header = [
        "# pagedspec vs vLLM CPU paged attention (Llama-3-8B heads: 32 q / 8 kv / 128)", "",
        f"Machine: {machine.get('Model name', '?')}, {machine.get('CPU(s)', '?')} CPUs, "
        f"flags {' '.join(machine.get('flags (selected)', []))}; "
        + "; ".join(f"{s}: torch {v.get('torch')} ({v.get('cpu_capability')}), kernels "
                    f"{v.get('kernel')}"
                    for s, v in sides.items()), "",
        f"Median of {args.rounds} rounds (alternating processes) of per-process medians over "
        f"{args.budget}s; (min-max) over rounds. GB/s: K/V rows once + Q + out; (x copy): "
        "fraction of the same process's copy bandwidth. pagedspec/vLLM: time ratio "
        "(< 1: pagedspec faster). vLLM's kernel per column, as its backend chooses it: "
        + (", ".join(f"{col} {dtype} {isa}" for col, dtype, isa in vllm_isas) or "none timed")
        + "; n/a: vLLM rejects it ("
        + ("; ".join(f"{', '.join(sorted(cols))}: {why}" for why, cols in rejections.items())
           or "none here")
        + "). SDPA: torch's SDPA on K/V pre-gathered into contiguous tensors "
        "(FP8 dequantized to bf16: it reads bf16).", ""]
    with open(os.path.join(out, "table.md"), "w") as f:
        f.write("\n".join(header) + md)
    serial = {f"{c}|{t}": row for (c, t), row in table.items()}
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump({"machine": machine, "sides": sides, "args": vars(args), "cases": cases,
                   "agreement": checks, "failed": failed, "disagree": disagree, "setup": setup,
                   "vllm_setup": vllm_info, "records": records, "table": serial}, f, indent=1)
    print("\n".join(header) + md)
    print(f"[peers] wrote {out}/table.md and results.json")
    if failed or disagree:
        print(f"!!! [peers] {len(failed)} case(s) FAILED: {', '.join(failed)}; "
              f"{len(disagree)} timed despite disagreeing: {', '.join(disagree)}",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
