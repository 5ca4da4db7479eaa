"""Where the chat's replies come from: an interface and its two implementations.

- :class:`EngineBackend` talks to an :class:`~localllm.engine.async_engine.AsyncEngine` in this process
  (the same engine the built-in API server uses, so TUI and API requests share batches).
- :class:`HTTPBackend` talks to a running localllm, or any OpenAI-compatible server, over HTTP
  (streamed ``/v1/chat/completions``; load from Prometheus ``/metrics`` where there is one).

The app only sees :class:`ChatBackend`, so tests hand it a real in-process backend.
"""

from __future__ import annotations

import abc
import asyncio
import dataclasses
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from localllm.api.openai.serving import DROPPED_HEADER
from localllm.client.http import asse_chunks, auth_headers, error_message, metric_values
from localllm.engine.context_fit import CHAT_OVERFLOW, fit_chat
from localllm.errors import LocalLLMError

if TYPE_CHECKING:
    from localllm.engine.async_engine import AsyncEngine


class BackendError(LocalLLMError):
    """The backend could not produce a reply (bad request, server down, HTTP error)."""


@dataclass(slots=True, frozen=True)
class GenerationParams:
    temperature: float = 0.7
    top_p: float = 0.95
    max_tokens: int = 1024
    priority: int = -1


@dataclass(slots=True)
class ModelInfo:
    name: str
    quant: str | None = None
    max_model_len: int | None = None
    where: str = "in-process"  # "in-process" or the attached server's URL


@dataclass(slots=True)
class LoadStats:
    """The engine's load right now (from ``AsyncEngine.stats()`` or the server's ``/metrics``)."""

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float | None = None  # 0..1
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    spec_drafted_tokens: int = 0  # speculative decoding
    spec_accepted_tokens: int = 0

    @property
    def prefix_cache_hit_rate(self) -> float | None:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else None

    @property
    def spec_acceptance_rate(self) -> float | None:
        return self.spec_accepted_tokens / self.spec_drafted_tokens if self.spec_drafted_tokens else None


@dataclass(slots=True)
class ChatDelta:
    """New text of the reply being streamed, and what it has cost so far."""

    text: str
    finished: bool = False
    finish_reason: str | None = None
    num_prompt_tokens: int | None = None
    num_output_tokens: int = 0
    ttft: float | None = None  # seconds from the request to its first token
    tokens_per_s: float | None = None  # decode rate after the first token
    notice: str | None = None  # what the chat should say once (earlier messages left out to fit the context)


@dataclass(slots=True, frozen=True)
class ModelChoice:
    """A model the chat can switch to (the model picker's rows)."""

    name: str
    quant: str | None = None
    loaded: bool | None = None  # in memory on the server right now (None: not known)
    size_bytes: int | None = None
    max_model_len: int | None = None

    @property
    def label(self) -> str:
        return f"{self.name} ({self.quant})" if self.quant else self.name


# An in-process model loader: the name (catalog name, hub name or path) -> a running engine.
EngineLoader = Callable[[str], "AsyncEngine"]


class ChatBackend(abc.ABC):
    """A source of streamed chat replies plus the engine's load."""

    info: ModelInfo

    async def start(self) -> None:
        """Connect / look up the model; called once before the first request."""

    @abc.abstractmethod
    def stream_chat(self, messages: list[dict], params: GenerationParams) -> AsyncIterator[ChatDelta]:
        """Yield the reply to ``messages`` piece by piece; the last delta has ``finished=True``.

        Closing the iterator early (the task is cancelled: Esc) stops the request on the engine and
        frees its KV cache. Raises :class:`BackendError` (or a LocalLLMError) for a failed request.
        """

    @abc.abstractmethod
    async def stats(self) -> LoadStats | None:
        """The engine's load, or None when it cannot be known."""

    async def list_models(self) -> list[ModelChoice]:
        """The models :meth:`switch_model` accepts (the current one at least)."""
        return [ModelChoice(self.info.name, self.info.quant, True, None, self.info.max_model_len)]

    async def switch_model(self, name: str) -> None:
        """Send the next requests to model ``name`` (``info`` changes); raises BackendError if it cannot."""
        if name != self.info.name:
            raise BackendError(f"this chat cannot switch models (to {name})")

    async def close(self) -> None:
        """Release connections; an in-process engine is left running (its owner shuts it down)."""


def _rate(num_output_tokens: int, first_token: float | None, now: float) -> float | None:
    if first_token is None or num_output_tokens < 2 or now <= first_token:
        return None
    return (num_output_tokens - 1) / (now - first_token)


# ---------------------------------------------------------------- in-process


class EngineBackend(ChatBackend):
    """Replies from an AsyncEngine in this process."""

    def __init__(
        self,
        engine: AsyncEngine,
        model_name: str,
        *,
        loader: EngineLoader | None = None,
        local_models: Callable[[], list[ModelChoice]] | None = None,
        release: Callable[[AsyncEngine], None] | None = None,
    ) -> None:
        """``loader`` builds the engine of another model (None: this backend cannot switch);
        ``local_models`` lists what it can load (default: the local store); ``release`` ends a
        replaced engine (default: ``engine.shutdown``)."""
        self.engine = engine
        served = engine.model_info()
        self.info = ModelInfo(name=model_name, quant=served.quant, max_model_len=served.max_model_len)
        self.last_prompt_ids: list[int] = []
        self.current_request_id: str | None = None
        self._loader = loader
        self._local_models = local_models or stored_models
        self._release = release or (lambda old: old.shutdown(timeout=2.0))

    async def list_models(self) -> list[ModelChoice]:
        current = ModelChoice(self.info.name, self.info.quant, True, None, self.info.max_model_len)
        if self._loader is None:
            return [current]
        others = await asyncio.to_thread(self._local_models)
        return [current, *(m for m in others if m.name != current.name)]

    async def switch_model(self, name: str) -> None:
        """Load ``name`` in a new engine (off the UI loop), then retire the old one."""
        if name == self.info.name:
            return
        if self._loader is None:
            await super().switch_model(name)
            return
        engine = await asyncio.to_thread(self._loader, name)
        old, self.engine = self.engine, engine
        served = engine.model_info()
        self.info.name, self.info.quant, self.info.max_model_len = name, served.quant, served.max_model_len
        await asyncio.to_thread(self._release, old)

    async def stream_chat(self, messages: list[dict], params: GenerationParams) -> AsyncIterator[ChatDelta]:
        from localllm.sampling_params import SamplingParams

        limit = self.engine.max_model_len
        fitted = fit_chat(messages, self.engine.tokenizer.apply_chat_template, limit,
                          min(params.max_tokens, limit // 4), CHAT_OVERFLOW)
        prompt_ids = fitted.prompt_ids
        self.last_prompt_ids = prompt_ids
        room = limit - len(prompt_ids)
        notice = fitted.notice(limit)
        sampling = SamplingParams(
            max_tokens=min(params.max_tokens, room), temperature=params.temperature, top_p=params.top_p
        )
        request_id = f"chat-{uuid.uuid4().hex[:12]}"
        self.current_request_id = request_id
        finished = False
        try:
            async for out in self.engine.generate(
                prompt_ids, sampling, request_id=request_id, priority=params.priority
            ):
                t = out.timings
                finished = out.finished
                yield ChatDelta(
                    text=out.new_text,
                    finished=out.finished,
                    finish_reason=out.finish_reason,
                    num_prompt_tokens=out.num_prompt_tokens,
                    num_output_tokens=out.num_output_tokens,
                    ttft=t.ttft,
                    tokens_per_s=_rate(out.num_output_tokens, t.first_token, t.finished or out.time),
                    notice=notice,
                )
                notice = None
        finally:
            self.current_request_id = None
            if not finished:  # AsyncEngine.generate aborts too; this also covers a close before it started
                self.engine.abort(request_id)

    async def stats(self) -> LoadStats | None:
        # stats() waits for the engine lock, which a model step holds: keep it off the UI loop.
        stats = await asyncio.to_thread(self.engine.stats)
        return LoadStats(**{f.name: getattr(stats, f.name) for f in dataclasses.fields(LoadStats)})


def stored_models() -> list[ModelChoice]:
    """The pulled models of the local store (``localllm list``)."""
    from localllm.store.local import list_models

    return [ModelChoice(m.name, m.quant, False, m.size) for m in list_models()]


# ---------------------------------------------------------------- over HTTP

def parse_metrics(text: str) -> LoadStats | None:
    """Load from Prometheus text of localllm or vLLM (``*:num_requests_running`` etc.); None if absent."""
    values = metric_values(text)

    def first(*names: str) -> float | None:
        for n in names:
            if n in values:
                return values[n]
        return None

    running = first("num_requests_running")
    if running is None:
        return None
    kv = first("kv_cache_usage_perc", "gpu_cache_usage_perc", "kv_cache_usage")
    return LoadStats(
        num_running=int(running),
        num_waiting=int(first("num_requests_waiting") or 0),
        kv_cache_usage=kv,
        prefix_cache_queries=int(first("prefix_cache_queries", "gpu_prefix_cache_queries") or 0),
        prefix_cache_hits=int(first("prefix_cache_hits", "gpu_prefix_cache_hits") or 0),
        spec_drafted_tokens=int(first("spec_decode_num_draft_tokens") or 0),
        spec_accepted_tokens=int(first("spec_decode_num_accepted_tokens") or 0),
    )


def normalize_base_url(url: str) -> str:
    """``host:port``, ``http://host:port`` or ``…/v1`` -> ``http://host:port/v1``."""
    url = url.strip().rstrip("/")
    if "://" not in url:
        url = "http://" + url
    if not url.endswith("/v1"):
        url += "/v1"
    return url


class HTTPBackend(ChatBackend):
    """Replies from an OpenAI-compatible server (``localllm serve``, ``localllm chat``'s own API, …)."""

    def __init__(
        self, url: str, api_key: str | None = None, model: str | None = None, timeout: float = 600.0
    ) -> None:
        import httpx

        self.base_url = normalize_base_url(url)
        self.root_url = self.base_url[: -len("/v1")]
        self.client = httpx.AsyncClient(headers=auth_headers(api_key), timeout=httpx.Timeout(timeout, connect=10.0))
        self.info = ModelInfo(name=model or "?", where=self.root_url)
        self._model = model
        self._is_localllm = False
        self._has_metrics = True

    async def _models(self) -> list[dict]:
        """The entries of ``/v1/models``."""
        import httpx

        try:
            r = await self.client.get(f"{self.base_url}/models")
        except httpx.HTTPError as exc:
            raise BackendError(f"cannot reach {self.root_url}: {exc}") from exc
        if r.status_code != 200:
            raise BackendError(f"{self.base_url}/models answered HTTP {r.status_code}: {r.text[:200]}")
        return [m for m in r.json().get("data") or [] if isinstance(m, dict) and m.get("id")]

    def _use(self, entry: dict) -> None:
        """Talk to the model of this ``/v1/models`` entry from now on."""
        self.info.name = str(entry.get("id") or self.info.name)
        self._is_localllm = entry.get("owned_by") == "localllm"
        ctx = entry.get("max_model_len") or entry.get("context_length")
        self.info.max_model_len = int(ctx) if isinstance(ctx, (int, float)) else None
        quant = entry.get("quant") or entry.get("quantization")
        self.info.quant = str(quant) if quant else None

    async def start(self) -> None:
        models = await self._models()
        entry = None
        if self._model:
            entry = next((m for m in models if m.get("id") == self._model), None)
        elif models:
            entry = models[0]
        if entry is None and not self._model:
            raise BackendError(f"{self.root_url} serves no models")
        if entry is not None:
            self._use(entry)

    async def list_models(self) -> list[ModelChoice]:
        """``/v1/models``: every model the server can answer with (a multi-model server loads on demand)."""
        choices = []
        for m in await self._models():
            ctx = m.get("max_model_len") or m.get("context_length")
            quant = m.get("quant") or m.get("quantization")
            size = m.get("size_bytes")
            loaded = m.get("loaded")
            choices.append(ModelChoice(
                name=str(m["id"]),
                quant=str(quant) if quant else None,
                loaded=loaded if isinstance(loaded, bool) else None,
                size_bytes=int(size) if isinstance(size, (int, float)) else None,
                max_model_len=int(ctx) if isinstance(ctx, (int, float)) else None,
            ))
        return choices

    async def switch_model(self, name: str) -> None:
        entry = next((m for m in await self._models() if m.get("id") == name), None)
        if entry is None:
            raise BackendError(f"{self.root_url} does not serve {name}")
        self._use(entry)

    async def stream_chat(self, messages: list[dict], params: GenerationParams) -> AsyncIterator[ChatDelta]:
        import httpx

        body: dict = {
            "model": self.info.name,
            "messages": messages,
            "stream": True,
            "stream_options": {"include_usage": True},
            "temperature": params.temperature,
            "top_p": params.top_p,
            "max_tokens": params.max_tokens,
        }
        if self._is_localllm:
            body["priority"] = params.priority
            body["context_overflow"] = CHAT_OVERFLOW
        start = time.monotonic()
        first_token: float | None = None
        num_chunks = 0
        prompt_tokens: int | None = None
        output_tokens: int | None = None
        finish_reason: str | None = None
        try:
            async with self.client.stream("POST", f"{self.base_url}/chat/completions", json=body) as r:
                if r.status_code != 200:
                    detail = error_message((await r.aread()).decode("utf-8", "replace"))
                    raise BackendError(f"HTTP {r.status_code}: {detail}")
                dropped = int(r.headers.get(DROPPED_HEADER, "0") or 0)
                if dropped:
                    s = "" if dropped == 1 else "s"
                    yield ChatDelta(text="", notice=f"{dropped} earlier message{s} left out to fit the context "
                                    f"of {self.info.max_model_len} tokens")
                async for chunk in asse_chunks(r.aiter_lines()):
                    if chunk.get("error"):
                        raise BackendError(str(chunk["error"].get("message", chunk["error"])))
                    usage = chunk.get("usage")
                    if usage:
                        prompt_tokens = usage.get("prompt_tokens", prompt_tokens)
                        output_tokens = usage.get("completion_tokens", output_tokens)
                    for choice in chunk.get("choices") or []:
                        text = (choice.get("delta") or {}).get("content") or ""
                        finish_reason = choice.get("finish_reason") or finish_reason
                        if not text:
                            continue
                        now = time.monotonic()
                        if first_token is None:
                            first_token = now
                        num_chunks += 1
                        yield ChatDelta(
                            text=text,
                            num_output_tokens=num_chunks,
                            ttft=first_token - start,
                            tokens_per_s=_rate(num_chunks, first_token, now),
                        )
        except httpx.HTTPError as exc:
            raise BackendError(f"{self.root_url}: {exc}") from exc
        now = time.monotonic()
        n = output_tokens if output_tokens is not None else num_chunks
        yield ChatDelta(
            text="",
            finished=True,
            finish_reason=finish_reason,
            num_prompt_tokens=prompt_tokens,
            num_output_tokens=n,
            ttft=None if first_token is None else first_token - start,
            tokens_per_s=_rate(n, first_token, now),
        )

    async def stats(self) -> LoadStats | None:
        import httpx

        if not self._has_metrics:
            return None
        try:
            r = await self.client.get(f"{self.root_url}/metrics", timeout=5.0)
        except httpx.HTTPError:
            return None
        if r.status_code == 404:
            self._has_metrics = False
            return None
        if r.status_code != 200:
            return None
        stats = parse_metrics(r.text)
        if stats is None:
            self._has_metrics = False
        return stats

    async def close(self) -> None:
        await self.client.aclose()
