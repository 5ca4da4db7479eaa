"""A mixture of experts' experts in a few launches (Triton): every expert's gated MLP for the tokens
routed to it, reading each chosen expert's weights once per step for all its rows.

``moe_experts(x, weights, chosen, plan)`` runs them:

1. the step's ``(token, rank)`` slots sorted by expert on the device (torch's stable sort and a
   histogram: no host sync), each expert's slots padded to whole ``BLOCK_M`` row blocks; every row
   block belongs to one expert (``block_expert``; ``-1``: a block past the step's, whose programs
   return at once: the grid is sized from the step's shape alone);
2. ``_moe_gemm_kernel`` with ``GATED``: per (row block, column tile) the gate and up projections
   of the block's expert, dequantized in the kernel from the file's blocks
   (:func:`~localllm.kernels.triton.blocks.dequant_tile`), their biases, and the activation
   (:func:`~localllm.kernels.triton.ops.gated_activation`: SiLU, or gpt-oss's clamped SwiGLU), one
   row per slot;
3. the same kernel without ``GATED``: the down projection of those rows;
4. ``_moe_combine_kernel``: each token's expert outputs times its weights, added in its rank
   order.

The weights are one tensor per projection ``[num_experts, N, bytes_per_row]`` (a GGUF file's 3-D
expert tensor; :func:`stacked_rows` reads it from the experts' row views): one base pointer and
an expert stride.

Batch invariance: a row's result depends on its own values only. Every tile has the shape of the
batch-invariant GEMM (:func:`~localllm.kernels.triton.quant._invariant_gemm_config`) whatever the
number of rows, and a K split fixed by the weight's shape
(:func:`~localllm.kernels.triton.quant.invariant_split_k`) runs inside each program, its partial
sums added in split order, as the batch-invariant matmul's split kernel adds them; the activation
and the combine round where the expert-by-expert route (``quant_matmul`` per linear, then
``silu_and_mul``, then torch's weighted sum) rounds. So a token's bits are those of that route.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from gguf import GGMLQuantizationType

from localllm.kernels.triton.blocks import WORD_ALIGNED_TYPES, dequant_tile, grid_arg, mma
from localllm.kernels.triton.ops import gated_activation
from localllm.kernels.triton.quant import (
    _HAS_OFFSET,
    _K_ALIGN,
    SUB_SIZE,
    SUPPORTED_QTYPES,
    _check,
    _invariant_gemm_config,
    _weight_arg,
    dot_precision,
    invariant_split_k,
)
from localllm.kernels.triton.spec import gpu_spec

T = GGMLQuantizationType

ACTIVATIONS = ("silu", "gelu_tanh", "swiglu_oai")


@dataclass(frozen=True, slots=True)
class ExpertWeights:
    """One projection of every expert: ``raw`` ``[num_experts, N, bytes_per_row]`` uint8 in the
    file's layout (F16/BF16: those bytes or the values typed ``[num_experts, N, K]``), ``bias``
    float32 ``[num_experts, N]`` or None."""

    raw: torch.Tensor
    qtype: GGMLQuantizationType
    in_features: int
    out_features: int
    bias: torch.Tensor | None = None


@dataclass(frozen=True, slots=True)
class ExpertPlan:
    """A mixture's experts as the grouped kernels read them."""

    gate: ExpertWeights
    up: ExpertWeights
    down: ExpertWeights
    activation: str = "silu"
    alpha: float = 0.0  # swiglu_oai's
    limit: float = 0.0


def stacked_rows(raws: list[torch.Tensor]) -> torch.Tensor | None:
    """The one ``[len(raws), N, row]`` tensor whose slices ``raws`` (each ``[N, row]``, rows
    contiguous) are, where they are equally strided views of one storage; else None."""
    first = raws[0]
    if first.dim() != 2 or first.stride(-1) != 1:
        return None
    storage = first.untyped_storage().data_ptr()
    step = raws[1].storage_offset() - first.storage_offset() if len(raws) > 1 else first.numel()
    if step <= 0 and len(raws) > 1:
        return None
    for e, raw in enumerate(raws):
        if (raw.shape != first.shape or raw.stride() != first.stride() or raw.dtype != first.dtype
                or raw.device != first.device or raw.untyped_storage().data_ptr() != storage
                or raw.storage_offset() != first.storage_offset() + e * step):
            return None
    return first.as_strided((len(raws), *first.shape), (step, *first.stride()), first.storage_offset())


def supports(qtype: GGMLQuantizationType) -> bool:
    """Whether the grouped kernels decode ``qtype`` (else its experts run one by one)."""
    return qtype in SUPPORTED_QTYPES


# ---------------------------------------------------------------------------------------------
# Kernels


@triton.jit
def _expert_dot(a_rows, a_ok, w_row, grid, K, k_lo, k_hi, QTYPE: tl.constexpr, SUB: tl.constexpr,
                HAS_OFFSET: tl.constexpr, DOT_PREC: tl.constexpr, BLOCK_M: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """``A[rows, k_lo:k_hi] @ W[:, k_lo:k_hi].T`` in float32, ``BLOCK_K`` at a time (the
    batch-invariant GEMM's loop: the same masks, the same order)."""
    kk = tl.arange(0, BLOCK_K)
    num_sub = K // SUB
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        w = dequant_tile(w_row, k0, num_sub, QTYPE, SUB, HAS_OFFSET, BLOCK_N, BLOCK_K, grid)
        xk = k0 + kk
        a = tl.load(a_rows + xk[None, :], mask=a_ok[:, None] & (xk[None, :] < k_hi), other=0.0)
        acc += mma(a, tl.trans(w.to(a.dtype)), DOT_PREC)
    return acc


@triton.jit
def _expert_matmul(a_rows, a_ok, w_row, grid, K, k_per_split, QTYPE: tl.constexpr, SUB: tl.constexpr,
                   HAS_OFFSET: tl.constexpr, DOT_PREC: tl.constexpr, SPLIT_K: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """The whole K of a tile: each of ``SPLIT_K`` ranges from zero, then added in range order."""
    total = _expert_dot(a_rows, a_ok, w_row, grid, K, 0, tl.minimum(K, k_per_split), QTYPE, SUB, HAS_OFFSET,
                        DOT_PREC, BLOCK_M, BLOCK_N, BLOCK_K)
    for s in tl.static_range(1, SPLIT_K):
        k_lo = s * k_per_split
        total += _expert_dot(a_rows, a_ok, w_row, grid, K, k_lo, tl.minimum(K, k_lo + k_per_split), QTYPE, SUB,
                             HAS_OFFSET, DOT_PREC, BLOCK_M, BLOCK_N, BLOCK_K)
    return total


@triton.jit
def _moe_gemm_kernel(
    a_ptr,
    w_ptr,
    w2_ptr,
    bias_ptr,
    bias2_ptr,
    grid_ptr,
    out_ptr,
    row_slot_ptr,
    block_expert_ptr,
    N,
    K,
    slots_per_row,
    stride_am,
    stride_we,
    stride_wn,
    stride_w2e,
    stride_w2n,
    stride_be,
    stride_om,
    k_per_split,
    alpha,
    limit,
    QTYPE: tl.constexpr,
    SUB: tl.constexpr,
    HAS_OFFSET: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    GATED: tl.constexpr,
    ACT: tl.constexpr,
    DOT_PREC: tl.constexpr,
    SPLIT_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """Row block ``program_id(0)`` (its rows: the slots ``row_slot``, ``-1`` none; its expert:
    ``block_expert``, ``-1`` none) times column tile ``program_id(1)`` of its expert's ``W``:
    ``out[slot] = A[slot // slots_per_row] @ W[e].T (+ bias[e])``; with ``GATED``,
    ``act(A @ W[e].T + bias[e], A @ W2[e].T + bias2[e])``, each rounded to ``out``'s dtype first."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m)
    if expert < 0:
        return
    e = expert.to(tl.int64)
    slots = tl.load(row_slot_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    ok = slots >= 0
    slot = tl.where(ok, slots, 0).to(tl.int64)
    a_rows = a_ptr + (slot // slots_per_row)[:, None] * stride_am
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < N
    rows = tl.minimum(n, N - 1).to(tl.int64)[:, None, None]
    acc = _expert_matmul(a_rows, ok, w_ptr + e * stride_we + rows * stride_wn, grid_ptr, K, k_per_split, QTYPE,
                         SUB, HAS_OFFSET, DOT_PREC, SPLIT_K, BLOCK_M, BLOCK_N, BLOCK_K)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + e * stride_be + n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    out_ty = out_ptr.dtype.element_ty
    if GATED:
        acc2 = _expert_matmul(a_rows, ok, w2_ptr + e * stride_w2e + rows * stride_w2n, grid_ptr, K, k_per_split, QTYPE,
                              SUB, HAS_OFFSET, DOT_PREC, SPLIT_K, BLOCK_M, BLOCK_N, BLOCK_K)
        if HAS_BIAS:
            acc2 += tl.load(bias2_ptr + e * stride_be + n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        res = gated_activation(acc.to(out_ty), acc2.to(out_ty), alpha, limit, ACT)
    else:
        res = acc
    out_ptrs = out_ptr + slot[:, None] * stride_om + n[None, :]
    tl.store(out_ptrs, res.to(out_ty), mask=ok[:, None] & n_mask[None, :])


@triton.jit(do_not_specialize=["top_k"])
def _moe_combine_kernel(y_ptr, part_ptr, weight_ptr, N, top_k, stride_ym, stride_pm, BLOCK: tl.constexpr):
    """``y[t] = sum_r part[t * top_k + r] * weight[t, r]``, each product rounded to ``y``'s dtype
    and added in rank order ``r = 0, 1, ...`` (torch's ``outs[:, 0] * w[:, :1] + ...`` in that
    dtype; launched without FMA contraction, which torch's separate ops never do)."""
    t = tl.program_id(0).to(tl.int64)
    n = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = n < N
    ty = y_ptr.dtype.element_ty
    w = tl.load(weight_ptr + t * top_k).to(ty).to(tl.float32)
    p = tl.load(part_ptr + t * top_k * stride_pm + n, mask=ok, other=0.0).to(tl.float32)
    y = (p * w).to(ty)
    for r in range(1, top_k):
        w = tl.load(weight_ptr + t * top_k + r).to(ty).to(tl.float32)
        p = tl.load(part_ptr + (t * top_k + r) * stride_pm + n, mask=ok, other=0.0).to(tl.float32)
        y = (y.to(tl.float32) + (p * w).to(ty).to(tl.float32)).to(ty)
    tl.store(y_ptr + t * stride_ym + n, y, mask=ok)


# ---------------------------------------------------------------------------------------------
# Launches


def gemm_config(dtype: torch.dtype, gated: bool) -> dict:
    """The tile of the grouped GEMMs for every step, fast-math or not: the batch-invariant GEMM's
    (taller row blocks spill registers in the gated kernel, which holds two projections' tiles).
    The gated kernel runs on twice the warps: on four, the K-quants' decoding spills there."""
    cfg = dict(_invariant_gemm_config(dtype))
    cfg.pop("GROUP_M")
    if gated:
        cfg["num_warps"] = 2 * cfg["num_warps"]
    return cfg


def sorted_rows(chosen: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(row_slot [blocks * block_m] int32, block_expert [blocks] int32)`` for ``chosen [T, k]``:
    the slots ``t * k + r`` grouped by expert (in slot order within one), each expert's padded to
    whole blocks of ``block_m`` rows (``-1``: a padding row, or a block past the last). ``blocks``
    is a bound from the shapes alone; everything is computed on ``chosen``'s device, without a sync."""
    flat = chosen.reshape(-1)
    num_slots = flat.numel()
    device = flat.device
    blocks = triton.cdiv(num_slots, block_m) + min(num_experts, num_slots)
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.index_add_(0, flat, torch.ones_like(flat))
    expert_blocks = (counts + (block_m - 1)) // block_m
    block_end = torch.cumsum(expert_blocks, 0)
    first_row = (block_end - expert_blocks) * block_m  # each expert's first padded row
    first_sorted = torch.cumsum(counts, 0) - counts  # its first slot in ``order``
    expert_of = flat[order]
    rows = first_row[expert_of] + torch.arange(num_slots, device=device) - first_sorted[expert_of]
    row_slot = torch.full((blocks * block_m,), -1, dtype=torch.int32, device=device)
    row_slot[rows] = order.to(torch.int32)
    block_expert = torch.searchsorted(block_end, torch.arange(blocks, device=device), right=True)
    block_expert = torch.where(block_expert < num_experts, block_expert, -1).to(torch.int32)
    return row_slot, block_expert


def _launch_gemm(a: torch.Tensor, first: ExpertWeights, second: ExpertWeights | None, out: torch.Tensor,
                 row_slot: torch.Tensor, block_expert: torch.Tensor, slots_per_row: int, cfg: dict,
                 invariant: bool, plan: ExpertPlan) -> None:
    n, k = first.out_features, first.in_features
    qtype = first.qtype
    w = _weight_arg(_experts_raw(first), qtype)
    w2 = w if second is None else _weight_arg(_experts_raw(second), qtype)
    has_bias = first.bias is not None
    bias = first.bias if has_bias else out
    bias2 = second.bias if second is not None and has_bias else bias
    cfg = dict(cfg)
    block_m, block_n = cfg.pop("BLOCK_M"), cfg["BLOCK_N"]
    split = invariant_split_k(n, k, block_n) if invariant else 1
    k_per_split = triton.cdiv(triton.cdiv(k, split), _K_ALIGN) * _K_ALIGN
    grid = (block_expert.numel(), triton.cdiv(n, block_n))
    _moe_gemm_kernel[grid](
        a, w, w2, bias, bias2, grid_arg(qtype, a.device), out, row_slot, block_expert,
        n, k, slots_per_row, a.stride(0),
        w.stride(0), w.stride(1), w2.stride(0), w2.stride(1), bias.stride(0) if has_bias else 0, out.stride(0),
        k_per_split, float(plan.alpha), float(plan.limit),
        QTYPE=int(qtype), SUB=SUB_SIZE[qtype], HAS_OFFSET=qtype in _HAS_OFFSET, HAS_BIAS=has_bias,
        GATED=second is not None, ACT=plan.activation, DOT_PREC=dot_precision(a.dtype, gpu_spec(a.device)),
        SPLIT_K=split, BLOCK_M=block_m, **cfg,
    )


def _experts_raw(weights: ExpertWeights) -> torch.Tensor:
    """``weights.raw`` as uint8 ``[E, N, bytes_per_row]``, each expert's rows checked as
    ``quant_matmul`` checks a weight's (the word-reading types' expert stride too)."""
    raw = weights.raw
    if raw.dtype != torch.uint8:  # typed F16/BF16 values
        raw = raw.view(torch.uint8)
    _check(raw[0], weights.qtype, weights.in_features)
    if weights.qtype in WORD_ALIGNED_TYPES and raw.shape[0] > 1 and raw.stride(0) % 4:
        raise ValueError(f"{weights.qtype.name} experts must step 4-byte aligned (the kernels read words)")
    return raw


def expert_outputs(x: torch.Tensor, chosen: torch.Tensor, plan: ExpertPlan, *, invariant: bool = True) -> torch.Tensor:
    """``out[t * k + r] = expert_{chosen[t, r]}(x[t])`` for ``x [T, H]`` and ``chosen [T, k]``, in
    ``x``'s dtype (two launches after the sort); ``invariant``: batch-invariant (see the module's
    docstring)."""
    if plan.activation not in ACTIVATIONS:
        raise ValueError(f"activation {plan.activation!r}")
    x2 = x if x.stride(-1) == 1 else x.contiguous()
    num_slots = chosen.numel()
    hidden, inter = plan.down.out_features, plan.down.in_features
    outs = torch.empty((num_slots, hidden), dtype=x.dtype, device=x.device)
    if num_slots == 0:
        return outs
    num_experts = plan.gate.raw.shape[0]
    cfg = gemm_config(x.dtype, gated=False)
    row_slot, block_expert = sorted_rows(chosen, num_experts, cfg["BLOCK_M"])
    act = torch.empty((num_slots, inter), dtype=x.dtype, device=x.device)
    _launch_gemm(x2, plan.gate, plan.up, act, row_slot, block_expert, chosen.shape[1], gemm_config(x.dtype, gated=True),
                 invariant, plan)
    _launch_gemm(act, plan.down, None, outs, row_slot, block_expert, 1, cfg, invariant, plan)
    return outs


def combine(outs: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """``y[t] = sum_r outs[t * k + r] * weights[t, r]`` in ``outs``' dtype, in rank order (see
    :func:`_moe_combine_kernel`)."""
    num_tokens, top_k = weights.shape
    hidden = outs.shape[-1]
    y = torch.empty((num_tokens, hidden), dtype=outs.dtype, device=outs.device)
    if num_tokens == 0:
        return y
    block = min(1024, triton.next_power_of_2(hidden))
    _moe_combine_kernel[(num_tokens, triton.cdiv(hidden, block))](
        y, outs, weights.float().contiguous(), hidden, top_k, y.stride(0), outs.stride(0), BLOCK=block,
        enable_fp_fusion=False,
    )
    return y


def moe_experts(x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor, plan: ExpertPlan, *,
                invariant: bool = True) -> torch.Tensor:
    """``sum_r weights[t, r] * expert_{chosen[t, r]}(x[t])`` for each row ``t`` of ``x [T, H]``,
    the terms added in rank order, in ``x``'s dtype; ``invariant``: batch-invariant (see the
    module's docstring)."""
    return combine(expert_outputs(x, chosen, plan, invariant=invariant), weights)
