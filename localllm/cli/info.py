"""``localllm config`` (the effective settings and where each comes from) and ``localllm version``."""

from __future__ import annotations

import typer

from localllm.cli.common import fail
from localllm.errors import LocalLLMError


def config() -> None:
    """Print every setting and LOCALLLM_* variable: its value, where that comes from (default <
    config.toml < LOCALLLM_* env < flags), its type, flag and meaning."""
    from localllm.config.settings import describe, load_settings

    try:
        settings = load_settings()
    except LocalLLMError as exc:
        fail(exc.message)
    for line in describe(settings):
        typer.echo(line)


def version() -> None:
    """Print localllm's version."""
    from localllm import __version__

    typer.echo(f"localllm {__version__}")
