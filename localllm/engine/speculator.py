"""The engine's half of speculative decoding: which running requests draft, how many tokens, from
which drafter, and what each verification teaches.

The drafters and the rules are plain Python in :mod:`localllm.speculation`; the draft model is
:mod:`localllm.engine.draft_model`. Between steps :meth:`Speculator.propose` writes each speculating
request's guesses into ``Request.spec_token_ids``; the scheduler gives them rows in the next step,
the runner verifies them, and :meth:`Speculator.observe` learns from what was kept.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from localllm.engine.draft_model import DraftModel
from localllm.engine.model_runner import ModelRunnerOutput
from localllm.scheduler.output import SchedulerOutput
from localllm.scheduler.request import Request
from localllm.speculation import (
    DraftCost,
    DraftLength,
    NgramIndex,
    SpeculationPolicy,
    SpeculationStats,
    SuffixCache,
)

log = logging.getLogger(__name__)


def speculation_mode(asked: str, draft_model: str | None, batch_invariant: bool, kernels: str) -> str:
    """The mode an engine runs: ``auto`` is drafting (from the draft model if there is one, else
    n-gram lookup) where the kernels are batch-invariant (a draft's row then computes the bits a
    decode would: no token changes), else off; any other mode as asked."""
    if asked != "auto":
        if asked != "draft" and draft_model:
            log.warning("speculative %s: the draft model %s is not used", asked, draft_model)
        return asked
    if not batch_invariant:
        if draft_model:
            log.warning("the %s kernels are not batch-invariant: speculation is off and the draft model %s is "
                        "not used (--speculative draft forces it)", kernels, draft_model)
        return "off"
    return "draft" if draft_model else "ngram"


@dataclass(slots=True)
class _Drafting:
    """One sample's drafting state, made on its first proposal."""

    length: DraftLength
    ngram: NgramIndex | None = None  # (n-gram and suffix modes)


@dataclass(slots=True)
class Speculator:
    policy: SpeculationPolicy
    draft_model: DraftModel | None = None
    stats: SpeculationStats = field(default_factory=SpeculationStats)
    draft_cost: DraftCost = field(default_factory=DraftCost)  # (measured while a draft model drafts)
    suffix_cache: SuffixCache | None = None
    _requests: dict[str, _Drafting] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.policy.mode == "suffix":  # drafts from other answers match by chance more: 3 tokens at least
            self.suffix_cache = SuffixCache(min_n=3)

    def observe(self, out: SchedulerOutput, result: ModelRunnerOutput, step_seconds: float) -> None:
        """After a step: the totals grow, each verified request's draft length learns from what it
        accepted, and a decode step's time is the draft model's yardstick."""
        stats = self.stats
        stats.drafted_tokens += result.num_drafted
        stats.accepted_tokens += result.num_accepted
        if self.draft_model is not None and all(len(s.token_ids) == 1 + len(s.draft_token_ids) for s in out.scheduled):
            self.draft_cost.observe_step(step_seconds)
        for s in out.scheduled:
            if not s.draft_token_ids:
                continue
            stats.verify_steps += 1
            drafting = self._requests.get(s.req_id)
            tokens = result.sampled_token_ids.get(s.req_id)
            if drafting is not None and tokens:
                drafting.length.update(len(s.draft_token_ids), len(tokens) - 1)
                if self.draft_model is not None:
                    self.draft_cost.observe_verification(len(s.draft_token_ids), len(tokens) - 1)

    def propose(self, running: list[Request], max_model_len: int) -> None:
        """Guess the next tokens of every decoding request in ``running`` that speculates: as many
        as its draft length, the step's row limit, ``max_tokens`` and the context window leave room
        for (with a draft model: as many as pay, see ``DraftCost``)."""
        cap = self.policy.per_request_cap(len(running))
        if cap <= 0:  # a batch this big is compute-bound already: nobody drafts
            return
        to_draft: list[tuple[Request, int]] = []  # for the draft model
        for req in running:
            if not req.sampling_params.speculative or req.num_computed_tokens + 1 != req.num_tokens:
                continue
            drafting = self._requests.get(req.req_id)
            if drafting is None:
                if self.draft_model is None:
                    drafting = _Drafting(DraftLength(self.policy.draft_max), NgramIndex())
                else:  # a new request expects what the draft model's guesses have been worth so far
                    drafting = _Drafting(DraftLength(self.policy.draft_max, acceptance=self.draft_cost.acceptance))
                self._requests[req.req_id] = drafting
            params = req.sampling_params
            room = max_model_len - req.num_tokens - 1
            if params.max_tokens is not None:
                room = min(room, params.max_tokens - req.num_output_tokens - 1)
            length = drafting.length
            k = min(length.next(), cap, room)
            if k <= 0:
                continue
            if self.draft_model is not None:
                k = 1 if length.probing else self.draft_cost.best_length(length.acceptance, k)
                if k <= 0:
                    length.pause()
                    continue
                if not length.probing:
                    length.paid()
                to_draft.append((req, k))
                continue
            ngram = drafting.ngram
            ngram.extend(req.token_ids_slice(len(ngram), req.num_tokens))
            drafts = ngram.propose(k)
            if not drafts and self.suffix_cache is not None:  # nothing to copy here: an earlier answer?
                drafts = self.suffix_cache.propose(req.token_ids_slice(max(req.num_tokens - ngram.max_n, 0),
                                                                       req.num_tokens), k)
            req.spec_token_ids = drafts
        if to_draft:
            guesses = self.draft_model.propose(to_draft)
            for req, _ in to_draft:  # (a request the draft cache has no room for gets none)
                req.spec_token_ids = guesses.get(req.req_id, [])
            for seconds in self.draft_model.guess_seconds:
                self.draft_cost.observe_guess(seconds)

    def answer_finished(self, req: Request) -> None:
        """A sample's answer is complete (not aborted): it feeds the suffix cache."""
        if self.suffix_cache is not None:
            self.suffix_cache.add(req.output_token_ids)  # drafts for later requests

    def release(self, req_id: str) -> None:
        """A sample is gone: its drafting state and its rows in the draft model's cache go too."""
        self._requests.pop(req_id, None)
        if self.draft_model is not None:
            self.draft_model.release(req_id)
