"""The CPU backend's settings, read from the environment when a backend is selected (never at import).

========================================  =========================================================
``LOCALLLM_CPU_FAST=0``                    no CPU backend: the float32 reference runs everywhere
``LOCALLLM_CPU_NATIVE=0``                  no native kernels: the int4 route and the torch ops
``LOCALLLM_CPU_FAST_RELEASE=0``            keep a repacked weight's file pages resident, no heap trim
``LOCALLLM_CPU_HUGE_PAGES=0``              repacked weights in ordinary pages (see ``huge_pages``)
``LOCALLLM_CPU_FAST_MAX_GROWTH`` (1.5)     a weight whose repacked form exceeds this multiple of its
                                           bytes in the file stays on the reference path
``LOCALLLM_CPU_FAST_GEMM_ROWS`` (96)       with ``fast_math``, from this many rows on, the int4 route
                                           dequantizes to bfloat16 and runs a GEMM (``0``: never)
``LOCALLLM_CPU_ACTIVATIONS`` (auto)        ``auto``, ``int8`` or ``int8x2``: see ``activation_passes``
``LOCALLLM_CPU_HEAD_8BIT=0``               keep an F32/F16/BF16/Q6_K/Q5_K LM head in its own format
                                           (see ``head_8bit``)
``LOCALLLM_CPU_ISA`` (auto)                ``auto`` (the best instruction set this CPU has),
                                           ``avx2`` or ``avx512vnni``: see ``isa``
========================================  =========================================================

``fast_math`` is the engine's setting (``serve --fast-math``, ``LOCALLLM_FAST_MATH``), handed
over by :func:`localllm.kernels.select.select_backend`: off, every matmul and attention route
computes a row's result independently of the other rows of its step (batch invariance, see
``docs/architecture.md``); on, long int4-route batches take a bfloat16 GEMM and prompt attention
the torch path, which are faster and depend on the step's shape.

========================================  =========================================================
``LOCALLLM_KERNEL_CACHE``                  where the native kernels are compiled to (default: the
                                           localllm cache)
========================================  =========================================================
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from localllm.config.settings import BY_NAME, env_or_default

ACTIVATION_MODES = {"auto": None, "int8": 1, "int8x2": 2}
ISA_MODES = {"auto": None, "avx2": "avx2", "avx512vnni": "avx512vnni"}


def _mode(name: str, modes: dict):
    """The setting ``name``'s value (``LOCALLLM_<NAME>``, else the table's default) among ``modes``."""
    value = str(env_or_default(name)).strip().lower() or "auto"
    if value not in modes:
        raise ValueError(f"{BY_NAME[name].env}={value!r}: expected one of {', '.join(modes)}")
    return modes[value]


def _prefetch() -> int | None:
    """``cpu_weight_prefetch``: ``None`` for ``auto``, else its byte count."""
    value = str(env_or_default("cpu_weight_prefetch")).strip().lower() or "auto"
    if value == "auto":
        return None
    if not value.isdigit() or int(value) > 1 << 20:
        raise ValueError(f"{BY_NAME['cpu_weight_prefetch'].env}={value!r}: expected auto or a byte count up to 1 MiB")
    return int(value)


def _default(name: str):
    return BY_NAME[name].default


@dataclass(frozen=True, slots=True)
class CpuOptions:
    """How the CPU backend runs; the defaults are the environment's defaults."""

    enabled: bool = True
    """The CPU backend at all (``False``: the float32 reference path, ``LOCALLLM_CPU_FAST=0``)."""

    native: bool = True
    """The compiled AVX-512 VNNI or AVX2 kernels where they build (``LOCALLLM_CPU_NATIVE=0``: off)."""

    release_file_pages: bool = _default("cpu_fast_release")
    """Once a weight is repacked, drop its mapped file pages from the resident set and trim the heap."""

    huge_pages: bool = _default("cpu_huge_pages")
    """Hold each decoder layer's repacked weights, the LM head and the KV cache in memory advised for
    transparent huge pages (:func:`localllm.platform.memory.huge_page_buffer`): a decode step streams
    every weight once (and a long context's K/V), and with 4 KiB pages its reads miss the TLB every 4 KiB."""

    max_growth: float = _default("cpu_fast_max_growth")
    """A weight whose repacked form would exceed this multiple of its bytes in the file stays on
    the reference path."""

    gemm_rows: int = _default("cpu_fast_gemm_rows")
    """With ``fast_math``: from this many activation rows on, the int4 route dequantizes to
    bfloat16 and uses a GEMM instead of the int4 kernel (measured crossover on SmolLM2 shapes,
    one thread: 64-128 rows; at 512 rows the GEMM route is 2.2x faster; see bench/cpu_linear.py).
    The two routes round differently, so a row's result depends on how many rows share its step;
    without ``fast_math`` (or with ``0``) every batch stays on the kernel, whose rows are computed
    independently of one another (bitwise), at the cost of about 30% of 512-token prefill speed."""

    activation_passes: int | None = None
    """How the native route quantizes the layers' activations: ``1`` (``int8``: llama.cpp's
    precision), ``2`` (``int8x2``: int8 codes plus their int8-quantized residual, about 2e-5 of
    an output's scale, up to 2x slower for batches and prompts), ``None`` (``auto``: one pass;
    see :func:`localllm.kernels.cpu.matmul.activation_passes`). The LM head takes the same, its top logits
    recomputed exactly."""

    head_8bit: bool = True
    """On the native route, an LM head stored as F16 or BF16 (GPTQ checkpoints, F16/BF16 files), Q6_K
    or Q5_K (the head of most K-quant and legacy-quant files) is held as 8-bit codes with a float16
    scale per 32 weights (see :data:`localllm.kernels.cpu.weights.HEAD_8BIT_TYPES` for why these
    types) and its top logits are recomputed from the file's rows (see
    :func:`localllm.kernels.cpu.matmul.refine_top_logits`), so greedy picks stay the file's."""

    isa: str | None = None
    """The instruction set the native kernels are built for: ``None`` (the best this CPU has, see
    :func:`localllm.kernels.cpu.native.cpu_isa`), or ``"avx2"`` / ``"avx512vnni"`` where the CPU has
    it: ``"avx2"`` on an AVX-512 CPU builds the kernels an AVX2-only CPU runs (how the tests check
    that route there)."""

    weight_prefetch: int | None = None
    """How many bytes ahead a one-row (decode) matmul asks for the weight it streams (``0``: the
    hardware's prefetchers alone), or ``None`` for this CPU's default
    (:func:`localllm.kernels.cpu.native.weight_prefetch`). A build per value: it is a constant of
    the kernels."""

    fast_math: bool = False
    """Give up batch invariance for speed (see the module docstring); the engine's setting."""

    kernel_cache: Path | None = None
    """Where the native kernels are built (``None``: the localllm cache)."""

    @property
    def dequant_min_rows(self) -> int:
        """``gemm_rows`` under ``fast_math``, else (or with ``0``) never."""
        return (self.gemm_rows if self.fast_math else 0) or 1 << 62

    @classmethod
    def from_env(cls) -> CpuOptions:
        """The options the environment sets (read now, through the settings table)."""
        cache = env_or_default("kernel_cache")
        return cls(
            enabled=env_or_default("cpu_fast"),
            native=env_or_default("cpu_native"),
            release_file_pages=env_or_default("cpu_fast_release"),
            huge_pages=env_or_default("cpu_huge_pages"),
            max_growth=env_or_default("cpu_fast_max_growth"),
            gemm_rows=env_or_default("cpu_fast_gemm_rows"),
            activation_passes=_mode("cpu_activations", ACTIVATION_MODES),
            head_8bit=env_or_default("cpu_head_8bit"),
            isa=_mode("cpu_isa", ISA_MODES),
            weight_prefetch=_prefetch(),
            kernel_cache=Path(cache).expanduser() if cache else None,
        )
