"""The native CPU kernels: their build and their contract (a quantized matmul with int8
activations, and a decoder layer's other ops), for x86 CPUs with AVX-512 VNNI or with AVX2.

``csrc/cpu_kernels.cpp`` (one translation unit: its headers beside it, ``formats.h`` generated
from :data:`localllm.quant.traits.CPU_FORMATS`) is compiled for this machine (``-march=native``)
on first use with ``torch.utils.cpp_extension`` (needs a C++ compiler; about a minute once, then
cached under ``CpuOptions.kernel_cache`` (``LOCALLLM_KERNEL_CACHE``) or the localllm cache, per
source, torch, machine and instruction set), and only where the CPU has one of its instruction sets
(:func:`cpu_isa`): AVX-512 VNNI (``vpdpbusd``), else AVX2 with FMA and F16C (``vpmaddubsw``;
the same layout and results: the integer group sums are exact on both). The build reports the
one it uses (``module.isa()``); ``CpuOptions.isa`` (``LOCALLLM_CPU_ISA=avx2``) builds the AVX2
kernels on an AVX-512 CPU too, which is how the tests cover the AVX2 route there. Anywhere else, or when compiling fails, :func:`load` returns
``None`` and callers keep their torch route. ``CpuOptions.native`` (``LOCALLLM_CPU_NATIVE=0``)
turns it off.

Weights: unsigned codes ``u`` (4 or 8 bits) with a per-32-group affine map ``w = d * u + z``,
packed by :func:`pack` into tiles of 16 output rows (layout at the top of ``cpu_kernels.cpp``).
Activations are quantized per row and 32-element group to int8 (``x ~ xs * xq``, round to
nearest, as llama.cpp's Q8 activations), so the kernel computes exactly

    y[m, n] = sum_g  xs[m, g] * (d[n, g] * sum_i u[n, g, i] * xq[m, g, i] + z[n, g] * sum_i xq[m, g, i])

in float32 after exact integer group sums; :func:`reference_qgemm` is that definition in torch.

Q4_1 and Q8_0 take those 4- and 8-bit tiles. Every other
GGUF type (Q4_0 without a stored offset, Q4_K, Q5_0, Q5_1,
Q5_K, Q6_K, Q3_K, Q2_K, MXFP4, IQ4_NL, IQ4_XS, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, F16, BF16) has a format of
its own (:data:`FORMATS`, packed by :func:`pack_format` or, for the lattice ones, :func:`pack_lattice`, layouts and
arithmetic in ``csrc/fmt_common.h`` and the formats' headers): the file's codes
(4, 5, 6, 3 or 2 bits: bit planes or, for Q3_K, bytes of two codes and part of a third, not widened; the
codebook formats' 4-bit codes looked up into their int8 values as the kernel decodes them; the lattice
formats' grid indices, signs and sub-scales as the file's bytes, grid points looked up), its integer
sub-scales and mins (six bits each in Q4_K and Q5_K, as in the file) and its float16 super-block scales, so the stored weights are the file's
exactly (``dequant_rows``), at its bytes (Q3_K: 1.04x, its sub-scales a byte each); F16 and BF16 are multiplied as they are. The kernel's integer sums are exact and its
result is the float64 product of the quantized activations with the file's weights
(:func:`reference_qgemm_weights`) up to float32 rounding, a fixed sequence per output for any
batch. Rows need not be a multiple of 16 (the last tile is padded with zero rows).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import platform
from pathlib import Path

import torch

from localllm.kernels.cpu.options import CpuOptions
from localllm.quant.traits import (  # noqa: F401 - the kernels' format ids, re-exported
    CPU_FORMAT_BY_ID,
    CPU_FORMATS,
    CPU_GROUP,
    CPU_TILE,
    FMT_BF16,
    FMT_F16,
    FMT_IQ4_NL,
    FMT_IQ4_XS,
    FMT_MXFP4,
    FMT_Q2_K,
    FMT_Q3_K,
    FMT_Q4_0,
    FMT_Q4_K,
    FMT_Q5_0,
    FMT_Q5_1,
    FMT_Q5_K,
    FMT_Q6_K,
    PLANE_BITS,
    CpuFormat,
)

log = logging.getLogger(__name__)

GROUP = CPU_GROUP
TILE = CPU_TILE
SOURCE = Path(__file__).with_name("csrc") / "cpu_kernels.cpp"
"""The one translation unit; the headers it includes lie beside it (:func:`sources`)."""


def sources(cpp: Path = SOURCE) -> list[Path]:
    """The files a build of ``cpp`` reads: itself and every header beside it (sorted by name)."""
    return [cpp, *sorted(cpp.parent.glob("*.h"))]


def source_digest(cpp: Path = SOURCE) -> bytes:
    """The bytes that name a build's source: each file of :func:`sources`, its name and its text."""
    return b"".join(p.name.encode() + b"\0" + p.read_bytes() + b"\0" for p in sources(cpp))

_MODULE = None
_TRIED = False


ISA_FLAGS = {
    "avx512vnni": {"avx512f", "avx512bw", "avx512_vnni", "f16c"},
    "avx2": {"avx2", "fma", "f16c"},
}
"""The /proc/cpuinfo flags each native instruction set needs, the preferred one first (the C++
file picks the same one from the compiler's ``-march=native`` macros)."""


def _cpuinfo(field: str) -> str:
    """The first /proc/cpuinfo line's value for ``field`` ("" where it is not an x86 Linux machine)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                name, _, value = line.partition(":")
                if name.strip() == field:
                    return value.strip()
    except OSError:
        pass
    return ""


def _cpu_flags() -> set[str]:
    """This CPU's /proc/cpuinfo flags (none where it is not an x86 Linux machine)."""
    return set(_cpuinfo("flags").split())


INTEL_WEIGHT_PREFETCH = 8192
"""How far ahead an Intel core's one-row kernels ask for their weights. A core of an Intel server
part reads memory at about half the two cores' streaming rate and its hardware prefetchers alone
leave it far below that: one row through 40 copies of 8192x2048, 2 threads, Xeon (family 6, model
207), best GB/s of the hardware's prefetchers / 8 / 16 / 32 KiB ahead, against a streaming read of
28: AVX-512 Q4_0 19.0 / 26.2 / 27.8 / 24.1, Q4_K 16.2 / 23.7 / 24.5 / 21.5, Q6_K 17.7 / 24.0 /
23.5 / 21.6, Q8_0 24.9 / 28.3 / 29.4 / 26.7; AVX2 Q4_K 10.9 / 19.4 at 8 KiB. (AMD's cores stream the
cheap formats faster without: see ``one_row_ahead`` in ``csrc/fmt_kernel.h``.)"""


KQUANT_WEIGHT_PREFETCH = 8192
"""How far ahead a Zen 5 core's (AMD family 26 and later) one-row K-quant kernels ask for their weights,
where Zen 4's stream them faster on the hardware's prefetchers alone (see ``one_row_ahead`` in
``csrc/fmt_kernel.h``); the 32-group formats still take none. Zen 5, 2 threads, AVX-512: one row
through 10 copies of 8192x2048, best GB/s of none / 4 / 8 KiB ahead in two interleaved passes, Q4_K
35.6 / 46.0 / 64.4 and 38.2 / 66.7 / 43.1, Q5_K 29.8 / 43.2 / 54.2 and 30.3 / 59.4 / 40.8 (the host's
read speed moved between runs); the 1B-shaped files' decode, builds alternating in one process, median
pairwise ratio at 8 KiB: Q4_K_M 1.17x (49.2 -> 57.7 tokens/s, 6 rounds), Q5_K_M 1.18x, Q3_K_M 1.33x,
Q6_K 1.00x (4 rounds each)."""


def kquant_prefetch(options: CpuOptions) -> int | None:
    """The K-quants' one-row prefetch distance for this CPU where it differs from the per-format table
    (``None``): Zen 5 and later, unless the setting sets one distance for every format."""
    if options.weight_prefetch is not None or _cpuinfo("vendor_id") != "AuthenticAMD":
        return None
    try:
        family = int(_cpuinfo("cpu family"))
    except ValueError:
        return None
    return KQUANT_WEIGHT_PREFETCH if family >= 26 else None


def weight_prefetch(options: CpuOptions) -> int | None:
    """The one-row kernels' weight prefetch distance in bytes for this CPU (``options``' where set),
    or ``None`` for the per-format table (``one_row_ahead``)."""
    if options.weight_prefetch is not None:
        return options.weight_prefetch
    return INTEL_WEIGHT_PREFETCH if _cpuinfo("vendor_id") == "GenuineIntel" else None


def cpu_isa() -> str | None:
    """The native kernels' instruction set this CPU supports: ``"avx512vnni"``, else ``"avx2"``
    (AVX2, FMA and F16C), else ``None`` (not x86, or neither; Linux /proc/cpuinfo flags)."""
    flags = _cpu_flags()
    return next((isa for isa, need in ISA_FLAGS.items() if need <= flags), None)


def build_isa(options: CpuOptions) -> str | None:
    """The instruction set the kernels are built for: ``options.isa`` where this CPU has it (an
    AVX-512 CPU runs the AVX2 build too), the best one it has when that is ``None``, else ``None``."""
    if options.isa is None:
        return cpu_isa()
    return options.isa if ISA_FLAGS[options.isa] <= _cpu_flags() else None


def cpu_has_native() -> bool:
    """Whether this CPU has an instruction set the native kernels are written for."""
    return cpu_isa() is not None


cpu_has_vnni = cpu_has_native
"""The old name of :func:`cpu_has_native` (from when AVX-512 VNNI was the only native route):
true on AVX2 CPUs too; :func:`cpu_isa` tells them apart."""


def compiler_flags(isa: str, prefetch: int | None = None, kquant_ahead: int | None = None) -> list[str]:
    """The C++ flags of the build for ``isa`` (``-mno-avx512f`` turns every AVX-512 extension off:
    the source then picks its AVX2 kernels) whose one-row kernels ask for their weights ``prefetch``
    bytes ahead (``None``: the per-format table; see :func:`weight_prefetch`), the K-quants'
    ``kquant_ahead`` (see :func:`kquant_prefetch`)."""
    ahead = [] if prefetch is None else [f"-DLOCALLLM_WEIGHT_AHEAD={int(prefetch)}"]
    if kquant_ahead is not None:
        ahead.append(f"-DLOCALLLM_KQUANT_AHEAD={int(kquant_ahead)}")
    return ["-O3", "-march=native", "-fopenmp", *(["-mno-avx512f"] if isa == "avx2" else []), *ahead]


def _build_dir(options: CpuOptions, flags: list[str]) -> Path:
    if options.kernel_cache is not None:
        path = options.kernel_cache
    else:
        from localllm.config.paths import cache_dir

        path = cache_dir("kernels")
    key = source_digest() + torch.__version__.encode() + platform.node().encode()
    key += " ".join(flags).encode()  # a build per instruction set (one machine name, other CPUs) and prefetch
    digest = hashlib.sha256(key).hexdigest()
    path = path / f"cpu_kernels-{digest[:16]}"
    path.mkdir(parents=True, exist_ok=True)
    return path


def load(options: CpuOptions | None = None):
    """The compiled extension, or ``None`` (switched off in ``options``, a CPU with neither AVX-512
    VNNI nor AVX2, or no compiler). Built or loaded once per process; ``options`` default to the
    environment's."""
    global _MODULE, _TRIED
    options = options if options is not None else CpuOptions.from_env()
    if _TRIED or not options.native:
        return _MODULE if options.native else None
    _TRIED = True
    isa = build_isa(options)
    if isa is None:
        if options.isa is not None:
            log.warning("LOCALLLM_CPU_ISA=%s: this CPU lacks it, using the torch route", options.isa)
        return None
    try:
        flags = compiler_flags(isa, weight_prefetch(options), kquant_prefetch(options))
        build = _build_dir(options, flags)
        built = build / "localllm_cpu_kernels.so"
        # already compiled for this source, torch and machine (and no build holds the lock): load it
        if built.exists() and not (build / "lock").exists():
            module = _load_built(built)
            if module.supported() and module.isa() == isa:
                _MODULE = _with_grids(module)
            return _MODULE
        with build_lock(build):
            log.warning("compiling the CPU kernels for this machine (once, about a minute)")
            from torch.utils import cpp_extension

            module = cpp_extension.load(
                name="localllm_cpu_kernels",
                sources=[str(SOURCE)],
                extra_cflags=flags,
                extra_ldflags=["-fopenmp"],
                build_directory=str(build),
                verbose=False,
            )
        if module.supported() and module.isa() == isa:
            _MODULE = _with_grids(module)
    except Exception as exc:  # noqa: BLE001 - no compiler, no ninja, odd toolchain: keep the torch route
        log.warning("CPU kernels unavailable, using the torch route (%s)", str(exc).splitlines()[0][:200])
    return _MODULE


def _with_grids(module):
    """``module`` with the lattice formats' grid points set (:data:`localllm.quant.grids.GRIDS`, the
    table the reference dequantizers read)."""
    from localllm.quant.grids import GRIDS
    from localllm.quant.traits import TRAITS

    for qtype, points in GRIDS.items():
        fmt = TRAITS[qtype].cpu_format
        if fmt is not None:
            module.set_lattice_grid(fmt, torch.from_numpy(points.copy()).contiguous())
    return module


@contextlib.contextmanager
def build_lock(build: Path):
    """Hold the build directory while compiling into it. torch's own lock is a file that a build
    killed midway (Ctrl-C, an OOM kill, a closed terminal) leaves behind, and every later start then
    waits on it forever. This one is an ``flock``, which the system releases when its holder dies:
    whoever holds it knows that no build is running, so a ``lock`` file found then is stale and goes."""
    try:
        import fcntl
    except ImportError:  # (not a POSIX system: torch's lock alone)
        yield
        return
    with open(build / "build.flock", "w") as guard:
        fcntl.flock(guard, fcntl.LOCK_EX)
        try:
            (build / "lock").unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(guard, fcntl.LOCK_UN)


def _load_built(path: Path):
    """Import a compiled extension from ``path`` (without torch.utils.cpp_extension, which pulls
    in setuptools: ~4 MiB and 0.3 s)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("localllm_cpu_kernels", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def pack(codes: torch.Tensor, bits: int, d: torch.Tensor, z: torch.Tensor | None) -> torch.Tensor:
    """Codes ``u`` uint8 ``[n, k]`` (< 2**bits) and float ``d``/``z`` ``[n, k/32]`` -> the kernel's
    uint8 tiles. 8-bit weights must have ``z == -128 * d`` (pass ``z=None``); the scales are
    stored as float16."""
    n, k = codes.shape
    if n % TILE or k % GROUP:
        raise ValueError(f"pack: need n % {TILE} == 0 and k % {GROUP} == 0, got {n}x{k}")
    g = k // GROUP
    tiles = n // TILE

    def scales(s: torch.Tensor) -> torch.Tensor:
        return s.to(torch.float16).reshape(tiles, TILE, g).transpose(1, 2).contiguous().view(torch.uint8)

    if bits == 4:
        # k = 8*s + 4*h + t: byte (s, 4*j + t) = code(h=0) | code(h=1) << 4
        q = codes.reshape(tiles, TILE, g, 4, 2, 4).permute(0, 2, 3, 1, 5, 4)
        body = (q[..., 0] | (q[..., 1] << 4)).reshape(tiles, g, 256)
        parts = [body, scales(d), scales(z)]
    elif bits == 8:
        if z is not None:
            raise ValueError("pack: 8-bit weights take z = -128 * d implicitly")
        body = codes.reshape(tiles, TILE, g, 8, 4).permute(0, 2, 3, 1, 4).reshape(tiles, g, 512)
        parts = [body, scales(d)]
    else:
        raise ValueError(f"pack: bits must be 4 or 8, got {bits}")
    return torch.cat(parts, dim=2).reshape(-1).contiguous()


FORMATS: dict[int, CpuFormat] = {f.id: f for f in CPU_FORMATS if f.layout == "format"}
"""The integer formats beyond 4/8-bit codes (``qgemm``'s ``bits``), from the one table
(:data:`localllm.quant.traits.CPU_FORMATS`)."""

FLOAT_FORMATS = frozenset(f.id for f in CPU_FORMATS if f.layout == "float")


def packed_bytes(n: int, k: int, bits: int) -> int:
    """Bytes of a packed ``[n, k]`` weight in format ``bits`` (``n`` rounded up to whole tiles)."""
    return CPU_FORMAT_BY_ID[bits].packed_bytes(n, k)


def pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    """``t`` with zero rows appended up to ``rows`` rows (itself when it has them)."""
    if t.shape[0] == rows:
        return t
    return torch.cat([t, t.new_zeros((rows - t.shape[0], *t.shape[1:]))])


def _nibble_plane(u: torch.Tensor, tiles: int, g: int) -> torch.Tensor:
    q = (u & 0x0F).reshape(tiles, TILE, g, 4, 2, 4).permute(0, 2, 3, 1, 5, 4)
    return (q[..., 0] | (q[..., 1] << 4)).reshape(tiles, g, 256)


def _crumb_plane(c: torch.Tensor, tiles: int, g: int) -> torch.Tensor:
    # k = 16 s + 4 h + t -> vector s, byte 4 j + t, bits 2h..2h+1
    q = (c & 3).reshape(tiles, TILE, g, 2, 4, 4).permute(0, 2, 3, 1, 5, 4)
    return (q[..., 0] | (q[..., 1] << 2) | (q[..., 2] << 4) | (q[..., 3] << 6)).reshape(tiles, g, 128)


def _bit_plane(b: torch.Tensor, tiles: int, g: int) -> torch.Tensor:
    # k = 4 v + t -> byte 4 j + t, bit v
    q = (b & 1).reshape(tiles, TILE, g, 8, 4)
    out = q[:, :, :, 0].clone()
    for v in range(1, 8):
        out |= q[:, :, :, v] << v
    return out.permute(0, 2, 1, 3).reshape(tiles, g, 64)


def _three_bit_bytes(u: torch.Tensor, tiles: int, g: int) -> torch.Tensor:
    # k = 4 v + t -> byte 4 j + t of three vectors: (c6 & 3) | c0 << 2 | c1 << 5,
    # (c7 & 3) | c2 << 2 | c3 << 5, c4 | c5 << 3 | (c6 >> 2) << 6 | (c7 >> 2) << 7
    c = (u & 7).reshape(tiles, TILE, g, 8, 4).unbind(3)  # c[v]: [tiles, 16, g, 4]
    b0 = (c[6] & 3) | (c[0] << 2) | (c[1] << 5)
    b1 = (c[7] & 3) | (c[2] << 2) | (c[3] << 5)
    b2 = c[4] | (c[5] << 3) | ((c[6] >> 2) << 6) | ((c[7] >> 2) << 7)
    return torch.stack([b0, b1, b2], dim=3).permute(0, 2, 3, 1, 4).reshape(tiles, g, 192)


SIX_BIT_FORMATS = frozenset(f.id for f in FORMATS.values() if f.six_bit_scales)
"""The formats whose 16 sub-scale and min values per row and super-block (sc of the 8 groups, then
their m) are held at six bits, as in the file."""

_PLANES = {"nibbles": _nibble_plane, "bits": _bit_plane, "crumbs": _crumb_plane, "three_bit": _three_bit_bytes}
"""The packers of :data:`localllm.quant.traits.PLANE_BITS`' planes (codes ``[tiles * 16, k]`` ->
``[tiles, k/32, bytes]``; the 8-bit tiles' bytes: :func:`pack`)."""


def _six_bit_block(values: torch.Tensor, tiles: int, nsb: int) -> torch.Tensor:
    """Six-bit ``values`` ``[tiles * 16, nsb, 16]`` (sc of groups 0-7, then m) -> the kernel's
    block of 192 bytes per tile and super-block (the file's 12 bytes a row): per group and row
    ``sc | (m & 3) << 6`` ``[8][16]``, then per pair of groups and row ``m >> 2`` of the even group
    ``| m >> 2`` of the odd one ``<< 4`` ``[4][16]``."""
    v = values.to(torch.int32)
    sc, m = v[..., :8], v[..., 8:]  # [rows, nsb, 8]
    low = (sc | ((m & 3) << 6)).to(torch.uint8)
    high = m >> 2
    high = (high[..., 0::2] | (high[..., 1::2] << 4)).to(torch.uint8)  # [rows, nsb, 4]
    low = low.reshape(tiles, TILE, nsb, 8).permute(0, 2, 3, 1).reshape(tiles, nsb, 128)
    high = high.reshape(tiles, TILE, nsb, 4).permute(0, 2, 3, 1).reshape(tiles, nsb, 64)
    return torch.cat([low, high], dim=2)


def pack_format(fmt: int, codes: torch.Tensor, scales: torch.Tensor | None, d: torch.Tensor,
                z: torch.Tensor | None) -> torch.Tensor:
    """One of :data:`FORMATS`: codes ``u`` uint8 ``[n, k]`` (the file's unsigned codes), per row
    and super-block the scale bytes ``scales`` uint8 ``[n, k/sb, scb/16]`` (the format's sub-scale
    array for that row; Q4_K, Q5_K: its 16 six-bit values, sc then m, which :func:`_six_bit_block`
    packs into 12 bytes; ``None`` where it has none), ``d`` and ``z`` (float16 ``[n, k/sb]``; each
    only where the format has one) -> the kernel's bytes. ``n`` is padded to whole tiles with
    zero rows."""
    f = FORMATS[fmt]
    sb, scb = f.super_block, f.scale_bytes
    n, k = codes.shape
    if k % sb:
        raise ValueError(f"pack_format: k must be a multiple of {sb}, got {k}")
    n16 = -(-n // TILE) * TILE
    tiles, g, nsb = n16 // TILE, k // GROUP, k // sb
    u = pad_rows(codes, n16)
    planes, shift = [], 0
    for plane in f.planes:  # (each plane the next bits of the codes, the lowest first)
        planes.append(_PLANES[plane](u >> shift if shift else u, tiles, g))
        shift += PLANE_BITS[plane]
    parts = [torch.cat(planes, dim=2).reshape(tiles, nsb, sb // GROUP * f.code_bytes)]
    if f.six_bit_scales:
        parts.append(_six_bit_block(pad_rows(scales, n16), tiles, nsb))
    elif scb:
        sc = pad_rows(scales, n16).reshape(tiles, TILE, nsb, scb // TILE).permute(0, 2, 3, 1)
        parts.append(sc.reshape(tiles, nsb, scb))

    def halves(s: torch.Tensor) -> torch.Tensor:
        s = pad_rows(s.to(torch.float16).reshape(n, nsb), n16)
        return s.reshape(tiles, TILE, nsb).transpose(1, 2).contiguous().view(torch.uint8)

    if f.has_d:
        parts.append(halves(d))
    if f.has_z:
        parts.append(halves(z))
    return torch.cat(parts, dim=2).reshape(-1).contiguous()


def pack_lattice(fmt: int, blocks: torch.Tensor, n: int, group_fields, scale_fields) -> torch.Tensor:
    """A lattice format of :data:`FORMATS`: the GGUF blocks (uint8 ``[n * k/256, type_size]``, ``n``
    rows) -> the kernel's bytes, the blocks' own: per tile and super-block each group's fields
    (``group_fields``: ``fields.BlockField``, the group's file bytes) as ``[field][16 rows][width]``,
    then the sub-scale fields (``scale_fields``) the same way, then the rows' float16 ``d`` (each
    block's first two bytes). ``n`` is padded to whole tiles with zero rows."""
    f = FORMATS[fmt]
    type_size = blocks.shape[1]
    nsb = blocks.shape[0] // n
    n16 = -(-n // TILE) * TILE
    tiles = n16 // TILE
    b = pad_rows(blocks.reshape(n, nsb * type_size), n16).reshape(tiles, TILE, nsb, type_size)

    def fields(field, g: int) -> torch.Tensor:
        start = field.start + field.stride * g
        x = b[..., start : start + field.count * field.width].reshape(tiles, TILE, nsb, field.count, field.width)
        return x.permute(0, 2, 3, 1, 4).reshape(tiles, nsb, -1)

    parts = [fields(field, g) for g in range(f.super_block // GROUP) for field in group_fields]
    parts += [fields(field, 0) for field in scale_fields]
    parts.append(b[..., :2].permute(0, 2, 1, 3).reshape(tiles, nsb, 2 * TILE))
    return torch.cat(parts, dim=2).reshape(-1).contiguous()


def reference_qgemm_weights(x: torch.Tensor, w: torch.Tensor, passes: int = 1, quantize: bool = True) -> torch.Tensor:
    """The definition of every exact format's kernel in float64: the activations' codes (as
    :func:`quantize_activations`; ``x`` itself where ``quantize`` is false: the float formats)
    times the weights ``w`` float ``[n, k]`` (the file's) -> float64 ``[m, n]``."""
    if not quantize:
        return x.double() @ w.double().t()
    xq, xs = quantize_activations(x, passes)
    p, m, k = xq.shape
    xa = (xq.double().view(p, m, -1, GROUP) * xs.double()[..., None]).sum(0).view(m, k)
    return xa @ w.double().t()


def quantize_activations(x: torch.Tensor, passes: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference activation codes: ``(xq int8 [passes, m, k], xs float32 [passes, m, k/32])``.
    Pass 1: ``xs = max|x| / 127`` per group and ``xq = round_half_even(x / xs)``; pass 2 does
    the same to the residual ``x - xs * xq`` (rounded once, as the kernel's fused multiply-add)."""
    m, k = x.shape
    r = x.float().reshape(m, k // GROUP, GROUP)
    codes, scales = [], []
    for _ in range(passes):
        amax = r.abs().amax(dim=2, keepdim=True)
        inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
        xq = torch.round(r * inv).clamp_(-128, 127)
        xs = amax / 127.0
        codes.append(xq.to(torch.int8).reshape(m, k))
        scales.append(xs.reshape(m, k // GROUP))
        r = (r.double() - xq.double() * xs.double()).float()
    return torch.stack(codes), torch.stack(scales)


def dequantize_activations(xq: torch.Tensor, xs: torch.Tensor) -> torch.Tensor:
    """``sum_p xs[p] * xq[p]``: what the kernel multiplies instead of ``x`` (float32 ``[m, k]``)."""
    p, m, k = xq.shape
    return (xq.float().view(p, m, -1, GROUP) * xs[..., None]).sum(0).view(m, k)


def reference_qgemm(x: torch.Tensor, codes: torch.Tensor, d: torch.Tensor, z: torch.Tensor,
                    passes: int = 1) -> torch.Tensor:
    """The kernel's definition in float64: ``x`` float ``[m, k]``, codes ``[n, k]``, ``d``/``z``
    ``[n, k/32]`` (as the kernel stores them: float16 values) -> float64 ``[m, n]``."""
    xq_all, xs_all = quantize_activations(x, passes)
    n, k = codes.shape
    g = k // GROUP
    d64, z64 = d.to(torch.float16).double(), z.to(torch.float16).double()
    out = 0
    for xq, xs in zip(xq_all, xs_all):
        m = xq.shape[0]
        xg = xq.double().reshape(m, g, GROUP)
        isum = torch.einsum("mgi,ngi->mng", xg, codes.double().reshape(n, g, GROUP))
        out = out + (xs.double()[:, None, :] * (d64[None] * isum + z64[None] * xg.sum(2)[:, None, :])).sum(2)
    return out


def qgemm(x: torch.Tensor, packed: torch.Tensor, bits: int, n: int, k: int, passes: int = 1,
          order: torch.Tensor | None = None) -> torch.Tensor:
    """``x`` float32 ``[m, k]`` -> float32 ``[m, n]`` through the native kernel (which must be
    loaded: see :func:`load`); ``order`` (int32 ``[k]``, a GPTQ act-order): ``x``'s columns read
    through it, gathered as the activations are quantized (the bits of ``x[:, order]``)."""
    return _MODULE.qgemm(x, packed, bits, n, k, passes, order)


def module():
    """The extension :func:`load` loaded (``None`` before, or where it did not)."""
    return _MODULE


def greedy_rows(logits: torch.Tensor) -> tuple[list[int], list[bool]] | None:
    """For float32 ``[S, V]`` logits on the CPU: each row's first largest entry (``argmax``; any index
    where the row holds a NaN) and whether the row can be sampled (no NaN, no +inf, not only -inf), in
    one native call on the calling thread; ``None`` where the extension is not loaded or the logits
    are not such a tensor (then: the torch ops)."""
    if _MODULE is None or not logits.is_cpu or logits.dtype != torch.float32 or logits.dim() != 2:
        return None
    if not logits.is_contiguous() or logits.shape[1] == 0:
        return None
    return _MODULE.greedy_rows(logits)
