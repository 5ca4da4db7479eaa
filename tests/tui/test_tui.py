"""`localllm chat` (localllm/tui) driven through Textual's Pilot on the real SmolLM2 engine.

One AsyncEngine for the module; every test has its own LOCALLLM_HOME. Replies are greedy and
short (the CPU model writes ~5-8 tokens/s).
"""

from __future__ import annotations

import asyncio
import io
import itertools
import json
import os
import time

import pytest

pytestmark = pytest.mark.timeout(120)

MODEL_NAME = "smollm2:135m"


# ---------------------------------------------------------------- fixtures and helpers


@pytest.fixture(scope="module")
def engine(smollm2_path):
    from localllm.config.engine import EngineConfig
    from localllm.engine.async_engine import AsyncEngine

    eng = AsyncEngine.from_config(EngineConfig(model=str(smollm2_path), kv_cache_memory=512 << 20))
    yield eng
    eng.shutdown(timeout=2.0)


@pytest.fixture()
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("LOCALLLM_HOME", str(tmp_path))
    return tmp_path


def save_settings(**changes):
    from localllm.tui.storage import ChatSettings, SettingsStore

    settings = ChatSettings(temperature=0.0, **changes)
    SettingsStore().save(settings)
    return settings


def make_app(engine, **kwargs):
    from localllm.tui.app import ChatApp
    from localllm.tui.backend import EngineBackend

    return ChatApp(EngineBackend(engine, MODEL_NAME), stats_interval=0.25, **kwargs)


async def greedy(engine, messages: list[dict], max_tokens: int) -> tuple[str, int]:
    """What the engine answers to ``messages`` alone, greedily: (text, number of tokens)."""
    from localllm.sampling_params import SamplingParams

    ids = engine.tokenizer.apply_chat_template(messages)
    text, n = "", 0
    async for out in engine.generate(ids, SamplingParams(max_tokens=max_tokens, temperature=0.0)):
        text += out.new_text
        n = out.num_output_tokens
    return text, n


def screen_text(app) -> str:
    """The screen as plain text (what a user sees, without colours)."""
    from rich.console import Console

    width, height = app.size
    console = Console(
        width=width,
        height=height,
        file=io.StringIO(),
        color_system=None,
        record=True,
        legacy_windows=False,
        safe_box=False,
    )
    console.print(app.screen._compositor.render_update(full=True, screen_stack=app._background_screens))
    return console.export_text()


async def until(predicate, timeout: float = 60.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


async def type_and_send(pilot, text: str) -> None:
    await pilot.press(*[{" ": "space", "?": "question_mark", "+": "plus"}.get(c, c) for c in text])
    await pilot.press("enter")


def engine_idle(engine) -> bool:
    s = engine.stats()
    return s.num_running == 0 and s.num_waiting == 0


# ---------------------------------------------------------------- chat


def test_message_streams_reply_equal_to_greedy_output(engine, home, monkeypatch):
    from textual.widgets import Markdown

    from localllm.tui.widgets import ChatInput, Turn

    save_settings(max_tokens=12)
    rendered: list[str] = []  # the reply's Markdown source at each incremental render
    append = Markdown.append

    def spy(self, fragment):
        result = append(self, fragment)
        rendered.append(self.source)
        return result

    monkeypatch.setattr(Markdown, "append", spy)

    async def scenario():
        app = make_app(engine)
        async with app.run_test(size=(80, 24)) as pilot:
            await type_and_send(pilot, "What is 2+2?")
            assert app.query_one(ChatInput).text == ""
            await app.wait_for_reply()
            await pilot.pause(0.1)
            conv = app.conversation
            assert [m.role for m in conv.messages] == ["user", "assistant"]
            assert conv.messages[0].content == "What is 2+2?"
            reply = conv.messages[1]
            turns = app.query(Turn)
            assert [t.role for t in turns] == ["user", "assistant"]
            assert turns.last().query_one(Markdown).source == reply.content
            first_words = " ".join(reply.content.split()[:3])
            assert first_words in " ".join(screen_text(app).split())
            assert reply.meta["num_output_tokens"] <= 12 and reply.meta["ttft"] > 0
            assert (
                app.status.context_used == reply.meta["num_prompt_tokens"] + reply.meta["num_output_tokens"]
            )
            return conv.chat_messages()[:-1], reply

    messages, reply = asyncio.run(scenario())
    expected, n = asyncio.run(greedy(engine, messages, 12))
    assert reply.content == expected and reply.meta["num_output_tokens"] == n
    # Streamed: the reply was rendered piece by piece, each render extending the one before.
    assert len(rendered) >= 2 and rendered[-1] == expected
    assert all(b.startswith(a) and len(b) > len(a) for a, b in itertools.pairwise(rendered))
    # Saved as it finished.
    saved = list((home / "conversations").glob("*.json"))
    assert len(saved) == 1 and json.loads(saved[0].read_text())["messages"][1]["content"] == expected


def test_escape_stops_a_long_reply_and_frees_its_kv_cache(engine, home):
    from localllm.tui.screens import HelpScreen

    save_settings(max_tokens=4000)
    before = engine.stats()
    assert before.num_running == 0 and before.kv_cache_usage == 0.0

    async def scenario():
        app = make_app(engine)
        async with app.run_test(size=(80, 24)) as pilot:
            await type_and_send(pilot, "Write a very long story about a dragon.")
            await until(lambda: engine.stats().num_running == 1, what="the request to run")
            await until(
                lambda: engine.stats().generation_tokens >= before.generation_tokens + 3, what="tokens"
            )
            assert engine.stats().kv_cache_usage > 0.0
            # A dialog over the streaming reply: the reply and the status keep updating under it,
            # and its esc closes the dialog, not the reply.
            await pilot.press("f1")
            assert isinstance(app.screen, HelpScreen)
            tokens = engine.stats().generation_tokens
            await until(
                lambda: engine.stats().generation_tokens >= tokens + 2, what="tokens under the dialog"
            )
            await pilot.press("escape")
            assert not isinstance(app.screen, HelpScreen) and app.generating
            pressed = engine.stats().generation_tokens - before.generation_tokens  # the reply's tokens so far
            await pilot.press("escape")
            await app.wait_for_reply()
            await pilot.pause()
            assert not app.generating
            after = engine.stats()
            assert after.num_running == 0 and after.num_waiting == 0
            assert after.kv_cache_usage == before.kv_cache_usage
            assert after.request_success.get("abort", 0) == before.request_success.get("abort", 0) + 1
            reply = app.conversation.messages[-1]
            assert reply.role == "assistant" and reply.meta["finish_reason"] == "abort"
            # stopped within a few steps of the key (the steps in flight when it came), far from
            # max_tokens=4000 (a fixed count would measure the machine's speed: a faster decode had
            # 1004 tokens out before the key)
            assert 0 < pressed <= reply.meta["num_output_tokens"] <= pressed + 200 < 4000
            # the reply's header says so (it sits above the reply, out of view when the reply is long)
            from localllm.tui.widgets import Turn

            last_turn = list(app.main_screen.query(Turn))[-1]
            assert last_turn.role == "assistant" and "stopped" in last_turn._header().plain

    asyncio.run(scenario())


def test_settings_screen_changes_the_next_request(engine, home):
    from textual.widgets import Input, TextArea

    from localllm.tui.screens import SettingsScreen
    from localllm.tui.storage import SettingsStore

    save_settings(max_tokens=64)
    system = "You are Zed, a pirate who answers in one word."

    async def scenario():
        app = make_app(engine)
        async with app.run_test(size=(80, 24)) as pilot:
            await pilot.press("ctrl+s")
            await pilot.pause()
            screen = app.screen
            assert isinstance(screen, SettingsScreen)
            assert "Max tokens" in screen_text(app) and "Priority" in screen_text(app)
            screen.query_one("#system-prompt", TextArea).text = system
            screen.query_one("#max-tokens", Input).value = "abc"
            await pilot.press("ctrl+s")
            await pilot.pause()
            assert app.screen is screen and "numbers only" in screen_text(app)  # refused, still open
            screen.query_one("#max-tokens", Input).value = "3"
            screen.query_one("#priority", Input).value = "-5"
            await pilot.press("ctrl+s")
            await pilot.pause()
            assert not isinstance(app.screen, SettingsScreen)
            assert app.settings.max_tokens == 3 and app.settings.priority == -5
            stored = SettingsStore().load()
            assert (stored.system_prompt, stored.max_tokens, stored.priority) == (system, 3, -5)

            await type_and_send(pilot, "Hello")
            await app.wait_for_reply()
            reply = app.conversation.messages[-1]
            assert reply.meta["num_output_tokens"] == 3 and reply.meta["finish_reason"] == "length"
            prompt = engine.tokenizer.decode(app.backend.last_prompt_ids)
            assert system in prompt and prompt.index(system) < prompt.index("Hello")
            return app.conversation.chat_messages()[:-1], reply.content

    messages, text = asyncio.run(scenario())
    assert messages[0] == {"role": "system", "content": system}
    assert text == asyncio.run(greedy(engine, messages, 3))[0]


def test_saved_conversation_reloads_identically(engine, home):
    from localllm.tui.storage import ConversationStore
    from localllm.tui.widgets import Turn

    save_settings(max_tokens=4, system_prompt="Be brief.")

    async def first():
        app = make_app(engine)
        async with app.run_test(size=(80, 24)) as pilot:
            await type_and_send(pilot, "Name a color.")
            await app.wait_for_reply()
            await type_and_send(pilot, "Another one?")
            await app.wait_for_reply()
            await pilot.pause()
            return app.conversation.to_dict(), [(t.role, t.content) for t in app.query(Turn)]

    saved, turns = asyncio.run(first())
    assert len(saved["messages"]) == 4 and saved["system_prompt"] == "Be brief."

    async def reopen():
        app = make_app(engine, conversation_id=saved["id"])
        async with app.run_test(size=(80, 24)) as pilot:
            await pilot.pause()
            return (
                app.conversation.to_dict(),
                [(t.role, t.content) for t in app.query(Turn)],
                screen_text(app),
            )

    loaded, loaded_turns, text = asyncio.run(reopen())
    assert loaded == saved
    assert loaded_turns == turns
    assert "Another one?" in text
    assert ConversationStore().load(saved["id"]).to_dict() == saved


def test_conversations_screen_lists_renames_deletes_and_opens(engine, home):
    from localllm.tui.screens import ConversationsScreen
    from localllm.tui.storage import Conversation, ConversationStore, Message

    store = ConversationStore()
    old = Conversation(title="", messages=[Message("user", "first chat"), Message("assistant", "hi")])
    store.save(old)
    time.sleep(0.01)
    other = Conversation(messages=[Message("user", "second chat"), Message("assistant", "yo")])
    store.save(other)
    assert [s.id for s in store.list()] == [other.id, old.id]

    async def scenario():
        app = make_app(engine)
        async with app.run_test(size=(80, 24)) as pilot:
            await pilot.press("ctrl+o")
            await pilot.pause()
            assert isinstance(app.screen, ConversationsScreen)
            text = screen_text(app)
            assert "first chat" in text and "second chat" in text
            await pilot.press("r")
            await pilot.pause()
            await pilot.press("ctrl+u")  # clear the pre-filled title
            await pilot.press(*"Renamed")
            await pilot.press("enter")
            await pilot.pause()
            assert store.load(other.id).title == "Renamed"
            await pilot.press("down", "d")
            await pilot.pause()
            assert store.load(old.id)  # asks first
            await pilot.press("d")
            await pilot.pause()
            assert [s.id for s in store.list()] == [other.id]
            await pilot.press("enter")  # open the highlighted (only) conversation
            await pilot.pause()
            assert not isinstance(app.screen, ConversationsScreen)
            assert app.conversation.id == other.id and app.conversation.title == "Renamed"
            assert "second chat" in screen_text(app)

    asyncio.run(scenario())


def test_new_regenerate_copy_and_edit_resend(engine, home):
    from localllm.tui.widgets import ChatInput, Turn

    save_settings(max_tokens=3)

    async def scenario():
        app = make_app(engine)
        async with app.run_test(size=(80, 24)) as pilot:
            await type_and_send(pilot, "Say hi")
            await app.wait_for_reply()
            first = app.conversation.messages[-1].content
            # regenerate: greedy, so the same reply replaces the old one
            await pilot.press("ctrl+r")
            await pilot.pause()
            await app.wait_for_reply()
            assert [m.role for m in app.conversation.messages] == ["user", "assistant"]
            assert app.conversation.messages[-1].content == first
            # copy the last reply
            await pilot.press("ctrl+y")
            assert app.clipboard == first
            # edit and resend: the last user message goes back into the input
            await pilot.press("ctrl+g")
            await pilot.pause()
            box = app.query_one(ChatInput)
            assert box.text == "Say hi" and app.conversation.messages == []
            await pilot.press("end", "space", "t", "w", "i", "c", "e")
            await pilot.press("enter")
            await pilot.pause()
            await app.wait_for_reply()
            assert app.conversation.messages[0].content == "Say hi twice"
            assert len(app.query(Turn)) == 2
            # up on the empty input does the same as ctrl+g
            await pilot.press("up")
            await pilot.pause()
            assert box.text == "Say hi twice" and app.conversation.messages == []
            await pilot.press("enter")
            await pilot.pause()
            await app.wait_for_reply()
            assert [m.role for m in app.conversation.messages] == ["user", "assistant"]
            conv_id = app.conversation.id
            # new chat: the old one is saved, the view is empty
            await pilot.press("ctrl+n")
            await pilot.pause()
            assert app.conversation.messages == [] and app.conversation.id != conv_id
            assert len(app.query(Turn)) == 0
            return conv_id

    conv_id = asyncio.run(scenario())
    from localllm.tui.storage import ConversationStore

    assert ConversationStore().load(conv_id).messages[0].content == "Say hi twice"


def test_input_keys_help_and_theme(engine, home):
    from localllm.tui.screens import HelpScreen
    from localllm.tui.storage import SettingsStore
    from localllm.tui.widgets import ChatInput

    save_settings()

    async def scenario():
        app = make_app(engine)
        async with app.run_test(size=(80, 24)) as pilot:
            box = app.query_one(ChatInput)
            # ? on an empty input opens the help; esc closes it
            await pilot.press("question_mark")
            await pilot.pause()
            assert isinstance(app.screen, HelpScreen)
            assert "stop the reply" in screen_text(app)
            await pilot.press("escape")
            await pilot.pause()
            assert not isinstance(app.screen, HelpScreen)
            # newline keys do not send; ? inside a message is just a character
            await pilot.press("a", "ctrl+j", "b", "shift+enter", "c", "question_mark")
            assert box.text == "a\nb\nc?" and app.conversation.messages == []
            # theme toggle, persisted
            assert app.theme == "textual-dark"
            await pilot.press("ctrl+t")
            assert app.theme == "textual-light"
            assert SettingsStore().load().theme == "textual-light"
            # 80x24: input, one-line status bar and footer all visible; no side panel
            lines = screen_text(app).splitlines()
            assert len(lines) == 24
            assert "ctx 0/" in lines[-2]
            assert MODEL_NAME in "".join(lines[-10:-2])  # on the input's border
            assert "Help" in lines[-1]
            assert not app.query_one("#side").display or app.query_one("#side").size.width == 0
            await pilot.resize_terminal(120, 40)
            await pilot.pause(0.1)
            text = screen_text(app)
            assert "Model" in text and "Engine" in text and "KV cache" in text
            assert app.query_one("#side").size.width > 0

    asyncio.run(scenario())


# ---------------------------------------------------------------- API in the same process / attach


def _in_process_server(engine, **flags):
    """``chat``'s server around the module's engine (a pool that never shuts it down)."""
    from localllm.api.in_process import InProcessServer
    from localllm.api.router import pool_for_engine
    from localllm.config.settings import load_settings

    settings = load_settings({"host": "127.0.0.1", "port": 0, **flags})
    return InProcessServer(settings, pool_for_engine(engine, MODEL_NAME), MODEL_NAME)


def test_chat_serves_the_api_from_the_same_engine(engine, home):
    from openai import AsyncOpenAI

    save_settings(max_tokens=12)
    steps: list[set[str]] = []

    def observer(outputs):
        steps.append({o.req_id for o in outputs})

    engine.add_observer(observer)
    before = engine.stats()
    api_messages = [{"role": "user", "content": "Tell me a fact about cats."}]
    tui_prompt = "Tell me a fact about dogs."

    async def scenario():
        server = _in_process_server(engine)
        app = make_app(engine, api_server=server)
        async with app.run_test(size=(80, 24)) as pilot:
            await until(lambda: app.status.api_url is not None, what="the API server")
            assert app.status.api_url == f"http://127.0.0.1:{server.port}" and server.port != 0
            client = AsyncOpenAI(base_url=f"{app.status.api_url}/v1", api_key="unused", max_retries=0)
            await pilot.press(*[{" ": "space"}.get(c, c) for c in tui_prompt])
            api_call = asyncio.create_task(
                client.chat.completions.create(
                    model=MODEL_NAME, messages=api_messages, max_tokens=48, temperature=0.0
                )
            )
            await until(lambda: engine.stats().num_running >= 1, what="the API request")
            await pilot.press("enter")
            api_reply = await api_call
            await app.wait_for_reply()
            await client.close()
            await pilot.pause()
            tui_reply = app.conversation.messages[-1]
            assert f":{server.port}" in screen_text(app)
            return api_reply, tui_reply, app.conversation.chat_messages()[:-1], server

    try:
        api_reply, tui_reply, tui_messages, server = asyncio.run(scenario())
    finally:
        engine._observers.remove(observer)
    assert not server.running  # stopped with the app
    server.close()
    after = engine.stats()
    done = sum(after.request_success.values()) - sum(before.request_success.values())
    assert done == 2
    usage = api_reply.usage
    assert (
        after.prompt_tokens - before.prompt_tokens
        == usage.prompt_tokens + tui_reply.meta["num_prompt_tokens"]
    )
    assert after.generation_tokens - before.generation_tokens == (
        usage.completion_tokens + tui_reply.meta["num_output_tokens"]
    )
    # Both were decoded in the same batches. (Their texts are not compared with solo greedy runs:
    # a different batch shape changes float32 rounding, which can flip a near-tie later on.)
    assert any(len(s) == 2 for s in steps)
    assert api_reply.choices[0].message.content and tui_reply.content
    assert tui_messages == [{"role": "user", "content": tui_prompt}]
    assert usage.completion_tokens == 48 or api_reply.choices[0].finish_reason == "stop"


def test_attach_to_a_running_server(engine, home):
    from localllm.tui.app import ChatApp
    from localllm.tui.backend import HTTPBackend

    save_settings(max_tokens=6)
    server = _in_process_server(engine)
    server.start()
    try:

        async def scenario():
            app = ChatApp(HTTPBackend(server.url), stats_interval=0.25)
            async with app.run_test(size=(80, 24)) as pilot:
                await pilot.pause()
                info = app.backend.info
                assert (info.name, info.max_model_len, info.where) == (
                    MODEL_NAME,
                    engine.max_model_len,
                    server.url,
                )
                await type_and_send(pilot, "Hello there")
                await app.wait_for_reply()
                await until(lambda: app.status.load is not None, what="/metrics")
                reply = app.conversation.messages[-1]
                assert reply.meta["finish_reason"] == "length" and reply.meta["num_output_tokens"] == 6
                assert reply.meta["num_prompt_tokens"] > 0
                # Esc closes the HTTP stream; the server aborts the request.
                app.settings.max_tokens = 4000
                await type_and_send(pilot, "Now write a long poem.")
                await until(lambda: engine.stats().num_running == 1, what="the long request")
                await pilot.press("escape")
                await app.wait_for_reply()
                await until(lambda: engine_idle(engine), timeout=10, what="the server to abort")
                assert engine.stats().kv_cache_usage == 0.0
                return app.conversation.chat_messages()[:2], reply.content

        messages, text = asyncio.run(scenario())
    finally:
        server.close()
    assert text == asyncio.run(greedy(engine, messages[:1], 6))[0]


# ---------------------------------------------------------------- storage, no model


def test_atomic_writes_never_leave_a_broken_conversation(home, monkeypatch):
    from localllm.tui import storage
    from localllm.tui.storage import Conversation, ConversationStore, Message

    store = ConversationStore()
    conv = Conversation(messages=[Message("user", "keep me")])
    store.save(conv)
    path = home / "conversations" / f"{conv.id}.json"
    good = path.read_text()

    def crash(*args, **kwargs):
        raise OSError("disk full")

    conv.messages.append(Message("assistant", "x" * 1000))
    monkeypatch.setattr(storage.json, "dump", crash)
    with pytest.raises(OSError):
        store.save(conv)
    monkeypatch.undo()
    assert path.read_text() == good
    assert os.listdir(path.parent) == [path.name]  # no temp files left behind
    assert store.load(conv.id).messages[0].content == "keep me"
    # A hand-broken file is skipped by the list, not fatal.
    (path.parent / "broken.json").write_text("{not json")
    assert [s.id for s in store.list()] == [conv.id]
    store.delete(conv.id)
    assert store.list() == []


def test_settings_file_tolerates_bad_values(home):
    from localllm.tui.storage import ChatSettings, SettingsStore

    store = SettingsStore()
    assert store.load() == ChatSettings()
    assert ChatSettings().priority == -1
    store.path.write_text(json.dumps({"temperature": 0.2, "max_tokens": "12", "unknown": 1}))
    s = store.load()
    assert (s.temperature, s.max_tokens) == (0.2, 12)
    store.path.write_text(json.dumps({"temperature": 9}))
    assert store.load() == ChatSettings()
    store.path.write_text("garbage")
    assert store.load() == ChatSettings()


def test_metrics_parsing():
    from localllm.tui.backend import normalize_base_url, parse_metrics

    text = """# HELP localllm:num_requests_running Requests in the running batch.
localllm:num_requests_running{model_name="m"} 2.0
localllm:num_requests_waiting{model_name="m"} 1.0
localllm:kv_cache_usage_perc{model_name="m"} 0.25
localllm:prefix_cache_queries_total{model_name="m"} 200.0
localllm:prefix_cache_hits_total{model_name="m"} 50.0
"""
    s = parse_metrics(text)
    assert (s.num_running, s.num_waiting, s.kv_cache_usage, s.prefix_cache_hit_rate) == (2, 1, 0.25, 0.25)
    assert parse_metrics("something_else 1") is None
    assert normalize_base_url("localhost:8000") == "http://localhost:8000/v1"
    assert normalize_base_url("http://h:1/v1/") == "http://h:1/v1"


def test_chat_command_is_registered():
    import typer
    from typer.testing import CliRunner

    from localllm.api.in_process import served_name
    from localllm.cli.chat import register

    app = typer.Typer()
    register(app)

    @app.command()
    def other() -> None:  # a second command keeps `chat` a subcommand
        pass

    result = CliRunner().invoke(app, ["chat", "--help"], env={"COLUMNS": "200", "NO_COLOR": "1"})
    assert result.exit_code == 0, result.output
    for flag in ("--attach", "--no-serve", "--port", "--open"):
        assert flag in result.output
    assert served_name("smollm2:135m") == "smollm2:135m"


# ---------------------------------------------------------------- switching models (ctrl+l)


class FakeOpenAI:
    """/v1/models with two models and a streamed /v1/chat/completions that answers with the model's name."""

    def __init__(self) -> None:
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        self.bodies: list[dict] = []
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                if self.path != "/v1/models":
                    self.send_error(404)
                    return
                data = json.dumps({"object": "list", "data": [
                    {"id": "alpha", "object": "model", "owned_by": "localllm", "max_model_len": 2048,
                     "loaded": True, "quant": "Q4_K_M", "size_bytes": 2_000_000_000, "context_length": 2048},
                    {"id": "beta", "object": "model", "owned_by": "localllm", "max_model_len": 4096,
                     "loaded": False, "quant": "Q8_0", "size_bytes": 500_000_000, "context_length": 4096},
                ]}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                fake.bodies.append(body)
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.end_headers()
                for chunk in ({"content": "model: "}, {"content": body["model"]}):
                    event = {"choices": [{"index": 0, "delta": chunk, "finish_reason": None}]}
                    self.wfile.write(f"data: {json.dumps(event)}\n\n".encode())
                done = {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}
                self.wfile.write(f"data: {json.dumps(done)}\n\ndata: [DONE]\n\n".encode())

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def test_model_picker_switches_the_attached_model(home):
    from textual.widgets import OptionList

    from localllm.tui.app import ChatApp
    from localllm.tui.backend import HTTPBackend
    from localllm.tui.screens import ModelsScreen
    from localllm.tui.widgets import ChatInput

    save_settings(max_tokens=8)
    fake = FakeOpenAI()

    async def scenario():
        app = ChatApp(HTTPBackend(fake.url), stats_interval=0.25)
        async with app.run_test(size=(100, 30)) as pilot:
            await pilot.pause()
            box = app.main_screen.query_one(ChatInput)
            assert box.border_title == "alpha Q4_K_M"  # the quant next to the model's name
            await pilot.press("ctrl+l")
            await until(lambda: isinstance(app.screen, ModelsScreen), what="the model picker")
            await pilot.pause()
            options = app.screen.query_one(OptionList)
            assert options.option_count == 2 and options.highlighted == 0
            shown = screen_text(app)
            assert "alpha  Q4_K_M  current · 2.0 GB · 2,048 ctx" in shown
            assert "beta  Q8_0  500.0 MB · 4,096 ctx" in shown
            await pilot.press("down", "enter")
            await until(lambda: app.backend.info.name == "beta", what="the switch")
            await pilot.pause()
            assert not isinstance(app.screen, ModelsScreen)
            assert box.border_title == "beta Q8_0" and app.backend.info.max_model_len == 4096
            assert app.conversation.model == "beta" and app.sub_title == "beta"
            await type_and_send(pilot, "Hi")
            await app.wait_for_reply()
            assert fake.bodies[-1]["model"] == "beta"
            assert app.conversation.messages[-1].content == "model: beta"
            # esc closes the picker without switching
            await pilot.press("ctrl+l")
            await until(lambda: isinstance(app.screen, ModelsScreen), what="the model picker")
            await pilot.press("escape")
            await pilot.pause()
            assert not isinstance(app.screen, ModelsScreen) and app.backend.info.name == "beta"

    try:
        asyncio.run(scenario())
    finally:
        fake.close()


def test_model_picker_lists_a_real_server_and_the_local_store(engine, home):
    """Attached to the real API the picker lists what /v1/models serves; in-process it lists the local
    store and switches through the loader (here one that hands back the same engine)."""
    from textual.widgets import OptionList

    from localllm.tui.app import ChatApp
    from localllm.tui.backend import EngineBackend, HTTPBackend, ModelChoice
    from localllm.tui.screens import ModelsScreen

    server = _in_process_server(engine)
    server.start()
    loaded: list[str] = []
    released: list = []

    def loader(name):
        loaded.append(name)
        return engine

    async def pick(app, pilot) -> list[str]:
        await pilot.press("ctrl+l")
        await until(lambda: isinstance(app.screen, ModelsScreen), what="the model picker")
        await pilot.pause()
        ol = app.screen.query_one(OptionList)
        return [ol.get_option_at_index(i).id for i in range(ol.option_count)]

    async def scenario():
        app = ChatApp(HTTPBackend(server.url), stats_interval=0.25)
        async with app.run_test(size=(100, 30)) as pilot:
            await pilot.pause()
            assert await pick(app, pilot) == [MODEL_NAME]
            await pilot.press("escape")

        backend = EngineBackend(
            engine, MODEL_NAME, loader=loader, release=released.append,
            local_models=lambda: [ModelChoice(MODEL_NAME, "Q4_1"),
                                  ModelChoice("other:1b", "Q4_0", False, 10**9)],
        )
        app = ChatApp(backend, stats_interval=0.25)
        async with app.run_test(size=(100, 30)) as pilot:
            await pilot.pause()
            assert await pick(app, pilot) == [MODEL_NAME, "other:1b"]
            await pilot.press("down", "enter")
            await until(lambda: backend.info.name == "other:1b", what="the switch")
            assert loaded == ["other:1b"] and released == [engine]
            assert app.conversation.model == "other:1b"

    try:
        asyncio.run(scenario())
    finally:
        server.close()


@pytest.fixture
def two_stored_models(home, tmp_path):
    """tiny-a and tiny-b in the store (LOCALLLM_HOME), as `pull` leaves them."""
    from tiny_models import add_to_store, write_tiny_model

    for name, seed in (("tiny-a", 0), ("tiny-b", 1)):
        add_to_store(name, write_tiny_model(tmp_path / f"{name}.gguf", seed=seed, context_length=256))
    return home


def test_chat_serves_the_pool_and_switches_through_it(two_stored_models):
    """`chat`'s server is `serve`'s composition: its API offers every stored model (loaded on demand), the
    UI holds the model it talks to through a lease on the same pool, and a switch leases the new model
    and lets the old one go, while the API goes on serving both on the same port."""
    import httpx

    from localllm.api.in_process import InProcessServer
    from localllm.cli.chat import _leasing_backend
    from localllm.config.settings import load_settings
    from localllm.tui.app import ChatApp

    save_settings(max_tokens=4)
    settings = load_settings({"model": "tiny-a", "host": "127.0.0.1", "port": 0, "kv_cache_memory": "4MiB",
                              "threads": 1})
    server = InProcessServer.load(settings)
    backend = _leasing_backend(server)
    pool = server.pool

    async def scenario():
        app = ChatApp(backend, api_server=server, stats_interval=0.25)
        async with app.run_test(size=(100, 30)) as pilot:
            await until(lambda: app.status.api_url is not None, what="the API server")
            port = server.port
            assert pool.get("tiny-a").running == 1 and pool.get("tiny-b") is None  # the UI's lease
            async with httpx.AsyncClient(base_url=app.status.api_url) as client:
                r = await client.get("/v1/models")
                assert {m["id"] for m in r.json()["data"]} >= {"tiny-a", "tiny-b"}
                await app.switch_model("tiny-b")
                assert backend.engine is pool.get("tiny-b").engine
                assert pool.get("tiny-b").running == 1 and pool.get("tiny-a").running == 0
                assert server.running and server.port == port
                for name in ("tiny-a", "tiny-b"):  # the API serves both, the pinned one and the UI's
                    r = await client.post("/v1/chat/completions", json={
                        "model": name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
                    assert r.status_code == 200 and r.json()["model"] == name, r.text
            await type_and_send(pilot, "Hi")
            await app.wait_for_reply()
            assert app.conversation.messages[-1].meta["num_output_tokens"] == 4
            assert app.conversation.model == "tiny-b"
            await app.switch_model("tiny-a")
            assert pool.get("tiny-a").running == 1 and pool.get("tiny-b").running == 0

    try:
        asyncio.run(scenario())
        engines = [m.engine for m in pool.loaded()]
        assert not server.running  # stopped with the app
    finally:
        server.close()
    assert len(engines) == 2 and not any(e.is_alive for e in engines)  # close shuts the pool down


def test_chat_takes_serve_s_flags(two_stored_models, monkeypatch):
    """`chat`'s flags are serve's, from the settings table (the replicas' aside); they reach the server."""
    from typer.testing import CliRunner

    from localllm.cli import app
    from localllm.tui.app import ChatApp

    seen = {}

    def run(self):
        seen.update(name=self.backend.info.name, server=self.api_server,
                    running=self.api_server.pool.get("tiny-a").running)

    monkeypatch.setattr(ChatApp, "run", run)
    monkeypatch.setattr("localllm.cli.chat._log_to_file", lambda: "chat.log")
    result = CliRunner().invoke(app, ["chat", "tiny-a", "--port", "0", "--kv-cache-memory", "4MiB", "--threads", "1",
                                      "--keep-alive", "0", "--max-loaded-models", "1", "--no-prefix-caching"])
    assert result.exit_code == 0, result.output
    settings = seen["server"].settings
    assert (settings.keep_alive, settings.max_loaded_models, settings.enable_prefix_caching) == ("0", 1, False)
    assert seen["name"] == "tiny-a" and seen["running"] == 1
    assert not seen["server"].pool.loaded()  # closed on the way out

    help_text = CliRunner().invoke(app, ["chat", "--help"], env={"COLUMNS": "200", "NO_COLOR": "1"}).output
    assert "--keep-alive" in help_text and "--max-loaded-models" in help_text and "--replicas" not in help_text
    bad = CliRunner().invoke(app, ["chat", "tiny-a", "--max-request-bytes", "12"])
    assert bad.exit_code == 2 and "max_request_bytes must be at least 1 KiB" in bad.output


def test_a_conversation_over_the_context_keeps_its_latest_turns_and_says_so(tmp_path):
    """The chat never stops at the context's end: the turns between the first and the latest go
    (truncate-middle), and the first delta says how many messages were left out."""
    from tiny_models import write_tiny_model

    from localllm.config.engine import EngineConfig
    from localllm.engine.async_engine import AsyncEngine
    from localllm.tui.backend import EngineBackend, GenerationParams

    model = write_tiny_model(tmp_path / "tiny.gguf", context_length=256)
    eng = AsyncEngine.from_config(EngineConfig(model=str(model), kv_cache_memory=16 << 20))
    messages = [{"role": "system", "content": "Be brief."}]
    for i in range(12):
        messages += [{"role": "user", "content": f"Question {i}: " + "tell me more " * 2},
                     {"role": "assistant", "content": f"Answer {i}: " + "here is more " * 2}]
    messages.append({"role": "user", "content": "And the last one?"})
    backend = EngineBackend(eng, "tiny")

    async def chat():
        return [d async for d in backend.stream_chat(messages, GenerationParams(temperature=0.0, max_tokens=16))]

    try:
        deltas = asyncio.run(chat())
    finally:
        eng.shutdown(timeout=2.0)
    notices = [d.notice for d in deltas if d.notice]
    assert len(notices) == 1 and "earlier messages left out to fit the context of 256 tokens" in notices[0]
    assert deltas[-1].finished and deltas[-1].num_prompt_tokens + 16 <= 256
    kept = eng.engine.tokenizer.decode(backend.last_prompt_ids)
    assert "Question 0" in kept and "Question 11" in kept and "And the last one?" in kept and "Question 5" not in kept
