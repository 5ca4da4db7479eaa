"""The ``localllm`` command line: ``app`` (the Typer app, built in :mod:`localllm.cli.commands`) and ``main``.

``python -m localllm.cli ARGS`` runs it too (:mod:`localllm.cli.__main__`).
"""

from __future__ import annotations

from localllm.cli.commands import app, main

__all__ = ["app", "main"]
