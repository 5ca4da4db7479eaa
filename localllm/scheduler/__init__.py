"""Scheduling, KV-block and recurrent-state-slot bookkeeping: plain Python, no torch, no tensors."""

from localllm.scheduler.kv_cache_manager import KVCacheBlock, KVCacheManager, hash_block_tokens
from localllm.scheduler.output import ScheduledRequest, SchedulerOutput
from localllm.scheduler.request import Request, RequestStatus
from localllm.scheduler.scheduler import Scheduler, SchedulerConfig, SchedulerStats

__all__ = [
    "KVCacheBlock",
    "KVCacheManager",
    "Request",
    "RequestStatus",
    "ScheduledRequest",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerOutput",
    "SchedulerStats",
    "hash_block_tokens",
]
