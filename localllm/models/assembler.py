"""The one model assembler: a :class:`~localllm.models.decoder.DecoderModel` from any weight source.

Whatever the file (:mod:`localllm.models.sources`) and the architecture
(:mod:`localllm.models.registry`), the model is built here, from the source's
:class:`~localllm.models.config.ModelConfig` and its tensors by GGUF name; linear weights stay
as the file holds them (packed GGUF blocks, GPTQ, float), memory-mapped.
"""

from __future__ import annotations

import os

import torch

from localllm.errors import ModelLoadError
from localllm.models.config import ModelConfig, RopeScaling
from localllm.models.decoder import (
    MLP,
    Attention,
    Classifier,
    DecoderLayer,
    DecoderModel,
    QueryTemperature,
    RMSNorm,
    RotaryEmbedding,
    SparseMoE,
)
from localllm.models.linear_attention import GatedDeltaNet
from localllm.models.sources import Checkpoint, WeightSource, open_source
from localllm.quant.gptq.layout import fold_down_order
from localllm.quant.linear import QuantLinear


def required_weights(config: ModelConfig, fused: bool, mlp_norm: str = "ffn_norm") -> list[str]:
    """GGUF stems of every weight the decoder of ``config`` needs (biases are optional;
    ``mlp_norm``: the stem of the norm before the MLP; a linear-attention layer's projections,
    whose layout varies by file, are checked as it is built)."""
    names = ["token_embd", "output_norm"]
    if not config.tie_word_embeddings:
        names.append("output")
    per_layer = ["attn_norm", mlp_norm]
    attention = ["attn_output"] + (["attn_qkv"] if fused else ["attn_q", "attn_k", "attn_v"])
    if config.moe is not None:
        per_layer += ["ffn_gate_inp", "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"]
        if config.moe.shared_intermediate_size:
            per_layer += ["ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp"]
        if config.moe.shared_gate:
            per_layer.append("ffn_gate_inp_shexp")
    else:
        per_layer += ["ffn_up", "ffn_down"] if fused else ["ffn_gate", "ffn_up", "ffn_down"]
    if config.qk_norm:
        attention += ["attn_q_norm", "attn_k_norm"]
    if config.sandwich_norms:
        per_layer += ["post_attention_norm", "post_ffw_norm"]
    if config.attention_sinks:
        attention.append("attn_sinks")
    linear = ["ssm_conv1d", "ssm_norm", "ssm_out"]
    return names + [f"blk.{i}.{p}" for i in range(config.num_layers)
                    for p in per_layer + (linear if config.is_linear(i) else attention)]


def _ropes(source: WeightSource) -> tuple[RotaryEmbedding, RotaryEmbedding | None]:
    """The RoPE of the global layers, and the sliding layers' own (Gemma 3) or None."""
    config = source.config
    rope = RotaryEmbedding(config, source.freq_factors)
    local = None
    if config.local_rope_theta is not None and any(config.sliding_layers):
        local = RotaryEmbedding(config, None, theta=config.local_rope_theta, scaling=RopeScaling())
    return rope, local


def _temperature(config: ModelConfig) -> QueryTemperature | None:
    """The attention temperature every layer shares, or None where the model has none."""
    if not config.attn_temperature_scale:
        return None
    return QueryTemperature(config.attn_temperature_scale, config.attn_temperature_length,
                            config.max_position_embeddings)


def build_layer(source: WeightSource, i: int, rope: RotaryEmbedding,
                local_rope: RotaryEmbedding | None = None,
                temperature: QueryTemperature | None = None) -> DecoderLayer:
    """Decoder layer ``i`` over ``source``'s tensors (``local_rope``: the sliding layers' RoPE,
    when they have their own; a NoPE layer gets none; ``temperature``: the attention temperature
    every layer shares)."""
    config = source.config
    fused = source.architecture.fused_projections
    H, I = config.hidden_size, config.intermediate_size

    def norm(stem: str, size: int) -> RMSNorm:
        return RMSNorm(source.norm(stem, (size,)), config.rms_norm_eps)

    p = f"blk.{i}."
    mixer = (_linear_attention(source, p) if config.is_linear(i)
             else _attention(source, i, rope, local_rope, temperature))
    if config.moe is not None:
        mlp = _experts(source, p, config)
    else:
        if fused:
            gate_proj, up_proj = source.linear(p + "ffn_up", H, I, rows=(0, I)), source.linear(p + "ffn_up", H, I,
                                                                                              rows=(I, 2 * I))
        else:
            gate_proj, up_proj = source.linear(p + "ffn_gate", H, I), source.linear(p + "ffn_up", H, I)
        # GPTQ act-order: down's input order folded into gate's and up's outputs (the same MLP)
        mlp = MLP(*fold_down_order(gate_proj, up_proj, source.linear(p + "ffn_down", I, H)), config.activation)
    sandwich = config.sandwich_norms
    return DecoderLayer(
        norm(p + "attn_norm", H), mixer, norm(p + source.architecture.mlp_norm, H), mlp,
        post_attn_norm=norm(p + "post_attention_norm", H) if sandwich else None,
        post_mlp_norm=norm(p + "post_ffw_norm", H) if sandwich else None,
    )


def _attention(source: WeightSource, i: int, rope: RotaryEmbedding, local_rope: RotaryEmbedding | None,
               temperature: QueryTemperature | None) -> Attention:
    """Layer ``i``'s attention (with its output gate's rows after each head's query rows in ``attn_q``
    where the config has one)."""
    config = source.config
    fused = source.architecture.fused_projections
    H, D = config.hidden_size, config.head_dim
    q, kv = config.q_size * (2 if config.attn_output_gate else 1), config.kv_size

    def norm(stem: str, size: int) -> RMSNorm:
        return RMSNorm(source.norm(stem, (size,)), config.rms_norm_eps)

    p = f"blk.{i}."
    if fused:
        q_proj = source.linear(p + "attn_qkv", H, q, rows=(0, q))
        k_proj = source.linear(p + "attn_qkv", H, kv, rows=(q, q + kv))
        v_proj = source.linear(p + "attn_qkv", H, kv, rows=(q + kv, q + 2 * kv))
    else:
        q_proj, k_proj, v_proj = (source.linear(p + n, H, size) for n, size in
                                  (("attn_q", q), ("attn_k", kv), ("attn_v", kv)))
    window = config.layer_window(i)
    q_norm_size, k_norm_size = (config.q_size, kv) if config.qk_norm_full else (D, D)
    if not config.layer_rotates(i):
        layer_rope = None
    else:
        layer_rope = local_rope if window is not None and local_rope is not None else rope
    return Attention(
        config, q_proj, k_proj, v_proj, source.linear(p + "attn_output", config.q_size, H),
        norm(p + "attn_q_norm", q_norm_size) if config.qk_norm else None,
        norm(p + "attn_k_norm", k_norm_size) if config.qk_norm else None,
        layer_rope, sliding_window=window, temperature=temperature,
        sinks=source.vector(p + "attn_sinks.weight", (config.num_heads,)) if config.attention_sinks else None,
    )


def _linear_attention(source: WeightSource, prefix: str) -> GatedDeltaNet:
    """Layer ``prefix``'s Gated DeltaNet, from whichever projections the file has: ``ssm_in``
    (q, k, v, z per key head) or ``attn_qkv`` and ``attn_gate``; ``ssm_ba`` (b, a per key head) or
    ``ssm_beta`` and ``ssm_alpha``."""
    config = source.config
    la, H = config.linear_attention, config.hidden_size
    heads = la.num_value_heads
    projections = {}
    if source.has(prefix + "ssm_in"):
        projections["qkvz"] = source.linear(prefix + "ssm_in", H, la.conv_channels + la.value_size)
    else:
        projections["qkv"] = source.linear(prefix + "attn_qkv", H, la.conv_channels)
        projections["z"] = source.linear(prefix + "attn_gate", H, la.value_size)
    if source.has(prefix + "ssm_ba"):
        projections["ba"] = source.linear(prefix + "ssm_ba", H, 2 * heads)
    else:
        projections["b"] = source.linear(prefix + "ssm_beta", H, heads)
        projections["a"] = source.linear(prefix + "ssm_alpha", H, heads)
    return GatedDeltaNet(
        config, projections,
        conv_weight=source.vector(prefix + "ssm_conv1d.weight", (la.conv_channels, la.conv_kernel)),
        dt_bias=source.vector(prefix + "ssm_dt.bias", (heads,)),
        neg_a=source.vector(prefix + "ssm_a", (heads,)),
        norm_weight=source.vector(prefix + "ssm_norm.weight", (la.value_head_dim,)),  # (no norm offset: a plain weight)
        out_proj=source.linear(prefix + "ssm_out", la.value_size, H),
    )


def _experts(source: WeightSource, prefix: str, config: ModelConfig) -> SparseMoE:
    """Layer ``prefix``'s router and experts: each expert's linears are row views of the file's
    3-D expert tensors (``ffn_{gate,up,down}_exps``, one matrix per expert)."""
    moe = config.moe
    H, I = config.hidden_size, moe.expert_intermediate_size
    experts = [MLP(source.expert_linear(prefix + "ffn_gate_exps", e, moe.num_experts, H, I),
                   source.expert_linear(prefix + "ffn_up_exps", e, moe.num_experts, H, I),
                   source.expert_linear(prefix + "ffn_down_exps", e, moe.num_experts, I, H), config.activation,
                   alpha=config.swiglu_alpha, limit=config.swiglu_limit)
               for e in range(moe.num_experts)]
    shared = shared_gate = None
    S = moe.shared_intermediate_size
    if S:
        shared = MLP(source.linear(prefix + "ffn_gate_shexp", H, S), source.linear(prefix + "ffn_up_shexp", H, S),
                     source.linear(prefix + "ffn_down_shexp", S, H), config.activation)
    if moe.shared_gate:
        shared_gate = source.linear(prefix + "ffn_gate_inp_shexp", H, 1)
    bias_name = prefix + "exp_probs_b.bias"  # (transformers' e_score_correction_bias)
    selection_bias = source.vector(bias_name, (moe.num_experts,)) if source.has_vector(bias_name) else None
    return SparseMoE(source.linear(prefix + "ffn_gate_inp", H, moe.num_experts), experts, moe, shared, shared_gate,
                     selection_bias)


def build_model(source: WeightSource, dtype: torch.dtype = torch.float32) -> DecoderModel:
    """Assemble the model over ``source``'s tensors; raise ModelLoadError naming what is wrong."""
    config = source.config
    fused = source.architecture.fused_projections
    missing = source.missing(required_weights(config, fused, source.architecture.mlp_norm))
    if missing:
        more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
        raise ModelLoadError(f"{source.path}: missing tensors: {', '.join(missing[:5])}{more}")

    H = config.hidden_size
    embed = source.embedding("token_embd", config.vocab_size, H)
    if config.tie_word_embeddings:
        lm_head = embed.as_linear()
    else:
        lm_head = source.linear("output", H, config.vocab_size)
    if isinstance(lm_head, QuantLinear):
        lm_head.is_lm_head = True  # a fast backend keeps its top logits exact
    rope, local_rope = _ropes(source)
    temperature = _temperature(config)

    layers = [build_layer(source, i, rope, local_rope, temperature) for i in range(config.num_layers)]
    norm = RMSNorm(source.norm("output_norm", (H,)), config.rms_norm_eps)
    labels = source.classifier_rows()
    if labels is not None and not source.missing(["cls"]) == ["cls.weight"]:
        raise ModelLoadError(f"{source.path}: a classifier head with a dense layer (cls.weight, BERT-style "
                             "rerankers) is not supported; only cls.output (Qwen3-Reranker's)")
    classifier = None if labels is None else Classifier(source.linear("cls.output", H, labels),
                                                        softmax=source.architecture.rank_softmax and labels >= 2)
    return DecoderModel(config, embed, layers, norm, lm_head, dtype, classifier=classifier).eval()


def load_model(path: str | os.PathLike, dtype: torch.dtype = torch.float32) -> tuple[DecoderModel, Checkpoint]:
    """The model at ``path`` (a GGUF file or a Hugging Face directory) and what it was read from."""
    source = open_source(path)
    return build_model(source, dtype), source.checkpoint()
