"""How many tokens to draft: per request from the acceptance it sees, per step from the batch."""

from __future__ import annotations

from dataclasses import dataclass

from localllm.config.engine import DEFAULT_DRAFT_MAX, SPECULATIVE_MODES

# A step's rows beyond this many are compute, not a second read of the weights: speculation stops
# there (a step of many running requests is already compute-bound).
DEFAULT_STEP_TOKEN_LIMIT = 16
# Drafting pauses for a request whose drafts are accepted less than this often (an n-gram that
# keeps matching text that is not being copied), and tries again after PAUSE_STEPS steps.
MIN_ACCEPTANCE = 0.25
PAUSE_STEPS = 16
# A draft model that does not pay for a request pauses it for PAUSE_STEPS, doubled at each pause in
# a row up to this: each try after a pause feeds the draft model what it missed meanwhile.
MAX_PAUSE_STEPS = 256
_EMA = 0.3  # weight of the newest verification in the acceptance average
# A draft model is asked for guesses only where they are expected to give this many times the
# tokens per second of plain decoding (a guess costs a forward pass of the draft model).
MIN_DRAFT_MODEL_GAIN = 1.05


@dataclass(slots=True)
class SpeculationStats:
    """Totals since start (Prometheus counters, ``localllm ps``, the TUI's status line)."""

    drafted_tokens: int = 0
    accepted_tokens: int = 0
    verify_steps: int = 0  # request-steps that verified at least one draft

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0


@dataclass(slots=True)
class DraftLength:
    """One request's draft length, adapted to what it accepts: doubled (up to ``draft_max``) after
    a draft accepted whole, cut to one more than what was accepted otherwise; paused for
    :data:`PAUSE_STEPS` steps while the average acceptance is under :data:`MIN_ACCEPTANCE`."""

    draft_max: int
    current: int = 0
    acceptance: float = 1.0  # moving average of accepted / drafted
    paused_steps: int = 0
    probing: bool = False  # after a pause: one guess, to see whether drafts got better
    next_pause: int = PAUSE_STEPS

    def __post_init__(self) -> None:
        self.current = self.current or max(1, self.draft_max // 2)

    def next(self) -> int:
        """The drafts to ask for now (0 while paused)."""
        if self.paused_steps > 0:
            self.paused_steps -= 1
            return 0
        return self.current

    def pause(self) -> None:
        """No drafts for a while, then one guess (``probing``) to measure again: :data:`PAUSE_STEPS`
        steps, doubled at each pause in a row (up to :data:`MAX_PAUSE_STEPS`) until :meth:`paid`."""
        self.paused_steps = self.next_pause
        self.next_pause = min(2 * self.next_pause, MAX_PAUSE_STEPS)
        self.probing = True

    def paid(self) -> None:
        """Drafting pays again: the next pause is a short one."""
        self.next_pause = PAUSE_STEPS

    def update(self, drafted: int, accepted: int) -> None:
        if drafted <= 0:
            return
        self.probing = False
        self.acceptance = (1 - _EMA) * self.acceptance + _EMA * accepted / drafted
        if accepted == drafted:
            self.current = min(self.draft_max, 2 * self.current)
        else:
            self.current = max(1, accepted + 1)
        if self.acceptance < MIN_ACCEPTANCE:
            self.paused_steps = PAUSE_STEPS
            self.acceptance = MIN_ACCEPTANCE  # one good draft after the pause lifts it above again


def _average(old: float | None, new: float) -> float:
    return new if old is None else (1 - _EMA) * old + _EMA * new


@dataclass(slots=True)
class DraftCost:
    """What a draft model's guess costs beside a step of the model, as moving averages of measured
    seconds (a guess: one forward pass of the draft model, all speculating requests together; a
    step: a decode step of the model, drafts' rows included). It decides how many guesses are
    worth asking a request for: none where even the best length does not pay."""

    guess_seconds: float | None = None
    step_seconds: float | None = None
    acceptance: float = 1.0  # over all requests: where a new request's estimate starts

    def observe_verification(self, drafted: int, accepted: int) -> None:
        if drafted > 0:
            self.acceptance = (1 - _EMA) * self.acceptance + _EMA * accepted / drafted

    def observe_guess(self, seconds: float) -> None:
        self.guess_seconds = _average(self.guess_seconds, seconds)

    def observe_step(self, seconds: float) -> None:
        self.step_seconds = _average(self.step_seconds, seconds)

    @property
    def ratio(self) -> float | None:
        """A guess's time over a step's (None until both were measured)."""
        if self.guess_seconds is None or not self.step_seconds:
            return None
        return self.guess_seconds / self.step_seconds

    def best_length(self, acceptance: float, longest: int) -> int:
        """The draft length in ``1..longest`` that gives the most tokens per second at this
        acceptance rate, or 0 if none gives :data:`MIN_DRAFT_MODEL_GAIN` times plain decoding's.
        With ``k`` guesses a step costs ``1 + k * ratio`` steps and gives ``1 + a + ... + a**k``
        tokens on average (each guess is kept with probability ``a`` while the ones before it were)."""
        ratio = self.ratio
        if ratio is None:
            return longest
        best, best_gain, expected = 0, MIN_DRAFT_MODEL_GAIN, 1.0
        for k in range(1, longest + 1):
            expected += acceptance**k
            gain = expected / (1 + k * ratio)
            if gain > best_gain:
                best, best_gain = k, gain
        return best


@dataclass(frozen=True, slots=True)
class SpeculationPolicy:
    """The engine's speculation settings and its per-step rule."""

    mode: str = "auto"
    draft_max: int = DEFAULT_DRAFT_MAX
    step_token_limit: int = DEFAULT_STEP_TOKEN_LIMIT

    def __post_init__(self) -> None:
        if self.mode not in SPECULATIVE_MODES:
            raise ValueError(f"speculative must be one of {', '.join(SPECULATIVE_MODES)}, got {self.mode!r}")
        if self.draft_max < 1:
            raise ValueError(f"draft_max must be at least 1, got {self.draft_max}")

    @property
    def enabled(self) -> bool:
        return self.mode != "off"

    def per_request_cap(self, num_running: int) -> int:
        """The most drafts one of ``num_running`` decoding requests may have in a step: the step's
        rows stay within ``step_token_limit`` (none at all once the decodes alone reach it)."""
        if num_running <= 0:
            return 0
        return max(0, min(self.draft_max, (self.step_token_limit - num_running) // num_running))
