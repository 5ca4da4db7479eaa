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
from localllm.kernels.backend import KernelModule, restore_reference, set_ops, swap_modules, zeroed_kv_cache
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
        return model

    def held_bytes(self, model: torch.nn.Module) -> int:
        return 0

    def linear(self, module, x: torch.Tensor, meta: AttentionMetadata | None = None) -> torch.Tensor:
        return module(x)

    def fused_linear(self, modules, x: torch.Tensor, meta: AttentionMetadata | None = None) -> torch.Tensor | None:
        return None
