"""A tiny Llama-style decoder with random weights, for exercising the engine end to end.

RMSNorm, rotary position embeddings (rotate-half form) at each token's absolute position, grouped
query attention and a SwiGLU MLP. Weights come from a seeded ``torch.Generator``, so a seed names
a model (no downloads). The attention itself is a callback: the paged runner passes one that
writes the paged KV cache and calls :func:`pagedspec.ops.paged_attention`, a reference passes a
dense one; everything else is shared, so comparing the two checks exactly the paged path.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = 512
    hidden_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_size: int = 64            # a head size the paged-attention kernels support
    intermediate_size: int = 256
    rope_theta: float = 10000.0
    rms_eps: float = 1e-6
    logit_std: float = 4.0         # spread of the logits: clear argmaxes, non-flat softmax
    # Scales the layers' output projections (LayerScale). Small values leave the token embedding
    # dominant: the model is then nearly a bigram model, whose greedy output soon cycles, the
    # regime where n-gram drafts get accepted (speculative-decoding tests use that).
    layer_scale: float = 1.0


@dataclass
class LayerWeights:
    attn_norm: torch.Tensor        # [H]
    wq: torch.Tensor               # [Hq * D, H]
    wk: torch.Tensor               # [Hkv * D, H]
    wv: torch.Tensor               # [Hkv * D, H]
    wo: torch.Tensor               # [H, Hq * D]
    mlp_norm: torch.Tensor         # [H]
    w_gate: torch.Tensor           # [I, H]
    w_up: torch.Tensor             # [I, H]
    w_down: torch.Tensor           # [H, I]


# attend(layer, q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, D]) -> [T, Hq, D]; q and k carry RoPE.
AttendFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class TinyLlama:
    """Random-weight decoder; ``forward`` maps token ids at positions to logits."""

    def __init__(self, config: ModelConfig = ModelConfig(), seed: int = 0,
                 device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32):
        c = self.config = config
        self.device, self.dtype = torch.device(device), dtype
        g = torch.Generator().manual_seed(seed)

        def randn(*shape: int, std: float) -> torch.Tensor:
            return (torch.randn(shape, generator=g) * std).to(self.device, dtype)

        def norm_weight() -> torch.Tensor:
            return 1.0 + randn(c.hidden_size, std=0.1)

        H, I, D = c.hidden_size, c.intermediate_size, c.head_size
        # std 1/sqrt(fan_in) keeps activations O(1) through the layers.
        self.embed = randn(c.vocab_size, H, std=1.0)
        self.layers = [
            LayerWeights(norm_weight(), randn(c.num_heads * D, H, std=H ** -0.5),
                         randn(c.num_kv_heads * D, H, std=H ** -0.5),
                         randn(c.num_kv_heads * D, H, std=H ** -0.5),
                         randn(H, c.num_heads * D, std=c.layer_scale * (c.num_heads * D) ** -0.5),
                         norm_weight(), randn(I, H, std=H ** -0.5), randn(I, H, std=H ** -0.5),
                         randn(H, I, std=c.layer_scale * I ** -0.5))
            for _ in range(c.num_layers)]
        self.final_norm = norm_weight()
        self.lm_head = randn(c.vocab_size, H, std=c.logit_std * H ** -0.5)
        self.inv_freq = (c.rope_theta ** (-torch.arange(0, D, 2, dtype=torch.float64) / D)
                         ).to(self.device, torch.float32)

    @property
    def scale(self) -> float:
        return self.config.head_size ** -0.5

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.config.rms_eps)
        return x32.to(x.dtype) * weight

    def rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Rotate-half RoPE of ``x`` ``[T, heads, D]`` at int64 ``positions`` ``[T]``."""
        angles = positions.to(torch.float32)[:, None] * self.inv_freq        # [T, D/2]
        cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]
        x1, x2 = x.float().chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                attend: AttendFn) -> torch.Tensor:
        """Hidden states ``[T, H]`` after the final norm; ``attend`` does the attention."""
        c = self.config
        T, D = input_ids.numel(), c.head_size
        h = self.embed[input_ids]
        for i, w in enumerate(self.layers):
            x = self.rms_norm(h, w.attn_norm)
            q = self.rope(F.linear(x, w.wq).view(T, c.num_heads, D), positions)
            k = self.rope(F.linear(x, w.wk).view(T, c.num_kv_heads, D), positions)
            v = F.linear(x, w.wv).view(T, c.num_kv_heads, D)
            h = h + F.linear(attend(i, q, k, v).reshape(T, c.num_heads * D), w.wo)
            x = self.rms_norm(h, w.mlp_norm)
            h = h + F.linear(F.silu(F.linear(x, w.w_gate)) * F.linear(x, w.w_up), w.w_down)
        return self.rms_norm(h, self.final_norm)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits ``[T, V]`` of final hidden states."""
        return F.linear(hidden, self.lm_head).float()

    def dense_logits(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Reference: logits ``[n, V]`` of one whole sequence, contiguous K/V and causal SDPA."""
        c = self.config
        token_ids = token_ids.to(self.device)
        positions = torch.arange(token_ids.numel(), device=self.device)
        groups = c.num_heads // c.num_kv_heads

        def attend(_: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            q, k, v = (t.transpose(0, 1) for t in (q, k, v))                 # [heads, n, D]
            k, v = k.repeat_interleave(groups, 0), v.repeat_interleave(groups, 0)
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale)
            return out.transpose(0, 1)

        return self.logits(self.forward(token_ids, positions, attend))
