"""Each architecture's own config keys: the ``gguf_features`` and ``hf_features`` functions of
the registry's entries (:mod:`localllm.models.registry`), which read what only that architecture's
GGUF metadata or ``config.json`` holds into :class:`~localllm.models.config.ModelConfig` fields
(``base``: the fields every architecture shares, already read)."""

from __future__ import annotations

from localllm.errors import ModelLoadError
from localllm.models.config import LinearAttentionConfig
from localllm.models.rope import hf_rope_parameters

Features = dict[str, object]


def _pattern_layers(num_layers: int, pattern: int) -> tuple[bool, ...]:
    """Sliding layers of a Gemma-style pattern: every ``pattern``-th layer is global."""
    return tuple((i + 1) % pattern != 0 for i in range(num_layers))


def _gemma_large_scale(base: dict, large_layers: int) -> Features:
    # llama.cpp's rule (GGUF files carry no query scale): the 27B models scale queries by
    # (hidden / heads) ** -0.5 (their query_pre_attn_scalar), the others by head_dim ** -0.5.
    if base["num_layers"] == large_layers:
        return {"attention_scale": (base["hidden_size"] / base["num_heads"]) ** -0.5}
    return {}


def gemma2_gguf(meta: dict, arch: str, base: dict) -> Features:
    window = meta.get(f"{arch}.attention.sliding_window")
    return {
        "attn_logit_softcap": _float_or_none(meta.get(f"{arch}.attn_logit_softcapping")),
        "final_logit_softcap": _float_or_none(meta.get(f"{arch}.final_logit_softcapping")),
        "sliding_window": int(window) if window else None,
        "sliding_layers": _pattern_layers(base["num_layers"], 2),
        **_gemma_large_scale(base, 46),
    }


def gemma3_gguf(meta: dict, arch: str, base: dict) -> Features:
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


def gemma_hf(cfg: dict, base: dict, pattern: int) -> Features:
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


def gemma3_hf(cfg: dict, base: dict) -> Features:
    features = gemma_hf(cfg, base, 6)
    params = cfg.get("rope_parameters") or {}
    local = params.get("sliding_attention") if isinstance(params.get("sliding_attention"), dict) else None
    theta = (local or {}).get("rope_theta") or cfg.get("rope_local_base_freq") or 10000.0
    features["local_rope_theta"] = float(theta)
    return features


def phi3_gguf(meta: dict, arch: str, base: dict) -> Features:
    window = meta.get(f"{arch}.attention.sliding_window")
    features: Features = {}
    if window and int(window) < base["max_position_embeddings"]:
        features.update(sliding_window=int(window), sliding_layers=(True,) * base["num_layers"])
    return features


def window_everywhere(cfg: dict, base: dict) -> Features:
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


def olmoe_hf(cfg: dict, base: dict) -> Features:
    if cfg.get("clip_qkv") is not None:
        raise ModelLoadError("config.json: clip_qkv is not supported")
    return {}


def gpt_oss_gguf(meta: dict, arch: str, base: dict) -> Features:
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


def gpt_oss_hf(cfg: dict, base: dict) -> Features:
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


def hybrid_gguf(meta: dict, arch: str, base: dict, *, value_heads_tiled: bool = False) -> Features:
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
            conv_kernel=need("ssm.conv_kernel"), value_heads_tiled=value_heads_tiled)
    except ValueError as exc:
        raise ModelLoadError(f"linear attention: {exc}") from exc
    return {"linear_attention": linear, "linear_layers": _hybrid_layers(list(kinds), "GGUF key recurrent_layers", num_layers),
            "attn_output_gate": True}


def hybrid_hf(cfg: dict, base: dict) -> Features:
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


def smollm3_gguf(meta: dict, arch: str, base: dict) -> Features:
    # llama.cpp's rule (GGUF files carry no key for it): every fourth layer has no RoPE
    return {"nope_layers": tuple((i + 1) % 4 == 0 for i in range(base["num_layers"]))}


def smollm3_hf(cfg: dict, base: dict) -> Features:
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


def mistral3_gguf(meta: dict, arch: str, base: dict) -> Features:
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


def mistral3_hf(cfg: dict, base: dict) -> Features:
    """Ministral 3's attention temperature (``rope_parameters``' ``llama_4_scaling_beta`` over
    steps of ``original_max_position_embeddings``, as ``Ministral3Attention`` reads them) and
    Mistral's sliding window; a wrapper's ``mistral`` text model (Mistral Small 3.x) has no
    temperature."""
    features = window_everywhere(cfg, base)
    if cfg.get("model_type") != "ministral3":
        return features
    rope, _ = hf_rope_parameters(cfg)
    beta, length = rope.get("llama_4_scaling_beta"), rope.get("original_max_position_embeddings")
    if beta is None or not length:
        raise ModelLoadError("config.json: ministral3 needs rope_parameters with llama_4_scaling_beta and "
                             "original_max_position_embeddings")
    if float(beta):
        features.update(attn_temperature_scale=float(beta), attn_temperature_length=int(length))
    return features


def _float_or_none(value) -> float | None:
    return float(value) if value else None


def any_layer(tensor_names: set[str], suffix: str) -> bool:
    """Whether some layer has the tensor ``suffix`` (``.attn_q_norm.weight``): in a hybrid model
    the first layer may have none of the attention layers' tensors."""
    return any(name.endswith(suffix) for name in tensor_names)
