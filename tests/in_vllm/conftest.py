"""tests/in_vllm needs vLLM, so it runs in the vLLM environment (tools/test_vllm.sh) and skips
elsewhere (each module starts with ``pytest.importorskip("vllm")``)."""
import os

# In-process engine and worker: ~9 s faster per LLM than vLLM's subprocesses on 2 cores, and the
# negative control's backend (registered in this process) reaches the worker.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB: this machine has 24
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0-1")
