"""Talking to a running server over HTTP: the one place for its wire formats.

The CLI (``run``, ``ps``, ``stop``), the TUI's :class:`~localllm.tui.backend.HTTPBackend` and the
tray (:mod:`localllm.tray.model`) all read a server through these: the Authorization header
(:func:`auth_headers`), an error body's message (:func:`error_message`), a stream's
``data:`` chunks (:func:`sse_chunks`, :func:`asse_chunks`) and ``/metrics`` (:func:`metric_values`,
summed per metric name whatever the namespace, ``localllm:`` or ``vllm:``). The functions below
them are the CLI's calls.
"""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterable, AsyncIterator, Iterable, Iterator
from typing import Any, Final

import httpx

from localllm.errors import LocalLLMError


def server_models(base_url: str, api_key: str | None = None, timeout: float = 0.5) -> list[str] | None:
    """The served model names, or None if no server answers at ``base_url``."""
    try:
        r = httpx.get(f"{base_url}/v1/models", timeout=timeout, headers=_headers(api_key))
        if r.status_code != 200:
            return None
        return [m["id"] for m in r.json().get("data", [])]
    except (httpx.HTTPError, ValueError, KeyError):
        return None


def auth_headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def error_message(body: str) -> str:
    """The message of an OpenAI-shaped error body (``{"error": {"message": ...}}``), else the body."""
    try:
        return str(json.loads(body)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return body[:300]


_DONE: Final = object()  # what _chunk answers for ``data: [DONE]``, the end of an OpenAI stream


def _chunk(line: str) -> Any:
    """A ``data:`` line's JSON, :data:`_DONE` at ``[DONE]``, ``None`` for other lines (comments, events)."""
    if not line.startswith("data:"):
        return None
    data = line[5:].strip()
    return _DONE if data == "[DONE]" else json.loads(data)


def sse_chunks(lines: Iterable[str]) -> Iterator[dict]:
    """The JSON chunks of a server-sent event stream, up to ``[DONE]``."""
    for chunk in map(_chunk, lines):
        if chunk is _DONE:
            return
        if chunk is not None:
            yield chunk


async def asse_chunks(lines: AsyncIterable[str]) -> AsyncIterator[dict]:
    """:func:`sse_chunks` over an asynchronous stream of lines."""
    async for line in lines:
        chunk = _chunk(line)
        if chunk is _DONE:
            return
        if chunk is not None:
            yield chunk


_METRIC_LINE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(\{[^}]*\})?\s+([-+0-9.eEinfNa]+)")


def metric_values(text: str) -> dict[str, float]:
    """Prometheus text as ``{name: value}``, the name without its namespace or ``_total``, the
    samples of one name (one per model) summed. A name in several namespaces (localllm serves its
    gauges as ``localllm:`` and, for inference gateways, again as ``vllm:``) counts once: the
    ``localllm:`` samples where there are some, else the first namespace's."""
    by_namespace: dict[str, dict[str, float]] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _METRIC_LINE.match(line)
        if not m:
            continue
        namespace, _, name = m.group(1).rpartition(":")
        name = name.removesuffix("_total")
        try:
            value = float(m.group(3))
        except ValueError:
            continue
        into = by_namespace.setdefault(namespace, {})
        into[name] = into.get(name, 0.0) + value
    values: dict[str, float] = {}
    for namespace in sorted(by_namespace, key=lambda n: n != "localllm"):  # localllm's first
        for name, value in by_namespace[namespace].items():
            values.setdefault(name, value)
    return values


_headers = auth_headers


def stream_chat(base_url: str, model: str, messages: list[dict], params: dict,
                api_key: str | None = None) -> Iterator[str]:
    """Yield text deltas of a streamed chat completion."""
    body = {"model": model, "messages": messages, "stream": True, **params}
    with httpx.stream("POST", f"{base_url}/v1/chat/completions", json=body, headers=_headers(api_key),
                      timeout=httpx.Timeout(10.0, read=None)) as r:
        if r.status_code != 200:
            raise LocalLLMError(f"server error {r.status_code}: {error_message(r.read().decode('utf-8', 'replace'))}")
        for chunk in sse_chunks(r.iter_lines()):
            for choice in chunk.get("choices", []):
                text = (choice.get("delta") or {}).get("content")
                if text:
                    yield text


def server_status(base_url: str, api_key: str | None = None) -> dict | None:
    """Loaded models and engine load read from /v1/models and /metrics; None if no server."""
    models = server_models(base_url, api_key)
    if models is None:
        return None
    status: dict = {"models": models}
    try:
        values = metric_values(httpx.get(f"{base_url}/metrics", timeout=1.0, headers=_headers(api_key)).text)
    except httpx.HTTPError:
        return status
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
        if name in values:
            status[name] = values[name]
    return status


def loaded_models(base_url: str, api_key: str | None = None, timeout: float = 2.0) -> list[dict] | None:
    """``GET /api/ps``: the models a server has loaded (name, quant, size_bytes, context_length,
    running, waiting, expires_at); None if no server answers at ``base_url``."""
    try:
        r = httpx.get(f"{base_url}/api/ps", timeout=timeout, headers=_headers(api_key))
    except httpx.HTTPError:
        return None
    if r.status_code != 200:
        raise LocalLLMError(f"server error {r.status_code}: {_error_message(r)}")
    return list(r.json().get("models", []))


def unload_model(base_url: str, model: str, api_key: str | None = None, timeout: float = 60.0) -> dict | None:
    """``POST /api/unload``: ``{"model", "unloaded", "pending"?}``; None if no server answers;
    LocalLLMError with the server's message otherwise (an unknown model: 404)."""
    try:
        r = httpx.post(f"{base_url}/api/unload", json={"model": model}, timeout=timeout, headers=_headers(api_key))
    except httpx.HTTPError:
        return None
    if r.status_code != 200:
        raise LocalLLMError(_error_message(r))
    return r.json()


def _error_message(r: httpx.Response) -> str:
    return error_message(r.text)
