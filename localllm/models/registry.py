"""The architecture registry: every architecture localllm runs, one entry each, in one place.

An :class:`Architecture` says how a file of that architecture maps onto
:class:`~localllm.models.config.ModelConfig` and onto the one decoder the assembler builds
(:mod:`localllm.models.assembler`): its names in GGUF files and in Hugging Face configs, its
RoPE layout, its norm and activation kinds and its special features, plus two small functions
that read the architecture's own config keys (``gguf_features`` from GGUF metadata,
``hf_features`` from ``config.json``). The keys every architecture shares (sizes, heads, RoPE
base and scaling...) are read once, by :func:`config_from_gguf` and :func:`config_from_hf`.

Tensor names are llama.cpp's GGUF names (``blk.{i}.attn_q.weight``) everywhere in localllm; a
Hugging Face checkpoint's names are mapped onto them by gguf-py's own ``TensorNameMap`` for the
entry's ``gguf_arch`` (:mod:`localllm.models.sources`).

Adding an architecture: an entry here; a feature the decoder does not have yet goes into
:class:`ModelConfig` and :mod:`localllm.models.decoder`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import gguf
import torch

from localllm.errors import ModelLoadError
from localllm.models.arch_features import (
    Features,
    any_layer,
    gemma2_gguf,
    gemma3_gguf,
    gemma3_hf,
    gemma_hf,
    gpt_oss_gguf,
    gpt_oss_hf,
    hybrid_gguf,
    hybrid_hf,
    mistral3_gguf,
    mistral3_hf,
    olmoe_hf,
    phi3_gguf,
    smollm3_gguf,
    smollm3_hf,
    window_everywhere,
)
from localllm.models.config import GGUF_GATINGS, HF_GATINGS, ModelConfig, MoeConfig
from localllm.models.rope import hf_rope_parameters, scaling_from_gguf, scaling_from_hf


@dataclass(frozen=True, slots=True)
class Architecture:
    name: str
    """``general.architecture`` in GGUF files, and localllm's name for it."""
    gguf_arch: gguf.MODEL_ARCH
    """gguf-py's enum: its tensor name map turns Hugging Face names into GGUF ones."""
    hf_model_types: tuple[str, ...]
    """``model_type`` values of Hugging Face configs."""
    hf_class: str
    """The transformers class written into an exported ``config.json``."""
    gguf_rope_neox: bool = True
    """RoPE rotates halves in GGUF files; llama's rotate adjacent pairs (llama.cpp permutes its
    Q/K rows). Hugging Face checkpoints always rotate halves."""
    hf_norm_offset: float = 0.0
    """Added to every RMS norm weight of a Hugging Face checkpoint (Gemma stores ``w - 1``;
    llama.cpp's converter adds the 1 when it writes the GGUF)."""
    activation: str = "silu"
    sandwich_norms: bool = False
    scale_embeddings: bool = False
    """Embeddings multiplied by ``sqrt(hidden_size)``."""
    fused_projections: bool = False
    """Q/K/V in one tensor (``attn_qkv``) and gate/up in one (``ffn_up``, gate rows first), as
    Phi-3 stores them; the assembler splits them into row views."""
    hf_longrope_aliases: tuple[str, ...] = ()
    """Legacy RoPE type names that the transformers config class turns into ``longrope``
    (``Phi3Config``: su and yarn)."""
    gguf_features: Callable[[dict, str, dict], Features] = field(default=lambda meta, arch, base: {})
    """Architecture-specific :class:`ModelConfig` fields from GGUF metadata (``base``: the
    common fields already read)."""
    hf_features: Callable[[dict, dict], Features] = field(default=lambda cfg, base: {})
    """Architecture-specific :class:`ModelConfig` fields from ``config.json``."""
    gptq_export: bool = False
    """``localllm quantize`` can write this architecture as a GPTQ checkpoint."""
    rank_softmax: bool = False
    """A reranker's classifier outputs go through a softmax (llama.cpp's rule for Qwen3-Reranker,
    whose two rows are the "yes" and "no" logits: the score is P(yes))."""
    moe_norm_topk: bool = True
    """A GGUF file's experts: the kept routing weights renormalized to sum to 1. llama.cpp fixes
    this per architecture (GGUF files carry no key for it); Hugging Face configs say
    ``norm_topk_prob``."""
    qk_norm_full: bool = False
    """Q/K norms over the whole projection (all heads at once, OLMoE), not per head."""
    hf_tied_default: bool = False
    """``tie_word_embeddings`` of a ``config.json`` without the key (the transformers config
    class's default: true for Gemma and SmolLM3)."""
    hf_wrapper_types: tuple[str, ...] = ()
    """``model_type`` values of vision-language configs (``mistral3``:
    Mistral3ForConditionalGeneration) whose ``text_config`` localllm runs as this architecture:
    the text model alone, its tensors named as the text model's under ``language_model.``
    (the vision tower and projector are not read)."""
    hf_wrapped_text_types: tuple[str, ...] = ()
    """The ``text_config`` ``model_type`` values such a wrapper may hold; the first is that of a
    ``text_config`` without one (the wrapper config class's default text model)."""
    moe_gating: str | None = None
    """The experts' gating (a :class:`MoeConfig` kind) where the architecture fixes it, as llama.cpp
    does for gpt-oss (whose GGUF files' ``expert_gating_func`` it does not read); None: a GGUF
    file's ``expert_gating_func`` (:data:`GGUF_GATINGS`), a Hugging Face config's ``scoring_func``
    (softmax without one)."""
    mlp_norm: str = "ffn_norm"
    """The GGUF stem of each layer's norm before the MLP (gpt-oss: ``post_attention_norm``)."""


def _gguf_moe(meta: dict, arch: str, entry: Architecture, path: str, tensor_names: set[str]) -> MoeConfig | None:
    """The experts of a GGUF file (``{arch}.expert_count`` and its sister keys), or None."""
    count = int(meta.get(f"{arch}.expert_count", 0) or 0)
    if not count:
        return None
    used = int(meta.get(f"{arch}.expert_used_count", 0) or 0)
    width = meta.get(f"{arch}.expert_feed_forward_length", meta.get(f"{arch}.feed_forward_length"))
    gating = entry.moe_gating
    if gating is None:
        func = int(meta.get(f"{arch}.expert_gating_func", 1) or 1)
        gating = GGUF_GATINGS.get(func)
        if gating is None:
            known = ", ".join(f"{k}: {v}" for k, v in GGUF_GATINGS.items())
            raise ModelLoadError(f"{path}: expert gating function {func} is not supported ({known})")
    if int(meta.get(f"{arch}.expert_group_count", 0) or 0) > 1:
        raise ModelLoadError(f"{path}: experts chosen by groups ({arch}.expert_group_count) are not supported")
    if int(meta.get(f"{arch}.expert_shared_count", 1) or 1) != 1:
        raise ModelLoadError(f"{path}: more than one shared expert is not supported")
    shared = int(meta.get(f"{arch}.expert_shared_feed_forward_length", 0) or 0)
    scale = float(meta.get(f"{arch}.expert_weights_scale", 0.0) or 0.0)
    norm = meta.get(f"{arch}.expert_weights_norm")
    try:
        return MoeConfig(count, used, int(width), entry.moe_norm_topk if norm is None else bool(norm),
                         gating=gating, weights_scale=scale if scale else 1.0,
                         shared_intermediate_size=shared,
                         shared_gate=bool(shared) and any_layer(tensor_names, ".ffn_gate_inp_shexp.weight"))
    except (TypeError, ValueError) as exc:
        raise ModelLoadError(f"{path}: experts: {exc} ({arch}.expert_count {count}, "
                             f"{arch}.expert_used_count {used})") from exc


def _hf_moe(cfg: dict, base: dict, entry: Architecture, where: str, tensor_names: set[str]) -> MoeConfig | None:
    """The experts of a transformers config (Mixtral's and gpt-oss's ``num_local_experts``,
    Qwen-MoE's and OLMoE's ``num_experts``, Qwen3-Next's shared expert), or None."""
    count = cfg.get("num_local_experts") or cfg.get("num_experts")
    if not count:
        return None
    if cfg.get("mlp_only_layers") or int(cfg.get("decoder_sparse_step") or 1) != 1:
        raise ModelLoadError(f"{where}: dense MLP layers among the expert layers (mlp_only_layers, "
                             "decoder_sparse_step) are not supported")
    shared = int(cfg.get("shared_expert_intermediate_size") or 0)
    # Mixtral's router always renormalizes (a softmax over the kept experts' scores); a config
    # without the key (Qwen3.5-MoE's) keeps the architecture's rule
    norm = True if cfg.get("model_type") == "mixtral" else bool(cfg.get("norm_topk_prob", entry.moe_norm_topk))
    gating = entry.moe_gating
    if gating is None:
        scoring = cfg.get("scoring_func") or "softmax"
        gating = HF_GATINGS.get(scoring)
        if gating is None:
            raise ModelLoadError(f"{where}: expert scoring function {scoring!r} is not supported "
                                 f"({', '.join(HF_GATINGS)})")
    if int(cfg.get("n_group") or 1) > 1 and int(cfg.get("topk_group") or 1) < int(cfg.get("n_group") or 1):
        raise ModelLoadError(f"{where}: experts chosen by groups (n_group, topk_group) are not supported")
    try:
        return MoeConfig(int(count), int(cfg.get("num_experts_per_tok") or 0),
                         int(cfg.get("moe_intermediate_size") or base["intermediate_size"]), norm,
                         gating=gating, weights_scale=float(cfg.get("routed_scaling_factor") or 1.0),
                         shared_intermediate_size=shared,
                         shared_gate=bool(shared) and any_layer(tensor_names, ".mlp.shared_expert_gate.weight"))
    except (TypeError, ValueError) as exc:
        raise ModelLoadError(f"{where}: experts: {exc}") from exc


ARCHITECTURES: dict[str, Architecture] = {
    a.name: a
    for a in (
        Architecture("llama", gguf.MODEL_ARCH.LLAMA, ("llama", "mistral", "mixtral"), "LlamaForCausalLM",
                     gguf_rope_neox=False, hf_features=window_everywhere, gptq_export=True),
        Architecture("qwen2", gguf.MODEL_ARCH.QWEN2, ("qwen2",), "Qwen2ForCausalLM",
                     hf_features=window_everywhere, gptq_export=True),
        Architecture("qwen3", gguf.MODEL_ARCH.QWEN3, ("qwen3",), "Qwen3ForCausalLM",
                     hf_features=window_everywhere, gptq_export=True, rank_softmax=True),
        Architecture("qwen3moe", gguf.MODEL_ARCH.QWEN3MOE, ("qwen3_moe",), "Qwen3MoeForCausalLM",
                     hf_features=window_everywhere),
        Architecture("olmoe", gguf.MODEL_ARCH.OLMOE, ("olmoe",), "OlmoeForCausalLM", moe_norm_topk=False,
                     qk_norm_full=True, hf_features=olmoe_hf),
        Architecture("gemma2", gguf.MODEL_ARCH.GEMMA2, ("gemma2",), "Gemma2ForCausalLM", hf_tied_default=True,
                     hf_norm_offset=1.0, activation="gelu_tanh", sandwich_norms=True, scale_embeddings=True,
                     gguf_features=gemma2_gguf, hf_features=lambda cfg, base: gemma_hf(cfg, base, 2)),
        Architecture("gemma3", gguf.MODEL_ARCH.GEMMA3, ("gemma3_text",), "Gemma3ForCausalLM", hf_tied_default=True,
                     hf_norm_offset=1.0, activation="gelu_tanh", sandwich_norms=True, scale_embeddings=True,
                     gguf_features=gemma3_gguf, hf_features=gemma3_hf),
        # llama.cpp's openai-moe: top-k of the router's logits, a softmax over those, no
        # renormalization; the norm before the experts is post_attention_norm
        Architecture("gpt-oss", gguf.MODEL_ARCH.GPT_OSS, ("gpt_oss",), "GptOssForCausalLM",
                     activation="swiglu_oai", moe_norm_topk=False, moe_gating="softmax_weight",
                     mlp_norm="post_attention_norm", gguf_features=gpt_oss_gguf, hf_features=gpt_oss_hf),
        Architecture("phi3", gguf.MODEL_ARCH.PHI3, ("phi3",), "Phi3ForCausalLM", fused_projections=True,
                     hf_longrope_aliases=("su", "yarn"),
                     gguf_features=phi3_gguf, hf_features=window_everywhere),
        Architecture("smollm3", gguf.MODEL_ARCH.SMOLLM3, ("smollm3",), "SmolLM3ForCausalLM",
                     gguf_rope_neox=False, hf_tied_default=True, gguf_features=smollm3_gguf, hf_features=smollm3_hf),
        Architecture("mistral3", gguf.MODEL_ARCH.MISTRAL3, ("ministral3",), "Ministral3ForCausalLM",
                     gguf_rope_neox=False, gguf_features=mistral3_gguf, hf_features=mistral3_hf,
                     hf_wrapper_types=("mistral3",), hf_wrapped_text_types=("mistral", "ministral3")),
        *(Architecture(name, arch, (model_type,), hf_class, hf_norm_offset=1.0, mlp_norm="post_attention_norm",
                       hf_features=hybrid_hf,
                       # (llama.cpp's converter tiles Qwen3.5's value heads over the key heads)
                       gguf_features=partial(hybrid_gguf, value_heads_tiled=tiled))
          for name, arch, model_type, hf_class, tiled in (
              ("qwen3next", gguf.MODEL_ARCH.QWEN3NEXT, "qwen3_next", "Qwen3NextForCausalLM", False),
              ("qwen35", gguf.MODEL_ARCH.QWEN35, "qwen3_5_text", "Qwen3_5ForCausalLM", True),
              ("qwen35moe", gguf.MODEL_ARCH.QWEN35MOE, "qwen3_5_moe_text", "Qwen3_5MoeForCausalLM", True))),
    )
}


def by_gguf_name(name: object, where: str) -> Architecture:
    arch = ARCHITECTURES.get(name) if isinstance(name, str) else None
    if arch is None:
        raise ModelLoadError(f"{where}: architecture {name!r} is not supported "
                             f"(supported: {', '.join(ARCHITECTURES)})")
    return arch


def by_hf_model_type(model_type: object, where: str) -> Architecture:
    for arch in ARCHITECTURES.values():
        if model_type in arch.hf_model_types or model_type in arch.hf_wrapper_types:
            return arch
    types = [t for a in ARCHITECTURES.values() for t in (*a.hf_model_types, *a.hf_wrapper_types)]
    raise ModelLoadError(f"{where}: model_type {model_type!r} is not supported (supported: {', '.join(types)})")


def hf_text_tensor_name(name: str) -> str:
    """A checkpoint tensor's name as its text model's: a vision-language wrapper's
    ``language_model.`` taken out (``model.language_model.layers.0...``, ``language_model.model.layers.0...``
    -> ``model.layers.0...``; ``language_model.lm_head`` -> ``lm_head``), as llama.cpp's converter
    takes it out."""
    return name.replace("language_model.", "")


def _wrapped_text_config(cfg: dict, entry: Architecture, where: str) -> dict:
    """The text model's config of a vision-language wrapper: its ``text_config``, with the
    wrapper's own ``tie_word_embeddings`` (true where it does not say, ``Mistral3Config``'s
    default), the one transformers reads."""
    text = cfg.get("text_config")
    if not isinstance(text, dict):
        raise ModelLoadError(f"{where}: model_type {cfg.get('model_type')!r} needs a text_config")
    # a text_config without a model_type is the wrapper's default text model (Mistral3Config's: mistral)
    text = {**text, "model_type": text.get("model_type") or entry.hf_wrapped_text_types[0]}
    if text["model_type"] not in entry.hf_wrapped_text_types:
        raise ModelLoadError(f"{where}: text_config model_type {text['model_type']!r} is not supported in a "
                             f"{cfg.get('model_type')!r} model (supported: {', '.join(entry.hf_wrapped_text_types)})")
    return {**text, "tie_word_embeddings": bool(cfg.get("tie_word_embeddings", True)),
            "_name_or_path": cfg.get("_name_or_path") or text.get("_name_or_path")}


# --- the keys every architecture shares -------------------------------------------------------


def _finish(arch: Architecture, base: dict, features: Features) -> ModelConfig:
    fields = dict(base)
    fields.update(activation=arch.activation, sandwich_norms=arch.sandwich_norms)
    if arch.scale_embeddings:
        fields["embedding_scale"] = math.sqrt(base["hidden_size"])
    fields.update({k: v for k, v in features.items() if v is not None})
    return ModelConfig(**fields)


def config_from_gguf(meta: dict, tensor_names: set[str], path: str = "") -> ModelConfig:
    """A :class:`ModelConfig` from GGUF key/values; ModelLoadError naming what is missing.

    A LongRoPE model's factors are tensors: the GGUF source fills them in
    (:class:`~localllm.models.sources.GGUFSource`)."""
    arch_name = meta.get("general.architecture")
    entry = by_gguf_name(arch_name, path)
    arch = entry.name

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
    max_pos = int(meta.get(f"{arch}.context_length", 2048))

    theta = float(meta.get(f"{arch}.rope.freq_base", 10000.0))
    rope_dim = int(meta.get(f"{arch}.rope.dimension_count", head_dim))
    scaling = scaling_from_gguf(meta, arch, tensor_names, max_pos, rope_dim, theta, path)

    base = dict(  # noqa: C408 - the ModelConfig fields, as keywords
        architecture=arch,
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(need("feed_forward_length")),
        # (multi-token-prediction layers, counted in block_count, are not run)
        num_layers=int(need("block_count")) - int(meta.get(f"{arch}.nextn_predict_layers", 0) or 0),
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(need("attention.layer_norm_rms_epsilon")),
        rope_theta=theta,
        rope_dim=rope_dim,
        rope_neox=entry.gguf_rope_neox,
        rope_scaling=scaling,
        max_position_embeddings=max_pos,
        tie_word_embeddings="output.weight" not in tensor_names,
        qkv_bias=any_layer(tensor_names, ".attn_q.bias"),
        qk_norm=any_layer(tensor_names, ".attn_q_norm.weight"),
        qk_norm_full=entry.qk_norm_full,
        name=str(meta.get("general.name", "")),
    )
    base["moe"] = _gguf_moe(meta, arch, entry, path, tensor_names)
    try:
        features = entry.gguf_features(meta, arch, base)
    except ModelLoadError as exc:
        raise ModelLoadError(f"{path}: {exc.message}") from exc
    return _finish(entry, base, features)


def config_from_hf(cfg: dict, tensor_names: set[str], where: str = "config.json") -> tuple[ModelConfig, torch.Tensor | None]:
    """``(ModelConfig, llama-3 rope frequency divisors or None)`` from a transformers ``config.json``
    (``tensor_names``: the checkpoint's, as :func:`hf_text_tensor_name` gives them). A
    vision-language wrapper's config gives its text model's."""
    entry = by_hf_model_type(cfg.get("model_type"), where)
    if cfg.get("model_type") in entry.hf_wrapper_types:
        cfg = _wrapped_text_config(cfg, entry, where)

    def need(key: str):
        if cfg.get(key) is None:
            raise ModelLoadError(f"{where}: {key!r} is missing")
        return cfg[key]

    if entry.activation == "silu":
        act = cfg.get("hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise ModelLoadError(f"{where}: hidden_act {act!r} is not supported (only silu)")
    hidden = int(need("hidden_size"))
    num_heads = int(need("num_attention_heads"))
    num_kv_heads = int(cfg.get("num_key_value_heads") or num_heads)
    head_dim = int(cfg.get("head_dim") or hidden // num_heads)
    if num_heads % num_kv_heads:
        raise ModelLoadError(f"{where}: num_attention_heads {num_heads} is not a multiple of num_key_value_heads {num_kv_heads}")
    rope, _ = hf_rope_parameters(cfg)
    theta = float(rope.get("rope_theta") or 10000.0)
    rope_dim = int(head_dim * float(rope.get("partial_rotary_factor") or 1.0))
    max_pos = int(cfg.get("max_position_embeddings") or 2048)
    scaling, freq_factors = scaling_from_hf(rope, rope_dim, theta, max_pos, where, entry.hf_longrope_aliases)
    base = dict(  # noqa: C408 - the ModelConfig fields, as keywords
        architecture=entry.name,
        vocab_size=int(need("vocab_size")),
        hidden_size=hidden,
        intermediate_size=int(need("intermediate_size")),
        num_layers=int(need("num_hidden_layers")),
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(cfg.get("rms_norm_eps") or 1e-6),
        rope_theta=theta,
        rope_dim=rope_dim,
        rope_neox=True,
        rope_scaling=scaling,
        max_position_embeddings=max_pos,
        # transformers ties the head to the embeddings only where the checkpoint has no head of its own
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", entry.hf_tied_default))
        and "lm_head.weight" not in tensor_names,
        qkv_bias=any_layer(tensor_names, ".self_attn.q_proj.bias"),
        qk_norm=any_layer(tensor_names, ".self_attn.q_norm.weight"),
        qk_norm_full=entry.qk_norm_full,
        name=str(cfg.get("_name_or_path") or ""),
    )
    base["moe"] = _hf_moe(cfg, base, entry, where, tensor_names)
    return _finish(entry, base, entry.hf_features(cfg, base)), freq_factors
