"""A chat answer read the way its model writes it: reasoning, content and tool calls, whole or as
it streams. Every route over chat (chat completions, the Responses API, Anthropic's messages)
reads answers here.

Two ways of writing reasoning, each chosen from the chat template:

* ``<think>…</think>`` blocks (Qwen3, the DeepSeek-R1 distills; :mod:`localllm.api.reasoning`),
  before the content, whose tool calls are parsed after the block is split off
  (:mod:`localllm.api.tools`);
* harmony's channels (gpt-oss; :mod:`localllm.engine.tool_formats.harmony`): the analysis channel
  is the reasoning, the final channel (and commentary preambles) the content, messages to
  ``functions.NAME`` the calls; read in one pass.

``reasoning_format: "none"`` leaves ``<think>`` blocks in the content, and harmony's analysis
messages as written (llama.cpp's way); the rest of a harmony answer is still read.
"""

from __future__ import annotations

from dataclasses import dataclass

from localllm.api.reasoning import ReasoningStream, prompt_opens_thinking, split_reasoning, template_reasons
from localllm.api.tools import ToolStream, parse_tool_calls
from localllm.engine.tool_formats import HarmonyStream, ParsedCall
from localllm.engine.tool_formats.harmony import parse_harmony, template_is_harmony


@dataclass(frozen=True, slots=True)
class AnswerFormat:
    """How to read an answer. ``thinking``: whether reasoning is split off (None: not) and, for
    ``<think>`` blocks, whether the answer begins inside one; ``harmony``: the answer is harmony
    messages; ``tool_format``: the format of its calls (None: no tools were offered, so none are
    read); ``schemas``: the offered functions' parameter schemas by name."""

    thinking: bool | None = None
    harmony: bool = False
    tool_format: str | None = None
    schemas: dict | None = None

    @property
    def reasons(self) -> bool:
        """Whether reasoning may come before the content."""
        return self.thinking is not None


def answer_format(chat_template: str, prompt_text: str, reasoning_format: str | None = None,
                  tool_format: str | None = None, tools: list[dict] | None = None) -> AnswerFormat:
    """How to read the answer to ``prompt_text`` (the rendered chat) of a model with
    ``chat_template``; ``reasoning_format``: the request's (``auto``, ``deepseek`` or ``none``)."""
    form = reasoning_format or "auto"
    harmony = template_is_harmony(chat_template)
    if form == "none" or (form == "auto" and not harmony and not template_reasons(chat_template)):
        thinking = None
    else:
        thinking = False if harmony else prompt_opens_thinking(prompt_text)
    schemas = {t["function"]["name"]: t["function"].get("parameters") or {} for t in tools or ()} or None
    return AnswerFormat(thinking, harmony, tool_format, schemas)


def read_answer(text: str, fmt: AnswerFormat, truncated: bool = False) -> tuple[str | None, str | None,
                                                                                 list[ParsedCall]]:
    """``(reasoning or None, content, calls)`` of a whole answer; ``truncated``: cut by
    ``max_tokens`` (a call it cut is dropped). The content is None only beside calls."""
    if fmt.harmony:
        reasoning, content, calls = parse_harmony(text, fmt.reasons, fmt.tool_format is not None, truncated)
        return reasoning or None, (content or None) if calls else content, calls
    reasoning = None
    if fmt.thinking is not None:
        reasoning, text = split_reasoning(text, fmt.thinking)
    if fmt.tool_format is not None:
        content, calls = parse_tool_calls(text, fmt.tool_format, truncated, fmt.schemas)
        if calls:
            return reasoning, content, calls
    return reasoning, text, []


class AnswerStream:
    """Reads an answer as it streams: :meth:`feed` gives ``(reasoning, content)`` deltas (what may
    be a marker or a call held back), :meth:`finish` the rest and the calls."""

    def __init__(self, fmt: AnswerFormat) -> None:
        self.fmt = fmt
        self.harmony = HarmonyStream(fmt.reasons, fmt.tool_format is not None) if fmt.harmony else None
        self.thoughts = ReasoningStream(fmt.thinking) if fmt.thinking is not None and not fmt.harmony else None
        self.tools = ToolStream(fmt.tool_format, fmt.schemas) if fmt.tool_format and not fmt.harmony else None

    def feed(self, delta: str) -> tuple[str, str]:
        if self.harmony is not None:
            return self.harmony.feed(delta)
        reasoning, content = self.thoughts.feed(delta) if self.thoughts is not None else ("", delta)
        if self.tools is not None:
            content = self.tools.feed(content)  # the content only: reasoning was split off
        return reasoning, content

    def finish(self, truncated: bool = False) -> tuple[str, str, list[ParsedCall]]:
        """``(reasoning, content, calls)`` still to send once the answer is complete."""
        if self.harmony is not None:
            return self.harmony.finish(truncated)
        reasoning, content = self.thoughts.finish() if self.thoughts is not None else ("", "")
        calls: list[ParsedCall] = []
        if self.tools is not None:
            content = self.tools.feed(content)
            rest, calls = self.tools.finish(truncated)
            content += rest
        return reasoning, content, calls
