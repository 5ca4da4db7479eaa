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
