"""GPTQ weights: the packed checkpoint layout, a pure-torch dequantizer, and ``GPTQLinear``.

The layout is the one AutoGPTQ, GPTQModel, optimum and transformers read and write. For one
linear with ``K`` inputs, ``N`` outputs, ``bits`` per weight and ``G = ceil(K / group_size)``
groups (``G = 1`` for ``group_size = -1``):

==========  ==========================  ==================================================
tensor      dtype, shape                holds
==========  ==========================  ==================================================
qweight     int32 ``[K*bits/32, N]``    the quantized weights, packed along the *input* dim
qzeros      int32 ``[G, ceil(N*bits/32)]`` one zero point per group and output, packed along
                                        the *output* dim
scales      float16 ``[G, N]``          one scale per group and output
g_idx       int32 ``[K]``               group of each input (``k // group_size`` unless the
                                        checkpoint was quantized in act-order, ``desc_act``)
bias        float16 ``[N]``, optional
==========  ==========================  ==================================================

Packing: a column of ``qweight`` (a row of ``qzeros``) is a little-endian bit stream of
``bits``-wide unsigned values. Value ``j`` takes bits ``j*bits .. j*bits + bits - 1`` of the
stream, and bit ``b`` of the stream is bit ``b % 32`` of int32 word ``b // 32``. For 2, 4 and 8
bits a word holds ``32 / bits`` whole values, lowest bits first; 3-bit values straddle words
(32 values in 3 words).

Dequantization: ``W[n, k] = scales[g, n] * (q[k, n] - z[g, n])`` with ``g = g_idx[k]``, where
``z`` is the stored zero plus one in ``checkpoint_format = "gptq"`` (v1: quantizers store
``zero - 1``) and the stored zero itself in ``"gptq_v2"``. ``sym`` only matters when quantizing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from localllm.errors import ModelLoadError

SUPPORTED_BITS = (2, 3, 4, 8)
CHECKPOINT_FORMATS = ("gptq", "gptq_v2")

# Upper bound on the float32 temporary one chunk of dequantized rows may take.
MAX_CHUNK_BYTES = 32 * 1024 * 1024

_MASK32 = 0xFFFFFFFF


def num_groups(in_features: int, group_size: int) -> int:
    return 1 if group_size == -1 else math.ceil(in_features / group_size)


def zero_offset(checkpoint_format: str) -> int:
    """What to add to a stored zero point: 1 for v1 (``"gptq"``), 0 for ``"gptq_v2"``."""
    return 1 if checkpoint_format == "gptq" else 0


def unpack_rows(packed: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """The first ``count`` ``bits``-wide values of each column's bit stream, as int32 ``[count, M]``.

    ``packed`` is int32 ``[words, M]``; see the module docstring for the stream layout.
    """
    if bits in (2, 4, 8):
        per_word = 32 // bits
        shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=packed.device).view(1, per_word, 1)
        # Arithmetic shifts of negative words sign-extend; the mask drops those bits.
        values = (packed.unsqueeze(1) >> shifts) & ((1 << bits) - 1)
        return values.reshape(-1, packed.shape[1])[:count]
    words = packed.to(torch.int64) & _MASK32
    words = torch.cat([words, words.new_zeros(1, words.shape[1])])
    start = torch.arange(count, device=packed.device) * bits
    index, shift = start // 32, (start % 32).unsqueeze(1)
    lo, hi = words[index], words[index + 1]
    values = ((lo >> shift) | (hi << (32 - shift))) & ((1 << bits) - 1)
    return values.to(torch.int32)


def pack_rows(values: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack ``values`` (ints in ``[0, 2**bits)``, ``[count, M]``) along dim 0: int32 ``[ceil(count*bits/32), M]``."""
    count, m = values.shape
    num_words = math.ceil(count * bits / 32)
    v = values.to(torch.int64)
    start = torch.arange(count, device=values.device) * bits
    index, shift = start // 32, start % 32
    out = torch.zeros(num_words + 1, m, dtype=torch.int64, device=values.device)
    # The fields are disjoint bit ranges, so adding them is OR-ing them.
    out.index_add_(0, index, (v << shift.unsqueeze(1)) & _MASK32)
    spill = shift + bits > 32
    if bool(spill.any()):
        out.index_add_(0, index[spill] + 1, v[spill] >> (32 - shift[spill]).unsqueeze(1))
    out = out[:num_words]
    return torch.where(out >= 1 << 31, out - (1 << 32), out).to(torch.int32)


@dataclass(slots=True)
class GPTQWeight:
    """The packed tensors of one GPTQ linear and how to read them (see the module docstring)."""

    qweight: torch.Tensor
    qzeros: torch.Tensor
    scales: torch.Tensor
    g_idx: torch.Tensor | None
    bits: int
    group_size: int
    in_features: int
    out_features: int
    checkpoint_format: str = "gptq"

    @property
    def num_groups(self) -> int:
        return num_groups(self.in_features, self.group_size)

    def validate(self, name: str = "<gptq>") -> None:
        """Raise ModelLoadError naming ``name`` if any tensor's dtype or shape is wrong."""
        k, n, bits = self.in_features, self.out_features, self.bits
        if bits not in SUPPORTED_BITS:
            raise ModelLoadError(f"'{name}': GPTQ with {bits} bits is not supported (supported: 2, 3, 4, 8)")
        if self.checkpoint_format not in CHECKPOINT_FORMATS:
            raise ModelLoadError(
                f"'{name}': GPTQ checkpoint_format {self.checkpoint_format!r} is not supported "
                f"(supported: {', '.join(CHECKPOINT_FORMATS)})"
            )
        if self.group_size != -1 and self.group_size <= 0:
            raise ModelLoadError(f"'{name}': GPTQ group_size must be positive or -1, got {self.group_size}")
        if (k * bits) % 32:
            raise ModelLoadError(f"'{name}': {k} inputs of {bits} bits are not a whole number of int32 words")
        g = self.num_groups
        expected = {
            "qweight": (self.qweight, (k * bits // 32, n), (torch.int32,)),
            "qzeros": (self.qzeros, (g, math.ceil(n * bits / 32)), (torch.int32,)),
            "scales": (self.scales, (g, n), (torch.float16, torch.bfloat16, torch.float32)),
        }
        if self.g_idx is not None:
            expected["g_idx"] = (self.g_idx, (k,), (torch.int32, torch.int64))
        for part, (t, shape, dtypes) in expected.items():
            if tuple(t.shape) != shape:
                raise ModelLoadError(
                    f"'{name}.{part}' has shape {tuple(t.shape)}, expected {shape} for a {bits}-bit GPTQ "
                    f"linear with {k} inputs, {n} outputs and group_size {self.group_size}"
                )
            if t.dtype not in dtypes:
                raise ModelLoadError(f"'{name}.{part}' has dtype {t.dtype}, expected one of {dtypes}")
        if self.g_idx is not None and k:
            lo, hi = int(self.g_idx.min()), int(self.g_idx.max())
            if lo < 0 or hi >= g:
                raise ModelLoadError(f"'{name}.g_idx' holds groups {lo}..{hi}, outside 0..{g - 1}")

    def group_index(self) -> torch.Tensor:
        """``g_idx`` as int64 (``k // group_size`` when the checkpoint has none)."""
        if self.g_idx is not None:
            return self.g_idx.to(torch.int64)
        g = self.in_features if self.group_size == -1 else self.group_size
        return torch.arange(self.in_features, device=self.qweight.device) // g

    def zeros(self) -> torch.Tensor:
        """Effective zero points, int32 ``[G, N]`` (the v1 offset applied)."""
        stored = unpack_rows(self.qzeros.t().contiguous(), self.bits, self.out_features).t()
        return stored + zero_offset(self.checkpoint_format)

    def intweight(self, start: int = 0, end: int | None = None) -> torch.Tensor:
        """Quantized values of outputs ``start:end``, int32 ``[K, end - start]``."""
        return unpack_rows(self.qweight[:, start:end], self.bits, self.in_features)


def dequantize_gptq(w: GPTQWeight) -> torch.Tensor:
    """The float32 weight ``[N, K]`` (``torch.nn.Linear`` layout) of ``w``: the reference."""
    g_idx = w.group_index()
    scales = w.scales.float()[g_idx]  # [K, N]
    zeros = w.zeros().float()[g_idx]
    return ((w.intweight().float() - zeros) * scales).t().contiguous()


class GPTQLinear(torch.nn.Module):
    """``y = x @ W.T + b`` with ``W`` kept packed in the GPTQ layout.

    Same interface as :class:`localllm.quant.linear.QuantLinear`. A matmul dequantizes
    ``chunk_rows`` output rows of ``W`` at a time, so no full float32 copy is ever held.
    """

    def __init__(
        self,
        weight: GPTQWeight,
        bias: torch.Tensor | None = None,
        *,
        name: str = "<gptq>",
        chunk_rows: int | None = None,
    ) -> None:
        super().__init__()
        weight.validate(name)
        self.bits = weight.bits
        self.group_size = weight.group_size
        self.checkpoint_format = weight.checkpoint_format
        self.in_features = weight.in_features
        self.out_features = weight.out_features
        self.chunk_rows = chunk_rows or max(1, min(8192, MAX_CHUNK_BYTES // (4 * max(1, self.in_features))))
        if bias is not None and tuple(bias.shape) != (self.out_features,):
            raise ModelLoadError(f"'{name}.bias' has shape {tuple(bias.shape)}, expected ({self.out_features},)")
        self.register_buffer("qweight", weight.qweight, persistent=False)
        self.register_buffer("qzeros", weight.qzeros, persistent=False)
        self.register_buffer("scales", weight.scales, persistent=False)
        self.register_buffer("g_idx", weight.g_idx, persistent=False)
        self.register_buffer("bias", bias, persistent=False)
        # Small per-group tables, unpacked once: [G, N] each.
        self.register_buffer("zeros_f", weight.zeros().float(), persistent=False)
        self.register_buffer("scales_f", weight.scales.float(), persistent=False)
        self.register_buffer("group_of", weight.group_index(), persistent=False)

    @property
    def weight(self) -> GPTQWeight:
        return GPTQWeight(
            self.qweight, self.qzeros, self.scales, self.g_idx, self.bits, self.group_size,
            self.in_features, self.out_features, self.checkpoint_format,
        )

    def dequantize(self) -> torch.Tensor:
        """The float32 weight ``[N, K]``."""
        return dequantize_gptq(self.weight)

    def _dequant_t(self, start: int, end: int) -> torch.Tensor:
        """Float32 ``W[start:end].T``, i.e. ``[K, end - start]``."""
        q = unpack_rows(self.qweight[:, start:end], self.bits, self.in_features)
        g = self.group_of
        return (q.float() - self.zeros_f[:, start:end][g]) * self.scales_f[:, start:end][g]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The one dispatch point: a faster backend replaces this call, while
        # reference_forward stays the definition it is tested against.
        return self.reference_forward(x)

    def reference_forward(self, x: torch.Tensor) -> torch.Tensor:
        """Dequantize-then-matmul, chunked over output rows."""
        n = self.out_features
        x2 = x.reshape(-1, x.shape[-1])
        out = x2.new_empty(x2.shape[0], n)
        for start in range(0, n, self.chunk_rows):
            end = min(start + self.chunk_rows, n)
            out[:, start:end] = x2 @ self._dequant_t(start, end).to(x.dtype)
        if self.bias is not None:
            out += self.bias.to(x.dtype)
        return out.reshape(*x.shape[:-1], n)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bits={self.bits}, "
            f"group_size={self.group_size}, act_order={self.g_idx is not None and not self._trivial_g_idx()}, "
            f"format={self.checkpoint_format}, bias={self.bias is not None}"
        )

    def _trivial_g_idx(self) -> bool:
        g = self.in_features if self.group_size == -1 else self.group_size
        expected = torch.arange(self.in_features, device=self.group_of.device) // g
        return bool(torch.equal(self.group_of, expected))


def group_order(linear: GPTQLinear) -> torch.Tensor | None:
    """The permutation that puts ``linear``'s inputs in group order (act-order's, a stable sort of
    ``g_idx``), ``None`` when they already are."""
    g = linear.group_of
    if bool((g[1:] >= g[:-1]).all()):
        return None
    return torch.sort(g, stable=True).indices


def _renumbered(linear: GPTQLinear, weight: GPTQWeight, bias: torch.Tensor | None) -> GPTQLinear:
    return GPTQLinear(weight, bias, chunk_rows=linear.chunk_rows)


def renumber_outputs(linear: GPTQLinear, order: torch.Tensor) -> GPTQLinear:
    """The same linear with its outputs renumbered: output ``j`` of the result is output ``order[j]``
    of ``linear``, exactly (qweight's and the scales' columns, the zero points repacked, the bias)."""
    w = linear.weight
    stored = unpack_rows(w.qzeros.t().contiguous(), w.bits, w.out_features)  # [N, G], as stored
    qzeros = pack_rows(stored[order], w.bits).t().contiguous()
    weight = GPTQWeight(w.qweight[:, order].contiguous(), qzeros, w.scales[:, order].contiguous(), w.g_idx,
                        w.bits, w.group_size, w.in_features, w.out_features, w.checkpoint_format)
    return _renumbered(linear, weight, None if linear.bias is None else linear.bias[order].contiguous())


def renumber_inputs(linear: GPTQLinear, order: torch.Tensor) -> GPTQLinear:
    """The same linear reading its inputs renumbered: input ``j`` of the result is input ``order[j]``
    of ``linear``, exactly (qweight's rows repacked, ``g_idx`` permuted with them)."""
    w = linear.weight
    qweight = pack_rows(w.intweight()[order], w.bits)
    g_idx = w.group_index()[order].to(torch.int32)
    weight = GPTQWeight(qweight, w.qzeros, w.scales, g_idx, w.bits, w.group_size, w.in_features,
                        w.out_features, w.checkpoint_format)
    return _renumbered(linear, weight, linear.bias)


def fold_down_order(gate: torch.nn.Module, up: torch.nn.Module, down: torch.nn.Module):
    """A gated MLP's ``(gate, up, down)`` with act-order's input permutation of ``down`` folded into
    ``gate`` and ``up``: the intermediate neurons renumbered in ``down``'s group order (the outputs
    of gate and up, the inputs of down, each permuted the same way), the same function of the input,
    whose ``down`` then reads its input as it comes (no gather per call). As given unless all three
    are GPTQ linears and ``down`` is in act-order."""
    if not all(isinstance(m, GPTQLinear) for m in (gate, up, down)):
        return gate, up, down
    order = group_order(down)
    if order is None:
        return gate, up, down
    return renumber_outputs(gate, order), renumber_outputs(up, order), renumber_inputs(down, order)
