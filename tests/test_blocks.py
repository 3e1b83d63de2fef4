"""Block manager: allocation, copy-on-write, prefix caching, eviction, rollback and swap.

The stateful test runs random interleavings against a real (tiny) KV cache: every step's block
moves are applied with the ops and every token's K/V is written with reshape_and_cache, so the
test checks the bookkeeping invariants and also that each table really reads back its tokens.
"""
from __future__ import annotations

import hashlib
import sys
from array import array

import pytest
import torch
from hypothesis import HealthCheck, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import pagedspec
from pagedspec import ops
from pagedspec.engine import BlockManager, Evictor, KVCache, hash_block
from pagedspec.engine.kv_cache import HUGE_PAGE_BYTES, empty_on_huge_pages

# ---- helpers -----------------------------------------------------------------------------------
BS = 8
HEAD = 64


def make_cache(num_blocks, num_cpu_blocks=0):
    kv = KVCache(1, num_blocks, BS, 1, HEAD, torch.float32, "cpu", num_cpu_blocks)
    for t in kv.key_caches + kv.value_caches + kv.cpu_key_caches + kv.cpu_value_caches:
        t.fill_(float("nan"))  # never-written slots read as NaN
    return kv


def write_tokens(kv, slots, tokens):
    """Store token id t as K = t, V = -t in its slot (what a forward pass would do)."""
    if not slots:
        return
    key = torch.tensor(tokens, dtype=torch.float32)[:, None, None].expand(-1, 1, HEAD).contiguous()
    ops.reshape_and_cache(key, -key, kv.key_caches[0], kv.value_caches[0],
                          torch.tensor(slots, dtype=torch.int64))


def slot(bm, seq_id, pos):
    return bm.tables[seq_id].blocks[pos // BS] * BS + pos % BS


def read_tokens(kv, bm, seq_id, n):
    table = bm.tables[seq_id]
    k, v = ((kv.cpu_key_caches[0], kv.cpu_value_caches[0]) if table.on_cpu
            else (kv.key_caches[0], kv.value_caches[0]))
    slots = [table.blocks[p // BS] * BS + p % BS for p in range(n)]
    keys = k.view(-1, HEAD)[slots]
    assert torch.equal(v.view(-1, HEAD)[slots], -keys)
    assert torch.equal(keys, keys[:, :1].expand_as(keys))
    return keys[:, 0].tolist()


def run_prompt(bm, kv, seq_id, tokens):
    """Admit, compute (write) and commit a prompt; returns the number of cached tokens."""
    cached = bm.allocate(seq_id, tokens)
    kv.apply(bm.end_step())
    write_tokens(kv, [slot(bm, seq_id, p) for p in range(cached, len(tokens))], tokens[cached:])
    bm.cache_blocks(seq_id, tokens, len(tokens))
    return cached


# ---- unit tests --------------------------------------------------------------------------------
def test_hash_is_stable_chained_and_salted():
    tokens = list(range(BS))
    expected = int.from_bytes(hashlib.blake2b(array("q", tokens).tobytes(), digest_size=8)
                              .digest(), "little", signed=True)
    assert hash_block(None, tokens) == expected          # no per-process randomness
    assert hash_block(None, tokens, b"tenant") != expected
    child = hash_block(expected, tokens)
    assert child != expected and child == hash_block(expected, tokens)
    assert -(2**63) <= child < 2**63


def test_tables_grow_one_block_at_a_time():
    bm = BlockManager(16, BS, enable_prefix_caching=False)
    assert bm.allocate(0, [1] * 3) == 0
    sizes = []
    for _ in range(40):
        assert bm.append_slots(0, 1)
        t = bm.tables[0]
        sizes.append(len(t.blocks))
        assert len(t.blocks) * BS - t.num_tokens < BS  # waste < one block
    assert sizes == [-(-n // BS) for n in range(4, 44)]
    assert bm.num_free_blocks == 16 - 6
    bm.free(0)
    assert bm.num_free_blocks == 16
    bm.check_invariants()


def test_allocation_fails_cleanly_when_pool_is_short():
    bm = BlockManager(4, BS)
    assert bm.allocate(0, list(range(3 * BS))) == 0
    assert bm.allocate(1, list(range(100, 100 + 2 * BS))) is None  # needs 2, 1 free
    assert 1 not in bm.tables
    assert not bm.append_slots(0, 2 * BS)
    assert bm.tables[0].num_tokens == 3 * BS
    assert bm.allocate(1, list(range(100, 100 + 2 * BS)), max_new_tokens=BS) == 0  # a chunk fits
    bm.check_invariants()


def test_prefix_hit_reuses_blocks_with_the_right_contents():
    bm, kv = BlockManager(32, BS), make_cache(32)
    prompt = [7 + i for i in range(3 * BS + 5)]
    assert run_prompt(bm, kv, 0, prompt) == 0
    shared_blocks = bm.tables[0].blocks[:3]
    other = prompt[:2 * BS] + [999] * (BS + 2)
    assert run_prompt(bm, kv, 1, other) == 2 * BS       # first two blocks shared
    assert bm.tables[1].blocks[:2] == shared_blocks[:2]
    assert bm.tables[1].blocks[2] != shared_blocks[2]
    assert [bm.ref_counts[b] for b in shared_blocks] == [2, 2, 1]
    bm.free(0)
    bm.free(1)
    # After both are gone the blocks stay cached: a later request still hits all three.
    assert run_prompt(bm, kv, 2, prompt[:3 * BS] + [5]) == 3 * BS
    assert bm.tables[2].blocks[:3] == shared_blocks
    assert read_tokens(kv, bm, 2, 3 * BS + 1) == prompt[:3 * BS] + [5]
    # The last token is always computed, even if its whole block is cached.
    assert run_prompt(bm, kv, 3, prompt[:3 * BS]) == 2 * BS
    assert bm.num_hit_blocks == 2 + 3 + 2
    bm.check_invariants()


def test_salt_separates_caches():
    bm = BlockManager(16, BS, salt=b"a")
    bm.allocate(0, list(range(2 * BS + 1)))
    bm.cache_blocks(0, list(range(2 * BS + 1)), 2 * BS + 1)
    other = BlockManager(16, BS, salt=b"b")
    assert other.hash_blocks(list(range(BS)), 1) != bm.tables[0].hashes[:1]


def test_copy_on_write_copies_exactly_the_shared_last_block():
    bm, kv = BlockManager(32, BS), make_cache(32)
    prompt = list(range(1, 2 * BS + 4))                     # last block partly filled
    run_prompt(bm, kv, 0, prompt)
    for child in (1, 2, 3):
        bm.fork(0, child)
    blocks = list(bm.tables[0].blocks)
    assert all(bm.ref_counts[b] == 4 for b in blocks)
    for seq_id in (0, 1, 2, 3):                             # one decode step for all four
        assert bm.append_slots(seq_id, 1)
    moves = bm.end_step()
    # Three copies of the shared last block, one per sequence that was not the last holder.
    assert moves.copies[:, 0].tolist() == [blocks[-1]] * 3
    dsts = moves.copies[:, 1].tolist()
    assert len(set(dsts)) == 3 and not set(dsts) & set(blocks)
    assert bm.tables[3].blocks == blocks                   # the last one writes in place
    assert all(bm.tables[s].blocks[:-1] == blocks[:-1] for s in (0, 1, 2))
    kv.apply(moves)
    for seq_id in range(4):
        write_tokens(kv, [slot(bm, seq_id, len(prompt))], [100 + seq_id])
        assert read_tokens(kv, bm, seq_id, len(prompt) + 1) == prompt + [100 + seq_id]
    # A full shared block is never copied: the next token goes to a fresh block.
    bm.fork(0, 4)
    for _ in range(BS):
        bm.append_slots(4, 1)
    assert bm.end_step().copies.numel() == 0 or bm.tables[4].blocks[:-2] == blocks[:-1]
    bm.check_invariants()


def test_blocks_read_by_this_steps_moves_are_not_reused_in_the_step():
    bm = BlockManager(6, BS)
    bm.allocate(0, list(range(BS + 1)))                     # 2 blocks, last partial
    bm.end_step()
    bm.fork(0, 1)
    assert bm.append_slots(1, 1)                            # CoW: src = 0's last block
    src = bm.tables[0].blocks[-1]
    bm.free(0)                                              # src unowned but still to be read
    assert src in bm.deferred
    bm.allocate(2, list(range(50, 50 + 2 * BS)))
    bm.fork(2, 3)
    bm.truncate(3, 3)
    assert bm.append_slots(3, 1)                            # another CoW in the same step
    moves = bm.end_step()
    srcs, dsts = moves.copies[:, 0].tolist(), moves.copies[:, 1].tolist()
    assert len(set(dsts)) == len(dsts) and not set(srcs) & set(dsts)
    assert src not in bm.deferred and src in bm.free_blocks
    bm.check_invariants()


def test_truncate_frees_blocks_and_drafts_never_enter_the_cache():
    bm, kv = BlockManager(16, BS), make_cache(16)
    prompt = list(range(1, BS + 3))
    run_prompt(bm, kv, 0, prompt)
    free_before = bm.num_free_blocks
    drafts = list(range(500, 500 + 2 * BS))                # fills block 1 and all of block 2
    bm.append_slots(0, len(drafts))
    tokens = prompt + drafts
    write_tokens(kv, [slot(bm, 0, p) for p in range(len(prompt), len(tokens))], drafts)
    bm.cache_blocks(0, tokens, len(prompt))                # only verified tokens
    assert len(bm.cached) == 1
    bm.truncate(0, 2 * BS - 1)                             # one draft accepted
    assert bm.num_free_blocks == free_before
    bm.cache_blocks(0, tokens[:len(prompt) + 1], len(prompt) + 1)
    assert len(bm.cached) == 1                              # block 1 is not full yet
    assert bm.tables[0].num_tokens == len(prompt) + 1
    with pytest.raises(ValueError, match="cannot drop"):
        bm.truncate(0, 100)
    bm.check_invariants()


def test_truncating_into_a_cached_block_takes_it_out_of_the_cache_before_writing():
    bm, kv = BlockManager(16, BS), make_cache(16)
    prompt = list(range(1, 2 * BS + 2))
    run_prompt(bm, kv, 0, prompt)
    assert len(bm.cached) == 2
    bm.truncate(0, 2)                                      # back into block 1 (cached, sole holder)
    assert len(bm.tables[0].hashes) == 1
    block1 = bm.tables[0].blocks[1]
    bm.append_slots(0, 1)
    assert bm.tables[0].blocks[1] == block1 and bm.block_hash[block1] is None
    assert len(bm.cached) == 1
    # Shared: the same situation copies instead.
    run_prompt(bm, kv, 1, list(range(1, 2 * BS + 1)) + [3])  # caches its own block 1
    bm.fork(1, 2)
    bm.truncate(2, 2)
    assert bm.append_slots(2, 1)
    assert bm.end_step().copies.shape == (1, 2)
    bm.check_invariants()


def test_swap_out_and_in_round_trip():
    bm, kv = BlockManager(8, BS, num_cpu_blocks=4), make_cache(8, 4)
    prompt = list(range(10, 10 + 2 * BS + 3))
    run_prompt(bm, kv, 0, prompt)
    gpu_blocks = list(bm.tables[0].blocks)
    assert bm.swap_out(0)
    assert bm.tables[0].on_cpu and bm.num_free_blocks == 5   # read by this step's swap
    moves = bm.end_step()
    assert bm.num_free_blocks == 8
    assert moves.swap_out[:, 0].tolist() == gpu_blocks
    kv.apply(moves)
    assert read_tokens(kv, bm, 0, len(prompt)) == prompt
    bm.allocate(1, list(range(6 * BS + 1)), max_new_tokens=6 * BS)  # needs 7: 2 cached blocks go
    assert not bm.swap_in(0)
    bm.free(1)
    assert bm.swap_in(0, extra_tokens=1)
    kv.apply(bm.end_step())
    assert read_tokens(kv, bm, 0, len(prompt)) == prompt
    assert bm.num_free_cpu_blocks == 4
    bm.check_invariants()


def test_swap_space_full_and_written_sequences_are_refused():
    bm = BlockManager(8, BS, num_cpu_blocks=1)
    bm.allocate(0, list(range(2 * BS)))
    assert not bm.swap_out(0)                              # 2 blocks, 1 CPU block
    bm = BlockManager(8, BS, num_cpu_blocks=4)
    bm.allocate(0, list(range(BS + 1)))
    bm.end_step()
    bm.fork(0, 1)
    bm.append_slots(1, 1)
    with pytest.raises(RuntimeError, match="end_step"):
        bm.swap_out(1)                                     # its block is this step's copy dst
    bm.end_step()
    assert bm.swap_out(1)


def test_lru_evicts_least_recently_freed_tail_first():
    ev = Evictor("lru")
    ev.push([5, 6], [105, 106])
    ev.push([7], [107])
    ev.remove(6)
    assert [ev.pop(), ev.pop()] == [5, 7] and len(ev) == 0


def test_popularity_keeps_frequently_requested_blocks():
    ev = Evictor("popularity", num_blocks=64)
    ev.record_access([1, 1, 1, 2])                          # content 1 asked for three times
    ev.record_access([1])
    ev.push([10, 20, 30], [1, 2, 3])                        # 10 holds the popular content
    # 30 was never looked up (generated output): it ranks like 20, asked for once; ties go LRU.
    assert [ev.pop(), ev.pop(), ev.pop()] == [20, 30, 10]
    ev = Evictor("lru")
    ev.push([10, 20, 30], [1, 2, 3])
    assert ev.pop() == 10


def test_sketch_decays_and_old_fame_fades():
    ev = Evictor("popularity", num_blocks=64, decay_period=4)
    ev.record_access([1] * 3)
    ev.push([10], [1])                                      # priority log2(3) in epoch 0
    assert ops.cms_query(ev.sketch, torch.tensor([1])).item() == 3
    ev.record_access([2] * 4)                               # 4 increments: halve, epoch 1
    assert ops.cms_query(ev.sketch, torch.tensor([1, 2])).tolist() == [1, 2]
    ev.push([20], [2])                                      # log2(2) + 1: above block 10
    ev.record_access([3])
    ev.push([30], [3])                                      # log2(1) + 1: below block 10
    assert [ev.pop(), ev.pop(), ev.pop()] == [30, 10, 20]


def test_evictor_compacts_stale_entries():
    ev = Evictor("lru")
    for i in range(500):
        ev.push([i], [i])
        ev.remove(i)
    assert len(ev._heap) < 200 and len(ev) == 0


def test_kv_eviction_drops_blocks_only_from_the_evicting_table():
    """A shared prefix block evicted by one sequence stays in the other's table; a block nobody
    holds any more returns to the pool (to the prefix cache when its content is registered); the
    kept blocks do not move; evicted tables stop registering prefix blocks."""
    bm = BlockManager(12, BS)
    prompt = list(range(3 * BS + 2))
    bm.allocate(0, prompt)
    bm.cache_blocks(0, prompt, len(prompt))
    bm.end_step()
    bm.allocate(1, prompt[:2 * BS] + [99, 98, 97])       # shares blocks 0 and 1 of sequence 0
    bm.end_step()
    shared, own = bm.tables[0].blocks[1], bm.tables[0].blocks[2]
    assert bm.tables[1].blocks[1] == shared and bm.ref_counts[shared] == 2
    kept = bm.tables[0].blocks[0]
    bm.evict(0, [1, 2])
    t0 = bm.tables[0]
    assert t0.blocks[0] == kept and t0.logical == [0, 3] and t0.num_evicted == 2 * BS
    assert t0.num_tokens == BS + 2 and bm.ref_counts[shared] == 1
    assert bm.tables[1].blocks[1] == shared               # still the other sequence's
    assert own in bm.evictor and bm.block_hash[own] is not None   # a valid prefix, cached
    bm.append_slots(0, BS)                                # grows past the evicted blocks
    assert bm.tables[0].logical == [0, 3, 4]
    bm.cache_blocks(0, prompt + [1] * BS, 100)            # no registration after an eviction
    assert len(bm.tables[0].hashes) == 1
    bm.check_invariants()
    with pytest.raises(ValueError, match="not its last"):
        bm.evict(0, [2])                                  # the last block
    with pytest.raises(ValueError, match="full blocks"):
        bm.evict(1, [2])                                  # a partly filled block
    bm.free(0)
    bm.free(1)
    bm.end_step()
    bm.check_invariants()
    assert bm.num_free_blocks == 12


def test_fp8_pool_and_sizing():
    kv = KVCache(2, 4, BS, 2, HEAD, torch.float8_e4m3fn, "cpu", 2)
    assert kv.key_caches[0].shape == (4, BS, 2, HEAD)
    assert kv.key_caches[0].dtype == torch.float8_e4m3fn
    assert KVCache.bytes_per_block(2, BS, 2, HEAD, torch.float8_e4m3fn) == 2 * 2 * BS * 2 * HEAD
    bm = BlockManager(4, BS, 2)
    bm.allocate(0, list(range(BS + 1)))
    bm.end_step()
    bm.fork(0, 1)
    bm.append_slots(1, 1)
    bm.swap_out(0)
    kv.apply(bm.end_step())                                # FP8 copy and swap run


def _smaps_kib(address, field="AnonHugePages"):
    """A field of /proc/self/smaps (KiB: AnonHugePages, Rss) for the mapping that holds
    `address`."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= address < hi
            elif inside and head == field + ":":
                return int(line.split()[1])
    return 0


def _thp_mode():
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return f.read().split("[")[1].split("]")[0]
    except (OSError, IndexError):
        return "absent"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_cpu_caches_on_huge_pages_read_as_plain_ones(dtype):
    """Each CPU cache starts at its huge-page offset (K aligned, V half a page past), is backed by
    huge pages where the kernel offers them, and the ops read it exactly as a plain tensor."""
    blocks, bs, heads, head = 256, 16, 4, 128                      # 4 MiB per bf16 cache
    kv = KVCache(2, blocks, bs, heads, head, dtype, "cpu")
    huge = HUGE_PAGE_BYTES
    for k, v in zip(kv.key_caches, kv.value_caches):
        assert k.shape == v.shape == (blocks, bs, heads, head) and k.dtype == v.dtype == dtype
        assert k.is_contiguous() and v.is_contiguous()
        assert k.data_ptr() % huge == 0 and v.data_ptr() % huge == huge // 2
        # Zeroed, so resident from the start: a step that first reaches a block pays no
        # page fault (a 2 MiB one per layer made one batch-64 decode step in ~20 twice as long).
        assert not k.view(torch.uint8).any() and not v.view(torch.uint8).any()
        if sys.platform.startswith("linux"):
            for cache in (k, v):
                assert _smaps_kib(cache.data_ptr(), "Rss") * 1024 >= cache.nbytes
    plain_k = torch.randn(blocks, bs, heads, head).to(dtype)
    plain_v = torch.randn(blocks, bs, heads, head).to(dtype)
    kv.key_caches[1].copy_(plain_k)
    kv.value_caches[1].copy_(plain_v)
    if sys.platform.startswith("linux") and _thp_mode() in ("always", "madvise"):
        assert _smaps_kib(kv.key_caches[1].data_ptr()) > 0
        assert _smaps_kib(kv.value_caches[1].data_ptr()) > 0
    tables = torch.randperm(blocks, dtype=torch.int32)[:64].view(2, 32)
    seq_lens = torch.tensor([500, 77], dtype=torch.int32)
    query = torch.randn(2, 4 * heads, head, dtype=torch.bfloat16)
    cu = torch.tensor([0, 1, 2], dtype=torch.int32)
    one = torch.tensor(1.0) if dtype == torch.float8_e4m3fn else None
    outs = []
    for k, v in ((kv.key_caches[1], kv.value_caches[1]), (plain_k, plain_v)):
        out = torch.empty_like(query)
        ops.paged_attention(out, query, k, v, tables, seq_lens, cu, 1, head ** -0.5, one, one)
        outs.append(out)
    assert torch.equal(outs[0], outs[1])


def test_small_caches_and_bad_offsets():
    small = empty_on_huge_pages((4, 8), torch.float32, 4096)       # under a huge page: plain
    assert small.shape == (4, 8) and small.is_contiguous()
    with pytest.raises(ValueError, match="offset must be a multiple of 4096"):
        empty_on_huge_pages((1 << 20,), torch.float32, 100)
    with pytest.raises(ValueError, match="offset"):
        empty_on_huge_pages((1 << 20,), torch.float32, HUGE_PAGE_BYTES)


# ---- stateful property test --------------------------------------------------------------------
POOL, CPU_POOL = 20, 12
PREFIXES = [[(7 * i + j) % 23 for j in range(5 * BS)] for i in range(3)]


class BlockMachine(RuleBasedStateMachine):
    """Random add / append / verify / fork / truncate / free / swap / preempt / evict / step
    sequences."""

    @initialize(eviction=st.sampled_from(["popularity", "lru"]))
    def setup(self, eviction):
        self.bm = BlockManager(POOL, BS, CPU_POOL, eviction=eviction, decay_period=32)
        self.kv = make_cache(POOL, CPU_POOL)
        self.tokens: dict[int, list[int]] = {}    # seq -> its tokens (the model of the truth)
        self.verified: dict[int, int] = {}        # seq -> tokens that may enter the cache
        self.pending: dict[int, set[int]] = {}    # seq -> positions to write at the step's end
        self.touched: set[int] = set()            # seqs written by this step
        self.known: dict[int, list[int]] = {}     # content hash -> the tokens it names
        self.next_id = 0

    def _pick(self, i, on_gpu=None):
        ids = sorted(s for s in self.tokens
                     if on_gpu is None or self.bm.tables[s].on_cpu != on_gpu)
        return ids[i % len(ids)] if ids else None

    @rule(prompts=st.lists(st.tuples(
        st.integers(0, 2), st.sampled_from([0, 3, BS, BS + 1, 2 * BS, 3 * BS + 2, 5 * BS]),
        st.lists(st.integers(100, 120), max_size=2 * BS), st.integers(1, 6 * BS)),
        min_size=1, max_size=3))
    def add(self, prompts):
        for prefix, keep, suffix, chunk in prompts:
            self._add(PREFIXES[prefix][:keep] + suffix, chunk)

    def _add(self, tokens, chunk):
        if not tokens:
            return
        seq = self.next_id
        cached = self.bm.allocate(seq, tokens, max_new_tokens=chunk)
        if cached is None:
            return
        self.next_id += 1
        n = self.bm.num_tokens(seq)
        self.tokens[seq] = tokens[:n]
        self.verified[seq] = cached
        self.pending[seq] = set(range(cached, n))
        self.touched.add(seq)
        assert cached % BS == 0 and cached < len(tokens)
        assert self.tokens[seq][:cached] == [t for h in self.bm.tables[seq].hashes
                                             for t in self.known[h]]

    @precondition(lambda self: self.tokens)
    @rule(i=st.integers(0, 99), new=st.lists(st.integers(100, 120), min_size=1, max_size=BS + 3))
    def append(self, i, new):
        self._append(self._pick(i, on_gpu=True), new)

    @precondition(lambda self: self.tokens)
    @rule(new=st.integers(100, 120))
    def decode_step(self, new):
        """One token for every sequence on the GPU in one step: the copy-on-writes batch up."""
        for seq in sorted(self.tokens):
            if not self.bm.tables[seq].on_cpu:
                self._append(seq, [new + seq % 7])
        self.end_step()

    def _append(self, seq, new):
        if seq is None or not self.bm.append_slots(seq, len(new)):
            return
        start = len(self.tokens[seq])
        self.tokens[seq] += new
        self.pending[seq].update(range(start, start + len(new)))
        self.touched.add(seq)
        for p in range(start, start + len(new)):  # fresh slots are this sequence's alone
            block = self.bm.tables[seq].blocks[p // BS]
            assert self.bm.ref_counts[block] == 1 and self.bm.block_hash[block] is None

    @precondition(lambda self: self.tokens)
    @rule(i=st.integers(0, 99), n=st.integers(0, 3 * BS) | st.just(10**6))
    def verify(self, i, n):
        self._verify(self._pick(i, on_gpu=True), n)

    def _verify(self, seq, n):
        if seq is None:
            return
        written = min([len(self.tokens[seq])] + list(self.pending[seq]))
        self.verified[seq] = max(self.verified[seq], min(written, self.verified[seq] + n))
        self.bm.cache_blocks(seq, self.tokens[seq], self.verified[seq])
        table = self.bm.tables[seq]
        for k, h in enumerate(table.hashes):
            self.known.setdefault(h, self.tokens[seq][k * BS:(k + 1) * BS])
            assert self.known[h] == self.tokens[seq][k * BS:(k + 1) * BS]

    @precondition(lambda self: self.tokens)
    @rule(i=st.integers(0, 99), then_append=st.lists(st.integers(100, 120), max_size=3))
    def fork(self, i, then_append):
        seq = self._pick(i, on_gpu=True)
        if seq is None or seq in self.touched:
            return  # forks happen between steps, after the parent's tokens are computed
        child = self.next_id
        self.next_id += 1
        self.bm.fork(seq, child)
        self.tokens[child] = list(self.tokens[seq])
        self.verified[child] = self.verified[seq]
        self.pending[child] = set()
        if then_append:
            self._append(child, then_append)

    @precondition(lambda self: self.tokens)
    @rule(i=st.integers(0, 99), n=st.integers(0, 2 * BS))
    def truncate(self, i, n):
        seq = self._pick(i, on_gpu=True)
        if seq is None:
            return
        n = min(n, len(self.tokens[seq]) - 1)
        self.bm.truncate(seq, n)
        del self.tokens[seq][len(self.tokens[seq]) - n:]
        self.verified[seq] = min(self.verified[seq], len(self.tokens[seq]))
        self.pending[seq] = {p for p in self.pending[seq] if p < len(self.tokens[seq])}

    def _drop(self, seq):
        self.bm.free(seq)
        for d in (self.tokens, self.verified, self.pending):
            del d[seq]
        self.touched.discard(seq)

    @precondition(lambda self: self.tokens)
    @rule(i=st.integers(0, 99), finish=st.booleans())
    def free(self, i, finish):
        seq = self._pick(i)
        if finish and not self.bm.tables[seq].on_cpu:
            self._verify(seq, 10**6)  # a finished sequence leaves its blocks in the prefix cache
        self._drop(seq)

    @precondition(lambda self: self.tokens)
    @rule(i=st.integers(0, 99))
    def swap_out(self, i):
        seq = self._pick(i, on_gpu=True)
        if seq is None or seq in self.touched:
            return  # as in the scheduler: only sequences not run in this step are preempted
        self.bm.swap_out(seq)

    @precondition(lambda self: self.tokens)
    @rule(i=st.integers(0, 99), picks=st.lists(st.integers(0, 99), min_size=1, max_size=3))
    def evict(self, i, picks):
        """KV eviction between steps: whole full blocks (never the last) leave the table; the
        model of the truth is the cache's contents in cache order."""
        seq = self._pick(i, on_gpu=True)
        if seq is None or seq in self.touched:
            return
        table = self.bm.tables[seq]
        evictable = min(self.bm.num_tokens(seq) // BS, len(table.blocks) - 1)
        if evictable <= 0:
            return
        drop = sorted({p % evictable for p in picks})
        self.bm.evict(seq, drop)
        verified_blocks = self.verified[seq] // BS
        for k in reversed(drop):
            del self.tokens[seq][k * BS:(k + 1) * BS]
        self.verified[seq] -= BS * sum(1 for k in drop if k < verified_blocks)

    @precondition(lambda self: self.tokens)
    @rule(i=st.integers(0, 99), extra=st.integers(0, BS))
    def swap_in(self, i, extra):
        seq = self._pick(i, on_gpu=False)
        if seq is not None and self.bm.swap_in(seq, extra):
            self.touched.add(seq)

    @precondition(lambda self: self.tokens)
    @rule()
    def preempt_newest(self):
        """The scheduler's move: the newest sequence not run in this step is swapped out if
        swap space allows, else dropped for recomputation."""
        idle = [s for s in self.tokens if s not in self.touched and not self.bm.tables[s].on_cpu]
        if idle and not self.bm.swap_out(max(idle)):
            self._drop(max(idle))

    @precondition(lambda self: self.tokens)
    @rule()
    def end_step(self):
        moves = self.bm.end_step()
        for m in (moves.swap_out, moves.swap_in, moves.copies):
            assert len(set(m[:, 1].tolist())) == len(m)    # no repeated destination
        assert not set(moves.copies[:, 0].tolist()) & set(moves.copies[:, 1].tolist())
        self.kv.apply(moves)
        slots, values = [], []
        for seq, positions in self.pending.items():
            for p in sorted(positions):
                slots.append(slot(self.bm, seq, p))
                values.append(self.tokens[seq][p])
            positions.clear()
        assert len(set(slots)) == len(slots), "one slot handed to two sequences"
        write_tokens(self.kv, slots, values)
        self.touched.clear()
        for seq, tokens in self.tokens.items():
            assert read_tokens(self.kv, self.bm, seq, len(tokens)) == tokens
        for h, block in self.bm.cached.items():              # cached contents are right
            assert h in self.known, "a block entered the cache without verification"
            assert self.kv.key_caches[0][block, :, 0, 0].tolist() == self.known[h]

    @invariant()
    def pool_is_consistent(self):
        if not hasattr(self, "bm"):
            return
        self.bm.check_invariants()
        for seq, tokens in self.tokens.items():
            assert self.bm.num_tokens(seq) == len(tokens)
            assert len(self.bm.tables[seq].hashes) <= self.verified[seq] // BS


TestBlockMachine = BlockMachine.TestCase
TestBlockMachine.settings = settings(max_examples=100, stateful_step_count=50, deadline=None,
                                     suppress_health_check=[HealthCheck.too_slow])
