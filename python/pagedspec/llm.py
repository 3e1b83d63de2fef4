"""The offline API, in the shape of vLLM's: ``LLM``, ``SamplingParams``, ``RequestOutput``.

    from pagedspec import LLM, SamplingParams

    llm = LLM("/path/to/hf-checkpoint", dtype="bfloat16")
    for out in llm.generate(["def fib(n):", "import os"], SamplingParams(max_tokens=32)):
        print(out.prompt, out.outputs[0].text)

One ``LLM`` owns a model, its paged KV cache, a block manager and a scheduler. ``generate`` runs
the given requests to completion by continuous batching: every step the scheduler picks the
tokens (prefill chunks and decodes together), the model runner computes them through
``reshape_and_cache`` and ``paged_attention``, and each request's rows are sampled with its own
generator and settings. ``n > 1`` forks the request's sequence after the prompt (the children
share the prompt's blocks; copy-on-write separates them), and finished requests leave the batch
at once, freeing their blocks.
"""
from __future__ import annotations

import itertools
import math
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Iterator, Optional, Sequence as Seq, Union

import torch

from pagedspec.engine.block_manager import BlockManager
from pagedspec.engine.kv_cache import KVCache
from pagedspec.engine.kv_eviction import KVBudgets, KVEvictionPolicy
from pagedspec.engine.controller import SpecStats, SpeculationController
from pagedspec.engine.runner import ModelRunner
from pagedspec.engine.sampler import SamplingRow, sample, top_logprobs
from pagedspec.engine.scheduler import Scheduler, SchedulerConfig, StepBatch
from pagedspec.engine.sequence import Sequence, SequenceStatus
from pagedspec.engine.speculative import (DraftModelProposer, DraftRequest, NgramProposer,
                                          Verification, verify_drafts)
from pagedspec.models.loader import DTYPES, Checkpoint, load_checkpoint

_KV_DTYPES = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn,
              "fp8_e5m2": torch.float8_e5m2}


@dataclass
class SamplingParams:
    """How to sample one request (vLLM's names and defaults).

    Args:
        temperature: >= 0; 0 is greedy decoding.
        top_k: keep the k most likely tokens (-1: all). top_p: keep the smallest set of most
            likely tokens holding this much mass, in (0, 1]. min_p: drop tokens less likely than
            ``min_p`` times the most likely one, in [0, 1].
        max_tokens: tokens to generate at most (>= 1; also capped by ``max_model_len``).
        stop_token_ids: tokens that end the completion (kept in ``token_ids``), besides the
            checkpoint's eos tokens unless ``ignore_eos``.
        stop: strings that end the completion; the text is cut before the stop string.
        seed: makes the request's samples reproducible whatever else is in the batch.
        n: completions to sample for the prompt.
        logprobs: return the top-``logprobs`` tokens' logprobs for every generated token.
        kv_eviction, kv_budget, kv_sink_tokens, kv_recent_tokens: this request's KV eviction
            policy, each None for the ``LLM``'s (see :class:`LLM` and
            :mod:`pagedspec.engine.kv_eviction`).
    """
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    min_p: float = 0.0
    max_tokens: int = 16
    stop_token_ids: Optional[list[int]] = None
    stop: Optional[Union[str, list[str]]] = None
    ignore_eos: bool = False
    seed: Optional[int] = None
    n: int = 1
    logprobs: Optional[int] = None
    kv_eviction: Optional[str] = None
    kv_budget: Optional[int] = None
    kv_sink_tokens: Optional[int] = None
    kv_recent_tokens: Optional[int] = None

    def validate(self, vocab_size: int) -> None:
        """Raises ValueError naming the first parameter out of range."""
        def bad(name: str, expected: str) -> ValueError:
            return ValueError(f"SamplingParams.{name} must be {expected}, got "
                              f"{getattr(self, name)!r}")

        if not (isinstance(self.temperature, (int, float)) and self.temperature >= 0
                and math.isfinite(self.temperature)):
            raise bad("temperature", "a finite number >= 0")
        if not isinstance(self.top_k, int) or not (self.top_k == -1 or self.top_k >= 1):
            raise bad("top_k", "-1 (off) or an int >= 1")
        if not (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1):
            raise bad("top_p", "in (0, 1]")
        if not (isinstance(self.min_p, (int, float)) and 0 <= self.min_p <= 1):
            raise bad("min_p", "in [0, 1]")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise bad("max_tokens", "an int >= 1")
        if not isinstance(self.n, int) or self.n < 1:
            raise bad("n", "an int >= 1")
        if self.logprobs is not None and not (isinstance(self.logprobs, int)
                                              and 0 <= self.logprobs <= vocab_size):
            raise bad("logprobs", f"None or an int in [0, {vocab_size}]")
        if self.seed is not None and not isinstance(self.seed, int):
            raise bad("seed", "None or an int")
        if any(not isinstance(t, int) or not 0 <= t < vocab_size
               for t in self.stop_token_ids or ()):
            raise bad("stop_token_ids", f"token ids in [0, {vocab_size})")
        if any(not isinstance(s, str) or not s for s in self.stop_strings):
            raise bad("stop", "a non-empty string or a list of them")

    @property
    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def row(self) -> SamplingRow:
        return SamplingRow(float(self.temperature), self.top_k, float(self.top_p),
                           float(self.min_p))


@dataclass
class Logprob:
    logprob: float
    rank: int                                # 1 = the most likely token
    decoded_token: Optional[str] = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: Optional[float]
    logprobs: Optional[list[dict[int, Logprob]]]   # per generated token: the top-n and the token
    finish_reason: Optional[str] = None             # "stop", "length" or None (unfinished)
    stop_reason: Union[int, str, None] = None       # the stop token or string that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_token_time: Optional[float] = None
    finished_time: Optional[float] = None

    @property
    def time_to_first_token(self) -> Optional[float]:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time


@dataclass
class RequestOutput:
    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    num_cached_tokens: int = 0                 # prompt tokens served by the prefix cache

    @property
    def time_per_output_token(self) -> Optional[float]:
        """Mean seconds between output tokens after the first, over all completions."""
        m = self.metrics
        extra = sum(len(o.token_ids) for o in self.outputs) - len(self.outputs)
        if m.first_token_time is None or m.finished_time is None or extra <= 0:
            return None
        return (m.finished_time - m.first_token_time) * len(self.outputs) / extra


class IncrementalDetokenizer:
    """Text of a growing list of token ids, decoded a few tokens at a time.

    Each new token is decoded together with the tokens since the last emitted text (plus a few
    tokens of context, so that tokenizers whose pieces carry leading spaces decode them right),
    and text is emitted once it no longer ends in an incomplete UTF-8 sequence. O(1) per token.
    """

    def __init__(self, tokenizer, prompt_token_ids: Seq[int], context: int = 6):
        self.tokenizer = tokenizer
        self.ids = list(prompt_token_ids[-context:])
        self.prefix_offset, self.read_offset = 0, len(self.ids)
        self.text = ""

    def _decode(self, ids: Seq[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def add(self, token: int) -> str:
        """Appends a token; returns the text it completed ("" while a character is partial)."""
        self.ids.append(token)
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            delta = full[len(prefix):]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            self.text += delta
            return delta
        return ""

    def flush(self) -> str:
        """The text of tokens still held back (an incomplete character at the very end)."""
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        delta = full[len(prefix):]
        self.prefix_offset = self.read_offset = len(self.ids)
        self.text += delta
        return delta


@dataclass(eq=False)
class _Completion:
    """One sequence of a request, with what the API reports about it."""
    index: int
    seq: Sequence
    generator: torch.Generator
    detok: Optional[IncrementalDetokenizer]
    logprobs: Optional[list[dict[int, Logprob]]] = None
    stop_reason: Union[int, str, None] = None
    finish_reason: Optional[str] = None
    num_detokenized: int = 0                 # output tokens fed to ``detok`` so far
    stop_checked: int = 0                    # characters of text searched for stop strings


@dataclass(eq=False)
class _Request:
    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    params: SamplingParams
    row: SamplingRow
    metrics: RequestMetrics
    completions: list[_Completion] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return (len(self.completions) == self.params.n
                and all(c.finish_reason is not None for c in self.completions))


@dataclass(eq=False)
class _Speculation:
    """The speculative half of an LLM: one drafter, the controller and the metrics."""
    controller: SpeculationController
    ngram: Optional[NgramProposer] = None
    draft: Optional[DraftModelProposer] = None
    stats: SpecStats = field(default_factory=SpecStats)

    def forget(self, seq_id: int) -> None:
        for part in (self.ngram, self.draft, self.controller):
            if part is not None:
                part.forget(seq_id)


def _mix_seed(*parts: int) -> int:
    """A 63-bit seed from integers (splitmix64 steps), so derived generators are unrelated."""
    x = 0
    for p in parts:
        x = (x + (p & 0xFFFFFFFFFFFFFFFF) + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
        x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
        x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
        x ^= x >> 31
    return x & 0x7FFFFFFFFFFFFFFF


class LLM:
    """A model served from a local checkpoint directory, with a paged KV cache.

    Args:
        model: a Hugging Face checkpoint directory (``config.json``, safetensors weights,
            ``tokenizer.json``), or the name of a checkpoint shipped with pagedspec.
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

    def __init__(self, model: Union[str, os.PathLike], *, dtype: Union[str, torch.dtype] = "auto",
                 device: Union[str, torch.device, None] = None, kv_cache_dtype: str = "auto",
                 kv_scales=None, block_size: int = 16, kv_cache_memory: Optional[int] = None,
                 num_kv_blocks: Optional[int] = None, max_num_seqs: int = 256,
                 max_num_batched_tokens: Optional[int] = None,
                 max_model_len: Optional[int] = None, enable_prefix_caching: bool = True,
                 swap_space: float = 0.0, preemption_mode: str = "auto", seed: int = 0,
                 skip_tokenizer_init: bool = False,
                 speculative_model: Union[str, os.PathLike, None] = None,
                 num_speculative_tokens: int = 4, speculative_adaptive: bool = True,
                 prompt_lookup_max: int = 3, prompt_lookup_min: int = 1,
                 kv_eviction: str = "none", kv_budget: Optional[int] = None,
                 kv_sink_tokens: int = 4, kv_recent_tokens: Optional[int] = None):
        self.checkpoint: Checkpoint = load_checkpoint(model)
        cfg = self.checkpoint.config
        self.device = self._device(device)
        self.dtype = self._dtype(dtype)
        cache_dtype = self._kv_dtype(kv_cache_dtype)
        if block_size not in (8, 16, 32, 64):
            raise ValueError(f"LLM: block_size must be 8, 16, 32 or 64, got {block_size}")
        self.kv_policy = KVEvictionPolicy(kv_eviction, kv_budget, kv_sink_tokens,
                                          kv_recent_tokens)
        self.kv_policy.check(block_size, "LLM: kv_budget")
        if max_model_len is None:
            max_model_len = cfg.max_position
        if not isinstance(max_model_len, int) or not 2 <= max_model_len <= cfg.max_position:
            raise ValueError(f"LLM: max_model_len must be in [2, {cfg.max_position}] (the "
                             f"checkpoint's max_position_embeddings), got {max_model_len}")
        if cfg.sliding_window is not None and cfg.sliding_window < max_model_len:
            raise ValueError(f"LLM: {self.checkpoint.path / 'config.json'} asks for a sliding "
                             f"window of {cfg.sliding_window} tokens, which pagedspec does not "
                             f"implement; pass max_model_len <= {cfg.sliding_window} (attention "
                             "is then the same) or use a checkpoint without one")
        if not isinstance(max_num_seqs, int) or max_num_seqs < 1:
            raise ValueError(f"LLM: max_num_seqs must be an int >= 1, got {max_num_seqs}")
        self.max_model_len = max_model_len
        self.tokenizer = None if skip_tokenizer_init else self.checkpoint.load_tokenizer()
        draft_ckpt = self._draft_checkpoint(speculative_model, num_speculative_tokens)
        self.model = self.checkpoint.load_model(self.dtype, self.device)

        bytes_per_block = sum(
            KVCache.bytes_per_block(c.num_layers, block_size, c.num_kv_heads, c.head_size,
                                    cache_dtype)
            for c in [cfg] + ([draft_ckpt.config] if draft_ckpt is not None else []))
        if num_kv_blocks is None:
            if kv_cache_memory is None:
                wanted = max_num_seqs * -(-max_model_len // block_size)
                num_kv_blocks = max(1, min(wanted, (1 << 30) // bytes_per_block))
            else:
                num_kv_blocks = int(kv_cache_memory) // bytes_per_block
        if num_kv_blocks < 1:
            raise ValueError(f"LLM: the KV cache holds no block ({kv_cache_memory} bytes, "
                             f"{bytes_per_block} bytes per block)")
        num_cpu_blocks = int(swap_space * (1 << 30)) // bytes_per_block
        self.kv_cache = KVCache(cfg.num_layers, num_kv_blocks, block_size, cfg.num_kv_heads,
                                cfg.head_size, cache_dtype, self.device, num_cpu_blocks)
        calibrate = self._set_kv_scales(kv_scales)
        self.block_manager = BlockManager(num_kv_blocks, block_size, num_cpu_blocks,
                                          enable_prefix_caching=enable_prefix_caching)
        budget = max_num_batched_tokens or max(2048, max_num_seqs + 256)
        self.scheduler = Scheduler(SchedulerConfig(max_num_seqs=max_num_seqs,
                                                   max_num_batched_tokens=budget,
                                                   preemption_mode=preemption_mode),
                                   self.block_manager)
        self.runner = ModelRunner(self.model, self.kv_cache, calibrate_fp8=calibrate)
        self.speculation: Optional[_Speculation] = None
        if speculative_model is not None:
            controller = SpeculationController(num_speculative_tokens, speculative_adaptive)
            if draft_ckpt is None:
                self.speculation = _Speculation(controller, ngram=NgramProposer(
                    prompt_lookup_max, prompt_lookup_min))
            else:
                dc = draft_ckpt.config
                self.draft_model = draft_ckpt.load_model(self.dtype, self.device)
                draft_cache = KVCache(dc.num_layers, num_kv_blocks, block_size, dc.num_kv_heads,
                                      dc.head_size, cache_dtype, self.device, num_cpu_blocks)
                scales = draft_ckpt.kv_scales() if draft_cache.is_fp8 else None
                if scales is not None:
                    draft_cache.set_scales(*scales)
                self.speculation = _Speculation(controller, draft=DraftModelProposer(
                    self.draft_model, draft_cache, calibrate_fp8=draft_cache.is_fp8
                    and scales is None))
        self.kv_budgets = KVBudgets(seed=seed)
        self.seed = seed
        self.eos_token_ids = self.checkpoint.generation.eos_token_ids
        self._request_ids = itertools.count()
        self._by_seq: dict[int, tuple[_Request, _Completion]] = {}

    # ---- construction helpers ---------------------------------------------------------------
    def _draft_checkpoint(self, speculative_model, k: int) -> Optional[Checkpoint]:
        """The draft checkpoint (None for n-gram drafting or none), its vocabulary checked."""
        if speculative_model is None:
            return None
        if not isinstance(k, int) or not 1 <= k <= 16:
            raise ValueError(f"LLM: num_speculative_tokens must be an int in [1, 16], got {k!r}")
        if speculative_model == "ngram":
            return None
        draft = load_checkpoint(speculative_model)
        target_vocab, draft_vocab = self.checkpoint.config.vocab_size, draft.config.vocab_size
        if draft_vocab != target_vocab:
            raise ValueError(f"LLM: the speculative model {draft.path} has a vocabulary of "
                             f"{draft_vocab} tokens, the target {target_vocab}; a draft must "
                             "share the target's tokenizer")
        if draft.config.max_position < self.max_model_len:
            raise ValueError(f"LLM: the speculative model {draft.path} covers "
                             f"{draft.config.max_position} positions, fewer than max_model_len "
                             f"({self.max_model_len}); lower max_model_len")
        if self.tokenizer is not None and draft.tokenizer_path is not None:
            if draft.load_tokenizer().get_vocab() != self.tokenizer.get_vocab():
                raise ValueError(f"LLM: the tokenizer of the speculative model {draft.path} "
                                 f"differs from the target's ({self.checkpoint.path}); a draft "
                                 "must share the target's tokenizer")
        return draft

    def speculative_metrics(self) -> Optional[dict]:
        """vLLM's speculative-decoding metrics over this LLM's life (None without
        speculation): drafts, draft tokens, accepted tokens (in all and per position),
        acceptance rate, mean acceptance length, draft and target seconds per step."""
        return self.speculation.stats.as_dict() if self.speculation is not None else None

    @staticmethod
    def _device(device) -> torch.device:
        if device is None:
            import pagedspec
            return torch.device("cuda" if pagedspec.build_info()["cuda_available"] else "cpu")
        try:
            dev = torch.device(device)
        except (RuntimeError, TypeError):
            dev = None
        if dev is None or dev.type not in ("cpu", "cuda"):
            raise ValueError(f"LLM: device must be 'cpu' or 'cuda[:i]', got {device!r}")
        if dev.type == "cuda":
            import pagedspec
            if not pagedspec.build_info()["cuda_available"]:
                raise ValueError(f"LLM: device {device!r} asked for, but "
                                 + ("no CUDA GPU is usable" if "cuda" in pagedspec.build_info()
                                    ["backends"] else "pagedspec was built without CUDA"))
        return dev

    def _dtype(self, dtype) -> torch.dtype:
        cuda = self.device.type == "cuda"
        if dtype == "auto":
            chosen = self.checkpoint.default_dtype()
            return torch.bfloat16 if cuda and chosen == torch.float32 else chosen
        chosen = dtype if isinstance(dtype, torch.dtype) else DTYPES.get(dtype)
        if chosen not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"LLM: dtype must be 'auto', 'float32', 'bfloat16', 'float16' or "
                             f"one of those torch dtypes, got {dtype!r}")
        if cuda and chosen == torch.float32:
            raise ValueError("LLM: dtype float32 is not supported on CUDA (the attention "
                             "kernels take float16 / bfloat16 queries); use 'bfloat16'")
        return chosen

    def _kv_dtype(self, kv_cache_dtype: str) -> torch.dtype:
        if kv_cache_dtype == "auto":
            return self.dtype
        if kv_cache_dtype not in _KV_DTYPES:
            raise ValueError(f"LLM: kv_cache_dtype must be 'auto', 'fp8_e4m3' or 'fp8_e5m2', "
                             f"got {kv_cache_dtype!r}")
        return _KV_DTYPES[kv_cache_dtype]

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
            raise ValueError(f"LLM: kv_scales must be None, 'calibrate' or (k, v) floats or "
                             f"per-layer lists, got {kv_scales!r}") from None
        kv.set_scales(k, v)
        return False

    # ---- requests -----------------------------------------------------------------------------
    def _tokenize(self, prompt) -> tuple[Optional[str], list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("LLM.generate: text prompts need a tokenizer (this LLM was made "
                                 "with skip_tokenizer_init=True); pass token ids")
            return prompt, self.tokenizer.encode(prompt).ids
        ids = list(prompt)
        V = self.model.vocab_size
        if not all(isinstance(t, int) and 0 <= t < V for t in ids):
            raise ValueError(f"LLM.generate: a token-id prompt must hold ints in [0, {V})")
        return None, ids

    def _make_requests(self, prompts, sampling_params) -> list[_Request]:
        """Validates everything before anything is queued, so one bad request loses nothing."""
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
        bm = self.block_manager
        pool = bm.num_blocks * bm.block_size
        requests = []
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            if not isinstance(p, SamplingParams):
                raise ValueError(f"LLM.generate: sampling_params[{i}] is a {type(p).__name__}, "
                                 "expected SamplingParams")
            p.validate(self.model.vocab_size)
            self._kv_policy(p).check(bm.block_size, f"LLM.generate: request {i}'s kv_budget")
            text, ids = self._tokenize(prompt)
            if not ids:
                raise ValueError(f"LLM.generate: prompt {i} is empty")
            if len(ids) >= self.max_model_len:
                raise ValueError(f"LLM.generate: prompt {i} has {len(ids)} tokens; max_model_len "
                                 f"is {self.max_model_len}, which must leave room for at least "
                                 "one generated token")
            need = min(len(ids) + p.max_tokens, self.max_model_len)
            if need > pool:
                raise ValueError(f"LLM.generate: prompt {i} needs {need} KV slots (prompt plus "
                                 f"max_tokens), but the KV cache holds {pool} "
                                 f"({bm.num_blocks} blocks of {bm.block_size}); raise "
                                 "kv_cache_memory or num_kv_blocks")
            requests.append(_Request(str(next(self._request_ids)), text, ids, p, p.row,
                                     RequestMetrics(time.monotonic())))
        return requests

    def _kv_policy(self, p: SamplingParams) -> KVEvictionPolicy:
        d = self.kv_policy
        pick = lambda mine, default: default if mine is None else mine  # noqa: E731
        mode = pick(p.kv_eviction, d.mode)
        return KVEvictionPolicy(mode, pick(p.kv_budget, d.budget),
                                pick(p.kv_sink_tokens, d.sink_tokens),
                                pick(p.kv_recent_tokens, d.recent_tokens))

    def _generator(self, request: _Request, index: int) -> torch.Generator:
        seed = request.params.seed
        g = torch.Generator(device=self.device)
        if seed is None:
            g.manual_seed(_mix_seed(self.seed, int(request.request_id), index))
        else:
            g.manual_seed(_mix_seed(seed, index) if index else seed)
        return g

    def _completion(self, request: _Request, index: int, seq: Sequence) -> _Completion:
        detok = (IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids)
                 if self.tokenizer is not None else None)
        c = _Completion(index, seq, self._generator(request, index), detok,
                        [] if request.params.logprobs is not None else None)
        request.completions.append(c)
        self._by_seq[seq.seq_id] = (request, c)
        self.kv_budgets.set(seq.seq_id, self._kv_policy(request.params))
        return c

    def _submit(self, request: _Request) -> None:
        p = request.params
        stop_ids = set(p.stop_token_ids or ())
        if not p.ignore_eos:
            stop_ids.update(self.eos_token_ids)
        max_tokens = min(p.max_tokens, self.max_model_len - len(request.prompt_token_ids))
        seq = self.scheduler.add(request.prompt_token_ids, max_tokens, None, sorted(stop_ids))
        self._completion(request, 0, seq)

    # ---- the step loop ------------------------------------------------------------------------
    def _plan_drafts(self) -> int:
        """Before scheduling: the step's k from the controller, and each decoding sequence's
        drafts (n-gram proposals, or placeholders the draft model fills in after scheduling,
        once the scheduler has given the draft positions their slots)."""
        running = self.scheduler.running
        for seq in running:
            seq.draft_token_ids = []
        spec = self.speculation
        if spec is None:
            return 0
        decoding = [s for s in running if s.is_decoding]
        room = [s.num_prompt_tokens + s.max_tokens - len(s.token_ids) - 1 for s in decoding]
        prefill = sum(len(s.token_ids) - s.num_computed_tokens for s in running
                      if not s.is_decoding)
        other = min(prefill, self.scheduler.config.max_num_batched_tokens - len(decoding))
        k = spec.controller.choose([s.seq_id for s in decoding], room, max(other, 0))
        if spec.ngram is not None:        # index new tokens outside the timed proposal
            for seq in decoding:
                spec.ngram.update(seq.seq_id, seq.token_ids)
        limit = spec.controller.draft_limit
        if k and limit is not None and limit < len(decoding):
            first = spec.controller.steps * limit % len(decoding)     # rotate who learns
            chosen = set(range(first, first + limit)) | set(range(first + limit - len(decoding)))
            room = [r if i in chosen else 0 for i, r in enumerate(room)]
        if k:
            start = time.perf_counter()
            for seq, r in zip(decoding, room):
                kr = min(k, r)
                if kr > 0:
                    seq.draft_token_ids = (spec.ngram.propose(seq.seq_id, seq.token_ids, kr)
                                           if spec.ngram is not None else [0] * kr)
            if spec.ngram is not None:              # the model drafter is timed when it runs
                seconds = time.perf_counter() - start
                spec.controller.observe_draft(len(decoding), seconds)
                spec.stats.draft_seconds += seconds
        return k

    def _draft(self, batch: StepBatch) -> list[Optional[torch.Tensor]]:
        """Runs the draft model for the batch's drafting sequences and writes its tokens into the
        batch; returns each sequence's draft distributions (None where none)."""
        spec = self.speculation
        draft_probs: list[Optional[torch.Tensor]] = [None] * len(batch.seqs)
        requests = []
        for i, seq in enumerate(batch.seqs):
            k = batch.num_draft_tokens[i]
            if k:
                request, c = self._by_seq[seq.seq_id]
                requests.append(DraftRequest(
                    i, seq.seq_id, seq.token_ids, seq.num_computed_tokens, k, request.row,
                    c.generator, self.block_manager.tables[seq.seq_id].num_evicted))
        if not requests:
            return draft_probs
        start = time.perf_counter()
        drafts, probs = spec.draft.propose(batch, requests)
        cu = batch.cu_seqlens_q.tolist()
        ids = batch.input_ids
        for r, tokens, p in zip(requests, drafts, probs):
            first = cu[r.batch_index] + 1          # the drafts follow the last verified token
            ids[first:first + r.k] = torch.tensor(tokens, dtype=ids.dtype, device=ids.device)
            batch.seqs[r.batch_index].draft_token_ids = tokens
            draft_probs[r.batch_index] = p
        total = self._synchronized(start)
        spec.stats.draft_seconds += total
        self._step_draft_seconds = total
        # The controller learns the cost of a drafting pass (one token per sequence), with the
        # Python bookkeeping around the passes spread over them; the first pass also catches
        # the draft cache up, which costs more the first time (the prompt): it is left out then.
        passes = spec.draft.pass_times
        extra = (total - sum(t for _, _, t in passes)) / len(passes)
        for num_seqs, num_tokens, seconds in passes:
            if num_tokens <= 2 * num_seqs:
                spec.controller.observe_draft(num_seqs, seconds + extra)
        return draft_probs

    def _evict(self, seqs: Seq[Sequence]) -> None:
        """KV eviction after the step: sequences over their budget drop blocks. A draft cache
        shares the block tables, so it loses the same blocks; only blocks the draft has
        computed too may go (its catch-up never writes into an evicted block)."""
        draft = self.speculation.draft if self.speculation is not None else None
        live = []
        for seq in seqs:
            if seq.status is not SequenceStatus.RUNNING:
                continue
            computed = seq.num_computed_tokens
            if draft is not None:
                computed = min(computed, draft.computed_tokens(seq.seq_id))
            live.append((seq.seq_id, computed))
        self.kv_budgets.enforce(self.block_manager, live)

    def _synchronized(self, start: float) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter() - start

    def _step(self) -> list[_Request]:
        """One scheduler step; returns the requests it finished."""
        spec = self.speculation
        step_start = time.perf_counter()
        self._step_draft_seconds = 0.0
        self._plan_drafts()
        batch = self.scheduler.schedule()
        draft_probs: list[Optional[torch.Tensor]] = [None] * len(batch.seqs)
        if spec is not None and spec.draft is not None:
            spec.draft.apply_moves(batch.block_ops)   # both caches make the same block moves
            draft_probs = self._draft(batch)
        start = time.perf_counter()
        seq_ids = [s.seq_id for s in batch.seqs]
        mass = self.kv_budgets.mass_buffer(self.block_manager, seq_ids, self.device)
        logits = self.runner.execute(batch, attn_mass=mass)
        if mass is not None:
            self.kv_budgets.record(self.block_manager, seq_ids, mass)
        if spec is not None:
            spec.stats.target_seconds += self._synchronized(start)
            spec.stats.num_steps += 1

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
        for seq, r in list(plain):
            request, c = self._by_seq[seq.seq_id]
            if c.index == 0 and request.params.n > 1 and not seq.output_token_ids:
                i = batch.seqs.index(seq)
                for index in range(1, request.params.n):
                    child = self.scheduler.fork(seq)
                    self._completion(request, index, child)
                    plain.append((child, r))
                    seqs.append(child)
                    scheduled.append(batch.num_scheduled_tokens[i])
                    drafts.append(0)

        new_tokens: dict[int, list[int]] = {}
        token_rows: dict[int, list[int]] = {}           # logits row of each new token
        if plain:
            owners = [self._by_seq[s.seq_id] for s, _ in plain]
            rows = torch.tensor([r for _, r in plain], device=logits.device)
            tokens = sample(logits[rows], [q.row for q, _ in owners],
                            [c.generator for _, c in owners])
            for (s, r), t in zip(plain, tokens):
                new_tokens[s.seq_id], token_rows[s.seq_id] = [t], [r]
        if verify:
            items = []
            for i, seq, first in verify:
                request, c = self._by_seq[seq.seq_id]
                k = batch.num_draft_tokens[i]
                items.append(Verification(logits[first:first + k + 1], seq.draft_token_ids[:k],
                                          draft_probs[i], request.row, c.generator))
            for (i, seq, first), item, out in zip(verify, items, verify_drafts(items)):
                new_tokens[seq.seq_id] = out
                token_rows[seq.seq_id] = list(range(first, first + len(out)))
                self._record_acceptance(seq, len(item.drafts), len(out) - 1)
        self._record_logprobs(logits, new_tokens, token_rows)

        sampled = [new_tokens.get(s.seq_id, []) for s in seqs]
        step = StepBatch(seqs, scheduled, drafts, batch.input_ids, batch.positions,
                         batch.slot_mapping, batch.block_tables, batch.seq_lens,
                         batch.cu_seqlens_q, batch.max_q_len, batch.logits_indices,
                         batch.block_ops, batch.preempted)
        self.scheduler.update(step, sampled)
        self._evict(seqs)
        if spec is not None:
            # What the controller weighs: the whole step but the drafting (scheduling,
            # verification, sampling and bookkeeping included), by tokens in the step.
            elapsed = time.perf_counter() - step_start
            spec.controller.observe_target(batch.num_tokens, elapsed - self._step_draft_seconds)
            decode_only = batch.seqs and all(
                batch.num_scheduled_tokens[i] == 1 + batch.num_draft_tokens[i]
                for i in range(len(batch.seqs)))
            # All drafted, or none; a draft model's catch-up after a pause is a one-off cost.
            catch_up = spec.draft is not None and verify and any(
                tokens > 2 * seqs for seqs, tokens, _ in spec.draft.pass_times)
            if decode_only and len(verify) in (0, len(batch.seqs)) and not catch_up:
                spec.controller.observe_goodput(len(batch.seqs), bool(verify),
                                                sum(map(len, new_tokens.values())), elapsed)
        now = time.monotonic()
        done = []
        for seq in seqs:
            if seq.seq_id not in new_tokens:
                continue
            request, c = self._by_seq[seq.seq_id]
            if request.metrics.first_token_time is None:
                request.metrics.first_token_time = now
            self._after_token(c)
            if c.finish_reason is not None and request.finished and request not in done:
                request.metrics.finished_time = now
                done.append(request)
        return done

    def _record_acceptance(self, seq: Sequence, k: int, accepted: int) -> None:
        spec = self.speculation
        st = spec.stats
        st.num_drafts += 1
        st.num_draft_tokens += k
        st.num_accepted_tokens += accepted
        while len(st.drafted_per_position) < k:
            st.drafted_per_position.append(0)
            st.accepted_per_position.append(0)
        for j in range(k):
            st.drafted_per_position[j] += 1
            st.accepted_per_position[j] += j < accepted
        spec.controller.observe_acceptance(seq.seq_id, k, accepted)
        if spec.draft is not None:
            spec.draft.on_verified(seq.seq_id, len(seq.token_ids), k, accepted)

    def _record_logprobs(self, logits: torch.Tensor, new_tokens: dict[int, list[int]],
                         token_rows: dict[int, list[int]]) -> None:
        wanted = [(sid, self._by_seq[sid]) for sid in new_tokens
                  if self._by_seq[sid][0].params.logprobs is not None]
        if not wanted:
            return
        rows, tokens, nums = [], [], []
        for sid, (request, _) in wanted:
            rows += token_rows[sid]
            tokens += new_tokens[sid]
            nums += [request.params.logprobs] * len(new_tokens[sid])
        lp = iter(top_logprobs(logits[torch.tensor(rows, device=logits.device)], tokens, nums))
        for sid, (_, c) in wanted:
            for token in new_tokens[sid]:
                chosen_lp, rank, pairs = next(lp)
                entry = {t: Logprob(v, n + 1, self._piece(t)) for n, (t, v) in enumerate(pairs)}
                entry.setdefault(token, Logprob(chosen_lp, rank, self._piece(token)))
                c.logprobs.append(entry)

    def _piece(self, token: int) -> Optional[str]:
        return self.tokenizer.decode([token]) if self.tokenizer is not None else None

    def _after_token(self, c: _Completion) -> None:
        """Detokenizes what the sequence gained, applies stop strings, records how it ended."""
        seq, params = c.seq, self._by_seq[c.seq.seq_id][0].params
        out = seq.output_token_ids
        if c.logprobs is not None and len(c.logprobs) > len(out):
            del c.logprobs[len(out):]            # cut by the scheduler's length / eos rule
        if c.detok is not None:
            for token in out[c.num_detokenized:]:
                c.detok.add(token)
            c.num_detokenized = len(out)
            stops = params.stop_strings
            if stops:
                # Text before this step held no stop string, so a hit overlaps the new text:
                # search only where it can start (not the whole text every token).
                text, seen = c.detok.text, c.stop_checked
                hits = [(pos, s) for s in stops
                        if (pos := text.find(s, max(0, seen - len(s) + 1))) >= 0]
                c.stop_checked = len(text)
                if hits:
                    pos, s = min(hits)
                    c.detok.text = text[:pos]
                    c.stop_reason = s
                    if seq.status is not SequenceStatus.FINISHED:
                        self.scheduler.finish(seq, "stop")
                    seq.finish_reason = "stop"
        if seq.status is SequenceStatus.FINISHED and c.finish_reason is None:
            if c.detok is not None and c.stop_reason is None:
                c.detok.flush()
            c.finish_reason = seq.finish_reason
            if c.stop_reason is None and seq.finish_reason == "stop" and out:
                c.stop_reason = out[-1]
            del self._by_seq[seq.seq_id]
            self.kv_budgets.forget(seq.seq_id)
            if self.speculation is not None:
                self.speculation.forget(seq.seq_id)

    def _output(self, request: _Request) -> RequestOutput:
        outs = []
        for c in sorted(request.completions, key=lambda c: c.index):
            text = c.detok.text if c.detok is not None else ""
            tokens = list(c.seq.output_token_ids)
            cumulative = (sum(entry[t].logprob for entry, t in zip(c.logprobs, tokens))
                          if c.logprobs is not None else None)
            outs.append(CompletionOutput(c.index, text, tokens, cumulative, c.logprobs,
                                         c.finish_reason, c.stop_reason))
        return RequestOutput(request.request_id, request.prompt, request.prompt_token_ids, outs,
                             request.finished, request.metrics,
                             request.completions[0].seq.num_cached_tokens)

    def _run(self, requests: list[_Request]) -> Iterator[_Request]:
        """Queues the (validated) requests and steps until they are done, yielding each as it
        finishes; requests left when the caller stops early are aborted and freed."""
        for request in requests:
            self._submit(request)
        remaining = len(requests)
        try:
            while remaining:
                for request in self._step():
                    remaining -= 1
                    yield request
        finally:
            if remaining:
                for request in requests:
                    for c in request.completions:
                        if c.seq.status is not SequenceStatus.FINISHED:
                            self.scheduler.finish(c.seq, "abort")
                        self._by_seq.pop(c.seq.seq_id, None)

    def generate_iter(self, prompts, sampling_params=None) -> Iterator[RequestOutput]:
        """Like :meth:`generate`, but yields each request's output as soon as it finishes
        (completion order, not prompt order). Parameters are validated before the first step."""
        requests = self._make_requests(prompts, sampling_params)
        return (self._output(r) for r in self._run(requests))

    def generate(self, prompts, sampling_params=None, use_tqdm: bool = True
                 ) -> list[RequestOutput]:
        """Runs the prompts to completion; one :class:`RequestOutput` per prompt, in prompt order.

        ``prompts``: a string, a list of strings, or a list of token-id lists (one token-id list
        is one prompt). ``sampling_params``: one :class:`SamplingParams` for all, or one per
        prompt (default: ``SamplingParams()``). Bad parameters raise ValueError before any work.
        """
        requests = self._make_requests(prompts, sampling_params)
        bar = None
        if use_tqdm and len(requests) > 1:
            try:
                from tqdm.auto import tqdm
                bar = tqdm(total=len(requests), desc="Processed prompts", file=sys.stderr,
                           dynamic_ncols=True)
            except ImportError:
                pass
        for _ in self._run(requests):
            if bar is not None:
                bar.update(1)
        if bar is not None:
            bar.close()
        return [self._output(r) for r in requests]
