"""Paged attention over a block-structured KV cache: the pure-torch reference path.

The KV cache of one layer is a tensor ``[2, num_blocks, block_size, num_kv_heads, head_dim]``.
A sequence's tokens live in the blocks listed by its block table, in order; token ``p`` of a
sequence sits at slot ``block_table[p // block_size] * block_size + p % block_size``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


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

    @property
    def num_seqs(self) -> int:
        return len(self.context_lens_host)


def write_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Scatter new keys/values ``[num_tokens, num_kv_heads, head_dim]`` into their slots."""
    _, num_blocks, block_size, nkv, hd = kv_cache.shape
    flat = kv_cache.view(2, num_blocks * block_size, nkv, hd)
    flat[0].index_copy_(0, slot_mapping, k.to(kv_cache.dtype))
    flat[1].index_copy_(0, slot_mapping, v.to(kv_cache.dtype))


def paged_attention(
    q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float
) -> torch.Tensor:
    """Causal attention of ``q [num_tokens, num_heads, head_dim]`` against the cached K/V.

    Decode queries are batched into one padded computation; each prompt chunk attends to
    its cached context plus itself with a causal mask.
    """
    num_tokens, num_heads, head_dim = q.shape
    nkv = kv_cache.shape[3]
    group = num_heads // nkv
    bs = meta.block_size
    out = torch.empty_like(q)
    k_cache, v_cache = kv_cache[0], kv_cache[1]

    nd = meta.num_decodes
    if nd:
        max_ctx = max(meta.context_lens_host[:nd])
        nblk = (max_ctx + bs - 1) // bs
        tables = meta.block_tables[:nd, :nblk]
        k = k_cache[tables].reshape(nd, nblk * bs, nkv, head_dim)[:, :max_ctx]
        v = v_cache[tables].reshape(nd, nblk * bs, nkv, head_dim)[:, :max_ctx]
        qd = q[:nd].view(nd, nkv, group, head_dim)
        scores = torch.einsum("bhgd,bthd->bhgt", qd.float(), k.float()) * scale
        valid = torch.arange(max_ctx, device=q.device)[None, :] < meta.context_lens[:nd, None]
        scores.masked_fill_(~valid[:, None, None, :], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        od = torch.einsum("bhgt,bthd->bhgd", probs, v.float())
        out[:nd] = od.reshape(nd, num_heads, head_dim).to(q.dtype)

    for i in range(nd, meta.num_seqs):
        start, end = meta.query_start_loc[i], meta.query_start_loc[i + 1]
        n_q = end - start
        ctx = meta.context_lens_host[i]
        nblk = (ctx + bs - 1) // bs
        table = meta.block_tables[i, :nblk]
        k = k_cache[table].reshape(nblk * bs, nkv, head_dim)[:ctx]
        v = v_cache[table].reshape(nblk * bs, nkv, head_dim)[:ctx]
        if group > 1:
            k = k.repeat_interleave(group, dim=1)
            v = v.repeat_interleave(group, dim=1)
        # query j (absolute position ctx - n_q + j) sees keys 0 .. ctx - n_q + j
        q_pos = torch.arange(ctx - n_q, ctx, device=q.device)[:, None]
        mask = torch.arange(ctx, device=q.device)[None, :] <= q_pos
        o = torch.nn.functional.scaled_dot_product_attention(
            q[start:end].transpose(0, 1).float(),
            k.transpose(0, 1).float(),
            v.transpose(0, 1).float(),
            attn_mask=mask,
            scale=scale,
        )
        out[start:end] = o.transpose(0, 1).to(q.dtype)
    return out
