"""``localllm tray``: the tray icon (:mod:`localllm.tray`), registered on the main Typer app by :func:`register`."""

from __future__ import annotations

from typing import Optional

import typer


def tray(
    url: Optional[str] = typer.Option(
        None, "--url", metavar="URL",
        help="The server to watch (default: the detached server's address, else the configured host:port).",
    ),
) -> None:
    """Show a tray icon for the localllm server: its state, loaded models, chat, start / stop, logs."""
    from localllm.config.settings import load_settings
    from localllm.serving.service import read_record
    from localllm.tray.app import TrayApp, TrayUnavailable, load_pystray
    from localllm.tray.model import ServerControl, TrayController

    try:
        pystray = load_pystray()
    except TrayUnavailable as exc:
        typer.echo(f"localllm tray: {exc}", err=True)
        raise typer.Exit(1)
    settings = load_settings()
    rec = read_record()
    base_url = url or (f"http://{rec.host}:{rec.port}" if rec else settings.base_url)
    server = ServerControl(host=settings.host, port=settings.port, api_key=settings.api_key)
    controller = TrayController(base_url, api_key=settings.api_key, server=server)
    TrayApp(controller, pystray).run()


def register(app: typer.Typer) -> None:
    """Add ``tray`` to the ``localllm`` command."""
    app.command("tray")(tray)
