"""Random but valid GGUF tensor data, for tests and tiny random models."""

from __future__ import annotations

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from localllm.quant.gguf_dequant import SUPPORTED_QTYPES

T = GGMLQuantizationType

# Per block type: (byte offset of each fp16 scale field, the largest |multiplier| that field
# is applied to). Scales are drawn with std WEIGHT_SCALE / multiplier so that dequantized
# weights stay well below 1 in magnitude whatever the random quant bytes are.
_FP16_FIELDS: dict[GGMLQuantizationType, tuple[tuple[int, int], ...]] = {
    T.Q8_0: ((0, 128),),
    T.Q4_0: ((0, 8),),
    T.Q4_1: ((0, 15), (2, 1)),
    T.Q5_0: ((0, 16),),
    T.Q5_1: ((0, 31), (2, 1)),
    T.Q2_K: ((80, 15 * 3), (82, 15)),
    T.Q3_K: ((108, 32 * 4),),
    T.Q4_K: ((0, 63 * 15), (2, 63)),
    T.Q5_K: ((0, 63 * 31), (2, 63)),
    T.Q6_K: ((208, 128 * 32),),
    T.IQ4_NL: ((0, 127),),
    T.IQ4_XS: ((0, 127 * 32),),
    T.IQ2_XXS: ((0, 167),),  # 15.5 / 4 * 43: the largest sub-scale and grid value
    T.IQ2_XS: ((0, 167),),
    T.IQ2_S: ((0, 167),),
    T.IQ3_XXS: ((0, 481),),  # 15.5 / 2 * 62
    T.IQ3_S: ((0, 31 * 15),),
    T.IQ1_S: ((0, 17),),  # 15 * 1.125
    T.TQ1_0: ((52, 1),),
    T.TQ2_0: ((64, 2),),  # (code 3 means 2)
}
_IQ1_M_FIELDS = (48, 17)
"""IQ1_M's d: its fp16 bits in the top nibbles of the four uint16 at this offset, lowest first."""

WEIGHT_SCALE = 0.1


def random_quantized(qtype: GGMLQuantizationType, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Random ``[rows, cols]`` weights in GGUF layout, as GGUFWriter.add_tensor takes them.

    Block types and BF16: uint8 ``[rows, bytes_per_row]`` (pass ``raw_dtype=qtype``). Block types
    are random bytes with every scale field (fp16; MXFP4's E8M0 byte) replaced by a small finite
    value, so all bit patterns of the quant fields occur. F32/F16: a typed ``[rows, cols]`` array.
    Values dequantize to finite numbers with ``|w|`` well below 1.
    """
    qtype = GGMLQuantizationType(qtype)
    if qtype not in SUPPORTED_QTYPES:
        raise ValueError(f"no random generator for {qtype.name}")
    rng = np.random.default_rng(seed)
    if qtype in (T.F32, T.F16, T.BF16):
        weights = (rng.standard_normal((rows, cols)) * 0.02).astype(np.float32)
        if qtype == T.F32:
            return weights
        if qtype == T.F16:
            return weights.astype(np.float16)
        # bfloat16 by truncation of the float32 bits; the values are finite and exact enough.
        return (weights.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8).reshape(rows, cols * 2)
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    if cols % block_size:
        raise ValueError(f"{qtype.name} needs cols to be a multiple of {block_size}, got {cols}")
    n_blocks = rows * cols // block_size
    blocks = rng.integers(0, 256, size=(n_blocks, type_size), dtype=np.uint8)
    if qtype == T.MXFP4:  # E8M0 scales of 2**-9 .. 2**-4: |w| <= 6 * 2**-4
        blocks[:, 0] = rng.integers(118, 124, size=n_blocks, dtype=np.uint8)
        return blocks.reshape(rows, cols // block_size * type_size)
    if qtype == T.IQ1_M:
        offset, multiplier = _IQ1_M_FIELDS
        d = (rng.standard_normal(n_blocks) * (WEIGHT_SCALE / multiplier)).astype(np.float16).view(np.uint16)
        scales = blocks[:, offset : offset + 8].copy().view(np.uint16)  # [n_blocks, 4]
        nibbles = (d[:, None] >> np.array([0, 4, 8, 12], dtype=np.uint16)) & 0xF
        scales = (scales & 0x0FFF) | (nibbles << 12).astype(np.uint16)
        blocks[:, offset : offset + 8] = scales.view(np.uint8)
        return blocks.reshape(rows, cols // block_size * type_size)
    for offset, multiplier in _FP16_FIELDS[qtype]:
        scale = (rng.standard_normal(n_blocks) * (WEIGHT_SCALE / multiplier)).astype(np.float16)
        blocks[:, offset : offset + 2] = scale.view(np.uint8).reshape(n_blocks, 2)
    return blocks.reshape(rows, cols // block_size * type_size)
