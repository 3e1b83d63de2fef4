"""The engine: requests in, outputs out, one step at a time (vLLM v1's ``LLMEngine`` shape).

    engine = Engine(EngineConfig(model="/path/to/checkpoint"))
    engine.add_request("a", "def fib(n):", SamplingParams(max_tokens=16))
    while engine.has_unfinished():
        for out in engine.step():
            print(out.request_id, out.outputs[0].text, out.finished)

It validates and tokenizes requests (:meth:`process_inputs`), hands them to the
:class:`~pagedspec.engine.core.EngineCore`, which owns the model and the one step loop, and turns
each step's token ids into :class:`RequestOutput`s through the
:class:`~pagedspec.engine.output_processor.OutputProcessor`. ``LLM`` and ``AsyncEngine`` are thin
drivers over it.
"""
from __future__ import annotations

import itertools
import time
from typing import Iterable, Optional, Union

from pagedspec.engine.config import EngineConfig
from pagedspec.engine.core import CoreRequest, EngineCore
from pagedspec.engine.kv_eviction import KVEvictionPolicy
from pagedspec.engine.controller import SpecStats
from pagedspec.engine.metrics import SpecDecodingStats, StepStats
from pagedspec.engine.output_processor import OutputProcessor
from pagedspec.engine.outputs import RequestOutput, SamplingParams

Prompt = Union[str, list[int]]


class Engine:
    """One model with its paged KV cache, serving requests by continuous batching.

    Not thread-safe: one thread drives it (:class:`~pagedspec.engine.async_engine.AsyncEngine`
    owns one in a background thread). :meth:`process_inputs` only reads the engine and may run
    on another thread.
    """

    def __init__(self, config: EngineConfig):
        if not isinstance(config, EngineConfig):
            raise TypeError(f"Engine: config must be an EngineConfig, got "
                            f"{type(config).__name__}")
        self.config = config
        self.core = EngineCore(config)
        self.checkpoint = self.core.checkpoint
        self.tokenizer = self.core.tokenizer
        self.max_model_len = self.core.max_model_len
        self.vocab_size = self.core.model.vocab_size
        self.eos_token_ids = self.checkpoint.generation.eos_token_ids
        self.output_processor = OutputProcessor(self.tokenizer)
        self._arrivals = itertools.count()

    # ---- requests -------------------------------------------------------------------------
    def process_inputs(self, request_id: str, prompt: Prompt, params: SamplingParams,
                       arrival_time: Optional[float] = None, index: Optional[int] = None
                       ) -> tuple[CoreRequest, Optional[str]]:
        """Validates and tokenizes one request; ``(core request, prompt text)``. Raises
        ValueError naming what is wrong (``index``: the prompt's place in a batch, for the
        messages). Changes nothing."""
        who = "prompt" if index is None else f"prompt {index}"
        if not isinstance(request_id, str):
            raise ValueError(f"request_id must be a str, got {type(request_id).__name__}")
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params{'' if index is None else f'[{index}]'} is a "
                             f"{type(params).__name__}, expected SamplingParams")
        params.validate(self.vocab_size)
        policy = self.kv_policy(params)
        policy.check(self.config.block_size,
                     "the request's kv_budget" if index is None else f"request {index}'s "
                     "kv_budget")
        if isinstance(prompt, str):
            text, ids = prompt, self.encode(prompt)
        elif isinstance(prompt, (list, tuple)):
            text, ids = None, list(prompt)
            V = self.vocab_size
            if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < V
                       for t in ids):
                raise ValueError(f"{who}: a token-id prompt must hold ints in [0, {V})")
        else:
            raise ValueError(f"{who} must be a string or a list of token ids, got "
                             f"{type(prompt).__name__}")
        if not ids:
            raise ValueError(f"{who} is empty")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"{who} has {len(ids)} tokens; max_model_len is "
                             f"{self.max_model_len}, which must leave room for at least one "
                             "generated token")
        bm = self.core.block_manager
        pool = bm.num_blocks * bm.block_size
        need = min(len(ids) + params.max_tokens, self.max_model_len)
        if need > pool:
            raise ValueError(f"{who} needs {need} KV slots (prompt plus max_tokens), but the "
                             f"KV cache holds {pool} ({bm.num_blocks} blocks of "
                             f"{bm.block_size}); raise kv_cache_memory or num_kv_blocks")
        arrival = time.monotonic() if arrival_time is None else arrival_time
        return CoreRequest(request_id, ids, params, policy, arrival, number=-1), text

    def encode(self, text: str) -> list[int]:
        """The token ids the engine computes for a text prompt (with the tokenizer's special
        tokens, e.g. bos); ValueError when the engine runs without a tokenizer."""
        if self.tokenizer is None:
            raise ValueError("text prompts need a tokenizer (this engine was made with "
                             "skip_tokenizer_init=True); pass token ids")
        return self.tokenizer.encode(text).ids

    def kv_policy(self, params: SamplingParams) -> KVEvictionPolicy:
        """The request's KV eviction policy: its own settings over the engine's."""
        d = self.core.kv_policy
        pick = lambda mine, default: default if mine is None else mine  # noqa: E731
        return KVEvictionPolicy(pick(params.kv_eviction, d.mode), pick(params.kv_budget, d.budget),
                                pick(params.kv_sink_tokens, d.sink_tokens),
                                pick(params.kv_recent_tokens, d.recent_tokens))

    def add_processed(self, request: CoreRequest, prompt_text: Optional[str]) -> None:
        """Queues a request that :meth:`process_inputs` made."""
        if request.request_id in self.core.requests \
                or self.output_processor.has_request(request.request_id):
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        request.number = next(self._arrivals)    # derives its generators when it has no seed
        self.core.add(request)
        self.output_processor.add(request, prompt_text)

    def add_request(self, request_id: str, prompt: Prompt, params: SamplingParams,
                    arrival_time: Optional[float] = None) -> None:
        """Validates the request and queues it; ValueError (naming the parameter) if it is bad,
        in which case nothing is queued."""
        self.add_processed(*self.process_inputs(request_id, prompt, params, arrival_time))

    def abort(self, request_ids: Iterable[str]) -> None:
        """Ends requests wherever they are (waiting, running, swapped) and frees their blocks;
        unknown or finished ids are ignored. They get no further output."""
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        for request_id in request_ids:
            self.core.abort(request_id)
            self.output_processor.abort(request_id)

    # ---- the loop -------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Runs one step; the outputs of the requests it changed (per their output kind)."""
        core = self.core
        if not core.has_unfinished():
            core.last_stats = core.collect_stats()      # aborts since the last step
            return []
        outputs, stopped = self.output_processor.process(core.step())
        core.clock.mark("output_processing")
        if stopped:
            now = time.monotonic()
            for request_id, index in stopped:
                core.finish(request_id, index, "stop")
            core.collect_stats(core.last_stats)
            for out in outputs:
                if out.finished and out.metrics.finished_time is None:
                    out.metrics.finished_time = now
        return outputs

    def warm_up(self) -> float:
        """With ``compile=True``, compiles every kind of step before real requests come (a
        server's first requests would otherwise wait for it): prefill and decode of one
        sequence and of several, and verification when speculating, on throwaway requests. Then
        forgets them: arrival numbers (seeding), the speculation controller's learning and the
        statistics start afresh. Does nothing in eager mode, with requests already queued, or
        while FP8 scales are still being calibrated (calibration must see real K/V, and its
        steps run eagerly anyway). Returns the seconds it took."""
        core = self.core
        spec = core.speculator
        if not self.config.compile or self.has_unfinished() or any(
                r.calibrate_fp8 for r in core.runners):
            return 0.0
        start = time.perf_counter()
        params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
        # Plain steps first (speculation off), then speculative ones with every sequence
        # drafting the most tokens (what an adaptive controller would choose depends on what
        # it has learned). Each pass: one sequence with a prompt under 17 tokens (a draft model
        # catches up on it in a verification-sized pass), one longer, then five at once.
        # Prompts repeat a 6-token period, so an n-gram drafter finds matches too; each starts
        # elsewhere, so the prefix cache never shares their blocks.
        try:
            for round_, speculator in enumerate((None, spec) if spec else (None,)):
                core.speculator = speculator
                if speculator is not None:
                    speculator.controller = core.new_controller(adaptive=False)
                for n, length in ((1, 12), (1, 40), (5, 20)):
                    for i in range(n):
                        first = 101 * round_ + 31 * i + 5 * n + length
                        size = max(1, min(length + 9 * i,
                                          self.max_model_len - params.max_tokens - 1))
                        prompt = [(first + 7 * (j % 6)) % self.vocab_size for j in range(size)]
                        self.add_request(f"warm-up-{round_}-{n}-{length}-{i}", prompt, params)
                    while self.has_unfinished():
                        self.step()
        finally:
            core.speculator = spec
        self._arrivals = itertools.count()
        if spec is not None:
            spec.controller, spec.stats = core.new_controller(), SpecStats()
            spec.step_stats = SpecDecodingStats()
        core.last_stats = StepStats()
        return time.perf_counter() - start

    def has_unfinished(self) -> bool:
        return self.core.has_unfinished()

    def num_unfinished(self) -> int:
        return len(self.core.requests)

    def stats(self) -> StepStats:
        """The last step's statistics (queue sizes, KV usage, tokens, latencies, speculation)."""
        return self.core.last_stats
