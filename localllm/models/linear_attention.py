"""Gated DeltaNet: the linear-attention layers of hybrid models (Qwen3-Next, Qwen3.5), and their
per-sequence recurrent state.

A layer (transformers' ``Qwen3NextGatedDeltaNet`` with its torch fallbacks, llama.cpp's
``build_layer_attn_linear``), for each token ``x`` of a sequence::

    qkv, z, b, a = projections of x                 (qkv: queries, keys, values; z: the output gate)
    qkv = silu(causal depthwise conv1d(qkv))        (conv_kernel taps over the sequence)
    q, k = l2-normalized per key head (q times key_head_dim ** -0.5), each serving its value heads
    beta = sigmoid(b);  decay = exp(-exp(A_log) * softplus(a + dt_bias))        (per value head)
    S = S * decay;  S = S + k (beta * (v - S^T k))^T;  o = S^T q                (S: [key, value])
    out = out_proj(rms_norm(o) * norm_weight * silu(z))                        (norm per value head)

The recurrence runs token by token (transformers' ``torch_recurrent_gated_delta_rule``): a
sequence's state after a token has the same bits however its tokens were cut into steps, and a
token's arithmetic has fixed shapes whatever else its step holds, so the layer is batch-invariant
(docs/architecture.md) given batch-invariant linears.

The state of a sequence (:class:`~localllm.models.config.LinearAttentionConfig.state_size`
floats per layer: the convolution's last ``conv_kernel - 1`` inputs, then the delta rule's
matrix) lives in its layer's state buffer, ``[2, slots, state_size]`` float32, in the slot its
scheduler gave it; ``meta.state_slots`` says per sequence ``(slot, buffer read, starts fresh)``.
A step reads one of the slot's two buffers and writes the other; :class:`StateBuffers` makes the
written one current once the step has succeeded, so a step that fails part way (and is run
again) never reads a state it half-advanced.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from torch.nn import functional as F

from localllm.kernels.attention import AttentionMetadata
from localllm.kernels.torch_backend import REFERENCE
from localllm.models.config import LinearAttentionConfig, ModelConfig

L2_NORM_EPS = 1e-6  # transformers' l2norm of q and k (the FLA library's)

StepSlots = list[tuple[int, int, bool]]
"""Per sequence of a step: ``(slot, buffer it reads, starts fresh)`` (see ``AttentionMetadata.state_slots``)."""


def state_buffer(config: ModelConfig, num_slots: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """One linear-attention layer's zeroed state buffer: ``[2, num_slots, state_size]`` float32."""
    return torch.zeros(2, num_slots, config.linear_attention.state_size, dtype=torch.float32, device=device)


def state_bytes_per_slot(config: ModelConfig) -> int:
    """Bytes one sequence's recurrent state takes over all layers, both buffers (0: no such layers)."""
    if config.linear_attention is None:
        return 0
    return 2 * config.num_linear_layers * config.linear_attention.state_size * 4


class StateBuffers:
    """Which of each slot's two buffers holds its committed state."""

    def __init__(self, num_slots: int) -> None:
        self.current = [0] * num_slots

    def step(self, entries: Sequence[tuple[int, bool]]) -> StepSlots:
        """The step's ``state_slots`` for sequences ``(slot, starts fresh)``, in the step's order."""
        return [(slot, self.current[slot], fresh) for slot, fresh in entries]

    def commit(self, step: StepSlots) -> None:
        """The step succeeded: the buffers it wrote become its slots' state."""
        for slot, read, _ in step:
            self.current[slot] = 1 - read


class GatedDeltaNet(nn.Module):
    """A Gated DeltaNet layer over its file's projections: ``qkvz`` (Qwen3-Next's Hugging Face
    ``in_proj_qkvz``, GGUF ``ssm_in``: per key head its q, k, v, z rows) or ``qkv`` and ``z``;
    ``ba`` (``in_proj_ba``, ``ssm_ba``: per key head its b rows, then its a rows) or ``b`` and
    ``a``. ``conv_weight [channels, conv_kernel]``, ``dt_bias`` and ``neg_a`` (``-exp(A_log)``,
    as GGUF ``ssm_a`` holds it) per value head, ``norm_weight [value_head_dim]``."""

    ops = REFERENCE

    def __init__(self, config: ModelConfig, projections: dict[str, nn.Module], conv_weight: torch.Tensor,
                 dt_bias: torch.Tensor, neg_a: torch.Tensor, norm_weight: torch.Tensor, out_proj: nn.Module) -> None:
        super().__init__()
        la: LinearAttentionConfig = config.linear_attention
        self.la = la
        self.eps = config.rms_norm_eps
        self.group = la.num_value_heads // la.num_key_heads
        self.scale = la.key_head_dim ** -0.5
        for name in ("qkvz", "qkv", "z", "ba", "b", "a"):
            setattr(self, f"in_{name}", projections.get(name))
        if (self.in_qkvz is None) == (self.in_qkv is None or self.in_z is None):
            raise ValueError("a Gated DeltaNet layer needs qkvz, or qkv and z")
        if (self.in_ba is None) == (self.in_b is None or self.in_a is None):
            raise ValueError("a Gated DeltaNet layer needs ba, or b and a")
        self.conv_weight = nn.Parameter(conv_weight.float(), requires_grad=False)
        self.dt_bias = nn.Parameter(dt_bias.float(), requires_grad=False)
        self.neg_a = nn.Parameter(neg_a.float(), requires_grad=False)
        self.norm_weight = nn.Parameter(norm_weight.float(), requires_grad=False)
        self.out_proj = out_proj

    def _projections(self, x: torch.Tensor, meta) -> tuple[torch.Tensor, ...]:
        """``(qkv [T, channels], z [T, value_size], b [T, value heads], a [T, value heads])`` float32,
        value heads in the file's order."""
        la, ops, T = self.la, self.ops, x.shape[0]
        if self.in_qkvz is not None:
            values = self.group * la.value_head_dim  # of one key head
            q, k, v, z = ops.linear(self.in_qkvz, x, meta).float().view(T, la.num_key_heads, -1).split(
                (la.key_head_dim, la.key_head_dim, values, values), dim=-1)
            qkv = torch.cat((q.reshape(T, -1), k.reshape(T, -1), v.reshape(T, -1)), dim=-1)
            z = z.reshape(T, -1)
        else:
            qkv, z = ops.linear(self.in_qkv, x, meta).float(), ops.linear(self.in_z, x, meta).float()
        if self.in_ba is not None:
            b, a = ops.linear(self.in_ba, x, meta).float().view(T, la.num_key_heads, -1).split(self.group, dim=-1)
            b, a = b.reshape(T, -1), a.reshape(T, -1)
        else:
            b, a = ops.linear(self.in_b, x, meta).float(), ops.linear(self.in_a, x, meta).float()
        return qkv, z, b, a

    def _key_heads(self, t: torch.Tensor) -> torch.Tensor:
        """``[key heads, d]`` -> ``[value heads, d]``: each value head's key head."""
        if self.group == 1:
            return t
        return t.repeat(self.group, 1) if self.la.value_heads_tiled else t.repeat_interleave(self.group, dim=0)

    def _token(self, qkv, z, b, a, conv, delta) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One token: ``(output [value_size], conv state, delta state)`` from the states before it."""
        la = self.la
        window = torch.cat((conv, qkv[:, None]), dim=1)  # [channels, conv_kernel], oldest input first
        mixed = F.silu((window * self.conv_weight).sum(-1))
        q, k, v = mixed.split((la.key_size, la.key_size, la.value_size))
        q = q.view(la.num_key_heads, -1)
        k = k.view(la.num_key_heads, -1)
        q = self._key_heads(q * torch.rsqrt((q * q).sum(-1, keepdim=True) + L2_NORM_EPS) * self.scale)
        k = self._key_heads(k * torch.rsqrt((k * k).sum(-1, keepdim=True) + L2_NORM_EPS))
        v = v.view(la.num_value_heads, -1)
        beta = torch.sigmoid(b)
        decay = torch.exp(self.neg_a * F.softplus(a + self.dt_bias))
        delta = delta * decay[:, None, None]
        remembered = torch.bmm(k[:, None, :], delta)[:, 0]  # [value heads, value_head_dim]: S^T k
        update = (v - remembered) * beta[:, None]
        delta = torch.baddbmm(delta, k[:, :, None], update[:, None, :])
        o = torch.bmm(q[:, None, :], delta)[:, 0]
        normed = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + self.eps) * self.norm_weight
        out = normed * F.silu(z.view(la.num_value_heads, -1))
        return out.reshape(-1), window[:, 1:], delta

    def _initial(self, cache, meta: AttentionMetadata, seq: int, num_tokens: int):
        """Sequence ``seq``'s ``(conv, delta)`` states before its tokens of this step."""
        la = self.la
        slots = meta.state_slots
        fresh = slots is None or slots[seq][2]
        if fresh:
            if meta.context_lens_host[seq] != num_tokens:
                raise ValueError("a linear-attention layer needs the recurrent state of a sequence that "
                                 "does not start at position 0 in this step")
            device = self.conv_weight.device
            return (torch.zeros(la.conv_channels, la.conv_kernel - 1, device=device),
                    torch.zeros(la.num_value_heads, la.key_head_dim, la.value_head_dim, device=device))
        slot, read, _ = slots[seq]
        split = la.conv_channels * (la.conv_kernel - 1)
        state = cache[read, slot]
        return (state[:split].view(la.conv_channels, -1),
                state[split:].view(la.num_value_heads, la.key_head_dim, la.value_head_dim))

    def forward(self, positions, x: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """``x [T, hidden]`` of the step's sequences (``meta``'s layout) -> ``[T, hidden]``; each
        sequence's state is read from and written into its slot of ``cache`` (this layer's state
        buffer), or starts from zero and is dropped where ``meta.state_slots`` is None."""
        qkv, z, b, a = self._projections(x, meta)
        out = torch.empty(x.shape[0], self.la.value_size, dtype=torch.float32, device=x.device)
        starts = meta.query_start_loc
        split = self.la.conv_channels * (self.la.conv_kernel - 1)
        for seq in range(meta.num_seqs):
            lo, hi = starts[seq], starts[seq + 1]
            conv, delta = self._initial(cache, meta, seq, hi - lo)
            for t in range(lo, hi):
                out[t], conv, delta = self._token(qkv[t], z[t], b[t], a[t], conv, delta)
            if meta.state_slots is not None:
                slot, read, _ = meta.state_slots[seq]
                written = cache[1 - read, slot]
                written[:split].copy_(conv.reshape(-1))
                written[split:].copy_(delta.reshape(-1))
        return self.ops.linear(self.out_proj, out.to(x.dtype), meta)
