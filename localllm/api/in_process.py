"""``chat``'s server: the pool and the API app of ``serve`` (:func:`~localllm.api.launch.build_pool`,
:func:`~localllm.api.launch.server_app`: one composition for both), in the chat's own process.

An event loop on a thread of its own owns the pool, and the API, when it is served, runs on that loop
too: HTTP handlers and the terminal UI never wait on each other's loop, while both feed the same engines
(thread-safe), so an editor's request and a message typed in the UI are scheduled in the same batches.
The UI holds the model it talks to through :meth:`InProcessServer.lease`, as a request does, so the
pool never unloads it under the UI; the models it switches away from follow the pool's keep-alive.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import threading
import time
from typing import TYPE_CHECKING, Any

from localllm.api.launch import build_pool, check_server_settings, server_app

if TYPE_CHECKING:
    from localllm.serving.pool import Lease, ModelPool

log = logging.getLogger(__name__)


def served_name(model: str) -> str:
    """The name ``chat`` gives ``model`` in the API: as typed, or a .gguf file's name without the suffix."""
    if os.path.isfile(model):
        return os.path.basename(model).removesuffix(".gguf")
    return model


class InProcessServer:
    """The pool's event loop runs from construction to :meth:`close`; :meth:`start` serves the API on it
    (raising OSError at once when the port is taken), :meth:`stop` stops serving."""

    def __init__(self, settings: Any, pool: ModelPool, model_name: str | None) -> None:
        self.settings = settings
        self.pool = pool
        self.model_name = model_name  # the pinned model: the one the chat opens with
        self.host: str = settings.host
        self.port: int = settings.port
        self.error: BaseException | None = None
        self._server: Any = None  # uvicorn.Server while serving
        self._serving: Any = None  # its concurrent.futures.Future
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="localllm-chat-pool", daemon=True)
        self._thread.start()

    @classmethod
    def load(cls, settings: Any, device: str = "cpu") -> InProcessServer:
        """Check the settings as ``serve`` does, load and pin the settings' model."""
        check_server_settings(settings)
        pool, name = build_pool(settings, device, pin=True)
        return cls(settings, pool, name)

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    @property
    def running(self) -> bool:
        return self._serving is not None and not self._serving.done()

    def lease(self, name: str | None = None) -> Lease:
        """A hold on model ``name`` (None: the pinned one), loaded first if need be; from any thread."""
        return asyncio.run_coroutine_threadsafe(self.pool.lease(name), self._loop).result()

    def release(self, lease: Lease) -> None:
        """Give ``lease`` back; done when this returns (from any thread but the pool's own)."""

        async def give_back() -> None:
            lease.release()

        asyncio.run_coroutine_threadsafe(give_back(), self._loop).result()

    def start(self, timeout: float = 15.0) -> None:
        import uvicorn

        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((self.host, self.port))
        except OSError:
            sock.close()
            raise
        self.port = sock.getsockname()[1]  # the real one when port 0 was asked for
        config = uvicorn.Config(server_app(self.settings, self.pool), lifespan="off", log_config=None,
                                access_log=False, log_level="warning", timeout_graceful_shutdown=2)
        server = uvicorn.Server(config)
        self._server = server
        self._serving = asyncio.run_coroutine_threadsafe(self._serve(server, sock), self._loop)
        deadline = time.monotonic() + timeout
        while not server.started and not self._serving.done() and time.monotonic() < deadline:
            time.sleep(0.01)
        if not server.started:
            self.stop()
            raise RuntimeError(f"the API server did not start on {self.url}: {self.error or 'timeout'}")

    async def _serve(self, server: Any, sock: socket.socket) -> None:
        try:
            await server.serve(sockets=[sock])
        except BaseException as exc:
            self.error = exc
            log.exception("the API server stopped")
        finally:
            sock.close()

    def stop(self, timeout: float = 5.0) -> None:
        """Stop serving the API (the pool stays)."""
        if self._server is not None:
            self._server.should_exit = True
        if self._serving is not None:
            with contextlib.suppress(Exception):
                self._serving.result(timeout)
        self._server = self._serving = None

    def close(self, timeout: float = 2.0) -> None:
        """Stop serving, shut the pool's engines down, end the loop."""
        self.stop()
        self.pool.shutdown(timeout=timeout)
        if self._loop.is_running():
            with contextlib.suppress(Exception):
                asyncio.run_coroutine_threadsafe(_cancel_tasks(), self._loop).result(timeout)
            self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout)
        if not self._thread.is_alive():
            self._loop.close()


async def _cancel_tasks() -> None:
    """Cancel the loop's other tasks (the pool's reaper and unloads) and wait for them."""
    tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
