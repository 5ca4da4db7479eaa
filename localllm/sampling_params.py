"""Per-request sampling and stopping parameters (plain Python: the scheduler imports this)."""

from __future__ import annotations

from dataclasses import dataclass, field

from localllm.errors import InvalidRequestError


@dataclass(slots=True)
class SamplingParams:
    """How to sample and when to stop one request.

    ``temperature == 0`` means greedy. Validation happens in :meth:`validate`, which raises
    :class:`InvalidRequestError` (mapped to HTTP 400 by the API) naming the bad field.
    """

    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None  # None: off; k >= 0: return the chosen token's logprob + top-k
    n: int = 1
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self) -> None:
        def bad(param: str, msg: str) -> None:
            raise InvalidRequestError(msg, param=param)

        if self.max_tokens is not None and (
            isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1
        ):
            bad("max_tokens", f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if not 0.0 <= self.temperature <= 2.0:
            bad("temperature", f"temperature must be in [0, 2], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            bad("top_p", f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            bad("top_k", f"top_k must be -1, 0 (disabled) or positive, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            bad("min_p", f"min_p must be in [0, 1], got {self.min_p}")
        if self.repetition_penalty <= 0.0:
            bad("repetition_penalty", f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            bad("presence_penalty", f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            bad("frequency_penalty", f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            bad("logprobs", f"logprobs must be in [0, 20], got {self.logprobs}")
        if not 1 <= self.n <= 16:
            bad("n", f"n must be in [1, 16], got {self.n}")
        if self.logit_bias:
            for tok, bias in self.logit_bias.items():
                if isinstance(tok, bool) or not isinstance(tok, int):
                    bad("logit_bias", f"logit_bias keys must be token ids (integers), got {tok!r}")
                if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not -100.0 <= bias <= 100.0:
                    bad("logit_bias", f"logit_bias values must be in [-100, 100], got {bias} for {tok}")
