"""vLLM's attention-backend interface over pagedspec's ops (vLLM 0.32.x; see
:mod:`pagedspec.vllm`). The work itself is in :mod:`pagedspec.vllm.layer_ops`."""
from __future__ import annotations

from typing import ClassVar

import torch
from vllm.config import VllmConfig, get_layers_from_vllm_config
from vllm.model_executor.layers.attention import Attention
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionImpl,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
)
from vllm.v1.kv_cache_layout import KVCacheLayout

import pagedspec
from pagedspec.vllm import layer_ops
from pagedspec.vllm.layer_ops import PagedSpecMetadata


class PagedSpecAttentionBackend(AttentionBackend):
    """Decoder self-attention (prefill, chunked prefill, decode, mixed batches) with paged K/V,
    MHA/GQA/MQA, float16/bfloat16 (and float32 on CPU), native or FP8 (e4m3, e5m2) caches."""

    forward_includes_kv_cache_update: bool = False
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16,
                                                     torch.float32]
    supported_kv_cache_dtypes: ClassVar[list[str]] = ["auto", "float16", "bfloat16", "fp8",
                                                      "fp8_e4m3", "fp8_e5m2"]

    @staticmethod
    def get_name() -> str:
        return "CUSTOM"

    @staticmethod
    def get_impl_cls() -> type["PagedSpecAttentionImpl"]:
        return PagedSpecAttentionImpl

    @staticmethod
    def get_builder_cls() -> type["PagedSpecMetadataBuilder"]:
        return PagedSpecMetadataBuilder

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list[int]:
        # Powers of two (the kernels split positions with shifts); vLLM splits a larger manager
        # block into kernel blocks of one of these.
        return [256, 128, 64, 32, 16, 8]

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return list(pagedspec.build_info()["attention_head_sizes"])

    @classmethod
    def supported_kv_cache_layouts(cls) -> tuple[KVCacheLayout, ...]:
        # Every layout in which one layer's block is one dense page (layer_ops.kv_cache_views).
        return (KVCacheLayout.LBHNC, KVCacheLayout.LBNHC, KVCacheLayout.BLHNC,
                KVCacheLayout.BLNHC)

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == AttentionType.DECODER

    @classmethod
    def supports_dtype(cls, dtype: torch.dtype) -> bool:
        if dtype == torch.float32 and torch.cuda.is_available():
            return False  # float32 queries are a CPU-only feature of the kernels
        return dtype in cls.supported_dtypes


class PagedSpecMetadataBuilder(AttentionMetadataBuilder[PagedSpecMetadata]):
    # CPU plans from host lengths, CUDA dispatches by the block table: neither captures.
    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.NEVER

    def __init__(self, kv_cache_spec, layer_names: list[str], vllm_config: VllmConfig,
                 device: torch.device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        layers = get_layers_from_vllm_config(vllm_config, Attention, layer_names)
        heads = {layer.impl.num_heads for layer in layers.values()}
        if len(heads) != 1:
            raise ValueError(f"pagedspec: one KV cache group's layers must share num_heads, got "
                             f"{sorted(heads)}")
        self.num_heads = heads.pop()
        self.num_kv_heads = kv_cache_spec.num_kv_heads
        self.head_size = kv_cache_spec.head_size

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> PagedSpecMetadata:
        m = common_attn_metadata
        return layer_ops.build_metadata(
            num_reqs=m.num_reqs, num_actual_tokens=m.num_actual_tokens,
            max_query_len=m.max_query_len, query_start_loc=m.query_start_loc,
            seq_lens=m.seq_lens, block_table=m.block_table_tensor, slot_mapping=m.slot_mapping,
            num_heads=self.num_heads, num_kv_heads=self.num_kv_heads, head_size=self.head_size,
            query_start_loc_cpu=m.query_start_loc_cpu)


class PagedSpecAttentionImpl(AttentionImpl):
    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int,
                 alibi_slopes: list[float] | None, sliding_window: int | None,
                 kv_cache_dtype: str, logits_soft_cap: float | None = None,
                 attn_type: str = AttentionType.DECODER,
                 kv_sharing_target_layer_name: str | None = None,
                 sinks: torch.Tensor | None = None) -> None:
        # What the kernels do not compute is refused here, when vLLM builds the model.
        unsupported = {
            "ALiBi": alibi_slopes is not None,
            "sliding-window attention": sliding_window is not None,
            "logits soft-capping": logits_soft_cap not in (None, 0, 0.0),
            "attention sinks": sinks is not None,
            f"attention type {attn_type}": attn_type != AttentionType.DECODER,
        }
        missing = [name for name, needed in unsupported.items() if needed]
        if missing:
            raise NotImplementedError(f"pagedspec's attention backend does not support "
                                      f"{', '.join(missing)}; choose another attention_backend")
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads
        self.kv_cache_dtype = kv_cache_dtype
        self.kv_sharing_target_layer_name = kv_sharing_target_layer_name
        self.attn_type = attn_type
        self._cache_dtype: torch.dtype | None = None  # from the first forward's query dtype
        self._views = None  # (kv_cache's identity, (K, V)): made once per cache tensor

    def _caches(self, kv_cache: torch.Tensor, model_dtype: torch.dtype):
        if self._cache_dtype is None:
            self._cache_dtype = layer_ops.cache_dtype(self.kv_cache_dtype, model_dtype)
        key = (kv_cache.data_ptr(), tuple(kv_cache.shape), kv_cache.stride(), kv_cache.dtype)
        if self._views is None or self._views[0] != key:
            self._views = (key, layer_ops.kv_cache_views(kv_cache, self.num_kv_heads,
                                                         self.head_size, self._cache_dtype))
        return self._views[1]

    def _scales(self, layer):
        return (layer_ops.scale_tensor(getattr(layer, "_k_scale", None), self._cache_dtype),
                layer_ops.scale_tensor(getattr(layer, "_v_scale", None), self._cache_dtype))

    def do_kv_cache_update(self, layer, key: torch.Tensor, value: torch.Tensor,
                           kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        if self.kv_sharing_target_layer_name is not None:
            return  # this layer reads another layer's cache, which that layer writes
        key_cache, value_cache = self._caches(kv_cache, key.dtype)
        layer_ops.write_kv(key, value, key_cache, value_cache, slot_mapping, *self._scales(layer))

    def forward(self, layer, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, attn_metadata: PagedSpecMetadata | None,
                output: torch.Tensor, output_scale: torch.Tensor | None = None,
                output_block_scale: torch.Tensor | None = None) -> torch.Tensor:
        """query ``[T, Hq, D]`` (a strided view of the fused QKV), output ``[T, Hq * D]``;
        kv_cache: this layer's ``[num_blocks, Hkv, block_size, 2 * D]`` pages."""
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("pagedspec's attention backend does not fuse output "
                                      "quantization")
        if attn_metadata is None:  # vLLM's warm-up / profiling run
            return output
        key_cache, value_cache = self._caches(kv_cache, query.dtype)
        return layer_ops.attend(query, key_cache, value_cache, attn_metadata, self.scale,
                                *self._scales(layer), output)
