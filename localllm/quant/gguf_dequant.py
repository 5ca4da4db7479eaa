"""Pure-torch dequantizers for GGUF tensor types: the reference path.

Each block decoder takes ``blocks``, a uint8 tensor ``[n_blocks, type_size]``, and returns
float32 ``[n_blocks, block_size]``. The byte layouts follow ggml's ``block_*`` structs
(``ggml-common.h``), all little-endian. The arithmetic keeps the same float32 operation order
as ``gguf.quants`` so that results are bit-exact against it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from gguf import GGML_QUANT_SIZES, QK_K, GGMLQuantizationType

from localllm.errors import ModelLoadError
from localllm.quant.grids import IQ1_DELTA, grid_values, ksign_values
from localllm.quant.traits import CODEBOOKS

T = GGMLQuantizationType

FLOAT_QTYPES: frozenset[GGMLQuantizationType] = frozenset({T.F32, T.F16, T.BF16})

_FLOAT_DTYPES = {T.F32: torch.float32, T.F16: torch.float16, T.BF16: torch.bfloat16}


def _f16(blocks: torch.Tensor, offset: int) -> torch.Tensor:
    """The fp16 field at byte ``offset`` of every block, as float32 ``[n_blocks, 1]``."""
    return blocks[:, offset : offset + 2].contiguous().view(torch.float16).float()


def _shifts(like: torch.Tensor, *values: int) -> torch.Tensor:
    """Shift amounts as uint8 on ``like``'s device (the bytes may sit on a GPU)."""
    return torch.tensor(values, dtype=torch.uint8, device=like.device)


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """``[n, k]`` bytes -> ``[n, 2k]``: the k low nibbles, then the k high nibbles."""
    return torch.cat([qs & 0x0F, qs >> 4], dim=-1)


def _bits(qh: torch.Tensor) -> torch.Tensor:
    """``[n, 4]`` bytes holding a little-endian uint32 -> ``[n, 32]`` bits, bit 0 first."""
    return ((qh.unsqueeze(-1) >> _shifts(qh, *range(8))) & 1).reshape(qh.shape[0], 32)


def _crumbs(qs: torch.Tensor, width: int) -> torch.Tensor:
    """2-bit fields: ``[n, g*width]`` bytes -> ``[n, g, 4, width]``; element (g, s, j) is
    bits 2s..2s+1 of byte g*width + j (the Q2_K/Q3_K/Q6_K "shift by 0, 2, 4, 6" layout)."""
    n = qs.shape[0]
    return (qs.reshape(n, -1, 1, width) >> _shifts(qs, 0, 2, 4, 6).view(1, 1, 4, 1)) & 3


def _plane_bits(hmask: torch.Tensor) -> torch.Tensor:
    """``[n, 32]`` bytes -> ``[n, 8, 32]``; element (b, j) is bit b of byte j."""
    return (hmask.unsqueeze(1) >> _shifts(hmask, *range(8)).view(1, 8, 1)) & 1


def _q8_0(blocks: torch.Tensor) -> torch.Tensor:
    # block_q8_0: d fp16 | qs int8[32]
    d = _f16(blocks, 0)
    x = blocks[:, 2:].contiguous().view(torch.int8).float()
    return x * d


def _q4_0(blocks: torch.Tensor) -> torch.Tensor:
    # block_q4_0: d fp16 | qs[16] (element j in the low nibble of byte j, j+16 in the high)
    d = _f16(blocks, 0)
    q = _nibbles(blocks[:, 2:]).float() - 8
    return d * q


def _q4_1(blocks: torch.Tensor) -> torch.Tensor:
    # block_q4_1: d fp16 | m fp16 | qs[16]
    d, m = _f16(blocks, 0), _f16(blocks, 2)
    q = _nibbles(blocks[:, 4:]).float()
    return d * q + m


def _q5_0(blocks: torch.Tensor) -> torch.Tensor:
    # block_q5_0: d fp16 | qh uint32 (5th bit of element j is bit j) | qs[16]
    d = _f16(blocks, 0)
    q = _nibbles(blocks[:, 6:]) | (_bits(blocks[:, 2:6]) << 4)
    return d * (q.float() - 16)


def _q5_1(blocks: torch.Tensor) -> torch.Tensor:
    # block_q5_1: d fp16 | m fp16 | qh uint32 | qs[16]
    d, m = _f16(blocks, 0), _f16(blocks, 2)
    q = _nibbles(blocks[:, 8:]) | (_bits(blocks[:, 4:8]) << 4)
    return d * q.float() + m


def _q2_k(blocks: torch.Tensor) -> torch.Tensor:
    # block_q2_K: scales[16] (low nibble scale, high nibble min) | qs[64] | d fp16 | dmin fp16
    n = blocks.shape[0]
    scales = blocks[:, :16]
    d, dmin = _f16(blocks, 80), _f16(blocks, 82)
    dl = (d * (scales & 0x0F).float()).view(n, 16, 1)
    ml = (dmin * (scales >> 4).float()).view(n, 16, 1)
    q = _crumbs(blocks[:, 16:80], 32).reshape(n, 16, 16).float()
    return (dl * q - ml).reshape(n, QK_K)


def _q3_k(blocks: torch.Tensor) -> torch.Tensor:
    # block_q3_K: hmask[32] | qs[64] | scales[12] (16 x 6-bit, biased by 32) | d fp16
    n = blocks.shape[0]
    hmask, qs, scales = blocks[:, :32], blocks[:, 32:96], blocks[:, 96:108]
    d = _f16(blocks, 108)
    # Scale i: low 4 bits from nibble i of bytes 0..7 (all low nibbles first), high 2 bits
    # from 2-bit field i // 4 of byte 8 + i % 4.
    low = _nibbles(scales[:, :8])
    high = ((scales[:, 8:12].unsqueeze(1) >> _shifts(scales, 0, 2, 4, 6).view(1, 4, 1)) & 3).reshape(n, 16)
    sc = (low | (high << 4)).float() - 32
    dl = (d * sc).view(n, 16, 1)
    ql = _crumbs(qs, 32).reshape(n, 16, 16)
    # A cleared hmask bit means "subtract 4".
    qh = _plane_bits(hmask).reshape(n, 16, 16) ^ 1
    q = ql.float() - (qh << 2).float()
    return (dl * q).reshape(n, QK_K)


def _k_scale_min(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Unpack the 12-byte Q4_K/Q5_K field into 8 six-bit scales and 8 six-bit mins."""
    d, m, md = scales[:, 0:4], scales[:, 4:8], scales[:, 8:12]
    sc = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mn = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc, mn


def _k_groups(blocks: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Q4_K/Q5_K weights from their codes ``q [n, 8, 32]``: ``d * scale * q - dmin * min`` per 32-group
    (the block begins d fp16 | dmin fp16 | scales[12])."""
    n = blocks.shape[0]
    sc, mn = _k_scale_min(blocks[:, 4:16])
    dl = (_f16(blocks, 0) * sc.float()).view(n, 8, 1)
    ml = (_f16(blocks, 2) * mn.float()).view(n, 8, 1)
    return (dl * q.float() - ml).reshape(n, QK_K)


def _low_high_nibbles(qs: torch.Tensor) -> torch.Tensor:
    """128 bytes of 32-byte groups, low then high nibbles -> the 8 groups' 4-bit codes ``[n, 8, 32]``."""
    qs = qs.reshape(qs.shape[0], 4, 1, 32)
    return torch.cat([qs & 0x0F, qs >> 4], dim=2).reshape(qs.shape[0], 8, 32)


def _q4_k(blocks: torch.Tensor) -> torch.Tensor:
    # block_q4_K: d fp16 | dmin fp16 | scales[12] | qs[128] (32-byte groups, low then high nibbles)
    return _k_groups(blocks, _low_high_nibbles(blocks[:, 16:]))


def _q5_k(blocks: torch.Tensor) -> torch.Tensor:
    # block_q5_K: d fp16 | dmin fp16 | scales[12] | qh[32] (bit b of byte j -> group b) | qs[128]
    return _k_groups(blocks, _low_high_nibbles(blocks[:, 48:]) | (_plane_bits(blocks[:, 16:48]) << 4))


def _q6_k(blocks: torch.Tensor) -> torch.Tensor:
    # block_q6_K: ql[128] | qh[64] | scales int8[16] | d fp16
    n = blocks.shape[0]
    scales = blocks[:, 192:208].contiguous().view(torch.int8).float()
    d = _f16(blocks, 208)
    dl = (d * scales).view(n, 16, 1)
    ql = blocks[:, :128].reshape(n, 2, 1, 64)
    ql = torch.cat([ql & 0x0F, ql >> 4], dim=2).reshape(n, 8, 32)
    qh = _crumbs(blocks[:, 128:192], 32).reshape(n, 8, 32)
    q = (ql | (qh << 4)).float() - 32
    return (dl * q.reshape(n, 16, 16)).reshape(n, QK_K)


def _codebook(qtype: GGMLQuantizationType, codes: torch.Tensor) -> torch.Tensor:
    """The values (float32) that 4-bit ``codes`` name in ``qtype``'s codebook, on their device."""
    return torch.tensor(CODEBOOKS[qtype], dtype=torch.float32, device=codes.device)[codes.long()]


def e8m0_half(e: torch.Tensor) -> torch.Tensor:
    """ggml's ``ggml_e8m0_to_fp32_half`` of E8M0 bytes: 2 ** (e - 128) as float32 bits (a subnormal
    for e < 2)."""
    e = e.to(torch.int32)
    bits = torch.where(e < 2, torch.bitwise_left_shift(torch.full_like(e, 0x00200000), e), (e - 1) << 23)
    return bits.view(torch.float32)


def _mxfp4(blocks: torch.Tensor) -> torch.Tensor:
    # block_mxfp4: e (E8M0) | qs[16] (element j in the low nibble of byte j, j+16 in the high)
    return e8m0_half(blocks[:, :1]) * _codebook(T.MXFP4, _nibbles(blocks[:, 1:]))


def _iq4_nl(blocks: torch.Tensor) -> torch.Tensor:
    # block_iq4_nl: d fp16 | qs[16] (element j in the low nibble of byte j, j+16 in the high)
    return _f16(blocks, 0) * _codebook(T.IQ4_NL, _nibbles(blocks[:, 2:]))


def iq4_xs_scales(blocks: torch.Tensor) -> torch.Tensor:
    """IQ4_XS's eight six-bit sub-scales a block (``sc - 32``, int32 ``[n, 8]``): group g's low 4 bits
    in nibble g of ``scales_l`` (bytes 4..7, low nibble first), its high 2 bits at bits 2g..2g+1 of
    ``scales_h`` (bytes 2..3, a little-endian uint16)."""
    low = _nibbles(blocks[:, 4:8])  # groups 0, 2, 4, 6 then 1, 3, 5, 7
    low = low.view(-1, 2, 4).transpose(1, 2).reshape(-1, 8).to(torch.int32)
    high = blocks[:, 2:4].to(torch.int32)
    high = (high[:, :1] | (high[:, 1:] << 8)) >> (2 * torch.arange(8, dtype=torch.int32, device=blocks.device))
    return (low | ((high & 3) << 4)) - 32


def _iq4_xs(blocks: torch.Tensor) -> torch.Tensor:
    # block_iq4_xs: d fp16 | scales_h uint16 | scales_l[4] | qs[128] (16 bytes a 32-group, as IQ4_NL's)
    n = blocks.shape[0]
    dl = (_f16(blocks, 0) * iq4_xs_scales(blocks).float()).view(n, 8, 1)
    q = _codebook(T.IQ4_XS, _nibbles(blocks[:, 8:].reshape(n, 8, 16)))
    return (dl * q).reshape(n, QK_K)


# --- the lattice types: groups of 4 or 8 weights named by an index into a grid (quant/grids.py)


def _u32(b: torch.Tensor) -> torch.Tensor:
    """``[..., 4]`` bytes holding little-endian uint32s -> int64 ``[...]``."""
    b = b.to(torch.int64)
    return b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16) | (b[..., 3] << 24)


def _u16(b: torch.Tensor) -> torch.Tensor:
    """``[..., 2k]`` bytes holding little-endian uint16s -> int64 ``[..., k]``."""
    b = b.to(torch.int64).unflatten(-1, (-1, 2))
    return b[..., 0] | (b[..., 1] << 8)


def _grid(qtype: GGMLQuantizationType, index: torch.Tensor) -> torch.Tensor:
    """The grid points ``index`` names, float32 ``[*index.shape, width]``."""
    return grid_values(qtype, index.device)[index.long()]


def _ksigns(index: torch.Tensor) -> torch.Tensor:
    """``+1`` / ``-1`` float32 ``[*index.shape, 8]`` of 7-bit sign indices."""
    return ksign_values(index.device)[index.long()]


def _sign_bits(signs: torch.Tensor) -> torch.Tensor:
    """Plain sign bytes ``[n, k]`` -> ``+1`` / ``-1`` float32 ``[n, k, 8]`` (bit j set: weight j negative)."""
    bits = (signs.unsqueeze(-1) >> _shifts(signs, *range(8))) & 1
    return 1.0 - 2.0 * bits.float()


def _scale_nibbles(scales: torch.Tensor) -> torch.Tensor:
    """Sub-scale bytes ``[n, k]`` -> float32 ``[n, 2k]``: byte i's low nibble, then its high one."""
    return torch.stack([scales & 0x0F, scales >> 4], dim=-1).reshape(scales.shape[0], -1).float()


def _iq2_xxs(blocks: torch.Tensor) -> torch.Tensor:
    # block_iq2_xxs: d fp16 | 8 x (grid indices u8[4] | uint32: four 7-bit sign indices, 4-bit scale)
    n = blocks.shape[0]
    q = blocks[:, 2:].reshape(n, 8, 8)
    aux = _u32(q[:, :, 4:])
    db = (_f16(blocks, 0) * (0.5 + (aux >> 28).float()) * 0.25).view(n, 8, 1, 1)
    signs = _ksigns((aux.unsqueeze(-1) >> torch.tensor([0, 7, 14, 21], device=aux.device)) & 0x7F)
    return (db * _grid(T.IQ2_XXS, q[:, :, :4]) * signs).reshape(n, QK_K)


def _iq2_xs(blocks: torch.Tensor) -> torch.Tensor:
    # block_iq2_xs: d fp16 | qs uint16[32] (9-bit grid index, 7-bit sign index) | scales[8] (4 bits a 16)
    n = blocks.shape[0]
    qs = _u16(blocks[:, 2:66])
    db = (_f16(blocks, 0) * (0.5 + _scale_nibbles(blocks[:, 66:74])) * 0.25).view(n, 16, 1, 1)
    signs = _ksigns(qs >> 9).view(n, 16, 2, 8)
    return (db * _grid(T.IQ2_XS, qs & 511).view(n, 16, 2, 8) * signs).reshape(n, QK_K)


def _iq2_s(blocks: torch.Tensor) -> torch.Tensor:
    # block_iq2_s: d fp16 | qs[32] (grid index, low 8 bits) | signs[32] | qh[8] (2 high bits a group)
    # | scales[8] (4 bits a 16)
    n = blocks.shape[0]
    db = (_f16(blocks, 0) * (0.5 + _scale_nibbles(blocks[:, 74:82])) * 0.25).view(n, 16, 1, 1)
    signs = _sign_bits(blocks[:, 34:66]).view(n, 16, 2, 8)
    qh = (blocks[:, 66:74].unsqueeze(-1) >> _shifts(blocks, 0, 2, 4, 6)) & 3
    index = blocks[:, 2:34].long() | (qh.reshape(n, 32).long() << 8)
    return (db * _grid(T.IQ2_S, index).view(n, 16, 2, 8) * signs).reshape(n, QK_K)


def _iq3_xxs(blocks: torch.Tensor) -> torch.Tensor:
    # block_iq3_xxs: d fp16 | qs[64] (grid indices, 4 weights each)
    # | 8 x uint32: four 7-bit sign indices, 4-bit scale
    n = blocks.shape[0]
    aux = _u32(blocks[:, 66:98].reshape(n, 8, 4))
    db = (_f16(blocks, 0) * (0.5 + (aux >> 28).float()) * 0.5).view(n, 8, 1, 1)
    signs = _ksigns((aux.unsqueeze(-1) >> torch.tensor([0, 7, 14, 21], device=aux.device)) & 0x7F)
    return (db * _grid(T.IQ3_XXS, blocks[:, 2:66]).view(n, 8, 4, 8) * signs).reshape(n, QK_K)


def _iq3_s(blocks: torch.Tensor) -> torch.Tensor:
    # block_iq3_s: d fp16 | qs[64] (grid index, low 8 bits) | qh[8] (the 9th bits) | signs[32]
    # | scales[4] (4 bits a 32)
    n = blocks.shape[0]
    db = (_f16(blocks, 0) * (1 + 2 * _scale_nibbles(blocks[:, 106:110]))).view(n, 8, 1, 1)
    signs = _sign_bits(blocks[:, 74:106]).view(n, 8, 4, 8)
    qh = (blocks[:, 66:74].unsqueeze(-1) >> _shifts(blocks, *range(8))) & 1
    index = blocks[:, 2:66].long() | (qh.reshape(n, 64).long() << 8)
    return (db * _grid(T.IQ3_S, index).view(n, 8, 4, 8) * signs).reshape(n, QK_K)


def _iq1_delta(bit: torch.Tensor) -> torch.Tensor:
    return torch.where(bit == 0, IQ1_DELTA, -IQ1_DELTA).float()


def _iq1_s(blocks: torch.Tensor) -> torch.Tensor:
    # block_iq1_s: d fp16 | qs[32] (grid index, low 8 bits) | qh uint16[8] (per 32: four 3-bit high
    # index bits, a 3-bit scale at 12, the delta's sign at 15)
    n = blocks.shape[0]
    qh = _u16(blocks[:, 34:50])
    dl = (_f16(blocks, 0) * (2 * ((qh >> 12) & 7) + 1).float()).view(n, 8, 1, 1)
    delta = _iq1_delta(qh & 0x8000).view(n, 8, 1, 1)
    high = (qh.unsqueeze(-1) >> torch.tensor([0, 3, 6, 9], device=qh.device)) & 7
    index = blocks[:, 2:34].long() | (high.reshape(n, 32) << 8)
    return (dl * (_grid(T.IQ1_S, index).view(n, 8, 4, 8) + delta)).reshape(n, QK_K)


def _iq1_m(blocks: torch.Tensor) -> torch.Tensor:
    # block_iq1_m: qs[32] (grid index, low 8 bits) | qh[16] (a nibble a group of 8: 3 high index
    # bits, the delta's sign) | scales uint16[4] (four 3-bit scales each, a 16 each; their top
    # nibbles, first to last, are d's fp16 bits, lowest first)
    n = blocks.shape[0]
    scales = _u16(blocks[:, 48:56])
    d_bits = (scales >> 12) << torch.tensor([0, 4, 8, 12], device=scales.device)
    d_bits = d_bits[:, 0] | d_bits[:, 1] | d_bits[:, 2] | d_bits[:, 3]
    d = d_bits.to(torch.int16).view(torch.float16).float().view(n, 1)
    sub = (scales.unsqueeze(-1) >> torch.tensor([0, 3, 6, 9], device=scales.device)) & 7
    dl = (d * (2 * sub.reshape(n, 16) + 1).float()).view(n, 8, 2, 1, 1)
    qh = torch.stack([blocks[:, 32:48] & 0x0F, blocks[:, 32:48] >> 4], dim=-1).reshape(n, 32)
    index = blocks[:, :32].long() | ((qh & 7).long() << 8)
    delta = _iq1_delta(qh & 8).view(n, 8, 2, 2, 1)
    return (dl * (_grid(T.IQ1_M, index).view(n, 8, 2, 2, 8) + delta)).reshape(n, QK_K)


# --- the ternary types: weights d * {-1, 0, 1}


def _tq1_0(blocks: torch.Tensor) -> torch.Tensor:
    # block_tq1_0: qs[48] | qh[4] | d fp16. Each byte holds 5 (qh: 4) base-3 digits as a fixed-point
    # fraction of 243: digit i is the top of (byte * 3**i mod 256) * 3 / 256, in uint8 arithmetic.
    n = blocks.shape[0]
    d = _f16(blocks, 52)
    pow3 = torch.tensor([1, 3, 9, 27, 81], dtype=torch.uint8, device=blocks.device)
    q0 = (blocks[:, 0:32].view(n, 1, 32) * pow3.view(1, 5, 1)).reshape(n, 160)
    q1 = (blocks[:, 32:48].view(n, 1, 16) * pow3.view(1, 5, 1)).reshape(n, 80)
    qh = (blocks[:, 48:52].view(n, 1, 4) * pow3[:4].view(1, 4, 1)).reshape(n, 16)
    q = torch.cat([q0, q1, qh], dim=-1).to(torch.int32)
    return d * (((q * 3) >> 8) - 1).float()


def _tq2_0(blocks: torch.Tensor) -> torch.Tensor:
    # block_tq2_0: qs[64] (2-bit codes, the Q2_K "shift by 0, 2, 4, 6" layout) | d fp16
    n = blocks.shape[0]
    q = _crumbs(blocks[:, :64], 32).reshape(n, QK_K)
    return _f16(blocks, 64) * (q.to(torch.int32) - 1).float()


_BLOCK_DECODERS: dict[GGMLQuantizationType, Callable[[torch.Tensor], torch.Tensor]] = {
    T.Q8_0: _q8_0,
    T.Q4_0: _q4_0,
    T.Q4_1: _q4_1,
    T.Q5_0: _q5_0,
    T.Q5_1: _q5_1,
    T.Q2_K: _q2_k,
    T.Q3_K: _q3_k,
    T.Q4_K: _q4_k,
    T.Q5_K: _q5_k,
    T.Q6_K: _q6_k,
    T.MXFP4: _mxfp4,
    T.IQ4_NL: _iq4_nl,
    T.IQ4_XS: _iq4_xs,
    T.IQ2_XXS: _iq2_xxs,
    T.IQ2_XS: _iq2_xs,
    T.IQ2_S: _iq2_s,
    T.IQ3_XXS: _iq3_xxs,
    T.IQ3_S: _iq3_s,
    T.IQ1_S: _iq1_s,
    T.IQ1_M: _iq1_m,
    T.TQ1_0: _tq1_0,
    T.TQ2_0: _tq2_0,
}

SUPPORTED_QTYPES: frozenset[GGMLQuantizationType] = FLOAT_QTYPES | frozenset(_BLOCK_DECODERS)


def check_qtype(qtype: GGMLQuantizationType | int, name: str) -> GGMLQuantizationType:
    """Return ``qtype`` as a ``GGMLQuantizationType``, or raise ``ModelLoadError`` naming the
    tensor if localllm cannot dequantize it."""
    try:
        qtype = GGMLQuantizationType(qtype)
    except ValueError:
        type_name = f"#{int(qtype)}"
    else:
        if qtype in SUPPORTED_QTYPES:
            return qtype
        type_name = qtype.name
    supported = ", ".join(t.name for t in sorted(SUPPORTED_QTYPES))
    raise ModelLoadError(
        f"tensor '{name}' uses GGUF type {type_name}, which localllm does not support; "
        f"supported: {supported}"
    )


def as_bytes(data: torch.Tensor, qtype: GGMLQuantizationType) -> torch.Tensor:
    """View ``data`` as uint8 ``[rows, bytes_per_row]`` without copying.

    Block types must already be uint8; float types may also come typed (as GGUFReader gives
    F32/F16 tensors), in which case the dtype must match ``qtype``.
    """
    if data.dtype == torch.uint8:
        return data
    expected = _FLOAT_DTYPES.get(qtype)
    if data.dtype != expected:
        raise ValueError(f"{qtype.name} data must be uint8 bytes or {expected}, got {data.dtype}")
    return data.view(torch.uint8)


def dequantize(raw: torch.Tensor, qtype: GGMLQuantizationType) -> torch.Tensor:
    """Dequantize ``raw`` (uint8 ``[rows, bytes_per_row]``) to float32 ``[rows, elems_per_row]``.

    For F32/F16/BF16, ``raw`` may also be the already-typed ``[rows, elems]`` tensor. F32 input
    comes back as a view when possible, not a copy. Unsupported types raise ``ModelLoadError``.
    """
    qtype = check_qtype(qtype, "<unnamed>")
    if raw.dim() != 2:
        raise ValueError(f"expected a 2-D [rows, bytes_per_row] tensor, got shape {tuple(raw.shape)}")
    if qtype in FLOAT_QTYPES:
        return as_bytes(raw, qtype).contiguous().view(_FLOAT_DTYPES[qtype]).float()
    if raw.dtype != torch.uint8:
        raise ValueError(f"{qtype.name} data must be uint8, got {raw.dtype}")
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    rows, nbytes = raw.shape
    if nbytes % type_size:
        raise ValueError(f"{qtype.name} rows must be a multiple of {type_size} bytes, got {nbytes}")
    blocks = raw.contiguous().view(-1, type_size)
    return _BLOCK_DECODERS[qtype](blocks).view(rows, nbytes // type_size * block_size)
