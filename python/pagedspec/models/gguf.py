"""GGUF checkpoints (llama.cpp's single-file format): configuration, weights and tokenizer.

    ckpt = load_checkpoint("model.Q4_K_M.gguf")     # or a directory holding exactly one .gguf
    model = ckpt.load_model(torch.bfloat16)           # dequantized one tensor at a time
    tokenizer = ckpt.load_tokenizer()                 # a tokenizers.Tokenizer from the metadata
    convert_gguf("model.gguf", "out/")                # a plain Hugging Face directory

Architectures ``llama`` and ``qwen2`` (``general.architecture``). Tensor types F32, F16, BF16,
Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K and Q6_K are dequantized here with torch (block layouts
of ggml's ``ggml-quants.c``; the tests check every one against ``gguf.quants.dequantize``).
llama.cpp's converter permutes the rows of a ``llama`` model's Q and K projections (it pairs
rotary dimensions ``(i, i + D/2)`` as adjacent rows); :func:`unpermute_rows` undoes that. ``qwen2``
files are not permuted.

The file is parsed here rather than with ``gguf.GGUFReader``: that reader builds a numpy view
per metadata element, which for a 49k-token vocabulary (tokens and merges) took 5.5 s of a load
that is otherwise about a second; this parser reads the same header in ~0.1 s and checks every
length against the file's size, so a truncated or malformed file fails with the byte offset.
The ``gguf`` package supplies the format's constants and, in the tests, the writer and the
reference dequantization. Every problem raises :class:`CheckpointError` naming the file and,
where there is one, the tensor and its type.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import mmap
import os
import re
import struct
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional, Sequence, Union

import numpy as np
import torch
from gguf.constants import GGMLQuantizationType, GGUFValueType

from pagedspec.models import llama
from pagedspec.models.loader import (Checkpoint, CheckpointError, GenerationDefaults,
                                     TensorSource, dtype_name)

GGUF_MAGIC = b"GGUF"
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}

# ---- file parsing -------------------------------------------------------------------------------
# GGUF value type -> struct format of one scalar (little-endian)
_SCALARS = {GGUFValueType.UINT8: "<B", GGUFValueType.INT8: "<b", GGUFValueType.UINT16: "<H",
            GGUFValueType.INT16: "<h", GGUFValueType.UINT32: "<I", GGUFValueType.INT32: "<i",
            GGUFValueType.FLOAT32: "<f", GGUFValueType.BOOL: "<?", GGUFValueType.UINT64: "<Q",
            GGUFValueType.INT64: "<q", GGUFValueType.FLOAT64: "<d"}
_NUMPY = {GGUFValueType.UINT8: "<u1", GGUFValueType.INT8: "<i1", GGUFValueType.UINT16: "<u2",
          GGUFValueType.INT16: "<i2", GGUFValueType.UINT32: "<u4", GGUFValueType.INT32: "<i4",
          GGUFValueType.FLOAT32: "<f4", GGUFValueType.BOOL: "?", GGUFValueType.UINT64: "<u8",
          GGUFValueType.INT64: "<i8", GGUFValueType.FLOAT64: "<f8"}


@dataclass(frozen=True)
class GGUFTensorInfo:
    """One tensor's entry in the file: ``shape`` in ggml order (``shape[0]`` is the row length,
    i.e. the reverse of torch's), ``qtype`` a ``GGMLQuantizationType`` value, ``offset`` absolute
    in the file, ``nbytes`` from the type's block size."""
    name: str
    shape: tuple[int, ...]
    qtype: int
    offset: int
    nbytes: int

    @property
    def type_name(self) -> str:
        return qtype_name(self.qtype)

    @property
    def torch_shape(self) -> tuple[int, ...]:
        return tuple(reversed(self.shape))


def qtype_name(qtype: int) -> str:
    try:
        return GGMLQuantizationType(qtype).name
    except ValueError:
        return f"unknown type {qtype}"


class _Parser:
    """Reads GGUF v2/v3 (little-endian) metadata and tensor infos from a read-only mmap."""

    def __init__(self, path: Path, buf):
        self.path, self.buf, self.pos = path, buf, 0

    def fail(self, what: str):
        raise CheckpointError(f"{self.path}: truncated or malformed GGUF file ({what} at byte "
                              f"{self.pos} of {len(self.buf)})")

    def unpack(self, fmt: str, what: str):
        size = struct.calcsize(fmt)
        if self.pos + size > len(self.buf):
            self.fail(f"{what} runs past the end")
        value = struct.unpack_from(fmt, self.buf, self.pos)[0]
        self.pos += size
        return value

    def string(self, what: str) -> str:
        n = self.unpack("<Q", what + " length")
        if self.pos + n > len(self.buf):
            self.fail(f"{what} of {n} bytes runs past the end")
        try:
            s = bytes(self.buf[self.pos:self.pos + n]).decode("utf-8")
        except UnicodeDecodeError:
            self.fail(f"{what} is not UTF-8")
        self.pos += n
        return s

    def value(self, vtype: int, key: str):
        if vtype == GGUFValueType.STRING:
            return self.string(f"value of {key!r}")
        if vtype == GGUFValueType.ARRAY:
            etype = self.unpack("<I", f"element type of {key!r}")
            count = self.unpack("<Q", f"length of {key!r}")
            if etype == GGUFValueType.STRING:
                return [self.string(f"element {i} of {key!r}") for i in range(count)]
            if etype in _NUMPY:
                dt = np.dtype(_NUMPY[etype])
                if self.pos + count * dt.itemsize > len(self.buf):
                    self.fail(f"array {key!r} of {count} elements runs past the end")
                arr = np.frombuffer(self.buf, dtype=dt, count=count, offset=self.pos)
                self.pos += count * dt.itemsize
                return arr.tolist()
            if etype == GGUFValueType.ARRAY:
                return [self.value(GGUFValueType.ARRAY, key) for _ in range(count)]
            self.fail(f"array {key!r} has unknown element type {etype}")
        if vtype in _SCALARS:
            return self.unpack(_SCALARS[vtype], f"value of {key!r}")
        self.fail(f"key {key!r} has unknown value type {vtype}")


@dataclass
class GGUFFile:
    """A parsed GGUF file: ``metadata`` (key -> int/float/bool/str/list) and ``tensors`` (name ->
    :class:`GGUFTensorInfo`, in file order). Tensor data stays on disk: :meth:`read` fetches one."""
    path: Path
    version: int
    metadata: dict = field(repr=False)                   # a vocabulary is 100k+ strings
    tensors: dict[str, GGUFTensorInfo] = field(repr=False)

    @classmethod
    def open(cls, path: Union[str, os.PathLike]) -> "GGUFFile":
        path = Path(path)
        try:
            f = open(path, "rb")
        except OSError as exc:
            raise CheckpointError(f"{path}: cannot be opened ({exc.strerror})") from None
        with f:
            size = os.fstat(f.fileno()).st_size
            if size < 24:
                raise CheckpointError(f"{path}: truncated or malformed GGUF file ({size} bytes, "
                                      "shorter than the 24-byte header)")
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
                return cls._parse(path, buf, size)

    @classmethod
    def _parse(cls, path: Path, buf, size: int) -> "GGUFFile":
        if bytes(buf[:4]) != GGUF_MAGIC:
            raise CheckpointError(f"{path}: not a GGUF file (magic {bytes(buf[:4])!r}, expected "
                                  f"{GGUF_MAGIC!r})")
        p = _Parser(path, buf)
        p.pos = 4
        version = p.unpack("<I", "version")
        if version not in (2, 3):
            swapped = int.from_bytes(version.to_bytes(4, "little"), "big")
            hint = " (a big-endian file)" if swapped in (2, 3) else ""
            raise CheckpointError(f"{path}: GGUF version {version}{hint} is not supported; "
                                  "expected little-endian version 2 or 3")
        n_tensors = p.unpack("<Q", "tensor count")
        n_kv = p.unpack("<Q", "metadata count")
        if n_tensors > size // 24 or n_kv > size // 12:   # each entry takes at least that much
            p.fail(f"{n_tensors} tensors and {n_kv} metadata entries cannot fit")
        metadata = {}
        for _ in range(n_kv):
            key = p.string("metadata key")
            metadata[key] = p.value(p.unpack("<I", f"value type of {key!r}"), key)
        infos = []
        for _ in range(n_tensors):
            name = p.string("tensor name")
            n_dims = p.unpack("<I", f"dimension count of tensor {name!r}")
            if not 1 <= n_dims <= 4:
                p.fail(f"tensor {name!r} has {n_dims} dimensions")
            shape = tuple(p.unpack("<Q", f"shape of tensor {name!r}") for _ in range(n_dims))
            qtype = p.unpack("<I", f"type of tensor {name!r}")
            offset = p.unpack("<Q", f"offset of tensor {name!r}")
            infos.append((name, shape, qtype, offset))
        alignment = metadata.get("general.alignment", 32)
        if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
            raise CheckpointError(f"{path}: general.alignment must be a power of two, got "
                                  f"{alignment!r}")
        data_start = -(-p.pos // alignment) * alignment
        tensors = {}
        for name, shape, qtype, offset in infos:
            nbytes = _tensor_nbytes(path, name, shape, qtype)
            start = data_start + offset
            if start + nbytes > size:
                raise CheckpointError(
                    f"{path}: truncated GGUF file: tensor {name!r} ({qtype_name(qtype)}, shape "
                    f"{list(shape)}) needs bytes {start}..{start + nbytes}, the file has {size}")
            if name in tensors:
                raise CheckpointError(f"{path}: tensor {name!r} appears twice")
            tensors[name] = GGUFTensorInfo(name, shape, qtype, start, nbytes)
        return cls(path, version, metadata, tensors)

    def read(self, name: str) -> torch.Tensor:
        """The raw bytes of tensor ``name`` as a uint8 tensor (one read, no mmap kept)."""
        info = self.tensors[name]
        raw = torch.empty(info.nbytes, dtype=torch.uint8)
        with open(self.path, "rb") as f:
            f.seek(info.offset)
            got = f.readinto(raw.numpy())
        if got != info.nbytes:
            raise CheckpointError(f"{self.path}: truncated GGUF file: tensor {name!r} "
                                  f"({info.type_name}) has {got} of its {info.nbytes} bytes")
        return raw

    def tensor(self, name: str) -> torch.Tensor:
        """Tensor ``name`` dequantized to float32, in torch's shape (reversed ggml shape)."""
        info = self.tensors[name]
        try:
            flat = dequantize(self.read(name), info.qtype)
        except UnsupportedTypeError:
            raise CheckpointError(
                f"{self.path}: tensor {name!r} has type {info.type_name}, which pagedspec "
                f"cannot dequantize; supported: {', '.join(supported_types())}") from None
        return flat.view(info.torch_shape)


def _tensor_nbytes(path: Path, name: str, shape: tuple[int, ...], qtype: int) -> int:
    """Bytes of a tensor of ``shape`` (ggml order) in type ``qtype``; an unknown type id or a
    row that is not whole blocks raises :class:`CheckpointError`."""
    if qtype not in _BLOCKS:
        # A type ggml knows but we cannot dequantize: the header still parses (the size is
        # known), and loading the tensor names it.
        if qtype in _FOREIGN_SIZES:
            block, type_size = _FOREIGN_SIZES[qtype]
        else:
            raise CheckpointError(f"{path}: tensor {name!r} has {qtype_name(qtype)}, which "
                                  f"pagedspec cannot read; supported: "
                                  f"{', '.join(supported_types())}")
    else:
        block, type_size = _BLOCKS[qtype][:2]
    if shape[0] % block:
        raise CheckpointError(f"{path}: tensor {name!r} ({qtype_name(qtype)}) has rows of "
                              f"{shape[0]} elements, not a multiple of the type's block of "
                              f"{block}")
    n = 1
    for d in shape:
        n *= d
    return n // block * type_size


# ---- dequantization -----------------------------------------------------------------------------
class UnsupportedTypeError(ValueError):
    """A ggml tensor type pagedspec has no dequantizer for."""


def _f16(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The float16 at byte ``start`` of every block, as float32 ``[N, 1]``."""
    return blocks[:, start:start + 2].contiguous().view(torch.float16).float()


def _put_nibbles(out: torch.Tensor, qs: torch.Tensor) -> None:
    """``out[..., :16]`` = low nibbles of ``qs`` ``[..., 16]``, ``out[..., 16:]`` the high ones
    (converted on the copy: one pass each, no uint8 temporaries of the whole row)."""
    out[..., :16].copy_(qs & 0xF)
    out[..., 16:].copy_(qs >> 4)


def _bits(qh: torch.Tensor) -> torch.Tensor:
    """``[N, 4]`` bytes (a little-endian uint32) -> its 32 bits ``[N, 32]``, bit 0 first."""
    shifts = torch.arange(8, dtype=torch.uint8)
    return ((qh[:, :, None] >> shifts) & 1).reshape(qh.shape[0], 32)


# Each dequantizer fills ``out`` (float32 ``[N, block]``) from ``b`` (uint8 ``[N, bytes]``), with
# the arithmetic in the order of ggml's reference (and gguf-py's), so the values agree bit for bit.
def _q8_0(b, out):   # d f16 | 32 x int8; x = d * q
    out.copy_(b[:, 2:34].contiguous().view(torch.int8)).mul_(_f16(b, 0))


def _q4_0(b, out):   # d f16 | 16 bytes of nibbles; x = d * (q - 8)
    _put_nibbles(out, b[:, 2:18])
    out.sub_(8).mul_(_f16(b, 0))


def _q4_1(b, out):   # d f16 | m f16 | 16 bytes of nibbles; x = d * q + m
    _put_nibbles(out, b[:, 4:20])
    out.mul_(_f16(b, 0)).add_(_f16(b, 2))


def _q5(b, out, qh_at: int):
    """Q5_0 / Q5_1 quants: nibbles with a fifth bit from the 32-bit ``qh`` at ``qh_at``."""
    qs = b[:, qh_at + 4:qh_at + 20]
    high = _bits(b[:, qh_at:qh_at + 4]) << 4
    out[:, :16].copy_((qs & 0xF) | high[:, :16])
    out[:, 16:].copy_((qs >> 4) | high[:, 16:])


def _q5_0(b, out):   # d f16 | 32 high bits | 16 bytes of nibbles; x = d * (q - 16)
    _q5(b, out, 2)
    out.sub_(16).mul_(_f16(b, 0))


def _q5_1(b, out):   # d f16 | m f16 | 32 high bits | 16 bytes of nibbles; x = d * q + m
    _q5(b, out, 4)
    out.mul_(_f16(b, 0)).add_(_f16(b, 2))


def _k_scales(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K: 12 bytes -> 8 six-bit scales and 8 six-bit mins ``[N, 8]`` each (the first
    four in the low bits of bytes 0-3 / 4-7, the last four split over bytes 8-11 and the top two
    bits of bytes 0-7)."""
    s0, s1, s2 = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    scales = torch.cat((s0 & 63, (s2 & 0xF) | ((s0 >> 6) << 4)), dim=1)
    mins = torch.cat((s1 & 63, (s2 >> 4) | ((s1 >> 6) << 4)), dim=1)
    return scales.float(), mins.float()


def _k_affine(b, out, q_low: torch.Tensor, q_high: torch.Tensor) -> None:
    """Q4_K / Q5_K: sub-block ``2c`` holds ``q_low[:, c]``, ``2c + 1`` ``q_high[:, c]`` (each
    ``[N, 4, 32]``); x = (d * scale) * q - dmin * min per sub-block of 32."""
    n = b.shape[0]
    scales, mins = _k_scales(b[:, 4:16])
    sub = out.view(n, 4, 2, 32)
    sub[:, :, 0].copy_(q_low)
    sub[:, :, 1].copy_(q_high)
    sub = out.view(n, 8, 32)
    sub.mul_((_f16(b, 0) * scales)[:, :, None]).sub_((_f16(b, 2) * mins)[:, :, None])


def _q4_k(b, out):   # d | dmin | 12 scale bytes | 128 bytes: 4 chunks of 32, low then high
    qs = b[:, 16:144].reshape(-1, 4, 32)
    _k_affine(b, out, qs & 0xF, qs >> 4)


def _q5_k(b, out):   # d | dmin | 12 scale bytes | 32 bytes of high bits | 128 nibble bytes
    qh = b[:, None, 16:48]                                   # bit j is sub-block j's fifth bit
    qs = b[:, 48:176].reshape(-1, 4, 32)
    shifts = torch.arange(0, 8, 2, dtype=torch.uint8)[None, :, None]
    _k_affine(b, out, (qs & 0xF) | (((qh >> shifts) & 1) << 4),
              (qs >> 4) | (((qh >> (shifts + 1)) & 1) << 4))


def _q6_k(b, out):   # 128 low-nibble bytes | 64 high-2-bit bytes | 16 int8 scales | d f16
    n = b.shape[0]
    ql = b[:, 0:128].reshape(n, 2, 2, 32)                     # half, first/second 32, l
    qh = b[:, 128:192].reshape(n, 2, 1, 32)
    shifts = torch.arange(0, 8, 2, dtype=torch.uint8)[None, None, :, None]
    high = ((qh >> shifts) & 3) << 4                           # [n, 2, 4, 32]: k-th 2-bit field
    q = out.view(n, 2, 4, 32)                                  # y[128 h + 32 k + l]
    q[:, :, 0:2].copy_((ql & 0xF) | high[:, :, 0:2])
    q[:, :, 2:4].copy_((ql >> 4) | high[:, :, 2:4])
    scales = b[:, 192:208].contiguous().view(torch.int8).float()      # one per 16 elements
    out.sub_(32).view(n, 16, 16).mul_((_f16(b, 208) * scales)[:, :, None])


def _plain(dtype: torch.dtype) -> Callable[[torch.Tensor, torch.Tensor], None]:
    def fill(b, out):
        out.copy_(b.contiguous().view(dtype))
    return fill


# type -> (elements per block, bytes per block, dequantizer filling float32 [N, elements])
_BLOCKS: dict[int, tuple[int, int, Callable]] = {
    GGMLQuantizationType.F32: (1, 4, _plain(torch.float32)),
    GGMLQuantizationType.F16: (1, 2, _plain(torch.float16)),
    GGMLQuantizationType.BF16: (1, 2, _plain(torch.bfloat16)),
    GGMLQuantizationType.Q8_0: (32, 34, _q8_0),
    GGMLQuantizationType.Q4_0: (32, 18, _q4_0),
    GGMLQuantizationType.Q4_1: (32, 20, _q4_1),
    GGMLQuantizationType.Q5_0: (32, 22, _q5_0),
    GGMLQuantizationType.Q5_1: (32, 24, _q5_1),
    GGMLQuantizationType.Q4_K: (256, 144, _q4_k),
    GGMLQuantizationType.Q5_K: (256, 176, _q5_k),
    GGMLQuantizationType.Q6_K: (256, 210, _q6_k),
}


def _foreign_sizes() -> dict[int, tuple[int, int]]:
    """Block sizes of the types we cannot dequantize, so a file holding one still parses and
    the error names the tensor that needs it."""
    from gguf.constants import GGML_QUANT_SIZES
    return {int(t): sizes for t, sizes in GGML_QUANT_SIZES.items() if int(t) not in _BLOCKS}


_FOREIGN_SIZES = _foreign_sizes()

# Bytes dequantized per chunk: bounds the float32 temporaries of a large tensor (an embedding)
# to a few times this, whatever the tensor's size.
_CHUNK_BYTES = 4 << 20


def supported_types() -> list[str]:
    """Names of the ggml tensor types :func:`dequantize` handles."""
    return [qtype_name(t) for t in _BLOCKS]


def dequantize(raw: torch.Tensor, qtype: int) -> torch.Tensor:
    """Flat float32 values of ``raw`` (uint8 ``[nbytes]``, whole blocks) holding ggml type
    ``qtype``. Raises :class:`UnsupportedTypeError` for a type without a dequantizer and
    ``ValueError`` when ``raw`` is not a whole number of blocks."""
    if qtype not in _BLOCKS:
        raise UnsupportedTypeError(f"dequantize: no dequantizer for {qtype_name(qtype)}")
    block, type_size, fn = _BLOCKS[qtype]
    if raw.dtype != torch.uint8 or raw.dim() != 1 or raw.numel() % type_size:
        raise ValueError(f"dequantize: raw must be uint8 [k * {type_size}] for "
                         f"{qtype_name(qtype)}, got {raw.dtype} {list(raw.shape)}")
    blocks = raw.view(-1, type_size)
    out = torch.empty(blocks.shape[0], block, dtype=torch.float32)
    step = max(1, _CHUNK_BYTES // type_size)
    for start in range(0, blocks.shape[0], step):
        fn(blocks[start:start + step], out[start:start + step])
    return out.view(-1)


def unpermute_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undoes llama.cpp's Q/K permutation of a llama model (``LlamaModel.permute`` in
    ``convert_hf_to_gguf.py``): within each of ``n_heads`` heads of ``D`` rows, the converter
    interleaves row ``i`` and row ``i + D/2`` (its rotary partner); this puts them back in
    rotate-half order. ``w``: ``[n_heads * D, ...]`` (a weight or a bias)."""
    d_half = w.shape[0] // n_heads // 2
    return w.reshape(n_heads, d_half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


# ---- names and configuration --------------------------------------------------------------------
_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight",
                 "output_norm.weight": "model.norm.weight", "output.weight": "lm_head.weight"}
_LAYER_NAMES = {"attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj",
                "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
                "attn_output": "self_attn.o_proj", "ffn_norm": "post_attention_layernorm",
                "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def hf_name(gguf_name: str) -> Optional[str]:
    """The ``transformers`` name of a GGUF tensor name (None if it has none here)."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _LAYER_RE.fullmatch(gguf_name)
    if m and m.group(2) in _LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.{m.group(3)}"
    return None


def gguf_name(name: str) -> str:
    """The GGUF name of a ``transformers`` tensor name (the name itself if it has none)."""
    for g, h in _GLOBAL_NAMES.items():
        if h == name:
            return g
    m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)\.(weight|bias)", name)
    for g, h in _LAYER_NAMES.items():
        if m and m.group(2) == h:
            return f"blk.{m.group(1)}.{g}.{m.group(3)}"
    return name


def _decimal(value) -> float:
    """A float32 metadata value as the shortest decimal that rounds to it (1e-05, not
    9.999999747378752e-06): what the converter was given, and the same float32."""
    return float(str(np.float32(value)))


def _hf_config(gf: GGUFFile) -> dict:
    """A ``transformers`` (v5) config dict from the GGUF metadata."""
    meta, path = gf.metadata, gf.path
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise CheckpointError(f"{path}: general.architecture {arch!r} is not supported; "
                              f"expected one of {', '.join(ARCHITECTURES)}")

    def need(key: str):
        full = f"{arch}.{key}"
        if full not in meta:
            raise CheckpointError(f"{path}: missing metadata key {full!r}")
        return meta[full]

    hidden, heads = int(need("embedding_length")), int(need("attention.head_count"))
    kv_heads = int(meta.get(f"{arch}.attention.head_count_kv", heads))
    head_dim = int(meta.get(f"{arch}.attention.key_length", hidden // heads))
    value_dim = int(meta.get(f"{arch}.attention.value_length", head_dim))
    rope_dim = int(meta.get(f"{arch}.rope.dimension_count", head_dim))
    if value_dim != head_dim or rope_dim != head_dim:
        raise CheckpointError(f"{path}: key length {head_dim}, value length {value_dim} and "
                              f"rope dimension {rope_dim} differ; pagedspec needs one head size "
                              "rotated whole")
    theta = _decimal(meta.get(f"{arch}.rope.freq_base", 10000.0))
    rope = {"rope_type": "default", "rope_theta": theta}
    kind = meta.get(f"{arch}.rope.scaling.type", "none")
    linear = meta.get(f"{arch}.rope.scale_linear")       # the older spelling of linear scaling
    if kind == "linear" or (kind == "none" and linear not in (None, 1.0)):
        factor = meta.get(f"{arch}.rope.scaling.factor", linear)
        rope = {"rope_type": "linear", "factor": _decimal(factor), "rope_theta": theta}
    elif kind != "none":
        raise CheckpointError(f"{path}: metadata {arch}.rope.scaling.type = {kind!r} is not "
                              "supported; expected 'none' or 'linear'")
    if "rope_freqs.weight" in gf.tensors:
        raise CheckpointError(f"{path}: tensor 'rope_freqs.weight' "
                              f"({gf.tensors['rope_freqs.weight'].type_name}: per-frequency RoPE "
                              "factors, llama3-style scaling) is not supported")
    tokens = meta.get("tokenizer.ggml.tokens")
    embed = gf.tensors.get("token_embd.weight")
    # The embedding's rows are the model's vocabulary (a tokenizer list may be shorter)
    vocab = meta.get(f"{arch}.vocab_size") or (
        embed.shape[1] if embed is not None and len(embed.shape) == 2 else None) or (
        len(tokens) if tokens else None)
    if vocab is None:
        raise CheckpointError(f"{path}: no vocabulary size ({arch}.vocab_size, "
                              "tokenizer.ggml.tokens and token_embd.weight are all absent)")
    bias = "blk.0.attn_q.bias" in gf.tensors
    cfg = {
        "architectures": [ARCHITECTURES[arch]], "model_type": arch, "vocab_size": int(vocab),
        "hidden_size": hidden, "intermediate_size": int(need("feed_forward_length")),
        "num_hidden_layers": int(need("block_count")), "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "head_dim": head_dim,
        "max_position_embeddings": int(need("context_length")),
        "rms_norm_eps": _decimal(need("attention.layer_norm_rms_epsilon")),
        "rope_parameters": rope, "hidden_act": "silu",
        "tie_word_embeddings": "output.weight" not in gf.tensors,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "dtype": dtype_name(_default_dtype(gf)),
    }
    if arch == "llama":
        cfg.update(attention_bias=bias, mlp_bias="blk.0.ffn_up.bias" in gf.tensors)
    else:
        cfg.update(use_sliding_window=False)
    return cfg


def _default_dtype(gf: GGUFFile) -> torch.dtype:
    """float32 / float16 / bfloat16 for a file of only that float type (and F32 norms), else
    bfloat16: dequantized weights are approximations already, and bf16 halves the memory."""
    kinds = {info.qtype for info in gf.tensors.values()} - {GGMLQuantizationType.F32}
    if not kinds:
        return torch.float32
    if kinds == {GGMLQuantizationType.F16}:
        return torch.float16
    return torch.bfloat16


class GGUFTensors(TensorSource):
    """The weights of a GGUF file under their ``transformers`` names, dequantized on request,
    Q/K rows unpermuted for ``llama``."""

    def __init__(self, gf: GGUFFile, config: llama.LlamaConfig):
        self.file, self.config = gf, config
        self.gguf_names = {}
        for name in gf.tensors:
            # A name without a mapping stays as is: load_model reports it as unexpected.
            self.gguf_names[hf_name(name) or name] = name

    def names(self) -> set[str]:
        return set(self.gguf_names)

    def location(self, name: str) -> str:
        return f"{self.file.path}: tensor {self.gguf_names[name]!r} ({name})"

    def stored_name(self, name: str) -> str:
        return self.gguf_names.get(name) or gguf_name(name)

    def get(self, name: str) -> torch.Tensor:
        gname = self.gguf_names[name]
        w = self.file.tensor(gname)
        c = self.config
        if c.model_type == "llama":
            if ".self_attn.q_proj." in name:
                w = unpermute_rows(w, c.num_heads)
            elif ".self_attn.k_proj." in name:
                w = unpermute_rows(w, c.num_kv_heads)
        return w


@dataclass
class GGUFCheckpoint(Checkpoint):
    """A GGUF file as a :class:`Checkpoint`: ``path`` is the ``.gguf`` file, ``raw_config`` the
    ``transformers`` config its metadata amounts to, ``tokenizer_path`` the file too (it holds
    the tokenizer), ``gguf`` the parsed header."""
    gguf: Optional[GGUFFile] = field(default=None, repr=False)

    def default_dtype(self) -> torch.dtype:
        return _default_dtype(self.gguf)

    def load_model(self, dtype: torch.dtype, device: torch.device | str = "cpu"):
        """As :meth:`Checkpoint.load_model`, on one torch thread (:func:`_one_thread`)."""
        with _one_thread():
            return super().load_model(dtype, device)

    def kv_scales(self):
        return None   # GGUF files carry no FP8 KV scales

    def load_tokenizer(self):
        return build_tokenizer(self.gguf)


@contextlib.contextmanager
def _one_thread():
    """torch on one thread while dequantizing: a few thousand small memory-bound ops, which gain
    little from a second thread and lose a lot when the cores are shared (SmolLM2-135M into
    bfloat16 on 2 busy cores: 1.7-2.1 s on one thread, 8-24 s on two)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def load_gguf(path: Union[str, os.PathLike]) -> GGUFCheckpoint:
    """Parses a ``.gguf`` file's header (no tensor data is read) into a checkpoint."""
    gf = GGUFFile.open(path)
    raw = _hf_config(gf)
    try:
        config = llama.LlamaConfig.from_dict(raw, str(gf.path))
    except llama.ConfigError as exc:
        raise CheckpointError(str(exc)) from None
    meta = gf.metadata
    eos = [meta[k] for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id")
           if k in meta]
    generation = GenerationDefaults(tuple(dict.fromkeys(int(e) for e in eos)),
                                    meta.get("tokenizer.ggml.bos_token_id"))
    has_tokenizer = "tokenizer.ggml.tokens" in meta
    return GGUFCheckpoint(gf.path, ARCHITECTURES[meta["general.architecture"]], config, raw,
                          generation, GGUFTensors(gf, config),
                          gf.path if has_tokenizer else None,
                          chat_template=meta.get("tokenizer.chat_template"), gguf=gf)


# ---- tokenizer ----------------------------------------------------------------------------------
_GPT2_REGEX = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# tokenizer.ggml.pre -> the regexes llama.cpp (llama-vocab.cpp) splits text with, in order
_PRE_SPLITS = {
    **{name: [_GPT2_REGEX] for name in ("gpt-2", "gpt2", "phi-2", "mpt", "olmo", "jais")},
    **{name: [r"\p{N}", _GPT2_REGEX] for name in ("smollm", "starcoder", "refact", "command-r",
                                                 "codeshell", "exaone", "minerva")},
    **{name: [_LLAMA3_REGEX] for name in ("llama3", "llama-v3", "llama-bpe", "falcon3",
                                          "smaug-bpe", "dbrx")},
    **{name: [_QWEN2_REGEX] for name in ("qwen2", "deepseek-r1-qwen", "stablelm2", "megrez")},
}
# pre-tokenizers whose vocabulary llama.cpp looks up whole words in before merging
_IGNORE_MERGES = {"llama3", "llama-v3", "llama-bpe", "falcon3", "smaug-bpe", "dbrx"}
TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED = 3, 4


def build_tokenizer(gf: GGUFFile):
    """The byte-level BPE ``tokenizers.Tokenizer`` that ``tokenizer.ggml.*`` describes
    (``model`` 'gpt2'): vocabulary in id order, merges in rank order, the pre-tokenizer regexes
    of ``pre`` as llama.cpp applies them, control tokens (type 3) as special added tokens,
    user-defined ones (type 4) as added tokens, and BOS/EOS added as ``add_bos_token`` /
    ``add_eos_token`` say."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    from tokenizers import processors

    meta, path = gf.metadata, gf.path
    kind = meta.get("tokenizer.ggml.model")
    if "tokenizer.ggml.tokens" not in meta:
        raise CheckpointError(f"{path}: no tokenizer (tokenizer.ggml.tokens is absent); pass "
                              "token ids and skip_tokenizer_init=True to run without one")
    if kind != "gpt2":
        raise CheckpointError(f"{path}: tokenizer.ggml.model {kind!r} is not supported; "
                              "expected 'gpt2' (byte-level BPE)")
    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre not in _PRE_SPLITS:
        raise CheckpointError(f"{path}: tokenizer.ggml.pre {pre!r} is not supported; expected "
                              f"one of {', '.join(sorted(_PRE_SPLITS))}")
    tokens = meta["tokenizer.ggml.tokens"]
    vocab = {token: i for i, token in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise CheckpointError(f"{path}: tokenizer.ggml.tokens lists a token twice "
                              f"({len(tokens) - len(vocab)} duplicates)")
    merges = []
    for i, merge in enumerate(meta.get("tokenizer.ggml.merges") or ()):
        parts = merge.split(" ")
        if len(parts) != 2 or parts[0] not in vocab or parts[1] not in vocab:
            raise CheckpointError(f"{path}: tokenizer.ggml.merges[{i}] = {merge!r} is not two "
                                  "vocabulary tokens separated by a space")
        merges.append((parts[0], parts[1]))
    if not merges:
        raise CheckpointError(f"{path}: tokenizer.ggml.merges is missing or empty (a byte-level "
                              "BPE needs its merges)")
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False,
                               ignore_merges=pre in _IGNORE_MERGES))
    splits = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in _PRE_SPLITS[pre]]
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        splits + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    types = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    if len(types) != len(tokens):
        raise CheckpointError(f"{path}: tokenizer.ggml.token_type has {len(types)} entries, "
                              f"tokenizer.ggml.tokens {len(tokens)}")
    special = [AddedToken(t, special=True, normalized=False)
               for t, kind_ in zip(tokens, types) if kind_ == TOKEN_TYPE_CONTROL]
    added = [AddedToken(t, special=False, normalized=False)
             for t, kind_ in zip(tokens, types) if kind_ == TOKEN_TYPE_USER_DEFINED]
    tok.add_special_tokens(special)
    tok.add_tokens(added)
    ends = []
    for flag, key in (("tokenizer.ggml.add_bos_token", "tokenizer.ggml.bos_token_id"),
                      ("tokenizer.ggml.add_eos_token", "tokenizer.ggml.eos_token_id")):
        if meta.get(flag, False):
            if key not in meta or not 0 <= meta[key] < len(tokens):
                raise CheckpointError(f"{path}: {flag} is set but {key} is "
                                      f"{meta.get(key)!r} (not a token id)")
            ends.append((tokens[meta[key]], meta[key]))
    if ends:
        bos = ends[0] if meta.get("tokenizer.ggml.add_bos_token", False) else None
        eos = ends[-1] if meta.get("tokenizer.ggml.add_eos_token", False) else None
        single = " ".join(([bos[0]] if bos else []) + ["$A"] + ([eos[0]] if eos else []))
        pair = single + " " + " ".join(["$B:1"] + ([eos[0] + ":1"] if eos else []))
        tok.post_processor = processors.TemplateProcessing(
            single=single, pair=pair, special_tokens=list(dict.fromkeys(ends)))
    return tok


# ---- conversion to a Hugging Face directory ----------------------------------------------------
_SAFETENSORS_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}


def _conversion_dtype(gf: GGUFFile) -> torch.dtype:
    """float16 / bfloat16 for a file of only that type (and F32), else float32: the dtype that
    holds every dequantized weight exactly."""
    kinds = {info.qtype for info in gf.tensors.values()} - {GGMLQuantizationType.F32}
    if kinds == {GGMLQuantizationType.F16}:
        return torch.float16
    if kinds == {GGMLQuantizationType.BF16}:
        return torch.bfloat16
    return torch.float32


def convert_gguf(src: Union[str, os.PathLike], out_dir: Union[str, os.PathLike],
                 dtype: Optional[torch.dtype] = None) -> Path:
    """Writes the GGUF checkpoint ``src`` as a Hugging Face directory ``out_dir`` (created):
    ``config.json``, ``model.safetensors`` (dequantized, Q/K unpermuted, in ``dtype``: by
    default the one that holds the dequantized values exactly, float32 for quantized files),
    ``generation_config.json``, ``tokenizer.json`` + ``tokenizer_config.json`` and
    ``chat_template.jinja`` when the file has a template. Tensors are streamed to the
    safetensors file one at a time. Returns ``out_dir``; raises :class:`CheckpointError`."""
    ckpt = load_gguf(src)
    gf = ckpt.gguf
    dtype = dtype or _conversion_dtype(gf)
    if dtype not in _SAFETENSORS_DTYPES:
        raise ValueError(f"convert_gguf: dtype must be float32, float16 or bfloat16, got {dtype}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    shapes = ckpt.config.weight_shapes()
    present = ckpt.weights.names()
    missing = sorted(set(shapes) - present)
    if missing:
        raise CheckpointError(f"{gf.path}: missing tensor {missing[0]!r} ({len(missing)} "
                              "missing in all)")
    with _one_thread():
        _write_safetensors(out / "model.safetensors", shapes, dtype, ckpt.weights)
    (out / "config.json").write_text(json.dumps(ckpt.raw_config, indent=2) + "\n")
    gen = {"bos_token_id": ckpt.generation.bos_token_id}
    eos = list(ckpt.generation.eos_token_ids)
    gen["eos_token_id"] = eos[0] if len(eos) == 1 else eos
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    if ckpt.tokenizer_path is not None:
        tok = ckpt.load_tokenizer()
        tok.save(str(out / "tokenizer.json"))
        meta = gf.metadata
        tokens = meta["tokenizer.ggml.tokens"]

        def token(key: str) -> Optional[str]:
            i = meta.get(f"tokenizer.ggml.{key}")
            return tokens[i] if i is not None and 0 <= i < len(tokens) else None

        config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": token("bos_token_id"),
                  "eos_token": token("eos_token_id"), "unk_token": token("unknown_token_id"),
                  "pad_token": token("padding_token_id"),
                  "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
                  "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
                  "model_max_length": ckpt.config.max_position}
        (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    if ckpt.chat_template is not None:
        (out / "chat_template.jinja").write_text(ckpt.chat_template)
    return out


def _write_safetensors(path: Path, shapes: dict[str, tuple[int, ...]], dtype: torch.dtype,
                       weights: TensorSource) -> None:
    """A safetensors file written tensor by tensor (header first: shapes are known), so only
    one dequantized tensor is in memory at a time."""
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, shape in shapes.items():
        n = dtype.itemsize
        for d in shape:
            n *= d
        header[name] = {"dtype": _SAFETENSORS_DTYPES[dtype], "shape": list(shape),
                        "data_offsets": [offset, offset + n]}
        offset += n
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)                     # the data starts 8-byte aligned
    tmp = path.with_name(path.name + ".partial")
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob)
        for name, shape in shapes.items():
            w = weights.get(name)
            if tuple(w.shape) != shape:
                raise CheckpointError(f"{weights.location(name)} has shape {list(w.shape)}, "
                                      f"expected {list(shape)}")
            f.write(w.to(dtype).contiguous().view(torch.uint8).numpy().tobytes())
    os.replace(tmp, path)


def main_convert(argv: Optional[Sequence[str]] = None) -> int:
    """``pagedspec convert IN.gguf OUT_DIR``: returns the exit status (0, or 1 with the error on
    stderr)."""
    parser = argparse.ArgumentParser(
        prog="pagedspec convert", usage="pagedspec convert IN.gguf OUT_DIR [--dtype DTYPE]",
        description="Write a GGUF checkpoint as a Hugging Face directory (config.json, "
                    "model.safetensors, generation_config.json, tokenizer.json, "
                    "chat_template.jinja) that pagedspec and transformers load.")
    parser.add_argument("src", metavar="IN.gguf", help="the GGUF file (llama or qwen2)")
    parser.add_argument("out_dir", metavar="OUT_DIR", help="the directory to write (created)")
    parser.add_argument("--dtype", choices=["auto", "float32", "float16", "bfloat16"],
                        default="auto", help="weights' dtype; auto: float32 for quantized "
                        "files, which holds every dequantized value exactly (default)")
    args = parser.parse_args(argv)
    dtype = None if args.dtype == "auto" else getattr(torch, args.dtype)
    try:
        out = convert_gguf(args.src, args.out_dir, dtype)
    except CheckpointError as exc:
        print(f"pagedspec convert: {exc}", file=sys.stderr)
        return 1
    print(f"pagedspec convert: wrote {out}")
    return 0
