"""The plumbing between an API request and the engine: :class:`Run` (the engine requests behind one
API request, their deltas merged) and :class:`EventStream` (server-sent events that abort their
run however the response ends). The OpenAI and Anthropic routes share them."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from localllm.engine.async_engine import AsyncEngine
from localllm.outputs import RequestOutput
from localllm.sampling_params import SamplingParams


class Run:
    """The engine requests behind one API request (one per prompt), their deltas merged.

    :meth:`start` submits them all and raises the first submission error (invalid prompt, full
    queue) after aborting the others, so it can still become an HTTP status. :meth:`events`
    yields ``(prompt_index, delta)``; :meth:`close` aborts whatever has not finished.
    """

    def __init__(
        self,
        engine: AsyncEngine,
        prompts: list[str | list[int]],
        params: SamplingParams,
        priority: int,
        request_id: str,
    ) -> None:
        self.prompts = prompts  # as submitted (token ids after the route's rendering and encoding)
        self._gens = [
            engine.generate(p, params, request_id if len(prompts) == 1 else f"{request_id}-{i}", priority)
            for i, p in enumerate(prompts)
        ]
        self._queue: asyncio.Queue = asyncio.Queue()
        self._tasks: list[asyncio.Task] = []
        self._error: BaseException | None = None

    async def start(self) -> None:
        self._tasks = [asyncio.create_task(self._pump(i, g)) for i, g in enumerate(self._gens)]
        # AsyncEngine.generate validates and queues its request before it first suspends, so
        # one pass of the event loop settles every submission.
        await asyncio.sleep(0)
        if self._error is not None:
            self.close()
            raise self._error

    async def _pump(self, index: int, gen: AsyncIterator[RequestOutput]) -> None:
        try:
            async for out in gen:
                self._queue.put_nowait((index, out))
        except Exception as exc:  # noqa: BLE001 - handed to the consumer
            self._error = self._error or exc
            self._queue.put_nowait((index, exc))
        finally:
            self._queue.put_nowait((index, None))

    async def events(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        remaining = len(self._tasks)
        while remaining:
            index, item = await self._queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item

    def close(self) -> None:
        for task in self._tasks:
            if not task.done():
                task.cancel()


class EventStream(StreamingResponse):
    """Server-sent events that abort their run however the response ends (even before it starts)."""

    def __init__(self, content: AsyncIterator[str], run: Run) -> None:
        super().__init__(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self._run = run
        self._on_close: list[Callable[[], None]] = []

    def on_close(self, fn: Callable[[], None]) -> None:
        """``fn()`` runs once the response has ended, however it ends (the model's lease, ...)."""
        self._on_close.append(fn)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._run.close()
            for fn in self._on_close:
                fn()
