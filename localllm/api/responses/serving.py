"""OpenAI's Responses API over the chat engine: ``POST /v1/responses`` (JSON or SSE),
``GET /v1/responses/{id}`` and ``DELETE /v1/responses/{id}``, as the official ``openai`` client's
``client.responses.create(...)`` / ``.stream(...)``, Codex CLI and the Agents SDK send them.

A request becomes a chat completion (:meth:`OpenAIServing.start_chat`: the same template, tools,
grammars, reasoning split, checks and metrics as ``/v1/chat/completions``):

* ``input``: a string, or items: messages (``input_text``/``output_text`` parts; ``developer``
  is a system message), ``function_call`` (an assistant's earlier call) and
  ``function_call_output`` (its result, a ``tool`` message); ``reasoning`` items are dropped
  (as Anthropic's thinking blocks); images, files and audio are refused (400).
* ``instructions``: a system message first (not carried to the next turn, as OpenAI does).
* ``tools`` (function tools only), ``tool_choice`` (``auto``, ``none``, ``required``, a named
  function: the last two enforced by a grammar), ``parallel_tool_calls``.
* ``text.format``: ``json_schema`` or ``json_object`` structured output.
* ``max_output_tokens``; ``temperature``, ``top_p``; the chat route's extensions ``seed``,
  ``priority``, ``speculative``, ``reasoning_format`` and ``guided_grammar``.
* ``previous_response_id``: the conversation so far (that response's input and output) comes
  first. Responses are kept (``store``, default true) in a :class:`ResponseStore`, in memory and
  bounded in entries and bytes; an id that was never stored or has been evicted is a 404.

The output is ``reasoning`` (where the model thinks: ``<think>`` blocks, harmony's analysis
channel), ``message`` (its ``output_text``) and ``function_call`` items; ``status`` is
``incomplete`` with ``incomplete_details.reason = "max_output_tokens"`` when the answer was cut. A
stream sends ``response.created``, ``response.in_progress``, each item's ``output_item.added``/``done``
around its ``content_part``, ``output_text.delta``/``done``, ``reasoning_text.delta``/``done`` and
``function_call_arguments.delta``/``done`` events, then ``response.completed`` (or
``response.incomplete``), every event numbered (``sequence_number``).
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import Response
from pydantic import ValidationError

from localllm.api.answers import AnswerStream, read_answer
from localllm.api.errors import describe_validation_errors, exception_body
from localllm.api.openai.protocol import ChatCompletionRequest
from localllm.api.responses.protocol import (
    FunctionCallItem,
    FunctionCallOutputItem,
    ItemReference,
    MessageItem,
    RefusedContent,
    ResponsesRequest,
    TextConfig,
    TextContent,
)
from localllm.api.responses.store import ResponseStore
from localllm.api.streaming import EventStream
from localllm.errors import InvalidRequestError

# ---------------------------------------------------------------- request -> chat


def _text(content: str | list) -> str:
    if isinstance(content, str):
        return content
    for part in content:
        if isinstance(part, RefusedContent):
            what = {"input_image": "images", "input_file": "files", "input_audio": "audio"}.get(part.type)
            if what is not None:
                raise InvalidRequestError(f"{what} are not supported by this server", param="input")
    return "".join(p.text for p in content if isinstance(p, TextContent))


def input_messages(req: ResponsesRequest) -> list[dict[str, Any]]:
    """The chat messages of ``req.input`` (an assistant's calls join its message as ``tool_calls``)."""
    if isinstance(req.input, str):
        return [{"role": "user", "content": req.input}]
    out: list[dict[str, Any]] = []
    for item in req.input:
        if isinstance(item, MessageItem):
            role = "system" if item.role == "developer" else item.role
            out.append({"role": role, "content": _text(item.content)})
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function", "function": {"name": item.name, "arguments": item.arguments}}
            if out and out[-1]["role"] == "assistant":
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif isinstance(item, FunctionCallOutputItem):
            output = item.output if isinstance(item.output, str) else "".join(p.text for p in item.output)
            out.append({"role": "tool", "content": output, "tool_call_id": item.call_id})
        elif isinstance(item, ItemReference):
            raise InvalidRequestError("item_reference inputs are not supported; send the item itself, or "
                                      "previous_response_id", param="input")
        # ReasoningItem: dropped
    if not out:
        raise InvalidRequestError("input has no message", param="input")
    return out


def _tools(req: ResponsesRequest) -> list[dict[str, Any]] | None:
    if not req.tools:
        return None
    tools = []
    for tool in req.tools:
        if tool.type != "function":
            raise InvalidRequestError(f"tools of type {tool.type!r} are not supported; only function tools",
                                      param="tools")
        if not tool.name:
            raise InvalidRequestError("a function tool needs a name", param="tools")
        function: dict[str, Any] = {"name": tool.name, "parameters": tool.parameters or {"type": "object",
                                                                                        "properties": {}}}
        if tool.description is not None:
            function["description"] = tool.description
        tools.append({"type": "function", "function": function})
    return tools


def _tool_choice(choice) -> str | dict | None:
    if choice is None or isinstance(choice, str):
        return choice
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise InvalidRequestError(f"tool_choice {json.dumps(choice)} is not supported; use none, auto, required or "
                              '{"type": "function", "name": ...}', param="tool_choice")


def _response_format(text: TextConfig | None) -> dict | None:
    fmt = text.format if text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "json_object"}
    if fmt.schema_ is None:
        raise InvalidRequestError("text.format json_schema needs a schema", param="text.format.schema")
    return {"type": "json_schema", "json_schema": {"name": fmt.name or "response", "schema": fmt.schema_,
                                                   "strict": fmt.strict}}


def chat_request(req: ResponsesRequest, history: list[dict]) -> ChatCompletionRequest:
    """The chat completion ``req`` asks for, after the conversation ``history``."""
    if req.background:
        raise InvalidRequestError("background responses are not supported by this server", param="background")
    messages = ([{"role": "system", "content": req.instructions}] if req.instructions else []) + history \
        + input_messages(req)
    body = {
        "model": req.model, "messages": messages, "max_tokens": req.max_output_tokens,
        "temperature": req.temperature, "top_p": req.top_p, "seed": req.seed, "priority": req.priority,
        "speculative": req.speculative, "tools": _tools(req), "tool_choice": _tool_choice(req.tool_choice),
        "parallel_tool_calls": req.parallel_tool_calls, "response_format": _response_format(req.text),
        "reasoning_format": req.reasoning_format, "guided_grammar": req.guided_grammar,
    }
    try:
        return ChatCompletionRequest.model_validate({k: v for k, v in body.items() if v is not None})
    except ValidationError as exc:
        message, param = describe_validation_errors(exc.errors())
        raise InvalidRequestError(message, param=_responses_param(param)) from None


# The chat fields a Responses request's fields become, by the name the client sent.
_PARAMS = {"max_tokens": "max_output_tokens", "response_format": "text.format", "messages": "input"}


def _responses_param(param: str | None) -> str | None:
    """The name in the client's request of a chat completion's field (``tools.0.function.name`` ->
    ``tools.0.name``)."""
    if param is None:
        return None
    head, _, rest = param.partition(".")
    if head == "tools":
        return param.replace(".function.", ".", 1)
    return _PARAMS.get(head, head) + (f".{rest}" if rest and head not in _PARAMS else "")


# ---------------------------------------------------------------- output


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class _Answer:
    """One answer's output items as they are built (streamed or whole)."""

    def __init__(self) -> None:
        self.items: list[dict] = []
        self.reasoning: dict | None = None
        self.message: dict | None = None

    def reasoning_item(self) -> dict:
        item = {"id": _id("rs"), "type": "reasoning", "summary": [],
                "content": [{"type": "reasoning_text", "text": ""}], "status": "in_progress"}
        self.items.append(item)
        self.reasoning = item
        return item

    def message_item(self) -> dict:
        item = {"id": _id("msg"), "type": "message", "role": "assistant", "status": "in_progress",
                "content": [{"type": "output_text", "text": "", "annotations": [], "logprobs": []}]}
        self.items.append(item)
        self.message = item
        return item

    def call_item(self, call) -> dict:
        item = {"id": _id("fc"), "type": "function_call", "call_id": call.id, "name": call.name,
                "arguments": call.arguments, "status": "completed"}
        self.items.append(item)
        return item


class ResponsesServing:
    """The Responses API's logic for one loaded model, over its
    :class:`~localllm.api.openai.serving.OpenAIServing` (submission, disconnects, metrics) and the
    server's :class:`ResponseStore`."""

    def __init__(self, serving, store: ResponseStore) -> None:
        self.serving = serving
        self.store = store

    async def create(self, req: ResponsesRequest, request: Request) -> Response:
        self.serving.check_model(req.model)
        history = self.store.conversation(req.previous_response_id) if req.previous_response_id else []
        chat = chat_request(req, history)
        response_id = _id("resp")
        try:
            started = await self.serving.start_chat(chat, response_id)
        except InvalidRequestError as exc:
            exc.param = _responses_param(exc.param)
            raise
        base = self._base(req, chat, response_id)
        # this turn's messages without the instructions (they are not carried to the next turn)
        turn = [m.to_template() for m in chat.messages[1 if req.instructions else 0:]]
        if req.stream:
            return EventStream(self._stream(started, req, base, turn), started.run)
        return await self.serving._unless_disconnected(request, started.run,
                                                       self._whole(started, req, base, turn))

    def _base(self, req: ResponsesRequest, chat: ChatCompletionRequest, response_id: str) -> dict:
        fmt = req.text.format.model_dump(by_alias=True, exclude_none=True) if req.text and req.text.format \
            else {"type": "text"}
        return {
            "id": response_id, "object": "response", "created_at": int(time.time()), "status": "in_progress",
            "model": self.serving.served_model_name, "output": [], "error": None, "incomplete_details": None,
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": req.previous_response_id, "store": req.store is not False,
            "temperature": 1.0 if req.temperature is None else req.temperature,
            "top_p": 1.0 if req.top_p is None else req.top_p,
            "tool_choice": req.tool_choice or "auto",
            "tools": [t.model_dump(exclude_none=True) for t in req.tools or []],
            "text": {"format": fmt}, "metadata": req.metadata or {}, "usage": None,
        }

    def _finish(self, base: dict, answer: _Answer, last, turn: list[dict], store: bool) -> dict:
        """The finished response (stored unless ``store`` is false): its status, output and usage.
        An item still open when ``max_output_tokens`` cut the answer is ``incomplete``."""
        cut = last is not None and last.finish_reason == "length"
        for item in answer.items:
            if item["status"] == "in_progress":
                item["status"] = "incomplete" if cut else "completed"
        reasoning = "".join(item["content"][0]["text"] for item in answer.items if item["type"] == "reasoning")
        reasoning_tokens = len(self.serving.tokenizer.encode(reasoning, add_special_tokens=False)) if reasoning else 0
        num_input, cached, num_output = (last.num_prompt_tokens, last.num_cached_tokens, last.num_output_tokens) \
            if last is not None else (0, 0, 0)
        response = {
            **base, "status": "incomplete" if cut else "completed", "output": answer.items,
            "completed_at": int(time.time()),
            "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
            "usage": {"input_tokens": num_input, "input_tokens_details": {"cached_tokens": cached},
                      "output_tokens": num_output,
                      "output_tokens_details": {"reasoning_tokens": min(reasoning_tokens, num_output)},
                      "total_tokens": num_input + num_output},
        }
        if store:
            self.store.put(response, turn + _output_messages(answer.items))
        return response

    async def _whole(self, started, req: ResponsesRequest, base: dict, turn: list[dict]) -> Response:
        tracker = self.serving.metrics.tracker()
        parts, last = [], None
        async for _, out in started.run.events():
            tracker.observe(out)
            parts.append(out.new_text)
            last = out
        reasoning, text, calls = read_answer("".join(parts), started.answer,
                                             truncated=last is not None and last.finish_reason == "length")
        text = text or ""
        answer = _Answer()
        if reasoning:
            item = answer.reasoning_item()
            item["content"][0]["text"] = reasoning
            if text or calls:  # the reasoning ended: only an answer cut inside it leaves it open
                item["status"] = "completed"
        if text or not calls:
            answer.message_item()["content"][0]["text"] = text
        for call in calls:
            answer.call_item(call)
        response = self._finish(base, answer, last, turn, req.store is not False)
        return Response(json.dumps(response), media_type="application/json")

    async def _stream(self, started, req: ResponsesRequest, base: dict, turn: list[dict]) -> AsyncIterator[str]:
        seq = 0

        def event(payload: dict) -> str:
            nonlocal seq
            payload = {**payload, "sequence_number": seq}
            seq += 1
            return f"event: {payload['type']}\ndata: {json.dumps(payload)}\n\n"

        answer = _Answer()

        def index(item: dict) -> int:
            return answer.items.index(item)

        def close_reasoning(cut: bool = False) -> list[str]:
            """The reasoning item's last events: ``cut`` (the answer ended inside it) makes it incomplete."""
            item, answer.reasoning = answer.reasoning, None
            if item is None:
                return []
            item["status"] = "incomplete" if cut else "completed"
            part = item["content"][0]
            return [event({"type": "response.reasoning_text.done", "item_id": item["id"], "output_index": index(item),
                           "content_index": 0, "text": part["text"]}),
                    event({"type": "response.content_part.done", "item_id": item["id"], "output_index": index(item),
                           "content_index": 0, "part": part}),
                    event({"type": "response.output_item.done", "output_index": index(item), "item": item})]

        def open_message() -> list[str]:
            item = answer.message_item()
            part = dict(item["content"][0])
            return [event({"type": "response.output_item.added", "output_index": index(item),
                           "item": {**item, "content": []}}),
                    event({"type": "response.content_part.added", "item_id": item["id"], "output_index": index(item),
                           "content_index": 0, "part": part})]

        try:
            yield event({"type": "response.created", "response": base})
            yield event({"type": "response.in_progress", "response": base})
            tracker = self.serving.metrics.tracker()
            stream = AnswerStream(started.answer)  # reasoning split off, calls held back and read at the end
            last, calls = None, []
            async for _, out in started.run.events():
                tracker.observe(out)
                last = out
                reasoning, text = stream.feed(out.new_text)
                if out.finished:
                    more_reasoning, more_text, calls = stream.finish(truncated=out.finish_reason == "length")
                    reasoning, text = reasoning + more_reasoning, text + more_text
                if reasoning:
                    if answer.reasoning is None and answer.message is None:
                        item = answer.reasoning_item()
                        yield event({"type": "response.output_item.added", "output_index": index(item),
                                     "item": {**item, "content": []}})
                        yield event({"type": "response.content_part.added", "item_id": item["id"],
                                     "output_index": index(item), "content_index": 0,
                                     "part": {"type": "reasoning_text", "text": ""}})
                    if answer.reasoning is not None:
                        item = answer.reasoning
                        item["content"][0]["text"] += reasoning
                        yield event({"type": "response.reasoning_text.delta", "item_id": item["id"],
                                     "output_index": index(item), "content_index": 0, "delta": reasoning})
                if text:
                    for e in close_reasoning():
                        yield e
                    if answer.message is None:
                        for e in open_message():
                            yield e
                    item = answer.message
                    item["content"][0]["text"] += text
                    yield event({"type": "response.output_text.delta", "item_id": item["id"],
                                 "output_index": index(item), "content_index": 0, "delta": text, "logprobs": []})
            cut = last is not None and last.finish_reason == "length"
            for e in close_reasoning(cut=cut and answer.message is None and not calls):
                yield e
            if answer.message is None and not calls:
                for e in open_message():
                    yield e
            if answer.message is not None:
                item = answer.message
                item["status"] = "incomplete" if cut else "completed"
                part = item["content"][0]
                yield event({"type": "response.output_text.done", "item_id": item["id"], "output_index": index(item),
                             "content_index": 0, "text": part["text"], "logprobs": []})
                yield event({"type": "response.content_part.done", "item_id": item["id"],
                             "output_index": index(item), "content_index": 0, "part": part})
                yield event({"type": "response.output_item.done", "output_index": index(item), "item": item})
            for call in calls:
                item = answer.call_item(call)
                at = index(item)
                yield event({"type": "response.output_item.added", "output_index": at,
                             "item": {**item, "arguments": "", "status": "in_progress"}})
                yield event({"type": "response.function_call_arguments.delta", "item_id": item["id"],
                             "output_index": at, "delta": item["arguments"]})
                yield event({"type": "response.function_call_arguments.done", "item_id": item["id"],
                             "output_index": at, "arguments": item["arguments"], "name": item["name"]})
                yield event({"type": "response.output_item.done", "output_index": at, "item": item})
            response = self._finish(base, answer, last, turn, req.store is not False)
            kind = "response.incomplete" if response["status"] == "incomplete" else "response.completed"
            yield event({"type": kind, "response": response})
        except Exception as exc:  # noqa: BLE001 - once a stream has begun, an error is an event in it
            _, body = exception_body(exc)
            error = body["error"]
            code = error.get("code") or error.get("type")
            yield event({"type": "error", "code": code, "message": error["message"], "param": error.get("param")})
            yield event({"type": "response.failed", "response": {
                **base, "status": "failed", "output": answer.items,
                "error": {"code": code, "message": error["message"]}}})


def _output_messages(items: list[dict]) -> list[dict]:
    """The chat messages of an answer's output items (for the next turn): its text and calls as
    one assistant message; reasoning is dropped."""
    text = "".join(part["text"] for item in items if item["type"] == "message" for part in item["content"])
    calls = [{"id": item["call_id"], "type": "function",
              "function": {"name": item["name"], "arguments": item["arguments"]}}
             for item in items if item["type"] == "function_call"]
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if calls:
        message["tool_calls"] = calls
    return [message]
