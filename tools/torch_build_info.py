"""Prints what the C++ build needs to know about the installed torch, as CMake `set()` lines.

Used by CMakeLists.txt (so setup.py and a direct CMake build share one source of truth).
"""
from __future__ import annotations

import os
import sys


def main() -> None:
    import torch
    from torch.utils import cpp_extension

    torch_dir = os.path.dirname(torch.__file__)
    includes = cpp_extension.include_paths()  # CPU paths only (no CUDA query, no GPU probe)
    extra_cuda = []
    # CUDA builds of torch include cuBLAS/cuSPARSE headers that ship in the nvidia-* wheels.
    site = os.path.dirname(torch_dir)
    for sub in ("nvidia/cu13/include", "nvidia/cuda_runtime/include"):
        path = os.path.join(site, sub)
        if os.path.isdir(path):
            extra_cuda.append(path)
    values = {
        "TORCH_VERSION": torch.__version__,
        "TORCH_CUDA_VERSION": torch.version.cuda or "",
        "TORCH_IS_CUDA": "ON" if torch.version.cuda else "OFF",
        "TORCH_CXX11_ABI": str(int(torch._C._GLIBCXX_USE_CXX11_ABI)),
        "TORCH_INCLUDE_DIRS": ";".join(includes),
        "TORCH_LIBRARY_DIR": os.path.join(torch_dir, "lib"),
        "TORCH_EXTRA_CUDA_INCLUDE_DIRS": ";".join(extra_cuda),
    }
    if sys.argv[1:] == ["cmake"]:
        for key, value in values.items():
            print(f'set({key} "{value}")')
    else:
        for key, value in values.items():
            print(f"{key}={value}")


if __name__ == "__main__":
    main()
