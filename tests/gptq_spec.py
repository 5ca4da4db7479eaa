"""GPTQ's checkpoint format written from its definition, bit by bit: packing, dequantization and
random checkpoints, which the format's and the CPU kernels' tests compare against."""

from __future__ import annotations

import math

import numpy as np
import torch


def spec_pack(values: np.ndarray, bits: int) -> np.ndarray:
    """Pack ``values [count, M]`` along dim 0, bit by bit: int32 ``[ceil(count*bits/32), M]``."""
    count, m = values.shape
    words = np.zeros((math.ceil(count * bits / 32), m), dtype=np.uint32)
    for j in range(count):
        for b in range(bits):
            pos = j * bits + b  # bit b of value j is bit `pos` of the column's stream
            bit = ((values[j] >> b) & 1).astype(np.uint32)
            words[pos // 32] |= bit << np.uint32(pos % 32)
    return words.view(np.int32)


def spec_unpack(words: np.ndarray, bits: int, count: int) -> np.ndarray:
    """The first ``count`` ``bits``-wide values of each column's bit stream, bit by bit."""
    u = np.ascontiguousarray(words).view(np.uint32)
    values = np.zeros((count, u.shape[1]), dtype=np.int64)
    for j in range(count):
        for b in range(bits):
            pos = j * bits + b
            values[j] |= ((u[pos // 32] >> np.uint32(pos % 32)) & 1).astype(np.int64) << b
    return values


def spec_dequantize(qweight, qzeros, scales, g_idx, bits: int, in_features: int, out_features: int,
                    checkpoint_format: str = "gptq") -> np.ndarray:
    """Float32 ``W [out, in]``: ``W[n, k] = scales[g, n] * (q[k, n] - zero[g, n])``, ``g = g_idx[k]``."""
    q = spec_unpack(np.asarray(qweight), bits, in_features)  # [K, N]
    zeros = spec_unpack(np.asarray(qzeros).T, bits, out_features).T  # [G, N]
    if checkpoint_format == "gptq":
        zeros = zeros + 1
    g = np.asarray(g_idx).astype(np.int64)
    s = np.asarray(scales, dtype=np.float32)
    return ((q.astype(np.float32) - zeros[g].astype(np.float32)) * s[g]).T


def random_gptq(bits, group_size, act_order, sym, in_features, out_features, fmt="gptq", seed=0):
    """Random packed tensors (packed by ``spec_pack``) and the spec's dequantized weight."""
    rng = np.random.default_rng(seed)
    maxq = 2**bits - 1
    g = in_features if group_size == -1 else group_size
    num_groups = math.ceil(in_features / g)
    intweight = rng.integers(0, maxq + 1, size=(in_features, out_features))
    if sym:
        zeros = np.full((num_groups, out_features), (maxq + 1) // 2)
    else:
        zeros = rng.integers(1 if fmt == "gptq" else 0, maxq + 1, size=(num_groups, out_features))
    stored = zeros - (1 if fmt == "gptq" else 0)
    scales = (rng.uniform(0.5, 1.5, size=(num_groups, out_features)) * 0.01).astype(np.float16)
    g_idx = np.arange(in_features) // g
    if act_order:  # as GPTQ writes it: groups of the permuted order, mapped back to input positions
        perm = rng.permutation(in_features)
        g_idx = np.empty(in_features, dtype=np.int64)
        g_idx[perm] = np.arange(in_features) // g
    tensors = {
        "qweight": torch.from_numpy(spec_pack(intweight, bits)),
        "qzeros": torch.from_numpy(np.ascontiguousarray(spec_pack(stored.T, bits).T)),
        "scales": torch.from_numpy(scales),
        "g_idx": torch.from_numpy(g_idx.astype(np.int32)),
    }
    ref = spec_dequantize(tensors["qweight"], tensors["qzeros"], scales, g_idx, bits, in_features, out_features, fmt)
    return tensors, torch.from_numpy(ref)
