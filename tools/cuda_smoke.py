"""Runs every op that has a CUDA kernel once on small CUDA inputs, and checks it against the
reference: the workload bench/gpu_check.sh runs under compute-sanitizer (pytest is too slow to
start under the sanitizer). Ops without a CUDA kernel yet are reported and skipped."""
from __future__ import annotations

import functools
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


def smoke_sampling(dev: str) -> None:
    """CPU and CUDA must emit identical tokens for the same uniforms (same summation order)."""
    g = torch.Generator().manual_seed(1)
    batch, k, vocab = 6, 3, 1000 + 3  # a vocabulary that is not a multiple of the vector width
    target = torch.softmax(torch.randn(batch, k + 1, vocab, generator=g) * 3, -1)
    draft = torch.softmax(torch.randn(batch, k, vocab, generator=g) * 3, -1)
    draft_ids = torch.randint(0, vocab, (batch, k), generator=g)
    u_accept = torch.rand(batch, k, generator=g)
    u_resample = torch.rand(batch, k + 1, generator=g)
    counts = torch.tensor([3, 0, 1, 2, 3, 3], dtype=torch.int32)
    for probs in (draft, None):
        args = (draft_ids, probs, target, u_accept, u_resample, counts)
        want = ops.rejection_sample(*args)
        got = ops.rejection_sample(*(a.to(dev) if a is not None else None for a in args))
        assert all(torch.equal(w, g_.cpu()) for w, g_ in zip(want, got)), (want, got)
    target_ids = torch.randint(0, vocab, (batch, k + 1), generator=g)
    target_ids[:, :2] = draft_ids[:, :2]
    want = ops.greedy_verify(draft_ids, target_ids, counts)
    got = ops.greedy_verify(draft_ids.to(dev), target_ids.to(dev), counts.to(dev))
    assert all(torch.equal(w, g_.cpu()) for w, g_ in zip(want, got))


def smoke_sketch(dev: str) -> None:
    """Plain and conservative updates, a query and a decay: bit-identical to the CPU kernels."""
    g = torch.Generator().manual_seed(2)
    keys = torch.randint(-(2**62), 2**62, (5000,), generator=g)
    keys[::7] = keys[0]  # duplicates within the batch
    increments = torch.randint(0, 1 << 20, (5000,), generator=g, dtype=torch.int32)
    for width in (1000, 1024):
        want = torch.zeros(4, width, dtype=torch.int32)
        got = want.to(dev)
        for conservative in (False, True):
            ops.cms_update(want, keys, increments, conservative)
            ops.cms_update(got, keys.to(dev), increments.to(dev), conservative)
        ops.cms_decay(want, 3)
        ops.cms_decay(got, 3)
        assert torch.equal(got.cpu(), want)
        assert torch.equal(ops.cms_query(got, keys.to(dev)).cpu(), ops.cms_query(want, keys))


def smoke_attention(dev: str) -> None:
    """v1, v2 and the dispatcher with lse and attn_mass, bf16 and FP8 caches, against the CPU
    kernel; unused cache slots hold NaN."""
    g = torch.Generator().manual_seed(3)
    seq_lens, q_lens, heads, kv_heads, head_size, block_size = [1, 17, 1300], [1, 2, 5], 8, 2, 128, 16
    blocks_per_seq = [(s + block_size - 1) // block_size for s in seq_lens]
    num_blocks = sum(blocks_per_seq) + 2
    perm = torch.randperm(num_blocks, generator=g)
    table = torch.zeros(len(seq_lens), max(blocks_per_seq), dtype=torch.int32)
    used = 0
    for i, n in enumerate(blocks_per_seq):
        table[i, :n] = perm[used:used + n]
        used += n
    cu = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32)
    tokens = int(cu[-1])
    query = torch.randn(tokens, heads, head_size, generator=g).bfloat16()
    for cache_dtype in (torch.bfloat16, torch.float8_e4m3fn):
        caches = []
        for _ in range(2):
            c = torch.full((num_blocks, block_size, kv_heads, head_size), float("nan"))
            for i, s in enumerate(seq_lens):
                for pos in range(s):
                    c[table[i, pos // block_size], pos % block_size] = torch.randn(
                        kv_heads, head_size, generator=g)
            caches.append(c.to(cache_dtype) if cache_dtype == torch.bfloat16
                          else c.clamp(-448, 448).to(cache_dtype))
        scale = torch.tensor(0.7)
        args_cpu = (query, *caches, table, torch.tensor(seq_lens, dtype=torch.int32), cu, 5,
                    head_size ** -0.5, scale, scale)
        def run(out, query, *rest, lse, attn_mass, partition_size):
            # paged_attention through a plan made for rest's device (rest[4]: cu_seqlens_q).
            device = query.device
            plan = ops.plan_paged_attention(rest[3].cpu(), rest[4].cpu(), heads, kv_heads,
                                            head_size, device, partition_size=partition_size)
            ops.paged_attention_run(out, query, *rest[:7], plan.plan, plan.workspace, *rest[7:],
                                    lse=lse, attn_mass=attn_mass)

        planned = [functools.partial(run, partition_size=p) for p in (0, -1, 256)]
        for fn in (ops.paged_attention_v1, ops.paged_attention_v2, ops.paged_attention, *planned):
            results = []
            for device, args in (("cpu", args_cpu), (dev, [a.to(dev) if torch.is_tensor(a) else a
                                                        for a in args_cpu])):
                out = torch.empty_like(args[0])
                lse = torch.empty(tokens, heads, device=device)
                mass = torch.zeros(num_blocks * block_size, device=device)
                fn(out, *args, lse=lse, attn_mass=mass)
                results.append((out.float().cpu(), lse.cpu(), mass.cpu()))
            (out_c, lse_c, mass_c), (out_g, lse_g, mass_g) = results
            torch.testing.assert_close(out_g, out_c, rtol=2e-2, atol=2e-2)  # bf16 output
            torch.testing.assert_close(lse_g, lse_c, rtol=1e-3, atol=1e-3)
            torch.testing.assert_close(mass_g, mass_c, rtol=1e-3, atol=1e-4)
            assert abs(float(mass_g.sum()) - heads * tokens) < 1e-2 * heads * tokens


SMOKES = {"reshape_and_cache": smoke_cache, "quantize_fp8": smoke_fp8,
          "rejection_sample": smoke_sampling, "cms_update": smoke_sketch,
          "paged_attention": smoke_attention}


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
