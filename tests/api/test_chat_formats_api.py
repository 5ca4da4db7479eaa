"""The chat formats through the API, with the official ``openai`` and ``anthropic`` clients: tiny
random models that carry the real chat templates of gpt-oss (harmony), Qwen3-Coder (XML calls),
Qwen3 (``<think>``, hermes calls) and Mistral Small 3.2 (``[TOOL_CALLS]NAME[CALL_ID]ID[ARGS]``),
served in this process (the app ``serve`` builds, over a store of those models).

A grammar scripts what a model writes (the chat route's ``guided_grammar``; for Anthropic's route,
which has no such field, the same grammar put in its sampling parameters): the answer in the
model's own format comes back as reasoning (``reasoning_content``, ``thinking`` blocks), content
and tool calls, streamed as it is whole; the call and its result go back into the next prompt.
Forced calls (``tool_choice: required``, Anthropic's ``any``) are shaped by each format's grammar
and always parse and validate."""

from __future__ import annotations

import asyncio
import json
from contextlib import contextmanager
from pathlib import Path
from unittest import mock

import anthropic
import httpx
import jsonschema
import openai
import pytest

from localllm.api.anthropic.protocol import MessagesRequest

try:  # the HTTP package the anthropic client is built on: httpx's fork in its newer releases
    import httpx2 as anthropic_httpx
except ImportError:
    anthropic_httpx = httpx
from localllm.sampling_params import StructuredOutput

pytestmark = pytest.mark.timeout(300)

TEMPLATES = Path(__file__).parent.parent / "fixtures" / "chat_templates"
MODELS = {  # served name: its chat template
    "gpt-oss": "openai-gpt-oss-120b.jinja",
    "qwen3-coder": "Qwen3-Coder.jinja",
    "qwen3": "Qwen-Qwen3-0.6B.jinja",
    "mistral-small": "Mistral-Small-3.2-24B-Instruct-2506.jinja",
}
ADD = {"type": "function", "function": {
    "name": "add", "description": "Add two integers",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer", "minimum": -100, "maximum": 100},
                                                    "b": {"type": "integer", "minimum": -100, "maximum": 100}},
                   "required": ["a", "b"], "additionalProperties": False}}}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "pattern": "^[A-Za-z ]{1,20}$"},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TOOLS = [ADD, WEATHER]
ASK = [{"role": "user", "content": "What is 2 + 3?"}]
SUM = {"a": 2, "b": 3}

# what each model writes, in its format, and what it reads as: (reasoning, content, calls)
SCRIPTS = {
    "gpt-oss": (("<|channel|>analysis<|message|>The user wants a sum: use add.<|end|><|start|>assistant"
                "<|channel|>commentary<|message|>Adding.<|end|><|start|>assistant<|channel|>commentary "
                'to=functions.add <|constrain|>json<|message|>{"a": 2, "b": 3}'),
                ("The user wants a sum: use add.", "Adding.", [("add", SUM)])),
    "qwen3-coder": (("Let me add.\n<tool_call>\n<function=add>\n<parameter=a>\n2\n</parameter>\n<parameter=b>\n3\n"
                    "</parameter>\n</function>\n</tool_call>"), (None, "Let me add.", [("add", SUM)])),
    "qwen3": (('<think>\nA sum: use add.\n</think>\n\n<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n'
              "</tool_call>"), ("A sum: use add.", None, [("add", SUM)])),
    "mistral-small": ('Adding.[TOOL_CALLS]add[CALL_ID]a1b2c3d4e[ARGS]{"a": 2, "b": 3}', (None, "Adding.", [("add", SUM)])),
}
GPT_OSS_ANSWER = ("<|channel|>analysis<|message|>Simple arithmetic.<|end|><|start|>assistant<|channel|>final"
                  "<|message|>2 + 3 = 5.")


def _grammar(text: str) -> str:
    return "root ::= " + json.dumps(text)


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    from tiny_models import add_to_store, write_tiny_model

    home = tmp_path_factory.mktemp("home")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LOCALLLM_HOME", str(home))
        for name, template in MODELS.items():
            path = write_tiny_model(tmp_path_factory.mktemp(name) / f"{name}.gguf", "qwen2", context_length=4096,
                                    overrides={"tokenizer.chat_template": (TEMPLATES / template).read_text()})
            add_to_store(name, path)
        yield home


def _serve(scenario):
    """Run ``scenario(openai_client, anthropic_client)`` against the app ``serve`` builds."""
    from localllm.api.launch import build_pool
    from localllm.api.server import build_app
    from localllm.config.settings import load_settings

    pool, _ = build_pool(load_settings({"kv_cache_memory": "32MiB", "threads": 1}))
    app = build_app(pool, None)

    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), timeout=120) as http, \
                anthropic_httpx.AsyncClient(transport=anthropic_httpx.ASGITransport(app=app), timeout=120) as http2:
            oai = openai.AsyncOpenAI(base_url="http://localhost/v1", api_key="none", http_client=http, max_retries=0)
            claude = anthropic.AsyncAnthropic(base_url="http://localhost", api_key="none", http_client=http2,
                                              max_retries=0)
            await scenario(oai, claude)

    try:
        asyncio.run(main())
    finally:
        pool.shutdown(0)


def _calls(calls) -> list:
    return [(c.function.name, json.loads(c.function.arguments)) for c in calls or ()]


async def _streamed_chat(oai, **kwargs):
    """``(reasoning, content, calls, finish)`` assembled from a chat stream, as the clients' helpers do."""
    reasoning = content = ""
    calls: dict[int, dict] = {}
    finish = None
    async for chunk in await oai.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            reasoning += (choice.delta.model_extra or {}).get("reasoning_content") or ""
            content += choice.delta.content or ""
            for d in choice.delta.tool_calls or []:
                c = calls.setdefault(d.index, {"id": None, "name": "", "arguments": ""})
                c["id"] = d.id or c["id"]
                c["name"] += d.function.name or ""
                c["arguments"] += d.function.arguments or ""
    return reasoning, content, [(c["name"], json.loads(c["arguments"])) for _, c in sorted(calls.items())], finish


@pytest.mark.parametrize("model", sorted(SCRIPTS))
def test_chat_completions_read_each_format_whole_and_streamed(store, model):
    text, (reasoning, content, calls) = SCRIPTS[model]

    async def scenario(oai, _):
        kwargs = {"model": model, "messages": ASK, "tools": TOOLS, "max_tokens": 400, "temperature": 0.0,
                  "extra_body": {"guided_grammar": _grammar(text)}}
        r = await oai.chat.completions.create(**kwargs)
        m = r.choices[0].message
        assert (m.model_extra.get("reasoning_content"), m.content, _calls(m.tool_calls)) == (reasoning, content, calls)
        assert r.choices[0].finish_reason == "tool_calls"
        if model == "mistral-small":
            assert m.tool_calls[0].id == "a1b2c3d4e"  # the model's own id
        streamed = await _streamed_chat(oai, **kwargs)
        assert streamed == (reasoning or "", content or "", calls, "tool_calls")

        # the call and its result back in the next prompt (Mistral's template checks the ids)
        history = [*ASK, {"role": "assistant", "content": m.content, "reasoning_content": reasoning,
                          "tool_calls": [t.model_dump() for t in m.tool_calls]},
                   {"role": "tool", "tool_call_id": m.tool_calls[0].id, "content": "5"}]
        after = await oai.chat.completions.create(model=model, messages=history, tools=TOOLS, max_tokens=1)
        assert after.usage.prompt_tokens > r.usage.prompt_tokens

    _serve(scenario)


def test_harmony_without_tools_splits_the_channels(store):
    async def scenario(oai, _):
        kwargs = {"model": "gpt-oss", "messages": ASK, "max_tokens": 300, "temperature": 0.0,
                  "extra_body": {"guided_grammar": _grammar(GPT_OSS_ANSWER)}}
        m = (await oai.chat.completions.create(**kwargs)).choices[0].message
        assert (m.model_extra.get("reasoning_content"), m.content) == ("Simple arithmetic.", "2 + 3 = 5.")
        assert (await _streamed_chat(oai, **kwargs))[:2] == ("Simple arithmetic.", "2 + 3 = 5.")
        kwargs["extra_body"]["reasoning_format"] = "none"  # the analysis as written, as llama-server keeps it
        m = (await oai.chat.completions.create(**kwargs)).choices[0].message
        assert m.content == "<|channel|>analysis<|message|>Simple arithmetic.<|end|>2 + 3 = 5."
        assert not m.model_extra.get("reasoning_content")
        r = await oai.responses.create(model="gpt-oss", input="What is 2 + 3?", max_output_tokens=300,
                                       extra_body={"guided_grammar": _grammar(GPT_OSS_ANSWER)})
        assert [i.type for i in r.output] == ["reasoning", "message"] and r.output_text == "2 + 3 = 5."
        assert r.output[0].content[0].text == "Simple arithmetic."

    _serve(scenario)


@contextmanager
def _anthropic_writes(text: str):
    """Anthropic's route asks the engine for ``text`` (its requests have no grammar field of their own)."""
    original = MessagesRequest.sampling_params

    def sampling_params(self):
        params = original(self)
        params.structured = StructuredOutput("grammar", _grammar(text))
        return params

    with mock.patch.object(MessagesRequest, "sampling_params", sampling_params):
        yield


def _anthropic_tools() -> list[dict]:
    return [{"name": t["function"]["name"], "description": t["function"]["description"],
             "input_schema": t["function"]["parameters"]} for t in TOOLS]


def _blocks(message) -> list:
    """A message's blocks as ``(type, text or (name, input))``, ids left out."""
    out = []
    for b in message.content:
        out.append((b.type, b.thinking if b.type == "thinking" else b.text if b.type == "text" else (b.name, b.input)))
    return out


@pytest.mark.parametrize("model", sorted(SCRIPTS))
def test_anthropic_messages_read_each_format_whole_and_streamed(store, model):
    text, (reasoning, content, calls) = SCRIPTS[model]
    expected = ([("thinking", reasoning)] if reasoning else []) + ([("text", content)] if content else []) + [
        ("tool_use", call) for call in calls]

    async def scenario(_, claude):
        kwargs = {"model": model, "max_tokens": 400, "messages": ASK, "tools": _anthropic_tools()}
        with _anthropic_writes(text):
            whole = await claude.messages.create(**kwargs)
            async with claude.messages.stream(**kwargs) as stream:
                events = [e async for e in stream]
                streamed = await stream.get_final_message()
        assert _blocks(whole) == _blocks(streamed) == expected
        assert whole.stop_reason == streamed.stop_reason == "tool_use"
        assert all(b.signature == "" for b in whole.content if b.type == "thinking")
        deltas = [e.delta for e in events if e.type == "content_block_delta"]
        assert "".join(d.thinking for d in deltas if d.type == "thinking_delta") == (reasoning or "")
        assert "".join(d.text for d in deltas if d.type == "text_delta") == (content or "")

        # the call and its result back in the next prompt: Anthropic's ids reach Mistral's template as 9 characters
        call = next(b for b in whole.content if b.type == "tool_use")
        turn = [*ASK, {"role": "assistant", "content": [b.model_dump() for b in whole.content]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "5"}]}]
        counted = await claude.messages.count_tokens(model=model, messages=turn, tools=_anthropic_tools())
        assert counted.input_tokens > whole.usage.input_tokens

    _serve(scenario)


@pytest.mark.parametrize("model", sorted(SCRIPTS))
def test_forced_calls_in_each_format_parse_and_validate(store, model):
    """A random model made to call by each format's grammar: its calls parse, in the format the
    template asks for, and their arguments validate against the function's parameters."""
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}

    async def scenario(oai, claude):
        for seed in (1, 2):
            r = await oai.chat.completions.create(model=model, messages=ASK, tools=TOOLS, tool_choice="required",
                                                  parallel_tool_calls=False, max_tokens=400, temperature=1.0,
                                                  seed=seed)
            assert r.choices[0].finish_reason == "tool_calls", r.choices[0]
            (call,) = r.choices[0].message.tool_calls
            jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
        m = await claude.messages.create(model=model, max_tokens=400, messages=ASK, tools=_anthropic_tools(),
                                         tool_choice={"type": "tool", "name": "get_weather"})
        (use,) = [b for b in m.content if b.type == "tool_use"]
        assert use.name == "get_weather" and m.stop_reason == "tool_use"
        jsonschema.validate(use.input, schemas["get_weather"])

    _serve(scenario)
