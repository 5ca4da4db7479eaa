"""Tool calling: tools into the model's chat template, tool calls out of its text.

The format a model emits calls in is chosen from its chat template (:func:`tool_format`) among
the entries of :data:`localllm.engine.tool_formats.TOOL_FORMATS` (harmony, qwen3_coder,
mistral_v11, mistral, llama3, hermes), which also parse the calls.

Templates that take ``tools`` get them as the ``tools`` variable (and assistant messages their
``tool_calls`` with ``arguments`` as objects, as Hugging Face templates expect); a template that
does not mention tools gets them in a system message that asks for the hermes format.

``tool_choice``: ``none`` (no tools in the prompt, no parsing), ``auto`` (the model chooses; its
text is parsed, and text that does not parse as calls stays content, never an error),
``required`` or a named function: the output is **constrained** by a grammar (see
:mod:`localllm.engine.structured`, kind ``tool_call``) to calls whose ``arguments`` match the tool's
``parameters`` schema, so they always parse and validate.
"""

from __future__ import annotations

import json

from localllm.engine.tool_formats import TOOL_FORMATS, HarmonyStream, ParsedCall, marker_start
from localllm.engine.tool_formats import tool_format as _format_of
from localllm.engine.tool_formats.calls import skip_space
from localllm.errors import InvalidRequestError
from localllm.sampling_params import StructuredOutput

__all__ = ["ParsedCall", "ToolStream", "adapt_history", "call_grammar", "parse_tool_calls", "template_messages",
           "template_takes_tools", "tool_format", "tools_system_prompt"]


def tool_format(chat_template: str) -> str:
    """The name of a chat template's tool-call format (a key of ``TOOL_FORMATS``)."""
    return _format_of(chat_template).name


def template_takes_tools(chat_template: str) -> bool:
    return "tools" in chat_template


def tools_system_prompt(tools: list[dict]) -> str:
    """The system message that describes ``tools`` to a model whose template does not take them."""
    lines = [
        "You may call one or more functions to answer. The functions, as JSON schemas:",
        "<tools>",
        *(json.dumps(t, ensure_ascii=False) for t in tools),
        "</tools>",
        ('To call a function, answer with <tool_call>\n{"name": <function name>, "arguments": <arguments as a JSON '
         "object>}\n</tool_call> for each call, and nothing else."),
    ]
    return "\n".join(lines)


def template_messages(messages: list[dict], tools: list[dict] | None, chat_template: str) -> list[dict]:
    """``messages`` for the chat template: assistant ``tool_calls`` with their ``arguments`` as
    objects; for a template that does not take ``tools``, the tools in a system message and tool
    calls and results as text (see also :func:`adapt_history`)."""
    takes_tools = template_takes_tools(chat_template)
    out = []
    for m in messages:
        m = dict(m)
        calls = m.get("tool_calls")
        if calls:
            converted = []
            for c in calls:
                fn = dict(c.get("function") or {})
                args = fn.get("arguments")
                if isinstance(args, str):
                    try:
                        fn["arguments"] = json.loads(args) if args.strip() else {}
                    except ValueError:
                        pass  # the template gets the text as it was sent
                converted.append({**c, "function": fn, "name": fn.get("name"), "arguments": fn.get("arguments")})
            m["tool_calls"] = converted
            if not takes_tools:
                blocks = [f'<tool_call>\n{json.dumps({"name": c["name"], "arguments": c["arguments"]})}\n</tool_call>'
                          for c in converted]
                m["content"] = "\n".join(filter(None, [m.get("content") or "", *blocks]))
                del m["tool_calls"]
        if not takes_tools and m.get("role") == "tool":
            m = {"role": "user", "content": f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"}
        out.append(m)
    if tools and not takes_tools:
        system = tools_system_prompt(tools)
        if out and out[0].get("role") == "system":
            out[0] = {**out[0], "content": f"{out[0].get('content') or ''}\n\n{system}".strip()}
        else:
            out.insert(0, {"role": "system", "content": system})
    return adapt_history(out, chat_template)


def adapt_history(messages: list[dict], chat_template: str) -> list[dict]:
    """Earlier turns as the template's format needs them: where its ids are checked (Mistral's: 9
    letters and digits), longer ids cut to their last characters, as vLLM cuts them (calls and
    results alike, so they still pair); for harmony, an assistant's ``reasoning_content`` is the
    ``thinking`` gpt-oss's template renders (its analysis before a call), which takes the place
    of the call's content, as llama.cpp passes them."""
    fmt = _format_of(chat_template)
    out = []
    for m in messages:
        m = dict(m)
        if fmt.id_length is not None:
            if m.get("tool_calls"):
                m["tool_calls"] = [{**c, "id": c["id"][-fmt.id_length:]} if isinstance(c.get("id"), str) else c
                                   for c in m["tool_calls"]]
            if isinstance(m.get("tool_call_id"), str):
                m["tool_call_id"] = m["tool_call_id"][-fmt.id_length:]
        if fmt.channels and m.get("role") == "assistant" and isinstance(m.get("reasoning_content"), str):
            m["thinking"] = m.pop("reasoning_content")
            if m.get("tool_calls"):
                m.pop("content", None)
        out.append(m)
    return out


def call_grammar(tools: list[dict], name: str | None, parallel: bool, fmt: str) -> StructuredOutput:
    """The grammar of the calls a ``required`` (``name`` None) or named ``tool_choice`` allows."""
    functions = [t["function"] for t in tools if name is None or t["function"]["name"] == name]
    if not functions:
        raise InvalidRequestError(f"tool_choice names the function {name!r}, which is not in tools",
                                  param="tool_choice")
    spec = {"format": fmt, "parallel": parallel,
            "functions": [{"name": f["name"], "parameters": f.get("parameters") or {"type": "object"}}
                          for f in functions]}
    return StructuredOutput("tool_call", json.dumps(spec, sort_keys=True))


def parse_tool_calls(text: str, fmt: str, truncated: bool = False,
                     schemas: dict | None = None) -> tuple[str | None, list[ParsedCall]]:
    """``(content, calls)`` from a model's answer in format ``fmt``; text that does not parse as calls
    stays content. ``truncated``: the answer was cut (``max_tokens``), so a last call that does not
    parse is the cut one: it is dropped and the complete calls before it are kept. ``schemas``: the
    offered functions' parameters by name (the XML format types its values by them)."""
    return TOOL_FORMATS[fmt].parse(text, truncated, schemas)


class ToolStream:
    """Streams an answer's content while holding back what may be tool calls: content until a
    call's marker may have begun (and the whitespace before it: the content of an answer with calls
    ends without it), for a format whose calls are the whole answer, as llama3's, only an answer
    that starts with one; the calls parsed once the answer is complete (:meth:`finish`).
    Harmony's calls are messages among its channels: its stream reads them (the analysis channel
    stays in the content as written; :mod:`localllm.api.answers` splits it off as reasoning)."""

    def __init__(self, fmt: str, schemas: dict | None = None) -> None:
        self.fmt = fmt
        self.format = TOOL_FORMATS[fmt]
        self.schemas = schemas
        self.text = ""
        self.emitted = 0
        self.holding = False
        # How far the text has been read, so that each character is read a bounded number of times
        # however the answer goes on (a run of whitespace, say): the whitespace it opens with, where no
        # marker can start before, how far it is checked for trailing whitespace, and where that begins.
        self.blank = 0
        self.longest = max(len(m) for m in self.format.markers)
        self.searched = 0
        self.checked = self.space_from = 0
        self.channels = HarmonyStream(split=False, tools=True) if self.format.channels else None

    def feed(self, delta: str) -> str:
        """The content that can be sent now."""
        if self.channels is not None:
            return self.channels.feed(delta)[1]
        self.text += delta
        if self.holding:
            return ""
        markers = self.format.markers
        if self.format.calls_start_the_answer:  # an answer is calls or none: decided by how it starts
            self.blank = skip_space(self.text, self.blank)
            head = self.text[self.blank:self.blank + self.longest]  # enough to tell
            undecided = not head or any(o.startswith(head) and o != head for o in markers)
            if undecided or self.text.startswith(markers, self.blank):
                self.holding = not undecided
                return ""
            out, self.emitted = self.text[self.emitted:], len(self.text)
            return out
        start = max(self.emitted, self.searched)
        found = [at for m in markers if (at := self.text.find(m, start)) >= 0]
        if found:  # the content ends here, without the whitespace before the calls (as parsed whole)
            self.holding = True
            end = max(self.emitted, len(self.text[:min(found)].rstrip()))
            out, self.emitted = self.text[self.emitted:end], end
            return out
        self.searched = max(0, len(self.text) - self.longest + 1)  # a marker from here on is not whole yet
        # keep back what may begin a marker, and the whitespace that may come before one; that end
        # never moves back (what is held as a marker's start grows by at most what arrived), so only
        # the text since the last call is read for where its trailing whitespace begins
        end = len(self.text) - max(marker_start(self.text, m) for m in markers)
        if end > self.checked:
            kept = self.text[self.checked:end].rstrip()
            if kept:
                self.space_from = self.checked + len(kept)
            self.checked = end
        end = self.space_from
        out = self.text[self.emitted:end] if end > self.emitted else ""
        self.emitted = max(self.emitted, end)
        return out

    def finish(self, truncated: bool = False) -> tuple[str, list[ParsedCall]]:
        """``(content still to send, calls)`` once the answer is complete (``truncated``: cut by
        ``max_tokens``; see :func:`parse_tool_calls`)."""
        if self.channels is not None:
            _, content, calls = self.channels.finish(truncated)
            return content, calls
        rest = self.text[self.emitted:]
        if not rest.strip():
            return rest, []
        content, calls = parse_tool_calls(rest, self.fmt, truncated, self.schemas)
        if not calls:
            return rest, []
        return content or "", calls
