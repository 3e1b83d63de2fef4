"""The paged KV cache tensors of every layer (and their CPU swap space), and the block moves
applied to them through :mod:`pagedspec.ops`."""
from __future__ import annotations

from typing import Sequence

import torch

from pagedspec import ops
from pagedspec.engine.block_manager import BlockOps


class KVCache:
    """The KV cache tensors of all layers in the contract's layout, ``[NB, BS, Hkv, D]`` each,
    plus CPU swap space (pinned when the cache is on a CUDA device, so swaps are one kernel).

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
        make = lambda: torch.empty(shape, dtype=dtype, device=self.device)  # noqa: E731
        make_cpu = lambda: torch.empty(cpu_shape, dtype=dtype, pin_memory=pin)  # noqa: E731
        self.key_caches = [make() for _ in range(num_layers)]
        self.value_caches = [make() for _ in range(num_layers)]
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
