"""The sampler's maths against distributions computed by hand.

Each filter (temperature, top-k, min-p, top-p) and each penalty (repetition, presence, frequency,
logit bias) on hand-built logit rows and token histories, with the expected distribution written
out from its definition (``math.exp``, not the code under test); then seeded draws, on the host
sampler and on the device sampler (``gpu_runner.sample_on_device``, plain torch: it runs here),
checked against those distributions with a chi-square test, and never outside their support.

The filters apply in turn, each to what the previous one left, renormalized: temperature, top-k
(the k most likely tokens and every token tied with the k-th), min-p (tokens at least min_p x the
most likely one's probability), top-p (the smallest set of the most likely tokens whose mass
reaches top_p, and every token tied with the last of them).
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from localllm.engine.gpu_runner import sample_on_device
from localllm.engine.sampler import (
    SampleRequest,
    _filter_and_sample,
    apply_penalties,
    greedy_ids,
    sample,
    sampling_distribution,
)
from localllm.sampling_params import SamplingParams


def softmax(values: list[float]) -> list[float]:
    top = max(values)
    e = [math.exp(v - top) if v != -math.inf else 0.0 for v in values]
    return [x / sum(e) for x in e]


def renormalized(probs: list[float], keep: set[int]) -> list[float]:
    total = sum(p for i, p in enumerate(probs) if i in keep)
    return [p / total if i in keep else 0.0 for i, p in enumerate(probs)]


def dist(logits: list[float], **params) -> list[float]:
    return sampling_distribution(torch.tensor(logits), SamplingParams(**params)).tolist()


def assert_dist(got: list[float], want: list[float]) -> None:
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        assert g == pytest.approx(w, abs=1e-6), (i, got, want)


LOG_HALVES = [math.log(p) for p in (0.5, 0.25, 0.125, 0.125)]  # exact binary fractions after softmax

# ---------------------------------------------------------------------------------------------
# Each filter alone


def test_temperature_divides_the_logits():
    assert_dist(dist([1.0, 2.0, 3.0], temperature=0.5), softmax([2.0, 4.0, 6.0]))
    assert_dist(dist([1.0, 2.0, 3.0], temperature=2.0), softmax([0.5, 1.0, 1.5]))


def test_top_k_keeps_the_k_most_likely():
    logits = [3.0, 1.0, 2.0, 0.0]
    assert_dist(dist(logits, top_k=2), renormalized(softmax(logits), {0, 2}))
    assert_dist(dist(logits, top_k=1), [1.0, 0.0, 0.0, 0.0])
    assert_dist(dist(logits, top_k=4), softmax(logits))
    assert_dist(dist(logits, top_k=0), softmax(logits))  # off


def test_top_k_keeps_the_tokens_tied_with_the_kth():
    logits = [3.0, 2.0, 2.0, 0.0]
    assert_dist(dist(logits, top_k=2), renormalized(softmax(logits), {0, 1, 2}))


def test_min_p_drops_tokens_below_a_fraction_of_the_most_likely():
    probs = [0.5, 0.3, 0.15, 0.05]
    logits = [math.log(p) for p in probs]
    assert_dist(dist(logits, min_p=0.2), renormalized(probs, {0, 1, 2}))  # 0.05 < 0.2 x 0.5
    assert_dist(dist(logits, min_p=0.3), renormalized(probs, {0, 1, 2}))  # 0.15 >= 0.3 x 0.5 stays
    assert_dist(dist(logits, min_p=0.31), renormalized(probs, {0, 1}))


@pytest.mark.parametrize(("top_p", "keep"), [
    (0.5, {0}),  # 0.5 alone reaches 0.5: the smallest set
    (0.6, {0, 1}),
    (0.75, {0, 1}),
    (0.76, {0, 1, 2, 3}),  # {0, 1, 2} reaches it; token 3 ties with token 2
    (1.0, {0, 1, 2, 3}),
    (0.01, {0}),
])
def test_top_p_keeps_the_smallest_set_reaching_p_and_its_ties(top_p, keep):
    assert_dist(dist(LOG_HALVES, top_p=top_p), renormalized([0.5, 0.25, 0.125, 0.125], keep))


def test_top_p_ties_do_not_depend_on_the_order_of_the_vocabulary():
    probs = [0.3, 0.4, 0.3]
    logits = [math.log(p) for p in probs]
    assert_dist(dist(logits, top_p=0.6), renormalized(probs, {0, 1, 2}))
    assert_dist(dist(logits, top_p=0.4), renormalized(probs, {1}))


# ---------------------------------------------------------------------------------------------
# Together, in order


def test_filters_apply_in_turn_each_to_what_the_last_left():
    logits = [2.0, 1.5, 1.0, 0.5, 0.0, -1.0]
    t = 0.8
    after_temperature = softmax([v / t for v in logits])
    after_top_k = renormalized(after_temperature, {0, 1, 2, 3, 4})  # top_k = 5
    # min_p = 0.1 of the top probability, on what top-k left
    kept = {i for i, p in enumerate(after_top_k) if p >= 0.1 * max(after_top_k)}
    after_min_p = renormalized(after_top_k, kept)
    # top_p = 0.7 on that, renormalized: the smallest prefix reaching it
    order = sorted(kept, key=lambda i: -after_min_p[i])
    mass, prefix = 0.0, set()
    for i in order:
        prefix.add(i)
        mass += after_min_p[i]
        if mass >= 0.7:
            break
    want = renormalized(after_min_p, prefix)
    assert len(prefix) < len(kept) < 5  # each filter did something here
    assert_dist(dist(logits, temperature=t, top_k=5, min_p=0.1, top_p=0.7), want)


# ---------------------------------------------------------------------------------------------
# Penalties


def _req(params: SamplingParams, prompt: list[int], output: list[int]) -> SampleRequest:
    return SampleRequest(params, prompt, output, None)


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits_of_every_seen_token():
    logits = torch.tensor([2.0, -2.0, 1.0, 0.5, 3.0])
    out = apply_penalties(logits.clone(), _req(SamplingParams(repetition_penalty=2.0), [0, 1], [3]))
    assert out.tolist() == [1.0, -4.0, 1.0, 0.25, 3.0]  # prompt tokens 0, 1 and output token 3


def test_presence_and_frequency_penalties_count_the_output_only():
    logits = torch.tensor([1.0, 1.0, 1.0, 1.0])
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)
    out = apply_penalties(logits.clone(), _req(params, [0, 0, 0], [2, 2, 3]))
    # token 2: twice (0.5 + 2 x 0.25), token 3: once (0.5 + 0.25); prompt token 0 untouched
    assert out.tolist() == [1.0, 1.0, 0.0, 0.25]
    negative = apply_penalties(logits.clone(), _req(SamplingParams(presence_penalty=-1.0), [], [1]))
    assert negative.tolist() == [1.0, 2.0, 1.0, 1.0]


def test_logit_bias_adds_to_the_named_tokens():
    logits = torch.tensor([0.0, 0.0, 0.0])
    out = apply_penalties(logits.clone(), _req(SamplingParams(logit_bias={1: 5.0, 2: -100.0}), [], []))
    assert out.tolist() == [0.0, 5.0, -100.0]


def test_sample_draws_from_the_penalized_distribution():
    """Through ``sample``: repetition penalty 2 on the prompt's token 0 and a bias of -100 on token 3
    turn logits [2, 2, 0, 2] into [1, 2, 0, -98]."""
    logits = torch.tensor([[2.0, 2.0, 0.0, 2.0]])
    params = SamplingParams(temperature=1.0, repetition_penalty=2.0, logit_bias={3: -100.0})
    g = torch.Generator().manual_seed(3)
    reqs = [SampleRequest(params, [0], [], g)]
    draws = [sample(logits, reqs).token_ids[0] for _ in range(DRAWS)]
    _check_draws(draws, softmax([1.0, 2.0, 0.0, -98.0]))


# ---------------------------------------------------------------------------------------------
# Seeded draws against the distributions

# chi-square critical values at p = 0.001 by degrees of freedom: a correct sampler fails one
# such check in a thousand runs; the seeds are fixed, so a run is reproducible either way
CHI2_999 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32}
DRAWS = 4000

CASES = [
    ([2.0, 1.5, 1.0, 0.5, 0.0, -1.0, -3.0], dict(temperature=1.0)),
    ([2.0, 1.5, 1.0, 0.5, 0.0, -1.0, -3.0], dict(temperature=0.7, top_k=3)),
    (LOG_HALVES, dict(temperature=1.0, top_p=0.76)),
    ([math.log(p) for p in (0.5, 0.3, 0.15, 0.05)], dict(temperature=1.0, min_p=0.2)),
    ([2.0, 1.5, 1.0, 0.5, 0.0, -1.0], dict(temperature=0.8, top_k=5, min_p=0.1, top_p=0.7)),
]


def _chi_square(counts: list[int], probs: list[float]) -> tuple[float, int]:
    support = [i for i, p in enumerate(probs) if p > 0]
    stat = sum((counts[i] - DRAWS * probs[i]) ** 2 / (DRAWS * probs[i]) for i in support)
    return stat, len(support) - 1


def _check_draws(draws: list[int], want: list[float]) -> None:
    counts = [draws.count(i) for i in range(len(want))]
    outside = [i for i, c in enumerate(counts) if c and want[i] == 0.0]
    assert not outside, f"drew tokens {outside} that the filters exclude: {counts}"
    stat, dof = _chi_square(counts, want)
    if dof:
        assert stat < CHI2_999[dof], f"chi-square {stat:.1f} >= {CHI2_999[dof]} ({dof} dof): {counts} vs {want}"


@pytest.mark.parametrize(("logits", "params"), CASES, ids=range(len(CASES)))
def test_host_sampler_draws_follow_the_distribution(logits, params):
    want = dist(logits, **params)
    g = torch.Generator().manual_seed(1234)
    row = torch.tensor(logits)
    p = SamplingParams(**params)
    _check_draws([_filter_and_sample(row, p, g)[0] for _ in range(DRAWS)], want)


@pytest.mark.parametrize(("logits", "params"), CASES, ids=range(len(CASES)))
def test_device_sampler_draws_follow_the_same_distribution(logits, params):
    want = dist(logits, **params)
    g = torch.Generator().manual_seed(4321)
    rows = torch.tensor([logits] * DRAWS)

    def col(name, default, dtype):
        return torch.full((DRAWS,), params.get(name, default), dtype=dtype)

    ids = sample_on_device(rows, col("temperature", 1.0, torch.float32), col("top_k", 0, torch.long),
                           col("top_p", 1.0, torch.float32), col("min_p", 0.0, torch.float32), generator=g)
    _check_draws(ids.tolist(), want)


def test_the_check_catches_an_inverted_filter(monkeypatch):
    """The draws test fails a sampler whose min-p keeps the tokens it should drop."""
    import localllm.engine.sampler as sampler

    logits, params = CASES[3]
    want = dist(logits, **params)
    real = sampler.sampling_distribution

    def inverted(row, p):
        probs = torch.softmax(row / p.temperature, dim=-1)
        probs = probs.masked_fill(probs >= p.min_p * probs.max(), 0.0)  # the inequality the wrong way
        return probs / probs.sum() if float(probs.sum()) > 0 else real(row, p)

    monkeypatch.setattr(sampler, "sampling_distribution", inverted)
    g = torch.Generator().manual_seed(1)
    draws = [_filter_and_sample(torch.tensor(logits), SamplingParams(**params), g)[0] for _ in range(200)]
    with pytest.raises(AssertionError, match="exclude"):
        _check_draws(draws, want)


def test_host_and_device_filters_agree_on_random_rows():
    g = torch.Generator().manual_seed(7)
    for trial in range(50):
        logits = torch.randn(40, generator=g) * 3
        if trial % 5 == 0:
            logits[3] = logits[7]  # a tie somewhere
        params = SamplingParams(temperature=float(torch.rand(1, generator=g)) + 0.3,
                                top_k=int(torch.randint(0, 12, (1,), generator=g)),
                                top_p=float(torch.rand(1, generator=g)) * 0.9 + 0.1,
                                min_p=float(torch.rand(1, generator=g)) * 0.2)
        host = sampling_distribution(logits, params)
        no_top_p = sampling_distribution(logits, SamplingParams(temperature=params.temperature, top_k=params.top_k,
                                                                min_p=params.min_p))
        assert torch.allclose(host.sum(), torch.tensor(1.0))
        support = set(host.nonzero().flatten().tolist())
        assert support <= set(no_top_p.nonzero().flatten().tolist())  # top-p only takes away
        # the device sampler never draws outside the host's support
        n = 64
        ids = sample_on_device(logits.repeat(n, 1), torch.full((n,), params.temperature),
                               torch.full((n,), params.top_k, dtype=torch.long), torch.full((n,), params.top_p),
                               torch.full((n,), params.min_p), generator=g)
        assert set(ids.tolist()) <= support, (trial, params)


@settings(max_examples=60, deadline=None)
@given(rows=st.integers(1, 5), vocab=st.sampled_from([1024, 1100, 4096, 49152, 49153, 127]),
       levels=st.integers(1, 6), seed=st.integers(0, 2**31 - 1))
def test_greedy_ids_is_the_first_argmax(rows, vocab, levels, seed):
    """The blocked argmax picks what torch.argmax picks (the first largest entry of each row), with
    ties everywhere (logits drawn from a few levels), -inf entries and a vocabulary not a multiple
    of the block."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randint(0, levels, (rows, vocab), generator=gen).float()
    logits[torch.rand(rows, vocab, generator=gen) < 0.1] = -math.inf
    assert torch.equal(greedy_ids(logits), logits.argmax(dim=-1))
    tail_wins = logits.clone()
    tail_wins[:, -1] = levels  # the largest entry in the last, partial block
    assert torch.equal(greedy_ids(tail_wins), tail_wins.argmax(dim=-1))
