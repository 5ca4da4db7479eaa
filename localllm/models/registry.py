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

import gguf
import torch

from localllm.errors import ModelLoadError
from localllm.models.config import GGUF_GATINGS, HF_GATINGS, LinearAttentionConfig, ModelConfig, MoeConfig
from localllm.models.rope import scaling_from_gguf, scaling_from_hf

Features = dict[str, object]


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
    gguf_value_heads_tiled: bool = False
    """A GGUF file's linear-attention value heads are tiled over the key heads (llama.cpp's
    converter reorders Qwen3.5's so; see :class:`~localllm.models.config.LinearAttentionConfig`)."""


# --- architecture-specific config -----------------------------------------------------------


def _pattern_layers(num_layers: int, pattern: int) -> tuple[bool, ...]:
    """Sliding layers of a Gemma-style pattern: every ``pattern``-th layer is global."""
    return tuple((i + 1) % pattern != 0 for i in range(num_layers))


def _gemma_large_scale(base: dict, large_layers: int) -> Features:
    # llama.cpp's rule (GGUF files carry no query scale): the 27B models scale queries by
    # (hidden / heads) ** -0.5 (their query_pre_attn_scalar), the others by head_dim ** -0.5.
    if base["num_layers"] == large_layers:
        return {"attention_scale": (base["hidden_size"] / base["num_heads"]) ** -0.5}
    return {}


def _gemma2_gguf(meta: dict, arch: str, base: dict) -> Features:
    window = meta.get(f"{arch}.attention.sliding_window")
    return {
        "attn_logit_softcap": _float_or_none(meta.get(f"{arch}.attn_logit_softcapping")),
        "final_logit_softcap": _float_or_none(meta.get(f"{arch}.final_logit_softcapping")),
        "sliding_window": int(window) if window else None,
        "sliding_layers": _pattern_layers(base["num_layers"], 2),
        **_gemma_large_scale(base, 46),
    }


def _gemma3_gguf(meta: dict, arch: str, base: dict) -> Features:
    window = meta.get(f"{arch}.attention.sliding_window")
    pattern = int(meta.get(f"{arch}.attention.sliding_window_pattern", 6) or 6)
    return {
        "sliding_window": int(window) if window else None,
        "sliding_layers": _pattern_layers(base["num_layers"], pattern),
        "local_rope_theta": 10000.0,  # llama.cpp's fixed base of Gemma 3's sliding layers
        **_gemma_large_scale(base, 62),
    }


def _hf_layer_types(cfg: dict, num_layers: int, default_pattern: int) -> tuple[bool, ...]:
    types = cfg.get("layer_types")
    if types is not None:
        if not isinstance(types, list) or len(types) != num_layers:
            raise ModelLoadError("config.json: layer_types must list one type per layer")
        return tuple(t == "sliding_attention" for t in types)
    return _pattern_layers(num_layers, int(cfg.get("sliding_window_pattern") or default_pattern))


def _gemma_hf(cfg: dict, base: dict, pattern: int) -> Features:
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise ModelLoadError(f"config.json: hidden_activation {act!r} is not supported (gelu_pytorch_tanh)")
    scalar = cfg.get("query_pre_attn_scalar")
    window = cfg.get("sliding_window")
    return {
        "attention_scale": float(scalar) ** -0.5 if scalar else None,
        "attn_logit_softcap": _float_or_none(cfg.get("attn_logit_softcapping")),
        "final_logit_softcap": _float_or_none(cfg.get("final_logit_softcapping")),
        "sliding_window": int(window) if window else None,
        "sliding_layers": _hf_layer_types(cfg, base["num_layers"], pattern),
    }


def _gemma3_hf(cfg: dict, base: dict) -> Features:
    features = _gemma_hf(cfg, base, 6)
    params = cfg.get("rope_parameters") or {}
    local = params.get("sliding_attention") if isinstance(params.get("sliding_attention"), dict) else None
    theta = (local or {}).get("rope_theta") or cfg.get("rope_local_base_freq") or 10000.0
    features["local_rope_theta"] = float(theta)
    return features


def _phi3_gguf(meta: dict, arch: str, base: dict) -> Features:
    window = meta.get(f"{arch}.attention.sliding_window")
    features: Features = {}
    if window and int(window) < base["max_position_embeddings"]:
        features.update(sliding_window=int(window), sliding_layers=(True,) * base["num_layers"])
    return features


def _window_everywhere(cfg: dict, base: dict) -> Features:
    """Mistral / Phi-3 / Qwen 2 with ``use_sliding_window``: one window on every layer."""
    window = cfg.get("sliding_window")
    if cfg.get("model_type") in ("qwen2", "qwen3", "qwen3_moe"):
        if not cfg.get("use_sliding_window"):
            return {}
        if cfg.get("max_window_layers", base["num_layers"]) < base["num_layers"]:
            raise ModelLoadError("config.json: sliding windows on only some layers (max_window_layers) "
                                 "are not supported")
    if window and int(window) < base["max_position_embeddings"]:
        return {"sliding_window": int(window), "sliding_layers": (True,) * base["num_layers"]}
    return {}


def _olmoe_hf(cfg: dict, base: dict) -> Features:
    if cfg.get("clip_qkv") is not None:
        raise ModelLoadError("config.json: clip_qkv is not supported")
    return {}


def _gpt_oss_gguf(meta: dict, arch: str, base: dict) -> Features:
    """gpt-oss as llama.cpp loads it: sliding layers by ``attention.sliding_window_pattern`` (a
    flag per layer, or a period whose last layer is global; absent: 2, layer 0 sliding), the
    clamped SwiGLU's constants fixed (1.702, 7.0: GGUF files carry no key for them), a sink logit
    per head in every layer."""
    window = meta.get(f"{arch}.attention.sliding_window")
    n = base["num_layers"]
    pattern = meta.get(f"{arch}.attention.sliding_window_pattern")
    if isinstance(pattern, (list, tuple)):
        if len(pattern) != n:
            raise ModelLoadError(f"GGUF key {arch}.attention.sliding_window_pattern must have one flag per layer")
        sliding = tuple(bool(p) for p in pattern)
    else:
        period = 2 if pattern is None else int(pattern)
        sliding = (True,) * n if period == 0 else _pattern_layers(n, period)
    swa_base = meta.get(f"{arch}.rope.freq_base_swa")
    if swa_base is not None and float(swa_base) != base["rope_theta"]:
        raise ModelLoadError(f"GGUF key {arch}.rope.freq_base_swa: a RoPE base of the sliding layers of their own "
                             "is not supported for this architecture")
    return {
        "sliding_window": int(window) if window else None,
        "sliding_layers": sliding,
        "attention_sinks": True,
    }


def _gpt_oss_hf(cfg: dict, base: dict) -> Features:
    window = cfg.get("sliding_window")
    return {
        "sliding_window": int(window) if window else None,
        "sliding_layers": _hf_layer_types(cfg, base["num_layers"], 2),
        "swiglu_alpha": float(cfg.get("swiglu_alpha", 1.702)),
        "swiglu_limit": float(cfg.get("swiglu_limit", 7.0)),
        "attention_sinks": True,
    }


def _hybrid_layers(kinds: list[bool], where: str, num_layers: int) -> tuple[bool, ...]:
    if len(kinds) < num_layers:
        raise ModelLoadError(f"{where}: {len(kinds)} layer kinds for {num_layers} layers")
    return tuple(bool(k) for k in kinds[:num_layers])  # (a GGUF file's list counts its MTP layers too)


def _hybrid_gguf(meta: dict, arch: str, base: dict) -> Features:
    """Qwen3-Next / Qwen3.5: Gated DeltaNet layers (``{arch}.ssm.*``, as llama.cpp reads them) among
    attention layers with an output gate; which are which: ``attention.recurrent_layers``, else
    every ``full_attention_interval``-th layer is attention."""
    def need(key: str) -> int:
        if f"{arch}.{key}" not in meta:
            raise ModelLoadError(f"GGUF metadata key {arch}.{key!r} is missing")
        return int(meta[f"{arch}.{key}"])

    num_layers = base["num_layers"]
    kinds = meta.get(f"{arch}.attention.recurrent_layers")
    if kinds is None:
        interval = int(meta.get(f"{arch}.full_attention_interval", 4) or 4)
        kinds = [(i + 1) % interval != 0 for i in range(num_layers)]
    num_value_heads = need("ssm.time_step_rank")
    try:
        linear = LinearAttentionConfig(
            num_key_heads=need("ssm.group_count"), num_value_heads=num_value_heads,
            key_head_dim=need("ssm.state_size"), value_head_dim=need("ssm.inner_size") // max(num_value_heads, 1),
            conv_kernel=need("ssm.conv_kernel"), value_heads_tiled=ARCHITECTURES[arch].gguf_value_heads_tiled)
    except ValueError as exc:
        raise ModelLoadError(f"linear attention: {exc}") from exc
    return {"linear_attention": linear, "linear_layers": _hybrid_layers(list(kinds), "GGUF key recurrent_layers", num_layers),
            "attn_output_gate": True}


def _hybrid_hf(cfg: dict, base: dict) -> Features:
    """Qwen3-Next / Qwen3.5 (text): ``linear_*`` sizes and ``layer_types`` (else every
    ``full_attention_interval``-th layer is attention), as transformers' configs read them."""
    num_layers = base["num_layers"]
    types = cfg.get("layer_types")
    if types is None:
        interval = int(cfg.get("full_attention_interval") or 4)
        types = ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(num_layers)]
    if not isinstance(types, list) or not set(types) <= {"linear_attention", "full_attention"}:
        raise ModelLoadError("config.json: layer_types must list linear_attention or full_attention per layer")
    try:
        linear = LinearAttentionConfig(
            num_key_heads=int(cfg.get("linear_num_key_heads") or 16), num_value_heads=int(cfg.get("linear_num_value_heads") or 32),
            key_head_dim=int(cfg.get("linear_key_head_dim") or 128), value_head_dim=int(cfg.get("linear_value_head_dim") or 128),
            conv_kernel=int(cfg.get("linear_conv_kernel_dim") or 4))
    except ValueError as exc:
        raise ModelLoadError(f"config.json: linear attention: {exc}") from exc
    return {"linear_attention": linear, "attn_output_gate": True,
            "linear_layers": _hybrid_layers([t == "linear_attention" for t in types], "config.json", num_layers)}


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
                         shared_gate=bool(shared) and _any_layer(tensor_names, ".ffn_gate_inp_shexp.weight"))
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
                         shared_gate=bool(shared) and _any_layer(tensor_names, ".mlp.shared_expert_gate.weight"))
    except (TypeError, ValueError) as exc:
        raise ModelLoadError(f"{where}: experts: {exc}") from exc


def _smollm3_gguf(meta: dict, arch: str, base: dict) -> Features:
    # llama.cpp's rule (GGUF files carry no key for it): every fourth layer has no RoPE
    return {"nope_layers": tuple((i + 1) % 4 == 0 for i in range(base["num_layers"]))}


def _smollm3_hf(cfg: dict, base: dict) -> Features:
    """SmolLM3's NoPE layers (``no_rope_layers``: 1 where a layer rotates, 0 where it does not;
    without it, every ``no_rope_layer_interval``-th layer has none) and its sliding-window layers
    (``layer_types``; without it, the NoPE layers where ``use_sliding_window``), as
    ``SmolLM3Config`` settles them."""
    n = base["num_layers"]
    flags = cfg.get("no_rope_layers")
    if flags is None:
        interval = cfg.get("no_rope_layer_interval", 4)
        if not isinstance(interval, int) or isinstance(interval, bool) or interval <= 0:
            raise ModelLoadError(f"config.json: no_rope_layer_interval must be a positive integer, not {interval!r}")
        nope = tuple((i + 1) % interval == 0 for i in range(n))
    else:
        if not isinstance(flags, list) or len(flags) < n:
            raise ModelLoadError("config.json: no_rope_layers must hold a 0 or 1 for every layer")
        nope = tuple(not flags[i] for i in range(n))
    window = cfg.get("sliding_window")
    types = cfg.get("layer_types")
    if types is None:
        sliding = nope if cfg.get("use_sliding_window") and window else (False,) * n
    else:
        if not isinstance(types, list) or len(types) < n:
            raise ModelLoadError("config.json: layer_types must list one type per layer")
        sliding = tuple(t == "sliding_attention" for t in types[:n])
    features: Features = {"nope_layers": nope}
    if any(sliding):
        if not window:
            raise ModelLoadError("config.json: sliding_attention layers need a sliding_window")
        features.update(sliding_window=int(window), sliding_layers=sliding)
    return features


def _mistral3_gguf(meta: dict, arch: str, base: dict) -> Features:
    """llama 4's attention temperature where the file has ``attention.temperature_scale``; its
    steps span llama.cpp's ``n_ctx_orig_yarn`` (``rope.scaling.original_context_length``, else
    the trained context)."""
    scale = float(meta.get(f"{arch}.attention.temperature_scale", 0.0) or 0.0)
    if not scale:
        return {}
    length = meta.get(f"{arch}.rope.scaling.original_context_length")
    length = int(base["max_position_embeddings"] if length is None else length)
    if length <= 0:
        raise ModelLoadError(f"attention temperature scaling needs a positive {arch}.rope.scaling.original_context_length")
    return {"attn_temperature_scale": scale, "attn_temperature_length": length}


def _mistral3_hf(cfg: dict, base: dict) -> Features:
    """Ministral 3's attention temperature (``rope_parameters``' ``llama_4_scaling_beta`` over
    steps of ``original_max_position_embeddings``, as ``Ministral3Attention`` reads them) and
    Mistral's sliding window; a wrapper's ``mistral`` text model (Mistral Small 3.x) has no
    temperature."""
    features = _window_everywhere(cfg, base)
    if cfg.get("model_type") != "ministral3":
        return features
    rope, _ = _hf_rope(cfg)
    beta, length = rope.get("llama_4_scaling_beta"), rope.get("original_max_position_embeddings")
    if beta is None or not length:
        raise ModelLoadError("config.json: ministral3 needs rope_parameters with llama_4_scaling_beta and "
                             "original_max_position_embeddings")
    if float(beta):
        features.update(attn_temperature_scale=float(beta), attn_temperature_length=int(length))
    return features


def _float_or_none(value) -> float | None:
    return float(value) if value else None


def _any_layer(tensor_names: set[str], suffix: str) -> bool:
    """Whether some layer has the tensor ``suffix`` (``.attn_q_norm.weight``): in a hybrid model
    the first layer may have none of the attention layers' tensors."""
    return any(name.endswith(suffix) for name in tensor_names)


ARCHITECTURES: dict[str, Architecture] = {
    a.name: a
    for a in (
        Architecture("llama", gguf.MODEL_ARCH.LLAMA, ("llama", "mistral", "mixtral"), "LlamaForCausalLM",
                     gguf_rope_neox=False, hf_features=_window_everywhere, gptq_export=True),
        Architecture("qwen2", gguf.MODEL_ARCH.QWEN2, ("qwen2",), "Qwen2ForCausalLM",
                     hf_features=_window_everywhere, gptq_export=True),
        Architecture("qwen3", gguf.MODEL_ARCH.QWEN3, ("qwen3",), "Qwen3ForCausalLM",
                     hf_features=_window_everywhere, gptq_export=True, rank_softmax=True),
        Architecture("qwen3moe", gguf.MODEL_ARCH.QWEN3MOE, ("qwen3_moe",), "Qwen3MoeForCausalLM",
                     hf_features=_window_everywhere),
        Architecture("olmoe", gguf.MODEL_ARCH.OLMOE, ("olmoe",), "OlmoeForCausalLM", moe_norm_topk=False,
                     qk_norm_full=True, hf_features=_olmoe_hf),
        Architecture("gemma2", gguf.MODEL_ARCH.GEMMA2, ("gemma2",), "Gemma2ForCausalLM", hf_tied_default=True,
                     hf_norm_offset=1.0, activation="gelu_tanh", sandwich_norms=True, scale_embeddings=True,
                     gguf_features=_gemma2_gguf, hf_features=lambda cfg, base: _gemma_hf(cfg, base, 2)),
        Architecture("gemma3", gguf.MODEL_ARCH.GEMMA3, ("gemma3_text",), "Gemma3ForCausalLM", hf_tied_default=True,
                     hf_norm_offset=1.0, activation="gelu_tanh", sandwich_norms=True, scale_embeddings=True,
                     gguf_features=_gemma3_gguf, hf_features=_gemma3_hf),
        # llama.cpp's openai-moe: top-k of the router's logits, a softmax over those, no
        # renormalization; the norm before the experts is post_attention_norm
        Architecture("gpt-oss", gguf.MODEL_ARCH.GPT_OSS, ("gpt_oss",), "GptOssForCausalLM",
                     activation="swiglu_oai", moe_norm_topk=False, moe_gating="softmax_weight",
                     mlp_norm="post_attention_norm", gguf_features=_gpt_oss_gguf, hf_features=_gpt_oss_hf),
        Architecture("phi3", gguf.MODEL_ARCH.PHI3, ("phi3",), "Phi3ForCausalLM", fused_projections=True,
                     hf_longrope_aliases=("su", "yarn"),
                     gguf_features=_phi3_gguf, hf_features=_window_everywhere),
        Architecture("smollm3", gguf.MODEL_ARCH.SMOLLM3, ("smollm3",), "SmolLM3ForCausalLM",
                     gguf_rope_neox=False, hf_tied_default=True, gguf_features=_smollm3_gguf, hf_features=_smollm3_hf),
        Architecture("mistral3", gguf.MODEL_ARCH.MISTRAL3, ("ministral3",), "Ministral3ForCausalLM",
                     gguf_rope_neox=False, gguf_features=_mistral3_gguf, hf_features=_mistral3_hf,
                     hf_wrapper_types=("mistral3",), hf_wrapped_text_types=("mistral", "ministral3")),
        *(Architecture(name, arch, (model_type,), hf_class, hf_norm_offset=1.0, mlp_norm="post_attention_norm",
                       gguf_value_heads_tiled=tiled, hf_features=_hybrid_hf,
                       gguf_features=_hybrid_gguf)
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
        qkv_bias=_any_layer(tensor_names, ".attn_q.bias"),
        qk_norm=_any_layer(tensor_names, ".attn_q_norm.weight"),
        qk_norm_full=entry.qk_norm_full,
        name=str(meta.get("general.name", "")),
    )
    base["moe"] = _gguf_moe(meta, arch, entry, path, tensor_names)
    try:
        features = entry.gguf_features(meta, arch, base)
    except ModelLoadError as exc:
        raise ModelLoadError(f"{path}: {exc.message}") from exc
    return _finish(entry, base, features)


def _hf_rope(cfg: dict) -> tuple[dict, dict]:
    """``(RoPE parameters of the global layers, of the sliding ones)`` from either config format:
    transformers 5's ``rope_parameters`` (per layer type, or one dict) or the older
    ``rope_theta`` + ``rope_scaling``. As transformers' ``standardize_rope_params``, a flat
    dict's ``original_max_position_embeddings`` is the config's top-level one where there is
    one (Phi-3 keeps it there), its own otherwise; ``max_position_embeddings`` when neither has it."""
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and isinstance(params.get("full_attention"), dict):
        # transformers' YaRN reads ``truncate`` from the top of rope_parameters, not the layer type's
        full = {**params["full_attention"], "truncate": params.get("truncate", True)}
        return full, params.get("sliding_attention") or {}
    merged = dict(params or {})
    merged.update({k: v for k, v in (cfg.get("rope_scaling") or {}).items() if v is not None})
    for key in ("rope_theta", "partial_rotary_factor", "original_max_position_embeddings"):
        if cfg.get(key) is not None:
            merged[key] = cfg[key]
    return merged, {}


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
    rope, _ = _hf_rope(cfg)
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
        qkv_bias=_any_layer(tensor_names, ".self_attn.q_proj.bias"),
        qk_norm=_any_layer(tensor_names, ".self_attn.q_norm.weight"),
        qk_norm_full=entry.qk_norm_full,
        name=str(cfg.get("_name_or_path") or ""),
    )
    base["moe"] = _hf_moe(cfg, base, entry, where, tensor_names)
    return _finish(entry, base, entry.hf_features(cfg, base)), freq_factors
