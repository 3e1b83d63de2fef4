"""vLLM's CPU platform, honouring attention_backend='CUSTOM' (pagedspec's backend)."""
from __future__ import annotations

import logging

from vllm.platforms.cpu import CpuPlatform
from vllm.v1.attention.backends.registry import AttentionBackendEnum

logger = logging.getLogger(__name__)


class PagedSpecCpuPlatform(CpuPlatform):
    """:class:`vllm.platforms.cpu.CpuPlatform` except for backend selection: ``CUSTOM`` is
    validated against the layer's configuration (as vLLM's CUDA platform does) and used, or
    refused with the reasons; every other choice goes to the stock CPU platform."""

    @classmethod
    def get_attn_backend_cls(cls, selected_backend, attn_selector_config, num_heads=None) -> str:
        if selected_backend != AttentionBackendEnum.CUSTOM:
            return super().get_attn_backend_cls(selected_backend, attn_selector_config,
                                                num_heads)
        try:
            backend = AttentionBackendEnum.CUSTOM.get_class()
        except ImportError as e:  # an unsupported vLLM (pagedspec.vllm.unsupported)
            raise ValueError(f"attention_backend='CUSTOM' is not available: {e}") from e
        reasons = backend.validate_configuration(device_capability=None,
                                                 **attn_selector_config._asdict())
        if reasons:
            raise ValueError(f"pagedspec: attention_backend='CUSTOM' ({backend.__name__}) cannot "
                             f"run this model's attention: {', '.join(reasons)} "
                             f"({attn_selector_config!r})")
        logger.warning("pagedspec: attention runs through pagedspec's kernels (%s.%s)",
                       backend.__module__, backend.__qualname__)
        return AttentionBackendEnum.CUSTOM.get_path()
