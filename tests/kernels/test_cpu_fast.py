"""The CPU backend's matmuls (localllm/kernels/cpu: weights.py, matmul.py) against the reference
dequantize-then-matmul of the quantized modules they replace.

Tolerances, per output matrix, as ``max|fast - ref| / max|ref|``:

* the native route (every GGUF type but F32 on CPUs with AVX-512 VNNI or AVX2; the kernels
  themselves are tested in test_cpu_native.py and, per type at real shapes, test_cpu_types.py):
  ``NATIVE_RTOL = 1e-4`` with two activation passes (``int8x2``; observed ~2e-5; the stored
  weights are the file's exactly), ``NATIVE_INT8_RTOL = 2e-2`` with one pass (the default).
* int4 routes (where the native kernels are off: Q4_0, Q4_1, Q4_K, Q8_0, and Q5_0, Q5_1, Q5_K
  when the memory budget allows) and BF16 weights there: ``BF16_RTOL = 1e-2``. They compute in bfloat16 (activations, per-group
  scales and zeros, outputs; float32 accumulation); observed 2e-3 to 6e-3.
* F32 weights: ``F32_RTOL = 1e-5`` (the same float32 GEMM, only blocked differently).
* An LM head's logits near each row's maximum: float32-exact (``rtol = atol = 1e-5``) on the
  int4 routes; on the native route each row's largest logit is exact and the rest are within
  the route's error bound.

On the real model, greedy decoding on the fast path is checked step by step against the
reference path's logits for the same tokens (teacher forcing): wherever the fast path's token is
not the reference's argmax, the reference must rate it within a near-tie margin of its best
logit, i.e. the paths part only at near-ties; and every logit must stay within an absolute
bound of the reference's. The fast path's logits come from a float16 KV cache (the engine's
default on the native route), the reference's from a float32 one. Per way of computing (3 chat
prompts, up to 32 tokens each):

* native, ``int8x2`` activations: observed no step off, logits within 0.006; bounds 0.01/0.05.
* native, ``int8`` activations (llama.cpp's precision) and ``auto`` (the default: int8 for the
  layers, the LM head at int8x2 with its top logits recomputed): observed 0-2 steps off per
  prompt (regrets
  0.006-0.082 with a float32 cache; with float16 one regret of 0.75 where that step's logits
  were off by more than 0.37), logits within 0.9-2.3. Bounds ``LOGIT_ATOL = 2.5`` and, per step
  off the reference, a regret below ``NEAR_TIE = 0.15`` or below twice that step's largest logit
  error (logits within e of the reference's cannot pick a token rated more than 2e below the
  best: the paths then part only where the fast path's own error allows it).
* int4 route (CPUs without native kernels, bfloat16 activations): observed no step off (on 5 more
  prompts: 2 steps in 160, regrets 0.0047 and 0.0015), logits within 0.62; bounds 0.05/1.5.
"""

from __future__ import annotations

import platform
import sys
from dataclasses import replace

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from smollm2_prompts import CONVERSATIONS, NUM_GREEDY_TOKENS

from localllm.kernels.attention import AttentionMetadata
from localllm.kernels.cpu import int4, weights
from localllm.kernels.cpu import native as cpu_native
from localllm.kernels.cpu.backend import CpuBackend
from localllm.kernels.cpu.matmul import CpuEmbedding, CpuLinear, held_bytes, refine_top_logits
from localllm.kernels.cpu.options import CpuOptions
from localllm.kernels.cpu.weights import FloatWeight, NativeWeight
from localllm.kernels.select import select_backend
from localllm.kernels.torch_backend import REFERENCE
from localllm.platform.memory import HUGE_PAGE_BYTES, huge_page_buffer, release_file_pages
from localllm.quant import QuantEmbedding, QuantLinear
from localllm.quant.testing import random_quantized

BF16_RTOL = 1e-2
F32_RTOL = 1e-5
NATIVE_RTOL = 1e-4
NATIVE_INT8_RTOL = 2e-2
NATIVE_TYPES = [T.Q4_0, T.Q4_1, T.Q4_K, T.Q8_0]
# the file's codes and scales in formats of their own on the native route (exact)
FORMAT_TYPES = [T.Q5_0, T.Q5_1, T.Q5_K, T.Q6_K, T.Q3_K, T.Q2_K, T.MXFP4, T.IQ4_NL, T.IQ4_XS, T.F16, T.BF16]
HAS_NATIVE = cpu_native.cpu_has_vnni()
needs_native = pytest.mark.skipif(not HAS_NATIVE, reason="the native route needs AVX-512 VNNI or AVX2 (x86)")
NEAR_TIE = 0.15
LOGIT_ATOL = 2.5
# (near-tie margin, logit bound, whether twice a step's logit error also bounds its regret) per
# way of computing, see the module docstring
GREEDY_BOUNDS = {"int8x2": (0.01, 0.05, False), "int8": (NEAR_TIE, LOGIT_ATOL, True),
                 "auto": (NEAR_TIE, LOGIT_ATOL, True), "int4": (0.05, 1.5, False)}

INT4_TYPES = [T.Q4_0, T.Q4_1, T.Q4_K, T.Q5_0, T.Q5_1, T.Q5_K, T.Q8_0]
FAST_TYPES = INT4_TYPES + [T.BF16, T.F32]
REFERENCE_ONLY_TYPES = [T.Q2_K, T.Q3_K, T.F16, T.Q6_K, T.MXFP4, T.IQ4_NL, T.IQ4_XS]  # where the native kernels are off
ROWS, COLS = 208, 512  # 208 = 3 full 64-row tiles + a partial one; 512 = two 256-element super-blocks


OPTIONS = CpuOptions(max_growth=2.0)  # the defaults, but a budget that lets the Q5 types take their route too


def _backend(**changes) -> CpuBackend:
    """The CPU backend with ``OPTIONS`` changed by ``changes``."""
    return CpuBackend(replace(OPTIONS, **changes))


def _fast(module, **changes):
    """``module`` (a QuantLinear or QuantEmbedding) on the CPU backend's matmuls, ``OPTIONS``
    changed by ``changes``."""
    options = replace(OPTIONS, **changes)
    return CpuLinear(module, options) if isinstance(module, QuantLinear) else CpuEmbedding(module, options)


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


def _tol(qtype) -> float:
    return F32_RTOL if qtype == T.F32 else BF16_RTOL


def _layer(qtype, rows=ROWS, cols=COLS, bias=None, seed=0) -> QuantLinear:
    return QuantLinear(random_quantized(qtype, rows, cols, seed=seed), qtype, cols, rows, bias)


INT4 = {"native": False}
"""Options that keep the native kernel out (the int4 routes are what CPUs without AVX-512 VNNI or AVX2 get)."""


@pytest.mark.parametrize("route", ["int4-kernel", "dequant-gemm"])
@pytest.mark.parametrize("qtype", FAST_TYPES, ids=[t.name for t in FAST_TYPES])
def test_fast_matches_reference(qtype, route, monkeypatch):
    # Force one route for every batch size (by default batches of gemm_rows and more take the
    # dequantize + GEMM route), the latter in bands of 64 rows (the last one partial).
    monkeypatch.setattr(int4, "DEQUANT_CHUNK_BYTES", 1)
    gen = torch.Generator().manual_seed(int(qtype))
    layer = _layer(qtype, bias=torch.randn(ROWS, generator=gen), seed=int(qtype))
    fast = _fast(layer, **INT4, gemm_rows=1 if route == "dequant-gemm" else 1 << 30, fast_math=True)
    for batch in (1, 7, 64):
        x = torch.randn(batch, COLS, generator=gen)
        ref = layer.reference_forward(x)
        out = fast(x)
        assert out.dtype == torch.float32 and out.shape == ref.shape
        err = _rel_err(out, ref)
        assert err <= _tol(qtype), f"{qtype.name} batch {batch}: relative error {err:.2e}"
    assert fast.prepared() is not None


@needs_native
@pytest.mark.parametrize("passes", [2, 1])
@pytest.mark.parametrize("qtype", NATIVE_TYPES, ids=[t.name for t in NATIVE_TYPES])
def test_native_route_matches_reference(qtype, passes):
    gen = torch.Generator().manual_seed(int(qtype))
    layer = _layer(qtype, bias=torch.randn(ROWS, generator=gen), seed=int(qtype))
    fast = _fast(layer, activation_passes=passes)
    for batch in (1, 7, 64, 200):
        x = torch.randn(batch, COLS, generator=gen)
        out, ref = fast(x), layer.reference_forward(x)
        assert out.dtype == torch.float32 and out.shape == ref.shape
        err = _rel_err(out, ref)
        tol = NATIVE_INT8_RTOL if passes == 1 else NATIVE_RTOL
        assert err <= tol, f"{qtype.name} batch {batch}: relative error {err:.2e}"
        # each row is computed alone: the same result in any batch
        assert torch.equal(fast(x[:1]), out[:1])
    assert isinstance(fast.prepared(), NativeWeight)


@needs_native
@pytest.mark.parametrize("passes", [2, 1])
@pytest.mark.parametrize("qtype", FORMAT_TYPES, ids=[t.name for t in FORMAT_TYPES])
def test_format_types_on_the_native_route(qtype, passes):
    """Q5_0, Q5_1, Q5_K, Q6_K, Q3_K, Q2_K, MXFP4, IQ4_NL, IQ4_XS, F16, BF16: the file's codes, integer
    sub-scales and float16 scales (MXFP4's E8M0 bytes; or its float rows) as they are, so exact and within the default budget;
    within the native route's tolerance of the reference and within the weight's rigorous error
    bound row by row, as an LM head's refinement needs; each row computed alone."""
    gen = torch.Generator().manual_seed(int(qtype))
    layer = _layer(qtype, seed=int(qtype))
    fast = _fast(layer, activation_passes=passes, max_growth=1.5)
    state = fast.prepared()
    assert isinstance(state, NativeWeight) and state.bits not in (4, 8) and state.exact
    assert state.nbytes <= 1.15 * weights.as_bytes(layer.raw, qtype).numel()
    for batch in (1, 7, 64):
        x = torch.randn(batch, COLS, generator=gen) * 3
        out, ref = fast(x), layer.reference_forward(x)
        tol = NATIVE_INT8_RTOL if passes == 1 and qtype not in (T.F16, T.BF16) else NATIVE_RTOL
        assert _rel_err(out, ref) <= tol
        assert torch.all((out - ref).abs().amax(1) <= state.error_bound(x, passes))
        assert torch.equal(fast(x[:1]), out[:1])


@pytest.mark.parametrize("qtype", REFERENCE_ONLY_TYPES, ids=[t.name for t in REFERENCE_ONLY_TYPES])
def test_types_without_a_route_run_the_reference(qtype):
    """Without the native kernels (switched off, or a CPU without AVX2), Q2_K, Q3_K, Q6_K, F16 and
    the codebook types have no route."""
    layer = _layer(qtype, rows=32, cols=256)
    fast = _fast(layer, **INT4)
    x = torch.randn(3, 256)
    assert torch.equal(fast(x), layer.reference_forward(x))
    assert fast.prepared() is None


def test_switch_off_runs_the_reference():
    layer = _layer(T.Q4_1)
    model = torch.nn.ModuleList([layer])
    x = torch.randn(5, COLS)
    select_backend("auto", "cpu", OPTIONS).install(model)
    assert isinstance(model[0], CpuLinear)
    assert not torch.equal(model[0](x), layer.reference_forward(x))  # the fast path did run
    off = select_backend("auto", "cpu", replace(OPTIONS, enabled=False))
    assert off is REFERENCE
    off.install(model)
    assert model[0] is layer and torch.equal(model[0](x), layer.reference_forward(x))


@pytest.mark.parametrize("value, enabled", [(None, True), ("1", True), ("0", False), ("off", False)])
def test_env_switch(value, enabled, python_with_env):
    code = "from localllm.kernels.select import select_backend; print(select_backend('auto', 'cpu').name != 'torch')"
    out = python_with_env(code, "LOCALLLM_CPU_FAST", value)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(enabled)


@pytest.mark.parametrize("route", ["native", "int4"])
@pytest.mark.parametrize("qtype", [T.Q4_1, T.Q4_K, T.Q8_0], ids=["Q4_1", "Q4_K", "Q8_0"])
def test_fused_linear_equals_the_modules_one_by_one(qtype, route):
    """q/k/v (or gate/up) repacked as one weight: the same columns as each module alone, bitwise
    on the native and int4 kernels (their output rows are independent), and close on the GEMM
    route."""
    if route == "native" and not HAS_NATIVE:
        pytest.skip("the native route needs AVX-512 VNNI or AVX2 (x86)")
    backend = _backend(**(INT4 if route == "int4" else {}))
    sizes = (256, 64, 64)
    layers = [_layer(qtype, rows=n, seed=i, bias=torch.randn(n) if i == 1 else None) for i, n in enumerate(sizes)]
    fast = [CpuLinear(layer, backend.options) for layer in layers]
    backend.fused_linear(fast, torch.randn(1, COLS))
    assert fast[0].state is None  # one fused weight, no separate ones
    assert held_bytes(torch.nn.ModuleList(fast)) > 0
    for m in (3, 128):  # decode-sized batch (int4 kernel) and a prefill chunk (dequant + GEMM)
        x = torch.randn(m, COLS, generator=torch.Generator().manual_seed(m))
        fused = backend.fused_linear(fast, x)
        alone = torch.cat([f(x) for f in fast], dim=-1)
        reference = torch.cat([layer.reference_forward(x) for layer in layers], dim=-1)
        assert fused is not None and fused.shape == (m, sum(sizes)) and fused.dtype == torch.float32
        if route == "native" or m < backend.options.dequant_min_rows:
            assert torch.equal(fused, alone)
        else:
            assert _rel_err(fused, alone) < 1e-3
        assert _rel_err(fused, reference) < BF16_RTOL


def test_fused_linear_declines_mixed_types_and_the_switch_off():
    x = torch.randn(2, COLS)
    backend = _backend()
    assert backend.fused_linear([_fast(_layer(T.Q4_1, rows=64)), _fast(_layer(T.Q8_0, rows=64))], x) is None
    int4 = _backend(**INT4)  # Q3_K has no route without the native kernels
    assert int4.fused_linear([_fast(_layer(T.Q3_K, rows=64), **INT4), _fast(_layer(T.Q3_K, rows=64), **INT4)], x) is None
    off = select_backend("auto", "cpu", replace(OPTIONS, enabled=False))  # switched off: the reference
    assert off.fused_linear([_layer(T.Q4_1, rows=64), _layer(T.Q4_1, rows=64)], x) is None


@pytest.mark.parametrize("qtype", [T.Q5_0, T.Q5_1, T.Q5_K], ids=["Q5_0", "Q5_1", "Q5_K"])
def test_memory_budget_and_the_q5_types(qtype):
    """1.5x the file by default. The native route holds Q5 types in their own 5-bit format
    (1.0-1.03x the file) and takes them; without it, the int4 route would need 1.7-1.8x: they stay
    on the reference unless the budget allows that."""
    assert CpuOptions().max_growth == 1.5
    if HAS_NATIVE:
        layer = _fast(_layer(qtype, rows=32, cols=256), max_growth=1.5)
        assert isinstance(layer.prepared(), NativeWeight) and layer.prepared().exact
        assert layer.prepared().nbytes <= 1.05 * layer.raw.numel()
    assert _fast(_layer(qtype, rows=32, cols=256), max_growth=1.5, **INT4).prepared() is None
    assert _fast(_layer(T.Q8_0, rows=32, cols=256), max_growth=1.5, **INT4).prepared() is not None
    assert _fast(_layer(qtype, rows=32, cols=256), max_growth=2.0, **INT4).prepared() is not None


def test_rows_not_a_multiple_of_16():
    """The native route pads the last tile with zero rows (and drops their outputs); the int4
    route has no such padding: there the reference runs."""
    layer = _layer(T.Q4_0, rows=40, cols=256)
    x = torch.randn(2, 256)
    assert torch.equal(_fast(layer, **INT4)(x), layer.reference_forward(x))
    if HAS_NATIVE:
        fast = _fast(layer, activation_passes=2)
        assert isinstance(fast.prepared(), NativeWeight)
        out = fast(x)
        assert out.shape == (2, 40) and _rel_err(out, layer.reference_forward(x)) <= NATIVE_RTOL
        assert torch.equal(fast(x[1:]), out[1:])


def test_bfloat16_and_batch_dims():
    layer = _layer(T.Q4_K, bias=torch.randn(ROWS))
    fast = _fast(layer)
    x = torch.randn(2, 5, COLS)
    y = fast(x.bfloat16())
    assert y.dtype == torch.bfloat16 and y.shape == (2, 5, ROWS)
    assert _rel_err(y, layer.reference_forward(x)) <= BF16_RTOL
    assert _rel_err(fast(x), layer.reference_forward(x)) <= BF16_RTOL


def test_chunked_repack_equals_one_shot(monkeypatch):
    raw = torch.from_numpy(random_quantized(T.Q8_0, ROWS, COLS, seed=3))
    whole = int4.repack_int4(raw, T.Q8_0, ROWS, COLS)
    native_whole = weights.repack_native(raw, T.Q8_0, ROWS, COLS)
    monkeypatch.setattr(int4, "REPACK_CHUNK_ROWS", 64)
    monkeypatch.setattr(weights, "REPACK_CHUNK_ROWS", 64)
    chunked = int4.repack_int4(raw, T.Q8_0, ROWS, COLS)
    assert torch.equal(whole.packed, chunked.packed)
    assert torch.equal(whole.scale_zero, chunked.scale_zero)
    native_chunked = weights.repack_native(raw, T.Q8_0, ROWS, COLS)
    assert torch.equal(native_whole.packed, native_chunked.packed)
    assert native_whole.nbytes == cpu_native.packed_bytes(ROWS, COLS, 8)


@pytest.mark.parametrize("qtype", [T.Q8_0, T.Q4_K, T.Q6_K, T.Q5_0], ids=["Q8_0", "Q4_K", "Q6_K", "Q5_0"])
def test_fused_weights_repack_in_place_as_if_concatenated(qtype, monkeypatch):
    """Fused weights (q/k/v, gate/up) are repacked from each one's rows in turn, without a copy of
    their concatenation: the same bytes and error bound, whatever the chunking."""
    k = 256
    parts = [torch.from_numpy(random_quantized(qtype, rows, k, seed=rows)) for rows in (48, 32, 40)]
    joined = weights.repack_native(torch.cat(parts), qtype, 120, k)
    monkeypatch.setattr(weights, "REPACK_CHUNK_ROWS", 16)
    in_place = weights.repack_native(parts, qtype, 120, k)
    assert torch.equal(joined.packed, in_place.packed)
    assert joined.max_scale_error == in_place.max_scale_error and joined.nbytes == in_place.nbytes


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="layouts probed on x86 only")
def test_packed_layout_is_known():
    assert int4.packed_layout() in ((64, True), (32, True))


def _logits_case(qtype):
    rows, cols = 1024, 256
    gen = torch.Generator().manual_seed(7)
    emb = QuantEmbedding(random_quantized(qtype, rows, cols, seed=11), qtype, rows, cols)
    return emb, torch.randn(4, cols, generator=gen) * 4


@pytest.mark.parametrize("route, passes", [("int4", 2), ("native", 2), ("native", 1)])
@pytest.mark.parametrize("qtype", [T.Q8_0, T.Q4_K], ids=["Q8_0", "Q4_K"])
def test_lm_head_keeps_the_top_logits_exact(qtype, passes, route):
    if route == "native" and not HAS_NATIVE:
        pytest.skip("the native route needs AVX-512 VNNI or AVX2 (x86)")
    options = {**(INT4 if route == "int4" else {}), "activation_passes": passes}
    emb, x = _logits_case(qtype)
    fast_emb, head = _fast(emb, **options), _fast(emb.as_linear(), **options)
    assert head.is_lm_head
    ref = emb.reference_logits(x)
    for out in (fast_emb.logits(x), head(x)):
        assert _rel_err(out, ref) <= BF16_RTOL
        # an LM head takes the layers' passes (one by default), its top logits refined
        assert torch.equal(out.argmax(1), ref.argmax(1))
        if route == "int4":
            # the logits near each row's maximum were recomputed in float32
            near = ref >= ref.max(dim=1, keepdim=True).values - 0.25
            torch.testing.assert_close(out[near], ref[near], rtol=1e-5, atol=1e-5)
        else:
            # each row's largest logit was recomputed; the rest are within the route's bound
            top = ref.argmax(1, keepdim=True)
            torch.testing.assert_close(out.gather(1, top), ref.gather(1, top), rtol=1e-5, atol=1e-5)
            state = fast_emb.prepared()
            bound = state.error_bound(x, passes)
            assert ((out - ref).abs() <= bound[:, None] + 1e-5).all()
            if passes == 1:  # the head took the layers' one pass: two would have kept it within their bound
                assert ((out - ref).abs() > state.error_bound(x, 2)[:, None]).any()
            # (in one native call, refined_logits: the bits of the matmul, the bound and the refinement apart)
            apart = state.matmul(x, passes)
            refine_top_logits(apart, x, emb.raw, qtype, fast_emb.options, state.error_bound(x, passes), state)
            assert torch.equal(out, apart)


@needs_native
@pytest.mark.parametrize("qtype", [T.F32, T.F16, T.BF16], ids=["F32", "F16", "BF16"])
def test_lm_head_is_held_in_8_bits_with_the_files_top_logits(qtype):
    """An F32/F16/BF16 LM head (GPTQ checkpoints' tied embeddings in any float dtype, float files)
    is held as 8-bit codes, read faster than its own format; each row's largest logit is
    still the file's, the rest within the route's bound. Off with ``head_8bit=False``: the file's
    own format. Quantized heads (Q6_K, Q5_K, Q4_K: most GGUF files) keep their formats (their
    kernels are as fast or faster), exactly."""
    emb, x = _logits_case(qtype)
    head = _fast(emb.as_linear())
    state = head.prepared()
    assert head.is_lm_head and state.bits == 8 and not state.exact
    assert state.nbytes == cpu_native.packed_bytes(emb.num_embeddings, emb.embedding_dim, 8)
    w = emb.reference_logits(torch.eye(emb.embedding_dim)).t()  # the file's weights, [rows, cols]
    assert 0 < state.max_scale_error <= 0.01 * w.norm(dim=1).max()
    ref = emb.reference_logits(x)
    out = head(x)
    assert torch.equal(out.argmax(1), ref.argmax(1))
    top = ref.argmax(1, keepdim=True)
    torch.testing.assert_close(out.gather(1, top), ref.gather(1, top), rtol=1e-5, atol=1e-5)
    assert ((out - ref).abs() <= state.error_bound(x, 2)[:, None] + 1e-5).all()
    assert (out - ref).abs().max() > 1e-5  # the other logits came from the 8-bit codes
    kept = _fast(emb.as_linear(), head_8bit=False).prepared()
    if qtype == T.F32:
        assert isinstance(kept, FloatWeight)  # float32 as it is
    else:
        own = {T.F16: cpu_native.FMT_F16, T.BF16: cpu_native.FMT_BF16}[qtype]
        assert kept.bits == own and kept.exact
    for quantized, layout in ((T.Q6_K, cpu_native.FMT_Q6_K), (T.Q5_K, cpu_native.FMT_Q5_K), (T.Q4_K, cpu_native.FMT_Q4_K)):
        head_case, _ = _logits_case(quantized)
        held = _fast(head_case.as_linear()).prepared()
        assert held.bits == layout and held.exact  # the file's own format


@needs_native
@pytest.mark.parametrize("qtype", [T.F16, T.BF16], ids=["F16", "BF16"])
def test_a_float_heads_top_logits_are_refined_natively_from_its_file_rows(qtype, monkeypatch):
    """An F16/BF16 head held as 8-bit codes (a GPTQ checkpoint's tied float16 embedding) has its
    top logits recomputed in one native call from the file's own rows (not gathered and summed in
    torch): each recomputed logit is the double-precision sum over the file's weights, rounded."""
    from localllm.kernels.cpu import matmul as cpu_matmul

    emb, x = _logits_case(qtype)
    head = _fast(emb.as_linear())
    state = head.prepared()
    assert state.bits == 8 and not state.exact
    calls = []
    kernels = cpu_native.load(head.options)

    class Spy:
        def __getattr__(self, name):
            return getattr(kernels, name)

        def refined_logits(self, x2, w, bits, n, k, passes, row_norm, scale_error, rows, rows_bits, *rest):
            calls.append(rows_bits)
            return kernels.refined_logits(x2, w, bits, n, k, passes, row_norm, scale_error, rows, rows_bits, *rest)

    monkeypatch.setattr(cpu_matmul.native, "module", lambda: Spy())
    out = head(x)
    assert calls == [{T.F16: cpu_native.FMT_F16, T.BF16: cpu_native.FMT_BF16}[qtype]]
    w = emb.reference_logits(torch.eye(emb.embedding_dim)).t().double()  # the file's weights
    exact = (x.double() @ w.t()).float()
    top = exact.argmax(1, keepdim=True)
    assert torch.equal(out.argmax(1, keepdim=True), top)
    assert torch.equal(out.gather(1, top), exact.gather(1, top))


@needs_native
def test_a_bf16_head_of_a_width_without_whole_groups_is_refined_in_torch():
    """A BF16 head 48 wide has no native route (held as it is, float32 matmul): its top logits are
    refined by torch's route, not by the native rows (which need whole 32-groups)."""
    rows, cols = 64, 48
    emb = QuantEmbedding(random_quantized(T.BF16, rows, cols, seed=11), T.BF16, rows, cols)
    head = _fast(emb.as_linear())
    assert isinstance(head.prepared(), FloatWeight)
    x = torch.randn(2, cols, generator=torch.Generator().manual_seed(3))
    out, ref = head(x), emb.reference_logits(x)
    assert torch.equal(out.argmax(1), ref.argmax(1))


_HEAP_SCRIPT = """
import resource, sys, torch
from localllm.platform import memory
if sys.argv[1] == "policy":
    assert memory.fix_heap_policy()
faults = []
for _ in range(10):  # one MLP of a 512-token prefill through a 1B model: gate/up out, silu(gate) * up, down out
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    h = torch.ones(512, 2048)
    gate_up = torch.ones(512, 16384)  # 32 MiB
    act = torch.ones(512, 8192)
    del gate_up
    out = torch.ones(512, 2048)
    del act, h
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    del out
print(sum(faults[2:]))  # once the heap has grown
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the heap policy is glibc's mallopt")
def test_heap_policy_lets_a_prompts_transients_reuse_freed_pages():
    """A prefill's transients, layer after layer: with glibc's own policy the 32 MiB gate/up output
    gets a fresh mapping each time (8192 page faults of 4 KiB and more per layer); with
    ``fix_heap_policy`` (the server and the native CPU backend set it) the freed pages serve the
    next layer: after the heap has grown, 0-24576 faults in eight layers against 61-81 thousand (glibc's
    aligned allocations sometimes walk on to fresh pages still, so the median of three runs is compared;
    on a 6.18 kernel one default run in three counted 61445, about 4 thousand short of eight layers'
    gate/up pages)."""
    import subprocess

    def faults(mode: str) -> int:
        run = subprocess.run([sys.executable, "-c", _HEAP_SCRIPT, mode], capture_output=True, text=True, check=True)
        return int(run.stdout.split()[-1])

    default = faults("default")
    assert default >= 6 * 8192  # fresh pages for the gate/up output, layer after layer
    assert sorted(faults("policy") for _ in range(3))[1] <= default / 2


_ARENA_SCRIPT = """
import ctypes, sys, threading
from localllm.platform import memory

def rss():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024

libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes, libc.memset.argtypes = [ctypes.c_void_p], [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
assert memory.fix_heap_policy()
held = []

def load():  # a model's tensors under the mmap threshold, made on a worker thread: that thread's arena
    for _ in range(6):
        p = libc.malloc(8 << 20)
        libc.memset(p, 1, 8 << 20)
        held.append(p)

def unload():
    for p in reversed(held):
        libc.free(p)

for _ in range(2):
    t = threading.Thread(target=load)
    t.start()
    t.join()
    before = rss()
    if sys.argv[1] == "handed_back":
        with memory.heap_handed_back():
            unload()
    else:
        unload()
        memory.trim_heap()
    held.clear()
    print((before - rss()) >> 20)
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the heap policy is glibc's mallopt")
def test_heap_handed_back_returns_a_worker_threads_arena_that_trimming_keeps():
    """48 MiB allocated on a worker thread and freed: ``malloc_trim`` returns none of it (it trims only
    the main heap's top, and the policy's top pad keeps a thread heap's); inside
    :func:`heap_handed_back` (the pool's unload) all of it goes back, cycle after cycle (the pad is
    restored after the block and zeroed again by the next)."""
    import subprocess

    def returned(mode: str) -> list[int]:
        run = subprocess.run([sys.executable, "-c", _ARENA_SCRIPT, mode], capture_output=True, text=True, check=True)
        return [int(v) for v in run.stdout.split()]

    assert all(mib < 8 for mib in returned("trimmed"))
    assert all(mib >= 46 for mib in returned("handed_back"))


def test_release_file_pages_only_drops_read_only_file_mappings(tmp_path):
    data = random_quantized(T.Q4_1, 256, 1024, seed=2)  # 160 KiB: whole pages inside
    anon = torch.from_numpy(data.copy())
    assert not release_file_pages(anon)
    assert torch.equal(anon, torch.from_numpy(data))

    path = tmp_path / "w.bin"
    data.tofile(path)
    writable = np.memmap(path, dtype=np.uint8, mode="r+", shape=data.shape)
    assert not release_file_pages(torch.from_numpy(writable))
    del writable

    mapped = np.memmap(path, dtype=np.uint8, mode="r", shape=data.shape)
    layer = QuantLinear(mapped, T.Q4_1, 1024, 256)
    x = torch.randn(2, 1024)
    before = layer.reference_forward(x)
    out = _fast(layer)(x)  # repacks, then drops the file pages from the resident set
    if sys.platform.startswith("linux"):
        assert release_file_pages(layer.raw)
    assert torch.equal(layer.reference_forward(x), before)  # pages fault back in from the file
    assert torch.equal(layer.raw, torch.from_numpy(data))
    assert _rel_err(out, before) <= BF16_RTOL


def _mapping_fields(address: int) -> dict[str, str]:
    """The /proc/self/smaps fields of the mapping that holds ``address``."""
    fields, inside = {}, False
    with open("/proc/self/smaps") as f:
        lines = f.readlines()
    for line in lines:
        head = line.split()[0]
        if "-" in head and ":" not in head:
            lo, hi = (int(v, 16) for v in head.split("-"))
            inside = lo <= address < hi
        elif inside:
            name, _, value = line.partition(":")
            fields[name] = value.strip()
    return fields


def test_huge_page_buffer_is_aligned_zeroed_and_advised_only_where_whole_huge_pages_fit():
    """The repacked weights' memory (``CpuOptions.huge_pages``): writable memory of the size asked
    for; on Linux on a 2 MiB boundary, zeroed, its whole 2 MiB pages advised for transparent huge
    pages and the rest not (so the resident set grows by the bytes asked for, never by a huge page's
    worth at the end). Elsewhere it is ``torch.empty``'s memory."""
    nbytes = 3 * HUGE_PAGE_BYTES + 12345
    buf = huge_page_buffer(nbytes)
    assert buf.dtype == torch.uint8 and buf.numel() == nbytes
    if sys.platform.startswith("linux"):
        assert buf.data_ptr() % HUGE_PAGE_BYTES == 0 and int(buf.count_nonzero()) == 0
    buf.fill_(7)
    assert int(buf[0]) == 7 and int(buf[-1]) == 7
    if sys.platform.startswith("linux"):
        advised = _mapping_fields(buf.data_ptr())
        tail = _mapping_fields(buf.data_ptr() + 3 * HUGE_PAGE_BYTES)
        assert "hg" in advised["VmFlags"].split() and "hg" not in tail["VmFlags"].split()
        assert int(advised["Size"].split()[0]) * 1024 == 3 * HUGE_PAGE_BYTES


# --- the real model ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llm(smollm2_path):
    from localllm import LLM

    return LLM(model=smollm2_path, device="cpu", dtype="float32", kv_cache_memory="64MiB")


@pytest.fixture
def one_thread():
    """One torch thread: the check is numeric, and on a busy machine every parallel region of a
    2-thread run waits for a descheduled thread (measured: 4 s alone, 150 s at load average 5)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _all_logits(model, seqs: list[list[int]], kv_dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    """Float32 logits ``[len(seq), vocab]`` of each of ``seqs``, from one prefill of them all
    into a private KV cache of ``kv_dtype``."""
    bs, c = 16, model.config
    lens = [len(s) for s in seqs]
    blocks = [-(-n // bs) for n in lens]
    kv = [torch.zeros(2, sum(blocks), bs, c.num_kv_heads, c.head_dim, dtype=kv_dtype) for _ in range(c.num_layers)]
    tables = torch.zeros(len(seqs), max(blocks), dtype=torch.long)
    slots, first = [], 0
    for i, (n, b) in enumerate(zip(lens, blocks)):
        tables[i, :b] = torch.arange(first, first + b)
        slots.append(torch.arange(first * bs, first * bs + n))
        first += b
    meta = AttentionMetadata(
        slot_mapping=torch.cat(slots),
        block_tables=tables,
        context_lens=torch.tensor(lens),
        query_start_loc=np.cumsum([0] + lens).tolist(),
        context_lens_host=lens,
        num_decodes=0,
        block_size=bs,
    )
    ids = torch.tensor([t for s in seqs for t in s])
    positions = torch.cat([torch.arange(n) for n in lens])
    return list(model.compute_logits(model(ids, positions, meta, kv)).split(lens))


@pytest.fixture
def model_on(llm):
    """``model_on(backend)``: the shared engine's model on ``backend`` for one test (then back on
    the engine's own backend)."""
    model = llm.engine.model
    yield lambda backend: backend.install(model)
    llm.engine.backend.install(model)


@pytest.mark.parametrize("mode", list(GREEDY_BOUNDS))
def test_greedy_on_the_real_model_parts_from_the_reference_only_at_near_ties(llm, model_on, one_thread, mode):
    from localllm import SamplingParams

    if mode != "int4" and not HAS_NATIVE:
        pytest.skip("the native route needs AVX-512 VNNI or AVX2 (x86)")
    # repacked afresh for the mode's route (the int4 kernel) and activation passes
    options = replace(llm.engine.backend.options, **(INT4 if mode == "int4" else {}),
                      activation_passes={"int8x2": 2, "int8": 1}.get(mode))
    model_on(CpuBackend(options))
    near_tie, logit_atol, error_bounds_regret = GREEDY_BOUNDS[mode]

    outs = llm.chat(CONVERSATIONS, SamplingParams(max_tokens=NUM_GREEDY_TOKENS, temperature=0.0))
    model = llm.engine.model
    seqs = [out.prompt_token_ids + out.token_ids for out in outs]
    kv_dtype = llm.engine.runner.kv_types.dtype
    assert kv_dtype == (torch.float16 if llm.engine.kernels == "cpu-native" else torch.float32)
    fast_all = _all_logits(model, seqs, kv_dtype)
    model_on(REFERENCE)
    ref_all = _all_logits(model, seqs)
    report = []
    for i, (out, fast, ref) in enumerate(zip(outs, fast_all, ref_all)):
        steps = slice(len(out.prompt_token_ids) - 1, len(seqs[i]) - 1)  # positions that chose a token
        fast, ref = fast[steps], ref[steps]
        chosen = torch.tensor(out.token_ids)
        regret = ref.max(dim=1).values - ref.gather(1, chosen[:, None]).squeeze(1)
        step_err = (fast - ref).abs().max(dim=1).values
        parted = [(k, round(regret[k].item(), 4), round(step_err[k].item(), 3))
                  for k in regret.nonzero().flatten().tolist()]
        max_diff = step_err.max().item()
        report.append(f"prompt {i}: {len(parted)} of {len(chosen)} steps off the reference argmax "
                      f"(step, regret, step's logit error) {parted}, max |logit diff| {max_diff:.3f}")
        assert all(r < near_tie or (error_bounds_regret and r <= 2 * e) for _, r, e in parted), report[-1]
        assert max_diff < logit_atol, report[-1]
    print("\n".join(report))


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
def test_output_heads_are_marked_as_lm_heads(tie, tmp_path):
    """Tied or not, the output head gets the exact top logits of an LM head."""
    from tiny_models import write_tiny_model

    from localllm.models.assembler import load_model

    path = write_tiny_model(tmp_path / "m.gguf", qtype=T.Q8_0, tie_embeddings=tie)
    model, _ = load_model(path)
    assert model.lm_head.is_lm_head
    assert not any(getattr(m, "is_lm_head", False) for m in model.layers.modules())
