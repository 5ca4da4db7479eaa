"""Typed errors. The API maps each to an OpenAI-shaped response; the CLI prints one line."""

from __future__ import annotations


class LocalLLMError(Exception):
    """Base class for every error localllm raises on purpose."""

    status_code = 500
    error_type = "internal_error"

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


class InvalidRequestError(LocalLLMError):
    """The caller asked for something invalid (HTTP 400)."""

    status_code = 400
    error_type = "invalid_request_error"


class ModelNotFoundError(LocalLLMError):
    """Unknown model name (HTTP 404)."""

    status_code = 404
    error_type = "not_found_error"


class ResponseNotFoundError(InvalidRequestError):
    """A stored response id that this server does not hold (HTTP 404): never stored, stored with
    ``store: false``, deleted, or dropped from its bounded memory."""

    status_code = 404


class QueueFullError(LocalLLMError):
    """The engine's waiting queue is full (HTTP 429)."""

    status_code = 429
    error_type = "rate_limit_error"
    retry_after_seconds = 1


class ModelBusyError(LocalLLMError):
    """A model cannot load until models that are serving requests finish (HTTP 503, Retry-After)."""

    status_code = 503
    error_type = "service_unavailable"
    retry_after_seconds = 5


class InsufficientMemoryError(LocalLLMError):
    """A model does not fit in memory even with every idle model unloaded (HTTP 507)."""

    status_code = 507
    error_type = "insufficient_memory"


class RequestFailedError(LocalLLMError):
    """One request failed inside the engine (HTTP 500); the engine goes on for the others."""

    error_type = "internal_error"


class ModelLoadError(LocalLLMError):
    """A model file is unreadable, truncated, or uses something localllm does not support."""

    error_type = "model_load_error"


class EngineDeadError(LocalLLMError):
    """The engine loop stopped (HTTP 503)."""

    status_code = 503
    error_type = "service_unavailable"


class HostNotAllowedError(InvalidRequestError):
    """A request whose Host header this server does not answer, against DNS rebinding (HTTP 403)."""

    status_code = 403


class UnsupportedMediaTypeError(InvalidRequestError):
    """A request body that is not JSON (HTTP 415)."""

    status_code = 415


class RequestTooLargeError(InvalidRequestError):
    """A request body over ``--max-request-bytes`` (HTTP 413)."""

    status_code = 413
