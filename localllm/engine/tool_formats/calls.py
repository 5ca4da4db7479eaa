"""What every tool-call format shares: the parsed call, the call ids, the look for a marker cut
at the end of a streamed text, and the whitespace a stream skips once."""

from __future__ import annotations

import json
import secrets
import string
import uuid
from dataclasses import dataclass

_ALPHANUMERIC = string.ascii_letters + string.digits


@dataclass(slots=True)
class ParsedCall:
    name: str
    arguments: str  # JSON text
    id: str

    @classmethod
    def make(cls, name: str, arguments, call_id: str | None = None) -> ParsedCall:
        """A call of ``name`` with ``arguments`` (an object, or its JSON text); ``call_id`` the model's
        own id, else a new ``call_…`` one."""
        text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
        return cls(name, text, call_id or f"call_{uuid.uuid4().hex[:24]}")


def short_id(length: int) -> str:
    """A random id of ``length`` letters and digits (Mistral's templates take ids of 9 of them only)."""
    return "".join(secrets.choice(_ALPHANUMERIC) for _ in range(length))


def marker_start(text: str, marker: str) -> int:
    """The length of the longest tail of ``text`` that is a proper start of ``marker`` (0: none)."""
    return next((k for k in range(min(len(marker) - 1, len(text)), 0, -1) if marker.startswith(text[-k:])), 0)


def skip_space(text: str, at: int) -> int:
    """The index of the first character from ``at`` on that is not whitespace (``len(text)``: none).
    A stream calls it from where it stopped last time, so a long run of whitespace is read once."""
    while at < len(text) and text[at].isspace():
        at += 1
    return at


def call_from(obj, key: str = "arguments", id_length: int | None = None) -> ParsedCall | None:
    """The call a JSON object names (``{"name": ..., key: {...}}``, arguments as an object or its
    JSON text), or ``None``. ``id_length``: the format's ids have that many letters and digits; an
    ``"id"`` of that shape written by the model is kept."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(key, obj.get("arguments", obj.get("parameters", {})))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    call_id = None
    if id_length is not None:
        given = obj.get("id")
        valid = isinstance(given, str) and len(given) == id_length and given.isalnum()
        call_id = given if valid else short_id(id_length)
    return ParsedCall.make(obj["name"], args, call_id)
