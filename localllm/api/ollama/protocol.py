"""Ollama's request bodies (its API documentation's fields; unknown ones are ignored, as Ollama
ignores them) and how their ``options`` map onto the OpenAI route's sampling fields."""

from __future__ import annotations

from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from localllm.api.body import RequestBody
from localllm.api.errors import exception_body
from localllm.api.options import option_fields
from localllm.errors import InvalidRequestError


class OllamaToolFunction(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str
    arguments: dict[str, Any] = Field(default_factory=dict)


class OllamaToolCall(BaseModel):
    model_config = ConfigDict(extra="ignore")
    function: OllamaToolFunction


class OllamaMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: str
    content: str = ""
    thinking: str | None = None
    images: list[str] | None = None
    tool_calls: list[OllamaToolCall] | None = None
    tool_name: str | None = None


class _OllamaRequest(RequestBody):
    model: str
    format: str | dict[str, Any] | None = None  # "json" or a JSON schema
    options: dict[str, Any] | None = None
    stream: bool = True
    think: bool | None = None


class OllamaChatRequest(_OllamaRequest):
    messages: list[OllamaMessage] = Field(default_factory=list)
    tools: list[dict[str, Any]] | None = None


class OllamaGenerateRequest(_OllamaRequest):
    prompt: str = ""
    suffix: str | None = None
    system: str | None = None
    template: str | None = None
    raw: bool = False
    images: list[str] | None = None
    context: list[int] | None = None


class OllamaEmbedRequest(RequestBody):
    model: str
    input: str | list[str] = ""
    truncate: bool = True
    dimensions: int | None = None
    options: dict[str, Any] | None = None


class OllamaEmbeddingsRequest(RequestBody):  # the legacy /api/embeddings
    model: str
    prompt: str = ""
    options: dict[str, Any] | None = None


class OllamaModelRequest(RequestBody):  # /api/show
    model: str = ""
    name: str = ""  # (older clients' field, read as model)
    verbose: bool = False

    @model_validator(mode="after")
    def _model_from_name(self):
        self.model = self.model or self.name
        return self


# Ollama's options -> the OpenAI route's fields (vLLM's for top_k, min_p, repetition_penalty).
class _StoreRequest(BaseModel):
    """A request naming a model of the store: ``model``, or the older ``name``."""

    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    name: str | None = None

    @model_validator(mode="after")
    def _named(self):
        if not (self.model or self.name):
            raise ValueError("model is required")
        return self

    @property
    def model_name(self) -> str:
        return self.model or self.name or ""


class OllamaPullRequest(_StoreRequest):
    insecure: bool = False
    stream: bool = True


class OllamaDeleteRequest(_StoreRequest):
    """``DELETE /api/delete``: the model to take out of the store."""


class OllamaCreateRequest(_StoreRequest):
    """``/api/create``: a variant ``from`` a model (or a legacy request's ``modelfile`` text)."""

    from_: str | None = Field(None, alias="from")
    modelfile: str | None = None
    system: str | None = None
    parameters: dict[str, Any] | None = None
    messages: list[dict[str, Any]] | None = None
    license: str | list[str] | None = None
    template: str | None = None
    adapters: dict[str, str] | None = None
    files: dict[str, str] | None = None
    quantize: str | None = None
    stream: bool = True


class OllamaCopyRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    source: str
    destination: str


def sampling_fields(options: dict[str, Any] | None, fmt: str | dict | None) -> dict[str, Any]:
    """The OpenAI route's sampling fields of Ollama's ``options`` and ``format``."""
    out = option_fields(options)
    if fmt == "json":
        out["response_format"] = {"type": "json_object"}
    elif isinstance(fmt, dict):
        out["response_format"] = {"type": "json_schema", "json_schema": {"name": "format", "schema": fmt}}
    elif fmt not in (None, ""):
        raise InvalidRequestError(f"format must be \"json\" or a JSON schema, not {fmt!r}", param="format")
    return out


async def read_body(request: Request, kind: type[BaseModel]) -> Any:
    """The request's JSON as ``kind``; a 400 with the first problem where it is not one."""
    try:
        return kind.model_validate(await request.json())
    except (ValidationError, ValueError) as exc:
        raise InvalidRequestError(str(exc).splitlines()[0]) from exc


def error_message(exc: BaseException) -> str:
    """The message of ``exc`` as Ollama's ``{"error": ...}`` carries it."""
    return exception_body(exc)[1]["error"]["message"]


def error_response(exc: BaseException) -> JSONResponse:
    """``exc`` in Ollama's shape, ``{"error": message}``, with its status."""
    return JSONResponse({"error": error_message(exc)}, status_code=exception_body(exc)[0])
