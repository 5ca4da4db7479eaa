"""gpt-oss's harmony response format (OpenAI's ``openai-harmony``, its ``docs/format.md``), read
from the answer's text as llama.cpp reads it.

An answer is a run of messages, each ``<|start|>assistant`` HEADER ``<|message|>`` BODY ``<|end|>``;
the first one's ``<|start|>assistant`` ends the prompt, and the last one ends with a stop token
(``<|return|>``, or ``<|call|>`` after a call) that never reaches the text. The header names the
channel (``<|channel|>analysis``, ``commentary`` or ``final``) and may name a recipient
(``to=functions.NAME``, in the role part or after the channel) and the body's type
(``<|constrain|>json``, or ``json``)::

    <|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>commentary
    to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}

Where each body goes:

* ``analysis``: reasoning; where reasoning is not split off, the message as written, into content;
* ``final``, and ``commentary`` without a recipient (a preamble to calls): content;
* a recipient ``functions.NAME``: a call of NAME whose body is its JSON arguments (dropped where
  no tools were offered); other recipients, the built-in ``browser`` and ``python`` tools, are
  dropped, as llama.cpp drops them.

Bodies of the same kind from separate messages are joined by a newline, as vLLM joins them.
Nothing of a header, nor any marker, reaches reasoning or content; text with no harmony structure
at all (an answer a grammar shaped) is content.
"""

from __future__ import annotations

import json
import re

from localllm.engine.tool_formats.calls import ParsedCall, marker_start, skip_space

START, END, MESSAGE, CHANNEL, CONSTRAIN = "<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>"
STOPS = ("<|call|>", "<|return|>")  # stop tokens: in the text only where something put them there
FUNCTIONS = "functions."
_BODY_ENDS = (END, *STOPS, START)
_HEADER_OPENERS = (CHANNEL, START, " to=", "to=")
_LONGEST_OPENER = max(len(o) for o in _HEADER_OPENERS)
# Linear on any header: each quantifier's class excludes what follows it (no backtracking)
_CHANNEL = re.compile(r"<\|channel\|>\s*([^\s<]+)")
_RECIPIENT = re.compile(r"(?:^|\s)to=([^\s<]+)")


def template_is_harmony(chat_template: str) -> bool:
    """Whether a chat template writes harmony messages (gpt-oss's)."""
    return CHANNEL in chat_template


def _kind(header: str, split: bool, tools: bool) -> tuple[str, str | None]:
    """``(kind, function name)`` of a message: ``reasoning``, ``raw`` (analysis kept as written),
    ``content``, ``call`` or ``drop``."""
    channels = _CHANNEL.findall(header)
    recipients = [r for r in _RECIPIENT.findall(header) if r != "assistant"]
    if recipients:
        recipient = recipients[-1]
        if tools and recipient.startswith(FUNCTIONS) and len(recipient) > len(FUNCTIONS):
            return "call", recipient[len(FUNCTIONS):]
        return "drop", None
    if channels and channels[-1] == "analysis":
        return ("reasoning" if split else "raw"), None
    return "content", None


class HarmonyStream:
    """Reads an answer as it arrives: :meth:`feed` gives ``(reasoning, content)`` deltas, holding
    back only what may begin a marker; :meth:`finish` the rest and the calls. ``split``: analysis
    is reasoning (else kept in content as written); ``tools``: calls to ``functions.*`` are read
    (else dropped)."""

    def __init__(self, split: bool = True, tools: bool = True) -> None:
        self.split, self.tools = split, tools
        self.buffer = ""
        # in a header, how far the buffer has been read: where <|message|> may still start, and the
        # whitespace it opens with (so that a long header costs a stream linear time, not quadratic)
        self.searched = self.blank = 0
        self.state = "header"  # "header" (before <|message|>), "body", "plain" (no harmony structure)
        self.kind = ""
        self.header = ""
        self.call_name: str | None = None
        self.call_body = ""
        self.closed_calls: list[tuple[str, str]] = []
        self.written: set[str] = set()  # kinds something was written to: a later message joins by "\n"
        self.joined = False

    def _route(self, text: str, out: dict[str, str]) -> None:
        if not text:
            return
        if self.kind == "call":
            self.call_body += text
            return
        if self.kind == "drop":
            return
        where = "reasoning" if self.kind == "reasoning" else "content"
        if self.kind != "raw" and not self.joined:
            self.joined = True
            if where in self.written:
                text = "\n" + text
            self.written.add(where)
        out[where] += text

    def _open(self, header: str, out: dict[str, str]) -> None:
        self.header = header
        self.kind, self.call_name = _kind(header, self.split, self.tools)
        self.call_body, self.joined = "", False
        if self.kind == "raw":
            out["content"] += header + MESSAGE

    def _close(self, end: str, out: dict[str, str]) -> None:
        if self.kind == "call":
            self.closed_calls.append((self.call_name, self.call_body))
        elif self.kind == "raw":
            out["content"] += end
        self.kind = ""

    def feed(self, delta: str) -> tuple[str, str]:
        self.buffer += delta
        out = {"reasoning": "", "content": ""}
        while self.buffer:
            if self.state == "plain":
                out["content"] += self.buffer
                self.buffer = ""
            elif self.state == "header":
                at = self.buffer.find(MESSAGE, self.searched)
                if at >= 0:
                    header, self.buffer = self.buffer[:at], self.buffer[at + len(MESSAGE):]
                    self.searched = self.blank = 0
                    self._open(header, out)
                    self.state = "body"
                    continue
                self.searched = max(0, len(self.buffer) - len(MESSAGE) + 1)
                self.blank = skip_space(self.buffer, self.blank)
                head = self.buffer[self.blank:self.blank + _LONGEST_OPENER]  # enough to tell
                if not head or head.startswith(_HEADER_OPENERS) or any(o.startswith(head) for o in _HEADER_OPENERS):
                    break  # a header, or what may begin one: wait for its <|message|>
                self.state = "plain"
            else:
                ends = [(at, e) for e in _BODY_ENDS if (at := self.buffer.find(e)) >= 0]
                if ends:
                    at, end = min(ends)
                    self._route(self.buffer[:at], out)
                    self._close(end if end != START else "", out)
                    self.buffer = self.buffer[at + (len(end) if end != START else 0):]
                    self.searched = self.blank = 0
                    self.state = "header"
                    continue
                keep = max(marker_start(self.buffer, e) for e in _BODY_ENDS)
                self._route(self.buffer[:len(self.buffer) - keep], out)
                self.buffer = self.buffer[len(self.buffer) - keep:]
                break
        return out["reasoning"], out["content"]

    def finish(self, truncated: bool = False) -> tuple[str, str, list[ParsedCall]]:
        """``(reasoning, content, calls)`` still to send once the answer is complete; ``truncated``:
        cut by ``max_tokens``, so an open call is cut and dropped (a header cut short is dropped
        whatever ended it). A call whose arguments are not a JSON object becomes content."""
        out = {"reasoning": "", "content": ""}
        if self.state == "plain":
            out["content"] += self.buffer
        elif self.state == "body":
            self._route(self.buffer, out)
            if self.kind == "call" and not truncated:
                self._close("", out)
        self.buffer, self.state = "", "header"
        self.searched = self.blank = 0
        calls = []
        for name, body in self.closed_calls:
            try:
                args = json.loads(body, strict=False)
            except ValueError:
                args = None
            if isinstance(args, dict):
                calls.append(ParsedCall.make(name, args))
            else:
                self.kind, self.joined = "content", False
                self._route(body, out)
        self.closed_calls = []
        return out["reasoning"], out["content"], calls


def parse_harmony(text: str, split: bool = True, tools: bool = True,
                  truncated: bool = False) -> tuple[str, str, list[ParsedCall]]:
    """``(reasoning, content, calls)`` of a whole answer (see :class:`HarmonyStream`)."""
    stream = HarmonyStream(split, tools)
    reasoning, content = stream.feed(text)
    more_reasoning, more_content, calls = stream.finish(truncated)
    return reasoning + more_reasoning, content + more_content, calls
