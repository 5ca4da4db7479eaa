"""The KV cache's writes in Triton, and its 8-bit forms (int8 or fp8 e4m3, :class:`KVQuant`).

A layer's cache is ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` (the reference's,
:mod:`localllm.kernels.attention`); :func:`write_kv` stores a step's keys and values at their
slots, quantizing them on the way where the cache is 8-bit; :func:`rope_write_kv` does the same in
the same kernel after RoPE on queries and keys (``neox`` halves or adjacent pairs, partial rotary
dims, any frequency table: llama3 frequency factors and linear scaling are baked into the model's
cos/sin tables). Quantized KV holds int8 or fp8 values with a float32 scale per (token, head)
(``"token"``, computed from the values as they are written) or per head (``"head"``, static scales
given by the caller); :func:`quantize_kv_reference` and :func:`dequantize_kv_reference` are the
pure-torch definitions. The attention kernel that reads them is
:mod:`localllm.kernels.triton.attention`'s.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

INT8_MAX = 127.0
FP8_MAX = 448.0  # float8_e4m3fn


@dataclass(frozen=True, slots=True)
class KVQuant:
    """How a quantized KV cache is stored.

    ``dtype``: ``torch.int8`` or ``torch.float8_e4m3fn``. ``granularity``: ``"token"`` (a scale
    per token and KV head, ``scales`` shaped ``[2, num_blocks, block_size, num_kv_heads]``,
    written with the values) or ``"head"`` (static, ``scales`` shaped ``[2, num_kv_heads]``).
    """

    dtype: torch.dtype
    granularity: str = "token"

    def __post_init__(self) -> None:
        if self.dtype not in (torch.int8, torch.float8_e4m3fn):
            raise ValueError(f"quantized KV must be int8 or float8_e4m3fn, got {self.dtype}")
        if self.granularity not in ("token", "head"):
            raise ValueError(f"KV scale granularity must be 'token' or 'head', got {self.granularity!r}")

    @property
    def qmax(self) -> float:
        return INT8_MAX if self.dtype == torch.int8 else FP8_MAX

    @property
    def mode(self) -> int:
        return 1 if self.granularity == "token" else 2


@dataclass(slots=True)
class QuantizedKVCache:
    """A layer's quantized cache: ``data`` ``[2, num_blocks, block_size, num_kv_heads, head_dim]``
    in ``quant.dtype`` and its float32 ``scales``."""

    data: torch.Tensor
    scales: torch.Tensor
    quant: KVQuant

    @classmethod
    def allocate(
        cls,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        quant: KVQuant,
        device=None,
        head_scales: torch.Tensor | None = None,
    ) -> QuantizedKVCache:
        data = torch.zeros(
            2, num_blocks, block_size, num_kv_heads, head_dim, dtype=quant.dtype, device=device
        )
        if quant.granularity == "token":
            scales = torch.ones(2, num_blocks, block_size, num_kv_heads, dtype=torch.float32, device=device)
        else:
            if head_scales is None:
                raise ValueError("per-head KV quantization needs head_scales [2, num_kv_heads]")
            scales = head_scales.to(device=device, dtype=torch.float32).reshape(2, num_kv_heads).contiguous()
        return cls(data, scales, quant)

    @property
    def shape(self) -> torch.Size:
        return self.data.shape


# ---------------------------------------------------------------------------------------------
# Pure-torch references for quantized KV


def quantize_kv_reference(x: torch.Tensor, quant: KVQuant, head_scale: torch.Tensor | None = None):
    """``x [T, H, D]`` -> ``(values in quant.dtype, scales float32 [T, H])``: the definition the
    write kernels follow (per-token: ``scale = amax / qmax``, 1 where amax is 0; int8 rounds half
    away from zero and saturates; fp8 saturates, then rounds to nearest even)."""
    xf = x.float()
    if quant.granularity == "token":
        scale = xf.abs().amax(-1) / quant.qmax
        scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    else:
        scale = head_scale.float().reshape(1, -1).expand(x.shape[0], -1)
    y = xf / scale[..., None]
    if quant.dtype == torch.int8:
        y = torch.where(y >= 0, y + 0.5, y - 0.5).trunc().clamp(-INT8_MAX, INT8_MAX)
        return y.to(torch.int8), scale
    return y.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale


def dequantize_kv_reference(cache: QuantizedKVCache) -> torch.Tensor:
    """The float32 cache ``[2, num_blocks, block_size, H, D]`` a quantized one stands for."""
    data = cache.data.float()
    if cache.quant.granularity == "token":
        return data * cache.scales[..., None]
    return data * cache.scales[:, None, None, :, None]


def write_kv_quant_reference(cache: QuantizedKVCache, k, v, slot_mapping) -> None:
    """Reference for :func:`write_kv` on a quantized cache (slots < 0 are skipped)."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    _, nb, bs, h, d = cache.data.shape
    data = cache.data.view(torch.uint8) if cache.data.dtype == torch.float8_e4m3fn else cache.data
    flat = data.view(2, nb * bs, h, d)
    for i, x in enumerate((k[keep], v[keep])):
        hs = cache.scales[i] if cache.quant.granularity == "head" else None
        q, s = quantize_kv_reference(x, cache.quant, hs)
        flat[i].index_copy_(0, slots, q.view(data.dtype))
        if cache.quant.granularity == "token":
            cache.scales[i].view(nb * bs, h).index_copy_(0, slots, s)


# ---------------------------------------------------------------------------------------------
# fp8 (e4m3fn) by bit manipulation: the same code on every GPU generation (no fp8 hardware
# conversion needed) and in the interpreter (whose float->fp8 cast mis-rounds values that
# round up to the next power of two).


@triton.jit
def _f32_to_e4m3_bits(y):
    """Float32 ``y`` with ``|y| <= 448`` -> e4m3fn bit patterns (uint8), round to nearest even."""
    a = tl.abs(y)
    bits = a.to(tl.int32, bitcast=True)
    # Normal range: round the mantissa to 3 bits (carries into the exponent), rebias 127 -> 7.
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) >> 20) - (120 << 3)
    # Subnormals (|y| < 2**-6) are multiples of 2**-9.
    f = a * 512.0
    m = f.to(tl.int32)
    frac = f - m.to(tl.float32)
    sub = m + ((frac > 0.5) | ((frac == 0.5) & ((m & 1) == 1))).to(tl.int32)
    code = tl.where(a < 0.015625, sub, normal)
    code = code | ((y.to(tl.int32, bitcast=True) >> 24) & 128)  # the sign bit
    return code.to(tl.uint8)


@triton.jit
def e4m3_bits_to_f16(b):
    """e4m3fn bit patterns (uint8) -> float16 (exact): place the fields in an fp16 and rescale."""
    b16 = b.to(tl.uint16)
    h = (((b16 & 0x80) << 8) | ((b16 & 0x7F) << 7)).to(tl.float16, bitcast=True)
    return h * 256.0


# ---------------------------------------------------------------------------------------------
# KV write, alone or fused with RoPE


@triton.jit
def _head_rows(x_ptr, rows, d, mask):
    """Rows ``[BH, BD]`` (float32) of the heads at ``x_ptr + rows[:, None] + d``."""
    return tl.load(x_ptr + rows[:, None] + d[None, :], mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _store_rows(
    ptrs, scale_ptrs, x, mask, h_ok, QUANT: tl.constexpr, IS_FP8: tl.constexpr, QMAX: tl.constexpr
):
    """Store rows ``x [BH, BD]`` (float32) of one token's heads at the cache pointers ``ptrs``;
    ``scale_ptrs`` ``[BH]``: the heads' scales (``h_ok``: the heads that exist).

    QUANT 0: plain cast; 1: per-token scales (computed, stored); 2: per-head scales (loaded).
    """
    if QUANT == 0:
        tl.store(ptrs, x.to(ptrs.dtype.element_ty), mask=mask)
    else:
        if QUANT == 1:
            # div_rn: correctly rounded, as torch divides (a GPU's "/" is div.full, within 2 ulp)
            scale = tl.div_rn(tl.max(tl.where(mask, tl.abs(x), 0.0), axis=1), QMAX)
            scale = tl.where(scale == 0.0, 1.0, scale)
            tl.store(scale_ptrs, scale, mask=h_ok)
        else:
            scale = tl.load(scale_ptrs, mask=h_ok, other=1.0)
        y = tl.div_rn(x, scale[:, None])
        if IS_FP8:
            y = tl.minimum(tl.maximum(y, -QMAX), QMAX)
            tl.store(ptrs, _f32_to_e4m3_bits(y), mask=mask)
        else:
            y = tl.where(y >= 0, y + 0.5, y - 0.5).to(tl.int32)  # round half away from zero
            y = tl.minimum(tl.maximum(y, -127), 127)
            tl.store(ptrs, y.to(tl.int8), mask=mask)


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
    x = _head_rows(x_ptr, rows, d, mask)
    xp = tl.load(x_ptr + rows[:, None] + partner[None, :], mask=mask & in_rot[None, :], other=0.0).to(
        tl.float32
    )
    c = cos[None, :]
    s = sin[None, :]
    rotated = tl.where(first[None, :], x * c - xp * s, x * c + xp * s)
    return tl.where(in_rot[None, :], rotated, x)


@triton.jit
def _write_kv_kernel(
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
    ROPE: tl.constexpr,
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
    """Token ``t``'s keys and values into its cache slot (``WRITE_KV``; a slot ``< 0`` is
    skipped); with ``ROPE``, its queries and keys rotated first, the queries written to ``qo``."""
    t = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    if ROPE:
        pos = tl.load(pos_ptr + t).to(tl.int64)
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
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if WRITE_KV:  # noqa: SIM102 - a constexpr test around a runtime one
        if slot >= 0:  # else padding (e.g. a CUDA-graph batch padded to its captured size)
            h = tl.arange(0, BLOCK_HKV)
            h_ok = h < num_kv_heads
            mask = h_ok[:, None] & (d[None, :] < HEAD_DIM)
            if ROPE:
                k = _rope_rows(k_ptr + t * stride_kt, h * stride_kh, d, h_ok, cos, sin, ROT, NEOX, HEAD_DIM)
                # Round to the activation dtype first: the unfused path writes the rotated k tensor.
                k = k.to(k_ptr.dtype.element_ty).to(tl.float32)
            else:
                k = _head_rows(k_ptr + t * stride_kt, h * stride_kh, d, mask)
            v = _head_rows(v_ptr + t * stride_vt, h * stride_vh, d, mask)
            cache_rows = slot * stride_cs + h[:, None] * stride_ch + d[None, :]
            scales = slot * stride_ss + h * stride_sh  # a per-head scale's slot stride is 0
            _store_rows(kc_ptr + cache_rows, ks_ptr + scales, k, mask, h_ok, QUANT, IS_FP8, QMAX)
            _store_rows(vc_ptr + cache_rows, vs_ptr + scales, v, mask, h_ok, QUANT, IS_FP8, QMAX)


def cache_parts(kv_cache):
    """``(k_cache, v_cache, k_scales, v_scales, quant)`` of a plain tensor or QuantizedKVCache;
    fp8 caches are returned as uint8 views (the kernels bitcast)."""
    if isinstance(kv_cache, QuantizedKVCache):
        data = kv_cache.data
        if data.dtype == torch.float8_e4m3fn:
            data = data.view(torch.uint8)
        return data[0], data[1], kv_cache.scales[0], kv_cache.scales[1], kv_cache.quant
    return kv_cache[0], kv_cache[1], None, None, None


def quant_args(quant: KVQuant | None):
    if quant is None:
        return 0, False, 1.0
    return quant.mode, quant.dtype == torch.float8_e4m3fn, quant.qmax


def scale_strides(ks: torch.Tensor | None, quant: KVQuant | None) -> tuple[int, int, int]:
    """(block, slot, head) strides of a scale tensor: per token ``[nb, bs, H]``, per head ``[H]``."""
    if quant is None:
        return 0, 0, 0
    if quant.granularity == "token":
        return ks.stride(0), ks.stride(1), ks.stride(2)
    return 0, 0, ks.stride(0)


def check_cache(kc: torch.Tensor, ks: torch.Tensor | None, quant: KVQuant | None) -> None:
    # Slots are addressed flat (block * block_size + offset): blocks must be densely packed.
    if kc.stride(0) != kc.shape[1] * kc.stride(1) or kc.stride(-1) != 1:
        raise ValueError("the KV cache must be laid out [blocks, block_size, heads, head_dim] densely")
    if quant is not None and quant.granularity == "token" and ks.stride(0) != ks.shape[1] * ks.stride(1):
        raise ValueError("per-token KV scales must be laid out [blocks, block_size, heads] densely")


@dataclass(frozen=True, slots=True)
class _RopeArgs:
    """What :func:`rope_write_kv` rotates: queries ``q [T, Hq, D]`` (written rotated to ``q_out``)
    and the keys, at ``positions``, with the tables ``cos``/``sin`` ``[max_pos, rot_dim/2]``
    (float32, contiguous rows) over the first ``rot_dim`` dims (``neox``: halves, else adjacent
    pairs)."""

    positions: torch.Tensor
    q: torch.Tensor
    q_out: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    rot_dim: int
    neox: bool


def write_kv(kv_cache, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Scatter ``k``/``v`` ``[T, num_kv_heads, head_dim]`` into their slots (``< 0``: skipped),
    quantizing when ``kv_cache`` is a :class:`QuantizedKVCache`."""
    if k.shape[0] == 0:
        return
    if k.stride(-1) != 1 or v.stride(-1) != 1:
        k, v = k.contiguous(), v.contiguous()
    _launch_write_kv(kv_cache, k, v, slot_mapping, None)


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
    q_out = torch.empty_like(q)
    if q.shape[0] == 0:
        return q_out
    if cos.stride(-1) != 1 or sin.stride() != cos.stride():
        cos, sin = cos.contiguous(), sin.contiguous()
    for x in (q, k, v):
        assert x.stride(-1) == 1, "q/k/v rows must be contiguous in head_dim"
    _launch_write_kv(kv_cache, k, v, slot_mapping, _RopeArgs(positions, q, q_out, cos, sin, rot_dim, neox))
    return q_out


def _launch_write_kv(kv_cache, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor,
                     rope: _RopeArgs | None) -> None:
    """One :func:`_write_kv_kernel` program per token (``k``/``v`` rows contiguous)."""
    t, num_kv_heads, head_dim = k.shape
    if kv_cache is not None:
        kc, vc, ks, vs, quant = cache_parts(kv_cache)
        check_cache(kc, ks, quant)
    else:
        kc, vc, ks, vs, quant = k, v, None, None, None
    mode, is_fp8, qmax = quant_args(quant)
    _, ss, sh = scale_strides(ks, quant)
    if rope is not None:
        q, q_out, positions, cos, sin = rope.q, rope.q_out, rope.positions, rope.cos, rope.sin
    else:  # the query and table arguments are never read: k stands in for them
        q = q_out = positions = cos = sin = k
    num_heads = q.shape[1]
    _write_kv_kernel[(t,)](
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
        ROPE=rope is not None,
        ROT=rope.rot_dim if rope is not None else 0,
        NEOX=rope.neox if rope is not None else False,
        WRITE_KV=kv_cache is not None,
        QUANT=mode,
        IS_FP8=is_fp8,
        QMAX=qmax,
        BLOCK_HQ=triton.next_power_of_2(num_heads),
        BLOCK_HKV=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
        num_warps=4,
    )
