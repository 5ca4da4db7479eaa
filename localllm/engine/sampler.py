"""Batched sampling with per-request parameters.

A request's sampled tokens depend only on its own logits, parameters and seed, never on what
else shares the batch: each seeded request draws from its own ``torch.Generator``.

Faults stay in their row. A row whose (penalized) logits hold NaN or +inf, or nothing but -inf,
is not sampled: it comes back in :attr:`SampleResult.errors` and only its request fails. A row
whose logits are finite but overflow once divided by the temperature has a distribution that is
all on its maximum, so it takes the argmax. An exception raised while sampling one row (a logits
processor, a penalty, a grammar) fails that row alone. Nothing non-finite reaches
``torch.multinomial``.

Rows with structured output (``SampleRequest.matcher``) are masked to the tokens their grammar
allows next, after the penalties, and their matcher advances by the token drawn (see
:mod:`localllm.engine.structured`). Logprobs stay those of the model's own distribution.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch

from localllm.engine.structured import BitmaskFill, accept, mask_logits
from localllm.outputs import TokenLogprobs
from localllm.sampling_params import SamplingParams


@dataclass(slots=True)
class SampleRequest:
    """One row of a sampling batch."""

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    generator: torch.Generator | None
    matcher: object | None = None  # an xgrammar GrammarMatcher: the request's structured output


class SampleResult(NamedTuple):
    """One token id per row (``-1`` for a row in ``errors``), logprobs where asked, the rows that
    could not be sampled (row -> reason), and how many rows held non-finite values."""

    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]
    errors: dict[int, str]
    num_nonfinite_rows: int


NONFINITE_MESSAGE = "the model produced non-finite logits (NaN or inf) for this request"


def _needs_processing(p: SamplingParams) -> bool:
    return bool(
        p.logit_bias
        or p.repetition_penalty != 1.0
        or p.presence_penalty
        or p.frequency_penalty
    )


def apply_penalties(logits: torch.Tensor, req: SampleRequest) -> torch.Tensor:
    """Logit bias, repetition (HF style: prompt+output), presence and frequency (output only)."""
    p = req.params
    if p.logit_bias:
        ids = torch.tensor([int(k) for k in p.logit_bias], dtype=torch.long)
        vals = torch.tensor([float(v) for v in p.logit_bias.values()], dtype=logits.dtype)
        valid = (ids >= 0) & (ids < logits.shape[-1])
        logits[ids[valid]] += vals[valid]
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(req.prompt_token_ids) | set(req.output_token_ids)), dtype=torch.long)
        if seen.numel():
            vals = logits[seen]
            logits[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
    if (p.presence_penalty or p.frequency_penalty) and req.output_token_ids:
        out = torch.tensor(req.output_token_ids, dtype=torch.long)
        counts = torch.bincount(out, minlength=logits.shape[-1])[: logits.shape[-1]].to(logits.dtype)
        logits -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)
    return logits


def filter_sorted(sorted_logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                  min_p: torch.Tensor) -> torch.Tensor:
    """The distribution sampled from, for rows of temperature-scaled logits ``[B, V]`` sorted in
    descending order, with per-row ``top_k`` (``<= 0``: off), ``top_p`` and ``min_p`` (``[B]``):
    probabilities in the same order, renormalized. The filters apply in turn, each to what the
    previous one left (renormalized):

    1. top-k: the ``k`` most likely tokens, and every token tied with the ``k``-th;
    2. min-p: the tokens whose probability is at least ``min_p`` x the most likely one's;
    3. top-p: the smallest set of the most likely tokens whose mass reaches ``top_p``, and every
       token tied with the last of them (``top_p >= 1``: off).

    No host synchronisation: the host sampler and the device sampler (``gpu_runner``) share it."""
    vocab = sorted_logits.shape[-1]
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), torch.full_like(top_k, vocab))
    kth = sorted_logits.gather(-1, (k - 1)[:, None].long())
    probs = torch.softmax(sorted_logits.masked_fill(sorted_logits < kth, float("-inf")), dim=-1)
    probs = probs.masked_fill(probs < min_p[:, None] * probs[:, :1], 0.0)
    probs = probs / probs.sum(dim=-1, keepdim=True)
    cum = torch.cumsum(probs, dim=-1)
    last = (cum < top_p[:, None]).sum(dim=-1).clamp(max=vocab - 1)  # the first index where the mass reaches top_p
    keep = (probs >= probs.gather(-1, last[:, None])) | (top_p >= 1.0)[:, None]
    probs = probs.masked_fill(~keep, 0.0)
    return probs / probs.sum(dim=-1, keepdim=True)


def sampling_distribution(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """One row's distribution (``[V]``, the row's token order) under ``p``: see :func:`filter_sorted`.
    Without top-p nothing needs sorting: top-k is a threshold at the k-th largest logit."""
    scaled = logits / p.temperature
    vocab = scaled.shape[-1]
    if p.top_p >= 1.0:
        if 0 < p.top_k < vocab:
            scaled = scaled.masked_fill(scaled < torch.topk(scaled, p.top_k).values[-1], float("-inf"))
        probs = torch.softmax(scaled, dim=-1)
        if p.min_p > 0.0:
            probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
            probs = probs / probs.sum()
        return probs
    sorted_logits, order = torch.sort(scaled, descending=True)
    row = filter_sorted(sorted_logits[None], torch.tensor([p.top_k]), torch.tensor([p.top_p], dtype=scaled.dtype),
                        torch.tensor([p.min_p], dtype=scaled.dtype))[0]
    return torch.zeros_like(row).scatter_(0, order, row)


def _filter_and_sample(logits: torch.Tensor, p: SamplingParams, generator: torch.Generator | None) -> tuple[int, bool]:
    """Draw from one finite row; the bool says the scaled row overflowed (then: its argmax)."""
    probs = sampling_distribution(logits, p)
    if not bool(torch.isfinite(probs).all()) or not float(probs.sum()) > 0.0:
        # Finite logits divided by a small temperature overflowed: the limit distribution puts
        # all its mass on the maximum.
        return int(logits.argmax()), True
    return int(torch.multinomial(probs, 1, generator=generator).item()), False


def finite_rows(logits: torch.Tensor) -> torch.Tensor:
    """``[S]`` bool: the row can be sampled (no NaN, no +inf, not only -inf); works on any device.
    One pass: a row's maximum is NaN if it holds a NaN (``amax`` propagates them), +inf if it
    holds a +inf, -inf if every entry is -inf, and finite otherwise."""
    return torch.isfinite(logits.amax(dim=-1))


ARGMAX_BLOCK = 128


def greedy_ids(logits: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(dim=-1)`` (the first largest of each row) for ``[S, V]`` logits, in two
    vectorized passes on the CPU: each block of :data:`ARGMAX_BLOCK` entries' maximum (``amax``),
    then the first block holding the row's maximum, and the first maximum within it (plus the
    last ``V % ARGMAX_BLOCK`` entries, taken only where strictly larger). torch's CPU ``argmax``
    over a whole row is a scalar loop: 64 against ~20 us for a 49152-entry row here. Rows holding
    NaN are not sampled (``finite_rows``), so their pick is unspecified."""
    rows, vocab = logits.shape
    whole = vocab // ARGMAX_BLOCK * ARGMAX_BLOCK
    if not logits.is_cpu or whole < 8 * ARGMAX_BLOCK or logits.stride(-1) != 1:
        return logits.argmax(dim=-1)
    blocks = logits[:, :whole].reshape(rows, whole // ARGMAX_BLOCK, ARGMAX_BLOCK)
    block_max = blocks.amax(dim=-1)
    block = block_max.argmax(dim=-1)
    ids = block * ARGMAX_BLOCK + blocks[torch.arange(rows), block].argmax(dim=-1)
    if whole < vocab:
        tail_max, tail_at = logits[:, whole:].max(dim=-1)
        ids = torch.where(tail_max > block_max.gather(1, block[:, None]).squeeze(1), whole + tail_at, ids)
    return ids


GreedyScan = Callable[[torch.Tensor], "tuple[list[int], list[bool]] | None"]
"""A backend's :meth:`~localllm.kernels.backend.Backend.greedy_rows`."""


def greedy_and_bad_rows(logits: torch.Tensor, scan: GreedyScan | None = None) -> tuple[list[int], list[int]]:
    """``(greedy_ids(logits), the rows that finite_rows refuses)`` as lists: by ``scan`` (the
    backend's one call) where it answers, else by those torch ops."""
    scanned = scan(logits) if scan is not None else None
    if scanned is not None:
        ids, finite = scanned
        return ids, [i for i, ok in enumerate(finite) if not ok]
    ok = finite_rows(logits)
    bad = [] if bool(ok.all()) else (~ok).nonzero().flatten().tolist()
    return greedy_ids(logits).tolist(), bad


def sample(logits: torch.Tensor, reqs: list[SampleRequest], masks: BitmaskFill | None = None,
           scan: GreedyScan | None = None) -> SampleResult:
    """Sample one token per row of ``logits [S, V]`` (float32); ``masks``: the constrained rows'
    bitmask, already being filled (else it is filled here); ``scan``: the backend's greedy scan."""
    raw_logits = logits
    processed = logits
    errors: dict[int, str] = {}
    if any(_needs_processing(r.params) for r in reqs):
        processed = logits.clone()
        for i, r in enumerate(reqs):
            if _needs_processing(r.params):
                try:
                    apply_penalties(processed[i], r)
                except Exception as exc:  # noqa: BLE001 - fails this row's request only
                    errors[i] = f"applying penalties failed: {exc!r}"
    constrained = [i for i, r in enumerate(reqs) if r.matcher is not None and i not in errors]
    if constrained:
        if processed is logits:
            processed = logits.clone()
        try:
            if masks is not None:  # the same rows (and a row that failed its penalties: masked, unused)
                masks.apply(processed)
            else:
                mask_logits(processed, constrained, [reqs[i].matcher for i in constrained], processed.shape[-1])
        except Exception as exc:  # noqa: BLE001 - fails the constrained rows only
            for i in constrained:
                errors[i] = f"applying the grammar failed: {exc!r}"
    greedy, bad = greedy_and_bad_rows(processed, scan)
    for i in bad:
        errors.setdefault(i, NONFINITE_MESSAGE)
    num_nonfinite = len(bad)
    token_ids: list[int] = []
    for i, r in enumerate(reqs):
        if i in errors:
            token_ids.append(-1)
        elif r.params.greedy:
            token_ids.append(greedy[i])
        else:
            try:
                token, overflowed = _filter_and_sample(processed[i], r.params, r.generator)
            except Exception as exc:  # noqa: BLE001 - fails this row's request only
                errors[i] = f"sampling failed: {exc!r}"
                token_ids.append(-1)
                continue
            num_nonfinite += overflowed
            token_ids.append(token)

    for i in constrained:
        if i not in errors and token_ids[i] >= 0 and not accept(reqs[i].matcher, token_ids[i]):
            errors[i] = f"the grammar does not allow token {token_ids[i]}"
            token_ids[i] = -1

    logprobs: list[TokenLogprobs | None] = [None] * len(reqs)
    wanted = [i for i, r in enumerate(reqs) if r.params.logprobs is not None and i not in errors]
    if wanted:
        lp = torch.log_softmax(raw_logits[wanted], dim=-1)
        for row, i in enumerate(wanted):
            k = reqs[i].params.logprobs
            top = []
            if k:
                vals, ids = torch.topk(lp[row], k)
                top = list(zip(ids.tolist(), vals.tolist()))
            logprobs[i] = TokenLogprobs(token_ids[i], float(lp[row, token_ids[i]]), top)
    return SampleResult(token_ids, logprobs, errors, num_nonfinite)
