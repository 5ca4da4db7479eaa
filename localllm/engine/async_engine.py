"""AsyncEngine: one LLMEngine per process, stepped by a background thread, fanned out to asyncio.

Many producers (API handlers, the TUI) call :meth:`AsyncEngine.generate` from any event loop;
only the step thread touches the engine. Requests are validated in the caller's thread, then
handed to the step thread through an inbox that it drains between steps, so adding or aborting
never waits for a model step and never blocks an event loop. Stats are a snapshot the step
thread publishes after every step and every drain.

Health: the step thread beats a heartbeat after every step and while idle; :meth:`health`
reports a dead loop (with its cause) and a *stalled* one (no beat for ``stall_timeout`` s while
a step runs). When the loop dies, the callbacks of :meth:`on_death` run (``localllm serve``
then exits non-zero so that its service manager restarts it).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import torch

from localllm.config.engine import EngineConfig
from localllm.engine.embeddings import EmbeddingBatcher, run_batch
from localllm.engine.llm_engine import EngineStats, LLMEngine
from localllm.errors import EngineDeadError, LocalLLMError, QueueFullError, RequestFailedError
from localllm.outputs import RequestOutput
from localllm.sampling_params import SamplingParams
from localllm.store import resolve_models

log = logging.getLogger(__name__)

DEFAULT_STALL_TIMEOUT = 120.0  # seconds one step may take before the engine counts as stalled


@dataclass(frozen=True, slots=True)
class AddRequest:
    """Inbox message: a validated request for the step thread to add to the engine."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    priority: int
    arrival_time: float


@dataclass(frozen=True, slots=True)
class AbortRequest:
    """Inbox message: stop a request and free its KV blocks (an unknown id is ignored)."""

    request_id: str


InboxMessage = AddRequest | AbortRequest


@dataclass(frozen=True, slots=True)
class EngineHealth:
    """What ``/health`` reports: ``ok``, else why not (dead or stalled)."""

    ok: bool
    reason: str | None
    stalled: bool
    seconds_since_heartbeat: float


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """What an :class:`AsyncEngine` serves: facts fixed when its model loaded."""

    path: str  # the model file or checkpoint directory the engine loaded
    architecture: str  # e.g. "llama"
    vocab_size: int
    max_model_len: int  # longest prompt + completion, in tokens
    quant: str | None  # the GGUF file type (Q4_1, Q8_0, F16...), "GPTQ 4-bit"; None when unknown (float safetensors)
    dtype: str  # activations: float32, bfloat16 or float16
    kv_cache_dtype: str  # the KV cache's type: f32, f16, bf16, q8_0, q4_0, or keys'/values' (q8_0/q4_0)
    kernels: str  # the kernel family the engine runs ("cpu-native", "triton", ...)
    device: str  # "cpu", "cuda", "cuda:1"...
    num_kv_blocks: int
    kv_block_size: int  # tokens per KV block
    parameters: int = 0  # weights of the model
    active_parameters: int = 0  # weights one token reads (a mixture of experts: its chosen experts only)


class _Stream:
    __slots__ = ("loop", "num_finished", "num_samples", "queue")

    def __init__(self, loop: asyncio.AbstractEventLoop, num_samples: int) -> None:
        self.loop = loop
        self.queue: asyncio.Queue = asyncio.Queue()
        self.num_samples = num_samples
        self.num_finished = 0

    def put(self, item) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the consumer's loop is closed: nobody is listening any more
            pass


class AsyncEngine:
    """Thread-safe, asyncio-facing front of one :class:`LLMEngine`."""

    def __init__(
        self,
        engine: LLMEngine | None = None,
        *,
        build: Callable[[], LLMEngine] | None = None,
        stall_timeout: float = DEFAULT_STALL_TIMEOUT,
    ) -> None:
        """Front ``engine``, or the engine that ``build()`` makes on the step thread (what
        :meth:`from_config` does; its errors are raised here)."""
        if (engine is None) == (build is None):
            raise TypeError("AsyncEngine needs an engine or a build function, not both")
        self._lock = threading.Lock()  # guards _streams and _inbox only (never held during a step)
        self._wake = threading.Event()
        self._streams: dict[str, _Stream] = {}
        self._inbox: deque[InboxMessage] = deque()
        self._num_pending_adds = 0
        self._observers: list[Callable[[list[RequestOutput]], None]] = []
        self._accepting = True
        self._stop = False
        self._dead: BaseException | None = None
        self._death_callbacks: list[Callable[[BaseException], None]] = []
        self.embeddings = EmbeddingBatcher()  # /v1/embeddings requests, batched on the step thread
        self.stall_timeout = stall_timeout
        self._heartbeat = time.monotonic()
        self._built = threading.Event()
        self._build_error: BaseException | None = None
        if engine is not None:
            self.engine = engine
            self._stats = engine.stats()
            self._built.set()
        self._thread = threading.Thread(target=self._run, args=(build,), name="localllm-engine", daemon=True)
        self._thread.start()
        self._built.wait()
        if self._build_error is not None:
            self._thread.join()
            raise self._build_error

    @classmethod
    def from_config(cls, config: EngineConfig, stall_timeout: float = DEFAULT_STALL_TIMEOUT) -> AsyncEngine:
        """Load the model on the step thread, which then runs every step: all of the engine's
        torch work happens on one thread. (OpenMP keeps a pool of worker threads per thread
        that runs parallel regions; with a second pool, from loading on the caller's thread,
        libgomp counts more threads than cores and stops spinning between parallel regions:
        decode steps measured ~1.3-1.5x slower at 2 threads.) A model named by catalog or hub name is
        pulled first, here."""
        config = resolve_models(config)
        return cls(build=lambda: LLMEngine(config), stall_timeout=stall_timeout)

    # ---------------------------------------------------------------- facts

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    def model_info(self) -> ModelInfo:
        """The served model's fixed facts (path, architecture, vocabulary, context, quant, KV cache).

        Safe from any thread: everything it reads is set once, when the model loads."""
        engine = self.engine
        config = engine.config
        parameters, active_parameters = engine.model_config.parameter_counts()
        return ModelInfo(
            path=str(config.model),
            architecture=str(engine.model_config.architecture),
            vocab_size=int(engine.model_config.vocab_size),
            max_model_len=int(engine.max_model_len),
            quant=engine.checkpoint.quant,
            dtype=config.dtype,
            kv_cache_dtype=str(engine.kv_types),
            kernels=str(engine.kernels),
            device=str(engine.device),
            num_kv_blocks=int(engine.num_blocks),
            kv_block_size=int(config.block_size),
            parameters=parameters,
            active_parameters=active_parameters,
        )

    def check_params(self, params: SamplingParams) -> None:
        """Raise InvalidRequestError for params this model cannot honour (validation plus the checks
        that need the vocabulary). Safe from any thread: reads the vocabulary only, never the queue."""
        self.engine.check_params(params)

    def encode_prompt(self, prompt: str | list[int]) -> list[int]:
        """Token ids for a text prompt (BOS as the model wants), or validated ids; raises
        InvalidRequestError. Safe from any thread (the tokenizer is read-only); a long prompt may take
        a while, so event loops call it through ``asyncio.to_thread``."""
        return self.engine.encode_prompt(prompt)

    @property
    def is_alive(self) -> bool:
        return self._dead is None and self._thread.is_alive()

    def stats(self) -> EngineStats:
        """The engine's counters as of the last step or inbox drain (never blocks)."""
        return self._stats

    def health(self) -> EngineHealth:
        """Dead (the loop stopped), stalled (no heartbeat for ``stall_timeout`` s), or ok."""
        since = max(time.monotonic() - self._heartbeat, 0.0)
        if not self.is_alive:
            cause = f"the engine has stopped: {self._dead!r}" if self._dead is not None else "the engine has stopped"
            return EngineHealth(False, cause, False, since)
        if since > self.stall_timeout:
            s = self._stats
            return EngineHealth(
                False,
                f"the engine is stalled: no step has finished for {since:.0f} s "
                f"({s.num_running} running, {s.num_waiting} waiting)",
                True,
                since,
            )
        return EngineHealth(True, None, False, since)

    def on_death(self, fn: Callable[[BaseException], None]) -> None:
        """``fn(cause)`` runs on the step thread if the step loop dies."""
        self._death_callbacks.append(fn)

    def add_observer(self, fn: Callable[[list[RequestOutput]], None]) -> None:
        """``fn(outputs)`` runs on the step thread after every step that produced outputs."""
        self._observers.append(fn)

    # ---------------------------------------------------------------- requests

    async def generate(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        priority: int = 0,
    ) -> AsyncIterator[RequestOutput]:
        """Yield deltas of one request until all its samples finish.

        Validation errors and QueueFullError are raised before the first suspension (so on the
        first ``__anext__``). If the consumer stops early (client gone, task cancelled), the
        request is aborted and its KV freed.
        """
        if self._dead is not None:
            raise EngineDeadError(f"the engine stopped: {self._dead}")
        if not self._accepting:
            raise EngineDeadError("the server is shutting down")
        params = params or SamplingParams()
        engine = self.engine
        engine.check_params(params)
        prompt_ids = engine.encode_prompt(prompt)
        engine.check_length(len(prompt_ids), params)
        stream = _Stream(asyncio.get_running_loop(), params.n)
        with self._lock:
            max_waiting = engine.config.max_waiting
            if max_waiting is not None and self._stats.num_waiting + self._num_pending_adds >= max_waiting:
                raise QueueFullError(
                    f"the server has {max_waiting} requests waiting; retry later", code="queue_full"
                )
            request_id = request_id or uuid.uuid4().hex
            if request_id in self._streams:
                request_id = f"{request_id}-{uuid.uuid4().hex[:8]}"
            self._streams[request_id] = stream
            self._inbox.append(AddRequest(request_id, prompt_ids, params, priority, time.monotonic()))
            self._num_pending_adds += 1
        self._wake.set()
        finished = False
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    finished = True  # nothing left to abort
                    raise item
                if item.error is not None:  # the engine already dropped the whole request
                    finished = True
                    raise item.error
                yield item
                if item.finished:
                    stream.num_finished += 1
                    if stream.num_finished == stream.num_samples:
                        finished = True
                        return
        finally:
            if finished:
                with self._lock:
                    self._streams.pop(request_id, None)
            else:
                self.abort(request_id)

    async def embed(self, token_ids: list[int]) -> torch.Tensor:
        """The pooled (not normalized) float32 hidden state of ``token_ids``, computed on the step
        thread in a batch with other embedding requests (see :mod:`localllm.engine.embeddings`)."""
        if self._dead is not None or self._stop:
            raise EngineDeadError(f"the engine stopped: {self._dead!r}")
        fut = self.embeddings.submit(token_ids)
        self._wake.set()
        return await asyncio.wrap_future(fut)  # cancelled: the future is, and the batcher drops it

    async def embed_many(self, token_ids: list[list[int]]) -> list[torch.Tensor]:
        """:meth:`embed` of each of ``token_ids``, batched together; if one fails or the caller is
        cancelled (its client left), the others are cancelled too, so the step thread computes
        nothing that nobody waits for."""
        if self._dead is not None or self._stop:
            raise EngineDeadError(f"the engine stopped: {self._dead!r}")
        futures = [self.embeddings.submit(ids) for ids in token_ids]
        self._wake.set()
        try:
            return list(await asyncio.gather(*(asyncio.wrap_future(f) for f in futures)))
        finally:
            for f in futures:
                f.cancel()  # (no-op for those taken or done)

    @property
    def pooling(self) -> str:
        return self.engine.pooling

    @property
    def rerank_template(self) -> str | None:
        return self.engine.rerank_template

    def abort(self, request_id: str) -> None:
        """Stop a request and free its KV blocks before the next step; unknown ids are ignored."""
        with self._lock:
            self._streams.pop(request_id, None)
            self._inbox.append(AbortRequest(request_id))
        self._wake.set()

    # ---------------------------------------------------------------- the step thread

    def _drain_inbox(self) -> None:
        engine = self.engine
        while True:
            with self._lock:
                if not self._inbox:
                    return
                item = self._inbox.popleft()
                if isinstance(item, AddRequest):
                    self._num_pending_adds -= 1
                    stream = self._streams.get(item.request_id)
            if isinstance(item, AbortRequest):
                engine.abort(item.request_id)
                continue
            rid = item.request_id
            if stream is None:  # aborted before it was added
                continue
            try:
                engine.add_request(item.prompt_ids, item.params, req_id=rid, priority=item.priority,
                                   arrival_time=item.arrival_time)
            except Exception as exc:
                if not isinstance(exc, LocalLLMError):
                    log.exception("adding request %s failed", rid)
                    engine.abort(rid)
                    exc = RequestFailedError(f"adding the request failed: {exc!r}")
                with self._lock:
                    self._streams.pop(rid, None)
                stream.put(exc)

    def _run(self, build: Callable[[], LLMEngine] | None) -> None:
        if build is not None:
            try:
                self.engine = build()
                self._stats = self.engine.stats()
            except BaseException as exc:  # noqa: BLE001 - raised by __init__ in the caller's thread
                self._build_error = exc
                return
            finally:
                self._built.set()
        engine = self.engine
        self._heartbeat = time.monotonic()
        try:
            engine.bind_device()  # this thread steps it: its GPU is this thread's current device
            embedded_last = False  # the last thing done was an embeddings batch
            while not self._stop:
                self._drain_inbox()
                busy = engine.has_unfinished_requests()
                # Embeddings go behind generation, never starved: once they may run beside it, one
                # batch (no larger than a step's token budget) and one generation step take turns.
                if not (busy and embedded_last) and self.embeddings.ready(busy):
                    batch = self.embeddings.take(engine.config.max_num_batched_tokens if busy else None)
                    if batch:
                        run_batch(engine.model, batch, engine.pooling, engine.runner.kv_types, engine.device)
                    self._heartbeat = time.monotonic()
                    embedded_last = bool(batch)
                    continue
                embedded_last = False
                if not busy:
                    self._stats = engine.stats()
                    self._heartbeat = time.monotonic()
                    wakeup = self.embeddings.next_wakeup()
                    self._wake.wait(0.05 if wakeup is None else min(0.05, wakeup))
                    self._wake.clear()
                    continue
                outputs = engine.step()
                self._heartbeat = time.monotonic()
                self._stats = engine.stats()
                with self._lock:
                    targets = [(o, self._streams.get(o.req_id)) for o in outputs]
                for out, stream in targets:
                    if stream is not None:
                        stream.put(out)
                if outputs:
                    for fn in self._observers:
                        try:
                            fn(outputs)
                        except Exception:
                            log.exception("engine observer failed")
            self._drain_inbox()
        except BaseException as exc:
            log.exception("engine step loop crashed")
            self._dead = exc
            err = EngineDeadError(f"the engine stopped: {exc!r}")
            self.embeddings.fail_all(err)
            with self._lock:
                streams = list(self._streams.values())
                self._streams.clear()
            for stream in streams:
                stream.put(err)
            for fn in self._death_callbacks:
                try:
                    fn(exc)
                except Exception:
                    log.exception("engine death callback failed")

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop accepting, let in-flight requests finish for up to ``timeout`` s, abort the rest."""
        self._accepting = False
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.is_alive:
            with self._lock:
                idle = not self._streams and not self._inbox
            if idle and not self.engine.has_unfinished_requests():
                break
            time.sleep(0.02)
        with self._lock:
            leftover = list(self._streams.items())
            self._streams.clear()
            for rid, _ in leftover:
                self._inbox.append(AbortRequest(rid))
        for _, stream in leftover:
            stream.put(EngineDeadError("the server shut down before the request finished"))
        self._stop = True
        self._wake.set()
        self._thread.join(timeout=30)
        self.embeddings.fail_all(EngineDeadError("the server shut down before the embedding was computed"))
        if not self._thread.is_alive():
            self.engine.close()


__all__ = ["AsyncEngine", "LocalLLMError", "ModelInfo"]
