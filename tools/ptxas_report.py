"""Turns ptxas' -v output in a build log into a per-kernel table and names every kernel that
spills or uses a stack frame (local memory), so a regression is visible in CI's log.

Usage: python tools/ptxas_report.py BUILD_LOG [--fail-on-spill]
"""
from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys

ENTRY = re.compile(r"Compiling entry function '(\w+)' for '(sm_\w+)'")
FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
REGS = re.compile(r"Used (\d+) registers")


def demangle(names: list[str]) -> dict[str, str]:
    tool = shutil.which("c++filt")
    if not tool or not names:
        return {n: n for n in names}
    out = subprocess.run([tool], input="\n".join(names), capture_output=True, text=True).stdout
    return dict(zip(names, out.splitlines()))


def parse(log: str) -> list[dict]:
    kernels, current = [], None
    for line in log.splitlines():
        if m := ENTRY.search(line):
            current = {"mangled": m.group(1), "arch": m.group(2), "regs": None, "stack": 0,
                       "spill_stores": 0, "spill_loads": 0}
            kernels.append(current)
        elif current is not None and (m := FRAME.search(line)):
            current["stack"], current["spill_stores"], current["spill_loads"] = map(int, m.groups())
        elif current is not None and (m := REGS.search(line)):
            current["regs"] = int(m.group(1))
    return kernels


def short(name: str, width: int = 110) -> str:
    name = name.replace("pagedspec::", "").replace("(anonymous namespace)::", "")
    return name if len(name) <= width else name[: width - 3] + "..."


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("log")
    parser.add_argument("--fail-on-spill", action="store_true")
    args = parser.parse_args()
    kernels = parse(open(args.log, errors="replace").read())
    if not kernels:
        print("ptxas report: no ptxas -v output in the log (CPU-only build?)")
        return 0
    names = demangle(sorted({k["mangled"] for k in kernels}))
    print(f"ptxas report: {len(kernels)} kernel compilations")
    print(f"{'arch':7s} {'regs':>4s} {'stack':>5s} {'spill st/ld':>11s}  kernel")
    bad = []
    for k in sorted(kernels, key=lambda k: (names[k["mangled"]], k["arch"])):
        spill = f"{k['spill_stores']}/{k['spill_loads']}"
        print(f"{k['arch']:7s} {k['regs'] or 0:4d} {k['stack']:5d} {spill:>11s}  "
              f"{short(names[k['mangled']])}")
        if k["spill_stores"] or k["spill_loads"] or k["stack"]:
            bad.append(k)
    for k in bad:
        print(f"WARNING: kernel spills or uses local memory on {k['arch']} "
              f"(stack {k['stack']} B, spill stores {k['spill_stores']} B, loads "
              f"{k['spill_loads']} B): {names[k['mangled']]}")
    if not bad:
        print("ptxas report: no kernel spills or uses a stack frame")
    return 1 if bad and args.fail_on_spill else 0


if __name__ == "__main__":
    sys.exit(main())
