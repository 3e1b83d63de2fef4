"""Executes one scheduler step (:class:`pagedspec.engine.StepBatch`) on a model over the paged
KV cache.

Per step: apply the step's block moves (swaps, copy-on-write copies), then per layer write the new
tokens' K/V at their ``slot_mapping`` slots with :func:`pagedspec.ops.reshape_and_cache` and attend
with :func:`pagedspec.ops.paged_attention_run` through one plan per step
(:func:`pagedspec.ops.plan_paged_attention`), which covers prefill chunks, decodes and multi-token
verification in one call (query rows grouped per sequence by ``cu_seqlens_q``, causal within each
sequence). Only the rows at ``logits_indices`` go through the LM head.

FP8 caches use per-layer, per-tensor scales. With ``calibrate_fp8=True`` they are set from the
first step that computes any token (normally a prefill): ``scale = amax(|x|) / (fp8_max / 2)``
for K and V of each layer. The factor 2 is headroom for later tokens larger than the prefill's;
FP8 is a floating-point format, so headroom costs precision only in the subnormal range.
"""
from __future__ import annotations

from typing import Optional

import torch

from pagedspec import ops
from pagedspec.engine.kv_cache import KVCache
from pagedspec.engine.model import CausalLM
from pagedspec.engine.scheduler import StepBatch

_FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}


class ModelRunner:
    """Runs ``model`` on ``kv_cache``'s device; the model's weights must live there too."""

    def __init__(self, model: CausalLM, kv_cache: KVCache, calibrate_fp8: bool = False):
        if len(kv_cache.key_caches) != model.num_layers:
            raise ValueError(f"ModelRunner: the KV cache has {len(kv_cache.key_caches)} layers, "
                             f"the model {model.num_layers}")
        if tuple(kv_cache.key_caches[0].shape[2:]) != (model.num_kv_heads, model.head_size):
            raise ValueError(f"ModelRunner: KV cache heads x head size "
                             f"{tuple(kv_cache.key_caches[0].shape[2:])} differ from the "
                             f"model's {(model.num_kv_heads, model.head_size)}")
        if model.device != kv_cache.device:
            raise ValueError(f"ModelRunner: model on {model.device}, KV cache on "
                             f"{kv_cache.device}")
        self.model, self.kv_cache, self.device = model, kv_cache, kv_cache.device
        self.calibrate_fp8 = calibrate_fp8 and kv_cache.is_fp8
        self.num_steps = 0             # forward passes run (the target model's step count)

    def _calibrate(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        headroom_max = _FP8_MAX[self.kv_cache.dtype] / 2
        for x, scale in ((k, self.kv_cache.k_scales[layer]), (v, self.kv_cache.v_scales[layer])):
            amax = torch.nan_to_num(x.abs().amax().float(), posinf=0.0)
            scale.copy_((amax / headroom_max).clamp_(min=1e-6))   # stays on the device: no sync

    @torch.inference_mode()
    def execute(self, batch: StepBatch, all_rows: bool = False,
                attn_mass: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Float32 logits ``[L, V]`` at ``batch.logits_indices`` (every row when ``all_rows``).

        ``attn_mass``: float32 ``[num_blocks * block_size]`` on the cache's device; every layer's
        attention adds the probability each slot received (summed over heads and query tokens),
        the H2O signal (:mod:`pagedspec.engine.kv_eviction`)."""
        kv, model, dev = self.kv_cache, self.model, self.device
        kv.apply(batch.block_ops)      # before the forward pass: it may read copied blocks
        self.num_steps += 1
        if batch.num_tokens == 0:
            return torch.empty((0, model.vocab_size), device=dev)
        slot_mapping = batch.slot_mapping.to(dev)
        block_tables, seq_lens = batch.block_tables.to(dev), batch.seq_lens.to(dev)
        cu_seqlens_q = batch.cu_seqlens_q.to(dev)
        calibrate, self.calibrate_fp8 = self.calibrate_fp8, False
        fp8 = kv.is_fp8

        # One split-KV plan per step, from the lengths the scheduler has on the host, shared by
        # every layer: the work and scratch follow the real lengths, not the table's width.
        plan = ops.plan_paged_attention(batch.seq_lens, batch.cu_seqlens_q, model.num_heads,
                                        model.num_kv_heads, model.head_size, dev)

        def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            key_cache, value_cache = kv.key_caches[layer], kv.value_caches[layer]
            k_scale = kv.k_scales[layer] if fp8 else None
            v_scale = kv.v_scales[layer] if fp8 else None
            if calibrate:
                self._calibrate(layer, k, v)
            ops.reshape_and_cache(k, v, key_cache, value_cache, slot_mapping, k_scale, v_scale)
            out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
            ops.paged_attention_run(out, q, key_cache, value_cache, block_tables, seq_lens,
                                    cu_seqlens_q, batch.max_q_len, model.scale, plan.plan,
                                    plan.workspace, k_scale, v_scale, attn_mass=attn_mass)
            return out

        hidden = model.forward(batch.input_ids.to(dev), batch.positions.to(dev), attend)
        if not all_rows:
            hidden = hidden[batch.logits_indices.to(dev)]
        return model.compute_logits(hidden)
