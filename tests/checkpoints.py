"""Tiny Hugging Face checkpoints built on the fly with ``transformers`` (no hub): random weights,
a byte-level BPE tokenizer trained on a few lines of Python, written as a real checkpoint
directory (``config.json``, safetensors, ``generation_config.json``, ``tokenizer.json``)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import torch

TEXT = """
def fibonacci(n):
    a, b = 0, 1
    for _ in range(n):
        a, b = b, a + b
    return a

class Stack:
    def __init__(self):
        self.items = []

    def push(self, item):
        self.items.append(item)

    def pop(self):
        return self.items.pop()

import os, sys
print("hello, world", os.path.join("a", "b"), sys.argv)
""" * 4

ARCHS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
}

# A small config every family accepts; tests override what they vary.
BASE = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=64,
            max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=False,
            bos_token_id=1, eos_token_id=2)


def train_tokenizer(vocab_size: int):
    """A byte-level BPE with ``vocab_size`` entries (3 special tokens first)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=1, show_progress=False,
                                  special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([TEXT], trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return tok


def make_checkpoint(path: Path, arch: str = "llama", *, seed: int = 0,
                    dtype: torch.dtype = torch.float32, tokenizer: bool = True,
                    scale_outputs: Optional[float] = None, logit_scale: float = 20.0,
                    shards: bool = False,
                    **config) -> Path:
    """Writes a random ``arch`` checkpoint into ``path`` and returns it.

    ``config`` overrides :data:`BASE`; ``scale_outputs`` multiplies the attention and MLP output
    projections (small values make the model nearly a bigram model, whose greedy output repeats:
    the regime where n-gram drafts are accepted). ``logit_scale`` multiplies the LM head (the
    embedding when tied): transformers' 0.02-std init gives logits of std ~0.2, a nearly flat
    distribution; x20 gives std ~3, clear argmaxes and a peaked softmax, as trained models have."""
    import transformers

    cfg_name, model_name = ARCHS[arch]
    kwargs = {**BASE, **config}
    if arch == "mistral":
        kwargs.setdefault("sliding_window", None)
    cfg = getattr(transformers, cfg_name)(**kwargs)
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(cfg).to(dtype).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(torch.randn_like(p) * 0.1)   # non-trivial norms: a test sees them
            elif name.endswith(".bias"):
                p.normal_(0.0, 0.1)
            if scale_outputs is not None and name.endswith(("o_proj.weight", "down_proj.weight")):
                p.mul_(scale_outputs)
        head = model.get_output_embeddings().weight
        head.mul_(logit_scale)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, max_shard_size="100KB" if shards else "10GB")
    if tokenizer:
        tok = train_tokenizer(kwargs["vocab_size"])
        tok.save(str(path / "tokenizer.json"))
        (path / "tokenizer_config.json").write_text(json.dumps(
            {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>",
             "eos_token": "</s>", "unk_token": "<unk>"}))
    return path


def hf_model(path: Path, dtype: torch.dtype = torch.float32):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()


def dense_forward(model, token_ids: list[int], record: Optional[list] = None) -> torch.Tensor:
    """Hidden states of one whole sequence through a pagedspec model with contiguous K/V and
    causal SDPA instead of the paged cache; ``record`` (a list) receives each layer's K (after
    RoPE) and V."""
    import torch.nn.functional as F

    def attend(_, q, k, v):
        if record is not None:
            record.append((k.clone(), v.clone()))
        g = q.shape[1] // k.shape[1]
        q, k, v = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)
        out = F.scaled_dot_product_attention(q, k.repeat_interleave(g, 0),
                                             v.repeat_interleave(g, 0), is_causal=True,
                                             scale=model.scale)
        return out.transpose(0, 1)

    with torch.no_grad():
        return model.forward(torch.tensor(token_ids), torch.arange(len(token_ids)), attend)


def eagle_copy(target: Path, dst: Path, seed: int = 0, feature_weight: float = 0.02) -> Path:
    """An EAGLE draft head (``pagedspec_eagle``) for ``target``: the target's first layer and
    final norm behind ``fc = [I | feature_weight * R]`` (R standard normal), the embedding
    borrowed. Row ``i`` then mostly runs the target's first layer on token ``i + 1``: it agrees
    with the target about as often as the first layer alone does, and the feature still counts."""
    import shutil

    from safetensors.torch import load_file, save_file

    config = json.loads((target / "config.json").read_text())
    H = config["hidden_size"]
    config.update(num_hidden_layers=1, pagedspec_eagle={"fc": "fc.weight"},
                  pagedspec_borrowed_weights=["model.embed_tokens.weight"])
    config.pop("layer_types", None)
    dst.mkdir(parents=True)
    (dst / "config.json").write_text(json.dumps(config))
    for f in target.iterdir():
        if f.name not in ("config.json", "model.safetensors") and f.is_file():
            shutil.copy(f, dst / f.name)
    tensors = load_file(target / "model.safetensors")
    kept = {n: t for n, t in tensors.items()
            if n.startswith("model.layers.0.") or n in ("model.norm.weight", "lm_head.weight")}
    g = torch.Generator().manual_seed(seed)
    fc = torch.cat([torch.eye(H), feature_weight * torch.randn(H, H, generator=g)], dim=1)
    kept["fc.weight"] = fc.to(tensors["model.norm.weight"].dtype)
    save_file(kept, dst / "model.safetensors")
    return dst
