"""Continuous batching on the real SmolLM2 model: batch invariance, prefix caching, chunked
prefill next to decodes, preemption, sampling, abort."""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest

from localllm import LLM, SamplingParams
from localllm.engine.async_engine import AsyncEngine
from localllm.errors import InvalidRequestError, QueueFullError

GREEDY = SamplingParams(max_tokens=10, temperature=0.0)
TOPICS = ["cats", "the moon", "bread", "rivers", "chess", "winter", "music", "trains", "volcanoes",
          "bees", "glass", "maps", "tea", "robots", "forests", "clocks"]


@pytest.fixture(scope="module")
def smollm2(smollm2_path):
    """SmolLM2 as an engine of this module's route (see conftest's ``BATCH_INVARIANT_MODULES``): the
    default one where the native kernels build."""
    return LLM(model=smollm2_path, kv_cache_memory="512MiB")


def chat(topic: str) -> list[dict]:
    return [{"role": "user", "content": f"Tell me one fact about {topic}."}]


def test_sixteen_prompts_together_equal_each_alone(smollm2):
    prompts = [smollm2.tokenizer.apply_chat_template(chat(t)) for t in TOPICS]
    together = smollm2.generate(prompts, GREEDY)
    for prompt, out in zip(prompts, together):
        alone = smollm2.generate([prompt], GREEDY)[0]
        assert out.token_ids == alone.token_ids
        assert out.text == alone.text


@pytest.fixture(scope="module")
def no_cache(smollm2_path):
    return LLM(model=smollm2_path, kv_cache_memory="256MiB", enable_prefix_caching=False)


def test_prefix_cache_hit_prefills_only_the_suffix(smollm2, no_cache):
    prefix = list(range(1000, 1512))  # 512 tokens = 32 full blocks
    first = prefix + smollm2.tokenizer.encode(" Question one: what is this?")
    second = prefix + smollm2.tokenizer.encode(" Another question entirely.")
    smollm2.generate([first], GREEDY)
    before = smollm2.engine.stats()
    out = smollm2.generate([second], GREEDY)[0]
    after = smollm2.engine.stats()
    assert out.num_cached_tokens == 512
    assert after.prefix_cache_hits - before.prefix_cache_hits == 512
    assert after.prefix_cache_queries - before.prefix_cache_queries == len(second)
    reference = no_cache.generate([second], GREEDY)[0]
    assert reference.num_cached_tokens == 0
    assert out.token_ids == reference.token_ids


def test_long_prompt_does_not_stall_running_decodes(smollm2_path):
    llm = LLM(model=smollm2_path, kv_cache_memory="256MiB", max_num_batched_tokens=512)
    engine = llm.engine
    decoders = [engine.add_request(llm.tokenizer.apply_chat_template(chat(t)),
                                   SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
                for t in TOPICS[:8]]
    while engine.scheduler.num_waiting or any(
        engine.scheduler.get_request(r).num_output_tokens == 0 for r in decoders
    ):
        engine.step()
    long_id = engine.add_request(list(range(2000, 4000)), SamplingParams(max_tokens=2, temperature=0.0))
    steps_with_prefill = 0
    while engine.scheduler.get_request(long_id).num_output_tokens == 0:
        got = {o.req_id for o in engine.step()}
        steps_with_prefill += 1
        # every step that carries a chunk of the long prompt also advances all 8 decodes
        assert set(decoders) <= got
    assert steps_with_prefill >= 4  # 2,000 tokens with a 512-token budget shared with 8 decodes
    for r in decoders:
        engine.abort(r)
    engine.abort(long_id)


def test_preemption_keeps_outputs_identical(smollm2, smollm2_path):
    prompts = [smollm2.tokenizer.apply_chat_template(chat(t)) for t in TOPICS[:6]]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    # 20 blocks of 16 tokens cannot hold six ~60-token sequences at once: someone is preempted.
    element_bytes = smollm2.engine.kv_types.dtype.itemsize  # the route's KV dtype: float16 native, float32 reference
    tight = LLM(model=smollm2_path, kv_cache_memory=20 * 16 * 2 * 30 * 3 * 64 * element_bytes, max_model_len=320)
    outs = tight.generate(prompts, params)
    assert tight.engine.stats().num_preemptions > 0
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == smollm2.generate([prompt], params)[0].token_ids


def test_seeded_sampling_does_not_depend_on_the_batch(smollm2):
    prompt = smollm2.tokenizer.apply_chat_template(chat("owls"))
    p = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.95, seed=1234)
    alone = smollm2.generate([prompt], p)[0].token_ids
    others = [smollm2.tokenizer.apply_chat_template(chat(t)) for t in TOPICS[:5]]
    batch = smollm2.generate(
        others + [prompt], [SamplingParams(max_tokens=12, temperature=1.0, seed=i) for i in range(5)] + [p]
    )
    assert batch[-1].token_ids == alone
    unseeded = {tuple(smollm2.generate([prompt], SamplingParams(max_tokens=12, temperature=1.0))[0].token_ids)
                for _ in range(3)}
    assert len(unseeded) > 1  # sampling is really random without a seed


def test_n_samples_share_the_prompt_blocks(smollm2):
    prompt = list(range(3000, 3100))  # 6 full blocks
    out = smollm2.generate([prompt], SamplingParams(max_tokens=6, temperature=1.0, n=3, seed=7))[0]
    assert len(out.outputs) == 3
    assert all(len(c.token_ids) == 6 for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    stats_before = smollm2.engine.stats()
    smollm2.generate([prompt + [5]], SamplingParams(max_tokens=6, temperature=1.0, n=3, seed=7))
    hits = smollm2.engine.stats().prefix_cache_hits - stats_before.prefix_cache_hits
    assert hits >= 3 * 96  # every sample reused the cached prompt blocks


def test_logprobs_and_processors(smollm2):
    prompt = smollm2.tokenizer.apply_chat_template(chat("salt"))
    out = smollm2.generate([prompt], SamplingParams(max_tokens=4, temperature=0.0, logprobs=3))[0]
    assert len(out.logprobs) == 4
    for tok, lp in zip(out.token_ids, out.logprobs):
        assert lp.token_id == tok
        assert len(lp.top) == 3 and lp.top[0][0] == tok  # greedy picks the top token
        assert lp.logprob == pytest.approx(lp.top[0][1])
        assert lp.logprob <= 0
    forced = smollm2.tokenizer.encode(" banana")[0]
    biased = smollm2.generate([prompt], SamplingParams(max_tokens=3, temperature=0.0, logit_bias={forced: 100}))[0]
    assert biased.token_ids == [forced] * 3
    penalized = smollm2.generate(
        [prompt], SamplingParams(max_tokens=3, temperature=0.0, logit_bias={forced: 100}, repetition_penalty=100.0)
    )[0]
    assert penalized.token_ids[0] == forced and penalized.token_ids[1] != forced
    freq = smollm2.generate([prompt], SamplingParams(max_tokens=40, temperature=0.0, frequency_penalty=2.0,
                                                     presence_penalty=-2.0, logprobs=20))[0]
    # Each penalized greedy token is the best of the model's own (unpenalized) top 20 once every
    # token already generated loses 2.0 per use and gains 2.0 for being there at all: a second use
    # costs 2.0, a first nothing. At some steps a penalty that ignored the count (the presence
    # penalty's flat one) would have picked another token: the check tells the two apart.
    uses: Counter[int] = Counter()
    flat_picks_otherwise = 0
    for tok, lp in zip(freq.token_ids, freq.logprobs):
        scores = {t: logprob - 2.0 * uses[t] + 2.0 * (uses[t] > 0) for t, logprob in lp.top}
        assert tok == max(scores, key=scores.get), (tok, scores)
        flat = {t: logprob for t, logprob in lp.top}  # 2.0 per token there at all, less 2.0: nothing
        flat_picks_otherwise += max(flat, key=flat.get) != tok
        uses[tok] += 1
    assert flat_picks_otherwise > 0 and max(uses.values()) >= 2


def test_a_stop_token_finishes_with_stop_and_is_not_in_the_text(smollm2):
    prompt = smollm2.tokenizer.apply_chat_template(chat("salt"))
    plain = smollm2.generate([prompt], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))[0]
    assert plain.finish_reason == "length"
    third = plain.token_ids[2]
    stopped = smollm2.generate([prompt], SamplingParams(max_tokens=6, temperature=0.0, stop_token_ids=[third]))[0]
    first = plain.token_ids.index(third)
    assert stopped.finish_reason == "stop" and stopped.token_ids == plain.token_ids[: first + 1]
    assert stopped.text == smollm2.tokenizer.decode(plain.token_ids[:first])


def test_bad_requests_are_rejected(smollm2):
    with pytest.raises(InvalidRequestError, match="context length"):
        smollm2.generate([[1] * (smollm2.engine.max_model_len + 1)], GREEDY)
    with pytest.raises(InvalidRequestError, match="vocabulary"):
        smollm2.generate([[10**9]], GREEDY)
    with pytest.raises(InvalidRequestError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(InvalidRequestError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    assert not smollm2.engine.has_unfinished_requests()


def test_async_engine_abort_frees_kv_and_queue_full(smollm2_path):
    engine = AsyncEngine.from_config(
        __import__("localllm.config.engine", fromlist=["EngineConfig"]).EngineConfig(
            model=str(smollm2_path), kv_cache_memory=128 << 20, max_num_seqs=1, max_waiting=1
        )
    )

    async def main():
        gen = engine.generate([1, 2, 3, 4], SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True))
        first = await gen.__anext__()
        assert first.new_token_ids
        assert engine.stats().kv_cache_usage > 0
        # one running (cap 1) + one waiting (max 1): a third request is refused
        waiting = engine.generate([5, 6, 7], SamplingParams(max_tokens=2, temperature=0.0))
        waiting_task = asyncio.ensure_future(waiting.__anext__())
        await asyncio.sleep(0.3)
        with pytest.raises(QueueFullError):
            await engine.generate([8, 9], SamplingParams(max_tokens=2)).__anext__()
        await gen.aclose()  # the consumer leaves: the request is aborted at once
        await waiting_task
        await waiting.aclose()
        for _ in range(200):  # the step thread drains the aborts and republishes its stats
            stats = engine.stats()
            if stats.num_running == 0 and stats.num_waiting == 0 and stats.kv_cache_usage == 0.0:
                break
            await asyncio.sleep(0.05)
        assert stats.num_running == 0 and stats.num_waiting == 0
        assert stats.kv_cache_usage == 0.0
        assert stats.request_success.get("abort", 0) >= 1

    try:
        asyncio.run(main())
    finally:
        engine.shutdown()


def test_async_engine_loads_on_its_step_thread_and_raises_load_errors_here(smollm2_path, tmp_path, monkeypatch):
    """from_config builds the engine on the step thread (all torch work on one thread: one
    OpenMP pool), and a load error still reaches the caller as itself."""
    import threading

    from localllm.config.engine import EngineConfig
    from localllm.engine.llm_engine import LLMEngine
    from localllm.errors import ModelLoadError

    built_on = []
    init = LLMEngine.__init__

    def recording_init(self, config):
        built_on.append(threading.current_thread().name)
        init(self, config)

    def step_threads() -> int:
        return sum(t.name == "localllm-engine" for t in threading.enumerate())

    monkeypatch.setattr(LLMEngine, "__init__", recording_init)
    before = step_threads()
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF" + bytes(12))  # a file, so it is loaded (not pulled), and fails to load
    with pytest.raises(ModelLoadError, match="broken.gguf"):
        AsyncEngine.from_config(EngineConfig(model=str(broken)))
    assert built_on == ["localllm-engine"]
    assert step_threads() == before  # that step thread ended

    engine = AsyncEngine.from_config(EngineConfig(model=str(smollm2_path), kv_cache_memory=32 << 20))
    try:
        assert built_on == ["localllm-engine", "localllm-engine"]

        async def reply():
            return [out async for out in engine.generate([1, 2, 3], SamplingParams(max_tokens=3, temperature=0.0))]

        outs = asyncio.run(reply())
        assert sum(len(o.new_token_ids) for o in outs) == 3
    finally:
        engine.shutdown()
    with pytest.raises(TypeError):
        AsyncEngine()


def test_the_context_is_the_models_unless_memory_is_short(tmp_path, monkeypatch, caplog):
    """Without --max-model-len an engine serves the model's whole context; where the memory free
    once the weights are in cannot hold its KV cache, it serves what half of that memory holds (at
    least the default cache), and says so in one line."""
    import logging

    from tiny_models import write_tiny_model

    from localllm.engine import cache_sizing

    model = write_tiny_model(tmp_path / "long.gguf", hidden=512, num_heads=8, num_kv_heads=8, layers=4,
                             context_length=262144)  # 8 KiB of KV a token: 2 GiB for the whole context
    monkeypatch.setattr(cache_sizing, "free_memory", lambda device="cpu": 64 << 30)
    assert LLM(model=str(model), kernels="torch", kv_cache_dtype="float16").engine.max_model_len == 262144
    monkeypatch.setattr(cache_sizing, "free_memory", lambda device="cpu": 3 << 30)
    with caplog.at_level(logging.WARNING, logger="localllm.engine.cache_sizing"):
        engine = LLM(model=str(model), kernels="torch", kv_cache_dtype="float16").engine
    assert engine.max_model_len == (3 << 29) // (8 << 10)  # half of 3 GiB: 1.5 GiB of KV
    lowered = [r.getMessage() for r in caplog.records if "context window lowered" in r.getMessage()]
    assert len(lowered) == 1 and "from 262144 to 196608 tokens" in lowered[0], lowered
    assert LLM(model=str(model), kernels="torch", kv_cache_dtype="float16", max_model_len=4096).engine.max_model_len == 4096
