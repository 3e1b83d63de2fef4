"""The one interface through which the engine runs a model.

A model maps token ids at positions to hidden states and hidden states to logits; its attention is
a callback, so the model never sees the KV cache, the block tables or the scheduler. The paged
runner (:class:`pagedspec.engine.ModelRunner`) passes a callback that writes K/V with
``reshape_and_cache`` and reads them with ``paged_attention``; a test may pass a dense one.
Implementations live in :mod:`pagedspec.models` (one file per architecture family).
"""
from __future__ import annotations

from typing import Any, Callable, Protocol, Sequence

import torch

# attend(layer, q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, D]) -> [T, Hq, D], in the model's dtype.
# q and k already carry the position encoding; k and v may be strided views (last dim dense).
AttendFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
# One layer's attention: attend(q, k, v), the same shapes.
LayerAttendFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class CausalLM(Protocol):
    """What the engine needs of a decoder-only model."""

    num_layers: int
    num_heads: int           # query heads
    num_kv_heads: int
    head_size: int
    vocab_size: int
    max_position: int        # positions the position encoding is defined for
    scale: float             # softmax scale of the attention logits
    device: torch.device
    dtype: torch.dtype       # activations and weights
    layers: Sequence[Any]    # each layer's weights, opaque to the engine, passed back below

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                attend: AttendFn) -> torch.Tensor:
        """Final-norm hidden states ``[T, hidden]`` of int64 ``input_ids`` ``[T]`` at int64
        ``positions`` ``[T]``: ``final_norm`` of every ``decoder_layer`` in turn on
        ``embed_input``."""
        ...

    # The forward in pieces, for a compiler that takes one layer at a time (every layer runs the
    # same code on other weights, so one graph serves them all).
    def embed_input(self, input_ids: torch.Tensor, positions: torch.Tensor
                    ) -> tuple[torch.Tensor, Any]:
        """The hidden states ``[T, hidden]`` entering layer 0 and the per-token position state
        (tensors) every layer reads. A model with ``takes_features = True`` (an EAGLE draft
        head) takes a third argument, ``features`` ``[T, hidden]``, one per input token."""
        ...

    def decoder_layer(self, weights: Any, hidden: torch.Tensor, position_state: Any,
                      attend: LayerAttendFn) -> torch.Tensor:
        """Layer ``weights`` (an element of ``layers``) on ``hidden``; a function of its
        arguments only."""
        ...

    def final_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits ``[T, vocab_size]`` of hidden states ``[T, hidden]``."""
        ...

    def prepack_weights(self) -> bool:
        """Re-lays weights out for the device's fastest eager products where that helps;
        returns whether it did. The runner calls it for eager (not compiled) models."""
        ...

    def restrict_vocab(self, token_ids: torch.Tensor) -> None:
        """Makes :meth:`compute_logits` return the logits of ``token_ids`` only (int64 ``[N]``)
        and ``vocab_size`` N: a draft's reduced vocabulary."""
        ...
