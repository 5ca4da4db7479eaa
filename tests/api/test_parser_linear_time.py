"""Answers are model output, which a client can steer: reading one (tool calls, ``<think>`` blocks,
harmony's channels), whole or streamed, takes time linear in its length. Hostile answers of 64k
characters (whitespace runs between markers, markers repeated) are read in well under a second;
the bound asserted is a generous regression guard, not a benchmark. Ordinary answers read as before."""

from __future__ import annotations

import json
import random
import re
import time

import pytest

from localllm.api.answers import AnswerFormat, AnswerStream, read_answer
from localllm.api.tools import parse_tool_calls
from localllm.engine.tool_formats import TOOL_FORMATS
from localllm.engine.tool_formats.calls import call_from, marker_start
from localllm.engine.tool_formats.json_calls import parse_hermes

N = 65536
BOUND_S = 2.0
WS = " " * N

HOSTILE = {
    "whitespace between a marker and text": "<tool_call>x" + WS + "x",
    "newlines between a marker and text": "<tool_call>x" + "\n" * N + "x",
    "whitespace after a marker": "<tool_call>" + WS,
    "whitespace then text after a marker": "<tool_call>" + WS + "x",
    "closes and whitespace": "<tool_call>{" + WS + "</tool_call>" * 100 + WS,
    "markers repeated": "<tool_call>" * (N // 11),
    "whitespace only": WS,
    "think then whitespace": "<think>" + WS + "x",
    "xml parameters repeated": "<function=f>\n<parameter=a>\n" + "</parameter>x" * (N // 13),
    "mistral markers repeated": "[TOOL_CALLS]" * (N // 12),
    "json opened": "{" + WS + "x",
    "harmony channel and whitespace": "<|channel|>" + WS + "x<|message|>" + WS,
    "harmony recipients repeated": "<|channel|>commentary" + " to=" * (N // 4) + "<|message|>{}",
    "harmony channels repeated": "<|channel|>" * (N // 11) + "<|message|>",
}


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


@pytest.mark.parametrize("fmt", list(TOOL_FORMATS))
@pytest.mark.parametrize("name", list(HOSTILE))
def test_a_hostile_answer_parses_in_linear_time(fmt, name):
    text = HOSTILE[name]
    elapsed = _timed(lambda: (parse_tool_calls(text, fmt, False, {}), parse_tool_calls(text, fmt, True, {})))
    assert elapsed < BOUND_S, f"{fmt}, {name}: {elapsed:.2f} s"


@pytest.mark.parametrize("harmony", [False, True])
@pytest.mark.parametrize("name", ["whitespace only", "whitespace between a marker and text",
                                  "think then whitespace", "harmony channel and whitespace",
                                  "harmony recipients repeated"])
def test_a_hostile_answer_streams_in_linear_time(harmony, name):
    text = HOSTILE[name]
    fmt = AnswerFormat(thinking=False, harmony=harmony, tool_format="harmony" if harmony else "hermes", schemas={})

    def stream():
        reader = AnswerStream(fmt)
        for i in range(0, len(text), 2):  # two characters a token: the most deltas a stream has
            reader.feed(text[i:i + 2])
        reader.finish()
        read_answer(text, fmt)

    elapsed = _timed(stream)
    assert elapsed < BOUND_S, f"{name}: {elapsed:.2f} s"


# ---------------------------------------------------------------- ordinary answers read as before

_OLD_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


def _regex_hermes(text: str, truncated: bool):
    """The hermes parser as a backtracking regular expression had it (quadratic on hostile text)."""
    if "<tool_call>" not in text:
        return text, []
    calls = []
    blocks = list(_OLD_BLOCK.finditer(text))
    for i, block in enumerate(blocks):
        try:
            call = call_from(json.loads(block.group(1), strict=False))
        except ValueError:
            call = None
        if call is None:
            if truncated and calls and i == len(blocks) - 1 and not block.group(0).rstrip().endswith("</tool_call>"):
                break
            return text, []
        calls.append(call)
    content = _OLD_BLOCK.sub("", text).strip()
    if truncated:
        content = content[:len(content) - marker_start(content, "<tool_call>")].strip()
    return (content or None), calls


def _shape(parsed):
    content, calls = parsed
    return content, [(c.name, json.loads(c.arguments)) for c in calls]


PIECES = ["<tool_call>", "</tool_call>", '{"name": "get", "arguments": {"city": "Paris"}}', '{"name": "f"',
          " ", "\n", "\t", "text", "<tool_", "{}", '{"name": "g", "arguments": "{\\"a\\": 1}"}', "\u00a0"]


def test_hermes_answers_parse_as_the_regular_expression_parsed_them():
    rng = random.Random(1)
    samples = [
        'Let me look.\n<tool_call>\n{"name": "get", "arguments": {"city": "Paris"}}\n</tool_call>',
        '<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>\n<tool_call>\n{"name": "b", "arguments": {}}\n',
        '<tool_call>{"name": "a", "arguments": {}}</tool_call> after <tool_call>{"name": "b", "argu',
        "no calls at all",
        "<tool_call>not json</tool_call>",
    ]
    samples += ["".join(rng.choice(PIECES) for _ in range(rng.randint(1, 12))) for _ in range(3000)]
    for text in samples:
        for truncated in (False, True):
            assert _shape(parse_hermes(text, truncated)) == _shape(_regex_hermes(text, truncated)), (text, truncated)
