"""Recurrent-state slots: which sequences hold one of a hybrid model's per-sequence states.

A model with linear-attention layers (Qwen3-Next, Qwen3.5) keeps, beside the paged KV cache of its
attention layers, one recurrent state per running sequence; the runner owns the memory
(``num_slots`` slots per layer), this pool hands out the slot ids. A request holds a slot while it
runs: from its admission to its end, or to its preemption (a preempted request is recomputed from
its tokens, as its KV blocks are, so its state is dropped with them).
"""

from __future__ import annotations

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
