"""Speculative decoding with a draft model (``--draft-model``).

The draft models here are SmolLM2 itself cut to its first layers (``write_first_layers``: a
smaller model with the same vocabulary, as self-speculative decoding's early exit makes one) and
SmolLM2 whole. The target checks every draft as it checks n-gram drafts, so the answers must be the
same bits as without speculation; the tests also check that drafts were made and accepted, and
that a model of another vocabulary is refused.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_speculative import EDIT, FREE, _answers, _chat_ids
from tiny_models import write_first_layers, write_tiny_model

from localllm import LLM, SamplingParams
from localllm.config.engine import EngineConfig
from localllm.engine.draft_model import DraftModel
from localllm.errors import InvalidRequestError, ModelLoadError
from localllm.scheduler.request import Request
from localllm.speculation import DraftCost, DraftLength
from localllm.speculation.policy import MAX_PAUSE_STEPS, MIN_DRAFT_MODEL_GAIN, PAUSE_STEPS

DRAFT_LAYERS = 28  # of SmolLM2-135M's 30 (with 8 or 16, hardly a draft is right: the layers were not trained to exit early)


@pytest.fixture(scope="module")
def first_layers(smollm2_path, tmp_path_factory):
    return str(write_first_layers(smollm2_path, tmp_path_factory.mktemp("draft") / "smollm2-first-layers.gguf", DRAFT_LAYERS))


class FreeGuesses(DraftCost):
    """Guesses measured as costing nothing: the engine then always asks for the longest draft, so
    that the tests of answers see as many drafts (and rejections) as possible."""

    @property
    def ratio(self) -> float:
        return 0.0


def drafting(llm: LLM) -> LLM:
    llm.engine.speculator.draft_cost = FreeGuesses()
    return llm


@pytest.fixture(scope="module")
def engines(smollm2_path, first_layers):
    drafted = drafting(LLM(smollm2_path, draft_model=first_layers, kv_cache_memory="128MiB"))
    off = LLM(smollm2_path, speculative="off", kv_cache_memory="128MiB")
    return drafted, off


def test_the_first_layers_copy_is_a_smaller_model_with_the_same_vocabulary(engines):
    drafted, _ = engines
    draft = drafted.engine.speculator.draft_model
    assert drafted.engine.speculator.policy.mode == "draft"  # auto, with a draft model on batch-invariant kernels
    assert draft.runner.model.config.num_layers == DRAFT_LAYERS < drafted.engine.model_config.num_layers
    assert draft.vocab_limit == drafted.engine.model_config.vocab_size


def test_answers_are_the_same_bits_with_a_draft_model(engines):
    """Greedy, seeded with n=2, penalized and logprobs: the same tokens, text, finish reasons and
    logprobs as without speculation, while the draft model's guesses were made and many kept."""
    drafted, off = engines
    prompts = [_chat_ids(drafted, EDIT), _chat_ids(drafted, FREE), _chat_ids(drafted, EDIT)]
    params = [
        SamplingParams(temperature=0.0, max_tokens=100, logprobs=2),
        SamplingParams(temperature=0.7, top_p=0.9, seed=5, max_tokens=60, n=2),
        SamplingParams(temperature=0.0, max_tokens=60, frequency_penalty=0.3, repetition_penalty=1.1),
    ]
    stats = drafted.engine.speculator.stats
    before = (stats.drafted_tokens, stats.accepted_tokens)
    assert _answers(drafted, prompts, params) == _answers(off, prompts, params)
    assert stats.drafted_tokens - before[0] >= 40, stats
    assert stats.accepted_tokens - before[1] >= 10, stats
    # finished requests hand their rows of the draft cache back
    assert not drafted.engine.speculator.draft_model._seqs


def test_the_model_as_its_own_draft_has_every_greedy_draft_accepted(smollm2_path):
    """Batch invariance: the draft model's decode rows are the bits of the target's verification
    rows, so the same model drafting for itself is right every time (greedy)."""
    llm = drafting(LLM(smollm2_path, draft_model=smollm2_path, kv_cache_memory="64MiB"))
    off = LLM(smollm2_path, speculative="off", kv_cache_memory="64MiB")
    params = SamplingParams(temperature=0.0, max_tokens=80, ignore_eos=True)
    prompt = _chat_ids(llm, FREE)
    assert _answers(llm, [prompt], params) == _answers(off, [prompt], params)
    s = llm.engine.stats()
    assert s.spec_drafted_tokens >= 40 and s.spec_accepted_tokens == s.spec_drafted_tokens, s


def test_preemption_and_a_small_cache_keep_the_answers(smollm2_path, first_layers):
    """Requests preempted and recomputed in the target's cache while the draft model drafts for
    them: the draft cache's rows of a request stay valid (its tokens do not change)."""
    small = dict(kv_cache_memory="8MiB", max_model_len=256)
    drafted = drafting(LLM(smollm2_path, draft_model=first_layers, **small))
    off = LLM(smollm2_path, speculative="off", **small)
    prompts = [_chat_ids(drafted, f"Copy this text exactly, then count to {n}: " + FREE) for n in range(4)]
    params = SamplingParams(temperature=0.0, max_tokens=60)
    assert _answers(drafted, prompts, params) == _answers(off, prompts, params)
    assert drafted.engine.stats().num_preemptions > 0, "the test wants preemptions"
    assert drafted.engine.speculator.stats.drafted_tokens > 0


def test_a_draft_model_that_does_not_pay_stops_drafting(smollm2_path, first_layers):
    """The first-layers copy costs nearly a step of the model per guess and is right less than
    half the time: at that rate no draft length pays, so after the first measurements the engine
    pauses each request's drafts, trying one guess after each pause, and the answer comes at about
    the speed of plain decoding (ungated, it drafts most steps: ~2x slower)."""
    llm = LLM(smollm2_path, draft_model=first_layers, kv_cache_memory="64MiB")
    out = llm.generate([_chat_ids(llm, FREE)], SamplingParams(temperature=0.0, max_tokens=160, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 160
    cost, stats = llm.engine.speculator.draft_cost, llm.engine.speculator.stats
    assert cost.ratio > 0.5, cost
    assert 0 < stats.drafted_tokens <= 8 + 160 // PAUSE_STEPS * 2, stats


@settings(max_examples=300, deadline=None)
@given(acceptance=st.floats(0, 1), ratio=st.floats(0, 2), longest=st.integers(1, 12))
def test_the_draft_length_asked_for_is_the_one_that_pays_most(acceptance, ratio, longest):
    cost = DraftCost(guess_seconds=ratio, step_seconds=1.0)

    def gain(k):
        return sum(acceptance**i for i in range(k + 1)) / (1 + k * ratio)

    k = cost.best_length(acceptance, longest)
    if k == 0:
        assert all(gain(j) <= MIN_DRAFT_MODEL_GAIN + 1e-9 for j in range(1, longest + 1))
    else:
        assert 1 <= k <= longest and gain(k) > MIN_DRAFT_MODEL_GAIN
        assert all(gain(j) <= gain(k) + 1e-9 for j in range(1, longest + 1))
    assert DraftCost().best_length(acceptance, longest) == longest  # nothing measured yet: optimistic


def test_a_paused_request_probes_with_one_guess_and_pauses_longer_each_time_in_a_row():
    d = DraftLength(draft_max=8)
    for pause in (PAUSE_STEPS, 2 * PAUSE_STEPS, 4 * PAUSE_STEPS):
        d.pause()
        assert [d.next() for _ in range(pause)] == [0] * pause
        assert d.probing and d.next() > 0
        d.update(drafted=1, accepted=0)
        assert not d.probing
    d.paid()
    d.pause()
    assert d.paused_steps == PAUSE_STEPS
    for _ in range(20):
        d.pause()
    assert d.paused_steps == MAX_PAUSE_STEPS


def test_a_model_of_another_vocabulary_is_refused(smollm2_path, tmp_path):
    tiny = write_tiny_model(tmp_path / "tiny.gguf")
    with pytest.raises(ModelLoadError, match="same vocabulary"):
        LLM(smollm2_path, draft_model=str(tiny), kv_cache_memory="64MiB")


def test_draft_mode_needs_a_draft_model():
    with pytest.raises(InvalidRequestError, match="draft model"):
        EngineConfig(model="m.gguf", speculative="draft")


def test_an_explicit_mode_other_than_draft_leaves_the_draft_model_out(smollm2_path, first_layers):
    llm = LLM(smollm2_path, draft_model=first_layers, speculative="ngram", kv_cache_memory="64MiB")
    assert llm.engine.speculator.policy.mode == "ngram" and llm.engine.speculator.draft_model is None


def _tiny_draft(path, target, min_cache_tokens=256) -> DraftModel:
    return DraftModel.load(
        str(path), target_tokenizer=target.tokenizer, target_name="tiny", target_vocab_size=200,
        backend=target.engine.backend, dtype=target.engine.dtype, device=target.engine.device, kv_dtype=None,
        block_size=16, cache_budget_bytes=0, min_cache_tokens=min_cache_tokens,
    )


@pytest.mark.parametrize("accepted, other", [(0, 1), (2, 1), (4, 1), (0, 6), (1, 5)])
def test_guesses_depend_only_on_the_requests_tokens(tmp_path, accepted, other):
    """After the target kept ``accepted`` of 4 drafts and then ``other`` tokens of its own (one:
    the token sampled after the drafts; more: steps without drafting, as while a request's
    drafting pauses), the next guesses are those of a draft model that never saw the rejected
    drafts: the cache's stale rows are rewritten, never read."""
    path = write_tiny_model(tmp_path / "tiny.gguf")
    target = LLM(str(path), speculative="off", kv_cache_memory="4MiB")
    kept = _tiny_draft(path, target)
    req = Request("r", [5, 9, 14, 2, 7] * 4, SamplingParams(max_tokens=50))
    first = kept.propose([(req, 4)])["r"]
    own = [(first[min(accepted + i, 3)] + 1 + i) % 200 for i in range(other)]  # never the draft in its place
    req.output_token_ids += first[:accepted] + own
    again = kept.propose([(req, 4)])["r"]
    assert again == _tiny_draft(path, target).propose([(req, 4)])["r"]
    # what the cache holds: the request's tokens, then the drafts fed to get the next ones
    assert kept._seqs["r"].fed == req.all_token_ids + again[:-1]


def test_the_draft_cache_evicts_idle_requests_and_drafts_nothing_it_cannot_hold(tmp_path):
    """A draft cache of 4 blocks of 16 tokens: two 20-token requests fit (2 blocks each), a third
    gets no drafts while both draft in the same step, and evicts the least recently used one
    otherwise; drafts never exceed k and the target's vocabulary."""
    path = write_tiny_model(tmp_path / "tiny.gguf")
    target = LLM(str(path), speculative="off", kv_cache_memory="4MiB")
    draft = _tiny_draft(path, target, min_cache_tokens=64)
    assert len(draft._free) == 4
    reqs = [Request(f"r{i}", [1 + i] * 20, SamplingParams(max_tokens=50)) for i in range(3)]
    got = draft.propose([(reqs[0], 3), (reqs[1], 5), (reqs[2], 2)])
    assert set(got) == {"r0", "r1"} and len(got["r0"]) == 3 and len(got["r1"]) == 5
    assert all(0 <= t < 200 for drafts in got.values() for t in drafts)
    assert "r2" not in draft._seqs
    # later, r1 drafts alone and then r2 does: r0, the least recently used, makes room
    draft.propose([(reqs[1], 2)])
    assert set(draft.propose([(reqs[2], 2)])) == {"r2"}
    assert set(draft._seqs) == {"r1", "r2"}
    draft.release("r1")
    draft.release("r2")
    assert len(draft._free) == 4
