"""Every GGUF type on the native route (localllm/kernels/cpu: the format kernels of
csrc/cpu_kernels.cpp, packed by native.pack_format / weights.repack_format), at real shapes:

* (a) the kernel equals its float64 definition (``native.reference_qgemm_weights``: the
  activations' int8 codes, one or two passes, times the stored weights; F16/BF16: the
  activations as they are) within ``DEF_RTOL`` of the output's scale (observed ~1e-6: float32
  rounding of the per-group products and sums);
* (b) it is within its own error bound (``NativeWeight.error_bound``) of the exact float64
  ``x @ W.T`` with ``W = dequantize(file)``;
* (c) a row's output is bitwise the same whatever else is in its batch (1, 3, 17, 40 rows);
* (d) the packed weight is at most ``MAX_RATIO`` times the file's bytes (printed per type);
* (e) ``rows(ids)`` gives the file's float32 weights exactly (every type).

Rows are ``N_ROWS`` (not a multiple of 16: the last tile is padded with zero rows).
"""

from __future__ import annotations

import functools
from dataclasses import replace

import pytest
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T

from localllm.kernels.cpu import native, weights
from localllm.kernels.cpu.matmul import CpuLinear
from localllm.kernels.cpu.options import CpuOptions
from localllm.kernels.cpu.weights import UNSUPPORTED, NativeWeight
from localllm.quant import QuantLinear
from localllm.quant.gguf_dequant import as_bytes, dequantize
from localllm.quant.testing import random_quantized

HAS_NATIVE = native.cpu_has_native()
pytestmark = pytest.mark.skipif(not HAS_NATIVE, reason="the native route needs AVX-512 VNNI or AVX2 (x86)")

LATTICE = [T.IQ2_XXS, T.IQ2_XS, T.IQ2_S, T.IQ3_XXS, T.IQ3_S]
TYPES = [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K, T.MXFP4, T.IQ4_NL, T.IQ4_XS,
         *LATTICE, T.F16, T.BF16]
K_QUANTS = {T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K}
FLOATS = {T.F16, T.BF16}
N_ROWS = 2048 + 16 * 3 + 8
MAX_RATIO = 1.15
DEF_RTOL = 1e-5
BATCH = 40
CHECKED_ROWS = [0, 3, 7, 20, 39]  # 3: a large row, 7: outliers
# the environment's (the conftest's kernel cache), the default budget (max_growth 1.5)
OPTIONS = replace(CpuOptions.from_env(), release_file_pages=False, max_growth=1.5, native=True)

CASES = [(t, 2048) for t in TYPES] + [(t, 8192) for t in TYPES] + [(t, 2048 + 32 * 5) for t in (T.Q4_0, T.Q5_0, T.Q8_0)]


@functools.lru_cache(maxsize=2)
def _weight(qtype, k):
    raw = torch.from_numpy(random_quantized(qtype, N_ROWS, k, seed=k + int(qtype)))
    return raw, dequantize(as_bytes(raw, qtype), qtype), weights.prepare(raw, qtype, N_ROWS, k, OPTIONS)


def _inputs(k, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(BATCH, k, generator=gen)
    x[3] *= 100.0  # rows of very different scales
    x[7, ::97] = 50.0  # a few outliers
    return x


@pytest.mark.parametrize("qtype,k", CASES, ids=[f"{t.name}-{k}" for t, k in CASES])
def test_type_on_the_native_route(qtype, k):
    raw, w, state = _weight(qtype, k)
    assert isinstance(state, NativeWeight), f"{qtype.name} fell off the native route"
    # (d) memory
    ratio = state.nbytes / as_bytes(raw, qtype).numel()
    print(f"{qtype.name} k={k}: {state.nbytes * 8 / (N_ROWS * k):.4f} bits/weight, {ratio:.4f}x the file")
    assert ratio <= MAX_RATIO
    # (e) rows: the file's weights exactly
    ids = torch.tensor([0, 1, 15, 16, 1000, N_ROWS - 9, N_ROWS - 1])
    assert state.exact and torch.equal(state.rows(ids), w[ids])
    assert state.max_scale_error == 0.0
    x = _inputs(k)
    some = CHECKED_ROWS  # the float64 references on a few rows (they dominate the test's time)
    exact = x[some].double() @ _weight(qtype, k)[1].double().t()  # the file's weights
    for passes in (1, 2):
        y = state.matmul(x, passes)
        assert y.shape == (BATCH, N_ROWS) and y.dtype == torch.float32
        # (a) the definition
        ref = native.reference_qgemm_weights(x[some], w, passes, quantize=qtype not in FLOATS)
        scale = ref.abs().amax(1, keepdim=True)
        assert ((y[some].double() - ref).abs() <= DEF_RTOL * scale).all()
        # (b) the error bound against the exact product
        bound = state.error_bound(x, passes).double()[some]
        assert ((y[some].double() - exact).abs() <= bound[:, None]).all()
        # (c) batch invariance, bitwise (AVX-512: blocks of 8 rows, then of 4, then single rows)
        for rows in (1, 3, 6, 12, 17):
            assert torch.equal(state.matmul(x[:rows], passes), y[:rows])
        assert torch.equal(state.matmul(x[29:30], passes), y[29:30])
        assert torch.equal(state.matmul(x[5:22], passes), y[5:22])


@pytest.mark.parametrize("qtype", TYPES, ids=[t.name for t in TYPES])
def test_layer_takes_the_native_route_by_default(qtype):
    """A QuantLinear of every type, with the default options: native, close to the reference
    forward (two activation passes), odd row counts included."""
    rows, cols = 40 + 5, 512
    layer = QuantLinear(random_quantized(qtype, rows, cols, seed=3), qtype, cols, rows, None)
    fast = CpuLinear(layer, replace(OPTIONS, activation_passes=2))
    assert isinstance(fast.prepared(), NativeWeight)
    x = torch.randn(6, cols)
    ref = layer.reference_forward(x)
    assert ((fast(x) - ref).abs().max() / ref.abs().max()).item() < 1e-4
    assert ((fast(x) - ref).abs().amax(1) <= fast.prepared().error_bound(x, 2)).all()


@pytest.mark.parametrize("qtype", [T.Q2_K, T.Q3_K, T.F16], ids=["Q2_K", "Q3_K", "F16"])
def test_types_without_a_route_when_native_is_off(qtype):
    raw = torch.from_numpy(random_quantized(qtype, 32, 256))
    assert weights.prepare(raw, qtype, 32, 256, replace(OPTIONS, native=False)) is UNSUPPORTED


def test_fused_weights_of_the_new_types_equal_the_parts():
    """q/k/v (or gate/up) of one type fuse into one weight whose columns are the parts' bitwise,
    odd row counts included."""
    for qtype in (T.Q5_K, T.Q6_K, T.Q3_K, T.F16):
        sizes = (40, 8, 24)
        layers = [QuantLinear(random_quantized(qtype, n, 256, seed=i), qtype, 256, n, None) for i, n in enumerate(sizes)]
        mods = [CpuLinear(m, OPTIONS) for m in layers]
        fused, bias = weights.prepare_fused(mods, OPTIONS)
        assert isinstance(fused, NativeWeight) and bias is None and fused.n == sum(sizes)
        x = torch.randn(5, 256)
        parts = torch.cat([m.prepared().matmul(x, 2) for m in mods], 1)
        assert torch.equal(fused.matmul(x, 2), parts)


# The types held at exactly the file's bytes (codes, sub-scales and scales as stored, Q4_K's,
# Q5_K's and IQ4_XS's six-bit ones at six bits, MXFP4's E8M0 bytes as they are, the lattice types'
# groups' bytes (indices, signs, sub-scales) as they are, no derived offset
# such as Q4_0's z = -8 d): all but Q3_K (1.036x: its six-bit sub-scales a byte each, cheaper to
# unpack for its one-row kernel).
FILE_SIZED = {T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K, T.Q2_K, T.MXFP4, T.IQ4_NL, T.IQ4_XS,
              *LATTICE, T.F16, T.BF16}


def test_memory_ratio_per_type_at_model_shapes():
    """Packed bytes against the file's for a 2048 x 8192 weight of every type (no padding)."""
    for qtype in TYPES:
        block, type_size = GGML_QUANT_SIZES[qtype]
        fmt = weights._FORMAT_OF.get(qtype, 8 if qtype == T.Q8_0 else 4)
        ratio = native.packed_bytes(2048, 8192, fmt) / (2048 * 8192 // block * type_size)
        assert ratio <= MAX_RATIO, qtype.name
        assert (ratio == 1.0) == (qtype in FILE_SIZED), (qtype.name, ratio)


_SAME_BITS_SCRIPT = """
import sys, torch
from dataclasses import replace
from gguf import GGMLQuantizationType as T
from localllm.kernels.cpu import native, weights
from localllm.kernels.cpu.options import CpuOptions
from localllm.quant.testing import random_quantized
opts = replace(CpuOptions.from_env(), release_file_pages=False, max_growth=1.5, native=True)
out = {"isa": native.load(opts).isa()}
for name in sys.argv[2].split(","):
    qtype = getattr(T, name)
    n, k = 16 * 5 + 8, 512
    state = weights.prepare(torch.from_numpy(random_quantized(qtype, n, k, seed=int(qtype))), qtype, n, k, opts)
    x = torch.randn(45, k, generator=torch.Generator().manual_seed(1))
    x[2] *= 300.0
    out[name] = torch.stack([state.matmul(x, 1), state.matmul(x, 2)])
torch.save(out, sys.argv[1])
"""


@pytest.mark.timeout(900)
@pytest.mark.skipif(native.cpu_isa() != "avx512vnni",
                    reason="an AVX-512 CPU runs both builds; elsewhere there is one build to run")
@pytest.mark.skipif(OPTIONS.isa is not None, reason="LOCALLLM_CPU_ISA is set: this process runs the build it names")
def test_the_avx2_and_avx512_builds_give_the_same_bits(tmp_path):
    """Every type's kernel is one template over the vector width (or, for the 4- and 8-bit tiles,
    two routes written to the same arithmetic): per output the same integer sums and the same float
    operations in the same order, so a model answers the same on both machines. Multi-row tiles
    (45 rows: blocks of 16, then 8 and 4 rows, and one single row; the K-quants' group factors
    formed by a tile's first block and kept for the others) and the one-row kernel, one and two passes."""
    import os
    import subprocess
    import sys

    names = ",".join(t.name for t in TYPES)
    results = {}
    for isa in ("avx512vnni", "avx2"):
        env = {**os.environ, "LOCALLLM_CPU_ISA": isa}
        out = tmp_path / f"{isa}.pt"
        run = subprocess.run([sys.executable, "-c", _SAME_BITS_SCRIPT, str(out), names], env=env,
                             capture_output=True, text=True, check=False)
        assert run.returncode == 0, run.stderr[-3000:]
        results[isa] = torch.load(out)
        assert results[isa]["isa"] == isa
    for qtype in TYPES:
        a, b = results["avx512vnni"][qtype.name], results["avx2"][qtype.name]
        assert torch.equal(a, b), f"{qtype.name}: builds differ by up to {(a - b).abs().max().item():.3g}"


def test_weights_side_by_side_equal_their_own_calls():
    """``qgemm_parts`` (q/k/v or gate/up of mixed types or GPTQ input orders, in one parallel region):
    per weight bitwise what its own ``qgemm`` gives, with shared and separate inputs, one row (decode)
    and several, one and two passes, widths that are not a multiple of the tile (the parts computed
    apart, then joined) and widths that all are (written in place into one output), and an F16 part
    (which takes its own kernel); small parts (each one chunk) and parts of 663 KB together (each in
    chunks sized over the total, taken by either thread)."""
    kernels = native.load(OPTIONS)
    small = [(T.Q4_K, 72), (T.Q6_K, 40), (T.Q4_0, 24), (T.Q8_0, 8), (T.Q5_K, 16), (T.Q3_K, 200), (T.Q4_1, 32)]
    whole = [(T.Q4_K, 64), (T.Q6_K, 32), (T.Q4_1, 48), (T.Q8_0, 16)]
    for k, parts in ((512, small), (512, whole), (2048, [(T.Q4_K, 320), (T.Q6_K, 96), (T.Q4_1, 100)])):
        held = [weights.prepare(torch.from_numpy(random_quantized(t, n, k, seed=n)), t, n, k, OPTIONS) for t, n in parts]
        assert all(isinstance(w, NativeWeight) for w in held)
        for rows in (1, 5):
            x, other = _inputs(k)[:rows].contiguous(), _inputs(k, seed=1)[:rows].contiguous()
            inputs = [x, other, x, other, x, x, other][:len(held)]
            for passes in (1, 2):
                together = kernels.qgemm_parts(inputs, [w.packed for w in held], [w.bits for w in held],
                                               [w.n for w in held], k, passes)
                alone = torch.cat([kernels.qgemm(xi, w.packed, w.bits, w.n, k, passes)
                                   for xi, w in zip(inputs, held)], 1)
                assert together.shape == (rows, sum(n for _, n in parts))
                assert torch.equal(together, alone), (k, rows, passes)
    f16 = weights.prepare(torch.from_numpy(random_quantized(T.F16, 32, k, seed=3)), T.F16, 32, k, OPTIONS)
    mixed = [held[0], f16]
    together = kernels.qgemm_parts([x, x], [w.packed for w in mixed], [w.bits for w in mixed], [w.n for w in mixed], k, 1)
    assert torch.equal(together, torch.cat([kernels.qgemm(x, w.packed, w.bits, w.n, k, 1) for w in mixed], 1))


@pytest.mark.parametrize("qtype", TYPES, ids=[t.name for t in TYPES])
def test_an_input_order_read_inside_the_kernel_gives_the_gathered_inputs_bits(qtype):
    """A weight whose input columns come in an order of their own (GPTQ act-order: qgemm's
    ``order``, as the fused decoder layer passes them) reads the input through it as the
    activations are quantized: bitwise what the input gathered first gives, at every batch size
    (one row, a block of 4 plus one, blocks of 16 and 8), one and two passes; a wrong order is
    refused."""
    k, n = 512, 40
    state = weights.prepare(torch.from_numpy(random_quantized(qtype, n, k, seed=11)), qtype, n, k, OPTIONS)
    assert isinstance(state, NativeWeight)
    order = torch.randperm(k, generator=torch.Generator().manual_seed(int(qtype)), dtype=torch.int32)
    for rows in (1, 5, 25):
        x = _inputs(k, seed=rows)[:rows].contiguous()
        for passes in (1, 2):
            assert torch.equal(state.matmul(x, passes, order), state.matmul(x[:, order], passes)), (rows, passes)
    with pytest.raises(RuntimeError, match="one entry per input column"):
        state.matmul(x, 1, order[:-1])
    for wrong in (k, -1):
        with pytest.raises(RuntimeError, match="out of range"):
            state.matmul(x, 1, torch.full((k,), wrong, dtype=torch.int32))
    with pytest.raises(RuntimeError, match="int32"):
        state.matmul(x, 1, order.long())
