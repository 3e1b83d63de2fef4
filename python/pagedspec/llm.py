"""The offline API, in the shape of vLLM's: ``LLM``, ``SamplingParams``, ``RequestOutput``.

    from pagedspec import LLM, SamplingParams

    llm = LLM("/path/to/hf-checkpoint", dtype="bfloat16")
    for out in llm.generate(["def fib(n):", "import os"], SamplingParams(max_tokens=32)):
        print(out.prompt, out.outputs[0].text)

An ``LLM`` is a thin loop over one :class:`~pagedspec.engine.engine.Engine`: ``generate`` adds
the requests and calls :meth:`Engine.step` until they are done. The engine does the rest:
continuous batching (prefill chunks and decodes in one step), ``n > 1`` as forks sharing the
prompt's blocks, speculation, KV eviction, detokenization, stop strings and logprobs.
"""
from __future__ import annotations

import dataclasses
import itertools
import os
import sys
from typing import Iterator, Optional, Union

from pagedspec.engine.config import EngineConfig
from pagedspec.engine.engine import Engine
from pagedspec.engine.outputs import (CompletionOutput, Logprob, RequestMetrics,  # noqa: F401
                                      RequestOutput, RequestOutputKind, SamplingParams)

_CONFIG_FIELDS = {f.name for f in dataclasses.fields(EngineConfig)} - {"model"}


class LLM:
    """A model served from a local checkpoint directory, with a paged KV cache.

    Args:
        model: a Hugging Face checkpoint directory (``config.json``, safetensors weights,
            ``tokenizer.json``), a ``.gguf`` file, or the name of a checkpoint shipped with
            pagedspec. Every other keyword is a field of :class:`EngineConfig`.
        dtype: ``"auto"`` (the checkpoint's dtype; float32 checkpoints run in bfloat16 on CUDA,
            whose kernels take 16-bit queries), ``"float32"``, ``"bfloat16"``, ``"float16"`` or a
            torch.dtype.
        device: ``"cpu"``, ``"cuda"``, ``"cuda:1"``, ...; default CUDA when usable, else CPU.
        kv_cache_dtype: ``"auto"`` (the model's dtype), ``"fp8_e4m3"`` or ``"fp8_e5m2"``.
        kv_scales: FP8 scales: None (the checkpoint's ``self_attn.k_scale`` / ``v_scale`` if it
            has them, else calibrated from the first prefill), ``"calibrate"``, or ``(k, v)``
            floats (every layer) or per-layer lists.
        block_size: tokens per KV block (8, 16, 32 or 64).
        kv_cache_memory: bytes for the KV cache (default: what ``max_num_seqs`` sequences of
            ``max_model_len`` tokens need, at most 1 GiB). num_kv_blocks: the block count instead.
        max_num_seqs: sequences in one step at most. max_num_batched_tokens: tokens per step.
        max_model_len: prompt plus output tokens per sequence (default: the checkpoint's
            ``max_position_embeddings``).
        enable_prefix_caching: reuse the KV blocks of identical prompt prefixes.
        swap_space: GiB of CPU memory for preempted sequences' blocks (0: recompute instead).
        preemption_mode: ``"auto"``, ``"recompute"`` or ``"swap"`` (see the scheduler).
        seed: seeds the requests that carry no seed of their own (request i gets a generator
            derived from ``(seed, i)``), so whole runs are reproducible.
        skip_tokenizer_init: run without ``tokenizer.json`` (prompts must be token ids; outputs
            then have empty text).
        speculative_model: a draft checkpoint sharing the target's tokenizer (or a shipped
            model's name), ``"ngram"`` for prompt lookup, or None (no speculation).
        num_speculative_tokens: the most draft tokens per sequence and step (1..16).
        speculative_adaptive: let the controller choose each step's k in 0..max from measured
            costs and acceptance (:mod:`pagedspec.engine.controller`); False drafts the maximum
            every step. With adaptive k, a seeded sampled request's tokens can depend on the
            batch (its k does; its distribution never does).
        prompt_lookup_max, prompt_lookup_min: n-gram sizes for ``"ngram"``.
        kv_eviction: ``"none"`` (keep every token's K/V), ``"streaming"`` (the first
            ``kv_sink_tokens`` and the last ``kv_recent_tokens``), ``"h2o"`` (those plus the
            blocks that received the most attention) or ``"random"`` (a baseline), within
            ``kv_budget`` tokens per sequence; whole blocks are evicted, keys keep their
            original positions (:mod:`pagedspec.engine.kv_eviction`). Requests may override
            each of these in their SamplingParams. kv_recent_tokens None: the rest of the budget
            (streaming) or half of it (h2o, random).
    """

    def __init__(self, model: Union[str, os.PathLike], **kwargs):
        unknown = sorted(set(kwargs) - _CONFIG_FIELDS)
        if unknown:
            raise TypeError(f"LLM: unexpected keyword argument {unknown[0]!r} (the engine's "
                            f"settings are {', '.join(sorted(_CONFIG_FIELDS))})")
        self.engine = Engine(EngineConfig(model=str(model), **kwargs))
        self._request_ids = itertools.count()

    # What the engine is made of, for inspection (tests, benchmarks).
    checkpoint = property(lambda self: self.engine.checkpoint)
    tokenizer = property(lambda self: self.engine.tokenizer)
    max_model_len = property(lambda self: self.engine.max_model_len)
    device = property(lambda self: self.engine.core.device)
    dtype = property(lambda self: self.engine.core.dtype)
    model = property(lambda self: self.engine.core.model)
    draft_model = property(lambda self: self.engine.core.draft_model)
    kv_cache = property(lambda self: self.engine.core.kv_cache)
    block_manager = property(lambda self: self.engine.core.block_manager)
    scheduler = property(lambda self: self.engine.core.scheduler)
    runner = property(lambda self: self.engine.core.runner)
    kv_budgets = property(lambda self: self.engine.core.kv_budgets)
    speculator = property(lambda self: self.engine.core.speculator)

    def speculative_metrics(self) -> Optional[dict]:
        """vLLM's speculative-decoding metrics over this LLM's life (None without
        speculation): drafts, draft tokens, accepted tokens (in all and per position),
        acceptance rate, mean acceptance length, draft and target seconds per step."""
        spec = self.engine.core.speculator
        return spec.stats.as_dict() if spec is not None else None

    def _add_all(self, prompts, sampling_params) -> list[str]:
        """Validates every request before any is queued, so one bad request loses nothing;
        returns their ids in prompt order."""
        if isinstance(prompts, str) or (isinstance(prompts, (list, tuple)) and prompts
                                        and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = (list(sampling_params) if isinstance(sampling_params, (list, tuple))
                  else [sampling_params] * len(prompts))
        if len(params) != len(prompts):
            raise ValueError(f"LLM.generate: {len(params)} SamplingParams for {len(prompts)} "
                             "prompts; pass one, or one per prompt")
        processed = []
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            if isinstance(p, SamplingParams) and p.output_kind is not RequestOutputKind.FINAL_ONLY:
                # Only final outputs are returned: the engine need not build the others.
                p = dataclasses.replace(p, output_kind=RequestOutputKind.FINAL_ONLY)
            try:
                processed.append(self.engine.process_inputs(
                    str(next(self._request_ids)), prompt, p, index=i))
            except ValueError as exc:
                raise ValueError(f"LLM.generate: {exc}") from None
        for request, text in processed:
            self.engine.add_processed(request, text)
        return [request.request_id for request, _ in processed]

    def _run(self, request_ids: list[str]) -> Iterator[RequestOutput]:
        """Steps until the requests are done, yielding each final output as it finishes;
        requests left when the caller stops early are aborted and freed."""
        remaining = set(request_ids)
        try:
            while remaining:
                for out in self.engine.step():
                    if out.finished and out.request_id in remaining:
                        remaining.discard(out.request_id)
                        yield out
        finally:
            if remaining:
                self.engine.abort(remaining)

    def generate_iter(self, prompts, sampling_params=None) -> Iterator[RequestOutput]:
        """Like :meth:`generate`, but yields each request's output as soon as it finishes
        (completion order, not prompt order). Parameters are validated before the first step."""
        return self._run(self._add_all(prompts, sampling_params))

    def generate(self, prompts, sampling_params=None, use_tqdm: bool = True
                 ) -> list[RequestOutput]:
        """Runs the prompts to completion; one :class:`RequestOutput` per prompt, in prompt order.

        ``prompts``: a string, a list of strings, or a list of token-id lists (one token-id list
        is one prompt). ``sampling_params``: one :class:`SamplingParams` for all, or one per
        prompt (default: ``SamplingParams()``). Bad parameters raise ValueError before any work.
        """
        request_ids = self._add_all(prompts, sampling_params)
        bar = None
        if use_tqdm and len(request_ids) > 1:
            try:
                from tqdm.auto import tqdm
                bar = tqdm(total=len(request_ids), desc="Processed prompts", file=sys.stderr,
                           dynamic_ncols=True)
            except ImportError:
                pass
        finals = {}
        for out in self._run(request_ids):
            finals[out.request_id] = out
            if bar is not None:
                bar.update(1)
        if bar is not None:
            bar.close()
        return [finals[r] for r in request_ids]
