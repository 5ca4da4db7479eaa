"""``localllm serve``: the command, its flags, and the choice between one server
(:func:`localllm.api.launch.run_server`, or :func:`~localllm.api.launch.start_in_background` in the background) and
replicas on Ray Serve (:func:`localllm.cluster.launch.run_cluster`, with ``--replicas``).

Flags are the settings of :mod:`localllm.config.settings` (one per setting, named as in the table):
``LOCALLLM_HOME/config.toml`` (or ``--config FILE``), then ``LOCALLLM_*`` variables, then flags.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from localllm.api.launch import DEFAULT_SHUTDOWN_TIMEOUT, run_server, start_in_background
from localllm.cli.common import DEVICE_OPTION, setup_logging
from localllm.cli.flags import flags_argv, setting_flags
from localllm.cluster import require_ray
from localllm.config.device import resolve_device
from localllm.config.settings import SETTING_NAMES, load_settings
from localllm.errors import InvalidRequestError, LocalLLMError


@setting_flags(SETTING_NAMES)
def serve(
    config: Optional[Path] = typer.Option(
        None,
        "--config",
        help="Settings file instead of LOCALLLM_HOME/config.toml (keys: the flag names with underscores).",
    ),
    device: str = DEVICE_OPTION,
    shutdown_timeout: float = typer.Option(
        DEFAULT_SHUTDOWN_TIMEOUT,
        "--shutdown-timeout",
        help="Seconds in-flight requests get on SIGINT/SIGTERM.",
    ),
    detach: bool = typer.Option(
        False, "--detach", "-d", help="Run in the background; `localllm stop` stops it."
    ),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Log engine events and every request."),
    setting_flags: dict | None = None,
) -> None:
    """Serve the store's models over an OpenAI-compatible HTTP API (/v1/chat/completions, ...), each loaded on
    its first request; with MODEL, that one is loaded now and is the default."""
    setup_logging(verbose)
    flags = setting_flags or {}
    try:
        if config is not None and not config.is_file():
            raise InvalidRequestError(f"the config file {config} does not exist")
        settings = load_settings(flags, path=config)
        if settings.replicas is not None or settings.min_replicas is not None or settings.max_replicas is not None:
            if detach:
                raise InvalidRequestError("--replicas runs in the foreground (Ray keeps its own processes); "
                                          "drop --detach")
            require_ray()
            from localllm.cluster.launch import run_cluster  # imports Ray: an optional extra

            status = run_cluster(settings, resolve_device(device), verbose)
        elif detach:
            extra = {"config": config, "device": device, "shutdown_timeout": shutdown_timeout}
            status = start_in_background(settings, flags_argv({**flags, **extra}, verbose))
        else:
            status = run_server(settings, resolve_device(device), shutdown_timeout, verbose)
    except LocalLLMError as exc:
        typer.echo(f"Error: {' '.join(exc.message.split())}", err=True)
        raise typer.Exit(1) from None
    raise typer.Exit(status)


def register(app: typer.Typer) -> None:
    """Add ``serve`` to ``app``."""
    app.command("serve")(serve)
