"""GGUF dequantizers against gguf-py's reference, and the packed Linear/Embedding modules."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFWriter
from gguf import quants as gguf_quants

from localllm.errors import ModelLoadError
from localllm.quant.gguf_dequant import FLOAT_QTYPES, SUPPORTED_QTYPES, check_qtype, dequantize
from localllm.quant.linear import QuantEmbedding, QuantLinear
from localllm.quant.testing import random_quantized

T = GGMLQuantizationType
ALL_TYPES = sorted(SUPPORTED_QTYPES)
BLOCK_TYPES = sorted(SUPPORTED_QTYPES - FLOAT_QTYPES)
COLS = 512  # a multiple of every block size (QK_K = 256)


# Chunked and whole matmuls may block their float32 sums differently.
MATMUL_TOL = {"rtol": 1e-5, "atol": 1e-5}


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def _ids(types):
    return [t.name for t in types]


def _reference(data: np.ndarray, qtype: GGMLQuantizationType) -> torch.Tensor:
    with np.errstate(all="ignore"):
        return torch.from_numpy(np.ascontiguousarray(gguf_quants.dequantize(data, qtype), dtype=np.float32))


def _weights(qtype, rows, cols=COLS, seed=0) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed tensor, its float32 dequantization)."""
    packed = torch.from_numpy(random_quantized(qtype, rows, cols, seed))
    return packed, dequantize(packed, qtype)


# --- dequantization ------------------------------------------------------------------------


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=_ids(ALL_TYPES))
def test_dequantize_matches_gguf_on_valid_blocks(qtype):
    data = random_quantized(qtype, 24, COLS, seed=1)
    out = dequantize(torch.from_numpy(data), qtype)
    assert out.dtype == torch.float32 and out.shape == (24, COLS)
    torch.testing.assert_close(out, _reference(data, qtype), rtol=0, atol=0)


@pytest.mark.parametrize("qtype", BLOCK_TYPES + [T.BF16], ids=_ids(BLOCK_TYPES + [T.BF16]))
def test_dequantize_matches_gguf_on_arbitrary_bytes(qtype):
    # Every byte random, scales included: exercises all bit patterns, inf and nan too.
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    data = np.random.default_rng(2).integers(0, 256, (16, COLS // block_size * type_size), dtype=np.uint8)
    out = dequantize(torch.from_numpy(data), qtype)
    torch.testing.assert_close(out, _reference(data, qtype), rtol=0, atol=0, equal_nan=True)


QUANTIZED_BY_GGUF = [T.Q4_0, T.Q8_0, T.Q5_1, T.MXFP4, T.TQ1_0, T.TQ2_0]


@pytest.mark.parametrize("qtype", QUANTIZED_BY_GGUF, ids=_ids(QUANTIZED_BY_GGUF))
def test_dequantize_matches_gguf_quantized_normal_weights(qtype):
    weights = np.random.default_rng(3).standard_normal((8, COLS)).astype(np.float32) * 0.02
    data = gguf_quants.quantize(weights, qtype)
    out = dequantize(torch.from_numpy(data), qtype)
    torch.testing.assert_close(out, _reference(data, qtype), rtol=0, atol=0)


def test_mxfp4_block_is_e2m1_codes_times_a_power_of_two():
    """One MXFP4 block by the OCP microscaling spec: E2M1 codes (sign bit, then 0, 0.5, 1, 1.5,
    2, 3, 4, 6), element j in the low nibble of byte j and j + 16 in the high one, all times
    2 ** (e - 127) for the E8M0 byte e."""
    e2m1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    codes = np.arange(32) % 16
    block = np.zeros(17, dtype=np.uint8)
    block[0] = 127 - 3
    block[1:] = codes[:16] | (codes[16:] << 4)
    want = [(-1 if c & 8 else 1) * e2m1[c & 7] * 2.0**-3 for c in codes]
    out = dequantize(torch.from_numpy(block[None]), T.MXFP4)
    assert out[0].tolist() == want


def test_codebooks_are_ggufs():
    """The one table of the codebook types' values (read by the reference and, through the generated
    header, the native kernels) is gguf-py's, and its IQ4 values llama.cpp's ``kvalues_iq4nl``."""
    from localllm.quant.traits import CODEBOOKS

    assert CODEBOOKS[T.MXFP4] == tuple(gguf_quants.MXFP4.kvalues)
    assert CODEBOOKS[T.IQ4_NL] == CODEBOOKS[T.IQ4_XS] == tuple(gguf_quants.IQ4_NL.kvalues)


def test_iq4_xs_sub_scales_by_hand():
    """One IQ4_XS super-block built field by field: group g's six-bit scale ``sc + 32`` is nibble g
    of ``scales_l`` (low nibbles first in each byte) and bits 2g..2g+1 of ``scales_h``, its 32
    codes as IQ4_NL's (element j in the low nibble of byte j, j + 16 in the high one)."""
    from localllm.quant.traits import KVALUES_IQ4NL

    scales = [0, 1, 31, 32, 33, 50, 63, 17]  # sc + 32
    codes = (np.arange(256) * 7) % 16
    block = np.zeros(136, dtype=np.uint8)
    block[0:2] = np.array([0.5], dtype=np.float16).view(np.uint8)
    high = sum((s >> 4) << (2 * g) for g, s in enumerate(scales))
    block[2:4] = np.array([high], dtype=np.uint16).view(np.uint8)
    block[4:8] = [(scales[2 * i] & 15) | ((scales[2 * i + 1] & 15) << 4) for i in range(4)]
    for g in range(8):
        c = codes[32 * g: 32 * g + 32]
        block[8 + 16 * g: 24 + 16 * g] = c[:16] | (c[16:] << 4)
    want = [0.5 * (scales[i // 32] - 32) * KVALUES_IQ4NL[c] for i, c in enumerate(codes)]
    assert dequantize(torch.from_numpy(block[None]), T.IQ4_XS)[0].tolist() == want


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=_ids(ALL_TYPES))
def test_random_quantized_is_weight_like(qtype):
    w = dequantize(torch.from_numpy(random_quantized(qtype, 64, COLS, seed=4)), qtype)
    assert torch.isfinite(w).all()
    assert 0 < w.abs().max() < 1
    assert w.std() > 1e-3


def test_float_types_accept_typed_tensors():
    w = torch.randn(4, 8)
    assert dequantize(w, T.F32).data_ptr() == w.data_ptr()  # no copy for F32
    torch.testing.assert_close(dequantize(w.half(), T.F16), w.half().float(), rtol=0, atol=0)
    torch.testing.assert_close(dequantize(w.bfloat16(), T.BF16), w.bfloat16().float(), rtol=0, atol=0)


# --- errors --------------------------------------------------------------------------------


def test_unsupported_type_names_tensor_and_supported_types():
    # Q8_K: ggml's activation type for the K-quant dot products, never a weight in a model file
    with pytest.raises(ModelLoadError) as excinfo:
        check_qtype(T.Q8_K, "blk.0.attn_q.weight")
    message = str(excinfo.value)
    assert "tensor 'blk.0.attn_q.weight' uses GGUF type Q8_K" in message
    assert "Q4_K" in message and "BF16" in message and "IQ2_XS" in message
    assert "\n" not in message
    with pytest.raises(ModelLoadError, match="Q8_K"):
        QuantLinear(torch.zeros(4, 292, dtype=torch.uint8), T.Q8_K, 256, 4, name="w")
    with pytest.raises(ModelLoadError, match="#9999"):
        check_qtype(9999, "w")


@pytest.mark.parametrize(
    ("shape", "in_features", "out_features", "match"),
    [
        ((8, 144), 256, 4, r"byte shape \(8, 144\), expected \(4, 144\)"),  # wrong rows
        ((4, 140), 256, 4, r"byte shape \(4, 140\), expected \(4, 144\)"),  # wrong bytes per row
        ((4, 144), 100, 4, "not a whole number of Q4_K blocks"),
    ],
)
def test_bad_byte_shape_raises(shape, in_features, out_features, match):
    with pytest.raises(ModelLoadError, match=match):
        QuantLinear(torch.zeros(shape, dtype=torch.uint8), T.Q4_K, in_features, out_features, name="w")


def test_bad_dtype_and_bias_raise():
    with pytest.raises(ModelLoadError, match="tensor 'w'"):
        QuantLinear(torch.zeros(4, 32), T.Q8_0, 32, 4, name="w")
    with pytest.raises(ModelLoadError, match="tensor 'w'"):
        QuantLinear(torch.zeros(4, 32, dtype=torch.float16), T.F32, 32, 4, name="w")
    with pytest.raises(ModelLoadError, match="bias shape"):
        QuantLinear(torch.zeros(4, 34, dtype=torch.uint8), T.Q8_0, 32, 4, torch.zeros(5), name="w")


# --- QuantLinear ---------------------------------------------------------------------------


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=_ids(ALL_TYPES))
@pytest.mark.parametrize("batch", [1, 3, 17])
def test_quant_linear_matches_dequantized_matmul(qtype, batch):
    packed, w = _weights(qtype, rows=100)
    x = torch.randn(batch, COLS)
    expected = x @ w.T
    for chunk_rows in (None, 32):  # one chunk; several chunks with a ragged last one
        layer = QuantLinear(packed, qtype, COLS, 100, chunk_rows=chunk_rows)
        torch.testing.assert_close(layer(x), expected, **MATMUL_TOL)


def test_quant_linear_default_chunking_covers_many_chunks():
    packed, w = _weights(T.Q8_0, rows=5000, cols=32)
    layer = QuantLinear(packed, T.Q8_0, 32, 5000)
    assert layer.chunk_rows < 5000
    x = torch.randn(2, 32)
    torch.testing.assert_close(layer(x), x @ w.T, **MATMUL_TOL)


def test_quant_linear_bias_batch_dims_and_bfloat16():
    packed, w = _weights(T.Q4_K, rows=48)
    bias = torch.randn(48)
    layer = QuantLinear(packed, T.Q4_K, COLS, 48, bias, chunk_rows=20)
    x = torch.randn(2, 5, COLS)
    y = layer(x)
    assert y.shape == (2, 5, 48)
    torch.testing.assert_close(y, x @ w.T + bias, **MATMUL_TOL)

    y16 = layer(x.bfloat16())
    assert y16.dtype == torch.bfloat16
    expected16 = x.bfloat16() @ w.bfloat16().T + bias.bfloat16()
    torch.testing.assert_close(y16, expected16, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("qtype", [T.Q6_K, T.Q4_0, T.F16], ids=lambda q: q.name)
def test_quant_linear_reference_forward_is_the_product_with_ggufs_dequantization(qtype):
    """The reference every fast path is compared with: ``x @ W.T`` for the ``W`` gguf-py's own
    dequantizer reads from the same bytes (not this package's, which the matmul uses)."""
    packed, _ = _weights(qtype, rows=8)
    layer = QuantLinear(packed, qtype, COLS, 8)
    x = torch.randn(3, COLS)
    w = torch.from_numpy(gguf_quants.dequantize(packed.numpy(), qtype).astype(np.float32)).reshape(8, COLS)
    torch.testing.assert_close(layer.reference_forward(x), x @ w.T, **MATMUL_TOL)
    torch.testing.assert_close(layer(x), layer.reference_forward(x), rtol=0, atol=0)  # and forward is it


def test_quant_linear_shares_memory_with_numpy():
    array = random_quantized(T.Q4_0, 16, COLS, seed=5)
    layer = QuantLinear(torch.from_numpy(array), T.Q4_0, COLS, 16)
    assert layer.raw.data_ptr() == array.ctypes.data
    assert np.shares_memory(layer.raw.numpy(), array)
    assert not list(layer.parameters())
    layer.to(torch.bfloat16)  # casting a model must leave packed bytes alone
    assert layer.raw.dtype == torch.uint8 and layer.raw.data_ptr() == array.ctypes.data

    floats = random_quantized(T.F16, 16, COLS, seed=5)
    layer = QuantLinear(floats, T.F16, COLS, 16)  # numpy arrays are accepted directly
    assert np.shares_memory(layer.raw.numpy(), floats)


def test_modules_over_gguf_reader_memmap(tmp_path):
    path = tmp_path / "tiny.gguf"
    writer = GGUFWriter(str(path), "llama")
    tensors = {}
    for qtype in (T.F32, T.F16, T.BF16, T.Q4_K, T.Q8_0):
        data = random_quantized(qtype, 8, COLS, seed=int(qtype))
        tensors[qtype.name] = (qtype, data)
        raw_dtype = None if qtype in (T.F32, T.F16) else qtype
        writer.add_tensor(qtype.name, data, raw_dtype=raw_dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    reader = GGUFReader(str(path))
    x = torch.randn(2, COLS)
    for tensor in reader.tensors:
        qtype, data = tensors[tensor.name]
        assert tensor.tensor_type == qtype
        layer = QuantLinear(tensor.data, tensor.tensor_type, COLS, 8, name=tensor.name)
        assert np.shares_memory(layer.raw.numpy(), tensor.data)
        w = dequantize(torch.from_numpy(data), qtype)
        torch.testing.assert_close(layer(x), x @ w.T, **MATMUL_TOL)


# --- QuantEmbedding ------------------------------------------------------------------------


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=_ids(ALL_TYPES))
def test_quant_embedding_rows_and_tied_logits(qtype):
    packed, w = _weights(qtype, rows=40)
    emb = QuantEmbedding(packed, qtype, 40, COLS, chunk_rows=16)
    ids = torch.tensor([[0, 39, 7], [7, 3, 0]])
    out = emb(ids)
    assert out.shape == (2, 3, COLS) and out.dtype == torch.float32
    torch.testing.assert_close(out, w[ids], rtol=0, atol=0)
    assert emb(ids, dtype=torch.bfloat16).dtype == torch.bfloat16

    x = torch.randn(3, COLS)
    torch.testing.assert_close(emb.logits(x), x @ w.T, **MATMUL_TOL)
    head = emb.as_linear()
    assert head.raw.data_ptr() == emb.raw.data_ptr()
    assert (head.in_features, head.out_features) == (COLS, 40)
    torch.testing.assert_close(head(x), x @ w.T, **MATMUL_TOL)


def test_the_type_table_covers_every_readable_type_once():
    """localllm.quant.traits is the one place for per-type facts: every type the reference
    decoders read has one entry; each format id is one type's, and the C++ kernels' format table
    has exactly the ``format`` layouts (and ``float`` its float ones); sub-blocks divide the block."""
    from gguf import GGML_QUANT_SIZES

    from localllm.kernels.cpu import native
    from localllm.quant.gguf_dequant import SUPPORTED_QTYPES
    from localllm.quant.traits import TRAITS

    assert set(TRAITS) == set(SUPPORTED_QTYPES)
    ids = [tr.cpu_format for tr in TRAITS.values() if tr.cpu_format is not None]
    assert len(ids) == len(set(ids))
    assert {tr.cpu_format for tr in TRAITS.values() if tr.cpu_layout == "format"} == set(native.FORMATS)
    assert {tr.cpu_format for tr in TRAITS.values() if tr.cpu_layout == "float"} == native.FLOAT_FORMATS
    for qtype, tr in TRAITS.items():
        assert GGML_QUANT_SIZES[qtype][0] % tr.sub_size == 0 or tr.cpu_layout in ("float", "f32"), qtype.name
        assert (tr.cpu_layout in ("format", "float")) == (tr.cpu_format is not None), qtype.name
