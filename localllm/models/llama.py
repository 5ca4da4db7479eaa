"""The llama family (llama 2/3.x, SmolLM2, TinyLlama, Mistral-style, qwen2, qwen3) in plain torch.

The model sees only a flat batch: ``input_ids [T]``, ``positions [T]`` and
:class:`~localllm.kernels.attention.AttentionMetadata`; it knows nothing about requests.
"""

from __future__ import annotations

import torch
from torch import nn

from localllm.kernels.attention import AttentionMetadata, paged_attention, write_kv
from localllm.models.config import ModelConfig


class TorchOps:
    """The model's non-linear-layer math in plain torch: the default backend and the reference
    for the Triton kernels. Modules call ``self.ops.<op>``; ``localllm.kernels.install.use_triton``
    points ``ops`` at an object with the same methods (``localllm.kernels.triton_ops.TritonOps``).
    """

    name = "torch"

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        return (xf * weight).to(x.dtype)

    def add_rms_norm(self, x, residual, weight, eps) -> tuple[torch.Tensor, torch.Tensor]:
        """``(rms_norm(residual + x), residual + x)``."""
        h = residual + x
        return self.rms_norm(h, weight, eps), h

    def rope_write_kv(self, rope, positions, q, k, v, kv_cache, slot_mapping) -> torch.Tensor:
        """Rotate ``q`` and ``k``, write ``k``/``v`` into the cache; return the rotated ``q``."""
        q = rope(positions, q)
        k = rope(positions, k)
        write_kv(kv_cache, k, v, slot_mapping)
        return q

    def attention(self, q, kv_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        return paged_attention(q, kv_cache, meta, scale)

    def silu_mul(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return nn.functional.silu(gate) * up


TORCH_OPS = TorchOps()


class RMSNorm(nn.Module):
    ops = TORCH_OPS

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
    """RoPE with a precomputed cos/sin table; ``neox`` rotates halves, otherwise adjacent pairs."""

    def __init__(self, config: ModelConfig, freq_factors: torch.Tensor | None) -> None:
        super().__init__()
        self.rot_dim = config.rope_dim
        self.neox = config.rope_neox
        inv_freq = 1.0 / (
            config.rope_theta ** (torch.arange(0, self.rot_dim, 2, dtype=torch.float64) / self.rot_dim)
        )
        if freq_factors is not None:
            inv_freq = inv_freq / freq_factors.double()
        pos = torch.arange(config.max_position_embeddings, dtype=torch.float64)
        if config.rope_scaling.kind == "linear":
            pos = pos / config.rope_scaling.factor
        freqs = torch.outer(pos, inv_freq)
        self.register_buffer("cos", freqs.cos().float(), persistent=False)
        self.register_buffer("sin", freqs.sin().float(), persistent=False)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Rotate ``x [T, heads, head_dim]`` in place of a copy; returns the rotated tensor."""
        cos = self.cos[positions][:, None, :]
        sin = self.sin[positions][:, None, :]
        rot = x[..., : self.rot_dim].float()
        if self.neox:
            x1, x2 = rot.chunk(2, dim=-1)
            rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        else:
            x1, x2 = rot[..., 0::2], rot[..., 1::2]
            rotated = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
        if self.rot_dim == x.shape[-1]:
            return rotated.to(x.dtype)
        return torch.cat((rotated.to(x.dtype), x[..., self.rot_dim :]), dim=-1)


class Attention(nn.Module):
    ops = TORCH_OPS

    def __init__(self, config: ModelConfig, q_proj, k_proj, v_proj, o_proj, q_norm, k_norm, rope) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.scale = self.head_dim**-0.5
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = q_proj, k_proj, v_proj, o_proj
        self.q_norm, self.k_norm = q_norm, k_norm
        self.rope = rope

    def forward(self, positions, x, kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        T = x.shape[0]
        q = self.q_proj(x).view(T, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(T, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(T, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q = self.q_norm(q)
            k = self.k_norm(k)
        q = self.ops.rope_write_kv(self.rope, positions, q, k, v, kv_cache, meta.slot_mapping)
        o = self.ops.attention(q, kv_cache, meta, self.scale)
        return self.o_proj(o.reshape(T, self.num_heads * self.head_dim))


class MLP(nn.Module):
    ops = TORCH_OPS

    def __init__(self, gate_proj, up_proj, down_proj) -> None:
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = gate_proj, up_proj, down_proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.ops.silu_mul(self.gate_proj(x), self.up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, input_norm, attn, post_norm, mlp) -> None:
        super().__init__()
        self.input_norm, self.attn, self.post_norm, self.mlp = input_norm, attn, post_norm, mlp

    def forward(self, positions, h, kv_cache, meta) -> torch.Tensor:
        a = self.attn(positions, self.input_norm(h), kv_cache, meta)
        x, h = self.post_norm.forward_add(a, h)  # h = h + a; x = post_norm(h)
        return h + self.mlp(x)


class LlamaForCausalLM(nn.Module):
    """Decoder-only transformer; build it with :func:`localllm.models.loader.load_model`."""

    def __init__(self, config: ModelConfig, embed, layers: list[DecoderLayer], norm, lm_head, dtype) -> None:
        super().__init__()
        self.config = config
        self.embed = embed
        self.layers = nn.ModuleList(layers)
        self.norm = norm
        self.lm_head = lm_head
        self.dtype = dtype

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: list[torch.Tensor],
    ) -> torch.Tensor:
        """Hidden states ``[T, hidden]`` after the final norm; K/V of every token is written."""
        h = self.embed(input_ids).to(self.dtype)
        for layer, kv_cache in zip(self.layers, kv_caches):
            h = layer(positions, h, kv_cache, meta)
        return self.norm(h)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()
