"""Which kernels run the model: Triton or the pure-torch reference.

``resolve_kernels(kernels, device)``: ``"auto"`` picks Triton on CUDA/ROCm GPUs (when Triton is
installed) and torch elsewhere; ``"triton"`` demands Triton (on a CPU only through the Triton
interpreter, ``TRITON_INTERPRET=1``, which is how the kernels are tested without a GPU);
``"torch"`` is the reference path. The environment variable ``LOCALLLM_KERNELS`` overrides the
configured value.
"""

from __future__ import annotations

import importlib.util
import logging
import os

import torch

from localllm.errors import InvalidRequestError

log = logging.getLogger(__name__)

CHOICES = ("auto", "triton", "torch")
ENV_VAR = "LOCALLLM_KERNELS"


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def interpreter_enabled() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def resolve_kernels(kernels: str, device: torch.device | str) -> str:
    """``"triton"`` or ``"torch"`` for ``kernels`` in ``auto``/``triton``/``torch`` on ``device``;
    raises :class:`InvalidRequestError` when the choice cannot run here."""
    env = os.environ.get(ENV_VAR, "").strip().lower()
    choice = env or (kernels or "auto").strip().lower()
    source = f"{ENV_VAR}={env}" if env else f"kernels={kernels!r}"
    if choice not in CHOICES:
        raise InvalidRequestError(f"{source}: kernels must be one of {', '.join(CHOICES)}", param="kernels")
    dev = torch.device(device)
    on_gpu = dev.type == "cuda"  # ROCm builds of torch report "cuda" too
    if choice == "torch":
        return "torch"
    if choice == "auto":
        if on_gpu and triton_available():
            return "triton"
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
    if not on_gpu and not interpreter_enabled():
        raise InvalidRequestError(
            f"{source} on device {dev.type!r}: Triton kernels need a CUDA/ROCm GPU; on a CPU they run only "
            "through the Triton interpreter (set TRITON_INTERPRET=1 before starting; slow, for tests)",
            param="kernels",
        )
    return "triton"
