"""What the engine hands back: per-step deltas, and whole results for the offline API."""

from __future__ import annotations

from dataclasses import dataclass, field

from localllm.errors import LocalLLMError


@dataclass(slots=True)
class TokenLogprobs:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # (token id, logprob), best first
    rank: int | None = None  # 1 + how many tokens were more likely (computed for prompt tokens)


@dataclass(slots=True)
class RequestTimings:
    """Monotonic timestamps of one request's life (seconds)."""

    arrival: float
    first_scheduled: float | None = None
    first_token: float | None = None
    finished: float | None = None

    @property
    def queue_time(self) -> float | None:
        return None if self.first_scheduled is None else self.first_scheduled - self.arrival

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrival


@dataclass(slots=True)
class RequestOutput:
    """A delta for one sample (``index``) of request ``req_id``: what is new since the last one."""

    req_id: str
    index: int
    new_token_ids: list[int]
    new_text: str
    new_logprobs: list[TokenLogprobs]
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int
    timings: RequestTimings
    time: float  # when this delta was produced
    # Set when the request failed (then ``finished`` is true and ``finish_reason`` is "error");
    # the other requests of the step went on.
    error: LocalLLMError | None = None
    # With SamplingParams.prompt_logprobs, on a sample's first delta only: one entry per prompt
    # token, None for the first (nothing before it predicts it).
    prompt_logprobs: list[TokenLogprobs | None] | None = None


@dataclass(slots=True)
class CompletionOutput:
    """One finished sample."""

    index: int
    token_ids: list[int]
    text: str
    finish_reason: str | None
    logprobs: list[TokenLogprobs] = field(default_factory=list)


@dataclass(slots=True)
class GenerationOutput:
    """A finished request of :meth:`localllm.LLM.generate` / :meth:`~localllm.LLM.chat`.

    ``token_ids``, ``text`` and ``finish_reason`` are those of the first sample; ``outputs``
    holds all ``n`` samples.
    """

    req_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    num_cached_tokens: int = 0

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason

    @property
    def logprobs(self) -> list[TokenLogprobs]:
        return self.outputs[0].logprobs
