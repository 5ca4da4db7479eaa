"""What a request or a model's chat template may ask of the server, and the 400 that answers more:
a template that builds a huge value, template variables that clash with the renderer's, more
messages, tools or content parts than any client sends, an endless keep_alive; and the model list
names no file on the server's disk. One tiny model, served in-process."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from localllm.api.anthropic.protocol import MessagesRequest
from localllm.api.body import MAX_CONTENT_PARTS, MAX_MESSAGES, MAX_TOOLS
from localllm.api.openai.protocol import ChatCompletionRequest
from localllm.errors import InvalidRequestError
from localllm.serving.pool import MAX_KEEP_ALIVE_SECONDS, parse_keep_alive
from localllm.tokenizer import templates

LIMIT = 1 << 20  # the template limit while these tests run: 4 MiB is over it, and cheap to build

# The last message's text picks what the template does: pad a value past the limit, or render.
TEMPLATE = (
    "{% set last = messages[-1]['content'] %}"
    "{% if last == 'pad' %}{% set x = 'a'.ljust(4194304) %}{{ x|length }}"
    "{% elif last == 'format' %}{% set x = '%4194304d'|format(1) %}{{ x|length }}"
    "{% else %}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}{% endif %}"
)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from tiny_models import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("bounds") / "tiny.gguf",
                            overrides={"tokenizer.chat_template": TEMPLATE})


@pytest.fixture(scope="module")
def http(model):
    from fastapi.testclient import TestClient

    from localllm.api.launch import build_pool
    from localllm.api.server import build_app
    from localllm.config.settings import load_settings

    with pytest.MonkeyPatch.context() as mp:
        # (set before the model loads: its template's constant parts are computed as it compiles)
        mp.setattr(templates, "TEMPLATE_OUTPUT_LIMIT_CHARS", LIMIT)
        pool, _ = build_pool(load_settings({"model": str(model), "served_model_name": "tiny",
                                            "kv_cache_memory": "16MiB", "threads": 1}))
        try:
            with TestClient(build_app(pool, None), raise_server_exceptions=False) as client:
                yield client
        finally:
            pool.shutdown(0)


def chat(http, content="hi", **body):
    return http.post("/v1/chat/completions", json={
        "model": "tiny", "messages": [{"role": "user", "content": content}], "max_tokens": 1, **body})


def openai_error(r, status: int, param: str | None) -> str:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error
    return error["message"]


# ---------------------------------------------------------------- the chat template


@pytest.mark.parametrize("what", ["pad", "format"])
def test_a_template_that_builds_a_value_over_the_limit_is_a_400_and_the_server_goes_on(http, what):
    message = openai_error(chat(http, what), 400, "messages")
    assert "chat template" in message and f"more than {LIMIT} characters" in message
    r = http.post("/v1/messages", json={"model": "tiny", "max_tokens": 1,
                                        "messages": [{"role": "user", "content": what}]})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", r.text
    assert chat(http).status_code == 200


@pytest.mark.parametrize("key", ["messages", "add_generation_prompt", "bos_token", "tools", "raise_exception"])
def test_template_kwargs_that_clash_with_the_renderers_own_are_a_400_naming_the_key(http, key):
    message = openai_error(chat(http, chat_template_kwargs={key: "x"}), 400, "chat_template_kwargs")
    assert repr(key) in message
    assert chat(http, chat_template_kwargs={"enable_thinking": False}).status_code == 200


# ---------------------------------------------------------------- counts


def test_more_messages_tools_or_parts_than_the_limits_are_a_400_naming_the_limit(http):
    one = {"role": "user", "content": "a"}
    tool = {"type": "function", "function": {"name": "f"}}
    part = {"type": "text", "text": "a"}
    cases = [
        ({"messages": [one] * (MAX_MESSAGES + 1)}, "messages", MAX_MESSAGES),
        ({"messages": [one], "tools": [tool] * (MAX_TOOLS + 1)}, "tools", MAX_TOOLS),
        ({"messages": [{"role": "user", "content": [part] * (MAX_CONTENT_PARTS + 1)}]}, "messages", MAX_CONTENT_PARTS),
    ]
    for body, param, limit in cases:
        r = http.post("/v1/chat/completions", json={"model": "tiny", "max_tokens": 1, **body})
        assert f"at most {limit}" in openai_error(r, 400, param)
    r = http.post("/v1/messages", json={"model": "tiny", "max_tokens": 1, "messages": [one] * (MAX_MESSAGES + 1)})
    assert r.status_code == 400 and f"at most {MAX_MESSAGES}" in r.json()["error"]["message"], r.text
    r = http.post("/v1/responses", json={"model": "tiny", "input": [one] * (MAX_MESSAGES + 1)})
    assert f"at most {MAX_MESSAGES}" in openai_error(r, 400, "input")


def test_counts_are_checked_before_any_item_is_validated():
    # Every message is invalid: refused for their number, none of them was looked at.
    bad = [{"role": "nobody"}] * 200_000
    with pytest.raises(InvalidRequestError, match=f"at most {MAX_MESSAGES}"):
        ChatCompletionRequest.model_validate({"model": "m", "messages": bad})
    with pytest.raises(InvalidRequestError, match=f"at most {MAX_MESSAGES}"):
        MessagesRequest.model_validate({"model": "m", "max_tokens": 1, "messages": bad})
    with pytest.raises(ValidationError):  # (under the limits, the items are validated as ever)
        ChatCompletionRequest.model_validate({"model": "m", "messages": bad[:10]})


# ---------------------------------------------------------------- keep_alive and the model list


def test_an_endless_keep_alive_is_a_400_and_a_huge_one_is_cut_to_the_maximum(http):
    for endless in ("1e309", "-1e309", float("inf")):
        with pytest.raises(InvalidRequestError, match="finite"):
            parse_keep_alive(endless)
    assert parse_keep_alive(1e300) == parse_keep_alive("99999999999h") == MAX_KEEP_ALIVE_SECONDS
    assert parse_keep_alive(-1) is None  # (still: loaded until unloaded)
    openai_error(chat(http, keep_alive="1e309"), 400, "keep_alive")
    assert chat(http, keep_alive=1e300).status_code == 200


def test_the_model_list_names_no_file_on_the_servers_disk(http, model):
    r = http.get("/v1/models")
    assert r.status_code == 200
    assert str(model.parent) not in r.text and "/" not in r.json()["data"][0]["root"]
    assert r.json()["data"][0]["root"] == "tiny"
