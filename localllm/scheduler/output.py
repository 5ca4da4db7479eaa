"""What the scheduler hands the model runner each step."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from localllm.scheduler.request import Request


class ScheduledRequest(NamedTuple):
    """One request's share of a step.

    The runner computes KV for ``token_ids`` at positions ``start_pos ..
    start_pos + len(token_ids) - 1`` (writing it into ``block_ids``, the request's whole
    block table) and, when ``sample`` is true, samples one new token from the logits of the
    last of them. ``sample`` is false for a prompt chunk that does not reach the prompt's end.

    ``draft_token_ids`` (speculative decoding) are the last ``len(draft_token_ids)`` of
    ``token_ids``: guesses past the request's tokens. The runner samples the row of the request's
    last token and of each draft in turn, keeping drafts while the sample equals them.

    A hybrid model's recurrent state (``request.state_slot``): ``state_from`` is the checkpoint
    (``scheduler.state_slots.StateCheckpoints``) the request's state at ``start_pos`` is read from,
    after a prefix-cache hit; -1: the slot's own state (none at position 0). For each
    ``(position, checkpoint)`` of ``state_checkpoints`` the runner also writes the state after the
    request's first ``position`` tokens (a block boundary this step passes) into that checkpoint.
    """

    request: Request
    token_ids: list[int]
    start_pos: int
    block_ids: list[int]
    sample: bool
    draft_token_ids: tuple[int, ...] = ()
    state_from: int = -1
    state_checkpoints: tuple[tuple[int, int], ...] = ()

    @property
    def req_id(self) -> str:
        return self.request.req_id


@dataclass(slots=True)
class SchedulerOutput:
    """One step's batch. ``scheduled`` lists decodes first, then prompt chunks."""

    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted_req_ids: list[str] = field(default_factory=list)
    num_batched_tokens: int = 0

    @property
    def is_empty(self) -> bool:
        return not self.scheduled
