"""The paged KV cache tensors of every layer (and their CPU swap space), and the block moves
applied to them through :mod:`pagedspec.ops`."""
from __future__ import annotations

import math
import mmap
from typing import Sequence

import torch

from pagedspec import ops
from pagedspec.engine.block_manager import BlockOps


HUGE_PAGE_BYTES = 2 << 20  # an x86-64 (and arm64 4 KiB-granule) transparent huge page


def empty_on_huge_pages(shape: Sequence[int], dtype: torch.dtype, offset: int = 0) -> torch.Tensor:
    """An uninitialized contiguous CPU tensor in fresh anonymous memory that Linux is asked
    (``MADV_HUGEPAGE``) to back with transparent huge pages, starting ``offset`` bytes (a multiple
    of 4096 below ``HUGE_PAGE_BYTES``) past a huge-page boundary. Tensors under one huge page,
    and systems without the advice, get ``torch.empty``.

    Why: the attention kernels read a sequence's blocks scattered across the whole cache, so on
    4 KiB pages a large cache misses the TLB on almost every block. Give the K and V caches of a
    layer different offsets: on huge pages both would otherwise put a slot at the same low 21
    address bits, and in one measurement that ran FP8 decode 20% slower than 4 KiB pages did
    (bench/NOTES.md).
    """
    if offset % 4096 or not 0 <= offset < HUGE_PAGE_BYTES:
        raise ValueError(f"empty_on_huge_pages: offset must be a multiple of 4096 in "
                         f"[0, {HUGE_PAGE_BYTES}), got {offset}")
    nbytes = math.prod(int(size) for size in shape) * dtype.itemsize
    if nbytes < HUGE_PAGE_BYTES or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.empty(tuple(shape), dtype=dtype)
    # Its own mapping, never touched before the advice (torch.empty may reuse malloc'd memory
    # already faulted in on small pages); the tensor keeps the mapping alive.
    region = mmap.mmap(-1, nbytes + offset + HUGE_PAGE_BYTES,
                       flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # shared memory: no THP
    raw = torch.frombuffer(region, dtype=torch.uint8)
    aligned = (-raw.data_ptr()) % HUGE_PAGE_BYTES
    try:
        region.madvise(mmap.MADV_HUGEPAGE, aligned, offset + nbytes)
    except OSError:
        pass  # THP compiled out or refused: 4 KiB pages, same contents
    start = aligned + offset
    return raw[start:start + nbytes].view(dtype).view(tuple(shape))


class KVCache:
    """The KV cache tensors of all layers in the contract's layout, ``[NB, BS, Hkv, D]`` each,
    plus CPU swap space (pinned when the cache is on a CUDA device, so swaps are one kernel).
    On the CPU each cache is on transparent huge pages where Linux offers them
    (:func:`empty_on_huge_pages`), the V caches half a huge page past the K caches' alignment,
    and zeroed at creation (resident from the start: no step pays a page fault).

    FP8 caches (``float8_e4m3fn`` / ``float8_e5m2``) carry one per-tensor scale per layer,
    ``k_scales[layer]`` / ``v_scales[layer]`` (float32 ``[]``, 1.0 until set): stored value =
    ``saturate(x / scale)``.
    """

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_size: int, dtype: torch.dtype = torch.float16,
                 device: torch.device | str = "cpu", num_cpu_blocks: int = 0):
        self.device = torch.device(device)
        shape = (num_blocks, block_size, num_kv_heads, head_size)
        cpu_shape = (num_cpu_blocks, *shape[1:])
        pin = self.device.type == "cuda"
        def make(offset: int) -> torch.Tensor:
            if self.device.type == "cpu":
                # Written once now, so the pages are faulted in here and not in the steps that
                # first reach a block: the free list hands out every block before reusing one,
                # and on a VM each 2 MiB fault in reshape_and_cache cost so much that one
                # decode step in about 20 took twice as long (SmolLM2, batch 64: 146 ms of
                # faults in a 120 ms step) until the whole cache had been touched.
                return empty_on_huge_pages(shape, dtype, offset).zero_()
            return torch.empty(shape, dtype=dtype, device=self.device)

        make_cpu = lambda: torch.empty(cpu_shape, dtype=dtype, pin_memory=pin)  # noqa: E731
        self.key_caches = [make(0) for _ in range(num_layers)]
        self.value_caches = [make(HUGE_PAGE_BYTES // 2) for _ in range(num_layers)]
        self.cpu_key_caches = [make_cpu() for _ in range(num_layers)]
        self.cpu_value_caches = [make_cpu() for _ in range(num_layers)]
        self.dtype = dtype
        ones = lambda: torch.ones((), dtype=torch.float32, device=self.device)  # noqa: E731
        self.k_scales = [ones() for _ in range(num_layers)]
        self.v_scales = [ones() for _ in range(num_layers)]

    @property
    def is_fp8(self) -> bool:
        return self.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)

    def set_scales(self, k_scales: Sequence[float], v_scales: Sequence[float]) -> None:
        """Per-layer FP8 scales (positive, finite); call before anything is cached."""
        for name, scales in (("k_scales", k_scales), ("v_scales", v_scales)):
            if len(scales) != len(self.key_caches):
                raise ValueError(f"KVCache.set_scales: {name} has {len(scales)} entries, "
                                 f"expected one per layer ({len(self.key_caches)})")
            bad = [s for s in scales if not (0 < float(s) < float("inf"))]
            if bad:
                raise ValueError(f"KVCache.set_scales: {name} must be positive and finite, "
                                 f"got {bad[0]}")
        for dst, src in ((self.k_scales, k_scales), (self.v_scales, v_scales)):
            for t, value in zip(dst, src):
                t.fill_(float(value))

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_size: int,
                        dtype: torch.dtype) -> int:
        """Bytes one block takes over all layers, K and V (size a pool from a memory budget)."""
        return 2 * num_layers * block_size * num_kv_heads * head_size * dtype.itemsize

    def apply(self, moves: BlockOps) -> None:
        """Run a step's block moves: swap out, swap in, then copy-on-write copies."""
        if moves.swap_out.numel():
            mapping = moves.swap_out.to(self.device)
            for src, dst in zip(self.key_caches + self.value_caches,
                                self.cpu_key_caches + self.cpu_value_caches):
                ops.swap_blocks(src, dst, mapping)
        if moves.swap_in.numel():
            mapping = moves.swap_in.to(self.device)
            for src, dst in zip(self.cpu_key_caches + self.cpu_value_caches,
                                self.key_caches + self.value_caches):
                ops.swap_blocks(src, dst, mapping)
        if moves.copies.numel():
            ops.copy_blocks(self.key_caches, self.value_caches, moves.copies.to(self.device))
