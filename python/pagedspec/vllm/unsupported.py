"""Registered as vLLM's CUSTOM backend on an unsupported vLLM: importing it is the error vLLM
reports when the backend is selected."""
from pagedspec.vllm import supported_text, vllm_version

raise ImportError(f"pagedspec's vLLM attention backend supports vLLM {supported_text()}, found "
                  f"vLLM {vllm_version()}: install a supported vLLM or choose another "
                  f"attention_backend")
