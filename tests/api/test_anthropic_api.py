"""Anthropic's Messages API (``/v1/messages``, ``/v1/messages/count_tokens``) end to end: one real
``localllm serve`` subprocess on SmolLM2 (served as ``smol``, with an API key), driven by the
official ``anthropic`` client (and httpx for raw SSE and headers); plus the request conversion
and the stream's error event without a server.

The server runs a batch-invariant path, so that a request's greedy text is the same whether it is
streamed or not (see tests/api/test_api.py), on one thread (a shared machine's other jobs then slow
it less). Every request asks for a handful of tokens.
"""

from __future__ import annotations

import asyncio
import json
import time

import anthropic
import httpx
import pytest
from api_server import ServerProcess, batch_invariant_env

from localllm.api.anthropic.protocol import CountTokensRequest
from localllm.api.anthropic.serving import (
    AnthropicErrorShape,
    AnthropicServing,
    _stop_reason,
    _stop_sequence,
    to_chat_prompt,
)
from localllm.api.errors import AuthenticationError, error_response
from localllm.errors import EngineDeadError, QueueFullError, RequestTooLargeError

pytestmark = [pytest.mark.slow, pytest.mark.timeout(150)]

API_KEY = "anthropic-test-secret"
MODEL = "smol"
HI = [{"role": "user", "content": "Hi! Say hello back."}]
STORY = [{"role": "user", "content": "Write a long story about a dragon."}]


# ---------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def server(smollm2_path):
    proc = ServerProcess(
        smollm2_path,
        "--served-model-name",
        MODEL,
        "--api-key",
        API_KEY,
        "--kv-cache-memory",
        "256MiB",
        "--threads",
        "1",
        env=batch_invariant_env(),
    )
    try:
        proc.wait_ready()
        yield proc
    finally:
        proc.kill()


@pytest.fixture(scope="module")
def url(server) -> str:
    return server.url


@pytest.fixture(scope="module")
def client(url) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=url, api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def http(url):
    with httpx.Client(base_url=url, headers={"x-api-key": API_KEY}, timeout=120) as c:
        yield c


# Recent SDKs have no sampling parameters in their signatures; the server still takes them.
GREEDY = {"temperature": 0}


def create(client: anthropic.Anthropic, **kwargs) -> anthropic.types.Message:
    return client.messages.create(
        **{"model": MODEL, "max_tokens": 8, "messages": HI, "extra_body": GREEDY, **kwargs}
    )


def raw_error(
    client: anthropic.Anthropic, body: dict, path: str = "/v1/messages"
) -> anthropic.APIStatusError:
    """What the SDK raises for a body its typed ``create`` would refuse to send."""
    with pytest.raises(anthropic.APIStatusError) as info:
        client.post(path, cast_to=anthropic.types.Message, body=body)
    return info.value


def assert_anthropic_error(body, error_type: str, *words: str) -> str:
    assert isinstance(body, dict) and set(body) == {"type", "error"}, body
    assert body["type"] == "error" and set(body["error"]) == {"type", "message"}, body
    assert body["error"]["type"] == error_type, body
    message = body["error"]["message"]
    assert isinstance(message, str) and message and all(w in message for w in words), body
    return message


# ---------------------------------------------------------------- happy paths


@pytest.fixture(scope="module")
def story(client) -> anthropic.types.Message:
    """The greedy non-streamed answer the streamed ones are compared with."""
    return create(client, messages=STORY, max_tokens=10)


def test_plain_message_max_tokens_and_count_tokens(client, story):
    m = story
    assert m.id.startswith("msg_") and m.type == "message" and m.role == "assistant" and m.model == MODEL
    assert len(m.content) == 1 and m.content[0].type == "text" and m.content[0].text
    assert m.stop_reason == "max_tokens" and m.stop_sequence is None
    assert m.usage.output_tokens == 10 and m.usage.input_tokens > 0
    count = client.messages.count_tokens(model=MODEL, messages=STORY)
    assert count.input_tokens == m.usage.input_tokens


def test_system_as_string_and_as_blocks(client):
    system = "You are a pirate. Answer like one."
    as_string = client.messages.count_tokens(model=MODEL, messages=HI, system=system)
    as_block = create(client, system=[{"type": "text", "text": system}], max_tokens=2)
    assert as_block.usage.input_tokens == as_string.input_tokens and as_block.content[0].text
    without = client.messages.count_tokens(model=MODEL, messages=HI)
    assert as_string.input_tokens != without.input_tokens  # the template's default system was replaced
    two_blocks = client.messages.count_tokens(
        model=MODEL,
        messages=HI,
        system=[{"type": "text", "text": "You are a pirate."}, {"type": "text", "text": "Answer like one."}],
    )
    joined = client.messages.count_tokens(
        model=MODEL, messages=HI, system="You are a pirate.\n\nAnswer like one."
    )
    assert two_blocks.input_tokens == joined.input_tokens


def test_streaming_events_in_order_and_text_matches(client, story):
    with client.messages.stream(model=MODEL, max_tokens=10, extra_body=GREEDY, messages=STORY) as s:
        types = [e.type for e in s if e.type != "text"]
        final = s.get_final_message()
    assert types[:2] == ["message_start", "content_block_start"], types
    assert types[-3:] == ["content_block_stop", "message_delta", "message_stop"], types
    assert set(types[2:-3]) == {"content_block_delta"}, types
    assert final.content[0].text == story.content[0].text
    assert (final.stop_reason, final.stop_sequence) == ("max_tokens", None)
    assert (final.usage.input_tokens, final.usage.output_tokens) == (story.usage.input_tokens, 10)


def test_stop_sequences_streamed_and_not(client, story):
    full = story.content[0].text
    words = full.split()
    assert len(words) >= 3, full
    stop = words[2]
    expected = full[: full.find(stop)]
    m = create(client, messages=STORY, max_tokens=10, stop_sequences=["<never>", stop])
    assert (m.stop_reason, m.stop_sequence, m.content[0].text) == ("stop_sequence", stop, expected)
    with client.messages.stream(
        model=MODEL, max_tokens=10, extra_body=GREEDY, messages=STORY, stop_sequences=[stop]
    ) as s:
        streamed = "".join(s.text_stream)
        final = s.get_final_message()
    assert streamed == expected and (final.stop_reason, final.stop_sequence) == ("stop_sequence", stop)


def test_raw_sse_names_each_event_and_pings(http):
    body = {"model": MODEL, "max_tokens": 2, "temperature": 0, "messages": HI, "stream": True}
    with http.stream("POST", "/v1/messages", json=body) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        blocks = [b for b in r.read().decode().split("\n\n") if b.strip()]
    names = []
    for block in blocks:
        event, data = block.split("\n")
        assert event.startswith("event: ") and data.startswith("data: "), block
        names.append(event.removeprefix("event: "))
        assert json.loads(data.removeprefix("data: "))["type"] == names[-1]
    assert names[:3] == ["message_start", "content_block_start", "ping"], names
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"], names
    start = json.loads(blocks[0].split("data: ", 1)[1])["message"]
    assert start["content"] == [] and start["stop_reason"] is None and start["usage"]["output_tokens"] == 0


def test_tool_result_round_trip_and_prefill(client):
    tools = [
        {
            "name": "get_weather",
            "description": "The weather in a city.",
            "input_schema": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        }
    ]
    messages = [
        {"role": "user", "content": "What is the weather in Paris?"},
        {
            "role": "assistant",
            "content": [
                {"type": "text", "text": "Let me check."},
                {"type": "tool_use", "id": "toolu_01", "name": "get_weather", "input": {"city": "Paris"}},
            ],
        },
        {
            "role": "user",
            "content": [
                {
                    "type": "tool_result",
                    "tool_use_id": "toolu_01",
                    "content": [{"type": "text", "text": "Sunny, 24 C"}],
                },
            ],
        },
    ]
    m = create(client, messages=messages, tools=tools, tool_choice={"type": "auto"}, max_tokens=2)
    assert m.content[0].type == "text" and m.usage.input_tokens > 0
    count = client.messages.count_tokens(model=MODEL, messages=messages, tools=tools)
    assert count.input_tokens == m.usage.input_tokens
    prefilled = create(client, messages=[*HI, {"role": "assistant", "content": "Hello"}], max_tokens=2)
    plain = client.messages.count_tokens(model=MODEL, messages=HI)
    assert prefilled.content[0].type == "text" and prefilled.usage.input_tokens > plain.input_tokens


def test_disconnect_mid_stream_aborts_the_request(url, http):
    def aborted() -> float:
        text = http.get("/metrics").text
        line = next(
            x
            for x in text.splitlines()
            if x.startswith("localllm:request_success_total{") and 'finished_reason="abort"' in x
        )
        return float(line.rsplit(" ", 1)[1])

    before = aborted()
    body = {"model": MODEL, "max_tokens": 400, "messages": STORY, "stream": True}
    with http.stream("POST", "/v1/messages", json=body) as r:
        lines = r.iter_lines()
        for _ in range(3):
            while not next(lines).startswith("event: content_block_delta"):
                pass
    deadline = time.monotonic() + 10
    while aborted() != before + 1 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert aborted() == before + 1


# ---------------------------------------------------------------- errors


def test_missing_max_tokens(client):
    body = {"model": MODEL, "messages": HI}
    err = raw_error(client, body)
    assert isinstance(err, anthropic.BadRequestError)
    assert_anthropic_error(err.body, "invalid_request_error", "max_tokens")
    err = raw_error(client, {**body, "max_tokens": "8"})
    assert_anthropic_error(err.body, "invalid_request_error", "max_tokens")


def test_bad_temperature(client):
    with pytest.raises(anthropic.BadRequestError) as info:
        create(client, extra_body={"temperature": 1.5})
    assert_anthropic_error(info.value.body, "invalid_request_error", "temperature", "[0, 1]")


def test_image_and_thinking_are_refused(client):
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}
    with pytest.raises(anthropic.BadRequestError) as info:
        create(
            client, messages=[{"role": "user", "content": [{"type": "text", "text": "What is this?"}, image]}]
        )
    assert_anthropic_error(info.value.body, "invalid_request_error", "images are not supported")
    with pytest.raises(anthropic.BadRequestError) as info:
        create(client, thinking={"type": "enabled", "budget_tokens": 1024}, max_tokens=2048)
    assert_anthropic_error(info.value.body, "invalid_request_error", "thinking")
    err = raw_error(
        client,
        {
            "model": MODEL,
            "max_tokens": 4,
            "messages": [{"role": "user", "content": [{"type": "video", "url": "x"}]}],
        },
    )
    assert_anthropic_error(err.body, "invalid_request_error", "messages")


def test_unknown_model_and_path(client, http):
    with pytest.raises(anthropic.NotFoundError) as info:
        create(client, model="claude-opus-4")
    assert_anthropic_error(info.value.body, "not_found_error", "claude-opus-4")
    with pytest.raises(anthropic.NotFoundError) as info:
        client.messages.count_tokens(model="claude-opus-4", messages=HI)
    assert_anthropic_error(info.value.body, "not_found_error")
    r = http.post("/v1/messages/nope", json={})
    assert r.status_code == 404
    assert_anthropic_error(r.json(), "not_found_error")


def test_api_key_as_x_api_key_or_bearer(url):
    kwargs = {"base_url": url, "max_retries": 0, "timeout": 60}
    with pytest.raises(anthropic.AuthenticationError) as info:
        create(anthropic.Anthropic(api_key="wrong", **kwargs))
    assert_anthropic_error(info.value.body, "authentication_error", "x-api-key")
    # Claude Code's way: x-api-key (the SDK's own Authorization header is wrong here).
    ok = anthropic.Anthropic(api_key="wrong", default_headers={"x-api-key": API_KEY}, **kwargs)
    assert ok.messages.count_tokens(model=MODEL, messages=HI).input_tokens > 0
    r = httpx.post(f"{url}/v1/messages/count_tokens", json={"model": MODEL, "messages": HI})
    assert r.status_code == 401
    assert_anthropic_error(r.json(), "authentication_error")
    # The OpenAI routes take x-api-key too, and keep their own error shape.
    assert httpx.get(f"{url}/v1/models", headers={"x-api-key": API_KEY}).status_code == 200
    assert set(httpx.get(f"{url}/v1/models").json()) == {"error"}


# ---------------------------------------------------------------- without a server


def test_conversion_to_chat_messages():
    req = CountTokensRequest.model_validate(
        {
            "model": MODEL,
            "system": [
                {"type": "text", "text": "A", "cache_control": {"type": "ephemeral"}},
                {"type": "text", "text": "B"},
            ],
            "messages": [
                {"role": "user", "content": [{"type": "text", "text": "q1"}, {"type": "text", "text": "q2"}]},
                {
                    "role": "assistant",
                    "content": [
                        {"type": "thinking", "thinking": "hmm", "signature": "x"},
                        {"type": "text", "text": "calling"},
                        {"type": "tool_use", "id": "t1", "name": "f", "input": {"x": 1}},
                    ],
                },
                {
                    "role": "user",
                    "content": [
                        {"type": "tool_result", "tool_use_id": "t1", "content": "42"},
                        {
                            "type": "tool_result",
                            "tool_use_id": "t2",
                            "content": [{"type": "text", "text": "no"}],
                            "is_error": True,
                        },
                        {"type": "text", "text": "go on"},
                    ],
                },
                {"role": "assistant", "content": "The answer"},
            ],
            "tools": [{"name": "f", "input_schema": {"type": "object"}}],
            "unknown_field": 1,
        }
    )
    plain = to_chat_prompt(req, "{{ messages }}")
    # a template without tools: they are described in the system message
    system = plain.messages[0]["content"]
    assert system.startswith("A\n\nB\n\nYou may call") and '"name": "f"' in system and "<tool_call>" in system
    assert plain.messages[1:] == [
        {"role": "user", "content": "q1\n\nq2"},
        {
            "role": "assistant",
            "content": 'calling\n\n{"type": "tool_use", "id": "t1", "name": "f", "input": {"x": 1}}',
        },
        {"role": "tool", "content": "42", "tool_call_id": "t1"},
        {"role": "tool", "content": "Error: no", "tool_call_id": "t2"},
        {"role": "user", "content": "go on"},
    ]
    assert plain.prefill == "The answer" and plain.template_kwargs == {}
    rich = to_chat_prompt(req, "{% for m in messages %}{{ m.tool_calls }}{% endfor %}{{ tools }}")
    assert rich.messages[2] == {
        "role": "assistant",
        "content": "calling",
        "tool_calls": [{"id": "t1", "type": "function", "function": {"name": "f", "arguments": {"x": 1}}}],
    }
    assert rich.template_kwargs["tools"][0]["function"]["name"] == "f"
    assert _stop_sequence("abc END", ["END", "D", "x"]) == "END" and _stop_sequence("abc", ["x"]) is None
    # max_tokens is a cap: clamped to the context window, a shorter "length" finish says so.
    assert _stop_reason("length", None, 10, 10) == "max_tokens"
    assert _stop_reason("length", None, 7, 10) == "model_context_window_exceeded"
    assert (
        _stop_reason("stop", None, 3, 10) == "end_turn"
        and _stop_reason("stop", "x", 3, 10) == "stop_sequence"
    )


def test_an_engine_error_mid_stream_becomes_an_error_event():
    async def events():
        yield "event: ping\ndata: {}\n\n"
        raise QueueFullError("busy", code="queue_full")

    async def collect():
        return [e async for e in AnthropicServing._with_error_event(events())]

    out = asyncio.run(collect())
    assert out[-1].startswith("event: error\ndata: ")
    body = json.loads(out[-1].split("data: ", 1)[1])
    assert body == {"type": "error", "error": {"type": "overloaded_error", "message": "busy"}}


@pytest.mark.parametrize(
    ("exc", "status", "error_type"),
    [
        (
            QueueFullError("the server has 4 requests waiting; retry later", code="queue_full"),
            529,
            "overloaded_error",
        ),
        (
            RequestTooLargeError("the request body is larger than 8 bytes", code="request_too_large"),
            413,
            "request_too_large",
        ),
        (AuthenticationError("missing or wrong API key"), 401, "authentication_error"),
        (EngineDeadError("the server is shutting down"), 503, "api_error"),
    ],
)
def test_every_layers_errors_are_reshaped(exc, status, error_type):
    async def app(scope, receive, send):
        await error_response(exc)(scope, receive, send)

    async def call(path: str) -> tuple[dict, bytes]:
        sent = []

        async def send(message):
            sent.append(message)

        scope = {"type": "http", "path": path, "method": "POST", "headers": []}
        await AnthropicErrorShape(app)(scope, None, send)
        return sent[0], b"".join(m.get("body", b"") for m in sent[1:])

    start, body = asyncio.run(call("/v1/messages"))
    headers = dict(start["headers"])
    assert start["status"] == status and int(headers[b"content-length"]) == len(body)
    assert_anthropic_error(json.loads(body), error_type, exc.message)
    if isinstance(exc, QueueFullError):
        assert int(headers[b"retry-after"]) >= 1
    start, body = asyncio.run(call("/v1/chat/completions"))  # other paths keep OpenAI's shape
    assert start["status"] == exc.status_code and set(json.loads(body)) == {"error"}


WEATHER_TOOL = {"name": "get_weather", "description": "Weather of a city", "input_schema": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 30}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"], "additionalProperties": False}}


def test_tool_choice_any_returns_tool_use_blocks(client):
    import jsonschema

    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    m = create(client, messages=ask, tools=[WEATHER_TOOL], tool_choice={"type": "any"}, max_tokens=200)
    uses = [b for b in m.content if b.type == "tool_use"]
    assert m.stop_reason == "tool_use" and uses
    for b in uses:
        assert b.name == "get_weather" and b.id.startswith("toolu_")
        jsonschema.validate(b.input, WEATHER_TOOL["input_schema"])
    # streamed: the SDK assembles input_json_delta events into the same blocks
    with client.messages.stream(model=MODEL, messages=ask, tools=[WEATHER_TOOL], max_tokens=200, extra_body=GREEDY,
                                tool_choice={"type": "tool", "name": "get_weather"}) as stream:
        final = stream.get_final_message()
    streamed = [b for b in final.content if b.type == "tool_use"]
    assert final.stop_reason == "tool_use" and len(streamed) == 1
    jsonschema.validate(streamed[0].input, WEATHER_TOOL["input_schema"])
    # the result goes back as a tool_result
    follow = ask + [{"role": "assistant", "content": [b.model_dump() for b in final.content if b.type == "tool_use"]},
                    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": streamed[0].id,
                                                  "content": "21 degrees, clear"}]}]
    answer = create(client, messages=follow, tools=[WEATHER_TOOL], tool_choice={"type": "none"}, max_tokens=8)
    assert answer.content[0].type == "text"


ROME = [{"role": "user", "content": "Weather in Rome?"}]  # SmolLM2 goes on calling, greedily, where it may


def _one_call(client) -> anthropic.types.Message:
    one = create(client, messages=ROME, tools=[WEATHER_TOOL], max_tokens=120,
                 tool_choice={"type": "any", "disable_parallel_tool_use": True})
    assert one.stop_reason == "tool_use" and [b.type for b in one.content] == ["tool_use"]
    return one


@pytest.mark.timeout(400)  # ~90 s here: constrained tool calls through this route are slow (see the note)
def test_disable_parallel_tool_use_makes_one_call_and_any_may_make_more(client):
    import jsonschema

    one = _one_call(client)
    jsonschema.validate(one.content[0].input, WEATHER_TOOL["input_schema"])
    several = create(client, messages=ROME, tools=[WEATHER_TOOL], tool_choice={"type": "any"},
                     max_tokens=2 * one.usage.output_tokens + 8)
    calls = [b for b in several.content if b.type == "tool_use"]
    assert len(calls) >= 2 and calls[0].input == one.content[0].input, several.content  # greedy: the same first call


@pytest.mark.timeout(400)  # ~90 s here: constrained tool calls through this route are slow (see the note)
def test_calls_cut_by_max_tokens_leave_the_complete_ones(client):
    """Where ``max_tokens`` cuts a later call, the complete ones still come back as tool_use blocks
    (streamed and not) and stop_reason is ``max_tokens``."""
    one = _one_call(client)
    limit = one.usage.output_tokens + 4  # a few tokens into the second call
    cut = create(client, messages=ROME, tools=[WEATHER_TOOL], tool_choice={"type": "any"}, max_tokens=limit)
    assert cut.stop_reason == "max_tokens"
    assert [(b.type, getattr(b, "input", None)) for b in cut.content] == [("tool_use", one.content[0].input)]
    with client.messages.stream(model=MODEL, messages=ROME, tools=[WEATHER_TOOL], max_tokens=limit,
                                extra_body=GREEDY, tool_choice={"type": "any"}) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "max_tokens"
    assert [(b.type, b.input) for b in final.content if b.type == "tool_use"] == [("tool_use", one.content[0].input)]
    assert all(b.type == "tool_use" or "<tool_call>" not in b.text for b in final.content)


def test_models_list_in_anthropics_shape(client):
    models = list(client.models.list())
    assert [m.id for m in models] == [MODEL] and models[0].type == "model"
    assert models[0].display_name == MODEL and models[0].created_at.year >= 2025
