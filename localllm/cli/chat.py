"""``localllm chat``: the terminal chat (:mod:`localllm.tui`), registered on the main Typer app by :func:`register`."""

from __future__ import annotations

import dataclasses
import logging
from typing import Annotated

import typer

from localllm.api.in_process import InProcessServer, served_name
from localllm.cli.common import DEVICE_OPTION, cli_errors
from localllm.cli.flags import setting_flags
from localllm.config.device import resolve_device
from localllm.config.settings import SETTINGS, load_settings
from localllm.tui.backend import EngineBackend

# serve's settings but those of replicas (localllm.cluster), which a chat in one process has no use for
CHAT_SETTINGS = tuple(s.name for s in SETTINGS if s.in_settings and s.applies != "cluster")


def _log_to_file() -> str:
    """While the TUI owns the terminal, log records (engine, uvicorn) go to a file instead."""
    from localllm.config.paths import home_dir

    log_dir = home_dir() / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    path = log_dir / "chat.log"
    handler = logging.FileHandler(path, encoding="utf-8")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per /metrics poll otherwise
    return str(path)


@setting_flags(CHAT_SETTINGS)
def chat(
    attach: Annotated[str | None, typer.Option(
        "--attach", metavar="URL",
        help="Chat with a running localllm (or any OpenAI-compatible) server instead of loading the model.",
    )] = None,
    serve: Annotated[bool, typer.Option(
        "--serve/--no-serve", help="Also serve the OpenAI API from this process (as `serve` would).")] = True,
    device: str = DEVICE_OPTION,
    conversation: Annotated[str | None, typer.Option("--open", help="Open a saved conversation by id.")] = None,
    setting_flags: dict | None = None,
) -> None:
    """Chat with a model in a terminal UI, while serving the OpenAI API from the same models.

    API clients (editors, scripts) share batches with what you type; the chat's requests go first.
    The API serves the store's models as `localllm serve` does, with the same flags.

    With --attach URL the chat talks to a server that is already running instead (--api-key: its key).
    """
    from localllm.tui.app import ChatApp
    from localllm.tui.backend import HTTPBackend

    flags = setting_flags or {}
    with cli_errors():
        settings = load_settings(flags)
        if attach:
            backend = HTTPBackend(attach, api_key=settings.api_key, model=flags.get("model"))
            _log_to_file()
            app = ChatApp(backend, conversation_id=conversation)
            app.run()
            raise typer.Exit(app.return_code or 0)
        if not settings.served_model_name:
            settings = dataclasses.replace(settings, served_model_name=served_name(settings.model))
        typer.echo(f"Loading {settings.model} …", err=True)
        server = InProcessServer.load(settings, resolve_device(device))
    try:
        backend = _leasing_backend(server)
        _log_to_file()
        app = ChatApp(backend, api_server=server if serve else None, conversation_id=conversation)
        app.run()
    finally:
        server.close()
    raise typer.Exit(app.return_code or 0)


def _leasing_backend(server: InProcessServer) -> EngineBackend:
    """The UI's backend: the engine of the model it talks to, held through a lease on the server's pool
    (the pinned model first; the model picker leases another and lets the last one go)."""
    first = server.lease(server.model_name)
    leases = {id(first.engine): first}

    def load(name: str):
        lease = server.lease(name)
        leases[id(lease.engine)] = lease
        return lease.engine

    def let_go(engine) -> None:
        lease = leases.pop(id(engine), None)
        if lease is not None:
            server.release(lease)

    return EngineBackend(first.engine, server.model_name, loader=load, release=let_go)


def register(app: typer.Typer) -> None:
    """Add ``chat`` to the ``localllm`` command."""
    app.command("chat")(chat)
