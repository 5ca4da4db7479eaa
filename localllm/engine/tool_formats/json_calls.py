"""The formats whose calls carry their arguments as JSON: hermes, llama3 and Mistral's two.

Each parser takes ``(answer, truncated, schemas)`` and gives ``(content, calls)``: text that does not
parse as calls stays content; ``truncated`` (the answer was cut by ``max_tokens``) drops a last
call that does not parse and keeps the complete ones before it. ``schemas`` (the offered functions'
parameters) is for the formats that type their values by it; JSON carries its own types.

Answers are model output, which a client can steer: every parser here scans with ``str.find`` and
``json``'s decoder, linear in the answer's length (no backtracking regular expression).
"""

from __future__ import annotations

import json

from localllm.engine.tool_formats.calls import ParsedCall, call_from, marker_start, short_id

MISTRAL_ID_LENGTH = 9  # mistral-common's check: ids of 9 letters and digits

HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"


def _hermes_blocks(text: str) -> tuple[list[tuple[str, bool]], str]:
    """``([(body, closed), ...], the text outside the blocks)``: each block runs from a
    ``<tool_call>`` to the first ``</tool_call>`` after it, or to the end where none follows."""
    blocks, outside, pos = [], [], 0
    at = text.find(HERMES_OPEN)
    while at >= 0:
        outside.append(text[pos:at])
        start = at + len(HERMES_OPEN)
        close = text.find(HERMES_CLOSE, start)
        if close < 0:
            blocks.append((text[start:], False))
            pos = len(text)
            break
        blocks.append((text[start:close], True))
        pos = close + len(HERMES_CLOSE)
        at = text.find(HERMES_OPEN, pos)
    outside.append(text[pos:])
    return blocks, "".join(outside)


def parse_hermes(text: str, truncated: bool = False, schemas=None) -> tuple[str | None, list[ParsedCall]]:
    if HERMES_OPEN not in text:
        return text, []
    calls = []
    blocks, content = _hermes_blocks(text)
    for i, (body, closed) in enumerate(blocks):
        try:
            call = call_from(json.loads(body.strip(), strict=False))
        except ValueError:
            call = None
        if call is None:
            if truncated and calls and i == len(blocks) - 1 and not closed:
                break  # the cut last call
            return text, []
        calls.append(call)
    content = content.strip()
    if truncated:  # cut inside the next call's marker: that is no content either
        content = content[:len(content) - marker_start(content, HERMES_OPEN)].strip()
    return (content or None), calls


def parse_llama3(text: str, truncated: bool = False, schemas=None) -> tuple[str | None, list[ParsedCall]]:
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
        call = call_from(obj, "parameters")
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


def parse_mistral(text: str, truncated: bool = False, schemas=None) -> tuple[str | None, list[ParsedCall]]:
    """Mistral's tokenizers before v11: ``[TOOL_CALLS][{"name": ..., "arguments": {...}, "id": ...}, ...]``."""
    if "[TOOL_CALLS]" not in text:
        return text, []
    before, _, after = text.partition("[TOOL_CALLS]")
    try:
        obj, _ = json.JSONDecoder(strict=False).raw_decode(after.strip())  # what follows the array is not read
    except ValueError:
        obj = _complete_items(after.strip()) if truncated else None
        if not obj:
            return text, []
    items = obj if isinstance(obj, list) else [obj]
    calls = [call_from(o, id_length=MISTRAL_ID_LENGTH) for o in items]
    if not calls or any(c is None for c in calls):
        return text, []
    return (before.strip() or None), calls


def parse_mistral_v11(text: str, truncated: bool = False, schemas=None) -> tuple[str | None, list[ParsedCall]]:
    """Mistral's tokenizers from v11 (Mistral Small 3.2, Magistral, Devstral, Ministral 3): one
    ``[TOOL_CALLS]NAME[ARGS]{...}`` per call, ``[CALL_ID]ID`` before ``[ARGS]`` where the model
    writes its call's id (Mistral Small 3.2)."""
    if "[TOOL_CALLS]" not in text:
        return text, []
    content, *raw_calls = text.split("[TOOL_CALLS]")
    decoder = json.JSONDecoder(strict=False)
    calls = []
    for i, raw in enumerate(raw_calls):
        call = None
        brace = raw.find("{")
        if brace > 0:
            head, body = raw[:brace], raw[brace:]
            name, _, call_id = head.replace("[ARGS]", "").partition("[CALL_ID]")
            name, call_id = name.strip(), call_id.strip()
            try:
                args, end = decoder.raw_decode(body)
            except ValueError:
                args, end = None, 0
            valid_id = len(call_id) == MISTRAL_ID_LENGTH and call_id.isalnum()
            if isinstance(args, dict) and name and not body[end:].strip():
                call = ParsedCall.make(name, args, call_id if valid_id else short_id(MISTRAL_ID_LENGTH))
        if call is None:
            if truncated and calls and i == len(raw_calls) - 1:
                break  # the cut last call
            return text, []
        calls.append(call)
    return (content.strip() or None), calls
