"""GGUF blocks decoded inside Triton kernels, in their file layout: :func:`block_parts` (one block
type's codes, scale and offset on a ``[rows, sub-blocks, elements]`` tile), :func:`dequant_tile` (a
weight tile as float32) and :func:`mma` (``tl.dot`` with float32 accumulation). The matmuls that use
them are :mod:`localllm.kernels.triton.quant`'s (which explains the scheme); attention uses
:func:`mma`.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from gguf import GGMLQuantizationType

from localllm.quant.grids import GRIDS, IQ1_DELTA
from localllm.quant.traits import CODEBOOKS

T = GGMLQuantizationType

# Types whose block fields the kernels read as aligned 32-bit words (block sizes of 144 and 176
# bytes): their weight bytes must start 4-byte aligned, as a GPU copy always does (256) and a GGUF
# file's tensors do at its default alignment of 32 (a file written with less reaches the kernels
# only through the interpreter, where `quant_matmul` refuses it and the torch kernels take over).
WORD_ALIGNED_TYPES = frozenset({T.Q4_K, T.Q5_K})

# The block types' codes, as constexprs the kernels compare QTYPE with.
_Q4_0, _Q4_1, _Q5_0, _Q5_1, _Q8_0, _Q2_K, _Q3_K, _Q4_K, _Q5_K, _Q6_K, _F16, _BF16, _MXFP4, _IQ4_NL, _IQ4_XS = (
    tl.constexpr(int(t))
    for t in (T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K, T.F16, T.BF16,
              T.MXFP4, T.IQ4_NL, T.IQ4_XS)
)
_IQ2_XXS, _IQ2_XS, _IQ2_S, _IQ3_XXS, _IQ3_S, _IQ1_S, _IQ1_M, _TQ1_0, _TQ2_0 = (
    tl.constexpr(int(t)) for t in (T.IQ2_XXS, T.IQ2_XS, T.IQ2_S, T.IQ3_XXS, T.IQ3_S, T.IQ1_S, T.IQ1_M, T.TQ1_0,
                                   T.TQ2_0))
_IQ1_DELTA = tl.constexpr(IQ1_DELTA)


@functools.cache
def _grid_on(qtype: GGMLQuantizationType, device: torch.device) -> torch.Tensor:
    points = GRIDS.get(qtype)
    if points is None:
        return torch.zeros(1, dtype=torch.int8, device=device)
    return torch.from_numpy(points.reshape(-1).copy()).to(device)


def grid_arg(qtype: GGMLQuantizationType | int, device: torch.device | str) -> torch.Tensor:
    """The kernels' ``grid`` argument for ``qtype``: a lattice type's grid points (int8, point after
    point: :data:`localllm.quant.grids.GRIDS`, the one table), one byte for the others (kept per
    device)."""
    return _grid_on(GGMLQuantizationType(qtype), torch.device(device))


def _codebook_words(qtype: GGMLQuantizationType) -> tuple[tl.constexpr, ...]:
    """``qtype``'s 16 int8 codebook values (:data:`~localllm.quant.traits.CODEBOOKS`) as four
    little-endian 32-bit words, value ``c`` in byte ``c % 4`` of word ``c // 4``."""
    table = bytes(v & 255 for v in CODEBOOKS[qtype])
    return tuple(tl.constexpr(int.from_bytes(table[i : i + 4], "little")) for i in range(0, 16, 4))


_MXFP4_W0, _MXFP4_W1, _MXFP4_W2, _MXFP4_W3 = _codebook_words(T.MXFP4)
_IQ4NL_W0, _IQ4NL_W1, _IQ4NL_W2, _IQ4NL_W3 = _codebook_words(T.IQ4_NL)


@triton.jit
def _f16_at(p):
    """The little-endian fp16 at byte pointer(s) ``p``, as float32 (unaligned-safe)."""
    lo = tl.load(p).to(tl.uint16)
    hi = tl.load(p + 1).to(tl.uint16)
    return (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _word_at(p):
    """The little-endian 32-bit word at byte pointer(s) ``p``, which must be 4-byte aligned
    (:data:`WORD_ALIGNED_TYPES`). One 4-byte load: the software pipeliner streams it ahead of the
    loop like the codes, where 1- and 2-byte loads (too narrow for ``cp.async``) stall every
    iteration on a GPU."""
    return tl.load(p.to(tl.pointer_type(tl.uint32)))


@triton.jit
def _f16_in(word, high: tl.constexpr):
    """The fp16 in the low (or ``high``) half of 32-bit ``word``, as float32."""
    half = (word >> 16) if high else (word & 0xFFFF)
    return half.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _codebook_value(code, W0: tl.constexpr, W1: tl.constexpr, W2: tl.constexpr, W3: tl.constexpr):
    """The int8 value that 4-bit ``code`` names in the codebook held in words ``W0..W3`` (see
    :func:`_codebook_words`), as float32: its word picked by three selects, its byte shifted out.
    (Integer registers only: no table in memory for the kernel to read.)"""
    code = code.to(tl.uint32)
    word = tl.where(code < 8, tl.where(code < 4, W0, W1), tl.where(code < 12, W2, W3)).to(tl.uint32)
    byte = (word >> ((code & 3) * 8)) & 255
    return byte.to(tl.uint8).to(tl.int8, bitcast=True).to(tl.float32)


@triton.jit
def _e8m0_half(e):
    """ggml's ``ggml_e8m0_to_fp32_half`` of E8M0 byte(s) ``e``: ``2 ** (e - 128)`` built as float32
    bits (a subnormal for ``e < 2``), as the reference's ``e8m0_half``."""
    e = e.to(tl.uint32)
    bits = tl.where(e < 2, 0x00200000 << e, (e - 1) << 23)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _k_scale_offset(blk, i):
    """Scale and offset of sub-block ``i`` (0..7) of the Q4_K/Q5_K block at ``blk`` (``d`` fp16 |
    ``dmin`` fp16 | six-bit scales and mins in 12 bytes): ``d * scale`` and ``-(dmin * min)``.
    The block's first 16 bytes are read as four words (blocks of 144 and 176 bytes keep them
    aligned); byte ``t = i % 4`` of words 1, 2 and 3 is what sub-blocks ``t`` and ``t + 4`` use."""
    d_dmin = _word_at(blk)
    shift = ((i & 3) * 8).to(tl.uint32)
    a = (_word_at(blk + 4) >> shift) & 255  # scale byte t: 6-bit scale t, high bits of scale t+4
    b = (_word_at(blk + 8) >> shift) & 255  # byte 4+t: 6-bit min t, high bits of min t+4
    c = (_word_at(blk + 12) >> shift) & 255  # byte 8+t: low nibbles of scale and min t+4
    lo = i < 4
    sc = tl.where(lo, a & 63, (c & 15) | ((a >> 6) << 4))
    mn = tl.where(lo, b & 63, (c >> 4) | ((b >> 6) << 4))
    return _f16_in(d_dmin, False) * sc.to(tl.float32), -(_f16_in(d_dmin, True) * mn.to(tl.float32))


@triton.jit
def _byte(p):
    return tl.load(p).to(tl.int32)


@triton.jit
def _sign_bit(s7, b):
    """Bit ``b`` (0-7) of the sign byte of 7-bit ksigns index ``s7``: its bit, or (bit 7) the
    parity of its seven bits (``ksigns_iq2xs``)."""
    p = s7 ^ (s7 >> 4)
    p = p ^ (p >> 2)
    p = (p ^ (p >> 1)) & 1
    return tl.where(b < 7, (s7 >> tl.minimum(b, 6)) & 1, p)


@triton.jit
def _signed(value, neg):
    return tl.where(neg != 0, -value, value).to(tl.float32)


@triton.jit
def _odd_scale(d, sc, div: tl.constexpr):
    """``d (sc + 1/2) / div``, as the reference's ``d * (0.5 + sc) * (1 / div)``."""
    return d * (0.5 + sc.to(tl.float32)) * (1.0 / div)


@triton.jit
def _lattice_parts(row, sub, j, grid, QTYPE: tl.constexpr):
    """:func:`block_parts` of the lattice (IQ2, IQ3, IQ1) and ternary types; ``grid``: the type's
    grid points (int8, :data:`localllm.quant.grids.GRIDS`, row after row)."""
    if QTYPE == _IQ2_XXS:  # d | per 32: 4 index bytes, a u32 of 4 x 7 sign bits and sc << 28 (sub 32)
        base = row + (sub >> 3) * 66
        blk = base + 2 + (sub & 7) * 8
        point = j >> 3
        idx = _byte(blk + point)
        at = point * 7  # (the sign index's first bit in the u32)
        s7 = ((_byte(blk + 4 + (at >> 3)) | (_byte(blk + 5 + (at >> 3)) << 8)) >> (at & 7)) & 127
        sc = _byte(blk + 7) >> 4
        value = tl.load(grid + idx * 8 + (j & 7)).to(tl.int32)
        d = _f16_at(base)
        return _signed(value, _sign_bit(s7, j & 7)), _odd_scale(d, sc, 4), tl.zeros_like(d)
    elif QTYPE == _IQ2_XS:  # d | qs u16[32] (9-bit index, 7 sign bits) | scales[8] (a nibble a 16)
        base = row + (sub >> 4) * 74
        i = sub & 15
        q = _byte(base + 2 + (2 * i + (j >> 3)) * 2) | (_byte(base + 3 + (2 * i + (j >> 3)) * 2) << 8)
        sc = (_byte(base + 66 + (i >> 1)) >> ((i & 1) * 4)) & 15
        value = tl.load(grid + (q & 511) * 8 + (j & 7)).to(tl.int32)
        d = _f16_at(base)
        return _signed(value, _sign_bit(q >> 9, j & 7)), _odd_scale(d, sc, 4), tl.zeros_like(d)
    elif QTYPE == _IQ2_S:  # d | qs[32] | signs[32] | qh[8] (2 bits an index) | scales[8] (a nibble a 16)
        base = row + (sub >> 4) * 82
        i = sub & 15
        point = 2 * i + (j >> 3)
        idx = _byte(base + 2 + point) | (((_byte(base + 66 + (point >> 2)) >> ((point & 3) * 2)) & 3) << 8)
        neg = (_byte(base + 34 + point) >> (j & 7)) & 1
        sc = (_byte(base + 74 + (i >> 1)) >> ((i & 1) * 4)) & 15
        value = tl.load(grid + idx * 8 + (j & 7)).to(tl.int32)
        d = _f16_at(base)
        return _signed(value, neg), _odd_scale(d, sc, 4), tl.zeros_like(d)
    elif QTYPE == _IQ3_XXS:  # d | qs[64] (an index a 4) | per 32 a u32 of 4 x 7 sign bits and sc << 28
        base = row + (sub >> 3) * 98
        i = sub & 7
        point = j >> 2
        idx = _byte(base + 2 + i * 8 + point)
        w = base + 66 + i * 4
        half = point >> 1  # (the sign index of this pair of points)
        s7 = ((_byte(w + (half * 7 >> 3)) | (_byte(w + (half * 7 >> 3) + 1) << 8)) >> ((half * 7) & 7)) & 127
        sc = _byte(w + 3) >> 4
        value = tl.load(grid + idx * 4 + (j & 3)).to(tl.int32)
        d = _f16_at(base)
        return _signed(value, _sign_bit(s7, (point & 1) * 4 + (j & 3))), _odd_scale(d, sc, 2), tl.zeros_like(d)
    elif QTYPE == _IQ3_S:  # d | qs[64] | qh[8] (a bit an index) | signs[32] | scales[4] (a nibble a 32)
        base = row + (sub >> 3) * 110
        i = sub & 7
        point = j >> 2
        idx = _byte(base + 2 + i * 8 + point) | (((_byte(base + 66 + i) >> point) & 1) << 8)
        neg = (_byte(base + 74 + i * 4 + (point >> 1)) >> ((point & 1) * 4 + (j & 3))) & 1
        sc = (_byte(base + 106 + (i >> 1)) >> ((i & 1) * 4)) & 15
        value = tl.load(grid + idx * 4 + (j & 3)).to(tl.int32)
        d = _f16_at(base)
        return _signed(value, neg), d * (1 + 2 * sc).to(tl.float32), tl.zeros_like(d)
    elif QTYPE == _IQ1_S:  # d | qs[32] | qh u16[8] (per 32: 4 x 3 high index bits, sc at 12, delta's sign at 15)
        base = row + (sub >> 3) * 50
        i = sub & 7
        point = j >> 3
        qh = _byte(base + 34 + 2 * i) | (_byte(base + 35 + 2 * i) << 8)
        idx = _byte(base + 2 + i * 4 + point) | (((qh >> (3 * point)) & 7) << 8)
        delta = tl.where((qh & 0x8000) != 0, -_IQ1_DELTA, _IQ1_DELTA)
        value = tl.load(grid + idx * 8 + (j & 7)).to(tl.float32)
        d = _f16_at(base) * (2 * ((qh >> 12) & 7) + 1).to(tl.float32)
        return value + delta, d, tl.zeros_like(d)
    elif QTYPE == _IQ1_M:  # qs[32] | qh[16] (a nibble a point: 3 index bits, delta's sign) | scales u16[4] (sub 16)
        base = row + (sub >> 4) * 56
        i = sub & 15
        point = 2 * i + (j >> 3)
        nib = (_byte(base + 32 + (point >> 1)) >> ((point & 1) * 4)) & 15
        idx = _byte(base + point) | ((nib & 7) << 8)
        delta = tl.where((nib & 8) != 0, -_IQ1_DELTA, _IQ1_DELTA)
        s01 = _byte(base + 48) | (_byte(base + 49) << 8)
        s23 = _byte(base + 50) | (_byte(base + 51) << 8)
        s45 = _byte(base + 52) | (_byte(base + 53) << 8)
        s67 = _byte(base + 54) | (_byte(base + 55) << 8)
        d_bits = (s01 >> 12) | ((s23 >> 12) << 4) | ((s45 >> 12) << 8) | ((s67 >> 12) << 12)
        d = d_bits.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
        word = _byte(base + 48 + (i >> 2) * 2) | (_byte(base + 49 + (i >> 2) * 2) << 8)
        sc = (word >> ((i & 3) * 3)) & 7
        value = tl.load(grid + idx * 8 + (j & 7)).to(tl.float32)
        return value + delta, d * (2 * sc + 1).to(tl.float32), tl.zeros_like(d)
    elif QTYPE == _TQ1_0:  # qs[48] | qh[4] | d: 5 (qh: 4) base-3 digits a byte, as fractions of 243 (sub 32)
        base = row + (sub >> 3) * 54
        e = (sub & 7) * 32 + j
        # element e: byte e % 32 digit e // 32 (the first 160), byte 32 + (e - 160) % 16 digit
        # (e - 160) // 16 (the next 80), qh byte (e - 240) % 4 digit (e - 240) // 4 (the last 16)
        first = e < 160
        second = (e >= 160) & (e < 240)
        byte_at = tl.where(first, e & 31, tl.where(second, 32 + ((e - 160) & 15), 48 + ((e - 240) & 3)))
        digit = tl.where(first, e >> 5, tl.where(second, (e - 160) >> 4, (e - 240) >> 2))
        pow3 = tl.where(digit == 0, 1, tl.where(digit == 1, 3, tl.where(digit == 2, 9, tl.where(digit == 3, 27, 81))))
        q = ((_byte(base + byte_at) * pow3) & 255) * 3 >> 8
        d = _f16_at(base + 52)
        return (q - 1).to(tl.float32), d, tl.zeros_like(d)
    else:  # TQ2_0: qs[64] (2-bit codes, Q2_K's "shift by 0, 2, 4, 6" layout) | d (sub 32)
        tl.static_assert(QTYPE == _TQ2_0)
        base = row + (sub >> 3) * 66
        e = (sub & 7) * 32 + j
        q = (_byte(base + (e >> 7) * 32 + (e & 31)) >> (((e & 127) >> 5) * 2)) & 3
        d = _f16_at(base + 64)
        return (q - 1).to(tl.float32), d, tl.zeros_like(d)


@triton.jit
def block_parts(row, sub, j, QTYPE: tl.constexpr, grid):
    """Decode part of a row of GGUF blocks.

    ``row``: byte pointers to the rows, ``[BN, 1, 1]`` (float16/bfloat16 pointers for F16/BF16,
    see :func:`_weight_arg`); ``sub``: sub-block index within the row,
    ``[1, G, 1]``; ``j``: element within the sub-block, ``[1, 1, SUB]``; ``grid``: a lattice type's
    grid points (int8, see :func:`grid_arg`; any pointer for the other types). Returns ``(q, scale,
    offset)``: ``q`` float32 ``[BN, G, SUB]`` and ``scale``/``offset`` ``[BN, G, 1]`` with
    ``w = scale * q + offset`` (``offset`` is zeros for types without a min, unused there). Byte layouts:
    ggml's ``block_*`` structs, as in ``localllm/quant/gguf_dequant.py``.
    """
    if (QTYPE == _IQ2_XXS or QTYPE == _IQ2_XS or QTYPE == _IQ2_S or QTYPE == _IQ3_XXS or QTYPE == _IQ3_S
            or QTYPE == _IQ1_S or QTYPE == _IQ1_M or QTYPE == _TQ1_0 or QTYPE == _TQ2_0):
        return _lattice_parts(row, sub, j, grid, QTYPE)
    elif QTYPE == _F16 or QTYPE == _BF16:  # the file's values (``row``: a typed pointer), scale 1
        q = tl.load(row + sub * 32 + j).to(tl.float32)  # 32 contiguous values: vectorized loads
        one = tl.full((q.shape[0], q.shape[1], 1), 1.0, tl.float32)
        return q, one, tl.zeros_like(one)
    elif QTYPE == _Q8_0:  # d fp16 | qs int8[32]
        blk = row + sub * 34
        d = _f16_at(blk)
        q = tl.load(blk + 2 + j).to(tl.int8, bitcast=True).to(tl.float32)
        return q, d, tl.zeros_like(d)
    elif QTYPE == _Q4_0:  # d fp16 | qs[16]: element j in the low nibble of byte j, j+16 high
        blk = row + sub * 18
        d = _f16_at(blk)
        nib = (tl.load(blk + 2 + (j & 15)) >> ((j >> 4) * 4)) & 15
        return nib.to(tl.float32) - 8, d, tl.zeros_like(d)
    elif QTYPE == _Q4_1:  # d fp16 | m fp16 | qs[16]
        blk = row + sub * 20
        nib = (tl.load(blk + 4 + (j & 15)) >> ((j >> 4) * 4)) & 15
        return nib.to(tl.float32), _f16_at(blk), _f16_at(blk + 2)
    elif QTYPE == _Q5_0:  # d fp16 | qh u32 (bit j: 5th bit of element j) | qs[16]
        blk = row + sub * 22
        d = _f16_at(blk)
        hb = (tl.load(blk + 2 + (j >> 3)) >> (j & 7)) & 1
        nib = (tl.load(blk + 6 + (j & 15)) >> ((j >> 4) * 4)) & 15
        return (nib | (hb << 4)).to(tl.float32) - 16, d, tl.zeros_like(d)
    elif QTYPE == _Q5_1:  # d fp16 | m fp16 | qh u32 | qs[16]
        blk = row + sub * 24
        hb = (tl.load(blk + 4 + (j >> 3)) >> (j & 7)) & 1
        nib = (tl.load(blk + 8 + (j & 15)) >> ((j >> 4) * 4)) & 15
        return (nib | (hb << 4)).to(tl.float32), _f16_at(blk), _f16_at(blk + 2)
    elif QTYPE == _Q2_K:  # scales[16] (lo: scale, hi: min) | qs[64] | d fp16 | dmin fp16
        blk = row + (sub >> 4) * 84
        i = sub & 15
        e = i * 16 + j
        sc = tl.load(blk + i)
        dl = _f16_at(blk + 80) * (sc & 15).to(tl.float32)
        ml = _f16_at(blk + 82) * (sc >> 4).to(tl.float32)
        q = (tl.load(blk + 16 + (e >> 7) * 32 + (e & 31)) >> (((e & 127) >> 5) * 2)) & 3
        return q.to(tl.float32), dl, -ml
    elif QTYPE == _Q3_K:  # hmask[32] | qs[64] | scales[12] (6-bit, biased by 32) | d fp16
        blk = row + (sub >> 4) * 110
        i = sub & 15
        e = i * 16 + j
        low = (tl.load(blk + 96 + (i & 7)) >> ((i >> 3) * 4)) & 15
        high = (tl.load(blk + 104 + (i & 3)) >> ((i >> 2) * 2)) & 3
        dl = _f16_at(blk + 108) * ((low | (high << 4)).to(tl.float32) - 32)
        ql = (tl.load(blk + 32 + (e >> 7) * 32 + (e & 31)) >> (((e & 127) >> 5) * 2)) & 3
        hb = (tl.load(blk + (e & 31)) >> (e >> 5)) & 1  # a cleared bit means "subtract 4"
        return ql.to(tl.float32) - ((hb ^ 1) << 2).to(tl.float32), dl, tl.zeros_like(dl)
    elif QTYPE == _Q4_K:  # d fp16 | dmin fp16 | scales[12] | qs[128]
        blk = row + (sub >> 3) * 144
        i = sub & 7
        dl, off = _k_scale_offset(blk, i)
        nib = (tl.load(blk + 16 + (i >> 1) * 32 + j) >> ((i & 1) * 4)) & 15
        return nib.to(tl.float32), dl, off
    elif QTYPE == _Q5_K:  # d fp16 | dmin fp16 | scales[12] | qh[32] | qs[128]
        blk = row + (sub >> 3) * 176
        i = sub & 7
        dl, off = _k_scale_offset(blk, i)
        nib = (tl.load(blk + 48 + (i >> 1) * 32 + j) >> ((i & 1) * 4)) & 15
        hb = (tl.load(blk + 16 + j) >> i) & 1
        return (nib | (hb << 4)).to(tl.float32), dl, off
    elif QTYPE == _MXFP4:  # e (E8M0) | qs[16]: element j in the low nibble of byte j, j+16 high
        blk = row + sub * 17
        d = _e8m0_half(tl.load(blk))
        nib = (tl.load(blk + 1 + (j & 15)) >> ((j >> 4) * 4)) & 15
        return _codebook_value(nib, _MXFP4_W0, _MXFP4_W1, _MXFP4_W2, _MXFP4_W3), d, tl.zeros_like(d)
    elif QTYPE == _IQ4_NL:  # d fp16 | qs[16] (as Q4_0's), each code naming a codebook value
        blk = row + sub * 18
        d = _f16_at(blk)
        nib = (tl.load(blk + 2 + (j & 15)) >> ((j >> 4) * 4)) & 15
        return _codebook_value(nib, _IQ4NL_W0, _IQ4NL_W1, _IQ4NL_W2, _IQ4NL_W3), d, tl.zeros_like(d)
    elif QTYPE == _IQ4_XS:  # d fp16 | scales_h u16 | scales_l[4] | qs[128] (16 bytes a 32-group)
        blk = row + (sub >> 3) * 136
        i = sub & 7
        low = (tl.load(blk + 4 + (i >> 1)) >> ((i & 1) * 4)) & 15
        high = (tl.load(blk + 2 + (i >> 2)) >> ((i & 3) * 2)) & 3
        dl = _f16_at(blk) * ((low | (high << 4)).to(tl.float32) - 32)
        nib = (tl.load(blk + 8 + i * 16 + (j & 15)) >> ((j >> 4) * 4)) & 15
        return _codebook_value(nib, _IQ4NL_W0, _IQ4NL_W1, _IQ4NL_W2, _IQ4NL_W3), dl, tl.zeros_like(dl)
    else:  # Q6_K: ql[128] | qh[64] | scales int8[16] | d fp16
        tl.static_assert(QTYPE == _Q6_K)
        blk = row + (sub >> 4) * 210
        i = sub & 15
        e = i * 16 + j
        dl = _f16_at(blk + 208) * tl.load(blk + 192 + i).to(tl.int8, bitcast=True).to(tl.float32)
        g = e >> 7
        low = (tl.load(blk + g * 64 + (e & 63)) >> (((e & 127) >> 6) * 4)) & 15
        high = (tl.load(blk + 128 + g * 32 + (e & 31)) >> (((e & 127) >> 5) * 2)) & 3
        return (low | (high << 4)).to(tl.float32) - 32, dl, tl.zeros_like(dl)


@triton.jit
def mma(a, b, DOT_PREC: tl.constexpr):
    """``tl.dot(a, b)`` in float32 accumulation; ``DOT_PREC == "upcast"`` computes it in float32
    (the interpreter's bfloat16 ``tl.dot`` is broken; values are the same after the upcast)."""
    if DOT_PREC == "upcast":
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b, input_precision=DOT_PREC)


@triton.jit
def dequant_tile(
    row,
    k0,
    num_sub,
    QTYPE: tl.constexpr,
    SUB: tl.constexpr,
    HAS_OFFSET: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    grid,
):
    """Weights of ``BLOCK_N`` rows (``row``: ``[BLOCK_N, 1, 1]`` pointers) at elements
    ``k0 .. k0 + BLOCK_K`` as float32 ``[BLOCK_N, BLOCK_K]`` (sub-blocks past ``num_sub`` read
    the last one; callers mask them through ``x``)."""
    G: tl.constexpr = BLOCK_K // SUB
    sub = tl.minimum(k0 // SUB + tl.arange(0, G), num_sub - 1)[None, :, None]
    j = tl.arange(0, SUB)[None, None, :]
    q, sc, off = block_parts(row, sub, j, QTYPE, grid)
    if HAS_OFFSET:
        w = sc * q + off
    else:
        w = sc * q
    return tl.reshape(w, (BLOCK_N, BLOCK_K))
