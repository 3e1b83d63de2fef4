"""One configuration for the engine: :class:`EngineConfig`. The ``LLM`` keyword arguments, the
``pagedspec generate`` / ``serve`` flags and the server's engine are all derived from its fields
(names, defaults and help), so a new setting is added once, here."""
from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Union


def _setting(default: Any, help: str, type: Optional[Callable] = None,
             choices: Optional[list] = None) -> Any:
    """A field with what its command-line flag needs: help text, a parser, choices."""
    return field(default=default, metadata={"help": help, "type": type, "choices": choices})


def _optional(parse: Callable) -> Callable:
    """A flag parser that reads ``none`` as None."""
    def parser(text: str):
        return None if text.lower() == "none" else parse(text)
    parser.__name__ = parse.__name__
    return parser


def _kv_scales(text: str):
    """``calibrate`` or ``K,V`` (floats for every layer)."""
    if text in ("calibrate", "none"):
        return None if text == "none" else text
    try:
        k, v = (float(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected 'calibrate' or 'K,V' floats, got {text!r}")
    return (k, v)


@dataclass
class EngineConfig:
    """Everything that makes an engine, and nothing about a single request.

    ``model`` is a Hugging Face checkpoint directory, a ``.gguf`` file or a shipped model's name;
    the rest are ``LLM``'s keyword arguments with the same names and defaults (see
    :class:`pagedspec.LLM` for what each means). Values are checked when the engine is built.
    """
    model: str = _setting(None, "checkpoint directory, .gguf file or shipped model name")
    dtype: str = _setting("auto", "weights and activations dtype",
                          choices=["auto", "float32", "bfloat16", "float16"])
    device: Optional[str] = _setting(None, "cpu or cuda[:i] (default: cuda if usable)")
    kv_cache_dtype: str = _setting("auto", "KV cache dtype",
                                   choices=["auto", "fp8_e4m3", "fp8_e5m2"])
    kv_scales: Union[None, str, tuple] = _setting(
        None, "FP8 KV scales: 'calibrate' or 'K,V' (default: the checkpoint's, else calibrate)",
        type=_kv_scales)
    block_size: int = _setting(16, "tokens per KV block", type=int, choices=[8, 16, 32, 64])
    kv_cache_memory: Optional[int] = _setting(None, "bytes for the KV cache", type=int)
    num_kv_blocks: Optional[int] = _setting(None, "KV blocks (instead of --kv-cache-memory)",
                                            type=int)
    max_num_seqs: int = _setting(256, "sequences in one step at most", type=int)
    max_num_batched_tokens: Optional[int] = _setting(None, "tokens per step at most", type=int)
    max_model_len: Optional[int] = _setting(
        None, "prompt plus output tokens per sequence (default: the model's context)", type=int)
    enable_prefix_caching: bool = _setting(True, "reuse the KV blocks of shared prompt prefixes")
    swap_space: float = _setting(0.0, "GiB of CPU memory for preempted sequences' blocks",
                                 type=float)
    preemption_mode: str = _setting("auto", "how preempted sequences resume",
                                    choices=["auto", "recompute", "swap"])
    seed: int = _setting(0, "seeds the requests that carry no seed of their own", type=int)
    skip_tokenizer_init: bool = _setting(False, "run without a tokenizer (token-id prompts)")
    speculative_model: Optional[str] = _setting(
        None, "draft checkpoint or shipped name, or 'ngram' for prompt lookup")
    num_speculative_tokens: int = _setting(4, "draft tokens per sequence and step at most",
                                           type=int)
    speculative_adaptive: bool = _setting(
        True, "choose each step's number of draft tokens from measured costs and acceptance")
    prompt_lookup_max: int = _setting(3, "longest n-gram for 'ngram' drafting", type=int)
    prompt_lookup_min: int = _setting(1, "shortest n-gram for 'ngram' drafting", type=int)
    kv_eviction: str = _setting("none", "KV eviction policy",
                                choices=["none", "streaming", "h2o", "random"])
    kv_budget: Optional[int] = _setting(None, "KV tokens kept per sequence under eviction",
                                        type=int)
    kv_sink_tokens: int = _setting(4, "first tokens eviction always keeps", type=int)
    kv_recent_tokens: Optional[int] = _setting(None, "latest tokens eviction always keeps",
                                               type=int)
    compile: bool = _setting(False, "run the model's (and the draft's) forward through "
                             "torch.compile: the first step of each kind compiles, later ones "
                             "fuse the elementwise work around the GEMMs")
    cuda_graphs: bool = _setting(True, "on a CUDA device, replay steps of at most 16 query "
                                 "rows per sequence (decodes, verifications) from CUDA graphs "
                                 "captured per batch-size bucket; prefill chunks stay eager")

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser, *, model_default: Optional[str] = None
                     ) -> None:
        """Adds one ``--flag`` per field (``--max-num-seqs`` for ``max_num_seqs``); booleans get
        ``--flag`` / ``--no-flag``."""
        group = parser.add_argument_group("engine")
        for f in dataclasses.fields(EngineConfig):
            flag = "--" + f.name.replace("_", "-")
            meta = f.metadata
            default = model_default if f.name == "model" else f.default
            if isinstance(f.default, bool):
                group.add_argument(flag, action=argparse.BooleanOptionalAction, default=default,
                                   help=meta["help"])
                continue
            kwargs = dict(default=default, help=f"{meta['help']} (default: {default})")
            if meta["type"] is not None:
                nullable = f.default is None and meta["type"] is not _kv_scales
                kwargs["type"] = _optional(meta["type"]) if nullable else meta["type"]
            if meta["choices"] is not None:
                kwargs["choices"] = meta["choices"]
            if f.name == "model" and default is None:
                kwargs["required"] = True
            group.add_argument(flag, **kwargs)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> "EngineConfig":
        return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})
