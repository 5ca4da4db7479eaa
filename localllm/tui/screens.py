"""Modal screens: settings, saved conversations, the model picker, key bindings."""

from __future__ import annotations

import time

from rich.text import Text
from textual import on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Grid, Horizontal, Vertical, VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Button, Input, Label, OptionList, Static, TextArea
from textual.widgets.option_list import Option

from localllm.tui.backend import ModelChoice
from localllm.tui.storage import ChatSettings, ConversationStore

KEYS: list[tuple[str, str]] = [
    ("enter", "send the message"),
    ("shift+enter, ctrl+j", "new line in the message"),
    ("esc", "stop the reply being generated"),
    ("ctrl+n", "new chat"),
    ("ctrl+r", "regenerate the last reply"),
    ("ctrl+y", "copy the last reply"),
    ("ctrl+g, ↑ on empty input", "edit the last message and resend"),
    ("ctrl+o", "conversations: open, rename, delete"),
    ("ctrl+l", "models: switch the model the chat talks to"),
    ("ctrl+s", "settings: system prompt, sampling, priority"),
    ("ctrl+t", "light / dark theme"),
    ("? on empty input, f1", "this help"),
    ("pgup / pgdn", "scroll the conversation"),
    ("ctrl+q", "quit"),
]


class HelpScreen(ModalScreen[None]):
    """The key bindings."""

    BINDINGS = [
        Binding("escape,q,question_mark,f1", "dismiss_help", "Close", show=False),
    ]

    def compose(self) -> ComposeResult:
        t = Text()
        width = max(len(k) for k, _ in KEYS) + 2
        for key, what in KEYS:
            t.append(key.ljust(width), style="bold cyan")
            t.append(what + "\n")
        t.rstrip()
        with Vertical(id="help-dialog", classes="dialog"):
            yield Static("Keys", classes="dialog-title")
            with VerticalScroll():
                yield Static(t, id="help-keys")
            yield Static("esc closes", classes="dialog-hint")

    def action_dismiss_help(self) -> None:
        self.dismiss(None)


class SettingsScreen(ModalScreen["ChatSettings | None"]):
    """Edit the settings; dismisses with the new settings, or None when cancelled."""

    BINDINGS = [
        Binding("escape", "cancel", "Cancel", show=False),
        Binding("ctrl+s", "save", "Save", show=False, priority=True),
    ]

    def __init__(self, settings: ChatSettings) -> None:
        super().__init__()
        self.settings = settings

    def compose(self) -> ComposeResult:
        s = self.settings
        with Vertical(id="settings-dialog", classes="dialog"):
            yield Static("Settings", classes="dialog-title")
            yield Label("System prompt (for this chat and new ones)")
            yield TextArea(s.system_prompt, id="system-prompt", compact=True)
            with Grid(id="settings-grid"):
                yield Label("Temperature (0 = greedy)")
                yield Input(f"{s.temperature:g}", id="temperature", type="number", compact=True)
                yield Label("Top-p")
                yield Input(f"{s.top_p:g}", id="top-p", type="number", compact=True)
                yield Label("Max tokens per reply")
                yield Input(str(s.max_tokens), id="max-tokens", type="integer", compact=True)
                yield Label("Priority (lower runs first; API uses 0)")
                yield Input(str(s.priority), id="priority", type="integer", compact=True)
            yield Static("", id="settings-error")
            with Horizontal(classes="dialog-buttons"):
                yield Button("Save", variant="primary", id="save", compact=True)
                yield Button("Cancel", id="cancel", compact=True)
            yield Static("ctrl+s saves · esc cancels", classes="dialog-hint")

    def on_mount(self) -> None:
        self.query_one("#system-prompt", TextArea).focus()

    def _read(self) -> ChatSettings:
        def value(widget_id: str) -> str:
            return self.query_one(f"#{widget_id}", Input).value.strip()

        try:
            settings = ChatSettings(
                system_prompt=self.query_one("#system-prompt", TextArea).text.strip(),
                temperature=float(value("temperature")),
                top_p=float(value("top-p")),
                max_tokens=int(value("max-tokens")),
                priority=int(value("priority")),
                theme=self.settings.theme,
            )
        except ValueError:
            raise ValueError("numbers only, please: temperature, top-p, max tokens, priority") from None
        settings.validate()
        return settings

    @on(Button.Pressed, "#save")
    def action_save(self) -> None:
        try:
            settings = self._read()
        except ValueError as exc:
            self.query_one("#settings-error", Static).update(Text(str(exc), style="bold red"))
            return
        self.dismiss(settings)

    @on(Input.Submitted)
    def _submitted(self) -> None:
        self.action_save()

    @on(Button.Pressed, "#cancel")
    def action_cancel(self) -> None:
        self.dismiss(None)


def _when(ts: float) -> str:
    if not ts:
        return ""
    fmt = "%H:%M" if time.localtime(ts)[:3] == time.localtime()[:3] else "%Y-%m-%d"
    return time.strftime(fmt, time.localtime(ts))


class ConversationsScreen(ModalScreen["str | None"]):
    """Saved conversations: enter opens one (dismisses with its id), r renames, d deletes."""

    BINDINGS = [
        Binding("escape", "close", "Close", show=False),
        Binding("r", "rename", "Rename", show=False),
        Binding("d,delete", "delete", "Delete", show=False),
    ]

    def __init__(self, store: ConversationStore, current_id: str | None = None) -> None:
        super().__init__()
        self.store = store
        self.current_id = current_id
        self._confirm_delete: str | None = None
        self._renaming: str | None = None

    def compose(self) -> ComposeResult:
        with Vertical(id="conversations-dialog", classes="dialog"):
            yield Static("Conversations", classes="dialog-title")
            yield OptionList(id="conversation-list")
            yield Input(id="rename-input", placeholder="new title", compact=True)
            yield Static(
                "enter open · r rename · d delete · esc close", id="conversations-hint", classes="dialog-hint"
            )

    def on_mount(self) -> None:
        self.query_one("#rename-input", Input).display = False
        self._reload()

    def _reload(self, highlight: str | None = None) -> None:
        ol = self.query_one("#conversation-list", OptionList)
        ol.clear_options()
        summaries = self.store.list()
        for s in summaries:
            title = s.title if len(s.title) <= 48 else s.title[:47] + "…"
            label = Text(title, style="bold" if s.id == self.current_id else "")
            label.append(f"  {_when(s.updated)} · {s.num_messages} msgs", style="dim")
            ol.add_option(Option(label, id=s.id))
        if not summaries:
            ol.add_option(Option(Text("no saved conversations yet", style="dim"), id="-", disabled=True))
        ids = [s.id for s in summaries]
        target = highlight if highlight in ids else (self.current_id if self.current_id in ids else None)
        if ids:
            ol.highlighted = ids.index(target) if target else 0
        ol.focus()

    def _selected(self) -> str | None:
        ol = self.query_one("#conversation-list", OptionList)
        if ol.highlighted is None:
            return None
        opt = ol.get_option_at_index(ol.highlighted)
        return None if opt.id in (None, "-") else opt.id

    def _hint(self, text: str, style: str = "") -> None:
        self.query_one("#conversations-hint", Static).update(Text(text, style=style))

    @on(OptionList.OptionSelected, "#conversation-list")
    def _open(self, event: OptionList.OptionSelected) -> None:
        if event.option.id and event.option.id != "-":
            self.dismiss(event.option.id)

    def action_rename(self) -> None:
        conv_id = self._selected()
        if conv_id is None:
            return
        self._renaming = conv_id
        title = next((s.title for s in self.store.list() if s.id == conv_id), "")
        box = self.query_one("#rename-input", Input)
        box.value = title
        box.display = True
        box.focus()
        self._hint("enter saves the title · esc cancels")

    @on(Input.Submitted, "#rename-input")
    def _rename_done(self, event: Input.Submitted) -> None:
        if self._renaming and event.value.strip():
            self.store.rename(self._renaming, event.value)
        self._end_rename()

    def _end_rename(self) -> None:
        renamed, self._renaming = self._renaming, None
        box = self.query_one("#rename-input", Input)
        box.display = False
        self._hint("enter open · r rename · d delete · esc close")
        self._reload(highlight=renamed)

    def action_delete(self) -> None:
        conv_id = self._selected()
        if conv_id is None:
            return
        if self._confirm_delete != conv_id:
            self._confirm_delete = conv_id
            self._hint("press d again to delete this conversation", style="bold yellow")
            return
        self._confirm_delete = None
        self.store.delete(conv_id)
        self._hint("deleted · enter open · r rename · d delete · esc close")
        self._reload()

    def check_action(self, action: str, parameters: tuple) -> bool | None:
        # While the title box has focus, letters are typed, not actions.
        return not (action in ("rename", "delete") and self._renaming is not None)

    def action_close(self) -> None:
        if self._renaming is not None:
            self._end_rename()
            return
        self.dismiss(None)


def _size(num_bytes: int | None) -> str:
    if not num_bytes:
        return ""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if num_bytes >= scale:
            return f"{num_bytes / scale:.1f} {unit}"
    return f"{num_bytes} B"


class ModelsScreen(ModalScreen["str | None"]):
    """The model picker: enter switches to the highlighted model (dismisses with its name), esc closes."""

    BINDINGS = [Binding("escape", "close", "Close", show=False)]

    def __init__(self, models: list[ModelChoice], current: str) -> None:
        super().__init__()
        self.models = models
        self.current = current

    def compose(self) -> ComposeResult:
        with Vertical(id="models-dialog", classes="dialog"):
            yield Static("Models", classes="dialog-title")
            yield OptionList(id="model-list")
            yield Static("enter switches · esc closes", classes="dialog-hint")

    def on_mount(self) -> None:
        ol = self.query_one("#model-list", OptionList)
        for m in self.models:
            label = Text(m.name, style="bold" if m.name == self.current else "")
            if m.quant:
                label.append(f"  {m.quant}", style="cyan")
            facts = [f for f in (
                "current" if m.name == self.current else ("loaded" if m.loaded else ""),
                _size(m.size_bytes),
                f"{m.max_model_len:,} ctx" if m.max_model_len else "",
            ) if f]
            if facts:
                label.append("  " + " · ".join(facts), style="dim")
            ol.add_option(Option(label, id=m.name))
        if not self.models:
            ol.add_option(Option(Text("no models to switch to", style="dim"), id="-", disabled=True))
        names = [m.name for m in self.models]
        if names:
            ol.highlighted = names.index(self.current) if self.current in names else 0
        ol.focus()

    @on(OptionList.OptionSelected, "#model-list")
    def _pick(self, event: OptionList.OptionSelected) -> None:
        if event.option.id and event.option.id != "-":
            self.dismiss(event.option.id)

    def action_close(self) -> None:
        self.dismiss(None)
