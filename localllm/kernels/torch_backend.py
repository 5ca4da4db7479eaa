"""The pure-torch backend: the reference every other backend is tested against.

A freshly loaded model runs on it (its modules' ``ops`` default to :data:`REFERENCE`, its
linears are the quantized modules' own dequantize-then-matmul). ``kernels="torch"`` (or
``LOCALLLM_CPU_FAST=0`` on a CPU) selects it for an engine.
"""

from __future__ import annotations

import torch
from torch import nn

from localllm.kernels.attention import AttentionMetadata, paged_attention, write_kv
from localllm.kernels.backend import restore_reference, zeroed_kv_cache


class TorchBackend:
    """The model's math in plain torch (see :class:`~localllm.kernels.backend.Backend`)."""

    name = "torch"
    supports_cuda_graphs = False  # the reference attention reads host-side lists a replay cannot change
    cuda_graphs = False
    kv_cache_matches_model_dtype = False
    batch_invariant = False  # torch's float32 GEMMs and attention pick their blocking by shape

    def kv_cache_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        return model_dtype

    def kv_cache(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return zeroed_kv_cache(shape, dtype, device)

    def greedy_rows(self, logits: torch.Tensor) -> tuple[list[int], list[bool]] | None:
        return None

    def decode_splits(self, num_seqs: int, num_kv_heads: int, max_context: int, device: torch.device) -> int:
        return 1

    def install(self, model: nn.Module) -> nn.Module:
        return restore_reference(model)

    def held_bytes(self, model: nn.Module) -> int:
        return 0

    def linear(self, module: nn.Module, x: torch.Tensor, meta: AttentionMetadata | None = None) -> torch.Tensor:
        return module(x)

    def fused_linear(self, modules, x: torch.Tensor, meta: AttentionMetadata | None = None) -> torch.Tensor | None:
        return None

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """``x / sqrt(mean(x**2) + eps) * weight``, computed in float32."""
        out = nn.functional.rms_norm(x.float(), (x.shape[-1],), weight.float(), eps)
        return out if out.dtype == x.dtype else out.to(x.dtype)

    def add_rms_norm(self, x, residual, weight, eps) -> tuple[torch.Tensor, torch.Tensor]:
        """``(rms_norm(residual + x), residual + x)``."""
        h = residual + x
        return self.rms_norm(h, weight, eps), h

    def rope_write_kv(self, rope, positions, q, k, v, kv_cache, slot_mapping) -> torch.Tensor:
        """Rotate ``q`` and ``k``, write ``k``/``v`` into the cache; return the rotated ``q``
        (``rope`` None: ``q`` and ``k`` as they are)."""
        if rope is not None:
            q = rope(positions, q)
            k = rope(positions, k)
        write_kv(kv_cache, k, v, slot_mapping)
        return q

    def attention(self, q, kv_cache, meta: AttentionMetadata, scale: float, **features) -> torch.Tensor:
        """``features``: KernelBackend.attention's ``sliding_window``, ``logit_softcap`` and ``sinks``."""
        return paged_attention(q, kv_cache, meta, scale, **features)

    def silu_mul(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return nn.functional.silu(gate).mul_(up)

    def gelu_tanh_mul(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return nn.functional.gelu(gate, approximate="tanh").mul_(up)

    def swiglu_oai_mul(self, gate: torch.Tensor, up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
        """As transformers' ``GptOssExperts._apply_gate``: the clamps, ``glu = g * sigmoid(g * alpha)``,
        then ``(u + 1) * glu``."""
        g = gate.clamp(max=limit)
        u = up.clamp(min=-limit, max=limit)
        return (u + 1).mul_(g * torch.sigmoid(g * alpha))

    def decoder_layer(self, layer, positions, h, kv_cache, meta) -> torch.Tensor | None:
        """A whole layer in one go, or ``None``: then the layer runs op by op (always, here)."""
        return None

    def moe_route(self, moe, x) -> tuple[torch.Tensor, torch.Tensor] | None:
        """A mixture of experts' routing, or ``None``: then the model routes with torch (always, here)."""
        return None

    def moe_experts(self, moe, x, weights, chosen) -> torch.Tensor | None:
        """A mixture of experts' experts in one go, or ``None``: then they run one by one (always, here)."""
        return None

    def decoder_layers(self, layers, positions, h, kv_caches, meta, norm=None) -> torch.Tensor | None:
        """Every layer in one go, or ``None``: then they run one by one (always, here)."""
        return None


REFERENCE = TorchBackend()
"""The reference backend: the default ``ops`` of the models' modules."""
