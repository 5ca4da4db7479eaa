"""Speculative decoding: n-gram drafts verified in one step change no answer.

The engine runs on the CPU backend's native route (batch-invariant: a draft's row computes the bits
a decode at its position would), so greedy and seeded requests must give the same tokens and the
same logprobs, bit for bit, with speculation on and off. The tests also check that drafts were in
fact made and accepted, so that equality is not the trivial one of a run that never speculated.
"""

from __future__ import annotations

import json
import math
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from localllm import LLM, SamplingParams
from localllm.engine.model_runner import ModelRunner
from localllm.engine.sampler import SampleRequest, sample
from localllm.sampling_params import StructuredOutput
from localllm.scheduler.output import ScheduledRequest
from localllm.scheduler.request import Request
from localllm.speculation import DraftLength, NgramIndex, SpeculationPolicy, SuffixCache
from localllm.speculation.policy import MIN_ACCEPTANCE, PAUSE_STEPS

CODE = '''def mean(values):
    total = 0
    for value in values:
        total += value
    return total / len(values)


def variance(values):
    m = mean(values)
    total = 0
    for value in values:
        total += (value - m) ** 2
    return total / len(values)
'''
EDIT = f"Rewrite this Python code with `values` renamed to `xs`. Reply with the code only.\n\n```python\n{CODE}```"
FREE = "Write a short poem about the autumn wind in the mountains."


# ---------------------------------------------------------------- the drafter and the policy


def _brute_force(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    for n in range(min(max_n, len(tokens)), min_n - 1, -1):
        suffix = tokens[len(tokens) - n:]
        for end in range(len(tokens) - 1, n - 1, -1):  # latest earlier occurrence first
            if tokens[end - n:end] == suffix:
                return tokens[end:end + k]
    return []


@settings(max_examples=300, deadline=None)
@given(tokens=st.lists(st.integers(0, 4), min_size=1, max_size=60), k=st.integers(0, 6),
       ns=st.tuples(st.integers(1, 3), st.integers(0, 3)), split=st.integers(0, 60))
def test_ngram_index_proposes_what_followed_the_longest_suffix_last_time(tokens, k, ns, split):
    min_n, max_n = ns[0], ns[0] + ns[1]
    index = NgramIndex(min_n, max_n)
    index.extend(tokens[:split])  # built in two parts, as the engine extends it between steps
    index.extend(tokens[split:])
    assert index.propose(k) == (_brute_force(tokens, k, min_n, max_n) if k else [])


def test_draft_length_grows_on_success_shrinks_on_failure_and_pauses_when_drafts_keep_failing():
    d = DraftLength(draft_max=8)
    assert d.next() == 4
    d.update(4, 4)
    assert d.next() == 8
    d.update(8, 8)
    assert d.next() == 8  # capped
    d.update(8, 2)
    assert d.next() == 3  # one more than was accepted
    for _ in range(10):
        d.update(d.current, 0)
        if d.paused_steps:
            break
    assert d.paused_steps == PAUSE_STEPS and d.acceptance == MIN_ACCEPTANCE
    assert [d.next() for _ in range(PAUSE_STEPS)] == [0] * PAUSE_STEPS
    assert d.next() >= 1


def test_suffix_cache_proposes_from_earlier_outputs_and_stays_bounded():
    cache = SuffixCache(max_tokens=20, min_n=2, max_n=3)
    cache.add([1, 2, 3, 4, 5, 6])
    cache.add([9, 2, 3, 7, 8])
    assert cache.propose([0, 2, 3], 3) == [7, 8]  # the latest output holding (2, 3)
    assert cache.propose([1, 2, 3], 3) == [4, 5, 6]  # the longest suffix wins
    assert cache.propose([5, 5], 3) == [] and cache.propose([2, 3], 0) == []
    for i in range(10):  # 50 more tokens: the first outputs go, and their index entries with them
        cache.add([100 + i, 101 + i, 102 + i, 103 + i, 104 + i])
    assert cache.num_tokens <= 20 and len(cache) == 4
    assert cache.propose([1, 2, 3], 3) == [] and cache.propose([0, 2, 3], 3) == []
    assert cache.propose([109, 110], 5) == [111, 112, 113]
    # the index holds only entries that point into the outputs kept (x..x+1 for x in 106..111, x..x+2 for
    # x in 106..110: those outputs overlap), so it stays bounded by the tokens kept
    kept = {seq_id for table in cache._last_end for seq_id, _ in table.values()}
    assert kept <= set(cache._sequences) and cache.num_entries() == 6 + 5


def test_big_batches_get_no_drafts():
    policy = SpeculationPolicy("ngram", draft_max=8, step_token_limit=16)
    assert policy.per_request_cap(1) == 8
    assert policy.per_request_cap(4) == 3  # 4 decodes + 4 x 3 drafts = 16 rows
    assert policy.per_request_cap(16) == 0 and policy.per_request_cap(40) == 0
    with pytest.raises(ValueError, match="speculative"):
        SpeculationPolicy("eagle")


# ---------------------------------------------------------------- verification keeps the distribution


def _runner() -> ModelRunner:
    """A runner without a model: only its per-request generators and the verification rule."""
    runner = ModelRunner.__new__(ModelRunner)
    runner._generators, runner._matchers, runner.grammars, runner.greedy_rows = {}, {}, None, None
    return runner


ROWS = torch.tensor([[2.0, 1.5, 1.0, 0.5, 0.0, -1.0],
                     [0.0, 1.8, 0.2, 1.0, -0.5, 0.3],
                     [1.0, 1.0, 1.0, 0.0, 0.0, 0.0]])
DRAFTS = (1, 1)  # token 1 is likely after row 0 (p=0.31) and row 1 (p=0.39)


def _verify(seed: int, params: dict) -> list[int]:
    req = Request(f"r{seed}", [7, 7], SamplingParams(seed=seed, max_tokens=10, **params))
    s = ScheduledRequest(req, [7, *DRAFTS], 1, [0], True, DRAFTS)
    return _runner()._verify(ROWS, s).sampled_token_ids[req.req_id]


def test_verification_draws_what_plain_decoding_draws_with_the_same_seed():
    """Row by row, with the request's generator: the tokens plain decoding would draw, one step at
    a time, for as long as they agree with the drafts."""
    for seed in range(200):
        got = _verify(seed, dict(temperature=0.9, top_k=5))
        g = torch.Generator().manual_seed(seed)
        want = []
        for i in range(len(DRAFTS) + 1):
            row = SampleRequest(SamplingParams(temperature=0.9, top_k=5, seed=seed), [7, 7], want.copy(), g)
            want.append(sample(ROWS[i:i + 1], [row]).token_ids[0])
            if i == len(DRAFTS) or want[-1] != DRAFTS[i]:
                break
        assert got == want, seed


CHI2_999 = {4: 18.47, 5: 20.52}


def _chi_square_ok(counts: list[int], probs: list[float]) -> tuple[bool, float]:
    total = sum(counts)
    stat = sum((c - total * p) ** 2 / (total * p) for c, p in zip(counts, probs) if p > 0)
    return stat < CHI2_999[sum(p > 0 for p in probs) - 1], stat


def test_accepted_and_corrected_tokens_follow_the_model_distribution():
    """Chi-square over 4000 seeds: the first token follows row 0's distribution whatever the draft,
    and the token after an accepted draft follows row 1's (rejection sampling with the draft as the
    proposal keeps the target distribution)."""
    draws = [_verify(seed, dict(temperature=1.0)) for seed in range(4000)]
    p0 = torch.softmax(ROWS[0], -1).tolist()
    p1 = torch.softmax(ROWS[1], -1).tolist()
    first = [d[0] for d in draws]
    ok, stat = _chi_square_ok([first.count(t) for t in range(6)], p0)
    assert ok, (stat, [first.count(t) for t in range(6)])
    second = [d[1] for d in draws if d[0] == DRAFTS[0]]
    assert abs(len(second) / len(draws) - p0[DRAFTS[0]]) < 0.03  # the acceptance rate is p(draft)
    ok, stat = _chi_square_ok([second.count(t) for t in range(6)], p1)
    assert ok, (stat, [second.count(t) for t in range(6)])
    assert all(len(d) == 1 for d in draws if d[0] != DRAFTS[0])  # a rejected draft ends the step


# ---------------------------------------------------------------- whole requests on SmolLM2


@pytest.fixture(scope="module")
def engines(smollm2_path):
    on = LLM(smollm2_path, speculative="suffix", kv_cache_memory="128MiB")  # both drafters
    off = LLM(smollm2_path, speculative="off", kv_cache_memory="128MiB")
    assert on.engine.backend.batch_invariant, "these tests need the native route"
    return on, off


def _chat_ids(llm: LLM, text: str) -> list[int]:
    return llm.engine.encode_prompt(llm.tokenizer.apply_chat_template([{"role": "user", "content": text}]))


def _answers(llm: LLM, prompts, params):
    outs = llm.generate(prompts, params)
    return [[(c.token_ids, c.text, c.finish_reason, [(lp.token_id, lp.logprob, lp.top) for lp in c.logprobs])
             for c in o.outputs] for o in outs]


def test_answers_are_the_same_bits_with_speculation(engines):
    """Greedy, seeded, penalized, n=2 and logprobs: the same tokens, text, finish reasons and
    logprobs (bitwise) as without speculation; and the drafts were many and mostly accepted."""
    on, off = engines
    prompts = [_chat_ids(on, EDIT), _chat_ids(on, FREE), _chat_ids(on, EDIT), _chat_ids(on, EDIT)]
    params = [
        SamplingParams(temperature=0.0, max_tokens=120, logprobs=2),
        SamplingParams(temperature=0.0, max_tokens=60),
        SamplingParams(temperature=0.7, top_p=0.9, seed=11, max_tokens=80, logprobs=1, n=2),
        SamplingParams(temperature=0.0, max_tokens=80, frequency_penalty=0.3, repetition_penalty=1.1),
    ]
    before = on.engine.speculator.stats.accepted_tokens
    assert _answers(on, prompts, params) == _answers(off, prompts, params)
    stats = on.engine.speculator.stats
    assert stats.accepted_tokens - before >= 20, stats  # (SmolLM2-135M rewrites more than it copies)
    assert off.engine.speculator.stats.drafted_tokens == 0


def test_a_stop_string_inside_a_step_of_several_tokens_ends_the_answer_where_it_would(engines):
    on, off = engines
    prompt = _chat_ids(on, EDIT)
    full = off.generate([prompt], SamplingParams(temperature=0.0, max_tokens=120))[0].outputs[0]
    stop = full.text[len(full.text) * 2 // 3:][:6]
    for include in (False, True):
        params = SamplingParams(temperature=0.0, max_tokens=120, stop=[stop], include_stop_str_in_output=include)
        got, want = on.generate([prompt], params)[0], off.generate([prompt], params)[0]
        assert got.outputs[0].text == want.outputs[0].text and got.outputs[0].token_ids == want.outputs[0].token_ids
        assert got.outputs[0].finish_reason == "stop"


def test_structured_output_holds_with_speculation(engines):
    """The grammar masks each draft's row: a drafted token it rejects ends the draft."""
    on, off = engines
    schema = {"type": "object", "properties": {"items": {"type": "array", "minItems": 4, "maxItems": 4, "items": {
        "type": "object", "properties": {"name": {"type": "string", "maxLength": 12}, "size": {"type": "integer"}},
        "required": ["name", "size"]}}}, "required": ["items"]}
    params = SamplingParams(temperature=0.0, max_tokens=150,
                            structured=StructuredOutput("json_schema", json.dumps(schema)))
    prompt = _chat_ids(on, "List four fruits with their sizes as JSON.")
    before = on.engine.speculator.stats.drafted_tokens
    got = on.generate([prompt], params)[0].outputs[0]
    want = off.generate([prompt], params)[0].outputs[0]
    assert got.token_ids == want.token_ids
    assert len(json.loads(got.text)["items"]) == 4
    assert on.engine.speculator.stats.drafted_tokens > before


def test_a_request_may_opt_out_and_auto_follows_the_kernels(engines, smollm2_path):
    on, _ = engines
    before = on.engine.speculator.stats.drafted_tokens
    on.generate([_chat_ids(on, EDIT)], SamplingParams(temperature=0.0, max_tokens=60, speculative=False))
    assert on.engine.speculator.stats.drafted_tokens == before
    auto_native = LLM(smollm2_path, kv_cache_memory="64MiB")
    assert auto_native.engine.speculator.policy.mode == "ngram"
    reference = LLM(smollm2_path, kv_cache_memory="64MiB", kernels="torch")  # not batch-invariant
    assert reference.engine.speculator.policy.mode == "off"
    assert LLM(smollm2_path, kv_cache_memory="64MiB", fast_math=True).engine.speculator.policy.mode == "off"


def test_many_running_requests_get_no_drafts(engines):
    """32 requests at once: each step's decodes alone reach the row limit, so nobody drafts."""
    on, off = engines
    prompts = [_chat_ids(on, EDIT)] * 32
    params = SamplingParams(temperature=0.0, max_tokens=12)
    before = on.engine.speculator.stats.drafted_tokens
    assert _answers(on, prompts, params) == _answers(off, prompts, params)
    # only the first steps (while requests are still being admitted) may draft
    assert on.engine.speculator.stats.drafted_tokens - before < 32 * 12 // 4


def test_preemption_and_the_prefix_cache_keep_the_answers(smollm2_path):
    """A cache too small for every request at once: requests are preempted and recomputed (from the
    prefix cache where it can) while others speculate."""
    rng = random.Random(3)
    small = dict(kv_cache_memory="8MiB", max_model_len=256)  # ~360 tokens: two requests at a time
    on = LLM(smollm2_path, speculative="ngram", **small)
    off = LLM(smollm2_path, speculative="off", **small)
    words = CODE.split()
    prompts = [_chat_ids(on, "Copy this text exactly: " + " ".join(rng.sample(words, len(words)))) for _ in range(4)]
    params = SamplingParams(temperature=0.0, max_tokens=60)
    assert _answers(on, prompts, params) == _answers(off, prompts, params)
    assert on.engine.stats().num_preemptions > 0, "the test wants preemptions"
    assert on.engine.speculator.stats.accepted_tokens > 0


def test_a_repeated_answer_is_drafted_from_the_suffix_cache(smollm2_path):
    """The second time an answer is written, its tokens come from the first answer (not in the
    prompt): most of it is accepted, and the answer is the same."""
    params = SamplingParams(temperature=0.0, max_tokens=80)
    accepted = {}
    for mode in ("ngram", "suffix"):
        llm = LLM(smollm2_path, speculative=mode, kv_cache_memory="64MiB")
        first = llm.generate([_chat_ids(llm, FREE)], params)[0].outputs[0].token_ids
        before = llm.engine.speculator.stats.accepted_tokens
        again = llm.generate([_chat_ids(llm, "Please: " + FREE)], params)[0].outputs[0].token_ids
        accepted[mode] = llm.engine.speculator.stats.accepted_tokens - before
        overlap = next((i for i, (a, b) in enumerate(zip(first, again)) if a != b), min(len(first), len(again)))
    assert overlap >= 20, "the test wants two answers that share their start"
    assert accepted["suffix"] >= accepted["ngram"] + 10, accepted


def test_drafts_stay_inside_max_tokens_and_the_context_window(smollm2_path):
    llm = LLM(smollm2_path, speculative="ngram", kv_cache_memory="64MiB", max_model_len=200)
    prompt = _chat_ids(llm, "Copy: " + "a b c d " * 30)
    for max_tokens in (1, 2, 5, 17):
        out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))[0]
        assert len(out.outputs[0].token_ids) == max_tokens
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True))[0]
    assert len(prompt) + len(out.outputs[0].token_ids) == 200 and out.outputs[0].finish_reason == "length"
    assert llm.engine.speculator.stats.accepted_tokens > 0


def test_acceptance_rate_is_reported(engines):
    on, _ = engines
    on.generate([_chat_ids(on, EDIT)], SamplingParams(temperature=0.0, max_tokens=60))
    s = on.engine.stats()
    assert s.spec_drafted_tokens >= s.spec_accepted_tokens > 0
    assert math.isclose(s.spec_acceptance_rate, s.spec_accepted_tokens / s.spec_drafted_tokens)
