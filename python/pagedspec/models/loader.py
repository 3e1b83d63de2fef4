"""Loads a local Hugging Face checkpoint directory: ``config.json``, the weights
(``model.safetensors`` or a sharded ``model.safetensors.index.json``), ``generation_config.json``
and ``tokenizer.json``. A path is a path: nothing is fetched from a hub.

Weights are read through ``safetensors``' memory-mapped files one tensor at a time and converted
straight to the model's dtype and device, so a checkpoint is never held twice in Python. Every
problem raises :class:`CheckpointError` naming the file, the tensor and what was expected.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Union

import torch

from pagedspec.models import llama

# architecture name in config.json -> (config parser, model class)
_ARCHITECTURES = {name: (llama.LlamaConfig, llama.LlamaForCausalLM)
                  for name in llama.ARCHITECTURES}

# dtype names as config.json and the LLM API spell them
DTYPES = {"float32": torch.float32, "float": torch.float32, "bfloat16": torch.bfloat16,
           "float16": torch.float16, "half": torch.float16}


class CheckpointError(ValueError):
    """A checkpoint directory that cannot be loaded; the message names the file and the part."""


def resolve_model_path(model: Union[str, os.PathLike]) -> Path:
    """A checkpoint directory: a path, or the name of a checkpoint shipped in the package."""
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    shipped = Path(__file__).parent / "data" / str(model)
    if shipped.is_dir():
        return shipped
    raise CheckpointError(f"{model}: not a checkpoint directory (no such folder, and no "
                          f"checkpoint of that name ships with pagedspec)")


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path}: file not found") from None
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path}: not valid JSON ({exc})") from None


@dataclass
class GenerationDefaults:
    """What ``generation_config.json`` (or ``config.json``) says about ending a completion."""
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: Optional[int] = None


@dataclass
class Checkpoint:
    """A checkpoint directory, parsed but with its weights still on disk."""
    path: Path
    architecture: str
    config: llama.LlamaConfig
    raw_config: dict
    generation: GenerationDefaults
    weight_files: dict[str, Path] = field(repr=False)   # tensor name -> safetensors file
    tokenizer_path: Optional[Path] = None

    def load_model(self, dtype: torch.dtype, device: torch.device | str = "cpu"):
        """Builds the model on ``device`` in ``dtype``, checking every tensor's name and shape."""
        from safetensors import safe_open

        expected = self.config.weight_shapes()
        present = set(self.weight_files)
        missing = sorted(set(expected) - present)
        if missing:
            raise CheckpointError(f"{self.path}: missing tensor {missing[0]!r} (expected shape "
                                  f"{list(expected[missing[0]])}; {len(missing)} missing in all)")
        extra = sorted(n for n in present - set(expected) if not self.config.optional_weights(n))
        if extra:
            raise CheckpointError(f"{self.path / self.weight_files[extra[0]].name}: unexpected "
                                  f"tensor {extra[0]!r} for {self.architecture} with this "
                                  f"config.json ({len(extra)} unexpected in all)")
        handles = {}

        def get_weight(name: str) -> torch.Tensor:
            file = self.weight_files[name]
            if file not in handles:
                handles[file] = safe_open(str(file), framework="pt", device="cpu")
            tensor = handles[file].get_tensor(name)
            if tuple(tensor.shape) != expected[name]:
                raise CheckpointError(f"{file}: tensor {name!r} has shape {list(tensor.shape)}, "
                                      f"expected {list(expected[name])}")
            if not tensor.is_floating_point():
                raise CheckpointError(f"{file}: tensor {name!r} has dtype {tensor.dtype}, "
                                      "expected a floating-point dtype")
            return tensor

        _, model_cls = _ARCHITECTURES[self.architecture]
        return model_cls(self.config, get_weight, device=device, dtype=dtype)

    def kv_scales(self) -> Optional[tuple[list[float], list[float]]]:
        """Per-layer FP8 KV scales ``(k, v)`` if the checkpoint carries them
        (``model.layers.{i}.self_attn.k_scale`` / ``v_scale``), else None."""
        from safetensors import safe_open

        names = [(f"model.layers.{i}.self_attn.k_scale", f"model.layers.{i}.self_attn.v_scale")
                 for i in range(self.config.num_layers)]
        if not all(k in self.weight_files and v in self.weight_files for k, v in names):
            return None
        handles = {file: safe_open(str(file), framework="pt")
                   for file in {self.weight_files[n] for pair in names for n in pair}}

        def scalar(name: str) -> float:
            return float(handles[self.weight_files[name]].get_tensor(name).float().reshape(-1)[0])

        return [scalar(k) for k, _ in names], [scalar(v) for _, v in names]

    def default_dtype(self) -> torch.dtype:
        """The checkpoint's own dtype (``torch_dtype`` / ``dtype`` in config.json), else float32."""
        return DTYPES.get(self.config.torch_dtype or "float32", torch.float32)

    def load_tokenizer(self):
        """The ``tokenizers.Tokenizer`` of ``tokenizer.json``."""
        if self.tokenizer_path is None:
            raise CheckpointError(f"{self.path}: missing tokenizer.json (needed to encode text "
                                  "prompts and decode completions; pass token ids and "
                                  "skip_tokenizer_init=True to run without one)")
        from tokenizers import Tokenizer

        try:
            return Tokenizer.from_file(str(self.tokenizer_path))
        except Exception as exc:  # the tokenizers package raises a bare Exception
            raise CheckpointError(f"{self.tokenizer_path}: cannot be read as a tokenizer "
                                  f"({exc})") from None


def _weight_files(path: Path) -> dict[str, Path]:
    """Tensor name -> safetensors file, from the index of a sharded checkpoint or a single file."""
    from safetensors import safe_open

    index = path / "model.safetensors.index.json"
    if index.exists():
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index}: expected a 'weight_map' object")
        files = {name: path / shard for name, shard in weight_map.items()}
        for name, file in files.items():
            if not file.exists():
                raise CheckpointError(f"{index}: tensor {name!r} is in shard {file.name}, which "
                                      "does not exist")
        return files
    single = path / "model.safetensors"
    if not single.exists():
        found = sorted(p.name for p in path.glob("*.bin")) + sorted(
            p.name for p in path.glob("*.pt"))
        hint = f" (found {', '.join(found)}: convert them to safetensors)" if found else ""
        raise CheckpointError(f"{path}: no model.safetensors or model.safetensors.index.json"
                              f"{hint}")
    try:
        with safe_open(str(single), framework="pt") as f:
            return {name: single for name in f.keys()}
    except Exception as exc:
        raise CheckpointError(f"{single}: not a readable safetensors file ({exc})") from None


def _generation_defaults(path: Path, config: dict) -> GenerationDefaults:
    gen_path = path / "generation_config.json"
    gen = _read_json(gen_path) if gen_path.exists() else {}
    eos = gen.get("eos_token_id", config.get("eos_token_id"))
    if eos is None:
        eos_ids: tuple[int, ...] = ()
    elif isinstance(eos, int):
        eos_ids = (eos,)
    elif isinstance(eos, list) and all(isinstance(e, int) for e in eos):
        eos_ids = tuple(eos)
    else:
        raise CheckpointError(f"{gen_path if gen else path / 'config.json'}: eos_token_id must "
                              f"be an int or a list of ints, got {eos!r}")
    return GenerationDefaults(eos_ids, gen.get("bos_token_id", config.get("bos_token_id")))


def load_checkpoint(model: Union[str, os.PathLike]) -> Checkpoint:
    """Parses a checkpoint directory (or a shipped checkpoint's name) without loading weights."""
    path = resolve_model_path(model)
    config_path = path / "config.json"
    raw = _read_json(config_path)
    archs = raw.get("architectures") or []
    arch = next((a for a in archs if a in _ARCHITECTURES), None)
    if arch is None:
        by_type = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                   "mistral": "MistralForCausalLM"}
        arch = by_type.get(raw.get("model_type", "")) if not archs else None
    if arch is None:
        raise CheckpointError(f"{config_path}: architecture {archs or raw.get('model_type')!r} "
                              f"is not supported; expected one of {', '.join(_ARCHITECTURES)}")
    config_cls, _ = _ARCHITECTURES[arch]
    try:
        config = config_cls.from_dict(raw, str(config_path))
    except llama.ConfigError as exc:
        raise CheckpointError(str(exc)) from None
    tokenizer = path / "tokenizer.json"
    return Checkpoint(path, arch, config, raw, _generation_defaults(path, raw),
                      _weight_files(path), tokenizer if tokenizer.exists() else None)
