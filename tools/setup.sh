#!/usr/bin/env bash
# Sets pagedspec up from nothing: a Python 3.11 virtual environment in .venv, torch (a CUDA 13.0
# build by default), the test, server and benchmark dependencies, the real model
# (tools/fetch_smollm2.sh), and an editable build of the package.
# The CUDA kernels are compiled whenever nvcc is found (PAGEDSPEC_CUDA=1 makes that mandatory,
# PAGEDSPEC_CUDA=0 skips them); no GPU is needed to build. The build log is build/build.log and
# ptxas' per-kernel register/spill report is printed at the end.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3.11}
TORCH_SPEC=${TORCH_SPEC:-torch==2.14.1}

if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install -q "$TORCH_SPEC" numpy scipy pytest pytest-xdist hypothesis \
  expecttest "cmake>=3.26" ninja tqdm matplotlib nvidia-ml-py safetensors tokenizers transformers gguf \
  fastapi uvicorn prometheus_client jinja2 openai httpx aiohttp 2>&1 | grep -v "^WARNING: Location" || true
.venv/bin/python -c "import torch, cmake, ninja" # fail here, clearly, if the install did not work
# The real model (SmolLM2-135M-Instruct, GGUF) into the model cache, outside the package:
# the main job's default and the real-model tests' subject. PAGEDSPEC_FETCH_MODEL=0 skips it.
if [ "${PAGEDSPEC_FETCH_MODEL:-1}" != 0 ]; then
  bash tools/fetch_smollm2.sh
fi

# torch guesses the toolkit from `nvcc` on PATH, which may be a wrapper script: name it instead.
if [ -z "${CUDA_HOME:-}" ] && [ -x /usr/local/cuda/bin/nvcc ]; then
  export CUDA_HOME=/usr/local/cuda
fi
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-8.9;9.0a}

mkdir -p build
start=$(date +%s)
if ! .venv/bin/python -m pip install -v --no-build-isolation -e . > build/build.log 2>&1; then
  grep -E "error|Error|FAILED" build/build.log | head -60 || true
  tail -40 build/build.log
  echo "setup: the build failed; the whole log is build/build.log" >&2
  exit 1
fi
echo "setup: built pagedspec in $(( $(date +%s) - start )) s"
.venv/bin/python tools/ptxas_report.py build/build.log
.venv/bin/python -c "import pagedspec, json; print('setup: build_info', json.dumps(pagedspec.build_info()))"
