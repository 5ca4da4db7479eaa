"""What the chat remembers between runs: its settings and its conversations, as JSON in ``home_dir()``.

Every write goes to a temporary file in the same directory and is moved into place with
``os.replace``, so a crash or a full disk leaves the previous version intact, never half a file.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from localllm.config.engine import INTERACTIVE_PRIORITY
from localllm.config.paths import home_dir

SETTINGS_FILE = "chat-settings.json"
CONVERSATIONS_DIR = "conversations"
_ID_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


def atomic_write_json(path: Path, data: Any) -> None:
    """Write ``data`` as JSON to ``path`` so that readers see the old file or the new one, never a mix."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            json.dump(data, fh, ensure_ascii=False, indent=2)
            fh.write("\n")
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


# ---------------------------------------------------------------- settings


@dataclass(slots=True)
class ChatSettings:
    """What the user can change in the settings screen; applies to the next request.

    ``priority`` follows the engine's convention (lower runs first): the default,
    ``INTERACTIVE_PRIORITY``, puts the TUI's requests ahead of API traffic (priority 0) so that
    typing stays responsive under load.
    """

    system_prompt: str = ""
    temperature: float = 0.7
    top_p: float = 0.95
    max_tokens: int = 1024
    priority: int = INTERACTIVE_PRIORITY
    theme: str = "textual-dark"

    def validate(self) -> None:
        """Raise ValueError naming the first bad field."""
        if not 0.0 <= self.temperature <= 2.0:
            raise ValueError("temperature must be between 0 and 2")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError("top-p must be in (0, 1]")
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError("max tokens must be a positive integer")
        if isinstance(self.priority, bool) or not isinstance(self.priority, int):
            raise ValueError("priority must be an integer")

    @classmethod
    def from_dict(cls, data: dict) -> ChatSettings:
        """Settings from an older or hand-edited dict: unknown keys ignored, bad values defaulted."""
        default = cls()
        values = {}
        for f in fields(cls):
            if f.name not in data:
                continue
            want = type(getattr(default, f.name))
            value = data[f.name]
            try:
                values[f.name] = want(value) if not isinstance(value, bool) else getattr(default, f.name)
            except (TypeError, ValueError):
                continue
        settings = cls(**values)
        try:
            settings.validate()
        except ValueError:
            return default
        return settings


class SettingsStore:
    """``home_dir()/chat-settings.json``."""

    def __init__(self, path: Path | None = None) -> None:
        self.path = path or home_dir() / SETTINGS_FILE

    def load(self) -> ChatSettings:
        try:
            data = json.loads(self.path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return ChatSettings()
        return ChatSettings.from_dict(data) if isinstance(data, dict) else ChatSettings()

    def save(self, settings: ChatSettings) -> None:
        settings.validate()
        atomic_write_json(self.path, asdict(settings))


# ---------------------------------------------------------------- conversations


@dataclass(slots=True)
class Message:
    """One turn. ``meta`` holds what the reply cost (tokens, TTFT, tokens/s, finish reason)."""

    role: str  # "user" | "assistant"
    content: str
    meta: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        d = {"role": self.role, "content": self.content}
        if self.meta:
            d["meta"] = dict(self.meta)
        return d

    @classmethod
    def from_dict(cls, data: dict) -> Message:
        return cls(
            role=str(data["role"]), content=str(data.get("content", "")), meta=dict(data.get("meta") or {})
        )


@dataclass(slots=True)
class Conversation:
    id: str = field(default_factory=lambda: time.strftime("%Y%m%d-%H%M%S-") + uuid.uuid4().hex[:6])
    title: str = ""
    system_prompt: str = ""
    model: str = ""
    created: float = field(default_factory=time.time)
    updated: float = field(default_factory=time.time)
    messages: list[Message] = field(default_factory=list)

    @property
    def display_title(self) -> str:
        if self.title:
            return self.title
        for m in self.messages:
            if m.role == "user" and m.content.strip():
                line = m.content.strip().splitlines()[0]
                return line if len(line) <= 60 else line[:59] + "…"
        return "New chat"

    def chat_messages(self) -> list[dict]:
        """The OpenAI-style message list to send: system prompt (if any), then the turns."""
        out = [{"role": "system", "content": self.system_prompt}] if self.system_prompt.strip() else []
        out.extend({"role": m.role, "content": m.content} for m in self.messages)
        return out

    def to_dict(self) -> dict:
        return {
            "version": 1,
            "id": self.id,
            "title": self.title,
            "system_prompt": self.system_prompt,
            "model": self.model,
            "created": self.created,
            "updated": self.updated,
            "messages": [m.to_dict() for m in self.messages],
        }

    @classmethod
    def from_dict(cls, data: dict) -> Conversation:
        return cls(
            id=str(data["id"]),
            title=str(data.get("title") or ""),
            system_prompt=str(data.get("system_prompt") or ""),
            model=str(data.get("model") or ""),
            created=float(data.get("created") or 0.0),
            updated=float(data.get("updated") or 0.0),
            messages=[Message.from_dict(m) for m in data.get("messages") or []],
        )


@dataclass(slots=True, frozen=True)
class ConversationSummary:
    id: str
    title: str
    updated: float
    num_messages: int


class ConversationStore:
    """One JSON file per conversation in ``home_dir()/conversations/``."""

    def __init__(self, directory: Path | None = None) -> None:
        self.dir = directory or home_dir() / CONVERSATIONS_DIR

    def _path(self, conv_id: str) -> Path:
        if not _ID_RE.match(conv_id):
            raise ValueError(f"not a conversation id: {conv_id!r}")
        return self.dir / f"{conv_id}.json"

    def save(self, conv: Conversation, touch: bool = True) -> None:
        if touch:
            conv.updated = time.time()
        atomic_write_json(self._path(conv.id), conv.to_dict())

    def load(self, conv_id: str) -> Conversation:
        """Raises FileNotFoundError, or ValueError for a file that is not a conversation."""
        data = json.loads(self._path(conv_id).read_text(encoding="utf-8"))
        try:
            return Conversation.from_dict(data)
        except (KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"{conv_id}: not a conversation file ({exc})") from exc

    def list(self) -> list[ConversationSummary]:
        """Newest first; unreadable files are skipped."""
        out = []
        if not self.dir.is_dir():
            return out
        for path in self.dir.glob("*.json"):
            try:
                conv = self.load(path.stem)
            except (OSError, ValueError):
                continue
            out.append(ConversationSummary(conv.id, conv.display_title, conv.updated, len(conv.messages)))
        out.sort(key=lambda s: s.updated, reverse=True)
        return out

    def rename(self, conv_id: str, title: str) -> Conversation:
        conv = self.load(conv_id)
        conv.title = title.strip()
        self.save(conv, touch=False)
        return conv

    def delete(self, conv_id: str) -> None:
        try:
            self._path(conv_id).unlink()
        except FileNotFoundError:
            pass
