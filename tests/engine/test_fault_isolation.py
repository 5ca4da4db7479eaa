"""A fault that belongs to one request finishes that request only: the sampler's non-finite rows,
a model step that fails with one request in the batch, a detokenizer that throws, a hostile chat
template; the engine loop's watchdog and its death callbacks. Tiny random models keep it fast."""

from __future__ import annotations

import asyncio
import math
import threading
import time

import pytest
import torch
from tiny_models import write_tiny_model

from localllm import LLM, SamplingParams
from localllm.engine.async_engine import AsyncEngine
from localllm.engine.sampler import NONFINITE_MESSAGE, SampleRequest, sample
from localllm.errors import InvalidRequestError, RequestFailedError

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
PROMPTS = [[1, 5 + i, 9, 17 + 2 * i, 40] for i in range(6)]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = write_tiny_model(tmp_path_factory.mktemp("tiny") / "tiny.gguf", seed=7)
    return LLM(model=str(path), device="cpu", dtype="float32", kv_cache_memory="16MiB")


def _req(params: SamplingParams, generator=None) -> SampleRequest:
    return SampleRequest(params, [1, 2, 3], [], generator)


# ---------------------------------------------------------------- the sampler


def test_the_one_bad_request_of_the_issue_is_refused_up_front():
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(repetition_penalty=1e-45)
    assert e.value.param == "repetition_penalty"
    for field, value in [("temperature", math.nan), ("top_p", math.inf), ("top_k", 2**40), ("seed", 2**64),
                         ("stop", ["x"] * 65), ("stop", ["x" * 2000]), ("presence_penalty", math.nan),
                         ("logit_bias", {1: math.nan}), ("stop_token_ids", [-1])]:
        with pytest.raises(InvalidRequestError) as e:
            SamplingParams(**{field: value})
        assert e.value.param == field


def test_nonfinite_rows_fail_alone_and_never_reach_multinomial():
    logits = torch.randn(5, 50)
    logits[1, 7] = math.nan
    logits[2, 3] = math.inf
    logits[3] = -math.inf
    params = [SamplingParams(temperature=0.8, seed=1), SamplingParams(temperature=0.8),
              SamplingParams(temperature=0.0), SamplingParams(temperature=0.5), SamplingParams(temperature=0.0)]
    gens = [torch.Generator().manual_seed(1) if p.seed is not None else None for p in params]
    result = sample(logits, [_req(p, g) for p, g in zip(params, gens)])
    assert set(result.errors) == {1, 2, 3}
    assert all(result.errors[i] == NONFINITE_MESSAGE for i in (1, 2, 3))
    assert [result.token_ids[i] for i in (1, 2, 3)] == [-1, -1, -1]
    assert result.num_nonfinite_rows == 3
    assert result.token_ids[4] == int(logits[4].argmax())
    # Row 0 is drawn as if alone: same seed, same token.
    alone = sample(logits[:1].clone(), [_req(params[0], torch.Generator().manual_seed(1))])
    assert alone.token_ids[0] == result.token_ids[0] and not alone.errors


def test_a_row_that_overflows_at_its_temperature_takes_its_argmax():
    logits = torch.zeros(1, 10)
    logits[0, 4] = 3e38
    logits[0, 6] = -3e38
    result = sample(logits, [_req(SamplingParams(temperature=1e-6))])
    assert result.token_ids == [4] and not result.errors and result.num_nonfinite_rows == 0  # greedy below 1e-5
    result = sample(logits, [_req(SamplingParams(temperature=0.01))])
    assert result.token_ids == [4] and not result.errors and result.num_nonfinite_rows == 1


def test_a_penalty_that_raises_fails_its_row_only(monkeypatch):
    import localllm.engine.sampler as sampler_module

    real = sampler_module.apply_penalties

    def flaky(logits, req):
        if req.params.presence_penalty == 1.5:
            raise RuntimeError("processor bug")
        return real(logits, req)

    monkeypatch.setattr(sampler_module, "apply_penalties", flaky)
    logits = torch.randn(2, 20)
    result = sample(logits, [_req(SamplingParams(temperature=0, presence_penalty=1.5)),
                             _req(SamplingParams(temperature=0, presence_penalty=1.0))])
    assert list(result.errors) == [0] and "processor bug" in result.errors[0]
    assert result.token_ids[1] == int(logits[1].argmax())


# ---------------------------------------------------------------- the engine


def _solo(llm: LLM, prompt) -> list[int]:
    return llm.generate([prompt], GREEDY)[0].token_ids


def _run_all(llm: LLM, prompts) -> dict[str, object]:
    """Each prompt's token ids, or the error its request failed with."""
    engine = llm.engine
    ids = {engine.add_request(p, GREEDY): i for i, p in enumerate(prompts)}
    results: dict[int, object] = {i: [] for i in ids.values()}
    while engine.has_unfinished_requests():
        for out in engine.step():
            i = ids[out.req_id]
            if out.error is not None:
                results[i] = out.error
            else:
                results[i].extend(out.new_token_ids)
    return results


def test_a_model_step_that_fails_with_one_request_fails_that_request_only(tiny, monkeypatch):
    solo = [_solo(tiny, p) for p in PROMPTS]
    runner = tiny.engine.runner
    real = runner.execute
    poison = PROMPTS[3][1]
    calls = {"n": 0}

    def execute(out):
        calls["n"] += 1
        if any(s.request.prompt_token_ids[1] == poison for s in out.scheduled):
            raise RuntimeError("kernel fault")
        return real(out)

    monkeypatch.setattr(runner, "execute", execute)
    before = tiny.engine.counters.request_success.get("error", 0)
    results = _run_all(tiny, PROMPTS)
    assert isinstance(results[3], RequestFailedError) and "kernel fault" in results[3].message
    for i, p in enumerate(PROMPTS):
        if i != 3:
            assert results[i] == solo[i], i
    assert tiny.engine.counters.request_success["error"] == before + 1
    assert tiny.engine.scheduler.stats().kv_cache_usage == 0.0 and not tiny.engine.has_unfinished_requests()
    monkeypatch.setattr(runner, "execute", real)
    assert _solo(tiny, PROMPTS[3]) == solo[3]  # the engine is fine afterwards


def test_a_transient_step_failure_is_retried_and_nobody_fails(tiny, monkeypatch):
    solo = [_solo(tiny, p) for p in PROMPTS[:3]]
    runner = tiny.engine.runner
    real = runner.execute
    state = {"failed": False}

    def execute(out):
        if not state["failed"]:
            state["failed"] = True
            raise MemoryError("transient")
        return real(out)

    monkeypatch.setattr(runner, "execute", execute)
    failures = tiny.engine.counters.num_step_failures
    assert _run_all(tiny, PROMPTS[:3]) == dict(enumerate(solo))
    assert tiny.engine.counters.num_step_failures == failures + 1


def test_a_detokenizer_that_throws_fails_its_request_only(tiny, monkeypatch):
    from localllm.tokenizer import IncrementalDetokenizer

    solo = [_solo(tiny, p) for p in PROMPTS[:3]]
    real = IncrementalDetokenizer.step

    def step(self, ids):
        if self.ids[:4] == PROMPTS[1][-4:]:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "broken")
        return real(self, ids)

    monkeypatch.setattr(IncrementalDetokenizer, "step", step)
    results = _run_all(tiny, PROMPTS[:3])
    assert isinstance(results[1], RequestFailedError)
    assert results[0] == solo[0] and results[2] == solo[2]


def test_nan_logits_for_one_request_fail_it_and_count(tiny, monkeypatch):
    runner = tiny.engine.runner
    real = runner._logits  # the step's forward pass (ModelRunner.execute runs it between sampling setup and sampling)

    def logits_with_nan(ids, positions, meta, sample_rows):
        logits = real(ids, positions, meta, sample_rows)
        if logits is None:
            return None
        logits = logits.clone()  # out of inference mode
        for i, (_, s) in enumerate(sample_rows):
            if s.request.prompt_token_ids[1] == PROMPTS[0][1]:
                logits[i, 0] = math.nan
        return logits

    monkeypatch.setattr(runner, "_logits", logits_with_nan)
    before = tiny.engine.counters.num_nonfinite_rows
    results = _run_all(tiny, PROMPTS[:2])
    assert isinstance(results[0], RequestFailedError) and "non-finite" in results[0].message
    assert isinstance(results[1], list) and len(results[1]) == GREEDY.max_tokens
    assert tiny.engine.counters.num_nonfinite_rows == before + 1


# ---------------------------------------------------------------- AsyncEngine: errors, watchdog, death


def test_async_generate_raises_the_request_error_and_serves_the_next(tiny, monkeypatch):
    engine = AsyncEngine(tiny.engine, stall_timeout=30)
    runner = tiny.engine.runner
    real = runner.execute

    def execute(out):
        if any(s.request.prompt_token_ids[1] == 99 for s in out.scheduled):
            raise RuntimeError("boom")
        return real(out)

    monkeypatch.setattr(runner, "execute", execute)

    async def consume(prompt):
        return [o async for o in engine.generate(prompt, GREEDY)]

    try:
        with pytest.raises(RequestFailedError):
            asyncio.run(consume([1, 99, 3]))
        assert sum(len(o.new_token_ids) for o in asyncio.run(consume(PROMPTS[0]))) == GREEDY.max_tokens
        assert engine.health().ok
    finally:
        engine.shutdown(timeout=0)


def test_watchdog_reports_a_stalled_step(tiny, monkeypatch):
    release = threading.Event()
    real = tiny.engine.step

    def hanging_step():
        release.wait(20)
        return real()

    monkeypatch.setattr(tiny.engine, "step", hanging_step)
    engine = AsyncEngine(tiny.engine, stall_timeout=0.5)

    async def consume():
        return [o async for o in engine.generate(PROMPTS[0], GREEDY)]

    try:
        worker = threading.Thread(target=lambda: asyncio.run(consume()))
        worker.start()
        deadline = time.monotonic() + 10
        while engine.health().ok and time.monotonic() < deadline:
            time.sleep(0.05)
        state = engine.health()
        assert state.stalled and not state.ok and "stalled" in state.reason
        release.set()
        worker.join(20)
        assert engine.health().ok
    finally:
        release.set()
        engine.shutdown(timeout=0)


def test_a_dead_loop_calls_back_and_reports_its_cause(tiny, monkeypatch):
    def broken_schedule():
        raise AssertionError("scheduler invariant broken")

    engine = AsyncEngine(tiny.engine)
    died = threading.Event()
    causes = []
    engine.on_death(lambda exc: (causes.append(exc), died.set()))
    monkeypatch.setattr(tiny.engine.scheduler, "schedule", broken_schedule)

    async def consume():
        return [o async for o in engine.generate(PROMPTS[0], GREEDY)]

    with pytest.raises(Exception, match="the engine stopped"):
        asyncio.run(consume())
    assert died.wait(5) and isinstance(causes[0], AssertionError)
    state = engine.health()
    assert not state.ok and "scheduler invariant broken" in state.reason
    monkeypatch.undo()
    for sid in list(tiny.engine._children):  # leave the shared engine clean for the next test
        tiny.engine.abort(sid)


# ---------------------------------------------------------------- chat templates from model files


@pytest.mark.parametrize(
    "template, kind",
    [
        ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", "longer than"),
        ("{{ 'a' * 10**10 }}", "chat template error"),
        ("{% set x = 2 %}{{ x ** 100000000 }}", "chat template error"),
        ("{% for i in range(100000) %}{% for j in range(100000) %}{{ 'xxxxxxxxxxxxxxxx' }}{% endfor %}{% endfor %}",
         "more than"),
        ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", "chat template failed"),
    ],
)
def test_a_hostile_chat_template_cannot_hang_or_exhaust_the_process(tiny, monkeypatch, template, kind):
    import localllm.tokenizer.templates as tokenizer_module

    tok = tiny.tokenizer
    monkeypatch.setattr(tokenizer_module, "TEMPLATE_TIME_LIMIT_S", 1.0)
    # 1 MiB of output, not 64: the output limit, not the time limit, must stop the loop that writes
    # (64 MiB in 16-character pieces took ~1 s on a loaded 2-core machine, and the time limit fired first)
    monkeypatch.setattr(tokenizer_module, "TEMPLATE_OUTPUT_LIMIT_CHARS", 1 << 20)
    monkeypatch.setattr(tok, "_template", tokenizer_module.make_jinja_env().from_string(template))
    t0 = time.monotonic()
    with pytest.raises((InvalidRequestError, RequestFailedError), match=kind):
        tok.render_chat([{"role": "user", "content": "hi"}])
    assert time.monotonic() - t0 < 10
