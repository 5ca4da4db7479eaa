"""The lattice (IQ1, IQ2, IQ3) and ternary (TQ1_0, TQ2_0) types: their one table of grid points
against gguf-py's, their reference dequantizers against ``gguf.quants.dequantize`` bit for bit, and
blocks built field by field."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf import quants as gguf_quants

from localllm.quant.gguf_dequant import dequantize
from localllm.quant.grids import GRIDS, IQ1_DELTA, KSIGNS, LATTICE_TYPES, grid_values, ksign_values
from localllm.quant.testing import random_quantized
from localllm.quant.traits import TRAITS

T = GGMLQuantizationType
TERNARY_TYPES = (T.TQ1_0, T.TQ2_0)
TYPES = LATTICE_TYPES + TERNARY_TYPES
SHAPES = [(1, 256), (3, 768), (7, 512), (16, 1024)]


def _ids(types):
    return [t.name for t in types]


def _reference(data: np.ndarray, qtype: GGMLQuantizationType) -> torch.Tensor:
    with np.errstate(all="ignore"):
        return torch.from_numpy(np.ascontiguousarray(gguf_quants.dequantize(data, qtype), dtype=np.float32))


def _same_bits(out: torch.Tensor, ref: torch.Tensor) -> None:
    """Equal to the bit, NaN where the reference has NaN (any payload)."""
    nan = torch.isnan(ref)
    assert torch.equal(torch.isnan(out), nan)
    assert torch.equal(out[~nan].view(torch.int32), ref[~nan].view(torch.int32))


def test_the_grids_are_ggufs():
    """One table, decoded from gguf-py's: what ``gguf.quants`` multiplies, int8 ``[entries, width]``."""
    for qtype in LATTICE_TYPES:
        cls = getattr(gguf_quants, qtype.name)
        cls.init_grid()
        grid = GRIDS[qtype]
        assert grid.dtype == np.int8 and grid.shape == cls.grid_shape, qtype.name
        assert np.array_equal(grid.astype(np.float32), cls.grid.reshape(cls.grid_shape)), qtype.name
        assert set(np.unique(grid).tolist()) <= set(cls.grid_map), qtype.name
        assert torch.equal(grid_values(qtype, torch.device("cpu")), torch.tensor(grid, dtype=torch.float32))
    assert GRIDS[T.IQ1_M] is GRIDS[T.IQ1_S]
    assert IQ1_DELTA == 0.125
    # ksigns_iq2xs: the 7 bits of the index, and bit 7 making the number of negatives even
    assert KSIGNS.shape == (128,)
    for i, byte in enumerate(KSIGNS.tolist()):
        assert byte & 0x7F == i and byte.bit_count() % 2 == 0
    signs = ksign_values(torch.device("cpu"))
    assert signs.shape == (128, 8) and signs[3].tolist() == [-1, -1, 1, 1, 1, 1, 1, 1]


@pytest.mark.parametrize("qtype", TYPES, ids=_ids(TYPES))
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_valid_blocks_match_gguf_bit_for_bit(qtype, shape):
    data = random_quantized(qtype, *shape, seed=shape[0])
    out = dequantize(torch.from_numpy(data), qtype)
    assert out.shape == shape and out.dtype == torch.float32
    _same_bits(out, _reference(data, qtype))


@pytest.mark.parametrize("qtype", TYPES, ids=_ids(TYPES))
def test_arbitrary_bytes_match_gguf_bit_for_bit(qtype):
    # every byte random, d too (IQ1_M's split across its sub-scales' top nibbles): inf and NaN included
    size = GGML_QUANT_SIZES[qtype][1]
    data = np.random.default_rng(9).integers(0, 256, (64, 4 * size), dtype=np.uint8)
    _same_bits(dequantize(torch.from_numpy(data), qtype), _reference(data, qtype))


NATIVE_LATTICE = (T.IQ2_XXS, T.IQ2_XS, T.IQ2_S, T.IQ3_XXS, T.IQ3_S)
REFERENCE_ONLY = tuple(t for t in TYPES if t not in NATIVE_LATTICE)


@pytest.mark.parametrize("qtype", REFERENCE_ONLY, ids=_ids(REFERENCE_ONLY))
def test_the_cpus_reference_route_holds_the_files_bytes(qtype):
    """IQ1 and the ternary types: no native CPU layout, so the CPU's reference path, at the file's
    bytes; the Triton kernels decode them (tests/kernels/test_triton_kernels.py)."""
    tr = TRAITS[qtype]
    assert tr.cpu is None and tr.cpu_layout == "none" and tr.triton and not tr.int4_slices
    assert GGML_QUANT_SIZES[qtype][0] == 256


@pytest.mark.parametrize("qtype", NATIVE_LATTICE, ids=_ids(NATIVE_LATTICE))
def test_the_native_lattice_formats_keep_each_groups_file_bytes(qtype):
    """The native format of an IQ2/IQ3 type holds a tile's blocks byte for byte: the group fields and
    sub-scale fields of ``LATTICE_FIELDS`` and ``d`` cover every byte of a block exactly once."""
    from localllm.kernels.cpu.fields import LATTICE_FIELDS

    tr = TRAITS[qtype]
    assert tr.cpu_layout == "format" and tr.cpu.group_bytes
    block, type_size = GGML_QUANT_SIZES[qtype]
    group_fields, scale_fields = LATTICE_FIELDS[qtype]
    seen = [0] * type_size
    seen[0] += 1
    seen[1] += 1  # d
    for g in range(block // 32):
        for f in group_fields:
            for b in range(f.start + f.stride * g, f.start + f.stride * g + f.count * f.width):
                seen[b] += 1
    for f in scale_fields:
        for b in range(f.start, f.start + f.count * f.width):
            seen[b] += 1
    assert seen == [1] * type_size
    assert sum(f.count * f.width for f in group_fields) == tr.cpu.group_bytes
    assert tr.cpu.block_bytes == 16 * type_size and tr.cpu.bits_per_weight == 8 * type_size / block


def _f16_bytes(x: float) -> list[int]:
    return list(np.array([x], dtype=np.float16).view(np.uint8))


def test_iq2_xxs_block_by_hand():
    """Group g of 32: four grid indices (bytes), then a uint32 of four 7-bit sign indices (bits
    0, 7, 14, 21) and the sub-scale s (bits 28..31): w = d (0.5 + s) / 4 * grid point * signs."""
    block = np.zeros(66, dtype=np.uint8)
    block[0:2] = _f16_bytes(0.5)
    want = []
    for g in range(8):
        index = [(g * 37 + 11 * j) % 256 for j in range(4)]
        sign = [(g * 5 + 3 * j) % 128 for j in range(4)]
        scale = (g * 3) % 16
        aux = sum(s << (7 * j) for j, s in enumerate(sign)) | (scale << 28)
        block[2 + 8 * g: 6 + 8 * g] = index
        block[6 + 8 * g: 10 + 8 * g] = list(np.array([aux], dtype=np.uint32).view(np.uint8))
        db = 0.5 * (0.5 + scale) * 0.25
        for j in range(4):
            for e in range(8):
                negative = (KSIGNS[sign[j]] >> e) & 1
                want.append(db * int(GRIDS[T.IQ2_XXS][index[j], e]) * (-1 if negative else 1))
    assert dequantize(torch.from_numpy(block[None]), T.IQ2_XXS)[0].tolist() == want


def test_iq1_m_block_by_hand():
    """IQ1_M's d is the top nibbles of its four uint16 sub-scale words (first word lowest); each
    word holds four 3-bit sub-scales s (a 16 each): w = d (2 s + 1) (grid value +- 1/8), the
    delta's sign in bit 3 of the group's qh nibble, its index's high 3 bits below it."""
    d_bits = int(np.array([0.25], dtype=np.float16).view(np.uint16)[0])
    subs = [(i * 5) % 8 for i in range(16)]
    words = [sum(subs[4 * w + j] << (3 * j) for j in range(4)) | (((d_bits >> (4 * w)) & 0xF) << 12)
             for w in range(4)]
    low = [(i * 73) % 256 for i in range(32)]
    nib = [(i * 7) % 16 for i in range(32)]
    block = np.zeros(56, dtype=np.uint8)
    block[:32] = low
    block[32:48] = [nib[2 * i] | (nib[2 * i + 1] << 4) for i in range(16)]
    block[48:56] = np.array(words, dtype=np.uint16).view(np.uint8)
    want = []
    for group in range(32):
        index = low[group] | ((nib[group] & 7) << 8)
        delta = -IQ1_DELTA if nib[group] & 8 else IQ1_DELTA
        dl = np.float32(0.25) * np.float32(2 * subs[group // 2] + 1)
        want += [float(dl * (np.float32(v) + np.float32(delta))) for v in GRIDS[T.IQ1_M][index]]
    assert dequantize(torch.from_numpy(block[None]), T.IQ1_M)[0].tolist() == want


def test_ternary_blocks_by_hand():
    """TQ2_0: 2-bit codes c (byte j of each 32, bits 2s..2s+1: element 32 (4 half + s) + j) mean
    c - 1; TQ1_0: five base-3 digits a byte, as fixed-point fractions of 243, d last in both."""
    codes = np.arange(256) % 3
    tq2 = np.zeros(66, dtype=np.uint8)
    for i, c in enumerate(codes):
        half, s, j = i // 128, (i // 32) % 4, i % 32
        tq2[32 * half + j] |= c << (2 * s)
    tq2[64:66] = _f16_bytes(2.0)
    assert dequantize(torch.from_numpy(tq2[None]), T.TQ2_0)[0].tolist() == [2.0 * (c - 1) for c in codes]
    weights = (codes - 1).astype(np.float32)[None] * 0.5
    tq1 = gguf_quants.quantize(weights, T.TQ1_0)
    assert tq1.shape == (1, 54)
    assert dequantize(torch.from_numpy(tq1), T.TQ1_0)[0].tolist() == weights[0].tolist()
