"""Linear and embedding modules over packed GGUF weights.

The packed bytes stay exactly as they are in the file (normally a zero-copy view of the
memory-mapped GGUF), so resident memory tracks the file size. Matmuls dequantize a chunk of
output rows at a time and never hold a full float32 copy of a large matrix.

These modules are the reference: a backend (``localllm.kernels``) that runs them faster swaps
them for its own modules when it is installed, keeping them as the definition it is tested
against.
"""

from __future__ import annotations

import warnings

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from localllm.errors import ModelLoadError
from localllm.quant.gguf_dequant import as_bytes, check_qtype, dequantize

# Upper bound on the float32 temporary one chunk of dequantized rows may take.
MAX_CHUNK_BYTES = 32 * 1024 * 1024


def tensor_from_numpy(array: np.ndarray) -> torch.Tensor:
    """Wrap ``array`` (e.g. GGUFReader's read-only memmap) as a tensor sharing its memory.

    Torch warns that read-only arrays are not writable; these weights are never written.
    """
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(array)


def _packed_bytes(
    raw: torch.Tensor | np.ndarray,
    qtype: GGMLQuantizationType | int,
    num_rows: int,
    row_elems: int,
    name: str,
) -> tuple[torch.Tensor, GGMLQuantizationType]:
    """Validate ``raw`` as ``num_rows`` rows of ``row_elems`` elements; return a uint8 view."""
    qtype = check_qtype(qtype, name)
    if isinstance(raw, np.ndarray):
        raw = tensor_from_numpy(raw)
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    if row_elems % block_size:
        raise ModelLoadError(
            f"tensor '{name}': rows of {row_elems} elements are not a whole number of "
            f"{qtype.name} blocks ({block_size} elements each)"
        )
    try:
        data = as_bytes(raw, qtype)
    except (ValueError, RuntimeError) as exc:
        raise ModelLoadError(f"tensor '{name}': {exc}") from exc
    expected = (num_rows, row_elems // block_size * type_size)
    if tuple(data.shape) != expected:
        raise ModelLoadError(
            f"tensor '{name}': {qtype.name} data has byte shape {tuple(data.shape)}, expected {expected} "
            f"for {num_rows} rows of {row_elems} elements"
        )
    return data, qtype


def _default_chunk_rows(row_elems: int) -> int:
    return max(1, min(4096, MAX_CHUNK_BYTES // (4 * row_elems)))


def chunked_matmul(
    x: torch.Tensor,
    raw: torch.Tensor,
    qtype: GGMLQuantizationType,
    chunk_rows: int,
    bias: torch.Tensor | None = None,
    rows_alone: bool = False,
) -> torch.Tensor:
    """``x @ W.T (+ bias)`` in ``x``'s dtype, where ``W = dequantize(raw, qtype)``, dequantizing
    ``chunk_rows`` rows of ``W`` at a time. ``rows_alone``: each row of ``x`` multiplied alone (a
    GEMM picks its blocking, and so its sums' order, by the row count: a row then gets the bits
    it gets alone, whatever its batch), each chunk still dequantized once."""
    num_rows = raw.shape[0]
    x2 = x.reshape(-1, x.shape[-1])
    out = x2.new_empty(x2.shape[0], num_rows)
    for start in range(0, num_rows, chunk_rows):
        end = min(start + chunk_rows, num_rows)
        w = dequantize(raw[start:end], qtype).to(x.dtype)
        if rows_alone:
            for i in range(x2.shape[0]):
                out[i : i + 1, start:end] = x2[i : i + 1] @ w.T
        else:
            out[:, start:end] = x2 @ w.T
    if bias is not None:
        out += bias.to(x.dtype)
    return out.reshape(*x.shape[:-1], num_rows)


class QuantLinear(torch.nn.Module):
    """``y = x @ W.T + b`` with ``W`` kept packed in a GGUF type.

    ``raw`` is uint8 ``[out_features, bytes_per_row]`` (float types may also be typed
    ``[out_features, in_features]``); it is stored as a non-persistent buffer, never copied.
    ``is_lm_head`` (set on output heads) lets a fast backend keep the top logits exact.
    """

    is_lm_head: bool = False

    def __init__(
        self,
        raw: torch.Tensor | np.ndarray,
        qtype: GGMLQuantizationType | int,
        in_features: int,
        out_features: int,
        bias: torch.Tensor | None = None,
        *,
        name: str = "<linear>",
        chunk_rows: int | None = None,
    ) -> None:
        super().__init__()
        data, self.qtype = _packed_bytes(raw, qtype, out_features, in_features, name)
        self.in_features = in_features
        self.out_features = out_features
        self.chunk_rows = chunk_rows or _default_chunk_rows(in_features)
        if bias is not None and tuple(bias.shape) != (out_features,):
            raise ModelLoadError(
                f"tensor '{name}': bias shape {tuple(bias.shape)}, expected ({out_features},)"
            )
        self.register_buffer("raw", data, persistent=False)
        self.register_buffer("bias", bias, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.reference_forward(x)

    def reference_forward(self, x: torch.Tensor, rows_alone: bool = False) -> torch.Tensor:
        """Dequantize-then-matmul, chunked over output rows (``rows_alone``: see :func:`chunked_matmul`)."""
        return chunked_matmul(x, self.raw, self.qtype, self.chunk_rows, self.bias, rows_alone)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"qtype={self.qtype.name}, bias={self.bias is not None}"
        )


class QuantEmbedding(torch.nn.Module):
    """Token embedding over a packed GGUF matrix ``[num_embeddings, embedding_dim]``.

    A lookup dequantizes only the requested rows. ``logits``/``as_linear`` reuse the same
    storage for a tied output head.
    """

    def __init__(
        self,
        raw: torch.Tensor | np.ndarray,
        qtype: GGMLQuantizationType | int,
        num_embeddings: int,
        embedding_dim: int,
        *,
        name: str = "<embedding>",
        chunk_rows: int | None = None,
    ) -> None:
        super().__init__()
        data, self.qtype = _packed_bytes(raw, qtype, num_embeddings, embedding_dim, name)
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.chunk_rows = chunk_rows or _default_chunk_rows(embedding_dim)
        self.register_buffer("raw", data, persistent=False)

    def forward(self, ids: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Rows ``ids`` (any shape, int) as ``[*ids.shape, embedding_dim]`` in ``dtype``."""
        rows = dequantize(self.raw.index_select(0, ids.reshape(-1)), self.qtype)
        return rows.to(dtype).reshape(*ids.shape, self.embedding_dim)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ W.T`` over all rows (tied LM head), in ``x``'s dtype."""
        return self.reference_logits(x)

    def reference_logits(self, x: torch.Tensor) -> torch.Tensor:
        """``logits`` by dequantize-then-matmul, chunked over rows (the reference path)."""
        return chunked_matmul(x, self.raw, self.qtype, self.chunk_rows)

    def as_linear(self) -> QuantLinear:
        """A ``QuantLinear`` sharing this embedding's storage (``in_features=embedding_dim``),
        marked as an LM head (a tied output head is what this is for)."""
        head = QuantLinear(
            self.raw, self.qtype, self.embedding_dim, self.num_embeddings, chunk_rows=self.chunk_rows
        )
        head.is_lm_head = True
        self.__dict__["_tied_head"] = head  # not a submodule: a backend's lookups may read the head's rows
        return head

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, qtype={self.qtype.name}"
