"""GPTQ: the checkpoint format localllm loads, and the math that writes it.

Modules:

* :mod:`~localllm.quant.gptq.layout`: the packed AutoGPTQ/GPTQModel layout, its pure-torch
  dequantizer and :class:`GPTQLinear` (what the loaders use; light: torch only);
* :mod:`~localllm.quant.gptq.algorithm`: the GPTQ math (:class:`GPTQSettings`, Hessians,
  column-by-column quantization with act-order, GPTAQ targets, packing), no I/O.

The quantizer that runs a whole model through this math (``localllm quantize``) is a tool over the
model and the engine, one room up: :mod:`localllm.quantize`.
"""

from __future__ import annotations

from localllm.quant.gptq.algorithm import GPTQSettings  # torch and the layout only
from localllm.quant.gptq.layout import (
    CHECKPOINT_FORMATS,
    MAX_CHUNK_BYTES,
    SUPPORTED_BITS,
    GPTQLinear,
    GPTQWeight,
    dequantize_gptq,
    num_groups,
    pack_rows,
    unpack_rows,
    zero_offset,
)

__all__ = [
    "CHECKPOINT_FORMATS",
    "MAX_CHUNK_BYTES",
    "SUPPORTED_BITS",
    "GPTQLinear",
    "GPTQSettings",
    "GPTQWeight",
    "dequantize_gptq",
    "num_groups",
    "pack_rows",
    "unpack_rows",
    "zero_offset",
]
