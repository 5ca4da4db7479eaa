"""Elementwise and normalisation kernels of the llama family in Triton, and :class:`TritonOps`,
the ops the model calls when it runs on Triton kernels (through
:class:`~localllm.kernels.triton_backend.TritonBackend`).

* ``rms_norm`` / ``add_rms_norm``: RMSNorm, optionally fused with the residual add
  (``h = x + residual`` is written out and normalised in the same pass);
* ``rope_write_kv``: RoPE on queries and keys (``neox`` halves or adjacent pairs, partial
  rotary dims, any frequency table: llama3 frequency factors and linear scaling are baked into
  the model's cos/sin tables) fused with the KV-cache write (plain or int8/fp8 quantized);
* ``silu_and_mul``: ``silu(gate) * up``; ``gelu_tanh_and_mul``: ``gelu_tanh(gate) * up`` (GeGLU).

The pure-torch references are the reference backend's ops
(:class:`localllm.kernels.torch_backend.TorchBackend`): the tests compare each kernel with them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from localllm.kernels import triton_attention as ta
from localllm.kernels import triton_kv as tkv
from localllm.kernels.attention import AttentionMetadata
from localllm.kernels.triton_attention import _tanh
from localllm.kernels.triton_kv import store_kv_rows

# ---------------------------------------------------------------------------------------------
# RMSNorm


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    res_out_ptr,
    n_cols,
    stride_x,
    stride_r,
    stride_o,
    stride_ro,
    eps,
    ADD_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK)
    mask = c < n_cols
    x = tl.load(x_ptr + row * stride_x + c, mask=mask, other=0.0)
    if ADD_RESIDUAL:
        r = tl.load(res_ptr + row * stride_r + c, mask=mask, other=0.0)
        # Round the sum to the activation dtype first, as the unfused ``residual + x`` does.
        h = (r.to(tl.float32) + x.to(tl.float32)).to(x.dtype)
        tl.store(res_out_ptr + row * stride_ro + c, h, mask=mask)
        xf = h.to(tl.float32)
    else:
        xf = x.to(tl.float32)
    var = tl.sum(xf * xf, axis=0) / n_cols
    y = xf * (1.0 / tl.sqrt(var + eps))
    w = tl.load(w_ptr + c, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + c, (y * w).to(out_ptr.dtype.element_ty), mask=mask)


def _rows(x: torch.Tensor) -> torch.Tensor:
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x * rsqrt(mean(x^2) + eps) * weight`` over the last dim, computed in float32."""
    x2 = _rows(x)
    n = x2.shape[-1]
    out = torch.empty_like(x2)
    if x2.shape[0]:
        _rms_norm_kernel[(x2.shape[0],)](
            x2,
            x2,
            weight,
            out,
            out,
            n,
            x2.stride(0),
            0,
            out.stride(0),
            0,
            eps,
            ADD_RESIDUAL=False,
            BLOCK=triton.next_power_of_2(n),
            num_warps=_norm_warps(n),
        )
    return out.view(x.shape)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    """``(rms_norm(residual + x), residual + x)`` in one pass."""
    x2, r2 = _rows(x), _rows(residual)
    n = x2.shape[-1]
    out = torch.empty_like(x2)
    res_out = torch.empty_like(x2)
    if x2.shape[0]:
        _rms_norm_kernel[(x2.shape[0],)](
            x2,
            r2,
            weight,
            out,
            res_out,
            n,
            x2.stride(0),
            r2.stride(0),
            out.stride(0),
            res_out.stride(0),
            eps,
            ADD_RESIDUAL=True,
            BLOCK=triton.next_power_of_2(n),
            num_warps=_norm_warps(n),
        )
    return out.view(x.shape), res_out.view(x.shape)


def _norm_warps(n: int) -> int:
    return 1 if n <= 256 else 4 if n <= 2048 else 8


# ---------------------------------------------------------------------------------------------
# SiLU and mul


@triton.jit
def _silu_and_mul_kernel(g_ptr, u_ptr, o_ptr, n_cols, stride_g, stride_u, stride_o, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = c < n_cols
    g = tl.load(g_ptr + row * stride_g + c, mask=mask, other=0.0)
    u = tl.load(u_ptr + row * stride_u + c, mask=mask, other=0.0)
    gf = g.to(tl.float32)
    # Round silu(g) to the activation dtype before the product, as the unfused torch ops do.
    s = (gf / (1.0 + tl.exp(-gf))).to(g.dtype)
    tl.store(
        o_ptr + row * stride_o + c,
        (s.to(tl.float32) * u.to(tl.float32)).to(o_ptr.dtype.element_ty),
        mask=mask,
    )


def silu_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` elementwise."""
    g2, u2 = _rows(gate), _rows(up)
    n = g2.shape[-1]
    out = torch.empty_like(g2)
    block = min(1024, triton.next_power_of_2(n))
    if g2.shape[0]:
        _silu_and_mul_kernel[(g2.shape[0], triton.cdiv(n, block))](
            g2,
            u2,
            out,
            n,
            g2.stride(0),
            u2.stride(0),
            out.stride(0),
            BLOCK=block,
        )
    return out.view(gate.shape)


@triton.jit
def _gelu_tanh_and_mul_kernel(g_ptr, u_ptr, o_ptr, n_cols, stride_g, stride_u, stride_o, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = c < n_cols
    g = tl.load(g_ptr + row * stride_g + c, mask=mask, other=0.0)
    u = tl.load(u_ptr + row * stride_u + c, mask=mask, other=0.0)
    gf = g.to(tl.float32)
    # gelu(x, approximate="tanh") = x/2 * (1 + tanh(sqrt(2/pi) * (x + 0.044715 x^3))), rounded to
    # the activation dtype before the product, as the unfused torch ops do
    inner = 0.7978845608028654 * (gf + 0.044715 * gf * gf * gf)
    a = (0.5 * gf * (1.0 + _tanh(inner))).to(g.dtype)
    tl.store(
        o_ptr + row * stride_o + c,
        (a.to(tl.float32) * u.to(tl.float32)).to(o_ptr.dtype.element_ty),
        mask=mask,
    )


def gelu_tanh_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``gelu(gate, approximate="tanh") * up`` elementwise."""
    g2, u2 = _rows(gate), _rows(up)
    n = g2.shape[-1]
    out = torch.empty_like(g2)
    block = min(1024, triton.next_power_of_2(n))
    if g2.shape[0]:
        _gelu_tanh_and_mul_kernel[(g2.shape[0], triton.cdiv(n, block))](
            g2,
            u2,
            out,
            n,
            g2.stride(0),
            u2.stride(0),
            out.stride(0),
            BLOCK=block,
        )
    return out.view(gate.shape)


# ---------------------------------------------------------------------------------------------
# RoPE fused with the KV write


@triton.jit
def _rope_rows(
    x_ptr, rows, d, row_ok, cos, sin, ROT: tl.constexpr, NEOX: tl.constexpr, HEAD_DIM: tl.constexpr
):
    """Rotated rows ``[BH, BD]`` (float32) of the heads at ``x_ptr + rows[:, None] + d``."""
    d_ok = d < HEAD_DIM
    in_rot = d < ROT
    if NEOX:
        HALF: tl.constexpr = ROT // 2
        first = d < HALF
        partner = tl.where(first, d + HALF, d - HALF)
    else:
        first = (d & 1) == 0
        partner = d ^ 1
    mask = row_ok[:, None] & d_ok[None, :]
    x = tl.load(x_ptr + rows[:, None] + d[None, :], mask=mask, other=0.0).to(tl.float32)
    xp = tl.load(x_ptr + rows[:, None] + partner[None, :], mask=mask & in_rot[None, :], other=0.0).to(
        tl.float32
    )
    c = cos[None, :]
    s = sin[None, :]
    rotated = tl.where(first[None, :], x * c - xp * s, x * c + xp * s)
    return tl.where(in_rot[None, :], rotated, x)


@triton.jit
def _rope_write_kv_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    qo_ptr,
    pos_ptr,
    cos_ptr,
    sin_ptr,
    slot_ptr,
    kc_ptr,
    vc_ptr,
    ks_ptr,
    vs_ptr,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_ot,
    stride_oh,
    stride_cos,
    stride_cs,
    stride_ch,
    stride_ss,
    stride_sh,
    num_heads,
    num_kv_heads,
    HEAD_DIM: tl.constexpr,
    ROT: tl.constexpr,
    NEOX: tl.constexpr,
    WRITE_KV: tl.constexpr,
    QUANT: tl.constexpr,
    IS_FP8: tl.constexpr,
    QMAX: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HKV: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    if NEOX:
        fi = d % (ROT // 2)
    else:
        fi = d // 2
    in_rot = d < ROT
    cos = tl.load(cos_ptr + pos * stride_cos + fi, mask=in_rot, other=1.0)
    sin = tl.load(sin_ptr + pos * stride_cos + fi, mask=in_rot, other=0.0)

    hq = tl.arange(0, BLOCK_HQ)
    hq_ok = hq < num_heads
    qr = _rope_rows(q_ptr + t * stride_qt, hq * stride_qh, d, hq_ok, cos, sin, ROT, NEOX, HEAD_DIM)
    tl.store(
        qo_ptr + t * stride_ot + hq[:, None] * stride_oh + d[None, :],
        qr.to(qo_ptr.dtype.element_ty),
        mask=hq_ok[:, None] & (d[None, :] < HEAD_DIM),
    )

    hk = tl.arange(0, BLOCK_HKV)
    hk_ok = hk < num_kv_heads
    kr = _rope_rows(k_ptr + t * stride_kt, hk * stride_kh, d, hk_ok, cos, sin, ROT, NEOX, HEAD_DIM)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if WRITE_KV:  # noqa: SIM102 - a constexpr test around a runtime one
        if slot >= 0:
            mask = hk_ok[:, None] & (d[None, :] < HEAD_DIM)
            # Round to the activation dtype first: the unfused path writes the rotated k tensor.
            kr = kr.to(k_ptr.dtype.element_ty).to(tl.float32)
            v = tl.load(v_ptr + t * stride_vt + hk[:, None] * stride_vh + d[None, :], mask=mask, other=0.0)
            store_kv_rows(
                kc_ptr,
                ks_ptr,
                kr,
                slot,
                hk,
                d,
                hk_ok,
                mask,
                stride_cs,
                stride_ch,
                stride_ss,
                stride_sh,
                QUANT,
                IS_FP8,
                QMAX,
            )
            store_kv_rows(
                vc_ptr,
                vs_ptr,
                v.to(tl.float32),
                slot,
                hk,
                d,
                hk_ok,
                mask,
                stride_cs,
                stride_ch,
                stride_ss,
                stride_sh,
                QUANT,
                IS_FP8,
                QMAX,
            )


def rope_write_kv(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    rot_dim: int,
    neox: bool,
    kv_cache,
    slot_mapping: torch.Tensor,
) -> torch.Tensor:
    """Rotate ``q [T, Hq, D]`` and ``k [T, Hkv, D]`` at ``positions`` with the tables ``cos``/
    ``sin`` ``[max_pos, rot_dim/2]`` (float32), write rotated keys and ``v`` into ``kv_cache`` at
    ``slot_mapping`` (``< 0``: skipped; ``kv_cache=None``: no write); return the rotated queries."""
    t, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    q_out = torch.empty_like(q)
    if t == 0:
        return q_out
    if kv_cache is not None:
        kc, vc, ks, vs, quant = tkv.cache_parts(kv_cache)
        tkv.check_cache(kc, ks, quant)
    else:
        kc = vc = q_out
        ks = vs = None
        quant = None
    mode, is_fp8, qmax = tkv.quant_args(quant)
    _, ss, sh = tkv.scale_strides(ks, quant)
    if cos.stride(-1) != 1 or sin.stride() != cos.stride():
        cos, sin = cos.contiguous(), sin.contiguous()
    for x in (q, k, v):
        assert x.stride(-1) == 1, "q/k/v rows must be contiguous in head_dim"
    _rope_write_kv_kernel[(t,)](
        q,
        k,
        v,
        q_out,
        positions,
        cos,
        sin,
        slot_mapping,
        kc,
        vc,
        ks if ks is not None else kc,
        vs if vs is not None else vc,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        q_out.stride(0),
        q_out.stride(1),
        cos.stride(0),
        kc.stride(1),
        kc.stride(2),
        ss,
        sh,
        num_heads,
        num_kv_heads,
        HEAD_DIM=head_dim,
        ROT=rot_dim,
        NEOX=neox,
        WRITE_KV=kv_cache is not None,
        QUANT=mode,
        IS_FP8=is_fp8,
        QMAX=qmax,
        BLOCK_HQ=triton.next_power_of_2(num_heads),
        BLOCK_HKV=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
        num_warps=4,
    )
    return q_out


# ---------------------------------------------------------------------------------------------
# The model backend


class TritonOps:
    """The model's ops on Triton kernels (same methods as ``localllm.kernels.torch_backend.TorchBackend``).

    Attention needs ``query_start_loc`` on the device; it is built once per
    :class:`AttentionMetadata` (all layers of a step share one) unless the metadata already
    carries it (``DeviceAttentionMetadata``, used by CUDA-graph replays). ``batch_invariant``:
    attention in tiles of one shape for prompt and decode tokens and no KV splits (see
    :func:`~localllm.kernels.triton_attention.paged_attention`).
    """

    name = "triton"

    def __init__(self, batch_invariant: bool = False) -> None:
        self.batch_invariant = batch_invariant
        self._meta: AttentionMetadata | None = None
        self._meta_args: tuple | None = None

    def rms_norm(self, x, weight, eps):
        return rms_norm(x, weight, eps)

    def add_rms_norm(self, x, residual, weight, eps):
        return add_rms_norm(x, residual, weight, eps)

    def silu_mul(self, gate, up):
        return silu_and_mul(gate, up)

    def gelu_tanh_mul(self, gate, up):
        return gelu_tanh_and_mul(gate, up)

    def decoder_layer(self, layer, positions, h, kv_cache, meta):
        return None  # op by op

    def rope_write_kv(self, rope, positions, q, k, v, kv_cache, slot_mapping):
        return rope_write_kv(
            positions, q, k, v, rope.cos, rope.sin, rope.rot_dim, rope.neox, kv_cache, slot_mapping
        )

    def _attention_args(self, meta: AttentionMetadata, device: torch.device):
        if meta is not self._meta:
            qsl = getattr(meta, "query_start_loc_dev", None)
            if qsl is None:
                qsl = torch.tensor(meta.query_start_loc, dtype=torch.int64).to(device, non_blocking=True)
            max_q = getattr(meta, "max_query_len", None)
            if max_q is None:
                starts = meta.query_start_loc
                max_q = max((b - a for a, b in zip(starts, starts[1:])), default=1)
            max_ctx = getattr(meta, "max_context_len", None)
            if max_ctx is None:
                max_ctx = max(meta.context_lens_host, default=0)
            self._meta, self._meta_args = meta, (qsl, max_q, max_ctx, getattr(meta, "num_splits", None))
        return self._meta_args

    def attention(self, q, kv_cache, meta, scale, *, sliding_window=None, logit_softcap=None):
        qsl, max_q, max_ctx, splits = self._attention_args(meta, q.device)
        return ta.paged_attention(
            q,
            kv_cache,
            meta.block_tables,
            meta.context_lens,
            qsl,
            max_q,
            scale,
            max_context_len=max_ctx,
            num_splits=splits,
            sliding_window=sliding_window,
            logit_softcap=logit_softcap,
            invariant=self.batch_invariant,
        )
