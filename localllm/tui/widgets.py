"""The chat's widgets: the input box, one turn of the conversation, and the two status views."""

from __future__ import annotations

from dataclasses import dataclass, field

from rich.text import Text
from textual import events
from textual.app import ComposeResult
from textual.containers import Vertical
from textual.message import Message
from textual.widgets import Markdown, Static, TextArea

from localllm.tui.backend import LoadStats, ModelInfo


class ChatInput(TextArea):
    """Multi-line input: Enter sends, Shift+Enter / Ctrl+J / Alt+Enter insert a newline."""

    NEWLINE_KEYS = ("shift+enter", "ctrl+j", "alt+enter")

    class Submitted(Message):
        def __init__(self, chat_input: ChatInput, text: str) -> None:
            super().__init__()
            self.chat_input = chat_input
            self.text = text

    class HelpRequested(Message):
        """``?`` typed into an empty input."""

    class EditRequested(Message):
        """Up pressed in an empty input: edit the last message."""

    async def _on_key(self, event: events.Key) -> None:
        if event.key == "enter":
            event.stop()
            event.prevent_default()
            self.post_message(self.Submitted(self, self.text))
            return
        if event.key in self.NEWLINE_KEYS:
            event.stop()
            event.prevent_default()
            start, end = self.selection
            self._replace_via_keyboard("\n", start, end)
            return
        if not self.text and event.character == "?":
            event.stop()
            event.prevent_default()
            self.post_message(self.HelpRequested())
            return
        if not self.text and event.key == "up":
            event.stop()
            event.prevent_default()
            self.post_message(self.EditRequested())
            return
        await super()._on_key(event)


def _fmt_meta(meta: dict) -> str:
    parts = []
    if meta.get("num_output_tokens") is not None:
        parts.append(f"{meta['num_output_tokens']} tok")
    if meta.get("tokens_per_s"):
        parts.append(f"{meta['tokens_per_s']:.1f} tok/s")
    if meta.get("ttft") is not None:
        parts.append(f"TTFT {meta['ttft']:.2f}s")
    reason = meta.get("finish_reason")
    if reason == "abort":
        parts.append("stopped")
    elif reason == "length":
        parts.append("max tokens")
    elif reason == "error":
        parts.append("error")
    return " · ".join(parts)


class Turn(Vertical):
    """One message: a header line (who, and what the reply cost) over its body.

    User text is shown as typed; assistant text as Markdown (code blocks highlighted).
    """

    def __init__(self, role: str, content: str = "", meta: dict | None = None, pending: bool = False) -> None:
        super().__init__(classes=f"turn {role}")
        self.role = role
        self.content = content
        self.meta = dict(meta or {})
        self.pending = pending

    def compose(self) -> ComposeResult:
        yield Static(self._header(), classes="turn-header", markup=False)
        if self.role == "assistant":
            yield Markdown(self.content, classes="turn-body")
        else:
            yield Static(self.content, classes="turn-body", markup=False)

    def _header(self) -> Text:
        who = "You" if self.role == "user" else "Assistant"
        text = Text(who, style="bold")
        if self.pending:
            text.append("  …", style="dim")
        meta = _fmt_meta(self.meta) if self.role == "assistant" else ""
        if meta:
            text.append(f"  {meta}", style="dim")
        return text

    @property
    def markdown(self) -> Markdown:
        return self.query_one(Markdown)

    def set_meta(self, meta: dict, pending: bool = False) -> None:
        self.meta = dict(meta)
        self.pending = pending
        self.query_one(".turn-header", Static).update(self._header())


@dataclass(slots=True)
class StatusState:
    """Everything the side panel and the status bar show."""

    model: ModelInfo
    context_used: int | None = None
    tokens_per_s: float | None = None
    ttft: float | None = None
    generating: bool = False
    load: LoadStats | None = None
    api_url: str | None = None
    notes: list[str] = field(default_factory=list)


def _pct(x: float | None) -> str:
    return "–" if x is None else f"{100 * x:.0f}%"


def _bar(frac: float, width: int) -> Text:
    frac = min(max(frac, 0.0), 1.0)
    full = round(frac * width)
    t = Text("█" * full, style="green" if frac < 0.75 else "yellow" if frac < 0.9 else "red")
    t.append("░" * (width - full), style="dim")
    return t


class StatusPanel(Static):
    """The side panel (wide terminals)."""

    def show(self, st: StatusState) -> None:
        t = Text()

        def head(title: str) -> None:
            t.append(f"{title}\n", style="bold underline")

        head("Model")
        t.append(f"{st.model.name}\n")
        t.append(f"{st.model.quant or '–'}", style="cyan")
        t.append(f" · {st.model.where}\n\n", style="dim")
        head("Context")
        used = st.context_used or 0
        if st.model.max_model_len:
            t.append(f"{used:,} / {st.model.max_model_len:,} tokens\n")
            t.append_text(_bar(used / st.model.max_model_len, 20))
            t.append("\n\n")
        else:
            t.append(f"{used:,} tokens\n\n")
        head("Last reply" if not st.generating else "This reply")
        rate = "–" if st.tokens_per_s is None else f"{st.tokens_per_s:.1f}"
        ttft = "–" if st.ttft is None else f"{st.ttft:.2f} s"
        t.append(f"{rate} tok/s\nTTFT {ttft}\n\n")
        head("Engine")
        if st.load is None:
            t.append("no load figures\n", style="dim")
        else:
            ld = st.load
            t.append(f"running {ld.num_running} · waiting {ld.num_waiting}\n")
            t.append(f"KV cache {_pct(ld.kv_cache_usage)}\n")
            t.append(f"prefix hits {_pct(ld.prefix_cache_hit_rate)}\n")
            if ld.spec_drafted_tokens:
                t.append(f"drafts accepted {_pct(ld.spec_acceptance_rate)}\n")
        if st.api_url:
            t.append("\n")
            head("API")
            t.append(f"{st.api_url}/v1\n", style="cyan")
        for note in st.notes:
            t.append(f"\n{note}\n", style="yellow")
        self.update(t)


class StatusBar(Static):
    """One line of the same facts (narrow terminals); model and API sit on the input's border."""

    def show(self, st: StatusState) -> None:
        t = Text(no_wrap=True, overflow="ellipsis", end="")
        used = st.context_used or 0
        ctx = f"{used}/{st.model.max_model_len}" if st.model.max_model_len else f"{used}"
        t.append(f"ctx {ctx}")
        if st.tokens_per_s is not None or st.ttft is not None:
            rate = "–" if st.tokens_per_s is None else f"{st.tokens_per_s:.1f}"
            ttft = "–" if st.ttft is None else f"{st.ttft:.2f}s"
            t.append(f" │ {rate} tok/s ttft {ttft}")
        if st.load is not None:
            ld = st.load
            t.append(
                f" │ run {ld.num_running} wait {ld.num_waiting} kv {_pct(ld.kv_cache_usage)}"
                f" hit {_pct(ld.prefix_cache_hit_rate)}"
            )
            if ld.spec_drafted_tokens:
                t.append(f" draft {_pct(ld.spec_acceptance_rate)}")
        for note in st.notes:
            t.append(f" │ {note}", style="yellow")
        width = self.content_size.width
        if width and t.cell_len > width:
            t.truncate(width, overflow="ellipsis")
        self.update(t)
