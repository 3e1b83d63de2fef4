"""The kernel benchmark runner: ``python -m pagedspec.bench`` or ``pagedspec-bench``.

For every registered case it measures the kernel's median time, the bytes it must move, the
achieved bandwidth and its ratio to a device-to-device copy measured in the same run, and the
speedup over the pure-PyTorch reference; it prints a table and writes results.json,
results.md and results.png into the output folder. Then the end-to-end section
(:mod:`pagedspec.bench.e2e`, ``--op e2e`` alone, ``--no-e2e`` skips it) adds an "e2e" list to
results.json, an "End to end" table to results.md, and e2e.png; when a draft model is known (the
shipped SmolLM2 draft or demo pair, or ``--draft-model``) the speculative section (:mod:`pagedspec.bench.e2e_spec`)
follows, as "e2e_speculative" and its own table.
"""
from __future__ import annotations

import argparse
import importlib
import json
import pkgutil
from pathlib import Path
from typing import Optional

import torch

from pagedspec.bench import core, e2e, e2e_spec
from pagedspec.bench.machine import default_out_dir, device_info, resolve_device


def load_cases() -> list[core.Case]:
    """Imports every ``cases_*`` module beside this file (each registers its cases)."""
    package = importlib.import_module("pagedspec.bench")
    for info in pkgutil.iter_modules(package.__path__):
        if info.name.startswith("cases_"):
            importlib.import_module(f"pagedspec.bench.{info.name}")
    return list(core.CASES)


def run_case(case: core.Case, device: torch.device, copy_bw: float, with_reference: bool,
             budget_s: float) -> dict:
    workload = case.build(device)
    seconds = core.time_call(workload.run, device, budget_s=budget_s)
    row = {"op": case.op, "case": case.name, **case.params, "time_us": seconds * 1e6,
           "bytes": workload.bytes_moved, "gbps": workload.bytes_moved / seconds / 1e9,
           "bw_ratio": workload.bytes_moved / seconds / copy_bw}
    if workload.items:
        row["items_per_s"] = workload.items / seconds
        row["items_unit"] = workload.items_unit
    if with_reference and workload.reference is not None:
        ref_seconds = core.time_call(workload.reference, device, min_reps=2, max_reps=20,
                                     budget_s=budget_s, warmup=1)
        row["ref_time_us"] = ref_seconds * 1e6
        row["speedup"] = ref_seconds / seconds
    del workload
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def markdown_table(rows: list[dict], copy_bw: float, info: dict) -> str:
    lines = [f"Device: {info.get('name')} ({info['device']}); copy bandwidth measured in this run: "
             f"{copy_bw / 1e9:.1f} GB/s", "",
             "| op | case | time (us) | bytes | GB/s | of copy BW | ref (us) | speedup | items/s |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        ref = f"{r['ref_time_us']:.1f}" if "ref_time_us" in r else "-"
        speedup = f"{r['speedup']:.1f}x" if "speedup" in r else "-"
        items = (f"{r['items_per_s']:.3g} {r['items_unit']}" if "items_per_s" in r else "-")
        lines.append(f"| {r['op']} | {r['case']} | {r['time_us']:.1f} | {r['bytes']:,} | "
                     f"{r['gbps']:.1f} | {r['bw_ratio']:.0%} | {ref} | {speedup} | {items} |")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path, title: str) -> Optional[Path]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    height = max(3.0, 0.28 * len(rows) + 1.5)
    fig, (ax_bw, ax_sp) = plt.subplots(1, 2, figsize=(14, height), sharey=True)
    labels = [r["case"] for r in rows]
    ax_bw.barh(labels, [100 * r["bw_ratio"] for r in rows], color="tab:blue")
    ax_bw.set_xlabel("% of measured copy bandwidth")
    ax_bw.axvline(100, color="gray", lw=0.8, ls="--")
    ax_sp.barh(labels, [r.get("speedup", 0) for r in rows], color="tab:green")
    ax_sp.set_xlabel("speedup over the pure-PyTorch reference (x)")
    ax_sp.set_xscale("log")
    ax_bw.invert_yaxis()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: Optional[list[str]] = None) -> int:

    parser = argparse.ArgumentParser(prog="pagedspec-bench", description=__doc__.splitlines()[0])
    parser.add_argument("--op", action="append", default=[],
                        help="only these op families (repeatable, or comma-separated; "
                             f"{e2e.OP!r} is the end-to-end section)")
    parser.add_argument("--quick", action="store_true",
                        help="only the cases marked quick, and a tiny end-to-end model")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--out", type=Path, default=None, help="output folder")
    parser.add_argument("--no-reference", action="store_true",
                        help="skip timing the pure-PyTorch references")
    parser.add_argument("--budget", type=float, default=1.0,
                        help="seconds of timing per kernel and per reference (default 1)")
    parser.add_argument("--list", action="store_true", help="list the selected cases and exit")
    parser.add_argument("--no-e2e", action="store_true", help="skip the end-to-end section")
    e2e.add_arguments(parser)
    parser.add_argument("--draft-model", default=None,
                        help="draft checkpoint for the speculative end-to-end section (default: "
                             f"{e2e_spec.SMOLLM2_DRAFT} when the target is "
                             f"{e2e_spec.SMOLLM2_TARGET}, {e2e_spec.DEMO_DRAFT} when it is the "
                             "demo model)")
    args = parser.parse_args(argv)

    device = resolve_device(args.device)
    families = {f for spec in args.op for f in spec.split(",") if f}
    cases = [c for c in load_cases()
             if (not families or c.op in families) and (not args.quick or c.quick)
             and device.type in c.devices]
    with_e2e = not args.no_e2e and (not families or e2e.OP in families)
    if args.list:
        for c in cases:
            print(f"{c.op:12s} {c.name}")
        for w in e2e.workloads(args.quick) if with_e2e else []:
            print(f"{e2e.OP:12s} {w.name}: {w.description}")
        return 0
    if not cases and not with_e2e:
        print("no benchmark case matches the filters")
        return 1

    try:
        from tqdm import tqdm
    except ImportError:  # the progress bar is a convenience, not a dependency
        def tqdm(items, **_):
            return items

    info = device_info(device)
    if with_e2e:
        info.update(e2e.cpu_isa())
    rows, copy_bw, tables, written = [], None, [], ["results.json", "results.md"]
    if cases:
        copy_bw = core.measure_copy_bandwidth(device)
        print(f"{info.get('name')}: copy bandwidth {copy_bw / 1e9:.1f} GB/s "
              f"(read + write of a {'1 GiB' if device.type == 'cuda' else '256 MiB'} copy)")
        progress = tqdm(cases, desc="benchmarks", unit="case")
        for case in progress:
            if hasattr(progress, "set_postfix_str"):
                progress.set_postfix_str(case.name[:60])
            rows.append(run_case(case, device, copy_bw, not args.no_reference, args.budget))
        tables.append(markdown_table(rows, copy_bw, info))
    report = (e2e.run(device, quick=args.quick, **e2e.run_options(args))
              if with_e2e else None)
    pair = e2e_spec.resolve_pair(args.model, args.draft_model) if with_e2e else None
    spec_report = e2e_spec.run(device, *pair, quick=args.quick) if pair is not None else None

    out_dir = args.out or default_out_dir(device)
    out_dir.mkdir(parents=True, exist_ok=True)
    if rows and plot(rows, out_dir / "results.png", f"pagedspec on {info.get('name')}"):
        written.append("results.png")
    if report is not None:
        tables.append(e2e.markdown_table(report))
        if e2e.plot(report, out_dir / "e2e.png", f"pagedspec end to end on {info.get('name')}"):
            written.append("e2e.png")
    if spec_report is not None:
        tables.append(e2e_spec.markdown_table(spec_report))
    table = "\n\n".join(tables)
    (out_dir / "results.md").write_text(table + "\n")
    (out_dir / "results.json").write_text(json.dumps(
        {"device": info, "copy_bandwidth_bytes_per_s": copy_bw, "results": rows,
         **(report.json_fields() if report is not None else {}),
         **(spec_report.json_fields() if spec_report is not None else {})}, indent=2))
    print()
    print(table)
    print(f"\nwrote {out_dir}/" + ", ".join(written))
    return 0
