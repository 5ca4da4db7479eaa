"""Tool calling: tools into the model's chat template, tool calls out of its text.

The format a model emits calls in is chosen from its chat template (:func:`tool_format`):

* ``hermes`` (Qwen2.5/Qwen3, Hermes, and the fallback): ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``,
  one block per call;
* ``llama3`` (Llama 3.1-3.3 JSON tool calling): ``{"name": ..., "parameters": {...}}``, optionally after
  ``<|python_tag|>``, calls separated by ``;``;
* ``mistral``: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]``.

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
import re
import uuid
from dataclasses import dataclass

from localllm.errors import InvalidRequestError
from localllm.sampling_params import StructuredOutput

FORMATS = ("hermes", "llama3", "mistral")

_HERMES_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


@dataclass(slots=True)
class ParsedCall:
    name: str
    arguments: str  # JSON text
    id: str

    @classmethod
    def make(cls, name: str, arguments) -> ParsedCall:
        text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
        return cls(name, text, f"call_{uuid.uuid4().hex[:24]}")


def tool_format(chat_template: str) -> str:
    """The tool-call format of a chat template (see the module docstring)."""
    if "[TOOL_CALLS]" in chat_template:
        return "mistral"
    if "<|python_tag|>" in chat_template or ("ipython" in chat_template and "parameters" in chat_template):
        return "llama3"
    return "hermes"


def template_takes_tools(chat_template: str) -> bool:
    return "tools" in chat_template


def tools_system_prompt(tools: list[dict]) -> str:
    """The system message that describes ``tools`` to a model whose template does not take them."""
    lines = [
        "You may call one or more functions to answer. The functions, as JSON schemas:",
        "<tools>",
        *(json.dumps(t, ensure_ascii=False) for t in tools),
        "</tools>",
        'To call a function, answer with <tool_call>\n{"name": <function name>, "arguments": <arguments as a JSON '
        "object>}\n</tool_call> for each call, and nothing else.",
    ]
    return "\n".join(lines)


def template_messages(messages: list[dict], tools: list[dict] | None, takes_tools: bool) -> list[dict]:
    """``messages`` for the chat template: assistant ``tool_calls`` with their ``arguments`` as
    objects; for a template that does not take ``tools``, the tools in a system message and tool
    calls and results as text."""
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


def parse_tool_calls(text: str, fmt: str, truncated: bool = False) -> tuple[str | None, list[ParsedCall]]:
    """``(content, calls)`` from a model's answer; text that does not parse as calls stays content.
    ``truncated``: the answer was cut (``max_tokens``), so a last call that does not parse is the cut
    one: it is dropped and the complete calls before it are kept."""
    if fmt == "mistral":
        return _parse_mistral(text, truncated)
    if fmt == "llama3":
        return _parse_llama3(text, truncated)
    return _parse_hermes(text, truncated)


def _call_from(obj, key: str = "arguments") -> ParsedCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(key, obj.get("arguments", obj.get("parameters", {})))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ParsedCall.make(obj["name"], args)


def _parse_hermes(text: str, truncated: bool = False) -> tuple[str | None, list[ParsedCall]]:
    if "<tool_call>" not in text:
        return text, []
    calls = []
    blocks = list(_HERMES_BLOCK.finditer(text))
    for i, block in enumerate(blocks):
        try:
            call = _call_from(json.loads(block.group(1), strict=False))
        except ValueError:
            call = None
        if call is None:
            if truncated and calls and i == len(blocks) - 1 and not block.group(0).rstrip().endswith("</tool_call>"):
                break  # the cut last call
            return text, []
        calls.append(call)
    content = _HERMES_BLOCK.sub("", text).strip()
    if truncated:  # cut inside the next call's marker: that is no content either
        content = content[:len(content) - _marker_start(content, "<tool_call>")].strip()
    return (content or None), calls


def _parse_llama3(text: str, truncated: bool = False) -> tuple[str | None, list[ParsedCall]]:
    body = text.strip()
    if body.startswith("<|python_tag|>"):
        body = body[len("<|python_tag|>"):].strip()
    if not body.startswith("{"):
        return text, []
    calls = []
    decoder = json.JSONDecoder(strict=False)
    pos = 0
    while pos < len(body):
        try:
            obj, end = decoder.raw_decode(body, pos)
        except ValueError:
            if truncated and calls:  # the cut last call
                break
            return text, []
        call = _call_from(obj, "parameters")
        if call is None:
            return text, []
        calls.append(call)
        pos = end
        while pos < len(body) and body[pos] in " \n;":
            pos += 1
    return None, calls


def _parse_mistral(text: str, truncated: bool = False) -> tuple[str | None, list[ParsedCall]]:
    if "[TOOL_CALLS]" not in text:
        return text, []
    before, _, after = text.partition("[TOOL_CALLS]")
    try:
        obj = json.loads(after.strip(), strict=False)
    except ValueError:
        obj = _complete_items(after.strip()) if truncated else None
        if not obj:
            return text, []
    items = obj if isinstance(obj, list) else [obj]
    calls = [_call_from(o) for o in items]
    if not calls or any(c is None for c in calls):
        return text, []
    return (before.strip() or None), calls


MARKERS = {"hermes": "<tool_call>", "llama3": "{", "mistral": "[TOOL_CALLS]"}


def _marker_start(text: str, marker: str) -> int:
    """The length of the longest tail of ``text`` that is a proper start of ``marker`` (0: none)."""
    return next((k for k in range(min(len(marker) - 1, len(text)), 0, -1) if marker.startswith(text[-k:])), 0)


def _complete_items(body: str) -> list | None:
    """The complete items of a JSON array cut short (``[{...}, {...}, {"na``), or ``None``."""
    if not body.startswith("["):
        return None
    decoder = json.JSONDecoder(strict=False)
    items, pos = [], 1
    while True:
        while pos < len(body) and body[pos] in " \n,":
            pos += 1
        try:
            obj, pos = decoder.raw_decode(body, pos)
        except ValueError:
            return items or None
        items.append(obj)


class ToolStream:
    """Streams an answer's content while holding back what may be tool calls: content until a
    call's marker may have begun (for llama3, only an answer that starts with ``{``), the calls
    parsed once the answer is complete (:meth:`finish`)."""

    def __init__(self, fmt: str) -> None:
        self.fmt = fmt
        self.text = ""
        self.emitted = 0
        self.holding = False

    def feed(self, delta: str) -> str:
        """The content that can be sent now."""
        self.text += delta
        if self.holding:
            return ""
        marker = MARKERS[self.fmt]
        if self.fmt == "llama3":
            stripped = self.text.lstrip()
            if stripped.startswith("{") or stripped.startswith("<|python_tag|>") or (
                    stripped and "<|python_tag|>".startswith(stripped)) or not stripped:
                self.holding = bool(stripped) and not (stripped and "<|python_tag|>".startswith(stripped))
                return ""
            out, self.emitted = self.text[self.emitted:], len(self.text)
            return out
        at = self.text.find(marker, self.emitted)
        if at >= 0:
            self.holding = True
            out, self.emitted = self.text[self.emitted:at], at
            return out
        end = len(self.text) - _marker_start(self.text, marker)  # keep back what may begin the marker
        out = self.text[self.emitted:end] if end > self.emitted else ""
        self.emitted = max(self.emitted, end)
        return out

    def finish(self, truncated: bool = False) -> tuple[str, list[ParsedCall]]:
        """``(content still to send, calls)`` once the answer is complete (``truncated``: cut by
        ``max_tokens``; see :func:`parse_tool_calls`)."""
        rest = self.text[self.emitted:]
        if not rest.strip():
            return rest, []
        content, calls = parse_tool_calls(rest, self.fmt, truncated)
        if not calls:
            return rest, []
        return content or "", calls
