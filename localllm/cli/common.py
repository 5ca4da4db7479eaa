"""What several CLI commands share: the default model, one-line errors, logging setup."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

import typer

from localllm.errors import InvalidRequestError, LocalLLMError

DEFAULT_MODEL = "smollm2:135m"
# The device an engine runs on (serve, chat): resolved by localllm.config.device.resolve_device
DEVICE_OPTION = typer.Option(
    "auto", "--device", help="auto (the GPU when there is one, else the CPU), cpu, cuda or cuda:N."
)


def fail(message: str, code: int = 1) -> None:
    """Print one readable error line and exit."""
    typer.echo(f"Error: {message}", err=True)
    raise typer.Exit(code)


@contextmanager
def cli_errors() -> Iterator[None]:
    """A command's expected failures as one line each: bad input exits 2, other localllm and OS
    errors 1, Ctrl-C 130 (messages on one line: their whitespace collapsed)."""
    try:
        yield
    except InvalidRequestError as e:
        fail(" ".join(e.message.split()), 2)
    except LocalLLMError as e:
        fail(" ".join(e.message.split()), 1)
    except OSError as e:
        fail(" ".join(str(e).split()), 1)
    except KeyboardInterrupt:
        fail("interrupted", 130)


def setup_logging(verbose: bool) -> None:
    logging.basicConfig(
        level=logging.INFO if verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )


def human_count(n: int) -> str:
    """1234567 -> "1.2M"."""
    for div, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= div:
            return f"{n / div:.1f}{suffix}"
    return str(n)


def parameters_text(total: int | None, active: int | None, unknown: str | None = "-") -> str | None:
    """"30.5B (3.3B active)" for a mixture of experts, "1.2B" for a dense model, ``unknown`` without a count."""
    if not total:
        return unknown
    if active and active < total:
        return f"{human_count(total)} ({human_count(active)} active)"
    return human_count(total)
