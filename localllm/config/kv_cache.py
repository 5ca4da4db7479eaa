"""How large a KV cache the settings give, and the context it serves: the one sizing that the memory
planner (before a load, from the file's header) and the engine (at load, from the model) share.

Plain arithmetic over bytes and tokens: the caller says what one token's K and V take and how many
bytes the cache may have (``--kv-cache-memory``, or, on a GPU, what is free once the weights are
loaded), and :func:`size_kv_cache` answers in whole blocks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from localllm.config.engine import DEFAULT_KV_CACHE_MEMORY, UNKNOWN_MODEL_CONTEXT, kv_row_bytes

MIB = 1 << 20


def mib_text(n: int) -> str:
    """``n`` bytes as people read them: MiB, or GiB from 10 GiB up."""
    return f"{n / MIB:,.0f} MiB" if n < 10 * 1024 * MIB else f"{n / (1024 * MIB):,.1f} GiB"


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, k_type: str, v_type: str) -> int:
    """One token's K and V over every layer, in the cache types ``k_type`` and ``v_type``."""
    return num_layers * num_kv_heads * (kv_row_bytes(k_type, head_dim) + kv_row_bytes(v_type, head_dim))


def default_context(model_context: int | None, max_model_len: int | None) -> int:
    """The context asked for: ``max_model_len`` where given, else the model's (trained, or scaled by
    its RoPE scaling; :data:`UNKNOWN_MODEL_CONTEXT` where the file names none); never more than the
    model's."""
    model_context = model_context or UNKNOWN_MODEL_CONTEXT
    return min(max_model_len or model_context, model_context)


KV_SHARE_OF_FREE = 2
"""A default KV cache larger than :data:`DEFAULT_KV_CACHE_MEMORY` (a long context's) takes at most
one part in this many of the memory free once the weights are in: the rest stays for the machine."""


def default_kv_budget(bytes_per_token: int, block_size: int, context: int, free_bytes: int | None) -> int:
    """The KV cache's bytes when ``--kv-cache-memory`` does not set them: one request of ``context``
    tokens, at least :data:`DEFAULT_KV_CACHE_MEMORY`; above that at most a
    :data:`KV_SHARE_OF_FREE`-th of ``free_bytes`` (the memory free once the weights are in; ``None``:
    not bounded). Where that bound holds less than the context, :func:`size_kv_cache` lowers the
    context served and says so."""
    context_bytes = -(-context // block_size) * block_size * max(bytes_per_token, 1)
    budget = max(context_bytes, DEFAULT_KV_CACHE_MEMORY)
    if free_bytes is not None:
        budget = min(budget, max(free_bytes // KV_SHARE_OF_FREE, DEFAULT_KV_CACHE_MEMORY))
    return budget


# The share of a hybrid model's spare budget (beyond one request's context of KV cache and the
# running requests' states) that its prefix-cache checkpoints take; the KV cache keeps the rest.
CHECKPOINT_SHARE = 4  # one part in this many


class StateSplit(NamedTuple):
    """A hybrid model's budget: its recurrent-state slots, its prefix-cache checkpoints, and the
    bytes left for the KV cache."""

    slots: int
    checkpoints: int
    kv_bytes: int


def split_for_states(bytes_per_slot: int, context_bytes: int, max_num_seqs: int, budget_bytes: int | None = None,
                     bytes_per_block: int = 1, bytes_per_checkpoint: int = 0) -> StateSplit:
    """A hybrid model's recurrent states (``bytes_per_slot`` each, one per running request) take what
    the budget (default :data:`DEFAULT_KV_CACHE_MEMORY`) holds beyond a KV cache of
    ``context_bytes`` (one request of the context), up to ``max_num_seqs`` of them and at least
    one; checkpoints of a state (``bytes_per_checkpoint`` each; 0: none, prefix caching off) one
    :data:`CHECKPOINT_SHARE`-th of what is left beyond that context, no more than the KV cache
    has blocks (``bytes_per_block``: a checkpoint is kept beside a cached block); the KV cache the rest."""
    budget = DEFAULT_KV_CACHE_MEMORY if budget_bytes is None else budget_bytes
    slots = max(1, min(max_num_seqs, (budget - context_bytes) // max(bytes_per_slot, 1)))
    rest = max(budget - slots * bytes_per_slot, 0)
    checkpoints = 0
    if bytes_per_checkpoint:
        spare = max(rest - context_bytes, 0) // CHECKPOINT_SHARE
        checkpoints = min(spare // bytes_per_checkpoint, rest // max(bytes_per_block, 1))
    return StateSplit(slots, checkpoints, rest - checkpoints * bytes_per_checkpoint)


@dataclass(frozen=True, slots=True)
class KvCacheSize:
    """A KV cache in whole blocks, and the context the engine serves with it."""

    num_blocks: int
    block_size: int
    bytes_per_token: int
    context_length: int
    """The context served: the one asked for, lowered to what the cache holds when none was asked."""
    lowered_from: int | None = None
    """The default context, when the cache holds less (the engine says so in one line)."""
    problem: str | None = None
    """A ``max_model_len`` the cache cannot hold: an error, never a silent cut."""
    note: str | None = None
    """A ``max_model_len`` over the model's context, which is served instead."""

    @property
    def tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def bytes(self) -> int:
        return self.tokens * self.bytes_per_token


def size_kv_cache(bytes_per_token: int, block_size: int, model_context: int | None, *,
                  max_model_len: int | None = None, budget_bytes: int | None = None) -> KvCacheSize:
    """The cache ``budget_bytes`` holds (default :func:`default_kv_budget`'s, not bounded by memory;
    at least one block) for tokens of ``bytes_per_token``, and the context it serves for a model
    trained on ``model_context`` tokens with ``max_model_len`` asked for (``None``: the default
    context)."""
    bytes_per_token = max(bytes_per_token, 1)
    wanted = default_context(model_context, max_model_len)
    budget = default_kv_budget(bytes_per_token, block_size, wanted, None) if budget_bytes is None else budget_bytes
    per_block = bytes_per_token * block_size
    num_blocks = max(budget // per_block, 1)
    tokens = num_blocks * block_size
    context, lowered_from, problem, note = wanted, None, None, None
    trained = model_context or UNKNOWN_MODEL_CONTEXT
    if max_model_len and max_model_len > trained:
        note = f"--max-model-len {max_model_len} is more than the model's context: it serves {trained}"
    if tokens < wanted:
        if max_model_len and max_model_len <= trained:
            problem = (f"a KV cache of {mib_text(num_blocks * per_block)} holds {tokens} tokens, less than "
                       f"--max-model-len {max_model_len}; raise --kv-cache-memory to "
                       f"{mib_text(bytes_per_token * max_model_len)} or lower --max-model-len")
        else:
            lowered_from = wanted
        context = tokens
    return KvCacheSize(num_blocks, block_size, bytes_per_token, context, lowered_from, problem, note)
