"""Anthropic's Messages API over the same engine: ``POST /v1/messages`` (JSON or SSE) and
``POST /v1/messages/count_tokens``, as the ``anthropic`` SDK and Claude Code send them.

A request becomes the engine's chat messages (system first; ``tool_result`` blocks become
``tool`` messages; ``tool_use`` blocks become ``tool_calls`` when the model's chat template knows
them, else JSON text), is rendered with the model's chat template like ``/v1/chat/completions``
and runs on the same engine, with the same checks, metrics and disconnect handling.

Errors on these paths (whoever raises them: validation, the API key check, the body guards, the
engine) leave in Anthropic's shape, ``{"type": "error", "error": {"type", "message"}}``, by
:class:`AnthropicErrorShape`; a full queue is ``529 overloaded_error`` there (the SDK and Claude
Code retry it, honouring ``Retry-After``), where the OpenAI routes say 429.

Tools (:mod:`localllm.api.tools`): rendered into the prompt by chat templates that take them,
else described in a system message; the answer's calls come back as ``tool_use`` blocks
(``stop_reason: "tool_use"``, streamed as ``input_json_delta``); ``tool_choice`` ``any`` and
``tool`` constrain the answer to calls by a grammar, ``none`` leaves the tools out.

A model that reasons before it answers (its template declares ``<think>`` blocks, or harmony's
analysis channel: :mod:`localllm.api.answers`) gets its reasoning back as ``thinking`` blocks
before the text (streamed as ``thinking_delta``; their ``signature`` is empty, as llama-server's).

Not supported: images and documents (400), asking for extended thinking (400 when enabled).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from localllm.api.answers import AnswerFormat, AnswerStream, answer_format, read_answer
from localllm.api.anthropic.protocol import (
    AnthropicMessage,
    CountTokensRequest,
    DocumentBlock,
    ImageBlock,
    MessagesRequest,
    TextBlock,
    ToolResultBlock,
    ToolUseBlock,
)
from localllm.api.background import in_background
from localllm.api.errors import error_response, exception_body
from localllm.api.streaming import EventStream
from localllm.api.tools import adapt_history, call_grammar, tool_format, tools_system_prompt
from localllm.errors import InvalidRequestError, LocalLLMError

log = logging.getLogger(__name__)

MESSAGES_PATH = "/v1/messages"
# Text blocks of one message (and of ``system``) are joined with this.
BLOCK_SEPARATOR = "\n\n"

# ---------------------------------------------------------------- request -> chat messages


def _text(blocks: list[TextBlock]) -> str:
    return BLOCK_SEPARATOR.join(b.text for b in blocks)


def _refuse(block) -> None:
    if isinstance(block, ImageBlock):
        raise InvalidRequestError("images are not supported by this server", param="messages")
    if isinstance(block, DocumentBlock):
        raise InvalidRequestError("documents are not supported by this server", param="messages")


def _tool_result_text(block: ToolResultBlock) -> str:
    content = block.content
    if content is None:
        text = ""
    elif isinstance(content, str):
        text = content
    else:
        for part in content:
            _refuse(part)
        text = _text([p for p in content if isinstance(p, TextBlock)])
    return f"Error: {text}" if block.is_error else text


def _tool_use_text(block: ToolUseBlock) -> str:
    return json.dumps({"type": "tool_use", "id": block.id, "name": block.name, "input": block.input})


@dataclasses.dataclass(slots=True)
class ChatPrompt:
    """What the chat template gets: messages, template keyword arguments, and the text of a final
    assistant turn to continue from (Anthropic's "prefill"), if the request ends with one."""

    messages: list[dict[str, Any]]
    template_kwargs: dict[str, Any]
    prefill: str | None = None


def _convert_message(message: AnthropicMessage, tool_calls_in_template: bool) -> list[dict[str, Any]]:
    """One Anthropic turn as chat messages: its text (and tool calls) as one message of its role,
    split around ``tool_result`` blocks, which become ``tool`` messages."""
    if isinstance(message.content, str):
        return [{"role": message.role, "content": message.content}]
    out: list[dict[str, Any]] = []
    texts: list[str] = []
    calls: list[dict[str, Any]] = []

    def flush(always: bool = False) -> None:
        if texts or calls or always:
            entry: dict[str, Any] = {"role": message.role, "content": BLOCK_SEPARATOR.join(texts)}
            if calls:
                entry["tool_calls"] = list(calls)
            out.append(entry)
        texts.clear()
        calls.clear()

    had_tool_result = False
    for block in message.content:
        _refuse(block)
        if isinstance(block, TextBlock):
            texts.append(block.text)
        elif isinstance(block, ToolResultBlock):
            if texts:
                flush()
            out.append(
                {"role": "tool", "content": _tool_result_text(block), "tool_call_id": block.tool_use_id}
            )
            had_tool_result = True
        elif isinstance(block, ToolUseBlock):
            if tool_calls_in_template:
                calls.append(
                    {
                        "id": block.id,
                        "type": "function",
                        "function": {"name": block.name, "arguments": block.input},
                    }
                )
            else:
                texts.append(_tool_use_text(block))
        # ThinkingBlock: dropped
    flush(always=message.role == "assistant" or not had_tool_result)
    return out


def to_chat_prompt(req: CountTokensRequest, chat_template: str) -> ChatPrompt:
    """The engine's chat messages for an Anthropic request; InvalidRequestError for what we refuse."""
    if req.thinking is not None and req.thinking.type != "disabled":
        raise InvalidRequestError(
            f"thinking ({req.thinking.type!r}) is not supported by this server; omit it or send "
            '{"type": "disabled"}',
            param="thinking",
        )
    tool_calls_in_template = "tool_calls" in chat_template
    out: list[dict[str, Any]] = []
    if req.system:
        out.append(
            {"role": "system", "content": req.system if isinstance(req.system, str) else _text(req.system)}
        )
    for message in req.messages:
        out.extend(_convert_message(message, tool_calls_in_template))
    kwargs: dict[str, Any] = {}
    tools = openai_tools(req)
    if tools and "tools" in chat_template:
        kwargs["tools"] = tools
    elif tools:  # the template cannot show them: a system message does (hermes format)
        system = tools_system_prompt(tools)
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{system}"}
        else:
            out.insert(0, {"role": "system", "content": system})
    out = adapt_history(out, chat_template)
    prefill = None
    final = req.messages[-1]
    if (
        final.role == "assistant"
        and len(out) > 1
        and (isinstance(final.content, str) or not any(isinstance(b, ToolUseBlock) for b in final.content))
    ):
        prefill = out.pop()["content"]
    return ChatPrompt(out, kwargs, prefill)


def openai_tools(req: CountTokensRequest) -> list[dict[str, Any]] | None:
    """The request's tools in OpenAI's shape (``None``: none, or ``tool_choice`` ``none``)."""
    if not req.tools or (req.tool_choice or {}).get("type") == "none":
        return None
    return [
        {
            "type": "function",
            "function": {
                "name": t.name,
                "description": t.description or "",
                "parameters": t.input_schema or {"type": "object", "properties": {}},
            },
        }
        for t in req.tools
    ]


def tool_use_blocks(calls) -> list[dict[str, Any]]:
    return [{"type": "tool_use", "id": "toolu_" + c.id.removeprefix("call_"), "name": c.name,
             "input": json.loads(c.arguments)} for c in calls]


def render_prompt(tokenizer, prompt: ChatPrompt) -> tuple[str, list[int]]:
    """The rendered chat and its token ids, as ``/v1/chat/completions`` makes them (a prefill is
    appended after the template's generation prompt)."""
    text = tokenizer.render_chat(prompt.messages, True, **prompt.template_kwargs) + (prompt.prefill or "")
    return text, tokenizer.encode(text, add_special_tokens=True)


# ---------------------------------------------------------------- responses


def _stop_sequence(text: str, stops: list[str]) -> str | None:
    """The stop sequence ``text`` ends with (the longest: the engine cuts at the earliest match)."""
    best = None
    for s in stops:
        if s and text.endswith(s) and (best is None or len(s) > len(best)):
            best = s
    return best


def _stop_reason(
    finish_reason: str | None, stop_sequence: str | None, num_output: int, max_tokens: int
) -> str:
    if stop_sequence is not None:
        return "stop_sequence"
    if finish_reason == "length":
        return "max_tokens" if num_output >= max_tokens else "model_context_window_exceeded"
    return "end_turn"


def _event(name: str, payload: dict) -> str:
    return f"event: {name}\ndata: {json.dumps(payload)}\n\n"


def _thinking_block(thinking: str) -> dict:
    """A ``thinking`` block; its ``signature`` is empty: there is nothing to verify it by."""
    return {"type": "thinking", "thinking": thinking, "signature": ""}


class _Blocks:
    """A stream's content blocks, one open at a time, each at the next index: a delta of another
    kind closes the open block and opens one of its own."""

    def __init__(self) -> None:
        self.index = -1
        self.kind: str | None = None

    def to(self, kind: str) -> list[str]:
        if kind == self.kind:
            return []
        events = self.close()
        self.index, self.kind = self.index + 1, kind
        block = _thinking_block("") if kind == "thinking" else {"type": "text", "text": ""}
        events.append(_event("content_block_start", {"type": "content_block_start", "index": self.index,
                                                     "content_block": block}))
        return events

    def delta(self, kind: str, text: str) -> list[str]:
        events = self.to(kind)
        delta = {"type": "thinking_delta", "thinking": text} if kind == "thinking" else {"type": "text_delta",
                                                                                          "text": text}
        events.append(_event("content_block_delta", {"type": "content_block_delta", "index": self.index,
                                                     "delta": delta}))
        return events

    def close(self) -> list[str]:
        if self.kind is None:
            return []
        self.kind = None
        return [_event("content_block_stop", {"type": "content_block_stop", "index": self.index})]


# ---------------------------------------------------------------- errors

_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    529: "overloaded_error",
}
OVERLOADED_STATUS = 529


def anthropic_error(status: int, openai_body: dict) -> tuple[int, dict]:
    """An OpenAI-shaped error (as :mod:`localllm.api.errors` makes them) in Anthropic's shape.

    A full queue (429 ``queue_full``) becomes 529 ``overloaded_error``, what Anthropic answers when
    it is busy; both are retried by the SDK.
    """
    error = openai_body.get("error") if isinstance(openai_body, dict) else None
    if not isinstance(error, dict):
        error = {}
    message = str(error.get("message") or f"HTTP {status}")
    if status == 429 and error.get("code") == "queue_full":
        status = OVERLOADED_STATUS
    error_type = _ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return status, {"type": "error", "error": {"type": error_type, "message": message}}


def anthropic_exception_body(exc: BaseException) -> tuple[int, dict]:
    return anthropic_error(*exception_body(exc))


def is_anthropic_path(path: str) -> bool:
    return path == MESSAGES_PATH or path.startswith(MESSAGES_PATH + "/")


class AnthropicErrorShape:
    """Rewrites JSON error responses (status >= 400) on ``/v1/messages*`` into Anthropic's shape.

    The outermost layer, so that it sees the errors of every other one (Host check, API key,
    body guards, validation, the handlers); SSE streams (200) pass through untouched.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not is_anthropic_path(scope["path"]):
            await self.app(scope, receive, send)
            return
        start: Message | None = None
        chunks: list[bytes] = []

        async def send_shaped(message: Message) -> None:
            nonlocal start
            if message["type"] == "http.response.start":
                content_type = dict(message.get("headers", [])).get(b"content-type", b"")
                if message["status"] >= 400 and content_type.startswith(b"application/json"):
                    start = message
                    return
            elif message["type"] == "http.response.body" and start is not None:
                chunks.append(message.get("body", b""))
                if message.get("more_body", False):
                    return
                status, body = self._reshape(start["status"], b"".join(chunks))
                headers = [(k, v) for k, v in start.get("headers", []) if k.lower() != b"content-length"]
                headers.append((b"content-length", str(len(body)).encode()))
                await send({**start, "status": status, "headers": headers})
                await send({"type": "http.response.body", "body": body, "more_body": False})
                start = None
                return
            await send(message)

        await self.app(scope, receive, send_shaped)

    @staticmethod
    def _reshape(status: int, raw: bytes) -> tuple[int, bytes]:
        try:
            body = json.loads(raw)
        except ValueError:
            return status, raw
        if isinstance(body, dict) and body.get("type") == "error":
            return status, raw  # already Anthropic's
        if not isinstance(body, dict) or not isinstance(body.get("error"), dict):
            return status, raw
        status, shaped = anthropic_error(status, body)
        return status, json.dumps(shaped).encode()


# ---------------------------------------------------------------- handlers


class AnthropicServing:
    """The Messages API's logic over the OpenAI routes' :class:`~localllm.api.openai.serving.OpenAIServing`
    (its submission, disconnect handling and metrics)."""

    def __init__(self, serving) -> None:
        self.serving = serving
        self.tokenizer = serving.tokenizer

    def _template(self) -> str:
        return getattr(self.tokenizer, "chat_template", "") or ""

    async def _prompt(self, req: CountTokensRequest) -> tuple[str, list[int]]:
        self.serving.check_model(req.model)
        prompt = to_chat_prompt(req, self._template())
        return await in_background(render_prompt, self.tokenizer, prompt)

    async def count_tokens(self, req: CountTokensRequest) -> Response:
        _, ids = await self._prompt(req)
        return Response(json.dumps({"input_tokens": len(ids)}), media_type="application/json")

    async def messages(self, req: MessagesRequest, request: Request) -> Response:
        self.serving.check_model(req.model)
        params = req.sampling_params()
        fmt = self._tool_setup(req, params)
        prompt_text, prompt_ids = await self._prompt(req)
        answer = answer_format(self._template(), prompt_text, None, fmt, openai_tools(req) if fmt else None)
        if answer.harmony:
            params.skip_special_tokens = False  # its markers are read from the text, tools or not
        limit = self.serving.engine.max_model_len
        if len(prompt_ids) < limit and len(prompt_ids) + params.max_tokens > limit:
            # Anthropic's max_tokens is a cap: a request may ask for more than the context has
            # left (Claude Code asks for 32k) and stops with model_context_window_exceeded.
            params = dataclasses.replace(params, max_tokens=limit - len(prompt_ids))
        message_id = f"msg_{uuid.uuid4().hex}"
        run = await self.serving.submit([prompt_ids], params, 0, message_id)
        if req.stream:
            return EventStream(
                self._with_error_event(self._stream(run, req, message_id, len(prompt_ids), answer)), run
            )
        return await self.serving._unless_disconnected(request, run, self._response(run, req, message_id, answer))

    def _tool_setup(self, req: MessagesRequest, params) -> str | None:
        """The tool-call format to parse the answer in (``None``: no tools); ``tool_choice``
        ``any`` or ``tool`` constrain ``params`` to calls."""
        tools = openai_tools(req)
        if tools is None:
            return None
        fmt = tool_format(self._template())
        choice = req.tool_choice or {}
        if choice.get("type") in ("any", "tool"):
            name = choice.get("name") if choice.get("type") == "tool" else None
            if choice.get("type") == "tool" and not isinstance(name, str):
                raise InvalidRequestError("tool_choice of type tool needs a name", param="tool_choice")
            parallel = not choice.get("disable_parallel_tool_use", False) and name is None
            params.structured = call_grammar(tools, name, parallel, fmt)
        params.skip_special_tokens = False
        return fmt

    def _message(
        self,
        message_id: str,
        content: list,
        stop_reason,
        stop_sequence,
        input_tokens: int,
        output_tokens: int,
    ) -> dict:
        return {
            "id": message_id,
            "type": "message",
            "role": "assistant",
            "model": self.serving.served_model_name,
            "content": content,
            "stop_reason": stop_reason,
            "stop_sequence": stop_sequence,
            "usage": {"input_tokens": input_tokens, "output_tokens": output_tokens},
        }

    async def _response(self, run, req: MessagesRequest, message_id: str, answer: AnswerFormat) -> Response:
        tracker = self.serving.metrics.tracker()
        parts: list[str] = []
        last = None
        async for _, out in run.events():
            tracker.observe(out)
            parts.append(out.new_text)
            last = out
        text = "".join(parts)
        finish = last.finish_reason if last is not None else None
        stop = _stop_sequence(text, req.stop_sequences or []) if finish == "stop" else None
        if stop is not None:  # the client's stop sequence ended the answer: no calls are read in it
            text = text[: len(text) - len(stop)]
            answer = dataclasses.replace(answer, tool_format=None)
        num_input, num_output = (
            (last.num_prompt_tokens, last.num_output_tokens) if last is not None else (0, 0)
        )
        reason = _stop_reason(finish, stop, num_output, req.max_tokens)
        reasoning, text, calls = read_answer(text, answer, truncated=finish == "length")
        content = [_thinking_block(reasoning)] if reasoning else []
        if text or not calls:
            content.append({"type": "text", "text": text or ""})
        content += tool_use_blocks(calls)
        if calls and finish == "stop":
            reason = "tool_use"
        body = self._message(message_id, content, reason, stop, num_input, num_output)
        return Response(json.dumps(body), media_type="application/json")

    async def _stream(
        self, run, req: MessagesRequest, message_id: str, input_tokens: int, answer: AnswerFormat
    ) -> AsyncIterator[str]:
        tracker = self.serving.metrics.tracker()
        yield _event(
            "message_start",
            {
                "type": "message_start",
                "message": self._message(message_id, [], None, None, input_tokens, 0),
            },
        )
        blocks = _Blocks()
        if not answer.reasons:  # the text block opens at once; thinking would have to come before it
            for e in blocks.to("text"):
                yield e
        yield _event("ping", {"type": "ping"})
        emitted: list[str] = []
        last = None
        stop = None
        calls = []
        stream = AnswerStream(answer)  # reasoning split off, calls held back and read at the end
        async for _, out in run.events():
            tracker.observe(out)
            last = out
            reasoning, text = stream.feed(out.new_text)
            if out.finished:
                more_reasoning, more_text, calls = stream.finish(truncated=out.finish_reason == "length")
                reasoning, text = reasoning + more_reasoning, text + more_text
            if out.finished and out.finish_reason == "stop" and req.stop_sequences:
                # The engine holds back text that may begin a stop sequence, so a matched one
                # arrives whole in the final delta.
                stop = _stop_sequence("".join(emitted) + text, req.stop_sequences)
                if stop is not None:
                    text = text[: max(len(text) - len(stop), 0)]
            for kind, delta in (("thinking", reasoning), ("text", text)):
                if delta:
                    for e in blocks.delta(kind, delta):
                        yield e
            if text:
                emitted.append(text)
        if blocks.index < 0 and not calls:
            for e in blocks.to("text"):
                yield e
        for e in blocks.close():
            yield e
        for block in tool_use_blocks(calls):
            i = blocks.index = blocks.index + 1
            yield _event("content_block_start", {"type": "content_block_start", "index": i,
                                                 "content_block": {**block, "input": {}}})
            yield _event("content_block_delta", {"type": "content_block_delta", "index": i, "delta": {
                "type": "input_json_delta", "partial_json": json.dumps(block["input"])}})
            yield _event("content_block_stop", {"type": "content_block_stop", "index": i})
        num_output = last.num_output_tokens if last is not None else 0
        reason = _stop_reason(last.finish_reason if last else None, stop, num_output, req.max_tokens)
        if calls and last is not None and last.finish_reason == "stop" and stop is None:
            reason = "tool_use"
        yield _event(
            "message_delta",
            {
                "type": "message_delta",
                "delta": {"stop_reason": reason, "stop_sequence": stop},
                "usage": {"output_tokens": num_output},
            },
        )
        yield _event("message_stop", {"type": "message_stop"})

    @staticmethod
    async def _with_error_event(events: AsyncIterator[str]) -> AsyncIterator[str]:
        """Once a stream has begun, an error can only be reported in it: one ``error`` event."""
        try:
            async for event in events:
                yield event
        except Exception as exc:  # becomes an Anthropic error event
            status, body = anthropic_exception_body(exc)
            if status >= 500 and not isinstance(exc, LocalLLMError):
                log.error("stream failed", exc_info=exc)
            yield _event("error", body)


def add_anthropic_routes(app: FastAPI, router) -> None:
    """Register ``POST /v1/messages`` and ``POST /v1/messages/count_tokens`` over ``router`` (a
    :class:`~localllm.api.router.ModelRouter`: each request's model through its pool; the app must
    also wrap itself in :class:`AnthropicErrorShape`)."""

    async def guarded(work) -> Response:
        try:
            return await work
        except (LocalLLMError, StarletteHTTPException):
            raise  # the app's handlers answer these (inside AnthropicErrorShape)
        except Exception as exc:  # noqa: BLE001 - the app's catch-all handler sits outside this layer
            return error_response(exc)

    @app.post(MESSAGES_PATH)
    async def create_message(body: MessagesRequest, request: Request) -> Response:
        return await guarded(router.run(body, lambda serving: AnthropicServing(serving).messages(body, request)))

    @app.post(MESSAGES_PATH + "/count_tokens")
    async def count_message_tokens(body: CountTokensRequest) -> Response:
        return await guarded(router.run(body, lambda serving: AnthropicServing(serving).count_tokens(body)))
