"""Paged attention over a block-structured KV cache: the pure-torch reference path.

The KV cache of one layer is a tensor ``[2, num_blocks, block_size, num_kv_heads, head_dim]``, or
a :class:`~localllm.quant.kv_rows.SplitKvCache` (quantized keys or values: read here as the float32
values they stand for, only the blocks a step reads). A sequence's tokens live in the blocks listed
by its block table, in order; token ``p`` of a sequence sits at slot
``block_table[p // block_size] * block_size + p % block_size``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from localllm.quant.kv_rows import KvRowType, SplitKvCache, dequantize_rows, hadamard, quantize_rows


@dataclass(slots=True)
class AttentionMetadata:
    """Describes one flat batch of tokens drawn from several sequences.

    Sequences appear in ``query_start_loc`` order; sequence ``i`` owns query tokens
    ``query_start_loc[i]:query_start_loc[i+1]`` whose positions are
    ``context_lens[i] - num_query_tokens(i) .. context_lens[i] - 1`` (its new tokens come last).
    Decodes (one query token) come first: ``num_decodes`` of them.
    """

    slot_mapping: torch.Tensor  # [num_tokens] int64, where each new token's K/V is written
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int64, padded with 0
    context_lens: torch.Tensor  # [num_seqs] int64, tokens in KV after this step
    query_start_loc: list[int]  # [num_seqs + 1], host-side
    context_lens_host: list[int]
    num_decodes: int
    block_size: int
    step_cache: dict | None = None  # when a dict: per-step tensors derived once, shared by the layers
    # per sequence, the recurrent state of linear-attention layers (models.linear_attention's
    # StateStep: the rows it reads, writes and records into); None: each sequence starts at 0 and
    # its state is dropped
    state_slots: list | None = None
    # a list where the step verifies drafts: each linear-attention layer appends its inputs, so that
    # the runner can recompute a sequence's state over only the tokens it keeps
    state_replay: list | None = None

    @property
    def num_seqs(self) -> int:
        return len(self.context_lens_host)

    @property
    def has_prompt_tokens(self) -> bool:
        """Whether the step has prompt tokens (a prefill chunk, alone or beside decodes): a
        backend may compute such steps more precisely (their K/V is read by every later token)."""
        return self.num_decodes < len(self.context_lens_host)


def write_kv(kv_cache: torch.Tensor | SplitKvCache, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Scatter new keys/values ``[num_tokens, num_kv_heads, head_dim]`` into their slots."""
    if isinstance(kv_cache, SplitKvCache):
        at = (slot_mapping // kv_cache.block_size, slot_mapping % kv_cache.block_size)
        kv_cache.k.index_put_(at, quantize_rows(hadamard(k.float(), kv_cache.k_rotation), kv_cache.types.k))
        kv_cache.v.index_put_(at, quantize_rows(hadamard(v.float(), kv_cache.v_rotation), kv_cache.types.v))
        return
    _, num_blocks, block_size, nkv, hd = kv_cache.shape
    flat = kv_cache.view(2, num_blocks * block_size, nkv, hd)
    flat[0].index_copy_(0, slot_mapping, k.to(kv_cache.dtype))
    flat[1].index_copy_(0, slot_mapping, v.to(kv_cache.dtype))


class _CodedRows:
    """One side (K or V) of a :class:`SplitKvCache` as the attention below reads a float cache's
    ``[num_blocks, block_size, num_kv_heads, head_dim]``: the blocks it takes, as float32."""

    def __init__(self, rows: torch.Tensor, t: KvRowType, head_dim: int) -> None:
        self.rows, self.type, self.head_dim = rows, t, head_dim
        self.shape = (*rows.shape[:3], head_dim)

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        return dequantize_rows(self.rows.narrow(dim, start, length), self.type, self.head_dim)

    def index_select(self, dim: int, index: torch.Tensor) -> torch.Tensor:
        return dequantize_rows(self.rows.index_select(dim, index), self.type, self.head_dim)


def _rotations(kv_cache) -> tuple[int, int]:
    """A split cache's keys' and values' Walsh-Hadamard blocks (the queries are turned as the keys
    were, the output back as the values were); ``(0, 0)`` for a float cache."""
    return (kv_cache.k_rotation, kv_cache.v_rotation) if isinstance(kv_cache, SplitKvCache) else (0, 0)


def kv_sides(kv_cache: torch.Tensor | SplitKvCache):
    """The K and V of a layer's cache, each read by block as ``[num_blocks, block_size,
    num_kv_heads, head_dim]`` (``narrow`` and ``index_select`` on the blocks)."""
    if isinstance(kv_cache, SplitKvCache):
        return (_CodedRows(kv_cache.k, kv_cache.types.k, kv_cache.head_dim),
                _CodedRows(kv_cache.v, kv_cache.types.v, kv_cache.head_dim))
    return kv_cache[0], kv_cache[1]


def _decode_mask(meta: AttentionMetadata, span: int, window: int | None = None) -> torch.Tensor:
    """``[num_decodes, 1, 1, span]``: which padded key positions each decode may attend to
    (with a sliding ``window``: only the last ``window`` of its context)."""
    cache = meta.step_cache
    key = ("decode_mask", span) if window is None else ("decode_mask", span, window)
    if cache is not None and key in cache:
        return cache[key]
    nd = meta.num_decodes
    pos = torch.arange(span, device=meta.context_lens.device)[None, :]
    ctx = meta.context_lens[:nd, None]
    mask = pos < ctx
    if window is not None:
        mask &= pos >= ctx - window  # ctx - 1 - j < window
    mask = mask.view(nd, 1, 1, span)
    if cache is not None:
        cache[key] = mask
    return mask


def _sdpa_dtypes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    """SDPA operands in float32 (a half-precision model's are upcast; float32 ones pass as they are)."""
    if q.dtype == k.dtype == torch.float32:
        return q, k, v
    return q.float(), k.float(), v.float()


def _first_of_run(meta: AttentionMetadata, seq: int, nblk: int) -> int | None:
    """The first block id if sequence ``seq``'s first ``nblk`` blocks are consecutive ids (then
    its K/V is a slice of the cache, no gather needed); else ``None``. Host tables only."""
    cache = meta.step_cache
    if cache is None or not meta.block_tables.is_cpu:
        return None
    key = ("run", seq, nblk)
    if key not in cache:
        tables = cache.get("tables")
        if tables is None:
            tables = cache["tables"] = meta.block_tables.tolist()
        row = tables[seq][:nblk]
        first = row[0]
        cache[key] = first if row == list(range(first, first + nblk)) else None
    return cache[key]


def _seq_kv(k_cache, v_cache, meta: AttentionMetadata, seq: int, nblk: int):
    """K and V ``[nblk * block_size, num_kv_heads, head_dim]`` of sequence ``seq``'s first ``nblk``
    blocks: a view of the cache when they are consecutive, a gathered copy otherwise."""
    first = _first_of_run(meta, seq, nblk)
    if first is not None:
        return k_cache.narrow(0, first, nblk).flatten(0, 1), v_cache.narrow(0, first, nblk).flatten(0, 1)
    table = meta.block_tables[seq, :nblk]
    return k_cache.index_select(0, table).flatten(0, 1), v_cache.index_select(0, table).flatten(0, 1)


def paged_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor | SplitKvCache,
    meta: AttentionMetadata,
    scale: float,
    *,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of ``q [num_tokens, num_heads, head_dim]`` against the cached K/V.

    Decode queries are batched into one padded computation; each prompt chunk attends to
    its cached context plus itself with a causal mask.

    ``sliding_window``: a query at position ``p`` sees the key at ``j`` only if
    ``p - j < sliding_window`` (besides ``j <= p``). ``logit_softcap``: the scores
    ``s = scale * q.k`` become ``logit_softcap * tanh(s / logit_softcap)`` before the mask and
    the softmax (Gemma 2). ``sinks`` ``[num_heads]``: one more logit per query head in each
    softmax, whose share of the probability brings no value (gpt-oss; transformers' ``s_aux``,
    llama.cpp's ``attn_sinks``): ``softmax([s, sink])`` without its last column. ``None``: off (a
    prompt chunk's attention then takes SDPA's causal path).
    """
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")
    num_heads, head_dim = q.shape[1:]
    k_rot, v_rot = _rotations(kv_cache)
    q = hadamard(q, k_rot)
    out = torch.empty_like(q)
    k_cache, v_cache = kv_sides(kv_cache)
    nd = meta.num_decodes
    if nd:
        od = _decode_attention(q[:nd], k_cache, v_cache, meta, scale, sliding_window, logit_softcap, sinks)
        if nd == meta.num_seqs and od.dtype == q.dtype:  # a decode-only step: no prompt rows to add
            return hadamard(od.reshape(nd, num_heads, head_dim), v_rot)
        out[:nd] = od.reshape(nd, num_heads, head_dim)
    plain = sliding_window is None and logit_softcap is None and sinks is None
    for i in range(nd, meta.num_seqs):
        start, end = meta.query_start_loc[i], meta.query_start_loc[i + 1]
        ctx = meta.context_lens_host[i]
        k, v = _seq_kv(k_cache, v_cache, meta, i, (ctx + meta.block_size - 1) // meta.block_size)
        if plain:
            out[start:end] = _prompt_attention(q[start:end], k[:ctx], v[:ctx], scale)
        else:
            _prompt_attention_ext(out[start:end], q[start:end], k, v, meta, i, ctx, scale, sliding_window,
                                  logit_softcap, sinks)
    return hadamard(out, v_rot)


def paged_attention_rows_alone(
    q: torch.Tensor,
    kv_cache: torch.Tensor | SplitKvCache,
    meta: AttentionMetadata,
    scale: float,
    *,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`paged_attention`, each query row computed alone, as a lone decode at its position is:
    against exactly the keys it sees (its window's, up to itself), with no padding and no other
    row in its operations. A row's bits then do not depend on the other rows of its step, nor on
    where a prompt was cut into chunks (batch invariance), at the cost of one computation per row."""
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")
    k_rot, v_rot = _rotations(kv_cache)
    q = hadamard(q, k_rot)
    out = torch.empty_like(q)
    k_cache, v_cache = kv_sides(kv_cache)
    nkv, head_dim = k_cache.shape[2], k_cache.shape[3]
    group = q.shape[1] // nkv
    head_sinks = None if sinks is None else sinks.float().view(nkv, group, 1)
    for i in range(meta.num_seqs):
        start, end = meta.query_start_loc[i], meta.query_start_loc[i + 1]
        ctx = meta.context_lens_host[i]
        # the sequence's blocks gathered once (never a view of the cache: each row's keys then
        # lie at the same offset of a fresh copy, whichever step computes it)
        table = meta.block_tables[i, : (ctx + meta.block_size - 1) // meta.block_size]
        k = k_cache.index_select(0, table).flatten(0, 1)
        v = v_cache.index_select(0, table).flatten(0, 1)
        for row in range(start, end):
            seen = ctx - (end - row) + 1  # keys 0 .. its position
            lo = 0 if sliding_window is None else max(0, seen - sliding_window)
            # 4-D operands, as a lone decode's (SDPA's fused CPU kernel)
            qd, kd, vd = _sdpa_dtypes(q[row].view(1, nkv, group, head_dim), k[None, lo:seen].transpose(1, 2),
                                      v[None, lo:seen].transpose(1, 2))
            out[row] = _attend(qd, kd, vd, None, scale, logit_softcap, head_sinks).reshape(-1, head_dim)
    return hadamard(out, v_rot)


def _attend(q, k, v, mask, scale: float, softcap, sinks) -> torch.Tensor:
    """SDPA, or the scores spelled out where it cannot (soft-capping, sinks): ``q [..., n, D]``
    against ``k``/``v`` ``[..., L, D]``; ``sinks`` broadcasting to ``[..., n, 1]``."""
    if softcap is None and sinks is None:
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    return _explicit_attention(q, k, v, mask, scale, softcap, sinks)


def _decode_attention(
    q, k_cache, v_cache, meta: AttentionMetadata, scale: float, window, softcap, sinks=None
) -> torch.Tensor:
    """The decodes' attention in one batched computation: ``q [nd, num_heads, head_dim]`` ->
    ``[nd, num_kv_heads, group, head_dim]`` (float32 for a half-precision model)."""
    nd, num_heads, head_dim = q.shape
    nkv = k_cache.shape[2]
    bs = meta.block_size
    max_ctx = max(meta.context_lens_host[:nd])
    nblk = (max_ctx + bs - 1) // bs
    span = nblk * bs
    if nd == 1:  # no padding: the whole context, or its last ``window`` keys
        k, v = _seq_kv(k_cache, v_cache, meta, 0, nblk)
        lo = 0 if window is None else max(0, max_ctx - window)
        k, v, mask = k[None, lo:max_ctx], v[None, lo:max_ctx], None
    else:
        flat = meta.block_tables[:nd, :nblk].reshape(-1)
        k = k_cache.index_select(0, flat).view(nd, span, nkv, head_dim)
        v = v_cache.index_select(0, flat).view(nd, span, nkv, head_dim)
        mask = _decode_mask(meta, span, window)
    # The `group` query heads that share a KV head act as its query rows.
    group = num_heads // nkv
    qd, k, v = _sdpa_dtypes(q.view(nd, nkv, group, head_dim), k.transpose(1, 2), v.transpose(1, 2))
    return _attend(qd, k, v, mask, scale, softcap, None if sinks is None else sinks.float().view(nkv, group, 1))


def _prompt_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """A prompt chunk's causal attention, ``q [n_q, num_heads, D]`` against its sequence's keys
    and values ``[ctx, num_kv_heads, D]`` (its own tokens last)."""
    n_q, ctx = q.shape[0], k.shape[0]
    grouped = q.shape[1] > k.shape[1]  # GQA: several query heads per KV head
    # query j (absolute position ctx - n_q + j) sees keys 0 .. ctx - n_q + j; with no cached
    # context that is SDPA's own causal mask, which lets the kernel skip the masked blocks
    if ctx == n_q:
        mask = None
    else:
        q_pos = torch.arange(ctx - n_q, ctx, device=q.device)[:, None]
        mask = torch.arange(ctx, device=q.device)[None, :] <= q_pos
    # 4-D operands: SDPA's fused CPU kernel (3-D ones take a much slower fallback)
    qs, k, v = _sdpa_dtypes(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None])
    o = torch.nn.functional.scaled_dot_product_attention(
        qs, k, v, attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=grouped
    )
    return o[0].transpose(0, 1)


_SOFTCAP_CHUNK = 1 << 24
"""Score elements the explicit (soft-capped or sink) path materialises at once for a prompt chunk."""


def _explicit_attention(q, k, v, mask, scale: float, softcap: float | None, sinks) -> torch.Tensor:
    """Attention spelled out, for what SDPA cannot do (soft-capped scores, sinks): ``q [..., n, D]``,
    ``k``/``v`` ``[..., L, D]`` (broadcast against ``q``'s leading dims), ``mask`` (bool, True:
    visible) broadcasting to ``[..., n, L]`` or ``None``, ``sinks`` broadcasting to
    ``[..., n, 1]`` or ``None``; float32 throughout. With sinks, the softmax runs over the scores
    and the sink (transformers' ``GptOssAttention``) and the sink's column is dropped."""
    s = torch.matmul(q, k.transpose(-1, -2)).mul_(scale)
    if softcap is not None:
        s = s.div_(softcap).tanh_().mul_(softcap)
    if mask is not None:
        s = s.masked_fill_(~mask, float("-inf"))
    if sinks is None:
        return torch.matmul(torch.softmax(s, dim=-1), v)
    s = torch.cat((s, sinks.expand(*s.shape[:-1], 1)), dim=-1)
    return torch.matmul(torch.softmax(s, dim=-1)[..., :-1], v)


def _prompt_mask(meta: AttentionMetadata, seq: int, n_q: int, ctx: int, lo: int, window: int | None, device):
    """``[n_q, ctx - lo]`` (True: visible) of prompt chunk ``seq``, whose keys start at ``lo``;
    ``None`` where every key is visible to every query."""
    if n_q == 1:  # one query: every key from ``lo`` on is visible (``lo`` applies the window)
        return None
    cache = meta.step_cache
    key = ("prompt_mask", seq, n_q, ctx, lo, window)
    if cache is not None and key in cache:
        return cache[key]
    q_pos = torch.arange(ctx - n_q, ctx, device=device)[:, None]
    k_pos = torch.arange(lo, ctx, device=device)[None, :]
    mask = k_pos <= q_pos
    if window is not None:
        mask &= q_pos - k_pos < window
    if cache is not None:
        cache[key] = mask
    return mask


def _prompt_attention_ext(out, q, k, v, meta: AttentionMetadata, seq: int, ctx: int, scale: float, window,
                          softcap, sinks=None) -> None:
    """:func:`_prompt_attention` with a sliding window, logit soft-capping and/or sinks, into
    ``out`` (``k``/``v``: the keys and values of the sequence's blocks, ``ctx`` of them in use)."""
    n_q, num_heads, head_dim = q.shape
    nkv = k.shape[1]
    group = num_heads // nkv
    # keys before the first query's window are seen by no query of the chunk
    lo = 0 if window is None else max(0, ctx - n_q - window + 1)
    k, v = k[lo:ctx], v[lo:ctx]
    mask = _prompt_mask(meta, seq, n_q, ctx, lo, window, q.device)
    if softcap is None and sinks is None:  # (so a window: no causal shortcut)
        qs, k, v = _sdpa_dtypes(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None])
        o = torch.nn.functional.scaled_dot_product_attention(
            qs, k, v, attn_mask=mask, scale=scale, enable_gqa=group > 1
        )
        out.copy_(o[0].transpose(0, 1))
        return
    # [nkv, group, n_q, D] queries against [nkv, 1, L, D] keys, a few query rows at a time
    qs, k, v = _sdpa_dtypes(
        q.view(n_q, nkv, group, head_dim).permute(1, 2, 0, 3), k.transpose(0, 1)[:, None],
        v.transpose(0, 1)[:, None],
    )
    head_sinks = None if sinks is None else sinks.float().view(nkv, group, 1, 1)
    rows = max(1, _SOFTCAP_CHUNK // max(1, num_heads * k.shape[-2]))
    for r in range(0, n_q, rows):
        m = None if mask is None else mask[r : r + rows]
        o = _explicit_attention(qs[:, :, r : r + rows], k, v, m, scale, softcap, head_sinks)
        out[r : r + o.shape[2]] = o.permute(2, 0, 1, 3).reshape(-1, num_heads, head_dim)
