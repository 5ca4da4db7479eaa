"""What each GGUF tensor type is, and how each backend holds it: the one table (in the spirit of
llama.cpp's ``type_traits`` and ``type_traits_cpu``). The CPU backend's routes
(:mod:`localllm.kernels.cpu.weights`), its C++ kernels' format ids
(:mod:`localllm.kernels.cpu.native`) and the Triton kernels' dequantization
(:mod:`localllm.kernels.triton.quant`) all read their per-type facts from :data:`TRAITS`.

CPU layouts (``cpu_layout``), the same on both instruction sets (AVX2 and AVX-512 VNNI build the
same kernels, to the same bits; see csrc/cpu_kernels.cpp):

* ``tile4`` / ``tile8``: 4- or 8-bit codes with one float16 affine map per 32 weights and row,
  in 16-row tiles (the VNNI/AVX2 4- and 8-bit kernels);
* ``format``: the file's own codes and integer sub-scales in 16-row tiles (``cpu_format`` is the
  kernel's format id), multiplied by one template over the vector width;
* ``float``: the file's rows as they are (F16, BF16), float32 FMA chains;
* ``f32``: used in place by torch (no native route).
"""

from __future__ import annotations

from dataclasses import dataclass

from gguf import GGMLQuantizationType

T = GGMLQuantizationType

# The C++ kernels' format ids (qgemm's ``bits`` argument) of the ``format`` and ``float`` layouts.
FMT_Q5_0, FMT_Q5_1, FMT_Q5_K, FMT_Q6_K, FMT_Q3_K, FMT_Q2_K, FMT_Q4_K, FMT_Q4_0 = 50, 51, 55, 66, 33, 22, 44, 40
FMT_F16, FMT_BF16 = 116, 216


@dataclass(frozen=True, slots=True)
class QuantTraits:
    qtype: GGMLQuantizationType
    sub_size: int
    """Weights that share one scale (32 for the float types: the Triton kernels' group)."""
    affine: bool
    """``w = scale * q + offset`` (a "min"); else ``w = scale * q``."""
    cpu_layout: str
    """The native CPU route's layout: ``tile4``, ``tile8``, ``format``, ``float`` or ``f32``."""
    cpu_format: int | None = None
    """The C++ kernel's format id, for the ``format`` and ``float`` layouts."""
    int4_slices: int | None = None
    """Slices on torch's int4 route (where the native kernels do not load): 1 (4-bit codes), 2
    (``q = 16 hi + lo``), or None (no int4 route)."""
    head_8bit: bool = False
    """An LM head of this type is held as 8-bit codes on the native route (its one-row kernel
    costs more per weight than the 8-bit one)."""
    triton: bool = True
    """The Triton kernels dequantize it."""


TRAITS: dict[GGMLQuantizationType, QuantTraits] = {t.qtype: t for t in (
    QuantTraits(T.F32, 32, False, "f32", head_8bit=True, triton=False),
    QuantTraits(T.F16, 32, False, "float", FMT_F16, head_8bit=True),
    QuantTraits(T.BF16, 32, False, "float", FMT_BF16, head_8bit=True),
    QuantTraits(T.Q8_0, 32, False, "tile8", int4_slices=2),
    QuantTraits(T.Q4_0, 32, False, "format", FMT_Q4_0, int4_slices=1),
    QuantTraits(T.Q4_1, 32, True, "tile4", int4_slices=1),
    # Q4_K in its own format (the file's codes, 6-bit sc/m per 32 at 6 bits, d/dmin per 256: its
    # file's bytes, exact; 1.03x with sc/m a byte each, as measured below). One row through 12 random 8192x2048 Q4_K matrices (beyond L3), 2 threads, AVX-512
    # EPYC, one pass: 0.232 ms a matrix against 0.249 on the 4-bit tiles (1.11x its file, d sc and
    # dmin m rounded to float16); 512 rows level (32.0 / 32.1 ms)
    QuantTraits(T.Q4_K, 32, True, "format", FMT_Q4_K, int4_slices=1),
    QuantTraits(T.Q5_0, 32, False, "format", FMT_Q5_0, int4_slices=2),
    QuantTraits(T.Q5_1, 32, True, "format", FMT_Q5_1, int4_slices=2),
    QuantTraits(T.Q5_K, 32, True, "format", FMT_Q5_K, int4_slices=2),
    QuantTraits(T.Q6_K, 16, False, "format", FMT_Q6_K),
    QuantTraits(T.Q3_K, 16, False, "format", FMT_Q3_K),
    QuantTraits(T.Q2_K, 16, True, "format", FMT_Q2_K),
)}


def types_where(**conditions) -> frozenset[GGMLQuantizationType]:
    """The types whose traits have every given value, e.g. ``types_where(cpu_layout="format")``."""
    return frozenset(t for t, tr in TRAITS.items() if all(getattr(tr, k) == v for k, v in conditions.items()))
