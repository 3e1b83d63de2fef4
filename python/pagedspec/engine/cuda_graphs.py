"""Steps replayed from CUDA graphs, over persistent input buffers.

Without graphs a small model's decode step on a GPU is bound by kernel launches (a few hundred
per step, each a few microseconds of host time), not by the GPU: vLLM and SGLang capture decode
steps in graphs for that reason. :class:`StepGraphs` captures the runner's forward for steps in
which every sequence has at most ``MAX_GRAPH_ROWS`` query rows (decodes, verifications, short
prefill chunks), keyed by a bucket of sequences (1, 2, 4, 8, then multiples of 8) and of rows per
sequence (1, 2, 4, 8, 16). A step is padded to its bucket:

- each sequence's rows to the row bucket, at the end: its padding rows write no K/V (slot -1),
  sit at position 0 for the rotary tables, and its length grows by them, so its real rows see
  exactly the keys they would unpadded (causality counts from the end) while the padding rows
  read block 0, whatever it holds;
- the batch to the sequence bucket with whole padding sequences of the same kind;
- block tables to the pool's full width, entries past a sequence's blocks pointing at block 0.

Rows are independent through every layer (norms, projections, attention per sequence), so the
real rows' results equal the unpadded step's up to the rounding of a different GEMM size.

The inputs live in two flat device buffers (int64: token ids, positions, slots, the rows to
gather; int32: block tables, lengths, query offsets, the attention plan), filled on the host in
numpy and copied with one non-blocking copy each from pinned memory; a graph's tensors are views
of them at fixed addresses. The attention plan is made on the host for the padded lengths with a
fixed capacity per bucket (``paged_attention_plan``'s ``max_items``), so the captured grid fits
every step of the bucket and the plan is refreshed in place before each replay, as the plan/run
split was made for. Capture is lazy (a key's first step captures it, after one warm-up run) and
all graphs share one memory pool.

With ``capture=False`` (any device) the same padded step runs eagerly on the same buffers: what
the CPU tests use to check everything but the capture itself.
"""
from __future__ import annotations

import warnings

import numpy as np
import torch

from pagedspec import ops
from pagedspec.reference import ROWS_PER_ITEM

MAX_GRAPH_ROWS = 16          # query rows per sequence a graph covers (k + 1 <= 16 drafts)
ROW_BUCKETS = (1, 2, 4, 8, 16)
# Work items x KV heads a graph's plan may reach by splitting long sequences (its fixed grid):
# about 4 waves of an H100 (132 SMs x 4 resident blocks x 4 waves is 2112).
SPLIT_ITEM_HEADS = 4096
MAX_PARTIAL_ROWS = 8192      # partial-result rows of the shared workspace (bounds its memory)


def seq_buckets(max_num_seqs: int) -> list[int]:
    """Batch sizes graphs are captured for: 1, 2, 4, 8, then every multiple of 8, up to and
    including ``max_num_seqs``."""
    sizes = [b for b in (1, 2, 4, 8) if b < max_num_seqs]
    sizes += list(range(16, max_num_seqs, 8))
    return sizes + [max_num_seqs]


def _bucket(sizes, n: int) -> int:
    return next(s for s in sizes if s >= n)


class StepGraphs:
    """Padded, graph-replayed forwards of ``runner`` for steps of at most ``max_num_seqs``
    sequences with at most ``MAX_GRAPH_ROWS`` query rows each (see the module docstring).

    ``max_model_len``: a sequence's longest length, which sets the block tables' width.
    ``capture``: capture and replay CUDA graphs (CUDA only); False runs the padded step eagerly.
    """

    def __init__(self, runner, max_num_seqs: int, max_model_len: int, capture: bool = True):
        if max_num_seqs < 1 or max_model_len < 1:
            raise ValueError(f"StepGraphs: max_num_seqs and max_model_len must be >= 1, "
                             f"got {max_num_seqs} and {max_model_len}")
        dev = runner.device
        if capture and dev.type != "cuda":
            raise ValueError(f"StepGraphs: capture=True needs a CUDA device, the runner is on "
                             f"{dev}")
        self.runner, self.capture = runner, capture
        model = runner.model
        self.sizes = seq_buckets(max_num_seqs)
        self.block_size = runner.kv_cache.key_caches[0].shape[1]
        # As wide as the longest sequence plus a verification's draft rows.
        self.width = -(-(max_model_len + MAX_GRAPH_ROWS) // self.block_size)
        B, Q, M = self.sizes[-1], ROW_BUCKETS[-1], self.width
        self.rows_per_item = ROWS_PER_ITEM[dev.type]
        self.group = model.num_heads // model.num_kv_heads
        plan_len = max(self._plan_len(b, q) for b in self.sizes for q in ROW_BUCKETS)
        T = B * Q
        # int64: ids | positions | slots | gathered rows; int32: tables | seq_lens | cu | plan
        self._i64_offsets = np.cumsum([0, T, T, T, T])
        self._i32_offsets = np.cumsum([0, B * M, B, B + 1, plan_len])
        self.i64 = torch.zeros(int(self._i64_offsets[-1]), dtype=torch.int64, device=dev)
        self.i32 = torch.zeros(int(self._i32_offsets[-1]), dtype=torch.int32, device=dev)
        pin = dev.type == "cuda"
        self._host_i64 = torch.zeros(self.i64.shape, dtype=torch.int64, pin_memory=pin)
        self._host_i32 = torch.zeros(self.i32.shape, dtype=torch.int32, pin_memory=pin)
        self.workspace = torch.empty(
            max(self._workspace_len(b, q) for b in self.sizes for q in ROW_BUCKETS),
            dtype=torch.float32, device=dev)
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._pool = torch.cuda.graph_pool_handle() if capture else None
        self.num_runs = 0      # padded steps run (replayed or eager)

    def _capacity(self, b: int, q: int) -> int:
        """Work items of a bucket's plan: the unsplit plan's, or more to split long contexts."""
        unsplit = b * -(-(q * self.group) // self.rows_per_item)
        return max(unsplit, SPLIT_ITEM_HEADS // self.runner.model.num_kv_heads)

    def _plan_len(self, b: int, q: int) -> int:
        return 8 + 2 * b + 3 * self._capacity(b, q)

    def _partial_rows(self, b: int, q: int) -> int:
        """Partial-result rows a bucket's plan may use (each item splits at most its rows)."""
        return min(q * self._capacity(b, q), MAX_PARTIAL_ROWS)

    def _workspace_len(self, b: int, q: int) -> int:
        model = self.runner.model
        return self._partial_rows(b, q) * model.num_heads * (model.head_size + 2)

    def _views(self, b: int, q: int):
        """The step tensors of bucket ``(b, q)``: views of the flat device buffers."""
        o64, o32, M, T = self._i64_offsets, self._i32_offsets, self.width, b * q
        ids, pos, slots = (self.i64[o64[i]:o64[i] + T] for i in range(3))
        tables = self.i32[o32[0]:o32[0] + b * M].view(b, M)
        seq_lens = self.i32[o32[1]:o32[1] + b]
        cu = self.i32[o32[2]:o32[2] + b + 1]
        plan = self.i32[o32[3]:o32[3] + self._plan_len(b, q)]
        workspace = self.workspace[:self._workspace_len(b, q)]
        return ids, pos, slots, tables, seq_lens, cu, plan, workspace

    def fits(self, batch) -> bool:
        n = len(batch.num_scheduled_tokens)
        return (0 < n <= self.sizes[-1] and batch.max_q_len <= MAX_GRAPH_ROWS
                and batch.block_tables.shape[1] <= self.width)

    def _fill(self, batch, wanted: np.ndarray, b: int, q: int) -> None:
        """Writes the padded step into the host buffers and copies them to the device."""
        n, T, M = len(batch.num_scheduled_tokens), batch.num_tokens, self.width
        q_lens = np.asarray(batch.num_scheduled_tokens, np.int64)
        cu = batch.cu_seqlens_q.numpy().astype(np.int64)
        # Real row r of sequence i lands at i * q + (r - cu[i]).
        padded_row = np.repeat(np.arange(n) * q - cu[:-1], q_lens) + np.arange(T)
        h64, h32 = self._host_i64.numpy(), self._host_i32.numpy()
        o64, o32 = self._i64_offsets, self._i32_offsets
        ids, pos, slots, gather = (h64[o64[i]:o64[i] + b * q] for i in range(4))
        ids[:] = 0
        pos[:] = 0
        slots[:] = -1
        ids[padded_row] = batch.input_ids.numpy()
        pos[padded_row] = batch.positions.numpy()
        slots[padded_row] = batch.slot_mapping.numpy()
        gather[:wanted.size] = padded_row[wanted]
        lens = np.full(b, q, np.int32)
        lens[:n] = batch.seq_lens.numpy() + (q - q_lens)
        cu_padded = np.arange(b + 1, dtype=np.int32) * q
        tables = h32[o32[0]:o32[0] + b * M].reshape(b, M)
        tables[:] = 0
        width = batch.block_tables.shape[1]
        real = batch.block_tables.numpy()
        # Past a sequence's own blocks (where its padding rows may read) block 0, a valid one.
        used = -(-batch.seq_lens.numpy().astype(np.int64) // self.block_size)
        tables[:n, :width] = np.where(np.arange(width)[None, :] < used[:, None], real, 0)
        h32[o32[1]:o32[1] + b] = lens
        h32[o32[2]:o32[2] + b + 1] = cu_padded
        model = self.runner.model
        host_plan = ops.paged_attention_plan(
            torch.from_numpy(lens), torch.from_numpy(cu_padded), model.num_heads,
            model.num_kv_heads, self.runner.device, max_items=self._capacity(b, q),
            max_partial_rows=self._partial_rows(b, q))
        h32[o32[3]:o32[3] + host_plan.numel()] = host_plan.numpy()
        if self.i64.data_ptr() != self._host_i64.data_ptr():
            # Pinned and non-blocking: the step's only synchronization stays the sampled
            # tokens' copy, which also keeps these host buffers from being rewritten early.
            self.i64.copy_(self._host_i64, non_blocking=True)
            self.i32.copy_(self._host_i32, non_blocking=True)

    def _forward(self, b: int, q: int) -> torch.Tensor:
        ids, pos, slots, tables, seq_lens, cu, plan, workspace = self._views(b, q)
        runner = self.runner
        return runner._run_layers(runner._layer, ids, pos, None, slots, tables, seq_lens, cu,
                                  plan, workspace, q if q == 1 else MAX_GRAPH_ROWS + 1, None)

    def _capture(self, b: int, q: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """Captures bucket ``(b, q)`` on inputs just filled: one warm-up run on a side stream
        first (compilation, library handles), as graph capture requires."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            self._forward(b, q)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            out = self._forward(b, q)
        return graph, out

    def run(self, batch, wanted: np.ndarray) -> torch.Tensor:
        """Final hidden states ``[len(wanted), hidden]`` of ``batch``'s rows ``wanted`` (int64
        indices into its unpadded rows), from the step's padded graph. ``fits(batch)`` first."""
        b = _bucket(self.sizes, len(batch.num_scheduled_tokens))
        q = _bucket(ROW_BUCKETS, batch.max_q_len)
        self._fill(batch, np.asarray(wanted, np.int64), b, q)
        o = self._i64_offsets[3]
        gather = self.i64[o:o + wanted.size]
        self.num_runs += 1
        if not self.capture:
            return self._forward(b, q)[gather]
        if (b, q) not in self.graphs:
            try:
                self.graphs[(b, q)] = self._capture(b, q)
            except RuntimeError as exc:
                # A capture the kernels do not allow must not stop serving: the same padded
                # steps then run uncaptured (what the CPU tests check), and the warning, and
                # the CUDA tests that expect captured graphs, say so.
                warnings.warn(f"pagedspec: capturing a CUDA graph for {b} sequences x {q} rows "
                              f"failed ({exc}); steps run uncaptured from now on",
                              RuntimeWarning, stacklevel=2)
                self.capture = False
                return self._forward(b, q)[gather]
        graph, out = self.graphs[(b, q)]
        graph.replay()
        return out[gather]
