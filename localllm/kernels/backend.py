"""What runs a model: the :class:`Backend` protocol, and the module swapping its installs share.

A backend is one object that is at once

* **the ops a model calls**: the model's modules (``RMSNorm``, ``Attention``, ``MLP``,
  ``DecoderLayer``, ``DecoderModel``) call ``self.ops.<op>``, and ``install`` points their
  ``ops`` at the backend;
* **its installation** on a loaded model (:meth:`Backend.install`): swapping the quantized
  linears and embeddings for the backend's own modules (which keep the originals as ``base``,
  the reference) and setting ``ops``;
* **its capabilities**, which the engine asks instead of comparing names.

Three implement it: :class:`~localllm.kernels.torch_backend.TorchBackend` (the pure-torch
reference, what a freshly loaded model runs), :class:`~localllm.kernels.cpu.backend.CpuBackend`
(repacked weights, native AVX-512 kernels) and
:class:`~localllm.kernels.triton.backend.TritonBackend` (GPUs). :func:`localllm.kernels.select.select_backend`
picks one; nothing outside ``localllm/kernels`` knows which.

Per-step state travels in the :class:`~localllm.kernels.attention.AttentionMetadata` each op
and linear receives (``meta.has_prompt_tokens``), never in module globals.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from localllm.kernels.attention import AttentionMetadata


@runtime_checkable
class Backend(Protocol):
    """The kernels a model runs on."""

    name: str
    """For display and stats: ``"torch"``, ``"cpu"``, ``"cpu-native"``, ``"triton"``."""

    # --- capabilities ------------------------------------------------------------------------

    supports_cuda_graphs: bool
    """Decode steps may be captured as CUDA graphs (the attention reads device-side metadata
    only): the engine runs such a backend on a GPU with the GPU runner."""

    cuda_graphs: bool
    """Whether to capture them (``supports_cuda_graphs`` and not switched off)."""

    kv_cache_matches_model_dtype: bool
    """The backend reads a KV cache of the model's dtype only."""

    batch_invariant: bool
    """A row's results do not depend on the other rows of its step, nor a prompt token's on
    whether it is computed with others or alone (docs/architecture.md, "Batch invariance"): the
    engine then speculates by default, since drafts verified in one step change no token."""

    def kv_cache_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        """The KV cache's dtype for ``kv_cache_dtype="auto"``."""
        ...

    def kv_cache(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """One layer's KV cache: a zeroed ``shape`` tensor of ``dtype`` on ``device``."""
        ...

    def greedy_rows(self, logits: torch.Tensor) -> tuple[list[int], list[bool]] | None:
        """Each row's first largest entry and whether the row can be sampled (no NaN, no +inf, not
        only -inf), in one call where the backend has one; ``None``: the sampler's torch ops."""
        ...

    def decode_splits(self, num_seqs: int, num_kv_heads: int, max_context: int, device: torch.device) -> int:
        """How many parts a captured decode step's attention splits each sequence's keys into
        (flash-decoding; 1: none)."""
        ...

    # --- lifecycle ---------------------------------------------------------------------------

    def install(self, model: torch.nn.Module) -> torch.nn.Module:
        """Run ``model`` (already on its device) on this backend, whatever ran it before; returns it."""
        ...

    def held_bytes(self, model: torch.nn.Module) -> int:
        """Bytes the backend holds for ``model`` beside its buffers (repacked weights)."""
        ...

    # --- the ops a model calls ---------------------------------------------------------------

    def linear(self, module: torch.nn.Module, x: torch.Tensor, meta: AttentionMetadata | None = None) -> torch.Tensor:
        """``module(x)`` for one of the model's linears (an LM head too), in this step."""
        ...

    def fused_linear(self, modules, x: torch.Tensor, meta: AttentionMetadata | None = None) -> torch.Tensor | None:
        """The outputs of ``modules`` (linears reading ``x``) concatenated along the last dim by
        one fused matmul, or ``None`` (then the model calls :meth:`linear` on each)."""
        ...

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor: ...

    def add_rms_norm(self, x, residual, weight, eps) -> tuple[torch.Tensor, torch.Tensor]:
        """``(rms_norm(residual + x), residual + x)``."""
        ...

    def rope_write_kv(self, rope, positions, q, k, v, kv_cache, slot_mapping) -> torch.Tensor:
        """Rotate ``q`` and ``k``, write ``k``/``v`` into the cache; return the rotated ``q``.
        ``rope`` None (a layer without RoPE): ``q`` and ``k`` stay as they are."""
        ...

    def attention(
        self,
        q,
        kv_cache,
        meta: AttentionMetadata,
        scale: float,
        *,
        sliding_window: int | None = None,
        logit_softcap: float | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Causal paged attention of ``q [num_tokens, num_heads, head_dim]`` against ``kv_cache``
        (see :func:`~localllm.kernels.attention.paged_attention`, the reference).

        ``sliding_window``: a query at position ``p`` sees the key at ``j`` iff ``j <= p`` and
        ``p - j < sliding_window`` (``None``: the whole context). ``logit_softcap``: the scores
        ``s = scale * q.k`` become ``logit_softcap * tanh(s / logit_softcap)`` before the mask and
        the softmax (``None``: off). ``sinks`` (float32 ``[num_heads]``): one more logit per query
        head in each softmax's denominator, with no value (``None``: none). With all three
        ``None`` the plain path runs, unchanged.
        """
        ...

    def silu_mul(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` (SwiGLU)."""
        ...

    def gelu_tanh_mul(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """``gelu(gate, approximate="tanh") * up`` (GeGLU), rounded like :meth:`silu_mul`:
        the activation in the inputs' dtype, then the product."""
        ...

    def swiglu_oai_mul(self, gate: torch.Tensor, up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
        """gpt-oss's clamped SwiGLU: with ``g = min(gate, limit)`` and ``u = clamp(up, -limit,
        limit)``, ``g * sigmoid(alpha * g) * (u + 1)`` (transformers' ``GptOssExperts``, llama.cpp's
        ``swiglu_oai``)."""
        ...

    def decoder_layer(self, layer, positions, h, kv_cache, meta: AttentionMetadata) -> torch.Tensor | None:
        """A whole layer in one go, or ``None``: then the layer runs op by op."""
        ...

    def moe_route(self, moe, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The mixture of experts ``moe``'s routing of the rows ``x`` (its router and gating, see
        ``SparseMoE.route``): ``(weights [T, k] float32, experts [T, k] int64)``, or ``None``:
        then the model routes them with torch."""
        ...

    def moe_experts(self, moe, x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor | None:
        """The experts of the mixture of experts ``moe`` for the rows ``x`` routed to ``chosen``
        ``[T, k]`` with ``weights`` ``[T, k]`` (each token's in its routing order: by descending
        selection score), their outputs added in that order, in one go; or ``None``: then the model runs them one by one."""
        ...

    def decoder_layers(self, layers, positions, h, kv_caches, meta: AttentionMetadata,
                       norm: tuple[torch.Tensor, float] | None = None) -> torch.Tensor | None:
        """Every layer of ``layers`` (one KV cache each) in one go, or ``None``: then they run one
        by one (each through :meth:`decoder_layer` or op by op). ``norm``: the model's final
        RMSNorm (weight, eps); where given, what comes back is normed by it (:meth:`rms_norm`)."""
        ...


def zeroed_kv_cache(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """One layer's KV cache as ``torch.zeros``: :meth:`Backend.kv_cache` where a backend holds it no
    other way."""
    return torch.zeros(shape, dtype=dtype, device=device)


STATE_KEY = "_backend_state"
"""Where a backend caches per-module state on the model's own modules (``module.__dict__``; the
CPU backend: a decoder layer's native plan); :func:`restore_reference` drops it."""


class KernelModule(torch.nn.Module):
    """A backend's stand-in for one of the model's modules; ``base`` (a registered submodule)
    is the module it replaces, kept as the reference and restored by :func:`restore_reference`."""

    base: torch.nn.Module


def swap_modules(model: torch.nn.Module, wrap) -> dict[int, torch.nn.Module]:
    """Replace each child ``c`` of ``model``'s modules by ``wrap(c)`` (a :class:`KernelModule`'s
    ``base`` stays as it is); returns ``{id(old): new}`` of those replaced."""
    swapped: dict[int, torch.nn.Module] = {}
    for parent in list(model.modules()):
        if isinstance(parent, KernelModule):
            continue  # its ``base`` stays the reference module
        for name, child in list(parent.named_children()):
            new = swapped.get(id(child))
            if new is None:
                new = wrap(child)
            if new is not child:
                swapped[id(child)] = new
                setattr(parent, name, new)
    return swapped


def set_ops(model: torch.nn.Module, ops) -> None:
    """Point the ``ops`` of every module of ``model`` that has them at ``ops`` (``None``: back
    to the class's own, the reference)."""
    for m in model.modules():
        if ops is None:
            m.__dict__.pop("ops", None)
        elif hasattr(type(m), "ops"):
            m.ops = ops


def restore_reference(model: torch.nn.Module) -> torch.nn.Module:
    """Undo any backend's install: the original modules and the reference ops."""
    swap_modules(model, lambda m: m.base if isinstance(m, KernelModule) else m)
    set_ops(model, None)
    for m in model.modules():
        m.__dict__.pop(STATE_KEY, None)
    return model
