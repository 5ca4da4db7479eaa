"""Ollama's REST API on the same server and port: ``/api/chat``, ``/api/generate``, ``/api/embed``,
``/api/embeddings``, ``/api/tags``, ``/api/show``, ``/api/version``, and the store's routes, as the
``ollama`` clients send them (``/api/ps`` is the server's own, in Ollama's shape too).

A chat or generate request becomes an OpenAI chat completion (:meth:`OpenAIServing.start_chat`: the
same template, tools, reasoning split, structured output, checks and metrics), or, with ``raw``, a
completion of the prompt as given; its answer streams back as NDJSON lines, Ollama's shape:
``message`` (or ``response``) deltas, then one line with ``done: true``, ``done_reason`` and the
counts and durations (nanoseconds) the engine measured. Errors are ``{"error": "..."}`` with Ollama's
statuses: 404 for a model the server does not have, 400 for a bad request.

``/api/pull``, ``/api/delete``, ``/api/copy`` and ``/api/create``: :mod:`localllm.api.ollama.store_routes`.
Images are a 400 (no vision models yet).
"""

from __future__ import annotations

import datetime
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

import localllm
from localllm.api.answers import AnswerFormat, AnswerStream
from localllm.api.errors import describe_validation_errors
from localllm.api.ollama.protocol import (
    OllamaChatRequest,
    OllamaEmbeddingsRequest,
    OllamaEmbedRequest,
    OllamaGenerateRequest,
    OllamaMessage,
    OllamaModelRequest,
    error_message,
    error_response,
    read_body,
    sampling_fields,
)
from localllm.api.ollama.store_routes import add_store_routes
from localllm.api.openai.model_protocol import EmbeddingRequest
from localllm.api.openai.model_serving import CLIENT_GONE, ClientGone, while_connected
from localllm.api.openai.protocol import ChatCompletionRequest, CompletionRequest
from localllm.api.streaming import EventStream
from localllm.api.tools import template_takes_tools
from localllm.engine.embeddings import RANK
from localllm.errors import InvalidRequestError

NDJSON = "application/x-ndjson"


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat().replace("+00:00", "Z")


class NdjsonStream(EventStream):
    """NDJSON lines in place of server-sent events (the run is aborted however the response ends)."""

    def __init__(self, content: AsyncIterator[str], run) -> None:
        super().__init__(content, run)
        self.media_type = NDJSON
        self.headers["content-type"] = NDJSON


def _messages(messages: list[OllamaMessage]) -> list[dict[str, Any]]:
    """Ollama's messages as the OpenAI route's (tool calls with JSON-text arguments, ids made up)."""
    out = []
    for i, m in enumerate(messages):
        if m.images:
            raise InvalidRequestError("images are not supported by this model", param="messages")
        msg: dict[str, Any] = {"role": m.role, "content": m.content}
        if m.tool_calls:
            msg["tool_calls"] = [{"id": f"call_{i}_{j}", "type": "function", "function": {
                "name": c.function.name, "arguments": json.dumps(c.function.arguments)}}
                for j, c in enumerate(m.tool_calls)]
        if m.role == "tool" and m.tool_name:
            msg["name"] = m.tool_name
        if m.thinking and m.role == "assistant":
            msg["reasoning_content"] = m.thinking
        out.append(msg)
    return out


def _openai(kind, body: dict):
    """``body`` as the OpenAI route's request ``kind`` (a field Ollama's request let through that the
    route refuses is a 400 naming it)."""
    try:
        return kind.model_validate(body)
    except ValidationError as exc:
        message, param = describe_validation_errors(exc.errors())
        raise InvalidRequestError(message, param=param) from exc


def _tool_calls(calls) -> list[dict]:
    return [{"function": {"name": c.name, "arguments": c.arguments}} for c in calls]


def _done(out, started: float) -> dict:
    """The closing line's counts and durations (nanoseconds) of the last delta ``out`` (``None``:
    the run ended without one)."""
    if out is None:
        return {"done_reason": "stop", "total_duration": int((time.monotonic() - started) * 1e9)}
    t = out.timings
    ns = 1_000_000_000
    end = t.finished or time.monotonic()
    first = t.first_token or end
    return {
        "done_reason": "length" if out.finish_reason == "length" else "stop",
        "total_duration": int((time.monotonic() - started) * ns),
        "load_duration": 0,
        "prompt_eval_count": out.num_prompt_tokens,
        "prompt_eval_duration": int(max(first - (t.first_scheduled or t.arrival), 0.0) * ns),
        "eval_count": out.num_output_tokens,
        "eval_duration": int(max(end - first, 0.0) * ns),
    }


class OllamaServing:
    """One model's Ollama routes over its :class:`~localllm.api.openai.serving.OpenAIServing`."""

    def __init__(self, serving, request: Request | None = None) -> None:
        self.serving = serving
        self.request = request  # (its client's leaving cancels an embedding's queued inputs)

    async def chat(self, req: OllamaChatRequest, generate: OllamaGenerateRequest | None = None) -> Response:
        """``/api/chat`` (and ``/api/generate`` without ``raw``: ``generate`` is its request)."""
        started = time.monotonic()
        fields = sampling_fields(req.options, req.format)
        body: dict[str, Any] = {"model": self.serving.served_model_name, "messages": _messages(req.messages),
                                **fields}
        if getattr(req, "tools", None):
            body["tools"] = req.tools
        if req.think is not None:
            body["chat_template_kwargs"] = {"enable_thinking": req.think}
        creq = _openai(ChatCompletionRequest, body)
        chat = await self.serving.start_chat(creq, f"ollama-{uuid.uuid4().hex}")
        line = self._line(generate is not None, req.think)
        if req.stream:
            return NdjsonStream(self._stream(chat.run, chat.answer, line, started), chat.run)
        reasoning, text, calls, last = [], [], [], None
        async for r, t, c, out in self._answer(chat.run, chat.answer):
            reasoning.append(r)
            text.append(t)
            calls.extend(c)
            last = out
        return JSONResponse({**line("".join(text), "".join(reasoning), calls, done=True), **_done(last, started)})

    def _line(self, generate: bool, think: bool | None):
        name = self.serving.served_model_name

        def line(text: str, reasoning: str, calls: list, done: bool = False) -> dict:
            out: dict[str, Any] = {"model": name, "created_at": _now()}
            if generate:
                out["response"] = text
                if reasoning and think:
                    out["thinking"] = reasoning
            else:
                message: dict[str, Any] = {"role": "assistant", "content": text}
                if reasoning and think is not False:
                    message["thinking"] = reasoning
                if calls:
                    message["tool_calls"] = _tool_calls(calls)
                out["message"] = message
            out["done"] = done
            return out

        return line

    @staticmethod
    async def _answer(run, answer):
        """``(reasoning, text, calls, delta)`` for each engine delta of ``run`` (calls at the end)."""
        stream = AnswerStream(answer)
        async for _, out in run.events():
            reasoning, text = stream.feed(out.new_text)
            calls = []
            if out.finished:
                more_reasoning, more_text, calls = stream.finish(truncated=out.finish_reason == "length")
                reasoning, text = reasoning + more_reasoning, text + more_text
            yield reasoning, text, calls, out

    async def _stream(self, run, answer, line, started: float) -> AsyncIterator[str]:
        try:
            async for reasoning, text, calls, out in self._answer(run, answer):
                if out.finished:
                    if text or reasoning:
                        yield json.dumps(line(text, reasoning, [])) + "\n"
                    yield json.dumps({**line("", "", calls, done=True), **_done(out, started)}) + "\n"
                elif text or reasoning:
                    yield json.dumps(line(text, reasoning, [])) + "\n"
        except Exception as exc:  # noqa: BLE001 - once the stream has begun, an error is a line of its own
            yield json.dumps({"error": error_message(exc)}) + "\n"

    async def generate(self, req: OllamaGenerateRequest) -> Response:
        """``/api/generate``: the prompt (with ``system``) through the chat template, or as given
        with ``raw``; an empty prompt only loads the model, as Ollama's does."""
        if req.images:
            raise InvalidRequestError("images are not supported by this model", param="images")
        if req.suffix and self.serving.tokenizer.fim_tokens is None:
            raise InvalidRequestError("this model has no fill-in-the-middle tokens, so suffix is not supported",
                                      param="suffix")
        if req.template:
            raise InvalidRequestError("a per-request template is not supported; the model's own is used",
                                      param="template")
        if not req.prompt:
            return JSONResponse({"model": self.serving.served_model_name, "created_at": _now(), "response": "",
                                 "done": True, "done_reason": "load"})
        if not req.raw and not req.suffix:
            messages = ([OllamaMessage(role="system", content=req.system)] if req.system else []) + [
                OllamaMessage(role="user", content=req.prompt)]
            chat = OllamaChatRequest(model=req.model, messages=messages, format=req.format, options=req.options,
                                     stream=req.stream, think=req.think)
            return await self.chat(chat, generate=req)
        started = time.monotonic()
        creq = _openai(CompletionRequest, {"model": self.serving.served_model_name, "prompt": req.prompt,
                                           **sampling_fields(req.options, req.format)})
        params = creq.sampling_params()
        # (with a suffix: the model's fill-in-the-middle prompt, as /v1/completions builds it)
        ids = (self.serving.tokenizer.encode_infill(req.prompt, req.suffix) if req.suffix
               else self.serving.engine.encode_prompt(req.prompt))
        run = await self.serving.submit([ids], params, 0, f"ollama-{uuid.uuid4().hex}")
        answer = AnswerFormat(None, False, None, None)  # (a raw prompt's answer is read as it comes)
        line = self._line(True, None)
        if req.stream:
            return NdjsonStream(self._stream(run, answer, line, started), run)
        text, last = [], None
        async for _, t, _, out in self._answer(run, answer):
            text.append(t)
            last = out
        return JSONResponse({**line("".join(text), "", [], done=True), **_done(last, started)})

    async def embed(self, req: OllamaEmbedRequest) -> Response:
        """``/api/embed``: each input pooled and normalized, as ``/v1/embeddings``."""
        started = time.monotonic()
        items = EmbeddingRequest(input=req.input).inputs()  # (the OpenAI route's bounds on inputs)
        try:
            vectors, n = await while_connected(self.request, self.serving.embed_items(items, req.dimensions))
        except ClientGone:
            return Response(status_code=CLIENT_GONE)
        return JSONResponse({"model": self.serving.served_model_name, "embeddings": vectors.tolist(),
                             "total_duration": int((time.monotonic() - started) * 1e9), "load_duration": 0,
                             "prompt_eval_count": n})

    async def embeddings(self, req: OllamaEmbeddingsRequest) -> Response:
        """The legacy ``/api/embeddings``: one prompt's vector."""
        try:
            vectors, _ = await while_connected(self.request, self.serving.embed_items([req.prompt]))
        except ClientGone:
            return Response(status_code=CLIENT_GONE)
        return JSONResponse({"embedding": vectors[0].tolist()})

    async def show(self, req: OllamaModelRequest) -> Response:
        """``/api/show``: the template, details and facts of the (loaded) model."""
        info = self.serving.engine.model_info()
        template = self.serving.tokenizer.chat_template or ""
        capabilities = ["completion", *(["tools"] if template_takes_tools(template) else [])]
        if self.serving.engine.pooling != RANK:  # (every model here embeds: /api/embed pools its states)
            capabilities.append("embedding")
        defaults = self.serving.defaults
        modelfile = defaults.modelfile(str(info.path)) if defaults is not None else f"FROM {info.path}\n"
        parameters = "\n".join(line.removeprefix("PARAMETER ") for line in modelfile.splitlines()
                               if line.startswith("PARAMETER "))
        extra = {"system": defaults.system} if defaults is not None and defaults.system is not None else {}
        if defaults is not None and defaults.license is not None:
            extra["license"] = defaults.license
        return JSONResponse({
            **extra, "modelfile": modelfile, "parameters": parameters, "template": template,
            "details": _details(info.quant, info.architecture),
            "model_info": {"general.architecture": info.architecture, "general.parameter_count": info.parameters,
                           f"{info.architecture}.context_length": int(self.serving.engine.max_model_len)},
            "capabilities": capabilities, "modified_at": _now()})


def _details(quant: str | None, family: str = "") -> dict:
    return {"parent_model": "", "format": "gguf", "family": family, "families": [family] if family else None,
            "parameter_size": "", "quantization_level": quant or ""}


def add_ollama_routes(app: FastAPI, router) -> None:
    """Ollama's routes on ``app``, each request's model through ``router`` (a ``ModelRouter``); the
    store's (pull, delete, copy): :mod:`localllm.api.ollama.store_routes`."""
    add_store_routes(app)

    async def serve(request: Request, kind, handler) -> Response:
        """``handler(OllamaServing, body)`` on the model that ``body`` (``kind``, from the request's
        JSON) names; every error in Ollama's shape, ``{"error": message}``, with its status."""
        try:
            body = await read_body(request, kind)
            return await router.run(body, lambda serving: handler(OllamaServing(serving, request), body))
        except Exception as exc:  # noqa: BLE001 - every error leaves as Ollama's shape
            return error_response(exc)

    @app.post("/api/chat")
    async def ollama_chat(request: Request) -> Response:
        return await serve(request, OllamaChatRequest, OllamaServing.chat)

    @app.post("/api/generate")
    async def ollama_generate(request: Request) -> Response:
        return await serve(request, OllamaGenerateRequest, OllamaServing.generate)

    @app.post("/api/embed")
    async def ollama_embed(request: Request) -> Response:
        return await serve(request, OllamaEmbedRequest, OllamaServing.embed)

    @app.post("/api/embeddings")
    async def ollama_embeddings(request: Request) -> Response:
        return await serve(request, OllamaEmbeddingsRequest, OllamaServing.embeddings)

    @app.post("/api/show")
    async def ollama_show(request: Request) -> Response:
        return await serve(request, OllamaModelRequest, OllamaServing.show)

    @app.get("/api/tags")
    def ollama_tags() -> dict:
        models = []
        for source in router.pool.catalog.sources():
            modified = datetime.datetime.fromtimestamp(source.path.stat().st_mtime, datetime.timezone.utc) \
                if source.path.exists() else datetime.datetime.now(datetime.timezone.utc)
            models.append({"name": source.name, "model": source.name,
                           "modified_at": modified.isoformat().replace("+00:00", "Z"),
                           "size": source.size_bytes, "digest": "", "details": _details(source.quant)})
        return {"models": models}

    @app.get("/api/version")
    def ollama_version() -> dict:
        return {"version": localllm.__version__}
