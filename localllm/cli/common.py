"""What several CLI commands share: the default model, one-line errors, logging setup."""

from __future__ import annotations

import logging

import typer

DEFAULT_MODEL = "smollm2:135m"


def fail(message: str, code: int = 1) -> None:
    """Print one readable error line and exit."""
    typer.echo(f"Error: {message}", err=True)
    raise typer.Exit(code)


def setup_logging(verbose: bool) -> None:
    logging.basicConfig(
        level=logging.INFO if verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
