"""What each GGUF tensor type is, and how each backend holds it: the one table (in the spirit of
llama.cpp's ``type_traits`` and ``type_traits_cpu``). The CPU backend's routes
(:mod:`localllm.kernels.cpu.weights`), its packers (:mod:`localllm.kernels.cpu.native`), its C++
kernels (through ``csrc/formats.h``, generated from :data:`CPU_FORMATS` by
:mod:`localllm.quant.cpu_header`) and the Triton kernels' dequantization
(:mod:`localllm.kernels.triton.quant`) all read their per-type facts from here.

CPU layouts (``cpu_layout``, the :attr:`CpuFormat.layout` of a type's ``cpu``), the same on both
instruction sets (AVX2 and AVX-512 VNNI build the same kernels, to the same bits):

* ``tile4`` / ``tile8``: 4- or 8-bit codes with one float16 affine map per 32 weights and row,
  in 16-row tiles (the VNNI/AVX2 4- and 8-bit kernels);
* ``format``: the file's own codes and integer sub-scales in 16-row tiles (``cpu_format`` is the
  kernel's format id), multiplied by one template over the vector width; the codebook formats
  (MXFP4, IQ4_NL, IQ4_XS: 4-bit codes naming one of 16 int8 values, :data:`CODEBOOKS`) keep the
  file's codes too, looked up into their values as the kernel decodes them; the lattice formats
  (IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S) keep each group's file bytes (grid indices, signs and
  sub-scales), their grid points looked up (:mod:`localllm.quant.grids`) as the kernel decodes them;
* ``float``: the file's rows as they are (F16, BF16), float32 FMA chains;
* ``f32``: used in place by torch (no native route; ``cpu`` is None);
* ``none``: no CPU route at all (``cpu`` is None): the reference path dequantizes the file's
  blocks at each use.
"""

from __future__ import annotations

from dataclasses import dataclass

from gguf import GGMLQuantizationType

T = GGMLQuantizationType

CPU_GROUP = 32
"""Weights per activation and scale group on every CPU route."""
CPU_TILE = 16
"""Output rows per tile of the native layouts."""

KVALUES_MXFP4 = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)
"""MXFP4's E2M1 values doubled (ggml's ``kvalues_mxfp4``: its E8M0 scale is halved to match)."""
KVALUES_IQ4NL = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)
"""IQ4_NL's and IQ4_XS's non-linear 4-bit values (ggml's ``kvalues_iq4nl``)."""
CODEBOOKS: dict[GGMLQuantizationType, tuple[int, ...]] = {
    T.MXFP4: KVALUES_MXFP4, T.IQ4_NL: KVALUES_IQ4NL, T.IQ4_XS: KVALUES_IQ4NL}
"""The types whose 4-bit codes index a table of 16 int8 values: code ``c`` means ``CODEBOOKS[t][c]``
times the block's scale (the reference dequantizers and the native kernels read them here)."""

PLANE_BITS = {"nibbles": 4, "bits": 1, "crumbs": 2, "three_bit": 3, "bytes": 8}
"""The code planes a 32-group's codes are stored in, and the bits of a code each holds: a plane of
``b`` bits holds ``CPU_TILE * CPU_GROUP * b / 8`` bytes per group and tile; a format's codes are
its planes' bits, lowest first (``nibbles`` then ``bits``: 5-bit codes)."""


@dataclass(frozen=True, slots=True)
class CpuFormat:
    """A layout of the native CPU kernels (qgemm's ``bits``). A packed weight is 16-row tiles,
    each a run of super-blocks of ``super_block`` weights a row; a super-block holds per 32-group
    the codes' planes, then ``scale_bytes`` of integer sub-scales, then float16 ``d[16]`` and,
    where ``has_z``, ``z[16]`` (an offset, or the mins' ``dmin``). ``float``: the file's rows."""

    name: str
    """The C++ constant's name: ``kFmt<name>``."""
    id: int
    """qgemm's ``bits``."""
    layout: str
    """``tile4``, ``tile8``, ``format`` or ``float`` (see the module's docstring)."""
    super_block: int = CPU_GROUP
    planes: tuple[str, ...] = ()
    """The code planes of a group, in the order they lie (keys of :data:`PLANE_BITS`)."""
    scale_bytes: int = 0
    """Sub-scale bytes per super-block and tile."""
    has_d: bool = True
    """A float16 ``d[16]`` follows the sub-scales (MXFP4 has none: its scale is its E8M0 byte)."""
    six_bit_scales: bool = False
    """The 16 sub-scales and mins per row and super-block held at six bits, as in the file."""
    has_z: bool = False
    code_offset: int = 0
    """What the unsigned codes ``u`` are stored above the signed ones: ``w = d sc (u - offset)``
    (a codebook format's ``u``: its looked-up values plus the offset, as the kernels multiply them)."""
    codebook: tuple[int, ...] = ()
    """The 16 int8 values the codes name (:data:`CODEBOOKS`; empty: the codes are the values)."""
    group_bytes: int = 0
    """A lattice format's file bytes per 32-group and row (grid indices, signs and the sub-scales that
    lie among them), kept as they are in the order ``fields.LATTICE_FIELDS`` gives; 0: code planes."""
    scales_doc: str = ""
    """The sub-scales and super-block scales, in words (for the generated header's table)."""

    @property
    def code_bits(self) -> int:
        """Bits of a code (a lattice format's: 8, the byte each weight is decoded into)."""
        if self.group_bytes:
            return 8
        return sum(PLANE_BITS[p] for p in self.planes)

    @property
    def value_bits(self) -> int:
        """Bits of the unsigned values ``u`` the kernels multiply (a codebook's values plus the offset;
        a lattice format's signed grid values plus 128)."""
        if self.codebook:
            return (max(self.codebook) + self.code_offset).bit_length()
        if self.group_bytes:
            return 8
        return self.code_bits

    @property
    def code_bytes(self) -> int:
        """Code bytes per 32-group and tile."""
        if self.group_bytes:
            return CPU_TILE * self.group_bytes
        return CPU_TILE * CPU_GROUP * self.code_bits // 8

    @property
    def block_bytes(self) -> int:
        """Bytes per super-block and tile: the groups' codes, the sub-scales, ``d`` (and ``z``)."""
        return (self.super_block // CPU_GROUP * self.code_bytes + self.scale_bytes
                + 2 * CPU_TILE * (self.has_d + self.has_z))

    def packed_bytes(self, n: int, k: int) -> int:
        """Bytes of a packed ``[n, k]`` weight (``n`` rounded up to whole tiles but in ``float``)."""
        if self.layout == "float":
            return n * k * 2
        return -(-n // CPU_TILE) * (k // self.super_block) * self.block_bytes

    @property
    def bits_per_weight(self) -> float:
        if self.layout == "float":
            return 16.0
        return 8 * self.block_bytes / (CPU_TILE * self.super_block)


_DZ = "d, dmin f16[16]"
CPU_FORMATS: tuple[CpuFormat, ...] = (
    # (in the order the C++ dispatches them)
    CpuFormat("Q4", 4, "tile4", planes=("nibbles",), has_z=True, scales_doc="d, z f16[16] a group"),
    CpuFormat("Q8", 8, "tile8", planes=("bytes",), code_offset=128, scales_doc="d f16[16] a group (z = -128 d)"),
    CpuFormat("Q4_0", 40, "format", planes=("nibbles",), code_offset=8, scales_doc="d f16[16]"),
    CpuFormat("Q4_K", 44, "format", 256, ("nibbles",), 192, six_bit_scales=True, has_z=True,
              scales_doc=f"six-bit sc, m | {_DZ}"),
    CpuFormat("Q5_0", 50, "format", planes=("nibbles", "bits"), code_offset=16, scales_doc="d f16[16]"),
    CpuFormat("Q5_1", 51, "format", planes=("nibbles", "bits"), has_z=True, scales_doc="d, m f16[16]"),
    CpuFormat("Q5_K", 55, "format", 256, ("nibbles", "bits"), 192, six_bit_scales=True, has_z=True,
              scales_doc=f"six-bit sc, m | {_DZ}"),
    CpuFormat("Q6_K", 66, "format", 256, ("nibbles", "crumbs"), 256, code_offset=32,
              scales_doc="sc i8[16][16] | d f16[16]"),
    CpuFormat("Q3_K", 33, "format", 256, ("three_bit",), 256, code_offset=4,
              scales_doc="sc-32 i8[16][16] | d f16[16]"),
    CpuFormat("Q2_K", 22, "format", 256, ("crumbs",), 256, has_z=True,
              scales_doc=f"(sc | m << 4) u8[16][16] | {_DZ}"),
    # the codebook formats: the file's 4-bit codes, looked up into their values (u = value + offset)
    CpuFormat("MXFP4", 94, "format", planes=("nibbles",), scale_bytes=16, has_d=False, code_offset=12,
              codebook=KVALUES_MXFP4, scales_doc="E8M0 e u8[16]"),
    CpuFormat("IQ4_NL", 41, "format", planes=("nibbles",), code_offset=128, codebook=KVALUES_IQ4NL,
              scales_doc="d f16[16]"),
    CpuFormat("IQ4_XS", 45, "format", 256, ("nibbles",), 96, code_offset=128, codebook=KVALUES_IQ4NL,
              scales_doc="sc+32: low 4 u8[4][16], high 2 u8[2][16] | d f16[16]"),
    # the lattice formats: each group's file bytes (grid indices, signs, sub-scales), the grid points
    # looked up as they are decoded into u = signed value + 128
    CpuFormat("IQ2_XXS", 21, "format", 256, group_bytes=8, code_offset=128,
              scales_doc="sc in the group's bytes | d f16[16]"),
    CpuFormat("IQ2_XS", 23, "format", 256, group_bytes=9, code_offset=128,
              scales_doc="sc per 16 in the group's bytes | d f16[16]"),
    CpuFormat("IQ2_S", 25, "format", 256, group_bytes=10, code_offset=128,
              scales_doc="sc per 16 in the group's bytes | d f16[16]"),
    CpuFormat("IQ3_XXS", 31, "format", 256, group_bytes=12, code_offset=128,
              scales_doc="sc in the group's bytes | d f16[16]"),
    CpuFormat("IQ3_S", 35, "format", 256, group_bytes=13, scale_bytes=64, code_offset=128,
              scales_doc="sc: 4-bit pairs u8[4][16] | d f16[16]"),
    CpuFormat("F16", 116, "float", scales_doc="the file's rows"),
    CpuFormat("BF16", 216, "float", scales_doc="the file's rows"),
)
CPU_FORMAT_BY_ID: dict[int, CpuFormat] = {f.id: f for f in CPU_FORMATS}
_BY_NAME = {f.name: f for f in CPU_FORMATS}

# The C++ kernels' format ids (qgemm's ``bits`` argument) of the ``format`` and ``float`` layouts.
(FMT_Q4_0, FMT_Q4_K, FMT_Q5_0, FMT_Q5_1, FMT_Q5_K, FMT_Q6_K, FMT_Q3_K, FMT_Q2_K, FMT_MXFP4, FMT_IQ4_NL,
 FMT_IQ4_XS, FMT_IQ2_XXS, FMT_IQ2_XS, FMT_IQ2_S, FMT_IQ3_XXS, FMT_IQ3_S, FMT_F16, FMT_BF16) = (
    _BY_NAME[n].id for n in ("Q4_0", "Q4_K", "Q5_0", "Q5_1", "Q5_K", "Q6_K", "Q3_K", "Q2_K", "MXFP4", "IQ4_NL",
                              "IQ4_XS", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "F16", "BF16"))


@dataclass(frozen=True, slots=True)
class QuantTraits:
    qtype: GGMLQuantizationType
    sub_size: int
    """Weights that share one scale (32 for the float types: the Triton kernels' group)."""
    affine: bool
    """``w = scale * q + offset`` (a "min"); else ``w = scale * q``."""
    cpu: CpuFormat | None
    """The native CPU route's layout (``None``: F32, used in place, or a type on the reference path)."""
    int4_slices: int | None = None
    """Slices on torch's int4 route (where the native kernels do not load): 1 (4-bit codes), 2
    (``q = 16 hi + lo``), or None (no int4 route)."""
    head_8bit: bool = False
    """An LM head of this type is held as 8-bit codes on the native route (its one-row kernel
    costs more per weight than the 8-bit one)."""
    triton: bool = True
    """The Triton kernels dequantize it."""

    @property
    def cpu_layout(self) -> str:
        """``tile4``, ``tile8``, ``format``, ``float``, ``f32`` or ``none``."""
        if self.cpu is not None:
            return self.cpu.layout
        return "f32" if self.qtype == T.F32 else "none"

    @property
    def cpu_format(self) -> int | None:
        """The C++ kernel's format id, for the ``format`` and ``float`` layouts."""
        return self.cpu.id if self.cpu is not None and self.cpu.layout in ("format", "float") else None


TRAITS: dict[GGMLQuantizationType, QuantTraits] = {t.qtype: t for t in (
    QuantTraits(T.F32, 32, False, None, head_8bit=True, triton=False),
    QuantTraits(T.F16, 32, False, _BY_NAME["F16"], head_8bit=True),
    QuantTraits(T.BF16, 32, False, _BY_NAME["BF16"], head_8bit=True),
    QuantTraits(T.Q8_0, 32, False, _BY_NAME["Q8"], int4_slices=2),
    QuantTraits(T.Q4_0, 32, False, _BY_NAME["Q4_0"], int4_slices=1),
    QuantTraits(T.Q4_1, 32, True, _BY_NAME["Q4"], int4_slices=1),
    # Q4_K in its own format (the file's codes, 6-bit sc/m per 32 at 6 bits, d/dmin per 256: its
    # file's bytes, exact; 1.03x with sc/m a byte each, as measured below). One row through 12 random 8192x2048 Q4_K matrices (beyond L3), 2 threads, AVX-512
    # EPYC, one pass: 0.232 ms a matrix against 0.249 on the 4-bit tiles (1.11x its file, d sc and
    # dmin m rounded to float16); 512 rows level (32.0 / 32.1 ms)
    QuantTraits(T.Q4_K, 32, True, _BY_NAME["Q4_K"], int4_slices=1),
    QuantTraits(T.Q5_0, 32, False, _BY_NAME["Q5_0"], int4_slices=2),
    QuantTraits(T.Q5_1, 32, True, _BY_NAME["Q5_1"], int4_slices=2),
    QuantTraits(T.Q5_K, 32, True, _BY_NAME["Q5_K"], int4_slices=2),
    QuantTraits(T.Q6_K, 16, False, _BY_NAME["Q6_K"]),
    QuantTraits(T.Q3_K, 16, False, _BY_NAME["Q3_K"]),
    QuantTraits(T.Q2_K, 16, True, _BY_NAME["Q2_K"]),
    # the codebook types (the Triton kernels look their codes up in registers: blocks._codebook_value)
    # MXFP4: 32 E2M1 codes and one E8M0 power-of-two scale a block (gpt-oss's experts)
    QuantTraits(T.MXFP4, 32, False, _BY_NAME["MXFP4"]),
    QuantTraits(T.IQ4_NL, 32, False, _BY_NAME["IQ4_NL"]),
    QuantTraits(T.IQ4_XS, 32, False, _BY_NAME["IQ4_XS"]),
    # the lattice types (groups of 4 or 8 weights named by a grid point, :mod:`localllm.quant.grids`)
    # (the Triton kernels read their grid points from a table argument: blocks.grid_arg)
    QuantTraits(T.IQ2_XXS, 32, False, _BY_NAME["IQ2_XXS"]),
    QuantTraits(T.IQ2_XS, 16, False, _BY_NAME["IQ2_XS"]),
    QuantTraits(T.IQ2_S, 16, False, _BY_NAME["IQ2_S"]),
    QuantTraits(T.IQ3_XXS, 32, False, _BY_NAME["IQ3_XXS"]),
    QuantTraits(T.IQ3_S, 32, False, _BY_NAME["IQ3_S"]),
    # IQ1 and the ternary types: no native CPU kernel, so the CPU's reference path holds the file's
    # blocks and dequantizes them at each use (IQ1 a 1.5-bit grid of 2048 points, the ternary types
    # base-3 digits: rare files, each a gather or a division a weight); the Triton kernels take them
    QuantTraits(T.IQ1_S, 32, False, None),  # (its +-delta offset scales with d, no min)
    QuantTraits(T.IQ1_M, 16, False, None),
    # the ternary types' scale is per 256; the Triton kernels decode them by 32 (each reads its d)
    QuantTraits(T.TQ1_0, 32, False, None),
    QuantTraits(T.TQ2_0, 32, False, None),
)}


def types_where(**conditions) -> frozenset[GGMLQuantizationType]:
    """The types whose traits have every given value, e.g. ``types_where(cpu_layout="format")``."""
    return frozenset(t for t, tr in TRAITS.items() if all(getattr(tr, k) == v for k, v in conditions.items()))
