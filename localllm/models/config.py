"""A model's hyper-parameters, whatever file they were read from (see :mod:`localllm.models.registry`)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class RopeScaling:
    """How RoPE frequencies are stretched beyond the trained context.

    ``kind`` is

    * ``"none"``;
    * ``"linear"``: positions divided by ``factor``;
    * ``"freq_factors"``: llama 3.x, a per-frequency divisor (llama.cpp stores it as the
      ``rope_freqs.weight`` tensor, a Hugging Face config as ``rope_type: llama3``);
    * ``"longrope"``: Phi-3's LongRoPE ("su"): per-frequency divisors ``short_factor`` for
      positions below ``original_max_positions`` and ``long_factor`` from there on;
    * ``"yarn"``: YaRN: each frequency a mix of itself and itself divided by ``factor``, by a
      ramp over the frequencies set by ``beta_fast``, ``beta_slow`` and ``original_max_positions``
      (its ends rounded outward when ``truncate``), the share of the unscaled frequency multiplied
      by ``extrapolation`` (llama.cpp's ``yarn_ext_factor``; 1 in transformers). See
      :mod:`localllm.models.rope`.

    LongRoPE and YaRN multiply every cos/sin by ``attention_factor``.
    """

    kind: str = "none"
    factor: float = 1.0
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()
    original_max_positions: int = 0
    attention_factor: float = 1.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    extrapolation: float = 1.0


GATINGS = ("softmax", "softmax_weight", "sigmoid")
"""The kinds of :attr:`MoeConfig.gating`."""

GGUF_GATINGS = {1: "softmax", 2: "sigmoid", 3: "softmax_weight"}
"""llama.cpp's ``llama_expert_gating_func_type`` values (GGUF ``{arch}.expert_gating_func``; 0, a
file without the key, is softmax) as gatings."""

HF_GATINGS = {"softmax": "softmax", "sigmoid": "sigmoid"}
"""transformers' ``scoring_func`` values as gatings."""


@dataclass(frozen=True, slots=True)
class MoeConfig:
    """A mixture-of-experts MLP: a router picks ``experts_per_token`` of ``num_experts`` gated
    MLPs (each ``expert_intermediate_size`` wide) for every token and sums their outputs, each
    weighted by its routing probability.

    ``gating`` turns the router's scores into the kept experts' weights: ``"softmax"``, a softmax
    over all experts whose top ones are kept; ``"softmax_weight"``, the top scores kept and a
    softmax over those alone (gpt-oss; llama.cpp's ``LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX_WEIGHT``);
    ``"sigmoid"``, each expert's own sigmoid, the top ones kept with those values
    (``LLAMA_EXPERT_GATING_FUNC_TYPE_SIGMOID``; transformers' ``scoring_func: "sigmoid"``). A
    layer's expert selection bias (GGUF ``exp_probs_b``), where it has one, is added to those
    scores for the choice alone; the weights are the unbiased scores.
    With ``norm_topk_prob`` the kept weights are renormalized to sum to 1 (Mixtral, Qwen3-MoE;
    OLMoE keeps the softmax's values). ``weights_scale`` multiplies the kept weights (1: none).

    A shared expert (``shared_intermediate_size`` wide; 0: none) sees every token and its output
    is added to the routed experts' sum, times ``sigmoid(shared_gate(x))`` with ``shared_gate``
    (Qwen3-Next, Qwen3.5-MoE: one score per token, GGUF ``ffn_gate_inp_shexp``)."""

    num_experts: int
    experts_per_token: int
    expert_intermediate_size: int
    norm_topk_prob: bool
    gating: str = "softmax"
    weights_scale: float = 1.0
    shared_intermediate_size: int = 0
    shared_gate: bool = False

    def __post_init__(self) -> None:
        if not 0 < self.experts_per_token <= self.num_experts:
            raise ValueError(f"{self.experts_per_token} experts per token of {self.num_experts}")
        if self.gating not in GATINGS:
            raise ValueError(f"expert gating {self.gating!r}")
        if self.shared_gate and not self.shared_intermediate_size:
            raise ValueError("a shared expert gate without a shared expert")


@dataclass(frozen=True, slots=True)
class LinearAttentionConfig:
    """The Gated DeltaNet layers of a hybrid model (Qwen3-Next, Qwen3.5; see
    :mod:`localllm.models.linear_attention`): ``num_key_heads`` query/key heads of
    ``key_head_dim``, ``num_value_heads`` value heads of ``value_head_dim`` (a multiple of the key
    heads: each key head serves ``num_value_heads // num_key_heads`` value heads), a causal
    depthwise convolution of ``conv_kernel`` taps over the q/k/v channels.

    ``value_heads_tiled``: the file orders the value heads tiled over the key heads (value head
    ``j`` reads key head ``j % num_key_heads``, as llama.cpp's converter writes Qwen3.5); otherwise
    grouped by key head (``j // (num_value_heads // num_key_heads)``, transformers' order)."""

    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int
    value_heads_tiled: bool = False

    def __post_init__(self) -> None:
        if min(self.num_key_heads, self.num_value_heads, self.key_head_dim, self.value_head_dim) < 1:
            raise ValueError(f"linear attention heads and sizes must be positive: {self}")
        if self.num_value_heads % self.num_key_heads:
            raise ValueError(f"{self.num_value_heads} value heads are not a multiple of {self.num_key_heads} key heads")
        if self.conv_kernel < 1:
            raise ValueError(f"conv kernel {self.conv_kernel}")

    @property
    def key_size(self) -> int:
        return self.num_key_heads * self.key_head_dim

    @property
    def value_size(self) -> int:
        return self.num_value_heads * self.value_head_dim

    @property
    def conv_channels(self) -> int:
        """The convolved channels: queries, keys and values."""
        return 2 * self.key_size + self.value_size

    @property
    def state_size(self) -> int:
        """Floats of one sequence's state in one layer: the convolution's last ``conv_kernel - 1``
        inputs and the delta rule's ``[value heads, key_head_dim, value_head_dim]`` matrix."""
        return self.conv_channels * (self.conv_kernel - 1) + self.num_value_heads * self.key_head_dim * self.value_head_dim


@dataclass(frozen=True, slots=True)
class ModelConfig:
    architecture: str  # a name in localllm.models.registry.ARCHITECTURES
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
    rope_neox: bool  # True: rotate halves (HF layout); False: rotate adjacent pairs (llama.cpp's llama layout)
    rope_scaling: RopeScaling
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    name: str = ""
    # --- features beyond the llama layout (the defaults are llama's) ---------------------------
    # of the gated MLP: "silu" (SwiGLU), "gelu_tanh" (GeGLU) or "swiglu_oai" (gpt-oss's clamped
    # SwiGLU: gate clamped above and up on both sides at swiglu_limit, gate * sigmoid(swiglu_alpha
    # * gate) * (up + 1))
    activation: str = "silu"
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    sandwich_norms: bool = False  # norms after attention and after the MLP too (Gemma 2/3)
    embedding_scale: float | None = None  # embeddings multiplied by this (Gemma: sqrt(hidden))
    attention_scale: float | None = None  # query scale; None: head_dim ** -0.5
    attn_logit_softcap: float | None = None  # scores -> cap * tanh(scores / cap)
    final_logit_softcap: float | None = None  # logits -> cap * tanh(logits / cap)
    sliding_window: int | None = None  # keys a sliding layer's query sees (itself included)
    sliding_layers: tuple[bool, ...] = ()  # per layer: windowed; empty: none is
    local_rope_theta: float | None = None  # RoPE base of the sliding layers (no scaling); None: rope_theta
    qk_norm_full: bool = False  # Q/K norms over all heads at once (OLMoE), not per head
    attention_sinks: bool = False  # a learned logit per query head in each softmax's denominator (gpt-oss)
    moe: MoeConfig | None = None  # every layer's MLP is a mixture of experts; None: dense
    nope_layers: tuple[bool, ...] = ()
    """Per layer: True where the layer applies no RoPE to its queries and keys (NoPE: the keys
    are cached as projected; SmolLM3's every fourth layer); empty: every layer rotates."""
    attn_temperature_scale: float | None = None
    """llama 4's attention temperature (Ministral 3's ``llama_4_scaling_beta``, GGUF
    ``attention.temperature_scale``): the rotated queries at position ``p`` are multiplied by
    ``1 + scale * ln(1 + floor(p / attn_temperature_length))``, so 1 within the first
    ``attn_temperature_length`` positions; None: no such factor."""
    attn_temperature_length: int = 0
    """The positions each step of the attention temperature spans (the original context of
    the model's YaRN scaling, in both references)."""
    linear_attention: LinearAttentionConfig | None = None  # of the layers in linear_layers
    linear_layers: tuple[bool, ...] = ()  # per layer: Gated DeltaNet instead of attention; empty: none is
    attn_output_gate: bool = False  # q projection doubled: per head its query, then a gate; o * sigmoid(gate)

    def __post_init__(self) -> None:
        if any(self.linear_layers) != (self.linear_attention is not None):
            raise ValueError("linear-attention layers need their config, and the config its layers")
        if self.linear_layers and len(self.linear_layers) != self.num_layers:
            raise ValueError(f"{len(self.linear_layers)} layer kinds for {self.num_layers} layers")

    def parameter_counts(self) -> tuple[int, int]:
        """``(total, active)``: the weights of the model and those one token reads (the experts it
        is routed to, not the others; embeddings counted once, the head apart unless tied)."""
        H = self.hidden_size
        q_out = self.q_size * (2 if self.attn_output_gate else 1)
        attention = H * (q_out + 2 * self.kv_size) + self.q_size * H
        embeddings = self.vocab_size * H * (1 if self.tie_word_embeddings else 2)
        moe = self.moe
        if moe is None:
            mlp_total = mlp_active = 3 * H * self.intermediate_size
        else:
            expert = 3 * H * moe.expert_intermediate_size
            router = H * moe.num_experts
            shared = 3 * H * moe.shared_intermediate_size + (H if moe.shared_gate else 0)
            mlp_total = router + shared + moe.num_experts * expert
            mlp_active = router + shared + moe.experts_per_token * expert
        mixers = (self.num_layers - self.num_linear_layers) * attention
        la = self.linear_attention
        if la is not None:  # in: q, k, v, z, beta, alpha; the conv taps, dt bias and A; out
            per_layer = (H * (la.conv_channels + la.value_size + 2 * la.num_value_heads)
                         + la.conv_channels * la.conv_kernel + 2 * la.num_value_heads + la.value_size * H)
            mixers += self.num_linear_layers * per_layer
        return (embeddings + mixers + self.num_layers * mlp_total,
                embeddings + mixers + self.num_layers * mlp_active)

    @property
    def num_linear_layers(self) -> int:
        return sum(self.linear_layers)

    def is_linear(self, layer: int) -> bool:
        """Whether layer ``layer`` is a linear-attention (Gated DeltaNet) layer: no KV cache, a
        recurrent state per sequence instead."""
        return bool(self.linear_layers) and self.linear_layers[layer]

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def query_scale(self) -> float:
        return self.attention_scale if self.attention_scale is not None else self.head_dim**-0.5

    def layer_rotates(self, layer: int) -> bool:
        """Whether layer ``layer`` applies RoPE (False for a NoPE layer)."""
        return not (self.nope_layers and self.nope_layers[layer])

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of layer ``layer``, or None for a layer that sees every key."""
        if self.sliding_window and self.sliding_layers and self.sliding_layers[layer]:
            return self.sliding_window
        return None
