"""A conversation over the context on the OpenAI API: refused by default (400
``context_length_exceeded``), fitted on request (``context_overflow``) and said in a header."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

from localllm.api.openai.serving import DROPPED_HEADER


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from tiny_models import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("ctx") / "tiny.gguf", context_length=256)


def _conversation(turns: int) -> list[dict]:
    msgs = [{"role": "system", "content": "You answer briefly."}]
    for i in range(turns):
        msgs.append({"role": "user", "content": f"Question {i}: " + "tell me more " * 6})
        msgs.append({"role": "assistant", "content": f"Answer {i}: " + "here is more " * 6})
    msgs.append({"role": "user", "content": "And the last question?"})
    return msgs


def _serve(model, scenario):
    from localllm.api.launch import build_pool
    from localllm.api.server import build_app
    from localllm.config.settings import load_settings

    pool, _ = build_pool(load_settings({"model": str(model), "served_model_name": "tiny", "kv_cache_memory": "16MiB", "threads": 1}))
    app = build_app(pool, None)

    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), timeout=120) as http:
            oai = openai.AsyncOpenAI(base_url="http://localhost/v1", api_key="none", http_client=http, max_retries=0)
            await scenario(oai, http)

    try:
        asyncio.run(main())
    finally:
        pool.shutdown(0)


def test_a_conversation_over_the_context_is_refused_unless_the_request_asks_to_fit_it(model):
    messages = _conversation(12)  # about 600 tokens against a context of 256

    async def scenario(oai, http):
        with pytest.raises(openai.BadRequestError) as err:
            await oai.chat.completions.create(model="tiny", messages=messages, max_tokens=8)
        assert err.value.body["code"] == "context_length_exceeded"
        for policy in ("truncate-middle", "rolling-window"):
            raw = await oai.chat.completions.with_raw_response.create(
                model="tiny", messages=messages, max_tokens=8, temperature=0.0,
                extra_body={"context_overflow": policy})
            reply = raw.parse()
            dropped = int(raw.headers[DROPPED_HEADER])
            assert 0 < dropped < len(messages) - 2 and dropped % 2 == 0  # whole turns go
            assert reply.usage.prompt_tokens + 8 <= 256 and reply.choices[0].finish_reason in ("stop", "length")
        r = await http.post("http://localhost/v1/chat/completions",
                            json={"model": "tiny", "messages": messages, "context_overflow": "drop-it"})
        assert r.status_code == 400 and r.json()["error"]["param"] in ("context_overflow", "body.context_overflow")

    _serve(model, scenario)


def test_a_conversation_that_fits_says_nothing(model):
    async def scenario(oai, _):
        raw = await oai.chat.completions.with_raw_response.create(
            model="tiny", messages=_conversation(1), max_tokens=4, extra_body={"context_overflow": "truncate-middle"})
        assert DROPPED_HEADER not in raw.headers and raw.parse().choices

    _serve(model, scenario)
