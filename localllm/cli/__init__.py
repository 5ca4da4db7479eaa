"""The ``localllm`` command line: ``app`` (the Typer app, built in :mod:`localllm.cli.commands`) and ``main``.

``python -m localllm.cli ARGS`` runs it too (:mod:`localllm.cli.__main__`).
"""

from __future__ import annotations

__all__ = ["app", "main"]


def __getattr__(name: str):
    # Loaded on first use, so that a command module (cli/quantize.py) can import
    # localllm.cli.common without building the whole app in the middle of its own import.
    if name in __all__:
        from localllm.cli import commands

        return getattr(commands, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
