"""The OpenAI-compatible HTTP API over a :class:`~localllm.pool.ModelPool` (or one AsyncEngine).

``build_app(pool)`` serves every model the pool offers, each loaded on its first request;
``build_app(engine, served_model_name, api_key)`` serves one engine the caller owns. The app neither
starts nor stops engines itself (``localllm serve``, the pool and the TUI own that). Routes:
``GET /v1/models``, ``POST /v1/chat/completions``, ``POST /v1/completions`` (JSON or SSE),
``POST /tokenize``, ``POST /detokenize``, llama-server's ``POST /infill`` (fill-in-the-middle),
``POST /v1/embeddings``, ``GET /api/ps`` and ``POST /api/unload`` (loaded models), ``GET /health``,
``GET /metrics``; Anthropic's ``POST /v1/messages`` and ``POST /v1/messages/count_tokens`` from
:mod:`localllm.api.anthropic`. Errors go through :mod:`localllm.api.errors`.

:class:`ModelRouter` resolves each request's ``model`` through the pool and holds a lease on it
until the response has ended (a stream: its last event), so that a model is never unloaded under a
request; :class:`OpenAIServing` is one loaded model's handlers.

A request whose client goes away is aborted in the engine at once, which frees its KV blocks:
for streams Starlette cancels the response when it sees the disconnect; non-streaming handlers
poll ``request.is_disconnected()`` while they wait.
"""

from __future__ import annotations

import asyncio
import base64
import datetime
import hmac
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from fastapi import FastAPI, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.responses import StreamingResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from localllm import __version__
from localllm.api import anthropic
from localllm.api.background import in_background
from localllm.api.errors import AuthenticationError, error_response, exception_body, install_error_handlers
from localllm.api.guard import DEFAULT_MAX_REQUEST_BYTES, BodyCheck, HostCheck
from localllm.api.metrics import Metrics, ModelMetrics, RequestTracker
from localllm.api.protocol import (
    MIN_LOGPROB,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    ChatLogprobs,
    ChatResponseMessage,
    ChatTokenLogprob,
    ChatTopLogprob,
    CompletionChoice,
    CompletionChunk,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    EmbeddingData,
    EmbeddingRequest,
    EmbeddingResponse,
    EmbeddingUsage,
    FunctionCall,
    FunctionCallDelta,
    InfillRequest,
    InfillResponse,
    ModelCard,
    ModelList,
    NamedToolChoice,
    PromptTokensDetails,
    TokenizeRequest,
    TokenizeResponse,
    ToolCall,
    ToolCallDelta,
    UnloadRequest,
    Usage,
)
from localllm.api.reasoning import ReasoningStream, prompt_opens_thinking, split_reasoning, template_reasons
from localllm.api.tools import (
    ParsedCall,
    ToolStream,
    call_grammar,
    parse_tool_calls,
    template_messages,
    template_takes_tools,
    tool_format,
)
from localllm.async_engine import AsyncEngine
from localllm.embeddings import normalize
from localllm.errors import EngineDeadError, InvalidRequestError, ModelNotFoundError
from localllm.outputs import RequestOutput
from localllm.pool import KEEP_ALIVE_UNSET, LoadedModel, ModelCatalog, ModelPool, ModelSource
from localllm.sampler import TokenLogprobs
from localllm.sampling_params import SamplingParams

DISCONNECT_POLL_SECONDS = 0.25
# Paths anyone may read without the API key (probes and Prometheus scrapes), as in vLLM.
PUBLIC_PATHS = frozenset({"/health", "/metrics"})


class _Run:
    """The engine requests behind one API request (one per prompt), their deltas merged.

    :meth:`start` submits them all and raises the first submission error (invalid prompt, full
    queue) after aborting the others, so it can still become an HTTP status. :meth:`events`
    yields ``(prompt_index, delta)``; :meth:`close` aborts whatever has not finished.
    """

    def __init__(
        self,
        engine: AsyncEngine,
        prompts: list[str | list[int]],
        params: SamplingParams,
        priority: int,
        request_id: str,
    ) -> None:
        self._gens = [
            engine.generate(p, params, request_id if len(prompts) == 1 else f"{request_id}-{i}", priority)
            for i, p in enumerate(prompts)
        ]
        self._queue: asyncio.Queue = asyncio.Queue()
        self._tasks: list[asyncio.Task] = []
        self._error: BaseException | None = None

    async def start(self) -> None:
        self._tasks = [asyncio.create_task(self._pump(i, g)) for i, g in enumerate(self._gens)]
        # AsyncEngine.generate validates and queues its request before it first suspends, so
        # one pass of the event loop settles every submission.
        await asyncio.sleep(0)
        if self._error is not None:
            self.close()
            raise self._error

    async def _pump(self, index: int, gen: AsyncIterator[RequestOutput]) -> None:
        try:
            async for out in gen:
                self._queue.put_nowait((index, out))
        except Exception as exc:  # noqa: BLE001 - handed to the consumer
            self._error = self._error or exc
            self._queue.put_nowait((index, exc))
        finally:
            self._queue.put_nowait((index, None))

    async def events(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        remaining = len(self._tasks)
        while remaining:
            index, item = await self._queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item

    def close(self) -> None:
        for task in self._tasks:
            if not task.done():
                task.cancel()


class _EventStream(StreamingResponse):
    """Server-sent events that abort their run however the response ends (even before it starts)."""

    def __init__(self, content: AsyncIterator[str], run: _Run) -> None:
        super().__init__(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self._run = run
        self._on_close: list[Callable[[], None]] = []

    def on_close(self, fn: Callable[[], None]) -> None:
        """``fn()`` runs once the response has ended, however it ends (the model's lease, ...)."""
        self._on_close.append(fn)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._run.close()
            for fn in self._on_close:
                fn()


def _tool_call(call: ParsedCall) -> ToolCall:
    return ToolCall(id=call.id, function=FunctionCall(name=call.name, arguments=call.arguments))


def _json(body) -> Response:
    return Response(body.model_dump_json(), media_type="application/json")


def _sse(payload) -> str:
    data = payload.model_dump_json() if hasattr(payload, "model_dump_json") else json.dumps(payload)
    return f"data: {data}\n\n"


async def _with_error_event(chunks: AsyncIterator[str]) -> AsyncIterator[str]:
    """Once a stream has begun, an error can only be reported in it: one error event, then [DONE]."""
    try:
        async for chunk in chunks:
            yield chunk
    except Exception as exc:  # noqa: BLE001 - becomes an OpenAI-shaped error event
        yield _sse(exception_body(exc)[1])
        yield "data: [DONE]\n\n"


@dataclass(slots=True)
class _Choice:
    index: int
    text: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    num_output_tokens: int = 0


class _UsageCounter:
    __slots__ = ("cached_tokens", "output_tokens", "prompt_tokens")

    def __init__(self) -> None:
        self.prompt_tokens: dict[int, int] = {}
        self.cached_tokens: dict[int, int] = {}
        self.output_tokens: dict[tuple[int, int], int] = {}

    def add(self, prompt_index: int, out: RequestOutput) -> None:
        self.prompt_tokens[prompt_index] = out.num_prompt_tokens
        self.cached_tokens[prompt_index] = max(self.cached_tokens.get(prompt_index, 0), out.num_cached_tokens)
        self.output_tokens[(prompt_index, out.index)] = out.num_output_tokens

    def usage(self) -> Usage:
        prompt, completion = sum(self.prompt_tokens.values()), sum(self.output_tokens.values())
        return Usage(
            prompt_tokens=prompt,
            completion_tokens=completion,
            total_tokens=prompt + completion,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=sum(self.cached_tokens.values())),
        )


class _ApiKeyMiddleware:
    """Requires ``Authorization: Bearer KEY`` or ``x-api-key: KEY`` (Anthropic's clients) on every
    path but :data:`PUBLIC_PATHS`."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.api_key = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in PUBLIC_PATHS:
            headers = dict(scope["headers"])
            scheme, _, token = headers.get(b"authorization", b"").partition(b" ")
            x_api_key = headers.get(b"x-api-key")  # Anthropic's clients send the key here
            if not (
                (scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.api_key))
                or (x_api_key is not None and hmac.compare_digest(x_api_key.strip(), self.api_key))
            ):
                exc = AuthenticationError(
                    "missing or wrong API key: send it as 'Authorization: Bearer KEY' or 'x-api-key: KEY'"
                )
                await error_response(exc)(scope, receive, send)
                return
        await self.app(scope, receive, send)


class OpenAIServing:
    """The handlers' logic, independent of routing."""

    def __init__(self, engine: AsyncEngine, served_model_name: str, metrics: ModelMetrics | None = None,
                 *, check_names: bool = True) -> None:
        """One model's handlers; ``check_names``: refuse a request naming another model (off when a
        :class:`ModelRouter` has already resolved the name through its pool)."""
        self.engine = engine
        self.served_model_name = served_model_name
        self.tokenizer = engine.tokenizer
        self.model_info = engine.model_info()
        self.vocab_size = self.model_info.vocab_size
        if metrics is None:
            metrics = Metrics(lambda: [(served_model_name, engine)]).for_model(served_model_name, engine)
        self.metrics = metrics
        self.check_names = check_names
        self.created = int(time.time())
        self._token_strs: dict[int, str] = {}
        self.anthropic = anthropic.AnthropicServing(self)

    # ---------------------------------------------------------------- shared checks

    def check_model(self, model: str | None) -> None:
        if self.check_names and model and model != self.served_model_name:
            raise ModelNotFoundError(
                f"The model `{model}` does not exist; this server serves `{self.served_model_name}`.",
                param="model",
                code="model_not_found",
            )

    def token_str(self, token_id: int) -> str:
        s = self._token_strs.get(token_id)
        if s is None:
            s = self._token_strs[token_id] = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return s

    async def _submit(
        self,
        prompts: list[str | list[int]],
        params: SamplingParams,
        priority: int | None,
        request_id: str,
        infill: Callable[[str | list[int]], list[int]] | None = None,
    ) -> _Run:
        """Validate, tokenize (on a worker thread: a 10 MB prompt must not stall other clients'
        streams on this event loop) and queue the engine requests of one API request; ``infill``
        first turns each prompt into a fill-in-the-middle prompt's ids."""
        if params.structured is not None:  # compiling a grammar (the first one: seconds) off the event loop
            await in_background(self.engine.check_params, params)
        else:
            self.engine.check_params(params)
        encode = self.engine.encode_prompt
        if infill is None:
            prompt_ids = await in_background(lambda: [encode(p) for p in prompts])
        else:
            prompt_ids = await in_background(lambda: [encode(infill(p)) for p in prompts])
        run = _Run(self.engine, prompt_ids, params, priority or 0, request_id)
        await run.start()
        return run

    async def _unless_disconnected(self, request: Request, run: _Run, work: Awaitable[Response]) -> Response:
        task = asyncio.ensure_future(work)
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_SECONDS)
                if done:
                    return task.result()
                if await request.is_disconnected():
                    return Response(status_code=499)
        finally:
            task.cancel()
            run.close()

    async def _collect(self, run: _Run, n: int, tracker: RequestTracker) -> tuple[list[_Choice], Usage]:
        choices: dict[int, _Choice] = {}
        usage = _UsageCounter()
        async for i, out in run.events():
            tracker.observe(out)
            usage.add(i, out)
            c = choices.setdefault(i * n + out.index, _Choice(i * n + out.index))
            c.text.append(out.new_text)
            c.logprobs.extend(out.new_logprobs)
            c.num_output_tokens = out.num_output_tokens
            if out.finished:
                c.finish_reason = out.finish_reason
        return [choices[k] for k in sorted(choices)], usage.usage()

    # ---------------------------------------------------------------- logprobs

    def chat_logprobs(self, lps: list[TokenLogprobs]) -> ChatLogprobs:
        def top(token_id: int, logprob: float) -> ChatTopLogprob:
            s = self.token_str(token_id)
            return ChatTopLogprob(token=s, logprob=max(logprob, MIN_LOGPROB), bytes=list(s.encode()))

        content = []
        for lp in lps:
            t = top(lp.token_id, lp.logprob)
            content.append(
                ChatTokenLogprob(
                    token=t.token,
                    logprob=t.logprob,
                    bytes=t.bytes,
                    top_logprobs=[top(i, v) for i, v in lp.top],
                )
            )
        return ChatLogprobs(content=content)

    def completion_logprobs(self, lps: list[TokenLogprobs], offset: int) -> CompletionLogprobs:
        out = CompletionLogprobs()
        for lp in lps:
            s = self.token_str(lp.token_id)
            out.tokens.append(s)
            out.token_logprobs.append(max(lp.logprob, MIN_LOGPROB))
            out.top_logprobs.append({self.token_str(i): max(v, MIN_LOGPROB) for i, v in lp.top})
            out.text_offset.append(offset)
            offset += len(s)
        return out

    # ---------------------------------------------------------------- chat completions

    def _tools(self, req: ChatCompletionRequest, params: SamplingParams, messages: list[dict]):
        """``(messages, template variables, tool-call format or None)`` for ``req``'s tools (see
        :mod:`localllm.api.tools`); a ``required`` or named ``tool_choice`` constrains ``params``."""
        tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
        choice = req.tool_choice
        template = self.tokenizer.chat_template
        takes_tools = template_takes_tools(template)
        if tools is None or choice == "none":
            if choice not in (None, "none", "auto"):
                raise InvalidRequestError("tool_choice needs tools", param="tool_choice")
            return template_messages(messages, None, takes_tools), {}, None
        fmt = tool_format(template)
        if choice == "required" or isinstance(choice, NamedToolChoice):
            if params.structured is not None:
                raise InvalidRequestError("a required or named tool_choice cannot be combined with response_format "
                                          "or guided decoding", param="tool_choice")
            name = choice.function.name if isinstance(choice, NamedToolChoice) else None
            parallel = req.parallel_tool_calls is not False and name is None
            params.structured = call_grammar(tools, name, parallel, fmt)
        params.skip_special_tokens = False  # some formats' markers are special tokens ([TOOL_CALLS])
        return template_messages(messages, tools, takes_tools), ({"tools": tools} if takes_tools else {}), fmt

    async def chat(self, req: ChatCompletionRequest, request: Request) -> Response:
        self.check_model(req.model)
        params = req.sampling_params()
        messages, variables, fmt = self._tools(req, params, [m.to_template() for m in req.messages])
        variables = {**(req.chat_template_kwargs or {}), **variables}
        tok = self.tokenizer

        def render() -> tuple[str, list[int]]:
            text = tok.render_chat(messages, True, **variables)
            return text, tok.encode(text, add_special_tokens=True)

        prompt_text, prompt_ids = await in_background(render)
        form = req.reasoning_format or "auto"
        # None: no reasoning split; else whether the answer begins inside a <think> block
        thinking = None if form == "none" or (form == "auto" and not template_reasons(tok.chat_template)) \
            else prompt_opens_thinking(prompt_text)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        run = await self._submit([prompt_ids], params, req.priority, request_id)
        created = int(time.time())
        if req.stream:
            return _EventStream(
                _with_error_event(self._chat_stream(run, req, request_id, created, params.n, fmt, thinking)), run
            )
        return await self._unless_disconnected(
            request, run, self._chat_response(run, req, request_id, created, params.n, fmt, thinking)
        )

    async def _chat_response(
        self, run: _Run, req: ChatCompletionRequest, request_id: str, created: int, n: int, fmt: str | None,
        thinking: bool | None = None,
    ) -> Response:
        choices, usage = await self._collect(run, n, self.metrics.tracker())
        out = []
        for c in choices:
            text, calls, finish, reasoning = "".join(c.text), [], c.finish_reason, None
            if thinking is not None:
                reasoning, text = split_reasoning(text, thinking)
            if fmt is not None:
                parsed, calls = parse_tool_calls(text, fmt)
                if calls:
                    text = parsed
                    finish = "tool_calls" if finish == "stop" else finish
            out.append(ChatChoice(
                index=c.index,
                message=ChatResponseMessage(content=text, reasoning_content=reasoning,
                                            tool_calls=[_tool_call(t) for t in calls] or None),
                logprobs=self.chat_logprobs(c.logprobs) if req.logprobs else None,
                finish_reason=finish,
            ))
        body = ChatCompletionResponse(id=request_id, created=created, model=self.served_model_name, usage=usage,
                                      choices=out)
        return _json(body)

    async def _chat_stream(
        self, run: _Run, req: ChatCompletionRequest, request_id: str, created: int, n: int, fmt: str | None = None,
        thinking: bool | None = None,
    ) -> AsyncIterator[str]:
        tracker = self.metrics.tracker()
        usage = _UsageCounter()
        started: set[int] = set()

        def chunk(choices: list[ChatChunkChoice], u: Usage | None = None) -> str:
            return _sse(
                ChatCompletionChunk(
                    id=request_id, created=created, model=self.served_model_name, choices=choices, usage=u
                )
            )

        streams: dict[int, ToolStream] = {}
        thoughts: dict[int, ReasoningStream] = {}
        async for i, out in run.events():
            tracker.observe(out)
            usage.add(i, out)
            index = i * n + out.index
            first = index not in started
            started.add(index)
            logprobs = self.chat_logprobs(out.new_logprobs) if req.logprobs and out.new_logprobs else None
            text, finish, calls, reasoning = out.new_text, out.finish_reason, [], None
            if thinking is not None:  # <think> text goes to reasoning_content
                split = thoughts.setdefault(index, ReasoningStream(thinking))
                reasoning, text = split.feed(text)
                if out.finished:
                    more_reasoning, more_text = split.finish()
                    reasoning, text = reasoning + more_reasoning, text + more_text
                reasoning = reasoning or None
            if fmt is not None:  # hold back what may be tool calls; parse them at the end
                stream = streams.setdefault(index, ToolStream(fmt))
                text = stream.feed(out.new_text)
                if out.finished:
                    rest, calls = stream.finish()
                    text += rest
                    if calls and finish == "stop":
                        finish = "tool_calls"
            if not (first or text or reasoning or out.finished or logprobs):
                continue
            if calls:  # the content first, then each call: its id and name, then its arguments
                if first or text or reasoning:
                    yield chunk([ChatChunkChoice(index=index, delta=ChatDelta(
                        role="assistant" if first else None, content=text, reasoning_content=reasoning),
                        logprobs=logprobs)])
                    first, logprobs = False, None
                for j, call in enumerate(calls):
                    yield chunk([ChatChunkChoice(index=index, delta=ChatDelta(tool_calls=[ToolCallDelta(
                        index=j, id=call.id, type="function", function=FunctionCallDelta(name=call.name, arguments=""))]))])
                    yield chunk([ChatChunkChoice(index=index, delta=ChatDelta(tool_calls=[ToolCallDelta(
                        index=j, function=FunctionCallDelta(arguments=call.arguments))]))])
                yield chunk([ChatChunkChoice(index=index, delta=ChatDelta(), finish_reason=finish)])
                continue
            delta = ChatDelta(role="assistant" if first else None, content=text, reasoning_content=reasoning)
            yield chunk(
                [
                    ChatChunkChoice(
                        index=index, delta=delta, logprobs=logprobs, finish_reason=finish
                    )
                ]
            )
        if req.include_usage:
            yield chunk([], usage.usage())
        yield "data: [DONE]\n\n"

    # ---------------------------------------------------------------- text completions

    def _check_fim(self, what: str, param: str | None) -> None:
        if self.tokenizer.fim_tokens is None:
            raise InvalidRequestError(
                f"this model has no fill-in-the-middle tokens, so {what} is not supported", param=param
            )

    async def completion(self, req: CompletionRequest, request: Request) -> Response:
        self.check_model(req.model)
        infill = None
        if req.suffix is not None:
            if req.echo:
                raise InvalidRequestError("echo is not supported together with suffix", param="echo")
            self._check_fim("`suffix`", "suffix")
            suffix = req.suffix

            def infill(prompt: str | list[int]) -> list[int]:
                return self.tokenizer.encode_infill(prompt, suffix)

        params = req.sampling_params()
        request_id = f"cmpl-{uuid.uuid4().hex}"
        try:
            run = await self._submit(req.prompts(), params, req.priority, request_id, infill)
        except InvalidRequestError as exc:
            if exc.param == "messages":
                exc.param = "prompt"
            raise
        created = int(time.time())
        if req.stream:
            return _EventStream(
                _with_error_event(self._completion_stream(run, req, request_id, created, params.n)), run
            )
        return await self._unless_disconnected(
            request, run, self._completion_response(run, req, request_id, created, params.n)
        )

    async def _completion_response(
        self, run: _Run, req: CompletionRequest, request_id: str, created: int, n: int
    ) -> Response:
        choices, usage = await self._collect(run, n, self.metrics.tracker())
        body = CompletionResponse(
            id=request_id,
            created=created,
            model=self.served_model_name,
            usage=usage,
            choices=[
                CompletionChoice(
                    index=c.index,
                    text="".join(c.text),
                    logprobs=self.completion_logprobs(c.logprobs, 0) if req.logprobs is not None else None,
                    finish_reason=c.finish_reason,
                )
                for c in choices
            ],
        )
        return _json(body)

    async def _completion_stream(
        self, run: _Run, req: CompletionRequest, request_id: str, created: int, n: int
    ) -> AsyncIterator[str]:
        tracker = self.metrics.tracker()
        usage = _UsageCounter()
        offsets: dict[int, int] = {}

        def chunk(choices: list[CompletionChoice], u: Usage | None = None) -> str:
            return _sse(
                CompletionChunk(
                    id=request_id, created=created, model=self.served_model_name, choices=choices, usage=u
                )
            )

        async for i, out in run.events():
            tracker.observe(out)
            usage.add(i, out)
            index = i * n + out.index
            logprobs = None
            if req.logprobs is not None and out.new_logprobs:
                logprobs = self.completion_logprobs(out.new_logprobs, offsets.get(index, 0))
                offsets[index] = offsets.get(index, 0) + sum(len(t) for t in logprobs.tokens)
            if not (out.new_text or out.finished or logprobs):
                continue
            yield chunk(
                [
                    CompletionChoice(
                        index=index, text=out.new_text, logprobs=logprobs, finish_reason=out.finish_reason
                    )
                ]
            )
        if req.include_usage:
            yield chunk([], usage.usage())
        yield "data: [DONE]\n\n"

    # ---------------------------------------------------------------- llama-server's /infill

    async def infill(self, req: InfillRequest, request: Request) -> Response:
        self.check_model(req.model)
        self._check_fim("/infill", None)
        params = req.sampling_params()
        extra = [(c.filename, c.text) for c in req.input_extra or []]

        def infill(prefix: str | list[int]) -> list[int]:
            return self.tokenizer.encode_infill(prefix, req.input_suffix, req.prompt or "", extra)

        run = await self._submit(
            [req.input_prefix], params, req.priority, f"infill-{uuid.uuid4().hex}", infill
        )
        if req.stream:
            return _EventStream(_with_error_event(self._infill_stream(run)), run)
        return await self._unless_disconnected(request, run, self._infill_response(run))

    def _infill_final(
        self, out: RequestOutput, last_token: int | None, content: str, tokens: list[int]
    ) -> InfillResponse:
        if out.finish_reason == "length":
            stop_type = "limit"
        elif out.finish_reason == "stop":
            stop_type = "eos" if last_token in self.tokenizer.stop_token_ids else "word"
        else:
            stop_type = "none"
        return InfillResponse(
            content=content,
            tokens=tokens,
            stop=True,
            model=self.served_model_name,
            tokens_predicted=out.num_output_tokens,
            tokens_evaluated=out.num_prompt_tokens,
            stop_type=stop_type,
            stopping_word="",
            tokens_cached=out.num_cached_tokens,
            truncated=False,
        )

    async def _infill_response(self, run: _Run) -> Response:
        tracker = self.metrics.tracker()
        text: list[str] = []
        tokens: list[int] = []
        last = None
        async for _, out in run.events():
            tracker.observe(out)
            text.append(out.new_text)
            tokens.extend(out.new_token_ids)
            last = out
        return _json(self._infill_final(last, tokens[-1] if tokens else None, "".join(text), tokens))

    async def _infill_stream(self, run: _Run) -> AsyncIterator[str]:
        """llama-server's stream: ``data: {content, stop: false, ...}`` chunks, then a final one with
        ``stop: true`` and empty content (no ``[DONE]``, as llama-server's non-OpenAI routes)."""
        tracker = self.metrics.tracker()
        last_token = None
        async for _, out in run.events():
            tracker.observe(out)
            if out.new_token_ids:
                last_token = out.new_token_ids[-1]
            if out.new_text or out.new_token_ids:
                partial = InfillResponse(
                    content=out.new_text,
                    tokens=out.new_token_ids,
                    stop=False,
                    model=self.served_model_name,
                    tokens_predicted=out.num_output_tokens,
                    tokens_evaluated=out.num_prompt_tokens,
                )
                yield f"data: {partial.model_dump_json(exclude_none=True)}\n\n"
            if out.finished:
                yield _sse(self._infill_final(out, last_token, "", []))

    # ---------------------------------------------------------------- everything else

    def tokenize(self, req: TokenizeRequest) -> TokenizeResponse:
        self.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise InvalidRequestError("give exactly one of prompt and messages", param="prompt")
        if req.messages is not None:
            if not req.messages:
                raise InvalidRequestError("messages must contain at least one message", param="messages")
            text = self.tokenizer.render_chat(
                [m.to_template() for m in req.messages], req.add_generation_prompt
            )
        else:
            text = req.prompt
        ids = self.tokenizer.encode(text, add_special_tokens=req.add_special_tokens)
        return TokenizeResponse(
            count=len(ids),
            max_model_len=self.engine.max_model_len,
            tokens=ids,
            token_strs=self.tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None,
        )

    def detokenize(self, req: DetokenizeRequest) -> DetokenizeResponse:
        self.check_model(req.model)
        bad = next((t for t in req.tokens if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise InvalidRequestError(
                f"token id {bad} is outside the vocabulary [0, {self.vocab_size})", param="tokens"
            )
        return DetokenizeResponse(prompt=self.tokenizer.decode(req.tokens))


    async def embeddings(self, req: EmbeddingRequest) -> Response:
        """``/v1/embeddings``: each input through the engine's batching window (see
        :mod:`localllm.embeddings`), pooled, normalized, optionally cut to ``dimensions``."""
        self.check_model(req.model)
        items = req.inputs()
        limit = self.engine.max_model_len
        encode = self.engine.encode_prompt

        def tokenize() -> list[list[int]]:
            out = []
            for i, item in enumerate(items):
                ids = encode(item)
                if len(ids) > limit:
                    raise InvalidRequestError(f"input {i} has {len(ids)} tokens, more than this model's context "
                                              f"of {limit}", param="input", code="context_length_exceeded")
                out.append(ids)
            return out

        token_ids = await in_background(tokenize)
        vectors = await asyncio.gather(*(self.engine.embed(ids) for ids in token_ids))
        normed = normalize(torch.stack(vectors), req.dimensions)
        data = []
        for i, v in enumerate(normed):
            if req.encoding_format == "base64":
                value: list[float] | str = base64.b64encode(v.numpy().astype("<f4").tobytes()).decode()
            else:
                value = v.tolist()
            data.append(EmbeddingData(index=i, embedding=value))
        n = sum(len(t) for t in token_ids)
        return _json(EmbeddingResponse(data=data, model=self.served_model_name,
                                       usage=EmbeddingUsage(prompt_tokens=n, total_tokens=n)))


class ModelRouter:
    """Each request's ``model`` through the :class:`~localllm.pool.ModelPool` (loading it on first
    use), one :class:`OpenAIServing` per loaded model, and the server-wide routes' logic
    (``/v1/models``, ``/api/ps``, ``/api/unload``, ``/health``, ``/metrics``)."""

    def __init__(self, pool: ModelPool) -> None:
        self.pool = pool
        self.metrics = Metrics(self.engines)
        self.created = int(time.time())
        self._servings: dict[str, OpenAIServing] = {}
        # Each loaded model's serving (and its metrics' series) from the moment it loads.
        for model in pool.loaded():
            self.serving(model)
        pool.on_load(self.serving)
        pool.on_unload(lambda model: self._servings.pop(model.name, None))

    def engines(self) -> list[tuple[str, AsyncEngine]]:
        return [(m.name, m.engine) for m in self.pool.loaded() if m.engine is not None]

    def serving(self, model: LoadedModel) -> OpenAIServing:
        serving = self._servings.get(model.name)
        if serving is None or serving.engine is not model.engine:
            serving = OpenAIServing(model.engine, model.name, self.metrics.for_model(model.name, model.engine),
                                    check_names=False)
            self._servings[model.name] = serving
        return serving

    async def run(self, body, work: Callable[[OpenAIServing], Awaitable[Response]]) -> Response:
        """``work`` on the serving of ``body.model``, under a lease on that model that lasts until
        the response has ended (for a stream: until its last event)."""
        keep_alive = body.keep_alive if getattr(body, "keep_alive", None) is not None else KEEP_ALIVE_UNSET
        lease = await self.pool.lease(getattr(body, "model", None), keep_alive)
        try:
            response = await work(self.serving(lease.model))
        except BaseException:
            lease.release()
            raise
        if isinstance(response, _EventStream):
            response.on_close(lease.release)
        else:
            lease.release()
        return response

    # ---------------------------------------------------------------- server-wide routes

    def _card(self, source: ModelSource) -> ModelCard:
        model = self.pool.get(source.name)
        engine = model.engine if model is not None else None
        header_context = self.pool.catalog.context_length(source)
        if engine is not None:
            context = int(engine.max_model_len)
        else:
            context = header_context
        created = self.created
        created_at = datetime.datetime.fromtimestamp(created, datetime.timezone.utc).isoformat()
        return ModelCard(
            id=source.name,
            created=created,
            root=str(source.path),
            max_model_len=context or 0,
            display_name=source.name,
            created_at=created_at.replace("+00:00", "Z"),
            loaded=engine is not None,
            quant=source.quant if source.quant is not None else (engine.model_info().quant if engine else None),
            size_bytes=source.size_bytes,
            context_length=context,
        )

    def models(self) -> ModelList:
        cards = [self._card(source) for source in self.pool.catalog.sources()]
        return ModelList(data=cards, first_id=cards[0].id if cards else None, last_id=cards[-1].id if cards else None)

    def ps(self) -> dict:
        out = []
        now = time.time()
        for model in self.pool.loaded():
            engine = model.engine
            if engine is None:
                continue
            stats = engine.stats()
            expires_in = self.pool.expires_in(model)
            expires_at = None
            if expires_in is not None:
                expires_at = datetime.datetime.fromtimestamp(now + expires_in, datetime.timezone.utc)
                expires_at = expires_at.isoformat().replace("+00:00", "Z")
            info = engine.model_info()
            out.append({
                "name": model.name,
                "quant": model.source.quant or info.quant,
                "device": info.device,  # where it runs, on which kernels, in which dtype
                "kernels": info.kernels,
                "dtype": info.dtype,
                "size_bytes": model.memory_bytes,
                "context_length": int(engine.max_model_len),
                "running": int(stats.num_running),
                "waiting": int(stats.num_waiting),
                "expires_at": expires_at,
            })
        return {"models": out}

    async def unload(self, body: UnloadRequest) -> dict:
        result = await self.pool.unload(body.model)
        out: dict = {"model": body.model, "unloaded": result.unloaded}
        if result.pending:
            out["pending"] = True
        return out

    def health(self) -> Response:
        for _name, engine in self.engines():
            state = engine.health()
            if not state.ok:
                return error_response(EngineDeadError(state.reason or "the engine is not healthy",
                                                      code="engine_stalled" if state.stalled else "engine_dead"))
        return Response(status_code=200)


def pool_for_engine(engine: AsyncEngine, served_model_name: str) -> ModelPool:
    """A pool holding just ``engine`` (owned by the caller: never unloaded) under ``served_model_name``."""
    info = engine.model_info()
    path = Path(info.path)
    size = path.stat().st_size if path.is_file() else 0
    source = ModelSource(served_model_name, path, info.quant, size, pinned=True)
    pool = ModelPool(ModelCatalog([source], include_store=False), _no_loading)
    pool.add_loaded(source, engine, owned=False)
    pool.default_model = served_model_name
    return pool


def _no_loading(source: ModelSource):
    raise ModelNotFoundError(f"The model `{source.name}` is not loaded.", param="model", code="model_not_found")


def build_app(
    engine: AsyncEngine | ModelPool,
    served_model_name: str | None = None,
    api_key: str | None = None,
    *,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
    allowed_hosts: frozenset[str] | None = None,
) -> FastAPI:
    """The API app over a :class:`~localllm.pool.ModelPool` (every model it offers, loaded on
    demand), or over one ``engine`` served as ``served_model_name`` (the caller's: the app neither
    starts nor stops it); with ``api_key``, every path but /health and /metrics needs it.

    ``allowed_hosts`` (see :func:`localllm.api.guard.allowed_host_names`) are the Host names it
    answers, None for any; bodies over ``max_request_bytes`` get 413, POSTs that are not JSON 415.
    """
    if isinstance(engine, ModelPool):
        pool = engine
    else:
        if served_model_name is None:
            raise TypeError("build_app(engine, served_model_name): the name clients send is required")
        pool = pool_for_engine(engine, served_model_name)
    app = FastAPI(title="localllm", version=__version__, docs_url=None, redoc_url=None, openapi_url=None)
    install_error_handlers(app)
    # The last added runs first: Host check, then the API key, then the body's type and size.
    app.add_middleware(BodyCheck, max_request_bytes=max_request_bytes)
    if api_key:
        app.add_middleware(_ApiKeyMiddleware, api_key=api_key)
    app.add_middleware(HostCheck, allowed_hosts=allowed_hosts)
    # Outermost: errors of every layer on /v1/messages* leave in Anthropic's shape.
    app.add_middleware(anthropic.AnthropicErrorShape)
    router = ModelRouter(pool)
    app.state.router = router
    app.state.pool = pool
    anthropic.add_anthropic_routes(app, router)

    @app.get("/v1/models")
    def list_models() -> ModelList:  # reads file headers: on the thread pool
        return router.models()

    @app.post("/v1/chat/completions")
    async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response:
        return await router.run(body, lambda serving: serving.chat(body, request))

    @app.post("/v1/completions")
    async def create_completion(body: CompletionRequest, request: Request) -> Response:
        return await router.run(body, lambda serving: serving.completion(body, request))

    @app.post("/infill")
    async def infill(body: InfillRequest, request: Request) -> Response:
        return await router.run(body, lambda serving: serving.infill(body, request))

    @app.post("/v1/embeddings")
    async def create_embeddings(body: EmbeddingRequest) -> Response:
        return await router.run(body, lambda serving: serving.embeddings(body))

    # Tokenizing a long text must not stall the event loop (and every stream on it): a worker thread.
    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> Response:
        return await router.run(body, lambda serving: _in_thread(serving.tokenize, body))

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> Response:
        return await router.run(body, lambda serving: _in_thread(serving.detokenize, body))

    @app.get("/api/ps")
    def list_loaded() -> dict:
        return router.ps()

    @app.post("/api/unload")
    async def unload(body: UnloadRequest) -> dict:
        return await router.unload(body)

    @app.get("/health")
    def health() -> Response:
        return router.health()

    @app.get("/metrics")
    def metrics() -> Response:
        return Response(router.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return app


async def _in_thread(fn: Callable, body) -> Response:
    return _json(await in_background(fn, body))
