"""The one place that turns exceptions into OpenAI-shaped errors:
``{"error": {"message", "type", "param", "code"}}`` with the matching HTTP status."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from localllm.errors import LocalLLMError

log = logging.getLogger(__name__)


class AuthenticationError(LocalLLMError):
    """Missing or wrong API key (HTTP 401)."""

    status_code = 401
    error_type = "invalid_request_error"

    def __init__(self, message: str) -> None:
        super().__init__(message, code="invalid_api_key")


_HTTP_TYPES = {404: "not_found_error", 405: "invalid_request_error", 413: "invalid_request_error"}


def error_body(message: str, error_type: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def exception_body(exc: BaseException) -> tuple[int, dict]:
    """Status code and body for any exception (also sent as an SSE event once a stream has begun)."""
    if isinstance(exc, LocalLLMError):
        return exc.status_code, error_body(exc.message, exc.error_type, exc.param, exc.code)
    if isinstance(exc, RequestValidationError):
        message, param = describe_validation_errors(exc.errors())
        return 400, error_body(message, "invalid_request_error", param)
    if isinstance(exc, StarletteHTTPException):
        return exc.status_code, error_body(
            str(exc.detail), _HTTP_TYPES.get(exc.status_code, "invalid_request_error")
        )
    return 500, error_body(f"internal error: {type(exc).__name__}", "internal_error")


def describe_validation_errors(errors: list[dict]) -> tuple[str, str | None]:
    """A readable one-line message naming the field of the first problem, and that field.

    A union field that matches none of its types yields one error per type; those are joined.
    """
    if not errors:
        return "invalid request body", None
    first = errors[0]
    if first.get("type") == "json_invalid":
        return f"the request body is not valid JSON: {first.get('ctx', {}).get('error', first['msg'])}", None
    loc = [p for p in first["loc"] if p != "body"]
    if not loc:
        if isinstance(first.get("input"), (bytes, str)):
            return "the request body must be JSON, sent with 'Content-Type: application/json'", None
        return f"the request body must be a JSON object ({first['msg']})", None
    param = str(loc[0])
    group = [e for e in errors if [p for p in e["loc"] if p != "body"][:1] == loc[:1]]
    if len(group) == 1:
        return f"{_path(loc)}: {first['msg']}", param
    locs = [[p for p in e["loc"] if p != "body"] for e in group]
    common = locs[0]
    for other in locs[1:]:
        n = 0
        while n < min(len(common), len(other)) and common[n] == other[n]:
            n += 1
        common = common[:n]
    messages = list(dict.fromkeys(e["msg"] for e in group))
    return f"{_path(common or loc[:1])}: invalid type or value ({'; '.join(messages[:4])})", param


def _path(loc: list) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def error_response(exc: BaseException) -> JSONResponse:
    status, body = exception_body(exc)
    # Errors worth retrying (a full queue, a model that waits for busy ones) say when.
    retry_after = getattr(exc, "retry_after_seconds", None)
    headers = {"Retry-After": str(retry_after)} if retry_after is not None else None
    if status >= 500:
        if isinstance(exc, LocalLLMError):
            log.warning("request failed: %s", exc.message)
        else:
            log.error("request failed", exc_info=exc)
    return JSONResponse(body, status_code=status, headers=headers)


async def _handle(request: Request, exc: Exception) -> JSONResponse:
    return error_response(exc)


def install_error_handlers(app: FastAPI) -> None:
    for exc_type in (LocalLLMError, RequestValidationError, StarletteHTTPException, Exception):
        app.add_exception_handler(exc_type, _handle)
