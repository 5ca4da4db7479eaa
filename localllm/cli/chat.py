"""``localllm chat``: the terminal chat (:mod:`localllm.tui`), registered on the main Typer app by :func:`register`."""

from __future__ import annotations

import dataclasses
import logging
from typing import Optional

import typer

from localllm.errors import LocalLLMError
from localllm.tui.serve import served_name


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


def chat(
    model: Optional[str] = typer.Argument(
        None,
        help="Catalog name (smollm2:135m), hub name, or path to a .gguf file. Default: the configured model.",
    ),
    attach: Optional[str] = typer.Option(
        None,
        "--attach",
        metavar="URL",
        help="Chat with a running localllm (or any OpenAI-compatible) server instead of loading the model.",
    ),
    serve: bool = typer.Option(
        True, "--serve/--no-serve", help="Also serve the OpenAI API from this process."
    ),
    host: Optional[str] = typer.Option(
        None, "--host", help="Address of the served API (default: configured host)."
    ),
    port: Optional[int] = typer.Option(
        None, "--port", help="Port of the served API (default: configured port)."
    ),
    api_key: Optional[str] = typer.Option(
        None,
        "--api-key",
        help="Key the served API requires / the attached server wants (default: configured).",
    ),
    conversation: Optional[str] = typer.Option(None, "--open", help="Open a saved conversation by id."),
    dtype: Optional[str] = typer.Option(None, "--dtype", help="float32 (reference) or bfloat16."),
    max_model_len: Optional[int] = typer.Option(None, "--max-model-len"),
    kv_cache_memory: Optional[str] = typer.Option(None, "--kv-cache-memory", help="e.g. 512MiB, 2GiB."),
) -> None:
    """Chat with a model in a terminal UI, while serving the OpenAI API from the same engine.

    API clients (editors, scripts) share batches with what you type; the chat's requests go first.

    With --attach URL the chat talks to a server that is already running instead.
    """
    from localllm.config.settings import load_settings
    from localllm.tui.app import ChatApp
    from localllm.tui.backend import HTTPBackend

    try:
        settings = load_settings(
            {
                "model": model,
                "host": host,
                "port": port,
                "api_key": api_key,
                "dtype": dtype,
                "max_model_len": max_model_len,
                "kv_cache_memory": kv_cache_memory,
            }
        )
        if attach:
            backend = HTTPBackend(attach, api_key=settings.api_key, model=model)
            _log_to_file()
            app = ChatApp(backend, conversation_id=conversation)
            app.run()
            raise typer.Exit(app.return_code or 0)
        _engine, backend, server = _load(settings, serve)
    except LocalLLMError as exc:
        typer.echo(f"Error: {exc.message}", err=True)
        raise typer.Exit(1)
    _log_to_file()
    app = ChatApp(backend, api_server=server, conversation_id=conversation)
    try:
        app.run()
    finally:
        backend.engine.shutdown(timeout=2.0)  # the engine of the model chatted with last (ctrl+l switches)
    raise typer.Exit(app.return_code or 0)


def _load(settings, serve: bool):
    from localllm.engine.async_engine import AsyncEngine
    from localllm.tui.backend import EngineBackend
    from localllm.tui.serve import ApiServer

    config = settings.engine_config()  # AsyncEngine.from_config pulls a catalog model on first use
    typer.echo(f"Loading {settings.model} …", err=True)
    engine = AsyncEngine.from_config(config)
    name = settings.served_model_name or served_name(settings.model)

    def load(model: str) -> AsyncEngine:  # another model, same settings (the chat's model picker)
        return AsyncEngine.from_config(dataclasses.replace(settings, model=model).engine_config())

    backend = EngineBackend(engine, name, loader=load)
    server = (
        ApiServer(engine, name, host=settings.host, port=settings.port, api_key=settings.api_key)
        if serve
        else None
    )
    return engine, backend, server


def register(app: typer.Typer) -> None:
    """Add ``chat`` to the ``localllm`` command."""
    app.command("chat")(chat)
