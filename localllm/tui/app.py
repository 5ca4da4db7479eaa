"""``localllm chat``: a Textual chat on a :class:`~localllm.tui.backend.ChatBackend`.

The app owns the conversation (turns, persistence) and the screen; the backend owns the model.
Replies stream in a worker; Esc cancels the worker, which closes the backend's stream, which
aborts the request in the engine (its KV blocks are freed at once).
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import TYPE_CHECKING

from textual import on, work
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.screen import ModalScreen, Screen
from textual.widgets import Footer, Markdown, Static
from textual.worker import Worker

from localllm.tui.backend import ChatBackend, GenerationParams, LoadStats
from localllm.tui.screens import ConversationsScreen, HelpScreen, ModelsScreen, SettingsScreen
from localllm.tui.storage import (
    ChatSettings,
    Conversation,
    ConversationStore,
    Message,
    SettingsStore,
)
from localllm.tui.widgets import ChatInput, StatusBar, StatusPanel, StatusState, Turn

if TYPE_CHECKING:
    from localllm.api.in_process import InProcessServer

WIDE = 100  # columns from which the side panel replaces the status bar
THEMES = ("textual-dark", "textual-light")


class ChatApp(App):
    """The chat. ``backend`` gives replies; ``api_server`` (optional: the API over the same models, see
    :mod:`localllm.api.in_process`) is started and stopped with the app."""

    CSS_PATH = Path(__file__).with_name("styles.tcss")
    TITLE = "localllm chat"
    ENABLE_COMMAND_PALETTE = False

    BINDINGS = [
        Binding("escape", "stop", "Stop", show=False),
        Binding("ctrl+n", "new_chat", "New", priority=True),
        Binding("ctrl+r", "regenerate", "Regen", priority=True),
        Binding("ctrl+y", "copy_reply", "Copy", priority=True),
        Binding("ctrl+g", "edit_last", "Edit", priority=True),
        Binding("ctrl+o", "conversations", "Chats", priority=True),
        Binding("ctrl+l", "models", "Model", show=False, priority=True),  # listed by ?: the footer is full
        Binding("ctrl+s", "settings", "Settings", priority=True),
        Binding("ctrl+t", "toggle_theme", "Theme", priority=True),
        Binding("f1", "help", "Help", key_display="?"),
        Binding("question_mark", "help", "Help", show=False),
        Binding("pageup", "scroll_log(-1)", "Up", show=False),
        Binding("pagedown", "scroll_log(1)", "Down", show=False),
    ]

    def __init__(
        self,
        backend: ChatBackend,
        *,
        api_server: InProcessServer | None = None,
        settings_store: SettingsStore | None = None,
        conversation_store: ConversationStore | None = None,
        conversation_id: str | None = None,
        stats_interval: float = 1.0,
    ) -> None:
        super().__init__()
        self.backend = backend
        self.api_server = api_server
        self.settings_store = settings_store or SettingsStore()
        self.store = conversation_store or ConversationStore()
        self.settings: ChatSettings = self.settings_store.load()
        self.conversation = Conversation(system_prompt=self.settings.system_prompt)
        self._open_id = conversation_id
        self.stats_interval = stats_interval
        self.status = StatusState(model=backend.info)
        self._gen_worker: Worker | None = None
        self._replying = False

    # ---------------------------------------------------------------- layout

    def compose(self) -> ComposeResult:
        with Horizontal(id="body"):
            with Vertical(id="main"):
                yield VerticalScroll(id="log")
                yield ChatInput(id="input", placeholder="Message — enter sends, shift+enter new line, ? help")
            yield StatusPanel(id="side")
        yield StatusBar(id="statusbar")
        yield Footer()

    async def on_mount(self) -> None:
        self.theme = self.settings.theme if self.settings.theme in self.available_themes else THEMES[0]
        self._layout_for(self.size.width)
        try:
            await self.backend.start()
        except Exception as exc:
            self.exit(return_code=1, message=f"Error: {getattr(exc, 'message', exc)}")
            return
        self.conversation.model = self.backend.info.name
        if self.api_server is not None:
            try:
                await asyncio.to_thread(self.api_server.start)
                self.status.api_url = self.api_server.url
            except Exception as exc:
                self.status.notes = [f"API not served: {exc}"]
                self.notify(f"could not serve the API: {exc}", severity="error", timeout=10)
        self.sub_title = self.backend.info.name
        if self._open_id:
            await self.open_conversation(self._open_id)
        else:
            await self._render_conversation()
        self._log().anchor()
        self._input().focus()
        self._show_status()
        self.set_interval(self.stats_interval, self.refresh_stats)
        self.refresh_stats()

    async def on_unmount(self) -> None:
        self.action_stop()
        if self.api_server is not None:
            await asyncio.to_thread(self.api_server.stop)
        await self.backend.close()

    def on_resize(self, event) -> None:
        self._layout_for(event.size.width)
        self.call_after_refresh(self._show_status)

    def _layout_for(self, width: int) -> None:
        self.main_screen.set_class(width >= WIDE, "-wide")

    @property
    def main_screen(self) -> Screen:
        """The chat screen, also while a dialog is on top of it (``self.query_one`` sees the dialog)."""
        return self.screen_stack[0]

    def check_action(self, action: str, parameters: tuple) -> bool | None:
        # While a dialog is open its own keys win (ctrl+s saves the settings, esc closes).
        if action in self._MAIN_SCREEN_ACTIONS and isinstance(self.screen, ModalScreen):
            return False
        return True

    _MAIN_SCREEN_ACTIONS = frozenset(
        {
            "stop",
            "new_chat",
            "regenerate",
            "copy_reply",
            "edit_last",
            "conversations",
            "models",
            "settings",
            "help",
            "scroll_log",
        }
    )

    # ---------------------------------------------------------------- status

    def _show_status(self) -> None:
        self.status.generating = self.generating
        main = self.main_screen
        box = main.query_one(ChatInput)
        info = self.backend.info
        box.border_title = f"{info.name} {info.quant or ''}".strip()
        if self.status.api_url:
            box.border_subtitle = f"API {self.status.api_url}/v1"
        elif info.where != "in-process":
            box.border_subtitle = f"attached to {info.where}"
        else:
            box.border_subtitle = ""
        if self.generating:
            box.border_subtitle = "esc stops · " + box.border_subtitle if box.border_subtitle else "esc stops"

        main.query_one(StatusPanel).show(self.status)
        main.query_one(StatusBar).show(self.status)

    @work(group="stats", exclusive=True, exit_on_error=False)
    async def refresh_stats(self) -> None:
        """Poll the engine's load (other clients may be using it through the API)."""
        try:
            load: LoadStats | None = await self.backend.stats()
        except Exception:
            return
        self.status.load = load
        self._show_status()

    # ---------------------------------------------------------------- conversation view

    @property
    def generating(self) -> bool:
        return self._replying

    def _log(self) -> VerticalScroll:
        return self.main_screen.query_one("#log", VerticalScroll)

    def _input(self) -> ChatInput:
        return self.main_screen.query_one(ChatInput)

    async def _render_conversation(self) -> None:
        log = self._log()
        await log.remove_children()
        turns = [Turn(m.role, m.content, m.meta) for m in self.conversation.messages]
        if turns:
            await log.mount_all(turns)
        else:
            await log.mount(Static(self._welcome(), id="welcome"))
        log.scroll_end(animate=False)
        last = next((m for m in reversed(self.conversation.messages) if m.role == "assistant"), None)
        meta = last.meta if last else {}
        self.status.context_used = meta.get("context_tokens")
        self.status.tokens_per_s = meta.get("tokens_per_s")
        self.status.ttft = meta.get("ttft")
        self._show_status()

    def _welcome(self) -> str:
        api = (
            f"\nThe OpenAI API is served at {self.status.api_url}/v1 on the same engine."
            if self.status.api_url
            else ""
        )
        return (
            f"Chat with {self.backend.info.name}. Enter sends, shift+enter or ctrl+j adds a line, "
            f"esc stops a reply, ? lists the keys.{api}"
        )

    async def _mount_turn(self, turn: Turn) -> Turn:
        log = self._log()
        for w in log.query("#welcome"):
            await w.remove()
        await log.mount(turn)
        log.scroll_end(animate=False)
        return turn

    def _save(self) -> None:
        if self.conversation.messages:
            try:
                self.store.save(self.conversation)
            except OSError as exc:
                self.notify(f"could not save the conversation: {exc}", severity="error")

    # ---------------------------------------------------------------- sending

    @on(ChatInput.Submitted)
    async def _on_submitted(self, event: ChatInput.Submitted) -> None:
        await self.send(event.text)

    @on(ChatInput.HelpRequested)
    def _on_help_requested(self) -> None:
        self.action_help()

    @on(ChatInput.EditRequested)
    async def _on_edit_requested(self) -> None:
        if any(m.role == "user" for m in self.conversation.messages):
            await self.action_edit_last()

    async def send(self, text: str) -> None:
        """Add a user turn with ``text`` and stream the reply."""
        if not text.strip():
            return
        if self.generating:
            self.notify("a reply is still being written: esc stops it", severity="warning")
            return
        self._input().text = ""
        msg = Message("user", text)
        self.conversation.messages.append(msg)
        await self._mount_turn(Turn("user", text))
        self._start_reply()

    def _start_reply(self) -> None:
        self._replying = True
        self._gen_worker = self.run_worker(
            self._reply(), group="generate", exclusive=True, exit_on_error=False
        )
        self._show_status()

    async def _reply(self) -> None:
        try:
            await self._stream_reply(self.conversation)
        finally:
            self._replying = False
            self._show_status()
            self.refresh_stats()

    async def _stream_reply(self, conv: Conversation) -> None:
        s = self.settings
        params = GenerationParams(
            temperature=s.temperature, top_p=s.top_p, max_tokens=s.max_tokens, priority=s.priority
        )
        messages = conv.chat_messages()
        turn = await self._mount_turn(Turn("assistant", pending=True))
        md = turn.markdown
        stream = Markdown.get_stream(md)
        parts: list[str] = []
        meta: dict = {}
        self.status.tokens_per_s = self.status.ttft = None
        try:
            async for d in self.backend.stream_chat(messages, params):
                if d.notice:
                    self.notify(d.notice, timeout=6)
                if d.text:
                    parts.append(d.text)
                    await stream.write(d.text)
                meta.update(num_output_tokens=d.num_output_tokens, tokens_per_s=d.tokens_per_s, ttft=d.ttft)
                if d.num_prompt_tokens is not None:
                    meta["num_prompt_tokens"] = d.num_prompt_tokens
                    meta["context_tokens"] = d.num_prompt_tokens + d.num_output_tokens
                if d.finished:
                    meta["finish_reason"] = d.finish_reason
                self.status.tokens_per_s, self.status.ttft = d.tokens_per_s, d.ttft
                self.status.context_used = meta.get("context_tokens", self.status.context_used)
                turn.set_meta(meta, pending=not d.finished)
                self._show_status()
        except asyncio.CancelledError:  # Esc (or a new chat): the engine has aborted the request
            meta["finish_reason"] = "abort"
        except Exception as exc:
            meta["finish_reason"] = "error"
            self.notify(f"{type(exc).__name__}: {getattr(exc, 'message', exc)}", severity="error", timeout=8)
        finally:
            await stream.stop()
        text = "".join(parts)
        if not text and meta.get("finish_reason") in ("abort", "error"):
            await turn.remove()  # nothing worth keeping; the user turn stays for ctrl+r
            return
        meta = {k: v for k, v in meta.items() if v is not None}
        meta["time"] = time.time()
        conv.messages.append(Message("assistant", text, meta))
        if md.source != text:
            await md.update(text)
        turn.content = text
        turn.set_meta(meta)
        try:
            self.store.save(conv)
        except OSError as exc:
            self.notify(f"could not save the conversation: {exc}", severity="error")

    async def wait_for_reply(self) -> None:
        """Until the reply being generated (if any) is done: for tests and scripts."""
        worker = self._gen_worker
        if worker is not None:
            await worker.wait()

    # ---------------------------------------------------------------- actions

    async def _stop_and_wait(self) -> None:
        worker = self._gen_worker
        if worker is not None and worker.is_running:
            worker.cancel()
            try:
                await worker.wait()
            except Exception:
                pass

    def action_stop(self) -> None:
        """Esc: stop the reply (the engine aborts the request and frees its KV cache)."""
        worker = self._gen_worker
        if worker is not None and worker.is_running:
            worker.cancel()

    async def action_new_chat(self) -> None:
        await self._stop_and_wait()
        self._save()
        self.conversation = Conversation(
            system_prompt=self.settings.system_prompt, model=self.backend.info.name
        )
        await self._render_conversation()
        self._input().text = ""
        self._input().focus()

    async def action_regenerate(self) -> None:
        await self._stop_and_wait()
        msgs = self.conversation.messages
        if msgs and msgs[-1].role == "assistant":
            msgs.pop()
        if not msgs:
            self.notify("nothing to regenerate yet")
            return
        await self._render_conversation()
        self._start_reply()

    def action_copy_reply(self) -> None:
        last = next((m for m in reversed(self.conversation.messages) if m.role == "assistant"), None)
        if last is None:
            self.notify("no reply to copy yet")
            return
        self.copy_to_clipboard(last.content)
        self.notify(f"copied the last reply ({len(last.content)} characters)")

    async def action_edit_last(self) -> None:
        """Put the last user message back into the input (dropping it and its reply) to edit and resend."""
        await self._stop_and_wait()
        msgs = self.conversation.messages
        idx = next((i for i in range(len(msgs) - 1, -1, -1) if msgs[i].role == "user"), None)
        if idx is None:
            self.notify("no message to edit yet")
            return
        text = msgs[idx].content
        del msgs[idx:]
        await self._render_conversation()
        box = self._input()
        box.text = text
        box.move_cursor(box.document.end)
        box.focus()

    def action_settings(self) -> None:
        def done(new: ChatSettings | None) -> None:
            if new is None:
                return
            new.theme = self.theme
            self.settings = new
            self.conversation.system_prompt = new.system_prompt
            try:
                self.settings_store.save(new)
            except OSError as exc:
                self.notify(f"could not save the settings: {exc}", severity="error")
            self.notify("settings saved; they apply to the next reply")

        self.push_screen(SettingsScreen(self.settings), done)

    def action_conversations(self) -> None:
        async def done(conv_id: str | None) -> None:
            if conv_id is not None:
                await self.open_conversation(conv_id)
            elif self.conversation.messages:
                # It may have been renamed or deleted in the list.
                try:
                    self.conversation.title = self.store.load(self.conversation.id).title
                except (OSError, ValueError):
                    pass

        self._save()
        self.push_screen(ConversationsScreen(self.store, self.conversation.id), done)

    async def action_models(self) -> None:
        """ctrl+l: pick the model to talk to (the server's /v1/models, or the local store in-process)."""
        try:
            models = await self.backend.list_models()
        except Exception as exc:
            self.notify(f"cannot list the models: {getattr(exc, 'message', exc)}", severity="error")
            return

        async def done(name: str | None) -> None:
            if name is not None and name != self.backend.info.name:
                await self.switch_model(name)

        self.push_screen(ModelsScreen(models, self.backend.info.name), done)

    async def switch_model(self, name: str) -> None:
        """Talk to ``name`` from the next reply on; the conversation stays."""
        await self._stop_and_wait()
        self.notify(f"switching to {name} …")
        try:
            await self.backend.switch_model(name)
        except Exception as exc:
            message = getattr(exc, "message", exc)
            self.notify(f"cannot switch to {name}: {message}", severity="error", timeout=8)
            return
        self.conversation.model = name
        self.sub_title = name
        self.status.model = self.backend.info
        self.status.context_used = None
        self._show_status()
        self.refresh_stats()
        info = self.backend.info
        self.notify(f"now chatting with {info.name}" + (f" ({info.quant})" if info.quant else ""))

    async def open_conversation(self, conv_id: str) -> None:
        await self._stop_and_wait()
        self._save()
        try:
            conv = self.store.load(conv_id)
        except (OSError, ValueError) as exc:
            self.notify(f"cannot open {conv_id}: {exc}", severity="error")
            return
        self.conversation = conv
        await self._render_conversation()
        self._input().focus()

    def action_toggle_theme(self) -> None:
        self.theme = THEMES[1] if self.theme == THEMES[0] else THEMES[0]
        self.settings.theme = self.theme
        try:
            self.settings_store.save(self.settings)
        except OSError:
            pass

    def action_help(self) -> None:
        if not isinstance(self.screen, HelpScreen):
            self.push_screen(HelpScreen())

    def action_scroll_log(self, direction: int) -> None:
        log = self._log()
        log.scroll_page_down() if direction > 0 else log.scroll_page_up()
