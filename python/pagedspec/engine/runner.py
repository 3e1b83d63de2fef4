"""Executes one scheduler step (:class:`pagedspec.engine.StepBatch`) on a model over the paged
KV cache.

Per step: apply the step's block moves (swaps, copy-on-write copies), then per layer write the new
tokens' K/V at their ``slot_mapping`` slots with :func:`pagedspec.ops.reshape_and_cache` and attend
with :func:`pagedspec.ops.paged_attention`, which covers prefill chunks, decodes and multi-token
verification in one call (query rows grouped per sequence by ``cu_seqlens_q``, causal within each
sequence). Only the rows at ``logits_indices`` go through the LM head.
"""
from __future__ import annotations

import torch

from pagedspec import ops
from pagedspec.engine.blocks import KVCache
from pagedspec.engine.model import TinyLlama
from pagedspec.engine.scheduler import StepBatch


class ModelRunner:
    """Runs ``model`` on ``kv_cache``'s device; the model's weights must live there too."""

    def __init__(self, model: TinyLlama, kv_cache: KVCache):
        c = model.config
        if len(kv_cache.key_caches) != c.num_layers:
            raise ValueError(f"ModelRunner: the KV cache has {len(kv_cache.key_caches)} layers, "
                             f"the model {c.num_layers}")
        if tuple(kv_cache.key_caches[0].shape[2:]) != (c.num_kv_heads, c.head_size):
            raise ValueError("ModelRunner: KV cache heads/head size differ from the model's")
        if model.device != kv_cache.device:
            raise ValueError(f"ModelRunner: model on {model.device}, KV cache on "
                             f"{kv_cache.device}")
        self.model, self.kv_cache, self.device = model, kv_cache, kv_cache.device
        self.num_steps = 0             # forward passes run (the target model's step count)

    @torch.inference_mode()
    def execute(self, batch: StepBatch, all_rows: bool = False) -> torch.Tensor:
        """Float32 logits ``[L, V]`` at ``batch.logits_indices`` (every row when ``all_rows``)."""
        kv, model, dev = self.kv_cache, self.model, self.device
        kv.apply(batch.block_ops)      # before the forward pass: it may read copied blocks
        self.num_steps += 1
        if batch.num_tokens == 0:
            return torch.empty((0, model.config.vocab_size), device=dev)
        slot_mapping = batch.slot_mapping.to(dev)
        block_tables, seq_lens = batch.block_tables.to(dev), batch.seq_lens.to(dev)
        cu_seqlens_q = batch.cu_seqlens_q.to(dev)

        def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            key_cache, value_cache = kv.key_caches[layer], kv.value_caches[layer]
            ops.reshape_and_cache(k, v, key_cache, value_cache, slot_mapping)
            out = torch.empty_like(q)
            ops.paged_attention(out, q, key_cache, value_cache, block_tables, seq_lens,
                                cu_seqlens_q, batch.max_q_len, model.scale)
            return out

        hidden = model.forward(batch.input_ids.to(dev), batch.positions.to(dev), attend)
        if not all_rows:
            hidden = hidden[batch.logits_indices.to(dev)]
        return model.logits(hidden)
