#!/usr/bin/env bash
# The GPU check: on a machine with an NVIDIA GPU and its own CUDA build of torch (any 2.x >= 2.4),
# build pagedspec in place for that GPU, run the whole test suite (CUDA tests included), run
# compute-sanitizer's memcheck over a small smoke run of every CUDA op, and run the quick
# benchmark. Everything lands in the folder given as the argument; summary.txt has the verdicts.
# Budget: under 8 minutes on 16 cores (the build compiles only this GPU's arch).
#
#   bash bench/gpu_check.sh OUT_DIR
set -uo pipefail
OUT=${1:?usage: bench/gpu_check.sh OUT_DIR}
cd "$(dirname "$0")/.."
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)  # absolute: some steps run from a subfolder
PY=${PYTHON:-python3}
SUMMARY="$OUT/summary.txt"
: > "$SUMMARY"
note() { echo "$*" | tee -a "$SUMMARY"; }
step() {  # step NAME TIMEOUT_S CMD... : runs CMD with its output in $OUT/NAME.log, records verdict
  local name=$1 limit=$2; shift 2
  local t0=$(date +%s)
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  note "$name: rc=$rc in $(( $(date +%s) - t0 )) s"
  return $rc
}

nvidia-smi --query-gpu=name,compute_cap,driver_version,clocks.max.sm,memory.total --format=csv \
  > "$OUT/gpu.csv" 2>&1
cap=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -1 | tr -d ' ')
case "$cap" in
  9.0) arch="9.0a" ;;   # Hopper: the arch-specific target, as the package's default list has
  *) arch="$cap" ;;
esac
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-$arch}
export CUDA_HOME=${CUDA_HOME:-$(dirname "$(dirname "$(readlink -f "$(command -v nvcc)")")")}
export MAX_JOBS=${MAX_JOBS:-$(nproc)}
note "gpu: $(tail -1 "$OUT/gpu.csv"); arch list $TORCH_CUDA_ARCH_LIST; CUDA_HOME $CUDA_HOME"
note "torch: $($PY -c 'import torch; print(torch.__version__, torch.version.cuda)')"

PAGEDSPEC_CUDA=1 step build 300 $PY setup.py build_ext --inplace || { note "build failed"; exit 1; }
$PY tools/ptxas_report.py "$OUT/build.log" > "$OUT/ptxas.txt"
grep -c WARNING "$OUT/ptxas.txt" | xargs -I{} note "ptxas: {} kernels spill or use local memory"

export PYTHONPATH="$PWD/python${PYTHONPATH:+:$PYTHONPATH}"
step tests 240 $PY -m pytest -q -n 8 -p no:cacheprovider --junitxml="$OUT/junit.xml"
tail -1 "$OUT/tests.log" | xargs -I{} note "tests: {}"

if command -v compute-sanitizer > /dev/null; then
  step memcheck 120 compute-sanitizer --tool memcheck --error-exitcode 3 $PY tools/cuda_smoke.py
  grep -E "ERROR SUMMARY" "$OUT/memcheck.log" | xargs -I{} note "memcheck: {}"
else
  note "memcheck: compute-sanitizer not found"
fi

# pagedspec inside vLLM, when this environment has a CUDA vLLM (tests/in_vllm registers the
# backend itself, so the source tree is enough).
if $PY -c "import vllm" > /dev/null 2>&1; then
  (cd tests/in_vllm && step vllm 240 $PY -m pytest -q -p no:cacheprovider .)
  tail -1 "$OUT/vllm.log" | xargs -I{} note "vllm: {}"
else
  note "vllm: not installed here (tests/in_vllm skipped)"
fi

step bench 150 $PY -m pagedspec.bench --quick --out "$OUT/bench" --budget 0.5
note "done: results in $OUT"
