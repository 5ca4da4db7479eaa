"""A request as the scheduler sees it: token ids and counters, no tensors."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from localllm.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2  # back in the waiting queue; its KV was freed and will be recomputed
    FINISHED_STOPPED = 3  # EOS, stop token or stop string
    FINISHED_LENGTH = 4  # max_tokens or the context window
    FINISHED_ABORTED = 5

    @property
    def finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        return {
            RequestStatus.FINISHED_STOPPED: "stop",
            RequestStatus.FINISHED_LENGTH: "length",
            RequestStatus.FINISHED_ABORTED: "abort",
        }.get(self)


@dataclass(slots=True, eq=False)
class Request:
    """One sequence being generated.

    Invariants: ``0 <= num_computed_tokens <= num_tokens``; the tokens
    ``all_token_ids[:num_computed_tokens]`` have their KV written in the request's blocks.
    A preempted request keeps ``output_token_ids`` and resets ``num_computed_tokens`` to 0
    (recomputed later, prefix cache permitting).
    """

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    priority: int = 0  # lower runs first
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1  # prefix-cache hit on first scheduling; -1 until known
    num_preemptions: int = 0
    status: RequestStatus = RequestStatus.WAITING
    # Prefix-cache hashes of the leading full blocks, filled lazily by the KV cache manager;
    # they stay valid across preemption because token ids are only ever appended.
    block_hashes: list[bytes] = field(default_factory=list, repr=False)
    # Guesses of the next tokens (speculative decoding), set by the engine between steps: the
    # scheduler gives a decoding request room for them, the runner keeps those the model agrees with.
    spec_token_ids: list[int] = field(default_factory=list)
    # A hybrid model's recurrent-state slot while the request runs (scheduler.state_slots); -1: none.
    state_slot: int = -1

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_ids_slice(self, start: int, end: int) -> list[int]:
        """``all_token_ids[start:end]`` without building the whole list."""
        p = len(self.prompt_token_ids)
        if end <= p:
            return self.prompt_token_ids[start:end]
        if start >= p:
            return self.output_token_ids[start - p : end - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - p]

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)

    @property
    def is_finished(self) -> bool:
        return self.status.finished
