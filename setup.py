"""Builds pagedspec: setup.py only drives CMakeLists.txt, the single description of the C++ build.

Environment:
  PAGEDSPEC_CUDA=0|1        force a CPU-only build (0) or require the CUDA kernels (1);
                            default: build them whenever torch is a CUDA build and nvcc is found.
  TORCH_CUDA_ARCH_LIST      CUDA archs, default "8.9;9.0a" (Ada and Hopper).
  CUDA_HOME                 CUDA toolkit root; default /usr/local/cuda when it has bin/nvcc.
  MAX_JOBS                  parallel compile jobs (default: CPU count).
  PAGEDSPEC_NATIVE=1        compile with -march=native (not portable; the CPU kernels choose
                            their ISA level at run time without it).
  PAGEDSPEC_BUILD_DIR       the CMake build folder (default build/cmake); a second environment
                            (another torch, e.g. bench/peers/setup_vllm_cpu.sh's) needs its own.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent
DEFAULT_ARCHS = "8.9;9.0a"


def _cuda_home() -> str | None:
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if home:
        return home
    # `nvcc` on PATH may be a wrapper script, so do not infer the toolkit root from it.
    for candidate in ("/usr/local/cuda",):
        if (Path(candidate) / "bin" / "nvcc").exists():
            return candidate
    return None


def _tool(name: str) -> str | None:
    """The cmake / ninja of the running Python's environment (their PyPI packages), else PATH's."""
    try:
        module = __import__(name)
        path = Path(module.CMAKE_BIN_DIR if name == "cmake" else module.BIN_DIR) / name
        if path.exists():
            return str(path)
    except (ImportError, AttributeError):
        pass
    return shutil.which(name)


class CMakeExtension(Extension):
    def __init__(self, name: str) -> None:
        super().__init__(name, sources=[])


class CMakeBuild(build_ext):
    def build_extension(self, ext: Extension) -> None:
        out_dir = Path(self.get_ext_fullpath(ext.name)).resolve().parent
        # A fixed build folder so `pip install -e .` rebuilds incrementally.
        build_dir = Path(os.environ.get("PAGEDSPEC_BUILD_DIR") or ROOT / "build" / "cmake")
        build_dir = build_dir if build_dir.is_absolute() else ROOT / build_dir
        build_dir.mkdir(parents=True, exist_ok=True)

        cuda_mode = {"0": "OFF", "1": "ON"}.get(os.environ.get("PAGEDSPEC_CUDA", ""), "AUTO")
        archs = os.environ.get("TORCH_CUDA_ARCH_LIST") or DEFAULT_ARCHS
        env = dict(os.environ)
        # torch probes a GPU for the arch list when it is unset, and crashes without one.
        env["TORCH_CUDA_ARCH_LIST"] = archs
        args = [
            f"-DPython_EXECUTABLE={sys.executable}",
            f"-DCMAKE_LIBRARY_OUTPUT_DIRECTORY={out_dir}",
            f"-DCMAKE_BUILD_TYPE={'Debug' if self.debug else 'Release'}",
            f"-DPAGEDSPEC_CUDA={cuda_mode}",
            f"-DPAGEDSPEC_CUDA_ARCHS={archs}",
            f"-DPAGEDSPEC_NATIVE={'ON' if os.environ.get('PAGEDSPEC_NATIVE') == '1' else 'OFF'}",
        ]
        cuda_home = _cuda_home()
        if cuda_home and cuda_mode != "OFF":
            env["CUDA_HOME"] = cuda_home
            nvcc = Path(cuda_home) / "bin" / "nvcc"
            if nvcc.exists():
                args += [f"-DCMAKE_CUDA_COMPILER={nvcc}", f"-DCUDAToolkit_ROOT={cuda_home}"]
        ninja = _tool("ninja")
        if ninja:
            args += ["-G", "Ninja", f"-DCMAKE_MAKE_PROGRAM={ninja}"]
        jobs = os.environ.get("MAX_JOBS") or str(os.cpu_count() or 1)

        cmake = _tool("cmake")
        if cmake is None:
            raise RuntimeError("pagedspec: cmake >= 3.26 is needed to build (pip install cmake)")
        subprocess.run([cmake, "-S", str(ROOT), "-B", str(build_dir), *args], check=True, env=env)
        subprocess.run([cmake, "--build", str(build_dir), "-j", jobs], check=True, env=env)


setup(
    packages=find_packages("python"),
    package_dir={"": "python"},
    # The shipped demo checkpoints (tools/train_demo_models.py writes them).
    package_data={"pagedspec.models": ["data/*/*"]},
    ext_modules=[CMakeExtension("pagedspec._C")],
    cmdclass={"build_ext": CMakeBuild},
    zip_safe=False,
)
