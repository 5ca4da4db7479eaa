"""The OpenAI-compatible routes' logic for one loaded model (:class:`OpenAIServing`), independent of
routing: chat and text completions (JSON or SSE, tools, reasoning, logprobs) and fill-in-the-middle;
embeddings, rerank, tokenize and detokenize are its base's (:mod:`localllm.api.openai.model_serving`).

A request whose client goes away is aborted in the engine at once, which frees its KV blocks:
for streams Starlette cancels the response when it sees the disconnect; non-streaming handlers
poll ``request.is_disconnected()`` while they wait.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

from fastapi import Request
from fastapi.responses import Response

from localllm.api.answers import AnswerFormat, AnswerStream, answer_format, read_answer
from localllm.api.background import in_background
from localllm.api.errors import exception_body
from localllm.api.guard import priority_bound
from localllm.api.logprobs import LogprobFormat
from localllm.api.metrics import Metrics, ModelMetrics, RequestTracker
from localllm.api.openai.model_serving import (
    CLIENT_GONE,
    ClientGone,
    ModelServing,
    json_response,
    while_connected,
)
from localllm.api.openai.protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    ChatResponseMessage,
    CompletionChoice,
    CompletionChunk,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    FunctionCall,
    FunctionCallDelta,
    InfillRequest,
    InfillResponse,
    NamedToolChoice,
    PromptTokensDetails,
    ToolCall,
    ToolCallDelta,
    Usage,
)
from localllm.api.options import with_model_defaults
from localllm.api.streaming import EventStream, Run
from localllm.api.tools import ParsedCall, call_grammar, template_messages, template_takes_tools, tool_format
from localllm.engine.async_engine import AsyncEngine
from localllm.engine.context_fit import fit_chat
from localllm.errors import InvalidRequestError
from localllm.outputs import RequestOutput, TokenLogprobs
from localllm.sampling_params import SamplingParams

DROPPED_HEADER = "x-context-dropped-messages"
"""The response header that says how many earlier messages a request's ``context_overflow`` left out."""


def _tool_call(call: ParsedCall) -> ToolCall:
    return ToolCall(id=call.id, function=FunctionCall(name=call.name, arguments=call.arguments))


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


@dataclass(frozen=True, slots=True)
class ChatRun:
    """A queued chat request: its engine run, sampling parameters, and how to read its answer
    (reasoning, content, tool calls: :mod:`localllm.api.answers`)."""

    run: Run
    params: SamplingParams
    answer: AnswerFormat
    dropped: int = 0  # earlier messages left out by the request's context_overflow policy


@dataclass(slots=True)
class _Choice:
    index: int
    text: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    num_output_tokens: int = 0
    prompt_logprobs: list[TokenLogprobs | None] | None = None


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


class OpenAIServing(ModelServing):
    """The handlers' logic, independent of routing: the generation routes here, the rest in
    :class:`~localllm.api.openai.model_serving.ModelServing`."""

    def __init__(self, engine: AsyncEngine, served_model_name: str, metrics: ModelMetrics | None = None,
                 *, check_names: bool = True, max_client_priority: int = 0, defaults=None) -> None:
        """One model's handlers; ``check_names``: refuse a request naming another model (off when a
        :class:`ModelRouter` has already resolved the name through its pool); ``max_client_priority``:
        the most urgent priority a request may ask for (lower runs first); ``defaults``: a stored
        variant's (``ModelDefaults``), which every chat starts from."""
        super().__init__(engine, served_model_name, check_names=check_names)
        self.max_client_priority = max_client_priority
        self.defaults = defaults
        if metrics is None:
            metrics = Metrics(lambda: [(served_model_name, engine)]).for_model(served_model_name, engine)
        self.metrics = metrics
        self.logprobs = LogprobFormat(self.tokenizer)

    # ---------------------------------------------------------------- shared checks

    async def submit(
        self,
        prompts: list[str | list[int]],
        params: SamplingParams,
        priority: int | None,
        request_id: str,
        infill: Callable[[str | list[int]], list[int]] | None = None,
        bound: int | None = None,
    ) -> Run:
        """Validate, tokenize (on a worker thread: a 10 MB prompt must not stall other clients'
        streams on this event loop) and queue the engine requests of one API request at ``priority``,
        made no more urgent than ``bound`` (default ``max_client_priority``); ``infill`` first
        turns each prompt into a fill-in-the-middle prompt's ids."""
        if params.structured is not None:  # compiling a grammar (the first one: seconds) off the event loop
            await in_background(self.engine.check_params, params)
        else:
            self.engine.check_params(params)
        encode = self.engine.encode_prompt
        if infill is None:
            prompt_ids = await in_background(lambda: [encode(p) for p in prompts])
        else:
            prompt_ids = await in_background(lambda: [encode(infill(p)) for p in prompts])
        # A client may lower its priority but not raise it past the server's bound: otherwise any
        # client could jump every queue and preempt everyone (in-process callers go to the engine)
        bound = self.max_client_priority if bound is None else bound
        run = Run(self.engine, prompt_ids, params, max(priority or 0, bound), request_id)
        await run.start()
        return run

    async def _unless_disconnected(self, request: Request, run: Run, work: Awaitable[Response]) -> Response:
        try:
            return await while_connected(request, work)
        except ClientGone:
            return Response(status_code=CLIENT_GONE)
        finally:
            run.close()

    async def _collect(self, run: Run, n: int, tracker: RequestTracker) -> tuple[list[_Choice], Usage]:
        choices: dict[int, _Choice] = {}
        usage = _UsageCounter()
        async for i, out in run.events():
            tracker.observe(out)
            usage.add(i, out)
            c = choices.setdefault(i * n + out.index, _Choice(i * n + out.index))
            c.text.append(out.new_text)
            c.logprobs.extend(out.new_logprobs)
            if out.prompt_logprobs is not None:
                c.prompt_logprobs = out.prompt_logprobs
            c.num_output_tokens = out.num_output_tokens
            if out.finished:
                c.finish_reason = out.finish_reason
        return [choices[k] for k in sorted(choices)], usage.usage()

    # ---------------------------------------------------------------- chat completions

    def _tools(self, req: ChatCompletionRequest, params: SamplingParams, messages: list[dict]):
        """``(messages, template variables, tool-call format or None, tools)`` for ``req``'s tools
        (see :mod:`localllm.api.tools`); a ``required`` or named ``tool_choice`` constrains ``params``."""
        tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
        choice = req.tool_choice
        template = self.tokenizer.chat_template
        takes_tools = template_takes_tools(template)
        if tools is None or choice == "none":
            if choice not in (None, "none", "auto"):
                raise InvalidRequestError("tool_choice needs tools", param="tool_choice")
            return template_messages(messages, None, template), {}, None, None
        fmt = tool_format(template)
        if choice == "required" or isinstance(choice, NamedToolChoice):
            if params.structured is not None:
                raise InvalidRequestError("a required or named tool_choice cannot be combined with response_format "
                                          "or guided decoding", param="tool_choice")
            name = choice.function.name if isinstance(choice, NamedToolChoice) else None
            parallel = req.parallel_tool_calls is not False and name is None
            params.structured = call_grammar(tools, name, parallel, fmt)
        params.skip_special_tokens = False  # some formats' markers are special tokens ([TOOL_CALLS])
        return template_messages(messages, tools, template), ({"tools": tools} if takes_tools else {}), fmt, tools

    async def chat(self, req: ChatCompletionRequest, request: Request) -> Response:
        self.check_model(req.model)
        if req.prompt_logprobs is not None and req.stream:
            raise InvalidRequestError("prompt_logprobs is returned by non-streaming chat completions (or by "
                                      "/v1/completions, streaming or not)", param="prompt_logprobs")
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        chat = await self.start_chat(req, request_id, priority_bound(request, self.max_client_priority))
        run, params, answer = chat.run, chat.params, chat.answer
        created = int(time.time())
        if req.stream:
            response = EventStream(
                _with_error_event(self._chat_stream(run, req, request_id, created, params.n, answer)), run
            )
        else:
            response = await self._unless_disconnected(
                request, run, self._chat_response(run, req, request_id, created, params.n, answer)
            )
        if chat.dropped:  # (never a silent cut: the client asked for it, and hears what it cost)
            response.headers[DROPPED_HEADER] = str(chat.dropped)
        return response

    async def start_chat(self, req: ChatCompletionRequest, request_id: str, bound: int | None = None) -> ChatRun:
        """Render ``req``'s messages (with its tools) through the chat template and queue it: the
        part of a chat completion that other APIs over chat (``/v1/responses``) share. ``bound``: the
        most urgent priority it may have (default ``max_client_priority``)."""
        if self.defaults is not None:
            req = with_model_defaults(req, self.defaults)
        params = req.sampling_params()
        messages, variables, fmt, tools = self._tools(req, params, [m.to_template() for m in req.messages])
        variables = {**(req.chat_template_kwargs or {}), **variables}
        tok = self.tokenizer

        policy = req.context_overflow or "error"

        def render() -> tuple[str, list[int], int]:
            texts: dict[tuple, str] = {}  # each rendering by its messages, for the fitted one's text

            def ids_of(kept: list[dict]) -> list[int]:
                texts[tuple(map(id, kept))] = text = tok.render_chat(kept, True, **variables)
                return tok.encode(text, add_special_tokens=True)

            if policy == "error":  # (a prompt over the context is the engine's 400)
                ids = ids_of(messages)
                return texts[tuple(map(id, messages))], ids, 0
            limit = self.engine.max_model_len
            fitted = fit_chat(messages, ids_of, limit, min(params.max_tokens or 1, limit // 2), policy)
            return texts[tuple(map(id, fitted.messages))], fitted.prompt_ids, fitted.dropped

        prompt_text, prompt_ids, dropped = await in_background(render)
        answer = answer_format(tok.chat_template, prompt_text, req.reasoning_format, fmt, tools)
        if answer.harmony:
            params.skip_special_tokens = False  # its markers are read from the text, tools or not
        run = await self.submit([prompt_ids], params, req.priority, request_id, bound=bound)
        return ChatRun(run, params, answer, dropped)

    async def _chat_response(
        self, run: Run, req: ChatCompletionRequest, request_id: str, created: int, n: int, answer: AnswerFormat,
    ) -> Response:
        choices, usage = await self._collect(run, n, self.metrics.tracker())
        out = []
        for c in choices:
            finish = c.finish_reason
            reasoning, text, calls = read_answer("".join(c.text), answer, truncated=finish == "length")
            if calls:
                finish = "tool_calls" if finish == "stop" else finish
            out.append(ChatChoice(
                index=c.index,
                message=ChatResponseMessage(content=text, reasoning_content=reasoning,
                                            tool_calls=[_tool_call(t) for t in calls] or None),
                logprobs=self.logprobs.chat(c.logprobs) if req.logprobs else None,
                finish_reason=finish,
            ))
        scored = next((c.prompt_logprobs for c in choices if c.prompt_logprobs is not None), None)
        body = ChatCompletionResponse(
            id=request_id, created=created, model=self.served_model_name, usage=usage, choices=out,
            prompt_logprobs=self.logprobs.vllm_prompt(scored, req.prompt_logprobs) if scored is not None else None,
        )
        return json_response(body)

    async def _chat_stream(
        self, run: Run, req: ChatCompletionRequest, request_id: str, created: int, n: int, answer: AnswerFormat,
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

        streams: dict[int, AnswerStream] = {}
        async for i, out in run.events():
            tracker.observe(out)
            usage.add(i, out)
            index = i * n + out.index
            first = index not in started
            started.add(index)
            logprobs = self.logprobs.chat(out.new_logprobs) if req.logprobs and out.new_logprobs else None
            finish, calls = out.finish_reason, []
            stream = streams.setdefault(index, AnswerStream(answer))  # reasoning split off, calls held back
            reasoning, text = stream.feed(out.new_text)
            if out.finished:
                more_reasoning, more_text, calls = stream.finish(truncated=finish == "length")
                reasoning, text = reasoning + more_reasoning, text + more_text
                if calls and finish == "stop":
                    finish = "tool_calls"
            reasoning = reasoning or None
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
            run = await self.submit(req.prompts(), params, req.priority, request_id, infill)
        except InvalidRequestError as exc:
            if exc.param == "messages":
                exc.param = "prompt"
            raise
        created = int(time.time())
        if req.stream:
            return EventStream(
                _with_error_event(self._completion_stream(run, req, request_id, created, params.n)), run
            )
        return await self._unless_disconnected(
            request, run, self._completion_response(run, req, request_id, created, params.n)
        )

    async def _completion_response(
        self, run: Run, req: CompletionRequest, request_id: str, created: int, n: int
    ) -> Response:
        choices, usage = await self._collect(run, n, self.metrics.tracker())
        body = CompletionResponse(
            id=request_id,
            created=created,
            model=self.served_model_name,
            usage=usage,
            choices=[self._completion_choice(c, req, run.prompts[c.index // n]) for c in choices],
        )
        return json_response(body)

    def _completion_choice(self, c: _Choice, req: CompletionRequest, prompt_ids: list[int]) -> CompletionChoice:
        """One whole choice; with ``echo`` the prompt comes first, in the text and (scored) in the logprobs."""
        text = "".join(c.text)
        logprobs = None
        if req.logprobs is not None:
            logprobs = self.logprobs.completion(c.logprobs, 0)
        if req.echo:
            prompt_text = self.logprobs.echo_text(prompt_ids)
            text = prompt_text + text
            if req.scores_prompt and c.prompt_logprobs is not None and logprobs is not None:
                echoed = self.logprobs.echoed(prompt_ids, c.prompt_logprobs, req.logprobs)
                end = sum(len(t) for t in echoed.tokens)
                generated = self.logprobs.completion(c.logprobs, end)
                logprobs = CompletionLogprobs(
                    tokens=echoed.tokens + generated.tokens,
                    token_logprobs=echoed.token_logprobs + generated.token_logprobs,
                    top_logprobs=echoed.top_logprobs + generated.top_logprobs,
                    text_offset=echoed.text_offset + generated.text_offset,
                )
        return CompletionChoice(
            index=c.index, text=text, logprobs=logprobs, finish_reason=c.finish_reason,
            prompt_logprobs=(self.logprobs.vllm_prompt(c.prompt_logprobs, req.prompt_logprobs)
                             if req.prompt_logprobs is not None and c.prompt_logprobs is not None else None),
        )

    async def _completion_stream(
        self, run: Run, req: CompletionRequest, request_id: str, created: int, n: int
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

        echoed: set[int] = set()
        async for i, out in run.events():
            tracker.observe(out)
            usage.add(i, out)
            index = i * n + out.index
            text, logprobs, prompt_logprobs = out.new_text, None, None
            if req.echo and index not in echoed:  # the prompt first, once per choice
                echoed.add(index)
                text = self.logprobs.echo_text(run.prompts[i]) + text
                if req.scores_prompt and out.prompt_logprobs is not None and req.logprobs is not None:
                    logprobs = self.logprobs.echoed(run.prompts[i], out.prompt_logprobs, req.logprobs)
                    offsets[index] = sum(len(t) for t in logprobs.tokens)
            if req.prompt_logprobs is not None and out.prompt_logprobs is not None:
                prompt_logprobs = self.logprobs.vllm_prompt(out.prompt_logprobs, req.prompt_logprobs)
            if req.logprobs is not None and out.new_logprobs:
                generated = self.logprobs.completion(out.new_logprobs, offsets.get(index, 0))
                offsets[index] = offsets.get(index, 0) + sum(len(t) for t in generated.tokens)
                logprobs = generated if logprobs is None else CompletionLogprobs(
                    tokens=logprobs.tokens + generated.tokens,
                    token_logprobs=logprobs.token_logprobs + generated.token_logprobs,
                    top_logprobs=logprobs.top_logprobs + generated.top_logprobs,
                    text_offset=logprobs.text_offset + generated.text_offset,
                )
            if not (text or out.finished or logprobs):
                continue
            yield chunk(
                [
                    CompletionChoice(
                        index=index, text=text, logprobs=logprobs, finish_reason=out.finish_reason,
                        prompt_logprobs=prompt_logprobs,
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

        run = await self.submit(
            [req.input_prefix], params, req.priority, f"infill-{uuid.uuid4().hex}", infill
        )
        if req.stream:
            return EventStream(_with_error_event(self._infill_stream(run)), run)
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

    async def _infill_response(self, run: Run) -> Response:
        tracker = self.metrics.tracker()
        text: list[str] = []
        tokens: list[int] = []
        last = None
        async for _, out in run.events():
            tracker.observe(out)
            text.append(out.new_text)
            tokens.extend(out.new_token_ids)
            last = out
        return json_response(self._infill_final(last, tokens[-1] if tokens else None, "".join(text), tokens))

    async def _infill_stream(self, run: Run) -> AsyncIterator[str]:
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
