"""Benchmark cases for the CPU model runner's products of a few rows (``--op linear``).

One call runs every projection of a real model once, as a decode or verification step does: the
30 layers' q/k/v, o, gate/up and down matrices and the LM head of SmolLM2-135M (270 MB in bf16,
far more than any cache, so each step streams them from memory), on M input rows. The kernel is
``pagedspec_models::packed_linear`` on its packed layout; the reference, the peer it replaces,
is oneDNN's product on its own prepacked weights (``mkldnn::_linear_pointwise``: what the runner
used before, and what vLLM-CPU and ``torch.compile`` freezing use), or ``F.linear`` where oneDNN
does not compute the dtype. Bytes moved: the weights, read once.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedspec.bench.core import Workload, register

# SmolLM2-135M: hidden 576, 9 query / 3 KV heads of 64, intermediate 1536, vocabulary 49152.
SMOLLM2_STACK = [(960, 576), (576, 576), (3072, 576), (576, 1536)] * 30 + [(49152, 576)]


def _linear_case(rows: int, dtype: torch.dtype, quick: bool):
    name = f"linear/smollm2-135m-stack/M={rows}/{str(dtype).removeprefix('torch.')}"

    @register("linear", name, quick=quick, devices=("cpu",), rows=rows)
    def build(device) -> Workload:
        from pagedspec.models.llama import _prepacked, pack_linear_weight

        gen = torch.Generator().manual_seed(0)
        weights = [(torch.randn(n, k, generator=gen) * k ** -0.5).to(dtype)
                   for n, k in SMOLLM2_STACK]
        inputs = {k: torch.randn(rows, k, generator=gen).to(dtype) for _, k in SMOLLM2_STACK}
        packed = [pack_linear_weight(w) for w in weights]
        onednn = torch.backends.mkldnn.is_available() and (
            dtype == torch.float32 or torch.ops.mkldnn._is_mkldnn_bf16_supported())
        peer = [_prepacked(w) for w in weights] if onednn else weights
        del weights                      # the timed layouts only: less memory, no cache reuse
        op = torch.ops.pagedspec_models.packed_linear

        def run():
            for (_, k), w in zip(SMOLLM2_STACK, packed):
                op(inputs[k], w)

        def reference():
            for (_, k), w in zip(SMOLLM2_STACK, peer):
                if onednn:
                    torch.ops.mkldnn._linear_pointwise(inputs[k], w, None, "none", [], "")
                else:
                    F.linear(inputs[k], w)

        nbytes = sum(n * k for n, k in SMOLLM2_STACK) * torch.empty((), dtype=dtype).element_size()
        return Workload(run, nbytes, reference)


for _rows in (1, 2, 4, 8, 32):
    for _dtype in (torch.bfloat16, torch.float32):
        _linear_case(_rows, _dtype, quick=_rows == 1)
