"""pagedspec's kernels as a vLLM attention backend.

``pip install pagedspec`` next to vLLM is enough: two entry points (``pyproject.toml``) load this
package in every vLLM process.

- ``vllm.general_plugins`` -> :func:`register`: registers
  :class:`pagedspec.vllm.backend.PagedSpecAttentionBackend` as vLLM's ``CUSTOM`` attention
  backend, so ``LLM(..., attention_backend="CUSTOM")`` runs attention through
  ``pagedspec.reshape_and_cache`` and ``pagedspec.paged_attention*``. vLLM's CUDA platform honours
  ``CUSTOM`` as it is.
- ``vllm.platform_plugins`` -> :func:`cpu_platform`: vLLM's stock CPU platform replaces every
  backend but its own ``CPU_ATTN`` with ``CPU_ATTN`` (logging one INFO line), so on a CPU build
  pagedspec activates :class:`pagedspec.vllm.platform.PagedSpecCpuPlatform`: vLLM's CPU platform
  unchanged except that it honours ``CUSTOM`` (validated like the CUDA platform does, refused
  with the reasons when the model needs what the backend lacks) and says so at WARNING level.
  ``PAGEDSPEC_VLLM_PLATFORM=0`` keeps the stock platform (and then ``CUSTOM`` is replaced by
  ``CPU_ATTN``, which :func:`register` warns about); ``VLLM_PLUGINS`` filters plugins by name
  (``pagedspec``) as for any plugin.

Supported: vLLM 0.32.x (CPU and CUDA builds). On another version nothing is registered over the
stock behaviour: ``CUSTOM`` points at a module whose import raises an ImportError naming the
supported versions, which vLLM reports when the backend is selected.

Importing :mod:`pagedspec` never imports vLLM, and neither does importing this package; only
:func:`register` and :func:`cpu_platform`, called by vLLM, do.
"""
from __future__ import annotations

import logging
import os

SUPPORTED_VLLM = ((0, 32),)  # (major, minor) releases the backend is written and tested for
BACKEND = "pagedspec.vllm.backend.PagedSpecAttentionBackend"
UNSUPPORTED_BACKEND = "pagedspec.vllm.unsupported.PagedSpecAttentionBackend"
CPU_PLATFORM = "pagedspec.vllm.platform.PagedSpecCpuPlatform"

logger = logging.getLogger(__name__)


def vllm_version() -> str:
    import vllm

    return getattr(vllm, "__version__", "unknown")


def version_supported(version: str) -> bool:
    """Whether the backend supports vLLM ``version`` (e.g. "0.32.0", "0.32.1+cpu")."""
    parts = version.split("+")[0].split(".")
    try:
        major_minor = (int(parts[0]), int(parts[1]))
    except (IndexError, ValueError):
        return False
    return major_minor in SUPPORTED_VLLM


def supported_text() -> str:
    return ", ".join(f"{a}.{b}.x" for a, b in SUPPORTED_VLLM)


def register() -> None:
    """vLLM general plugin: register the backend as ``AttentionBackendEnum.CUSTOM``.
    Idempotent (vLLM loads plugins once per process, and processes may repeat it)."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    version = vllm_version()
    if not version_supported(version):
        logger.warning("pagedspec: vLLM %s is not supported by pagedspec's attention backend "
                       "(supported: %s); attention_backend='CUSTOM' will fail with this "
                       "message.", version, supported_text())
        register_backend(AttentionBackendEnum.CUSTOM, UNSUPPORTED_BACKEND)
        return
    register_backend(AttentionBackendEnum.CUSTOM, BACKEND)
    if os.environ.get("PAGEDSPEC_VLLM_PLATFORM", "1") == "0":
        logger.warning("pagedspec: PAGEDSPEC_VLLM_PLATFORM=0: on vLLM's stock CPU platform, "
                       "attention_backend='CUSTOM' is replaced by CPU_ATTN (pagedspec's "
                       "backend is used on CUDA only)")


def cpu_platform() -> str | None:
    """vLLM platform plugin: pagedspec's CPU platform wherever vLLM's CPU platform would be
    chosen (a supported vLLM, unless ``PAGEDSPEC_VLLM_PLATFORM=0``); None otherwise."""
    if os.environ.get("PAGEDSPEC_VLLM_PLATFORM", "1") == "0":
        return None
    if not version_supported(vllm_version()):
        return None
    from vllm.platforms import cpu_platform_plugin

    return CPU_PLATFORM if cpu_platform_plugin() is not None else None
