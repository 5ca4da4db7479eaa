"""Model hyper-parameters read from GGUF metadata."""

from __future__ import annotations

from dataclasses import dataclass

from localllm.errors import ModelLoadError

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3")


@dataclass(frozen=True, slots=True)
class RopeScaling:
    """How RoPE frequencies are stretched beyond the trained context.

    ``kind`` is ``"none"``, ``"linear"`` (positions divided by ``factor``) or ``"freq_factors"``
    (llama 3.x: a per-frequency divisor stored by llama.cpp as the ``rope_freqs.weight`` tensor).
    """

    kind: str = "none"
    factor: float = 1.0


@dataclass(frozen=True, slots=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_dim: int
    rope_neox: bool  # True: rotate halves (qwen); False: rotate adjacent pairs (llama.cpp's llama layout)
    rope_scaling: RopeScaling
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    name: str = ""

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


def config_from_gguf_metadata(meta: dict, tensor_names: set[str], path: str = "") -> ModelConfig:
    """Build a :class:`ModelConfig` from GGUF key/values; raise ModelLoadError naming what is missing."""
    arch = meta.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(
            f"{path}: architecture {arch!r} is not supported (supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
        )

    def need(key: str):
        full = f"{arch}.{key}"
        if full not in meta:
            raise ModelLoadError(f"{path}: GGUF metadata key {full!r} is missing")
        return meta[full]

    hidden = int(need("embedding_length"))
    num_heads = int(need("attention.head_count"))
    num_kv_heads = int(meta.get(f"{arch}.attention.head_count_kv", num_heads))
    head_dim = int(meta.get(f"{arch}.attention.key_length", hidden // num_heads))
    if int(meta.get(f"{arch}.attention.value_length", head_dim)) != head_dim:
        raise ModelLoadError(f"{path}: different key and value head sizes are not supported")
    if num_heads % num_kv_heads:
        raise ModelLoadError(f"{path}: head_count {num_heads} is not a multiple of head_count_kv {num_kv_heads}")
    if "token_embd.weight" not in tensor_names:
        raise ModelLoadError(f"{path}: tensor 'token_embd.weight' is missing")
    vocab = meta.get(f"{arch}.vocab_size")
    if vocab is None:
        tokens = meta.get("tokenizer.ggml.tokens")
        vocab = len(tokens) if tokens is not None else None
    if vocab is None:
        raise ModelLoadError(f"{path}: cannot tell the vocabulary size")

    scaling = RopeScaling()
    if "rope_freqs.weight" in tensor_names:
        scaling = RopeScaling(kind="freq_factors")
    else:
        kind = meta.get(f"{arch}.rope.scaling.type", "none")
        factor = float(meta.get(f"{arch}.rope.scaling.factor", 1.0) or 1.0)
        if kind == "linear" and factor != 1.0:
            scaling = RopeScaling(kind="linear", factor=factor)
        elif kind not in ("none", "linear", None):
            raise ModelLoadError(f"{path}: RoPE scaling type {kind!r} is not supported")

    return ModelConfig(
        architecture=arch,
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(need("feed_forward_length")),
        num_layers=int(need("block_count")),
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(need("attention.layer_norm_rms_epsilon")),
        rope_theta=float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
        rope_dim=int(meta.get(f"{arch}.rope.dimension_count", head_dim)),
        rope_neox=arch in ("qwen2", "qwen3"),
        rope_scaling=scaling,
        max_position_embeddings=int(meta.get(f"{arch}.context_length", 2048)),
        tie_word_embeddings="output.weight" not in tensor_names,
        qkv_bias="blk.0.attn_q.bias" in tensor_names,
        qk_norm="blk.0.attn_q_norm.weight" in tensor_names,
        name=str(meta.get("general.name", "")),
    )
