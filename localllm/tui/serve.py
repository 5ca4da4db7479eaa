"""The OpenAI-compatible API served from the chat's own process, on the chat's own engine.

Uvicorn runs in a thread with its own event loop: HTTP handlers and the TUI never wait on each
other's loop, while both feed the one :class:`~localllm.engine.async_engine.AsyncEngine` (thread-safe),
so an editor's request and a message typed in the TUI are scheduled in the same batches.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import threading
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from localllm.engine.async_engine import AsyncEngine

log = logging.getLogger(__name__)


def served_name(model: str) -> str:
    """The name API clients use for ``model``: as typed, or a .gguf file's name without the suffix."""
    if os.path.isfile(model):
        return os.path.basename(model).removesuffix(".gguf")
    return model


class ApiServer:
    """``start()`` binds (raising OSError at once if the port is taken) and serves in a thread."""

    def __init__(
        self,
        engine: AsyncEngine,
        served_model_name: str,
        host: str = "127.0.0.1",
        port: int = 8000,
        api_key: str | None = None,
    ) -> None:
        self.engine = engine
        self.served_model_name = served_model_name
        self.host = host
        self.port = port
        self.api_key = api_key
        self._server = None
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self, timeout: float = 15.0) -> None:
        import uvicorn

        from localllm.api.guard import allowed_host_names
        from localllm.api.server import build_app

        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((self.host, self.port))
        except OSError:
            sock.close()
            raise
        self.port = sock.getsockname()[1]  # the real one when port 0 was asked for
        fastapi_app = build_app(
            self.engine, self.served_model_name, self.api_key, allowed_hosts=allowed_host_names(self.host, None)
        )
        config = uvicorn.Config(
            fastapi_app, log_config=None, access_log=False, log_level="warning", timeout_graceful_shutdown=2
        )
        server = uvicorn.Server(config)
        self._server = server

        def serve() -> None:
            try:
                asyncio.run(server.serve(sockets=[sock]))
            except BaseException as exc:
                self.error = exc
                log.exception("the API server stopped")
            finally:
                sock.close()

        self._thread = threading.Thread(target=serve, name="localllm-chat-api", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not server.started and self._thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.01)
        if not server.started:
            self.stop()
            raise RuntimeError(f"the API server did not start on {self.url}: {self.error or 'timeout'}")

    def stop(self, timeout: float = 5.0) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout)
        self._thread = None
