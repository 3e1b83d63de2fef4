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

from pagedspec.engine.blocks import BlockManager, KVCache
from pagedspec.engine.runner import ModelRunner
from pagedspec.engine.sampler import SamplingRow, sample, top_logprobs
from pagedspec.engine.scheduler import Scheduler, SchedulerConfig, StepBatch
from pagedspec.engine.sequence import Sequence, SequenceStatus
from pagedspec.models.loader import Checkpoint, load_checkpoint

_DTYPES = {"float32": torch.float32, "float": torch.float32, "bfloat16": torch.bfloat16,
           "float16": torch.float16, "half": torch.float16}
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
    cumulative_logprob: float = 0.0
    stop_reason: Union[int, str, None] = None
    finish_reason: Optional[str] = None
    num_detokenized: int = 0                 # output tokens fed to ``detok`` so far


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
    """

    def __init__(self, model: Union[str, os.PathLike], *, dtype: Union[str, torch.dtype] = "auto",
                 device: Union[str, torch.device, None] = None, kv_cache_dtype: str = "auto",
                 kv_scales=None, block_size: int = 16, kv_cache_memory: Optional[int] = None,
                 num_kv_blocks: Optional[int] = None, max_num_seqs: int = 256,
                 max_num_batched_tokens: Optional[int] = None,
                 max_model_len: Optional[int] = None, enable_prefix_caching: bool = True,
                 swap_space: float = 0.0, preemption_mode: str = "auto", seed: int = 0,
                 skip_tokenizer_init: bool = False):
        self.checkpoint: Checkpoint = load_checkpoint(model)
        cfg = self.checkpoint.config
        self.device = self._device(device)
        self.dtype = self._dtype(dtype)
        cache_dtype = self._kv_dtype(kv_cache_dtype)
        if block_size not in (8, 16, 32, 64):
            raise ValueError(f"LLM: block_size must be 8, 16, 32 or 64, got {block_size}")
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
        self.model = self.checkpoint.load_model(self.dtype, self.device)

        bytes_per_block = KVCache.bytes_per_block(cfg.num_layers, block_size, cfg.num_kv_heads,
                                                  cfg.head_size, cache_dtype)
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
        self.seed = seed
        self.eos_token_ids = self.checkpoint.generation.eos_token_ids
        self._request_ids = itertools.count()
        self._by_seq: dict[int, tuple[_Request, _Completion]] = {}

    # ---- construction helpers ---------------------------------------------------------------
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
        chosen = dtype if isinstance(dtype, torch.dtype) else _DTYPES.get(dtype)
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
    def _step(self) -> list[_Request]:
        """One scheduler step; returns the requests it finished."""
        batch = self.scheduler.schedule()
        logits = self.runner.execute(batch)
        rows = [i for i, s in enumerate(batch.seqs)
                if s.num_computed_tokens + batch.num_scheduled_tokens[i] >= len(s.token_ids)]
        assert logits.shape[0] == len(rows), "one logits row per sequence that samples"
        owners = [self._by_seq[batch.seqs[i].seq_id] for i in rows]
        # Requests with n > 1 fork after their prompt: the children sample from the same row.
        row_of, row_seq = list(range(len(rows))), [batch.seqs[i] for i in rows]
        seqs, scheduled, drafts = list(batch.seqs), list(batch.num_scheduled_tokens), \
            list(batch.num_draft_tokens)
        for r, (request, c) in enumerate(owners):
            if c.index == 0 and request.params.n > 1 and not c.seq.output_token_ids:
                i = rows[r]
                for index in range(1, request.params.n):
                    child = self.scheduler.fork(c.seq)
                    self._completion(request, index, child)
                    row_of.append(r)
                    row_seq.append(child)
                    seqs.append(child)
                    scheduled.append(batch.num_scheduled_tokens[i])
                    drafts.append(0)
        completions = [self._by_seq[s.seq_id][1] for s in row_seq]
        requests = [self._by_seq[s.seq_id][0] for s in row_seq]
        row_index = torch.tensor(row_of, device=logits.device)
        row_logits = logits[row_index] if len(row_of) != len(rows) else logits
        tokens = sample(row_logits, [q.row for q in requests], [c.generator for c in completions])
        want = [q.params.logprobs for q in requests]
        lp_rows = [j for j, w in enumerate(want) if w is not None]
        if lp_rows:
            lp = top_logprobs(row_logits[torch.tensor(lp_rows, device=logits.device)],
                              [tokens[j] for j in lp_rows], [want[j] for j in lp_rows])
            for j, (chosen_lp, rank, pairs) in zip(lp_rows, lp):
                c = completions[j]
                entry = {t: Logprob(v, n + 1, self._piece(t)) for n, (t, v) in enumerate(pairs)}
                entry.setdefault(tokens[j], Logprob(chosen_lp, rank, self._piece(tokens[j])))
                c.logprobs.append(entry)
                c.cumulative_logprob += chosen_lp
        new_by_seq = {s.seq_id: [t] for s, t in zip(row_seq, tokens)}
        sampled = [new_by_seq.get(s.seq_id, []) for s in seqs]
        step = StepBatch(seqs, scheduled, drafts, batch.input_ids, batch.positions,
                         batch.slot_mapping, batch.block_tables, batch.seq_lens,
                         batch.cu_seqlens_q, batch.max_q_len, batch.logits_indices,
                         batch.block_ops, batch.preempted)
        self.scheduler.update(step, sampled)
        now = time.monotonic()
        done = []
        for request, c in zip(requests, completions):
            if request.metrics.first_token_time is None:
                request.metrics.first_token_time = now
            self._after_token(c)
            if c.finish_reason is not None and request.finished and request not in done:
                request.metrics.finished_time = now
                done.append(request)
        return done

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
                text = c.detok.text
                hits = [(text.find(s), s) for s in stops if s in text]
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

    def _output(self, request: _Request) -> RequestOutput:
        outs = []
        for c in sorted(request.completions, key=lambda c: c.index):
            text = c.detok.text if c.detok is not None else ""
            outs.append(CompletionOutput(c.index, text, list(c.seq.output_token_ids),
                                         c.cumulative_logprob if c.logprobs is not None else None,
                                         c.logprobs, c.finish_reason, c.stop_reason))
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
