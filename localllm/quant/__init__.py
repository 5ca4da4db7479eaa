"""GGUF weight formats: dequantization references and packed Linear/Embedding modules."""

from localllm.quant.gguf_dequant import SUPPORTED_QTYPES, check_qtype, dequantize
from localllm.quant.linear import QuantEmbedding, QuantLinear, tensor_from_numpy

__all__ = [
    "SUPPORTED_QTYPES",
    "QuantEmbedding",
    "QuantLinear",
    "check_qtype",
    "dequantize",
    "tensor_from_numpy",
]
