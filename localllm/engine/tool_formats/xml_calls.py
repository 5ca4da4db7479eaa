"""Qwen3-Coder's XML calls (also Qwen3.5's and Nemotron 3 Nano's), as Qwen's own parser (vLLM's
``qwen3coder_tool_parser``) reads them::

    <tool_call>
    <function=NAME>
    <parameter=ARG>
    VALUE
    </parameter>
    </function>
    </tool_call>

A value is text: one newline after ``<parameter=ARG>`` and one before ``</parameter>`` frame it.
It is typed by the parameter's JSON schema: strings (and parameters the schema does not name) as
written, integers, numbers and booleans converted, objects and arrays parsed as JSON (or as a
Python literal), ``null``/``None`` as null where the type is not a string. A ``</parameter>`` ends
the value only where the next parameter, ``</function>`` or the end follows it, so a value may hold
the closing tag as text.
"""

from __future__ import annotations

import ast
import json

from localllm.engine.tool_formats.calls import ParsedCall

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
FUNCTION_OPEN, FUNCTION_CLOSE = "<function=", "</function>"
PARAMETER_OPEN, PARAMETER_CLOSE = "<parameter=", "</parameter>"
XML_VALUE_END = "\n" + PARAMETER_CLOSE  # what the templates write after a value
STRING_TYPES = frozenset({"string", "str", "text", "varchar", "char", "enum"})


def param_type(schema) -> tuple[str, bool]:
    """``(type, nullable)`` of a parameter's schema as the XML format reads it: its ``type`` (the first
    that is not null of a list or an ``anyOf``), ``string`` where it names none."""
    if not isinstance(schema, dict):
        return "string", False
    kind = schema.get("type")
    if isinstance(kind, list):
        named = [str(k).lower() for k in kind]
        others = [k for k in named if k != "null"]
        return (others[0] if others else "null"), "null" in named
    if kind is not None:
        kind = str(kind).strip().lower()
        return kind, kind == "null"
    options = [o for o in schema.get("anyOf", []) if isinstance(o, dict) and "type" in o]
    types = [str(o["type"]).strip().lower() for o in options]
    others = [t for t in types if t != "null"]
    return (others[0] if others else "string"), "null" in types


def typed_value(value: str, schema) -> object:
    """A parameter's text as the value its schema types (see the module docstring)."""
    kind, nullable = param_type(schema)
    if nullable and value.lower() in ("null", "none"):
        return None
    if kind in STRING_TYPES:
        return value
    if value.lower() in ("null", "none"):
        return None
    if kind.startswith(("int", "uint", "long", "short", "unsigned")):
        try:
            return int(value)
        except ValueError:
            return value
    if kind.startswith(("num", "float")):
        try:
            number = float(value)
        except ValueError:
            return value
        return int(number) if number.is_integer() else number
    if kind in ("boolean", "bool", "binary"):
        return value.lower() == "true"
    container = kind in ("object", "array", "arr") or kind.startswith(("dict", "list"))
    if container:
        try:
            return json.loads(value)
        except ValueError:
            pass
    try:
        return ast.literal_eval(value)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return value


def _value_end(text: str, start: int) -> int:
    """Where the value that begins at ``start`` ends: the first ``</parameter>`` followed (past
    whitespace) by another parameter, ``</function>``, ``</tool_call>`` or the end; -1: none yet."""
    at = text.find(PARAMETER_CLOSE, start)
    while at >= 0:
        rest = text[at + len(PARAMETER_CLOSE):].lstrip()
        if not rest or rest.startswith((PARAMETER_OPEN, FUNCTION_CLOSE, CALL_CLOSE)):
            return at
        at = text.find(PARAMETER_CLOSE, at + 1)
    return -1


def _function(text: str, pos: int, schemas: dict) -> tuple[str, dict, int, bool] | None:
    """The function whose ``<function=`` is at ``pos``: ``(name, arguments, end, closed)``, ``end``
    past its ``</function>`` (or the text's end where it is not ``closed``); None without a name."""
    name_end = text.find(">", pos)
    if name_end < 0:
        return None
    name = text[pos + len(FUNCTION_OPEN):name_end].strip()
    if not name or any(c in name for c in "{}<>\"' \t\n"):
        return None
    properties = (schemas.get(name) or {}).get("properties") or {}
    args: dict = {}
    at = name_end + 1
    while True:
        while at < len(text) and text[at].isspace():
            at += 1
        if text.startswith(FUNCTION_CLOSE, at):
            return name, args, at + len(FUNCTION_CLOSE), True
        if not text.startswith(PARAMETER_OPEN, at):
            return name, args, len(text), False
        key_end = text.find(">", at)
        if key_end < 0:
            return name, args, len(text), False
        key = text[at + len(PARAMETER_OPEN):key_end].strip()
        start = key_end + 1
        end = _value_end(text, start)
        value = text[start:end if end >= 0 else len(text)]
        value = value.removeprefix("\n")
        value = value.removesuffix("\n")
        args[key] = typed_value(value, properties.get(key))
        if end < 0:
            return name, args, len(text), False
        at = end + len(PARAMETER_CLOSE)


def parse_xml(text: str, truncated: bool = False, schemas: dict | None = None) -> tuple[str | None, list[ParsedCall]]:
    """``(content, calls)`` of an answer: the content is what comes before the first call (the
    format allows no text after them); an unclosed call is the answer's last: kept where the model
    ended it, dropped where ``max_tokens`` cut it."""
    first = text.find(FUNCTION_OPEN)
    if first < 0:
        return text, []
    opener = text.rfind(CALL_OPEN, 0, first)
    content = text[:opener if opener >= 0 and not text[opener + len(CALL_OPEN):first].strip() else first]
    calls: list[ParsedCall] = []
    pos = first
    while pos >= 0:
        parsed = _function(text, pos, schemas or {})
        if parsed is None or (truncated and not parsed[3]):
            if truncated and calls:
                break  # the cut last call
            return text, []
        name, args, end, _ = parsed
        calls.append(ParsedCall.make(name, args))
        rest = text[end:].lstrip()
        rest = rest[len(CALL_CLOSE):].lstrip() if rest.startswith(CALL_CLOSE) else rest
        rest = rest[len(CALL_OPEN):].lstrip() if rest.startswith(CALL_OPEN) else rest
        pos = len(text) - len(rest) if rest.startswith(FUNCTION_OPEN) else -1
    return (content.strip() or None), calls
