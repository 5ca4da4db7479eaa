"""Batch invariance on the CPU backend's default path: a request's tokens, and the
logprobs they were chosen with, do not depend on the other requests in its steps, on where
chunked prefill cut its prompt, or on prefix-cache hits.

Each request is run alone first (one engine, one request at a time; the shared system prompt
hits the prefix cache from the second request on), then all together on an engine with another
step budget (other chunk boundaries), some arriving while others decode, some sharing a prefix
with requests already running. Logprobs are compared bitwise: they are the log-softmax of the
whole logit row, so equal logprobs mean the logits of the chosen positions were equal too, not
merely that greedy choices happened to agree.
"""

from __future__ import annotations

import torch

from localllm import LLM, SamplingParams
from localllm.kernels.cpu import native as cpu_native
from localllm.kernels.cpu.matmul import activation_passes
from localllm.kernels.cpu.options import CpuOptions

SYSTEM = ("You are a careful assistant. Answer in plain English, briefly, and say so when you do not know. "
          "The user is a developer who reads documentation closely. ") * 3
QUESTIONS = [
    "What is the capital of France?",
    "Name three colours of the rainbow.",
    "Write a haiku about the sea, then explain its second line in detail, word by word, " * 3,
    "Why is the sky blue?",
    "Count from one to ten.",
    "What does a compiler do?",
]
MAX_TOKENS = 14


def _prompts(llm: LLM) -> list[list[int]]:
    tok = llm.tokenizer
    chats = [[{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}] for q in QUESTIONS[:4]]
    chats += [[{"role": "user", "content": q}] for q in QUESTIONS[4:]]
    return [llm.engine.encode_prompt(tok.apply_chat_template(c)) for c in chats]


def _params(i: int) -> SamplingParams:
    if i % 3 == 2:  # sampled, seeded: the same draws alone and together
        return SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8, top_p=0.95, seed=1000 + i, logprobs=0)
    return SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, logprobs=0)


def _result(out) -> tuple[list[int], list[float]]:
    c = out.outputs[0]
    return c.token_ids, [lp.logprob for lp in c.logprobs]


def _run_together(llm: LLM, prompts: list[list[int]]) -> list[tuple[list[int], list[float]]]:
    """Half the requests first; the others once those are decoding (arriving mid-way)."""
    engine = llm.engine
    tokens = {i: [] for i in range(len(prompts))}
    logprobs = {i: [] for i in range(len(prompts))}
    cached = {i: 0 for i in range(len(prompts))}
    ids = {}

    def add(i):
        ids[engine.add_request(prompts[i], _params(i), req_id=f"r{i}")] = i

    for i in range(0, len(prompts), 2):
        add(i)
    steps = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            i = ids[out.req_id]
            tokens[i] += out.new_token_ids
            logprobs[i] += [lp.logprob for lp in out.new_logprobs]
            cached[i] = max(cached[i], out.num_cached_tokens)
        steps += 1
        if steps == 6:
            for i in range(1, len(prompts), 2):
                add(i)
    return [(tokens[i], logprobs[i]) for i in range(len(prompts))], cached


def test_default_activation_passes_do_not_depend_on_the_step():
    assert activation_passes(CpuOptions()) == 1  # one pass for every row of every step
    assert activation_passes(CpuOptions(fast_math=True)) == 1
    assert CpuOptions().dequant_min_rows > 1 << 40  # the int4 route never switches to its GEMM by batch size
    assert CpuOptions(fast_math=True).dequant_min_rows == 96


def test_requests_alone_and_together_get_the_same_tokens_and_logprobs(smollm2_path):
    solo_llm = LLM(model=smollm2_path, kv_cache_memory="128MiB", max_num_batched_tokens=512)
    assert solo_llm.engine.kernels == ("cpu-native" if cpu_native.cpu_has_native() else "cpu")
    prompts = _prompts(solo_llm)
    alone = [_result(solo_llm.generate(p, _params(i))[0]) for i, p in enumerate(prompts)]
    del solo_llm
    # another step budget: other chunk boundaries, decodes beside prompt chunks
    llm = LLM(model=smollm2_path, kv_cache_memory="128MiB", max_num_batched_tokens=40)
    together, cached = _run_together(llm, prompts)
    for i, ((tok_a, lp_a), (tok_b, lp_b)) in enumerate(zip(alone, together)):
        assert len(tok_a) > 0
        assert tok_a == tok_b, f"request {i}: alone {tok_a} together {tok_b}"
        assert torch.equal(torch.tensor(lp_a), torch.tensor(lp_b)), f"request {i}: logprobs {lp_a} vs {lp_b}"
    # requests 1 and 3 arrived mid-way and found request 0's system prompt in the prefix cache
    assert cached[1] > 0 and cached[3] > 0, cached


def test_fast_math_is_an_explicit_engine_setting(smollm2_path, monkeypatch):
    from localllm.config.settings import load_settings
    from localllm.kernels.select import select_backend

    model = str(smollm2_path)
    assert load_settings({"model": model}).engine_config().fast_math is False
    assert load_settings({"model": model, "fast_math": True}).engine_config().fast_math is True
    monkeypatch.setenv("LOCALLLM_FAST_MATH", "1")
    assert load_settings({"model": model}).engine_config().fast_math is True
    assert select_backend("cpu", "cpu", fast_math=True).options.fast_math is True
    assert select_backend("cpu", "cpu").options.fast_math is False
