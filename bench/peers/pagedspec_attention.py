"""pagedspec side of the peer benchmark (run with the main venv's python).

For each case: builds the inputs from the case's seed as python/pagedspec/bench/cases_attention.py
builds them (paged K/V cache at block size 16, random block tables, Llama-3-8B heads) and saves
them to ``<data-dir>/<key>.pt`` for the vLLM worker (torch.save here, torch.load there: the two
sides see the same bytes whatever their torch versions); a data file that exists is loaded instead,
so every round of the driver times the same inputs.

Columns it measures, each in this process, with this process's copy bandwidth:

* ``pagedspec``: ``pagedspec.ops.paged_attention`` on the paged cache (block size 16).
* ``sdpa``: torch's own fast path, ``torch.nn.functional.scaled_dot_product_attention`` on K/V
  already gathered (untimed) into contiguous ``[B, Hkv, S, D]`` tensors, with the query heads of a
  KV head's group folded into the query rows (so K/V are read once, as a paged kernel reads them)
  and, for verification, the causal mask (query token j sees positions 0 .. S - q_len + j). For
  FP8 the gathered K/V are dequantized to bf16 first, so SDPA reads bf16 there.

With ``--outputs`` it writes pagedspec's, SDPA's and (for small cases) the pure-PyTorch
reference's outputs to ``<out-dir>`` for the driver's agreement check, without timing. Otherwise
it times: one JSON line per (case, thread count) on stdout.

    python bench/peers/pagedspec_attention.py --cases '[{"batch":8,"context":2048,"q_len":1,
        "dtype":"bf16","threads":[1,2]}]' --data-dir /tmp/peers-data [--outputs --out-dir DIR]
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

import pagedspec  # noqa: E402
from pagedspec import ops, reference  # noqa: E402


def build_inputs(case: dict) -> dict:
    """The case's inputs, built from its seed the way cases_attention.py builds them."""
    torch.manual_seed(case["seed"])
    batch, context, q_len = case["batch"], case["context"], case["q_len"]
    cache_dtype, query_dtype = common.torch_dtypes(case["dtype"])
    bs = common.PAGEDSPEC_BLOCK_SIZE
    blocks_per_seq = math.ceil(context / bs)
    num_blocks = batch * blocks_per_seq
    shape = (num_blocks, bs, common.NUM_KV_HEADS, common.HEAD_SIZE)
    fp8 = case["dtype"] == "fp8e4m3"
    init_dtype = torch.bfloat16 if fp8 else cache_dtype
    key_cache = torch.randn(shape, dtype=init_dtype).to(cache_dtype)
    value_cache = torch.randn(shape, dtype=init_dtype).to(cache_dtype)
    block_tables = torch.randperm(num_blocks).view(batch, blocks_per_seq).int()
    seq_lens = torch.full((batch,), context, dtype=torch.int32)
    cu_seqlens_q = torch.arange(batch + 1, dtype=torch.int32) * q_len
    query = torch.randn(batch * q_len, common.NUM_HEADS, common.HEAD_SIZE, dtype=query_dtype)
    return {"query": query, "key_cache": key_cache, "value_cache": value_cache,
            "block_tables": block_tables, "seq_lens": seq_lens, "cu_seqlens_q": cu_seqlens_q,
            "q_len": q_len, "scale": common.HEAD_SIZE ** -0.5, "block_size": bs,
            "dtype": case["dtype"], "k_scale": 1.0, "v_scale": 1.0}


def save_inputs(data: dict, path: str) -> None:
    """FP8 caches are saved as their uint8 bytes (plain integer tensors load the same in any
    torch); the vLLM worker views them back."""
    saved = dict(data)
    if data["dtype"] == "fp8e4m3":
        saved["key_cache"] = data["key_cache"].view(torch.uint8)
        saved["value_cache"] = data["value_cache"].view(torch.uint8)
    tmp = path + f".tmp{os.getpid()}"
    torch.save(saved, tmp)
    os.replace(tmp, path)


def inputs_for(case: dict, data_dir: str) -> dict:
    path = os.path.join(data_dir, common.case_key(case) + ".pt")
    if os.path.exists(path):
        return common.load_inputs(path)
    data = build_inputs(case)
    os.makedirs(data_dir, exist_ok=True)
    save_inputs(data, path)
    return data


def paged_args(data: dict, out: torch.Tensor) -> tuple:
    fp8 = data["dtype"] == "fp8e4m3"
    k_scale = torch.tensor(data["k_scale"]) if fp8 else None
    v_scale = torch.tensor(data["v_scale"]) if fp8 else None
    return (out, data["query"], data["key_cache"], data["value_cache"], data["block_tables"],
            data["seq_lens"], data["cu_seqlens_q"], data["q_len"], data["scale"], k_scale, v_scale)


def gather_contiguous(data: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of every sequence gathered through the block table into contiguous
    ``[B, Hkv, S, D]`` tensors (FP8 dequantized to bf16). All sequences have the same length."""
    bs = data["block_size"]
    seq_len = int(data["seq_lens"][0])
    positions = torch.arange(seq_len)
    slots = (data["block_tables"].long()[:, positions // bs] * bs + positions % bs)  # [B, S]
    out = []
    for cache in (data["key_cache"], data["value_cache"]):
        flat = cache.view(-1, cache.shape[2], cache.shape[3])
        rows = flat[slots]  # [B, S, Hkv, D]
        if data["dtype"] == "fp8e4m3":
            rows = rows.to(torch.bfloat16)
        out.append(rows.permute(0, 2, 1, 3).contiguous())
    return out[0], out[1]


class Sdpa:
    """SDPA with GQA folded into the query rows: row j * G + g of KV head h is query token j of
    query head h * G + g, so each KV head's K/V are read once for its whole group."""

    def __init__(self, data: dict):
        self.k, self.v = gather_contiguous(data)
        query = data["query"]
        q_len = data["q_len"]
        batch = data["seq_lens"].numel()
        hkv = self.k.shape[1]
        group = query.shape[1] // hkv
        self.shape = (batch, q_len, hkv, group, query.shape[2])
        # [B*q, Hq, D] -> [B, q, Hkv, G, D] -> [B, Hkv, q, G, D] -> [B, Hkv, q*G, D]
        self.q = (query.view(self.shape).permute(0, 2, 1, 3, 4)
                  .reshape(batch, hkv, q_len * group, query.shape[2]).contiguous())
        self.mask = None
        if q_len > 1:
            seq_len = self.k.shape[2]
            rows = torch.arange(q_len).repeat_interleave(group)  # query token of each row
            self.mask = (torch.arange(seq_len)[None, :]
                         <= (seq_len - q_len + rows)[:, None])  # [q*G, S] bool, True = attend
        self.scale = data["scale"]

    def __call__(self) -> torch.Tensor:
        return torch.nn.functional.scaled_dot_product_attention(
            self.q, self.k, self.v, attn_mask=self.mask, scale=self.scale)

    def unfold(self, out: torch.Tensor) -> torch.Tensor:
        batch, q_len, hkv, group, d = self.shape
        return (out.view(batch, hkv, q_len, group, d).permute(0, 2, 1, 3, 4)
                .reshape(batch * q_len, hkv * group, d))


def write_outputs(case: dict, data: dict, out_dir: str, ref_max_tokens: int) -> dict:
    key = common.case_key(case)
    os.makedirs(out_dir, exist_ok=True)
    out = torch.empty_like(data["query"])
    ops.paged_attention(*paged_args(data, out))
    torch.save(out, os.path.join(out_dir, f"pagedspec_{key}.pt"))
    sdpa = Sdpa(data)
    torch.save(sdpa.unfold(sdpa()).contiguous(), os.path.join(out_dir, f"sdpa_{key}.pt"))
    has_ref = case["batch"] * case["context"] <= ref_max_tokens
    if has_ref:
        ref = torch.empty_like(data["query"])
        reference.paged_attention(*paged_args(data, ref))
        torch.save(ref, os.path.join(out_dir, f"reference_{key}.pt"))
    return {"outputs": ["pagedspec", "sdpa"] + (["reference"] if has_ref else [])}


def time_case(case: dict, data: dict, budget_s: float, copy_budget_s: float) -> list[dict]:
    nbytes = common.bytes_moved(case)
    out = torch.empty_like(data["query"])
    args = paged_args(data, out)
    sdpa = Sdpa(data)
    sdpa_bytes = (sdpa.k.numel() * sdpa.k.element_size() * 2
                  + 2 * data["query"].numel() * data["query"].element_size())
    records = []
    for threads in case["threads"]:
        torch.set_num_threads(threads)
        copy_bps = common.copy_bandwidth(budget_s=copy_budget_s)
        ps_s, ps_reps = common.time_call(lambda: ops.paged_attention(*args), budget_s=budget_s)
        sd_s, sd_reps = common.time_call(sdpa, budget_s=budget_s)
        records.append({
            "side": "pagedspec", "case": common.case_name(case), "key": common.case_key(case),
            "threads": threads, "bytes": nbytes, "copy_gbps": copy_bps / 1e9,
            "impls": {
                "pagedspec": {"ms": ps_s * 1e3, "gbps": nbytes / ps_s / 1e9, "reps": ps_reps,
                              "block_size": data["block_size"]},
                "sdpa": {"ms": sd_s * 1e3, "gbps": sdpa_bytes / sd_s / 1e9, "reps": sd_reps,
                         "bytes": sdpa_bytes},
            },
            **common.machine_info(common.pagedspec_kernel(pagedspec.build_info()))})
    return records


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", required=True, help="JSON list of cases, or @file")
    parser.add_argument("--data-dir", required=True, help="shared input .pt files")
    parser.add_argument("--outputs", action="store_true",
                        help="write outputs for the agreement check instead of timing")
    parser.add_argument("--out-dir", help="where --outputs writes (default: --data-dir)")
    parser.add_argument("--budget", type=float, default=0.5, help="seconds timed per column")
    parser.add_argument("--copy-budget", type=float, default=0.5)
    parser.add_argument("--ref-max-tokens", type=int, default=16384,
                        help="also write the pure-PyTorch reference where batch*context <= this")
    args = parser.parse_args(argv)
    for case in common.load_cases(args.cases):
        t0 = time.perf_counter()
        data = inputs_for(case, args.data_dir)
        if args.outputs:
            torch.set_num_threads(max(case["threads"]))
            info = write_outputs(case, data, args.out_dir or args.data_dir, args.ref_max_tokens)
            common.emit({"side": "pagedspec", "case": common.case_name(case),
                         "key": common.case_key(case), "setup_s": time.perf_counter() - t0,
                         **info,
                         **common.machine_info(common.pagedspec_kernel(pagedspec.build_info()))})
        else:
            for record in time_case(case, data, args.budget, args.copy_budget):
                common.emit(record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
