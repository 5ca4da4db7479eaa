"""GPTQ linears on the CPU backend's native route: repacked once, at install, into the native
kernel's tiles (:mod:`localllm.kernels.cpu.native`), the same integer kernels as GGUF weights.

A GPTQ weight is ``W[n, k] = s[g(k), n] * (q[k, n] - z[g(k), n])`` (``g = g_idx``; see
:mod:`localllm.quant.gptq.layout`). The native layout wants one affine map per output row and
32 consecutive inputs, so:

* **act-order** (``g_idx`` not ``k // group_size``) is a fixed permutation of the inputs:
  the weight's columns are put in group order at load (``perm``, a stable sort of ``g_idx``)
  and the activation is gathered the same way once per call (one gather for q/k/v, one for
  gate/up, which share their input and, quantized from the same Hessian, their order); the down
  projection's order is folded into gate and up at load
  (:func:`~localllm.quant.gptq.layout.fold_down_order`), so its input needs no gather;
* every run of 32 columns must then lie in one group: ``group_size`` a multiple of 32 (or
  ``-1``, one group per row), ``in_features`` a multiple of 32; otherwise the linear stays on
  the reference (``GPTQLinear.reference_forward``);
* **2, 3 and 4 bits** become 4-bit codes ``u = q`` with ``d = s`` and ``z = -s * zero`` (the
  zero point folded into the offset, stored as float16 like the kernel's scales: an error of at
  most 2**-12 of ``s * zero`` per weight, counted in the route's error bound, ``max_scale_error``);
* **8 bits** become 8-bit codes ``u = q - zero + 128`` with ``d = s`` (exact; symmetric
  checkpoints have ``zero = 128``); a weight whose codes would leave ``[0, 255]`` stays on
  the reference.

Rows are not fused across linears of different bits, inputs or orders. The float32 reference
(``GPTQLinear.reference_forward``) stays the definition ``tests/kernels/test_gptq_cpu.py`` compares
against.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from localllm.kernels.attention import AttentionMetadata
from localllm.kernels.backend import KernelModule
from localllm.kernels.cpu import native
from localllm.kernels.cpu.fields import GROUP
from localllm.kernels.cpu.matmul import _fast_input, matmul
from localllm.kernels.cpu.options import CpuOptions
from localllm.kernels.cpu.weights import UNSUPPORTED, NativeWeight
from localllm.quant.gptq.layout import GPTQLinear, group_order, unpack_rows


@dataclass(slots=True)
class GPTQNative:
    """A GPTQ weight (or several fused along the outputs) in native tiles, with the input
    permutation its columns were put in (``None``: none; int32, the native kernels' index width)."""

    weight: NativeWeight
    perm: torch.Tensor | None  # int32 [k]

    @property
    def nbytes(self) -> int:
        return self.weight.nbytes

    def gather(self, x2: torch.Tensor) -> torch.Tensor:
        return x2 if self.perm is None else x2.index_select(1, self.perm)

    def matmul(self, x2: torch.Tensor, bias: torch.Tensor | None, options: CpuOptions) -> torch.Tensor:
        """``x2 [m, k] @ W.T (+ bias)`` in ``x2``'s dtype, ``x2``'s columns read in ``perm``'s
        order inside the native kernel (the bits of ``gather(x2)`` through the weight)."""
        return matmul(self.weight, x2, self.weight.k, self.weight.n, bias, options, order=self.perm)


def _groups_of_32(m: GPTQLinear, perm: torch.Tensor | None) -> torch.Tensor | None:
    """The GPTQ group of each run of 32 (ordered) inputs, or ``None`` if a run spans two."""
    k = m.in_features
    if k % GROUP or (m.group_size != -1 and m.group_size % GROUP):
        return None
    g = m.group_of if perm is None else m.group_of[perm]
    runs = g.view(-1, GROUP)
    if not bool((runs == runs[:, :1]).all()):
        return None
    return runs[:, 0]


def _codes(m: GPTQLinear, perm: torch.Tensor | None, runs: torch.Tensor):
    """``(codes uint8 [n, k], bits, d, z, w)``: the native layout's codes and per-32 affine map
    (float32 ``[n, k/32]``; ``z`` is ``None`` for 8 bits) and the file's weights ``w`` (float32
    ``[n, k/32, 32]``), or ``None`` where 8-bit codes would not fit."""
    q = unpack_rows(m.qweight, m.bits, m.in_features)  # int32 [k, n]
    if perm is not None:
        q = q.index_select(0, perm)
    n, k = m.out_features, m.in_features
    q = q.t().contiguous()  # [n, k]
    s = m.scales_f[runs].t().contiguous()  # [n, k/32]
    zero = m.zeros_f[runs].t().contiguous()
    w = (q.view(n, -1, GROUP).float() - zero[..., None]) * s[..., None]
    if m.bits == 8:
        u = q.view(n, -1, GROUP) - zero[..., None].to(torch.int32) + 128
        if int(u.min()) < 0 or int(u.max()) > 255:
            return None
        return u.to(torch.uint8).view(n, k), 8, s, None, w
    return q.to(torch.uint8), 4, s, -s * zero, w


def repack(modules: list[GPTQLinear]) -> GPTQNative | object:
    """``modules`` (sharing their input) repacked as one native weight, or :data:`UNSUPPORTED`."""
    first = modules[0]
    perm = group_order(first)
    runs = _groups_of_32(first, perm)
    if runs is None:
        return UNSUPPORTED
    for m in modules[1:]:
        other = group_order(m)
        if (m.in_features != first.in_features or m.bits != first.bits
                or (perm is None) != (other is None) or (perm is not None and not torch.equal(perm, other))):
            return UNSUPPORTED
        if _groups_of_32(m, perm) is None:
            return UNSUPPORTED
    parts = []
    for m in modules:
        part = _codes(m, perm, runs if m is first else _groups_of_32(m, perm))
        if part is None:
            return UNSUPPORTED
        parts.append(part)
    codes = torch.cat([p[0] for p in parts])
    bits = parts[0][1]
    n, k = codes.shape
    if n % native.TILE:
        return UNSUPPORTED
    d = torch.cat([p[2] for p in parts])
    z = None if bits == 8 else torch.cat([p[3] for p in parts])
    w = torch.cat([p[4] for p in parts])
    d16 = d.to(torch.float16)
    z16 = (-128 * d16.float() if z is None else z.to(torch.float16).float())
    packed = native.pack(codes, bits, d16, None if z is None else z16)
    kernel_w = z16[..., None] + codes.view(n, -1, GROUP).float() * d16.float()[..., None]
    norm = w.square().sum((1, 2)).max().sqrt().item()
    err = (kernel_w - w).square().sum((1, 2)).max().sqrt().item()
    order = None if perm is None else perm.to(torch.int32)
    return GPTQNative(NativeWeight(packed, bits, n, k, err, known_row_norm=norm), order)


class CpuGPTQLinear(KernelModule):
    """A ``GPTQLinear`` (``base``) on the native kernels; ``forward(x, meta)``. ``fused`` holds
    the weight of the linears fused with it when it is the first of them."""

    def __init__(self, base: GPTQLinear, options: CpuOptions) -> None:
        super().__init__()
        self.base = base
        self.in_features, self.out_features = base.in_features, base.out_features
        self.options = options
        self.state = None
        self.fused = None

    @property
    def bias(self) -> torch.Tensor | None:
        return self.base.bias

    def prepared(self) -> GPTQNative | None:
        if self.state is None:
            self.state = repack([self.base]) if native.load(self.options) is not None else UNSUPPORTED
        return None if self.state is UNSUPPORTED else self.state

    def forward(self, x: torch.Tensor, meta: AttentionMetadata | None = None) -> torch.Tensor:
        state = self.prepared() if _fast_input(x) else None
        if state is None:
            return self.base.reference_forward(x)
        out = state.matmul(x.reshape(-1, self.in_features), self.base.bias, self.options)
        return out.reshape(*x.shape[:-1], self.out_features)

    def reference_forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base.reference_forward(x)

    def extra_repr(self) -> str:
        return f"cpu, {self.base.extra_repr()}"


def fused_state(modules, options: CpuOptions):
    """``(GPTQNative, bias | None)`` of ``modules`` (``CpuGPTQLinear`` s reading one input)
    repacked together (built on first use, kept on the first), or ``None``."""
    head = modules[0]
    if head.fused is None:
        if native.load(options) is None:
            head.fused = UNSUPPORTED
        else:
            state = repack([m.base for m in modules])
            bias = None
            if state is not UNSUPPORTED and any(m.bias is not None for m in modules):
                bias = torch.cat([m.bias.float() if m.bias is not None else torch.zeros(m.out_features)
                                  for m in modules])
            head.fused = UNSUPPORTED if state is UNSUPPORTED else (state, bias)
    return None if head.fused is UNSUPPORTED else head.fused


def fused_linear(modules, x: torch.Tensor, meta: AttentionMetadata | None, options: CpuOptions):
    """As :func:`localllm.kernels.cpu.matmul.fused_linear`, for GPTQ linears."""
    if not _fast_input(x) or not all(type(m) is CpuGPTQLinear for m in modules):
        return None
    fused = fused_state(modules, options)
    if fused is None:
        return None
    state, bias = fused
    out = state.matmul(x.reshape(-1, state.weight.k), bias, options)
    return out.reshape(*x.shape[:-1], state.weight.n)


def held_bytes(model: torch.nn.Module) -> int:
    total = 0
    for m in model.modules():
        if isinstance(m, CpuGPTQLinear):
            for s in (m.state, m.fused):
                if s is not None and s is not UNSUPPORTED:
                    total += (s if isinstance(s, GPTQNative) else s[0]).nbytes
    return total
