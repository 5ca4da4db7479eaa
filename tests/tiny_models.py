"""Tiny random GGUF models (llama / qwen2 / qwen3) for tests, written with ``gguf.GGUFWriter``.

The files follow llama.cpp's conventions (key names, tensor names, the permuted Q/K layout of
arch ``llama``, ``rope_freqs.weight`` for llama-3 style RoPE) and carry a small working byte-level
BPE tokenizer (``tokenizer.ggml.model = "gpt2"``), so that localllm and transformers both load them:

    path = write_tiny_model(tmp_path / "tiny.gguf", arch="qwen3", head_dim=128)
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter
from gguf import quants as gguf_quants

from localllm.quant.gguf_dequant import SUPPORTED_QTYPES
from localllm.quant.testing import random_quantized

T = GGMLQuantizationType

# Merges of the tiny BPE, in priority order; every merge result becomes a vocabulary token.
# "Ġ" is the GPT-2 byte-to-unicode spelling of a space.
MERGES: tuple[tuple[str, str], ...] = (
    ("Ġ", "t"), ("h", "e"), ("i", "n"), ("Ġ", "a"), ("e", "r"), ("o", "n"), ("Ġ", "s"), ("r", "e"),
    ("a", "n"), ("o", "r"), ("l", "l"), ("e", "n"), ("Ġt", "he"), ("Ġ", "w"), ("a", "t"), ("Ġ", "o"),
    ("i", "s"), ("e", "s"), ("Ġ", "c"), ("i", "t"), ("o", "u"), ("Ġ", "b"), ("Ġ", "f"), ("Ġ", "h"),
    ("Ġ", "m"), ("Ġ", "d"), ("Ġ", "i"), ("Ġ", "p"), ("a", "r"), ("l", "e"), ("Ġ", "he"),
    ("Ġo", "n"), ("Ġ", "in"), ("Ġa", "n"), ("Ġw", "or"), ("ll", "o"), ("e", "llo"), ("Ġh", "ello"),
    ("Ġwor", "l"), ("Ġworl", "d"),
)
SPECIAL_TOKENS = ("<|bos|>", "<|eos|>", "<|im_start|>", "<|im_end|>")

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_TOKEN_NORMAL, _TOKEN_CONTROL = 1, 3


def byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from bytes to printable unicode characters."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def tiny_vocab() -> tuple[list[str], list[int], list[str]]:
    """(tokens, token types, merges) of the tiny tokenizer: 256 bytes + merges + special tokens."""
    tokens = [byte_to_unicode()[b] for b in range(256)]
    for a, b in MERGES:
        assert a in tokens and b in tokens and a + b not in tokens, (a, b)
        tokens.append(a + b)
    types = [_TOKEN_NORMAL] * len(tokens)
    tokens += list(SPECIAL_TOKENS)
    types += [_TOKEN_CONTROL] * len(SPECIAL_TOKENS)
    return tokens, types, [f"{a} {b}" for a, b in MERGES]


VOCAB_SIZE = len(tiny_vocab()[0])
BOS_ID = VOCAB_SIZE - len(SPECIAL_TOKENS)
EOS_ID = BOS_ID + 1


def write_tiny_model(
    path: str | Path,
    arch: str = "llama",
    qtype: GGMLQuantizationType = T.F32,
    *,
    tie_embeddings: bool = True,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int | None = None,
    hidden: int = 256,
    intermediate: int = 512,
    layers: int = 2,
    context_length: int = 256,
    rope_freqs: bool = False,
    rope_theta: float = 10000.0,
    seed: int = 0,
    overrides: dict[str, object] | None = None,
    tensor_types: dict[str, GGMLQuantizationType] | None = None,
    skip_tensors: tuple[str, ...] = (),
    extra_weights: dict[str, int] | None = None,
    gguf_quantized: frozenset[GGMLQuantizationType] = frozenset(),
) -> Path:
    """Write a tiny random model to ``path`` and return the path.

    ``qtype`` is the type of every 2-D weight (token embedding and output head included); norms,
    biases and ``rope_freqs`` are F32. ``head_dim`` defaults to ``hidden // num_heads``; when it
    differs, ``attention.key_length``/``value_length`` say so (as for qwen3). qwen2 gets Q/K/V
    biases, qwen3 gets Q/K RMS norms, like the real architectures. Keep ``hidden``,
    ``intermediate`` and ``num_heads * head_dim`` multiples of 256 for the K-quant types.

    For broken-file tests: ``overrides`` replaces metadata values (``general.architecture`` too),
    ``tensor_types`` sets the type of single tensors by name (any GGUF type: random bytes of the
    right size are written), ``skip_tensors`` leaves tensors out. ``extra_weights`` adds 2-D weights of
    ``qtype`` by name and row count (``hidden`` columns), such as a reranker's ``cls.output.weight``.
    Weights of a type in ``gguf_quantized`` are normal weights quantized by ``gguf.quants.quantize``
    (as a converter writes them), not random blocks.
    """
    path = Path(path)
    overrides = dict(overrides or {})
    tensor_types = dict(tensor_types or {})
    qtype = GGMLQuantizationType(qtype)
    head_dim = head_dim or hidden // num_heads
    arch_key = str(overrides.pop("general.architecture", arch))
    rng = np.random.default_rng(seed)
    tokens, token_types, merges = tiny_vocab()
    vocab = len(tokens)

    writer = GGUFWriter(str(path), arch_key)
    writer.add_name(f"tiny-{arch}")
    writer.add_context_length(context_length)
    writer.add_embedding_length(hidden)
    writer.add_block_count(layers)
    writer.add_feed_forward_length(intermediate)
    writer.add_head_count(num_heads)
    writer.add_head_count_kv(num_kv_heads)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(rope_theta)
    writer.add_rope_dimension_count(head_dim)
    writer.add_vocab_size(vocab)
    if head_dim != hidden // num_heads:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)

    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2" if arch.startswith("qwen") else "gpt-2")
    writer.add_token_list(tokens)
    writer.add_token_types(token_types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(BOS_ID)
    writer.add_eos_token_id(EOS_ID)
    writer.add_add_bos_token(True)
    writer.add_chat_template(CHAT_TEMPLATE)

    for key, value in overrides.items():
        if key in writer.kv_data[0]:
            del writer.kv_data[0][key]
        if isinstance(value, str):
            writer.add_string(key, value)
        elif isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, int):
            writer.add_uint32(key, value)
        else:
            writer.add_float32(key, float(value))

    counter = iter(range(seed * 1000 + 1, seed * 1000 + 1000))

    def weight(name: str, rows: int, cols: int) -> None:
        if name in skip_tensors:
            return
        t = GGMLQuantizationType(tensor_types.get(name, qtype))
        if t in gguf_quantized:
            weights = (rng.standard_normal((rows, cols)) * 0.02).astype(np.float32)
            writer.add_tensor(name, gguf_quants.quantize(weights, t), raw_dtype=t)
        elif t in (T.F32, T.F16):
            writer.add_tensor(name, random_quantized(t, rows, cols, next(counter)))
        elif t in SUPPORTED_QTYPES:
            writer.add_tensor(name, random_quantized(t, rows, cols, next(counter)), raw_dtype=t)
        else:  # a type localllm cannot read: random bytes of the right size ("unsupported type" tests)
            block, size = GGML_QUANT_SIZES[t]
            data = rng.integers(0, 256, size=(rows, cols // block * size), dtype=np.uint8)
            writer.add_tensor(name, data, raw_dtype=t)

    def vector(name: str, n: int, mean: float, std: float) -> None:
        if name in skip_tensors:
            return
        writer.add_tensor(name, (mean + std * rng.standard_normal(n)).astype(np.float32))

    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    weight("token_embd.weight", vocab, hidden)
    if rope_freqs and "rope_freqs.weight" not in skip_tensors:
        # llama 3.x: divisors of each RoPE frequency, 1 for the fast ones up to 8 for the slow ones.
        writer.add_tensor("rope_freqs.weight", np.geomspace(1.0, 8.0, head_dim // 2).astype(np.float32))
    for i in range(layers):
        p = f"blk.{i}."
        vector(p + "attn_norm.weight", hidden, 1.0, 0.1)
        weight(p + "attn_q.weight", q_size, hidden)
        weight(p + "attn_k.weight", kv_size, hidden)
        weight(p + "attn_v.weight", kv_size, hidden)
        if arch == "qwen2":
            vector(p + "attn_q.bias", q_size, 0.0, 0.1)
            vector(p + "attn_k.bias", kv_size, 0.0, 0.1)
            vector(p + "attn_v.bias", kv_size, 0.0, 0.1)
        if arch == "qwen3":
            vector(p + "attn_q_norm.weight", head_dim, 1.0, 0.1)
            vector(p + "attn_k_norm.weight", head_dim, 1.0, 0.1)
        weight(p + "attn_output.weight", hidden, q_size)
        vector(p + "ffn_norm.weight", hidden, 1.0, 0.1)
        weight(p + "ffn_gate.weight", intermediate, hidden)
        weight(p + "ffn_up.weight", intermediate, hidden)
        weight(p + "ffn_down.weight", hidden, intermediate)
    vector("output_norm.weight", hidden, 1.0, 0.1)
    if not tie_embeddings:
        weight("output.weight", vocab, hidden)
    for name, rows in (extra_weights or {}).items():
        weight(name, rows, hidden)

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def write_first_layers(source: str | Path, path: str | Path, layers: int) -> Path:
    """Copy the GGUF model at ``source`` keeping only its first ``layers`` blocks: a smaller model
    with the same vocabulary, embeddings and head (a draft model made from the model itself, as
    self-speculative decoding's early exit does). Every other key and tensor is copied unchanged."""
    from gguf import GGUFReader, GGUFValueType, Keys

    reader = GGUFReader(str(source))
    arch = reader.fields[Keys.General.ARCHITECTURE].contents()
    block_count = Keys.LLM.BLOCK_COUNT.format(arch=arch)
    writer = GGUFWriter(str(path), arch)
    for f in reader.fields.values():
        if f.name == Keys.General.ARCHITECTURE or f.name.startswith("GGUF."):
            continue
        kind = f.types[0]
        sub = f.types[-1] if kind == GGUFValueType.ARRAY else None
        value = layers if f.name == block_count else f.contents()
        writer.add_key_value(f.name, value, kind, sub_type=sub)
    kept = [t for t in reader.tensors
            if not t.name.startswith("blk.") or int(t.name.split(".")[1]) < layers]
    for t in kept:
        writer.add_tensor_info(t.name, t.data.shape, t.data.dtype, t.data.nbytes, t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for t in kept:
        writer.write_tensor_data(t.data, tensor_endianess=reader.endianess)
    writer.close()
    return Path(path)


def add_to_store(name: str, path: Path) -> None:
    """Put ``path`` in the store (LOCALLLM_HOME) the way pull does: file first, manifest last."""
    from localllm.store import local

    directory = local.model_dir(name)
    directory.mkdir(parents=True, exist_ok=True)
    data = path.read_bytes()
    (directory / path.name).write_bytes(data)
    local.write_manifest(name, source={"type": "file", "path": str(path)},
                         files=[{"name": path.name, "size": len(data), "sha256": hashlib.sha256(data).hexdigest()}],
                         format="gguf", quant="F32")
