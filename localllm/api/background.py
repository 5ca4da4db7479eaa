"""The request handlers' background work (chat templating, tokenizing long prompts): on worker
threads of the lowest priority, below the engine's step thread.

Tokenizing a 6.5 MB prompt took one of a 2-core machine's cores for 4 s, and the engine's
OpenMP threads, each of a step's many parallel regions waiting for the one that was preempted,
delivered no token to a stream running meanwhile. At nice 19 (Linux: per thread) the stream's
largest gap is a fraction of the tokenizing time and the long prompt takes ~5x longer; at nice 10
a stream still waited 1.8 s, and ``SCHED_IDLE`` made the prompt wait a minute. Elsewhere the
workers run at the normal priority. An ordinary prompt's milliseconds of tokenizing are not
noticeably later.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import os
import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

_WORKERS: concurrent.futures.ThreadPoolExecutor | None = None
_LOCK = threading.Lock()


BACKGROUND_NICENESS = 19


def _yield_to_the_engine() -> None:
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), BACKGROUND_NICENESS)
    except (AttributeError, OSError):  # not Linux: as it is
        pass


def _workers() -> concurrent.futures.ThreadPoolExecutor:
    global _WORKERS
    with _LOCK:
        if _WORKERS is None:
            _WORKERS = concurrent.futures.ThreadPoolExecutor(thread_name_prefix="localllm-api-background",
                                                             initializer=_yield_to_the_engine)
        return _WORKERS


async def in_background(fn: Callable[..., T], *args) -> T:
    """``await fn(*args)`` on a background worker (as ``asyncio.to_thread``, at idle priority)."""
    return await asyncio.get_running_loop().run_in_executor(_workers(), functools.partial(fn, *args))
