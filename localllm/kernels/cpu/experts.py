"""A mixture of experts' native plans: its router (:class:`RouterPlan`, for ``moe_route`` and the
one-call layer) and its experts (:class:`ExpertPlan`, for ``moe_experts`` and the one-call layer),
each made once per layer on first use (see :mod:`localllm.kernels.cpu.ops`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from localllm.kernels.cpu import native
from localllm.kernels.cpu.matmul import CpuLinear, fused_state
from localllm.kernels.cpu.options import CpuOptions
from localllm.kernels.cpu.weights import NativeWeight, join_packed
from localllm.quant.gguf_dequant import dequantize
from localllm.quant.linear import QuantLinear

ROUTER_KEY = "_localllm_cpu_router"
"""Where a mixture of experts keeps its :class:`RouterPlan` (its ``STATE_KEY`` holds the experts')."""

NATIVE_GATINGS = {"softmax": 0, "softmax_weight": 1}
"""The gating kinds (``MoeConfig.gating``) the native router has, by its ids (``csrc/moe.h``)."""


@dataclass(slots=True)
class RouterPlan:
    """A mixture of experts' router for the native calls: its weight in float32 ``[E, H]`` (the
    file's values, dequantized once: a router is small) and the gating kind's id."""

    weight: torch.Tensor
    gating: int


def router_plan(moe) -> RouterPlan | None:
    """The plan of ``moe``'s router: a GGUF linear without bias, a gating kind of
    :data:`NATIVE_GATINGS`, no selection bias, a hidden size a multiple of 16; else ``None``."""
    router = getattr(moe.router, "base", moe.router)  # (the file's linear under the CPU backend's)
    gating = NATIVE_GATINGS.get(moe.gating)
    if (gating is None or not isinstance(router, QuantLinear) or router.bias is not None
            or getattr(moe, "selection_bias", None) is not None or router.in_features % 16):
        return None
    weight = dequantize(router.raw, router.qtype).reshape(router.out_features, router.in_features)
    return RouterPlan(weight.float().contiguous(), gating)


@dataclass(slots=True)
class ExpertPlan:
    """What :meth:`CpuOps.moe_experts` hands the native call for a mixture of experts: each
    expert's gate and up weights repacked together and its down weight, all of one format each,
    their biases (float32 ``[E, 2 I]`` and ``[E, H]``, or ``None``) and the experts' activation."""

    gate_up: list[torch.Tensor]
    gate_up_bits: int
    down: list[torch.Tensor]
    down_bits: int
    inter: int
    gate_up_bias: torch.Tensor | None = None
    down_bias: torch.Tensor | None = None
    activation: str = "silu"
    """``silu`` or ``swiglu_oai`` (gpt-oss's clamped SwiGLU, with :attr:`alpha` and :attr:`limit`)."""
    alpha: float = 1.702
    limit: float = 7.0


def _stacked_biases(biases: list) -> torch.Tensor | None | bool:
    """The experts' biases as one float32 ``[E, n]`` tensor, ``None`` where no expert has one, or
    ``False`` where only some have (a zero bias added would turn a -0.0 output into +0.0)."""
    if all(b is None for b in biases):
        return None
    if any(b is None for b in biases):
        return False
    return torch.stack([b.float() for b in biases]).contiguous()


def expert_plan(moe, options: CpuOptions) -> ExpertPlan | None:
    """A plan when every expert of ``moe`` is a SiLU or clamped-SwiGLU MLP (all the same activation)
    of GGUF linears on the CPU backend, whose gate/up fuse into one native weight and whose down is a
    native weight, every expert in the same formats, with biases on all of them or on none (of the
    gate/up and of the down apart), widths multiples of 16; else ``None``. The experts' weights are
    moved into one allocation (:func:`~localllm.kernels.cpu.weights.join_packed`)."""
    if native.load(options) is None:
        return None
    first = moe.experts[0]
    activation = getattr(first, "activation", None)
    if activation not in ("silu", "swiglu_oai"):
        return None
    gate_up, down, gate_up_biases, down_biases = [], [], [], []
    for expert in moe.experts:
        linears = (expert.gate_proj, expert.up_proj, expert.down_proj)
        if getattr(expert, "activation", None) != activation or not all(type(m) is CpuLinear for m in linears):
            return None
        if activation == "swiglu_oai" and (expert.alpha, expert.limit) != (first.alpha, first.limit):
            return None
        fused = fused_state((expert.gate_proj, expert.up_proj), options)
        d = expert.down_proj.prepared()
        if fused is None or not isinstance(fused[0], NativeWeight) or not isinstance(d, NativeWeight):
            return None
        gate_up.append(fused[0])
        gate_up_biases.append(fused[1])
        down.append(d)
        down_biases.append(expert.down_proj.bias)
    inter, hidden = down[0].k, down[0].n
    if (inter % 16 or hidden % 16 or any(w.bits != gate_up[0].bits or w.n != 2 * inter for w in gate_up)
            or any(w.bits != down[0].bits or w.k != inter for w in down)
            or gate_up[0].bits in native.FLOAT_FORMATS or down[0].bits in native.FLOAT_FORMATS):
        return None
    gate_up_bias, down_bias = _stacked_biases(gate_up_biases), _stacked_biases(down_biases)
    if gate_up_bias is False or down_bias is False:
        return None
    join_packed([*gate_up, *down], options.huge_pages)
    return ExpertPlan([w.packed for w in gate_up], gate_up[0].bits, [w.packed for w in down], down[0].bits, inter,
                      gate_up_bias, down_bias, activation, float(first.alpha), float(first.limit))
