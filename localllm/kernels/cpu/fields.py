"""GGUF blocks as the codes and scales the CPU routes repack (no layout of their own here).

:func:`affine_fields`: unsigned integer codes with a per-32-group affine map ``w = s * q + z`` in the
reference decoders' float32 arithmetic (the int4 route's and the native 4/8-bit tiles' input);
:func:`format_fields`: the file's own codes, sub-scale bytes and float16 scales, as the native
formats keep them (exact); :data:`LATTICE_FIELDS`: which of a lattice type's block bytes make up each
of its 32-groups, as its native format keeps them (as they are).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from gguf import GGMLQuantizationType

from localllm.quant.gguf_dequant import _bits, _crumbs, _f16, _k_scale_min, _nibbles, _plane_bits
from localllm.quant.traits import CPU_GROUP

T = GGMLQuantizationType

GROUP = CPU_GROUP
"""Elements per activation and scale group on every CPU route."""
REPACK_CHUNK_ROWS = 4096  # a multiple of 64 so chunked packing equals one-shot packing


@dataclass(frozen=True, slots=True)
class BlockField:
    """``count`` fields of ``width`` bytes at byte ``start + stride * g`` of a block, for its group
    ``g`` (``stride`` 0: one run per block, the same for every group)."""

    start: int
    stride: int
    count: int
    width: int


LATTICE_FIELDS: dict[GGMLQuantizationType, tuple[tuple[BlockField, ...], tuple[BlockField, ...]]] = {
    # (a group's fields, in the order the kernel keeps them; the super-block's sub-scale fields)
    # IQ2_XXS: d, then per group 4 grid indices and a word of 4 x 7 sign bits and sc << 28
    T.IQ2_XXS: ((BlockField(2, 8, 4, 1), BlockField(6, 8, 1, 4)), ()),
    # IQ2_XS: d, per group 4 u16 (9-bit index, 7 sign bits), then 8 bytes of two 4-bit sc
    T.IQ2_XS: ((BlockField(2, 8, 4, 2), BlockField(66, 1, 1, 1)), ()),
    # IQ2_S: d, 32 index bytes, 32 sign bytes, 8 qh (2 index bits each), 8 bytes of two sc
    T.IQ2_S: ((BlockField(2, 4, 4, 1), BlockField(34, 4, 1, 4), BlockField(66, 1, 1, 1), BlockField(74, 1, 1, 1)),
              ()),
    # IQ3_XXS: d, 64 index bytes, then per group a word of 4 x 7 sign bits and sc << 28
    T.IQ3_XXS: ((BlockField(2, 8, 8, 1), BlockField(66, 4, 1, 4)), ()),
    # IQ3_S: d, 64 index bytes, 8 qh (an index bit each), 32 sign bytes, 4 bytes of two sc
    T.IQ3_S: ((BlockField(2, 8, 8, 1), BlockField(66, 1, 1, 1), BlockField(74, 4, 1, 4)),
              (BlockField(106, 0, 4, 1),)),
}
"""Per lattice type, its groups' block bytes and its super-block's sub-scale bytes (the byte offsets
of llama.cpp's ``block_iq2_xxs`` .. ``block_iq3_s``; every block starts with its float16 ``d``)."""




def affine_fields(blocks: torch.Tensor, qtype: GGMLQuantizationType):
    """``(q, bits, s, z)`` for ``blocks`` uint8 ``[n, type_size]``: ``q`` uint8 ``[n, block_size]``
    in ``[0, 2**bits)``, ``s``/``z`` float32 ``[n, block_size // 32]`` with ``w = s*q + z`` per
    32-element group, in the reference decoders' float32 arithmetic."""
    n = blocks.shape[0]
    if qtype == T.Q8_0:
        d = _f16(blocks, 0)
        q = blocks[:, 2:] ^ 0x80  # int8 q -> q + 128
        return q, 8, d, -128 * d
    if qtype == T.Q4_0:
        d = _f16(blocks, 0)
        return _nibbles(blocks[:, 2:]), 4, d, -8 * d
    if qtype == T.Q4_1:
        return _nibbles(blocks[:, 4:]), 4, _f16(blocks, 0), _f16(blocks, 2)
    if qtype == T.Q5_0:
        d = _f16(blocks, 0)
        return _nibbles(blocks[:, 6:]) | (_bits(blocks[:, 2:6]) << 4), 5, d, -16 * d
    if qtype == T.Q5_1:
        q = _nibbles(blocks[:, 8:]) | (_bits(blocks[:, 4:8]) << 4)
        return q, 5, _f16(blocks, 0), _f16(blocks, 2)
    if qtype in (T.Q4_K, T.Q5_K):
        d, dmin = _f16(blocks, 0), _f16(blocks, 2)
        sc, mn = _k_scale_min(blocks[:, 4:16])
        s = d * sc.float()
        z = -(dmin * mn.float())
        qs = blocks[:, 16:].reshape(n, 4, 1, 32) if qtype == T.Q4_K else blocks[:, 48:].reshape(n, 4, 1, 32)
        q = torch.cat([qs & 0x0F, qs >> 4], dim=2).reshape(n, 8, 32)
        if qtype == T.Q4_K:
            return q.reshape(n, 256), 4, s, z
        return (q | (_plane_bits(blocks[:, 16:48]) << 4)).reshape(n, 256), 5, s, z
    raise AssertionError(f"no int4 mapping for {qtype.name}")


def raw_f16(blocks: torch.Tensor, offset: int) -> torch.Tensor:
    """The float16 field at byte ``offset`` of every block, as it is: float16 ``[n_blocks, 1]``."""
    return blocks[:, offset : offset + 2].contiguous().view(torch.float16)


def format_fields(blocks: torch.Tensor, qtype: GGMLQuantizationType):
    """``(u, scales, d, z)`` of GGUF ``blocks`` (uint8 ``[n, type_size]``) for their native format
    (:data:`localllm.kernels.cpu.native.FORMATS`): the file's unsigned codes ``u`` uint8 ``[n,
    block_size]``, the sub-scale bytes uint8 ``[n, scb/16]`` (Q4_K, Q5_K: ``[n, 16]``, sc then m,
    one value a byte; MXFP4: its E8M0 byte; or ``None``), ``d`` and ``z``
    float16 ``[n, 1]`` as stored in the file (``None`` where the format has none; the codebook
    formats' ``u`` are their codes, not the values they name)."""
    n = blocks.shape[0]
    if qtype == T.Q4_0:
        return _nibbles(blocks[:, 2:]), None, raw_f16(blocks, 0), None
    if qtype == T.Q5_0:
        return _nibbles(blocks[:, 6:]) | (_bits(blocks[:, 2:6]) << 4), None, raw_f16(blocks, 0), None
    if qtype == T.Q5_1:
        u = _nibbles(blocks[:, 8:]) | (_bits(blocks[:, 4:8]) << 4)
        return u, None, raw_f16(blocks, 0), raw_f16(blocks, 2)
    if qtype in (T.Q4_K, T.Q5_K):
        sc, mn = _k_scale_min(blocks[:, 4:16])
        qs = blocks[:, 16:].reshape(n, 4, 1, 32) if qtype == T.Q4_K else blocks[:, 48:].reshape(n, 4, 1, 32)
        q = torch.cat([qs & 0x0F, qs >> 4], dim=2).reshape(n, 8, 32)
        u = (q if qtype == T.Q4_K else q | (_plane_bits(blocks[:, 16:48]) << 4)).reshape(n, 256)
        return u, torch.cat([sc, mn], dim=1), raw_f16(blocks, 0), raw_f16(blocks, 2)
    if qtype == T.Q6_K:
        ql = blocks[:, :128].reshape(n, 2, 1, 64)
        ql = torch.cat([ql & 0x0F, ql >> 4], dim=2).reshape(n, 8, 32)
        qh = _crumbs(blocks[:, 128:192], 32).reshape(n, 8, 32)
        return (ql | (qh << 4)).reshape(n, 256), blocks[:, 192:208], raw_f16(blocks, 208), None
    if qtype == T.Q3_K:
        hmask, qs, scales = blocks[:, :32], blocks[:, 32:96], blocks[:, 96:108]
        low = _nibbles(scales[:, :8])
        high = ((scales[:, 8:12].unsqueeze(1) >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8).view(1, 4, 1)) & 3)
        sc = (low | (high.reshape(n, 16) << 4)).to(torch.int16) - 32  # signed, in [-32, 31]
        u = _crumbs(qs, 32).reshape(n, 256) | (_plane_bits(hmask).reshape(n, 256) << 2)  # q + 4
        return u, sc.to(torch.int8).view(torch.uint8), raw_f16(blocks, 108), None
    if qtype == T.Q2_K:
        u = _crumbs(blocks[:, 16:80], 32).reshape(n, 256)
        return u, blocks[:, :16], raw_f16(blocks, 80), raw_f16(blocks, 82)
    if qtype == T.MXFP4:  # the E8M0 byte as the sub-scale, no d
        return _nibbles(blocks[:, 1:]), blocks[:, :1], None, None
    if qtype == T.IQ4_NL:
        return _nibbles(blocks[:, 2:]), None, raw_f16(blocks, 0), None
    if qtype == T.IQ4_XS:  # the sub-scale bytes: scales_l, then scales_h (the kernel's order)
        u = _nibbles(blocks[:, 8:].reshape(n, 8, 16)).reshape(n, 256)
        return u, torch.cat([blocks[:, 4:8], blocks[:, 2:4]], dim=1), raw_f16(blocks, 0), None
    raise AssertionError(f"no native format for {qtype.name}")
