"""The scheduler: which requests run this step, and how many tokens each (vLLM v1's one rule).

There are no prefill and decode phases. A request only knows how many tokens it has and how
many are computed; each step gives tokens to running requests first, then to waiting ones,
until the token budget is spent. Chunked prefill, prefix-cache hits and the resumption of
preempted requests all fall out of that rule.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass

from localllm.config.engine import SchedulerConfig
from localllm.errors import InvalidRequestError, QueueFullError
from localllm.scheduler.kv_cache_manager import KVCacheManager
from localllm.scheduler.output import ScheduledRequest, SchedulerOutput
from localllm.scheduler.request import Request, RequestStatus
from localllm.scheduler.state_slots import StateCheckpoints, StateSlots

QueueKey = tuple[float, float, int]  # (effective priority, arrival time, admission counter)


@dataclass(slots=True)
class SchedulerStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions_total: int


class Scheduler:
    """Waiting queue, running set, token budget, preemption; owns the :class:`KVCacheManager`.

    Ordering: every request gets one :data:`QueueKey` when added, and that key decides
    everything: the waiting queue pops the smallest, running requests get tokens smallest
    first, and the victim of a preemption is the largest. With aging off the key is
    ``(priority, arrival, counter)``, i.e. priority then first come, first served.

    Invariants between calls: ``requests`` holds exactly the unfinished requests, each
    either RUNNING (in ``running``, holding blocks for at least its computed tokens, and a
    recurrent-state slot where the model has such states) or WAITING/PREEMPTED (in ``waiting``,
    holding no blocks and no slot, ``num_computed_tokens == 0``);
    ``len(running) <= max_num_seqs``. Each :meth:`schedule` must be followed by its
    :meth:`update_from_output` before the next one.

    A hybrid model's prefix-cache hit is taken only up to the last cached block that has a state
    checkpoint (:class:`StateCheckpoints`), which the request's state starts from; every block
    boundary a step passes reserves a checkpoint (the latest boundaries first, while the pool has
    one that no step in flight reads), registered once the step has succeeded and the block is
    cached.
    """

    def __init__(self, config: SchedulerConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.clock = clock
        # a hybrid model's recurrent states: a slot per running request, checkpoints beside cached blocks
        self.state_slots = StateSlots(config.num_state_slots) if config.num_state_slots else None
        self.checkpoints = StateCheckpoints(config.num_state_checkpoints) if config.num_state_checkpoints else None
        self.kv = KVCacheManager(config.num_blocks, config.block_size, config.enable_prefix_caching,
                                 on_uncache=self.checkpoints.drop if self.checkpoints is not None else None)
        self.requests: dict[str, Request] = {}
        self.waiting: list[tuple[QueueKey, Request]] = []  # a heap
        self.running: list[Request] = []
        self.num_preemptions_total = 0
        self._keys: dict[str, QueueKey] = {}
        self._counter = itertools.count()

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def get_request(self, req_id: str) -> Request | None:
        return self.requests.get(req_id)

    def stats(self) -> SchedulerStats:
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            kv_cache_usage=self.kv.usage,
            prefix_cache_queries=self.kv.prefix_cache_queries,
            prefix_cache_hits=self.kv.prefix_cache_hits,
            num_preemptions_total=self.num_preemptions_total,
        )

    def queue_key(self, req_id: str) -> QueueKey:
        """The request's ordering key (smaller runs first)."""
        return self._keys[req_id]

    def add_request(self, req: Request, *, force: bool = False) -> None:
        """Queue a new request; its arrival time for ordering and aging is ``clock()`` now.

        Raises :class:`InvalidRequestError` for an empty or too long prompt or a duplicate
        id, :class:`QueueFullError` when ``max_waiting`` requests are already waiting, unless
        ``force`` (for requests already accepted as part of another, such as extra samples).
        """
        cfg = self.config
        if req.req_id in self.requests:
            raise InvalidRequestError(f"duplicate request id {req.req_id!r}", param="request_id")
        if not req.prompt_token_ids:
            raise InvalidRequestError("the prompt is empty", param="prompt")
        if req.num_tokens > cfg.max_model_len:
            raise InvalidRequestError(
                f"the prompt has {req.num_tokens} tokens, more than the context window of "
                f"{cfg.max_model_len}",
                param="prompt",
            )
        if not force and cfg.max_waiting is not None and len(self.waiting) >= cfg.max_waiting:
            raise QueueFullError(f"the waiting queue is full ({cfg.max_waiting} requests)")
        arrival = self.clock()
        # Effective priority at time t is `priority - (t - arrival) / aging_seconds`. Every
        # waiting request ages at the same rate, so subtracting the common `t / aging_seconds`
        # leaves a key that never changes: `priority + arrival / aging_seconds`. A heap keyed
        # by it pops the request with the best effective priority at any time.
        effective = float(req.priority)
        if cfg.aging_seconds is not None:
            effective += arrival / cfg.aging_seconds
        key = (effective, arrival, next(self._counter))
        self._keys[req.req_id] = key
        self.requests[req.req_id] = req
        req.status = RequestStatus.WAITING
        heapq.heappush(self.waiting, (key, req))

    def finish_request(self, req_id: str, status: RequestStatus) -> None:
        """Remove a request (stop, length or abort) and free its blocks at once.

        Unknown ids are a no-op, so finishing twice is safe.
        """
        assert status.finished, status
        req = self.requests.pop(req_id, None)
        if req is None:
            return
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        else:
            self.waiting = [entry for entry in self.waiting if entry[1] is not req]
            heapq.heapify(self.waiting)
        self.kv.free(req)
        if self.state_slots is not None:
            self.state_slots.free(req)
        del self._keys[req_id]
        req.status = status

    def schedule(self) -> SchedulerOutput:
        """Choose this step's batch.

        Guarantees: at most ``max_num_batched_tokens`` tokens and ``max_num_seqs`` running
        requests; no request is given KV slots beyond ``max_model_len``; a request preempted
        in this step is not scheduled in it; decodes come first in ``scheduled``.
        """
        cfg = self.config
        budget = cfg.max_num_batched_tokens
        scheduled: dict[str, ScheduledRequest] = {}
        preempted: list[str] = []
        may_admit = cfg.batching == "continuous" or not self.running

        self.running.sort(key=self._key_of)
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens, cfg.max_model_len) - req.num_computed_tokens
            n = min(n, budget)
            if n <= 0:
                i += 1
                continue
            drafts = self._drafts_that_fit(req, budget)
            n += len(drafts)
            while (block_ids := self.kv.allocate_slots(req, n)) is None:
                # Running is sorted, so the victim is at the end: never one already scheduled.
                victim = self.running.pop()
                self._preempt(victim, scheduled, preempted)
                if victim is req:
                    break
            if block_ids is None:
                break
            scheduled[req.req_id] = self._chunk(req, req.num_computed_tokens, n - len(drafts), block_ids, drafts)
            budget -= n
            i += 1

        # After a preemption for lack of blocks, admitting newcomers would only thrash.
        if may_admit and not preempted:
            while self.waiting and budget > 0:
                key, req = self.waiting[0]
                if req.req_id in preempted:
                    break
                block_ids = None
                if len(self.running) < cfg.max_num_seqs:
                    computed, num_cached = self.kv.get_computed_blocks(req)
                    if req.sampling_params.prompt_logprobs is not None:  # every prompt row is needed
                        computed, num_cached = [], 0
                    state_from = -1
                    if self.state_slots is not None:  # a hit needs the recurrent state at its end
                        computed, state_from = self._restorable(computed)
                        num_cached = len(computed) * cfg.block_size
                    n = min(min(req.num_tokens, cfg.max_model_len) - num_cached, budget)
                    assert n > 0, f"request {req.req_id} reached max_model_len; the engine must finish it"
                    block_ids = self.kv.allocate_slots(req, n, computed)
                if block_ids is None:
                    victim = self._worst_running_worse_than(key)
                    if victim is None:
                        break
                    self.running.remove(victim)
                    budget += self._preempt(victim, scheduled, preempted)
                    continue
                heapq.heappop(self.waiting)
                req.num_computed_tokens = num_cached
                if req.num_cached_tokens < 0:
                    req.num_cached_tokens = num_cached
                req.status = RequestStatus.RUNNING
                if self.state_slots is not None:
                    self.state_slots.allocate(req)
                if state_from >= 0:
                    self.checkpoints.pin(state_from)
                self.running.append(req)
                scheduled[req.req_id] = self._chunk(req, num_cached, n, block_ids, state_from=state_from)
                budget -= n

        decodes = [s for s in scheduled.values() if _is_decode(s)]
        chunks = [s for s in scheduled.values() if not _is_decode(s)]
        return SchedulerOutput(
            scheduled=decodes + chunks,
            preempted_req_ids=preempted,
            num_batched_tokens=cfg.max_num_batched_tokens - budget,
        )

    def update_from_output(self, out: SchedulerOutput, sampled_token_ids: dict[str, list[int]]) -> None:
        """Apply a finished step: advance computed tokens, cache full blocks, append samples.

        ``sampled_token_ids[req_id]``: the tokens the step produced for a request that sampled:
        its accepted drafts, then one sampled token. A rejected draft's KV (written past the
        computed tokens) is rewritten by the next step. Requests finished or aborted since
        :meth:`schedule` are skipped.
        """
        for s in out.scheduled:
            req = s.request
            if req.status != RequestStatus.RUNNING or self.requests.get(req.req_id) is not req:
                self._release_checkpoints(s)
                continue
            assert req.num_computed_tokens == s.start_pos, "update_from_output applied out of order"
            tokens = sampled_token_ids.get(req.req_id, []) if s.sample else []
            accepted = max(len(tokens) - 1, 0)
            assert accepted <= len(s.draft_token_ids), "more tokens accepted than drafted"
            req.num_computed_tokens += len(s.token_ids) - len(s.draft_token_ids) + accepted
            req.spec_token_ids = []
            self.kv.cache_full_blocks(req, req.num_computed_tokens)
            if s.state_checkpoints:
                self._register_checkpoints(req, s)
            for token_id in tokens:
                req.append_output_token(token_id)
        if self.checkpoints is not None:
            self.checkpoints.unpin_all()

    def _key_of(self, req: Request) -> QueueKey:
        return self._keys[req.req_id]

    def _drafts_that_fit(self, req: Request, budget: int) -> list[int]:
        """The request's drafts this step has room for: only a decode (its one last token) takes
        them, within the token budget and the context window."""
        if not req.spec_token_ids or req.num_computed_tokens + 1 != req.num_tokens:
            return []
        room = min(budget - 1, self.config.max_model_len - req.num_tokens)
        return req.spec_token_ids[:max(room, 0)]

    def _chunk(self, req: Request, start: int, n: int, block_ids: list[int],
               drafts: list[int] | None = None, state_from: int = -1) -> ScheduledRequest:
        """``n`` of the request's tokens from ``start``, then ``drafts``; its recurrent state from
        checkpoint ``state_from`` (-1: its slot's), with checkpoints reserved at the block
        boundaries its tokens pass (drafts included: kept only if they are accepted)."""
        token_ids = req.token_ids_slice(start, start + n)
        return ScheduledRequest(
            request=req,
            token_ids=token_ids + drafts if drafts else token_ids,
            start_pos=start,
            block_ids=block_ids,
            sample=start + n == req.num_tokens,
            draft_token_ids=tuple(drafts or ()),
            state_from=state_from,
            state_checkpoints=self._reserve_checkpoints(start, start + n + len(drafts or ())),
        )

    def _restorable(self, computed: list[int]) -> tuple[list[int], int]:
        """The leading blocks of a prefix-cache hit that end where a state checkpoint is, and that
        checkpoint (-1: none, and no hit)."""
        if self.checkpoints is not None:
            for j in range(len(computed), 0, -1):
                checkpoint = self.checkpoints.lookup(computed[j - 1])
                if checkpoint is not None:
                    return computed[:j], checkpoint
        return [], -1

    def _reserve_checkpoints(self, start: int, end: int) -> tuple[tuple[int, int], ...]:
        """``(position, checkpoint)`` for the block boundaries in ``(start, end]``, the latest first
        while the pool has checkpoints to give (a long chunk keeps those nearest its end, where
        the sequence goes on); in position order."""
        if self.checkpoints is None:
            return ()
        bs = self.config.block_size
        reserved = []
        for position in range(end // bs * bs, start, -bs):
            checkpoint = self.checkpoints.reserve()
            if checkpoint is None:
                break
            reserved.append((position, checkpoint))
        return tuple(reversed(reserved))

    def _register_checkpoints(self, req: Request, s: ScheduledRequest) -> None:
        """Register the checkpoints of step ``s`` at boundaries the request's computed tokens reached
        under the cached blocks that end there (the request's own, or another's with the same
        tokens); release the rest (behind rejected drafts, or beside a block not cached)."""
        bs = self.config.block_size
        reached = [(p, c) for p, c in s.state_checkpoints if p <= req.num_computed_tokens]
        cached = self.kv.cached_prefix(req, reached[-1][0] // bs) if reached else []
        for position, checkpoint in s.state_checkpoints:
            i = position // bs - 1
            if position <= req.num_computed_tokens and i < len(cached):
                self.checkpoints.register(checkpoint, cached[i])
            else:
                self.checkpoints.release(checkpoint)

    def _release_checkpoints(self, s: ScheduledRequest) -> None:
        for _, checkpoint in s.state_checkpoints:
            self.checkpoints.release(checkpoint)

    def _worst_running_worse_than(self, key: QueueKey) -> Request | None:
        """The running request to preempt for a waiting one with ``key``, if any.

        Compares effective priorities (the first element of the key): without aging that is
        the raw priority; with aging, a low-priority request that has waited its way in is
        not pushed out again by every newcomer, which would undo the aging.
        """
        if not self.running:
            return None
        worst = max(self.running, key=self._key_of)
        return worst if self._keys[worst.req_id][0] > key[0] else None

    def _preempt(self, req: Request, scheduled: dict[str, ScheduledRequest], preempted: list[str]) -> int:
        """Send a request (already removed from ``running``) back to waiting, freeing its blocks.

        Its outputs are kept and its tokens recomputed later (prefix cache permitting).
        Returns the tokens it had been given in this step, now back in the budget.
        """
        self.kv.free(req)
        if self.state_slots is not None:  # recomputed from its tokens with its KV: its state is dropped too
            self.state_slots.free(req)
        req.num_computed_tokens = 0
        req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        self.num_preemptions_total += 1
        heapq.heappush(self.waiting, (self._keys[req.req_id], req))
        preempted.append(req.req_id)
        unscheduled = scheduled.pop(req.req_id, None)
        if unscheduled is None:
            return 0
        self._release_checkpoints(unscheduled)
        return len(unscheduled.token_ids)


def _is_decode(s: ScheduledRequest) -> bool:
    return len(s.token_ids) - len(s.draft_token_ids) == 1 and s.start_pos >= s.request.num_prompt_tokens
