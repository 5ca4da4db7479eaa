"""Embeddings on the engine's step thread beside generation: a waiter that left (its future
cancelled) never reaches the step thread as an error, and a large embeddings request shares the
steps with generation instead of running ahead of it. Counted in batches and steps, not seconds."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import CancelledError, Future

import pytest
import torch
from tiny_models import write_tiny_model

import localllm.engine.async_engine as async_engine_module
from localllm import LLM, SamplingParams
from localllm.engine.async_engine import AsyncEngine
from localllm.engine.embeddings import BatchingWindow, EmbeddingBatcher, _Pending, run_batch

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = write_tiny_model(tmp_path_factory.mktemp("tiny") / "tiny.gguf", seed=7)
    return LLM(model=str(path), device="cpu", dtype="float32", kv_cache_memory="16MiB")


def _generate(engine: AsyncEngine, prompt: list[int]) -> list[int]:
    async def consume():
        return [t async for o in engine.generate(prompt, GREEDY) for t in o.new_token_ids]

    return asyncio.run(consume())


def test_the_batch_runner_skips_a_cancelled_future_and_serves_the_others(tiny):
    engine = tiny.engine
    gone, kept = Future(), Future()
    assert gone.cancel()
    run_batch(engine.model, [_Pending([1, 5, 9], gone), _Pending([1, 7, 3], kept)], "mean",
              engine.runner.kv_types, engine.device)
    assert gone.cancelled() and kept.result(0).shape == (engine.model_config.hidden_size,)

    class Broken:  # a forward pass that fails: the batch's waiters get the error, the gone one nothing
        config = engine.model.config

        def __call__(self, *args):
            raise RuntimeError("forward failed")

    gone, kept = Future(), Future()
    assert gone.cancel()
    run_batch(Broken(), [_Pending([1, 5], gone), _Pending([1, 7], kept)], "mean", engine.runner.kv_types, engine.device)
    assert gone.cancelled() and isinstance(kept.exception(0), RuntimeError)


def test_a_cancelled_queued_request_is_dropped_and_never_run():
    b = EmbeddingBatcher(BatchingWindow(max_batch_size=2, max_queue_delay=60.0))
    gone, first, second = b.submit([1, 2]), b.submit([3]), b.submit([4])
    assert gone.cancel()
    batch = b.take()
    assert [p.future for p in batch] == [first, second]
    assert not first.cancel()  # taken: running, so a late cancel cannot break its result
    assert len(b) == 0


def test_an_embedding_client_that_leaves_does_not_kill_the_engine(tiny):
    engine = AsyncEngine(tiny.engine, stall_timeout=30)
    # nothing is ready alone: the abandoned request sits in the queue until two more arrive
    engine.embeddings = EmbeddingBatcher(BatchingWindow(max_batch_size=2, max_queue_delay=60.0))

    async def scenario():
        leaving = asyncio.ensure_future(engine.embed([1, 5, 9]))
        await asyncio.sleep(0)
        queued = engine.embeddings._queue[0].future
        leaving.cancel()
        await asyncio.gather(leaving, return_exceptions=True)
        for _ in range(10):  # the wrapped future's cancellation reaches the queued one on the loop
            if queued.cancelled():
                break
            await asyncio.sleep(0)
        assert queued.cancelled()
        return await asyncio.gather(engine.embed([1, 7, 3]), engine.embed([2, 4]))

    try:
        vectors = asyncio.run(scenario())
        assert all(isinstance(v, torch.Tensor) for v in vectors)
        assert len(_generate(engine, [1, 5, 9, 17, 40])) == GREEDY.max_tokens
        assert engine.health().ok and engine.is_alive
    finally:
        engine.shutdown(timeout=0)


def test_embed_many_cancels_the_rest_when_its_caller_leaves(tiny):
    engine = AsyncEngine(tiny.engine, stall_timeout=30)
    engine.embeddings = EmbeddingBatcher(BatchingWindow(max_batch_size=64, max_queue_delay=60.0))

    async def scenario():
        task = asyncio.ensure_future(engine.embed_many([[1, 2, 3]] * 5))
        await asyncio.sleep(0)
        futures = [p.future for p in engine.embeddings._queue]
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return futures

    try:
        futures = asyncio.run(scenario())
        assert len(futures) == 5 and all(f.cancelled() for f in futures)
        assert not engine.embeddings.ready(False) and len(engine.embeddings) == 0
        assert engine.is_alive
    finally:
        engine.shutdown(timeout=0)


def test_generation_makes_progress_while_a_large_embeddings_request_is_pending(tiny, monkeypatch):
    engine = AsyncEngine(tiny.engine, stall_timeout=30)
    # embeddings may run beside generation at once (no starvation wait): the policy is all that decides
    engine.embeddings = EmbeddingBatcher(BatchingWindow(max_batch_size=2, max_queue_delay=0.0, max_starvation=0.0))
    counts = {"batches": 0, "steps": 0}
    generation_added = threading.Event()
    real_run_batch, real_step = async_engine_module.run_batch, tiny.engine.step

    def counting_run_batch(*args, **kwargs):
        if counts["batches"] == 0:  # hold the first batch until the chat request is in the inbox
            assert generation_added.wait(10)
        counts["batches"] += 1
        return real_run_batch(*args, **kwargs)

    def counting_step():
        counts["steps"] += 1
        return real_step()

    monkeypatch.setattr(async_engine_module, "run_batch", counting_run_batch)
    monkeypatch.setattr(tiny.engine, "step", counting_step)
    num_inputs = 200  # 100 batches of 2

    async def scenario():
        pending = [engine.embeddings.submit([1, 2 + i % 50, 3]) for i in range(num_inputs)]
        engine._wake.set()
        chat = engine.generate([1, 5, 9, 17, 40], GREEDY)
        first = asyncio.ensure_future(chat.__anext__())
        await asyncio.sleep(0)  # the request is in the inbox now
        generation_added.set()
        tokens = list((await first).new_token_ids)
        async for out in chat:
            tokens.extend(out.new_token_ids)
        at_finish = dict(counts)
        vectors = await asyncio.gather(*(asyncio.wrap_future(f) for f in pending))
        return tokens, at_finish, vectors

    try:
        tokens, at_finish, vectors = asyncio.run(scenario())
    finally:
        engine.shutdown(timeout=0)
    assert len(tokens) == GREEDY.max_tokens and len(vectors) == num_inputs
    # batches and steps took turns: the chat finished long before the embeddings did
    assert at_finish["batches"] <= at_finish["steps"] + 1, at_finish
    assert at_finish["batches"] < num_inputs // 2, at_finish
    assert counts["batches"] == num_inputs // 2


def test_the_embeddings_batch_beside_generation_fits_a_steps_token_budget():
    b = EmbeddingBatcher(BatchingWindow(max_batch_size=32, max_batch_tokens=8192))
    for _ in range(10):
        b.submit([1] * 100)
    assert len(b.take(max_tokens=250)) == 2  # 200 tokens: a third would go over
    assert len(b.take()) == 8
    b.submit([1] * 1000)
    assert len(b.take(max_tokens=250)) == 1  # one longer than the budget still runs, alone


def test_fail_all_skips_cancelled_futures():
    b = EmbeddingBatcher()
    gone, waiting = b.submit([1]), b.submit([2])
    assert gone.cancel()
    b.fail_all(RuntimeError("stopped"))
    assert isinstance(waiting.exception(0), RuntimeError)
    with pytest.raises(CancelledError):
        gone.result(0)
