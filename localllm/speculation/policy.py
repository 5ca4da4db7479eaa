"""How many tokens to draft: per request from the acceptance it sees, per step from the batch."""

from __future__ import annotations

from dataclasses import dataclass

from localllm.config import DEFAULT_DRAFT_MAX, SPECULATIVE_MODES
# A step's rows beyond this many are compute, not a second read of the weights: speculation stops
# there (a step of many running requests is already compute-bound).
DEFAULT_STEP_TOKEN_LIMIT = 16
# Drafting pauses for a request whose drafts are accepted less than this often (an n-gram that
# keeps matching text that is not being copied), and tries again after PAUSE_STEPS steps.
MIN_ACCEPTANCE = 0.25
PAUSE_STEPS = 16
_EMA = 0.3  # weight of the newest verification in the acceptance average


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

    def __post_init__(self) -> None:
        self.current = self.current or max(1, self.draft_max // 2)

    def next(self) -> int:
        """The drafts to ask for now (0 while paused)."""
        if self.paused_steps > 0:
            self.paused_steps -= 1
            return 0
        return self.current

    def update(self, drafted: int, accepted: int) -> None:
        if drafted <= 0:
            return
        self.acceptance = (1 - _EMA) * self.acceptance + _EMA * accepted / drafted
        if accepted == drafted:
            self.current = min(self.draft_max, 2 * self.current)
        else:
            self.current = max(1, accepted + 1)
        if self.acceptance < MIN_ACCEPTANCE:
            self.paused_steps = PAUSE_STEPS
            self.acceptance = MIN_ACCEPTANCE  # one good draft after the pause lifts it above again


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
