"""What the Triton launchers need to know about the GPU they launch on: :class:`GpuSpec`.

Launch settings that a card's limits decide (attention tile stages and key-tile width, split-K,
KV splits, the dot precision a backend accepts) are chosen from a :class:`GpuSpec`, never from a
live query inside the choice, so that the same choice can be made, and checked by the real
compiler, for a card that is not here (:mod:`localllm.kernels.triton.compile`, whose test
compiles every launch for sm_80/86/89/90 on a machine without a GPU).

:func:`gpu_spec` reads a CUDA/ROCm device's properties once; ``None`` for a CPU device (the Triton
interpreter, which has limits of its own). :func:`targeting` makes :func:`gpu_spec` answer for a
named card instead, whatever the device (only the compile check uses it).
"""

from __future__ import annotations

import contextlib
import contextvars
import os
from collections.abc import Iterator
from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class GpuSpec:
    """One GPU model's limits, as the CUDA occupancy calculator has them."""

    name: str
    backend: str  # "cuda" or "hip"
    arch: int | str  # CUDA compute capability as an int (86 for sm_86), or a ROCm gfx name
    num_sms: int
    max_shared_per_block: int  # bytes a block may opt in to
    shared_per_sm: int = 0  # bytes per SM (0: the per-block figure)
    regs_per_sm: int = 65536
    max_threads_per_sm: int = 2048
    max_blocks_per_sm: int = 32
    warp_size: int = 32
    reserved_shared_per_block: int = 1024  # the driver's share of each block's shared memory (sm_80+)

    @property
    def is_hip(self) -> bool:
        return self.backend == "hip"

    def ctas_per_sm(self, *, num_warps: int, regs_per_thread: int, shared_bytes: int) -> int:
        """Blocks of one kernel resident on an SM at once (the occupancy calculator's minimum over
        threads, registers, shared memory and the block limit; registers are allocated per warp
        in units of 256)."""
        if shared_bytes > self.max_shared_per_block:
            return 0
        threads = num_warps * self.warp_size
        by_threads = self.max_threads_per_sm // threads
        regs_per_warp = -(-max(regs_per_thread, 1) * self.warp_size // 256) * 256
        by_regs = self.regs_per_sm // (regs_per_warp * num_warps)
        per_block = shared_bytes + self.reserved_shared_per_block
        by_shared = (self.shared_per_sm or self.max_shared_per_block) // per_block if per_block else self.max_blocks_per_sm
        return max(0, min(self.max_blocks_per_sm, by_threads, by_regs, by_shared))


# The cards the compile check targets: the data-centre part and the consumer cards of each
# generation this project is for (the consumer cards have the smallest shared memory).
A100 = GpuSpec("A100 (sm_80)", "cuda", 80, num_sms=108, max_shared_per_block=166912, shared_per_sm=167936,
               max_threads_per_sm=2048, max_blocks_per_sm=32)
RTX_3090 = GpuSpec("RTX 3090 (sm_86)", "cuda", 86, num_sms=82, max_shared_per_block=101376, shared_per_sm=102400,
                   max_threads_per_sm=1536, max_blocks_per_sm=16)
RTX_4090 = GpuSpec("RTX 4090 (sm_89)", "cuda", 89, num_sms=128, max_shared_per_block=101376, shared_per_sm=102400,
                   max_threads_per_sm=1536, max_blocks_per_sm=24)
H100 = GpuSpec("H100 SXM (sm_90)", "cuda", 90, num_sms=132, max_shared_per_block=232448, shared_per_sm=233472,
               max_threads_per_sm=2048, max_blocks_per_sm=32)
KNOWN_TARGETS: tuple[GpuSpec, ...] = (A100, RTX_3090, RTX_4090, H100)

_TARGET: contextvars.ContextVar[GpuSpec | None] = contextvars.ContextVar("localllm_gpu_target", default=None)
_SPECS: dict[int, GpuSpec] = {}


@contextlib.contextmanager
def targeting(spec: GpuSpec) -> Iterator[GpuSpec]:
    """Within the block, :func:`gpu_spec` answers ``spec`` for every device (the compile check)."""
    token = _TARGET.set(spec)
    try:
        yield spec
    finally:
        _TARGET.reset(token)


def gpu_spec(device: torch.device) -> GpuSpec | None:
    """The spec of a CUDA/ROCm ``device`` (read once per device), ``None`` on a CPU."""
    target = _TARGET.get()
    if target is not None:
        return target
    if device.type != "cuda":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    spec = _SPECS.get(index)
    if spec is None:
        _SPECS[index] = spec = _read_spec(index)
    return spec


def _read_spec(index: int) -> GpuSpec:
    p = torch.cuda.get_device_properties(index)
    hip = torch.version.hip is not None
    shared = int(getattr(p, "shared_memory_per_block_optin", 0) or getattr(p, "shared_memory_per_block", 0) or 49152)
    return GpuSpec(
        name=p.name,
        backend="hip" if hip else "cuda",
        arch=str(getattr(p, "gcnArchName", "")).split(":")[0] if hip else p.major * 10 + p.minor,
        num_sms=p.multi_processor_count,
        max_shared_per_block=shared,
        shared_per_sm=int(getattr(p, "shared_memory_per_multiprocessor", 0) or 0),
        regs_per_sm=int(getattr(p, "regs_per_multiprocessor", 0) or 65536),
        max_threads_per_sm=int(getattr(p, "max_threads_per_multi_processor", 0) or 2048),
        warp_size=int(getattr(p, "warp_size", 0) or (64 if hip else 32)),
        reserved_shared_per_block=0 if hip else 1024,
    )


def interpreter_enabled() -> bool:
    """Whether Triton runs its kernels in the interpreter (``TRITON_INTERPRET=1``: CPU tests). Triton
    reads the variable when it is imported, so it holds for the whole process."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"
