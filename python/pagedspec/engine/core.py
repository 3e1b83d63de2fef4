"""The engine core: the model, its paged KV cache, the block manager, the scheduler, the KV
eviction budgets and (optionally) a :class:`Speculator`, and the one step that drives them.

A step (:meth:`EngineCore.step`): plan drafts, schedule, draft, run the target, sample or verify,
update the scheduler, evict. It works on token ids only and reports per sequence what it
gained (:class:`SeqUpdate`); text, stop strings and output shapes are the output processor's
(:mod:`pagedspec.engine.output_processor`), requests' validation the engine's
(:class:`pagedspec.engine.engine.Engine`).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Optional

import torch

from pagedspec._build_info import build_info
from pagedspec.engine.block_manager import BlockManager
from pagedspec.engine.config import EngineConfig
from pagedspec.engine.controller import SpeculationController
from pagedspec.engine.kv_cache import KVCache
from pagedspec.engine.kv_eviction import KVBudgets, KVEvictionPolicy
from pagedspec.engine.metrics import FinishedRequestStats, StepStats
from pagedspec.engine.outputs import SamplingParams
from pagedspec.engine.runner import ModelRunner
from pagedspec.engine.sampler import SamplingRow, sample, top_logprobs
from pagedspec.engine.scheduler import Scheduler, SchedulerConfig, StepBatch
from pagedspec.engine.sequence import Sequence, SequenceStatus
from pagedspec.engine.speculative import (DraftModelProposer, EagleProposer, NgramProposer,
                                          Verification, verify_drafts)
from pagedspec.engine.speculator import Speculator
from pagedspec.models.loader import DTYPES, Checkpoint, load_checkpoint

KV_DTYPES = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn,
             "fp8_e5m2": torch.float8_e5m2}

# One generated token's logprobs: (the token's logprob, its rank, the top (token, logprob) pairs)
RawLogprobs = tuple[float, int, list[tuple[int, float]]]


class PhaseClock:
    """Wall seconds per phase of the step, for the step profile
    (:mod:`pagedspec.bench.step_profile`): :meth:`mark` charges the time since the previous
    mark to a phase. The core's default clock does nothing, so a step pays nothing for it."""

    def __init__(self):
        self.seconds: dict[str, float] = {}
        self.steps = 0
        self._last = 0.0

    def start(self) -> None:
        self._last = time.perf_counter()
        self.steps += 1

    def mark(self, phase: str) -> None:
        now = time.perf_counter()
        self.seconds[phase] = self.seconds.get(phase, 0.0) + now - self._last
        self._last = now


class _NoClock:
    def start(self) -> None:
        pass

    def mark(self, phase: str) -> None:
        pass


def mix_seed(*parts: int) -> int:
    """A 63-bit seed from integers (splitmix64 steps), so derived generators are unrelated."""
    x = 0
    for p in parts:
        x = (x + (p & 0xFFFFFFFFFFFFFFFF) + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
        x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
        x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
        x ^= x >> 31
    return x & 0x7FFFFFFFFFFFFFFF


@dataclass(eq=False)
class CoreRequest:
    """A validated request as the core runs it: ``params.n`` sequences once its prompt is in."""
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    kv_policy: KVEvictionPolicy
    arrival_time: float
    number: int                      # arrival order in the engine: derives unseeded generators
    row: SamplingRow = field(init=False)
    seqs: list[Sequence] = field(default_factory=list)          # completion index order
    generators: list[torch.Generator] = field(default_factory=list)
    first_scheduled_time: Optional[float] = None
    first_token_time: Optional[float] = None
    last_token_time: dict[int, float] = field(default_factory=dict)   # index -> time
    finished_time: Optional[float] = None

    def __post_init__(self):
        self.row = self.params.row

    @property
    def finished(self) -> bool:
        return (len(self.seqs) == self.params.n
                and all(s.status is SequenceStatus.FINISHED for s in self.seqs))


@dataclass
class SeqUpdate:
    """What one sequence gained in a step."""
    request: CoreRequest
    index: int                                   # the completion's index in its request
    new_token_ids: list[int]
    new_logprobs: Optional[list[RawLogprobs]]    # one per new token when the request wants them
    finish_reason: Optional[str]                 # "stop" / "length" when it ended this step
    stop_reason: Optional[int]                   # the stop token that ended it


class EngineCore:
    """Builds everything from an :class:`EngineConfig` and runs steps. Not thread-safe: one
    caller (the :class:`~pagedspec.engine.engine.Engine`) drives it."""

    def __init__(self, config: EngineConfig):
        self.config = config
        self.checkpoint: Checkpoint = load_checkpoint(config.model)
        cfg = self.checkpoint.config
        self.device = _device(config.device)
        self.dtype = _dtype(config.dtype, self.device, self.checkpoint)
        cache_dtype = _kv_dtype(config.kv_cache_dtype, self.dtype)
        block_size = config.block_size
        if block_size not in (8, 16, 32, 64):
            raise ValueError(f"EngineConfig.block_size must be 8, 16, 32 or 64, got "
                             f"{block_size!r}")
        self.kv_policy = KVEvictionPolicy(config.kv_eviction, config.kv_budget,
                                          config.kv_sink_tokens, config.kv_recent_tokens)
        self.kv_policy.check(block_size, "EngineConfig.kv_budget")
        max_model_len = cfg.max_position if config.max_model_len is None \
            else config.max_model_len
        if not isinstance(max_model_len, int) or not 2 <= max_model_len <= cfg.max_position:
            raise ValueError(f"EngineConfig.max_model_len must be in [2, {cfg.max_position}] "
                             f"(the checkpoint's max_position_embeddings), got {max_model_len}")
        if cfg.sliding_window is not None and cfg.sliding_window < max_model_len:
            raise ValueError(f"{self.checkpoint.path}: the checkpoint asks for a sliding window "
                             f"of {cfg.sliding_window} tokens, which pagedspec does not "
                             f"implement; pass max_model_len <= {cfg.sliding_window} (attention "
                             "is then the same) or use a checkpoint without one")
        max_num_seqs = config.max_num_seqs
        if not isinstance(max_num_seqs, int) or max_num_seqs < 1:
            raise ValueError(f"EngineConfig.max_num_seqs must be an int >= 1, got "
                             f"{max_num_seqs!r}")
        self.max_model_len = max_model_len
        # The core computes on token ids; the tokenizer is loaded here once, for the engine's
        # input and output processing and for checking a draft's vocabulary against it.
        self.tokenizer = None if config.skip_tokenizer_init else self.checkpoint.load_tokenizer()
        draft_ckpt = self._draft_checkpoint(config)
        self.model = self.checkpoint.load_model(self.dtype, self.device)

        bytes_per_block = sum(
            KVCache.bytes_per_block(c.num_layers, block_size, c.num_kv_heads, c.head_size,
                                    cache_dtype)
            for c in [cfg] + ([draft_ckpt.config] if draft_ckpt is not None else []))
        num_kv_blocks = config.num_kv_blocks
        if num_kv_blocks is None:
            if config.kv_cache_memory is None:
                wanted = max_num_seqs * -(-max_model_len // block_size)
                num_kv_blocks = max(1, min(wanted, (1 << 30) // bytes_per_block))
            else:
                num_kv_blocks = int(config.kv_cache_memory) // bytes_per_block
        if num_kv_blocks < 1:
            raise ValueError(f"EngineConfig: the KV cache holds no block "
                             f"({config.kv_cache_memory} bytes, {bytes_per_block} bytes per "
                             "block)")
        num_cpu_blocks = int(config.swap_space * (1 << 30)) // bytes_per_block
        self.kv_cache = KVCache(cfg.num_layers, num_kv_blocks, block_size, cfg.num_kv_heads,
                                cfg.head_size, cache_dtype, self.device, num_cpu_blocks)
        calibrate = self._set_kv_scales(config.kv_scales)
        self.block_manager = BlockManager(num_kv_blocks, block_size, num_cpu_blocks,
                                          enable_prefix_caching=config.enable_prefix_caching)
        budget = config.max_num_batched_tokens or max(2048, max_num_seqs + 256)
        self.scheduler = Scheduler(SchedulerConfig(max_num_seqs=max_num_seqs,
                                                   max_num_batched_tokens=budget,
                                                   preemption_mode=config.preemption_mode),
                                   self.block_manager)
        self.runner = ModelRunner(self.model, self.kv_cache, calibrate_fp8=calibrate,
                                  compile=config.compile)
        self.speculator: Optional[Speculator] = None
        self.draft_model = None
        if config.speculative_model is not None:
            controller = self.new_controller()
            if draft_ckpt is None:
                self.speculator = Speculator(controller, ngram=NgramProposer(
                    config.prompt_lookup_max, config.prompt_lookup_min))
            else:
                dc = draft_ckpt.config
                self.draft_model = draft_ckpt.load_model(self.dtype, self.device,
                                                         borrow=self._lend_to_draft)
                draft_cache = KVCache(dc.num_layers, num_kv_blocks, block_size, dc.num_kv_heads,
                                      dc.head_size, cache_dtype, self.device, num_cpu_blocks)
                scales = draft_ckpt.kv_scales() if draft_cache.is_fp8 else None
                if scales is not None:
                    draft_cache.set_scales(*scales)
                proposer = EagleProposer if dc.eagle else DraftModelProposer
                self.speculator = Speculator(controller, draft_model=proposer(
                    self.draft_model, draft_cache, calibrate_fp8=draft_cache.is_fp8
                    and scales is None, compile=config.compile,
                    vocab=draft_ckpt.draft_vocab()))
                # An EAGLE head reads the target's final hidden states of every step.
                self.runner.keep_hidden = self.speculator.reads_target_hidden
        if config.cuda_graphs and self.device.type == "cuda":
            for runner in self.runners:
                # An EAGLE head's passes take features, which the graphs' buffers do not hold.
                if not getattr(runner.model, "takes_features", False):
                    runner.enable_graphs(max_num_seqs, max_model_len)
        self.kv_budgets = KVBudgets(seed=config.seed)
        self.requests: dict[str, CoreRequest] = {}
        self._by_seq: dict[int, tuple[CoreRequest, int]] = {}   # seq id -> (request, index)
        self._finished_stats: list[FinishedRequestStats] = []     # aborts between steps
        self.last_stats = StepStats()
        self.clock = _NoClock()       # a PhaseClock splits steps into phases (step profile)

    @property
    def runners(self) -> list[ModelRunner]:
        """The target's runner, then the draft model's when one drafts."""
        spec = self.speculator
        draft = spec.draft_model if spec is not None else None
        return [self.runner] + ([draft.runner] if draft is not None else [])

    # ---- construction helpers -------------------------------------------------------------
    def new_controller(self, adaptive: Optional[bool] = None) -> SpeculationController:
        """A speculation controller that has learned nothing yet (adaptive as configured, unless
        ``adaptive`` says otherwise)."""
        return SpeculationController(self.config.num_speculative_tokens,
                                     self.config.speculative_adaptive if adaptive is None
                                     else adaptive)

    def _draft_checkpoint(self, config: EngineConfig) -> Optional[Checkpoint]:
        """The draft checkpoint (None for n-gram drafting or none), its vocabulary checked."""
        if config.speculative_model is None:
            return None
        k = config.num_speculative_tokens
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= 16:
            raise ValueError(f"EngineConfig.num_speculative_tokens must be an int in [1, 16], "
                             f"got {k!r}")
        if config.speculative_model == "ngram":
            return None
        draft = load_checkpoint(config.speculative_model)
        target_vocab, draft_vocab = self.checkpoint.config.vocab_size, draft.config.vocab_size
        if draft_vocab != target_vocab:
            raise ValueError(f"EngineConfig.speculative_model: {draft.path} has a vocabulary of "
                             f"{draft_vocab} tokens, the target {target_vocab}; a draft must "
                             "share the target's tokenizer")
        if draft.config.eagle and draft.config.hidden_size != self.checkpoint.config.hidden_size:
            raise ValueError(f"EngineConfig.speculative_model: {draft.path} is an EAGLE head "
                             f"over features of size {draft.config.hidden_size}, the target's "
                             f"hidden size is {self.checkpoint.config.hidden_size}")
        if draft.config.max_position < self.max_model_len:
            raise ValueError(f"EngineConfig.speculative_model: {draft.path} covers "
                             f"{draft.config.max_position} positions, fewer than max_model_len "
                             f"({self.max_model_len}); lower max_model_len")
        if self.tokenizer is not None and draft.tokenizer_path is not None:
            if draft.load_tokenizer().get_vocab() != self.tokenizer.get_vocab():
                raise ValueError(f"EngineConfig.speculative_model: the tokenizer of {draft.path} "
                                 f"differs from the target's ({self.checkpoint.path}); a draft "
                                 "must share the target's tokenizer")
        return draft

    def _lend_to_draft(self, name: str) -> torch.Tensor:
        """The target's tensor ``name`` for a draft that borrows it (shared, not copied)."""
        try:
            return self.model.loaded_weight(name)
        except KeyError as exc:
            raise ValueError(f"EngineConfig.speculative_model: the draft borrows {name!r} from "
                             f"the target, which cannot lend it: {exc.args[0]}") from None

    def _set_kv_scales(self, kv_scales) -> bool:
        """Applies the FP8 scales; returns whether they are to be calibrated from the prefill."""
        kv, layers = self.kv_cache, self.checkpoint.config.num_layers
        if not kv.is_fp8:
            return False
        if kv_scales is None:
            kv_scales = self.checkpoint.kv_scales() or "calibrate"
        if kv_scales == "calibrate":
            return True
        try:
            k, v = kv_scales
            k = [float(k)] * layers if isinstance(k, (int, float)) else [float(s) for s in k]
            v = [float(v)] * layers if isinstance(v, (int, float)) else [float(s) for s in v]
        except (TypeError, ValueError):
            raise ValueError(f"EngineConfig.kv_scales must be None, 'calibrate' or (k, v) "
                             f"floats or per-layer lists, got {kv_scales!r}") from None
        kv.set_scales(k, v)
        return False

    # ---- requests -------------------------------------------------------------------------
    def add(self, request: CoreRequest) -> None:
        """Queues a validated request (see :meth:`Engine.add_request`)."""
        p = request.params
        stop_ids = set(p.stop_token_ids or ())
        if not p.ignore_eos:
            stop_ids.update(self.checkpoint.generation.eos_token_ids)
        max_tokens = min(p.max_tokens, self.max_model_len - len(request.prompt_token_ids))
        generator = self._generator(request, 0)      # before anything is queued: it may raise
        seq = self.scheduler.add(request.prompt_token_ids, max_tokens, None, sorted(stop_ids))
        self.requests[request.request_id] = request
        self._attach(request, 0, seq, generator)

    def _generator(self, request: CoreRequest, index: int) -> torch.Generator:
        """Completion ``index``'s generator: from the request's seed, else from the engine's seed
        and the request's arrival number (never from its id, which is the caller's string)."""
        seed = request.params.seed
        g = torch.Generator(device=self.device)
        if seed is None:
            g.manual_seed(mix_seed(self.config.seed, request.number, index))
        else:
            g.manual_seed(mix_seed(seed, index) if index else seed)
        return g

    def _attach(self, request: CoreRequest, index: int, seq: Sequence,
                generator: Optional[torch.Generator] = None) -> None:
        request.seqs.append(seq)
        request.generators.append(generator or self._generator(request, index))
        self._by_seq[seq.seq_id] = (request, index)
        self.kv_budgets.set(seq.seq_id, request.kv_policy)

    def _release(self, seq: Sequence) -> None:
        """Forgets a finished sequence everywhere but in its request."""
        self._by_seq.pop(seq.seq_id, None)
        self.kv_budgets.forget(seq.seq_id)
        if self.speculator is not None:
            self.speculator.forget(seq.seq_id)

    def finish(self, request_id: str, index: int, reason: str) -> None:
        """Ends one completion between steps (a stop string, an abort); frees its blocks."""
        request = self.requests.get(request_id)
        if request is None or index >= len(request.seqs):
            return
        seq = request.seqs[index]
        if seq.status is not SequenceStatus.FINISHED:
            self.scheduler.finish(seq, reason)
        seq.finish_reason = seq.finish_reason or reason
        self._release(seq)
        if request.finished:
            self._retire(request, time.monotonic())

    def abort(self, request_id: str) -> bool:
        """Ends every completion of a request between steps; returns whether it was running."""
        request = self.requests.get(request_id)
        if request is None:
            return False
        for seq in request.seqs:
            if seq.status is not SequenceStatus.FINISHED:
                self.scheduler.finish(seq, "abort")
            self._release(seq)
        self._retire(request, time.monotonic())
        return True

    def _retire(self, request: CoreRequest, now: float) -> None:
        self.requests.pop(request.request_id, None)
        request.finished_time = now
        first_token = request.first_token_time or now
        scheduled = request.first_scheduled_time or now
        self._finished_stats.append(FinishedRequestStats(
            finish_reason=request.seqs[-1].finish_reason or "abort",
            e2e_latency=now - request.arrival_time,
            queue_time=scheduled - request.arrival_time,
            prefill_time=max(first_token - scheduled, 0.0),
            decode_time=max(now - first_token, 0.0) if request.first_token_time else 0.0,
            num_prompt_tokens=len(request.prompt_token_ids),
            num_generation_tokens=sum(len(s.output_token_ids) for s in request.seqs),
            max_tokens=request.params.max_tokens, n=request.params.n))

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # ---- the step -------------------------------------------------------------------------
    def _synchronized(self, start: float) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter() - start

    def _lookup(self, seq_id: int):
        request, index = self._by_seq[seq_id]
        return (request.row, request.generators[index],
                self.block_manager.tables[seq_id].num_evicted)

    def _evict(self, seqs: list[Sequence]) -> None:
        """KV eviction after the step: sequences over their budget drop blocks. A draft cache
        shares the block tables, so it loses the same blocks; only blocks the draft has
        computed too may go (its catch-up never writes into an evicted block)."""
        live = []
        for seq in seqs:
            if seq.status is not SequenceStatus.RUNNING:
                continue
            computed = seq.num_computed_tokens
            if self.speculator is not None and self.speculator.draft_model is not None:
                computed = min(computed, self.speculator.computed_tokens(seq.seq_id))
            live.append((seq.seq_id, computed))
        self.kv_budgets.enforce(self.block_manager, live)

    def step(self) -> list[SeqUpdate]:
        """One scheduler step; returns what each sequence that gained tokens gained."""
        spec, clock = self.speculator, self.clock
        clock.start()
        step_start = time.perf_counter()
        for seq in self.scheduler.running:
            seq.draft_token_ids = []
        if spec is not None:
            spec.plan(self.scheduler.running, self.scheduler.config.max_num_batched_tokens)
            clock.mark("plan_drafts")
        batch = self.scheduler.schedule()
        clock.mark("schedule")
        draft_probs: list[Optional[torch.Tensor]] = [None] * len(batch.seqs)
        if spec is not None:
            draft_probs = spec.draft(batch, self._lookup, self._synchronized)
            clock.mark("draft")
        now = time.monotonic()
        num_prompt_tokens = 0
        for seq, num in zip(batch.seqs, batch.num_scheduled_tokens):
            request, _ = self._by_seq[seq.seq_id]
            if request.first_scheduled_time is None:
                request.first_scheduled_time = now
            num_prompt_tokens += max(0, min(num, seq.num_prompt_tokens
                                            - seq.num_computed_tokens))
        start = time.perf_counter()
        seq_ids = [s.seq_id for s in batch.seqs]
        mass = self.kv_budgets.mass_buffer(self.block_manager, seq_ids, self.device)
        logits = self.runner.execute(batch, attn_mass=mass)
        if mass is not None:
            self.kv_budgets.record(self.block_manager, seq_ids, mass)
        if spec is not None:
            spec.observe_target(self._synchronized(start))
        clock.mark("forward")

        # Logits rows per sequence: none (prefill chunk short of the prompt's end), or 1 + k.
        plain: list[tuple[Sequence, int]] = []          # (sequence, its logits row)
        verify: list[tuple[int, Sequence, int]] = []    # (batch index, sequence, first row)
        row = 0
        for i, seq in enumerate(batch.seqs):
            if seq.num_computed_tokens + batch.num_scheduled_tokens[i] < len(seq.token_ids):
                continue
            k = batch.num_draft_tokens[i]
            (verify.append((i, seq, row)) if k else plain.append((seq, row)))
            row += 1 + k
        assert row == logits.shape[0], "logits rows != 1 + drafts per sampling sequence"

        # Requests with n > 1 fork after their prompt: the children sample from the same row.
        seqs, scheduled, drafts = (list(batch.seqs), list(batch.num_scheduled_tokens),
                                   list(batch.num_draft_tokens))
        forks: list[tuple[int, int]] = []               # (parent, child) seq ids
        for seq, r in list(plain):
            request, index = self._by_seq[seq.seq_id]
            if index == 0 and request.params.n > 1 and not seq.output_token_ids:
                i = batch.seqs.index(seq)
                for child_index in range(1, request.params.n):
                    child = self.scheduler.fork(seq)
                    forks.append((seq.seq_id, child.seq_id))
                    self._attach(request, child_index, child)
                    plain.append((child, r))
                    seqs.append(child)
                    scheduled.append(batch.num_scheduled_tokens[i])
                    drafts.append(0)

        new_tokens: dict[int, list[int]] = {}
        token_rows: dict[int, list[int]] = {}           # logits row of each new token
        if plain:
            owners = [self._by_seq[s.seq_id] for s, _ in plain]
            rows = [r for _, r in plain]
            # Every row, in order (plain decoding): no copy (12 MB of float32 at batch 64).
            selected = (logits if rows == list(range(logits.shape[0]))
                        else logits[torch.tensor(rows, device=logits.device)])
            tokens = sample(selected, [q.row for q, _ in owners],
                            [q.generators[index] for q, index in owners])
            for (s, r), t in zip(plain, tokens):
                new_tokens[s.seq_id], token_rows[s.seq_id] = [t], [r]
        if verify:
            items = []
            for i, seq, first in verify:
                request, index = self._by_seq[seq.seq_id]
                k = batch.num_draft_tokens[i]
                items.append(Verification(logits[first:first + k + 1], seq.draft_token_ids[:k],
                                          draft_probs[i], request.row, request.generators[index]))
            for (i, seq, first), item, out in zip(verify, items, verify_drafts(items)):
                new_tokens[seq.seq_id] = out
                token_rows[seq.seq_id] = list(range(first, first + len(out)))
                spec.record(seq, len(item.drafts), len(out) - 1)
        if spec is not None and spec.reads_target_hidden:
            spec.observe_target_hidden(batch, self.runner.hidden, new_tokens)
            for parent, child in forks:
                spec.fork(parent, child)
        logprobs = self._logprobs(logits, new_tokens, token_rows)
        clock.mark("sample_verify")

        lengths = {s.seq_id: len(s.token_ids) for s in seqs}
        sampled = [new_tokens.get(s.seq_id, []) for s in seqs]
        step = StepBatch(seqs, scheduled, drafts, batch.input_ids, batch.positions,
                         batch.slot_mapping, batch.block_tables, batch.seq_lens,
                         batch.cu_seqlens_q, batch.max_q_len, batch.logits_indices,
                         batch.block_ops, batch.preempted)
        self.scheduler.update(step, sampled)
        self._evict(seqs)
        if spec is not None:
            spec.observe_step(batch, len(verify), sum(map(len, new_tokens.values())),
                              time.perf_counter() - step_start)
        clock.mark("update_evict")
        updates = self._updates(seqs, new_tokens, lengths, logprobs, batch, num_prompt_tokens)
        clock.mark("bookkeeping")
        return updates

    def _logprobs(self, logits: torch.Tensor, new_tokens: dict[int, list[int]],
                  token_rows: dict[int, list[int]]) -> dict[int, list[RawLogprobs]]:
        wanted = [sid for sid in new_tokens
                  if self._by_seq[sid][0].params.logprobs is not None]
        if not wanted:
            return {}
        rows, tokens, nums = [], [], []
        for sid in wanted:
            rows += token_rows[sid]
            tokens += new_tokens[sid]
            nums += [self._by_seq[sid][0].params.logprobs] * len(new_tokens[sid])
        flat = iter(top_logprobs(logits[torch.tensor(rows, device=logits.device)], tokens, nums))
        return {sid: [next(flat) for _ in new_tokens[sid]] for sid in wanted}

    def _updates(self, seqs: list[Sequence], new_tokens: dict[int, list[int]],
                 lengths: dict[int, int], logprobs: dict[int, list[RawLogprobs]],
                 batch: StepBatch, num_prompt_tokens: int) -> list[SeqUpdate]:
        """The step's per-sequence news (tokens the scheduler cut at a stop token or the length
        limit are not news), the requests' timelines and the step's statistics."""
        now = time.monotonic()
        stats = StepStats(num_prompt_tokens=num_prompt_tokens,
                          num_preemptions=len(batch.preempted),
                          spec=self.speculator.step_stats if self.speculator else None)
        updates, done = [], []
        for seq in seqs:
            if seq.seq_id not in new_tokens:
                continue
            request, index = self._by_seq[seq.seq_id]
            new = seq.token_ids[lengths[seq.seq_id]:]
            stats.num_generation_tokens += len(new)
            if request.first_token_time is None:
                request.first_token_time = now
                stats.time_to_first_tokens.append(now - request.arrival_time)
            previous = request.last_token_time.get(index)
            previous, gaps = (now, len(new) - 1) if previous is None else (previous, len(new))
            if gaps > 0:
                stats.inter_token_latencies += [(now - previous) / gaps] * gaps
            request.last_token_time[index] = now
            lp = logprobs.get(seq.seq_id)
            finished = seq.status is SequenceStatus.FINISHED
            stop_reason = seq.token_ids[-1] if finished and seq.finish_reason == "stop" else None
            updates.append(SeqUpdate(request, index, new, lp[:len(new)] if lp else lp,
                                     seq.finish_reason if finished else None, stop_reason))
            if finished:
                self._release(seq)
                if request.finished and request not in done:
                    done.append(request)
        for request in done:
            self._retire(request, now)
        self.last_stats = self.collect_stats(stats)
        return updates

    def collect_stats(self, stats: Optional[StepStats] = None) -> StepStats:
        """``stats`` (or an empty step's) with the queues and KV usage as they are now, and the
        requests that ended since the last collection (aborts and stop strings included)."""
        stats = StepStats() if stats is None else stats
        bm, sched = self.block_manager, self.scheduler
        stats.num_running, stats.num_waiting = len(sched.running), len(sched.waiting)
        stats.num_swapped = len(sched.swapped)
        stats.kv_cache_usage = 1.0 - bm.num_free_blocks / bm.num_blocks
        stats.finished += self._finished_stats
        self._finished_stats = []
        return stats


def _device(device) -> torch.device:
    info = build_info()
    if device is None:
        return torch.device("cuda" if info["cuda_available"] else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        dev = None
    if dev is None or dev.type not in ("cpu", "cuda"):
        raise ValueError(f"EngineConfig.device must be 'cpu' or 'cuda[:i]', got {device!r}")
    if dev.type == "cuda" and not info["cuda_available"]:
        raise ValueError(f"EngineConfig.device {device!r} asked for, but "
                         + ("no CUDA GPU is usable" if "cuda" in info["backends"]
                            else "pagedspec was built without CUDA"))
    return dev


def _dtype(dtype, device: torch.device, checkpoint: Checkpoint) -> torch.dtype:
    cuda = device.type == "cuda"
    if dtype == "auto":
        chosen = checkpoint.default_dtype()
        return torch.bfloat16 if cuda and chosen == torch.float32 else chosen
    chosen = dtype if isinstance(dtype, torch.dtype) else DTYPES.get(dtype)
    if chosen not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"EngineConfig.dtype must be 'auto', 'float32', 'bfloat16', 'float16' "
                         f"or one of those torch dtypes, got {dtype!r}")
    if cuda and chosen == torch.float32:
        raise ValueError("EngineConfig.dtype float32 is not supported on CUDA (the attention "
                         "kernels take float16 / bfloat16 queries); use 'bfloat16'")
    return chosen


def _kv_dtype(kv_cache_dtype: str, dtype: torch.dtype) -> torch.dtype:
    if kv_cache_dtype == "auto":
        return dtype
    if kv_cache_dtype not in KV_DTYPES:
        raise ValueError(f"EngineConfig.kv_cache_dtype must be 'auto', 'fp8_e4m3' or "
                         f"'fp8_e5m2', got {kv_cache_dtype!r}")
    return KV_DTYPES[kv_cache_dtype]
