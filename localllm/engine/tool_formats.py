"""Tool-call formats: how a model writes its function calls, one registry entry per format (as
``models/registry.py`` has one entry per architecture).

A :class:`ToolFormat` says how to recognise the format in a chat template, what the text of a call
starts with (so that a stream holds calls back), the shape of a call (the arguments' key, what
surrounds a call, what separates parallel calls, or the array they are written in), and how to
parse an answer. The API parses answers and streams with it (``api/tools.py``); the grammar of a
forced call is built from the same entry (``engine/structured.py``). A new format is one entry here.

* ``hermes`` (Qwen2.5/Qwen3, Hermes, and the fallback): ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``,
  one block per call;
* ``llama3`` (Llama 3.1-3.3 JSON tool calling): ``{"name": ..., "parameters": {...}}``, optionally after
  ``<|python_tag|>``, calls separated by ``;``;
* ``mistral``: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]``.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(slots=True)
class ParsedCall:
    name: str
    arguments: str  # JSON text
    id: str

    @classmethod
    def make(cls, name: str, arguments) -> ParsedCall:
        text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
        return cls(name, text, f"call_{uuid.uuid4().hex[:24]}")


Parser = Callable[[str, bool], "tuple[str | None, list[ParsedCall]]"]


@dataclass(frozen=True, slots=True)
class ToolFormat:
    """One way of writing tool calls (see the module docstring)."""

    name: str
    used_by: Callable[[str], bool]  # does a chat template use this format?
    parse: Parser  # (answer, truncated) -> (content, calls); text that does not parse stays content
    marker: str  # what a call's text starts with
    arguments_key: str = "arguments"
    call_prefix: str = ""  # around each call's JSON object ...
    call_suffix: str = ""
    separator: str = ""  # ... and between parallel calls
    array_prefix: str | None = None  # the calls as one JSON array after this, instead
    # a call is the whole answer (it may only start it; other markers that may open it too)
    calls_start_the_answer: bool = False
    other_openers: tuple[str, ...] = ()


def marker_start(text: str, marker: str) -> int:
    """The length of the longest tail of ``text`` that is a proper start of ``marker`` (0: none)."""
    return next((k for k in range(min(len(marker) - 1, len(text)), 0, -1) if marker.startswith(text[-k:])), 0)


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


_HERMES_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


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
        content = content[:len(content) - marker_start(content, "<tool_call>")].strip()
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


HERMES = ToolFormat("hermes", used_by=lambda template: True, parse=_parse_hermes, marker="<tool_call>",
                    call_prefix="<tool_call>\n", call_suffix="\n</tool_call>", separator="\n")
LLAMA3 = ToolFormat(
    "llama3", used_by=lambda t: "<|python_tag|>" in t or ("ipython" in t and "parameters" in t), parse=_parse_llama3,
    marker="{", arguments_key="parameters", separator="; ", calls_start_the_answer=True,
    other_openers=("<|python_tag|>",),
)
MISTRAL = ToolFormat("mistral", used_by=lambda t: "[TOOL_CALLS]" in t, parse=_parse_mistral, marker="[TOOL_CALLS]",
                     array_prefix="[TOOL_CALLS]")

# in the order templates are tried; hermes, the fallback, last
TOOL_FORMATS: dict[str, ToolFormat] = {f.name: f for f in (MISTRAL, LLAMA3, HERMES)}


def tool_format(chat_template: str) -> ToolFormat:
    """The tool-call format of a chat template."""
    return next(f for f in TOOL_FORMATS.values() if f.used_by(chat_template))
