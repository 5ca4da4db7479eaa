"""Elementwise and normalisation kernels of the llama family in Triton, and :class:`TritonOps`,
the ops the model calls when it runs on Triton kernels (through
:class:`~localllm.kernels.triton.backend.TritonBackend`).

* ``rms_norm`` / ``add_rms_norm``: RMSNorm, optionally fused with the residual add
  (``h = x + residual`` is written out and normalised in the same pass);
* ``rope_write_kv``: RoPE on queries and keys fused with the KV-cache write (plain or int8/fp8
  quantized), :mod:`localllm.kernels.triton.kv`'s;
* ``silu_and_mul``: ``silu(gate) * up``; ``gelu_tanh_and_mul``: ``gelu_tanh(gate) * up`` (GeGLU);
  ``swiglu_oai_and_mul``: gpt-oss's clamped SwiGLU.

The pure-torch references are the reference backend's ops
(:class:`localllm.kernels.torch_backend.TorchBackend`): the tests compare each kernel with them.
"""

from __future__ import annotations

import itertools

import torch
import triton
import triton.language as tl

from localllm.kernels.attention import AttentionMetadata
from localllm.kernels.triton import attention as ta
from localllm.kernels.triton.attention import _tanh
from localllm.kernels.triton.kv import rope_write_kv, write_kv

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


def _rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(h), h)`` for ``h = x`` or, with a ``residual``, ``h = residual + x`` (then
    written out by the kernel)."""
    add_residual = residual is not None
    x2 = _rows(x)
    r2 = _rows(residual) if add_residual else x2
    n = x2.shape[-1]
    out = torch.empty_like(x2)
    res_out = torch.empty_like(x2) if add_residual else x2
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
            ADD_RESIDUAL=add_residual,
            BLOCK=triton.next_power_of_2(n),
            num_warps=_norm_warps(n),
        )
    return out.view(x.shape), res_out.view(x.shape)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x * rsqrt(mean(x^2) + eps) * weight`` over the last dim, computed in float32."""
    return _rms_norm(x, None, weight, eps)[0]


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    """``(rms_norm(residual + x), residual + x)`` in one pass."""
    return _rms_norm(x, residual, weight, eps)


def _norm_warps(n: int) -> int:
    return 1 if n <= 256 else 4 if n <= 2048 else 8


# ---------------------------------------------------------------------------------------------
# Gated activations: SiLU and GELU (tanh) times ``up``


@triton.jit
def gated_activation(g, u, alpha, limit, ACT: tl.constexpr):
    """``act(g) * u`` in float32 for ``g``, ``u`` in the activation dtype: ``ACT`` ``"silu"`` or
    ``"gelu_tanh"``; for ``"swiglu_oai"``, gpt-oss's ``g * sigmoid(alpha * g) * (u + 1)`` with
    ``g = min(gate, limit)``, ``u = clamp(up, -limit, limit)`` (``alpha``, ``limit``: read by that
    one only). Each step is rounded to the activation dtype where the unfused torch ops round it,
    so that every kernel applying it (the grouped experts' too) gives the same bits."""
    gf = g.to(tl.float32)
    if ACT == "swiglu_oai":
        # (the clamps are exact)
        gc = tl.minimum(gf, limit)
        uc = tl.minimum(tl.maximum(u.to(tl.float32), -limit), limit)
        ga = (gc * alpha).to(g.dtype).to(tl.float32)
        sig = (1.0 / (1.0 + tl.exp(-ga))).to(g.dtype).to(tl.float32)
        glu = (gc * sig).to(g.dtype).to(tl.float32)
        out = (uc + 1.0).to(g.dtype).to(tl.float32) * glu
    else:
        if ACT == "silu":
            a = gf / (1.0 + tl.exp(-gf))
        else:
            tl.static_assert(ACT == "gelu_tanh")
            # gelu(x, approximate="tanh") = x/2 * (1 + tanh(sqrt(2/pi) * (x + 0.044715 x^3)))
            inner = 0.7978845608028654 * (gf + 0.044715 * gf * gf * gf)
            a = 0.5 * gf * (1.0 + _tanh(inner))
        # act(g) rounded to the activation dtype before the product
        out = a.to(g.dtype).to(tl.float32) * u.to(tl.float32)
    return out


@triton.jit
def _act_and_mul_kernel(
    g_ptr, u_ptr, o_ptr, n_cols, stride_g, stride_u, stride_o, alpha, limit, ACT: tl.constexpr,
    BLOCK: tl.constexpr
):
    """``o = act(gate) * up`` row by row (:func:`gated_activation`)."""
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = c < n_cols
    g = tl.load(g_ptr + row * stride_g + c, mask=mask, other=0.0)
    u = tl.load(u_ptr + row * stride_u + c, mask=mask, other=0.0)
    out = gated_activation(g, u, alpha, limit, ACT)
    tl.store(o_ptr + row * stride_o + c, out.to(o_ptr.dtype.element_ty), mask=mask)


def _act_and_mul(gate: torch.Tensor, up: torch.Tensor, act: str, alpha: float = 0.0,
                 limit: float = 0.0) -> torch.Tensor:
    g2, u2 = _rows(gate), _rows(up)
    n = g2.shape[-1]
    out = torch.empty_like(g2)
    block = min(1024, triton.next_power_of_2(n))
    if g2.shape[0]:
        _act_and_mul_kernel[(g2.shape[0], triton.cdiv(n, block))](
            g2, u2, out, n, g2.stride(0), u2.stride(0), out.stride(0), float(alpha), float(limit), ACT=act,
            BLOCK=block
        )
    return out.view(gate.shape)


def silu_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` elementwise."""
    return _act_and_mul(gate, up, "silu")


def gelu_tanh_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``gelu(gate, approximate="tanh") * up`` elementwise."""
    return _act_and_mul(gate, up, "gelu_tanh")


def swiglu_oai_and_mul(gate: torch.Tensor, up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's clamped SwiGLU elementwise (see ``Backend.swiglu_oai_mul``)."""
    return _act_and_mul(gate, up, "swiglu_oai", alpha, limit)


# ---------------------------------------------------------------------------------------------
# The model backend


class TritonOps:
    """The model's ops on Triton kernels (same methods as ``localllm.kernels.torch_backend.TorchBackend``).

    Attention needs ``query_start_loc`` on the device; it is built once per
    :class:`AttentionMetadata` (all layers of a step share one) unless the metadata already
    carries it (``DeviceAttentionMetadata``, used by CUDA-graph replays). ``batch_invariant``:
    attention in tiles of one shape for prompt and decode tokens and no KV splits (see
    :func:`~localllm.kernels.triton.attention.paged_attention`).
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

    def swiglu_oai_mul(self, gate, up, alpha, limit):
        return swiglu_oai_and_mul(gate, up, alpha, limit)

    def decoder_layer(self, layer, positions, h, kv_cache, meta):
        return None  # op by op

    def decoder_layers(self, layers, positions, h, kv_caches, meta, norm=None):
        return None  # layer by layer

    def moe_route(self, moe, x):
        return None  # torch's routing

    def moe_experts(self, moe, x, weights, chosen):
        return None  # expert by expert

    def rope_write_kv(self, rope, positions, q, k, v, kv_cache, slot_mapping):
        if rope is None:  # a layer without RoPE: the queries as they are, laid out as the rotated ones
            write_kv(kv_cache, k, v, slot_mapping)
            return q.contiguous()
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
                max_q = max((b - a for a, b in itertools.pairwise(starts)), default=1)
            max_ctx = getattr(meta, "max_context_len", None)
            if max_ctx is None:
                max_ctx = max(meta.context_lens_host, default=0)
            self._meta, self._meta_args = meta, (qsl, max_q, max_ctx, getattr(meta, "num_splits", None))
        return self._meta_args

    def attention(self, q, kv_cache, meta, scale, *, sliding_window=None, logit_softcap=None, sinks=None):
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
            sinks=sinks,
            invariant=self.batch_invariant,
        )
