"""Speculative decoding: guesses of a request's next tokens, checked by the model in one step.

A *drafter* proposes up to ``k`` tokens that may follow a request's tokens
(:class:`NgramIndex`: the longest recent n-gram that reappears in the prompt or output;
:class:`SuffixCache`: where it appeared in a recent request's output). The
scheduler gives the request ``1 + k`` tokens in its next step: its last token and the drafts. The
runner samples each of those rows in order, exactly as plain decoding would sample them one step at
a time (the same sampler, the same per-request generator, the same grammar matcher), and keeps the
drafts while the sampled token equals the draft; the first sample that differs (or the one after
the last draft) is the step's last token. Batch invariance makes every row's logits the same bits as
without speculation, so the tokens are the same: greedy and seeded requests give the answer they
give with speculation off.

Plain Python, no tensors: the engine owns the drafters and the :class:`SpeculationPolicy` that
decides how many drafts each request gets.
"""

from localllm.speculation.ngram import NgramIndex
from localllm.speculation.policy import (
    DEFAULT_DRAFT_MAX,
    SPECULATIVE_MODES,
    DraftCost,
    DraftLength,
    SpeculationPolicy,
    SpeculationStats,
)
from localllm.speculation.suffix_cache import SuffixCache

__all__ = [
    "DEFAULT_DRAFT_MAX",
    "SPECULATIVE_MODES",
    "DraftCost",
    "DraftLength",
    "NgramIndex",
    "SpeculationPolicy",
    "SpeculationStats",
    "SuffixCache",
]
