"""GGUF weights repacked once into layouts the CPU's vector units consume.

Two routes, chosen per weight when it is first prepared (:func:`prepare`):

* **native** (preferred): on x86 CPUs with AVX-512 VNNI or AVX2 (with FMA and F16C), every GGUF
  type but F32 (:class:`NativeWeight`, multiplied by the compiled kernels of
  :mod:`localllm.kernels.cpu.native`, int8 activations per 32-element group as llama.cpp's, exact
  integer dot products per group, optionally a second pass over the int8-quantized residual: see
  :func:`localllm.kernels.cpu.matmul.activation_passes`). A row's result does not depend on the
  other rows of its batch for a given number of passes (no algorithm switch, split or reduction
  order that depends on the batch). Weights are held in 16-row tiles; a weight whose row count is
  not a multiple of 16 gets zero rows in its last tile (their outputs are dropped). Per type, its
  layout per 16-row tile and its bits per weight against the file's: the table at the top of
  ``csrc/formats.h``, written from :data:`localllm.quant.traits.CPU_FORMATS` (Q4_1 and Q8_0 take
  the 4- and 8-bit tiles, ``native.pack``; Q4_0 has no stored offset: ``u - 8``; F16 and BF16 are
  the file's rows as they are, a view of the file); every one exact, at the file's bytes
  (Q3_K: 1.04x). The formats beyond Q4_1/Q8_0 (:data:`localllm.kernels.cpu.native.FORMATS`,
  layouts and integer arithmetic in ``csrc/fmt_common.h`` and the formats' headers) keep the
  file's codes and integer sub-scales: the kernel multiplies the sub-scales into exact integer group sums and applies the
  file's float16 super-block scales once per 32-group, so ``rows(ids)`` gives the file's float32
  weights and the kernel's result is the float64 product of the activation codes with the file's
  weights up to float32 rounding (every per-type fact of these routes lives in
  :data:`localllm.quant.traits.TRAITS`). F16 and BF16 are
  multiplied in float32 (two FMA chains per output, the activations not quantized), except an
  LM head of a type in :data:`HEAD_8BIT_TYPES` (F32, F16, BF16), held as 8-bit codes
  (:func:`prepare_head`, ``CpuOptions.head_8bit``) whose top logits are recomputed from the
  file's rows.
  ``CpuOptions.native`` (``LOCALLLM_CPU_NATIVE=0``) turns the route off. Each weight's packed
  size per row must be within ``CpuOptions.max_growth`` of the file's (always true today).
* **int4** (:class:`~localllm.kernels.cpu.int4.Int4Weight`, :mod:`localllm.kernels.cpu.int4`): torch's
  int4 tile layout and kernel, where the native kernels are off or do not load (no compiler, a CPU
  without AVX2); there Q2_K, Q3_K, Q6_K, F16, the codebook types (MXFP4, IQ4_NL, IQ4_XS) and the
  lattice ones (IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S) have no route (the reference path runs) and F32 and BF16 weights are used as they are (:class:`FloatWeight`). F32 takes :class:`FloatWeight` everywhere.

The GGUF blocks' codes and scales both routes start from: :mod:`localllm.kernels.cpu.fields`.

Memory and time: each weight is repacked once (0.5 s in all for SmolLM2-135M on one core);
then the file pages read to repack it are dropped from the process's resident set
(:func:`localllm.platform.memory.release_file_pages`) and the repack's temporaries are
handed back (``malloc_trim``), so the repacked copy replaces the file's pages rather than adding
to them: for SmolLM2-135M, 97 MiB repacked for a 94 MiB file, and the same process RSS as the
reference path. Nothing else is cached; large batches dequantize into transients that live for
one matmul.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from localllm.kernels.cpu import native
from localllm.kernels.cpu.fields import GROUP, LATTICE_FIELDS, REPACK_CHUNK_ROWS, affine_fields, format_fields
from localllm.kernels.cpu.int4 import repack_int4
from localllm.kernels.cpu.options import CpuOptions
from localllm.platform.memory import huge_page_buffer, release_file_pages, trim_heap
from localllm.quant.gguf_dequant import (
    as_bytes,
    dequantize,
)
from localllm.quant.traits import TRAITS, types_where

T = GGMLQuantizationType

_NORM_CHUNK_ROWS = 1024

# Per type, from the one table (localllm.quant.traits): the int4 route's types and slices, the
# native route's 4/8-bit tile types and format ids (the file's codes and scales: exact)
_INT4_TYPES = frozenset(t for t, tr in TRAITS.items() if tr.int4_slices)
_ONE_SLICE_TYPES = types_where(int4_slices=1)
_NATIVE_TYPES = types_where(cpu_layout="tile4") | types_where(cpu_layout="tile8")
_FORMAT_OF = {t: tr.cpu_format for t, tr in TRAITS.items() if tr.cpu_layout in ("format", "float")}
_FLOAT_ROUTES = frozenset({T.F32, T.BF16})


@dataclass(slots=True)
class NativeWeight:
    """A weight ``[n, k]`` in the native kernel's tiles (see :mod:`localllm.kernels.cpu.native`)."""

    packed: torch.Tensor  # uint8, native.pack's or native.pack_format's layout (or F16/BF16 rows)
    bits: int  # the format: 4, 8 (z = -128 d), or a native.FORMATS / FLOAT_FORMATS id
    n: int
    k: int
    max_scale_error: float  # max over rows of ||w_n - file's w_n||_2 (0 where the layout is exact)
    known_row_norm: float | None = None  # max_row_norm when the packer knew it; else computed on first use

    @property
    def nbytes(self) -> int:
        return self.packed.numel()

    @property
    def max_row_norm(self) -> float:
        """An upper bound on ``max_n ||w_n||_2`` over the file's rows (for an LM head's error bound):
        the stored rows' largest norm plus :attr:`max_scale_error`. Computed once, on first use,
        from the packed weight (only LM heads ask, so loading does not pay for every weight)."""
        if self.known_row_norm is None:
            kernels, largest = native.module(), 0.0
            for start in range(0, self.n, _NORM_CHUNK_ROWS):
                ids = torch.arange(start, min(start + _NORM_CHUNK_ROWS, self.n))
                rows = kernels.dequant_rows(self.packed, self.bits, self.n, self.k, ids)
                largest = max(largest, rows.double().square().sum(1).max().sqrt().item())
            self.known_row_norm = largest + self.max_scale_error
        return self.known_row_norm

    @property
    def exact(self) -> bool:
        """Whether the stored codes and scales give the file's weights exactly (every type today)."""
        return self.max_scale_error == 0.0

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` of the weight, float32 ``[len(ids), k]`` (the file's values when ``exact``)."""
        return native.module().dequant_rows(self.packed, self.bits, self.n, self.k, ids.long())

    def matmul(self, x2: torch.Tensor, passes: int, order: torch.Tensor | None = None) -> torch.Tensor:
        """``x2 [m, k]`` (any float dtype) -> float32 ``[m, n]``, with ``passes`` activation
        passes (see :func:`localllm.kernels.cpu.matmul.activation_passes`; the F16/BF16 formats
        take the activations as they are); ``order`` (int32 ``[k]``): ``x2``'s columns read through
        it (a GPTQ act-order, gathered inside the kernel)."""
        xf = x2 if x2.dtype == torch.float32 and x2.is_contiguous() else x2.float().contiguous()
        return native.qgemm(xf, self.packed, self.bits, self.n, self.k, passes, order=order)

    def error_bound(self, x2: torch.Tensor, passes: int) -> torch.Tensor:
        """Per row of ``x2``, a bound on ``|matmul(x2) - x2 @ W.T|`` for every output (``W`` as
        the file defines it): the activation codes' error norm times the largest weight row norm
        plus the input's norm times the largest row error of the stored scales (Cauchy-Schwarz),
        plus the float32 arithmetic's share: ``(||e|| R + ||x|| S + sum_p |xs_p xq_p| R (p K/32 + 4) 2**-24) 1.001``
        with ``e = x - sum_p xs_p xq_p`` (the kernel's codes, ``p`` passes; each group term takes at
        most two roundings, the sum one per term: a proof for the formats without a min or offset,
        the row norm's slack for the others, see ``qgemm_error_bounds``), ``R`` :attr:`max_row_norm`, ``S``
        :attr:`max_scale_error` (one native call). F16/BF16 (activations not quantized): the float32
        FMA chains' rounding only, ``(k/16 + 5)`` roundings of at most ``2**-24`` relative each,
        doubled, times ``|x| . |w| <= ||x|| ||w||``."""
        xf = x2.float()
        if self.bits in native.FLOAT_FORMATS:
            return xf.norm(dim=1) * self.max_row_norm * ((self.k / 16 + 5) * 2.0**-23) * 1.001
        return native.module().qgemm_error_bounds(xf.contiguous(), passes, self.max_row_norm, self.max_scale_error)


_JOIN_ALIGN = 64  # bytes: each weight of a joined allocation starts on a cache line


def join_packed(weights, huge_pages: bool) -> None:
    """Move the packed bytes of ``weights`` (a decoder layer's, read one after another by its native
    call, or an LM head alone) into one allocation, each a cache line after the one before, in
    transparent huge pages with ``huge_pages`` (:func:`~localllm.platform.memory.huge_page_buffer`):
    the threads then stream one stretch of memory instead of a piece of each (SmolLM2's q/k/v of a
    GPTQ checkpoint whose three input orders differ: 22.7 -> 20.0 us a layer from memory) and walk
    one page table entry per 2 MiB. Each weight's ``packed`` becomes a view of it and the separate
    tensors are freed. F16/BF16 weights (the file's rows, which may be its mapped pages) stay where
    they are."""
    movable = [w for w in weights
               if w.bits not in native.FLOAT_FORMATS and w.packed.dim() == 1 and w.packed.dtype == torch.uint8]
    if len(movable) < (1 if huge_pages else 2):
        return  # (a weight alone in small pages: a copy would gain nothing)
    first = movable[0].packed.untyped_storage()
    if (all(w.packed.untyped_storage().data_ptr() == first.data_ptr() for w in movable)
                       and first.nbytes() > movable[0].packed.numel()):
        return  # (joined already: a plan made again)
    offsets, total = [], 0
    for w in movable:
        offsets.append(total)
        total += -(-w.packed.numel() // _JOIN_ALIGN) * _JOIN_ALIGN
    joined = huge_page_buffer(total) if huge_pages else torch.empty(total, dtype=torch.uint8)
    for w, at in zip(movable, offsets):
        view = joined[at:at + w.packed.numel()]
        view.copy_(w.packed)
        w.packed = view


RawRows = torch.Tensor | list[torch.Tensor]
"""A weight's GGUF rows (uint8 ``[n, bytes_per_row]``), or those of several weights fused into one
as a list (each but the last a whole number of tiles), read in place rather than concatenated."""


def _row_chunks(raw: RawRows, qtype: GGMLQuantizationType):
    """``(rows, blocks)`` per ``REPACK_CHUNK_ROWS`` rows of ``raw``: the row count and the GGUF
    blocks uint8 ``[rows * blocks_per_row, type_size]``."""
    type_size = GGML_QUANT_SIZES[qtype][1]
    for part in raw if isinstance(raw, list) else [raw]:
        for start in range(0, part.shape[0], REPACK_CHUNK_ROWS):
            rows = part[start : start + REPACK_CHUNK_ROWS]
            yield rows.shape[0], rows.contiguous().view(-1, type_size)


def _joined(raw: RawRows) -> torch.Tensor:
    return torch.cat(raw) if isinstance(raw, list) else raw


def repack_native(raw: RawRows, qtype: GGMLQuantizationType, n: int, k: int) -> NativeWeight:
    """Repack GGUF rows ``raw`` (uint8 ``[n, bytes_per_row]``) for the native kernel, in chunks
    of ``REPACK_CHUNK_ROWS`` rows (a multiple of 16) so that temporaries stay small; the last
    tile is padded with zero rows."""
    if qtype in _FORMAT_OF:
        return repack_format(raw, qtype, n, k)
    parts, err2 = [], 0.0
    for r, blocks in _row_chunks(raw, qtype):
        q, bits, s, z = affine_fields(blocks, qtype)
        q = q.reshape(r, k)
        s = s.reshape(r, k // GROUP)
        z = z.reshape(r, k // GROUP)
        s16, z16 = s.to(torch.float16), z.to(torch.float16)  # the kernel's scales (the file's: exact)
        r16 = -(-r // native.TILE) * native.TILE
        parts.append(native.pack(native.pad_rows(q, r16), bits, native.pad_rows(s16, r16),
                                 None if bits == 8 else native.pad_rows(z16, r16)))
        err2 = max(err2, _scale_error2(bits, s, z, s16, z16))
    packed = parts[0] if len(parts) == 1 else torch.cat(parts)
    return NativeWeight(packed, bits, n, k, err2**0.5)


def _scale_error2(bits: int, s: torch.Tensor, z: torch.Tensor, s16: torch.Tensor, z16: torch.Tensor) -> float:
    """A bound on ``max_n ||w16_n - w_n||^2`` where ``w = s*q + z`` per 32-group (scales ``[r,
    k/32]``, codes ``q`` in ``[0, 2**bits)``) and ``w16`` the same with the float16 scales: per
    group ``32 * max_q (dz + ds*q)^2``, the maximum at ``q = 0`` or ``q = 2**bits - 1`` (linear
    in ``q``), from the scales alone. 0.0 when the float16 scales equal the file's (Q4_0, Q4_1,
    Q8_0)."""
    if torch.equal(s16.float(), s) and torch.equal(z16.float(), z):
        return 0.0
    ds, dz = (s16.double() - s.double()), (z16.double() - z.double())
    if not (ds.any() or dz.any()):
        return 0.0
    worst = torch.maximum(dz.abs(), (dz + ds * (2**bits - 1)).abs())
    return (GROUP * worst.square()).sum(1).max().item()


def repack_format(raw: RawRows, qtype: GGMLQuantizationType, n: int, k: int) -> NativeWeight:
    """GGUF rows ``raw`` of a ``_FORMAT_OF`` type in its native format: the file's codes, integer
    sub-scales and float16 scales (exact), or for F16/BF16 the rows themselves (a view of
    ``raw`` where it is contiguous)."""
    fmt = _FORMAT_OF[qtype]
    if fmt in native.FLOAT_FORMATS:
        return NativeWeight(_joined(raw).contiguous().view(-1), fmt, n, k, 0.0)
    sb = native.FORMATS[fmt].super_block
    parts = []
    for r, blocks in _row_chunks(raw, qtype):
        if qtype in LATTICE_FIELDS:
            parts.append(native.pack_lattice(fmt, blocks, r, *LATTICE_FIELDS[qtype]))
            continue
        u, scales, d, z = format_fields(blocks, qtype)
        nsb = k // sb
        parts.append(native.pack_format(
            fmt, u.reshape(r, k), None if scales is None else scales.reshape(r, nsb, -1),
            None if d is None else d.reshape(r, nsb), None if z is None else z.reshape(r, nsb)))
    packed = parts[0] if len(parts) == 1 else torch.cat(parts)
    return NativeWeight(packed, fmt, n, k, 0.0)


def _native_route(qtype: GGMLQuantizationType, n: int, k: int, options: CpuOptions) -> bool:
    """Whether ``qtype`` ``[n, k]`` takes the native route: a kernel for it loads, ``k`` fits its
    blocks, and its packed size is within ``options.max_growth`` of the file's."""
    if qtype in _NATIVE_TYPES:
        if k % GROUP:
            return False
        bits = 8 if qtype == T.Q8_0 else 4
    elif qtype in _FORMAT_OF:
        bits = _FORMAT_OF[qtype]
        if k % (native.FORMATS[bits].super_block if bits in native.FORMATS else GROUP):
            return False
    else:
        return False
    module = native.load(options)
    if module is None or (bits not in (4, 8) and not module.formats()):
        return False
    block, type_size = GGML_QUANT_SIZES[qtype]
    # per row (the last tile's padding, under 16 rows, is not counted: it only matters for tiny weights)
    return native.packed_bytes(native.TILE, k, bits) / native.TILE <= options.max_growth * (k // block) * type_size


@dataclass(slots=True)
class FloatWeight:
    """An F32 or BF16 weight used in place (a view of the file)."""

    weight: torch.Tensor  # [n, k] float32 or bfloat16

    @property
    def nbytes(self) -> int:
        return 0  # a view, nothing new held

    @property
    def exact(self) -> bool:
        return self.weight.dtype == torch.float32

    def matmul(self, x2: torch.Tensor, rows_alone: bool = False) -> torch.Tensor:
        """``x2 @ W.T``; with ``rows_alone``, one row at a time: torch's GEMM picks its kernel (and
        its sums' order) by the row count, so a row would not get the bits it gets alone. The
        weights this serves on the native route are small (a mixture of experts' router) or rare
        (F32 files)."""
        x2 = x2.to(self.weight.dtype)
        if not rows_alone or x2.shape[0] <= 1:
            return torch.nn.functional.linear(x2, self.weight)
        return torch.cat([torch.nn.functional.linear(x2[i:i + 1], self.weight) for i in range(x2.shape[0])])


UNSUPPORTED = object()
"""What :func:`prepare` returns for a weight without a route (it stays on the reference path)."""


def prepare(raw: torch.Tensor, qtype: GGMLQuantizationType, n: int, k: int, options: CpuOptions):
    """GGUF rows ``raw`` (``[n, k]`` weights) as a :class:`NativeWeight`, :class:`Int4Weight` or
    :class:`FloatWeight`, or :data:`UNSUPPORTED`; the file pages read are released (see
    ``CpuOptions.release_file_pages``) unless the weight is a view of them (F16/BF16 rows)."""
    if qtype in (T.F16, T.BF16) and _native_route(qtype, n, k, options):
        return repack_format(as_bytes(raw, qtype), qtype, n, k)  # the file's rows: nothing to release
    if qtype in _FLOAT_ROUTES:
        dtype = torch.float32 if qtype == T.F32 else torch.bfloat16
        return FloatWeight(as_bytes(raw, qtype).contiguous().view(dtype).view(n, k))
    if qtype not in _INT4_TYPES | _FORMAT_OF.keys() or qtype == T.F16 or k % GROUP:
        return UNSUPPORTED
    raw = as_bytes(raw, qtype)
    weight = _repack(raw, qtype, n, k, options)
    if weight is UNSUPPORTED:
        return weight
    if options.release_file_pages:
        release_file_pages(raw)
        trim_heap()
    return weight


HEAD_8BIT_TYPES = types_where(head_8bit=True)
"""LM head types held as 8-bit codes on the native route (``CpuOptions.head_8bit``): those whose
one-row kernel takes longer per weight than the 8-bit one, which streams 8.5 bits per weight at
about the memory's speed. Measured at one row, two passes, 2 threads, 12 copies of 8192 x 2048
(beyond the last-level cache), median of 5 rounds, Zen 4: the 8-bit kernel 51 ps per weight,
F16 90. Q6_K (36) and Q5_K (33) are faster in their own formats, as the one-row kernels
prefetch into L2; so are Q5_0/Q5_1, Q4_K, Q3_K, Q2_K.
F32 (float32 embeddings tied to the head: GPTQ checkpoints saved in float32) is read by torch's
float32 matmul at 32 bits per weight, almost 4x the 8-bit codes' bytes. The LM head is the
largest matrix of a small model and read at every decode step."""


def prepare_head(raw: torch.Tensor, qtype: GGMLQuantizationType, n: int, k: int, options: CpuOptions):
    """An LM head's weight: as :func:`prepare`, except that a head of a type in
    :data:`HEAD_8BIT_TYPES` on the native route becomes 8-bit codes (``options.head_8bit``, see
    :func:`quantize_rows_8bit`); its top logits are then recomputed from the file's rows by the
    caller."""
    if (qtype in HEAD_8BIT_TYPES and options.head_8bit and k % GROUP == 0
            and _native_route(T.Q8_0, n, k, options)):
        raw = as_bytes(raw, qtype)
        weight = quantize_rows_8bit(raw, qtype, n, k)
        if options.release_file_pages:
            release_file_pages(raw)
            trim_heap()
        return weight
    return prepare(raw, qtype, n, k, options)


def quantize_rows_8bit(raw: torch.Tensor, qtype: GGMLQuantizationType, n: int, k: int) -> NativeWeight:
    """GGUF rows ``raw`` (uint8 ``[n, bytes per row]``) as the native 8-bit format: per 32-group a float16
    scale ``d = max|w| / 127`` (rounded) and codes ``round(w / d)`` in ``[-128, 127]``, Q8_0's
    scheme. Not exact: ``max_scale_error`` is the largest row's error norm, measured."""
    parts, err2, norm2 = [], 0.0, 0.0
    for start in range(0, n, REPACK_CHUNK_ROWS):
        w = dequantize(raw[start : start + REPACK_CHUNK_ROWS], qtype).view(-1, k)
        r = w.shape[0]
        g = w.view(r, k // GROUP, GROUP)
        d16 = (g.abs().amax(-1) / 127).to(torch.float16)
        d = d16.float()
        inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
        q = torch.round(g * inv[..., None]).clamp_(-128, 127)
        err2 = max(err2, (q * d[..., None] - g).square().sum((1, 2)).max().item())
        norm2 = max(norm2, w.square().sum(1).max().item())
        r16 = -(-r // native.TILE) * native.TILE
        u = (q.to(torch.int16) + 128).to(torch.uint8).view(r, k)
        parts.append(native.pack(native.pad_rows(u, r16), 8, native.pad_rows(d16, r16), None))
    packed = parts[0] if len(parts) == 1 else torch.cat(parts)
    return NativeWeight(packed, 8, n, k, err2**0.5, known_row_norm=norm2**0.5)


def _repack(raw: RawRows, qtype: GGMLQuantizationType, n: int, k: int, options: CpuOptions):
    """GGUF rows ``raw`` (uint8 ``[n, bytes_per_row]``) on the native route where it takes them,
    else the int4 route within ``options.max_growth``, else ``UNSUPPORTED``."""
    if _native_route(qtype, n, k, options):
        return repack_native(raw, qtype, n, k)
    raw = _joined(raw)
    num_slices = 1 if qtype in _ONE_SLICE_TYPES else 2
    if (qtype not in _INT4_TYPES or n % 16
            or n * k * num_slices * (0.5 + 4 / GROUP) > options.max_growth * raw.numel()):
        return UNSUPPORTED
    return repack_int4(raw, qtype, n, k)


def prepare_fused(modules, options: CpuOptions):
    """``(NativeWeight | Int4Weight, bias | None)`` for ``modules`` repacked as one weight, or ``UNSUPPORTED``
    unless they are all GGUF linears (``raw``/``qtype``) of one routed type and input size (F16/BF16
    on the native route only: their rows are then copied into one weight)."""
    first = modules[0]
    qtype, k = getattr(first, "qtype", None), getattr(first, "in_features", None)
    for m in modules:
        raw = getattr(m, "raw", None)
        if (not isinstance(raw, torch.Tensor) or not raw.is_cpu or getattr(m, "qtype", None) != qtype
                or getattr(m, "in_features", None) != k or getattr(m, "is_lm_head", False)):
            return UNSUPPORTED
    if qtype not in _INT4_TYPES | _FORMAT_OF.keys() or k % GROUP:
        return UNSUPPORTED
    if qtype in (T.F16, T.BF16) and not _native_route(qtype, 16, k, options):
        return UNSUPPORTED  # the float types fuse on the native route only
    n = sum(m.out_features for m in modules)
    raws = [as_bytes(m.raw, qtype) for m in modules]
    whole_tiles = all(m.out_features % native.TILE == 0 for m in modules[:-1])
    weight = _repack(raws if whole_tiles else torch.cat(raws), qtype, n, k, options)
    if weight is UNSUPPORTED:
        return weight
    bias = None
    if any(getattr(m, "bias", None) is not None for m in modules):
        bias = torch.cat([m.bias.float() if m.bias is not None else torch.zeros(m.out_features) for m in modules])
    if options.release_file_pages:
        for r in raws:
            release_file_pages(r)
        trim_heap()
    return weight, bias


