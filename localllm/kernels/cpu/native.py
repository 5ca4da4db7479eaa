"""The native CPU kernels: their build and their contract (a quantized matmul with int8
activations, and a decoder layer's other ops), for x86 CPUs with AVX-512 VNNI or with AVX2.

``csrc/cpu_kernels.cpp`` is compiled for this machine (``-march=native``) on first use with
``torch.utils.cpp_extension`` (needs a C++ compiler; about 30 s once, then cached under
``CpuOptions.kernel_cache`` (``LOCALLLM_KERNEL_CACHE``) or the localllm cache, per source, torch,
machine and instruction set), and only where the CPU has one of its instruction sets
(:func:`cpu_isa`): AVX-512 VNNI (``vpdpbusd``), else AVX2 with FMA and F16C (``vpmaddubsw``;
the same layout and results: the integer group sums are exact on both). The build reports the
one it uses (``module.isa()``). Anywhere else, or when compiling fails, :func:`load` returns
``None`` and callers keep their torch route. ``CpuOptions.native`` (``LOCALLLM_CPU_NATIVE=0``)
turns it off.

Weights: unsigned codes ``u`` (4 or 8 bits) with a per-32-group affine map ``w = d * u + z``,
packed by :func:`pack` into tiles of 16 output rows (layout in the C++ file). Activations are
quantized per row and 32-element group to int8 (``x ~ xs * xq``, round to nearest, as
llama.cpp's Q8 activations), so the kernel computes exactly

    y[m, n] = sum_g  xs[m, g] * (d[n, g] * sum_i u[n, g, i] * xq[m, g, i] + z[n, g] * sum_i xq[m, g, i])

in float32 after exact integer group sums; :func:`reference_qgemm` is that definition in torch.
"""

from __future__ import annotations

import hashlib
import logging
import platform
from pathlib import Path

import torch

from localllm.kernels.cpu.options import CpuOptions

log = logging.getLogger(__name__)

GROUP = 32
TILE = 16
SOURCE = Path(__file__).with_name("csrc") / "cpu_kernels.cpp"

_MODULE = None
_TRIED = False


ISA_FLAGS = {
    "avx512vnni": {"avx512f", "avx512bw", "avx512_vnni", "f16c"},
    "avx2": {"avx2", "fma", "f16c"},
}
"""The /proc/cpuinfo flags each native instruction set needs, the preferred one first (the C++
file picks the same one from the compiler's ``-march=native`` macros)."""


def cpu_isa() -> str | None:
    """The native kernels' instruction set this CPU supports: ``"avx512vnni"``, else ``"avx2"``
    (AVX2, FMA and F16C), else ``None`` (not x86, or neither; Linux /proc/cpuinfo flags)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return None
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    return next((isa for isa, need in ISA_FLAGS.items() if need <= flags), None)
    except OSError:
        return None
    return None


def cpu_has_native() -> bool:
    """Whether this CPU has an instruction set the native kernels are written for."""
    return cpu_isa() is not None


cpu_has_vnni = cpu_has_native
"""The old name of :func:`cpu_has_native` (from when AVX-512 VNNI was the only native route):
true on AVX2 CPUs too; :func:`cpu_isa` tells them apart."""


def _build_dir(options: CpuOptions) -> Path:
    if options.kernel_cache is not None:
        path = options.kernel_cache
    else:
        from localllm.paths import cache_dir

        path = cache_dir("kernels")
    key = SOURCE.read_bytes() + torch.__version__.encode() + platform.node().encode()
    key += str(cpu_isa()).encode()  # a build per instruction set (one machine name, other CPUs)
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
    if cpu_isa() is None:
        return None
    try:
        build = _build_dir(options)
        built = build / "localllm_cpu_kernels.so"
        # already compiled for this source, torch and machine (and no build holds the lock): load it
        if built.exists() and not (build / "lock").exists():
            module = _load_built(built)
            if module.supported():
                _MODULE = module
            return _MODULE
        log.warning("compiling the CPU kernels for this machine (once, about 30 s)")
        from torch.utils import cpp_extension

        module = cpp_extension.load(
            name="localllm_cpu_kernels",
            sources=[str(SOURCE)],
            extra_cflags=["-O3", "-march=native", "-fopenmp"],
            extra_ldflags=["-fopenmp"],
            build_directory=str(build),
            verbose=False,
        )
        if module.supported():
            _MODULE = module
    except Exception as exc:  # noqa: BLE001 - no compiler, no ninja, odd toolchain: keep the torch route
        log.warning("CPU kernels unavailable, using the torch route (%s)", str(exc).splitlines()[0][:200])
    return _MODULE


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


def packed_bytes(n: int, k: int, bits: int) -> int:
    return n // TILE * (k // GROUP) * (320 if bits == 4 else 544)


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


def qgemm(x: torch.Tensor, packed: torch.Tensor, bits: int, n: int, k: int, passes: int = 1) -> torch.Tensor:
    """``x`` float32 ``[m, k]`` -> float32 ``[m, n]`` through the native kernel (which must be
    loaded: see :func:`load`)."""
    return _MODULE.qgemm(x, packed, bits, n, k, passes)


def module():
    """The extension :func:`load` loaded (``None`` before, or where it did not)."""
    return _MODULE
