"""paged_attention_plan / paged_attention_run: the planner against its pure-Python definition
(reference.paged_attention_plan), runs through every kind of plan against the attention
reference, plans reused across steps at a fixed capacity, and bad plans rejected by name.

Tolerances are test_attention.py's (both sides compute in float32 and differ in summation order
only); a split and an unsplit run of the same call differ by the merge's rounding alone.
"""
from __future__ import annotations

import pytest
import torch

import pagedspec  # noqa: F401
from pagedspec import ops, reference
from conftest import requires_cuda
from test_attention import Case, assert_close, check_case

pytestmark = pytest.mark.usefixtures("one_thread")

# (seq_lens, q_lens): decode, verification, mixed lengths across partition boundaries, q_len 0.
SHAPES = [
    ([4000], [1]),
    ([700, 3, 1500, 512, 513], [1, 3, 5, 2, 1]),
    ([300] * 6, [1] * 6),
    ([2100, 40, 0 + 9], [9, 0, 9]),
    ([1030, 1030], [33, 1]),
]


def _lens(seq_lens, q_lens):
    cu = [0]
    for n in q_lens:
        cu.append(cu[-1] + n)
    return (torch.tensor(seq_lens, dtype=torch.int32), torch.tensor(cu, dtype=torch.int32))


@pytest.mark.parametrize("seq_lens, q_lens", SHAPES)
@pytest.mark.parametrize("heads", [(8, 2), (32, 8), (4, 4)])
@pytest.mark.parametrize("partition_size, max_items", [(0, None), (-1, None), (512, None),
                                                       (256, None), (37, None), (0, 4000)])
@pytest.mark.parametrize("threads", [1, 4, 64])
def test_plan_matches_its_definition(seq_lens, q_lens, heads, partition_size, max_items,
                                     threads):
    lens, cu = _lens(seq_lens, q_lens)
    torch.set_num_threads(threads)
    plan = ops.paged_attention_plan(lens, cu, *heads, "cpu", partition_size, max_items)
    want = reference.paged_attention_plan(lens, cu, *heads, "cpu", partition_size,
                                          max_items or -1)
    assert torch.equal(plan, want)


@pytest.mark.parametrize("threads, seq_lens, heads, partition", [
    (2, [4000], (32, 8), 1024),        # 4 items x 8 KV heads = 32 tasks >= 4 x 2 threads
    (16, [4000], (32, 8), 512),        # 32 tasks < 4 x 16; 8 items x 8 = 64
    (64, [4000], (32, 8), 256),        # not enough tasks at any size: the smallest
    (64, [4000] * 64, (32, 8), 1024),  # plenty of work: the largest
    (2, [4000], (8, 1), 512),          # one KV head: 4 items < 8; 8 items
    (1, [1500], (32, 8), 1024),        # 1024 + 476
])
def test_cpu_planner_splits_long_contexts_whatever_the_work(threads, seq_lens, heads,
                                                            partition):
    # Splitting beats unsplit tasks on CPU at every batch measured, and longer partitions beat
    # 256 where there are tasks enough for the threads (bench/NOTES.md).
    torch.set_num_threads(threads)
    lens, cu = _lens(seq_lens, [1] * len(seq_lens))
    plan = ops.paged_attention_plan(lens, cu, *heads, "cpu")
    parts = -(-seq_lens[0] // partition)
    assert plan[4] == partition and plan[2] == parts * len(seq_lens)
    # Contexts under two partitions never split; a bound on the items makes partitions longer.
    lens, cu = _lens([500], [1])
    assert ops.plan_paged_attention(lens, cu, 8, 1, 64, "cpu").split is False
    lens, cu = _lens([4000], [1])
    assert ops.paged_attention_plan(lens, cu, 8, 1, "cpu", max_items=4)[4] == 1024


@pytest.mark.cuda
@requires_cuda
def test_cuda_planner_splits_only_when_the_device_would_idle():
    # Batch 1 fills no GPU: split. 256 sequences x 8 KV heads fill 4 waves of any GPU of up to
    # 256 / 4 x 8 / 2 = 256 SMs at 2 blocks per SM: no split.
    lens, cu = _lens([32768], [1])
    assert ops.paged_attention_plan(lens, cu, 32, 8, "cuda")[4] < 32768
    lens, cu = _lens([4096] * 256, [1] * 256)
    assert ops.paged_attention_plan(lens, cu, 32, 8, "cuda")[4] == 4096


def planned(plan):
    """paged_attention_run through ``plan`` as a function of paged_attention's arguments (for
    Case.run and check_case)."""
    def fn(out, *args):
        ops.paged_attention_run(out, *args[:8], plan.plan, plan.workspace, *args[8:])
    return fn


def _run(case, plan, *, lse=True, mass=True):
    return check_case(case, planned(plan), lse=lse, mass=mass)


@pytest.mark.parametrize("seq_lens, q_lens", SHAPES)
@pytest.mark.parametrize("partition_size", [0, -1, 512, 256, 100, 16])
@pytest.mark.parametrize("dtype, cache_dtype", [(torch.float32, None),
                                                (torch.bfloat16, torch.float8_e4m3fn)])
def test_run_matches_reference(gen, seq_lens, q_lens, partition_size, dtype, cache_dtype):
    case = Case(gen, seq_lens=seq_lens, q_lens=q_lens, num_heads=8, num_kv_heads=2,
                head_size=64, block_size=16, dtype=dtype, cache_dtype=cache_dtype)
    plan = ops.plan_paged_attention(case.seq_lens, case.cu_seqlens_q, 8, 2, 64, "cpu",
                                    partition_size=partition_size)
    _run(case, plan)


def test_plan_buffers_reused_across_steps(gen):
    # A fixed capacity (as a captured CUDA graph needs): each step plans into the same plan and
    # workspace buffers; padding items do nothing.
    max_items, max_rows = 600, 400
    first = None
    for step, (seq_lens, q_lens) in enumerate([([900, 20], [1, 4]), ([2000], [3]),
                                               ([30, 3000, 600], [1, 1, 2])]):
        case = Case(gen, seq_lens=seq_lens, q_lens=q_lens, num_heads=4, num_kv_heads=1,
                    head_size=64, block_size=16)
        new = ops.plan_paged_attention(case.seq_lens, case.cu_seqlens_q, 4, 1, 64, "cpu",
                                       partition_size=256, max_items=max_items,
                                       max_partial_rows=max_rows)
        if first is None or first.plan.numel() != new.plan.numel():
            first = new  # the plan's length depends on B: one buffer per batch-size bucket
        else:
            first.plan.copy_(new.plan)
        assert new.num_items < max_items and new.split
        _run(case, first)


def test_split_and_unsplit_runs_agree(gen):
    case = Case(gen, seq_lens=[3000, 1200], q_lens=[5, 1], num_heads=8, num_kv_heads=1,
                head_size=128, block_size=32, dtype=torch.float16)
    results = []
    for partition_size in (-1, 256):
        plan = ops.plan_paged_attention(case.seq_lens, case.cu_seqlens_q, 8, 1, 128, "cpu",
                                        partition_size=partition_size)
        out, lse, _ = case.run(planned(plan), lse=True)
        results.append((out, lse))
    assert_close(results[0][0], results[1][0].float(), torch.float16)
    torch.testing.assert_close(results[0][1], results[1][1], rtol=2e-5, atol=2e-5)


def test_wide_block_table_costs_no_scratch(gen):
    # A table padded to 8192 blocks (a 128k-token model context at block size 16) around short
    # sequences: v2 and the dispatcher plan from the real lengths on CPU, so the scratch is that
    # of the real contexts (the CUDA grid launches would size it by the width).
    case = Case(gen, seq_lens=[1500, 700], q_lens=[1, 1], num_heads=8, num_kv_heads=1,
                head_size=64, block_size=16)
    wide = torch.zeros(2, 8192, dtype=torch.int32)
    wide[:, :case.block_tables.shape[1]] = case.block_tables
    case.block_tables = wide
    check_case(case, ops.paged_attention_v2, mass=True)
    plan = ops.plan_paged_attention(case.seq_lens, case.cu_seqlens_q, 8, 1, 64, "cpu",
                                    partition_size=512)
    assert plan.partial_rows == 3 + 2  # 3 partitions of 1500, 2 of 700
    _run(case, plan)


def _bad_plan(gen):
    case = Case(gen, seq_lens=[1200, 40], q_lens=[2, 1], num_heads=4, num_kv_heads=2,
                head_size=64, block_size=16)
    plan = ops.plan_paged_attention(case.seq_lens, case.cu_seqlens_q, 4, 2, 64, "cpu",
                                    partition_size=256)
    return case, plan


def _edit(index, value):
    def edit(plan):
        plan.plan = plan.plan.clone()
        plan.plan[index] = value
    return edit


BAD_PLANS = [
    ("magic", _edit(0, 7), "is not a plan"),
    ("num_seqs", _edit(1, 3), "was made for 3 sequences"),
    ("num_tokens", _edit(7, 9), "was made for 9 query tokens"),
    ("rows per item", _edit(6, 4), "another device type"),
    ("num_items past capacity", _edit(2, 1000), "header is inconsistent"),
    ("partition count", _edit(8, 2), "does not match sequence 0"),
    ("item sequence", _edit(8 + 4, 5), "names no sequence"),
    ("item repeated", _edit(8 + 4 + 5, 0), "out of order or repeated"),
    ("item missing", _edit(2, 5), "does not cover sequence"),
    ("workspace too small", lambda p: setattr(p, "workspace", p.workspace[:10]),
     "workspace must hold the plan's"),
    ("workspace dtype", lambda p: setattr(p, "workspace", p.workspace.double()), "workspace"),
    ("plan length", lambda p: setattr(p, "plan", p.plan[:-1]), "plan must have"),
    ("plan dtype", lambda p: setattr(p, "plan", p.plan.long()), "plan"),
    ("workspace aliases out", None, "workspace must not share memory with out"),
]


@pytest.mark.parametrize("what, edit, match", BAD_PLANS, ids=[b[0] for b in BAD_PLANS])
def test_bad_plans_are_rejected(gen, what, edit, match):
    case, plan = _bad_plan(gen)
    out = torch.full_like(case.query, 7.0)
    if edit is None:
        plan.workspace = torch.empty(10**6)
        out = plan.workspace[:out.numel()].view(out.shape)
    else:
        edit(plan)
    before = out.clone()
    with pytest.raises(RuntimeError, match=match):
        ops.paged_attention_run(out, *case.args()[:8], plan.plan, plan.workspace)
    if edit is not None:
        assert torch.equal(out, before), "a rejected call writes nothing"


BAD_REQUESTS = [
    ("seq_lens dtype", dict(seq_lens=torch.tensor([5], dtype=torch.int64)), "seq_lens"),
    ("cu size", dict(cu_seqlens_q=torch.tensor([0], dtype=torch.int32)), "cu_seqlens_q"),
    ("cu decreasing", dict(seq_lens=torch.tensor([5, 5], dtype=torch.int32),
                           cu_seqlens_q=torch.tensor([0, 2, 1], dtype=torch.int32)),
     "non-decreasing"),
    ("q_len > seq_len", dict(seq_lens=torch.tensor([1], dtype=torch.int32),
                             cu_seqlens_q=torch.tensor([0, 2], dtype=torch.int32)), "seq_lens"),
    ("heads", dict(num_heads=6, num_kv_heads=4), "multiple of num_kv_heads"),
    ("device", dict(device="meta"), "device must be cpu or cuda"),
    ("partition_size", dict(partition_size=-5), "partition_size"),
    ("max_items too small", dict(max_items=1), "too small"),
]


@pytest.mark.parametrize("what, changes, match", BAD_REQUESTS, ids=[b[0] for b in BAD_REQUESTS])
def test_bad_plan_requests(what, changes, match):
    args = dict(seq_lens=torch.tensor([5], dtype=torch.int32),
                cu_seqlens_q=torch.tensor([0, 1], dtype=torch.int32), num_heads=8,
                num_kv_heads=1, device="cpu", partition_size=0, max_items=None)
    if what == "max_items too small":
        args.update(seq_lens=torch.tensor([5, 5], dtype=torch.int32),
                    cu_seqlens_q=torch.tensor([0, 1, 2], dtype=torch.int32))
    args.update(changes)
    with pytest.raises(RuntimeError, match=match):
        ops.paged_attention_plan(**args)


def test_opcheck(gen):
    case, plan = _bad_plan(gen)
    out = torch.empty_like(case.query)
    lse = torch.empty(case.query.shape[:2])
    torch.library.opcheck(torch.ops.pagedspec.paged_attention_run,
                          (out, *case.args()[:8], plan.plan, plan.workspace, None, None, lse,
                           None))
    lens, cu = case.seq_lens, case.cu_seqlens_q
    torch.library.opcheck(torch.ops.pagedspec.paged_attention_plan,
                          (lens, cu, 4, 2, torch.device("cpu"), 256, 64, -1))


# ---- CUDA: the same plans on the GPU's work items, and a captured graph replanned per step ----
@pytest.mark.cuda
@requires_cuda
@pytest.mark.parametrize("seq_lens, q_lens", SHAPES)
@pytest.mark.parametrize("partition_size", [0, -1, 512, 100])
@pytest.mark.parametrize("cache_dtype", [None, torch.float8_e5m2])
def test_run_matches_reference_cuda(gen, seq_lens, q_lens, partition_size, cache_dtype):
    case = Case(gen, seq_lens=seq_lens, q_lens=q_lens, num_heads=8, num_kv_heads=2,
                head_size=128, block_size=16, dtype=torch.bfloat16, cache_dtype=cache_dtype,
                device="cuda")
    plan = ops.plan_paged_attention(case.seq_lens.cpu(), case.cu_seqlens_q.cpu(), 8, 2, 128,
                                    "cuda", partition_size=partition_size)
    _run(case, plan)


@pytest.mark.cuda
@requires_cuda
def test_cuda_graph_replays_new_plans(gen):
    # Capture one run with plan and workspace buffers of a fixed capacity, then for each new
    # step write its plan into the buffer and replay: the graph follows the plan.
    max_items, max_rows = 512, 256
    cases = [Case(gen, seq_lens=s, q_lens=[1, 1], num_heads=8, num_kv_heads=1, head_size=128,
                  block_size=16, dtype=torch.bfloat16, device="cuda")
             for s in ([3000, 40], [600, 3000], [3000, 41])]  # one max: one shape
    # One cache / table / query buffer set, overwritten per step (as an engine's static inputs).
    static = cases[0]
    out = torch.empty_like(static.query)
    plan = ops.plan_paged_attention(static.seq_lens.cpu(), static.cu_seqlens_q.cpu(), 8, 1, 128,
                                    "cuda", partition_size=256, max_items=max_items,
                                    max_partial_rows=max_rows)
    args = list(static.args())
    run = lambda: ops.paged_attention_run(out, *args[:8], plan.plan, plan.workspace)  # noqa
    run()  # warm-up outside the graph
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    for case in cases:
        for dst, src in zip(args[:6], case.args()[:6]):
            if dst.shape != src.shape:
                pytest.skip("cases must share shapes for one graph")
            dst.copy_(src)
        new = ops.plan_paged_attention(case.seq_lens.cpu(), case.cu_seqlens_q.cpu(), 8, 1, 128,
                                       "cuda", partition_size=256, max_items=max_items,
                                       max_partial_rows=max_rows)
        plan.plan.copy_(new.plan)
        graph.replay()
        want, _, _ = case.expected()
        assert_close(out, want, torch.bfloat16)
