"""Runs every op that has a CUDA kernel once on small CUDA inputs, and checks it against the
reference: the workload bench/gpu_check.sh runs under compute-sanitizer (pytest is too slow to
start under the sanitizer). Ops without a CUDA kernel yet are reported and skipped."""
from __future__ import annotations

import sys

import torch

import pagedspec
from pagedspec import ops, reference


def has_cuda_kernel(name: str) -> bool:
    return torch._C._dispatch_has_kernel_for_dispatch_key(f"pagedspec::{name}", "CUDA")


def smoke_cache(dev: str) -> None:
    g = torch.Generator().manual_seed(0)
    key = torch.randn(37, 2, 128, generator=g).half().to(dev)
    value = torch.randn(37, 2, 128, generator=g).half().to(dev)
    slots = torch.randperm(64, generator=g)[:37].to(dev)
    slots[::5] = -1
    for dtype in (torch.float16, torch.float8_e4m3fn):
        kc = torch.zeros(4, 16, 2, 128, dtype=dtype, device=dev)
        vc = torch.zeros_like(kc)
        ek, ev = kc.cpu(), vc.cpu()
        scale = torch.tensor(0.25, device=dev)
        ops.reshape_and_cache(key, value, kc, vc, slots, scale, scale)
        reference.reshape_and_cache(key.cpu(), value.cpu(), ek, ev, slots.cpu(), scale.cpu(),
                                    scale.cpu())
        assert torch.equal(kc.cpu().view(torch.uint8), ek.view(torch.uint8))
    keys = [torch.randn(8, 16, 2, 128, device=dev) for _ in range(3)]
    values = [torch.randn(8, 16, 2, 128, device=dev) for _ in range(3)]
    want = [t.cpu() for t in keys + values]
    mapping = torch.tensor([[0, 5], [1, 6], [0, 7]])
    ops.copy_blocks(keys, values, mapping.to(dev))
    reference.copy_blocks(want[:3], want[3:], mapping)
    assert all(torch.equal(a.cpu(), b) for a, b in zip(keys + values, want))
    host = torch.randn(6, 16, 2, 128).pin_memory()
    for where in ("cpu", dev):
        gpu = torch.zeros(6, 16, 2, 128, device=dev)
        ops.swap_blocks(host, gpu, torch.tensor([[0, 5], [3, 1]]).to(where))
        torch.cuda.synchronize()
        assert torch.equal(gpu[5].cpu(), host[0]) and torch.equal(gpu[1].cpu(), host[3])


def smoke_fp8(dev: str) -> None:
    x = torch.randn(5, 4, 96).bfloat16().to(dev)
    scale = torch.rand(4, device=dev) + 0.5
    out = torch.empty(x.shape, dtype=torch.float8_e5m2, device=dev)
    want = torch.empty(x.shape, dtype=torch.float8_e5m2)
    ops.quantize_fp8(out, x, scale)
    reference.quantize_fp8(want, x.cpu(), scale.cpu())
    assert torch.equal(out.cpu().view(torch.uint8), want.view(torch.uint8))
    back = torch.empty_like(x)
    ops.dequantize_fp8(back, out, scale)


SMOKES = {"reshape_and_cache": smoke_cache, "quantize_fp8": smoke_fp8}


def main() -> int:
    if not pagedspec.build_info()["cuda_available"]:
        print("cuda_smoke: no CUDA device or no CUDA kernels; nothing to do")
        return 0
    for op, fn in SMOKES.items():
        if not has_cuda_kernel(op):
            print(f"cuda_smoke: {op}: no CUDA kernel, skipped")
            continue
        fn("cuda")
        torch.cuda.synchronize()
        print(f"cuda_smoke: {fn.__name__}: ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
