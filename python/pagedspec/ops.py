"""Typed wrappers over ``torch.ops.pagedspec.*``.

Each wrapper states shapes and dtypes; the meaning of every op is ``pagedspec.reference`` and the
contract in CONTRACT.md. Ops that write into caller-owned buffers return ``None``, never
synchronize with the host and can be captured in a CUDA graph.

Shape letters: T tokens, Hq query heads, Hkv KV heads, D head size, NB cache blocks, BS block size,
B sequences / requests, M max blocks per sequence, k draft tokens, V vocabulary, L layers.

Errors: every bad argument raises ``RuntimeError`` whose message reads
``pagedspec.<op>: <argument> <expected>, got <given>``, whether the wrapper finds it (a Python
value of the wrong type, ``None`` where the argument is not optional, the wrong rank of a tensor
the wrapper itself unpacks) or the kernel does (dtypes, shapes, devices, contents). One exception
class for both, because the dispatcher already reports a wrong argument type of
``torch.ops.pagedspec.*`` as ``RuntimeError``: callers catch one kind of error whichever layer
rejects the call. A wrapper never converts a value lossily (``max_q_len=3.7`` is an error, not 3).

:data:`OP_NAMES` is the one list of ops: every op the compiled library registered.
"""
from __future__ import annotations

import numbers
import operator
from typing import Optional, Sequence

import torch

_ops = torch.ops.pagedspec

#: Every op the compiled library registers (csrc/registration.cpp), sorted: the single source for
#: the fake kernels (``_fake.py``) and the tests, so an op added in C++ without a wrapper, fake or
#: reference fails tests/test_build.py.
OP_NAMES: tuple[str, ...] = tuple(sorted(
    name.split("::", 1)[1] for name in torch._C._dispatch_get_all_op_names()
    if name.startswith("pagedspec::")))


def _fail(op: str, message: str):
    raise RuntimeError(f"pagedspec.{op}: {message}")


def _type_name(value) -> str:
    return "None" if value is None else type(value).__name__


def _tensor(op: str, name: str, value, *, ndim: Optional[int] = None) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        _fail(op, f"{name} must be a Tensor, got {_type_name(value)}")
    if ndim is not None and value.dim() != ndim:
        _fail(op, f"{name} must have {ndim} dimensions, got {value.dim()} "
                  f"(shape {list(value.shape)})")
    return value


def _optional_tensor(op: str, name: str, value) -> Optional[torch.Tensor]:
    if value is not None and not isinstance(value, torch.Tensor):
        _fail(op, f"{name} must be a Tensor or None, got {_type_name(value)}")
    return value


def _int(op: str, name: str, value) -> int:
    if isinstance(value, torch.SymInt):
        return value
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        _fail(op, f"{name} must be an int, got {_type_name(value)} ({value!r})")
    return operator.index(value)


def _float(op: str, name: str, value) -> float:
    if isinstance(value, torch.SymFloat):
        return value
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        _fail(op, f"{name} must be a float, got {_type_name(value)} ({value!r})")
    return float(value)


def _tensor_list(op: str, name: str, value) -> list:
    if isinstance(value, torch.Tensor) or not isinstance(value, Sequence):
        _fail(op, f"{name} must be a list or tuple of Tensors, got {_type_name(value)}")
    for i, t in enumerate(value):
        if not isinstance(t, torch.Tensor):
            _fail(op, f"{name}[{i}] must be a Tensor, got {_type_name(t)}")
    return list(value)


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: Optional[torch.Tensor] = None,
    v_scale: Optional[torch.Tensor] = None,
) -> None:
    """Write new tokens' K and V into the paged cache.

    Args:
        key, value: ``[T, Hkv, D]`` float16 / bfloat16 / float32 (last dim contiguous; the token
            and head strides may be anything, e.g. a slice of a fused QKV tensor).
        key_cache, value_cache: ``[NB, BS, Hkv, D]`` contiguous, in key's dtype or
            float8_e4m3fn / float8_e5m2. Written.
        slot_mapping: int64 ``[T]``; token t goes to slot ``slot_mapping[t]`` (block
            ``slot // BS``, offset ``slot % BS``); -1 skips the token.
        k_scale, v_scale: float32 ``[]`` or ``[Hkv]``; FP8 caches store ``saturate(x / scale)``.
            Ignored for non-FP8 caches; None means 1.0.
    """
    op = "reshape_and_cache"
    _ops.reshape_and_cache.default(
        _tensor(op, "key", key), _tensor(op, "value", value),
        _tensor(op, "key_cache", key_cache), _tensor(op, "value_cache", value_cache),
        _tensor(op, "slot_mapping", slot_mapping), _optional_tensor(op, "k_scale", k_scale),
        _optional_tensor(op, "v_scale", v_scale))


def _attention_doc(variant: str) -> str:
    return f"""Paged attention ({variant}) for decode and multi-token verification.

    Args:
        out: ``[T, Hq, D]`` in query's dtype. Written.
        query: ``[T, Hq, D]`` float16 / bfloat16 / float32 (float32 on CPU only).
        key_cache, value_cache: ``[NB, BS, Hkv, D]`` in query's dtype or FP8; ``Hq % Hkv == 0``.
        block_tables: int32 ``[B, M]``; position p of sequence i is in block
            ``block_tables[i, p // BS]``.
        seq_lens: int32 ``[B]``; KV length of each sequence, including its query tokens.
        cu_seqlens_q: int32 ``[B + 1]``; sequence i owns query rows
            ``cu_seqlens_q[i] .. cu_seqlens_q[i+1]-1`` (q_len_i of them).
        max_q_len: the largest q_len_i (a host-side bound, so no device read is needed).
        scale: softmax scale, usually ``D ** -0.5``.
        k_scale, v_scale: float32 ``[]`` or ``[Hkv]`` for FP8 caches.
        lse: optional float32 ``[T, Hq]``; written with the natural-log log-sum-exp of the scaled
            logits.
        attn_mass: optional float32 ``[NB * BS]``; accumulates, per slot, the attention
            probability summed over query heads and query tokens (the H2O heavy-hitter signal).

    Query token j of sequence i attends to positions ``0 .. seq_lens[i] - q_len_i + j``.
    """


def _attention(name, out, query, key_cache, value_cache, block_tables, seq_lens, cu_seqlens_q,
               max_q_len, scale, k_scale, v_scale, lse, attn_mass) -> None:
    getattr(_ops, name).default(_tensor(name, "out", out), _tensor(name, "query", query),
       _tensor(name, "key_cache", key_cache), _tensor(name, "value_cache", value_cache),
       _tensor(name, "block_tables", block_tables), _tensor(name, "seq_lens", seq_lens),
       _tensor(name, "cu_seqlens_q", cu_seqlens_q), _int(name, "max_q_len", max_q_len),
       _float(name, "scale", scale), _optional_tensor(name, "k_scale", k_scale),
       _optional_tensor(name, "v_scale", v_scale), _optional_tensor(name, "lse", lse),
       _optional_tensor(name, "attn_mass", attn_mass))


def paged_attention_v1(out: torch.Tensor, query: torch.Tensor, key_cache: torch.Tensor,
                       value_cache: torch.Tensor, block_tables: torch.Tensor,
                       seq_lens: torch.Tensor, cu_seqlens_q: torch.Tensor, max_q_len: int,
                       scale: float, k_scale: Optional[torch.Tensor] = None,
                       v_scale: Optional[torch.Tensor] = None, lse: Optional[torch.Tensor] = None,
                       attn_mass: Optional[torch.Tensor] = None) -> None:
    _attention("paged_attention_v1", out, query, key_cache, value_cache, block_tables,
               seq_lens, cu_seqlens_q, max_q_len, scale, k_scale, v_scale, lse, attn_mass)


def paged_attention_v2(out: torch.Tensor, query: torch.Tensor, key_cache: torch.Tensor,
                       value_cache: torch.Tensor, block_tables: torch.Tensor,
                       seq_lens: torch.Tensor, cu_seqlens_q: torch.Tensor, max_q_len: int,
                       scale: float, k_scale: Optional[torch.Tensor] = None,
                       v_scale: Optional[torch.Tensor] = None, lse: Optional[torch.Tensor] = None,
                       attn_mass: Optional[torch.Tensor] = None) -> None:
    _attention("paged_attention_v2", out, query, key_cache, value_cache, block_tables,
               seq_lens, cu_seqlens_q, max_q_len, scale, k_scale, v_scale, lse, attn_mass)


def paged_attention(out: torch.Tensor, query: torch.Tensor, key_cache: torch.Tensor,
                    value_cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                    cu_seqlens_q: torch.Tensor, max_q_len: int, scale: float,
                    k_scale: Optional[torch.Tensor] = None, v_scale: Optional[torch.Tensor] = None,
                    lse: Optional[torch.Tensor] = None,
                    attn_mass: Optional[torch.Tensor] = None) -> None:
    _attention("paged_attention", out, query, key_cache, value_cache, block_tables,
               seq_lens, cu_seqlens_q, max_q_len, scale, k_scale, v_scale, lse, attn_mass)


paged_attention_v1.__doc__ = _attention_doc("v1: one pass per sequence and KV head group") + """
    One CUDA thread block (one CPU task) per (sequence, KV head, chunk of query rows) walks the
    whole context with an online softmax in registers, so any context length works (nothing about
    it is kept in shared memory). Best when sequences x KV heads fill the device.
    """
paged_attention_v2.__doc__ = _attention_doc("v2: context split into partitions, merged by LSE") + """
    Sequences longer than 512 positions are split into 512-position partitions processed by
    separate thread blocks (CPU tasks), which write partial (output, max, sum) to scratch from the
    caching allocator; a second kernel merges them by log-sum-exp. CUDA sizes the scratch and the
    grid by the block table's width (``T * ceil(M * BS / 512)`` partial rows: a table padded far
    past the real lengths costs idle thread blocks and memory); CPU by the real lengths. To size
    both by the real lengths on CUDA, use :func:`paged_attention_plan` and
    :func:`paged_attention_run`. Best for few sequences with long contexts.
    """
paged_attention.__doc__ = _attention_doc("dispatcher: picks v1 or v2 by occupancy and length") + """
    Heuristic. CUDA: v2 when v1 would run fewer than 4 full waves of thread blocks
    (``num_seqs * num_kv_heads * row_chunks < 4 * SM count * resident blocks per SM``, the last
    from the occupancy calculator; row_chunks = ``ceil(max_q_len * Hq / Hkv / 4)``, a block
    serving up to 4 query rows) and the block table can hold a context of at least two
    partitions (``M * BS >= 1024``: the block-table width is the host-side bound on the context,
    since seq_lens live on the device and reading them would synchronize). With few waves v1
    leaves SMs idle (at batch 1 most of them); v2 costs under 1% extra traffic for its partials
    plus one small launch. Otherwise v1. CPU: the planner of :func:`paged_attention_plan` on the
    real (host) lengths.
    """


def paged_attention_plan(seq_lens: torch.Tensor, cu_seqlens_q: torch.Tensor, num_heads: int,
                         num_kv_heads: int, device, partition_size: int = 0,
                         max_items: Optional[int] = None,
                         max_partial_rows: Optional[int] = None) -> torch.Tensor:
    """Split-KV plan for one step, made on the host from the step's real lengths.

    Args:
        seq_lens: int32 ``[B]`` on the CPU: KV length of each sequence, query tokens included.
        cu_seqlens_q: int32 ``[B + 1]`` on the CPU.
        num_heads, num_kv_heads: Hq and Hkv of the attention the plan is for.
        device: where the plan will run (``cpu`` or a ``cuda`` device): the work-item size and
            the parallelism it plans for (CPU threads; CUDA SMs x resident thread blocks).
        partition_size: 0 lets the planner choose: contexts under 512 never split; CPU splits
            longer ones whatever the work (faster on CPU at every batch measured), into the
            largest of 1024, 512 and 256 positions that leaves 4 x threads tasks (items x KV
            heads; 256 if none does: fewer, longer tasks cost less setup and merging); CUDA
            splits only when the unsplit work fills fewer than 4 waves of the device, into the
            smallest power-of-two multiple of 256 positions that stays within 4 waves.
            -1 never splits; > 0 forces that partition size.
        max_items, max_partial_rows: bounds the plan must fit (it splits less to fit). With
            max_items the plan has exactly that capacity, so one buffer (and a CUDA graph
            captured with it) serves every step planned with the same bounds.

    Returns:
        int32 ``[8 + 2 * B + 3 * capacity]`` on the CPU (layout: include/pagedspec/attention_plan.h).
        Copy it to ``device`` for :func:`paged_attention_run`; ``plan[5]`` is the number of
        partial rows the workspace must hold (see :func:`plan_paged_attention`).
    """
    op = "paged_attention_plan"
    return _ops.paged_attention_plan.default(
        _tensor(op, "seq_lens", seq_lens), _tensor(op, "cu_seqlens_q", cu_seqlens_q),
        _int(op, "num_heads", num_heads), _int(op, "num_kv_heads", num_kv_heads),
        torch.device(device), _int(op, "partition_size", partition_size),
        -1 if max_items is None else _int(op, "max_items", max_items),
        -1 if max_partial_rows is None else _int(op, "max_partial_rows", max_partial_rows))


def paged_attention_run(out: torch.Tensor, query: torch.Tensor, key_cache: torch.Tensor,
                        value_cache: torch.Tensor, block_tables: torch.Tensor,
                        seq_lens: torch.Tensor, cu_seqlens_q: torch.Tensor, max_q_len: int,
                        scale: float, plan: torch.Tensor, workspace: torch.Tensor,
                        k_scale: Optional[torch.Tensor] = None,
                        v_scale: Optional[torch.Tensor] = None,
                        lse: Optional[torch.Tensor] = None,
                        attn_mass: Optional[torch.Tensor] = None) -> None:
    op = "paged_attention_run"
    _ops.paged_attention_run.default(
        _tensor(op, "out", out), _tensor(op, "query", query),
        _tensor(op, "key_cache", key_cache), _tensor(op, "value_cache", value_cache),
        _tensor(op, "block_tables", block_tables), _tensor(op, "seq_lens", seq_lens),
        _tensor(op, "cu_seqlens_q", cu_seqlens_q), _int(op, "max_q_len", max_q_len),
        _float(op, "scale", scale), _tensor(op, "plan", plan), _tensor(op, "workspace", workspace),
        _optional_tensor(op, "k_scale", k_scale), _optional_tensor(op, "v_scale", v_scale),
        _optional_tensor(op, "lse", lse), _optional_tensor(op, "attn_mass", attn_mass))


paged_attention_run.__doc__ = _attention_doc("through a plan: exactly the planned work") + """
        plan: int32 from :func:`paged_attention_plan` for these seq_lens and cu_seqlens_q and
            this device, on query's device.
        workspace: float32 1-D on query's device with at least
            ``plan[5] * Hq * (D + 2)`` elements (the plan's partial rows). Written.

    Launches exactly the plan's work items (a CUDA grid of the plan's capacity), so it can be
    captured in a CUDA graph: planning a new step into the same plan buffer and workspace keeps
    the graph valid. The plan's contents are validated on CPU always and on CUDA with
    ``PAGEDSPEC_DEBUG=1``; without it, a plan that does not match the call is memory-safe but
    its results are unspecified.
    """


class PagedAttentionPlan:
    """A step's plan on its device and a workspace for it: the pair :func:`paged_attention_run`
    takes. Make one per step with :func:`plan_paged_attention` (every layer of the step shares it).

    Attributes:
        plan: int32 plan on the device. workspace: float32 ``[partial_rows * Hq * (D + 2)]``.
        partition_size, num_items, partial_rows: read from the host copy (``split`` is whether
        any sequence is split).
    """

    def __init__(self, host_plan: torch.Tensor, plan: torch.Tensor, workspace: torch.Tensor):
        self.host_plan, self.plan, self.workspace = host_plan, plan, workspace
        header = host_plan[:8].tolist()
        self.num_items, self.partition_size, self.partial_rows = header[2], header[4], header[5]
        self.split = self.partial_rows > 0


def plan_paged_attention(seq_lens: torch.Tensor, cu_seqlens_q: torch.Tensor, num_heads: int,
                         num_kv_heads: int, head_size: int, device, *, partition_size: int = 0,
                         max_items: Optional[int] = None,
                         max_partial_rows: Optional[int] = None) -> PagedAttentionPlan:
    """:func:`paged_attention_plan` for host lengths (int32 ``[B]`` and ``[B + 1]``), copied to
    ``device``, with a workspace for ``head_size``-wide heads (of ``max_partial_rows`` rows when
    given, so it can be reused across steps)."""
    device = torch.device(device)
    host = paged_attention_plan(seq_lens, cu_seqlens_q, num_heads, num_kv_heads, device,
                                partition_size, max_items, max_partial_rows)
    rows = max_partial_rows if max_partial_rows is not None else int(host[5])
    workspace = torch.empty(rows * num_heads * (head_size + 2), dtype=torch.float32, device=device)
    return PagedAttentionPlan(host, host.to(device, non_blocking=True), workspace)


def quantize_fp8(out: torch.Tensor, input: torch.Tensor, scale: torch.Tensor) -> None:
    """``out = saturate(input / scale)`` in FP8, round to nearest even; NaN stays NaN.

    Args:
        out: float8_e4m3fn / float8_e5m2, same shape as input, contiguous. Written.
        input: float16 / bfloat16 / float32 ``[..., H, D]``, contiguous.
        scale: float32 ``[]`` or ``[H]`` (one per head, dim -2 of input).
    """
    op = "quantize_fp8"
    _ops.quantize_fp8.default(_tensor(op, "out", out), _tensor(op, "input", input),
                              _tensor(op, "scale", scale))


def dequantize_fp8(out: torch.Tensor, input: torch.Tensor, scale: torch.Tensor) -> None:
    """``out = input * scale`` computed in float32, written in out's dtype.

    Args:
        out: float16 / bfloat16 / float32, same shape as input, contiguous. Written.
        input: float8_e4m3fn / float8_e5m2 ``[..., H, D]``, contiguous.
        scale: float32 ``[]`` or ``[H]``.
    """
    op = "dequantize_fp8"
    _ops.dequantize_fp8.default(_tensor(op, "out", out), _tensor(op, "input", input),
                                _tensor(op, "scale", scale))


def copy_blocks(key_caches: Sequence[torch.Tensor], value_caches: Sequence[torch.Tensor],
                block_mapping: torch.Tensor) -> None:
    """Copy-on-write: copy block ``src`` to block ``dst`` in every layer's K and V cache.

    Args:
        key_caches, value_caches: L tensors ``[NB, BS, Hkv, D]``, all of one shape, dtype and
            device. Written.
        block_mapping: int64 ``[n, 2]`` (src, dst) rows on the caches' device. A dst that is also a
            src, or a repeated dst, is an error (checked on CPU always; on CUDA with
            ``PAGEDSPEC_DEBUG=1``). One kernel launch covers up to 64 layers.
    """
    op = "copy_blocks"
    _ops.copy_blocks.default(_tensor_list(op, "key_caches", key_caches),
                             _tensor_list(op, "value_caches", value_caches),
                             _tensor(op, "block_mapping", block_mapping))


def swap_blocks(src: torch.Tensor, dst: torch.Tensor, block_mapping: torch.Tensor) -> None:
    """Copy block ``block_mapping[j, 0]`` of ``src`` to block ``block_mapping[j, 1]`` of ``dst``.

    Args:
        src: ``[NB_src, ...]`` contiguous, on CPU or CUDA.
        dst: ``[NB_dst, ...]`` same block shape and dtype, on CPU or CUDA. Written.
        block_mapping: int64 ``[n, 2]``. On CPU: the host reads it and issues one copy per run of
            consecutive blocks (any pair of devices). On the CUDA device: one kernel copies all
            blocks, reading pinned host memory directly when one side is on the CPU (the host side
            must then be pinned); no host synchronization, graph-capturable.
    """
    op = "swap_blocks"
    _ops.swap_blocks.default(_tensor(op, "src", src), _tensor(op, "dst", dst),
                             _tensor(op, "block_mapping", block_mapping))


def rejection_sample(
    draft_token_ids: torch.Tensor,
    draft_probs: Optional[torch.Tensor],
    target_probs: torch.Tensor,
    uniform_accept: Optional[torch.Tensor] = None,
    uniform_resample: Optional[torch.Tensor] = None,
    num_draft_tokens: Optional[torch.Tensor] = None,
    generator: Optional[torch.Generator] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative-decoding rejection sampling (Leviathan et al. 2023; Chen et al. 2023).

    Args:
        draft_token_ids: int64 ``[B, k]``.
        draft_probs: float32 ``[B, k, V]``, or None for a deterministic (one-hot) draft.
        target_probs: float32 ``[B, k+1, V]``.
        uniform_accept: float32 ``[B, k]`` in [0, 1); drawn from ``generator`` when None.
        uniform_resample: float32 ``[B, k+1]`` in [0, 1); drawn from ``generator`` when None,
            as an independent draw (no random stream serves two purposes).
        num_draft_tokens: int32 ``[B]``, each ``<= k``; default k for every request.
        generator: the ``torch.Generator`` the uniforms come from (default: the global one).

    Returns:
        ``(output_token_ids, num_accepted)``: int64 ``[B, k+1]`` (accepted tokens, then the one
        corrected or bonus token, then -1) and int32 ``[B]``.
    """
    op = "rejection_sample"
    batch, k = _tensor(op, "draft_token_ids", draft_token_ids, ndim=2).shape
    draft_probs = _optional_tensor(op, "draft_probs", draft_probs)
    device = _tensor(op, "target_probs", target_probs).device
    uniform_accept = _optional_tensor(op, "uniform_accept", uniform_accept)
    uniform_resample = _optional_tensor(op, "uniform_resample", uniform_resample)
    num_draft_tokens = _optional_tensor(op, "num_draft_tokens", num_draft_tokens)
    if generator is not None and not isinstance(generator, torch.Generator):
        _fail(op, f"generator must be a torch.Generator or None, got {_type_name(generator)}")
    if uniform_accept is None:
        uniform_accept = torch.rand((batch, k), generator=generator, device=device,
                                    dtype=torch.float32)
    if uniform_resample is None:
        uniform_resample = torch.rand((batch, k + 1), generator=generator, device=device,
                                      dtype=torch.float32)
    return _ops.rejection_sample.default(draft_token_ids, draft_probs, target_probs,
                                         uniform_accept, uniform_resample, num_draft_tokens)


def greedy_verify(draft_token_ids: torch.Tensor, target_token_ids: torch.Tensor,
                  num_draft_tokens: Optional[torch.Tensor] = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy verification: accept drafted tokens while they equal the target's argmax.

    Args:
        draft_token_ids: int64 ``[B, k]``.
        target_token_ids: int64 ``[B, k+1]``, the target's argmax at each position.
        num_draft_tokens: int32 ``[B]`` (each ``<= k``), default k.

    Returns:
        ``(output_token_ids, num_accepted)`` as for :func:`rejection_sample`.
    """
    op = "greedy_verify"
    return _ops.greedy_verify.default(
        _tensor(op, "draft_token_ids", draft_token_ids),
        _tensor(op, "target_token_ids", target_token_ids),
        _optional_tensor(op, "num_draft_tokens", num_draft_tokens))


def cms_update(sketch: torch.Tensor, keys: torch.Tensor,
               increments: Optional[torch.Tensor] = None, conservative: bool = False) -> None:
    """Count-min sketch update (plain, or conservative as in Estan & Varghese).

    Args:
        sketch: int32 ``[depth, width]``, depth 1..16, counters saturate at 2^31 - 1. Written.
        keys: int64 ``[n]``.
        increments: int32 ``[n]``, each >= 0; default 1 per key.
        conservative: raise each hit counter only to (estimate before the call + this call's
            increments for the key). Both modes are independent of the order of keys.

    Raises RuntimeError naming the argument when ``keys`` or ``increments`` shares memory with
    ``sketch`` (the sketch is written while they are read).
    """
    op = "cms_update"
    if not isinstance(conservative, (bool, numbers.Integral)):
        _fail(op, f"conservative must be a bool, got {_type_name(conservative)}")
    _ops.cms_update.default(_tensor(op, "sketch", sketch), _tensor(op, "keys", keys),
                            _optional_tensor(op, "increments", increments), bool(conservative))


def cms_query(sketch: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """Count-min estimate of each key: int32 ``[n]``, the min over rows.

    Args:
        sketch: int32 ``[depth, width]``.
        keys: int64 ``[n]``.
    """
    op = "cms_query"
    return _ops.cms_query.default(_tensor(op, "sketch", sketch), _tensor(op, "keys", keys))


def cms_decay(sketch: torch.Tensor, shift: int = 1) -> None:
    """Age the sketch: every counter is shifted right by ``shift`` (TinyLFU's reset).

    Args:
        sketch: int32 ``[depth, width]``. Written.
        shift: bits to shift, 0..31.
    """
    op = "cms_decay"
    _ops.cms_decay.default(_tensor(op, "sketch", sketch), _int(op, "shift", shift))
