"""What every protocol's request bodies share: strict numbers (a string where a number belongs is a
400, not a silent conversion), text that is valid Unicode, unknown fields ignored (clients send
some), ``keep_alive``, and the most messages, tools and content parts a chat may carry."""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from localllm.errors import InvalidRequestError

Int = Annotated[int, Field(strict=True)]
Int64 = Annotated[int, Field(strict=True, ge=-(2**63), le=2**63 - 1)]
Float = Annotated[float, Field(strict=True, allow_inf_nan=False)]
Bool = Annotated[bool, Field(strict=True)]

# The most a chat request may carry, counted before any item is validated: validating each of
# 200,000 messages held the event loop for seconds. No real client comes near these.
MAX_MESSAGES = 10_000
MAX_TOOLS = 2_048
MAX_CONTENT_PARTS = 50_000  # content parts (blocks) of all messages together


class RequestBody(BaseModel):
    model_config = ConfigDict(extra="ignore")

    # How long the model stays loaded after this request, as Ollama's: seconds or a duration ("5m");
    # negative keeps it loaded, 0 unloads it after the request; None: as it was (see localllm.serving.pool).
    keep_alive: str | float | None = None

    @field_validator("*", mode="after")
    @classmethod
    def _valid_unicode(cls, value):
        """Text must be encodable as UTF-8: JSON may carry a lone surrogate (``"\\ud800"``),
        which the tokenizer cannot take (nested models check their own fields)."""
        _check_unicode(value)
        return value


def _check_unicode(value) -> None:
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            bad = value[exc.start : exc.end].encode("utf-8", "backslashreplace").decode()
            raise ValueError(f"text is not valid Unicode (a lone surrogate {bad} at character {exc.start})") from None
    elif isinstance(value, (list, tuple)):
        for item in value:
            _check_unicode(item)
    elif isinstance(value, dict):
        for key, item in value.items():
            _check_unicode(key)
            _check_unicode(item)


def messages_not_empty(messages: list) -> list:
    """A chat's ``messages`` (OpenAI's or Anthropic's): at least one."""
    if not messages:
        raise ValueError("messages must contain at least one message")
    return messages


def _content(message: dict):
    return message.get("content")


def check_counts(data: Any, content_of: Callable[[dict], Any] = _content, messages: str = "messages") -> Any:
    """``data`` (a raw chat request body) unchanged, or an :class:`InvalidRequestError` naming the
    first list over its limit: the messages (the field ``messages`` names), ``tools``, or the
    content parts of all messages (``content_of`` gives a message's list of parts, or something
    else when it has none)."""
    if not isinstance(data, dict):
        return data  # not an object: the model's own validation says so
    for field, limit in ((messages, MAX_MESSAGES), ("tools", MAX_TOOLS)):
        items = data.get(field)
        if isinstance(items, list) and len(items) > limit:
            raise InvalidRequestError(
                f"{field} has {len(items)} items; at most {limit} are accepted", param=field
            )
    items = data.get(messages)
    if isinstance(items, list):
        parts = 0
        for message in items:
            content = content_of(message) if isinstance(message, dict) else None
            parts += len(content) if isinstance(content, list) else 0
        if parts > MAX_CONTENT_PARTS:
            raise InvalidRequestError(
                f"{messages} have {parts} content parts in all; at most {MAX_CONTENT_PARTS} are accepted",
                param=messages,
            )
    return data
