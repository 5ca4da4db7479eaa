"""AsyncEngine: one LLMEngine per process, stepped by a background thread, fanned out to asyncio.

Many producers (API handlers, the TUI) call :meth:`AsyncEngine.generate` from any event loop;
the step thread is the only one that runs the model. Every engine call holds ``_lock``, so
adding, aborting and reading stats are safe from any thread.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable

from localllm.config import EngineConfig
from localllm.engine import EngineStats, LLMEngine
from localllm.errors import EngineDeadError, LocalLLMError
from localllm.outputs import RequestOutput
from localllm.sampling_params import SamplingParams

log = logging.getLogger(__name__)


class _Stream:
    __slots__ = ("loop", "queue", "num_samples", "num_finished")

    def __init__(self, loop: asyncio.AbstractEventLoop, num_samples: int) -> None:
        self.loop = loop
        self.queue: asyncio.Queue = asyncio.Queue()
        self.num_samples = num_samples
        self.num_finished = 0


class AsyncEngine:
    """Thread-safe, asyncio-facing front of one :class:`LLMEngine`."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._streams: dict[str, _Stream] = {}
        self._observers: list[Callable[[list[RequestOutput]], None]] = []
        self._accepting = True
        self._stop = False
        self._dead: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="localllm-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_config(cls, config: EngineConfig) -> "AsyncEngine":
        return cls(LLMEngine(config))

    # ---------------------------------------------------------------- facts

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def is_alive(self) -> bool:
        return self._dead is None and self._thread.is_alive()

    def stats(self) -> EngineStats:
        with self._lock:
            return self.engine.stats()

    def add_observer(self, fn: Callable[[list[RequestOutput]], None]) -> None:
        """``fn(outputs)`` runs on the step thread after every step that produced outputs."""
        self._observers.append(fn)

    # ---------------------------------------------------------------- requests

    async def generate(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        priority: int = 0,
    ) -> AsyncIterator[RequestOutput]:
        """Yield deltas of one request until all its samples finish.

        Raises InvalidRequestError / QueueFullError before the first delta. If the consumer
        stops early (client gone, task cancelled), the request is aborted and its KV freed.
        """
        if self._dead is not None:
            raise EngineDeadError(f"the engine stopped: {self._dead}")
        if not self._accepting:
            raise EngineDeadError("the server is shutting down")
        params = params or SamplingParams()
        request_id = request_id or uuid.uuid4().hex
        prompt_ids = self.engine.encode_prompt(prompt)  # tokenize outside the lock
        stream = _Stream(asyncio.get_running_loop(), params.n)
        with self._lock:
            if request_id in self._streams:
                request_id = f"{request_id}-{uuid.uuid4().hex[:8]}"
            self.engine.add_request(prompt_ids, params, req_id=request_id, priority=priority)
            self._streams[request_id] = stream
        self._wake.set()
        finished = False
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    stream.num_finished += 1
                    if stream.num_finished == stream.num_samples:
                        finished = True
                        return
        finally:
            if not finished:
                self.abort(request_id)
            else:
                with self._lock:
                    self._streams.pop(request_id, None)

    def abort(self, request_id: str) -> None:
        """Stop a request now and free its KV blocks; unknown ids are ignored."""
        with self._lock:
            self.engine.abort(request_id)
            self._streams.pop(request_id, None)

    # ---------------------------------------------------------------- the step thread

    def _run(self) -> None:
        try:
            while not self._stop:
                with self._lock:
                    busy = self.engine.has_unfinished_requests()
                    outputs = self.engine.step() if busy else []
                    targets = [(o, self._streams.get(o.req_id)) for o in outputs]
                if not busy:
                    self._wake.wait(0.05)
                    self._wake.clear()
                    continue
                for out, stream in targets:
                    if stream is not None:
                        stream.loop.call_soon_threadsafe(stream.queue.put_nowait, out)
                if outputs:
                    for fn in self._observers:
                        try:
                            fn(outputs)
                        except Exception:  # noqa: BLE001 - an observer must never stop the engine
                            log.exception("engine observer failed")
        except BaseException as exc:  # noqa: BLE001 - report to every waiting client, then stop
            log.exception("engine step loop crashed")
            self._dead = exc
            err = EngineDeadError(f"the engine stopped: {exc!r}")
            with self._lock:
                streams = list(self._streams.values())
                self._streams.clear()
            for stream in streams:
                stream.loop.call_soon_threadsafe(stream.queue.put_nowait, err)

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop accepting, let in-flight requests finish for up to ``timeout`` s, abort the rest."""
        self._accepting = False
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.is_alive:
            with self._lock:
                if not self.engine.has_unfinished_requests():
                    break
            time.sleep(0.02)
        with self._lock:
            leftover = list(self._streams.items())
            for rid, _ in leftover:
                self.engine.abort(rid)
            self._streams.clear()
        for _, stream in leftover:
            stream.loop.call_soon_threadsafe(
                stream.queue.put_nowait, EngineDeadError("the server shut down before the request finished")
            )
        self._stop = True
        self._wake.set()
        self._thread.join(timeout=5)


__all__ = ["AsyncEngine", "LocalLLMError"]
