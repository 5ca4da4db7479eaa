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
matrix) lives in a row of its layer's state buffer, ``[rows, state_size]`` float32, whose rows
:class:`StateBuffers` lays out: two per slot (a running sequence's), then the prefix-cache
checkpoints. ``meta.state_slots`` says per sequence of a step which row it reads, which it
writes and where it records the state after some of its tokens (:class:`StateStep`). A step
reads one of the slot's two rows and writes the other; :class:`StateBuffers` makes the written
one current once the step has succeeded, so a step that fails part way (and is run again) never
reads a state it half-advanced. Because the recurrence runs token by token, the state after any
of a step's tokens is there to copy as it passes: a checkpoint at a block boundary costs one
copy, and a step that verifies drafts keeps its inputs (``meta.state_replay``) so that the state
after its last accepted token can be computed again from the state it read (:meth:`GatedDeltaNet.replay`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import nn
from torch.nn import functional as F

from localllm.kernels.attention import AttentionMetadata
from localllm.kernels.torch_backend import REFERENCE
from localllm.models.config import LinearAttentionConfig, ModelConfig

L2_NORM_EPS = 1e-6  # transformers' l2norm of q and k (the FLA library's)



class StateStep(NamedTuple):
    """One sequence's recurrent state in a step (rows of each layer's state buffer)."""

    read: int  # the row its state before the step is read from; -1: it starts from zero (position 0)
    write: int  # the row its state after the step's last token is written to
    records: tuple[tuple[int, int], ...] = ()  # (n, row): the state after its first n tokens, copied to row


def state_buffer(config: ModelConfig, num_rows: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """One linear-attention layer's zeroed state buffer: ``[num_rows, state_size]`` float32
    (:attr:`StateBuffers.num_rows` rows)."""
    return torch.zeros(num_rows, config.linear_attention.state_size, dtype=torch.float32, device=device)


def state_bytes(config: ModelConfig) -> int:
    """Bytes of one sequence's recurrent state over all layers, one copy (0: no such layers): a
    prefix-cache checkpoint's; a slot holds two."""
    if config.linear_attention is None:
        return 0
    return config.num_linear_layers * config.linear_attention.state_size * 4


def state_bytes_per_slot(config: ModelConfig) -> int:
    """Bytes one running sequence's recurrent state takes over all layers, both buffers (0: no such layers)."""
    return 2 * state_bytes(config)


class StateBuffers:
    """The rows of each layer's state buffer: slot ``s``'s two buffers are rows ``2s`` and
    ``2s + 1`` (``current[s]`` says which holds its committed state), checkpoint ``c`` (the
    scheduler's :class:`~localllm.scheduler.state_slots.StateCheckpoints`) is row
    ``2 * num_slots + c``."""

    def __init__(self, num_slots: int, num_checkpoints: int = 0) -> None:
        self.num_slots = num_slots
        self.num_checkpoints = num_checkpoints
        self.current = [0] * num_slots

    @property
    def num_rows(self) -> int:
        return 2 * self.num_slots + self.num_checkpoints

    def checkpoint_row(self, checkpoint: int) -> int:
        assert 0 <= checkpoint < self.num_checkpoints, f"no checkpoint {checkpoint}"
        return 2 * self.num_slots + checkpoint

    def step(self, slot: int, fresh: bool = False, checkpoint: int = -1,
             records: Sequence[tuple[int, int]] = ()) -> StateStep:
        """Slot ``slot``'s sequence in a step: its state starts from zero (``fresh``), from
        ``checkpoint``, or from its slot's committed row; it goes to the slot's other row, and
        after its first ``n`` tokens of the step to checkpoint ``c`` for each ``(n, c)`` of ``records``."""
        if fresh:
            read = -1
        elif checkpoint >= 0:
            read = self.checkpoint_row(checkpoint)
        else:
            read = 2 * slot + self.current[slot]
        return StateStep(read, 2 * slot + 1 - self.current[slot],
                         tuple((n, self.checkpoint_row(c)) for n, c in records))

    def commit(self, steps: Sequence[StateStep]) -> None:
        """The step succeeded: the rows it wrote become its slots' state."""
        for step in steps:
            self.current[step.write // 2] = step.write % 2


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

    def _advance(self, qkv, b, a, conv, delta) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One token through the recurrence: ``(its query [value heads, key_head_dim], conv state,
        delta state)`` from the states before it."""
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
        return q, window[:, 1:], delta

    def _token(self, qkv, z, b, a, conv, delta) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One token: ``(output [value_size], conv state, delta state)`` from the states before it."""
        q, conv, delta = self._advance(qkv, b, a, conv, delta)
        o = torch.bmm(q[:, None, :], delta)[:, 0]
        normed = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + self.eps) * self.norm_weight
        out = normed * F.silu(z.view(self.la.num_value_heads, -1))
        return out.reshape(-1), conv, delta

    def _initial(self, cache, meta: AttentionMetadata, seq: int, num_tokens: int):
        """Sequence ``seq``'s ``(conv, delta)`` states before its tokens of this step."""
        steps = meta.state_slots
        if steps is None or steps[seq].read < 0:
            if meta.context_lens_host[seq] != num_tokens:
                raise ValueError("a linear-attention layer needs the recurrent state of a sequence that "
                                 "does not start at position 0 in this step")
            return self._zero_state()
        return self._state_in(cache[steps[seq].read])

    def _zero_state(self) -> tuple[torch.Tensor, torch.Tensor]:
        la, device = self.la, self.conv_weight.device
        return (torch.zeros(la.conv_channels, la.conv_kernel - 1, device=device),
                torch.zeros(la.num_value_heads, la.key_head_dim, la.value_head_dim, device=device))

    def _state_in(self, row: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A state buffer's row as ``(conv, delta)`` views."""
        la = self.la
        split = la.conv_channels * (la.conv_kernel - 1)
        return (row[:split].view(la.conv_channels, -1),
                row[split:].view(la.num_value_heads, la.key_head_dim, la.value_head_dim))

    def _store(self, row: torch.Tensor, conv: torch.Tensor, delta: torch.Tensor) -> None:
        split = self.la.conv_channels * (self.la.conv_kernel - 1)
        row[:split].copy_(conv.reshape(-1))
        row[split:].copy_(delta.reshape(-1))

    def forward(self, positions, x: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """``x [T, hidden]`` of the step's sequences (``meta``'s layout) -> ``[T, hidden]``; each
        sequence's state is read from and written into the rows of ``cache`` (this layer's state
        buffer) that ``meta.state_slots`` names, and recorded after the tokens it asks for, or
        starts from zero and is dropped where ``meta.state_slots`` is None. Where
        ``meta.state_replay`` is a list, the step's inputs to the recurrence are appended to it
        (for :meth:`replay`)."""
        qkv, z, b, a = self._projections(x, meta)
        out = torch.empty(x.shape[0], self.la.value_size, dtype=torch.float32, device=x.device)
        starts = meta.query_start_loc
        steps = meta.state_slots
        for seq in range(meta.num_seqs):
            lo, hi = starts[seq], starts[seq + 1]
            conv, delta = self._initial(cache, meta, seq, hi - lo)
            records = dict(steps[seq].records) if steps is not None else {}
            for t in range(lo, hi):
                out[t], conv, delta = self._token(qkv[t], z[t], b[t], a[t], conv, delta)
                row = records.get(t - lo + 1)
                if row is not None:  # a checkpoint at a block boundary: the state as it passes
                    self._store(cache[row], conv, delta)
            if steps is not None:
                self._store(cache[steps[seq].write], conv, delta)
        if meta.state_replay is not None:
            meta.state_replay.append((self, cache, qkv, b, a))
        return self.ops.linear(self.out_proj, out.to(x.dtype), meta)

    def replay(self, cache: torch.Tensor, meta: AttentionMetadata, seq: int, num_tokens: int,
               qkv: torch.Tensor, b: torch.Tensor, a: torch.Tensor) -> None:
        """Write into sequence ``seq``'s written row the state after only its first ``num_tokens``
        tokens of the step (``qkv``, ``b``, ``a``: the step's inputs that :meth:`forward` kept),
        from the state it read: the same arithmetic token by token, so the same bits as a step
        that had run just those tokens. For a step that verified drafts and kept fewer."""
        step = meta.state_slots[seq]
        lo = meta.query_start_loc[seq]
        conv, delta = self._zero_state() if step.read < 0 else self._state_in(cache[step.read])
        for t in range(lo, lo + num_tokens):
            _, conv, delta = self._advance(qkv[t], b[t], a[t], conv, delta)
        self._store(cache[step.write], conv, delta)
