"""GGUF blocks decoded inside Triton kernels, in their file layout: :func:`block_parts` (one block
type's codes, scale and offset on a ``[rows, sub-blocks, elements]`` tile), :func:`dequant_tile` (a
weight tile as float32) and :func:`mma` (``tl.dot`` with float32 accumulation). The matmuls that use
them are :mod:`localllm.kernels.triton.quant`'s (which explains the scheme); attention uses
:func:`mma`.
"""

from __future__ import annotations

import triton
import triton.language as tl
from gguf import GGMLQuantizationType

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
def block_parts(row, sub, j, QTYPE: tl.constexpr):
    """Decode part of a row of GGUF blocks.

    ``row``: byte pointers to the rows, ``[BN, 1, 1]`` (float16/bfloat16 pointers for F16/BF16,
    see :func:`_weight_arg`); ``sub``: sub-block index within the row,
    ``[1, G, 1]``; ``j``: element within the sub-block, ``[1, 1, SUB]``. Returns ``(q, scale,
    offset)``: ``q`` float32 ``[BN, G, SUB]`` and ``scale``/``offset`` ``[BN, G, 1]`` with
    ``w = scale * q + offset`` (``offset`` is zeros for types without a min, unused there). Byte layouts:
    ggml's ``block_*`` structs, as in ``localllm/quant/gguf_dequant.py``.
    """
    if QTYPE == _F16 or QTYPE == _BF16:  # the file's values (``row``: a typed pointer), scale 1
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
):
    """Weights of ``BLOCK_N`` rows (``row``: ``[BLOCK_N, 1, 1]`` pointers) at elements
    ``k0 .. k0 + BLOCK_K`` as float32 ``[BLOCK_N, BLOCK_K]`` (sub-blocks past ``num_sub`` read
    the last one; callers mask them through ``x``)."""
    G: tl.constexpr = BLOCK_K // SUB
    sub = tl.minimum(k0 // SUB + tl.arange(0, G), num_sub - 1)[None, :, None]
    j = tl.arange(0, SUB)[None, None, :]
    q, sc, off = block_parts(row, sub, j, QTYPE)
    if HAS_OFFSET:
        w = sc * q + off
    else:
        w = sc * q
    return tl.reshape(w, (BLOCK_N, BLOCK_K))
