"""Download progress: one rich bar per file (size, rate, ETA) on stderr, silent when disabled.

:class:`Bars` is driven directly by the HTTP downloads and, through :meth:`Bars.tqdm_class`,
by ``huggingface_hub.hf_hub_download``. Knows nothing of models or the store.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, Self

Listener = Callable[[str, int, "int | None"], None]
"""Told ``(label, completed, total)`` of a file's bar at each change (an API's progress stream)."""


class Bars:
    """One rich progress bar per file (size, rate, ETA) on stderr; silent when disabled."""

    def __init__(self, enabled: bool, listener: Listener | None = None) -> None:
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            DownloadColumn,
            Progress,
            TextColumn,
            TimeRemainingColumn,
            TransferSpeedColumn,
        )

        self.progress = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            DownloadColumn(),
            TransferSpeedColumn(),
            TimeRemainingColumn(),
            console=Console(stderr=True),
            disable=not enabled,
        )
        self.listener = listener
        self._state: dict[Any, list] = {}  # task -> [label, completed, total]

    def __enter__(self) -> Self:
        self.progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.progress.stop()

    def add(self, label: str, total: int | None, completed: int = 0) -> Any:
        task = self.progress.add_task(short(label), total=total, completed=completed)
        self._state[task] = [label, completed, total]
        self._tell(task)
        return task

    def update(self, task: Any, *, advance: float | None = None, total: int | None = None,
               completed: int | None = None) -> None:
        """Move a file's bar (by ``advance`` bytes, or to ``completed`` of ``total``)."""
        self.progress.update(task, advance=advance, total=total, completed=completed)
        state = self._state[task]
        if completed is not None:
            state[1] = completed
        if advance:
            state[1] += int(advance)
        if total is not None:
            state[2] = total
        self._tell(task)

    def _tell(self, task: Any) -> None:
        if self.listener is not None:
            label, completed, total = self._state[task]
            self.listener(label, completed, total)

    def tqdm_class(self, label: str) -> Any:
        """A tqdm stand-in for ``hf_hub_download(tqdm_class=...)`` that drives a rich bar."""
        return functools.partial(TqdmToRich, self, label)


class TqdmToRich:
    """The part of tqdm's interface that ``hf_hub_download`` uses, advancing a :class:`Bars` bar."""

    def __init__(self, bars: Bars, label: str, *, total: int | None = None, initial: int = 0, **_: Any):
        self._bars = bars
        self._task = bars.add(label, total, initial)

    def update(self, n: float | None = 1) -> None:
        self._bars.update(self._task, advance=n or 0)

    def close(self) -> None:
        pass

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def short(label: str, width: int = 40) -> str:
    """A label cut to ``width`` characters from the left (the end of a file name matters most)."""
    return label if len(label) <= width else "…" + label[-(width - 1) :]

