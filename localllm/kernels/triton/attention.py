"""Paged attention in Triton, over an optionally int8/fp8 KV cache.

One kernel serves a whole mixed batch: decode queries (one token) and chunked-prefill queries
(many tokens attending causally to their cached context and to themselves), each sequence
reading its keys and values through its block table (``varlen``: sequences may have any
number of query tokens and any context length; the last block may be partial). The layout is
the reference's (:mod:`localllm.kernels.attention`): a layer's cache is
``[2, num_blocks, block_size, num_kv_heads, head_dim]`` and the metadata is
:class:`~localllm.kernels.attention.AttentionMetadata`, plus ``query_start_loc`` on the device.

GQA/MQA: one program serves one KV head and a tile of query *rows*, where a row is one (token,
query head of that KV head's group) pair, so each K/V tile is loaded once for the whole group.
Head dims need not be powers of two (64, 80, 96, 128, ...). Long contexts with few programs
(decode at small batch) split the KV range over ``num_splits`` programs whose partial results
(normalised output and log-sum-exp) are merged by a second small kernel: flash-decoding.

Gemma-style layers: a sliding window (each row sees only its last ``window`` keys; the key
tiles before a query tile's window are not visited) and attention-logit soft-capping
(``cap * tanh(score / cap)``); gpt-oss's attention sinks (a logit per head in each softmax,
with no value); each switched on by a constexpr flag, so the plain kernel is compiled exactly as
without them.

Quantized KV (:class:`~localllm.kernels.triton.kv.KVQuant`, written by
:mod:`localllm.kernels.triton.kv`): scales are applied inside the attention kernel, folded into the
score (keys) and the probabilities (values), so the tensor-core dot products read the 8-bit values
as they are.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from localllm.kernels.triton.blocks import mma
from localllm.kernels.triton.kv import (
    QuantizedKVCache,
    cache_parts,
    check_cache,
    dequantize_kv_reference,
    e4m3_bits_to_f16,
    quant_args,
    scale_strides,
)
from localllm.kernels.triton.quant import dot_precision
from localllm.kernels.triton.spec import GpuSpec, gpu_spec

_LOG2E = 1.4426950408889634


# ---------------------------------------------------------------------------------------------
# Paged attention


@triton.jit
def _tanh(x):
    """``tanh(x)`` in float32 from one ``exp2`` (no libdevice: the interpreter runs it too);
    within ~1e-7 of the exact value, saturating to +-1 without overflow."""
    e = tl.exp2(-2.8853900817779268 * tl.abs(x))  # exp(-2|x|)
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -t, t)


@triton.jit
def _paged_attention_kernel(
    q_ptr,
    kc_ptr,
    vc_ptr,
    ks_ptr,
    vs_ptr,
    o_ptr,
    po_ptr,
    pl_ptr,
    bt_ptr,
    ctx_ptr,
    qsl_ptr,
    qk_scale,  # softmax scale * log2(e)
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_sb,
    stride_ss,
    stride_sh,
    stride_bt,
    stride_pt,
    stride_ph,
    stride_pp,
    stride_lt,
    stride_lh,
    block_size,
    head_dim,
    window,  # sliding window (USE_WINDOW): a row at q_pos sees keys q_pos - window < t <= q_pos
    softcap,  # logit soft-cap * log2(e) (USE_SOFTCAP): scores -> softcap * tanh(scores / softcap)
    sink_ptr,  # float32 [num_heads] (USE_SINKS): a logit per query head in the softmax, with no value
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    QUANT: tl.constexpr,
    IS_FP8: tl.constexpr,
    DOT_PREC: tl.constexpr,
    USE_WINDOW: tl.constexpr = False,
    USE_SOFTCAP: tl.constexpr = False,
    USE_SINKS: tl.constexpr = False,
):
    seq = tl.program_id(0)
    kvh = tl.program_id(1)
    q_tile = tl.program_id(2) // NUM_SPLITS
    split = tl.program_id(2) % NUM_SPLITS
    TOKENS: tl.constexpr = BLOCK_M // GROUP  # query tokens per tile (rows = tokens x group heads)

    q_start = tl.load(qsl_ptr + seq)
    n_q = tl.load(qsl_ptr + seq + 1) - q_start
    tok0 = q_tile * TOKENS
    if tok0 >= n_q:
        return
    ctx = tl.load(ctx_ptr + seq)

    r = tl.arange(0, BLOCK_M)
    tok = tok0 + r // GROUP
    head = kvh * GROUP + r % GROUP
    row_ok = (r < TOKENS * GROUP) & (tok < n_q)
    q_pos = ctx - n_q + tok  # absolute position: a row sees keys 0 .. q_pos
    d = tl.arange(0, BLOCK_D)
    d_ok = d < head_dim
    q_rows = (q_start + tok).to(tl.int64)
    q = tl.load(
        q_ptr + q_rows[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
        mask=row_ok[:, None] & d_ok[None, :],
        other=0.0,
    )

    # Keys this tile can see, and this split's share of them (whole BLOCK_N tiles).
    kv_len = ctx - n_q + tl.minimum(tok0 + TOKENS, n_q)
    if USE_WINDOW:
        # keys before the tile's first row's window are seen by no row of the tile; the first key
        # tile starts on a BLOCK_N boundary, as for any other row (batch invariance)
        kv_lo = (tl.maximum(ctx - n_q + tok0 - window + 1, 0) // BLOCK_N) * BLOCK_N
        span = tl.cdiv(tl.cdiv(kv_len - kv_lo, NUM_SPLITS), BLOCK_N) * BLOCK_N
        lo = kv_lo + split * span
    else:
        span = tl.cdiv(tl.cdiv(kv_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
        lo = split * span
    hi = tl.minimum(lo + span, kv_len)

    score_scale = qk_scale
    if QUANT == 2:
        score_scale = qk_scale * tl.load(ks_ptr + kvh * stride_sh)
    m_i = tl.full((BLOCK_M,), -1.0e30, dtype=tl.float32)  # finite: fully masked tiles give p = 0, not NaN
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    if USE_SINKS:  # the sink counts once: in the first split's running max and denominator
        sink = tl.load(sink_ptr + head, mask=row_ok, other=0.0) * 1.4426950408889634  # in log2 units
        m_i = tl.where(split == 0, sink, m_i)
        l_i = tl.where(split == 0, 1.0, l_i)  # exp2(sink - m_i)
    acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    n_off = tl.arange(0, BLOCK_N)
    table = bt_ptr + seq.to(tl.int64) * stride_bt
    for start in range(lo, hi, BLOCK_N):
        t = start + n_off
        t_ok = t < hi
        blk = tl.load(table + t // block_size, mask=t_ok, other=0).to(tl.int64)
        slot_off = blk * stride_cb + (t % block_size) * stride_cs + kvh * stride_ch
        kv_mask = t_ok[:, None] & d_ok[None, :]
        k = tl.load(kc_ptr + slot_off[:, None] + d[None, :], mask=kv_mask, other=0)
        v = tl.load(vc_ptr + slot_off[:, None] + d[None, :], mask=kv_mask, other=0)
        if IS_FP8:
            k = e4m3_bits_to_f16(k)
            v = e4m3_bits_to_f16(v)
        s = mma(q, tl.trans(k.to(q.dtype)), DOT_PREC) * score_scale
        if QUANT == 1:
            scale_off = blk * stride_sb + (t % block_size) * stride_ss + kvh * stride_sh
            s = s * tl.load(ks_ptr + scale_off, mask=t_ok, other=0.0)[None, :]
        if USE_SOFTCAP:  # in log2 units: c * log2(e) * tanh(x / c) = C * tanh(x * log2(e) / C)
            s = softcap * _tanh(s / softcap)
        visible = (t[None, :] <= q_pos[:, None]) & t_ok[None, :]
        if USE_WINDOW:
            visible = visible & (q_pos[:, None] - t[None, :] < window)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if QUANT == 1:
            p = p * tl.load(vs_ptr + scale_off, mask=t_ok, other=0.0)[None, :]
        acc = acc * alpha[:, None] + mma(p.to(q.dtype), v.to(q.dtype), DOT_PREC)
        m_i = m_new

    if QUANT == 2:
        acc = acc * tl.load(vs_ptr + kvh * stride_sh)
    has = l_i > 0.0
    out = acc / tl.where(has, l_i, 1.0)[:, None]
    mask = row_ok[:, None] & d_ok[None, :]
    if NUM_SPLITS == 1:
        tl.store(
            o_ptr + q_rows[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
            out.to(o_ptr.dtype.element_ty),
            mask=mask,
        )
    else:
        base = q_rows * stride_pt + head * stride_ph + split * stride_pp
        tl.store(po_ptr + base[:, None] + d[None, :], out, mask=mask)
        lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
        tl.store(pl_ptr + q_rows * stride_lt + head * stride_lh + split, lse, mask=row_ok)


@triton.jit
def _merge_splits_kernel(
    po_ptr,
    pl_ptr,
    o_ptr,
    stride_pt,
    stride_ph,
    stride_pp,
    stride_lt,
    stride_lh,
    stride_ot,
    stride_oh,
    head_dim,
    NUM_SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    s_ok = s < NUM_SPLITS
    lse = tl.load(pl_ptr + t * stride_lt + h * stride_lh + s, mask=s_ok, other=float("-inf"))
    mx = tl.max(lse, axis=0)
    mx = tl.where(mx == float("-inf"), 0.0, mx)
    w = tl.exp2(lse - mx)
    parts = tl.load(
        po_ptr + t * stride_pt + h * stride_ph + s[:, None] * stride_pp + d[None, :],
        mask=s_ok[:, None] & (d[None, :] < head_dim),
        other=0.0,
    )
    den = tl.sum(w, axis=0)
    out = tl.sum(parts * w[:, None], axis=0) / tl.where(den > 0.0, den, 1.0)
    tl.store(o_ptr + t * stride_ot + h * stride_oh + d, out.to(o_ptr.dtype.element_ty), mask=d < head_dim)


def choose_num_splits(
    num_seqs: int,
    num_kv_heads: int,
    num_q_tiles: int,
    max_context: int,
    device: torch.device,
    block_n: int = 64,
) -> int:
    """KV splits for flash-decoding: enough programs for about two waves of SMs (1 on CPU or
    when the batch alone fills the GPU; at most one split per 256 keys, at most 32)."""
    spec = gpu_spec(device)
    if spec is None:
        return 1
    programs = num_seqs * num_kv_heads * num_q_tiles
    target = 2 * spec.num_sms
    if programs >= target:
        return 1
    return max(1, min(32, triton.cdiv(target, programs), triton.cdiv(max_context, 256)))


@dataclass(frozen=True, slots=True)
class AttentionTile:
    """How one attention launch is tiled: ``block_m`` rows (query tokens x the group's heads) by
    ``block_n`` keys, ``num_warps`` warps, ``num_stages`` stages of K/V tiles in flight."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


# Keys per tile and warps, by (bytes per query element, head dim padded to a power of two), for
# decode tiles (16 rows) and prompt tiles (64 rows); ``None``: prompts take the decode tile. Chosen
# with the real compiler (``localllm.kernels.triton.compile``): two stages of K/V tiles fit the
# 99 KiB of an RTX 3060-4090 (sm_86/89) with no register spills, float32 included.
_TILES: dict[tuple[int, int], tuple[tuple[int, int], tuple[int, int] | None]] = {
    (2, 64): ((64, 4), (32, 4)),
    (2, 128): ((64, 4), (64, 8)),
    (2, 256): ((32, 4), (32, 8)),
    (4, 64): ((32, 4), (32, 8)),
    (4, 128): ((16, 4), None),
    (4, 256): ((16, 4), None),
}
ATTENTION_STAGES = 2


def attention_tile(spec: GpuSpec | None, *, group: int, head_dim: int, dtype: torch.dtype, decode: bool) -> AttentionTile:
    """The tile for a launch on ``spec`` (``None``: the interpreter) with ``dtype`` queries (and a
    cache of that dtype, or of 8 bits) and ``head_dim``; ``decode``: the decode tile shape (every
    query of a batch-invariant launch takes it, so a prompt token sees the key tiles a decode at
    its position sees)."""
    rows = triton.next_power_of_2(group)
    if spec is None:  # the interpreter's cost is per program: fewer, larger tiles
        return AttentionTile(max(16 if decode else 32, rows), 32, 4, 1)
    d = min(256, max(64, triton.next_power_of_2(head_dim)))
    decode_tile, prompt_tile = _TILES[(4 if dtype == torch.float32 else 2, d)]
    if decode or prompt_tile is None:
        block_n, warps = decode_tile
        block_m = max(16, rows)
        if block_m > 16:  # a group of more than 16 heads: rows of a prompt tile
            warps = (prompt_tile or decode_tile)[1]
    else:
        (block_n, warps), block_m = prompt_tile, max(64, rows)
    return AttentionTile(block_m, block_n, warps, ATTENTION_STAGES)


def paged_attention(
    q: torch.Tensor,
    kv_cache,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    max_query_len: int,
    scale: float,
    *,
    max_context_len: int | None = None,
    num_splits: int | None = None,
    out: torch.Tensor | None = None,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    invariant: bool = False,
) -> torch.Tensor:
    """Causal paged attention of ``q [T, num_heads, head_dim]`` against the cache (which already
    holds this step's keys/values). ``query_start_loc`` (int32/int64 ``[S+1]``, on the device)
    delimits each sequence's query tokens, which are its last ``n`` positions before
    ``context_lens[i]``; ``max_query_len`` (host int) sizes the grid. ``num_splits`` overrides
    the flash-decoding heuristic (which needs ``max_context_len``, a host int).
    ``sliding_window`` / ``logit_softcap`` / ``sinks``: as in the reference
    (:func:`localllm.kernels.attention.paged_attention`); ``None``: off (compiled out). A sink is
    one more logit of its head's rows, folded into the online softmax's running max and
    denominator before the first key tile (of the first KV split only).
    ``invariant``: batch-invariant, a row's result independent of the other sequences, of how
    many query tokens share its launch and of where a prompt was cut: the decode tile shape for
    every query (a prompt token is computed as a decode at its position would be: its tile's keys
    are the same aligned blocks, the ones past its position masked to an exact no-op) and no KV
    splits (``num_splits`` is ignored)."""
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")
    kc, vc, ks, vs, quant = cache_parts(kv_cache)
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = kc.shape
    group = num_heads // num_kv_heads
    num_seqs = query_start_loc.shape[0] - 1
    if out is None:
        out = torch.empty_like(q)
    if num_tokens == 0 or num_seqs == 0:
        return out
    spec = gpu_spec(q.device)
    tile = attention_tile(spec, group=group, head_dim=head_dim, dtype=q.dtype, decode=invariant or max_query_len == 1)
    tokens_per_tile = tile.block_m // group
    num_q_tiles = triton.cdiv(max_query_len, tokens_per_tile)
    if invariant:
        num_splits = 1
    elif num_splits is None:
        keys = max_context_len or 0
        if sliding_window is not None:  # a decode reads at most its window
            keys = min(keys, sliding_window)
        num_splits = choose_num_splits(num_seqs, num_kv_heads, num_q_tiles, keys, q.device, tile.block_n)
    check_cache(kc, ks, quant)
    if sinks is not None:
        sinks = sinks.to(device=q.device, dtype=torch.float32).contiguous()
        if sinks.shape != (num_heads,):
            raise ValueError(f"sinks must be [{num_heads}] (one per query head), got {tuple(sinks.shape)}")
    mode, is_fp8, _ = quant_args(quant)
    sb, ss, sh = scale_strides(ks, quant)
    if num_splits > 1:
        part_out = torch.empty(
            (num_tokens, num_heads, num_splits, head_dim), dtype=torch.float32, device=q.device
        )
        part_lse = torch.empty((num_tokens, num_heads, num_splits), dtype=torch.float32, device=q.device)
    else:
        part_out = part_lse = out
    _paged_attention_kernel[(num_seqs, num_kv_heads, num_q_tiles * num_splits)](
        q,
        kc,
        vc,
        ks if ks is not None else kc,
        vs if vs is not None else vc,
        out,
        part_out,
        part_lse,
        block_tables,
        context_lens,
        query_start_loc,
        scale * _LOG2E,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        kc.stride(0),
        kc.stride(1),
        kc.stride(2),
        sb,
        ss,
        sh,
        block_tables.stride(0),
        *(_split_strides(part_out, part_lse) if num_splits > 1 else (0,) * 5),
        block_size,
        head_dim,
        0 if sliding_window is None else int(sliding_window),
        1.0 if logit_softcap is None else float(logit_softcap) * _LOG2E,
        sinks if sinks is not None else q,
        GROUP=group,
        BLOCK_M=tile.block_m,
        BLOCK_N=tile.block_n,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        NUM_SPLITS=num_splits,
        QUANT=mode,
        IS_FP8=is_fp8,
        DOT_PREC=dot_precision(q.dtype, spec),
        USE_WINDOW=sliding_window is not None,
        USE_SOFTCAP=logit_softcap is not None,
        USE_SINKS=sinks is not None,
        num_warps=tile.num_warps,
        num_stages=tile.num_stages,
    )
    if num_splits > 1:
        _merge_splits_kernel[(num_tokens, num_heads)](
            part_out,
            part_lse,
            out,
            *_split_strides(part_out, part_lse),
            out.stride(0),
            out.stride(1),
            head_dim,
            NUM_SPLITS=num_splits,
            BLOCK_S=triton.next_power_of_2(num_splits),
            BLOCK_D=triton.next_power_of_2(head_dim),
        )
    return out


def _split_strides(part_out: torch.Tensor, part_lse: torch.Tensor) -> tuple[int, ...]:
    """The strides of the KV splits' partial outputs ``[T, H, splits, D]`` and log-sum-exps
    ``[T, H, splits]`` that both kernels take: ``stride_pt, stride_ph, stride_pp, stride_lt,
    stride_lh``."""
    return (*part_out.stride()[:3], *part_lse.stride()[:2])


def attention_reference_quant(q, cache: QuantizedKVCache, meta, scale: float, **features) -> torch.Tensor:
    """Reference for quantized KV: the torch paged attention over the dequantized cache
    (``features``: its ``sliding_window`` / ``logit_softcap`` / ``sinks``)."""
    from localllm.kernels.attention import paged_attention as torch_paged_attention

    return torch_paged_attention(q, dequantize_kv_reference(cache).to(q.dtype), meta, scale, **features)
