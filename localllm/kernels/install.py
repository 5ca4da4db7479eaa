"""Switch a loaded model onto the Triton kernels, without touching the modules' code.

:func:`use_triton` swaps every :class:`~localllm.quant.linear.QuantLinear` for a
:class:`TritonLinear` that shares its packed storage (and keeps it as ``base``, the reference),
every :class:`~localllm.quant.linear.QuantEmbedding` for a :class:`TritonEmbedding`, and points
the ``ops`` hook of the attention/MLP/norm modules at :class:`~localllm.kernels.triton_ops.TritonOps`.
:func:`use_torch` undoes it. Import this module only once Triton is wanted: importing the kernels
fixes whether they run compiled or interpreted (``TRITON_INTERPRET``).
"""

from __future__ import annotations

import torch
from gguf import GGMLQuantizationType

from localllm.kernels import triton_quant
from localllm.kernels.triton_ops import TritonOps
from localllm.quant.gguf_dequant import FLOAT_QTYPES, as_bytes
from localllm.quant.linear import QuantEmbedding, QuantLinear

T = GGMLQuantizationType
_FLOAT_DTYPES = {T.F32: torch.float32, T.F16: torch.float16, T.BF16: torch.bfloat16}


class TritonLinear(torch.nn.Module):
    """``QuantLinear`` on the Triton dequant-fused matmul (float weights: ``F.linear``)."""

    def __init__(self, base: QuantLinear) -> None:
        super().__init__()
        self.base = base
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
        if self.qtype in FLOAT_QTYPES:
            return torch.nn.functional.linear(
                x, self._weight(x.dtype), None if bias is None else bias.to(x.dtype)
            )
        return triton_quant.quant_matmul(x, self.base.raw, self.qtype, bias)

    def reference_forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base.reference_forward(x)

    def extra_repr(self) -> str:
        return f"triton, {self.base.extra_repr()}"


class TritonEmbedding(torch.nn.Module):
    """``QuantEmbedding`` whose lookup dequantizes the requested rows with a Triton kernel."""

    def __init__(self, base: QuantEmbedding) -> None:
        super().__init__()
        self.base = base
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
        if self.qtype in FLOAT_QTYPES:
            return self.base.logits(x)
        return triton_quant.quant_matmul(x, self.base.raw, self.qtype)

    def as_linear(self) -> QuantLinear:
        return self.base.as_linear()

    def extra_repr(self) -> str:
        return f"triton, {self.base.extra_repr()}"


def _swap(model: torch.nn.Module, wrap) -> None:
    for parent in list(model.modules()):
        if isinstance(parent, (TritonLinear, TritonEmbedding)):
            continue  # a wrapper's ``base`` stays the reference module
        for name, child in list(parent.named_children()):
            new = wrap(child)
            if new is not child:
                setattr(parent, name, new)


def use_triton(model: torch.nn.Module) -> torch.nn.Module:
    """Run ``model`` (already on its device) on Triton kernels; returns it. Idempotent."""
    ops = TritonOps()

    def wrap(m):
        if isinstance(m, QuantLinear):
            return TritonLinear(m)
        if isinstance(m, QuantEmbedding):
            return TritonEmbedding(m)
        return m

    _swap(model, wrap)
    for m in model.modules():
        if "ops" in type(m).__dict__ or hasattr(type(m), "ops"):
            m.ops = ops
    model.kernels = "triton"
    return model


def use_torch(model: torch.nn.Module) -> torch.nn.Module:
    """Undo :func:`use_triton`: back to the reference modules and ops."""
    _swap(model, lambda m: m.base if isinstance(m, (TritonLinear, TritonEmbedding)) else m)
    for m in model.modules():
        if "ops" in m.__dict__:
            del m.ops
    model.kernels = "torch"
    return model
