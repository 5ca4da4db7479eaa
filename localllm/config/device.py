"""Which device and dtype ``auto`` means here: the two settings whose default depends on the
machine (the GPU when torch sees one; bfloat16 or float16 on it, float32 on a CPU)."""

from __future__ import annotations

import torch  # the one module of config/ that reads torch: what "auto" is depends on what torch sees


def resolve_device(device: str) -> str:
    """``"auto"``: the GPU when torch sees one (CUDA, or ROCm's build), else the CPU."""
    if device != "auto":
        return device
    return "cuda" if torch.cuda.is_available() else "cpu"


def engine_device(device: str) -> torch.device:
    """The torch device an engine keeps: ``cuda`` without an index names the GPU current when the
    engine is built, kept as its index (``cuda:0``). The engine's step thread makes that GPU its
    own current device (``torch.cuda.set_device`` takes an index, never a bare ``cuda``), and a
    thread's current device is not another thread's."""
    placed = torch.device(device)
    if placed.type == "cuda" and placed.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return placed


def resolve_dtype(dtype: str, device: str) -> str:
    """The activations' dtype for ``dtype`` on ``device``: ``"auto"`` is float32 on a CPU (the
    reference path the native kernels keep), and on a GPU bfloat16 where the card has it (sm_80+),
    else float16, as every GPU server defaults to (float32 there: tensor cores unused, twice the KV
    memory; still there on request)."""
    if dtype != "auto":
        return dtype
    if torch.device(device).type == "cpu":
        return "float32"
    return "bfloat16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "float16"
