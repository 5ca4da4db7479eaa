"""Embeddings on the generation engine's model: pooled, normalized final hidden states, computed
in batches gathered by a dynamic batching window.

:class:`EmbeddingBatcher` is the window (the Triton Inference Server / BentoML policy): requests
queue from any thread; the engine's step thread takes a batch once it holds ``max_batch_size``
sequences (or ``max_batch_tokens`` tokens) or its oldest request has waited ``max_queue_delay``
seconds — and only when no generation request is waiting to be stepped, unless the oldest
embedding has waited ``max_starvation`` seconds (embeddings go behind chat traffic, but never
forever). While generation runs, the step thread then alternates: one embeddings batch, no larger
than a generation step's token budget, then one generation step, so a large embeddings request
slows chat down but never stops it. A batch is one forward pass over its sequences laid out one
after another (each from position 0, on a private KV cache: the paged cache of the chat requests
is not touched).

A request whose waiter has gone (its future cancelled: the client left) is dropped when a batch is
taken, and never computed; a batch's futures are marked running as they are taken, so they can no
longer be cancelled, and :func:`settle` resolves a future only where nobody has yet: the step
thread never raises for a client that left.

Pooling (``pooling``, else the GGUF's ``{arch}.pooling_type``, else ``mean``): ``last`` token
(Qwen3-Embedding and other decoder embedders), ``mean`` over the tokens, or ``cls`` (the first).
``rank`` (a reranker, llama.cpp's pooling type 4) takes the last token, as llama.cpp does for
causal models, and puts it through the model's classifier: a batch's results are then scores
per label (Qwen3-Reranker: P(yes), P(no)), which ``/v1/rerank`` reads.
Vectors are L2-normalized; ``dimensions`` keeps the first ones and normalizes again (Matryoshka
models). On the CPU backend's default (batch-invariant) path a text's embedding is the same
alone and inside a batch.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field

import torch

from localllm.errors import InvalidRequestError

POOLINGS = ("mean", "last", "cls")
GGUF_POOLING = {1: "mean", 2: "cls", 3: "last", 4: "rank"}  # llama.cpp's LLAMA_POOLING_TYPE values
RANK = "rank"


def pooling_from_metadata(metadata: dict, architecture: str) -> str | None:
    value = metadata.get(f"{architecture}.pooling_type")
    return GGUF_POOLING.get(int(value)) if isinstance(value, (int, float)) else None


@dataclass(frozen=True, slots=True)
class BatchingWindow:
    max_batch_size: int = 32
    max_batch_tokens: int = 8192
    max_queue_delay: float = 0.005  # seconds the oldest request waits for company
    max_starvation: float = 0.5  # seconds an embedding waits behind generation at most


@dataclass(slots=True)
class _Pending:
    token_ids: list[int]
    future: Future
    arrival: float = field(default_factory=time.monotonic)


def settle(future: Future, result: object = None, error: BaseException | None = None) -> bool:
    """Resolve ``future`` with ``result`` (or ``error``) unless it is done already (cancelled: its
    waiter left); whether it was resolved. The step thread calls it: it must not raise for a waiter."""
    if future.done():
        return False
    try:
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)
    except InvalidStateError:  # cancelled between the check and the call
        return False
    return True


class EmbeddingBatcher:
    """The queue of embedding requests and its batching policy (thread-safe)."""

    def __init__(self, window: BatchingWindow | None = None) -> None:
        self.window = window or BatchingWindow()
        self._queue: deque[_Pending] = deque()
        self._lock = threading.Lock()
        self.on_batch = None  # called with each batch's size (the API's metrics)

    def submit(self, token_ids: list[int]) -> Future:
        fut: Future = Future()
        with self._lock:
            self._queue.append(_Pending(token_ids, fut))
        return fut

    def __len__(self) -> int:
        return len(self._queue)

    def ready(self, generation_busy: bool, now: float | None = None) -> bool:
        """Whether a batch should run now."""
        with self._lock:
            self._drop_cancelled()
            if not self._queue:
                return False
            now = time.monotonic() if now is None else now
            waited = now - self._queue[0].arrival
            if generation_busy and waited < self.window.max_starvation:
                return False
            full = len(self._queue) >= self.window.max_batch_size or \
                sum(len(p.token_ids) for p in self._queue) >= self.window.max_batch_tokens
            return full or waited >= self.window.max_queue_delay

    def _drop_cancelled(self) -> None:
        """Forget the requests whose waiters have gone (under the lock)."""
        if any(p.future.cancelled() for p in self._queue):
            self._queue = deque(p for p in self._queue if not p.future.cancelled())

    def take(self, max_tokens: int | None = None) -> list[_Pending]:
        """The next batch: up to the window's sequences and tokens (and ``max_tokens``, where given),
        oldest first (always one, unless every queued request was cancelled). Each request taken is
        marked running, so that it can no longer be cancelled; a cancelled one is dropped."""
        w = self.window
        budget = w.max_batch_tokens if max_tokens is None else max(1, min(max_tokens, w.max_batch_tokens))
        with self._lock:
            batch, tokens = [], 0
            while self._queue and len(batch) < w.max_batch_size:
                n = len(self._queue[0].token_ids)
                if batch and tokens + n > budget:
                    break
                p = self._queue.popleft()
                if not p.future.set_running_or_notify_cancel():  # its client left: no forward pass for it
                    continue
                batch.append(p)
                tokens += n
        if batch and self.on_batch is not None:
            self.on_batch(len(batch))
        return batch

    def fail_all(self, exc: BaseException) -> None:
        """Fail every queued request (the engine stopped)."""
        with self._lock:
            pending, self._queue = list(self._queue), deque()
        for p in pending:
            settle(p.future, error=exc)

    def next_wakeup(self) -> float | None:
        """Seconds until the oldest request's delay runs out (``None``: nothing queued)."""
        with self._lock:
            if not self._queue:
                return None
            return max(0.0, self._queue[0].arrival + self.window.max_queue_delay - time.monotonic())


def pool(hidden: torch.Tensor, lengths: list[int], pooling: str) -> torch.Tensor:
    """``[len(lengths), H]``: each sequence's pooled vector from the flat ``hidden [T, H]``."""
    out, start = [], 0
    for n in lengths:
        h = hidden[start:start + n]
        out.append(h[-1] if pooling in ("last", RANK) else h[0] if pooling == "cls" else h.mean(0))
        start += n
    return torch.stack(out)


def normalize(vectors: torch.Tensor, dimensions: int | None = None) -> torch.Tensor:
    if dimensions is not None:
        if not 1 <= dimensions <= vectors.shape[-1]:
            raise InvalidRequestError(f"dimensions must be in [1, {vectors.shape[-1]}] for this model, got "
                                      f"{dimensions}", param="dimensions")
        vectors = vectors[..., :dimensions]
    return torch.nn.functional.normalize(vectors.float(), dim=-1)


@torch.inference_mode()
def run_batch(model, batch: list[_Pending], pooling: str, kv_types,
              device: torch.device | str = "cpu") -> None:
    """One forward pass over ``batch`` on ``device`` (the model's); each future gets its sequence's
    pooled float32 vector on the host (not normalized; with ``rank`` pooling, the classifier's
    scores), or the exception."""
    from localllm.engine.model_runner import prefill_batch

    lengths = [len(p.token_ids) for p in batch]
    try:
        positions, meta, kv = prefill_batch(lengths, model.config, kv_types, device=device)
        ids = torch.tensor([t for p in batch for t in p.token_ids], dtype=torch.long).to(device)
        hidden = model(ids, positions, meta, kv)
        vectors = pool(hidden.float(), lengths, pooling)
        if pooling == RANK:
            vectors = model.classifier(vectors)
        vectors = vectors.cpu()
    except Exception as exc:  # noqa: BLE001 - the batch's requests fail, the engine goes on
        for p in batch:
            settle(p.future, error=exc)
        return
    for p, v in zip(batch, vectors):
        settle(p.future, v.clone())
