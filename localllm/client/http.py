"""A small HTTP client for a running localllm server (used by `run` and `ps`)."""

from __future__ import annotations

import json
from collections.abc import Iterator

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


def _headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def stream_chat(base_url: str, model: str, messages: list[dict], params: dict,
                api_key: str | None = None) -> Iterator[str]:
    """Yield text deltas of a streamed chat completion."""
    body = {"model": model, "messages": messages, "stream": True, **params}
    with httpx.stream("POST", f"{base_url}/v1/chat/completions", json=body, headers=_headers(api_key),
                      timeout=httpx.Timeout(10.0, read=None)) as r:
        if r.status_code != 200:
            r.read()
            try:
                msg = r.json()["error"]["message"]
            except (ValueError, KeyError, TypeError):
                msg = r.text
            raise LocalLLMError(f"server error {r.status_code}: {msg}")
        for line in r.iter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                return
            chunk = json.loads(data)
            for choice in chunk.get("choices", []):
                text = (choice.get("delta") or {}).get("content")
                if text:
                    yield text


def server_status(base_url: str, api_key: str | None = None) -> dict | None:
    """Loaded models and engine load read from /v1/models and /metrics; None if no server."""
    from prometheus_client.parser import text_string_to_metric_families

    models = server_models(base_url, api_key)
    if models is None:
        return None
    status: dict = {"models": models}
    try:
        text = httpx.get(f"{base_url}/metrics", timeout=1.0, headers=_headers(api_key)).text
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                if s.name in ("localllm:num_requests_running", "localllm:num_requests_waiting",
                              "localllm:kv_cache_usage_perc"):
                    status[s.name.split(":", 1)[1]] = s.value
    except (httpx.HTTPError, ValueError):
        pass
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
    try:
        return str(r.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return r.text
