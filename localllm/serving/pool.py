"""The model pool: every model a server can serve, loaded on first use, one AsyncEngine each.

:class:`~localllm.serving.catalog.ModelCatalog` knows what can be served (the local store, plus
models registered by name such as ``localllm serve MODEL``'s); :class:`ModelPool` loads them on
demand and unloads them again.

Contracts:

- :meth:`ModelPool.lease` (or :meth:`ModelPool.acquire`, its ``async with`` form) gives a
  :class:`Lease` on a loaded model; the first lease of a model loads it, once: concurrent first
  requests await the same load. Loading (planning, then building the engine) runs on worker
  threads, so requests to other models go on meanwhile; loads of different models run one at a
  time, so that each sees the memory the last one took.
- A model with a lease out (a running request, a stream) is never unloaded: not by keep-alive, not
  by eviction, not by :meth:`ModelPool.unload` (which then unloads it when its last lease ends).
- Keep-alive: after its last lease a model stays loaded for its keep-alive (the server's, or the
  last request's ``keep_alive``), then :meth:`ModelPool.expire_idle` (run every second by the
  reaper task) unloads it; ``None`` keeps it loaded, ``0`` unloads it at once. A pinned model
  (``serve MODEL``'s) never expires and is never evicted.
- Before a load, the memory planner (:mod:`localllm.serving.planner`) says what it needs; while it does not
  fit in what is free (``memory_budget`` minus what loaded models hold, else the free memory now) or
  ``max_loaded_models`` are loaded, idle models are unloaded, least recently used first. If busy
  models hold the memory, the load waits for them up to ``load_wait_timeout`` seconds, then fails
  with :class:`~localllm.errors.ModelBusyError` (503, Retry-After); if it would not fit even with
  every unpinned model unloaded, it fails at once with
  :class:`~localllm.errors.InsufficientMemoryError` (507), one line saying what it needs and what
  is free.
- Unloading shuts the engine down, drops every reference the pool holds, runs ``gc.collect()`` and
  hands the freed heap back to the OS (on glibc: inside :func:`heap_handed_back`, which lets the
  worker threads' arenas shrink too, then ``malloc_trim(0)``); a server fixes glibc's heap policy
  (:func:`fix_heap_policy`: a fixed mmap threshold) so that what a model took comes back whole.

Everything but the loading threads runs on the server's event loop; nothing is read at import.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import math
import re
import threading
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace
from typing import Protocol

from localllm.errors import InsufficientMemoryError, InvalidRequestError, ModelBusyError
from localllm.platform.memory import fix_heap_policy, heap_handed_back, trim_heap
from localllm.serving.catalog import ModelCatalog, ModelSource
from localllm.serving.planner import MemoryPlan

log = logging.getLogger(__name__)

DEFAULT_KEEP_ALIVE_SECONDS = 300.0
# The longest a keep-alive lasts: a longer one (1e300 seconds) is cut to this, so that an expiry is
# always a real time (-1 is the way to keep a model loaded).
MAX_KEEP_ALIVE_SECONDS = 365 * 24 * 3600.0
DEFAULT_LOAD_WAIT_SECONDS = 30.0  # how long a load waits for busy models to free memory
REAPER_INTERVAL_SECONDS = 0.5
_DURATION_PART = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h)")
_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}


class KeepAliveUnset:
    """The type of :data:`KEEP_ALIVE_UNSET`: a request that said nothing about keep-alive."""


KEEP_ALIVE_UNSET = KeepAliveUnset()


def parse_keep_alive(value: str | float | None, param: str = "keep_alive") -> float | None:
    """Seconds a model stays loaded after its last request; None: forever.

    Accepts seconds (``300``, ``"300"``), durations (``"30s"``, ``"5m"``, ``"1h30m"``, ``"500ms"``);
    a negative value keeps the model loaded; ``0`` unloads it after each request; more than
    :data:`MAX_KEEP_ALIVE_SECONDS` is that; infinity (``"1e309"``) is refused."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise InvalidRequestError(f"{param} must be seconds or a duration such as 5m, not {value!r}", param=param)
    if isinstance(value, (int, float)):
        seconds = float(value)
    else:
        text = value.strip().lower()
        try:
            seconds = float(text)
        except ValueError:
            sign = -1.0 if text.startswith("-") else 1.0
            body = text.lstrip("+-")
            parts = _DURATION_PART.findall(body)
            if not body or "".join(n + u for n, u in parts) != body:
                raise InvalidRequestError(
                    f"{param} must be seconds or a duration such as 30s, 5m or 1h, not {value!r}", param=param
                ) from None
            seconds = sign * sum(float(n) * _UNITS[u] for n, u in parts)
    if not math.isfinite(seconds):
        raise InvalidRequestError(f"{param} must be a finite number of seconds, not {value!r}", param=param)
    return None if seconds < 0 else min(seconds, MAX_KEEP_ALIVE_SECONDS)


# ---------------------------------------------------------------- what can be served


# ---------------------------------------------------------------- loaded models


class Engine(Protocol):
    """What the pool needs of an engine (an :class:`~localllm.engine.async_engine.AsyncEngine`)."""

    def shutdown(self, timeout: float = 10.0) -> None: ...


@dataclass(slots=True, eq=False)
class LoadedModel:
    """One loaded model: its engine, its memory plan, its leases and keep-alive."""

    source: ModelSource
    engine: Engine | None  # None once unloaded
    plan: MemoryPlan | None
    keep_alive: float | None  # seconds after the last lease; None: forever
    last_used: float  # the pool's clock
    running: int = 0  # leases out (API requests in flight)
    expires_at: float | None = None  # the pool's clock; None while leased or pinned
    unload_when_idle: bool = False
    owned: bool = True  # False: an engine its caller owns (build_app(engine)): never unloaded here

    @property
    def name(self) -> str:
        return self.source.name

    @property
    def memory_bytes(self) -> int:
        return self.plan.total_bytes if self.plan is not None else 0


class Lease:
    """A request's hold on a loaded model; :meth:`release` once (further calls do nothing)."""

    __slots__ = ("_pool", "_released", "model")

    def __init__(self, pool: ModelPool, model: LoadedModel) -> None:
        self._pool = pool
        self.model = model
        self._released = False

    @property
    def engine(self):
        return self.model.engine

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._pool._release(self.model)


@dataclass(slots=True)
class _Waiter:
    granted: bool = False


@dataclass(frozen=True, slots=True)
class UnloadResult:
    unloaded: bool  # it was loaded (and is gone, or will be once its requests finish)
    pending: bool = False  # requests are still running: it unloads when they finish


def release_memory() -> None:
    """Collect garbage and hand freed heap pages back to the OS (glibc's ``malloc_trim``)."""
    gc.collect()
    trim_heap()


@dataclass(slots=True)
class _PoolEvents:
    """Wakes loads that wait for a busy model to go idle."""

    idle: asyncio.Event | None = None

    def wait(self) -> asyncio.Event:
        if self.idle is None:
            self.idle = asyncio.Event()
        return self.idle

    def notify(self) -> None:
        if self.idle is not None:
            self.idle.set()
            self.idle = None


class ModelPool:
    """Loaded models by name, loaded on demand (see the module's docstring for the contracts).

    ``load_engine(source)`` builds a model's engine (blocking; run on a worker thread);
    ``plan_load(source)`` its :class:`~localllm.serving.planner.MemoryPlan` (blocking: reads the header).
    ``device``: where the engines load ("cpu", "cuda:1"...), whose free memory plans are checked
    against. ``clock`` is injectable for tests (monotonic seconds)."""

    def __init__(
        self,
        catalog: ModelCatalog,
        load_engine: Callable[[ModelSource], Engine],
        plan_load: Callable[[ModelSource], MemoryPlan] | None = None,
        *,
        keep_alive: float | None = DEFAULT_KEEP_ALIVE_SECONDS,
        max_loaded_models: int = 3,
        memory_budget: int | None = None,
        load_wait_timeout: float = DEFAULT_LOAD_WAIT_SECONDS,
        clock: Callable[[], float] = time.monotonic,
        device: str = "cpu",
    ) -> None:
        if max_loaded_models < 1:
            raise InvalidRequestError(f"max_loaded_models must be at least 1, got {max_loaded_models}")
        self.catalog = catalog
        self._load_engine = load_engine
        self._plan_load = plan_load
        self.keep_alive = keep_alive
        self.max_loaded_models = max_loaded_models
        self.memory_budget = memory_budget
        self.load_wait_timeout = load_wait_timeout
        self.clock = clock
        self.device = device  # where models load: what "free memory" means
        self.default_model: str | None = None  # what a request without `model` gets
        self.num_loads: Counter[str] = Counter()  # loads per model name, ever
        self._loaded: dict[str, LoadedModel] = {}
        self._loading: dict[str, asyncio.Task] = {}
        self._waiters: dict[str, list[_Waiter]] = {}
        self._load_lock: asyncio.Lock | None = None
        self._events = _PoolEvents()
        self._reaper: asyncio.Task | None = None
        self._unloading: set[asyncio.Task] = set()
        self._on_load: list[Callable[[LoadedModel], None]] = []
        self._on_unload: list[Callable[[LoadedModel], None]] = []

    # ---------------------------------------------------------------- hooks and facts

    def on_load(self, fn: Callable[[LoadedModel], None]) -> None:
        """``fn(model)`` runs on the event loop after every load."""
        self._on_load.append(fn)

    def on_unload(self, fn: Callable[[LoadedModel], None]) -> None:
        """``fn(model)`` runs when a model leaves the pool, before its engine shuts down: drop every
        reference to its engine there."""
        self._on_unload.append(fn)

    def loaded(self) -> list[LoadedModel]:
        """The loaded models, most recently used first."""
        return sorted(self._loaded.values(), key=lambda m: m.last_used, reverse=True)

    def get(self, name: str) -> LoadedModel | None:
        return self._loaded.get(name)

    def is_loaded(self, name: str) -> bool:
        return name in self._loaded

    def expires_in(self, model: LoadedModel) -> float | None:
        """Seconds until ``model`` unloads if nothing uses it; None when it stays (pinned, forever)."""
        if model.source.pinned or model.keep_alive is None:
            return None
        if model.expires_at is None:  # leased: the clock starts when the last lease ends
            return model.keep_alive
        return max(model.expires_at - self.clock(), 0.0)

    # ---------------------------------------------------------------- registering a loaded engine

    def add_loaded(
        self, source: ModelSource, engine: Engine, plan: MemoryPlan | None = None, *, owned: bool = True
    ) -> LoadedModel:
        """Put an engine loaded elsewhere (``serve MODEL``'s, at start) in the pool; ``owned=False``:
        its caller shuts it down, the pool never unloads it."""
        self.catalog.register(source)
        model = LoadedModel(source, engine, plan, None if source.pinned else self.keep_alive, self.clock(),
                            owned=owned)
        model.expires_at = self._expiry(model)
        self._loaded[source.name] = model
        self.num_loads[source.name] += 1
        for fn in self._on_load:
            fn(model)
        return model

    # ---------------------------------------------------------------- leases

    def resolve_name(self, name: str | None) -> str:
        """The pool's name for a request's ``model`` (the default model when it names none)."""
        if not name:
            if self.default_model is not None:
                return self.default_model
            if len(self._loaded) == 1:
                return next(iter(self._loaded))
            raise InvalidRequestError(
                "`model` is required: this server serves every model in its store (GET /v1/models lists them)",
                param="model",
            )
        if name in self._loaded:
            return name
        return self.catalog.resolve(name).name

    async def lease(
        self, name: str | None, keep_alive: str | float | None | KeepAliveUnset = KEEP_ALIVE_UNSET
    ) -> Lease:
        """A lease on model ``name`` (loading it first if need be); ``keep_alive`` (a request's)
        becomes the model's keep-alive from now on."""
        self._start_reaper()
        wanted = KEEP_ALIVE_UNSET if isinstance(keep_alive, KeepAliveUnset) else parse_keep_alive(keep_alive)
        key = self.resolve_name(name)
        model = self._loaded.get(key)
        if model is None:
            model = await self._await_load(self.catalog.resolve(key) if key not in self.catalog.registered
                                           else self.catalog.registered[key])
        else:
            model.running += 1
            model.expires_at = None
        model.last_used = self.clock()
        if not isinstance(wanted, KeepAliveUnset) and not model.source.pinned:
            model.keep_alive = wanted
        return Lease(self, model)

    @contextlib.asynccontextmanager
    async def acquire(
        self, name: str | None, keep_alive: str | float | None | KeepAliveUnset = KEEP_ALIVE_UNSET
    ) -> AsyncIterator[LoadedModel]:
        """``async with pool.acquire(name) as model:`` — a lease for the block."""
        lease = await self.lease(name, keep_alive)
        try:
            yield lease.model
        finally:
            lease.release()

    async def _await_load(self, source: ModelSource) -> LoadedModel:
        key = source.name
        task = self._loading.get(key)
        if task is None:
            task = asyncio.ensure_future(self._load(source))
            self._loading[key] = task
            task.add_done_callback(lambda _t, k=key: self._loading.pop(k, None))
        waiter = _Waiter()
        self._waiters.setdefault(key, []).append(waiter)
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            if waiter.granted:  # the load finished and counted this request: give its lease back
                self._release(task.result())
            else:
                with contextlib.suppress(ValueError):
                    self._waiters.get(key, []).remove(waiter)
            raise

    def _release(self, model: LoadedModel) -> None:
        model.running -= 1
        model.last_used = self.clock()
        if model.running > 0:
            return
        self._events.notify()
        if model.unload_when_idle or (model.keep_alive == 0 and not model.source.pinned):
            self._unload_soon(model)
        else:
            model.expires_at = self._expiry(model)

    def _expiry(self, model: LoadedModel) -> float | None:
        if model.source.pinned or model.keep_alive is None:
            return None
        return self.clock() + model.keep_alive

    # ---------------------------------------------------------------- loading

    async def _load(self, source: ModelSource) -> LoadedModel:
        key = source.name
        try:
            if self._load_lock is None:
                self._load_lock = asyncio.Lock()
            async with self._load_lock:
                plan = await asyncio.to_thread(self._plan_load, source) if self._plan_load else None
                if plan is not None and plan.problem:
                    raise InvalidRequestError(f"cannot load {key}: {plan.problem}", param="model")
                await self._make_room(plan)
                log.info("loading %s (%s)", key, plan.summary() if plan else source.path)
                engine = await asyncio.to_thread(self._load_engine_and_trim, source)
        except BaseException:
            self._waiters.pop(key, None)
            raise
        model = LoadedModel(source, engine, plan, None if source.pinned else self.keep_alive, self.clock())
        self._loaded[key] = model
        self.num_loads[key] += 1
        waiters = self._waiters.pop(key, [])
        for waiter in waiters:
            waiter.granted = True
        model.running = len(waiters)
        model.expires_at = None if waiters else self._expiry(model)
        for fn in self._on_load:
            fn(model)
        return model

    def _load_engine_and_trim(self, source: ModelSource) -> Engine:
        """Build the engine, then hand the load's freed temporaries (a repack's: more than the model's
        size again) back to the OS, so that what the planner counted is what the process holds."""
        engine = self._load_engine(source)
        release_memory()
        return engine

    def _available(self) -> int:
        """Bytes a new model may take now: the budget minus what loaded models hold, else the free
        memory of the device models load on (host RAM, or a GPU's)."""
        if self.memory_budget is not None:
            return self.memory_budget - sum(m.memory_bytes for m in self._loaded.values())
        from localllm.platform.memory import free_memory

        return free_memory(self.device)

    async def _make_room(self, plan: MemoryPlan | None) -> None:
        """Unload idle models (least recently used first) until ``plan`` fits and a slot is free;
        wait for busy ones up to ``load_wait_timeout``; raise when it cannot fit."""
        deadline = self.clock() + self.load_wait_timeout
        while True:
            loaded = list(self._loaded.values())
            full = len(loaded) >= self.max_loaded_models
            available = self._available() if plan is not None else 0
            fits = plan is None or plan.total_bytes <= available
            if not full and fits:
                return
            idle = sorted((m for m in loaded if m.running == 0 and not m.source.pinned), key=lambda m: m.last_used)
            if idle:
                log.info("unloading %s (least recently used) to make room", idle[0].name)
                await self._unload_now(idle[0])
                continue
            reclaimable = sum(m.memory_bytes for m in loaded if not m.source.pinned)
            if plan is not None and plan.total_bytes > available + reclaimable:
                raise InsufficientMemoryError(
                    "cannot load " + replace(plan, free_bytes=max(available, 0)).summary()
                    + (f" (a budget of {self.memory_budget / 2**20:.0f} MiB)" if self.memory_budget else ""),
                    param="model", code="insufficient_memory",
                )
            busy = [m for m in loaded if not m.source.pinned]
            if not busy:
                raise InsufficientMemoryError(
                    f"cannot load another model: {len(loaded)} pinned models are loaded and at most "
                    f"{self.max_loaded_models} may be (--max-loaded-models)", param="model",
                    code="insufficient_memory",
                )
            remaining = deadline - self.clock()
            if remaining <= 0:
                names = ", ".join(m.name for m in busy)
                raise ModelBusyError(
                    f"the model cannot load until running requests finish on {names}; retry later",
                    param="model", code="model_busy",
                )
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._events.wait().wait(), timeout=min(remaining, 1.0))

    # ---------------------------------------------------------------- unloading

    async def unload(self, name: str) -> UnloadResult:
        """Unload ``name`` now, or once its running requests finish (``pending``); ModelNotFoundError
        for a name the server does not offer."""
        key = self.resolve_name(name)
        model = self._loaded.get(key)
        if model is None:
            return UnloadResult(unloaded=False)
        if not model.owned:
            raise InvalidRequestError(f"`{key}` belongs to the program that embeds this server; it cannot be "
                                      "unloaded", param="model")
        if model.running > 0:
            model.unload_when_idle = True
            return UnloadResult(unloaded=True, pending=True)
        await self._unload_now(model)
        return UnloadResult(unloaded=True)

    async def expire_idle(self) -> list[str]:
        """Unload every idle model whose keep-alive has run out; their names."""
        now = self.clock()
        expired = [m for m in self._loaded.values()
                   if m.running == 0 and m.expires_at is not None and m.expires_at <= now]
        for model in expired:
            log.info("unloading %s (keep-alive expired)", model.name)
            await self._unload_now(model)
        return [m.name for m in expired]

    def _unload_soon(self, model: LoadedModel) -> None:
        task = asyncio.ensure_future(self._unload_now(model))
        self._unloading.add(task)
        task.add_done_callback(self._unloading.discard)

    async def _unload_now(self, model: LoadedModel) -> None:
        if self._loaded.get(model.name) is not model or model.running > 0 or not model.owned:
            return
        del self._loaded[model.name]
        for fn in self._on_unload:
            try:
                fn(model)
            except Exception:
                log.exception("unload callback failed")
        holder = [model.engine]
        model.engine = None
        await asyncio.to_thread(_shut_down, holder)
        self._events.notify()

    # ---------------------------------------------------------------- the reaper and shutdown

    def _start_reaper(self) -> None:
        if self._reaper is None or self._reaper.done():
            self._reaper = asyncio.ensure_future(self._reap())

    async def _reap(self) -> None:
        while True:
            await asyncio.sleep(REAPER_INTERVAL_SECONDS)
            try:
                await self.expire_idle()
            except Exception:
                log.exception("unloading an expired model failed")

    def shutdown(self, timeout: float = 10.0) -> None:
        """Drain and stop every engine (blocking; the server's shutdown runs it on a thread)."""
        if self._reaper is not None:
            with contextlib.suppress(RuntimeError):  # its loop has closed already
                self._reaper.get_loop().call_soon_threadsafe(self._reaper.cancel)
            self._reaper = None
        models = list(self._loaded.values())
        self._loaded.clear()
        threads = [threading.Thread(target=m.engine.shutdown, args=(timeout,), daemon=True)
                   for m in models if m.engine is not None and m.owned]
        for thread in threads:  # drained side by side: the timeout holds for all of them together
            thread.start()
        for thread in threads:
            thread.join()


def _shut_down(holder: list) -> None:
    """Stop the engine in ``holder`` and free its memory (the holder is its last reference here)."""
    engine = holder.pop()
    if engine is not None:
        engine.shutdown(0)
    with heap_handed_back():  # every heap the model's tensors came from shrinks, not only the main one
        del engine
        gc.collect()


__all__ = [
    "KEEP_ALIVE_UNSET",
    "Lease",
    "LoadedModel",
    "ModelCatalog",
    "ModelPool",
    "ModelSource",
    "UnloadResult",
    "fix_heap_policy",
    "parse_keep_alive",
    "release_memory",
]
