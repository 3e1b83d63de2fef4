"""Fake (meta) kernels: output shapes and dtypes without computing, so ``torch.compile`` can trace
the ops and ``torch.library.opcheck`` can check their schemas. Ops that only mutate their
arguments return nothing, so their fake kernels do nothing."""
from __future__ import annotations

import torch
from torch.library import register_fake

_MUTATING_OPS = (
    "reshape_and_cache",
    "paged_attention_v1",
    "paged_attention_v2",
    "paged_attention",
    "quantize_fp8",
    "dequantize_fp8",
    "copy_blocks",
    "swap_blocks",
    "cms_update",
    "cms_decay",
)


def _register_noop(name: str) -> None:
    @register_fake(f"pagedspec::{name}")
    def _fake(*args, **kwargs) -> None:
        return None


for _name in _MUTATING_OPS:
    _register_noop(_name)


def _verify_outputs(draft_token_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    batch, k = draft_token_ids.shape
    output_token_ids = draft_token_ids.new_empty((batch, k + 1), dtype=torch.int64)
    num_accepted = draft_token_ids.new_empty((batch,), dtype=torch.int32)
    return output_token_ids, num_accepted


@register_fake("pagedspec::rejection_sample")
def _rejection_sample_fake(draft_token_ids, draft_probs, target_probs, uniform_accept,
                           uniform_resample, num_draft_tokens=None):
    return _verify_outputs(draft_token_ids)


@register_fake("pagedspec::greedy_verify")
def _greedy_verify_fake(draft_token_ids, target_token_ids, num_draft_tokens=None):
    return _verify_outputs(draft_token_ids)


@register_fake("pagedspec::cms_query")
def _cms_query_fake(sketch, keys):
    return keys.new_empty(keys.shape, dtype=torch.int32)
