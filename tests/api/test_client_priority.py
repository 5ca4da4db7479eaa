"""A request's ``priority`` from an API client is bounded by ``max_client_priority`` (lower runs
first): a client may lower its priority but not raise it past the bound (default 0), so no client
can jump every queue; the bound is a setting (``--max-client-priority``, ``LOCALLLM_MAX_CLIENT_PRIORITY``),
and in-process callers (the chat TUI) are not bound by it."""

from __future__ import annotations

import asyncio
import inspect
import re

import httpx
import pytest

from localllm.api.guard import CHAT_PAGE_HEADER
from localllm.cli.flags import flags_argv
from localllm.cli.serve import serve
from localllm.config.settings import BY_NAME, load_settings


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from tiny_models import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("prio") / "tiny.gguf")


def _priorities_reaching_the_engine(model, settings_flags: dict, bodies: list[tuple[str, dict]]) -> list[int]:
    """Each body POSTed to its route on the app ``serve`` builds from ``settings_flags``; the priority
    each engine request was queued at."""
    from localllm.api.launch import build_pool, server_app

    settings = load_settings({"model": str(model), "served_model_name": "tiny", "kv_cache_memory": "16MiB",
                              "threads": 1, **settings_flags})
    pool, name = build_pool(settings)
    engine = pool.get(name).engine
    seen: list[int] = []
    generate = engine.generate

    def recording_generate(prompt, params=None, request_id=None, priority=0):
        seen.append(priority)
        return generate(prompt, params, request_id, priority)

    engine.generate = recording_generate
    app = server_app(settings, pool)

    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://localhost",
                                     timeout=120) as http:
            for path, body, *headers in bodies:
                if headers and headers[0] is PAGE_TOKEN:  # the token the served chat page carries
                    page = (await http.get("/")).text
                    headers = [{CHAT_PAGE_HEADER: re.search(r'chat-page-token" content="([^"]+)"', page)[1]}]
                r = await http.post(path, json={"model": "tiny", "max_tokens": 1, **body},
                                    headers=headers[0] if headers else None)
                assert r.status_code == 200, r.text

    try:
        asyncio.run(main())
    finally:
        pool.shutdown(0)
    return seen


PAGE_TOKEN = object()
CHAT = "/v1/chat/completions"
HI = [{"role": "user", "content": "hi"}]


def test_a_client_cannot_raise_its_priority_above_the_default(model):
    bodies = [(CHAT, {"messages": HI, "priority": -9223372036854775808}), (CHAT, {"messages": HI, "priority": -1}),
              (CHAT, {"messages": HI, "priority": 7}), (CHAT, {"messages": HI}),
              ("/v1/completions", {"prompt": "hi", "priority": -50}),
              ("/v1/completions", {"prompt": "hi", "priority": 3})]
    assert _priorities_reaching_the_engine(model, {}, bodies) == [0, 0, 7, 0, 0, 3]


def test_the_bound_is_a_setting_from_the_environment(model, monkeypatch):
    monkeypatch.setenv("LOCALLLM_MAX_CLIENT_PRIORITY", "-3")
    assert load_settings({}).max_client_priority == -3
    bodies = [(CHAT, {"messages": HI, "priority": -100}), (CHAT, {"messages": HI, "priority": -2})]
    assert _priorities_reaching_the_engine(model, {}, bodies) == [-3, -2]


def test_the_bound_is_a_serve_flag():
    setting = BY_NAME["max_client_priority"]
    assert setting.default == 0 and setting.env == "LOCALLLM_MAX_CLIENT_PRIORITY"
    assert "max_client_priority" in inspect.signature(serve).parameters
    assert flags_argv({"max_client_priority": -2}) == ["--max-client-priority", "-2"]
    assert load_settings({"max_client_priority": 5}).max_client_priority == 5


def test_the_servers_own_chat_page_may_ask_for_the_interactive_priority(model):
    """The page's token lifts the bound to the TUI's priority (-1), no further; a wrong token, another
    route's body or a server without the page (``--no-web-ui``) gets the default bound."""
    bodies = [(CHAT, {"messages": HI, "priority": -1}, PAGE_TOKEN), (CHAT, {"messages": HI, "priority": -50}, PAGE_TOKEN),
              (CHAT, {"messages": HI, "priority": -1}, {CHAT_PAGE_HEADER: "guessed"}),
              (CHAT, {"messages": HI, "priority": -1})]
    assert _priorities_reaching_the_engine(model, {}, bodies) == [-1, -1, 0, 0]
    no_page = [(CHAT, {"messages": HI, "priority": -1}, {CHAT_PAGE_HEADER: ""})]
    assert _priorities_reaching_the_engine(model, {"web_ui": False}, no_page) == [0]
