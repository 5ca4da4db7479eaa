"""OpenAI's Responses API: the store's bounds and the input conversion as units;
then end to end with the official ``openai`` client (``client.responses.create``, ``.stream``,
``.parse``, ``.retrieve``, ``.delete``) against a real ``localllm serve`` on SmolLM2.

The answers are checked against the chat route they are built on: the same messages through
``/v1/chat/completions`` give the same greedy text, so a wrong conversion (a lost instruction,
history or tool result) shows as a different answer or prompt length."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from api_server import serving
from pydantic import BaseModel

from localllm.api.responses.protocol import ResponsesRequest
from localllm.api.responses.serving import chat_request, input_messages
from localllm.api.responses.store import ResponseStore
from localllm.errors import InvalidRequestError, ResponseNotFoundError

MODEL = "smol"
WEATHER = {"type": "function", "name": "get_weather", "description": "Current weather of a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}},
                          "required": ["city"], "additionalProperties": False}}

# ---------------------------------------------------------------- units


def _response(i: int, text: str = "x") -> dict:
    return {"id": f"resp_{i}", "output": [{"type": "message", "content": [{"type": "output_text", "text": text}]}]}


def test_the_store_keeps_the_most_recently_used_within_its_entries_and_bytes():
    store = ResponseStore(max_entries=3, max_bytes=10_000)
    for i in range(4):
        store.put(_response(i), [{"role": "user", "content": f"q{i}"}])
    assert len(store) == 3
    with pytest.raises(ResponseNotFoundError):
        store.response("resp_0")  # the oldest went first
    store.conversation("resp_1")  # used: now the most recent
    store.put(_response(4), [])
    assert store.response("resp_1")["id"] == "resp_1"
    with pytest.raises(ResponseNotFoundError):
        store.response("resp_2")
    # bytes: one large answer pushes out the others, and its size is what the store counts
    big = _response(5, "y" * 9_850)
    store.put(big, [])
    assert store.nbytes <= 10_000 and store.response("resp_5")["output"] == big["output"]
    assert len(store) == 1
    store.put(_response(6, "z" * 20_000), [])  # larger than the whole store: not kept
    with pytest.raises(ResponseNotFoundError):
        store.response("resp_6")
    store.put(_response(7), [{"role": "user", "content": "q7"}])  # evicts the large one (bytes)
    store.put(_response(8), [{"role": "user", "content": "q8"}])
    assert set(store._entries) == {"resp_7", "resp_8"}
    assert store.nbytes == sum(len(json.dumps(store.response(k))) + len(json.dumps(store.conversation(k)))
                               for k in ("resp_7", "resp_8"))
    store.delete("resp_7")
    with pytest.raises(ResponseNotFoundError):
        store.delete("resp_7")
    assert store.nbytes == len(json.dumps(store.response("resp_8"))) + len(json.dumps(store.conversation("resp_8")))


def test_input_items_become_chat_messages():
    req = ResponsesRequest.model_validate({"input": [
        {"role": "developer", "content": "Be brief."},  # the "easy" shape: no type
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather "},
                                                         {"type": "input_text", "text": "in Rome?"}]},
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Rome"}'},
        {"type": "function_call", "call_id": "call_2", "name": "get_weather", "arguments": '{"city": "Oslo"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "21 C"},
        {"type": "function_call_output", "call_id": "call_2", "output": [{"type": "input_text", "text": "3 C"}]},
    ]})
    assert input_messages(req) == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Rome?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}},
            {"id": "call_2", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "content": "21 C", "tool_call_id": "call_1"},
        {"role": "tool", "content": "3 C", "tool_call_id": "call_2"},
    ]
    chat = chat_request(ResponsesRequest.model_validate({
        "input": "hi", "instructions": "Answer in French.", "max_output_tokens": 7, "tools": [WEATHER],
        "tool_choice": {"type": "function", "name": "get_weather"}, "parallel_tool_calls": False,
        "text": {"format": {"type": "json_schema", "name": "p", "schema": {"type": "object"}}}}),
        [{"role": "user", "content": "before"}, {"role": "assistant", "content": "earlier"}])
    assert [(m.role, m.content) for m in chat.messages] == [
        ("system", "Answer in French."), ("user", "before"), ("assistant", "earlier"), ("user", "hi")]
    assert chat.max_tokens == 7 and chat.tool_choice.function.name == "get_weather"
    assert chat.tools[0].function.name == "get_weather" and chat.parallel_tool_calls is False
    assert chat.response_format.type == "json_schema" and chat.response_format.json_schema.schema_ == {"type": "object"}


@pytest.mark.parametrize("body, param, words", [
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input", "images"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input", "item_reference"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools", "only function tools"),
    ({"input": "hi", "tool_choice": {"type": "file_search"}}, "tool_choice", "not supported"),
    ({"input": "hi", "background": True}, "background", "background"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema", "schema"),
    ({"input": [{"type": "reasoning"}]}, "input", "no message"),
])
def test_what_is_refused_is_named(body, param, words):
    with pytest.raises(InvalidRequestError) as err:
        chat_request(ResponsesRequest.model_validate(body), [])
    assert err.value.param == param and words in err.value.message


# ---------------------------------------------------------------- end to end


@pytest.fixture(scope="module")
def client(smollm2_path):
    with serving(smollm2_path, "--served-model-name", MODEL, "--kv-cache-memory", "256MiB") as proc:
        yield openai.OpenAI(base_url=proc.url + "/v1", api_key="none", max_retries=0, timeout=240)


def _chat(client, messages, **kwargs):
    return client.chat.completions.create(model=MODEL, messages=messages, temperature=0.0, **kwargs)


@pytest.mark.slow
def test_text_input_and_instructions_answer_as_the_chat_route(client):
    r = client.responses.create(model=MODEL, input="Name a color.", instructions="Answer in one word.",
                                max_output_tokens=40, temperature=0.0)
    chat = _chat(client, [{"role": "system", "content": "Answer in one word."},
                          {"role": "user", "content": "Name a color."}], max_tokens=40)
    assert r.object == "response" and r.id.startswith("resp_") and r.model == MODEL
    assert r.status == "completed" and r.output_text == chat.choices[0].message.content
    assert [o.type for o in r.output] == ["message"] and r.output[0].status == "completed"
    assert r.usage.input_tokens == chat.usage.prompt_tokens and r.usage.output_tokens == chat.usage.completion_tokens
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens


@pytest.mark.slow
def test_streamed_events_assemble_to_the_whole_response(client):
    kwargs = dict(model=MODEL, input="Say hello to Ada.", max_output_tokens=60, temperature=0.0)
    whole = client.responses.create(**kwargs)
    with client.responses.stream(**kwargs) as stream:
        events = list(stream)
        final = stream.get_final_response()
    types = [e.type for e in events]
    assert types[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert types[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == final.output_text == whole.output_text and final.status == "completed"
    assert final.usage.output_tokens == whole.usage.output_tokens


@pytest.mark.slow
def test_previous_response_id_continues_the_conversation(client):
    first = client.responses.create(model=MODEL, input="My name is Ada. Greet me.", max_output_tokens=30,
                                    temperature=0.0, instructions="Be kind.")
    second = client.responses.create(model=MODEL, input="What is my name?", previous_response_id=first.id,
                                     max_output_tokens=30, temperature=0.0)
    chat = _chat(client, [{"role": "user", "content": "My name is Ada. Greet me."},
                          {"role": "assistant", "content": first.output_text},
                          {"role": "user", "content": "What is my name?"}], max_tokens=30)
    # the instructions are not carried over (as OpenAI does), the history is
    assert second.usage.input_tokens == chat.usage.prompt_tokens
    assert second.output_text == chat.choices[0].message.content
    assert second.previous_response_id == first.id
    assert client.responses.retrieve(first.id).output_text == first.output_text
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError) as err:
        client.responses.create(model=MODEL, input="hi", previous_response_id=first.id, max_output_tokens=5)
    assert err.value.body["param"] == "previous_response_id"
    unstored = client.responses.create(model=MODEL, input="hi", store=False, max_output_tokens=5)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


@pytest.mark.slow
def test_a_forced_function_call_and_its_output_round_trip(client):
    kwargs = dict(model=MODEL, input="Weather in Rome?", tools=[WEATHER], tool_choice="required",
                  parallel_tool_calls=False, max_output_tokens=120, temperature=0.0)
    r = client.responses.create(**kwargs)
    calls = [o for o in r.output if o.type == "function_call"]
    assert r.status == "completed" and len(calls) == 1 and calls[0].name == "get_weather"
    assert calls[0].call_id.startswith("call_") and calls[0].status == "completed"
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER["parameters"])
    with client.responses.stream(**kwargs) as stream:
        events = list(stream)
        final = stream.get_final_response()
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert args == calls[0].arguments
    assert [(o.type, o.name, o.arguments) for o in final.output] == [("function_call", "get_weather", args)]
    # the result goes back as a function_call_output item, after the stored call
    follow = client.responses.create(model=MODEL, previous_response_id=r.id, tools=[WEATHER], tool_choice="none",
                                     input=[{"type": "function_call_output", "call_id": calls[0].call_id,
                                             "output": '{"temperature_c": 21}'}],
                                     max_output_tokens=30, temperature=0.0)
    chat = _chat(client, [{"role": "user", "content": "Weather in Rome?"},
                          {"role": "assistant", "content": "", "tool_calls": [
                              {"id": calls[0].call_id, "type": "function",
                               "function": {"name": "get_weather", "arguments": calls[0].arguments}}]},
                          {"role": "tool", "tool_call_id": calls[0].call_id, "content": '{"temperature_c": 21}'}],
                 tools=[{"type": "function", "function": {k: WEATHER[k] for k in ("name", "description", "parameters")}}],
                 tool_choice="none", max_tokens=30)
    assert follow.usage.input_tokens == chat.usage.prompt_tokens
    assert follow.output_text == chat.choices[0].message.content and follow.output_text


class City(BaseModel):
    name: str
    country: str


@pytest.mark.slow
def test_text_format_json_schema_and_parse(client):
    r = client.responses.parse(model=MODEL, input="Name a city and its country.", text_format=City,
                               max_output_tokens=60, temperature=0.0)
    assert r.status == "completed" and isinstance(r.output_parsed, City)
    assert City.model_validate_json(r.output_text) == r.output_parsed


@pytest.mark.slow
def test_reasoning_becomes_a_reasoning_item(client):
    grammar = 'root ::= "<think>\\n" [a-z ]{3,40} "\\n</think>\\n\\nThe answer is " [0-9] "."'
    kwargs = dict(model=MODEL, input="What is 2 + 2?", max_output_tokens=60, temperature=0.0,
                  extra_body={"guided_grammar": grammar, "reasoning_format": "deepseek"})
    r = client.responses.create(**kwargs)
    assert [o.type for o in r.output] == ["reasoning", "message"]
    thought = r.output[0].content[0].text
    assert thought and "<think>" not in thought and r.output_text.startswith("The answer is ")
    with client.responses.stream(**kwargs) as stream:
        events = list(stream)
        final = stream.get_final_response()
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == thought
    assert final.output_text == r.output_text
    assert [e.output_index for e in events if e.type == "response.output_text.delta"][0] == 1
    # the reasoning item opens with its text part and closes before the message opens
    order = [(e.type, getattr(e, "output_index", None)) for e in events]
    at = {key: order.index(key) for key in order}
    assert (at[("response.output_item.added", 0)] < at[("response.content_part.added", 0)]
            < at[("response.reasoning_text.delta", 0)] < at[("response.content_part.done", 0)]
            < at[("response.output_item.done", 0)] < at[("response.output_item.added", 1)])
    assert r.output[0].status == "completed" and final.output[0].status == "completed"
    assert 0 < r.usage.output_tokens_details.reasoning_tokens < r.usage.output_tokens


@pytest.mark.slow
def test_max_output_tokens_makes_an_incomplete_response(client):
    # greedy: sampled at temperature 1, the story could end (an end-of-turn token) within its 5 tokens
    kwargs = dict(model=MODEL, input="Tell me a long story about a dragon.", max_output_tokens=5, temperature=0)
    r = client.responses.create(**kwargs)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens", \
        (r.status, r.output_text, r.usage, r.output)
    assert r.usage.output_tokens == 5 and r.output[0].status == "incomplete"
    with client.responses.stream(**kwargs) as stream:
        last = list(stream)[-1]
    assert last.type == "response.incomplete" and last.response.incomplete_details.reason == "max_output_tokens"


@pytest.mark.slow
def test_bad_requests_are_openai_shaped_400s(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(model=MODEL, input="hi", tools=[{"type": "web_search"}])
    assert err.value.body["param"] == "tools"
    with pytest.raises(openai.BadRequestError):
        client.responses.create(model=MODEL, input=[{"role": "user", "content": [
            {"type": "input_image", "image_url": "https://example.com/x.png"}]}])
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="no-such-model", input="hi")
    with pytest.raises(openai.BadRequestError) as err:  # the client's own field names in the error
        client.responses.create(model=MODEL, input="hi", max_output_tokens=0)
    assert err.value.body["param"] == "max_output_tokens"
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(model=MODEL, input="hi", tools=[{**WEATHER, "name": "bad name!"}])
    assert err.value.body["param"].startswith("tools")
