"""How an engine sizes its KV cache at load (:func:`size_engine_cache`): the byte budget (the
setting, free VRAM on a GPU, else :func:`~localllm.config.kv_cache.default_kv_budget` over the
memory free now), a hybrid model's recurrent-state slots and checkpoints taken out of it, and the
context that what is left serves (lowered and said where it holds less than the model's)."""

from __future__ import annotations

import logging
from typing import NamedTuple

import torch

from localllm.config.engine import EngineConfig
from localllm.config.kv_cache import (
    KvCacheSize,
    default_context,
    default_kv_budget,
    mib_text,
    size_kv_cache,
    split_for_states,
)
from localllm.engine.model_runner import kv_bytes_per_block
from localllm.errors import InvalidRequestError
from localllm.models.linear_attention import state_bytes, state_bytes_per_slot
from localllm.platform.memory import free_memory
from localllm.quant.kv_rows import KvCacheTypes

log = logging.getLogger(__name__)


class CacheSizing(NamedTuple):
    state_slots: int
    state_checkpoints: int
    kv: KvCacheSize


def size_engine_cache(model, device: torch.device, config: EngineConfig, kv_types: KvCacheTypes) -> CacheSizing:
    """The KV cache (and a hybrid model's state slots and checkpoints) of ``model`` on ``device``
    with ``config``'s settings; a ``max_model_len`` the cache cannot hold is a 400."""
    ctx = model.config.max_position_embeddings
    per_block = kv_bytes_per_block(model, config.block_size, kv_types)
    budget = config.kv_cache_memory
    if budget is None and device.type == "cuda":  # size the cache from free VRAM
        from localllm.engine.gpu_runner import kv_budget_from_free_memory

        budget = kv_budget_from_free_memory(model, device, per_block, config,
                                            default_context(ctx, config.max_model_len))
    elif budget is None:  # the context's cache, as far as the memory free now allows
        budget = default_kv_budget(per_block // config.block_size, config.block_size,
                                   default_context(ctx, config.max_model_len), free_memory("cpu"))
    slots, checkpoints = 0, 0
    per_slot = state_bytes_per_slot(model.config)
    if per_slot:  # a hybrid model's recurrent states and their prefix-cache checkpoints, beside the KV cache
        context_bytes = -(-default_context(ctx, config.max_model_len) // config.block_size) * per_block
        split = split_for_states(per_slot, context_bytes, config.max_num_seqs, budget, per_block,
                                 state_bytes(model.config) if config.enable_prefix_caching else 0)
        slots, checkpoints, budget = split
        log.info("%d linear-attention layers: a recurrent state of %s per running request, %d at most; "
                 "%d checkpoints of it for prefix caching", model.config.num_linear_layers,
                 mib_text(per_slot // 2), slots, checkpoints)
    kv = size_kv_cache(per_block // config.block_size, config.block_size, ctx,
                       max_model_len=config.max_model_len, budget_bytes=budget or None)
    if kv.problem:
        raise InvalidRequestError(kv.problem)
    if kv.lowered_from:
        log.warning("context window lowered from %d to %d tokens: what a KV cache of %s holds (the memory "
                    "free allows no more; --kv-cache-memory or --max-model-len to choose)", kv.lowered_from,
                    kv.tokens, mib_text(kv.bytes))
    return CacheSizing(slots, checkpoints, kv)
