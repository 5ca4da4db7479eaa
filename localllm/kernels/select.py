"""Which backend runs the model: :func:`select_backend` returns one (see :mod:`localllm.kernels.backend`).

``kernels``:

* ``"auto"`` (the default): Triton on CUDA/ROCm GPUs (when Triton is installed), the CPU
  backend on a CPU (unless ``LOCALLLM_CPU_FAST=0``), the pure-torch reference otherwise;
* ``"triton"`` demands Triton (on a CPU only through the Triton interpreter,
  ``TRITON_INTERPRET=1``, which is how the kernels are tested without a GPU);
* ``"cpu"`` demands the CPU backend (on a CPU; ``LOCALLLM_CPU_FAST=0`` still turns it off);
* ``"torch"`` is the reference path.

The environment variable ``LOCALLLM_KERNELS`` overrides the configured value. Each backend's
settings (:class:`~localllm.kernels.cpu.options.CpuOptions`,
:class:`~localllm.kernels.triton.backend.TritonOptions`) are read from the environment here,
when a backend is selected, unless given.
"""

from __future__ import annotations

import importlib.util
import logging
from dataclasses import replace

import torch

from localllm.config.settings import BY_NAME, env_value
from localllm.errors import InvalidRequestError
from localllm.kernels.backend import Backend
from localllm.kernels.cpu.backend import CpuBackend  # imported with the engine, as before
from localllm.kernels.cpu.options import CpuOptions
from localllm.kernels.torch_backend import REFERENCE
from localllm.kernels.triton.spec import interpreter_enabled

log = logging.getLogger(__name__)

CHOICES = ("auto", "triton", "cpu", "torch")
ENV_VAR = BY_NAME["kernels"].env


# The oldest Triton the kernels are known to compile with: every launch compiles and fits for
# sm_86 with 3.4 (``python -m localllm.kernels.triton.compile``; torch 2.8's); 3.7 is what CI
# checks on every card. Older ones were never checked (the check needs 3.4's compiler hooks).
MIN_TRITON = (3, 4)


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def triton_version() -> tuple[int, ...]:
    """The installed Triton's version as numbers (``3.7.1`` -> ``(3, 7, 1)``; ROCm's
    ``pytorch-triton-rocm`` reports ``triton.__version__`` too)."""
    import triton

    parts = []
    for piece in triton.__version__.split("+")[0].split("."):
        digits = "".join(ch for ch in piece if ch.isdigit()) if piece[:1].isdigit() else ""
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts)


def triton_too_old() -> str | None:
    """Why the installed Triton cannot run the kernels (None: it can)."""
    version = triton_version()
    if version < MIN_TRITON:
        have = ".".join(map(str, version)) or "unknown"
        return f"Triton {have} is older than {'.'.join(map(str, MIN_TRITON))}, the oldest the kernels work with"
    return None


def resolve_kernels(kernels: str, device: torch.device | str, cpu_options: CpuOptions | None = None) -> str:
    """``"triton"``, ``"cpu"`` or ``"torch"`` for ``kernels`` (one of :data:`CHOICES`) on ``device``;
    raises :class:`InvalidRequestError` when the choice cannot run here."""
    env = (env_value("kernels") or "").strip().lower()
    choice = env or (kernels or "auto").strip().lower()
    source = f"{ENV_VAR}={env}" if env else f"kernels={kernels!r}"
    if choice not in CHOICES:
        raise InvalidRequestError(f"{source}: kernels must be one of {', '.join(CHOICES)}", param="kernels")
    dev = torch.device(device)
    on_gpu = dev.type == "cuda"  # ROCm builds of torch report "cuda" too
    if choice == "torch":
        return "torch"
    if choice == "cpu" or (choice == "auto" and dev.type == "cpu"):
        if dev.type != "cpu":
            raise InvalidRequestError(f"{source} on device {dev.type!r}: the CPU kernels run on the CPU only",
                                      param="kernels")
        enabled = (cpu_options if cpu_options is not None else CpuOptions.from_env()).enabled
        return "cpu" if enabled else "torch"  # LOCALLLM_CPU_FAST=0: the reference everywhere
    if choice == "auto":
        if on_gpu and triton_available():
            old = triton_too_old()
            if old is None:
                return "triton"
            log.warning("%s: running the pure-torch kernels on %s (pip install -U triton, or a newer torch)", old, dev)
            return "torch"
        if on_gpu:
            log.warning(
                "Triton is not installed: running the pure-torch kernels on %s "
                "(pip install 'localllm[triton]' for the fast path)",
                dev,
            )
        return "torch"
    if not triton_available():
        raise InvalidRequestError(
            f"{source}: Triton is not installed (pip install 'localllm[triton]')", param="kernels"
        )
    old = triton_too_old()
    if old is not None:
        raise InvalidRequestError(f"{source}: {old} (pip install -U triton, or a newer torch)", param="kernels")
    if not on_gpu and not interpreter_enabled():
        raise InvalidRequestError(
            f"{source} on device {dev.type!r}: Triton kernels need a CUDA/ROCm GPU; on a CPU they run only "
            "through the Triton interpreter (set TRITON_INTERPRET=1 before starting; slow, for tests)",
            param="kernels",
        )
    return "triton"


def fastest_cpu_backend() -> Backend:
    """The CPU backend even where ``LOCALLLM_CPU_FAST=0`` keeps engines on the reference: for text
    whose bits nobody compares (the quantizer's calibration samples)."""
    return CpuBackend(replace(CpuOptions.from_env(), enabled=True))


def select_backend(kernels: str = "auto", device: torch.device | str = "cpu", options=None, *,
                   fast_math: bool = False) -> Backend:
    """The backend for ``kernels`` on ``device`` (see the module docstring), built with
    ``options`` (a ``CpuOptions`` or ``TritonOptions``; by default read from the environment).
    ``fast_math`` (the engine's setting) gives up batch invariance for speed
    (``CpuOptions.fast_math``, ``TritonOptions.batch_invariant``). Nothing is installed yet: call
    its ``install(model)``."""
    cpu_options = options if isinstance(options, CpuOptions) else None
    if fast_math:
        cpu_options = replace(cpu_options if cpu_options is not None else CpuOptions.from_env(), fast_math=True)
    name = resolve_kernels(kernels, device, cpu_options)
    if name == "triton":
        # imports Triton: only when chosen
        from localllm.kernels.triton.backend import TritonBackend, TritonOptions

        triton_options = options if isinstance(options, TritonOptions) else TritonOptions.from_env()
        return TritonBackend(replace(triton_options, batch_invariant=not fast_math))
    if name == "cpu":
        return CpuBackend(cpu_options)
    return REFERENCE
