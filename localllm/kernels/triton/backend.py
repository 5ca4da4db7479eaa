"""The Triton backend: GPUs (CUDA/ROCm), or a CPU through the Triton interpreter (tests).

:class:`TritonBackend` has the ops of :class:`~localllm.kernels.triton.ops.TritonOps`; its
:meth:`~TritonBackend.install` swaps every :class:`~localllm.quant.linear.QuantLinear` for a
:class:`TritonLinear` that shares its packed storage (and keeps it as ``base``, the reference),
every :class:`~localllm.quant.linear.QuantEmbedding` for a :class:`TritonEmbedding`, and points
the ``ops`` of the model's modules at itself. Installing the reference backend
(:class:`~localllm.kernels.torch_backend.TorchBackend`) undoes it. Import this module only once
Triton is wanted: importing the kernels fixes whether they run compiled or interpreted
(``TRITON_INTERPRET``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from gguf import GGMLQuantizationType

from localllm.config.settings import env_or_default
from localllm.kernels.attention import AttentionMetadata
from localllm.kernels.backend import (
    STATE_KEY,
    KernelModule,
    restore_reference,
    set_ops,
    swap_modules,
    zeroed_kv_cache,
)
from localllm.kernels.triton import moe as triton_moe
from localllm.kernels.triton import quant as triton_quant
from localllm.kernels.triton.attention import choose_num_splits
from localllm.kernels.triton.ops import TritonOps
from localllm.quant.gguf_dequant import FLOAT_QTYPES, as_bytes
from localllm.quant.linear import QuantEmbedding, QuantLinear

T = GGMLQuantizationType
_FLOAT_DTYPES = {T.F32: torch.float32, T.F16: torch.float16, T.BF16: torch.bfloat16}


@dataclass(frozen=True, slots=True)
class TritonOptions:
    """How the Triton backend runs; the defaults are the environment's defaults."""

    cuda_graphs: bool = True
    """Capture decode steps as CUDA graphs on a GPU (``LOCALLLM_CUDA_GRAPHS=0``: eager)."""

    autotune: bool = True
    """Autotune the quantized matmuls (``LOCALLLM_TRITON_AUTOTUNE=0``: one config per kernel)."""

    batch_invariant: bool = True
    """A row's result does not depend on the other rows of its step (the engine's default;
    ``serve --fast-math`` turns it off): every matmul, quantized or float, runs the GEMM kernel in
    one fixed config whatever the number of rows (no GEMV/GEMM switch, no split-K, no
    autotuning), and attention takes the decode tile shape for prompt tokens too, with no KV
    splits. Off: the fastest kernel per shape (autotuned, split-K GEMV for decode, cuBLAS for
    float weights, flash-decoding splits)."""

    @classmethod
    def from_env(cls) -> TritonOptions:
        return cls(cuda_graphs=env_or_default("cuda_graphs"), autotune=env_or_default("triton_autotune"))


class TritonLinear(KernelModule):
    """``QuantLinear`` on the Triton dequant-fused matmul (float weights: ``F.linear``; a type
    without a Triton kernel: the reference's dequantize-then-matmul, on the same device)."""

    def __init__(self, base: QuantLinear, invariant: bool = False) -> None:
        super().__init__()
        self.base = base
        self.invariant = invariant
        self.in_features, self.out_features, self.qtype = base.in_features, base.out_features, base.qtype
        self._float_weight: torch.Tensor | None = None

    def _weight(self, dtype: torch.dtype) -> torch.Tensor:
        raw = self.base.raw
        w = self._float_weight
        if w is None or w.device != raw.device or w.dtype != dtype:
            w = (
                as_bytes(raw, self.qtype)
                .view(_FLOAT_DTYPES[self.qtype])
                .view(self.out_features, self.in_features)
            )
            self._float_weight = w = w.to(dtype)
        return w

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = self.base.bias
        if self.qtype not in triton_quant.SUPPORTED_QTYPES and self.qtype not in FLOAT_QTYPES:
            return self.base.reference_forward(x)  # no kernel for the type (MXFP4, IQ4): torch's dequantization
        if self.invariant and self.qtype in triton_quant.SUPPORTED_QTYPES:
            return triton_quant.quant_matmul(x, as_bytes(self.base.raw, self.qtype), self.qtype, bias, invariant=True)
        if self.qtype in FLOAT_QTYPES:
            return torch.nn.functional.linear(
                x, self._weight(x.dtype), None if bias is None else bias.to(x.dtype)
            )
        return triton_quant.quant_matmul(x, self.base.raw, self.qtype, bias)

    def reference_forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base.reference_forward(x)

    def extra_repr(self) -> str:
        return f"triton, {self.base.extra_repr()}"


class TritonEmbedding(KernelModule):
    """``QuantEmbedding`` whose lookup dequantizes the requested rows with a Triton kernel."""

    def __init__(self, base: QuantEmbedding, invariant: bool = False) -> None:
        super().__init__()
        self.base = base
        self.invariant = invariant
        self.num_embeddings, self.embedding_dim, self.qtype = (
            base.num_embeddings,
            base.embedding_dim,
            base.qtype,
        )

    def forward(self, ids: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        if self.qtype in FLOAT_QTYPES:
            return self.base(ids, dtype)
        rows = triton_quant.dequantize_rows(self.base.raw, self.qtype, self.embedding_dim, ids, dtype)
        return rows.reshape(*ids.shape, self.embedding_dim)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        if self.invariant and self.qtype in triton_quant.SUPPORTED_QTYPES:
            return triton_quant.quant_matmul(x, as_bytes(self.base.raw, self.qtype), self.qtype, invariant=True)
        if self.qtype in FLOAT_QTYPES:
            return self.base.logits(x)
        return triton_quant.quant_matmul(x, self.base.raw, self.qtype)

    def as_linear(self) -> QuantLinear:
        return self.base.as_linear()

    def extra_repr(self) -> str:
        return f"triton, {self.base.extra_repr()}"


class TritonBackend(TritonOps):
    """The Triton backend (see :class:`~localllm.kernels.backend.Backend`)."""

    name = "triton"
    supports_cuda_graphs = True
    kv_cache_matches_model_dtype = True  # the kernels read a cache of the model's dtype

    def __init__(self, options: TritonOptions | None = None) -> None:
        self.options = options if options is not None else TritonOptions.from_env()
        super().__init__(batch_invariant=self.options.batch_invariant)
        triton_quant.configure(autotune=self.options.autotune)

    @property
    def cuda_graphs(self) -> bool:
        return self.options.cuda_graphs

    def kv_cache_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        return model_dtype

    def kv_cache(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return zeroed_kv_cache(shape, dtype, device)

    def greedy_rows(self, logits: torch.Tensor) -> tuple[list[int], list[bool]] | None:
        return None

    def decode_splits(self, num_seqs: int, num_kv_heads: int, max_context: int, device: torch.device) -> int:
        return choose_num_splits(num_seqs, num_kv_heads, 1, max_context, device)

    def install(self, model: torch.nn.Module) -> torch.nn.Module:
        """Run ``model`` (already on its device) on the Triton kernels; returns it. Idempotent."""
        restore_reference(model)

        def wrap(m):
            if isinstance(m, QuantLinear):
                return TritonLinear(m, self.options.batch_invariant)
            if isinstance(m, QuantEmbedding):
                return TritonEmbedding(m, self.options.batch_invariant)
            return m

        swap_modules(model, wrap)
        set_ops(model, self)
        for m in model.modules():  # the mixtures of experts' plans, before any step is captured
            if isinstance(getattr(m, "experts", None), torch.nn.ModuleList):
                self.expert_plan(m)
        return model

    def held_bytes(self, model: torch.nn.Module) -> int:
        return 0

    def linear(self, module, x: torch.Tensor, meta: AttentionMetadata | None = None) -> torch.Tensor:
        return module(x)

    def fused_linear(self, modules, x: torch.Tensor, meta: AttentionMetadata | None = None) -> torch.Tensor | None:
        return None

    def moe_experts(self, moe, x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor | None:
        """``moe``'s experts in a few launches (:mod:`~localllm.kernels.triton.moe`), or ``None``
        where they have no grouped route (then the layer runs them one by one)."""
        if x.dim() != 2:
            return None
        plan = self.expert_plan(moe)
        if plan is None:
            return None
        return triton_moe.moe_experts(x, weights, chosen, plan, invariant=self.options.batch_invariant)

    def expert_plan(self, moe) -> triton_moe.ExpertPlan | None:
        """``moe``'s grouped plan, made once (:func:`expert_plan`), or ``None`` where it has none."""
        plan = moe.__dict__.get(STATE_KEY)
        if plan is None:
            plan = moe.__dict__[STATE_KEY] = expert_plan(moe) or False
        return plan or None


def expert_plan(moe) -> triton_moe.ExpertPlan | None:
    """The grouped kernels' view of ``moe``'s experts when each is a gated MLP (SiLU, GeGLU or
    gpt-oss's SwiGLU) of :class:`TritonLinear` s whose projections share one GGUF type with a Triton
    kernel across the experts (gate and up the same), biases on all of a projection or none; else
    ``None`` (an MXFP4 or F32 expert: one by one).

    Each projection's experts must be one tensor ``[num_experts, N, row]``: the row views a GGUF
    file's 3-D expert tensor gives are (:func:`~localllm.kernels.triton.moe.stacked_rows` checks
    it). Where they are not (moved to a GPU one by one, or separate tensors in a Hugging Face
    directory), their bytes are moved into one such tensor and each expert's linear views its
    slice: the same bytes, held once."""
    experts = list(moe.experts)
    if not experts:
        return None
    first = experts[0]
    activation = getattr(first, "activation", None)
    if activation not in triton_moe.ACTIVATIONS:
        return None
    parts = {}
    for name in ("gate_proj", "up_proj", "down_proj"):
        linears = [getattr(expert, name, None) for expert in experts]
        if not all(type(m) is TritonLinear for m in linears):
            return None
        qtype, shape = linears[0].qtype, (linears[0].in_features, linears[0].out_features)
        if not triton_moe.supports(qtype) or any(
                m.qtype != qtype or (m.in_features, m.out_features) != shape for m in linears):
            return None
        biases = [m.base.bias for m in linears]
        if any((b is None) != (biases[0] is None) for b in biases):
            return None
        parts[name] = linears
    if parts["gate_proj"][0].qtype != parts["up_proj"][0].qtype or any(
            (e.activation, e.alpha, e.limit) != (activation, first.alpha, first.limit) for e in experts):
        return None
    gate, up, down = (_stacked(parts[name]) for name in ("gate_proj", "up_proj", "down_proj"))
    return triton_moe.ExpertPlan(gate, up, down, activation, float(first.alpha), float(first.limit))


def _stacked(linears: list[TritonLinear]) -> triton_moe.ExpertWeights:
    """One projection of every expert as one tensor (moving the experts' bytes into one where
    they are apart; see :func:`expert_plan`)."""
    bases = [m.base for m in linears]
    raws = [b.raw for b in bases]
    stacked = triton_moe.stacked_rows(raws)
    if stacked is None:
        stacked = torch.stack(raws)
        for e, base in enumerate(bases):
            base.raw = stacked[e]
        for m in linears:
            m._float_weight = None
    bias = None
    if bases[0].bias is not None:
        bias = torch.stack([b.bias.float() for b in bases]).contiguous()
    first = linears[0]
    return triton_moe.ExpertWeights(stacked, first.qtype, first.in_features, first.out_features, bias)
