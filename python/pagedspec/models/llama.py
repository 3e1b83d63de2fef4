"""The Llama architecture family as ``transformers`` defines it: ``LlamaForCausalLM``,
``Qwen2ForCausalLM`` (biased q/k/v projections) and ``MistralForCausalLM`` (without a sliding
window shorter than the context).

Pre-norm decoder: RMSNorm, rotary position embeddings (rotate-half form; default, ``linear`` and
``llama3`` frequency scaling), grouped-query attention with any ratio of query to KV heads, a
SwiGLU MLP, tied or untied embeddings. The arithmetic follows ``transformers`` step for step
(norms in float32, rotations and residual sums in the model's dtype) so logits agree to the
rounding of the matrix products. Projections that read the same input are fused at load time
(q/k/v into one matrix, gate/up into another): one GEMM each instead of three or two.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Callable, Mapping, NamedTuple, Optional

import torch
import torch.nn.functional as F

from pagedspec.engine.model import AttendFn

ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM")
MODEL_TYPES = ("llama", "qwen2", "mistral")
# config.json key of an EAGLE draft head (:class:`EagleDraft`), and its input projection
EAGLE_KEY = "pagedspec_eagle"
EAGLE_FC = "fc.weight"


class ConfigError(ValueError):
    """A ``config.json`` this implementation cannot run; the message names the key."""


@dataclass(frozen=True)
class LlamaConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: Optional[dict]       # None, or {"rope_type": "linear" | "llama3", ...}
    max_position: int
    tie_word_embeddings: bool
    attention_bias: bool               # q/k/v (and for Llama, o) projections carry a bias
    o_proj_bias: bool
    mlp_bias: bool
    sliding_window: Optional[int]      # None: full attention
    torch_dtype: Optional[str]
    eagle: bool = False                # an EAGLE draft head (EAGLE_KEY): it reads the target's
                                       # hidden states through fc.weight [H, 2H]

    @classmethod
    def from_dict(cls, cfg: Mapping, source: str = "config.json") -> "LlamaConfig":
        """Reads a ``transformers`` config dict (v4 or v5 spelling); ``source`` names it in errors."""

        def need(key: str):
            if key not in cfg or cfg[key] is None:
                raise ConfigError(f"{source}: missing required key {key!r}")
            return cfg[key]

        model_type = need("model_type")
        if model_type not in MODEL_TYPES:
            raise ConfigError(f"{source}: model_type {model_type!r} is not supported; expected "
                              f"one of {', '.join(MODEL_TYPES)}")
        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            raise ConfigError(f"{source}: hidden_act {act!r} is not supported; expected 'silu' "
                              "(SwiGLU)")
        hidden, heads = int(need("hidden_size")), int(need("num_attention_heads"))
        kv_heads = int(cfg.get("num_key_value_heads") or heads)
        if heads % kv_heads:
            raise ConfigError(f"{source}: num_attention_heads ({heads}) must be a multiple of "
                              f"num_key_value_heads ({kv_heads})")
        head_size = cfg.get("head_dim") or hidden // heads
        theta, scaling = _rope_parameters(cfg, source)
        qwen2 = model_type == "qwen2"
        window = cfg.get("sliding_window")
        if qwen2 and not cfg.get("use_sliding_window", False):
            window = None                    # Qwen2 keeps the key but ignores it by default
        dtype = cfg.get("torch_dtype") or cfg.get("dtype")
        return cls(
            model_type=model_type, vocab_size=int(need("vocab_size")), hidden_size=hidden,
            intermediate_size=int(need("intermediate_size")),
            num_layers=int(need("num_hidden_layers")), num_heads=heads, num_kv_heads=kv_heads,
            head_size=int(head_size), rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=theta, rope_scaling=scaling,
            max_position=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=qwen2 or bool(cfg.get("attention_bias", False)),
            o_proj_bias=(not qwen2) and bool(cfg.get("attention_bias", False)),
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            sliding_window=int(window) if window is not None else None,
            torch_dtype=str(dtype) if dtype is not None else None,
            eagle=bool(cfg.get(EAGLE_KEY)))

    def weight_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor a checkpoint of this config holds, by its ``transformers`` name."""
        H, I, D = self.hidden_size, self.intermediate_size, self.head_size
        q, kv = self.num_heads * D, self.num_kv_heads * D
        shapes = {"model.embed_tokens.weight": (self.vocab_size, H), "model.norm.weight": (H,)}
        if not self.tie_word_embeddings:
            shapes["lm_head.weight"] = (self.vocab_size, H)
        for i in range(self.num_layers):
            p = f"model.layers.{i}."
            shapes.update({
                p + "input_layernorm.weight": (H,), p + "post_attention_layernorm.weight": (H,),
                p + "self_attn.q_proj.weight": (q, H), p + "self_attn.k_proj.weight": (kv, H),
                p + "self_attn.v_proj.weight": (kv, H), p + "self_attn.o_proj.weight": (H, q),
                p + "mlp.gate_proj.weight": (I, H), p + "mlp.up_proj.weight": (I, H),
                p + "mlp.down_proj.weight": (H, I)})
            if self.attention_bias:
                shapes.update({p + "self_attn.q_proj.bias": (q,),
                               p + "self_attn.k_proj.bias": (kv,),
                               p + "self_attn.v_proj.bias": (kv,)})
            if self.o_proj_bias:
                shapes[p + "self_attn.o_proj.bias"] = (H,)
            if self.mlp_bias:
                shapes.update({p + "mlp.gate_proj.bias": (I,), p + "mlp.up_proj.bias": (I,),
                               p + "mlp.down_proj.bias": (H,)})
        if self.eagle:
            shapes[EAGLE_FC] = (H, 2 * H)
        return shapes

    @staticmethod
    def optional_weights(name: str) -> bool:
        """Tensors a checkpoint may carry that the model does not need: rotary buffers saved by
        old exports, and a copy of the embedding as ``lm_head`` in tied checkpoints. FP8 KV scales
        (``self_attn.k_scale`` / ``v_scale``) are read by the loader, not the model."""
        return (name.endswith("rotary_emb.inv_freq") or name == "lm_head.weight"
                or name.endswith(("self_attn.k_scale", "self_attn.v_scale")))


class PackedWeight(NamedTuple):
    """A projection's weight ``[N, K]`` for the CPU's products of few rows: ``packed`` in the
    layout of ``pagedspec_models::packed_linear`` (:func:`pack_linear_weight`), and ``onednn``,
    the same weight prepacked for oneDNN (or None), which products of more than
    :data:`PACKED_MAX_ROWS` rows take instead."""
    packed: torch.Tensor
    onednn: Optional[torch.Tensor]


def linear(x: torch.Tensor, weight, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for ``x`` ``[..., K]``, whatever the weight's layout: plain
    ``[N, K]``, a :class:`PackedWeight`, or prepacked for oneDNN (:func:`_prepacked`)."""
    if isinstance(weight, PackedWeight):
        rows = x.reshape(-1, x.shape[-1]).contiguous()
        out = torch.ops.pagedspec_models.packed_linear(rows, weight.packed, bias, weight.onednn,
                                                       PACKED_MAX_ROWS)
        return out.view(*x.shape[:-1], out.shape[-1])
    if weight.is_mkldnn:
        if torch.compiler.is_compiling():
            return _prepacked_linear(x, weight, bias)
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


@torch.library.custom_op("pagedspec_models::prepacked_linear", mutates_args=())
def _prepacked_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]
                      ) -> torch.Tensor:
    """oneDNN's product on a prepacked weight, opaque to ``torch.compile``: inductor lowers
    oneDNN's own op only for weights that are graph constants, and here they are arguments of
    the graph every group of layers shares. Eager calls skip this wrapper (its dispatch costs)."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


@_prepacked_linear.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


@torch.library.register_fake("pagedspec_models::packed_linear")
def _(input: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
      onednn_weight: Optional[torch.Tensor] = None, max_packed_rows: int = 4) -> torch.Tensor:
    return input.new_empty((input.shape[0], weight.shape[0] * weight.shape[2]))


# oneDNN's layout hint (rows per product). Any row count runs on the layout; a hint of 1 picks
# a matrix-vector layout on which 2-17 rows cost as much as with F.linear, any hint from 2 to 64
# one on which they cost 1.25-1.6x less, and one row the same (MILAN-VM, float32, 2026-12-07).
PREPACK_ROWS_HINT = 16
# Rows up to which packed_linear beats oneDNN on its prepacked weights (EPYC-VM, Zen 4, 2 threads,
# SmolLM2's projections, 2026-12-07: bfloat16 1.6-2.1x at 1-4 rows, 1.06-1.13x at 5-6, even at 8;
# float32 1.2-1.6x at 1-4, 0.85-0.9x at 5-6; 0.88-0.94x either way at 17-64 rows).
PACKED_MAX_ROWS = 4
# A model whose projections and LM head take at most this much keeps both layouts (every product
# at the faster kernel, the weights held twice); a larger one keeps the packed layout only.
BOTH_LAYOUTS_MAX_BYTES = 4 << 30


def _prepacked(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` ``[N, K]`` in oneDNN's blocked layout for the CPU (an opaque mkldnn tensor)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), PREPACK_ROWS_HINT)


def pack_linear_weight(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` ``[N, K]`` (float32 or bfloat16) in packed_linear's layout
    ``[N / 4, K / E, 4, E]``, E = 64 bytes' worth of elements (include/pagedspec/packed_linear.h).
    N must be a multiple of 16 and K of E."""
    n, k = weight.shape
    e = 64 // weight.element_size()
    if weight.dtype not in (torch.float32, torch.bfloat16) or not _packable(weight):
        raise ValueError(f"pack_linear_weight: weight must be float32 or bfloat16 [N, K] with N a "
                         f"multiple of 16 and K of {e}, got {weight.dtype} {list(weight.shape)}")
    return weight.contiguous().view(n // 4, 4, k // e, e).transpose(1, 2).contiguous()


def _packable(weight: torch.Tensor) -> bool:
    """Whether ``weight`` ``[N, K]`` has the packed layout's shape: N a multiple of 16 (a kernel
    task's rows), K of the 64 bytes' worth of elements in a chunk."""
    return weight.shape[0] % 16 == 0 and weight.shape[1] % (64 // weight.element_size()) == 0


def _is_prepacked(weight) -> bool:
    return isinstance(weight, PackedWeight) or weight.is_mkldnn


def _cpu_weight_packer(dtype: torch.dtype, nbytes: int) -> Optional[Callable]:
    """How :meth:`LlamaForCausalLM.prepack_weights` lays a CPU weight out: packed_linear's layout
    where its kernel runs at the avx512 level (the level it was measured fastest at), with
    oneDNN's beside it for larger products while the model is small enough
    (:data:`BOTH_LAYOUTS_MAX_BYTES`); oneDNN's alone elsewhere (float32, or bfloat16 where oneDNN
    computes it); None: plain weights."""
    from pagedspec import _C

    onednn = torch.backends.mkldnn.is_available() and (
        dtype == torch.float32
        or (dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported()))
    if dtype in (torch.float32, torch.bfloat16) and _C.cpu_isa() == "avx512":
        both = onednn and nbytes <= BOTH_LAYOUTS_MAX_BYTES

        def pack(w: torch.Tensor):
            if not _packable(w):
                return _prepacked(w) if onednn else w
            return PackedWeight(pack_linear_weight(w), _prepacked(w) if both else None)
        return pack
    return _prepacked if onednn else None


def _rope_parameters(cfg: Mapping, source: str) -> tuple[float, Optional[dict]]:
    """``(theta, scaling)`` from ``rope_parameters`` (transformers 5) or ``rope_theta`` +
    ``rope_scaling`` (earlier); scaling is None for the plain rotation."""
    params = cfg.get("rope_parameters")
    if isinstance(params, Mapping) and "rope_theta" not in params and params:
        # Per-layer-type parameters ({"full_attention": {...}}): one kind of layer here.
        params = next(iter(params.values()))
    if isinstance(params, Mapping):
        theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
        scaling = dict(params)
    else:
        theta = cfg.get("rope_theta", 10000.0)
        scaling = dict(cfg["rope_scaling"]) if cfg.get("rope_scaling") else None
    if scaling is not None:
        kind = scaling.get("rope_type", scaling.get("type", "default"))
        if kind == "default":
            scaling = None
        elif kind == "linear":
            scaling = {"rope_type": "linear", "factor": float(scaling["factor"])}
        elif kind == "llama3":
            try:
                scaling = {"rope_type": "llama3", "factor": float(scaling["factor"]),
                           "low_freq_factor": float(scaling["low_freq_factor"]),
                           "high_freq_factor": float(scaling["high_freq_factor"]),
                           "original_max_position_embeddings":
                               int(scaling["original_max_position_embeddings"])}
            except KeyError as exc:
                raise ConfigError(f"{source}: llama3 RoPE scaling is missing {exc}") from None
        else:
            raise ConfigError(f"{source}: RoPE scaling type {kind!r} is not supported; expected "
                              "'default', 'linear' or 'llama3'")
    return float(theta), scaling


def rope_inv_freq(config: LlamaConfig) -> torch.Tensor:
    """Float32 inverse frequencies ``[head_size / 2]``, scaled as the config asks (the formulas of
    ``transformers``' ``modeling_rope_utils``)."""
    D = config.head_size
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, D, 2, dtype=torch.int64).float() / D))
    s = config.rope_scaling
    if s is None:
        return inv_freq
    if s["rope_type"] == "linear":
        return inv_freq / s["factor"]
    # llama3: long wavelengths slowed by `factor`, short ones kept, a smooth ramp between.
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    low_freq_wavelen, high_freq_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(medium, smoothed, scaled)


@dataclass
class _Layer:
    input_norm: torch.Tensor           # [H]
    qkv: torch.Tensor                  # [(Hq + 2 Hkv) D, H]: q, k, v projections stacked
    qkv_bias: Optional[torch.Tensor]   # [(Hq + 2 Hkv) D]
    o: torch.Tensor                    # [H, Hq D]
    o_bias: Optional[torch.Tensor]     # [H]
    post_norm: torch.Tensor            # [H]
    gate_up: torch.Tensor              # [2 I, H]: gate, then up
    gate_up_bias: Optional[torch.Tensor]
    down: torch.Tensor                 # [H, I]
    down_bias: Optional[torch.Tensor]


class LlamaForCausalLM:
    """A Llama-family decoder over weights loaded by name (see :meth:`LlamaConfig.weight_shapes`).

    Implements :class:`pagedspec.engine.model.CausalLM`. ``get_weight(name)`` returns a checkpoint
    tensor (any dtype, on any device); it is converted to ``dtype`` on ``device``.
    """

    def __init__(self, config: LlamaConfig, get_weight: Callable[[str], torch.Tensor],
                 device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32):
        c = self.config = config
        self.device, self.dtype = torch.device(device), dtype
        self.num_layers, self.num_heads = c.num_layers, c.num_heads
        self.num_kv_heads, self.head_size = c.num_kv_heads, c.head_size
        self.vocab_size, self.max_position = c.vocab_size, c.max_position
        self.scale = c.head_size ** -0.5

        def w(name: str) -> torch.Tensor:
            return get_weight(name).to(self.device, dtype)

        def cat(*names: str) -> torch.Tensor:
            return torch.cat([w(n) for n in names]).contiguous()

        self.embed = w("model.embed_tokens.weight")
        self.layers: list[_Layer] = []
        for i in range(c.num_layers):
            p = f"model.layers.{i}."
            a, m = p + "self_attn.", p + "mlp."
            self.layers.append(_Layer(
                input_norm=w(p + "input_layernorm.weight"),
                qkv=cat(a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight"),
                qkv_bias=(cat(a + "q_proj.bias", a + "k_proj.bias", a + "v_proj.bias")
                          if c.attention_bias else None),
                o=w(a + "o_proj.weight"), o_bias=w(a + "o_proj.bias") if c.o_proj_bias else None,
                post_norm=w(p + "post_attention_layernorm.weight"),
                gate_up=cat(m + "gate_proj.weight", m + "up_proj.weight"),
                gate_up_bias=cat(m + "gate_proj.bias", m + "up_proj.bias") if c.mlp_bias else None,
                down=w(m + "down_proj.weight"),
                down_bias=w(m + "down_proj.bias") if c.mlp_bias else None))
        self.norm = w("model.norm.weight")
        self.lm_head = self.embed if c.tie_word_embeddings else w("lm_head.weight")
        # cos/sin for every position, computed as transformers does (float32, then cast), so a
        # lookup replaces the per-step trigonometry.
        angles = (torch.arange(c.max_position, dtype=torch.float32)[:, None]
                  * rope_inv_freq(c)[None, :])
        emb = torch.cat((angles, angles), dim=-1)
        self._cos = emb.cos().to(self.device, dtype)           # [max_position, D]
        self._sin = emb.sin().to(self.device, dtype)
        self._packer: Optional[Callable] = None   # how prepack_weights laid the weights out

    def _rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.config.rms_norm_eps)
        return weight * x32.to(x.dtype)

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate-half RoPE of ``x`` ``[T, heads, D]``; cos/sin ``[T, 1, D]``."""
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin

    def embed_input(self, input_ids: torch.Tensor, positions: torch.Tensor
                    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """The hidden states ``[T, hidden]`` that enter layer 0, and the rotary tables ``(cos,
        sin)``, each ``[T, 1, head_size]``, that every layer applies."""
        cos, sin = self._cos[positions][:, None, :], self._sin[positions][:, None, :]
        return self.embed[input_ids], (cos, sin)

    def decoder_layer(self, w: _Layer, h: torch.Tensor,
                      rope: tuple[torch.Tensor, torch.Tensor],
                      attend: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
                      ) -> torch.Tensor:
        """One decoder layer with weights ``w`` (an element of :attr:`layers`) on ``h``
        ``[T, hidden]``; ``attend(q, k, v)`` is the layer's attention. A function of its
        arguments only, so one compiled graph serves every layer."""
        T, Hq, Hkv, D = h.shape[0], self.num_heads, self.num_kv_heads, self.head_size
        cos, sin = rope
        x = self._rms_norm(h, w.input_norm)
        qkv = linear(x, w.qkv, w.qkv_bias)
        qk = self._rope(qkv[:, :(Hq + Hkv) * D].view(T, Hq + Hkv, D), cos, sin)
        v = qkv[:, (Hq + Hkv) * D:].view(T, Hkv, D)
        out = attend(qk[:, :Hq], qk[:, Hq:], v)
        h = h + linear(out.reshape(T, Hq * D), w.o, w.o_bias)
        x = self._rms_norm(h, w.post_norm)
        gate, up = linear(x, w.gate_up, w.gate_up_bias).chunk(2, dim=-1)
        return h + linear(F.silu(gate) * up, w.down, w.down_bias)

    def final_norm(self, h: torch.Tensor) -> torch.Tensor:
        return self._rms_norm(h, self.norm)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                attend: AttendFn) -> torch.Tensor:
        return self._layers_and_norm(*self.embed_input(input_ids, positions), attend)

    def _layers_and_norm(self, h: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                         attend: AttendFn) -> torch.Tensor:
        for i, w in enumerate(self.layers):
            h = self.decoder_layer(w, h, rope, lambda q, k, v, i=i: attend(i, q, k, v))
        return self.final_norm(h)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return linear(hidden, self.lm_head).float()

    def restrict_vocab(self, token_ids: torch.Tensor) -> None:
        """From now on :meth:`compute_logits` gives the logits of ``token_ids`` only (int64
        ``[N]``, column j for token ``token_ids[j]``) and ``vocab_size`` is N: a draft model's
        reduced vocabulary, whose LM head costs N / V of the full one. Before
        :meth:`prepack_weights`."""
        if _is_prepacked(self.lm_head):
            raise RuntimeError("LlamaForCausalLM.restrict_vocab: call it before prepack_weights")
        self.lm_head = self.lm_head[token_ids.to(self.device)].contiguous()
        self.vocab_size = token_ids.numel()

    def prepack_weights(self) -> bool:
        """Re-lays the projection and LM head matrices out for the CPU's products, where that is
        faster (:func:`_cpu_weight_packer`); returns whether it did. Products of a few rows, a
        decode step's or a verification's, then stream the weights at up to twice oneDNN's rate
        on its own layout, and oneDNN's on its layout costs far less than ``F.linear``'s, which
        re-packs the whole matrix on every call (PERFORMANCE.md); a compiled forward calls them
        through opaque ops. The results differ from ``F.linear``'s by the rounding of the
        float32 accumulation only."""
        if self.device.type != "cpu" or _is_prepacked(self.lm_head):
            return False
        nbytes = sum(t.numel() * t.element_size() for w in self.layers
                     for t in (w.qkv, w.o, w.gate_up, w.down))
        nbytes += self.lm_head.numel() * self.lm_head.element_size()
        pack = _cpu_weight_packer(self.dtype, nbytes)
        if pack is None:
            return False
        self.layers = [dataclasses.replace(w, qkv=pack(w.qkv), o=pack(w.o),
                                           gate_up=pack(w.gate_up), down=pack(w.down))
                       for w in self.layers]
        self.lm_head = pack(self.lm_head)
        self._packer = pack
        return True

    def loaded_weight(self, name: str) -> torch.Tensor:
        """The tensor the model holds for checkpoint tensor ``name``, in its dtype on its
        device, for those it keeps as stored (the embedding, the final norm): what a draft
        borrows from its target (:attr:`Checkpoint.borrowed_weights`) without a copy."""
        held = {"model.embed_tokens.weight": self.embed, "model.norm.weight": self.norm}
        if name not in held:
            raise KeyError(f"{name!r}: the model does not keep it as stored; it keeps "
                           f"{', '.join(held)}")
        return held[name]


class EagleDraft(LlamaForCausalLM):
    """An EAGLE-style draft head (Li et al. 2024): Llama decoder layers whose input at row ``i``
    is ``fc([embed(x_{i+1}), f_i])``, ``f_i`` being a feature ``[H]`` of position ``i``: the
    target's final hidden state there (its LM head's input), or for a position the target has
    not computed yet, the draft's own output at the row before. Its output after the final norm
    estimates the target's feature at ``i + 1``; the (usually borrowed) LM head on it gives the
    draft's distribution of ``x_{i+2}``. The row for position ``i`` thus takes the token at
    ``i + 1``: :class:`pagedspec.engine.speculative.EagleProposer` lays the rows out.

    ``embed_input(input_ids, positions, features)``: ``features`` ``[T, H]``, any float dtype.
    """

    takes_features = True

    def __init__(self, config: LlamaConfig, get_weight: Callable[[str], torch.Tensor],
                 device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32):
        super().__init__(config, get_weight, device, dtype)
        self.fc = get_weight(EAGLE_FC).to(self.device, dtype)      # [H, 2H]

    def embed_input(self, input_ids: torch.Tensor, positions: torch.Tensor,
                    features: Optional[torch.Tensor] = None
                    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        if features is None or features.shape != (input_ids.shape[0], self.config.hidden_size):
            raise ValueError(f"EagleDraft.embed_input: features must be [{input_ids.shape[0]}, "
                             f"{self.config.hidden_size}] (one per input token), got "
                             f"{None if features is None else list(features.shape)}")
        embeds, rope = super().embed_input(input_ids, positions)
        x = torch.cat([embeds, features.to(self.dtype)], dim=-1)
        return linear(x, self.fc), rope

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attend: AttendFn,
                features: Optional[torch.Tensor] = None) -> torch.Tensor:
        return self._layers_and_norm(*self.embed_input(input_ids, positions, features), attend)

    def prepack_weights(self) -> bool:
        packed = super().prepack_weights()
        if packed:
            self.fc = self._packer(self.fc)
        return packed
