"""Reads the SASS of every kernel in the built library (cuobjdump, from the CUDA toolkit or the
copy Triton's wheel carries) and reports, per kernel and arch, its global loads and stores by
width and any local-memory traffic (LDL/STL: spills or stack arrays).

Usage: python tools/sass_report.py [LIBRARY] [--arch sm_90a]
As a module: kernel_memory_ops(library, arch) -> {kernel: Counter of opcode classes}.
"""
from __future__ import annotations

import argparse
import collections
import glob
import os
import re
import shutil
import subprocess
import sys

FUNCTION = re.compile(r"Function : (\S+)")
MEMORY_OP = re.compile(r"\b(LDG|STG|LDL|STL|LDS|STS)(\.[\w.]+)?\b")


def find_cuobjdump() -> str | None:
    found = shutil.which("cuobjdump")
    if found:
        return found
    cuda_home = os.environ.get("CUDA_HOME", "/usr/local/cuda")
    candidates = [os.path.join(cuda_home, "bin", "cuobjdump")]
    try:
        import triton

        candidates.append(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia",
                                       "bin", "cuobjdump"))
    except ImportError:
        pass
    return next((c for c in candidates if os.path.exists(c)), None)


def default_library() -> str:
    import pagedspec._C as lib

    return lib.__file__


def width_class(opcode: str, suffix: str | None) -> str:
    """LDG.E.128 -> 'LDG.128'; LDG.E -> 'LDG.32'; local memory collapses to 'LDL'/'STL'."""
    if opcode in ("LDL", "STL"):
        return opcode
    bits = re.search(r"\.(128|64|U8|S8|U16|S16)\b", suffix or "")
    return f"{opcode}.{bits.group(1) if bits else '32'}"


def kernel_memory_ops(library: str, arch: str) -> dict[str, collections.Counter]:
    tool = find_cuobjdump()
    if tool is None:
        raise FileNotFoundError("cuobjdump not found (CUDA toolkit or triton's wheel)")
    sass = subprocess.run([tool, "-sass", "-arch", arch, library], capture_output=True,
                          text=True, check=True).stdout
    kernels: dict[str, collections.Counter] = {}
    current = None
    for line in sass.splitlines():
        if m := FUNCTION.search(line):
            current = kernels.setdefault(m.group(1), collections.Counter())
        elif current is not None and (m := MEMORY_OP.search(line)):
            current[width_class(m.group(1), m.group(2))] += 1
    return kernels


def demangle(names: list[str]) -> dict[str, str]:
    tool = shutil.which("c++filt")
    if not tool:
        return {n: n for n in names}
    out = subprocess.run([tool], input="\n".join(names), capture_output=True, text=True).stdout
    return dict(zip(names, out.splitlines()))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("library", nargs="?", default=None)
    parser.add_argument("--arch", default="sm_90a")
    args = parser.parse_args()
    library = args.library or default_library()
    kernels = kernel_memory_ops(library, args.arch)
    names = demangle(sorted(kernels))
    print(f"SASS memory operations per kernel ({args.arch}, {os.path.basename(library)})")
    local = []
    for mangled in sorted(kernels, key=lambda k: names[k]):
        ops = kernels[mangled]
        summary = ", ".join(f"{k} x{v}" for k, v in sorted(ops.items()))
        print(f"  {names[mangled][:100]}\n      {summary}")
        if ops["LDL"] or ops["STL"]:
            local.append(names[mangled])
    for name in local:
        print(f"WARNING: local memory (LDL/STL) in {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
