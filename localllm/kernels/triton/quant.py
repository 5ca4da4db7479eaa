"""Dequant-fused matmuls over GGUF blocks in their file layout (Triton).

``quant_matmul(x, raw, qtype)`` computes ``x @ W.T`` where ``W = dequantize(raw, qtype)``
(:mod:`localllm.quant.gguf_dequant` is the reference), reading ``raw`` (uint8
``[N, bytes_per_row]``, the bytes exactly as the GGUF file has them) inside the kernel: no
repack, no dequantized copy, so a memory-mapped file can be used as it is.

Every block type is decoded by one helper, :func:`~localllm.kernels.triton.blocks.block_parts`, on a 3-D tile
``[BLOCK_N rows, G sub-blocks, SUB elements]`` where a sub-block is the unit that shares one
scale (32 elements for Q4_0..Q8_0/Q4_K/Q5_K, 16 for Q2_K/Q3_K/Q6_K). Scales and mins are
decoded once per sub-block (``[BN, G, 1]``), quants once per element; the weight is
``w = scale * q (+ offset)`` in the reference decoders' float32 operation order, so a
dequantized tile is bit-exact against them (up to FMA contraction on a GPU).

Two kernels use it:

* ``_qgemv_kernel`` for few rows (decode, ``M <= 16``): one program per ``BLOCK_N`` output
  columns and K-split. With ``M == 1`` it multiplies in registers with the scale factored out of
  the inner sum (``sum(w*x) = scale*sum(q*x) + offset*sum(x)`` per sub-block); with
  ``2 <= M <= 16`` it pads M to 16 and uses ``tl.dot``. Split-K (partials in float32, summed
  in a fixed order: deterministic) fills the GPU when N alone gives too few programs.
* ``_qgemm_kernel`` for prefill: a tiled GEMM with grouped program order (L2 reuse of the
  dequantized W tiles across M tiles).

On a GPU both are autotuned over a handful of configs keyed on the shape and an M bucket
(``TritonOptions.autotune``, ``LOCALLLM_TRITON_AUTOTUNE=0``: one fixed config, see
:func:`configure`); under ``TRITON_INTERPRET=1`` (CPU tests) each has one config and no
benchmarking. Batch-invariant matmuls (``quant_matmul(..., invariant=True)``, the Triton
backend's default) take neither: ``_qgemm_kernel`` in one config for every number of rows, so a
row's result never depends on the others. F16 and BF16 weights are "blocks" of 32 values with
scale 1 there, so float linears take the same kernel.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from localllm.config.settings import env_or_default
from localllm.kernels.triton.blocks import WORD_ALIGNED_TYPES, block_parts, dequant_tile, grid_arg, mma
from localllm.kernels.triton.spec import GpuSpec, gpu_spec, interpreter_enabled
from localllm.quant.gguf_dequant import as_bytes
from localllm.quant.traits import TRAITS, types_where

T = GGMLQuantizationType

_AUTOTUNE: bool | None = None  # None: not configured yet (TritonOptions.from_env() at the first launch)
_TUNED: tuple | None = None  # the autotuned (gemv, gemm) kernels for _AUTOTUNE

# Sub-block size (elements sharing one scale) per block type, and the types whose weight is
# ``scale * q + offset`` (an affine "min"; the others are ``scale * q``): the one type table's.
SUB_SIZE: dict[GGMLQuantizationType, int] = {t: tr.sub_size for t, tr in TRAITS.items() if tr.triton}
_HAS_OFFSET = types_where(affine=True)

SUPPORTED_QTYPES: frozenset[GGMLQuantizationType] = frozenset(SUB_SIZE)
TABLE_QTYPES = frozenset({T.IQ2_XXS, T.IQ2_XS, T.IQ2_S, T.IQ3_XXS, T.IQ3_S, T.IQ1_S, T.IQ1_M, T.TQ1_0, T.TQ2_0})
"""The types whose weights come from a grid table or base-3 digits: more values live a weight as they
decode, so the autotuned GEMM takes tiles of at most :data:`TABLE_GEMM_TILE` outputs for them (the
larger ones spilled registers on sm_80 and sm_86: kernels/triton/compile.py's check)."""
TABLE_GEMM_TILE = 64 * 64

# K ranges of split-K programs are multiples of this (every block size divides it).
_K_ALIGN = 256
GEMV_MAX_M = 16

# ---------------------------------------------------------------------------------------------
# Kernels


# M, the number of rows, is never specialized on (divisible by 16 or not): one compiled kernel
# for every batch, the same instructions for a row whatever the rows beside it
@triton.jit(do_not_specialize=["M"])
def _qgemv_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    bias_ptr,
    grid_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_om,
    stride_os,
    k_per_split,
    QTYPE: tl.constexpr,
    SUB: tl.constexpr,
    HAS_OFFSET: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SPLIT_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    DOT_PREC: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """``out[s] (+)= x @ W[:, K-range s].T`` for ``M <= BLOCK_M`` rows (``BLOCK_M`` 1 or 16)."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    G: tl.constexpr = BLOCK_K // SUB
    num_sub = K // SUB
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < N
    row = w_ptr + tl.minimum(n, N - 1).to(tl.int64)[:, None, None] * stride_wn
    k_lo = pid_k * k_per_split
    k_hi = tl.minimum(K, k_lo + k_per_split)
    if BLOCK_M == 1:
        acc = tl.zeros((BLOCK_N, G, 1), dtype=tl.float32)
        j = tl.arange(0, SUB)[None, None, :]
        for k0 in range(k_lo, k_hi, BLOCK_K):
            sub_idx = k0 // SUB + tl.arange(0, G)[None, :, None]
            kk = sub_idx * SUB + j
            x = tl.load(x_ptr + kk, mask=kk < k_hi, other=0.0).to(tl.float32)
            q, sc, off = block_parts(row, tl.minimum(sub_idx, num_sub - 1), j, QTYPE, grid_ptr)
            # sum_j (sc*q_j + off) x_j = sc * sum_j q_j x_j + off * sum_j x_j
            acc += sc * tl.sum(q * x, axis=2, keep_dims=True)
            if HAS_OFFSET:
                acc += off * tl.sum(x, axis=2, keep_dims=True)
        res = tl.sum(tl.sum(acc, axis=2), axis=1)
        out_ptrs = out_ptr + pid_k * stride_os + n
        if SPLIT_K == 1:
            if HAS_BIAS:
                res += tl.load(bias_ptr + n, mask=n_mask, other=0.0).to(tl.float32)
            tl.store(out_ptrs, res.to(out_ptr.dtype.element_ty), mask=n_mask)
        else:
            tl.store(out_ptrs, res, mask=n_mask)
    else:
        m = tl.arange(0, BLOCK_M)
        kk = tl.arange(0, BLOCK_K)
        acc2 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            w = dequant_tile(row, k0, num_sub, QTYPE, SUB, HAS_OFFSET, BLOCK_N, BLOCK_K, grid_ptr)
            xk = k0 + kk
            x = tl.load(
                x_ptr + m[:, None] * stride_xm + xk[None, :],
                mask=(m[:, None] < M) & (xk[None, :] < k_hi),
                other=0.0,
            )
            acc2 += mma(x, tl.trans(w.to(x.dtype)), DOT_PREC)
        out_ptrs = out_ptr + pid_k * stride_os + m[:, None] * stride_om + n[None, :]
        mask = (m[:, None] < M) & n_mask[None, :]
        if SPLIT_K == 1:
            if HAS_BIAS:
                acc2 += tl.load(bias_ptr + n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
            tl.store(out_ptrs, acc2.to(out_ptr.dtype.element_ty), mask=mask)
        else:
            tl.store(out_ptrs, acc2, mask=mask)


@triton.jit(do_not_specialize=["M", "M_BUCKET"])
def _qgemm_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    bias_ptr,
    grid_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_om,
    stride_os,
    k_per_split,
    M_BUCKET,
    QTYPE: tl.constexpr,
    SUB: tl.constexpr,
    HAS_OFFSET: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    DOT_PREC: tl.constexpr,
    SPLIT_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    """``out = x @ W.T (+ bias)``, tiled; programs walk ``GROUP_M`` M-tiles per N-tile column.
    ``SPLIT_K > 1``: program ``(pid, s)`` writes the float32 partial product of K range ``s``
    (``k_per_split`` wide) to ``out[s]``, without bias (:func:`_sum_splits_kernel` adds them)."""
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    group_rows = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_rows
    pid_n = (pid % per_group) // group_rows

    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    kk = tl.arange(0, BLOCK_K)
    num_sub = K // SUB
    row = w_ptr + tl.minimum(n, N - 1).to(tl.int64)[:, None, None] * stride_wn
    x_rows = x_ptr + m.to(tl.int64)[:, None] * stride_xm
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_lo = pid_k * k_per_split
    k_hi = tl.minimum(K, k_lo + k_per_split)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        w = dequant_tile(row, k0, num_sub, QTYPE, SUB, HAS_OFFSET, BLOCK_N, BLOCK_K, grid_ptr)
        xk = k0 + kk
        x = tl.load(x_rows + xk[None, :], mask=(m[:, None] < M) & (xk[None, :] < k_hi), other=0.0)
        acc += mma(x, tl.trans(w.to(x.dtype)), DOT_PREC)
    n_mask = n < N
    out_ptrs = out_ptr + pid_k * stride_os + m.to(tl.int64)[:, None] * stride_om + n[None, :]
    if SPLIT_K == 1:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=(m[:, None] < M) & n_mask[None, :])
    else:
        tl.store(out_ptrs, acc, mask=(m[:, None] < M) & n_mask[None, :])


@triton.jit(do_not_specialize=["M"])
def _sum_splits_kernel(
    part_ptr,
    bias_ptr,
    out_ptr,
    M,
    N,
    stride_ps,
    stride_pm,
    stride_om,
    SPLIT_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """``out[m] = sum_s part[s, m] (+ bias)``, the splits added in order 0, 1, ... (the same
    order for every row, whatever the batch)."""
    m = tl.program_id(0).to(tl.int64)
    n = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = n < N
    acc = tl.load(part_ptr + m * stride_pm + n, mask=ok, other=0.0)
    for s in tl.static_range(1, SPLIT_K):
        acc += tl.load(part_ptr + s * stride_ps + m * stride_pm + n, mask=ok, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + n, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + m * stride_om + n, acc.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _dequant_rows_kernel(
    w_ptr,
    grid_ptr,
    ids_ptr,
    out_ptr,
    K,
    stride_wn,
    stride_or,
    QTYPE: tl.constexpr,
    SUB: tl.constexpr,
    HAS_OFFSET: tl.constexpr,
    HAS_IDS: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """Dequantize one row (``ids[r]`` or ``r``) of ``W`` per program along axis 0."""
    r = tl.program_id(0)
    k0 = tl.program_id(1) * BLOCK_K
    if HAS_IDS:
        src = tl.load(ids_ptr + r).to(tl.int64)
    else:
        src = r.to(tl.int64)
    row = w_ptr + src * stride_wn + tl.zeros((1, 1, 1), dtype=tl.int64)
    w = dequant_tile(row, k0, K // SUB, QTYPE, SUB, HAS_OFFSET, 1, BLOCK_K, grid_ptr)
    k = k0 + tl.arange(0, BLOCK_K)
    tl.store(
        out_ptr + r.to(tl.int64) * stride_or + k[None, :], w.to(out_ptr.dtype.element_ty), mask=k[None, :] < K
    )


# ---------------------------------------------------------------------------------------------
# Launch configuration


def _gemv_configs(autotune: bool) -> list[triton.Config]:
    if interpreter_enabled():  # few, large programs: the interpreter's cost is per program and per op
        return [triton.Config({"BLOCK_N": 64, "BLOCK_K": 256}, num_warps=4)]
    if not autotune:
        return [triton.Config({"BLOCK_N": 32, "BLOCK_K": 128}, num_warps=4, num_stages=3)]
    return [
        triton.Config({"BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w, num_stages=s)
        for bn, bk, w, s in (
            (16, 256, 4, 3),
            (32, 128, 4, 3),
            (64, 128, 8, 3),
            (64, 64, 4, 4),
            (128, 64, 8, 3),
        )
    ]


def _gemm_configs(autotune: bool) -> list[triton.Config]:
    if interpreter_enabled():
        return [triton.Config({"BLOCK_M": 32, "BLOCK_N": 64, "BLOCK_K": 256, "GROUP_M": 8}, num_warps=4)]
    if not autotune:
        return [
            triton.Config(
                {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 64, "GROUP_M": 8}, num_warps=4, num_stages=3
            )
        ]
    return [
        triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8}, num_warps=w, num_stages=s)
        for bm, bn, bk, w, s in (
            (32, 64, 64, 4, 4),
            (64, 64, 64, 4, 3),
            (64, 128, 64, 8, 3),
            (128, 64, 64, 8, 3),
            (128, 128, 64, 8, 3),
            (128, 128, 32, 8, 4),
        )
    ]


# Batch-invariant split-K: enough programs for about two waves of the largest GPUs' SMs (132 on
# an H100) at decode, from the shape alone, so that a row's reduction order never depends on the
# batch (or on the card).
INVARIANT_TARGET_PROGRAMS = 256
INVARIANT_MIN_SPLIT_K = 1024  # elements of K each split reduces, at least
INVARIANT_MAX_SPLIT = 8


def invariant_split_k(n: int, k: int, block_n: int) -> int:
    """K-splits of the batch-invariant GEMM for an ``[n, k]`` weight: a function of the shape
    only (one row tile's ``n / block_n`` programs are too few to fill a big GPU at decode)."""
    tiles = triton.cdiv(n, block_n)
    split = 1
    while (tiles * split < INVARIANT_TARGET_PROGRAMS and split < INVARIANT_MAX_SPLIT
           and k // (2 * split) >= INVARIANT_MIN_SPLIT_K and k % (2 * split * _K_ALIGN) == 0):
        split *= 2
    return split


def _invariant_gemm_config(dtype: torch.dtype = torch.bfloat16) -> dict:
    """The one GEMM config of batch-invariant matmuls for ``dtype`` activations, for every number
    of rows (a row's tile shape, and so its reduction order, never depends on the batch). Float32
    dots run on the FMA units: half the K step there (64 spills ~170 B per thread)."""
    if interpreter_enabled():
        return {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 256, "GROUP_M": 8, "num_warps": 4}
    block_k = 32 if dtype == torch.float32 else 64
    return {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": block_k, "GROUP_M": 8, "num_warps": 4, "num_stages": 3}


def configure(*, autotune: bool) -> None:
    """Autotune the matmuls over several configs (``True``) or launch one fixed config per kernel
    (kernel tests: compile once). Called by the Triton backend with its options; until then the
    first launch reads them from the environment (``LOCALLLM_TRITON_AUTOTUNE``)."""
    global _AUTOTUNE, _TUNED
    if autotune != _AUTOTUNE:
        _AUTOTUNE, _TUNED = autotune, None


def _prune_gemm(configs: list[triton.Config], named_args: dict, **kwargs) -> list[triton.Config]:
    """The GEMM configs for a launch: all of them, but for the table types the tiles of at most
    :data:`TABLE_GEMM_TILE` outputs."""
    if kwargs.get("QTYPE") in _TABLE_IDS:
        return [c for c in configs if c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"] <= TABLE_GEMM_TILE] or configs
    return configs


_TABLE_IDS = frozenset(int(t) for t in TABLE_QTYPES)


def _tuned():
    """The ``(gemv, gemm)`` kernels wrapped in their autotuners for the configured setting."""
    global _TUNED
    if _TUNED is None:
        if _AUTOTUNE is None:
            configure(autotune=env_or_default("triton_autotune"))
        _TUNED = (
            triton.autotune(configs=_gemv_configs(_AUTOTUNE), key=["N", "K", "BLOCK_M", "SPLIT_K"])(_qgemv_kernel),
            triton.autotune(configs=_gemm_configs(_AUTOTUNE), key=["M_BUCKET", "N", "K"],
                            prune_configs_by={"early_config_prune": _prune_gemm})(_qgemm_kernel),
        )
    return _TUNED


def m_bucket(m: int) -> int:
    """The autotuning bucket of ``m`` rows: the next power of two, at most 4096."""
    return min(4096, triton.next_power_of_2(max(m, 1)))


def choose_split_k(n: int, k: int, device: torch.device) -> int:
    """K-splits for a GEMV: enough programs for about two waves over the SMs (1 on CPU)."""
    spec = gpu_spec(device)
    if spec is None:
        return 1
    programs = triton.cdiv(n, 32)
    target = 2 * spec.num_sms
    split = 1
    while programs * split < target and (split * 2) * _K_ALIGN <= k and split < 16:
        split *= 2
    return split


def dot_precision(dtype: torch.dtype, spec: GpuSpec | None = None) -> str:
    """``DOT_PREC`` for activations of ``dtype`` on ``spec`` (``None``: the interpreter): float32
    multiplies exactly ("ieee", no TF32: the float32 path is the accuracy reference); 16-bit
    inputs ignore it on CUDA ("tf32"), while ROCm accepts "tf32" on gfx942 only, so it gets
    "ieee" throughout; bfloat16 under the interpreter is upcast."""
    if dtype == torch.float32 or (spec is not None and spec.is_hip):
        return "ieee"
    if spec is None and interpreter_enabled() and dtype == torch.bfloat16:
        return "upcast"
    return "tf32"


def _check(raw: torch.Tensor, qtype: GGMLQuantizationType, k: int) -> tuple[torch.Tensor, GGMLQuantizationType]:
    """``(raw as uint8 bytes, qtype)``: F16/BF16 weights may come typed (``[N, K]``)."""
    qtype = GGMLQuantizationType(qtype)
    if qtype not in SUPPORTED_QTYPES:
        raise ValueError(f"no Triton kernel for GGUF type {qtype.name}")
    if qtype in (T.F16, T.BF16) and raw.dtype != torch.uint8:
        raw = as_bytes(raw, qtype)
    block, type_size = GGML_QUANT_SIZES[qtype]
    if raw.dtype != torch.uint8 or raw.dim() != 2 or raw.shape[1] != k // block * type_size or k % block:
        raise ValueError(
            f"{qtype.name} weight must be uint8 [N, {k // block * type_size}] for K={k}, "
            f"got {raw.dtype} {tuple(raw.shape)}"
        )
    if raw.stride(1) != 1:
        raise ValueError("weight rows must be contiguous")
    if qtype in WORD_ALIGNED_TYPES and (raw.data_ptr() % 4 or (raw.shape[0] > 1 and raw.stride(0) % 4)):
        raise ValueError(f"{qtype.name} weight bytes must start, and their rows step, 4-byte aligned "
                         "(the kernels read words)")
    return raw, qtype


def _weight_arg(raw: torch.Tensor, qtype: GGMLQuantizationType) -> torch.Tensor:
    """What the kernels read: the bytes, or for F16/BF16 the same memory typed, so that a row's
    values load as vectors rather than byte by byte."""
    if qtype == T.F16:
        return raw.view(torch.float16)
    if qtype == T.BF16:
        return raw.view(torch.bfloat16)
    return raw


def quant_matmul(
    x: torch.Tensor,
    raw: torch.Tensor,
    qtype: GGMLQuantizationType | int,
    bias: torch.Tensor | None = None,
    *,
    split_k: int | None = None,
    force: str | None = None,
    invariant: bool = False,
) -> torch.Tensor:
    """``x @ W.T (+ bias)`` in ``x``'s dtype for ``W = dequantize(raw, qtype)``, ``raw`` uint8
    ``[N, bytes_per_row]`` in GGUF layout. ``split_k`` overrides the split heuristic (GEMV only);
    ``force`` is ``"gemv"`` or ``"gemm"`` (tests), else ``M <= 16`` runs the GEMV kernel.
    ``invariant``: batch-invariant, each row's result independent of the others and of their
    number (the GEMM kernel in one fixed config for every ``M``, no split-K, no autotuning)."""
    k = x.shape[-1]
    raw, qtype = _check(raw, qtype, k)
    n = raw.shape[0]
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out.reshape(*x.shape[:-1], n)
    w = _weight_arg(raw, qtype)
    sub = SUB_SIZE[qtype]
    has_off = qtype in _HAS_OFFSET
    has_bias = bias is not None
    bias_arg = bias if has_bias else out
    prec = dot_precision(x.dtype, gpu_spec(x.device))
    kind = force or ("invariant" if invariant else "gemv" if m <= GEMV_MAX_M else "gemm")
    if kind != "invariant" and m > 1 and x.dtype == torch.float32 and not force:
        # float32 dots run on the FMA units: the invariant route's small tile (the autotuned
        # ones spill thousands of bytes per thread there, see kernels/triton/compile.py)
        kind = "invariant"
    if kind == "gemv":
        if m > GEMV_MAX_M:
            raise ValueError(f"the GEMV kernel takes at most {GEMV_MAX_M} rows, got {m}")
        kernel, bucket_arg, cfg = _tuned()[0], (), {"BLOCK_M": 1 if m == 1 else 16}
        split = split_k or choose_split_k(n, k, x.device)
    elif kind == "invariant":  # the GEMM kernel in its one config
        kernel, bucket_arg, cfg = _qgemm_kernel, (0,), _invariant_gemm_config(x.dtype)
        split = invariant_split_k(n, k, cfg["BLOCK_N"])
    else:  # "gemm": autotuned per row bucket
        kernel, bucket_arg, cfg = _tuned()[1], (m_bucket(m),), {}
        split = 1
    k_per_split = triton.cdiv(triton.cdiv(k, split), _K_ALIGN) * _K_ALIGN
    if kind == "gemv":
        split = triton.cdiv(k, k_per_split)  # the aligned K ranges may need fewer splits than asked
        grid = lambda meta: (triton.cdiv(n, meta["BLOCK_N"]), split)
    else:
        grid = lambda meta: (triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(n, meta["BLOCK_N"]), split)
    target = out if split == 1 else torch.empty((split, m, n), dtype=torch.float32, device=x.device)
    kernel[grid](
        x2,
        w,
        target,
        bias_arg,
        grid_arg(qtype, x.device),
        m,
        n,
        k,
        x2.stride(0),
        w.stride(0),
        target.stride(-2),
        target.stride(0) if split > 1 else 0,
        k_per_split,
        *bucket_arg,
        QTYPE=int(qtype),
        SUB=sub,
        HAS_OFFSET=has_off,
        HAS_BIAS=has_bias,
        SPLIT_K=split,
        DOT_PREC=prec,
        **cfg,
    )
    if split > 1 and kind == "gemv":
        acc = target.sum(0)
        if has_bias:
            acc += bias.float()
        out.copy_(acc)
    elif split > 1:
        block = min(1024, triton.next_power_of_2(n))
        _sum_splits_kernel[(m, triton.cdiv(n, block))](
            target, bias_arg, out, m, n, target.stride(0), target.stride(1), out.stride(0),
            SPLIT_K=split, HAS_BIAS=has_bias, BLOCK=block,
        )
    return out.reshape(*x.shape[:-1], n)


def dequantize_rows(
    raw: torch.Tensor,
    qtype: GGMLQuantizationType | int,
    k: int,
    ids: torch.Tensor | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Rows ``ids`` (or all rows) of ``W = dequantize(raw, qtype)`` as ``[R, k]`` in ``dtype``
    (the embedding lookup; in float32 bit-exact against the reference decoders)."""
    raw, qtype = _check(raw, qtype, k)
    flat_ids = None if ids is None else ids.reshape(-1)
    rows = raw.shape[0] if flat_ids is None else flat_ids.numel()
    out = torch.empty((rows, k), dtype=dtype, device=raw.device)
    if rows == 0:
        return out
    block_k = 256 if k % 256 == 0 else 32
    w = _weight_arg(raw, qtype)
    _dequant_rows_kernel[(rows, triton.cdiv(k, block_k))](
        w,
        grid_arg(qtype, raw.device),
        flat_ids if flat_ids is not None else out,
        out,
        k,
        w.stride(0),
        out.stride(0),
        QTYPE=int(qtype),
        SUB=SUB_SIZE[qtype],
        HAS_OFFSET=qtype in _HAS_OFFSET,
        HAS_IDS=flat_ids is not None,
        BLOCK_K=block_k,
    )
    return out
