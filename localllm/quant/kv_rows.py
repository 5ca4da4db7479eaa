"""The KV cache's storage types, as llama.cpp names them (``-ctk``/``-ctv``): float32, float16 and
bfloat16 values, or GGML's q8_0 and q4_0 blocks (32 values and their float16 scale), chosen for
keys and values apart.

A cache whose keys and values are of one float type is a tensor of that dtype
``[2, num_blocks, block_size, num_kv_heads, head_dim]`` (the kernels' own). Any other pair is a
:class:`SplitKvCache`: each block's keys then its values as rows of bytes, one row per token and KV
head, so that the cache holds exactly the bytes of its types (llama.cpp's per token). This module
is the reference of their bytes: :func:`quantize_rows` writes them as ggml's reference quantizers
do (``quantize_row_q8_0_ref``/``quantize_row_q4_0_ref``, the same bytes as gguf-py's
``quants.quantize``) and :func:`dequantize_rows` reads them; the native CPU kernels write and read
the same bytes (``csrc/kv_rows.h``).

A quantized side is stored rotated, as llama.cpp stores it: each head's row goes through an
orthonormal Walsh-Hadamard transform before it is quantized (keys: over the largest power of two
that divides the head size, the queries turned alike, so that their dot products are the same;
values: over blocks of 64, the attention's output turned back). An outlier channel is spread over
the block then, and one scale fits it: on SmolLM2, q4_0's KL divergence from the float16 cache
falls about threefold. :func:`hadamard` is the transform, its own inverse.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from localllm.config.engine import KV_CACHE_TYPES, KV_TYPE_ALIASES, kv_row_bytes

QK = KV_CACHE_TYPES["q8_0"][0]  # values of one q8_0 / q4_0 block


@dataclass(frozen=True, slots=True)
class KvRowType:
    """One storage type of K or V (:data:`~localllm.config.engine.KV_CACHE_TYPES`' facts): ``code``
    is the native kernels' (``csrc/kv_rows.h``)."""

    name: str
    code: int
    block: int  # values per block (1 for the floats)
    block_bytes: int
    dtype: torch.dtype | None = None  # a float type's torch dtype

    def row_bytes(self, head_dim: int) -> int:
        """The bytes of one token's row of one KV head."""
        return kv_row_bytes(self.name, head_dim)

    @property
    def quantized(self) -> bool:
        return self.dtype is None


_FLOATS = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}
KV_ROW_TYPES: dict[str, KvRowType] = {
    name: KvRowType(name, code, values, size, _FLOATS.get(name))
    for code, (name, (values, size)) in enumerate(KV_CACHE_TYPES.items())
}


def kv_row_type(name: str) -> KvRowType:
    """The type named ``name`` (llama.cpp's name or torch's), else a ``ValueError`` naming them."""
    key = KV_TYPE_ALIASES.get(name, name)
    if key not in KV_ROW_TYPES:
        raise ValueError(f"unknown KV cache type {name!r}: one of {', '.join(KV_ROW_TYPES)}")
    return KV_ROW_TYPES[key]


def row_type_of(dtype: torch.dtype) -> KvRowType:
    """The float type of ``dtype``."""
    for t in KV_ROW_TYPES.values():
        if t.dtype == dtype:
            return t
    raise ValueError(f"no KV cache type holds {dtype}")


ROTATION_BLOCK = 64  # a rotated row's blocks (values'; keys' take the largest power of two that divides the row)


def rotation(t: KvRowType, head_dim: int, keys: bool) -> int:
    """The Walsh-Hadamard block of a row of ``t`` (0: not rotated; a float type, or a head size that
    is not a multiple of :data:`ROTATION_BLOCK`)."""
    if not t.quantized or head_dim % ROTATION_BLOCK:
        return 0
    return head_dim & -head_dim if keys else ROTATION_BLOCK


def hadamard(x: torch.Tensor, n: int) -> torch.Tensor:
    """``x [..., d]`` (float32) through the orthonormal Walsh-Hadamard transform of each block of
    ``n`` values (Sylvester's order; its own inverse): butterflies, then one scaling by 1/sqrt(n)."""
    if not n:
        return x
    lead, d = x.shape[:-1], x.shape[-1]
    y = x.reshape(-1, d // n, n)
    h = 1
    while h < n:
        y = y.reshape(*y.shape[:2], n // (2 * h), 2, h)
        a, b = y[..., 0, :], y[..., 1, :]
        y = torch.stack((a + b, a - b), dim=-2).reshape(-1, d // n, n)
        h *= 2
    return (y * (1 / math.sqrt(n))).reshape(*lead, d)


@dataclass(frozen=True, slots=True)
class KvCacheTypes:
    """The types of a cache's keys and of its values."""

    k: KvRowType
    v: KvRowType

    @classmethod
    def of(cls, k: KvCacheTypes | str | torch.dtype, v: str | torch.dtype | None = None) -> KvCacheTypes:
        """The types named (or of a float dtype), ``v`` defaulting to ``k``'s."""
        if isinstance(k, KvCacheTypes):
            return k

        def one(t):
            return row_type_of(t) if isinstance(t, torch.dtype) else kv_row_type(t)

        return cls(one(k), one(k if v is None else v))

    @property
    def dtype(self) -> torch.dtype | None:
        """The dtype of a cache held as one float tensor (keys and values of one float type), else ``None``."""
        return self.k.dtype if self.k == self.v else None

    def bytes_per_token(self, num_kv_heads: int, head_dim: int) -> int:
        """One layer's K and V bytes of one token."""
        return num_kv_heads * (self.k.row_bytes(head_dim) + self.v.row_bytes(head_dim))

    def __str__(self) -> str:
        return self.k.name if self.k == self.v else f"{self.k.name}/{self.v.name}"


@dataclass(frozen=True, slots=True, eq=False)  # (one cache is one cache: compared by identity)
class SplitKvCache:
    """A layer's cache of :class:`KvCacheTypes` other than one float dtype: ``data`` uint8
    ``[num_blocks, block_size, num_kv_heads, k_row + v_row]`` by its sizes, as the native kernels take
    it, each block's bytes its tokens' K rows (``[block_size, num_kv_heads, k_row]``) then their V rows."""

    data: torch.Tensor
    types: KvCacheTypes
    head_dim: int

    @classmethod
    def allocate(cls, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, types: KvCacheTypes,
                 device: torch.device,
                 make: Callable[[tuple[int, ...], torch.dtype, torch.device], torch.Tensor]) -> SplitKvCache:
        """A zeroed cache, its bytes made by ``make(shape, dtype, device)`` (a backend's allocator)."""
        row = types.bytes_per_token(1, head_dim)
        return cls(make((num_blocks, block_size, num_kv_heads, row), torch.uint8, device), types, head_dim)

    @property
    def num_blocks(self) -> int:
        return self.data.shape[0]

    @property
    def block_size(self) -> int:
        return self.data.shape[1]

    @property
    def num_kv_heads(self) -> int:
        return self.data.shape[2]

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    @property
    def k_rotation(self) -> int:
        """The keys' Walsh-Hadamard block (0: stored as they are)."""
        return rotation(self.types.k, self.head_dim, keys=True)

    @property
    def v_rotation(self) -> int:
        """The values' Walsh-Hadamard block (0: stored as they are)."""
        return rotation(self.types.v, self.head_dim, keys=False)

    def _rows(self, t: KvRowType, start: int) -> torch.Tensor:
        nb, bs, nkv, _ = self.data.shape
        row = t.row_bytes(self.head_dim)
        return self.data.view(nb, -1)[:, start:start + bs * nkv * row].view(nb, bs, nkv, row)

    @property
    def k(self) -> torch.Tensor:
        """The K rows, a view ``[num_blocks, block_size, num_kv_heads, k_row]`` (uint8)."""
        return self._rows(self.types.k, 0)

    @property
    def v(self) -> torch.Tensor:
        """The V rows, a view ``[num_blocks, block_size, num_kv_heads, v_row]`` (uint8)."""
        return self._rows(self.types.v, self.block_size * self.num_kv_heads * self.types.k.row_bytes(self.head_dim))


def _round_away(x: torch.Tensor) -> torch.Tensor:
    """C's ``roundf``: halves away from zero (torch.round takes them to even)."""
    t = x.trunc()
    return t + ((x - t).abs() >= 0.5).to(x.dtype) * x.sign()


def quantize_rows(x: torch.Tensor, t: KvRowType) -> torch.Tensor:
    """``x [..., head_dim]`` (float) as rows of ``t``'s bytes ``[..., row_bytes]`` (uint8)."""
    if t.dtype is not None:
        return x.to(t.dtype).contiguous().view(torch.uint8)
    lead, hd = x.shape[:-1], x.shape[-1]
    blocks = x.float().reshape(-1, hd // QK, QK)
    if t.name == "q8_0":
        d = blocks.abs().amax(dim=-1, keepdim=True) / 127
        inv = torch.where(d == 0, 0.0, 1 / d)
        qs = _round_away(blocks * inv).to(torch.int8).view(torch.uint8)
    else:  # q4_0: the value of largest magnitude (its sign too) is -8 d; a block of zeros keeps +0 (as ggml's C)
        peak = blocks.gather(-1, blocks.abs().argmax(dim=-1, keepdim=True))  # (the first of equal magnitudes)
        peak = torch.where(peak == 0, 0.0, peak)
        d = peak / -8
        inv = torch.where(d == 0, 0.0, 1 / d)
        q = (blocks * inv + 8.5).trunc().clamp(0, 15).to(torch.uint8)
        qs = q[..., : QK // 2] | (q[..., QK // 2:] << 4)
    scale = d.to(torch.float16).view(torch.uint8)
    return torch.cat((scale, qs), dim=-1).reshape(*lead, t.row_bytes(hd))


def dequantize_rows(raw: torch.Tensor, t: KvRowType, head_dim: int) -> torch.Tensor:
    """Rows of ``t``'s bytes ``[..., row_bytes]`` (uint8) as float32 ``[..., head_dim]``."""
    lead = raw.shape[:-1]
    if t.dtype is not None:
        return raw.contiguous().view(t.dtype).float()
    blocks = raw.reshape(-1, head_dim // QK, t.block_bytes)
    d = blocks[..., :2].contiguous().view(torch.float16).float()
    if t.name == "q8_0":
        q = blocks[..., 2:].contiguous().view(torch.int8).float()
    else:
        qs = blocks[..., 2:]
        q = torch.cat((qs & 15, qs >> 4), dim=-1).float() - 8
    return (q * d).reshape(*lead, head_dim)
