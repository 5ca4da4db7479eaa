"""Per-request sampling and stopping parameters (plain Python: the scheduler imports this)."""

from __future__ import annotations

from dataclasses import dataclass, field

from localllm.errors import InvalidRequestError

# Bounds that keep every logit finite and every request's cost bounded (docs/api.md lists them).
MIN_TEMPERATURE = 1e-5  # vLLM's threshold: a smaller temperature is greedy (logits / t would overflow)
MAX_TEMPERATURE = 2.0
REPETITION_PENALTY_RANGE = (0.01, 100.0)  # logits are scaled by it: 1e-45 made them inf
MAX_TOP_K = 2**31 - 1  # beyond the vocabulary it means the whole vocabulary (clamped by the samplers)
MAX_LOGPROBS = 20
MAX_N = 16
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 1024
MAX_STOP_TOKEN_IDS = 1024
MAX_LOGIT_BIAS_ENTRIES = 1024
SEED_RANGE = (-(2**63), 2**63 - 1)


MAX_STRUCTURED_SPEC_CHARS = 256 * 1024


@dataclass(frozen=True, slots=True)
class StructuredOutput:
    """A grammar the output must follow (compiled and enforced by :mod:`localllm.engine.structured`).

    ``kind``: ``json_schema`` (``spec``: the schema as JSON text), ``json_object`` (any JSON
    object; ``spec`` empty), ``regex``, ``choice`` (``spec``: a JSON list of strings) or
    ``grammar`` (EBNF/GBNF, root rule ``root``), or ``tool_call`` (``spec``: JSON ``{"format",
    "parallel", "functions": [{"name", "parameters"}]}``: calls in a model's tool-call format, see
    :mod:`localllm.api.tools`). Hashable: compiled grammars are cached by it.
    """

    kind: str
    spec: str = ""

    KINDS = ("json_schema", "json_object", "regex", "choice", "grammar", "tool_call")


@dataclass(slots=True)
class SamplingParams:
    """How to sample and when to stop one request.

    ``temperature < MIN_TEMPERATURE`` (0 included) means greedy. Validation happens in :meth:`validate`, which raises
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
    structured: StructuredOutput | None = None  # constrain the output to a grammar
    speculative: bool = True  # False: no speculative decoding for this request (the tokens are the same)
    # The prompt's tokens' logprobs (each given the tokens before it) and this many top alternatives
    # each (None: not computed: other requests pay nothing). With it, max_tokens may be 0: score only.
    prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature < MIN_TEMPERATURE

    def validate(self) -> None:
        def bad(param: str, msg: str) -> None:
            raise InvalidRequestError(msg, param=param)

        least = 0 if self.prompt_logprobs is not None else 1  # scoring a prompt generates nothing
        if self.max_tokens is not None and (
            isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < least
        ):
            bad("max_tokens", f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if self.prompt_logprobs is not None and (
            not _integer(self.prompt_logprobs) or not 0 <= self.prompt_logprobs <= MAX_LOGPROBS
        ):
            bad("prompt_logprobs", f"prompt_logprobs must be in [0, {MAX_LOGPROBS}], got {self.prompt_logprobs}")
        if not _number(self.temperature) or not 0.0 <= self.temperature <= MAX_TEMPERATURE:
            bad("temperature", f"temperature must be in [0, {MAX_TEMPERATURE:g}], got {self.temperature}")
        if not _number(self.top_p) or not 0.0 < self.top_p <= 1.0:
            bad("top_p", f"top_p must be in (0, 1], got {self.top_p}")
        if not _integer(self.top_k) or not -1 <= self.top_k <= MAX_TOP_K:
            bad("top_k", f"top_k must be -1, 0 (disabled) or a positive integer, got {self.top_k}")
        if not _number(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            bad("min_p", f"min_p must be in [0, 1], got {self.min_p}")
        lo, hi = REPETITION_PENALTY_RANGE
        if not _number(self.repetition_penalty) or not lo <= self.repetition_penalty <= hi:
            bad("repetition_penalty", f"repetition_penalty must be in [{lo:g}, {hi:g}], got {self.repetition_penalty}")
        if not _number(self.presence_penalty) or not -2.0 <= self.presence_penalty <= 2.0:
            bad("presence_penalty", f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not _number(self.frequency_penalty) or not -2.0 <= self.frequency_penalty <= 2.0:
            bad("frequency_penalty", f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if self.logprobs is not None and (not _integer(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS):
            bad("logprobs", f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        if not _integer(self.n) or not 1 <= self.n <= MAX_N:
            bad("n", f"n must be in [1, {MAX_N}], got {self.n}")
        if self.seed is not None and (not _integer(self.seed) or not SEED_RANGE[0] <= self.seed <= SEED_RANGE[1]):
            bad("seed", f"seed must be a 64-bit signed integer, got {self.seed}")
        if self.structured is not None:
            so = self.structured
            if not isinstance(so, StructuredOutput) or so.kind not in StructuredOutput.KINDS:
                bad("response_format", f"structured output must be one of {', '.join(StructuredOutput.KINDS)}")
            if not isinstance(so.spec, str) or len(so.spec) > MAX_STRUCTURED_SPEC_CHARS:
                bad("response_format", f"a schema, regex or grammar may have at most {MAX_STRUCTURED_SPEC_CHARS} "
                    "characters")
        if len(self.stop) > MAX_STOP_STRINGS:
            bad("stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(self.stop)}")
        for s in self.stop:
            if not isinstance(s, str):
                bad("stop", f"stop strings must be strings, got {s!r}")
            if len(s) > MAX_STOP_STRING_CHARS:
                bad("stop", f"a stop string may have at most {MAX_STOP_STRING_CHARS} characters, got {len(s)}")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            bad("stop_token_ids", f"at most {MAX_STOP_TOKEN_IDS} stop token ids, got {len(self.stop_token_ids)}")
        for t in self.stop_token_ids:
            if not _integer(t) or t < 0:
                bad("stop_token_ids", f"stop_token_ids must be token ids (integers >= 0), got {t!r}")
        if self.logit_bias:
            if len(self.logit_bias) > MAX_LOGIT_BIAS_ENTRIES:
                bad("logit_bias", f"logit_bias may have at most {MAX_LOGIT_BIAS_ENTRIES} entries")
            for tok, bias in self.logit_bias.items():
                if not _integer(tok):
                    bad("logit_bias", f"logit_bias keys must be token ids (integers), got {tok!r}")
                if not _number(bias) or not -100.0 <= bias <= 100.0:
                    bad("logit_bias", f"logit_bias values must be in [-100, 100], got {bias} for {tok}")


def _integer(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _number(value) -> bool:
    """A real number (NaN fails every range check above, since its comparisons are false)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)
