"""Ollama's routes over the model store: ``/api/pull`` (NDJSON progress, as Ollama streams it),
``DELETE /api/delete``, ``/api/copy`` and ``/api/create`` (a stored variant with its own system
prompt, parameters and example messages: :mod:`localllm.store.modelfile`). A pulled model is served on its first request (the pool's
catalog lists the store), so ``pull`` then ``chat`` works as it does with Ollama.

Each store operation runs in a worker thread (downloads and hashing block); a pull whose client leaves
goes on to the end, as Ollama's does, so that the store never keeps half of it."""

from __future__ import annotations

import asyncio
import functools
import json
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from localllm.api.ollama.protocol import (
    OllamaCopyRequest,
    OllamaCreateRequest,
    OllamaDeleteRequest,
    OllamaPullRequest,
    error_message,
    error_response,
    read_body,
)
from localllm.errors import InvalidRequestError
from localllm.store import local
from localllm.store.download import pull
from localllm.store.modelfile import ROLES, ModelDefaults, parameter, parse_modelfile

_DONE = ("verifying sha256 digest", "writing manifest", "success")
"""The statuses Ollama's pull ends with (each file is verified before the manifest is written)."""


def _line(obj: dict) -> str:
    return json.dumps(obj) + "\n"


async def _pull_lines(job: asyncio.Future, queue: asyncio.Queue) -> AsyncIterator[str]:
    yield _line({"status": "pulling manifest"})
    while True:
        get = asyncio.ensure_future(queue.get())
        done, _ = await asyncio.wait({get, job}, return_when=asyncio.FIRST_COMPLETED)
        if get in done:
            yield _line(get.result())
            continue
        get.cancel()
        while not queue.empty():
            yield _line(queue.get_nowait())
        break
    try:
        job.result()
    except Exception as exc:  # noqa: BLE001 - once the stream has begun, an error is a line of its own
        yield _line({"error": error_message(exc)})
        return
    for status in _DONE:
        yield _line({"status": status})


def _progress_listener(loop: asyncio.AbstractEventLoop, queue: asyncio.Queue):
    """A store listener that queues a line per percent of each file (and its last), from the pull's thread."""
    last: dict[str, int] = {}

    def listener(label: str, completed: int, total: int | None) -> None:
        step = (total or 0) // 100
        if completed != total and label in last and completed - last[label] < step:
            return
        last[label] = completed
        line = {"status": f"pulling {label}", "digest": label, "total": total or 0, "completed": completed}
        loop.call_soon_threadsafe(queue.put_nowait, line)

    return listener


def create_args(body: OllamaCreateRequest) -> tuple[str, ModelDefaults]:
    """``(base, defaults)`` of a create request; a 400 for what a stored variant cannot hold."""
    for name in ("template", "adapters", "files", "quantize"):
        if getattr(body, name):
            what = {"template": "a Go template (the model's own chat template is used)",
                    "adapters": "LoRA adapters", "files": "weights uploaded as blobs (name a pulled model or a "
                    "GGUF file's path in from)", "quantize": "quantizing on create (localllm quantize)"}[name]
            raise InvalidRequestError(f"{name}: {what} is not supported", param=name)
    if body.modelfile:
        return parse_modelfile(body.modelfile)
    if not body.from_:
        raise InvalidRequestError("from is required: the model this one is made from", param="from")
    messages = []
    for m in body.messages or []:
        if m.get("role") not in ROLES or not isinstance(m.get("content"), str):
            raise InvalidRequestError(f"messages: each needs a role of {sorted(ROLES)} and text content",
                                      param="messages")
        messages.append((m["role"], m["content"]))
    parameters = {name: parameter(name, value) for name, value in (body.parameters or {}).items()}
    license_ = "\n".join(body.license) if isinstance(body.license, list) else body.license
    return body.from_, ModelDefaults(body.system, parameters, tuple(messages), license_)


def add_store_routes(app: FastAPI) -> None:
    """``/api/pull``, ``/api/delete`` and ``/api/copy`` on ``app``, errors in Ollama's shape."""

    @app.post("/api/pull")
    async def ollama_pull(request: Request) -> Response:
        try:
            body = await read_body(request, OllamaPullRequest)
        except Exception as exc:  # noqa: BLE001 - every error leaves as Ollama's shape
            return error_response(exc)
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        listener = _progress_listener(loop, queue)
        job = loop.run_in_executor(None, functools.partial(pull, body.model_name, False, True, listener))
        if body.stream:
            return StreamingResponse(_pull_lines(job, queue), media_type="application/x-ndjson")
        try:
            await job
        except Exception as exc:  # noqa: BLE001
            return error_response(exc)
        return JSONResponse({"status": "success"})

    @app.post("/api/create")
    async def ollama_create(request: Request) -> Response:
        try:
            body = await read_body(request, OllamaCreateRequest)
            base, defaults = create_args(body)
            await asyncio.to_thread(local.create, body.model_name, base, defaults)
        except Exception as exc:  # noqa: BLE001
            return error_response(exc)
        if body.stream:
            return StreamingResponse(iter([_line({"status": s}) for s in ("using existing layers", *_DONE[1:])]),
                                     media_type="application/x-ndjson")
        return JSONResponse({"status": "success"})

    @app.delete("/api/delete")
    async def ollama_delete(request: Request) -> Response:
        try:
            body = await read_body(request, OllamaDeleteRequest)
            await asyncio.to_thread(local.remove, body.model_name)
        except Exception as exc:  # noqa: BLE001
            return error_response(exc)
        return Response(status_code=200)

    @app.post("/api/copy")
    async def ollama_copy(request: Request) -> Response:
        try:
            body = await read_body(request, OllamaCopyRequest)
            await asyncio.to_thread(local.copy, body.source, body.destination)
        except Exception as exc:  # noqa: BLE001
            return error_response(exc)
        return Response(status_code=200)
