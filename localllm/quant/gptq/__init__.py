"""GPTQ: the checkpoint format localllm loads, and ``localllm quantize``, which writes it.

Modules:

* :mod:`~localllm.quant.gptq.layout`: the packed AutoGPTQ/GPTQModel layout, its pure-torch
  dequantizer and :class:`GPTQLinear` (what the loaders use; light: torch only);
* :mod:`~localllm.quant.gptq.algorithm`: the GPTQ math (:class:`GPTQSettings`, Hessians,
  column-by-column quantization with act-order, GPTAQ targets, packing), no I/O;
* :mod:`~localllm.quant.gptq.source`: the model to quantize, as float32 HF-layout tensors;
* :mod:`~localllm.quant.gptq.calibration`: calibration text (self-written through the engine's
  model runner and sampler) and running layers on it, collecting each linear's inputs;
* :mod:`~localllm.quant.gptq.export`: writing safetensors, index, config and tokenizer files;
* :mod:`~localllm.quant.gptq.pipeline`: :func:`quantize_model`, the entry point;
* :mod:`~localllm.quant.gptq.cli`: the ``localllm quantize`` command.

The format names are imported eagerly (the model loaders import them from here); the quantizer
(:func:`quantize_model`, :func:`export_hf`, :class:`QuantizeReport`) is
imported on first use, since it reads models through :mod:`localllm.models`, which imports this
package.
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
    "QuantizeReport",
    "dequantize_gptq",
    "export_hf",
    "num_groups",
    "pack_rows",
    "quantize_model",
    "unpack_rows",
    "zero_offset",
]

_LAZY = {
    "QuantizeReport": "localllm.quant.gptq.pipeline",
    "quantize_model": "localllm.quant.gptq.pipeline",
    "export_hf": "localllm.quant.gptq.pipeline",
}


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
