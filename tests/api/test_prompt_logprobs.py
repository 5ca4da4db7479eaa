"""Prompt logprobs: what lm-evaluation-harness's loglikelihood requests need.

``/v1/completions`` with ``echo: true, logprobs: N, max_tokens: 0`` returns the prompt's tokens,
their logprobs (null for the first) and the top N of each, and generates nothing; vLLM's
``prompt_logprobs`` is accepted too. The values are checked against the model's own forward pass
over the whole prompt, computed here.
"""

from __future__ import annotations

import math

import httpx
import pytest
import torch
from api_server import serving
from openai import OpenAI

from localllm import LLM, SamplingParams
from localllm.engine.model_runner import prefill_batch

TEXT = "The capital of France is Paris. The capital of Italy is Rome. The capital of Spain is Madrid."


def _forward_logprobs(llm: LLM, ids: list[int]) -> torch.Tensor:
    """log-softmax of the model's logits at every position of ``ids`` (one forward pass, no engine)."""
    model = llm.engine.model
    positions, meta, kv = prefill_batch([len(ids)], model.config, llm.engine.kv_types)
    with torch.inference_mode():
        hidden = model(torch.tensor(ids), positions, meta, kv)
        return torch.log_softmax(model.compute_logits(hidden, meta).float(), dim=-1)


def _score(llm: LLM, ids: list[int], params: SamplingParams):
    engine = llm.engine
    rid = engine.add_request(ids, params)
    outs = []
    while engine.has_request(rid):
        outs += [o for o in engine.step() if o.req_id == rid]
    return outs


@pytest.fixture(scope="module")
def llm(smollm2_path):
    return LLM(smollm2_path, kv_cache_memory="64MiB")


def test_prompt_logprobs_are_the_model_distribution_and_nothing_is_generated(llm):
    ids = llm.engine.encode_prompt(TEXT)
    outs = _score(llm, ids, SamplingParams(max_tokens=0, prompt_logprobs=3))
    assert len(outs) == 1 and outs[0].finished and outs[0].finish_reason == "length"
    assert outs[0].new_token_ids == [] and outs[0].num_output_tokens == 0
    got = outs[0].prompt_logprobs
    assert len(got) == len(ids) and got[0] is None
    want = _forward_logprobs(llm, ids)  # the same kernels, each row alone: the same bits
    for p in range(1, len(ids)):
        lp = got[p]
        row = want[p - 1]
        assert lp.token_id == ids[p]
        assert lp.logprob == row[ids[p]].item(), p
        assert lp.rank == 1 + int((row > row[ids[p]]).sum()), p
        values, indices = row.topk(3)
        assert lp.top == list(zip(indices.tolist(), values.tolist())), p
    assert sum(lp.rank == 1 for lp in got[1:]) >= len(ids) // 3  # (the text is predictable: not all rank 1 by luck)


def test_prefix_cache_chunks_and_generation_do_not_change_them(llm, smollm2_path):
    """A second request with the same prompt (its blocks in the prefix cache), a prompt cut in
    chunks of 7 tokens, and a request that goes on generating all score the prompt the same."""
    ids = llm.engine.encode_prompt(TEXT)
    first = _score(llm, ids, SamplingParams(max_tokens=0, prompt_logprobs=0))[0].prompt_logprobs
    again = _score(llm, ids, SamplingParams(max_tokens=0, prompt_logprobs=0))[0].prompt_logprobs
    generating = _score(llm, ids, SamplingParams(max_tokens=4, temperature=0, prompt_logprobs=0))
    assert sum(len(o.new_token_ids) for o in generating) == 4
    assert generating[0].prompt_logprobs is not None and all(o.prompt_logprobs is None for o in generating[1:])
    chunked_llm = LLM(smollm2_path, kv_cache_memory="64MiB", max_num_batched_tokens=7)
    chunked = _score(chunked_llm, ids, SamplingParams(max_tokens=0, prompt_logprobs=0))[0].prompt_logprobs
    values = [[lp.logprob for lp in run[1:]] for run in (first, again, generating[0].prompt_logprobs, chunked)]
    assert values[0] == values[1] == values[2] == values[3]  # bitwise: the rows are batch-invariant


def test_max_tokens_zero_needs_a_scored_prompt():
    with pytest.raises(Exception, match="max_tokens"):
        SamplingParams(max_tokens=0)
    with pytest.raises(Exception, match="prompt_logprobs"):
        SamplingParams(max_tokens=0, prompt_logprobs=21)


# ---------------------------------------------------------------- over HTTP


@pytest.fixture(scope="module")
def server(smollm2_path):
    with serving(smollm2_path, "--kv-cache-memory", "128MiB", "--served-model-name", "m") as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


def test_echo_with_logprobs_and_max_tokens_zero_scores_the_prompt(client, llm):
    """lm-evaluation-harness's loglikelihood request, through the official client."""
    ids = llm.engine.encode_prompt(TEXT)
    r = client.completions.create(model="m", prompt=TEXT, echo=True, logprobs=2, max_tokens=0)
    c = r.choices[0]
    assert c.text == TEXT and c.finish_reason == "length" and r.usage.completion_tokens == 0
    lp = c.logprobs
    assert len(lp.tokens) == len(ids) and "".join(lp.tokens) == TEXT
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    want = _forward_logprobs(llm, ids)
    for p in range(1, len(ids)):
        assert math.isclose(lp.token_logprobs[p], want[p - 1, ids[p]].item(), rel_tol=1e-6, abs_tol=1e-6)
        assert len(lp.top_logprobs[p]) == 2
    assert lp.text_offset[0] == 0 and lp.text_offset[-1] == len(TEXT) - len(lp.tokens[-1])


def test_echo_with_generation_appends_the_completion(client):
    r = client.completions.create(model="m", prompt=TEXT, echo=True, logprobs=1, max_tokens=5, temperature=0)
    c = r.choices[0]
    plain = client.completions.create(model="m", prompt=TEXT, logprobs=1, max_tokens=5, temperature=0).choices[0]
    assert c.text == TEXT + plain.text
    n_prompt = r.usage.prompt_tokens
    assert len(c.logprobs.tokens) == n_prompt + 5
    assert c.logprobs.token_logprobs[n_prompt:] == plain.logprobs.token_logprobs
    assert c.logprobs.text_offset[n_prompt] == len(TEXT)


def test_streamed_echo_sends_the_prompt_first(client):
    chunks = list(client.completions.create(model="m", prompt=TEXT, echo=True, logprobs=0, max_tokens=3,
                                            temperature=0, stream=True))
    text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
    assert text.startswith(TEXT) and len(text) > len(TEXT)
    first = chunks[0].choices[0].logprobs
    assert first.token_logprobs[0] is None and "".join(first.tokens).startswith(TEXT[:10])


def test_vllm_prompt_logprobs_on_completions_and_chat(client, server):
    r = client.completions.create(model="m", prompt=TEXT, max_tokens=1, extra_body={"prompt_logprobs": 2})
    plp = r.choices[0].model_extra["prompt_logprobs"]  # a vLLM field: the client keeps it as an extra
    assert plp[0] is None and len(plp) == r.usage.prompt_tokens
    for entry in plp[1:]:
        assert 1 <= len(entry) <= 3  # the token, and its top 2 (which may include it)
        assert all(set(v) == {"logprob", "rank", "decoded_token"} for v in entry.values())
    body = httpx.post(f"{server.url}/v1/chat/completions", timeout=120, json={
        "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1, "prompt_logprobs": 0}).json()
    assert body["prompt_logprobs"][0] is None and len(body["prompt_logprobs"]) == body["usage"]["prompt_tokens"]
    plain = httpx.post(f"{server.url}/v1/chat/completions", timeout=120, json={
        "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}).json()
    assert "prompt_logprobs" not in plain and "prompt_logprobs" not in plain["choices"][0]


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"prompt": "Hi", "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"prompt": "Hi", "max_tokens": 1, "prompt_logprobs": 21}, "prompt_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "stream": True,
                              "prompt_logprobs": 1}, "prompt_logprobs"),
])
def test_bad_requests_get_a_400_naming_the_field(server, path, body, param):
    r = httpx.post(f"{server.url}{path}", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
