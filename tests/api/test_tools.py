"""Tool calling: the parsers on recorded outputs of each format, the stream
filter that holds back calls, the template conversions; and end to end, with the official
``openai`` client against a real ``localllm serve`` on SmolLM2 (whose template does not take
tools: the tools go in a system message, hermes format): ``required`` and named choices always
parse and validate against the function's parameters (they are constrained by a grammar),
streamed calls assemble to the non-streamed ones, a tool result round-trips, and ``auto`` answers
never fail on unparseable text."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from api_server import serving

from localllm.api.tools import (
    ToolStream,
    parse_tool_calls,
    template_messages,
    template_takes_tools,
    tool_format,
)
from localllm.engine.tool_formats import TOOL_FORMATS
from localllm.tokenizer.templates import make_jinja_env

MODEL = "smol"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
ADD = {"type": "function", "function": {
    "name": "add", "description": "Add two integers",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer", "minimum": -100, "maximum": 100},
                                                    "b": {"type": "integer", "minimum": -100, "maximum": 100}},
                   "required": ["a", "b"], "additionalProperties": False}}}
TOOLS = [WEATHER, ADD]
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris, in celsius? Also, what is 2 + 3?"}]


# ---------------------------------------------------------------- parsers, on recorded outputs


@pytest.mark.parametrize("fmt, text, content, calls", [
    ("hermes", '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>', None,
     [("add", {"a": 2, "b": 3})]),
    ("hermes", 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
     '\n</tool_call>\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 1}}\n</tool_call>', "Let me check.",
     [("get_weather", {"city": "Paris", "unit": "celsius"}), ("add", {"a": 1, "b": 1})]),
    ("hermes", '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}', None, [("add", {"a": 2, "b": 3})]),
    ("hermes", '<tool_call>\n{"name": "add", "arguments": {"a": 2,', None, []),  # broken: content
    ("hermes", "Paris is sunny.", "Paris is sunny.", []),
    ("llama3", '<|python_tag|>{"name": "add", "parameters": {"a": 2, "b": 3}}', None, [("add", {"a": 2, "b": 3})]),
    ("llama3", '{"name": "add", "parameters": {"a": 2, "b": 3}}; {"name": "add", "parameters": {"a": 1, "b": 0}}',
     None, [("add", {"a": 2, "b": 3}), ("add", {"a": 1, "b": 0})]),
    ("llama3", '{"not": "a call"}', '{"not": "a call"}', []),
    ("llama3", "It is 5.", "It is 5.", []),
    ("mistral", '[TOOL_CALLS][{"name": "add", "arguments": {"a": 2, "b": 3}}]', None, [("add", {"a": 2, "b": 3})]),
    ("mistral", '[TOOL_CALLS][{"name": "add", "arguments": "{\\"a\\": 1, \\"b\\": 2}"}]', None,
     [("add", {"a": 1, "b": 2})]),
    ("mistral", "[TOOL_CALLS][{broken", "[TOOL_CALLS][{broken", []),
])
def test_parsers_on_recorded_outputs(fmt, text, content, calls):
    got_content, got = parse_tool_calls(text, fmt)
    assert [(c.name, json.loads(c.arguments)) for c in got] == calls
    expected = content if calls else text
    assert got_content == expected
    assert len({c.id for c in got}) == len(got) and all(_id_of_format(c.id, fmt) for c in got)


def _id_of_format(call_id: str, fmt: str) -> bool:
    """Whether an id has the shape the format's templates take (Mistral's: 9 letters and digits)."""
    length = TOOL_FORMATS[fmt].id_length
    return call_id.startswith("call_") if length is None else len(call_id) == length and call_id.isalnum()


CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'


@pytest.mark.parametrize("fmt, text, calls", [
    ("hermes", CALL + '\n<tool_call>\n{"name": "ad', [("add", {"a": 2, "b": 3})]),
    ("hermes", CALL + "\n<tool", [("add", {"a": 2, "b": 3})]),  # cut inside the next call's marker
    ("hermes", CALL + "\n" + CALL + '\n<tool_call>\n{"name": "add", "arguments": {"a"',
     [("add", {"a": 2, "b": 3})] * 2),
    ("hermes", '<tool_call>\n{"name": "add", "argu', []),  # nothing complete: the text stays content
    ("llama3", '{"name": "add", "parameters": {"a": 2, "b": 3}}; {"name": "add", "param',
     [("add", {"a": 2, "b": 3})]),
    ("mistral", '[TOOL_CALLS][{"name": "add", "arguments": {"a": 2, "b": 3}}, {"name": "add", "argu',
     [("add", {"a": 2, "b": 3})]),
])
def test_a_call_cut_by_max_tokens_leaves_the_complete_ones(fmt, text, calls):
    content, got = parse_tool_calls(text, fmt, truncated=True)
    assert [(c.name, json.loads(c.arguments)) for c in got] == calls
    assert content == (None if calls else text)
    if calls:  # an answer that was not cut and does not parse whole stays text, as before
        assert parse_tool_calls(text, fmt) == (text, []) or "<tool" in text[-6:]
    stream = ToolStream(fmt)
    sent = stream.feed(text)
    rest, streamed = stream.finish(truncated=True)
    assert [(c.name, c.arguments) for c in streamed] == [(c.name, c.arguments) for c in got]
    assert (sent + rest) == ("" if calls else text)


def test_formats_from_templates():
    assert tool_format("{% if tools %}<tool_call>{% endif %}") == "hermes"
    assert tool_format("{{- '<|python_tag|>' }}{% if tools %}{% endif %}") == "llama3"
    assert tool_format("[TOOL_CALLS]{{ tools }}") == "mistral"
    assert tool_format("{{ messages }}") == "hermes"  # the fallback
    assert template_takes_tools("{% if tools %}{% endif %}") and not template_takes_tools("{{ messages }}")


@pytest.mark.parametrize("fmt", sorted(TOOL_FORMATS))
@pytest.mark.parametrize("n", [1, 3])
def test_each_format_reads_the_calls_written_in_its_own_shape(fmt, n):
    """The registry entry that shapes a forced call's grammar (prefix, suffix, separator, array,
    the arguments' key, the name before the arguments, XML parameters) also parses it: calls
    written in that shape come back, whole or streamed."""
    f = TOOL_FORMATS[fmt]
    n = n if f.parallel else 1
    written = [{"name": f"f{i}", f.arguments_key: {"a": i, "s": "x<y"}} for i in range(n)]
    schemas = {w["name"]: {"properties": {"a": {"type": "integer"}, "s": {"type": "string"}}} for w in written}

    def arguments(args: dict) -> str:
        if not f.xml_arguments:
            return json.dumps(args)
        return "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in args.items())

    if f.array_prefix is not None:
        text = f.array_prefix + json.dumps(written)
    elif f.args_prefix is not None:
        text = f.separator.join(f.call_prefix + w["name"] + f.args_prefix + arguments(w[f.arguments_key])
                                + f.call_suffix for w in written)
    else:
        text = f.separator.join(f.call_prefix + json.dumps(c) + f.call_suffix for c in written)
    content, calls = parse_tool_calls(text, fmt, schemas=schemas)
    assert not content
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [(w["name"], w[f.arguments_key]) for w in written]
    stream = ToolStream(fmt, schemas)
    assert "".join(stream.feed(ch) for ch in text) == ""  # nothing of a call leaks as content
    rest, streamed = stream.finish()
    assert not rest and [(c.name, c.arguments) for c in streamed] == [(c.name, c.arguments) for c in calls]


@pytest.mark.parametrize("pieces", [1, 3, 100])
def test_tool_stream_holds_back_calls_and_passes_text(pieces):
    text = 'Let me look <that> up.<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
    size = max(1, len(text) // pieces)
    stream = ToolStream("hermes")
    sent = "".join(stream.feed(text[i:i + size]) for i in range(0, len(text), size))
    rest, calls = stream.finish()
    assert sent + rest == "Let me look <that> up." and [c.name for c in calls] == ["add"]
    plain = ToolStream("hermes")
    sent = "".join(plain.feed(ch) for ch in "a < b and <tool")
    rest, calls = plain.finish()
    assert sent + rest == "a < b and <tool" and calls == []


def test_template_messages_for_templates_with_and_without_tools():
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "5"}]
    qwen_like = ("{% if tools %}<tools>{% for t in tools %}{{ t.function.name }};{% endfor %}</tools>{% endif %}"
                 "{% for m in messages %}{{ m.role }}:{{ m.content }}{% if m.tool_calls %}"
                 "{% for c in m.tool_calls %}<tool_call>{{ c.function.name }} {{ c.function.arguments.a }}"
                 "</tool_call>{% endfor %}{% endif %}|{% endfor %}")
    out = template_messages(history, TOOLS, qwen_like)
    assert out[1]["tool_calls"][0]["function"]["arguments"] == {"a": 2, "b": 3}  # an object, as HF templates expect
    rendered = make_jinja_env().from_string(qwen_like).render(messages=out, tools=TOOLS)
    assert rendered.startswith("<tools>get_weather;add;</tools>") and "<tool_call>add 2</tool_call>" in rendered
    assert "tool:5|" in rendered
    plain = template_messages(history, TOOLS, "{{ messages }}")
    assert plain[0]["role"] == "system" and "get_weather" in plain[0]["content"] and "<tool_call>" in plain[0]["content"]
    assert '"name": "add"' in plain[2]["content"] and "tool_calls" not in plain[2]
    assert plain[3] == {"role": "user", "content": "<tool_response>\n5\n</tool_response>"}


# ---------------------------------------------------------------- end to end


@pytest.fixture(scope="module")
def client(smollm2_path):
    with serving(smollm2_path, "--served-model-name", MODEL, "--kv-cache-memory", "256MiB") as proc:
        yield openai.OpenAI(base_url=proc.url + "/v1", api_key="none", max_retries=0, timeout=240)


def _check_finish(finish: str, has_calls: bool, completion_tokens: int, max_tokens: int) -> None:
    """The finish reason the answer earned: ``tool_calls`` when it holds calls, else ``length`` when
    it used every token it was allowed, else ``stop``."""
    want = "tool_calls" if has_calls else "length" if completion_tokens >= max_tokens else "stop"
    assert finish == want, (finish, has_calls, completion_tokens, max_tokens)


def _check_calls(message, names=None):
    assert message.tool_calls, message
    for call in message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert names is None or call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), PARAMS[call.function.name])


@pytest.mark.slow
def test_required_and_named_choices_always_parse_and_validate(client):
    for seed in (1, 2, 3):
        # the grammar bounds the answer (at most 4 calls of bounded arguments): 240 tokens always fit
        r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
                                           max_tokens=240, temperature=1.0, seed=seed)
        assert r.choices[0].finish_reason == "tool_calls"
        _check_calls(r.choices[0].message)
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=80, temperature=1.0,
                                       seed=4, tool_choice={"type": "function", "function": {"name": "add"}})
    _check_calls(r.choices[0].message, {"add"})
    assert len(r.choices[0].message.tool_calls) == 1


@pytest.mark.slow
def test_streamed_calls_assemble_to_the_non_streamed_ones(client):
    kwargs = dict(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=240, temperature=0.0)
    whole = client.chat.completions.create(**kwargs).choices[0]
    calls: dict[int, dict] = {}
    finish = None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            for d in choice.delta.tool_calls or []:  # what the official clients' helpers assemble
                c = calls.setdefault(d.index, {"id": None, "name": "", "arguments": ""})
                c["id"] = d.id or c["id"]
                c["name"] += (d.function.name or "") if d.function else ""
                c["arguments"] += (d.function.arguments or "") if d.function else ""
    assert finish == whole.finish_reason == "tool_calls"
    assert [(c["name"], json.loads(c["arguments"])) for _, c in sorted(calls.items())] == [
        (t.function.name, json.loads(t.function.arguments)) for t in whole.message.tool_calls]


@pytest.mark.slow
def test_forced_calls_cut_by_max_tokens_leave_the_complete_ones(client):
    """``parallel_tool_calls: false`` makes exactly one call; ``required`` with parallel calls may make
    several, and where ``max_tokens`` cuts a later one the complete ones still come back as
    tool_calls (streamed and not), with finish_reason ``length``."""
    ask = [{"role": "user", "content": "Weather in Rome?"}]  # SmolLM2 goes on calling, greedily, where it may
    kwargs = dict(model=MODEL, messages=ask, tools=[WEATHER], tool_choice="required", temperature=0.0)
    one = client.chat.completions.create(max_tokens=300, parallel_tool_calls=False, **kwargs)
    assert one.choices[0].finish_reason == "tool_calls" and len(one.choices[0].message.tool_calls) == 1
    first = json.loads(one.choices[0].message.tool_calls[0].function.arguments)
    several = client.chat.completions.create(max_tokens=300, **kwargs).choices[0]
    assert len(several.message.tool_calls) >= 2 and json.loads(several.message.tool_calls[0].function.arguments) == first
    limit = one.usage.completion_tokens + 4  # a few tokens into the second call
    cut = client.chat.completions.create(max_tokens=limit, **kwargs).choices[0]
    assert cut.finish_reason == "length" and not cut.message.content
    assert [json.loads(t.function.arguments) for t in cut.message.tool_calls] == [first]
    streamed, finish, content = {}, None, ""
    for chunk in client.chat.completions.create(max_tokens=limit, stream=True, **kwargs):
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            content += choice.delta.content or ""
            for d in choice.delta.tool_calls or []:
                streamed[d.index] = streamed.get(d.index, "") + ((d.function.arguments or "") if d.function else "")
    assert finish == "length" and not content and [json.loads(a) for a in streamed.values()] == [first]


@pytest.mark.slow
def test_a_tool_result_round_trips(client):
    """The call and its result reach the next prompt: a longer result makes the prompt longer by
    exactly the result's extra tokens (give or take one where the texts meet), and the answer is text."""
    import httpx

    first = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=80, temperature=0.0,
                                           tool_choice={"type": "function", "function": {"name": "get_weather"}})
    call = first.choices[0].message.tool_calls[0]
    short = '{"temperature": 21, "sky": "clear"}'
    long = '{"temperature": 21, "sky": "clear", "note": "' + "a light breeze from the west " * 4 + '"}'

    def ask(result: str):
        history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                   {"role": "tool", "tool_call_id": call.id, "content": result}]
        return client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, tool_choice="none",
                                              max_tokens=20)

    def tokens(text: str) -> int:
        r = httpx.post(str(client.base_url).removesuffix("/v1/") + "/tokenize",
                       json={"model": MODEL, "prompt": text, "add_special_tokens": False})
        return r.json()["count"]

    a, b = ask(short), ask(long)
    extra = tokens(long) - tokens(short)
    assert extra > 20
    assert abs((b.usage.prompt_tokens - a.usage.prompt_tokens) - extra) <= 1, (a.usage, b.usage, extra)
    before = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="none", max_tokens=1)
    assert a.usage.prompt_tokens > before.usage.prompt_tokens + tokens(short) + 5  # the call is there too
    assert a.choices[0].message.content and not a.choices[0].message.tool_calls


@pytest.mark.slow
def test_auto_never_fails_on_what_the_model_writes(client):
    for seed in (1, 2):
        for stream in (False, True):
            kwargs = dict(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="auto", max_tokens=40,
                          temperature=1.0, seed=seed)
            if not stream:
                r = client.chat.completions.create(**kwargs)
                m = r.choices[0].message
                assert m.content or m.tool_calls
                if m.tool_calls:
                    for c in m.tool_calls:
                        json.loads(c.function.arguments)
                _check_finish(r.choices[0].finish_reason, bool(m.tool_calls), r.usage.completion_tokens, 40)
            else:
                chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True},
                                                             **kwargs))
                finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
                calls = any(c.choices and c.choices[0].delta.tool_calls for c in chunks)
                assert len(finish) == 1
                _check_finish(finish[0], calls, chunks[-1].usage.completion_tokens, 40)


@pytest.mark.slow
@pytest.mark.parametrize("body, param", [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "not": {}}}}],
      "tool_choice": "required"}, "tools"),
])
def test_bad_tool_requests_are_400s(client, body, param):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=5, **body)
    assert err.value.body["param"] == param, err.value.body


QWEN_LIKE_TEMPLATE = """{%- if tools %}<|im_start|>system
# Tools
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools>
For each function call, return a json object within <tool_call></tool_call> XML tags.<|im_end|>
{%- endif %}
{%- for message in messages %}
{%- if message.role == "assistant" and message.tool_calls %}<|im_start|>assistant
{%- for tc in message.tool_calls %}
<tool_call>
{"name": "{{ tc.function.name }}", "arguments": {{ tc.function.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{%- elif message.role == "tool" %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{%- else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{%- endif %}"""


@pytest.mark.slow
def test_a_tiny_model_with_a_template_that_takes_tools(tmp_path):
    """The tools reach the template (its own <tools> section, not our system message), earlier
    calls and results render through it, and constrained calls of a random model still parse."""
    from tiny_models import write_tiny_model

    from localllm import LLM

    path = write_tiny_model(tmp_path / "tiny-qwen.gguf", "qwen2", context_length=2048,
                            overrides={"tokenizer.chat_template": QWEN_LIKE_TEMPLATE})
    tok = LLM(model=path, kv_cache_memory="8MiB").tokenizer
    assert tool_format(tok.chat_template) == "hermes" and template_takes_tools(tok.chat_template)
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "5"}]
    text = tok.render_chat(template_messages(history, TOOLS, tok.chat_template), True, tools=TOOLS)
    assert '"name": "get_weather"' in text and "You may call" not in text  # the template's own tools section
    assert '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>' in text
    assert "<tool_response>\n5\n</tool_response>" in text
    with serving(path, "--served-model-name", MODEL, "--kv-cache-memory", "16MiB") as proc:
        c = openai.OpenAI(base_url=proc.url + "/v1", api_key="none", max_retries=0, timeout=120)
        for seed in (1, 2):
            # one call (byte-level vocabulary: ~110 tokens at most), always complete in 300 tokens
            r = c.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, tool_choice="required",
                                          parallel_tool_calls=False, max_tokens=300, temperature=1.0, seed=seed)
            assert r.choices[0].finish_reason == "tool_calls"
            _check_calls(r.choices[0].message)
        r = c.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, max_tokens=20, seed=3)
        _check_finish(r.choices[0].finish_reason, bool(r.choices[0].message.tool_calls), r.usage.completion_tokens, 20)
