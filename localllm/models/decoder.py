"""The one decoder every architecture is assembled into, in plain torch.

llama's layout (pre-norm, SwiGLU, RoPE; SmolLM2, TinyLlama, Mistral, qwen2/3) with the features
other architectures add, each switched on by :class:`~localllm.models.config.ModelConfig`:
Q/K/V biases and Q/K norms (qwen; OLMoE's over all heads), mixtures of experts (Mixtral,
Qwen3-MoE, OLMoE; gpt-oss's with biases, its router's softmax over the kept experts and its
clamped SwiGLU; a shared expert with its sigmoid gate: Qwen3-Next, Qwen3.5-MoE), sandwich norms,
GeGLU, scaled embeddings, attention and final logit soft-capping, sliding-window layers with their
own RoPE base (Gemma 2/3), attention sinks (gpt-oss), LongRoPE (Phi-3) and YaRN scaling
(:mod:`localllm.models.rope`), layers without RoPE (SmolLM3's NoPE layers), llama 4's attention
temperature (Ministral 3), an output gate on attention and Gated DeltaNet layers in its place
(:mod:`localllm.models.linear_attention`: Qwen3-Next, Qwen3.5). :mod:`localllm.models.assembler`
builds it from any weight source.

The model sees only a flat batch: ``input_ids [T]``, ``positions [T]`` and
:class:`~localllm.kernels.attention.AttentionMetadata`; it knows nothing about requests. Its
modules call ``self.ops.<op>`` for their math (linears included), which is the reference
backend's unless a backend's ``install`` points them elsewhere (``localllm.kernels.select``).
"""

from __future__ import annotations

import torch
from torch import nn

from localllm.kernels.attention import AttentionMetadata
from localllm.kernels.torch_backend import REFERENCE
from localllm.models.config import ModelConfig, MoeConfig, RopeScaling
from localllm.models.rope import yarn_inv_freq


def sigmoid_rows(x: torch.Tensor) -> torch.Tensor:
    """``sigmoid(x)`` of a ``[T, n]`` tensor; on a CPU row by row, so that a row's bits do not depend
    on its batch (torch's vectorized CPU loop computes a tensor's last elements on its scalar path,
    whose bits differ). A GPU computes every element alike: there, in one go."""
    if not x.is_cpu or x.shape[0] == 1:
        return torch.sigmoid(x)
    return torch.stack([torch.sigmoid(row) for row in x])


MIN_WEIGHTS_SUM = 6.103515625e-5
"""The least sum the kept routing weights are divided by (llama.cpp's clamp: float16's smallest
normal number; sigmoid scores may all be near zero)."""


class RMSNorm(nn.Module):
    ops = REFERENCE

    def __init__(self, weight: torch.Tensor, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.rms_norm(x, self.weight, self.eps)

    def forward_add(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(self(residual + x), residual + x)``: the residual add fused with the norm."""
        return self.ops.add_rms_norm(x, residual, self.weight, self.eps)


class RotaryEmbedding(nn.Module):
    """RoPE with a precomputed cos/sin table; ``neox`` rotates halves, otherwise adjacent pairs.

    ``x * cos + rotate(x) * sin`` with full-width tables, where ``rotate`` maps each pair
    ``(a, b)`` to ``(-b, a)``: the same float operations as the textbook form, so bitwise equal to
    it. :meth:`begin_step` computes one forward pass's tables once for all layers.
    """

    def __init__(self, config: ModelConfig, freq_factors: torch.Tensor | None = None, *,
                 theta: float | None = None, scaling: RopeScaling | None = None) -> None:
        """RoPE of ``config`` (``theta``/``scaling``: another base and scaling, e.g. Gemma 3's
        sliding layers'); ``freq_factors``: llama 3's per-frequency divisors."""
        super().__init__()
        self.rot_dim = config.rope_dim
        self.neox = config.rope_neox
        theta = config.rope_theta if theta is None else theta
        scaling = config.rope_scaling if scaling is None else scaling
        exponents = torch.arange(0, self.rot_dim, 2, dtype=torch.float64) / self.rot_dim
        inv_freq = 1.0 / (theta**exponents)
        if freq_factors is not None:
            inv_freq = inv_freq / freq_factors.double()
        if scaling.kind == "yarn":
            inv_freq = yarn_inv_freq(inv_freq, theta, scaling)
        pos = torch.arange(config.max_position_embeddings, dtype=torch.float64)
        if scaling.kind == "linear":
            pos = pos / scaling.factor
        if scaling.kind == "longrope":
            # per position: short factors below the trained context, long ones from there on
            # (what a growing sequence gets from transformers' dynamic LongRoPE with a KV cache)
            short = inv_freq / torch.tensor(scaling.short_factor, dtype=torch.float64)
            long = inv_freq / torch.tensor(scaling.long_factor, dtype=torch.float64)
            is_long = (pos >= scaling.original_max_positions)[:, None]
            freqs = pos[:, None] * torch.where(is_long, long[None, :], short[None, :])
        else:
            freqs = torch.outer(pos, inv_freq)
        cos, sin = freqs.cos(), freqs.sin()
        if scaling.kind in ("longrope", "yarn"):
            cos, sin = cos * scaling.attention_factor, sin * scaling.attention_factor
        self.register_buffer("cos", cos.float(), persistent=False)
        self.register_buffer("sin", sin.float(), persistent=False)
        self._step: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Full-width ``(cos, sin)`` for ``positions``, ``[T, 1, rot_dim]`` float32."""
        step = self._step
        if step is not None and step[0] is positions:
            if step[1] is None:  # the first layer of the step that needs them
                self._step = step = (positions, *self._gather(positions))
            return step[1], step[2]
        return self._gather(positions)

    def _gather(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self.cos[positions], self.sin[positions]
        if self.neox:
            cos, sin = torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)
        else:
            cos, sin = cos.repeat_interleave(2, dim=-1), sin.repeat_interleave(2, dim=-1)
        return cos[:, None, :], sin[:, None, :]

    def begin_step(self, positions: torch.Tensor) -> None:
        """Layers of this forward pass share one computation of the tables for ``positions``
        (made when the first of them asks: kernels that rotate from ``cos``/``sin`` never do)."""
        self._step = (positions, None, None)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Rotate ``x [T, heads, head_dim]``; returns a new tensor."""
        cos, sin = self.tables(positions)
        rot = x if self.rot_dim == x.shape[-1] and x.dtype == torch.float32 else x[..., : self.rot_dim].float()
        if self.neox:
            x1, x2 = rot.chunk(2, dim=-1)
            turned = torch.cat((x2.neg(), x1), dim=-1)
        else:
            turned = torch.stack((rot[..., 1::2].neg(), rot[..., 0::2]), dim=-1).flatten(-2)
        rotated = rot * cos + turned * sin
        if self.rot_dim == x.shape[-1]:
            return rotated if rotated.dtype == x.dtype else rotated.to(x.dtype)
        return torch.cat((rotated.to(x.dtype), x[..., self.rot_dim :]), dim=-1)


class QueryTemperature(nn.Module):
    """llama 4's attention temperature (Ministral 3): the rotated queries at position ``p``
    multiplied by ``1 + scale * ln(1 + floor(p / length))`` (see
    :attr:`~localllm.models.config.ModelConfig.attn_temperature_scale`), from a table of every
    position's factor computed once in float64, as llama.cpp computes each (transformers: in
    float32), so that a query's factor never depends on the other rows of its step."""

    def __init__(self, scale: float, length: int, max_positions: int) -> None:
        super().__init__()
        if length <= 0:
            raise ValueError(f"attention temperature length {length}")
        steps = torch.div(torch.arange(max_positions, dtype=torch.int64), length, rounding_mode="floor")
        table = 1.0 + scale * torch.log1p(steps.double())
        self.register_buffer("table", table.float(), persistent=False)

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        """The factors of ``positions`` ``[T]`` as ``[T, 1, 1]``, to multiply queries ``[T, heads, head_dim]``."""
        return self.table[positions][:, None, None]


class Attention(nn.Module):
    """Self-attention over the paged KV cache. ``rope`` is None on a layer without RoPE (NoPE):
    its queries and keys stay as projected; ``temperature`` (or None) scales the rotated queries
    by position."""

    ops = REFERENCE

    def __init__(self, config: ModelConfig, q_proj, k_proj, v_proj, o_proj, q_norm, k_norm,
                 rope: RotaryEmbedding | None, sliding_window: int | None = None,
                 temperature: QueryTemperature | None = None, sinks: torch.Tensor | None = None) -> None:
        """``sinks``: a learned logit per query head ``[num_heads]`` that takes its share of each
        softmax and brings no value (gpt-oss), or None. With ``config.attn_output_gate``
        (Qwen3-Next, Qwen3.5) ``q_proj`` gives per head its query, then a gate: the attention's
        output is multiplied by ``sigmoid(gate)``."""
        super().__init__()
        self.output_gate = config.attn_output_gate
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.scale = config.query_scale
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = q_proj, k_proj, v_proj, o_proj
        self.q_norm, self.k_norm = q_norm, k_norm
        self.qk_norm_full = config.qk_norm_full
        self.rope = rope
        self.temperature = temperature
        self.sliding_window = sliding_window
        self.logit_softcap = config.attn_logit_softcap
        extras = {}
        if sliding_window is not None:
            extras["sliding_window"] = sliding_window
        if self.logit_softcap is not None:
            extras["logit_softcap"] = self.logit_softcap
        # a parameter: moved with the model (its data replaced in place), so extras keeps it
        self.sinks = None if sinks is None else nn.Parameter(sinks.float(), requires_grad=False)
        if self.sinks is not None:
            extras["sinks"] = self.sinks
        self._extras = extras  # only what differs from plain attention reaches the backend

    def forward(self, positions, x, kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        T = x.shape[0]
        ops = self.ops
        qkv = ops.fused_linear((self.q_proj, self.k_proj, self.v_proj), x, meta)
        q_width = self.num_heads * self.head_dim * (2 if self.output_gate else 1)
        if qkv is None:
            q, k, v = (ops.linear(m, x, meta) for m in (self.q_proj, self.k_proj, self.v_proj))
        else:
            kv_size = self.num_kv_heads * self.head_dim
            q, k, v = qkv.split((q_width, kv_size, kv_size), dim=-1)
        gate = None
        if self.output_gate:
            q, gate = q.view(T, self.num_heads, 2 * self.head_dim).split(self.head_dim, dim=-1)
            gate = gate.reshape(T, self.num_heads * self.head_dim)
        if self.q_norm is not None and self.qk_norm_full:
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.reshape(T, self.num_heads, self.head_dim)
        k = k.view(T, self.num_kv_heads, self.head_dim)
        v = v.view(T, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and not self.qk_norm_full:
            q = self.q_norm(q)
            k = self.k_norm(k)
        q = ops.rope_write_kv(self.rope, positions, q, k, v, kv_cache, meta.slot_mapping)
        if self.temperature is not None:  # (in float32, as llama.cpp's graph; back to the queries' dtype)
            q = (q * self.temperature(positions)).to(q.dtype)
        o = ops.attention(q, kv_cache, meta, self.scale, **self._extras).reshape(T, self.num_heads * self.head_dim)
        if gate is not None:
            o = o * sigmoid_rows(gate).to(o.dtype)
        return ops.linear(self.o_proj, o, meta)


class MLP(nn.Module):
    """The gated MLP: ``down(act(gate(x)) * up(x))`` with SiLU (SwiGLU) or tanh-GELU (GeGLU), or
    ``down(swiglu_oai(gate(x), up(x)))``, gpt-oss's clamped SwiGLU (``alpha``, ``limit``: see
    :class:`~localllm.models.config.ModelConfig`)."""

    ops = REFERENCE

    def __init__(self, gate_proj, up_proj, down_proj, activation: str = "silu", *, alpha: float = 1.702,
                 limit: float = 7.0) -> None:
        super().__init__()
        if activation not in ("silu", "gelu_tanh", "swiglu_oai"):
            raise ValueError(f"activation {activation!r}")
        self.gate_proj, self.up_proj, self.down_proj = gate_proj, up_proj, down_proj
        self.activation = activation
        self.alpha, self.limit = alpha, limit

    def forward(self, x: torch.Tensor, meta: AttentionMetadata | None = None) -> torch.Tensor:
        ops = self.ops
        gate_up = ops.fused_linear((self.gate_proj, self.up_proj), x, meta)
        if gate_up is None:
            gate, up = ops.linear(self.gate_proj, x, meta), ops.linear(self.up_proj, x, meta)
        else:
            gate, up = gate_up.chunk(2, dim=-1)
        if self.activation == "silu":
            act = ops.silu_mul(gate, up)
        elif self.activation == "gelu_tanh":
            act = ops.gelu_tanh_mul(gate, up)
        else:
            act = ops.swiglu_oai_mul(gate, up, self.alpha, self.limit)
        return ops.linear(self.down_proj, act, meta)


class SparseMoE(nn.Module):
    """A mixture of experts: the router scores every expert for each token, the token goes
    through its top ``experts_per_token`` (each a gated :class:`MLP`) and their outputs are summed,
    each times its routing weight (see :class:`~localllm.models.config.MoeConfig`).

    The step's tokens run grouped by expert: each expert's weights are read once for all the
    tokens routed to it. A token's output is the same whichever tokens share its step: each
    expert's linears compute rows alone on a batch-invariant backend, and a token's expert
    outputs are added in its own routing order (highest selection score first), as llama.cpp adds
    them. A shared expert's output (times its sigmoid gate, where it has one) is added to their sum.

    ``selection_bias`` (float32 ``[num_experts]``; GGUF ``exp_probs_b``): added to the scores for
    the choice of experts only, never to their weights."""

    ops = REFERENCE

    def __init__(self, router, experts: list[MLP], moe: MoeConfig, shared: MLP | None = None,
                 shared_gate: nn.Module | None = None, selection_bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.router = router
        self.experts = nn.ModuleList(experts)
        self.shared, self.shared_gate = shared, shared_gate
        self.register_buffer("selection_bias", selection_bias, persistent=False)
        self.top_k = moe.experts_per_token
        self.norm_topk_prob = moe.norm_topk_prob
        self.weights_scale = moe.weights_scale
        self.gating = moe.gating

    def route(self, x: torch.Tensor, meta: AttentionMetadata | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(weights [T, k] float32, experts [T, k] int64)``, each token's chosen experts by
        descending selection score (its weight's order, but where a selection bias is added), as
        llama.cpp's ``build_moe_ffn`` routes: the scores (a softmax over the experts, their sigmoids,
        or the logits themselves for ``softmax_weight``), the top ones by score plus the selection
        bias, their unbiased scores as weights (``softmax_weight``: a softmax over the kept logits),
        renormalized (the sum kept from zero as llama.cpp keeps it) and scaled."""
        native = self.ops.moe_route(self, x)
        if native is not None:
            return native
        logits = self.ops.linear(self.router, x, meta).float()
        if self.gating == "softmax":
            scores = torch.softmax(logits, dim=-1)
        elif self.gating == "sigmoid":
            scores = sigmoid_rows(logits)
        else:  # softmax_weight: the top logits, then a softmax over them alone
            scores = logits
        if self.selection_bias is None:
            weights, chosen = torch.topk(scores, self.top_k, dim=-1)
        else:
            chosen = torch.topk(scores + self.selection_bias, self.top_k, dim=-1).indices
            weights = scores.gather(-1, chosen)
        if self.gating == "softmax_weight":
            weights = torch.softmax(weights, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True).clamp(min=MIN_WEIGHTS_SUM)
        if self.weights_scale != 1.0:
            weights = weights * self.weights_scale
        return weights, chosen

    def forward(self, x: torch.Tensor, meta: AttentionMetadata | None = None) -> torch.Tensor:
        y = self.routed(x, meta)
        if self.shared is None:
            return y
        shared = self.shared(x, meta)
        if self.shared_gate is not None:
            shared = shared * sigmoid_rows(self.ops.linear(self.shared_gate, x, meta)).to(shared.dtype)
        return y + shared

    def routed(self, x: torch.Tensor, meta: AttentionMetadata | None = None) -> torch.Tensor:
        """The routed experts' weighted sum."""
        weights, chosen = self.route(x, meta)
        whole = self.ops.moe_experts(self, x, weights, chosen)
        if whole is not None:
            return whole
        T, k = chosen.shape
        flat = chosen.reshape(-1)
        order = torch.argsort(flat, stable=True)  # (token, rank) slots grouped by expert
        counts = torch.bincount(flat, minlength=len(self.experts)).tolist()
        outs = x.new_empty(T * k, x.shape[-1])
        start = 0
        for expert, n in enumerate(counts):
            if n:
                slots = order[start:start + n]
                outs[slots] = self.experts[expert](x[slots // k])
                start += n
        outs = outs.view(T, k, -1)
        w = weights.to(x.dtype)
        y = outs[:, 0] * w[:, :1]
        for rank in range(1, k):
            y = y + outs[:, rank] * w[:, rank:rank + 1]
        return y


class DecoderLayer(nn.Module):
    """``h + mlp(post_norm(h + attn(input_norm(h))))``; with sandwich norms (Gemma 2/3) the
    attention's and the MLP's outputs are normed too (``post_attn_norm``, ``post_mlp_norm``)
    before each residual add. ``post_norm`` is the norm before the MLP. ``attn``: an
    :class:`Attention`, or a :class:`~localllm.models.linear_attention.GatedDeltaNet` (whose
    ``kv_cache`` is its recurrent state buffer)."""

    ops = REFERENCE

    def __init__(self, input_norm, attn, post_norm, mlp, post_attn_norm=None, post_mlp_norm=None) -> None:
        super().__init__()
        self.input_norm, self.attn, self.post_norm, self.mlp = input_norm, attn, post_norm, mlp
        self.post_attn_norm, self.post_mlp_norm = post_attn_norm, post_mlp_norm
        # llama's layout: a backend may run the whole layer in one call (ops.decoder_layer)
        # (or a mixture of experts in its place: SwiGLU experts, no shared expert)
        mlps = list(mlp.experts) if isinstance(mlp, SparseMoE) and mlp.shared is None else [mlp]
        self.llama_layout = (post_attn_norm is None and post_mlp_norm is None
                             and all(isinstance(m, MLP) and m.activation == "silu" for m in mlps)
                             and isinstance(attn, Attention) and not attn.qk_norm_full
                             and attn.sliding_window is None and attn.logit_softcap is None
                             and attn.sinks is None and not attn.output_gate)

    def forward(self, positions, h, kv_cache, meta) -> torch.Tensor:
        if self.llama_layout:
            whole = self.ops.decoder_layer(self, positions, h, kv_cache, meta)
            if whole is not None:
                return whole
        a = self.attn(positions, self.input_norm(h), kv_cache, meta)
        if self.post_attn_norm is not None:
            a = self.post_attn_norm(a)
        x, h = self.post_norm.forward_add(a, h)  # h = h + a; x = post_norm(h)
        m = self.mlp(x, meta)
        if self.post_mlp_norm is not None:
            m = self.post_mlp_norm(m)
        return h + m


class Classifier(nn.Module):
    """A reranker's head (llama.cpp's ``cls.output`` on the pooled hidden state): scores per label,
    through a softmax where the architecture asks for one (Qwen3-Reranker: P(yes), P(no))."""

    def __init__(self, linear: nn.Module, softmax: bool) -> None:
        super().__init__()
        self.linear = linear
        self.softmax = softmax

    def forward(self, pooled: torch.Tensor) -> torch.Tensor:
        scores = self.linear(pooled.float()).float()
        return torch.softmax(scores, dim=-1) if self.softmax else scores


class DecoderModel(nn.Module):
    """Decoder-only transformer; build it with :func:`localllm.models.assembler.load_model`.
    ``classifier``: a reranker's head (None for every other model)."""

    ops = REFERENCE

    def __init__(self, config: ModelConfig, embed, layers: list[DecoderLayer], norm, lm_head, dtype,
                 classifier: Classifier | None = None) -> None:
        super().__init__()
        self.classifier = classifier
        self.config = config
        self.embed = embed
        self.layers = nn.ModuleList(layers)
        self.norm = norm
        self.lm_head = lm_head
        self.dtype = dtype
        self.embedding_scale = config.embedding_scale
        self.final_logit_softcap = config.final_logit_softcap
        ropes = {id(layer.attn.rope): layer.attn.rope for layer in layers
                 if isinstance(layer.attn, Attention) and layer.attn.rope is not None}
        self._ropes = list(ropes.values())  # a plain list: not registered twice as submodules
        self._meta: AttentionMetadata | None = None  # the last forward pass's, for compute_logits

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: list[torch.Tensor],
    ) -> torch.Tensor:
        """Hidden states ``[T, hidden]`` after the final norm; K/V of every token is written."""
        self._meta = meta
        for rope in self._ropes:
            rope.begin_step(positions)
        h = self.embed(input_ids).to(self.dtype)
        if self.embedding_scale is not None:
            h = h * torch.tensor(self.embedding_scale, dtype=h.dtype)
        # the final norm in the layers' call where the backend takes it there (an RMSNorm on its ops)
        norm = self.norm
        fold = (norm.weight, norm.eps) if type(norm) is RMSNorm and norm.ops is self.ops else None
        whole = self.ops.decoder_layers(self.layers, positions, h, kv_caches, meta, fold)
        if whole is not None:
            return whole if fold is not None else norm(whole)
        for layer, kv_cache in zip(self.layers, kv_caches):
            h = layer(positions, h, kv_cache, meta)
        return norm(h)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor, meta: AttentionMetadata | None = None) -> torch.Tensor:
        """Float32 logits of ``hidden`` (rows of the step ``meta``; default: the step of the last
        forward pass, whose hidden states these are)."""
        logits = self.ops.linear(self.lm_head, hidden, meta if meta is not None else self._meta).float()
        cap = self.final_logit_softcap
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits
