"""Build a model from a GGUF file; weights stay packed and memory-mapped."""

from __future__ import annotations

import torch

from localllm.errors import ModelLoadError
from localllm.models.config import ModelConfig, config_from_gguf_metadata
from localllm.models.gguf_file import GGUFFile, read_gguf
from localllm.models.llama import MLP, Attention, DecoderLayer, LlamaForCausalLM, RMSNorm, RotaryEmbedding
from localllm.quant.gguf_dequant import check_qtype, dequantize
from localllm.quant.linear import QuantEmbedding, QuantLinear, tensor_from_numpy


def required_tensor_names(config: ModelConfig) -> list[str]:
    names = ["token_embd.weight", "output_norm.weight"]
    if not config.tie_word_embeddings:
        names.append("output.weight")
    per_layer = ["attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm", "ffn_gate", "ffn_up", "ffn_down"]
    if config.qkv_bias:
        per_layer += ["attn_q.bias", "attn_k.bias", "attn_v.bias"]
    if config.qk_norm:
        per_layer += ["attn_q_norm", "attn_k_norm"]
    for i in range(config.num_layers):
        for p in per_layer:
            names.append(f"blk.{i}.{p}" if p.endswith(".bias") else f"blk.{i}.{p}.weight")
    return names


class _Weights:
    def __init__(self, gf: GGUFFile) -> None:
        self.gf = gf

    def check_shape(self, name: str, shape: tuple[int, ...]) -> None:
        t = self.gf.tensors[name]
        if tuple(t.shape) != tuple(shape):
            raise ModelLoadError(f"{self.gf.path}: tensor {name!r} has shape {t.shape}, expected {tuple(shape)}")

    def dense(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        """A small tensor (norms, biases) as float32, copied out of the file."""
        self.check_shape(name, shape)
        t = self.gf.tensors[name]
        rows = tensor_from_numpy(t.data).reshape(1, -1)  # one row: every supported type has whole blocks here
        return dequantize(rows, check_qtype(t.qtype, name)).reshape(shape).float().clone()

    def linear(self, name: str, in_features: int, out_features: int, bias: torch.Tensor | None = None) -> QuantLinear:
        self.check_shape(name, (out_features, in_features))
        t = self.gf.tensors[name]
        return QuantLinear(t.data, t.qtype, in_features, out_features, bias, name=name)


def build_model(gf: GGUFFile, dtype: torch.dtype = torch.float32) -> LlamaForCausalLM:
    """Assemble the model over ``gf``'s tensors; raise ModelLoadError naming what is wrong."""
    config = config_from_gguf_metadata(gf.metadata, set(gf.tensors), str(gf.path))
    missing = [n for n in required_tensor_names(config) if n not in gf.tensors]
    if missing:
        more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
        raise ModelLoadError(f"{gf.path}: missing tensors: {', '.join(missing[:5])}{more}")
    for name, t in gf.tensors.items():
        check_qtype(t.qtype, name)

    w = _Weights(gf)
    H, D = config.hidden_size, config.head_dim
    emb_t = gf.tensors["token_embd.weight"]
    w.check_shape("token_embd.weight", (config.vocab_size, H))
    embed = QuantEmbedding(emb_t.data, emb_t.qtype, config.vocab_size, H, name="token_embd.weight")
    if config.tie_word_embeddings:
        lm_head = embed.as_linear()
    else:
        lm_head = w.linear("output.weight", H, config.vocab_size)
        lm_head.is_lm_head = True  # a fast backend keeps its top logits exact

    freq_factors = None
    if config.rope_scaling.kind == "freq_factors":
        freq_factors = w.dense("rope_freqs.weight", (config.rope_dim // 2,))
    rope = RotaryEmbedding(config, freq_factors)

    layers = []
    for i in range(config.num_layers):
        p = f"blk.{i}."
        biases = [None, None, None]
        if config.qkv_bias:
            biases = [w.dense(p + f"attn_{x}.bias", (n,)) for x, n in
                      (("q", config.q_size), ("k", config.kv_size), ("v", config.kv_size))]
        q_norm = k_norm = None
        if config.qk_norm:
            q_norm = RMSNorm(w.dense(p + "attn_q_norm.weight", (D,)), config.rms_norm_eps)
            k_norm = RMSNorm(w.dense(p + "attn_k_norm.weight", (D,)), config.rms_norm_eps)
        attn = Attention(
            config,
            w.linear(p + "attn_q.weight", H, config.q_size, biases[0]),
            w.linear(p + "attn_k.weight", H, config.kv_size, biases[1]),
            w.linear(p + "attn_v.weight", H, config.kv_size, biases[2]),
            w.linear(p + "attn_output.weight", config.q_size, H),
            q_norm,
            k_norm,
            rope,
        )
        mlp = MLP(
            w.linear(p + "ffn_gate.weight", H, config.intermediate_size),
            w.linear(p + "ffn_up.weight", H, config.intermediate_size),
            w.linear(p + "ffn_down.weight", config.intermediate_size, H),
        )
        layers.append(
            DecoderLayer(
                RMSNorm(w.dense(p + "attn_norm.weight", (H,)), config.rms_norm_eps),
                attn,
                RMSNorm(w.dense(p + "ffn_norm.weight", (H,)), config.rms_norm_eps),
                mlp,
            )
        )
    norm = RMSNorm(w.dense("output_norm.weight", (H,)), config.rms_norm_eps)
    return LlamaForCausalLM(config, embed, layers, norm, lm_head, dtype).eval()


def load_model(path, dtype: torch.dtype = torch.float32) -> tuple[LlamaForCausalLM, GGUFFile]:
    gf = read_gguf(path)
    return build_model(gf, dtype), gf
