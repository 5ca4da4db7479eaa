"""The OpenAI-compatible API end to end: real ``localllm serve`` subprocesses on SmolLM2, driven by the
official ``openai`` client (and httpx for raw requests).

Two servers start once for the module: ``main`` (defaults, 512 MiB of KV cache) and ``small``
(``--config`` TOML: one running request, four waiting at most, served as ``smol``, API key from
``LOCALLLM_API_KEY``) for priorities, the full queue, auth and the graceful SIGTERM (last).
The model is slow on a CPU, so every request asks for a handful of tokens.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest
from api_server import ServerProcess, batch_invariant_env, serve_command
from openai import APIStatusError, AsyncOpenAI, OpenAI
from prometheus_client.parser import text_string_to_metric_families

pytestmark = [pytest.mark.slow, pytest.mark.timeout(150)]

API_KEY = "test-secret"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
SMALL_CONFIG = """
max_num_seqs = 1
max_waiting = 4
kv_cache_memory = "256MiB"
served_model_name = "smol"
"""
ERROR_KEYS = {"message", "type", "param", "code"}


# ---------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def servers(smollm2_path, tmp_path_factory):
    config = tmp_path_factory.mktemp("serve") / "small.toml"
    config.write_text(SMALL_CONFIG)
    # The main server runs a batch-invariant path: there a request's greedy text does not depend
    # on what else shares its steps (test_32_concurrent_streams_...).
    main = ServerProcess(smollm2_path, "--kv-cache-memory", "512MiB", env=batch_invariant_env())
    small = ServerProcess(
        smollm2_path, "--config", str(config), "--shutdown-timeout", "30", env={"LOCALLLM_API_KEY": API_KEY}
    )
    try:
        main.wait_ready()
        small.wait_ready()
        yield main, small
    finally:
        main.kill()
        small.kill()


@pytest.fixture(scope="module")
def main_url(servers) -> str:
    return servers[0].url


@pytest.fixture(scope="module")
def small_server(servers) -> ServerProcess:
    return servers[1]


@pytest.fixture(scope="module")
def model(smollm2_path) -> str:
    return str(smollm2_path)


@pytest.fixture(scope="module")
def client(main_url) -> OpenAI:
    return OpenAI(base_url=f"{main_url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def http(main_url):
    with httpx.Client(base_url=main_url, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def tok(servers, smollm2_path):
    """The server's tokenizer, loaded here from the cache the servers filled."""
    from localllm.models.gguf_file import read_gguf
    from localllm.tokenizer import Tokenizer

    return Tokenizer(smollm2_path, read_gguf(smollm2_path).metadata)


def scrape(url: str, headers: dict | None = None) -> dict[str, float]:
    """Samples of /metrics by name (label values of ``finished_reason`` appended as ``name[reason]``)."""
    text = httpx.get(f"{url}/metrics", headers=headers, timeout=30).text
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            key = s.name + (f"[{s.labels['finished_reason']}]" if "finished_reason" in s.labels else "")
            if "le" not in s.labels:
                out[key] = s.value
    return out


def wait_for(predicate, timeout: float = 20.0, interval: float = 0.1):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(interval)


def assert_error(r: httpx.Response, status: int, param: str | None = None, code: str | None = None) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == ERROR_KEYS and isinstance(err["message"], str) and err["message"], body
    assert "detail" not in r.text and "loc" not in err
    if param is not None:
        assert err["param"] == param, body
    if code is not None:
        assert err["code"] == code, body
    return err


# ---------------------------------------------------------------- happy paths


def test_models_health_and_ready_line(servers, http, model, client):
    main, _ = servers
    assert main.url.startswith("http://127.0.0.1:")
    assert "KV cache:" in main.output() and "blocks" in main.output()
    assert http.get("/health").status_code == 200
    body = http.get("/v1/models").json()
    assert body["object"] == "list" and body["data"][0]["id"] == model
    assert body["data"][0]["max_model_len"] == 8192
    assert [m.id for m in client.models.list()] == [model]


def test_chat_streaming_and_not(client, model, tok):
    messages = [
        {"role": "system", "content": "You are a terse assistant."},
        {
            "role": "user",
            "content": [{"type": "text", "text": "Name one "}, {"type": "text", "text": "color."}],
        },
    ]
    r = client.chat.completions.create(model=model, messages=messages, max_tokens=6, temperature=0)
    choice = r.choices[0]
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-") and r.model == model
    assert choice.index == 0 and choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason in ("stop", "length")
    flat = [
        {"role": m["role"], "content": m["content"] if isinstance(m["content"], str) else "Name one color."}
        for m in messages
    ]
    assert r.usage.prompt_tokens == len(tok.apply_chat_template(flat))
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    if choice.finish_reason == "length":
        assert r.usage.completion_tokens == 6

    chunks = list(
        client.chat.completions.create(
            model=model,
            messages=messages,
            max_completion_tokens=6,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert text == choice.message.content and finish == [choice.finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == r.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == r.usage.prompt_tokens


def test_completions_text_ids_batch_and_stream(client, model, tok):
    prompt = "The capital of France is"
    r = client.completions.create(model=model, prompt=prompt, max_tokens=5, temperature=0)
    assert r.object == "text_completion" and r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.prompt_tokens == len(tok.encode(prompt))
    if r.choices[0].finish_reason == "length":
        assert r.usage.completion_tokens == 5
    text = r.choices[0].text

    ids = tok.encode(prompt)
    assert (
        client.completions.create(model=model, prompt=ids, max_tokens=5, temperature=0).choices[0].text
        == text
    )

    other = "Water boils at"
    batch = client.completions.create(model=model, prompt=[prompt, other], max_tokens=5, temperature=0)
    assert [c.index for c in batch.choices] == [0, 1] and batch.choices[0].text == text
    assert batch.usage.prompt_tokens == len(ids) + len(tok.encode(other))
    batch_ids = client.completions.create(
        model=model, prompt=[tok.encode(other), ids], max_tokens=5, temperature=0
    )
    assert [c.text for c in batch_ids.choices] == [batch.choices[1].text, text]

    stream = client.completions.create(
        model=model,
        prompt=prompt,
        max_tokens=5,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == text
    assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens


def test_stop_strings(client, model):
    prompt = "List three fruits: apple, banana,"
    base = client.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0).choices[0].text
    assert len(base) >= 6, base
    stop = base[len(base) // 2 : len(base) // 2 + 2]
    expected = base[: base.find(stop)]
    for stop_arg in (stop, [stop, "\u2603"]):
        r = client.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0, stop=stop_arg)
        assert (r.choices[0].text, r.choices[0].finish_reason) == (expected, "stop")
    chunks = list(
        client.completions.create(
            model=model, prompt=prompt, max_tokens=8, temperature=0, stop=[stop], stream=True
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_n_and_seed_reproducibility(client, model):
    kwargs = {"model": model, "prompt": "Once upon a time", "max_tokens": 6, "temperature": 0.8, "seed": 1234}
    a = client.completions.create(n=2, **kwargs)
    assert sorted(c.index for c in a.choices) == [0, 1]
    assert a.usage.completion_tokens == 12 or any(c.finish_reason == "stop" for c in a.choices)
    b = client.completions.create(n=2, **kwargs)
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    chunks = [c for c in client.completions.create(n=2, stream=True, **kwargs) if c.choices]
    for i, choice in enumerate(a.choices):
        mine = [c.choices[0] for c in chunks if c.choices[0].index == i]
        assert "".join(c.text for c in mine) == choice.text and mine[-1].finish_reason == choice.finish_reason

    messages = [{"role": "user", "content": "Tell me a word."}]
    # Both seeded runs then see the same prefix-cache state (hit-vs-miss numerics: engine tests).
    client.chat.completions.create(model=model, messages=messages, max_tokens=1, temperature=0)
    c1 = client.chat.completions.create(model=model, messages=messages, max_tokens=5, temperature=0.8, seed=7)
    c2 = client.chat.completions.create(model=model, messages=messages, max_tokens=5, temperature=0.8, seed=7)
    assert c1.choices[0].message.content == c2.choices[0].message.content


# chi-square critical values at p = 0.001 by degrees of freedom (seeded requests: reproducible)
_CHI2_999 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32, 8: 26.12, 9: 27.88,
             10: 29.59, 11: 31.26, 12: 32.91, 13: 34.53, 14: 36.12, 15: 37.70, 16: 39.25, 17: 40.79, 18: 42.31,
             19: 43.82}


@pytest.mark.parametrize("extra", [{"top_k": 4}, {"top_p": 0.4}, {"min_p": 0.15}], ids=["top_k", "top_p", "min_p"])
def test_seeded_samples_follow_the_filtered_renormalized_distribution(client, model, extra):
    """Through the API: 208 seeded one-token samples (13 requests of n=16) with a filter stay in
    the set the filter allows, computed from the model's own top-20 logprobs for that position,
    and their counts match those probabilities renormalized (chi-square, p = 0.001)."""
    prompt = "My favourite colour is"
    first = client.completions.create(model=model, prompt=prompt, max_tokens=1, temperature=0, logprobs=20)
    top = sorted(first.choices[0].logprobs.top_logprobs[0].items(), key=lambda kv: -kv[1])
    probs = [math.exp(lp) for _, lp in top]
    if "top_k" in extra:
        allowed = top[: extra["top_k"]]
    elif "top_p" in extra:
        mass, allowed = 0.0, []
        for (tok, lp), p in zip(top, probs):
            allowed.append((tok, lp))
            mass += p
            if mass >= extra["top_p"]:
                break
        assert mass >= extra["top_p"], "the top 20 do not reach top_p: pick another prompt"
    else:
        allowed = [(tok, lp) for (tok, lp), p in zip(top, probs) if p >= extra["min_p"] * probs[0]]
    assert 2 <= len(allowed) < len(top)
    total = sum(math.exp(lp) for _, lp in allowed)
    want = {tok: math.exp(lp) / total for tok, lp in allowed}
    draws = []
    for k in range(13):  # sample i of a request draws with seed + i: seeds far apart, no draw repeated
        r = client.completions.create(model=model, prompt=prompt, max_tokens=1, temperature=1.0, n=16,
                                      seed=1000 * k, extra_body=extra)
        draws += [c.text for c in r.choices]
    outside = sorted(set(draws) - set(want))
    assert not outside, f"{extra}: drew {outside}, outside the allowed {sorted(want)}"
    n = len(draws)
    big = [tok for tok, p in want.items() if n * p >= 5]  # the rest pooled, each cell expecting >= 5
    cells = [(draws.count(tok), n * want[tok]) for tok in big]
    rest = n - sum(c for c, _ in cells)
    if n - sum(e for _, e in cells) > 0:
        cells.append((rest, n - sum(e for _, e in cells)))
    stat = sum((c - e) ** 2 / e for c, e in cells)
    assert stat < _CHI2_999[len(cells) - 1], (extra, stat, cells)


def test_logprobs(client, model):
    r = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
    )
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].token == entry.token  # greedy picks the most likely token
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=1e-5)
        assert entry.bytes == list(entry.token.encode())

    c = client.completions.create(model=model, prompt="One, two,", max_tokens=4, temperature=0, logprobs=2)
    lp = c.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == c.usage.completion_tokens
    assert all(1 <= len(t) <= 2 for t in lp.top_logprobs) and lp.text_offset[0] == 0


def test_unknown_fields_are_ignored(http, model):
    messages = [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": "What is 6 x 7?", "name": "ann"},
        {
            "role": "assistant",
            "content": None,
            "refusal": None,
            "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "mul", "arguments": "{}"}}],
        },
        {"role": "tool", "content": "42", "tool_call_id": "c1"},
    ]
    r = http.post(
        "/v1/chat/completions",
        json={
            "model": model,
            "messages": messages,
            "max_tokens": 1,
            "tools": [],
            "tool_choice": "none",
            "response_format": {"type": "text"},
            "parallel_tool_calls": False,
            "store": False,
            "foo": {"bar": 1},
            "user": "someone",
            "top_k": 5,
            "min_p": 0.05,
            "repetition_penalty": 1.1,
            "ignore_eos": True,
            "presence_penalty": 0.5,
            "frequency_penalty": 0.5,
            "logit_bias": {"28": -5},
            "priority": 3,
        },
    )
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 1


def test_tokenize_detokenize(http, tok, model):
    r = http.post(
        "/tokenize", json={"model": model, "prompt": "hello world", "return_token_strs": True}
    ).json()
    assert r["tokens"] == tok.encode("hello world") and r["count"] == len(r["tokens"])
    assert r["max_model_len"] == 8192 and len(r["token_strs"]) == r["count"]
    messages = [{"role": "user", "content": "Hi"}]
    r = http.post("/tokenize", json={"messages": messages}).json()
    assert r["tokens"] == tok.apply_chat_template(messages) and r["token_strs"] is None
    plain = http.post("/tokenize", json={"prompt": "a<|im_end|>", "parse_special": False,
                                         "add_special_tokens": False}).json()["tokens"]
    assert plain == tok.encode("a<|im_end|>", add_special_tokens=False, parse_special=False) != tok.encode(
        "a<|im_end|>", add_special_tokens=False)
    ids = tok.encode("hello world", add_special_tokens=False)
    assert http.post("/detokenize", json={"tokens": ids}).json() == {"prompt": "hello world"}
    assert_error(http.post("/detokenize", json={"tokens": [10**9]}), 400, "tokens")
    assert_error(http.post("/tokenize", json={}), 400)


# ---------------------------------------------------------------- errors


CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
HI = [{"role": "user", "content": "Hi"}]


@pytest.mark.parametrize(
    "path, body, status, param, code",
    [
        (CHAT, {"messages": HI, "max_tokens": -1}, 400, "max_tokens", None),
        (CHAT, {"messages": HI, "max_tokens": 0}, 400, "max_tokens", None),
        (CHAT, {"messages": HI, "max_tokens": "ten"}, 400, "max_tokens", None),
        (CHAT, {"messages": HI, "max_tokens": 2.5}, 400, "max_tokens", None),
        (CHAT, {"messages": HI, "max_completion_tokens": -3}, 400, "max_completion_tokens", None),
        (COMPLETIONS, {"prompt": "x", "max_tokens": -1}, 400, "max_tokens", None),
        (CHAT, {"messages": HI, "temperature": 2.5}, 400, "temperature", None),
        (CHAT, {"messages": HI, "temperature": "hot"}, 400, "temperature", None),
        (CHAT, {"messages": HI, "top_p": 0}, 400, "top_p", None),
        (CHAT, {"messages": HI, "n": 0}, 400, "n", None),
        (CHAT, {"messages": []}, 400, "messages", None),
        (CHAT, {"messages": "Hi"}, 400, "messages", None),
        (CHAT, {"messages": [{"role": "wizard", "content": "Hi"}]}, 400, "messages", None),
        (
            CHAT,
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
            400,
            "messages",
            None,
        ),
        (CHAT, {}, 400, "messages", None),
        (CHAT, {"messages": HI, "top_logprobs": 2}, 400, "top_logprobs", None),
        (CHAT, {"messages": HI, "logprobs": True, "top_logprobs": 50}, 400, "top_logprobs", None),
        (CHAT, {"messages": HI, "logit_bias": {"abc": 1}}, 400, "logit_bias", None),
        (CHAT, {"messages": HI, "logit_bias": {"99999999": 1}}, 400, "logit_bias", None),
        (CHAT, {"messages": HI, "logit_bias": {"5": 500}}, 400, "logit_bias", None),
        (CHAT, {"messages": HI, "seed": 2**70}, 400, "seed", None),
        (CHAT, {"messages": HI, "stream": "yes"}, 400, "stream", None),
        (COMPLETIONS, {"prompt": 5}, 400, "prompt", None),
        (COMPLETIONS, {"prompt": []}, 400, "prompt", None),
        (COMPLETIONS, {"prompt": [-1, 5]}, 400, "prompt", None),
        (COMPLETIONS, {"prompt": "x", "logprobs": 30}, 400, "logprobs", None),
        (COMPLETIONS, {"prompt": [100] * 8200, "max_tokens": 4}, 400, "prompt", "context_length_exceeded"),
        (
            COMPLETIONS,
            {"prompt": [100] * 8200, "max_tokens": 4, "stream": True},
            400,
            "prompt",
            "context_length_exceeded",
        ),
        (
            CHAT,
            {"messages": [{"role": "user", "content": "hi " * 9000}], "max_tokens": 4},
            400,
            "messages",
            "context_length_exceeded",
        ),
        (COMPLETIONS, {"prompt": "x", "max_tokens": 9000}, 400, "max_tokens", "context_length_exceeded"),
        (CHAT, {"messages": HI, "repetition_penalty": 0}, 400, "repetition_penalty", None),
        (CHAT, {"messages": HI, "repetition_penalty": 1000}, 400, "repetition_penalty", None),
        (CHAT, {"messages": HI, "top_k": 2**40}, 400, "top_k", None),
        (CHAT, {"messages": HI, "top_k": -2}, 400, "top_k", None),
        (CHAT, {"messages": HI, "min_p": 1.5}, 400, "min_p", None),
        (CHAT, {"messages": HI, "presence_penalty": -3}, 400, "presence_penalty", None),
        (CHAT, {"messages": HI, "stop": ["x"] * 65}, 400, "stop", None),
        (CHAT, {"messages": HI, "stop": ["x" * 1025]}, 400, "stop", None),
        (CHAT, {"messages": HI, "n": 17}, 400, "n", None),
        (CHAT, {"messages": [{"role": "user", "content": "caf\ud800e"}]}, 400, "messages", None),
        (CHAT, {"messages": [{"role": "user", "content": [{"type": "text", "text": "\udfff"}]}]}, 400, "messages",
         None),
        (CHAT, {"messages": HI, "stop": ["\ud83d"]}, 400, "stop", None),
        (COMPLETIONS, {"prompt": "hi \ud800"}, 400, "prompt", None),
        (COMPLETIONS, {"prompt": ["a", "b\udc00"]}, 400, "prompt", None),
        (COMPLETIONS, {"prompt": ["a"] * 257, "max_tokens": 1}, 400, "prompt", None),
        (COMPLETIONS, {"prompt": ["a"] * 20, "n": 16, "max_tokens": 1}, 400, "n", None),
        (COMPLETIONS, {"prompt": [10**12]}, 400, "prompt", None),
        (CHAT, {"messages": HI, "model": "gpt-4o"}, 404, "model", "model_not_found"),
        (COMPLETIONS, {"prompt": "x", "model": "gpt-4o", "stream": True}, 404, "model", "model_not_found"),
    ],
)
def test_invalid_requests_get_openai_errors(http, path, body, status, param, code):
    # As JSON text with escapes (json.dumps' default): a lone surrogate goes as "\ud800", which
    # httpx's json= could not encode.
    content = json.dumps(body)
    assert_error(http.post(path, content=content, headers={"Content-Type": "application/json"}), status, param, code)


def test_the_request_that_stopped_the_engine_gets_400_and_everyone_is_served(http, client, model):
    """repetition_penalty 1e-45 at temperature 1 makes the sampler's probabilities non-finite: the
    request is refused up front, and the step thread serves everyone after it."""
    for path, body in [(COMPLETIONS, {"prompt": "hi", "repetition_penalty": 1e-45, "temperature": 1}),
                       (CHAT, {"messages": HI, "repetition_penalty": 1e-45, "temperature": 1, "stream": True})]:
        assert_error(http.post(path, json={"model": model, **body}), 400, "repetition_penalty")
    # At temperature 1, as the requests that stopped the engine; ignore_eos: " Paris." and the end
    # token come in 3 tokens about one time in 30 (13 of 400 samples), which is not what this checks.
    out = client.completions.create(model=model, prompt="The capital of France is", max_tokens=3, temperature=1,
                                    extra_body={"ignore_eos": True})
    assert out.choices[0].finish_reason == "length"
    assert http.get("/health").status_code == 200


def test_bodies_that_are_not_json_get_415(http):
    chat = json.dumps({"messages": HI, "max_tokens": 1}).encode()
    for ctype in ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", None]:
        headers = {"Content-Type": ctype} if ctype else {}
        r = httpx.post(f"{str(http.base_url).rstrip('/')}{CHAT}", content=chat, headers=headers, timeout=30)
        if ctype is None:
            assert "content-type" not in {k.lower() for k in r.request.headers}
        assert_error(r, 415, code="unsupported_media_type")
    ok = http.post(CHAT, content=chat, headers={"Content-Type": "application/json; charset=utf-8"})
    assert ok.status_code == 200, ok.text


def test_bodies_over_the_limit_get_413_declared_or_streamed(http):
    big = b'{"prompt": "' + b"a" * (9 << 20) + b'"}'
    assert_error(http.post(COMPLETIONS, content=big, headers={"Content-Type": "application/json"}), 413,
                 code="request_too_large")

    def chunks():
        for i in range(0, len(big), 1 << 20):
            yield big[i : i + (1 << 20)]

    r = http.post(COMPLETIONS, content=chunks(), headers={"Content-Type": "application/json"})
    assert "content-length" not in {k.lower() for k in r.request.headers}
    assert_error(r, 413, code="request_too_large")
    assert http.get("/health").status_code == 200


def test_dns_rebinding_host_names_are_refused(http, main_url):
    port = main_url.rsplit(":", 1)[1]
    for host in ["evil.example", f"evil.example:{port}", "127.0.0.1.evil.example", "localhost.evil"]:
        assert_error(http.get("/v1/models", headers={"Host": host}), 403, code="host_not_allowed")
        assert_error(http.post(CHAT, json={"messages": HI}, headers={"Host": host}), 403, code="host_not_allowed")
    for host in [f"localhost:{port}", f"127.0.0.1:{port}", "localhost", f"[::1]:{port}", f"LOCALHOST:{port}"]:
        assert http.get("/v1/models", headers={"Host": host}).status_code == 200, host


def test_requests_from_another_sites_page_are_refused(http, main_url):
    """A page elsewhere can make a browser send a GET without a CORS preflight, and
    /tokenizer_info?model= loads a model: what a browser marks as another site's is refused."""
    for headers in [{"Sec-Fetch-Site": "cross-site", "Sec-Fetch-Mode": "no-cors"},
                    {"Origin": "https://evil.example"}, {"Origin": "null"},
                    {"Origin": main_url.replace("127.0.0.1", "localhost")}]:
        assert_error(http.get("/tokenizer_info", headers=headers), 403, code="cross_site_request")
        assert_error(http.post(CHAT, json={"messages": HI, "max_tokens": 1}, headers=headers), 403,
                     code="cross_site_request")
    # the server's own pages, a navigation to it, and clients that are not browsers
    own = {"Origin": main_url, "Sec-Fetch-Site": "same-origin"}
    assert http.get("/v1/models", headers=own).status_code == 200
    assert http.get("/health", headers={"Sec-Fetch-Site": "cross-site", "Sec-Fetch-Mode": "navigate"}).status_code == 200
    assert http.get("/tokenizer_info").status_code == 200


def test_malformed_bodies_never_take_the_server_down(http):
    for content, ctype in [
        (b"{not json", "application/json"),
        (b'{"messages": [', "application/json"),
        (b"\xff\xfe\x00garbage", "application/json"),
        (b"[1, 2, 3]", "application/json"),
        (b'"just a string"', "application/json"),
        (b"", "application/json"),
    ]:
        assert_error(http.post(CHAT, content=content, headers={"Content-Type": ctype}), 400)
    assert_error(http.get("/v1/nothing-here"), 404)
    assert_error(http.get(CHAT), 405)
    assert http.get("/health").status_code == 200


def test_openai_client_sees_status_errors(client, model):
    with pytest.raises(APIStatusError) as e:
        client.chat.completions.create(model="nope", messages=HI, max_tokens=1)
    assert e.value.status_code == 404
    with pytest.raises(APIStatusError) as e:
        client.chat.completions.create(model=model, messages=HI, max_tokens=1, temperature=-1)
    assert e.value.status_code == 400 and e.value.body["param"] == "temperature"


# ---------------------------------------------------------------- load and disconnects


def test_32_concurrent_streams_match_their_solo_greedy_text(client, main_url, model):
    prompts = ["The sky is", "My favourite food is", "In 1492,", "def add(a, b):"]
    solo = [
        client.completions.create(model=model, prompt=p, max_tokens=8, temperature=0).choices[0].text
        for p in prompts
    ]

    async def one(aclient: AsyncOpenAI, i: int) -> str:
        stream = await aclient.completions.create(
            model=model, prompt=prompts[i % 4], max_tokens=8, temperature=0, stream=True
        )
        return "".join([c.choices[0].text async for c in stream if c.choices])

    async def all_of_them() -> list[str]:
        async with AsyncOpenAI(
            base_url=f"{main_url}/v1", api_key="unused", max_retries=0, timeout=120
        ) as aclient:
            return await asyncio.gather(*(one(aclient, i) for i in range(32)))

    texts = asyncio.run(all_of_them())
    assert texts == [solo[i % 4] for i in range(32)]


def _idle(url: str, headers: dict | None = None) -> bool:
    m = scrape(url, headers)
    return (
        m["localllm:num_requests_running"],
        m["localllm:num_requests_waiting"],
        m["localllm:kv_cache_usage_perc"],
    ) == (0, 0, 0)


def test_disconnect_mid_stream_frees_kv(http, main_url, model):
    assert wait_for(lambda: _idle(main_url))
    aborted = scrape(main_url)["localllm:request_success_total[abort]"]
    body = {
        "model": model,
        "prompt": "Write a long story about a dragon.",
        "max_tokens": 400,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.Client(base_url=main_url, timeout=60) as c, c.stream("POST", COMPLETIONS, json=body) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        for _ in range(3):
            while not next(lines).startswith("data: {"):
                pass
        during = scrape(main_url)
        assert during["localllm:num_requests_running"] == 1 and during["localllm:kv_cache_usage_perc"] > 0
    assert wait_for(lambda: _idle(main_url), timeout=10)
    assert scrape(main_url)["localllm:request_success_total[abort]"] == aborted + 1


def test_disconnect_while_waiting_for_a_whole_answer_frees_kv(main_url, model):
    assert wait_for(lambda: _idle(main_url))
    with pytest.raises(httpx.ReadTimeout):
        body = {"model": model, "prompt": "Count:", "max_tokens": 400, "ignore_eos": True}
        httpx.post(f"{main_url}{COMPLETIONS}", json=body, timeout=httpx.Timeout(60, read=1.5))
    assert wait_for(lambda: _idle(main_url), timeout=10)


def test_metrics_are_prometheus_text(http, main_url, model):
    prompt = "Repeat after me: " + "the quick brown fox jumps over the lazy dog " * 4
    for _ in range(2):
        http.post(COMPLETIONS, json={"model": model, "prompt": prompt, "max_tokens": 3, "ignore_eos": True})
    families = {f.name: f for f in text_string_to_metric_families(http.get("/metrics").text)}
    kinds = {
        "localllm:num_requests_running": "gauge",
        "localllm:num_requests_waiting": "gauge",
        "localllm:kv_cache_usage_perc": "gauge",
        "localllm:prefix_cache_queries": "counter",
        "localllm:prefix_cache_hits": "counter",
        "localllm:num_preemptions": "counter",
        "localllm:prompt_tokens": "counter",
        "localllm:generation_tokens": "counter",
        "localllm:request_success": "counter",
        "localllm:time_to_first_token_seconds": "histogram",
        "localllm:inter_token_latency_seconds": "histogram",
        "localllm:e2e_request_latency_seconds": "histogram",
        "localllm:request_queue_time_seconds": "histogram",
    }
    for name, kind in kinds.items():
        assert name in families and families[name].type == kind, name
    m = scrape(main_url)
    assert m["localllm:generation_tokens_total"] >= 3 and m["localllm:prompt_tokens_total"] > 0
    assert m["localllm:time_to_first_token_seconds_count"] >= 1
    assert m["localllm:inter_token_latency_seconds_count"] >= 2
    assert m["localllm:e2e_request_latency_seconds_count"] >= 1
    assert m["localllm:request_success_total[length]"] >= 1
    assert m["localllm:prefix_cache_hits_total"] >= 32  # the second run found the prompt's full blocks


# The Kubernetes Gateway API Inference Extension's model-server protocol
# (docs/proposals/003-model-server-protocol): what its endpoint picker reads, by vLLM's names.
GATEWAY_PROTOCOL = {
    "vllm:num_requests_waiting": ("gauge", set()),  # TotalQueuedRequests
    "vllm:num_requests_running": ("gauge", set()),  # TotalRunningRequests
    "vllm:kv_cache_usage_perc": ("gauge", set()),  # KVCacheUtilization (a fraction)
    "vllm:cache_config_info": ("gauge", {"block_size", "num_gpu_blocks"}),  # [optional] BlockSize, NumGPUBlocks
    "vllm:lora_requests_info": ("gauge", {"max_lora", "running_lora_adapters", "waiting_lora_adapters"}),
}


def test_the_inference_gateways_model_server_metrics(http, main_url, model):
    """Every metric of the protocol's list, of its type, with its labels, per model; the request
    gauges are the localllm: ones of the same scrape, and the cache's labels its real geometry."""
    import time as _time

    before = _time.time()
    http.post(COMPLETIONS, json={"model": model, "prompt": "Hello", "max_tokens": 2})
    families = {f.name: f for f in text_string_to_metric_families(http.get("/metrics").text)}
    for name, (kind, labels) in GATEWAY_PROTOCOL.items():
        assert name in families and families[name].type == kind, name
        samples = families[name].samples
        assert [s.labels["model_name"] for s in samples] == [model], name
        assert labels <= set(samples[0].labels), (name, samples[0].labels)
    value = {name: families[name].samples[0].value for name in GATEWAY_PROTOCOL}
    for gauge in ("num_requests_waiting", "num_requests_running", "kv_cache_usage_perc"):
        assert value[f"vllm:{gauge}"] == families[f"localllm:{gauge}"].samples[0].value
    assert 0.0 <= value["vllm:kv_cache_usage_perc"] <= 1.0
    cache = families["vllm:cache_config_info"].samples[0].labels
    from localllm.config.engine import BLOCK_SIZE

    assert int(cache["block_size"]) == BLOCK_SIZE and int(cache["num_gpu_blocks"]) > 0
    lora = families["vllm:lora_requests_info"].samples[0]
    assert lora.labels["max_lora"] == "0" and lora.labels["running_lora_adapters"] == ""
    assert before <= lora.value <= _time.time()


# ---------------------------------------------------------------- small server: auth, priority, 429, SIGTERM


def test_api_key_and_served_model_name(small_server):
    url = small_server.url
    assert_error(httpx.get(f"{url}/v1/models"), 401, code="invalid_api_key")
    assert_error(httpx.get(f"{url}/v1/models", headers={"Authorization": "Bearer wrong"}), 401)
    assert_error(httpx.post(f"{url}{CHAT}", content=b"{oops", headers={"Authorization": "Basic x"}), 401)
    assert_error(httpx.post(f"{url}/tokenize", json={"prompt": "x"}), 401)
    assert httpx.get(f"{url}/health").status_code == 200
    assert_error(httpx.get(f"{url}/metrics"), 401)  # its series name the models and their traffic
    scraped = httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {API_KEY}"})
    assert scraped.status_code == 200 and "localllm:num_requests_running" in scraped.text
    client = OpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0, timeout=60)
    assert [m.id for m in client.models.list()] == ["smol"]
    r = client.chat.completions.create(model="smol", messages=HI, max_tokens=2, temperature=0)
    assert r.model == "smol" and r.usage.completion_tokens <= 2


async def _stream_first_token(client: httpx.AsyncClient, body: dict) -> float:
    """Monotonic time of the first streamed token; reads the stream to its end."""
    first = None
    async with client.stream("POST", CHAT, json={**body, "stream": True}) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if first is None and line.startswith("data: {"):
                first = time.monotonic()
    return first


async def _until(predicate, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not await asyncio.to_thread(predicate):
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.05)


def test_priority_jumps_the_queue(small_server):
    url = small_server.url
    gauge = lambda name: scrape(url, AUTH)[f"localllm:num_requests_{name}"]

    async def scenario():
        async with httpx.AsyncClient(base_url=url, headers=AUTH, timeout=120) as c:

            def body(priority, max_tokens, text):
                return {
                    "messages": [{"role": "user", "content": text}],
                    "max_tokens": max_tokens,
                    "temperature": 0,
                    "ignore_eos": True,
                    "priority": priority,
                }

            head = asyncio.create_task(_stream_first_token(c, body(0, 4000, "Tell me about the sea.")))
            await _until(lambda: gauge("running") == 1)
            lows = [asyncio.create_task(_stream_first_token(c, body(5, 2, f"Low {i}"))) for i in range(3)]
            await _until(lambda: gauge("waiting") == 3)
            high = asyncio.create_task(_stream_first_token(c, body(-5, 2, "High")))
            # queued behind the head, or (priority preemption of the head) already answered
            await _until(lambda: high.done() or gauge("waiting") == 4)
            head.cancel()  # its client leaves: the one running slot frees up for the queue
            return await asyncio.gather(*lows), await high

    lows, high = asyncio.run(scenario())
    assert all(high < low for low in lows), (high, lows)  # the high-priority request is served first


def test_full_queue_gets_429_and_queued_disconnects_are_aborted(small_server):
    url = small_server.url
    gauge = lambda name: scrape(url, AUTH)[f"localllm:num_requests_{name}"]
    assert wait_for(lambda: _idle(url, AUTH))
    body = {"messages": HI, "max_tokens": 200, "ignore_eos": True}

    async def scenario():
        async with httpx.AsyncClient(base_url=url, headers=AUTH, timeout=120) as c:
            tasks = [asyncio.create_task(_stream_first_token(c, body))]
            await _until(lambda: gauge("running") == 1)
            tasks += [asyncio.create_task(c.post(CHAT, json=body)) for _ in range(4)]
            await _until(lambda: gauge("waiting") == 4)
            refused = [await c.post(CHAT, json=body), await c.post(CHAT, json={**body, "stream": True})]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            return refused

    for r in asyncio.run(scenario()):
        err = assert_error(r, 429)
        assert err["type"] == "rate_limit_error" and int(r.headers["Retry-After"]) >= 1
    assert wait_for(lambda: _idle(url, AUTH), timeout=15)


def test_sigterm_finishes_in_flight_requests_and_exits_0(small_server):
    url = small_server.url
    chunks = []
    with httpx.Client(base_url=url, headers=AUTH, timeout=60) as c:
        body = {"messages": HI, "max_tokens": 4, "ignore_eos": True, "stream": True}
        with c.stream("POST", CHAT, json=body) as r:
            lines = r.iter_lines()
            for line in lines:
                if line.startswith("data: {"):
                    chunks.append(line)
                    break
            small_server.proc.send_signal(signal.SIGTERM)
            chunks += [line for line in lines if line.startswith("data: ")]
    assert chunks[-1] == "data: [DONE]"
    assert '"finish_reason":"length"' in chunks[-2], chunks[-2]
    assert small_server.terminate(timeout=60) == 0, small_server.output()
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{url}/health", timeout=5)


def test_detach_then_stop(smollm2_path):
    assert serve_command()[-1] == "serve"  # `localllm serve` is registered in localllm.cli
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cli = [sys.executable, "-m", "localllm.cli"]
    started = subprocess.run(
        [*cli, "serve", str(smollm2_path), "--port", str(port), "--kv-cache-memory", "256MiB", "--detach"],
        capture_output=True,
        text=True,
        timeout=150,
        check=False,
    )
    try:
        assert started.returncode == 0, started.stderr
        assert f"127.0.0.1:{port}" in started.stdout and "background" in started.stdout
        assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=10).status_code == 200
    finally:
        stopped = subprocess.run([*cli, "stop"], capture_output=True, text=True, timeout=60, check=False)
    assert "Stopped" in stopped.stdout, stopped.stdout + stopped.stderr
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"http://127.0.0.1:{port}/health", timeout=5)


@pytest.mark.parametrize(
    "config_text, message",
    [
        (None, "does not exist"),
        ("nonsense_key = 1\n", "nonsense_key"),
        ("port = [\n", "TOML"),
        ('kv_cache_dtype = "fp8"\n', "kv_cache_dtype must be auto or one of f32, f16, bf16, q8_0, q4_0"),
    ],
)
def test_bad_config_fails_in_one_line(tmp_path, smollm2_path, config_text, message):
    config = tmp_path / "serve.toml"
    if config_text is not None:
        config.write_text(config_text)
    server = ServerProcess(smollm2_path, "--config", str(config))
    assert server.proc.wait(60) == 1
    err = server.stderr_path.read_text().strip()
    assert err.startswith("Error:") and message in err and len(err.splitlines()) == 1, err


def test_a_huge_prompt_does_not_stall_other_clients_streams(smollm2_path):
    """A 450 kB prompt takes seconds to tokenize; that happens on a worker thread, so a stream
    already running keeps getting its chunks meanwhile (the big request then fails its length check).
    The stream runs on a server of its own with the default (fast) path, where a chunk takes
    milliseconds on an idle machine, so the tokenizing lasts many chunks' time."""
    model = str(smollm2_path)
    big = {"model": model, "prompt": "The quick brown fox jumps over the lazy dog. " * 10_000, "max_tokens": 1}
    stream_body = {"model": model, "prompt": "Once upon a time", "max_tokens": 4000, "ignore_eos": True,
                   "temperature": 0, "stream": True}
    arrivals: list[float] = []
    big_took: list[tuple[float, float]] = []
    server = ServerProcess(smollm2_path)

    async def stream():
        async with (httpx.AsyncClient(base_url=server.url, timeout=240) as c,
                    c.stream("POST", COMPLETIONS, json=stream_body) as r):
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    arrivals.append(time.monotonic())
                if big_took:  # enough seen: closing the stream aborts the request
                    return

    async def huge():
        while len(arrivals) < 20:  # the stream is flowing
            await asyncio.sleep(0.01)
        async with httpx.AsyncClient(base_url=server.url, timeout=240) as c:
            t0 = time.monotonic()
            r = await c.post(COMPLETIONS, json=big)
            big_took.append((t0, time.monotonic()))
        assert_error(r, 400, code="context_length_exceeded")

    async def both():
        await asyncio.wait_for(asyncio.gather(stream(), huge()), 240)

    try:
        server.wait_ready()
        asyncio.run(both())
    finally:
        server.kill()
    t0, t1 = big_took[0]
    gaps_before = sorted(b - a for a, b in itertools.pairwise(arrivals) if b < t0)
    pace = gaps_before[len(gaps_before) // 2]  # the stream's own median gap between chunks
    during = [b - a for a, b in itertools.pairwise(arrivals) if t0 <= a and b <= t1]
    # Ratios to the stream's own pace, both measured here: the big request lasts several chunks' time
    # (fewer on a loaded machine, where the stream's pace slows as much as the tokenizer)...
    assert t1 - t0 > 6 * pace, f"the big prompt took {t1 - t0:.2f} s, only {(t1 - t0) / pace:.0f} chunks' time"
    # ...and a blocked event loop (or a GIL held by the tokenizer) would deliver no chunk meanwhile;
    # sharing the 2 cores with the tokenizer only slows the stream down.
    assert len(during) >= 3 and max(during) < (t1 - t0) / 3, (during, pace, t1 - t0)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice values are Linux's")
def test_background_work_runs_below_the_engine():
    """Templating and tokenizing run on workers at the lowest priority (per thread)."""
    import os
    import threading

    from localllm.api.background import BACKGROUND_NICENESS, in_background

    def niceness() -> int:
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    here = niceness()
    assert asyncio.run(in_background(niceness)) == BACKGROUND_NICENESS
    assert niceness() == here  # the caller's thread is left as it was
