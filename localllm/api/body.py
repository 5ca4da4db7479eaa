"""What every protocol's request bodies share: strict numbers (a string where a number belongs is a
400, not a silent conversion), text that is valid Unicode, unknown fields ignored (clients send
some), and ``keep_alive``."""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, field_validator

Int = Annotated[int, Field(strict=True)]
Int64 = Annotated[int, Field(strict=True, ge=-(2**63), le=2**63 - 1)]
Float = Annotated[float, Field(strict=True, allow_inf_nan=False)]
Bool = Annotated[bool, Field(strict=True)]


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
