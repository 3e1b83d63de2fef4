"""Executes one scheduler step (:class:`pagedspec.engine.StepBatch`) on a model over the paged
KV cache.

Per step: apply the step's block moves (swaps, copy-on-write copies), then per layer write the new
tokens' K/V at their ``slot_mapping`` slots with :func:`pagedspec.ops.reshape_and_cache` and attend
with :func:`pagedspec.ops.paged_attention_run` through one plan per step
(:func:`pagedspec.ops.plan_paged_attention`), which covers prefill chunks, decodes and multi-token
verification in one call (query rows grouped per sequence by ``cu_seqlens_q``, causal within each
sequence). Only the rows at ``logits_indices`` go through the LM head.

FP8 caches use per-layer, per-tensor scales. With ``calibrate_fp8=True`` they are calibrated over
the first steps until ``calibration_tokens`` tokens were computed: ``scale = amax(|x|) /
(fp8_max / 2)`` rounded up to a power of two, for K and V of each layer, ``amax`` a running
maximum over every token seen so far. One step is not enough: a one-token warm-up request left
the scales of SmolLM2-135M 2-3x too small, and later K/V clipped (greedy agreement with float32
fell from 95% to 69% on a long prompt). When a scale grows, the blocks already written
with the smaller one (tracked through the steps' writes, copies and swaps) are requantized to
it, so every cached value always decodes with its layer's current scale; powers of two make that
requantization exact outside the subnormal range. The factor 2 (2 to 4 after rounding) is
headroom for later tokens larger than the calibration's; FP8 is a floating-point format, so
headroom costs precision only in the subnormal range.
"""
from __future__ import annotations

import functools
from typing import Callable, Optional

import numpy as np
import torch

from pagedspec import ops
from pagedspec.engine.cuda_graphs import StepGraphs
from pagedspec.engine.kv_cache import KVCache
from pagedspec.engine.model import CausalLM
from pagedspec.engine.scheduler import StepBatch

_FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}

# Tokens the FP8 calibration sees before the scales are fixed: a few hundred, so that one short
# warm-up request cannot set them alone.
CALIBRATION_TOKENS = 256

# Decoder layers per compiled graph. Every group of this many layers runs one graph, so the
# cold compile grows with the group, while each call of a graph costs a fixed dispatch (~0.3 ms
# on a 2-core VM). SmolLM2's 30 layers, bf16, cold warm-up / batch-1 step (EPYC-VM, 2 threads):
# whole stack 140 s / 25.5 ms, 6 layers 37 s / 25.5 ms, 1 layer 21 s / 27.2 ms, eager 30.3 ms
# (plain weights; on prepacked ones 6 layers 36 s / 17.9 ms, 15 layers 67 s / 18.0 ms).
LAYERS_PER_GRAPH = 6


def layers_per_graph(num_layers: int, target: Optional[int] = None) -> int:
    """The group size for ``num_layers``: its largest divisor up to ``target`` (default
    ``LAYERS_PER_GRAPH``; equal groups share one graph), or ``target`` if that divisor is under
    half of it (a shorter last group then compiles a second graph)."""
    target = LAYERS_PER_GRAPH if target is None else target
    divisor = max(d for d in range(1, min(target, num_layers) + 1) if num_layers % d == 0)
    return divisor if 2 * divisor >= min(target, num_layers) else target


class ModelRunner:
    """Runs ``model`` on ``kv_cache``'s device; the model's weights must live there too.

    ``compile=True`` runs the decoder layers through ``torch.compile`` (inductor), with
    pagedspec's ops as opaque custom ops (their fake kernels give the shapes), so the elementwise
    work around the GEMMs (norms, RoPE, SwiGLU, residual adds) fuses. The layers go in equal
    groups (:func:`layers_per_graph`), one graph serving every group (the layers' weights,
    caches and scales are its arguments): compiling a few layers instead of the whole unrolled
    model cuts the cold compile several-fold (PyTorch's "regional compilation"). Per-step
    tensors are marked dynamic in their step-varying dimensions, so varying token and sequence
    counts reuse a few graphs (one or one and a size-1 specialization per kind of step) instead
    of recompiling; the first step of each kind pays the compilation once per process. The
    embedding lookup, final norm and LM head run eagerly, and so do FP8 calibration steps.
    Weights are prepacked for oneDNN where that helps (:meth:`CausalLM.prepack_weights`),
    compiled or not."""

    def __init__(self, model: CausalLM, kv_cache: KVCache, calibrate_fp8: bool = False,
                 calibration_tokens: int = CALIBRATION_TOKENS, compile: bool = False):
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
        if not isinstance(calibration_tokens, int) or calibration_tokens < 1:
            raise ValueError(f"ModelRunner: calibration_tokens must be an int >= 1, got "
                             f"{calibration_tokens!r}")
        self.model, self.kv_cache, self.device = model, kv_cache, kv_cache.device
        self.calibrate_fp8 = calibrate_fp8 and kv_cache.is_fp8   # True while calibrating
        self.calibration_tokens = calibration_tokens
        self.calibrated_tokens = 0     # tokens the FP8 calibration has seen
        zeros = lambda: torch.zeros((), dtype=torch.float32, device=self.device)  # noqa: E731
        self._amax = [(zeros(), zeros()) for _ in range(model.num_layers)] \
            if self.calibrate_fp8 else []
        # Blocks that may hold K/V quantized during calibration (device pool, CPU swap space):
        # requantized whenever a scale grows. A superset is harmless (it costs a copy).
        self._written: set[int] = set()
        self._written_cpu: set[int] = set()
        self.num_steps = 0             # forward passes run (the target model's step count)
        self.graphs: Optional[StepGraphs] = None     # see enable_graphs
        self.keep_hidden = False       # keep the last step's hidden states (see execute)
        self.hidden: Optional[torch.Tensor] = None
        self.compiled = bool(compile)
        self.prepacked = model.prepack_weights()
        self._layer = self._layers_forward
        self.layers_per_call = model.num_layers      # eager: the whole stack in one call
        if compile:
            # Every runner (target, draft) shares _layers_forward's code object, whose graphs
            # dynamo counts against one limit (8 by default): a few kinds of step per model need
            # more. vLLM raises it too.
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
            # dynamic=None: sizes start static and only the dimensions marked below (or seen to
            # vary) become symbolic; fullgraph: a break would silently leave the ops eager.
            self._layer = torch.compile(self._layers_forward, dynamic=None, fullgraph=True)
            self.layers_per_call = layers_per_graph(model.num_layers)

    def enable_graphs(self, max_num_seqs: int, max_model_len: int,
                      capture: bool = True) -> None:
        """From now on, steps of at most ``max_num_seqs`` sequences of at most
        ``max_model_len`` tokens with at most 16 query rows each run padded over persistent
        buffers, replayed from CUDA graphs
        (:class:`pagedspec.engine.cuda_graphs.StepGraphs`; ``capture=False``: padded but eager,
        for tests on any device). Prefill chunks, FP8 calibration and H2O steps stay as they
        are."""
        self.graphs = StepGraphs(self, max_num_seqs, max_model_len, capture=capture)

    def _track_moves(self, moves) -> None:
        """Blocks that calibration-era K/V reached through this step's swaps and copies."""
        if moves.swap_out.numel():
            self._written_cpu.update(moves.swap_out[:, 1].tolist())
        if moves.swap_in.numel():
            self._written.update(moves.swap_in[:, 1].tolist())
        if moves.copies.numel():
            self._written.update(moves.copies[:, 1].tolist())

    def _calibrate(self, layer: int, k: torch.Tensor, v: torch.Tensor,
                   written: Optional[torch.Tensor], written_cpu: Optional[torch.Tensor]) -> None:
        """Grows layer ``layer``'s running amax by this step's ``k``/``v`` and sets its scales
        from it, first requantizing the ``written`` blocks (device) and ``written_cpu`` blocks
        (swap space) from the old scale to the new one. No host synchronization."""
        kv = self.kv_cache
        headroom_max = _FP8_MAX[kv.dtype] / 2
        for x, amax, scale, cache, cpu_cache in (
                (k, self._amax[layer][0], kv.k_scales[layer], kv.key_caches[layer],
                 kv.cpu_key_caches[layer]),
                (v, self._amax[layer][1], kv.v_scales[layer], kv.value_caches[layer],
                 kv.cpu_value_caches[layer])):
            torch.maximum(amax, torch.nan_to_num(x.abs().amax().float(), posinf=0.0), out=amax)
            # A power of two: requantizing by the ratio of two of them is exact (FP8 values
            # just change exponent) except for values that fall into the subnormal range, so
            # the several requantizations of a calibration do not compound rounding errors.
            new = torch.exp2(torch.ceil(torch.log2((amax / headroom_max).clamp_(min=2.0**-24))))
            # amax only grows, so ratio <= 1 for blocks written since the first step: the
            # requantized values stay in range.
            if written is not None:
                _requantize(cache, written, scale / new)
            if written_cpu is not None:
                _requantize(cpu_cache, written_cpu, (scale / new).to(cpu_cache.device))
            scale.copy_(new)

    @torch.inference_mode()
    def execute(self, batch: StepBatch, all_rows: bool = False,
                attn_mass: Optional[torch.Tensor] = None,
                features: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Float32 logits ``[L, V]`` at ``batch.logits_indices`` (every row when ``all_rows``).

        ``attn_mass``: float32 ``[num_blocks * block_size]`` on the cache's device; every layer's
        attention adds the probability each slot received (summed over heads and query tokens),
        the H2O signal (:mod:`pagedspec.engine.kv_eviction`). ``features``: ``[T, H]`` per input
        token, for a model that takes them (an EAGLE draft, :class:`EagleDraft`). With
        :attr:`keep_hidden` set, :attr:`hidden` holds every row's final-norm hidden state
        ``[T, H]`` afterwards (what an EAGLE draft reads of its target)."""
        kv, model, dev = self.kv_cache, self.model, self.device
        if (features is not None) != bool(getattr(model, "takes_features", False)):
            raise ValueError("ModelRunner.execute: features must be given exactly for a model "
                             f"that takes them ({type(model).__name__})")
        kv.apply(batch.block_ops)      # before the forward pass: it may read copied blocks
        if self.calibrate_fp8:
            self._track_moves(batch.block_ops)
        self.num_steps += 1
        if batch.num_tokens == 0:
            return torch.empty((0, model.vocab_size), device=dev)
        graphs = self.graphs
        if (graphs is not None and not self.calibrate_fp8 and attn_mass is None
                and graphs.fits(batch)):
            every = all_rows or self.keep_hidden
            hidden = graphs.run(batch, np.arange(batch.num_tokens) if every
                                else batch.logits_indices.numpy())
            if self.keep_hidden:
                self.hidden = hidden
                if not all_rows:
                    hidden = hidden[batch.logits_indices.to(dev)]
            return model.compute_logits(hidden)
        slot_mapping = batch.slot_mapping.to(dev)
        block_tables, seq_lens = batch.block_tables.to(dev), batch.seq_lens.to(dev)
        cu_seqlens_q = batch.cu_seqlens_q.to(dev)
        calibrate = self.calibrate_fp8
        written = written_cpu = None
        if calibrate:
            if self._written:
                written = torch.tensor(sorted(self._written), dtype=torch.int64, device=dev)
            if self._written_cpu:
                written_cpu = torch.tensor(sorted(self._written_cpu), dtype=torch.int64)

        # One split-KV plan per step, from the lengths the scheduler has on the host, shared by
        # every layer: the work and scratch follow the real lengths, not the table's width.
        plan = ops.plan_paged_attention(batch.seq_lens, batch.cu_seqlens_q, model.num_heads,
                                        model.num_kv_heads, model.head_size, dev)
        inputs = (batch.input_ids.to(dev), batch.positions.to(dev), features, slot_mapping,
                  block_tables, seq_lens, cu_seqlens_q, plan.plan, plan.workspace)
        if calibrate:
            hidden = self._run_layers(
                self._layers_forward, *inputs, batch.max_q_len, attn_mass,
                on_kv=lambda layer, k, v: self._calibrate(layer, k, v, written, written_cpu))
        else:
            max_q_len = batch.max_q_len
            if self.compiled:
                # An int argument of an op specializes the graph on its value; max_q_len is only
                # an upper bound on each sequence's query rows, so three values cover all steps:
                # decodes, verifications (k + 1 <= 17 rows) and prefill chunks.
                max_q_len = 1 if max_q_len == 1 else 17 if max_q_len <= 17 else model.max_position
            hidden = self._run_layers(self._layer, *inputs, max_q_len, attn_mass)
        if calibrate:
            block_size = kv.key_caches[0].shape[1]
            slots = batch.slot_mapping[batch.slot_mapping >= 0]      # -1: a padding row
            self._written.update((slots // block_size).unique().tolist())
            self.calibrated_tokens += batch.num_tokens
            if self.calibrated_tokens >= self.calibration_tokens:
                self.calibrate_fp8 = False        # scales fixed from here on
                self._written.clear()
                self._written_cpu.clear()
        if self.keep_hidden:
            self.hidden = hidden
        if not all_rows:
            hidden = hidden[batch.logits_indices.to(dev)]
        return model.compute_logits(hidden)

    def _run_layers(self, layer_fn: Callable[..., torch.Tensor], input_ids: torch.Tensor,
                    positions: torch.Tensor, features: Optional[torch.Tensor],
                    slot_mapping: torch.Tensor,
                    block_tables: torch.Tensor, seq_lens: torch.Tensor,
                    cu_seqlens_q: torch.Tensor, plan: torch.Tensor, workspace: torch.Tensor,
                    max_q_len: int, attn_mass: Optional[torch.Tensor],
                    on_kv: Optional[Callable[[int, torch.Tensor, torch.Tensor], None]] = None
                    ) -> torch.Tensor:
        """The model's forward over the paged cache, from the step's tensors (the caches and
        scales are the runner's), ``self.layers_per_call`` layers at a time through
        ``layer_fn`` (:meth:`_layers_forward` or its compiled graph). ``on_kv(layer, k, v)``
        sees each layer's new K/V before they are cached (calibration; eager only)."""
        kv, model = self.kv_cache, self.model
        h, position_state = (model.embed_input(input_ids, positions) if features is None else
                             model.embed_input(input_ids, positions, features.to(self.device)))
        step = (slot_mapping, block_tables, seq_lens, cu_seqlens_q, plan, workspace)
        if layer_fn is not self._layers_forward:
            for t in (h, *step, *position_state):   # step-varying sizes symbolic (or size 1)
                for dim in range(t.dim()):
                    torch._dynamo.maybe_mark_dynamic(t, dim)
        fp8, group = kv.is_fp8, self.layers_per_call
        for first in range(0, model.num_layers, group):
            layers = slice(first, first + group)
            h = layer_fn(model.layers[layers], h, position_state, kv.key_caches[layers],
                         kv.value_caches[layers], kv.k_scales[layers] if fp8 else None,
                         kv.v_scales[layers] if fp8 else None, *step, max_q_len, attn_mass,
                         None if on_kv is None else functools.partial(_shifted, on_kv, first))
        return model.final_norm(h)

    def _layers_forward(self, weights: list, h: torch.Tensor, position_state,
                        key_caches: list[torch.Tensor], value_caches: list[torch.Tensor],
                        k_scales: Optional[list[torch.Tensor]],
                        v_scales: Optional[list[torch.Tensor]], slot_mapping: torch.Tensor,
                        block_tables: torch.Tensor, seq_lens: torch.Tensor,
                        cu_seqlens_q: torch.Tensor, plan: torch.Tensor,
                        workspace: torch.Tensor, max_q_len: int,
                        attn_mass: Optional[torch.Tensor],
                        on_kv: Optional[Callable[[int, torch.Tensor, torch.Tensor], None]] = None
                        ) -> torch.Tensor:
        """Consecutive decoder layers over the paged cache: everything they read is an
        argument (no layer index), so one compiled graph serves every group of as many layers.
        ``on_kv(i, k, v)``: ``i`` counts within the group."""
        model = self.model
        for i, weights_i in enumerate(weights):
            key_cache, value_cache = key_caches[i], value_caches[i]
            k_scale = k_scales[i] if k_scales is not None else None
            v_scale = v_scales[i] if v_scales is not None else None

            def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
                if on_kv is not None:
                    on_kv(i, k, v)
                ops.reshape_and_cache(k, v, key_cache, value_cache, slot_mapping, k_scale,
                                      v_scale)
                out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
                ops.paged_attention_run(out, q, key_cache, value_cache, block_tables, seq_lens,
                                        cu_seqlens_q, max_q_len, model.scale, plan, workspace,
                                        k_scale, v_scale, attn_mass=attn_mass)
                return out

            h = model.decoder_layer(weights_i, h, position_state, attend)
        return h


def _shifted(on_kv: Callable[[int, torch.Tensor, torch.Tensor], None], first: int, i: int,
             k: torch.Tensor, v: torch.Tensor) -> None:
    on_kv(first + i, k, v)


def _requantize(cache: torch.Tensor, blocks: torch.Tensor, ratio: torch.Tensor) -> None:
    """FP8 ``cache[blocks] = fp8(cache[blocks] * ratio)``: values stored under scale ``s_old``
    re-stored under ``s_new`` (``ratio = s_old / s_new``), through uint8 views (index_put has no
    float8 kernels)."""
    raw = cache.view(torch.uint8)
    values = raw[blocks].view(cache.dtype).float().mul_(ratio)
    raw[blocks] = values.to(cache.dtype).view(torch.uint8)
