"""Recurrent-state slots: which sequences hold one of a hybrid model's per-sequence states.

A model with linear-attention layers (Qwen3-Next, Qwen3.5) keeps, beside the paged KV cache of its
attention layers, one recurrent state per running sequence; the runner owns the memory
(``num_slots`` slots per layer), this pool hands out the slot ids. A request holds a slot while it
runs: from its admission to its end, or to its preemption (a preempted request is recomputed from
its tokens, as its KV blocks are, so its state is dropped with them). With prefix caching, states
at block boundaries are kept in a pool of checkpoints beside the cached blocks
(:class:`StateCheckpoints`): a request admitted with a hit, a preempted one resumed included,
starts from the checkpoint at the hit's end.
"""

from __future__ import annotations

from collections import OrderedDict

from localllm.scheduler.request import Request


class StateSlots:
    """Slot ids ``0 .. num_slots - 1``; a request's is ``Request.state_slot`` (-1: none)."""

    def __init__(self, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError(f"need at least one state slot, got {num_slots}")
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))  # popped from the end: lowest first

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, req: Request) -> None:
        """Give ``req`` a slot. The scheduler runs at most ``num_slots`` requests, so one is free."""
        assert req.state_slot < 0, f"request {req.req_id} already holds state slot {req.state_slot}"
        assert self._free, "more running requests than state slots"
        req.state_slot = self._free.pop()

    def free(self, req: Request) -> None:
        """Take back ``req``'s slot, if it holds one."""
        if req.state_slot >= 0:
            self._free.append(req.state_slot)
            req.state_slot = -1


class StateCheckpoints:
    """A bounded pool of recurrent-state checkpoints ``0 .. num_checkpoints - 1`` for prefix caching.

    A checkpoint holds the state of a sequence after its first ``k * block_size`` tokens (the
    runner owns the memory; here only ids), and is registered under the prefix-cache block that
    ends at that boundary: a hit on a prefix of cached blocks is taken up to the last block that
    has one, and the request's state starts from it. Taking one is three steps:
    :meth:`reserve` when a step will pass the boundary (the runner writes the state into it), then
    :meth:`register` once the step has succeeded and the block is cached, or :meth:`release`.

    Invariants: every checkpoint is free, reserved (by one step in flight) or registered (under
    exactly one block id, which is registered in the prefix cache: the KV cache manager drops it,
    :meth:`drop`, when the block leaves the cache). Registered ones are evicted least recently used
    first, never one pinned (read by the step in flight).
    """

    def __init__(self, num_checkpoints: int) -> None:
        if num_checkpoints < 1:
            raise ValueError(f"need at least one checkpoint, got {num_checkpoints}")
        self.num_checkpoints = num_checkpoints
        self._free = list(range(num_checkpoints - 1, -1, -1))  # popped from the end: lowest first
        self._by_block: OrderedDict[int, int] = OrderedDict()  # block id -> checkpoint, least recent first
        self._block_of: dict[int, int] = {}  # checkpoint -> block id (registered ones)
        self._pinned: set[int] = set()
        self._dropped_pinned: set[int] = set()  # dropped while pinned: freed when unpinned

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_registered(self) -> int:
        return len(self._by_block)

    def lookup(self, block_id: int) -> int | None:
        """The checkpoint registered under ``block_id``, if any. No side effects."""
        return self._by_block.get(block_id)

    def pin(self, checkpoint: int) -> None:
        """``checkpoint`` is read by the step being scheduled: the most recently used, and not
        evicted until :meth:`unpin_all`."""
        self._by_block.move_to_end(self._block_of[checkpoint])
        self._pinned.add(checkpoint)

    def unpin_all(self) -> None:
        """The step in flight is over."""
        self._pinned.clear()
        self._free += sorted(self._dropped_pinned, reverse=True)
        self._dropped_pinned.clear()

    def reserve(self) -> int | None:
        """A checkpoint for a step to write: a free one, else the least recently used registered
        one not pinned (evicted); ``None`` if every one is reserved or pinned."""
        if self._free:
            return self._free.pop()
        for block_id, checkpoint in self._by_block.items():
            if checkpoint not in self._pinned:
                del self._by_block[block_id], self._block_of[checkpoint]
                return checkpoint
        return None

    def register(self, checkpoint: int, block_id: int) -> None:
        """The reserved ``checkpoint`` holds the state at the end of cached block ``block_id``.
        A block that has one keeps it (the same state) and this one is freed."""
        if block_id in self._by_block:
            self.release(checkpoint)
            return
        self._by_block[block_id] = checkpoint
        self._block_of[checkpoint] = block_id

    def release(self, checkpoint: int) -> None:
        """A reserved checkpoint that was not written, or not for a block that stayed cached."""
        assert checkpoint not in self._block_of, f"checkpoint {checkpoint} is registered"
        self._free.append(checkpoint)

    def drop(self, block_id: int) -> None:
        """Block ``block_id`` left the prefix cache: its checkpoint, if any, is freed."""
        checkpoint = self._by_block.pop(block_id, None)
        if checkpoint is None:
            return
        del self._block_of[checkpoint]
        if checkpoint in self._pinned:
            self._dropped_pinned.add(checkpoint)
        else:
            self._free.append(checkpoint)
