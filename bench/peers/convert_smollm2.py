"""Convert SmolLM2-135M-Instruct's GGUF into a Hugging Face checkpoint directory, for servers
(vLLM's) and tools that read only that format.

    .venv/bin/python bench/peers/convert_smollm2.py [--gguf FILE] [--out DIR] [--dtype bfloat16]

The GGUF comes from ``tools/fetch_smollm2.sh`` (default
``~/.cache/pagedspec/smollm2-135m/SmolLM2-135M-Instruct.Q4_1.gguf``). ``transformers`` dequantizes
it (Q4_1 weights become ``--dtype``, so the checkpoint holds the quantized model's values, not the
original bf16 release) and writes ``config.json``, safetensors, the tokenizer and the chat
template to ``--out`` (default ``~/.cache/pagedspec/smollm2-135m-hf``). An existing ``--out``
with a ``config.json`` is left as it is unless ``--force``.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

CACHE = Path(os.path.expanduser("~/.cache/pagedspec"))
DEFAULT_GGUF = CACHE / "smollm2-135m" / "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_OUT = CACHE / "smollm2-135m-hf"


def convert(gguf: Path, out: Path, dtype: str) -> Path:
    """Writes the Hugging Face checkpoint of ``gguf`` into ``out`` and returns ``out``.

    The weights are read with ``transformers``' GGUF reader into a model built from the GGUF's
    config; ``from_pretrained(gguf_file=...)`` would do the same but requires ``accelerate``,
    which neither environment here has. Raises RuntimeError when a weight of the model is not in
    the file (other than a tied LM head)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    torch_dtype = getattr(torch, dtype)
    config = AutoConfig.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_config(config, dtype=torch_dtype)
    tensors = load_gguf_checkpoint(str(gguf), return_tensors=True, model_to_load=model,
                                   torch_dtype=torch_dtype)["tensors"]
    state = {name: torch.as_tensor(t).to(torch_dtype) for name, t in tensors.items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
    if set(missing) - tied or unexpected:
        raise RuntimeError(f"{gguf}: weights missing from the file {sorted(set(missing) - tied)}, "
                           f"unexpected in it {sorted(unexpected)}")
    model.tie_weights()
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gguf", type=Path, default=DEFAULT_GGUF)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    p.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16")
    p.add_argument("--force", action="store_true", help="convert again into an existing --out")
    args = p.parse_args()
    if not args.gguf.is_file():
        print(f"error: --gguf {args.gguf} does not exist (run tools/fetch_smollm2.sh)",
              file=sys.stderr)
        return 2
    if (args.out / "config.json").is_file() and not args.force:
        print(f"{args.out} already holds a checkpoint (--force converts again)")
        return 0
    print(f"converted {args.gguf} -> {convert(args.gguf, args.out, args.dtype)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
