"""The CPU backend's ops: a decoder layer's non-matmul work on the native kernels
(``csrc/cpu_kernels.cpp``), and the dispatch of its linears to :mod:`localllm.kernels.cpu.matmul`.

:class:`CpuOps` has the methods of the reference :class:`~localllm.kernels.torch_backend.TorchBackend`
and runs each as one compiled call where it can: RMSNorm (with the residual add), RoPE on the
fused q/k/v output plus the K/V cache write (on a layer without RoPE, the same call with no
rotation), SiLU-and-multiply (or gpt-oss's clamped SwiGLU) of the fused gate/up output, and decode
attention read straight from the paged cache (no gather, no padding); a decode-only step runs each
whole layer in one call (:meth:`CpuOps.decoder_layer`), an attention temperature's query factors
included. Whatever it cannot take
(non-float32 tensors, partial rotary, q/k norms, sliding windows, logit
soft-capping, attention sinks, GeGLU, no native kernels on this CPU)
goes to torch: to the torch ops it wraps (``base``), which stay the reference the tests compare
against (``tests/kernels/test_cpu_native.py``), and attention with one of its features each row
alone where the route is batch-invariant (:func:`~localllm.kernels.attention.paged_attention_rows_alone`).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch

from localllm.kernels.attention import AttentionMetadata, paged_attention_rows_alone
from localllm.kernels.backend import STATE_KEY
from localllm.kernels.cpu import gptq, native
from localllm.kernels.cpu.experts import ROUTER_KEY, ExpertPlan, RouterPlan, expert_plan, router_plan
from localllm.kernels.cpu.matmul import CpuLinear, activation_passes, fused_linear, fused_state
from localllm.kernels.cpu.options import CpuOptions
from localllm.kernels.cpu.weights import NativeWeight, join_packed
from localllm.quant.kv_rows import QK, SplitKvCache

_F32 = torch.float32


def _usable(*tensors: torch.Tensor) -> bool:
    return all(t.dtype == _F32 and t.is_contiguous() and t.is_cpu for t in tensors)


def _cache_usable(kv_cache: torch.Tensor | SplitKvCache) -> bool:
    """A KV cache the kernels read and write: float32 or float16, or a split cache of any types."""
    if isinstance(kv_cache, SplitKvCache):
        return kv_cache.data.is_contiguous() and kv_cache.data.is_cpu and kv_cache.head_dim % QK == 0
    return kv_cache.dtype in (_F32, torch.float16) and kv_cache.is_contiguous() and kv_cache.is_cpu


def _native_cache(kv_cache: torch.Tensor | SplitKvCache) -> tuple[torch.Tensor, dict]:
    """A KV cache as the native calls take it: its tensor and, for a split cache, its types' codes."""
    if isinstance(kv_cache, SplitKvCache):
        return kv_cache.data, {"k_type": kv_cache.types.k.code, "v_type": kv_cache.types.v.code}
    return kv_cache, {}


class CpuOps:
    """The model's ops on the native kernels (``native``: the compiled extension, or ``None``
    where there is none), falling back to ``base`` (the torch reference's ops); its linears on
    the repacked weights of :class:`~localllm.kernels.cpu.matmul.CpuLinear`."""

    def __init__(self, base, native, options: CpuOptions) -> None:
        self.base = base
        self.native = native
        self.options = options

    # --- linears -----------------------------------------------------------------------------

    def linear(self, module, x: torch.Tensor, meta: AttentionMetadata | None = None) -> torch.Tensor:
        if type(module) in (CpuLinear, gptq.CpuGPTQLinear):
            return module(x, meta)
        return module(x)

    def fused_linear(self, modules, x: torch.Tensor, meta: AttentionMetadata | None = None) -> torch.Tensor | None:
        kind = type(modules[0])
        if kind is gptq.CpuGPTQLinear:
            return gptq.fused_linear(modules, x, meta, self.options)
        if kind is not CpuLinear:
            return None
        return fused_linear(modules, x, meta, self.options)

    # --- a layer's other ops -----------------------------------------------------------------

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if self.native is not None and x.shape[-1] % 16 == 0 and x.dtype == _F32 and x.is_cpu and _usable(weight):
            # a strided view (Q/K norms of a fused projection's output) is copied first: torch's
            # norm would vectorize by the whole tensor's layout, a row's bits then depending on its batch
            return self.native.rms_norm(x.contiguous(), weight, eps)
        return self.base.rms_norm(x, weight, eps)

    def add_rms_norm(self, x, residual, weight, eps) -> tuple[torch.Tensor, torch.Tensor]:
        if (self.native is not None and _usable(x, residual, weight) and x.shape == residual.shape
                and x.shape[-1] % 16 == 0):
            normed, h = self.native.add_rms_norm(x, residual, weight, eps)
            return normed, h
        return self.base.add_rms_norm(x, residual, weight, eps)

    def rope_write_kv(self, rope, positions, q, k, v, kv_cache, slot_mapping) -> torch.Tensor:
        """``rope`` None (a layer without RoPE): the native call copies q and writes k as they are."""
        if self.native is None:
            return self.base.rope_write_kv(rope, positions, q, k, v, kv_cache, slot_mapping)
        qkv = _fused_source(q, k, v)
        hd = q.shape[-1]
        if qkv is None and q.dim() == k.dim() == v.dim() == 3 and q.dtype == k.dtype == v.dtype == _F32:
            # q and k normed apart (Qwen3's per-head norms): joined again, so that RoPE takes the
            # native arithmetic of the one-call layer, whatever route the step takes
            T = q.shape[0]
            qkv = torch.cat((q.reshape(T, -1), k.reshape(T, -1), v.reshape(T, -1)), dim=1)
        cos, sin, neox = _tables(rope)
        if (qkv is not None and (rope is None or rope.rot_dim == hd) and hd % 32 == 0 and _usable(qkv, cos)
                and _cache_usable(kv_cache) and positions.dtype == torch.int64 and slot_mapping.dtype == torch.int64):
            cache, types = _native_cache(kv_cache)
            return self.native.rope_write_kv(qkv, positions.contiguous(), cos, sin, cache, slot_mapping.contiguous(),
                                             q.shape[1], k.shape[1], hd, neox, rope is not None, **types)
        return self.base.rope_write_kv(rope, positions, q, k, v, kv_cache, slot_mapping)

    def attention(self, q, kv_cache, meta: AttentionMetadata, scale: float, **features) -> torch.Tensor:
        """``features``: ``sliding_window``, ``logit_softcap`` and ``sinks`` (KernelBackend.attention's).
        The native kernel takes a window and sinks; with soft-capping, torch answers, each query
        row alone where the route is batch-invariant (native kernels, no fast math: a prompt token
        then gets the bits a decode at its position gets), the base backend's route otherwise."""
        window, sinks = features.get("sliding_window"), features.get("sinks")
        if features.get("logit_softcap") is not None or (sinks is not None and not _usable(sinks)):
            if self.native is not None and not self.options.fast_math:
                return paged_attention_rows_alone(q, kv_cache, meta, scale, **features)
            return self.base.attention(q, kv_cache, meta, scale, **features)
        cache, types = _native_cache(kv_cache)
        native_features = {"window": window or 0, "sinks": sinks, **types}
        nd = meta.num_decodes
        fast_math = self.options.fast_math
        if (self.native is None or (nd == 0 and fast_math) or q.shape[-1] % 16 or q.shape[-1] > 256
                or q.shape[1] > 256 or not _usable(q) or not _cache_usable(kv_cache)
                or not meta.block_tables.is_cpu or not meta.context_lens.is_cpu):
            return self.base.attention(q, kv_cache, meta, scale, **features)
        if nd == meta.num_seqs:
            return self.native.paged_decode_attention(q, cache, meta.block_tables, meta.context_lens, scale,
                                                      **native_features)
        if not fast_math:
            # batch invariance: each prompt token attends exactly as a decode at its position would
            # (the same kernel, reduction order and context), whatever the chunk, the prefix cache
            # and the other sequences of the step
            tables, lens = _per_token_rows(meta)
            return self.native.paged_decode_attention(q, cache, tables, lens, scale, **native_features)
        decodes = self.native.paged_decode_attention(q[:nd], cache, meta.block_tables, meta.context_lens, scale,
                                                     **native_features)
        # a mixed step: the decodes natively (above), only the prompt chunks on the torch path
        prompts = self.base.attention(q[nd:], kv_cache, _prompt_rows(meta), scale, **features)
        return torch.cat([decodes, prompts]) if nd else prompts

    def decoder_layer(self, layer, positions, h, kv_cache, meta: AttentionMetadata) -> torch.Tensor | None:
        """The whole layer in one native call for a decode-only step, or (batch-invariant mode) a
        step of at most :data:`FUSED_LAYER_MAX_ROWS` rows whose prompt tokens (or speculative
        drafts) attend as decodes at their positions; ``None`` otherwise: then it runs op by op.
        The native layer writes every row's KV before any row attends, so rows of one sequence
        see each other as the op-by-op path would."""
        rows = self._attention_rows(h, (kv_cache,), meta)
        if rows is None:
            return None
        plan = self._plan(layer)
        if plan is None:
            return None
        cache, types = _native_cache(kv_cache)
        return self.native.decoder_layer(h, plan.held, positions, *_tables(plan.rope), cache, meta.slot_mapping,
                                         *rows, **types)

    def decoder_layers(self, layers, positions, h, kv_caches, meta: AttentionMetadata,
                       norm: tuple[torch.Tensor, float] | None = None) -> torch.Tensor | None:
        """Every layer of ``layers`` in one native call, on the steps :meth:`decoder_layer` takes,
        where each layer is a llama-layout layer on these ops with a native plan and all of them
        share one RoPE; ``None`` otherwise: then they run one by one. The same native calls as
        :meth:`decoder_layer`'s one by one (the same bits), without a Python call per layer; the
        final ``norm`` in the same call (as :meth:`rms_norm`: the same bits). The held layers are
        bound to ``kv_caches`` and ``norm`` once (:class:`LayerStack`), while they stay the same."""
        if not all(layer.ops is self for layer in layers):  # (a layer on other ops runs as its ops say)
            return None
        rows = self._step_rows(h, meta)
        if rows is None:
            return None
        stack = layers.__dict__.get(STATE_KEY)
        if stack is None:
            stack = layers.__dict__[STATE_KEY] = self._stack(layers) or False
        if stack is False:
            return None
        bound = stack.bound(self.native, kv_caches, norm, h.shape[-1])
        if bound is None:
            return None
        held_layers, folds_norm = bound
        out = self.native.decoder_layers(h, held_layers, positions, meta.slot_mapping, *rows)
        return out if norm is None or folds_norm else self.rms_norm(out, *norm)

    def _attention_rows(self, h, kv_caches, meta: AttentionMetadata) -> tuple | None:
        """``(block_tables, context_lens)`` with a row per row of ``h`` for the native layer, or
        ``None`` where it does not take this step (see :meth:`decoder_layer`)."""
        if not all(_cache_usable(c) for c in kv_caches):
            return None
        return self._step_rows(h, meta)

    def _step_rows(self, h, meta: AttentionMetadata) -> tuple | None:
        """:meth:`_attention_rows` but for the KV caches' check."""
        if (self.native is None or h.dim() != 2 or not _usable(h) or not meta.block_tables.is_cpu
                or not meta.context_lens.is_cpu):
            return None
        if meta.num_decodes != meta.num_seqs:
            if self.options.fast_math or h.shape[0] > FUSED_LAYER_MAX_ROWS:
                return None
            return _per_token_rows(meta)
        return meta.block_tables, meta.context_lens

    def _plan(self, layer) -> LayerPlan | None:
        """``layer``'s native plan, made on first use, or ``None`` where it has none."""
        plan = layer.__dict__.get(STATE_KEY)
        if plan is None:
            plan = layer.__dict__[STATE_KEY] = layer_plan(layer, self.options) or False
        return plan or None

    def _stack(self, layers) -> LayerStack | None:
        """The held layers of ``layers`` and their one RoPE (that of every layer with one; the
        layers without RoPE hold that they rotate nothing) for :meth:`decoder_layers`, or ``None``."""
        if not len(layers) or not all(getattr(layer, "llama_layout", False) for layer in layers):
            return None
        plans = [self._plan(layer) for layer in layers]
        if not all(plans):
            return None
        ropes = {id(p.rope): p.rope for p in plans if p.rope is not None}
        if len(ropes) > 1:
            return None
        return LayerStack([p.held for p in plans], next(iter(ropes.values()), None))

    def silu_mul(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        gate_up = self._gate_up(gate, up)
        if gate_up is not None:
            return self.native.silu_mul(gate_up)
        return self.base.silu_mul(gate, up)

    def gelu_tanh_mul(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return self.base.gelu_tanh_mul(gate, up)  # no native kernel (yet)

    def swiglu_oai_mul(self, gate: torch.Tensor, up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
        """Natively as :meth:`silu_mul`: each row's bits then do not depend on its batch (torch's
        sigmoid computes a tensor's last elements with other arithmetic than the others)."""
        gate_up = self._gate_up(gate, up)
        if gate_up is not None:
            return self.native.swiglu_oai_mul(gate_up, alpha, limit)
        return self.base.swiglu_oai_mul(gate, up, alpha, limit)

    def _gate_up(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor | None:
        """``[T, 2 I]``: gate and up side by side for a native gated activation, or None where it
        cannot take them."""
        if self.native is None or gate.shape != up.shape or gate.dim() != 2 or gate.shape[-1] % 16:
            return None
        gate_up = _fused_source(gate, up)
        if gate_up is None and gate.dtype == up.dtype == _F32 and gate.is_cpu and up.is_cpu:
            # gate and up apart (weights of different routes): joined, so that each row takes the
            # same native arithmetic as a fused one (torch's elementwise kernels vectorize by
            # the whole tensor's layout, so a row's bits would depend on its batch)
            gate_up = torch.cat((gate, up), dim=-1)
        return gate_up if gate_up is not None and _usable(gate_up) else None

    def moe_route(self, moe, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``moe``'s routing of the rows ``x`` in one native call (``csrc/moe.h``: each logit a dot
        product of its own, so a token's experts and weights do not depend on its batch; the
        one-call layer routes with the same code), or ``None`` where the router has no native route."""
        if self.native is None or x.dim() != 2 or not _usable(x):
            return None
        router = self.router_plan(moe)
        if router is None:
            return None
        weights, chosen = self.native.moe_route(x, router.weight, moe.top_k, router.gating, moe.norm_topk_prob,
                                                moe.weights_scale)
        return weights, chosen

    def router_plan(self, moe) -> RouterPlan | None:
        """``moe``'s native router, made on first use, or ``None`` where it has none."""
        return _cached(moe, ROUTER_KEY, router_plan)

    def moe_experts(self, moe, x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor | None:
        """A mixture of experts' experts for the rows ``x`` in one native call (each expert's weights
        read once for the step's tokens routed to it; see ``csrc/moe.h``), or ``None`` where its
        experts have no native route (then the layer runs them one by one)."""
        if self.native is None or x.dim() != 2 or not _usable(x):
            return None
        plan = self.expert_plan(moe)
        if plan is None:
            return None
        return self.native.moe_experts(x, chosen.contiguous(), weights.float().contiguous(), plan.gate_up,
                                       plan.gate_up_bits, plan.down, plan.down_bits, plan.inter,
                                       activation_passes(self.options), plan.gate_up_bias, plan.down_bias,
                                       plan.activation, plan.alpha, plan.limit)

    def expert_plan(self, moe) -> ExpertPlan | None:
        """``moe``'s native plan, made on first use, or ``None`` where it has none."""
        return _cached(moe, STATE_KEY, lambda m: expert_plan(m, self.options))


# Steps of at most this many rows that are not all decodes (speculative decoding's drafts, short
# prompt chunks) still take the one-call layer: per-op dispatch would cost more than their compute.
FUSED_LAYER_MAX_ROWS = 64


def _per_token_rows(meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    """``(block_tables [T, max_blocks], context_lens [T])`` with one row per query token of the
    step: its sequence's block table and its own position + 1 (made once per step, shared by
    the layers through ``meta.step_cache``)."""
    cache = meta.step_cache
    if cache is not None and "per_token_rows" in cache:
        return cache["per_token_rows"]
    starts = meta.query_start_loc
    counts = torch.tensor([starts[i + 1] - starts[i] for i in range(meta.num_seqs)], dtype=torch.int64)
    seq = torch.repeat_interleave(torch.arange(meta.num_seqs), counts)
    ends = torch.tensor(meta.context_lens_host, dtype=torch.int64)  # each sequence's last position + 1
    offset_from_end = torch.cat([torch.arange(int(n) - 1, -1, -1) for n in counts])
    rows = (meta.block_tables.index_select(0, seq).contiguous(), ends[seq] - offset_from_end)
    if cache is not None:
        cache["per_token_rows"] = rows
    return rows


def _prompt_rows(meta: AttentionMetadata) -> AttentionMetadata:
    """``meta`` without its decode rows (each decode is one query token, listed first)."""
    nd = meta.num_decodes
    return AttentionMetadata(
        slot_mapping=meta.slot_mapping[nd:],
        block_tables=meta.block_tables[nd:],
        context_lens=meta.context_lens[nd:],
        query_start_loc=[start - nd for start in meta.query_start_loc[nd:]],
        context_lens_host=meta.context_lens_host[nd:],
        num_decodes=0,
        block_size=meta.block_size,
        step_cache=None if meta.step_cache is None else {},  # its keys index sequences by position
    )


def _fused_source(*parts: torch.Tensor) -> torch.Tensor | None:
    """The contiguous 2-D tensor ``[T, sum(widths)]`` whose consecutive column blocks ``parts``
    are (a fused projection's output, split and viewed per head), or ``None``. Read from strides
    and offsets: tensors made in inference mode keep no ``_base``."""
    first = parts[0]
    rows = first.shape[0]
    widths = [p.numel() // rows if rows else 0 for p in parts]
    width = sum(widths)
    storage = first.untyped_storage().data_ptr()
    offset = first.storage_offset()
    for p, w in zip(parts, widths):
        if p.shape[0] != rows or p.untyped_storage().data_ptr() != storage or p.storage_offset() != offset:
            return None
        # each row of ``p`` is ``w`` consecutive elements, rows ``width`` apart
        if (rows > 1 and p.stride(0) != width) or p.stride(-1) != 1 or not p[0].is_contiguous():
            return None
        offset += w
    if rows == 0:
        return None
    return first.as_strided((rows, width), (width, 1), first.storage_offset())


@dataclass(slots=True)
class LayerPlan:
    """What :meth:`CpuOps.decoder_layer` hands the native call for one layer."""

    input_norm: torch.Tensor
    post_norm: torch.Tensor
    eps: float
    qkv: tuple[NativeWeight, ...]  # one fused weight, or q, k, v apart (different types or input orders)
    qkv_bias: torch.Tensor | None
    o: NativeWeight
    gate_up: tuple[NativeWeight, ...]  # one fused weight, or gate and up apart; none: a mixture of experts
    down: NativeWeight | None  # None: a mixture of experts (held by LayerPlan.held)
    inter: int  # the MLP's width (a mixture's: each expert's)
    perms: tuple = ()  # GPTQ act-order: each weight's input order (q/k/v, o, gate/up, down; None: as is), or ()
    rope: object = None  # the layer's RotaryEmbedding (its cos/sin tables are read at each call); None: no RoPE
    held: object = None  # the native call's weights and shapes (native.HeldLayer, made once by layer_plan)


class LayerStack:
    """A model's held layers (each one's ``LayerPlan.held``) and their one RoPE, for
    :meth:`CpuOps.decoder_layers`; :meth:`bound` binds them to the step's KV caches, the RoPE's
    tables and the final norm once (``native.HeldLayers``), and again only when one of those changes."""

    def __init__(self, held: list, rope) -> None:
        self.held = held
        self.rope = rope  # None where no layer rotates
        self._bound: tuple | None = None  # (key, (native.HeldLayers, whether it folds the norm))

    def bound(self, native, kv_caches, norm: tuple[torch.Tensor, float] | None, hidden: int) -> tuple | None:
        """``(native.HeldLayers of these layers on kv_caches (one per layer) and, where it can run
        natively, norm ((weight, eps)), whether it took the norm)``; ``None`` where a KV cache cannot
        be read natively."""
        cos, sin, neox = _tables(self.rope)
        key = (tuple(kv_caches), cos, sin, None if norm is None else norm[0], None if norm is None else norm[1])
        bound = self._bound  # (read once: a binding made meanwhile on another thread is whole too)
        if bound is not None:
            was = bound[0]
            if (len(key[0]) == len(was[0]) and all(map(operator.is_, key[0], was[0]))
                    and all(map(operator.is_, key[1:4], was[1:4])) and key[4] == was[4]):
                return bound[1]
        if not all(_cache_usable(c) for c in kv_caches):
            return None
        native_norm = norm is not None and _usable(norm[0]) and norm[0].shape == (hidden,) and hidden % 16 == 0
        caches = [_native_cache(c) for c in kv_caches]
        types = caches[0][1] if caches else {}  # (one engine's layers share their types)
        held_layers = native.HeldLayers(self.held, cos, sin, neox, [c for c, _ in caches],
                                        *((norm[0], float(norm[1])) if native_norm else (None, 0.0)), **types)
        self._bound = bound = (key, (held_layers, native_norm))
        return bound[1]


def _tables(rope) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """``(cos, sin, neox)`` of ``rope`` for the native calls; for None (no RoPE), empty tables
    that they never read."""
    if rope is None:
        return _NO_TABLE, _NO_TABLE, True
    return rope.cos, rope.sin, rope.neox


_NO_TABLE = torch.empty(0, 0)


def layer_plan(layer, options: CpuOptions) -> LayerPlan | None:
    """A plan when every part of ``layer`` has a native route (llama layout: per-head q/k norms or
    none, full rotary or none, no sliding window, logit soft-capping or sinks, a SiLU MLP or a
    mixture of SiLU experts with native router and experts, GGUF linears on the CPU backend
    repacked for the native kernel, no biases but q/k/v's; an attention temperature taken); else
    ``None``."""
    kernels = native.load(options)
    if kernels is None or not getattr(layer, "llama_layout", False):
        return None
    attn, mlp = layer.attn, layer.mlp
    experts = getattr(mlp, "experts", None)  # a mixture of experts in place of the MLP
    # the native layer has no sliding window, no soft-capping, no sinks, SiLU only
    if (getattr(attn, "sliding_window", None) is not None or getattr(attn, "logit_softcap", None) is not None
            or getattr(attn, "sinks", None) is not None or getattr(mlp, "activation", "silu") != "silu"):
        return None
    norms = (layer.input_norm, layer.post_norm)
    rope = attn.rope
    if ((rope is not None and rope.rot_dim != attn.head_dim) or attn.head_dim % 32
            or attn.head_dim > 256 or attn.num_heads > 256):
        return None
    qk_norms = None if attn.q_norm is None else (attn.q_norm, attn.k_norm)
    if qk_norms is not None and (attn.qk_norm_full or qk_norms[0].eps != qk_norms[1].eps
                                 or any(n.weight.dtype != _F32 or n.weight.numel() != attn.head_dim for n in qk_norms)):
        return None
    temperature = getattr(attn, "temperature", None)
    if temperature is not None and not _usable(temperature.table):
        return None
    if any(n.weight.dtype != _F32 or n.weight.shape[-1] % 16 for n in norms) or norms[0].eps != norms[1].eps:
        return None
    mlp_linears = () if experts is not None else (mlp.gate_proj, mlp.up_proj, mlp.down_proj)
    linears = (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, *mlp_linears)
    if not (all(type(m) is CpuLinear for m in linears) or all(type(m) is gptq.CpuGPTQLinear for m in linears)):
        return None
    if any(m.bias is not None for m in (attn.o_proj, *mlp_linears)):
        return None
    moe = None
    if experts is not None:
        moe = (_cached(mlp, ROUTER_KEY, router_plan), _cached(mlp, STATE_KEY, lambda m: expert_plan(m, options)))
        # (the one-call layer's experts: SiLU, no biases)
        if not all(moe) or moe[1].activation != "silu" or moe[1].gate_up_bias is not None or moe[1].down_bias is not None:
            return None
    projections = (attn.q_proj, attn.k_proj, attn.v_proj)
    qkv = _fused(projections, options)
    if qkv is not None:
        qkv_states, bias = (qkv[0],), qkv[1]
    else:  # e.g. Q4_K_M's v in Q6_K beside q and k in Q4_K, or GPTQ q/k/v in different input orders
        qkv_states = tuple(m.prepared() for m in projections)
        bias = None
        if any(m.bias is not None for m in projections):
            bias = torch.cat([m.bias.float() if m.bias is not None else torch.zeros(m.out_features)
                              for m in projections])
    gate_up_states, down_states = (), ()
    if experts is None:
        gate_up = _fused((mlp.gate_proj, mlp.up_proj), options)
        if gate_up is not None and gate_up[1] is not None:
            return None
        gate_up_states = (gate_up[0],) if gate_up is not None else (mlp.gate_proj.prepared(), mlp.up_proj.prepared())
        down_states = (mlp.down_proj.prepared(),)
    states = (*qkv_states, attn.o_proj.prepared(), *gate_up_states, *down_states)
    # GPTQ weights carry their input order (act-order): the native layer gathers each input as its weight wants
    perms = tuple(s.perm if isinstance(s, gptq.GPTQNative) else None for s in states)
    weights = tuple(_plain(s) for s in states)
    if not all(isinstance(w, NativeWeight) for w in weights):
        return None
    nq = len(qkv_states)
    join_packed(weights, options.huge_pages)
    bias = None if bias is None else bias.float().contiguous()
    inter = moe[1].inter if moe is not None else mlp.gate_proj.out_features
    plan = LayerPlan(norms[0].weight.contiguous(), norms[1].weight.contiguous(), float(norms[0].eps),
                     weights[:nq], bias, weights[nq], weights[nq + 1:nq + 1 + len(gate_up_states)],
                     weights[-1] if down_states else None, inter,
                     perms if any(p is not None for p in perms) else (), rope)
    passes = activation_passes(options)
    plan.held = kernels.HeldLayer(
        plan.input_norm, [w.packed for w in plan.qkv], [w.bits for w in plan.qkv], plan.qkv_bias,
        plan.o.packed, plan.o.bits, plan.post_norm, [w.packed for w in plan.gate_up], [w.bits for w in plan.gate_up],
        _NO_WEIGHT if plan.down is None else plan.down.packed, 0 if plan.down is None else plan.down.bits,
        attn.num_heads, attn.num_kv_heads, attn.head_dim, plan.inter, plan.eps,
        attn.scale, passes, list(plan.perms), rope is not None,
        None if temperature is None else temperature.table)
    if qk_norms is not None:
        plan.held.set_qk_norm(qk_norms[0].weight.contiguous(), qk_norms[1].weight.contiguous(), float(qk_norms[0].eps))
    if moe is not None:
        router, ep = moe
        plan.held.set_moe(kernels.HeldMoe(router.weight, ep.gate_up, ep.gate_up_bits, ep.down, ep.down_bits, ep.inter,
                                          mlp.top_k, router.gating, mlp.norm_topk_prob, mlp.weights_scale, passes))
    return plan


_NO_WEIGHT = torch.empty(0, dtype=torch.uint8)  # (the dense MLP's down weight of a layer of experts)


def _cached(module, key: str, make):
    """``module``'s plan under ``key``, made by ``make(module)`` on first use; ``None`` where it has none."""
    plan = module.__dict__.get(key)
    if plan is None:
        plan = module.__dict__[key] = make(module) or False
    return plan or None


def _fused(modules, options: CpuOptions):
    """``(weight, bias | None)`` of GGUF or GPTQ linears fused, or ``None``."""
    if type(modules[0]) is gptq.CpuGPTQLinear:
        return gptq.fused_state(modules, options)
    return fused_state(modules, options)


def _plain(state):
    """The native weight of a GGUF or GPTQ state (a GPTQ one's input order goes in the plan)."""
    return state.weight if isinstance(state, gptq.GPTQNative) else state
