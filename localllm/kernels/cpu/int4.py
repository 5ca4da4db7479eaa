"""The int4 route: GGUF weights in torch's int4 tile layout and kernel, where the native kernels are
off or do not load (:mod:`localllm.kernels.cpu.weights` chooses).

How the GGUF block types map onto ``torch.ops.aten._weight_int4pack_mm_for_cpu`` (group size
32, per group and output row a ``scale`` and a ``zero``; it computes ``w = (nib - 8) * scale +
zero``, with activations, scales, zeros and output in bfloat16 and float32 accumulation):

* Q4_0 ``d*(q-8)``, Q4_1 ``d*q+m`` and Q4_K ``d*sc*q - dmin*m`` (32-element sub-blocks) are one
  int4 slice: ``scale = d*sc``, ``zero = 8*scale + min``. 0.625 bytes/weight (the file: 0.56-0.63).
* Q8_0 and Q5_0, Q5_1, Q5_K split ``q = 16*hi + lo`` into two int4 slices concatenated along K
  (the activation is repeated to match), with the whole offset on the ``lo`` slice so that both
  zeros stay small. 1.25 bytes/weight: 1.18x a Q8_0 file, but 1.7-1.8x a Q5 one, so Q5 types
  only take this route when ``CpuOptions.max_growth`` (``LOCALLLM_CPU_FAST_MAX_GROWTH``, default
  1.5, the resident-memory budget per tensor against its size in the file) allows it. The int4
  route needs whole 16-row tiles.

The int4 kernel's cost grows with the number of rows M much faster than a oneDNN bfloat16
GEMM's, so from ``CpuOptions.gemm_rows`` rows on (prefill chunks) the packed weight is instead
dequantized to a transient bfloat16 matrix, one band of rows at a time, and multiplied with
``torch.matmul``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from localllm.kernels.cpu.fields import GROUP, REPACK_CHUNK_ROWS, affine_fields

DEQUANT_CHUNK_BYTES = 2 << 20
"""Target size of one band of dequantized rows on the large-batch route."""

_INT4PACK_MM = torch.ops.aten._weight_int4pack_mm_for_cpu.default
_SIXTEEN = torch.tensor(16, dtype=torch.int16)


def int4_slices(q: torch.Tensor, bits: int, s: torch.Tensor, z: torch.Tensor):
    """Split ``w = s*q + z`` into int4 slices ``(nib, scale, zero)`` with
    ``w = sum((nib - 8) * scale + zero)``; ``q`` is ``[rows, K]``, ``s``/``z`` ``[rows, K/32]``."""
    if bits == 4:
        return [(q, s, z + 8 * s)]
    hi, lo = q >> 4, q & 0x0F
    # 8-bit codes have hi in [0, 16): use it as is (centred by the kernel's -8); 5-bit codes have
    # hi in {0, 1}: shift it to 8..9 so the kernel's -8 cancels. The rest of the offset rides on lo.
    hc = 8 if bits == 8 else 0
    return [(hi + (8 - hc), 16 * s, torch.zeros_like(z)), (lo, s, z + 8 * s + 16 * hc * s)]


# ---------------------------------------------------------------------------------------------
# The int4 tile layout of _convert_weight_to_int4pack_for_cpu, for dequantizing it back


def _decode_packed(packed: torch.Tensor, n: int, k: int, block: int, halves: bool) -> torch.Tensor:
    """Packed uint8 ``[n, k/2]`` -> codes transposed, uint8 ``[k, n]``.

    Layout (ATen ``weight_to_int4pack_kernel``): rows in blocks of ``block`` (64 with AVX512,
    32 with AVX2), each block ``[k, block/2]`` bytes. With ``halves`` (the vectorized builds)
    byte ``p`` holds row ``p`` in the low nibble and row ``p + block/2`` in the high one;
    otherwise, and always in a last partial block, byte ``p`` holds rows ``2p`` and ``2p+1``.
    """
    flat = packed.reshape(-1)
    parts = []
    full = n // block * block
    for start, size, bsize, split in ((0, full, block, halves), (full, n - full, n - full, False)):
        if size == 0:
            continue
        blk = flat[start * k // 2 : (start + size) * k // 2].view(size // bsize, k, bsize // 2)
        lo = (blk & 0x0F).permute(1, 0, 2)
        hi = (blk >> 4).permute(1, 0, 2)
        parts.append(torch.stack([lo, hi], dim=2 if split else 3).reshape(k, size))
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)


_LAYOUT: tuple[int, bool] | None | bool = False  # False: not probed yet; None: unknown layout


def packed_layout() -> tuple[int, bool] | None:
    """``(block, halves)`` of this build's int4 packing, or ``None`` if a probe matches no known
    layout (then large batches stay on the int4 kernel, which is always correct)."""
    global _LAYOUT
    if _LAYOUT is False:
        gen = torch.Generator().manual_seed(0)
        n, k = 64 * 2 + 16, 64
        q = torch.randint(0, 16, (n, k), dtype=torch.int32, generator=gen)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 2)
        _LAYOUT = None
        for layout in ((64, True), (32, True), (32, False), (64, False), (16, False)):
            if torch.equal(_decode_packed(packed, n, k, *layout).t().to(torch.int32), q):
                _LAYOUT = layout
                break
    return _LAYOUT


# ---------------------------------------------------------------------------------------------
# Repacked weights


@dataclass(slots=True)
class Int4Weight:
    """A weight ``[n, k]`` as ``num_slices`` int4 slices concatenated along K."""

    packed: torch.Tensor  # uint8 [n, num_slices * k / 2], the kernel's tile layout
    scale_zero: torch.Tensor  # bfloat16 [num_slices * k / 32, n, 2]
    n: int
    k: int
    num_slices: int

    @property
    def nbytes(self) -> int:
        return self.packed.numel() + self.scale_zero.numel() * 2

    def mm_small(self, xb: torch.Tensor) -> torch.Tensor:
        """``xb`` bfloat16 ``[m, k]`` -> bfloat16 ``[m, n]`` with the int4 kernel."""
        if self.num_slices > 1:
            xb = xb.repeat(1, self.num_slices)
        elif not xb.is_contiguous():
            xb = xb.contiguous()
        return _INT4PACK_MM(xb, self.packed, GROUP, self.scale_zero)

    def dequant_t(self, layout: tuple[int, bool], start: int = 0, end: int | None = None) -> torch.Tensor:
        """Rows ``start:end`` of the weight, transposed: bfloat16 ``[k, end - start]`` (a transient
        for large batches). Each element is the kernel's ``sum((nib - 8) * scale + zero)`` over
        the slices, rounded once. ``start`` must be a multiple of the layout's row block."""
        end = self.n if end is None else end
        ns, k, n = self.num_slices, self.k, end - start
        g = k // GROUP
        kk = ns * k
        q = _decode_packed(self.packed.view(-1)[start * kk // 2 : end * kk // 2], n, kk, *layout)
        # contiguous copies (small): broadcasting strided operands takes a slow scalar path
        s = self.scale_zero[:, start:end, 0].contiguous()
        z = self.scale_zero[:, start:end, 1].contiguous()
        if ns == 1:
            codes = q.view(torch.int8).sub_(8)
        else:
            # hi slice: scale 16*s_lo exactly (a power-of-two multiple survives bfloat16), zero 0,
            # so (hi-8)*16s + (lo-8)*s + z = (16*hi + lo - 136)*s + z: one affine map, exact codes.
            codes = torch.addcmul(q[k:].to(torch.int16) - 136, q[:k].to(torch.int16), _SIXTEEN)
            s, z = s[g:], z[g:]
        codes = codes.view(g, GROUP, n)
        return torch.addcmul(z.view(g, 1, n), codes, s.view(g, 1, n)).view(k, n)

    def mm_dequant(self, xb: torch.Tensor, layout: tuple[int, bool]) -> torch.Tensor:
        """``xb`` bfloat16 ``[m, k]`` -> bfloat16 ``[m, n]``: dequantize a band of rows at a time
        (about ``DEQUANT_CHUNK_BYTES``, so the transients stay in cache) and GEMM it."""
        rows = max(64, DEQUANT_CHUNK_BYTES // (2 * self.k * self.num_slices) // 64 * 64)
        if rows >= self.n:
            return xb @ self.dequant_t(layout)
        return torch.cat([xb @ self.dequant_t(layout, i, min(i + rows, self.n)) for i in range(0, self.n, rows)], 1)

    def matmul(self, x2: torch.Tensor, dequant_min_rows: int) -> torch.Tensor:
        """``x2 [m, k]`` (any float dtype) -> bfloat16 ``[m, n]``; from ``dequant_min_rows`` rows on
        by dequantizing to bfloat16 and a GEMM (``CpuOptions.dequant_min_rows``)."""
        xb = x2 if x2.dtype == torch.bfloat16 else x2.to(torch.bfloat16)
        if x2.shape[0] >= dequant_min_rows:
            layout = packed_layout()
            if layout is not None:
                return self.mm_dequant(xb, layout)
        return self.mm_small(xb)


def repack_int4(raw: torch.Tensor, qtype: GGMLQuantizationType, n: int, k: int) -> Int4Weight:
    """Repack GGUF rows ``raw`` (uint8 ``[n, bytes_per_row]``) for the int4 kernel.

    Works through ``REPACK_CHUNK_ROWS`` rows at a time so temporaries stay small.
    """
    type_size = GGML_QUANT_SIZES[qtype][1]
    packed_parts, sz_parts = [], []
    num_slices = 1
    for start in range(0, n, REPACK_CHUNK_ROWS):
        rows = raw[start : start + REPACK_CHUNK_ROWS]
        r = rows.shape[0]
        blocks = rows.contiguous().view(-1, type_size)
        q, bits, s, z = affine_fields(blocks, qtype)
        q = q.reshape(r, k)
        s = s.reshape(r, k // GROUP)
        z = z.reshape(r, k // GROUP)
        slices = int4_slices(q, bits, s, z)
        num_slices = len(slices)
        codes = torch.cat([c for c, _, _ in slices], dim=1).to(torch.int32)
        packed_parts.append(torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 2))
        scale = torch.cat([sc for _, sc, _ in slices], dim=1)
        zero = torch.cat([zr for _, _, zr in slices], dim=1)
        sz_parts.append(torch.stack([scale.t(), zero.t()], dim=-1).to(torch.bfloat16))
    packed = packed_parts[0] if len(packed_parts) == 1 else torch.cat(packed_parts, dim=0)
    scale_zero = sz_parts[0] if len(sz_parts) == 1 else torch.cat(sz_parts, dim=1)
    return Int4Weight(packed, scale_zero.contiguous(), n, k, num_slices)
